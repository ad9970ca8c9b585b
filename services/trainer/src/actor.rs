//! The models and their optimisation, on a dedicated thread (libtorch stays off the async reactor).
//!
//! Roles, as verl's `need_reference_policy` / `need_critic`:
//! - the actor (policy), always;
//! - a frozen reference policy (the initial weights) when `actor.use_kl_loss` or `algorithm.use_kl_in_reward`;
//! - a critic ([`crate::critic`]) when `critic.enable`, by default exactly for `gae`.
//!
//! [`Actor::train`] is one training step over a batch of scored trajectories, verl's `_step_once` after
//! sampling: old log-probs (π_old, temperature-scaled) → reference log-probs → values → token rewards (minus
//! the in-reward KL) → rollout correction → advantages → critic update → actor update. Each update is
//! `ppo_epochs` passes over mini-batches of `ppo_mini_batch_size` prompt groups (seeded shuffle), each split
//! into micro-batches that fit `ppo_max_token_len` tokens, with gradients accumulated and the loss normalised
//! over the whole mini-batch (so the split does not change the gradient), global-norm clipping and AdamW.
//! The LR schedules step once per [`Actor::train`] call, as verl's `update_actor` calls do: once per global step
//! in sync and colocate_async, once per local update in separate_async (whose horizon is therefore
//! `total_training_steps × parameter_sync_step`).
//!
//! separate_async is decoupled PPO: the `parameter_sync_step` local updates of one global step all take π_old
//! from the policy as it was at the start of the step ([`OldPolicy::CycleStart`]), kept as a copy of the weights
//! ([`Actor::snapshot`]), while the rollout-correction weights come from the behaviour log-probs the trajectories
//! carry.
//!
//! Everything random in a step draws from seeds derived from (`run.seed`, step), so a resumed run repeats an
//! uninterrupted one exactly: the checkpoint holds no opaque generator state.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
// tokio's `Instant`, as [`StepTimings`] takes it: nothing pauses the clock here, so it reads std's
use tokio::time::Instant;

use jetrl_algos::{
    agg_loss, apply_kl_penalty, compute_actor_loss, compute_advantage, compute_rollout_correction, entropy_from_logits,
    logprobs_from_logits, pf_ppo_resample, sum_pi_squared_from_logits, ActorLossInputs, ActorLossParams,
    AdvantageConfig, AdvantageEstimator, AdvantageInputs, GlobalBatchInfo, KlController, KlPenalty, PfPpoReweight,
    PolicyLossInputs, RolloutCorrectionParams,
};
use jetrl_config::{JobConfig, ModelDtype};
use jetrl_model::{CausalLm, Checkpoints, DType};
use tch::{Device, Kind, Tensor};
use tokio::sync::oneshot;

use crate::batch::{gather_rows, mini_batches, to_host, MicroBatch};
pub use crate::batch::{RankBatch, RowInfo, Sample};
use crate::checkpoint;
use crate::critic::{Critic, ValueTargets};
use crate::dist::Comm;
use crate::optim::{AdamW, LrSchedule};
use crate::ranks::{Command, Leader};
use crate::step_metrics::{Phase, StepTimings};

pub use crate::checkpoint::ActorState;
pub use crate::error::ActorError;

/// Training settings, resolved from the job config once.
#[derive(Debug, Clone)]
struct Settings {
    /// prompt groups per optimizer update (0 = the whole batch)
    mini_batch_groups: usize,
    epochs: u32,
    max_token_len: usize,
    shuffle: bool,
    shuffle_seed: u64,
    grad_clip: f64,
    /// the rollout temperature: log-probs are recomputed on logits / T, as the rollout sampled them
    temperature: f64,
    /// the actor is updated only from this step on (verl `critic_warmup`)
    critic_warmup: u64,
    run_seed: u64,
    calculate_sum_pi_squared: bool,
    /// compute the entropy in the update (`actor.calculate_entropy`, or an entropy bonus): its aggregate is
    /// reported as `actor/entropy`, replacing the old-log-prob pass's, as verl does
    calculate_entropy: bool,
    /// reuse the rollout log-probs as π_old (`rollout_correction.bypass_mode`)
    bypass_old_log_prob: bool,
    /// recompute the decoder layers' activations in the backward pass (`model.enable_gradient_checkpointing`)
    gradient_checkpointing: bool,
    /// forward passes on micro-batches packed without padding (`model.use_remove_padding`)
    remove_padding: bool,
}

/// The result of one [`Actor::train`]: verl-named metrics and the phase timings (`timing_s/<phase>`).
#[derive(Debug, Clone, Default)]
pub struct TrainOutput {
    pub metrics: BTreeMap<String, f64>,
    pub timings: StepTimings,
}

/// Which weights give π_old, the log-probs the PPO ratio is taken against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldPolicy {
    /// the policy as it is now (sync, colocate_async: one update call per batch)
    Current,
    /// the copy taken by the last [`Actor::snapshot`] (separate_async: the policy at the start of the global
    /// step, for every local update of it)
    CycleStart,
}

/// Per-row log-probs, and the entropy and Σπ² when asked, as `[rows, width]` host matrices.
type ScoredRows = (Vec<f32>, Option<Vec<f32>>, Option<Vec<f32>>);

/// Per-token columns of the whole batch as `[rows, width]` host matrices.
struct Columns {
    width: usize,
    /// the response mask after rollout rejection
    mask: Vec<f32>,
    old_log_probs: Vec<f32>,
    ref_log_probs: Option<Vec<f32>>,
    advantages: Vec<f32>,
    is_weights: Option<Vec<f32>>,
}

pub struct Actor {
    model: CausalLm,
    /// π_old of decoupled PPO: the weights at the start of the current global step (separate_async), loaded
    /// on first use
    cycle_start: Option<CausalLm>,
    /// π_old of decoupled PPO with LoRA: the adapter tensors at the start of the current global step
    lora_snapshot: Option<Vec<Tensor>>,
    optim: AdamW,
    schedule: LrSchedule,
    reference: Option<CausalLm>,
    /// the reference policy is the model with its LoRA adapters off (`model.lora_rank` with a KL term)
    reference_is_base: bool,
    critic: Option<Critic>,
    kl_ctrl: Option<KlController>,
    kl_penalty: KlPenalty,
    loss: ActorLossParams,
    correction: Option<RolloutCorrectionParams>,
    estimator: AdvantageEstimator,
    advantage: AdvantageConfig,
    pf_ppo: Option<PfPpoReweight>,
    settings: Settings,
    actor_updates: u64,
    model_dir: PathBuf,
    /// the dtype weights are shipped to rollout workers in (`model.dtype`)
    ship_dtype: DType,
    pad_id: i64,
    /// the trainer's ranks: each holds the whole model, its shard of the optimizer state, and a share of every
    /// batch's rows
    comm: Comm,
    /// rank 0's commands to the other ranks (unused on the others)
    leader: Leader,
}

/// The torch seed of a training step: a pure function of the run seed and the step.
fn step_seed(run_seed: u64, step: u64) -> i64 {
    (run_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ step.wrapping_mul(0xbf58_476d_1ce4_e5b9)) as i64 & i64::MAX
}

/// The device and precision the trainer computes in: the configured ones on CUDA (bf16 weights, fp32 master
/// copies in the optimizer); always f32 on the CPU, where bf16 matmuls are slow and master copies would only
/// double the memory.
pub fn compute_dtype(cfg: &JobConfig) -> Result<(Device, DType), ActorError> {
    let device = jetrl_model::resolve_device(cfg.model.device)?;
    let requested = DType::from(cfg.model.dtype);
    Ok((device, if device == Device::Cpu { DType::F32 } else { requested }))
}

impl Actor {
    /// Loads the models. `total_steps` is the LR schedules' horizon; `resume` a checkpoint directory
    /// (`global_step_<n>`) and the actor state saved with it; `comm` this rank's place among the trainer's ranks
    /// (every rank builds its actor at the same time: loading the optimizer state is a collective).
    pub fn new(
        cfg: &JobConfig,
        total_steps: u64,
        resume: Option<(&Path, &ActorState)>,
        comm: Comm,
    ) -> Result<Self, ActorError> {
        let (device, dtype) = compute_dtype(cfg)?;
        if device == Device::Cpu && cfg.model.dtype != ModelDtype::F32 {
            tracing::info!(dtype = %cfg.model.dtype, "training in f32 on the CPU; weights are shipped as {}", cfg.model.dtype);
        }
        tch::manual_seed(cfg.run.seed as i64);
        let model_dir = PathBuf::from(&cfg.model.path);
        let lora = cfg.model.lora_rank > 0;
        let model = if lora {
            // the frozen base from model.path; the adapter from the checkpoint, lora_adapter_path or new
            let mut model = CausalLm::load(&model_dir, device, dtype)?;
            match resume {
                Some((dir, _)) => {
                    let adapter = dir.join("actor").join(checkpoint::LORA_ADAPTER_DIR);
                    model.load_lora(&adapter)?;
                }
                None => model.attach_configured_lora(&cfg.model, cfg.run.seed)?,
            }
            model
        } else {
            let source = resume.map(|(dir, _)| dir.join("actor")).unwrap_or_else(|| model_dir.clone());
            CausalLm::load(&source, device, dtype)?
        };
        if let Some((spec, modules)) = model.lora_spec() {
            tracing::info!(rank = spec.rank, alpha = spec.alpha, modules = modules.len(), "training a LoRA adapter");
        }
        let params: Vec<(String, Tensor)> = model.trainable_parameters().into_iter().collect();
        let mut optim = AdamW::sharded(params, &cfg.actor.optim, comm.clone())?;
        if let Some((dir, _)) = resume {
            checkpoint::load_optimizer(&dir.join("actor"), &mut optim)?;
        }
        let use_kl_in_reward = cfg.algorithm.use_kl_in_reward;
        let reference_is_base = lora && (cfg.actor.use_kl_loss || use_kl_in_reward);
        let reference = if !lora && (cfg.actor.use_kl_loss || use_kl_in_reward) {
            let mut reference = CausalLm::load(&model_dir, device, dtype)?;
            reference.var_store_mut().freeze();
            Some(reference)
        } else {
            None
        };
        let critic = if cfg.critic.is_enabled(&cfg.algorithm) {
            Some(Critic::new(cfg, total_steps, device, dtype, resume.map(|(dir, _)| dir), comm.clone())?)
        } else {
            None
        };
        let bypass = cfg.algorithm.rollout_correction.as_ref().is_some_and(|rc| rc.bypass_mode);
        let correction = match &cfg.algorithm.rollout_correction {
            Some(rc) if !rc.bypass_mode => Some(RolloutCorrectionParams::from_config(rc)?),
            _ => None,
        };
        let estimator = cfg.algorithm.adv_estimator;
        let pf_ppo = (cfg.algorithm.use_pf_ppo && estimator == AdvantageEstimator::Gae)
            .then(|| PfPpoReweight::from_config(&cfg.algorithm.pf_ppo));
        let temperature = f64::from(cfg.rollout.temperature);
        let mut actor = Self {
            model,
            cycle_start: None,
            lora_snapshot: None,
            optim,
            schedule: LrSchedule::new(&cfg.actor.optim, total_steps),
            reference,
            reference_is_base,
            critic,
            kl_ctrl: use_kl_in_reward.then(|| KlController::from_config(&cfg.algorithm.kl_ctrl)).transpose()?,
            kl_penalty: cfg.algorithm.kl_penalty,
            loss: ActorLossParams::from_config(&cfg.actor, cfg.algorithm.rollout_correction.as_ref())?,
            correction,
            estimator,
            advantage: AdvantageConfig::from_config(&cfg.algorithm),
            pf_ppo,
            settings: Settings {
                mini_batch_groups: cfg.actor.ppo_mini_batch_size.unwrap_or(0) as usize,
                epochs: cfg.actor.ppo_epochs.max(1),
                max_token_len: cfg.actor.ppo_max_token_len.max(1) as usize,
                shuffle: cfg.actor.shuffle,
                shuffle_seed: cfg.actor.data_loader_seed,
                grad_clip: cfg.actor.grad_clip,
                temperature: if temperature > 0.0 { temperature } else { 1.0 },
                critic_warmup: cfg.trainer.critic_warmup,
                run_seed: cfg.run.seed,
                calculate_sum_pi_squared: cfg.actor.calculate_sum_pi_squared || estimator.needs_sum_pi_squared(),
                calculate_entropy: cfg.actor.calculate_entropy || cfg.actor.entropy_coeff != 0.0,
                bypass_old_log_prob: bypass,
                gradient_checkpointing: cfg.model.enable_gradient_checkpointing,
                remove_padding: cfg.model.use_remove_padding,
            },
            actor_updates: 0,
            model_dir,
            ship_dtype: DType::from(cfg.model.dtype),
            pad_id: 0,
            leader: Leader::new(comm.clone()),
            comm,
        };
        if let Some((_, state)) = resume {
            actor.actor_updates = state.actor_updates;
            if let Some(critic) = actor.critic.as_mut() {
                critic.updates = state.critic_updates;
            }
            if state.kl_ctrl.is_some() && actor.kl_ctrl.is_some() {
                actor.kl_ctrl = state.kl_ctrl.clone();
            }
        }
        Ok(actor)
    }

    /// The id written into padding positions (any id works: padding is masked; the tokenizer's pad id keeps
    /// embeddings of padding finite and familiar).
    pub fn set_pad_id(&mut self, pad_id: u32) {
        self.pad_id = i64::from(pad_id);
        if let Some(critic) = self.critic.as_mut() {
            critic.set_pad_id(i64::from(pad_id));
        }
    }

    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    pub fn has_critic(&self) -> bool {
        self.critic.is_some()
    }

    pub fn has_reference(&self) -> bool {
        self.reference.is_some() || self.reference_is_base
    }

    /// The state to save with a checkpoint.
    pub fn state(&self) -> ActorState {
        ActorState {
            actor_updates: self.actor_updates,
            critic_updates: self.critic.as_ref().map_or(0, |c| c.updates),
            kl_ctrl: self.kl_ctrl.clone(),
        }
    }

    /// What rollout workers load: the weights as a safetensors blob in `model.dtype`, or with LoRA the
    /// adapter tensors only (f32; workers keep the base and merge them in).
    pub fn weights_blob(&self) -> Result<Vec<u8>, ActorError> {
        if self.model.lora_spec().is_some() {
            return Ok(self.model.lora_to_safetensors_bytes()?);
        }
        Ok(self.model.to_safetensors_bytes_as(self.ship_dtype)?)
    }

    /// Writes `actor/` (and `critic/`) of a checkpoint into `dir` and returns the state to save with them.
    /// Every rank writes its optimizer shards; rank 0 also the models (every rank holds the same weights).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<ActorState, ActorError> {
        let actor_dir = dir.join("actor");
        let (rank, world) = (self.comm.rank(), self.comm.world());
        if rank == 0 {
            if self.model.lora_spec().is_some() {
                // PEFT's layout; the base is model.path, named in the adapter's config as the user gave it
                let adapter = actor_dir.join(checkpoint::LORA_ADAPTER_DIR);
                self.model.save_lora(&adapter, &self.model_dir.display().to_string())?;
            } else {
                self.model.save(&actor_dir)?;
                checkpoint::copy_model_side_files(&self.model_dir, &actor_dir)?;
            }
        }
        checkpoint::save_optimizer(&actor_dir, &self.optim, rank, world)?;
        if let Some(critic) = &self.critic {
            critic.save(&dir.join(checkpoint::CRITIC_DIR), &self.model_dir)?;
        }
        Ok(self.state())
    }

    /// This rank's place among the trainer's ranks.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Rank 0: tells every other rank to do what this rank is about to do (nothing with one rank).
    pub fn lead(&mut self, command: &Command) -> Result<(), ActorError> {
        self.leader.send(command)
    }

    /// Bytes of optimizer state this rank holds (the actor's and the critic's).
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.optim.state_bytes() + self.critic.as_ref().map_or(0, |c| c.optimizer_state_bytes())
    }

    /// Response-position logits, f32, divided by the rollout temperature: `[n, r, V]` for a padded micro-batch,
    /// `[T, V]` for a packed one (its response tokens end to end; [`MicroBatch::to_rows`] brings per-token values
    /// back to `[n, r]`). With `checkpointing` (an update with `model.enable_gradient_checkpointing`) the decoder
    /// layers keep no activations and the returned checkpoints must be back-propagated
    /// ([`CausalLm::backward_checkpointed`]) right after the loss's backward pass.
    fn response_logits(
        model: &CausalLm,
        mb: &MicroBatch,
        temperature: f64,
        checkpointing: bool,
    ) -> Result<(Tensor, Option<Checkpoints>), ActorError> {
        let (hidden, checkpoints) = mb.response_hidden(model, checkpointing)?;
        let logits = model.lm_head(&hidden)?;
        let logits = if temperature != 1.0 { logits.f_div_scalar(temperature)? } else { logits };
        Ok((logits, checkpoints))
    }

    /// Log-probs of every row's response under `model` without autograd, as `[rows, width]` host matrices of the
    /// whole batch, with the per-token entropy and Σπ² when asked: each rank scores the rows it holds, and the
    /// matrices are summed over the ranks (each row is held by one).
    fn score_rows(
        &self,
        model: &CausalLm,
        batch: &RankBatch,
        width: usize,
        entropy: bool,
        sum_pi_squared: bool,
    ) -> Result<ScoredRows, ActorError> {
        let n = batch.len();
        let mut lp = vec![0f32; n * width];
        let mut ent = entropy.then(|| vec![0f32; n * width]);
        let mut spsq = sum_pi_squared.then(|| vec![0f32; n * width]);
        let copy = |dst: &mut [f32], src: &[f32], chunk: &[usize], r: usize| {
            for (k, &row) in chunk.iter().enumerate() {
                let len = batch.rows[row].response_len;
                dst[row * width..row * width + len].copy_from_slice(&src[k * r..k * r + len]);
            }
        };
        tch::no_grad(|| -> Result<(), ActorError> {
            for chunk in batch.local_micro_batches(&batch.local_rows(), self.settings.max_token_len) {
                let refs = batch.samples(&chunk);
                let mb = MicroBatch::build_for(&refs, self.pad_id, model.device(), self.settings.remove_padding)?;
                let (logits, _) = Self::response_logits(model, &mb, self.settings.temperature, false)?;
                let r = mb.r as usize;
                let rows = |values: Tensor| -> Result<Vec<f32>, tch::TchError> { to_host(&mb.to_rows(&values)?) };
                copy(&mut lp, &rows(logprobs_from_logits(&logits, mb.scored_ids()))?, &chunk, r);
                if let Some(ent) = ent.as_mut() {
                    copy(ent, &rows(entropy_from_logits(&logits))?, &chunk, r);
                }
                if let Some(spsq) = spsq.as_mut() {
                    copy(spsq, &rows(sum_pi_squared_from_logits(&logits))?, &chunk, r);
                }
            }
            Ok(())
        })?;
        let device = model.device();
        self.comm.all_reduce_f32(&mut lp, device)?;
        if let Some(ent) = ent.as_mut() {
            self.comm.all_reduce_f32(ent, device)?;
        }
        if let Some(spsq) = spsq.as_mut() {
            self.comm.all_reduce_f32(spsq, device)?;
        }
        Ok((lp, ent, spsq))
    }

    /// A `[rows, width]` host matrix of the whole batch from a per-token column of the rows this rank holds
    /// (summed over the ranks).
    fn held_matrix(
        &self,
        batch: &RankBatch,
        width: usize,
        column: impl Fn(&Sample, usize) -> f32,
    ) -> Result<Vec<f32>, ActorError> {
        let mut m = vec![0f32; batch.len() * width];
        for (&i, s) in &batch.local {
            for j in 0..s.response.len() {
                m[i * width + j] = column(s, j);
            }
        }
        self.comm.all_reduce_f32(&mut m, self.model.device())?;
        Ok(m)
    }

    /// Copies the current weights as π_old for the local updates that follow (separate_async, at the start of
    /// every global step).
    pub fn snapshot(&mut self) -> Result<(), ActorError> {
        if self.model.lora_spec().is_some() {
            // the adapters are all that changes: keep a copy of them, not a second model
            let copies = tch::no_grad(|| -> Result<Vec<Tensor>, tch::TchError> {
                self.model.lora_parameters().values().map(|t| t.f_detach_copy()).collect()
            })?;
            self.lora_snapshot = Some(copies);
            return Ok(());
        }
        if self.cycle_start.is_none() {
            let mut copy = CausalLm::load(&self.model_dir, self.model.device(), self.model.dtype())?;
            copy.var_store_mut().freeze();
            self.cycle_start = Some(copy);
        }
        let copy = self.cycle_start.as_mut().ok_or(ActorError::Stopped)?;
        tch::no_grad(|| copy.var_store_mut().copy(self.model.var_store()))?;
        Ok(())
    }

    /// Runs `f` with the adapters of the last [`Self::snapshot`] in the model (π_old of a LoRA run), then puts
    /// the current ones back.
    fn with_snapshot_adapters<T>(&mut self, f: impl FnOnce(&Self) -> Result<T, ActorError>) -> Result<T, ActorError> {
        let snapshot = self.lora_snapshot.as_ref().ok_or(ActorError::Stopped)?;
        let params: Vec<Tensor> = self.model.lora_parameters().into_values().collect();
        let swap = |from: &[Tensor]| -> Result<Vec<Tensor>, tch::TchError> {
            tch::no_grad(|| {
                let mut old = Vec::with_capacity(params.len());
                for (p, s) in params.iter().zip(from) {
                    old.push(p.f_detach_copy()?);
                    p.shallow_clone().f_copy_(s)?;
                }
                Ok(old)
            })
        };
        let current = swap(snapshot)?;
        let result = f(self);
        swap(&current)?;
        result
    }

    /// One training step on `batch` (the global step `step`) with π_old from `old`: old, reference and value
    /// passes, advantages, critic and actor updates. Returns verl-named metrics and timings. With several ranks,
    /// every rank calls it at once with the same rows (each holding its share of the payloads); the metrics are
    /// those of the whole batch on every rank.
    pub fn train(&mut self, batch: &RankBatch, step: u64, pi_old: OldPolicy) -> Result<TrainOutput, ActorError> {
        if batch.is_empty() {
            return Err(ActorError::Batch("no trajectories to train on".into()));
        }
        tch::manual_seed(step_seed(self.settings.run_seed, step));
        let mut out = TrainOutput::default();
        let mut batch = std::borrow::Cow::Borrowed(batch);
        let n = batch.len();
        let width = batch.width();
        let matrix = |f: &dyn Fn(&RowInfo, usize) -> f32, rows: &[RowInfo]| -> Vec<f32> {
            let mut m = vec![0f32; rows.len() * width];
            for (i, row) in rows.iter().enumerate() {
                for j in 0..row.response_len {
                    m[i * width + j] = f(row, j);
                }
            }
            m
        };
        let mask = self.held_matrix(&batch, width, |s, j| f32::from(s.response_mask.get(j).copied().unwrap_or(1)))?;
        let rollout = self.held_matrix(&batch, width, |s, j| s.rollout_logprobs.get(j).copied().unwrap_or(0.0))?;
        let host_tensor = |m: &[f32], rows: usize| -> Result<Tensor, tch::TchError> {
            Tensor::f_from_slice(m)?.f_view([rows as i64, width as i64])
        };
        let mask_t = host_tensor(&mask, n)?;
        let agg = self.loss.policy.loss_agg_mode;
        let full_batch = GlobalBatchInfo {
            dp_size: 1,
            batch_num_tokens: Some(mask.iter().map(|&m| f64::from(m)).sum::<f64>().max(1.0)),
            global_batch_size: Some(n as f64),
            loss_scale_factor: None,
        };

        // π_old: recomputed with the current weights, or the rollout's own in bypass mode
        let t = Instant::now();
        let (old, spsq) = if self.settings.bypass_old_log_prob {
            (rollout.clone(), None)
        } else {
            let (old, entropy, spsq) = match pi_old {
                OldPolicy::CycleStart if self.lora_snapshot.is_some() => self.with_snapshot_adapters(|actor| {
                    actor.score_rows(&actor.model, &batch, width, true, actor.settings.calculate_sum_pi_squared)
                })?,
                OldPolicy::Current => {
                    self.score_rows(&self.model, &batch, width, true, self.settings.calculate_sum_pi_squared)?
                }
                OldPolicy::CycleStart => {
                    let policy = self.cycle_start.as_ref().ok_or_else(|| {
                        ActorError::Batch("π_old of the cycle start was asked for before any snapshot".into())
                    })?;
                    self.score_rows(policy, &batch, width, true, self.settings.calculate_sum_pi_squared)?
                }
            };
            if let Some(entropy) = entropy {
                let value = agg_loss(&host_tensor(&entropy, n)?, &mask_t, agg, &full_batch)?;
                out.metrics.insert("actor/entropy".into(), f64::try_from(value)?);
            }
            rollout_probs_diff(&batch.rows, &rollout, &old, &mask, width, &mut out.metrics);
            (old, spsq)
        };
        out.timings.since(Phase::OldLogProb, t);

        let t = Instant::now();
        let reference = match &self.reference {
            Some(model) => Some(self.score_rows(model, &batch, width, false, false)?.0),
            None if self.reference_is_base => {
                self.model.set_lora_enabled(false);
                let scored = self.score_rows(&self.model, &batch, width, false, false);
                self.model.set_lora_enabled(true);
                Some(scored?.0)
            }
            None => None,
        };
        if reference.is_some() {
            out.timings.since(Phase::Ref, t);
        }
        let t = Instant::now();
        let mut values = match &self.critic {
            Some(critic) => {
                let mut values = critic.values(&batch, width)?;
                self.comm.all_reduce_f32(&mut values, self.model.device())?;
                Some(values)
            }
            None => None,
        };
        if values.is_some() {
            out.timings.since(Phase::Values, t);
        }

        // token rewards: the score on the last response token, minus β·KL(π_old‖π_ref) when in the reward
        let t = Instant::now();
        let scores = matrix(&|r, j| if j + 1 == r.response_len { r.score as f32 } else { 0.0 }, &batch.rows);
        let scores_t = host_tensor(&scores, n)?;
        let old_t = host_tensor(&old, n)?;
        let rewards_t = match (self.kl_ctrl.as_mut(), &reference) {
            (Some(ctrl), Some(reference)) => {
                let ref_t = host_tensor(reference, n)?;
                let (rewards, kl) = apply_kl_penalty(&scores_t, &old_t, &ref_t, &mask_t, self.kl_penalty, ctrl)?;
                out.metrics.insert("actor/reward_kl_penalty".into(), kl.current_kl);
                out.metrics.insert("actor/reward_kl_penalty_coeff".into(), kl.coefficient);
                rewards
            }
            _ => scores_t.shallow_clone(),
        };
        let (mask_t, is_weights) = match &self.correction {
            Some(params) => {
                let rc = compute_rollout_correction(&old_t, &host_tensor(&rollout, n)?, &mask_t, params)?;
                out.metrics.extend(rc.metrics);
                (rc.response_mask.f_to_kind(Kind::Float)?, rc.weights)
            }
            None => (mask_t, None),
        };
        let uids: Vec<String> = batch.rows.iter().map(|r| r.uid.clone()).collect();
        let keys: Vec<String> = batch.rows.iter().map(|r| r.key.clone()).collect();
        let values_t = values.as_ref().map(|v| host_tensor(v, n)).transpose()?;
        let spsq_t = spsq.as_ref().map(|v| host_tensor(v, n)).transpose()?;
        let extra_scores = gdpo_components(&batch.rows, &self.advantage.gdpo_reward_keys)?;
        let baselines_t = match self.estimator {
            AdvantageEstimator::Remax => Some(reward_baselines(&batch.rows)?),
            _ => None,
        };
        let inputs = AdvantageInputs {
            index: Some(&uids),
            keys: Some(&keys),
            values: values_t.as_ref(),
            extra_scores: extra_scores.as_ref(),
            old_log_probs: Some(&old_t),
            sum_pi_squared: spsq_t.as_ref(),
            rollout_is_weights: is_weights.as_ref(),
            reward_baselines: baselines_t.as_ref(),
            ..AdvantageInputs::new(&rewards_t, &mask_t)
        };
        let (advantages, returns) = compute_advantage(self.estimator, &inputs, &self.advantage)?;
        let mut cols = Columns {
            width,
            mask: to_host(&mask_t)?,
            old_log_probs: old,
            ref_log_probs: reference,
            advantages: to_host(&advantages)?,
            is_weights: is_weights.as_ref().map(to_host).transpose()?,
        };
        let mut returns = to_host(&returns)?;
        let mut rewards = to_host(&rewards_t)?;
        let mut scores = scores;

        // PF-PPO: resample the batch by score (GAE only)
        if let Some(method) = self.pf_ppo {
            let seq_scores: Vec<f64> = batch.rows.iter().map(|r| r.score).collect();
            let picked = pf_ppo_resample(&seq_scores, method, step_seed(self.settings.run_seed, step) as u64)?;
            batch = std::borrow::Cow::Owned(batch.resampled(&picked));
            let take = |m: &[f32]| -> Vec<f32> {
                picked.iter().flat_map(|&i| m[i * width..(i + 1) * width].iter().copied()).collect()
            };
            cols.mask = take(&cols.mask);
            cols.old_log_probs = take(&cols.old_log_probs);
            cols.advantages = take(&cols.advantages);
            cols.ref_log_probs = cols.ref_log_probs.as_deref().map(take);
            cols.is_weights = cols.is_weights.as_deref().map(take);
            values = values.as_deref().map(take);
            returns = take(&returns);
            rewards = take(&rewards);
            scores = take(&scores);
        }
        data_metrics(&cols, &scores, &rewards, &returns, values.as_deref(), &mut out.metrics);
        out.timings.since(Phase::Adv, t);

        if let (Some(critic), Some(values)) = (self.critic.as_mut(), values.as_ref()) {
            let t = Instant::now();
            let targets = ValueTargets { width, mask: &cols.mask, values, returns: &returns };
            out.metrics.extend(critic.update(&batch, &targets, step)?);
            out.timings.since(Phase::UpdateCritic, t);
        }
        if self.settings.critic_warmup <= step {
            let t = Instant::now();
            out.metrics.extend(self.update_policy(&batch, &cols, step)?);
            out.timings.since(Phase::UpdateActor, t);
        }
        Ok(out)
    }

    /// The actor update (verl `update_actor`): ppo_epochs × mini-batches of whole prompt groups.
    fn update_policy(
        &mut self,
        batch: &RankBatch,
        cols: &Columns,
        step: u64,
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let groups = batch.groups();
        let lr = self.schedule.lr(self.actor_updates);
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut updates = 0.0f64;
        for epoch in 0..self.settings.epochs {
            let batches = mini_batches(
                &groups,
                self.settings.mini_batch_groups,
                self.settings.shuffle,
                self.settings.shuffle_seed,
                step,
                epoch,
            );
            for rows in batches {
                for (k, v) in self.update_mini_batch(batch, cols, &rows, lr)? {
                    *sums.entry(k).or_insert(0.0) += v;
                }
                updates += 1.0;
                // fault injection (inert unless JETRL_CRASH_AT names it): weights changed, step not finished
                jetrl_telemetry::crash::crash_point("trainer.mid_update", step);
            }
        }
        self.actor_updates += 1;
        let mut out: BTreeMap<String, f64> = sums.into_iter().map(|(k, v)| (k, v / updates.max(1.0))).collect();
        out.insert("actor/lr".into(), lr);
        if self.loss.use_kl_loss {
            out.insert("actor/kl_coef".into(), self.loss.kl_loss_coef);
        }
        Ok(out)
    }

    /// One optimizer update over the rows `rows` of a mini-batch (every rank the same rows; each computes the
    /// loss of those it holds), gradients accumulated over micro-batches. Each micro-batch's loss is its share of
    /// the whole mini-batch's (token counts of the whole mini-batch), so the gradients summed over the ranks are
    /// the gradient of one rank holding everything.
    fn update_mini_batch(
        &mut self,
        batch: &RankBatch,
        cols: &Columns,
        rows: &[usize],
        lr: f64,
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let width = cols.width;
        let total_tokens: f64 = rows
            .iter()
            .map(|&r| cols.mask[r * width..(r + 1) * width].iter().map(|&m| f64::from(m)).sum::<f64>())
            .sum();
        let info = GlobalBatchInfo {
            dp_size: 1,
            batch_num_tokens: Some(total_tokens.max(1.0)),
            global_batch_size: Some(rows.len() as f64),
            loss_scale_factor: None,
        };
        let device = self.model.device();
        self.optim.zero_grad();
        let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
        for chunk in batch.local_micro_batches(rows, self.settings.max_token_len) {
            let mb = MicroBatch::build_for(&batch.samples(&chunk), self.pad_id, device, self.settings.remove_padding)?;
            let r = mb.r as usize;
            let mask = gather_rows(&cols.mask, width, &chunk, r, device)?;
            let old = gather_rows(&cols.old_log_probs, width, &chunk, r, device)?;
            let adv = gather_rows(&cols.advantages, width, &chunk, r, device)?;
            let reference =
                cols.ref_log_probs.as_ref().map(|m| gather_rows(m, width, &chunk, r, device)).transpose()?;
            let weights = cols.is_weights.as_ref().map(|m| gather_rows(m, width, &chunk, r, device)).transpose()?;
            let (logits, checkpoints) = Self::response_logits(
                &self.model,
                &mb,
                self.settings.temperature,
                self.settings.gradient_checkpointing,
            )?;
            let log_prob = mb.to_rows(&logprobs_from_logits(&logits, mb.scored_ids()))?;
            let entropy = match (self.settings.calculate_entropy, self.loss.entropy_coeff != 0.0) {
                (false, _) => None,
                (true, true) => Some(mb.to_rows(&entropy_from_logits(&logits))?),
                // only a metric: kept out of the backward pass
                (true, false) => Some(mb.to_rows(&entropy_from_logits(&logits.f_detach()?))?),
            };
            let inputs = ActorLossInputs {
                policy: PolicyLossInputs {
                    old_log_prob: &old,
                    log_prob: &log_prob,
                    advantages: &adv,
                    response_mask: &mask,
                    rollout_is_weights: weights.as_ref(),
                },
                entropy: entropy.as_ref(),
                ref_log_prob: reference.as_ref(),
            };
            let (loss, m) = compute_actor_loss(&inputs, &self.loss, &info)?;
            loss.f_backward()?;
            if let Some(checkpoints) = checkpoints {
                self.model.backward_checkpointed(checkpoints)?;
            }
            let weight = f64::try_from(mask.f_sum(Kind::Double)?)? / total_tokens.max(1.0);
            for (k, v) in m.to_map() {
                // losses of a micro-batch are already its share of the mini-batch loss: sum them; ratios and
                // fractions are per-token means: weight them by the micro-batch's token share.
                let contribution = if matches!(k.as_str(), "actor/pg_loss" | "actor/entropy_loss" | "actor/kl_loss") {
                    v
                } else {
                    v * weight
                };
                *metrics.entry(k).or_insert(0.0) += contribution;
            }
        }
        let mut metrics = sum_metrics_over_ranks(&self.comm, metrics, device)?;
        if let Some(&entropy) = metrics.get("actor/entropy_loss") {
            metrics.insert("actor/entropy".into(), entropy);
        }
        let grad_norm = self.optim.clip_grad_norm(self.settings.grad_clip)?;
        if grad_norm.is_finite() {
            self.optim.step(lr)?;
        } else {
            tracing::warn!(grad_norm, "non-finite gradient norm: update skipped");
        }
        self.optim.zero_grad();
        metrics.insert("actor/grad_norm".into(), grad_norm);
        Ok(metrics)
    }

    /// One PPO update of the policy on fixed old log-probs and advantages (no π_old pass, no advantage
    /// estimation): forward, backward, clipping, AdamW — the part the `trainer_step` benchmark measures.
    pub fn ppo_update(
        &mut self,
        samples: &[Sample],
        old_log_probs: &[Vec<f32>],
        advantages: &[Vec<f32>],
        lr: f64,
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let batch = RankBatch::whole(samples.to_vec());
        let width = batch.width();
        let flat = |rows: &[Vec<f32>]| -> Vec<f32> {
            let mut m = vec![0f32; samples.len() * width];
            for (i, row) in rows.iter().enumerate() {
                let len = row.len().min(width);
                m[i * width..i * width + len].copy_from_slice(&row[..len]);
            }
            m
        };
        let mask: Vec<Vec<f32>> =
            samples.iter().map(|s| s.response_mask.iter().map(|&m| f32::from(m)).collect()).collect();
        let cols = Columns {
            width,
            mask: flat(&mask),
            old_log_probs: flat(old_log_probs),
            ref_log_probs: None,
            advantages: flat(advantages),
            is_weights: None,
        };
        let rows: Vec<usize> = (0..samples.len()).collect();
        self.update_mini_batch(&batch, &cols, &rows, lr)
    }
}

/// Sums metric maps over the ranks (a rank that held no row of a mini-batch has none): the union of the keys, each
/// the sum of the ranks' values.
pub(crate) fn sum_metrics_over_ranks(
    comm: &Comm,
    metrics: BTreeMap<String, f64>,
    device: Device,
) -> Result<BTreeMap<String, f64>, ActorError> {
    if comm.world() == 1 {
        return Ok(metrics);
    }
    let mine = serde_json::to_vec(&metrics).map_err(|e| ActorError::Batch(format!("metrics: {e}")))?;
    let mut sum: BTreeMap<String, f64> = BTreeMap::new();
    for bytes in comm.all_gather_bytes(&mine, device)? {
        let theirs: BTreeMap<String, f64> =
            serde_json::from_slice(&bytes).map_err(|e| ActorError::Batch(format!("a rank's metrics: {e}")))?;
        for (k, v) in theirs {
            *sum.entry(k).or_insert(0.0) += v;
        }
    }
    Ok(sum)
}

/// verl's `training/rollout_probs_diff_*`: how far the rollout's probabilities are from the trainer's on the
/// same weights (a sanity check of the inference engine), over the trained tokens of the whole batch.
fn rollout_probs_diff(
    rows: &[RowInfo],
    rollout: &[f32],
    old: &[f32],
    mask: &[f32],
    width: usize,
    metrics: &mut BTreeMap<String, f64>,
) {
    let (mut sum, mut max, mut count) = (0.0f64, 0.0f64, 0.0f64);
    for (i, row) in rows.iter().enumerate() {
        for j in i * width..i * width + row.response_len {
            if mask[j] == 1.0 {
                let d = (f64::from(rollout[j]).exp() - f64::from(old[j]).exp()).abs();
                sum += d;
                max = max.max(d);
                count += 1.0;
            }
        }
    }
    if count > 0.0 {
        metrics.insert("training/rollout_probs_diff_mean".into(), sum / count);
        metrics.insert("training/rollout_probs_diff_max".into(), max);
    }
}

/// remax's `reward_baselines`, `[rows]`: each row's greedy-rollout score. A row without one is an error naming
/// it (the trainer rejects such groups when it fetches them, so this is a broken invariant, not an input).
fn reward_baselines(rows: &[RowInfo]) -> Result<Tensor, ActorError> {
    let column = rows
        .iter()
        .map(|r| {
            r.reward_baseline
                .map(|b| b as f32)
                .ok_or_else(|| ActorError::Batch(format!("remax: trajectory {} has no greedy-rollout baseline", r.key)))
        })
        .collect::<Result<Vec<f32>, _>>()?;
    Ok(Tensor::f_from_slice(&column)?)
}

/// The reward components GDPO normalises, `[rows]` each, from the rows' reward extras.
fn gdpo_components(rows: &[RowInfo], keys: &[String]) -> Result<Option<BTreeMap<String, Tensor>>, ActorError> {
    if keys.is_empty() {
        return Ok(None);
    }
    let mut out = BTreeMap::new();
    for key in keys {
        let column: Vec<f32> = rows.iter().map(|r| r.extra.get(key).copied().unwrap_or(0.0) as f32).collect();
        out.insert(key.clone(), Tensor::f_from_slice(&column)?);
    }
    Ok(Some(out))
}

/// verl's `compute_data_metrics`: sequence scores and rewards, and advantages, returns and values over the
/// valid tokens, each as mean/max/min; `critic/vf_explained_var` with a critic.
fn data_metrics(
    cols: &Columns,
    scores: &[f32],
    rewards: &[f32],
    returns: &[f32],
    values: Option<&[f32]>,
    metrics: &mut BTreeMap<String, f64>,
) {
    let width = cols.width;
    let rows = cols.mask.len() / width.max(1);
    let seq_sum = |m: &[f32]| -> Vec<f64> {
        (0..rows).map(|i| m[i * width..(i + 1) * width].iter().map(|&v| f64::from(v)).sum()).collect()
    };
    let valid = |m: &[f32]| -> Vec<f64> {
        m.iter().zip(&cols.mask).filter(|(_, &k)| k > 0.0).map(|(&v, _)| f64::from(v)).collect()
    };
    stats(&seq_sum(scores), "critic/score", metrics);
    stats(&seq_sum(rewards), "critic/rewards", metrics);
    stats(&valid(&cols.advantages), "critic/advantages", metrics);
    let returns_valid = valid(returns);
    stats(&returns_valid, "critic/returns", metrics);
    if let Some(values) = values {
        let values_valid = valid(values);
        stats(&values_valid, "critic/values", metrics);
        let residual: Vec<f64> = returns_valid.iter().zip(&values_valid).map(|(r, v)| r - v).collect();
        let var = |x: &[f64]| {
            let mean = x.iter().sum::<f64>() / x.len().max(1) as f64;
            x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / x.len().max(1) as f64
        };
        metrics.insert("critic/vf_explained_var".into(), 1.0 - var(&residual) / (var(&returns_valid) + 1e-5));
    }
}

/// `<name>/mean`, `/max`, `/min` of `values` (nothing when empty).
pub fn stats(values: &[f64], name: &str, out: &mut BTreeMap<String, f64>) {
    if values.is_empty() {
        return;
    }
    out.insert(format!("{name}/mean"), values.iter().sum::<f64>() / values.len() as f64);
    out.insert(format!("{name}/max"), values.iter().copied().fold(f64::MIN, f64::max));
    out.insert(format!("{name}/min"), values.iter().copied().fold(f64::MAX, f64::min));
}

type Job = Box<dyn FnOnce(&mut Actor) + Send>;

/// Handle to the actor thread: closures run on the thread, in order, with exclusive access. The thread blocks on
/// its bounded channel; callers wait for room without blocking the reactor.
#[derive(Clone)]
pub struct ActorHandle {
    tx: tokio::sync::mpsc::Sender<Job>,
    /// the message of the panic that ended the thread, if one did
    panicked: Arc<Mutex<Option<String>>>,
}

impl ActorHandle {
    /// Builds the actor on a new thread; returns once the models are loaded (or failed to load).
    /// With several ranks this is rank 0: it tells the others to build theirs (the same horizon, checkpoint and pad
    /// id) before it builds its own, as loading the optimizer state is a collective.
    pub fn spawn(
        cfg: JobConfig,
        total_steps: u64,
        resume: Option<(PathBuf, ActorState)>,
        comm: Comm,
        pad_id: u32,
    ) -> Result<Self, ActorError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Job>(16);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("trainer-actor".into())
            .spawn(move || {
                let mut leader = Leader::new(comm.clone());
                let init = Command::Init { horizon: total_steps, resume: resume.clone(), pad_id };
                if let Err(e) = leader.send(&init) {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
                let resume_ref = resume.as_ref().map(|(dir, state)| (dir.as_path(), state));
                let built = Actor::new(&cfg, total_steps, resume_ref, comm).map(|mut a| {
                    a.leader = leader;
                    a.set_pad_id(pad_id);
                    a
                });
                let mut actor = match built {
                    Ok(a) => {
                        let _ = ready_tx.send(Ok(()));
                        a
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(job) = rx.blocking_recv() {
                    job(&mut actor);
                }
            })
            .map_err(ActorError::Spawn)?;
        ready_rx.recv().map_err(|_| ActorError::Stopped)??;
        Ok(Self { tx, panicked: Arc::default() })
    }

    /// Runs `f` on the actor thread and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Actor) -> R + Send + 'static,
    ) -> Result<R, ActorError> {
        let (reply, rx) = oneshot::channel();
        let panicked = self.panicked.clone();
        let job: Job = Box::new(move |actor| match std::panic::catch_unwind(AssertUnwindSafe(|| f(actor))) {
            Ok(result) => {
                let _ = reply.send(result);
            }
            // the caller gets the message, then the thread unwinds as it would have (its state is not to be trusted)
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                *panicked.lock().unwrap_or_else(PoisonError::into_inner) = Some(message);
                drop(reply);
                std::panic::resume_unwind(payload);
            }
        });
        let stopped = || match self.panicked.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            Some(message) => ActorError::Panicked(message),
            None => ActorError::Stopped,
        };
        self.tx.send(job).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }
}

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_string(),
        (_, Some(text)) => text.clone(),
        _ => "a panic without a message".into(),
    }
}

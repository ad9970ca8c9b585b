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
//!
//! The files, one per part of a step: `passes` (the forward passes without autograd: π_old, reference, values),
//! `phases` (token rewards, rollout correction, advantages, PF-PPO, data metrics: functions over columns, tested
//! alone), `update` (the critic-free actor update and the benchmark's PPO update), `thread` (the actor's thread,
//! [`ActorHandle`], and rank 0's command channel). This file holds the [`Actor`], its settings and the step that
//! runs the phases in order.

mod passes;
mod phases;
mod routes;
mod thread;
mod update;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
// tokio's `Instant`, as [`StepTimings`] takes it: nothing pauses the clock here, so it reads std's
use tokio::time::Instant;

use jetrl_algos::{
    ActorLossParams, AdvantageConfig, AdvantageEstimator, KlController, KlPenalty, PfPpoReweight,
    RolloutCorrectionParams,
};
use jetrl_config::{JobConfig, ModelDtype, RouterReplayMode};
use jetrl_model::{CausalLm, DType};
use tch::{Device, Tensor};

use self::phases::{host_tensor, AdvantageColumns, Columns, StepColumns};
pub use self::thread::{ActorHandle, LeadingActor};
use crate::batch::{to_host, RankBatch};
use crate::checkpoint::{self, ActorState};
use crate::critic::{Critic, ValueTargets};
use crate::dist::Comm;
use crate::error::ActorError;
use crate::optim::{self, AdamW, LrSchedule};
use crate::step_metrics::{Phase, StepTimings};

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
    /// which routes the π_old and update passes replay (`actor.router_replay.mode`)
    router_replay: RouterReplayMode,
    /// weight of the MoE load-balancing loss (`actor.moe_aux_loss_coeff`)
    moe_aux_loss_coeff: f64,
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
    /// whether this process has logged the policy loss its updates compute (once, at its first actor update)
    loss_mode_logged: bool,
    model_dir: PathBuf,
    /// the dtype weights are shipped to rollout workers in (`model.dtype`)
    ship_dtype: DType,
    pad_id: i64,
    /// the current step's routes of the rows this rank holds (router replay: R2's from the π_old pass, R3's from
    /// the rollout)
    routes: routes::RowRoutes,
    /// the trainer's ranks: each holds the whole model, its shard of the optimizer state, and a share of every
    /// batch's rows
    comm: Comm,
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
        let router_replay = cfg.actor.router_replay.mode;
        if (router_replay != RouterReplayMode::Disabled || cfg.actor.moe_aux_loss_coeff > 0.0)
            && model.sparse_layer_count() == 0
        {
            return Err(ActorError::Model(jetrl_model::ModelError::Config(format!(
                "actor.router_replay.mode and actor.moe_aux_loss_coeff act on mixture-of-experts layers; {} has none \
                 (model_type {})",
                model_dir.display(),
                model.config().architecture.model_type()
            ))));
        }
        let params: Vec<(String, Tensor)> = model.trainable_parameters().into_iter().collect();
        let mut optim = AdamW::sharded(params, &cfg.actor.optim, comm.clone())?;
        if let Some((dir, _)) = resume {
            optim::load_optimizer(&dir.join("actor"), &mut optim)?;
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
                router_replay,
                moe_aux_loss_coeff: cfg.actor.moe_aux_loss_coeff,
            },
            actor_updates: 0,
            loss_mode_logged: false,
            model_dir,
            ship_dtype: DType::from(cfg.model.dtype),
            pad_id: 0,
            routes: routes::RowRoutes::default(),
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

    pub fn critic(&self) -> Option<&Critic> {
        self.critic.as_ref()
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
        optim::save_optimizer(&actor_dir, &self.optim, rank, world)?;
        if let Some(critic) = &self.critic {
            critic.save(&dir.join(checkpoint::CRITIC_DIR), &self.model_dir)?;
        }
        Ok(self.state())
    }

    /// This rank's place among the trainer's ranks.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Bytes of optimizer state this rank holds (the actor's and the critic's).
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.optim.state_bytes() + self.critic.as_ref().map_or(0, |c| c.optimizer_state_bytes())
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

    /// One training step on `batch` (the global step `step`) with π_old from `pi_old`, verl's `_step_once` after
    /// sampling, phase by phase: π_old, reference and value passes ([`passes`]), token rewards, rollout
    /// correction, advantages and PF-PPO ([`phases`]), critic and actor updates ([`update`]). Returns verl-named
    /// metrics and timings. With several ranks, every rank calls it at once with the same rows (each holding its
    /// share of the payloads); the metrics are those of the whole batch on every rank.
    pub fn train(&mut self, batch: &RankBatch, step: u64, pi_old: OldPolicy) -> Result<TrainOutput, ActorError> {
        if batch.is_empty() {
            return Err(ActorError::Batch("no trajectories to train on".into()));
        }
        tch::manual_seed(step_seed(self.settings.run_seed, step));
        let mut out = TrainOutput::default();
        let (n, width) = (batch.len(), batch.width());
        let host = |m: &[f32]| host_tensor(m, n, width);
        let mask = self.held_matrix(batch, width, |s, j| f32::from(s.response_mask.get(j).copied().unwrap_or(1)))?;
        let rollout = self.held_matrix(batch, width, |s, j| s.rollout_logprobs.get(j).copied().unwrap_or(0.0))?;

        let t = Instant::now();
        let old = self.old_log_prob_pass(batch, width, pi_old, &rollout, &mask, &mut out.metrics)?;
        out.timings.since(Phase::OldLogProb, t);
        let t = Instant::now();
        let reference = self.reference_pass(batch, width)?;
        if reference.is_some() {
            out.timings.since(Phase::Ref, t);
        }
        let t = Instant::now();
        let values = self.value_pass(batch, width)?;
        if values.is_some() {
            out.timings.since(Phase::Values, t);
        }

        let t = Instant::now();
        let scores = phases::score_column(&batch.rows, width);
        let old_t = host(&old.log_probs)?;
        let mask_t = host(&mask)?;
        let reference_t = reference.as_deref().map(host).transpose()?;
        let kl_penalty = self.kl_penalty;
        let kl = self.kl_ctrl.as_mut().map(|ctrl| (ctrl, kl_penalty));
        let rewards_t =
            phases::token_rewards(&host(&scores)?, &old_t, reference_t.as_ref(), &mask_t, kl, &mut out.metrics)?;
        let (mask_t, is_weights) =
            phases::rollout_correction(&old_t, &host(&rollout)?, mask_t, self.correction.as_ref(), &mut out.metrics)?;
        let values_t = values.as_deref().map(host).transpose()?;
        let spsq_t = old.sum_pi_squared.as_deref().map(host).transpose()?;
        let inputs = AdvantageColumns {
            rows: &batch.rows,
            rewards: &rewards_t,
            mask: &mask_t,
            old_log_probs: &old_t,
            values: values_t.as_ref(),
            sum_pi_squared: spsq_t.as_ref(),
            is_weights: is_weights.as_ref(),
        };
        let (advantages, returns) = phases::advantages(self.estimator, &self.advantage, &inputs)?;
        let mut cols = StepColumns {
            policy: Columns {
                width,
                mask: to_host(&mask_t)?,
                old_log_probs: old.log_probs,
                ref_log_probs: reference,
                advantages: to_host(&advantages)?,
                is_weights: is_weights.as_ref().map(to_host).transpose()?,
            },
            values,
            returns: to_host(&returns)?,
            rewards: to_host(&rewards_t)?,
            scores,
        };
        // PF-PPO: resample the batch by score (GAE only)
        let mut trained = Cow::Borrowed(batch);
        if let Some(method) = self.pf_ppo {
            let picked = phases::pf_ppo_rows(&batch.rows, method, step_seed(self.settings.run_seed, step) as u64)?;
            trained = Cow::Owned(batch.resampled(&picked));
            self.routes.resample(&picked);
            cols = cols.take_rows(&picked);
        }
        phases::data_metrics(&cols, &mut out.metrics);
        out.timings.since(Phase::Adv, t);

        if let (Some(critic), Some(values)) = (self.critic.as_mut(), cols.values.as_ref()) {
            let t = Instant::now();
            let targets = ValueTargets { width, mask: &cols.policy.mask, values, returns: &cols.returns };
            out.metrics.extend(critic.update(&trained, &targets, step)?);
            out.timings.since(Phase::UpdateCritic, t);
        }
        if self.settings.critic_warmup <= step {
            let t = Instant::now();
            out.metrics.extend(self.update_policy(&trained, &cols.policy, step)?);
            out.timings.since(Phase::UpdateActor, t);
        }
        Ok(out)
    }
}

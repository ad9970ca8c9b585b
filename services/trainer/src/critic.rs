//! The critic (verl's value model): a second copy of the policy's architecture whose final hidden states feed
//! a `Linear(hidden, 1)` value head, trained with PPO's clipped value loss. It is saved as an HF
//! `*ForTokenClassification` model with one label (the head is `score`), which is what verl's critic is.
//!
//! With `critic.model.lora_rank` the trunk stays frozen and trains LoRA adapters, and the head trains in full
//! beside them (verl wraps its critic in PEFT as `TOKEN_CLS`, whose `modules_to_save` are the classifier
//! heads): the checkpoint is then a PEFT adapter directory, `critic/lora_adapter/`, holding both.

use std::collections::BTreeMap;
use std::path::Path;

use jetrl_algos::{compute_value_loss, AggMode, GlobalBatchInfo};
use jetrl_config::JobConfig;
use jetrl_model::{CausalLm, Checkpoints, DType};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::{gather_rows, mini_batches, to_host, MicroBatch, RankBatch};
use crate::checkpoint::{self, CheckpointError};
use crate::dist::Comm;
use crate::error::ActorError;
use crate::optim::{self, AdamW, LrSchedule};

/// Settings of the critic's update, resolved from `critic.*` with verl's inheritance from `actor.*`.
#[derive(Debug, Clone)]
struct CriticSettings {
    mini_batch_groups: usize,
    epochs: u32,
    max_token_len: usize,
    shuffle: bool,
    seed: u64,
    grad_clip: f64,
    /// `model.enable_gradient_checkpointing`: the trunk's layers recompute their activations in the backward pass
    gradient_checkpointing: bool,
    /// `model.use_remove_padding`: forward passes on micro-batches packed without padding
    remove_padding: bool,
    cliprange_value: f64,
    agg: AggMode,
    loss_scale_factor: Option<f64>,
}

pub struct Critic {
    model: CausalLm,
    /// The value head lives in its own store: the trunk's store must keep exactly the HF causal-LM names so
    /// checkpoints of the policy architecture load into it unchanged.
    _head_store: VarStore,
    head_weight: Tensor,
    head_bias: Tensor,
    optim: AdamW,
    schedule: LrSchedule,
    /// critic update calls made: the position of its LR schedule
    pub updates: u64,
    settings: CriticSettings,
    pad_id: i64,
    /// the trainer's ranks (the critic's optimizer state is sharded over them as the actor's)
    comm: Comm,
}

/// What the critic update needs per row, as `[rows, width]` host matrices.
pub struct ValueTargets<'a> {
    pub width: usize,
    pub mask: &'a [f32],
    pub values: &'a [f32],
    pub returns: &'a [f32],
}

/// Mixed into the run seed for the critic's new adapter, so that it is not drawn as the actor's is.
const CRITIC_ADAPTER_SEED: u64 = 0xc417_1c00;

/// The value head's tensors by their HF names.
fn head_tensors(weight: &Tensor, bias: &Tensor) -> BTreeMap<String, Tensor> {
    BTreeMap::from([("score.weight".into(), weight.shallow_clone()), ("score.bias".into(), bias.shallow_clone())])
}

/// HF's initialisation of the new `score` head, normal(0, 0.02), drawn from a generator of its own seeded by
/// the run seed: libtorch's global generator is shared by every thread of the process, so drawing from it
/// would make the head depend on whatever else ran first.
fn head_init(hidden: i64, seed: u64) -> Result<Tensor, tch::TchError> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5c0e_4ead);
    let values: Vec<f32> = (0..hidden)
        .map(|_| {
            // Box–Muller
            let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
            let u2: f64 = rng.gen();
            (0.02 * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    Tensor::f_from_slice(&values)?.f_view([1, hidden])
}

impl Critic {
    /// The critic starts from the policy checkpoint (`model.path`) with a fresh head (normal(0, 0.02), zero
    /// bias, from `run.seed`), or from `<resume>/critic`.
    pub fn new(
        cfg: &JobConfig,
        total_steps: u64,
        device: Device,
        dtype: DType,
        resume: Option<&Path>,
        comm: Comm,
    ) -> Result<Self, ActorError> {
        let mut model = CausalLm::load(Path::new(&cfg.model.path), device, dtype)?;
        let hidden = model.config().hidden_size;
        let mut head_store = VarStore::new(device);
        let root = head_store.root();
        let score = &root / "score";
        let head_weight = score.var("weight", &[1, hidden], tch::nn::Init::Const(0.0));
        let head_bias = score.var("bias", &[1], tch::nn::Init::Const(0.0));
        tch::no_grad(|| head_weight.shallow_clone().f_copy_(&head_init(hidden, cfg.run.seed)?))?;
        head_store.set_kind(dtype.kind());
        let critic_dir = resume.map(|dir| dir.join(checkpoint::CRITIC_DIR));
        let lora = jetrl_model::lora::critic_spec_of(&cfg.critic.model);
        if let Some(spec) = &lora {
            let head = head_tensors(&head_weight, &head_bias);
            match &critic_dir {
                // the trunk from model.path; the adapters and the head from the checkpoint
                Some(dir) => {
                    model.load_lora_with_modules(&dir.join(checkpoint::LORA_ADAPTER_DIR), &head)?;
                }
                None => model.add_lora_seeded(spec, cfg.run.seed ^ CRITIC_ADAPTER_SEED)?,
            }
            if let Some((spec, modules)) = model.lora_spec() {
                tracing::info!(
                    rank = spec.rank,
                    alpha = spec.alpha,
                    modules = modules.len(),
                    "the critic trains a LoRA adapter on its trunk and its value head in full"
                );
            }
        }
        // the adapters (the trunk frozen) with LoRA, else every parameter; and the head
        let mut params: Vec<(String, Tensor)> = model.trainable_parameters().into_iter().collect();
        params.push(("score.weight".into(), head_weight.shallow_clone()));
        params.push(("score.bias".into(), head_bias.shallow_clone()));
        let critic = &cfg.critic;
        let settings = CriticSettings {
            mini_batch_groups: critic.ppo_mini_batch_size.or(cfg.actor.ppo_mini_batch_size).unwrap_or(0) as usize,
            epochs: critic.ppo_epochs.unwrap_or(cfg.actor.ppo_epochs).max(1),
            max_token_len: critic.ppo_max_token_len.unwrap_or(cfg.actor.ppo_max_token_len).max(1) as usize,
            shuffle: critic.shuffle,
            seed: critic.data_loader_seed,
            grad_clip: critic.grad_clip,
            gradient_checkpointing: cfg.model.enable_gradient_checkpointing,
            remove_padding: cfg.model.use_remove_padding,
            cliprange_value: critic.cliprange_value,
            agg: critic.loss_agg_mode.unwrap_or(cfg.actor.loss_agg_mode),
            loss_scale_factor: critic.loss_scale_factor.or(cfg.actor.loss_scale_factor),
        };
        let mut out = Self {
            model,
            _head_store: head_store,
            head_weight,
            head_bias,
            optim: AdamW::sharded(params, &critic.optim, comm.clone())?,
            schedule: LrSchedule::new(&critic.optim, total_steps),
            updates: 0,
            settings,
            pad_id: 0,
            comm,
        };
        match critic_dir {
            Some(dir) if lora.is_some() => optim::load_optimizer(&dir, &mut out.optim)?,
            Some(dir) => out.load(&dir)?,
            None => {}
        }
        Ok(out)
    }

    /// The trunk, with its adapters under LoRA.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The value head's tensors by their HF names (`score.weight`, `score.bias`).
    pub fn head(&self) -> BTreeMap<String, Tensor> {
        head_tensors(&self.head_weight, &self.head_bias)
    }

    pub fn set_pad_id(&mut self, pad_id: i64) {
        self.pad_id = pad_id;
    }

    /// Bytes of optimizer state this rank holds.
    pub fn optimizer_state_bytes(&self) -> u64 {
        self.optim.state_bytes()
    }

    /// Values `[n, r]` (f32) at the response positions of a micro-batch: V_t is read at the state that
    /// generates response token t, as verl's `values[:, -response_length - 1 : -1]`. With `checkpointing` the
    /// trunk keeps no activations and the returned checkpoints must be back-propagated right after the loss's
    /// backward pass.
    fn forward_values(
        &self,
        mb: &MicroBatch,
        checkpointing: bool,
    ) -> Result<(Tensor, Option<Checkpoints>), ActorError> {
        let (hidden, checkpoints) = mb.response_hidden(&self.model, checkpointing)?;
        let values =
            hidden.f_linear(&self.head_weight, Some(&self.head_bias))?.f_squeeze_dim(-1)?.f_to_kind(Kind::Float)?;
        Ok((mb.to_rows(&values)?, checkpoints))
    }

    /// The current values of the rows this rank holds, in a `[rows, width]` host matrix of the whole batch (zero
    /// past each response and in the rows of other ranks).
    pub fn values(&self, batch: &RankBatch, width: usize) -> Result<Vec<f32>, ActorError> {
        let mut out = vec![0f32; batch.len() * width];
        tch::no_grad(|| -> Result<(), ActorError> {
            for chunk in batch.local_micro_batches(&batch.local_rows(), self.settings.max_token_len) {
                let refs = batch.samples(&chunk);
                let mb = MicroBatch::build_for(&refs, self.pad_id, self.model.device(), self.settings.remove_padding)?;
                let values = to_host(&self.forward_values(&mb, false)?.0)?;
                for (k, &row) in chunk.iter().enumerate() {
                    let len = batch.rows[row].response_len;
                    out[row * width..row * width + len].copy_from_slice(&values[k * mb.r as usize..][..len]);
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// One critic update (verl `update_critic`): `ppo_epochs` passes over mini-batches of whole prompt
    /// groups, gradients accumulated over token-budget micro-batches, global-norm clipping, AdamW.
    pub fn update(
        &mut self,
        batch: &RankBatch,
        targets: &ValueTargets,
        step: u64,
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let groups = batch.groups();
        let lr = self.schedule.lr(self.updates);
        let device = self.model.device();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut count = 0.0;
        for epoch in 0..self.settings.epochs {
            let batches = mini_batches(
                &groups,
                self.settings.mini_batch_groups,
                self.settings.shuffle,
                self.settings.seed,
                step,
                epoch,
            );
            for rows in batches {
                let tokens: f64 = rows
                    .iter()
                    .map(|&r| {
                        targets.mask[r * targets.width..(r + 1) * targets.width]
                            .iter()
                            .map(|&m| f64::from(m))
                            .sum::<f64>()
                    })
                    .sum();
                let info = GlobalBatchInfo {
                    dp_size: 1,
                    batch_num_tokens: Some(tokens.max(1.0)),
                    global_batch_size: Some(rows.len() as f64),
                    loss_scale_factor: self.settings.loss_scale_factor,
                };
                self.optim.zero_grad();
                let (mut vf_loss, mut clipfrac, mut vpred) = (0.0, 0.0, 0.0);
                for chunk in batch.local_micro_batches(&rows, self.settings.max_token_len) {
                    let refs = batch.samples(&chunk);
                    let mb = MicroBatch::build_for(&refs, self.pad_id, device, self.settings.remove_padding)?;
                    let r = mb.r as usize;
                    let mask = gather_rows(targets.mask, targets.width, &chunk, r, device)?;
                    let old = gather_rows(targets.values, targets.width, &chunk, r, device)?;
                    let returns = gather_rows(targets.returns, targets.width, &chunk, r, device)?;
                    let (vpreds, checkpoints) = self.forward_values(&mb, self.settings.gradient_checkpointing)?;
                    let (loss, m) = compute_value_loss(
                        &vpreds,
                        &returns,
                        &old,
                        &mask,
                        self.settings.cliprange_value,
                        self.settings.agg,
                        &info,
                    )?;
                    loss.f_backward()?;
                    if let Some(checkpoints) = checkpoints {
                        self.model.backward_checkpointed(checkpoints)?;
                    }
                    let share = f64::try_from(mask.f_sum(Kind::Double)?)? / tokens.max(1.0);
                    vf_loss += f64::try_from(loss.f_detach()?)?;
                    clipfrac += m.vf_clipfrac * share;
                    vpred += m.vpred_mean * share;
                }
                let mut summed = [vf_loss, clipfrac, vpred];
                self.comm.all_reduce_f64(&mut summed, device)?;
                let [vf_loss, clipfrac, vpred] = summed;
                let grad_norm = self.optim.clip_grad_norm(self.settings.grad_clip)?;
                if grad_norm.is_finite() {
                    self.optim.step(lr)?;
                } else {
                    tracing::warn!(grad_norm, "non-finite critic gradient norm: update skipped");
                }
                self.optim.zero_grad();
                for (k, v) in [
                    ("critic/vf_loss", vf_loss),
                    ("critic/vf_clipfrac", clipfrac),
                    ("critic/vpred_mean", vpred),
                    ("critic/grad_norm", grad_norm),
                ] {
                    *sums.entry(k.to_string()).or_insert(0.0) += v;
                }
                count += 1.0;
            }
        }
        self.updates += 1;
        let mut out: BTreeMap<String, f64> = sums.into_iter().map(|(k, v)| (k, v / f64::max(count, 1.0))).collect();
        out.insert("critic/lr".into(), lr);
        Ok(out)
    }

    /// Writes `dir` (rank 0) as an HF token-classification model directory, or with LoRA as PEFT saves a
    /// `TOKEN_CLS` adapter (`dir/lora_adapter/`: the adapters and the head; the trunk is `model_dir`), plus this
    /// rank's optimizer shard.
    pub fn save(&self, dir: &Path, model_dir: &Path) -> Result<(), ActorError> {
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
        let (rank, world) = (self.comm.rank(), self.comm.world());
        optim::save_optimizer(dir, &self.optim, rank, world)?;
        if rank != 0 {
            return Ok(());
        }
        let head = head_tensors(&self.head_weight, &self.head_bias);
        if self.model.lora_spec().is_some() {
            let adapter = dir.join(checkpoint::LORA_ADAPTER_DIR);
            self.model.save_lora_with_modules(&adapter, &model_dir.display().to_string(), "TOKEN_CLS", &head)?;
            return Ok(());
        }
        let mut tensors: Vec<(String, Tensor)> =
            self.model.parameters().into_iter().filter(|(name, _)| !name.starts_with("lm_head")).collect();
        tensors.extend(head);
        checkpoint::write_tensors(&dir.join(jetrl_model::WEIGHTS_FILE), &tensors)?;
        let mut config = self.model.config().to_json(self.model.dtype());
        if let Some(obj) = config.as_object_mut() {
            let arch = obj
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(|a| a.as_str())
                .unwrap_or("Qwen2ForCausalLM")
                .replace("ForCausalLM", "ForTokenClassification");
            obj.insert("architectures".into(), serde_json::json!([arch]));
            obj.insert("num_labels".into(), serde_json::json!(1));
            obj.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
            obj.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
        }
        checkpoint::copy_model_side_files(model_dir, dir)?;
        checkpoint::write_json(&dir.join("config.json"), &config)?;
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> Result<(), ActorError> {
        let weights = checkpoint::read_tensors(&dir.join(jetrl_model::WEIGHTS_FILE))?;
        let mut params = self.model.parameters();
        params.extend(head_tensors(&self.head_weight, &self.head_bias));
        let mut seen = 0usize;
        tch::no_grad(|| -> Result<(), ActorError> {
            for (name, value) in &weights {
                let Some(param) = params.get(name) else {
                    return Err(ActorError::Checkpoint(CheckpointError::format(
                        dir,
                        format!("unexpected tensor {name}"),
                    )));
                };
                if param.size() != value.size() {
                    return Err(ActorError::Checkpoint(CheckpointError::format(
                        dir,
                        format!("{name} has shape {:?}, the critic has {:?}", value.size(), param.size()),
                    )));
                }
                param.shallow_clone().f_copy_(value)?;
                seen += 1;
            }
            Ok(())
        })?;
        let expected = params.keys().filter(|n| !n.starts_with("lm_head")).count();
        if seen != expected {
            return Err(ActorError::Checkpoint(CheckpointError::format(
                dir,
                format!("has {seen} of the critic's {expected} tensors"),
            )));
        }
        Ok(optim::load_optimizer(dir, &mut self.optim)?)
    }
}

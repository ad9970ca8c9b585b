//! The policy and its optimisation, on a dedicated thread (libtorch stays off the async reactor).
//!
//! [`Actor::train`] is one PPO step over a batch of scored trajectories: recompute the behaviour
//! log-probs with the current weights (π_old), compute advantages, then `ppo_epochs` passes over
//! mini-batches of `ppo_mini_batch_size` prompt groups, each split into micro-batches that fit
//! `ppo_max_token_len` tokens, with gradients accumulated and the loss normalised over the whole
//! mini-batch (so the split does not change the gradient), global-norm clipping and AdamW.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::mpsc::{sync_channel, SyncSender};

use jetrl_algos::{
    compute_actor_loss, compute_advantage, entropy_from_logits, ActorLossInputs, ActorLossParams, AdvantageConfig,
    AdvantageEstimator, AdvantageInputs, GlobalBatchInfo, PolicyLossInputs,
};
use jetrl_config::JobConfig;
use jetrl_model::{CausalLm, DType};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::{Device, Kind, Tensor};
use tokio::sync::oneshot;

use crate::optim::{AdamW, LrSchedule, OptimError};

#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    #[error("model: {0}")]
    Model(#[from] jetrl_model::ModelError),
    #[error("algorithm: {0}")]
    Algo(#[from] jetrl_algos::AlgoError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    #[error("batch: {0}")]
    Batch(String),
    #[error("the actor thread has stopped")]
    Stopped,
}

/// One scored trajectory, as the trainer trains on it.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub key: String,
    pub uid: String,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// 1 = policy token (trained on), 0 = tool/observation token
    pub response_mask: Vec<u8>,
    /// behaviour log-probs from the rollout
    pub rollout_logprobs: Vec<f32>,
    pub score: f64,
    pub min_version: u64,
    pub max_version: u64,
    pub submit_step: u64,
    pub data_source: String,
    pub ground_truth: String,
    /// the response hit max_new_tokens
    pub truncated: bool,
}

/// Training settings, resolved from the job config once.
#[derive(Debug, Clone)]
struct Settings {
    /// prompt groups per optimizer update (0 = the whole batch)
    mini_batch_groups: usize,
    epochs: u32,
    max_token_len: usize,
    shuffle: bool,
    seed: u64,
    grad_clip: f64,
    /// the rollout temperature: log-probs are recomputed on logits / T, as the rollout sampled them
    temperature: f64,
}

pub struct Actor {
    model: CausalLm,
    optim: AdamW,
    schedule: LrSchedule,
    loss: ActorLossParams,
    estimator: AdvantageEstimator,
    advantage: AdvantageConfig,
    settings: Settings,
    pad_id: i64,
}

/// Per-row tensors of a micro-batch: prompts left-padded to `p`, responses right-padded to `r`.
struct MicroBatch {
    input_ids: Tensor,
    attention_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    p: i64,
    r: i64,
}

impl Actor {
    pub fn new(cfg: &JobConfig, total_updates: u64) -> Result<Self, ActorError> {
        let device = jetrl_model::parse_device(&cfg.model.device)?;
        let dtype: DType = cfg.model.dtype.parse()?;
        tch::manual_seed(cfg.run.seed as i64);
        let model = CausalLm::load(Path::new(&cfg.model.path), device, dtype)?;
        let params: Vec<(String, Tensor)> = model.parameters().into_iter().collect();
        let optim = AdamW::new(params, &cfg.actor.optim);
        let temperature = f64::from(cfg.rollout.temperature);
        Ok(Self {
            model,
            optim,
            schedule: LrSchedule::new(&cfg.actor.optim, total_updates),
            loss: ActorLossParams::from_config(&cfg.actor, cfg.algorithm.rollout_correction.as_ref())?,
            estimator: cfg.algorithm.adv_estimator.parse()?,
            advantage: AdvantageConfig::from_config(&cfg.algorithm),
            settings: Settings {
                mini_batch_groups: cfg.actor.ppo_mini_batch_size.unwrap_or(0) as usize,
                epochs: cfg.actor.ppo_epochs.max(1),
                max_token_len: cfg.actor.ppo_max_token_len.max(1) as usize,
                shuffle: cfg.actor.shuffle,
                seed: cfg.actor.data_loader_seed,
                grad_clip: cfg.actor.grad_clip,
                temperature: if temperature > 0.0 { temperature } else { 1.0 },
            },
            pad_id: 0,
        })
    }

    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The weights as a safetensors blob (what rollout workers load).
    pub fn weights_blob(&self) -> Result<Vec<u8>, ActorError> {
        Ok(self.model.to_safetensors_bytes()?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    fn micro_batch(&self, rows: &[&Sample]) -> Result<MicroBatch, ActorError> {
        let p = rows.iter().map(|s| s.prompt.len()).max().unwrap_or(1).max(1) as i64;
        let r = rows.iter().map(|s| s.response.len()).max().unwrap_or(1).max(1) as i64;
        let n = rows.len() as i64;
        let width = (p + r) as usize;
        let mut ids = vec![self.pad_id; rows.len() * width];
        let mut attn = vec![0i64; rows.len() * width];
        let mut resp_ids = vec![self.pad_id; rows.len() * r as usize];
        let mut resp_mask = vec![0f32; rows.len() * r as usize];
        for (i, s) in rows.iter().enumerate() {
            let row = &mut ids[i * width..(i + 1) * width];
            let arow = &mut attn[i * width..(i + 1) * width];
            let offset = p as usize - s.prompt.len();
            for (j, &t) in s.prompt.iter().enumerate() {
                row[offset + j] = i64::from(t);
                arow[offset + j] = 1;
            }
            for (j, &t) in s.response.iter().enumerate() {
                row[p as usize + j] = i64::from(t);
                arow[p as usize + j] = 1;
                resp_ids[i * r as usize + j] = i64::from(t);
                resp_mask[i * r as usize + j] = f32::from(s.response_mask.get(j).copied().unwrap_or(1));
            }
        }
        let device = self.device();
        Ok(MicroBatch {
            input_ids: Tensor::from_slice(&ids).view([n, p + r]).to_device(device),
            attention_mask: Tensor::from_slice(&attn).view([n, p + r]).to_device(device),
            response_ids: Tensor::from_slice(&resp_ids).view([n, r]).to_device(device),
            response_mask: Tensor::from_slice(&resp_mask).view([n, r]).to_device(device),
            p,
            r,
        })
    }

    /// Logits of the response positions, `[n, r, V]` f32 divided by the temperature.
    fn response_logits(&self, mb: &MicroBatch) -> Result<Tensor, ActorError> {
        let hidden = self.model.forward_hidden(&mb.input_ids, &mb.attention_mask)?;
        // position p-1+j predicts response token j
        let h = hidden.f_narrow(1, mb.p - 1, mb.r)?;
        let logits = self.model.lm_head(&h)?.f_to_kind(Kind::Float)?;
        Ok(if self.settings.temperature != 1.0 { logits.f_div_scalar(self.settings.temperature)? } else { logits })
    }

    fn response_log_probs(logits: &Tensor, response_ids: &Tensor) -> Result<Tensor, ActorError> {
        Ok(logits
            .f_log_softmax(-1, Kind::Float)?
            .f_gather(-1, &response_ids.f_unsqueeze(-1)?, false)?
            .f_squeeze_dim(-1)?)
    }

    /// Splits rows into micro-batches whose padded size stays within the token budget.
    fn micro_batches<'a>(&self, rows: &[&'a Sample]) -> Vec<Vec<&'a Sample>> {
        let mut out: Vec<Vec<&Sample>> = Vec::new();
        let mut current: Vec<&Sample> = Vec::new();
        let (mut p, mut r) = (0usize, 0usize);
        for &s in rows {
            let np = p.max(s.prompt.len());
            let nr = r.max(s.response.len());
            if !current.is_empty() && (current.len() + 1) * (np + nr) > self.settings.max_token_len {
                out.push(std::mem::take(&mut current));
                p = s.prompt.len();
                r = s.response.len();
            } else {
                p = np;
                r = nr;
            }
            current.push(s);
        }
        if !current.is_empty() {
            out.push(current);
        }
        out
    }

    /// Behaviour log-probs under the current weights (π_old) and per-token entropy, row by row.
    fn old_log_probs(&self, samples: &[Sample]) -> Result<(Vec<Vec<f32>>, f64), ActorError> {
        let rows: Vec<&Sample> = samples.iter().collect();
        let mut out = Vec::with_capacity(samples.len());
        let (mut entropy_sum, mut tokens) = (0.0, 0.0);
        tch::no_grad(|| -> Result<(), ActorError> {
            for chunk in self.micro_batches(&rows) {
                let mb = self.micro_batch(&chunk)?;
                let logits = self.response_logits(&mb)?;
                let lp = Self::response_log_probs(&logits, &mb.response_ids)?.f_to_device(Device::Cpu)?;
                let entropy = entropy_from_logits(&logits);
                entropy_sum += (&entropy * &mb.response_mask).sum(Kind::Double).double_value(&[]);
                tokens += mb.response_mask.sum(Kind::Double).double_value(&[]);
                for (i, s) in chunk.iter().enumerate() {
                    let row = Vec::<f32>::try_from(lp.get(i as i64).narrow(0, 0, s.response.len() as i64))?;
                    out.push(row);
                }
            }
            Ok(())
        })?;
        Ok((out, if tokens > 0.0 { entropy_sum / tokens } else { 0.0 }))
    }

    /// One training step on `samples`; returns verl-named metrics.
    pub fn train(&mut self, samples: &[Sample]) -> Result<BTreeMap<String, f64>, ActorError> {
        let mut metrics = BTreeMap::new();
        if samples.is_empty() {
            return Err(ActorError::Batch("no trajectories to train on".into()));
        }
        let n = samples.len();
        let rmax = samples.iter().map(|s| s.response.len()).max().unwrap_or(1).max(1);
        let (old, entropy) = self.old_log_probs(samples)?;
        metrics.insert("actor/entropy".into(), entropy);

        // rollout vs trainer log-prob agreement on the same weights (verl's rollout_probs_diff)
        let (mut diff_sum, mut diff_max, mut diff_n) = (0.0f64, 0.0f64, 0.0f64);
        for (s, o) in samples.iter().zip(&old) {
            for (j, (&a, &b)) in s.rollout_logprobs.iter().zip(o).enumerate() {
                if s.response_mask.get(j).copied().unwrap_or(1) == 1 {
                    let d = (f64::from(a).exp() - f64::from(b).exp()).abs();
                    diff_sum += d;
                    diff_max = diff_max.max(d);
                    diff_n += 1.0;
                }
            }
        }
        if diff_n > 0.0 {
            metrics.insert("training/rollout_probs_diff_mean".into(), diff_sum / diff_n);
            metrics.insert("training/rollout_probs_diff_max".into(), diff_max);
        }

        // token-level rewards: the score on the last valid response token
        let mut rewards = vec![0f32; n * rmax];
        let mut mask = vec![0f32; n * rmax];
        for (i, s) in samples.iter().enumerate() {
            for j in 0..s.response.len() {
                mask[i * rmax + j] = f32::from(s.response_mask.get(j).copied().unwrap_or(1));
            }
            if let Some(last) = s.response.len().checked_sub(1) {
                rewards[i * rmax + last] = s.score as f32;
            }
        }
        let rewards_t = Tensor::from_slice(&rewards).view([n as i64, rmax as i64]);
        let mask_t = Tensor::from_slice(&mask).view([n as i64, rmax as i64]);
        let uids: Vec<String> = samples.iter().map(|s| s.uid.clone()).collect();
        let keys: Vec<String> = samples.iter().map(|s| s.key.clone()).collect();
        let inputs =
            AdvantageInputs { index: Some(&uids), keys: Some(&keys), ..AdvantageInputs::new(&rewards_t, &mask_t) };
        let (advantages, _returns) = compute_advantage(self.estimator, &inputs, &self.advantage)?;
        let advantages = advantages.f_to_kind(Kind::Float)?;
        let adv_rows: Vec<Vec<f32>> = (0..n)
            .map(|i| Vec::<f32>::try_from(advantages.get(i as i64).narrow(0, 0, samples[i].response.len() as i64)))
            .collect::<Result<_, _>>()?;
        let valid = mask_t.sum(Kind::Double).double_value(&[]).max(1.0);
        let adv_masked = &advantages * &mask_t;
        metrics.insert("critic/advantages/mean".into(), adv_masked.sum(Kind::Double).double_value(&[]) / valid);
        metrics
            .insert("critic/advantages/max".into(), advantages.masked_select(&mask_t.gt(0.5)).max().double_value(&[]));
        metrics
            .insert("critic/advantages/min".into(), advantages.masked_select(&mask_t.gt(0.5)).min().double_value(&[]));

        let update_metrics = self.update(samples, &old, &adv_rows)?;
        metrics.extend(update_metrics);
        Ok(metrics)
    }

    /// ppo_epochs × mini-batches of whole prompt groups, gradient accumulation over micro-batches.
    fn update(
        &mut self,
        samples: &[Sample],
        old: &[Vec<f32>],
        adv: &[Vec<f32>],
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let mut by_group: Vec<(String, Vec<usize>)> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, s) in samples.iter().enumerate() {
            let slot = *index.entry(s.uid.as_str()).or_insert_with(|| {
                by_group.push((s.uid.clone(), Vec::new()));
                by_group.len() - 1
            });
            by_group[slot].1.push(i);
        }
        let groups_per_mb =
            if self.settings.mini_batch_groups == 0 { by_group.len() } else { self.settings.mini_batch_groups };
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut updates = 0.0f64;
        for epoch in 0..self.settings.epochs {
            let mut order: Vec<usize> = (0..by_group.len()).collect();
            if self.settings.shuffle {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                    self.settings.seed ^ (self.optim.step << 8) ^ u64::from(epoch),
                );
                order.shuffle(&mut rng);
            }
            for chunk in order.chunks(groups_per_mb.max(1)) {
                let rows: Vec<usize> = chunk.iter().flat_map(|&g| by_group[g].1.iter().copied()).collect();
                let m = self.update_mini_batch(samples, old, adv, &rows)?;
                for (k, v) in m {
                    *sums.entry(k).or_insert(0.0) += v;
                }
                updates += 1.0;
            }
        }
        Ok(sums.into_iter().map(|(k, v)| (k, v / updates.max(1.0))).collect())
    }

    fn update_mini_batch(
        &mut self,
        samples: &[Sample],
        old: &[Vec<f32>],
        adv: &[Vec<f32>],
        rows: &[usize],
    ) -> Result<BTreeMap<String, f64>, ActorError> {
        let refs: Vec<&Sample> = rows.iter().map(|&i| &samples[i]).collect();
        let total_tokens: f64 = refs.iter().map(|s| s.response_mask.iter().map(|&m| f64::from(m)).sum::<f64>()).sum();
        let info = GlobalBatchInfo {
            dp_size: 1,
            batch_num_tokens: Some(total_tokens.max(1.0)),
            global_batch_size: Some(refs.len() as f64),
            loss_scale_factor: None,
        };
        self.optim.zero_grad();
        let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
        let mut position = 0usize;
        for chunk in self.micro_batches(&refs) {
            let chunk_rows = &rows[position..position + chunk.len()];
            position += chunk.len();
            let mb = self.micro_batch(&chunk)?;
            let pad = |src: &[Vec<f32>]| -> Tensor {
                let mut flat = vec![0f32; chunk.len() * mb.r as usize];
                for (i, &row) in chunk_rows.iter().enumerate() {
                    for (j, &v) in src[row].iter().enumerate() {
                        flat[i * mb.r as usize + j] = v;
                    }
                }
                Tensor::from_slice(&flat).view([chunk.len() as i64, mb.r]).to_device(self.model.device())
            };
            let old_t = pad(old);
            let adv_t = pad(adv);
            let logits = self.response_logits(&mb)?;
            let log_prob = Self::response_log_probs(&logits, &mb.response_ids)?;
            let entropy = (self.loss.entropy_coeff != 0.0).then(|| entropy_from_logits(&logits));
            let inputs = ActorLossInputs {
                policy: PolicyLossInputs {
                    old_log_prob: &old_t,
                    log_prob: &log_prob,
                    advantages: &adv_t,
                    response_mask: &mb.response_mask,
                    rollout_is_weights: None,
                },
                entropy: entropy.as_ref(),
                ref_log_prob: None,
            };
            let (loss, m) = compute_actor_loss(&inputs, &self.loss, &info)?;
            loss.f_backward()?;
            let weight = mb.response_mask.sum(Kind::Double).double_value(&[]) / total_tokens.max(1.0);
            for (k, v) in m.to_map() {
                // pg_loss of a micro-batch is already its share of the mini-batch loss: sum it; ratios
                // and fractions are per-token means: weight them by the micro-batch's token share.
                let contribution = if k == "actor/pg_loss" || k == "actor/entropy_loss" || k == "actor/kl_loss" {
                    v
                } else {
                    v * weight
                };
                *metrics.entry(k).or_insert(0.0) += contribution;
            }
        }
        let grad_norm = self.optim.clip_grad_norm(self.settings.grad_clip)?;
        let lr = self.schedule.lr(self.optim.step);
        if grad_norm.is_finite() {
            self.optim.step(lr)?;
        } else {
            tracing::warn!(grad_norm, "non-finite gradient norm: update skipped");
        }
        self.optim.zero_grad();
        metrics.insert("actor/grad_norm".into(), grad_norm);
        metrics.insert("actor/lr".into(), lr);
        Ok(metrics)
    }
}

type Job = Box<dyn FnOnce(&mut Actor) + Send>;

/// Handle to the actor thread: closures run on the thread, in order, with exclusive access.
#[derive(Clone)]
pub struct ActorHandle {
    tx: SyncSender<Job>,
}

impl ActorHandle {
    /// Builds the actor on a new thread; returns once the model is loaded (or failed to load).
    pub fn spawn(cfg: JobConfig, total_updates: u64) -> Result<Self, ActorError> {
        let (tx, rx) = sync_channel::<Job>(16);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("trainer-actor".into())
            .spawn(move || {
                let mut actor = match Actor::new(&cfg, total_updates) {
                    Ok(a) => {
                        let _ = ready_tx.send(Ok(()));
                        a
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Ok(job) = rx.recv() {
                    job(&mut actor);
                }
            })
            .map_err(|e| ActorError::Batch(format!("cannot start the actor thread: {e}")))?;
        ready_rx.recv().map_err(|_| ActorError::Stopped)??;
        Ok(Self { tx })
    }

    /// Runs `f` on the actor thread and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Actor) -> R + Send + 'static,
    ) -> Result<R, ActorError> {
        let (reply, rx) = oneshot::channel();
        let job: Job = Box::new(move |actor| {
            let _ = reply.send(f(actor));
        });
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || tx.send(job))
            .await
            .map_err(|_| ActorError::Stopped)?
            .map_err(|_| ActorError::Stopped)?;
        rx.await.map_err(|_| ActorError::Stopped)
    }
}

//! The updates of a training step: the actor's (verl `update_actor`: `ppo_epochs` × mini-batches of whole prompt
//! groups, each split into micro-batches with gradients accumulated, global-norm clipping, AdamW), and the PPO
//! update on given columns that the `trainer_step` benchmark measures.

use std::collections::BTreeMap;

use jetrl_algos::{
    compute_actor_loss, entropy_from_logits, logprobs_from_logits, ActorLossInputs, GlobalBatchInfo, PolicyLossInputs,
};
use jetrl_config::RouterReplayMode;
use tch::{Device, Kind};

use super::phases::Columns;
use super::{routes, Actor};
use crate::batch::{gather_rows, mini_batches, MicroBatch, RankBatch, Sample};
use crate::dist::Comm;
use crate::error::ActorError;

impl Actor {
    /// The actor update (verl `update_actor`): ppo_epochs × mini-batches of whole prompt groups.
    pub(super) fn update_policy(
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
        if !self.loss_mode_logged {
            self.loss_mode_logged = true;
            tracing::info!(step, loss_mode = %self.loss.mode, "first actor update of this process");
        }
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
        let moe = self.model.config().moe.as_ref().map(|m| m.top_k);
        let aux_coeff = self.settings.moe_aux_loss_coeff;
        for chunk in batch.local_micro_batches(rows, self.settings.max_token_len) {
            let samples = batch.samples(&chunk);
            let mb = MicroBatch::build_for(&samples, self.pad_id, device, self.settings.remove_padding)?;
            if let (RouterReplayMode::R2 | RouterReplayMode::R3, Some(top_k)) = (self.settings.router_replay, moe) {
                let layers = self.model.sparse_layer_count();
                self.model.set_router_replay(Some(self.routes.layout(&mb, &chunk, &samples, layers, top_k)?))?;
            }
            self.model.collect_router_logits(aux_coeff > 0.0);
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
            let weight = f64::try_from(mask.f_sum(Kind::Double)?)? / total_tokens.max(1.0);
            let loss = match moe.filter(|_| aux_coeff > 0.0) {
                // the micro-batch's share of the mini-batch's mean load-balancing loss
                Some(top_k) => {
                    let aux = routes::aux_loss(&self.model, &mb, top_k)?;
                    *metrics.entry("actor/moe_aux_loss".into()).or_insert(0.0) += f64::try_from(&aux)? * weight;
                    loss.f_add(&aux.f_mul_scalar(aux_coeff * weight)?)?
                }
                None => loss,
            };
            self.model.collect_router_logits(false);
            loss.f_backward()?;
            if let Some(checkpoints) = checkpoints {
                self.model.backward_checkpointed(checkpoints)?;
            }
            self.model.set_router_replay(None)?;
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
fn sum_metrics_over_ranks(
    comm: &Comm,
    metrics: BTreeMap<String, f64>,
    device: Device,
) -> Result<BTreeMap<String, f64>, ActorError> {
    if comm.world() == 1 {
        return Ok(metrics);
    }
    let mine =
        serde_json::to_vec(&metrics).map_err(|source| ActorError::RankMessage { what: "metrics".into(), source })?;
    let mut sum: BTreeMap<String, f64> = BTreeMap::new();
    for bytes in comm.all_gather_bytes(&mine, device)? {
        let theirs: BTreeMap<String, f64> = serde_json::from_slice(&bytes)
            .map_err(|source| ActorError::RankMessage { what: "a rank's metrics".into(), source })?;
        for (k, v) in theirs {
            *sum.entry(k).or_insert(0.0) += v;
        }
    }
    Ok(sum)
}

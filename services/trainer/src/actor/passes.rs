//! The forward passes of a training step that need no gradient: π_old, the reference policy and the critic's
//! values, each over the rows this rank holds and summed over the ranks into whole-batch columns.

use std::collections::BTreeMap;

use jetrl_algos::{agg_loss, entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits, GlobalBatchInfo};
use jetrl_model::{CausalLm, Checkpoints};
use tch::Tensor;

use super::phases::{host_tensor, rollout_probs_diff};
use jetrl_config::RouterReplayMode;

use super::routes::RowRoutes;
use super::{Actor, OldPolicy};
use crate::batch::{to_host, MicroBatch, RankBatch, Sample};
use crate::error::ActorError;

/// Per-row log-probs, and the entropy and Σπ² when asked, as `[rows, width]` host matrices.
type ScoredRows = (Vec<f32>, Option<Vec<f32>>, Option<Vec<f32>>);

/// Which per-token columns besides the log-probs a scoring pass computes.
#[derive(Debug, Clone, Copy, Default)]
struct Scoring {
    entropy: bool,
    sum_pi_squared: bool,
}

/// How the forward passes of a scoring pass route an MoE model's tokens.
enum Routing<'a> {
    /// each by its own router
    Free,
    /// by its own router, the routes kept (R2's π_old pass)
    Record(&'a mut RowRoutes),
    /// by the given routes (R3)
    Replay(&'a RowRoutes),
}

/// π_old of a step, and Σπ² when the advantage estimator needs it.
pub(super) struct OldPass {
    pub log_probs: Vec<f32>,
    pub sum_pi_squared: Option<Vec<f32>>,
}

impl Actor {
    /// π_old: recomputed with the weights `pi_old` names, or the rollout's own in bypass mode. Reports the
    /// entropy under π_old (`actor/entropy`) and the rollout's probability gap to it.
    pub(super) fn old_log_prob_pass(
        &mut self,
        batch: &RankBatch,
        width: usize,
        pi_old: OldPolicy,
        rollout: &[f32],
        mask: &[f32],
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<OldPass, ActorError> {
        self.model.set_router_replay(None)?;
        self.routes.clear();
        if self.settings.router_replay == RouterReplayMode::R3 {
            self.routes = RowRoutes::from_rollout(batch, &self.model)?;
        }
        if self.settings.bypass_old_log_prob {
            return Ok(OldPass { log_probs: rollout.to_vec(), sum_pi_squared: None });
        }
        let scoring = Scoring { entropy: true, sum_pi_squared: self.settings.calculate_sum_pi_squared };
        let mut routes = std::mem::take(&mut self.routes);
        let mut routing = match self.settings.router_replay {
            RouterReplayMode::Disabled => Routing::Free,
            RouterReplayMode::R2 => Routing::Record(&mut routes),
            RouterReplayMode::R3 => Routing::Replay(&routes),
        };
        let scored = match pi_old {
            OldPolicy::CycleStart if self.lora_snapshot.is_some() => {
                self.with_snapshot_adapters(|actor| actor.score_rows(&actor.model, batch, width, scoring, &mut routing))
            }
            OldPolicy::Current => self.score_rows(&self.model, batch, width, scoring, &mut routing),
            OldPolicy::CycleStart => match self.cycle_start.as_ref() {
                Some(policy) => self.score_rows(policy, batch, width, scoring, &mut routing),
                None => Err(ActorError::Batch("π_old of the cycle start was asked for before any snapshot".into())),
            },
        };
        self.routes = routes;
        let (old, entropy, spsq) = scored?;
        if let Some(entropy) = entropy {
            let n = batch.len();
            let full_batch = GlobalBatchInfo {
                dp_size: 1,
                batch_num_tokens: Some(mask.iter().map(|&m| f64::from(m)).sum::<f64>().max(1.0)),
                global_batch_size: Some(n as f64),
                loss_scale_factor: None,
            };
            let (entropy, mask) = (host_tensor(&entropy, n, width)?, host_tensor(mask, n, width)?);
            let value = agg_loss(&entropy, &mask, self.loss.policy.loss_agg_mode, &full_batch)?;
            metrics.insert("actor/entropy".into(), f64::try_from(value)?);
        }
        rollout_probs_diff(&batch.rows, rollout, &old, mask, width, metrics);
        Ok(OldPass { log_probs: old, sum_pi_squared: spsq })
    }

    /// The reference policy's log-probs (a frozen copy of the initial weights, or with LoRA the model with its
    /// adapters off); None without a reference.
    pub(super) fn reference_pass(&mut self, batch: &RankBatch, width: usize) -> Result<Option<Vec<f32>>, ActorError> {
        match &self.reference {
            Some(model) => Ok(Some(self.score_rows(model, batch, width, Scoring::default(), &mut Routing::Free)?.0)),
            None if self.reference_is_base => {
                self.model.set_lora_enabled(false);
                let scored = self.score_rows(&self.model, batch, width, Scoring::default(), &mut Routing::Free);
                self.model.set_lora_enabled(true);
                Ok(Some(scored?.0))
            }
            None => Ok(None),
        }
    }

    /// The critic's values of every token; None without a critic.
    pub(super) fn value_pass(&self, batch: &RankBatch, width: usize) -> Result<Option<Vec<f32>>, ActorError> {
        match &self.critic {
            Some(critic) => {
                let mut values = critic.values(batch, width)?;
                self.comm.all_reduce_f32(&mut values, self.model.device())?;
                Ok(Some(values))
            }
            None => Ok(None),
        }
    }

    /// Response-position logits, f32, divided by the rollout temperature: `[n, r, V]` for a padded micro-batch,
    /// `[T, V]` for a packed one (its response tokens end to end; [`MicroBatch::to_rows`] brings per-token values
    /// back to `[n, r]`). With `checkpointing` (an update with `model.enable_gradient_checkpointing`) the decoder
    /// layers keep no activations and the returned checkpoints must be back-propagated
    /// ([`CausalLm::backward_checkpointed`]) right after the loss's backward pass.
    pub(super) fn response_logits(
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
    /// matrices are summed over the ranks (each row is held by one). `routing` says whether the forward passes
    /// route freely, record their routes (R2) or replay given ones (R3).
    fn score_rows(
        &self,
        model: &CausalLm,
        batch: &RankBatch,
        width: usize,
        scoring: Scoring,
        routing: &mut Routing<'_>,
    ) -> Result<ScoredRows, ActorError> {
        let n = batch.len();
        let mut lp = vec![0f32; n * width];
        let mut ent = scoring.entropy.then(|| vec![0f32; n * width]);
        let mut spsq = scoring.sum_pi_squared.then(|| vec![0f32; n * width]);
        model.record_routes(matches!(routing, Routing::Record(_)));
        let layers = model.sparse_layer_count();
        let top_k = model.config().moe.as_ref().map_or(0, |m| m.top_k);
        let copy = |dst: &mut [f32], src: &[f32], chunk: &[usize], r: usize| {
            for (k, &row) in chunk.iter().enumerate() {
                let len = batch.rows[row].response_len;
                dst[row * width..row * width + len].copy_from_slice(&src[k * r..k * r + len]);
            }
        };
        let scored = tch::no_grad(|| -> Result<(), ActorError> {
            for chunk in batch.local_micro_batches(&batch.local_rows(), self.settings.max_token_len) {
                let refs = batch.samples(&chunk);
                let mb = MicroBatch::build_for(&refs, self.pad_id, model.device(), self.settings.remove_padding)?;
                if let Routing::Replay(routes) = routing {
                    model.set_router_replay(Some(routes.layout(&mb, &chunk, &refs, layers, top_k)?))?;
                }
                let (logits, _) = Self::response_logits(model, &mb, self.settings.temperature, false)?;
                match routing {
                    Routing::Record(routes) => routes.keep(&model.take_routes()?, &mb, &chunk, &refs)?,
                    Routing::Replay(_) => model.set_router_replay(None)?,
                    Routing::Free => {}
                }
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
        });
        model.record_routes(false);
        model.set_router_replay(None)?;
        scored?;
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
    pub(super) fn held_matrix(
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
}

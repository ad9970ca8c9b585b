//! MoE routing in the actor's passes: router replay and the load-balancing loss of each update micro-batch.
//!
//! - R2: the π_old pass records the experts each token of each held row was routed to; the update passes of the
//!   step route every token the same way, so the PPO ratio compares the same experts.
//! - R3: the rollout's routes, carried by the trajectories, are replayed in the π_old pass and the updates, so the
//!   trainer computes its log-probs on the experts that sampled the tokens.

use std::collections::BTreeMap;

use jetrl_model::{load_balancing_loss, CausalLm};
use tch::{Kind, Tensor};

use crate::batch::{MicroBatch, RankBatch, Sample};
use crate::error::ActorError;

/// Each held row's routes for the current step (from the π_old pass, or the rollout's): one `[tokens, top_k]`
/// int64 tensor per sparse layer over the row's prompt then response tokens, or its first tokens (a token no
/// forward read in the rollout has no route; it is routed by the filler, which only the unscored tail reaches).
#[derive(Debug, Default)]
pub(super) struct RowRoutes {
    rows: BTreeMap<usize, Vec<Tensor>>,
}

impl RowRoutes {
    pub fn clear(&mut self) {
        self.rows.clear();
    }

    /// The rollout's routes of the rows this rank holds (R3), checked against the model: its sparse layers, its
    /// experts per token and its expert count.
    pub fn from_rollout(batch: &RankBatch, model: &CausalLm) -> Result<Self, ActorError> {
        let layers = model.sparse_layer_count();
        let (top_k, experts) = model.config().moe.as_ref().map_or((0, 0), |m| (m.top_k, m.num_experts));
        let mut rows = BTreeMap::new();
        for (&row, sample) in &batch.local {
            if sample.routed_experts.is_empty() {
                return Err(ActorError::Batch(format!(
                    "router replay R3: trajectory {} carries no routed experts (is \
                     rollout.enable_rollout_routing_replay on for the workers that sampled it?)",
                    sample.key
                )));
            }
            if sample.routes_layout != (layers as u32, top_k as u32) {
                return Err(ActorError::Batch(format!(
                    "router replay R3: trajectory {} has routes of {} layers × {} experts; the model routes {layers} \
                     layers × {top_k}",
                    sample.key, sample.routes_layout.0, sample.routes_layout.1
                )));
            }
            if let Some(bad) = sample.routed_experts.iter().find(|&&e| i64::from(e) >= experts) {
                return Err(ActorError::Batch(format!(
                    "router replay R3: trajectory {} routes to expert {bad}; the model has {experts}",
                    sample.key
                )));
            }
            let ids: Vec<i64> = sample.routed_experts.iter().map(|&e| i64::from(e)).collect();
            let all = Tensor::f_from_slice(&ids)?.f_view([-1, layers as i64, top_k])?;
            let per_layer = (0..layers as i64).map(|l| all.f_select(1, l)).collect::<Result<Vec<_>, _>>()?;
            rows.insert(row, per_layer);
        }
        Ok(Self { rows })
    }

    /// Keeps the routes a micro-batch's forward recorded (`[N, top_k]` per sparse layer over its flattened
    /// tokens), split into its rows `chunk` (batch row indices) built from `samples`.
    pub fn keep(
        &mut self,
        recorded: &[Tensor],
        mb: &MicroBatch,
        chunk: &[usize],
        samples: &[&Sample],
    ) -> Result<(), ActorError> {
        for (&row, (start, len)) in chunk.iter().zip(mb.token_spans(samples)) {
            let routes = recorded.iter().map(|layer| layer.f_narrow(0, start, len)).collect::<Result<Vec<_>, _>>()?;
            self.rows.insert(row, routes);
        }
        Ok(())
    }

    /// The routes of `chunk`'s rows laid out as micro-batch `mb`'s forward reads its tokens, one `[N, top_k]`
    /// tensor per sparse layer; padding tokens, and a row's tokens past its known routes, get experts `0..top_k`
    /// (their outputs reach no scored position).
    pub fn layout(
        &self,
        mb: &MicroBatch,
        chunk: &[usize],
        samples: &[&Sample],
        layers: usize,
        top_k: i64,
    ) -> Result<Vec<Tensor>, ActorError> {
        let device = mb.input_ids.device();
        let mut held = Vec::with_capacity(chunk.len());
        let mut positions = Vec::new();
        for (row, (start, len)) in chunk.iter().zip(mb.token_spans(samples)) {
            let routes = self
                .rows
                .get(row)
                .filter(|r| r.len() == layers)
                .ok_or_else(|| ActorError::Batch(format!("router replay: no routes for row {row} of the step")))?;
            let known = routes.first().map_or(0, |t| t.size()[0]).min(len);
            positions.extend(start..start + known);
            held.push((routes, known));
        }
        let positions = Tensor::f_from_slice(&positions)?.f_to_device(device)?;
        let filler = Tensor::f_arange(top_k, (Kind::Int64, device))?.f_expand([mb.token_count(), top_k], false)?;
        (0..layers)
            .map(|layer| {
                let parts = held
                    .iter()
                    .map(|(routes, known)| routes[layer].f_narrow(0, 0, *known)?.f_to_device(device))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut out = filler.f_contiguous()?;
                let _ = out.f_index_copy_(0, &positions, &Tensor::f_cat(&parts, 0)?)?;
                Ok(out)
            })
            .collect()
    }

    /// The routes of a resampled batch (PF-PPO): row `k` gets what row `picked[k]` had.
    pub fn resample(&mut self, picked: &[usize]) {
        let rows = std::mem::take(&mut self.rows);
        self.rows = picked
            .iter()
            .enumerate()
            .filter_map(|(k, old)| rows.get(old).map(|routes| (k, routes.iter().map(Tensor::shallow_clone).collect())))
            .collect();
    }
}

/// The load-balancing loss of the forward the model just ran with router logits collected, over its real tokens
/// (`mb`'s attention mask; every token of a packed row is real).
pub(super) fn aux_loss(model: &CausalLm, mb: &MicroBatch, top_k: i64) -> Result<Tensor, ActorError> {
    let logits = model.take_router_logits();
    let mask = match &mb.packed {
        None => Some(mb.attention_mask.f_reshape([-1])?),
        Some(_) => None,
    };
    Ok(load_balancing_loss(&logits, top_k, mask.as_ref())?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use jetrl_model::{DType, ModelConfig};
    use serde_json::json;
    use tch::Device;

    use super::*;

    fn moe_model() -> CausalLm {
        let cfg = ModelConfig::from_json(json!({
            "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        }))
        .unwrap();
        tch::manual_seed(7);
        CausalLm::random(cfg, Device::Cpu, DType::F32, 0.2).unwrap()
    }

    fn samples() -> Vec<Sample> {
        [(vec![5u32, 9, 14, 2], vec![3u32, 8]), (vec![21, 7], vec![30, 4, 11, 40, 6]), (vec![1, 2, 3], vec![9])]
            .into_iter()
            .map(|(prompt, response)| Sample {
                response_mask: vec![1; response.len()],
                prompt,
                response,
                ..Sample::default()
            })
            .collect()
    }

    /// Response log-probs `[n, r]` of a micro-batch of `rows`, replaying `routes` when given.
    fn scored(model: &CausalLm, all: &[Sample], rows: &[usize], packed: bool, routes: Option<&RowRoutes>) -> Tensor {
        let refs: Vec<&Sample> = rows.iter().map(|&r| &all[r]).collect();
        let mb = MicroBatch::build_for(&refs, 0, Device::Cpu, packed).unwrap();
        if let Some(routes) = routes {
            model.set_router_replay(Some(routes.layout(&mb, rows, &refs, 2, 2).unwrap())).unwrap();
        }
        let (hidden, _) = tch::no_grad(|| mb.response_hidden(model, false)).unwrap();
        model.set_router_replay(None).unwrap();
        let lp = jetrl_algos::logprobs_from_logits(&model.lm_head(&hidden).unwrap(), mb.scored_ids());
        mb.to_rows(&lp).unwrap()
    }

    /// Routes kept from a padded micro-batch of every row replay exactly into a packed one and into a padded one
    /// of other rows in another order (a wrong layout would give tokens other tokens' experts).
    #[test]
    fn routes_kept_from_one_layout_replay_exactly_in_another() {
        let (model, all) = (moe_model(), samples());
        let refs: Vec<&Sample> = all.iter().collect();
        let mb = MicroBatch::build_for(&refs, 0, Device::Cpu, false).unwrap();
        model.record_routes(true);
        let _ = tch::no_grad(|| mb.response_hidden(&model, false)).unwrap();
        let mut routes = RowRoutes::default();
        routes.keep(&model.take_routes().unwrap(), &mb, &[0, 1, 2], &refs).unwrap();
        model.record_routes(false);

        for (rows, packed) in [(vec![0, 1, 2], true), (vec![2, 0], false), (vec![1, 2], true)] {
            let free = scored(&model, &all, &rows, packed, None);
            let replayed = scored(&model, &all, &rows, packed, Some(&routes));
            let diff = f64::try_from((&free - &replayed).abs().max()).unwrap();
            assert!(diff < 1e-5, "rows {rows:?} packed {packed}: replayed routes give other log-probs ({diff})");
        }
        // and the replay is live: other rows' routes change the output
        let mut swapped = RowRoutes::default();
        swapped.rows.insert(1, routes.rows[&0].iter().map(|t| t.narrow(0, 0, 1).repeat([7, 1])).collect());
        swapped.rows.insert(2, routes.rows[&2].iter().map(Tensor::shallow_clone).collect());
        let diff = f64::try_from(
            (&scored(&model, &all, &[1, 2], true, None) - &scored(&model, &all, &[1, 2], true, Some(&swapped)))
                .abs()
                .max(),
        )
        .unwrap();
        assert!(diff > 1e-4, "replayed routes must reach the forward ({diff})");
    }
}

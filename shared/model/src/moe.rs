//! The sparse mixture-of-experts feed-forward of Qwen2-MoE and Qwen3-MoE, and the routing a trainer replays.
//!
//! A router (`mlp.gate`, `[experts, hidden]`) scores every token; the token goes to its `top_k` experts, each a
//! SwiGLU MLP (`mlp.experts.<e>.{gate,up,down}_proj`, the checkpoint's own names), and their outputs are summed
//! weighted by the routing probabilities (renormalised over the top k when `norm_topk_prob`). Qwen2-MoE adds a
//! shared expert every token passes through, scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! The experts run grouped: the (token, expert) assignments are sorted by expert, each expert with tokens runs one
//! matmul over its contiguous slice, and the results are added back per token in ascending expert order (the order
//! transformers adds them in). No per-token loop and no pass of every expert over every token.
//!
//! Each block keeps a [`RouteTape`]: the routes to replay instead of the router's own choice (router replay, R3:
//! the experts the rollout chose, so training routes as the rollout did; the weights still come from the current
//! router, so it keeps learning), the routes it chose (recorded for a later replay), and the router logits of the
//! forward for the load-balancing loss.

use std::cell::RefCell;

use tch::nn::Path;
use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::layers::{Linear, Mlp};

/// What a block replays, records and keeps across forward passes (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct RouteTape {
    /// `[N, top_k]` int64 experts to route the next forward's `N` tokens to (in its flattened token order)
    replay: Option<Tensor>,
    /// the experts each forward chose, `[N, top_k]` int64 per forward, while recording
    recorded: Option<Vec<Tensor>>,
    /// the router logits `[N, experts]` of each forward (in the autograd graph), while collecting
    logits: Option<Vec<Tensor>>,
}

/// One decoder layer's sparse feed-forward.
#[derive(Debug)]
pub struct SparseMoe {
    /// the router, `[experts, hidden]`, no bias
    pub(crate) gate: Linear,
    pub(crate) experts: Vec<Mlp>,
    /// Qwen2-MoE's dense expert and its `[1, hidden]` gate
    pub(crate) shared_expert: Option<(Mlp, Linear)>,
    top_k: i64,
    norm_topk_prob: bool,
    tape: RefCell<RouteTape>,
}

/// A forward's routing: each token's experts and their weights.
struct Routing {
    /// `[N, top_k]` int64
    experts: Tensor,
    /// `[N, top_k]` in the model's dtype
    weights: Tensor,
}

impl SparseMoe {
    pub fn new(vs: Path, cfg: &ModelConfig, moe: &MoeConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let experts = (0..moe.num_experts)
            .map(|e| Mlp::with_width(&vs / "experts" / e, h, moe.moe_intermediate_size, false))
            .collect::<Result<Vec<_>>>()?;
        let shared_expert = match moe.shared_expert_intermediate_size {
            Some(width) => Some((
                Mlp::with_width(&vs / "shared_expert", h, width, false)?,
                Linear::new(&vs / "shared_expert_gate", h, 1, false)?,
            )),
            None => None,
        };
        Ok(SparseMoe {
            gate: Linear::new(&vs / "gate", h, moe.num_experts, false)?,
            experts,
            shared_expert,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            tape: RefCell::new(RouteTape::default()),
        })
    }

    /// `x` `[B, T, H]` → `[B, T, H]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.size3()?;
        let flat = x.f_reshape([b * t, h])?;
        let routing = self.route(&flat)?;
        let mut y = self.experts_forward(&flat, &routing)?;
        if let Some((expert, gate)) = &self.shared_expert {
            let scale = gate.forward(&flat)?.f_sigmoid()?;
            y = y.f_add(&scale.f_mul(&expert.forward(&flat)?)?)?;
        }
        Ok(y.f_reshape([b, t, h])?)
    }

    /// The router's choice for `x` `[N, H]` (or the replayed one), recorded and kept as the tape says.
    fn route(&self, x: &Tensor) -> Result<Routing> {
        let n = x.size()[0];
        let logits = self.gate.forward(x)?;
        let probs = logits.f_softmax(-1, Kind::Float)?;
        let mut tape = self.tape.borrow_mut();
        let (top, experts) = match &tape.replay {
            Some(experts) => {
                if experts.size() != [n, self.top_k] {
                    return Err(ModelError::Input(format!(
                        "router replay holds routes of shape {:?} for a forward of {n} tokens routed to {} experts \
                         each",
                        experts.size(),
                        self.top_k
                    )));
                }
                let experts = experts.f_to_device(x.device())?;
                (probs.f_gather(-1, &experts, false)?, experts)
            }
            None => probs.f_topk(self.top_k, -1, true, true)?,
        };
        let top = if self.norm_topk_prob { top.f_div(&top.f_sum_dim_intlist(-1, true, Kind::Float)?)? } else { top };
        if let Some(recorded) = &mut tape.recorded {
            recorded.push(experts.f_detach()?);
        }
        if let Some(kept) = &mut tape.logits {
            kept.push(logits.shallow_clone());
        }
        Ok(Routing { experts, weights: top.f_to_kind(logits.kind())? })
    }

    /// The routed experts' weighted sum for `x` `[N, H]`, grouped by expert (see the module docs).
    fn experts_forward(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let k = self.top_k;
        let assignments = routing.experts.f_reshape([-1])?;
        let order = assignments.f_argsort_stable(true, 0, false)?;
        let tokens = order.f_floor_divide_scalar(k)?;
        let weights = routing.weights.f_reshape([-1])?.f_index_select(0, &order)?;
        let counts = assignments.f_bincount(None::<&Tensor>, self.experts.len() as i64)?;
        let counts = Vec::<i64>::try_from(counts.f_to_device(Device::Cpu)?)
            .map_err(|e| ModelError::Generation(format!("reading the experts' token counts: {e}")))?;
        let inputs = x.f_index_select(0, &tokens)?;
        let mut outputs = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (expert, &count) in self.experts.iter().zip(&counts) {
            if count > 0 {
                outputs.push(expert.forward(&inputs.f_narrow(0, start, count)?)?);
                start += count;
            }
        }
        let outputs = Tensor::f_cat(&outputs, 0)?.f_mul(&weights.f_unsqueeze(-1)?)?;
        Ok(x.f_zeros_like()?.f_index_add(0, &tokens, &outputs)?)
    }

    pub(crate) fn tape(&self) -> std::cell::RefMut<'_, RouteTape> {
        self.tape.borrow_mut()
    }
}

impl RouteTape {
    pub(crate) fn replay(&mut self, routes: Option<Tensor>) {
        self.replay = routes;
    }

    pub(crate) fn record(&mut self, on: bool) {
        self.recorded = on.then(Vec::new);
    }

    pub(crate) fn take_recorded(&mut self) -> Result<Option<Tensor>> {
        match self.recorded.as_mut().map(std::mem::take) {
            Some(parts) if !parts.is_empty() => Ok(Some(Tensor::f_cat(&parts, 0)?)),
            _ => Ok(None),
        }
    }

    pub(crate) fn collect_logits(&mut self, on: bool) {
        self.logits = on.then(Vec::new);
    }

    pub(crate) fn take_logits(&mut self) -> Vec<Tensor> {
        self.logits.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

/// transformers' `load_balancing_loss_func` (the Switch Transformer's auxiliary loss) over every sparse layer's
/// router logits `[N, experts]` of one forward: `experts · Σ_e f_e · P_e`, where `f_e` is the share of top-k
/// assignments expert `e` received and `P_e` its mean routing probability, both over the real tokens (`mask`
/// `[N]`, 1 = token, when given). Its gradient reaches the routers through `P_e`. A scalar f32; 0 with no layers.
pub fn load_balancing_loss(router_logits: &[Tensor], top_k: i64, mask: Option<&Tensor>) -> Result<Tensor> {
    let Some(first) = router_logits.first() else {
        return Ok(Tensor::f_zeros([], (Kind::Float, Device::Cpu))?);
    };
    let (device, experts) = (first.device(), first.size().last().copied().unwrap_or(0));
    let mut tokens_per_expert = Tensor::f_zeros([experts], (Kind::Float, device))?;
    let mut prob_sum = Tensor::f_zeros([experts], (Kind::Float, device))?;
    let mut rows = Tensor::f_zeros([], (Kind::Float, device))?;
    for logits in router_logits {
        let probs = logits.f_softmax(-1, Kind::Float)?;
        let n = probs.size()[0];
        let weight = match mask {
            Some(mask) => mask.f_reshape([-1])?.f_to_device(device)?.f_to_kind(Kind::Float)?,
            None => Tensor::f_ones([n], (Kind::Float, device))?,
        };
        let (_, selected) = probs.f_topk(top_k, -1, true, true)?;
        let counts = Tensor::f_zeros([experts], (Kind::Float, device))?.f_scatter_add(
            0,
            &selected.f_reshape([-1])?,
            &weight.f_repeat_interleave_self_int(top_k, None, None)?,
        )?;
        tokens_per_expert = tokens_per_expert.f_add(&counts)?;
        prob_sum =
            prob_sum.f_add(&probs.f_mul(&weight.f_unsqueeze(-1)?)?.f_sum_dim_intlist(0, false, Kind::Float)?)?;
        rows = rows.f_add(&weight.f_sum(Kind::Float)?)?;
    }
    let f = tokens_per_expert.f_div(&rows)?;
    let p = prob_sum.f_div(&rows)?;
    Ok(f.f_mul(&p)?.f_sum(Kind::Float)?.f_mul_scalar(experts as f64)?)
}

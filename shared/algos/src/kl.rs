//! KL estimators between the policy and the reference (verl `kl_penalty`), the KL-in-reward penalty
//! (`apply_kl_penalty`) and the fixed / adaptive KL coefficient controllers.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::masked::{masked_mean, Axis};
use crate::util::{check_same_2d, item};
use crate::AlgoError;

pub use jetrl_config::{KlEstimator, KlPenalty};

/// The per-token KL estimate (same shape as the inputs, differentiable in `logprob`).
///
/// Panics like any tensor op if the shapes cannot broadcast; [`f_kl_penalty`] checks them first.
pub fn kl_penalty(logprob: &Tensor, ref_logprob: &Tensor, kind: KlPenalty) -> Tensor {
    let forward = kl_forward(logprob, ref_logprob, kind.estimator);
    if !kind.straight_through {
        return forward;
    }
    let k2 = (logprob - ref_logprob).square() * 0.5;
    &k2 - k2.detach() + forward.detach()
}

/// [`kl_penalty`] for `[batch, response_len]` inputs of untrusted shape.
pub fn f_kl_penalty(logprob: &Tensor, ref_logprob: &Tensor, kind: KlPenalty) -> Result<Tensor, AlgoError> {
    check_same_2d(&[("logprob", logprob), ("ref_logprob", ref_logprob)]).map_err(AlgoError::KlPenalty)?;
    Ok(kl_penalty(logprob, ref_logprob, kind))
}

fn kl_forward(logprob: &Tensor, ref_logprob: &Tensor, estimator: KlEstimator) -> Tensor {
    match estimator {
        KlEstimator::K1 => logprob - ref_logprob,
        KlEstimator::Abs => (logprob - ref_logprob).abs(),
        KlEstimator::K2 => (logprob - ref_logprob).square() * 0.5,
        KlEstimator::K3 => {
            let x = (ref_logprob - logprob).clamp(-20.0, 20.0);
            (x.exp() - &x - 1.0).clamp(-10.0, 10.0)
        }
    }
}

/// Token rewards with a fixed KL ratio: `scores − (old − ref)·kl_ratio` (verl `compute_rewards`).
pub fn compute_rewards(
    token_level_scores: &Tensor,
    old_log_prob: &Tensor,
    ref_log_prob: &Tensor,
    kl_ratio: f64,
) -> Tensor {
    token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio
}

/// The KL coefficient β of the in-reward penalty, and its state (serialisable, to checkpoint it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum KlController {
    /// β never changes.
    Fixed { value: f64 },
    /// Ziegler et al.: β is nudged towards the value that keeps the observed KL near `target_kl`.
    Adaptive { value: f64, target_kl: f64, horizon: f64 },
}

impl KlController {
    /// A controller from `algorithm.kl_ctrl` (`type: fixed | adaptive`).
    pub fn from_config(cfg: &jetrl_config::KlCtrlConfig) -> Result<Self, AlgoError> {
        match cfg.kind {
            jetrl_config::KlCtrlType::Fixed => Ok(Self::Fixed { value: cfg.kl_coef }),
            jetrl_config::KlCtrlType::Adaptive => Self::adaptive(cfg.kl_coef, cfg.target_kl, cfg.horizon),
        }
    }

    /// An adaptive controller; `horizon` must be > 0 and `target_kl` non-zero.
    pub fn adaptive(init_kl_coef: f64, target_kl: f64, horizon: f64) -> Result<Self, AlgoError> {
        if horizon.is_nan() || horizon <= 0.0 {
            return Err(AlgoError::KlController(format!("algorithm.kl_ctrl.horizon must be > 0, got {horizon}")));
        }
        if target_kl == 0.0 || !target_kl.is_finite() {
            return Err(AlgoError::KlController(format!(
                "algorithm.kl_ctrl.target_kl must be a non-zero number, got {target_kl}"
            )));
        }
        Ok(Self::Adaptive { value: init_kl_coef, target_kl, horizon })
    }

    /// The current coefficient β.
    pub fn value(&self) -> f64 {
        match self {
            Self::Fixed { value } | Self::Adaptive { value, .. } => *value,
        }
    }

    /// Feeds the KL observed over `n_steps` samples: `β *= 1 + clip(kl/target − 1, ±0.2)·n_steps/horizon`.
    pub fn update(&mut self, current_kl: f64, n_steps: u64) {
        if let Self::Adaptive { value, target_kl, horizon } = self {
            let proportional_error = (current_kl / *target_kl - 1.0).clamp(-0.2, 0.2);
            let mult = 1.0 + proportional_error * n_steps as f64 / *horizon;
            *value *= mult;
        }
    }
}

/// What [`apply_kl_penalty`] reports: `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlPenaltyMetrics {
    /// Batch mean of the per-sequence masked mean of the KL.
    pub current_kl: f64,
    /// The β that was applied (before this batch's controller update).
    pub coefficient: f64,
}

/// KL in the reward: `token_level_rewards = scores − β·kl(old, ref)·mask`, then the controller is updated
/// with the batch KL over `batch` samples. Uses the old (behaviour-of-the-update) log-probs, as verl.
pub fn apply_kl_penalty(
    token_level_scores: &Tensor,
    old_log_probs: &Tensor,
    ref_log_prob: &Tensor,
    response_mask: &Tensor,
    kind: KlPenalty,
    controller: &mut KlController,
) -> Result<(Tensor, KlPenaltyMetrics), AlgoError> {
    let (batch, _) = check_same_2d(&[
        ("token_level_scores", token_level_scores),
        ("old_log_probs", old_log_probs),
        ("ref_log_prob", ref_log_prob),
        ("response_mask", response_mask),
    ])
    .map_err(AlgoError::KlPenalty)?;
    tch::no_grad(|| {
        let mask = crate::util::mask_like(response_mask, token_level_scores);
        let kld = kl_penalty(old_log_probs, ref_log_prob, kind) * &mask;
        let beta = controller.value();
        let rewards = token_level_scores - &kld * beta;
        let current_kl =
            if batch == 0 { 0.0 } else { item(&masked_mean(&kld, response_mask, Axis::Last).mean(None::<tch::Kind>)) };
        controller.update(current_kl, batch as u64);
        Ok((rewards, KlPenaltyMetrics { current_kl, coefficient: beta }))
    })
}

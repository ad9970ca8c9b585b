//! The clipped value-function loss of PPO's critic (verl `compute_value_loss`).

use tch::Tensor;

use crate::agg::{agg_loss, AggMode, GlobalBatchInfo};
use crate::masked::{masked_mean, Axis};
use crate::util::{check_same_2d, item};
use crate::AlgoError;

/// The value-loss metrics (`critic/vf_clipfrac`, `critic/vpred_mean`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValueLossMetrics {
    /// Fraction of valid tokens where the clipped prediction gave the larger error.
    pub vf_clipfrac: f64,
    pub vpred_mean: f64,
}

/// `½·agg(max((v−R)², (clip(v, V_old ± c) − R)²))`, differentiable in `vpreds`.
pub fn compute_value_loss(
    vpreds: &Tensor,
    returns: &Tensor,
    values: &Tensor,
    response_mask: &Tensor,
    cliprange_value: f64,
    mode: AggMode,
    info: &GlobalBatchInfo,
) -> Result<(Tensor, ValueLossMetrics), AlgoError> {
    check_same_2d(&[("vpreds", vpreds), ("returns", returns), ("values", values), ("response_mask", response_mask)])
        .map_err(AlgoError::ValueLoss)?;
    let clipped = vpreds.minimum(&(values + cliprange_value)).maximum(&(values - cliprange_value));
    let unclipped_loss = (vpreds - returns).square();
    let clipped_loss = (&clipped - returns).square();
    let loss_mat = unclipped_loss.maximum(&clipped_loss);
    let vf_loss = agg_loss(&loss_mat, response_mask, mode, info)? * 0.5;
    let metrics = tch::no_grad(|| ValueLossMetrics {
        vf_clipfrac: item(&masked_mean(
            &clipped_loss.gt_tensor(&unclipped_loss).to_kind(vpreds.kind()),
            response_mask,
            Axis::All,
        )),
        vpred_mean: item(&masked_mean(vpreds, response_mask, Axis::All)),
    });
    Ok((vf_loss, metrics))
}

//! `agg_loss`: a `[batch, response_len]` loss matrix to the scalar that is back-propagated, with verl's
//! global-batch normalisation so that the gradients of the micro-batches of one mini-batch, summed (and
//! averaged over data-parallel ranks), equal the gradient of the loss over the whole mini-batch.

use tch::Tensor;

use crate::masked::{masked_sum, Axis};
use crate::util::{check_same_2d, mask_like, sum_all, sum_last};
use crate::AlgoError;

pub use jetrl_config::AggMode;

/// The mini-batch a micro-batch belongs to (verl's `global_batch_info`). With the defaults the loss is
/// normalised by the micro-batch itself, which is right only when the micro-batch is the whole mini-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GlobalBatchInfo {
    /// Data-parallel ranks that average their gradients; each rank's loss is scaled up by it.
    pub dp_size: i64,
    /// Valid tokens (Σ loss_mask) of the whole mini-batch over all ranks, for `token-mean`.
    pub batch_num_tokens: Option<f64>,
    /// Sequences of the whole mini-batch over all ranks, for the `seq-mean-*` modes.
    pub global_batch_size: Option<f64>,
    /// Divisor of `seq-mean-token-sum-norm`; default the padded response length of the micro-batch.
    pub loss_scale_factor: Option<f64>,
}

impl Default for GlobalBatchInfo {
    fn default() -> Self {
        Self { dp_size: 1, batch_num_tokens: None, global_batch_size: None, loss_scale_factor: None }
    }
}

impl GlobalBatchInfo {
    /// Whether the loss is a partial sum of a larger batch (then per-micro-batch loss metrics are summed,
    /// not averaged, to report the mini-batch loss; verl's `AggregationType.SUM`).
    pub fn is_partial(&self) -> bool {
        self.dp_size > 1
            || self.batch_num_tokens.is_some()
            || self.global_batch_size.is_some()
            || self.loss_scale_factor.is_some()
    }
}

/// Aggregates `loss_mat` over `loss_mask` (both `[batch, response_len]`) into a differentiable scalar.
///
/// Where verl would divide 0 by 0 (no valid token or sequence and no global count) the result is 0, not NaN.
pub fn agg_loss(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    mode: AggMode,
    info: &GlobalBatchInfo,
) -> Result<Tensor, AlgoError> {
    let fail = |message: String| AlgoError::Aggregation { mode: mode.as_str(), message };
    check_same_2d(&[("loss_mat", loss_mat), ("loss_mask", loss_mask)]).map_err(fail)?;
    if info.dp_size < 1 {
        return Err(fail(format!("dp_size must be >= 1, got {}", info.dp_size)));
    }
    let dp = info.dp_size as f64;
    let weights = mask_like(loss_mask, loss_mat);
    let loss = match mode {
        AggMode::TokenMean => {
            let total = masked_sum(loss_mat, loss_mask, Axis::All);
            match info.batch_num_tokens {
                Some(tokens) if tokens > 0.0 => total / tokens * dp,
                Some(tokens) => return Err(fail(format!("batch_num_tokens must be > 0, got {tokens}"))),
                None if info.dp_size > 1 => {
                    return Err(fail("the global batch_num_tokens is required when dp_size > 1".into()))
                }
                None => total / nonzero(&sum_all(&weights)) * dp,
            }
        }
        AggMode::TokenSum => masked_sum(loss_mat, loss_mask, Axis::All) * dp,
        AggMode::SeqMeanTokenSum | AggMode::SeqMeanTokenSumNorm | AggMode::SeqMeanTokenMean => {
            let tokens_per_seq = sum_last(&weights);
            let token_sums = masked_sum(loss_mat, loss_mask, Axis::Last);
            let seq_losses =
                if mode == AggMode::SeqMeanTokenMean { token_sums / (&tokens_per_seq + 1e-8) } else { token_sums };
            let seq_mask = tokens_per_seq.gt(0.0).to_kind(loss_mat.kind());
            let total = masked_sum(&seq_losses, &seq_mask, Axis::All);
            let mean = match info.global_batch_size {
                Some(size) if size > 0.0 => total / size * dp,
                Some(size) => return Err(fail(format!("global_batch_size must be > 0, got {size}"))),
                None if info.dp_size > 1 => {
                    return Err(fail("the global_batch_size is required when dp_size > 1".into()))
                }
                None => total / nonzero(&sum_all(&seq_mask)) * dp,
            };
            if mode == AggMode::SeqMeanTokenSumNorm {
                let horizon = loss_mat.size()[1] as f64;
                let factor = info.loss_scale_factor.unwrap_or(horizon);
                if factor == 0.0 {
                    return Err(fail("loss_scale_factor must not be 0".into()));
                }
                mean / factor
            } else {
                mean
            }
        }
    };
    Ok(loss)
}

/// A count used as a divisor, with 0 replaced by 1 (the numerator is then 0 too).
fn nonzero(count: &Tensor) -> Tensor {
    count.masked_fill(&count.eq(0.0), 1.0)
}

//! Masked reductions with verl's semantics (`verl/utils/torch_functional.py`): positions where the mask is 0
//! never contribute, not even a NaN; means divide by `Σmask + 1e-8`; the variance is unbiased (Bessel) and
//! refuses masks with fewer than two valid elements.

use tch::Tensor;

use crate::util::{item, mask_like, sum_all, sum_last};
use crate::AlgoError;

/// The reduction axis of [`masked_sum`] / [`masked_mean`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// Over every element: a 0-dim result.
    All,
    /// Over the last dimension (per row of `[batch, response_len]`).
    Last,
}

/// `Σ values·mask`, with masked-out positions replaced by 0 first so a NaN or inf there cannot leak in.
pub fn masked_sum(values: &Tensor, mask: &Tensor, axis: Axis) -> Tensor {
    let weights = mask_like(mask, values);
    let kept = values.masked_fill(&mask.eq(0.0), 0.0) * &weights;
    match axis {
        Axis::All => sum_all(&kept),
        Axis::Last => sum_last(&kept),
    }
}

/// `masked_sum / (Σmask + 1e-8)`.
pub fn masked_mean(values: &Tensor, mask: &Tensor, axis: Axis) -> Tensor {
    let weights = mask_like(mask, values);
    let count = match axis {
        Axis::All => sum_all(&weights),
        Axis::Last => sum_last(&weights),
    };
    masked_sum(values, mask, axis) / (count + 1e-8)
}

/// Masked variance over all elements; unbiased (times `n/(n−1)`) like verl's default, which rejects `n ≤ 1`.
pub fn masked_var(values: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor, AlgoError> {
    let mean = masked_mean(values, mask, Axis::All);
    let centered = values - &mean;
    let variance = masked_mean(&centered.square(), mask, Axis::All);
    if !unbiased {
        return Ok(variance);
    }
    let count = item(&sum_all(&mask_like(mask, values)));
    if count == 0.0 {
        return Err(AlgoError::Masked("the mask selects no element; the variance is undefined".into()));
    }
    if count == 1.0 {
        return Err(AlgoError::Masked(
            "the mask selects a single element; the unbiased variance divides by zero (use a larger batch)".into(),
        ));
    }
    Ok(variance * (count / (count - 1.0)))
}

/// `(values − mean)·rsqrt(var + 1e-8)` with mean and unbiased variance over the masked elements; with
/// `shift_mean = false` the mean is added back. Every element is transformed, masked or not (as verl).
pub fn masked_whiten(values: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor, AlgoError> {
    let mean = masked_mean(values, mask, Axis::All);
    let var = masked_var(values, mask, true)?;
    let whitened = (values - &mean) * (var + 1e-8).rsqrt();
    Ok(if shift_mean { whitened } else { whitened + mean })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn t(rows: &[&[f64]]) -> Tensor {
        let width = rows[0].len() as i64;
        let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat).reshape([rows.len() as i64, width])
    }

    #[test]
    fn nan_under_the_mask_does_not_leak_into_sums_or_means() {
        let values = t(&[&[1.0, f64::NAN], &[3.0, 4.0]]);
        let mask = t(&[&[1.0, 0.0], &[1.0, 1.0]]);
        assert_eq!(item(&masked_sum(&values, &mask, Axis::All)), 8.0);
        let rows = masked_mean(&values, &mask, Axis::Last);
        assert!((rows.double_value(&[0]) - 1.0).abs() < 1e-7);
        assert!((rows.double_value(&[1]) - 3.5).abs() < 1e-7);
    }

    #[test]
    fn unbiased_variance_applies_bessel_and_rejects_single_element_masks() {
        let values = t(&[&[1.0, 2.0, 3.0, 100.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0, 0.0]]);
        let var = item(&masked_var(&values, &mask, true).expect("three elements"));
        assert!((var - 1.0).abs() < 1e-6, "{var}");
        let single = t(&[&[1.0, 0.0, 0.0, 0.0]]);
        assert!(matches!(masked_var(&values, &single, true), Err(AlgoError::Masked(_))));
        let none = Tensor::zeros([1, 4], (Kind::Double, tch::Device::Cpu));
        assert!(matches!(masked_whiten(&values, &none, true), Err(AlgoError::Masked(_))));
    }
}

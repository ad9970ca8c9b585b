//! Rollout correction (verl `rollout_corr_helper.py`): importance-sampling weights π_train/π_rollout that
//! correct for the gap between the policy that generated a trajectory (another engine, an older version)
//! and the policy being trained, and rejection masks that drop tokens or sequences whose divergence is out
//! of bounds. Everything here is detached: the weights change the measure, not the objective.

use std::collections::BTreeMap;
use std::fmt;

use jetrl_config::{RolloutCorrectionConfig, ThresholdSpec};
use tch::{Kind, Tensor};

use crate::masked::{masked_mean, masked_sum, Axis};
use crate::util::{check_same_2d, item, mask_like, sum_all, sum_last};
use crate::AlgoError;

/// Exponents are clamped to ±20 before `exp` (exp(20) ≈ 4.9e8).
const SAFETY_BOUND: f64 = 20.0;

/// The granularity of the IS weights (`rollout_is`).
pub use jetrl_config::RolloutIsLevel as IsLevel;

/// What happens to IS weights out of range (`rollout_is_threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IsThreshold {
    /// Truncated IS: weights are clamped to at most `upper` (a number in the config).
    Truncate { upper: f64 },
    /// IcePop: weights outside `[lower, upper]` become 0 (`"lower_upper"` in the config).
    IcePop { lower: f64, upper: f64 },
}

impl IsThreshold {
    /// Parses verl's threshold forms: `2.0`, `"2.0"` or `"0.5_2.0"`.
    pub fn parse(spec: &ThresholdSpec) -> Result<Self, AlgoError> {
        let fail = |message: String| AlgoError::RolloutCorrection(format!("rollout_is_threshold {spec}: {message}"));
        let parsed = match spec {
            ThresholdSpec::Number(upper) => Self::Truncate { upper: *upper },
            ThresholdSpec::Text(text) => {
                let text = text.trim();
                if text.is_empty() {
                    return Err(fail("must not be empty".into()));
                }
                match text.split_once('_') {
                    Some((lower, upper)) => Self::IcePop {
                        lower: parse_number(lower).map_err(fail)?,
                        upper: parse_number(upper).map_err(fail)?,
                    },
                    None => Self::Truncate { upper: parse_number(text).map_err(fail)? },
                }
            }
        };
        match parsed {
            Self::Truncate { upper } | Self::IcePop { upper, .. } if upper.is_nan() || upper <= 0.0 => {
                Err(fail(format!("the upper bound must be positive, got {upper}")))
            }
            Self::IcePop { lower, .. } if lower.is_nan() || lower <= 0.0 => {
                Err(fail(format!("the lower bound must be positive, got {lower}")))
            }
            Self::IcePop { lower, upper } if lower > upper => {
                Err(fail("the lower bound must be <= the upper bound".into()))
            }
            ok => Ok(ok),
        }
    }

    fn upper(&self) -> f64 {
        match self {
            Self::Truncate { upper } | Self::IcePop { upper, .. } => *upper,
        }
    }
}

fn parse_number(text: &str) -> Result<f64, String> {
    text.trim().parse::<f64>().map_err(|_| format!("{text:?} is not a number"))
}

/// The divergence estimator a rejection criterion thresholds, from `r = log π_train − log π_rollout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsStatistic {
    /// `−r`, kept within `[ln lower, ln upper]`.
    K1,
    /// `½r²`, kept at most `upper`.
    K2,
    /// `exp(r) − 1 − r`, kept at most `upper`.
    K3,
}

/// Where a rejection criterion is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsLevel {
    /// Each token on its own.
    Token,
    /// The sum of the statistic over the sequence's valid tokens.
    SeqSum,
    /// The masked mean over the sequence.
    SeqMean,
    /// The maximum over the sequence's valid tokens (k2, k3 only).
    SeqMax,
}

/// One rejection criterion (`rollout_rs` option with its `rollout_rs_threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RejectionCriterion {
    pub level: RsLevel,
    pub statistic: RsStatistic,
    /// Ratio lower bound (k1 only).
    pub lower: Option<f64>,
    /// Ratio upper bound for k1, divergence upper bound for k2/k3.
    pub upper: f64,
}

impl fmt::Display for RejectionCriterion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match self.level {
            RsLevel::Token => "token",
            RsLevel::SeqSum => "seq_sum",
            RsLevel::SeqMean => "seq_mean",
            RsLevel::SeqMax => "seq_max",
        };
        let statistic = match self.statistic {
            RsStatistic::K1 => "k1",
            RsStatistic::K2 => "k2",
            RsStatistic::K3 => "k3",
        };
        write!(f, "{level}_{statistic}")
    }
}

const RS_OPTIONS: &str =
    "token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, \
     seq_max_k2, seq_max_k3";

fn parse_rs_option(name: &str) -> Result<(RsLevel, RsStatistic), AlgoError> {
    let unknown = || {
        AlgoError::UnknownName(jetrl_config::UnknownValue {
            what: "rollout_rs option",
            value: name.to_string(),
            expected: RS_OPTIONS.into(),
        })
    };
    let (level, statistic) = name.rsplit_once('_').ok_or_else(unknown)?;
    let level = match level {
        "token" => RsLevel::Token,
        "seq_sum" => RsLevel::SeqSum,
        "seq_mean" => RsLevel::SeqMean,
        "seq_max" => RsLevel::SeqMax,
        _ => return Err(unknown()),
    };
    let statistic = match statistic {
        "k1" if level != RsLevel::SeqMax => RsStatistic::K1,
        "k2" => RsStatistic::K2,
        "k3" => RsStatistic::K3,
        _ => return Err(unknown()),
    };
    Ok((level, statistic))
}

/// Parses `rollout_rs` (comma-separated options, duplicates dropped) with `rollout_rs_threshold` (one value
/// for all options or one per option; `*_k1` options take `"lower_upper"` or an upper bound whose reciprocal
/// is the lower bound).
pub fn parse_rejection(options: &str, threshold: Option<&ThresholdSpec>) -> Result<Vec<RejectionCriterion>, AlgoError> {
    let fail = |message: String| AlgoError::RolloutCorrection(message);
    let mut names: Vec<&str> = Vec::new();
    for name in options.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.is_empty() {
        return Err(fail("rollout_rs must name at least one option".into()));
    }
    let threshold = threshold.ok_or_else(|| fail("rollout_rs_threshold must be set when rollout_rs is".into()))?;
    let mut specs: Vec<String> = match threshold {
        ThresholdSpec::Number(value) => vec![format!("{value:?}")],
        ThresholdSpec::Text(text) => {
            text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
        }
    };
    if specs.is_empty() {
        return Err(fail("rollout_rs_threshold must contain at least one value".into()));
    }
    if specs.len() != 1 && specs.len() != names.len() {
        return Err(fail(format!(
            "rollout_rs_threshold has {} values; give one shared value or exactly {} (one per rollout_rs option)",
            specs.len(),
            names.len()
        )));
    }
    if specs.len() == 1 {
        specs = vec![specs[0].clone(); names.len()];
    }
    names
        .iter()
        .zip(specs)
        .map(|(name, spec)| {
            let (level, statistic) = parse_rs_option(name)?;
            let bad = |message: String| fail(format!("rollout_rs_threshold {spec:?} for {name}: {message}"));
            if statistic == RsStatistic::K1 {
                let (lower, upper) = match spec.split_once('_') {
                    Some((lower, upper)) => (parse_number(lower).map_err(bad)?, parse_number(upper).map_err(bad)?),
                    None => {
                        let upper = parse_number(&spec).map_err(bad)?;
                        (1.0 / upper, upper)
                    }
                };
                if !(lower > 0.0 && upper > 0.0) {
                    return Err(bad("bounds must be positive".into()));
                }
                if lower > upper {
                    return Err(bad("lower must be <= upper".into()));
                }
                Ok(RejectionCriterion { level, statistic, lower: Some(lower), upper })
            } else {
                if spec.contains('_') {
                    return Err(bad("k2/k3 options take a single upper bound, without '_'".into()));
                }
                let upper = parse_number(&spec).map_err(bad)?;
                if upper.is_nan() || upper <= 0.0 {
                    return Err(bad("the bound must be positive".into()));
                }
                Ok(RejectionCriterion { level, statistic, lower: None, upper })
            }
        })
        .collect()
}

/// The loss used in bypass mode (old log-probs = rollout log-probs).
pub use jetrl_config::BypassLossType as BypassLoss;

/// Parsed `algorithm.rollout_correction`.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrectionParams {
    /// `None`: no weights (metrics and rejection only).
    pub rollout_is: Option<IsLevel>,
    pub is_threshold: IsThreshold,
    /// Rescale the weights to mean 1 over the batch.
    pub batch_normalize: bool,
    /// Every criterion must pass for a token to stay in the mask.
    pub rejection: Vec<RejectionCriterion>,
    pub bypass_mode: bool,
    pub loss_type: BypassLoss,
}

impl Default for RolloutCorrectionParams {
    fn default() -> Self {
        Self {
            rollout_is: None,
            is_threshold: IsThreshold::Truncate { upper: 2.0 },
            batch_normalize: false,
            rejection: Vec::new(),
            bypass_mode: false,
            loss_type: BypassLoss::PpoClip,
        }
    }
}

impl RolloutCorrectionParams {
    pub fn from_config(cfg: &RolloutCorrectionConfig) -> Result<Self, AlgoError> {
        let rollout_is = cfg.rollout_is;
        let rejection = match cfg.rollout_rs.as_deref() {
            None => Vec::new(),
            Some(options) => parse_rejection(options, cfg.rollout_rs_threshold.as_ref())?,
        };
        let loss_type = cfg.loss_type;
        Ok(Self {
            rollout_is,
            is_threshold: IsThreshold::parse(&cfg.rollout_is_threshold)?,
            batch_normalize: cfg.rollout_is_batch_normalize,
            rejection,
            bypass_mode: cfg.bypass_mode,
            loss_type,
        })
    }
}

/// The result of [`compute_rollout_correction`].
#[derive(Debug)]
pub struct RolloutCorrection {
    /// IS weights `[batch, response_len]` (0 on padding), when `rollout_is` is set; detached.
    pub weights: Option<Tensor>,
    /// The response mask with rejected tokens set to 0 (the input mask when there is no criterion).
    pub response_mask: Tensor,
    /// `rollout_corr/*` metrics (IS weight, rejection and off-policy diagnostics).
    pub metrics: BTreeMap<String, f64>,
}

/// IS weights and rejection mask from the training policy's log-probs (`old_log_prob`) and the rollout
/// engine's (`rollout_log_prob`).
pub fn compute_rollout_correction(
    old_log_prob: &Tensor,
    rollout_log_prob: &Tensor,
    response_mask: &Tensor,
    params: &RolloutCorrectionParams,
) -> Result<RolloutCorrection, AlgoError> {
    check_same_2d(&[
        ("old_log_prob", old_log_prob),
        ("rollout_log_prob", rollout_log_prob),
        ("response_mask", response_mask),
    ])
    .map_err(AlgoError::RolloutCorrection)?;
    tch::no_grad(|| {
        let old_log_prob = old_log_prob.detach();
        let rollout_log_prob = rollout_log_prob.detach();
        if item(&sum_all(&response_mask.ne(0.0).to_kind(Kind::Double))) == 0.0 {
            return Err(AlgoError::RolloutCorrection("response_mask must contain at least one valid token".into()));
        }
        let log_ratio = &old_log_prob - &rollout_log_prob;
        let mut metrics = BTreeMap::new();
        let weights = params.rollout_is.map(|level| is_weights(&log_ratio, response_mask, level, params, &mut metrics));
        let corrected_mask = if params.rejection.is_empty() {
            response_mask.copy()
        } else {
            rejection_mask(&log_ratio, response_mask, &params.rejection, &mut metrics)
        };
        offpolicy_metrics(&old_log_prob, &rollout_log_prob, response_mask, &mut metrics);
        let metrics = metrics.into_iter().map(|(k, v)| (format!("rollout_corr/{k}"), v)).collect();
        Ok(RolloutCorrection { weights, response_mask: corrected_mask, metrics })
    })
}

fn masked_max(values: &Tensor, mask: &Tensor) -> f64 {
    item(&values.masked_fill(&mask.eq(0.0), f64::NEG_INFINITY).max())
}

fn masked_min(values: &Tensor, mask: &Tensor) -> f64 {
    item(&values.masked_fill(&mask.eq(0.0), f64::INFINITY).min())
}

fn mean_all(values: &Tensor) -> f64 {
    item(&values.to_kind(Kind::Double).mean(None::<Kind>))
}

fn is_weights(
    log_ratio: &Tensor,
    response_mask: &Tensor,
    level: IsLevel,
    params: &RolloutCorrectionParams,
    metrics: &mut BTreeMap<String, f64>,
) -> Tensor {
    let mask = mask_like(response_mask, log_ratio);
    let (raw, log_ratio_for_metrics) = match level {
        IsLevel::Token => (log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), log_ratio.shallow_clone()),
        IsLevel::Sequence => {
            let per_seq = masked_sum(log_ratio, response_mask, Axis::Last).unsqueeze(-1);
            (per_seq.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio), per_seq)
        }
    };
    let raw = raw * &mask;
    let weights = match params.is_threshold {
        IsThreshold::Truncate { upper } => raw.clamp_max(upper),
        IsThreshold::IcePop { lower, upper } => {
            let kept = raw.ge(lower).logical_and(&raw.le(upper));
            raw.where_self(&kept, &raw.zeros_like())
        }
    };
    is_metrics(&weights, &raw, &log_ratio_for_metrics, response_mask, level, params.is_threshold, metrics);
    if let IsThreshold::IcePop { lower, upper } = params.is_threshold {
        let out_of_bounds = raw.lt(lower).logical_or(&raw.gt(upper)).to_kind(log_ratio.kind());
        metrics.insert("rollout_is_oob_ratio".into(), item(&masked_mean(&out_of_bounds, response_mask, Axis::All)));
    }
    if !params.batch_normalize {
        return weights;
    }
    let mean = match level {
        IsLevel::Token => item(&masked_mean(&weights, response_mask, Axis::All)),
        IsLevel::Sequence => {
            let per_seq = masked_mean(&weights, response_mask, Axis::Last);
            let seq_mask = sum_last(&mask).gt(0.0).to_kind(weights.kind());
            item(&(sum_all(&(per_seq * &seq_mask)) / sum_all(&seq_mask).clamp_min(1e-8)))
        }
    };
    if mean > 1e-8 {
        metrics.insert("rollout_is_batch_norm_factor".into(), mean);
        weights / mean
    } else {
        metrics.insert("rollout_is_batch_norm_factor".into(), 1.0);
        weights
    }
}

fn is_metrics(
    weights: &Tensor,
    raw: &Tensor,
    log_ratio_for_metrics: &Tensor,
    response_mask: &Tensor,
    level: IsLevel,
    threshold: IsThreshold,
    metrics: &mut BTreeMap<String, f64>,
) {
    let upper = threshold.upper();
    let lower = match threshold {
        IsThreshold::IcePop { lower, .. } => lower,
        IsThreshold::Truncate { upper } => 1.0 / upper,
    };
    let float = |t: Tensor| t.to_kind(weights.kind());
    metrics.insert("rollout_is_mean".into(), item(&masked_mean(weights, response_mask, Axis::All)));
    match level {
        IsLevel::Sequence => {
            let log_max = item(&log_ratio_for_metrics.max());
            metrics.insert("rollout_is_max".into(), log_max.min(SAFETY_BOUND).exp());
            metrics.insert("rollout_is_min".into(), item(&log_ratio_for_metrics.min()).exp());
            metrics.insert(
                "rollout_is_ratio_fraction_high".into(),
                mean_all(&float(log_ratio_for_metrics.gt(upper.ln()))),
            );
            metrics
                .insert("rollout_is_ratio_fraction_low".into(), mean_all(&float(log_ratio_for_metrics.lt(lower.ln()))));
        }
        IsLevel::Token => {
            let high = masked_mean(&float(raw.gt(upper)), response_mask, Axis::All);
            let low = masked_mean(&float(raw.lt(lower)), response_mask, Axis::All);
            metrics.insert("rollout_is_ratio_fraction_high".into(), item(&high));
            metrics.insert("rollout_is_ratio_fraction_low".into(), item(&low));
            metrics.insert("rollout_is_max".into(), masked_max(weights, response_mask));
            metrics.insert("rollout_is_min".into(), masked_min(weights, response_mask));
        }
    }
    let count = item(&sum_all(&mask_like(response_mask, weights)));
    let bounded = weights.clamp(0.0, upper);
    let bounded_mean = masked_mean(&bounded, response_mask, Axis::All);
    let std = if count > 1.0 {
        let var = masked_mean(&bounded.square(), response_mask, Axis::All) - bounded_mean.square();
        item(&var.clamp_min(0.0).sqrt())
    } else {
        0.0
    };
    metrics.insert("rollout_is_std".into(), std);
    let normalized = &bounded / (&bounded_mean + 1e-8);
    metrics.insert(
        "rollout_is_eff_sample_size".into(),
        1.0 / item(&masked_mean(&normalized.square(), response_mask, Axis::All)),
    );
    let seq_means = masked_mean(weights, response_mask, Axis::Last);
    let rows = seq_means.size()[0];
    metrics.insert("rollout_is_seq_mean".into(), mean_all(&seq_means));
    metrics.insert("rollout_is_seq_std".into(), if rows > 1 { item(&seq_means.std(true)) } else { 0.0 });
    metrics.insert("rollout_is_seq_max".into(), item(&seq_means.max()));
    metrics.insert("rollout_is_seq_min".into(), item(&seq_means.min()));
    metrics.insert("rollout_is_seq_max_deviation".into(), item(&(&seq_means - 1.0).abs().max()));
    let raw_seq_means = masked_mean(raw, response_mask, Axis::Last);
    metrics.insert("rollout_is_seq_fraction_high".into(), mean_all(&float(raw_seq_means.gt(upper))));
    metrics.insert("rollout_is_seq_fraction_low".into(), mean_all(&float(raw_seq_means.lt(lower))));
}

fn rejection_mask(
    log_ratio: &Tensor,
    response_mask: &Tensor,
    criteria: &[RejectionCriterion],
    metrics: &mut BTreeMap<String, f64>,
) -> Tensor {
    let kind = log_ratio.kind();
    let safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND);
    let k1 = -&safe;
    let k2 = safe.square() * 0.5;
    let k3 = safe.exp() - 1.0 - &safe;
    let valid = response_mask.ne(0.0);
    let seq_valid = sum_last(&mask_like(response_mask, log_ratio)).gt(0.0);
    let seq_valid_count = item(&sum_all(&seq_valid.to_kind(Kind::Double)));
    let mut combined = log_ratio.ones_like();
    for criterion in criteria {
        let name = criterion.to_string();
        let token_stat = match criterion.statistic {
            RsStatistic::K1 => &k1,
            RsStatistic::K2 => &k2,
            RsStatistic::K3 => &k3,
        };
        let (lower_bound, upper_bound) = match (criterion.statistic, criterion.lower) {
            (RsStatistic::K1, Some(lower)) => (Some(lower.ln()), criterion.upper.ln()),
            _ => (None, criterion.upper),
        };
        let (stat, per_sequence) = match criterion.level {
            RsLevel::Token => (token_stat.shallow_clone(), None),
            RsLevel::SeqSum => {
                let seq = masked_sum(token_stat, response_mask, Axis::Last);
                (seq.unsqueeze(-1).expand_as(log_ratio), Some(seq))
            }
            RsLevel::SeqMean => {
                let seq = masked_mean(token_stat, response_mask, Axis::Last);
                (seq.unsqueeze(-1).expand_as(log_ratio), Some(seq))
            }
            RsLevel::SeqMax => {
                let seq = token_stat.masked_fill(&valid.logical_not(), f64::NEG_INFINITY).amax(-1, false);
                let seq = seq.masked_fill(&seq.eq(f64::NEG_INFINITY), 0.0);
                (seq.unsqueeze(-1).expand_as(log_ratio), Some(seq))
            }
        };
        let keep = match lower_bound {
            Some(lower) => stat.ge(lower).logical_and(&stat.le(upper_bound)),
            None => stat.le(upper_bound),
        };
        let keep_float = keep.to_kind(kind);
        combined *= &keep_float;

        let threshold_low = lower_bound.unwrap_or(0.0);
        metrics.insert(format!("rollout_rs_{name}_mean"), item(&masked_mean(&stat, response_mask, Axis::All)));
        match &per_sequence {
            Some(seq) if seq_valid_count > 0.0 => {
                let valid_seqs = seq.masked_select(&seq_valid);
                metrics.insert(format!("rollout_rs_{name}_max"), item(&valid_seqs.max()));
                metrics.insert(format!("rollout_rs_{name}_min"), item(&valid_seqs.min()));
                metrics.insert(
                    format!("rollout_rs_{name}_fraction_high"),
                    mean_all(&valid_seqs.gt(upper_bound).to_kind(kind)),
                );
                let low =
                    if lower_bound.is_some() { mean_all(&valid_seqs.lt(threshold_low).to_kind(kind)) } else { 0.0 };
                metrics.insert(format!("rollout_rs_{name}_fraction_low"), low);
            }
            _ => {
                metrics.insert(format!("rollout_rs_{name}_max"), masked_max(&stat, response_mask));
                metrics.insert(format!("rollout_rs_{name}_min"), masked_min(&stat, response_mask));
                let high = masked_mean(&stat.gt(upper_bound).to_kind(kind), response_mask, Axis::All);
                metrics.insert(format!("rollout_rs_{name}_fraction_high"), item(&high));
                let low = if lower_bound.is_some() {
                    item(&masked_mean(&stat.lt(threshold_low).to_kind(kind), response_mask, Axis::All))
                } else {
                    0.0
                };
                metrics.insert(format!("rollout_rs_{name}_fraction_low"), low);
            }
        }
        let rejected = -&keep_float + 1.0;
        metrics.insert(
            format!("rollout_rs_{name}_masked_fraction"),
            item(&masked_mean(&rejected, response_mask, Axis::All)),
        );
        let seq_kept = keep.logical_not().logical_and(&valid).any_dim(-1, false).logical_not();
        let seq_fraction = if seq_valid_count > 0.0 {
            let dropped = seq_kept.logical_not().logical_and(&seq_valid).to_kind(Kind::Double);
            item(&sum_all(&dropped)) / seq_valid_count
        } else {
            0.0
        };
        metrics.insert(format!("rollout_rs_{name}_seq_masked_fraction"), seq_fraction);
    }
    let rejected = -&combined + 1.0;
    metrics.insert("rollout_rs_masked_fraction".into(), item(&masked_mean(&rejected, response_mask, Axis::All)));
    let final_keep = combined.gt(0.5).logical_and(&valid);
    let seq_has_masked = final_keep.logical_not().logical_and(&valid).any_dim(-1, false);
    metrics.insert("rollout_rs_seq_masked_fraction".into(), mean_all(&seq_has_masked.to_kind(Kind::Double)));
    (mask_like(response_mask, log_ratio) * combined).to_kind(response_mask.kind())
}

fn offpolicy_metrics(
    old_log_prob: &Tensor,
    rollout_log_prob: &Tensor,
    mask: &Tensor,
    metrics: &mut BTreeMap<String, f64>,
) {
    let mean_train = masked_mean(old_log_prob, mask, Axis::Last);
    metrics.insert("training_ppl".into(), mean_all(&(-&mean_train).exp()));
    metrics.insert("training_log_ppl".into(), mean_all(&(-&mean_train)));
    metrics.insert("kl".into(), item(&masked_mean(&(rollout_log_prob - old_log_prob), mask, Axis::All)));
    let log_ratio = old_log_prob - rollout_log_prob;
    let k3 = log_ratio.exp() - &log_ratio - 1.0;
    metrics.insert("k3_kl".into(), item(&masked_mean(&k3, mask, Axis::All)));
    let mean_rollout = masked_mean(rollout_log_prob, mask, Axis::Last);
    metrics.insert("rollout_ppl".into(), mean_all(&(-&mean_rollout).exp()));
    metrics.insert("rollout_log_ppl".into(), mean_all(&(-&mean_rollout)));
    let log_ppl_diff = &mean_rollout - &mean_train;
    metrics.insert("log_ppl_diff".into(), mean_all(&log_ppl_diff));
    metrics.insert("log_ppl_abs_diff".into(), mean_all(&log_ppl_diff.abs()));
    metrics.insert("log_ppl_diff_max".into(), item(&log_ppl_diff.max()));
    metrics.insert("log_ppl_diff_min".into(), item(&log_ppl_diff.min()));
    metrics.insert("ppl_ratio".into(), mean_all(&log_ppl_diff.exp()));
    let rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp();
    metrics.insert("chi2_token".into(), item(&masked_mean(&rho.square(), mask, Axis::All)) - 1.0);
    let per_seq = masked_sum(&log_ratio, mask, Axis::Last).clamp(-SAFETY_BOUND, SAFETY_BOUND);
    metrics.insert("chi2_seq".into(), mean_all(&(per_seq * 2.0).exp()) - 1.0);
}

//! The phases of a training step between the forward passes and the updates, each a function over per-token
//! columns of the whole batch that can be tested alone: token rewards (minus the in-reward KL), rollout
//! correction, advantages, PF-PPO resampling and verl's data metrics. A column is a `[rows, width]` host matrix,
//! row-major, a row's tokens first and zeros after its response; every rank computes the same columns.

use std::collections::BTreeMap;

use jetrl_algos::{
    apply_kl_penalty, compute_advantage, compute_rollout_correction, pf_ppo_resample, AdvantageConfig,
    AdvantageEstimator, AdvantageInputs, KlController, KlPenalty, PfPpoReweight, RolloutCorrectionParams,
};
use tch::{Kind, Tensor};

use crate::batch::RowInfo;
use crate::error::ActorError;
use crate::step_metrics::stats;

/// The columns the policy update reads, per token of the whole batch.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Columns {
    pub width: usize,
    /// the response mask after rollout rejection
    pub mask: Vec<f32>,
    pub old_log_probs: Vec<f32>,
    pub ref_log_probs: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub is_weights: Option<Vec<f32>>,
}

/// Everything the advantage phase leaves: the policy update's columns, and what the critic update and the data
/// metrics read.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StepColumns {
    pub policy: Columns,
    pub values: Option<Vec<f32>>,
    pub returns: Vec<f32>,
    /// token rewards (the score on the last token, minus the in-reward KL)
    pub rewards: Vec<f32>,
    /// the score on each row's last response token
    pub scores: Vec<f32>,
}

impl StepColumns {
    /// The rows `picked` (in that order, repeats allowed) of every column: PF-PPO's resampled batch.
    pub fn take_rows(&self, picked: &[usize]) -> Self {
        let width = self.policy.width;
        let take = |m: &[f32]| -> Vec<f32> {
            picked.iter().flat_map(|&i| m[i * width..(i + 1) * width].iter().copied()).collect()
        };
        Self {
            policy: Columns {
                width,
                mask: take(&self.policy.mask),
                old_log_probs: take(&self.policy.old_log_probs),
                ref_log_probs: self.policy.ref_log_probs.as_deref().map(take),
                advantages: take(&self.policy.advantages),
                is_weights: self.policy.is_weights.as_deref().map(take),
            },
            values: self.values.as_deref().map(take),
            returns: take(&self.returns),
            rewards: take(&self.rewards),
            scores: take(&self.scores),
        }
    }
}

/// A `[rows, width]` host matrix with `f(row, token)` at each response token of each row.
pub(super) fn row_matrix(rows: &[RowInfo], width: usize, f: impl Fn(&RowInfo, usize) -> f32) -> Vec<f32> {
    let mut m = vec![0f32; rows.len() * width];
    for (i, row) in rows.iter().enumerate() {
        for j in 0..row.response_len {
            m[i * width + j] = f(row, j);
        }
    }
    m
}

/// A host matrix as a `[rows, width]` tensor.
pub(super) fn host_tensor(m: &[f32], rows: usize, width: usize) -> Result<Tensor, tch::TchError> {
    Tensor::f_from_slice(m)?.f_view([rows as i64, width as i64])
}

/// Each row's score on its last response token, zero elsewhere.
pub(super) fn score_column(rows: &[RowInfo], width: usize) -> Vec<f32> {
    row_matrix(rows, width, |r, j| if j + 1 == r.response_len { r.score as f32 } else { 0.0 })
}

/// Token rewards: `scores`, minus β·KL(π_old‖π_ref) when the KL is in the reward (a controller and a reference
/// both present; verl's `apply_kl_penalty`, which also moves the adaptive controller), with its metrics.
pub(super) fn token_rewards(
    scores: &Tensor,
    old: &Tensor,
    reference: Option<&Tensor>,
    mask: &Tensor,
    kl: Option<(&mut KlController, KlPenalty)>,
    metrics: &mut BTreeMap<String, f64>,
) -> Result<Tensor, ActorError> {
    match (kl, reference) {
        (Some((ctrl, penalty)), Some(reference)) => {
            let (rewards, kl) = apply_kl_penalty(scores, old, reference, mask, penalty, ctrl)?;
            metrics.insert("actor/reward_kl_penalty".into(), kl.current_kl);
            metrics.insert("actor/reward_kl_penalty_coeff".into(), kl.coefficient);
            Ok(rewards)
        }
        _ => Ok(scores.shallow_clone()),
    }
}

/// Rollout correction (TIS/MIS, rejection) of π_old against the rollout's log-probs: the response mask with the
/// rejected tokens off and the importance weights, with its metrics. Without `params`, the mask unchanged.
pub(super) fn rollout_correction(
    old: &Tensor,
    rollout: &Tensor,
    mask: Tensor,
    params: Option<&RolloutCorrectionParams>,
    metrics: &mut BTreeMap<String, f64>,
) -> Result<(Tensor, Option<Tensor>), ActorError> {
    match params {
        Some(params) => {
            let rc = compute_rollout_correction(old, rollout, &mask, params)?;
            metrics.extend(rc.metrics);
            Ok((rc.response_mask.f_to_kind(Kind::Float)?, rc.weights))
        }
        None => Ok((mask, None)),
    }
}

/// What the advantage estimators read of a step, as tensors of the whole batch.
pub(super) struct AdvantageColumns<'a> {
    pub rows: &'a [RowInfo],
    pub rewards: &'a Tensor,
    pub mask: &'a Tensor,
    pub old_log_probs: &'a Tensor,
    pub values: Option<&'a Tensor>,
    pub sum_pi_squared: Option<&'a Tensor>,
    pub is_weights: Option<&'a Tensor>,
}

/// Advantages and returns by `estimator` (groups by uid; GDPO's components and REMAX's baselines from the rows).
pub(super) fn advantages(
    estimator: AdvantageEstimator,
    config: &AdvantageConfig,
    cols: &AdvantageColumns<'_>,
) -> Result<(Tensor, Tensor), ActorError> {
    let uids: Vec<String> = cols.rows.iter().map(|r| r.uid.clone()).collect();
    let keys: Vec<String> = cols.rows.iter().map(|r| r.key.clone()).collect();
    let extra_scores = gdpo_components(cols.rows, &config.gdpo_reward_keys)?;
    let baselines = match estimator {
        AdvantageEstimator::Remax => Some(reward_baselines(cols.rows)?),
        _ => None,
    };
    let inputs = AdvantageInputs {
        index: Some(&uids),
        keys: Some(&keys),
        values: cols.values,
        extra_scores: extra_scores.as_ref(),
        old_log_probs: Some(cols.old_log_probs),
        sum_pi_squared: cols.sum_pi_squared,
        rollout_is_weights: cols.is_weights,
        reward_baselines: baselines.as_ref(),
        ..AdvantageInputs::new(cols.rewards, cols.mask)
    };
    Ok(compute_advantage(estimator, &inputs, config)?)
}

/// PF-PPO: the rows to train on, drawn by score with the step's seed (repeats allowed).
pub(super) fn pf_ppo_rows(rows: &[RowInfo], method: PfPpoReweight, seed: u64) -> Result<Vec<usize>, ActorError> {
    let scores: Vec<f64> = rows.iter().map(|r| r.score).collect();
    Ok(pf_ppo_resample(&scores, method, seed)?)
}

/// verl's `training/rollout_probs_diff_*`: how far the rollout's probabilities are from the trainer's on the
/// same weights (a sanity check of the inference engine), over the trained tokens of the whole batch.
pub(super) fn rollout_probs_diff(
    rows: &[RowInfo],
    rollout: &[f32],
    old: &[f32],
    mask: &[f32],
    width: usize,
    metrics: &mut BTreeMap<String, f64>,
) {
    let (mut sum, mut max, mut count) = (0.0f64, 0.0f64, 0.0f64);
    for (i, row) in rows.iter().enumerate() {
        for j in i * width..i * width + row.response_len {
            if mask[j] == 1.0 {
                let d = (f64::from(rollout[j]).exp() - f64::from(old[j]).exp()).abs();
                sum += d;
                max = max.max(d);
                count += 1.0;
            }
        }
    }
    if count > 0.0 {
        metrics.insert("training/rollout_probs_diff_mean".into(), sum / count);
        metrics.insert("training/rollout_probs_diff_max".into(), max);
    }
}

/// remax's `reward_baselines`, `[rows]`: each row's greedy-rollout score. A row without one is an error naming
/// it (the trainer rejects such groups when it fetches them, so this is a broken invariant, not an input).
fn reward_baselines(rows: &[RowInfo]) -> Result<Tensor, ActorError> {
    let column = rows
        .iter()
        .map(|r| {
            r.reward_baseline
                .map(|b| b as f32)
                .ok_or_else(|| ActorError::Batch(format!("remax: trajectory {} has no greedy-rollout baseline", r.key)))
        })
        .collect::<Result<Vec<f32>, _>>()?;
    Ok(Tensor::f_from_slice(&column)?)
}

/// The reward components GDPO normalises, `[rows]` each, from the rows' reward extras.
fn gdpo_components(rows: &[RowInfo], keys: &[String]) -> Result<Option<BTreeMap<String, Tensor>>, ActorError> {
    if keys.is_empty() {
        return Ok(None);
    }
    let mut out = BTreeMap::new();
    for key in keys {
        let column: Vec<f32> = rows.iter().map(|r| r.extra.get(key).copied().unwrap_or(0.0) as f32).collect();
        out.insert(key.clone(), Tensor::f_from_slice(&column)?);
    }
    Ok(Some(out))
}

/// verl's `compute_data_metrics`: sequence scores and rewards, and advantages, returns and values over the
/// valid tokens, each as mean/max/min; `critic/vf_explained_var` with a critic.
pub(super) fn data_metrics(step: &StepColumns, metrics: &mut BTreeMap<String, f64>) {
    let cols = &step.policy;
    let width = cols.width;
    let rows = cols.mask.len() / width.max(1);
    let seq_sum = |m: &[f32]| -> Vec<f64> {
        (0..rows).map(|i| m[i * width..(i + 1) * width].iter().map(|&v| f64::from(v)).sum()).collect()
    };
    let valid = |m: &[f32]| -> Vec<f64> {
        m.iter().zip(&cols.mask).filter(|(_, &k)| k > 0.0).map(|(&v, _)| f64::from(v)).collect()
    };
    stats(&seq_sum(&step.scores), "critic/score", metrics);
    stats(&seq_sum(&step.rewards), "critic/rewards", metrics);
    stats(&valid(&cols.advantages), "critic/advantages", metrics);
    let returns_valid = valid(&step.returns);
    stats(&returns_valid, "critic/returns", metrics);
    if let Some(values) = &step.values {
        let values_valid = valid(values);
        stats(&values_valid, "critic/values", metrics);
        let residual: Vec<f64> = returns_valid.iter().zip(&values_valid).map(|(r, v)| r - v).collect();
        let var = |x: &[f64]| {
            let mean = x.iter().sum::<f64>() / x.len().max(1) as f64;
            x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / x.len().max(1) as f64
        };
        metrics.insert("critic/vf_explained_var".into(), 1.0 - var(&residual) / (var(&returns_valid) + 1e-5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::to_host;

    fn row(uid: &str, index: usize, score: f64, response_len: usize) -> RowInfo {
        RowInfo {
            key: format!("{uid}_{index}_0"),
            uid: uid.into(),
            score,
            response_len,
            prompt_len: 2,
            ..RowInfo::default()
        }
    }

    #[test]
    fn the_score_sits_on_each_rows_last_response_token() {
        let rows = [row("a", 0, 1.5, 2), row("a", 1, -1.0, 3)];
        assert_eq!(score_column(&rows, 3), vec![0.0, 1.5, 0.0, 0.0, 0.0, -1.0]);
    }

    #[test]
    fn without_a_kl_controller_the_token_rewards_are_the_scores() {
        let scores = Tensor::from_slice(&[0.0f32, 1.0, 0.0, 2.0]).view([2, 2]);
        let old = Tensor::zeros([2, 2], (Kind::Float, tch::Device::Cpu));
        let mut metrics = BTreeMap::new();
        let rewards = token_rewards(&scores, &old, Some(&old), &old.ones_like(), None, &mut metrics).unwrap();
        assert_eq!(Vec::<f32>::try_from(rewards.flatten(0, -1)).unwrap(), vec![0.0, 1.0, 0.0, 2.0]);
        assert!(metrics.is_empty());
    }

    #[test]
    fn without_rollout_correction_the_mask_is_kept_and_there_are_no_weights() {
        let mask = Tensor::from_slice(&[1.0f32, 0.0]).view([1, 2]);
        let old = mask.zeros_like();
        let mut metrics = BTreeMap::new();
        let (kept, weights) = rollout_correction(&old, &old, mask, None, &mut metrics).unwrap();
        assert_eq!(Vec::<f32>::try_from(kept.flatten(0, -1)).unwrap(), vec![1.0, 0.0]);
        assert!(weights.is_none() && metrics.is_empty());
    }

    #[test]
    fn grpo_advantages_rank_the_better_answer_of_a_group_above_the_worse() {
        let rows = [row("a", 0, 1.0, 2), row("a", 1, 0.0, 2)];
        let rewards = host_tensor(&score_column(&rows, 2), 2, 2).unwrap();
        let mask = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
        let old = mask.zeros_like();
        let cols = AdvantageColumns {
            rows: &rows,
            rewards: &rewards,
            mask: &mask,
            old_log_probs: &old,
            values: None,
            sum_pi_squared: None,
            is_weights: None,
        };
        let config = AdvantageConfig::default();
        let (adv, _) = advantages(AdvantageEstimator::Grpo, &config, &cols).unwrap();
        let adv = to_host(&adv).unwrap();
        assert!(adv[0] > 0.0 && adv[2] < 0.0, "{adv:?}");
        assert_eq!(adv[0], adv[1], "a sequence's advantage is on every one of its tokens");
    }

    #[test]
    fn remax_without_a_greedy_baseline_names_the_trajectory() {
        let err = reward_baselines(&[row("u1", 0, 1.0, 1)]).unwrap_err();
        assert!(matches!(&err, ActorError::Batch(m) if m.contains("u1_0_0")), "{err:?}");
    }

    #[test]
    fn gdpo_components_are_the_named_extras_by_row_and_zero_where_missing() {
        assert!(gdpo_components(&[row("a", 0, 1.0, 1)], &[]).unwrap().is_none());
        let mut with = row("a", 0, 1.0, 1);
        with.extra.insert("format".into(), 0.5);
        let rows = [with, row("a", 1, 0.0, 1)];
        let components = gdpo_components(&rows, &["format".into()]).unwrap().unwrap();
        assert_eq!(Vec::<f32>::try_from(&components["format"]).unwrap(), vec![0.5, 0.0]);
    }

    #[test]
    fn rollout_probs_diff_is_taken_over_masked_tokens_only() {
        let rows = [row("a", 0, 0.0, 2)];
        let (rollout, old) = ([0.5f32.ln(), 0.0], [0.25f32.ln(), 0.9f32.ln()]);
        let mut metrics = BTreeMap::new();
        rollout_probs_diff(&rows, &rollout, &old, &[1.0, 0.0], 2, &mut metrics);
        assert!((metrics["training/rollout_probs_diff_mean"] - 0.25).abs() < 1e-6, "{metrics:?}");
        assert!((metrics["training/rollout_probs_diff_max"] - 0.25).abs() < 1e-6);
        let mut none = BTreeMap::new();
        rollout_probs_diff(&rows, &rollout, &old, &[0.0, 0.0], 2, &mut none);
        assert!(none.is_empty());
    }

    fn step_columns() -> StepColumns {
        let m = |a: f32, b: f32| vec![a, a + 1.0, b, b + 1.0];
        StepColumns {
            policy: Columns {
                width: 2,
                mask: vec![1.0, 1.0, 1.0, 0.0],
                old_log_probs: m(0.0, 10.0),
                ref_log_probs: Some(m(20.0, 30.0)),
                advantages: m(40.0, 50.0),
                is_weights: None,
            },
            values: Some(m(60.0, 70.0)),
            returns: m(80.0, 90.0),
            rewards: m(100.0, 110.0),
            scores: m(120.0, 130.0),
        }
    }

    #[test]
    fn resampling_takes_whole_rows_of_every_column_in_the_order_picked() {
        let step = step_columns();
        let picked = step.take_rows(&[1, 1, 0]);
        assert_eq!(picked.policy.mask, vec![1.0, 0.0, 1.0, 0.0, 1.0, 1.0]);
        assert_eq!(picked.policy.old_log_probs, vec![10.0, 11.0, 10.0, 11.0, 0.0, 1.0]);
        assert_eq!(picked.policy.ref_log_probs.as_deref(), Some(&[30.0, 31.0, 30.0, 31.0, 20.0, 21.0][..]));
        assert_eq!(picked.values.as_deref(), Some(&[70.0, 71.0, 70.0, 71.0, 60.0, 61.0][..]));
        assert_eq!(picked.scores, vec![130.0, 131.0, 130.0, 131.0, 120.0, 121.0]);
        assert!(picked.policy.is_weights.is_none());
    }

    #[test]
    fn data_metrics_sum_scores_per_sequence_and_average_the_rest_over_valid_tokens() {
        let mut metrics = BTreeMap::new();
        data_metrics(&step_columns(), &mut metrics);
        assert_eq!(metrics["critic/score/max"], 261.0);
        assert_eq!(metrics["critic/score/min"], 241.0);
        // valid tokens: (0,0), (0,1), (1,0)
        assert_eq!(metrics["critic/advantages/mean"], (40.0 + 41.0 + 50.0) / 3.0);
        assert_eq!(metrics["critic/returns/max"], 90.0);
        // values are returns − 20 on every token: the residual has no variance
        assert!((metrics["critic/vf_explained_var"] - 1.0).abs() < 1e-6, "{metrics:?}");
    }
}

//! One file: every advantage estimator behind one dispatcher, as verl's `core_algos` has them.
//!
//! Advantage estimators (verl `core_algos.compute_*_advantage`, dispatched by `algorithm.adv_estimator`) and
//! the multi-trajectory GRPO rule of verl's V1 trainer (`compute_advantage_for_multi_trajectories`).
//!
//! Notation: r = token-level rewards, m = response mask, s_i = Σ_t r_it the score of row i; a group is the
//! set of rows sharing a uid (`index`). Every estimator returns `(advantages, returns)` shaped like `r`,
//! detached, in the kind and on the device of `r`. The per-row and recurrence arithmetic runs on the host in
//! f64 (batches are small); the batch whitening runs as tensor ops.

use std::collections::{BTreeMap, HashMap};

use jetrl_wire::keys::TrajectoryKey;
use tch::Tensor;

use crate::masked::masked_whiten;
use crate::util::{check_rows, check_same_2d, mask_like, to_vec_f64};
use crate::AlgoError;

pub use jetrl_config::AdvantageEstimator;

/// The scalar settings of the estimators (verl `algorithm.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageConfig {
    /// Discount (gae, reinforce_plus_plus).
    pub gamma: f64,
    /// GAE λ.
    pub lam: f64,
    /// Divide by the group std (grpo, grpo_vectorized, grpo_passk, gdpo).
    pub norm_adv_by_std_in_grpo: bool,
    /// Added to the group std (verl: 1e-6).
    pub epsilon: f64,
    /// GDPO reward components, read from `AdvantageInputs::extra_scores`; empty: plain GRPO on the rewards.
    pub gdpo_reward_keys: Vec<String>,
    /// One weight per GDPO key (default 1 each).
    pub gdpo_reward_weights: Option<Vec<f64>>,
    /// Optimal token baseline: zero the baseline of a unique longest row past the second-longest length.
    pub handle_zero_tail: bool,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            norm_adv_by_std_in_grpo: true,
            epsilon: 1e-6,
            gdpo_reward_keys: Vec::new(),
            gdpo_reward_weights: None,
            handle_zero_tail: true,
        }
    }
}

impl AdvantageConfig {
    pub fn from_config(algorithm: &jetrl_config::AlgorithmConfig) -> Self {
        Self {
            gamma: algorithm.gamma,
            lam: algorithm.lam,
            norm_adv_by_std_in_grpo: algorithm.norm_adv_by_std_in_grpo,
            gdpo_reward_keys: algorithm.gdpo_reward_keys.clone().unwrap_or_default(),
            gdpo_reward_weights: algorithm.gdpo_reward_weights.clone(),
            ..Self::default()
        }
    }
}

/// The batch an estimator reads; tensors are `[batch, response_len]` unless said.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    pub token_level_rewards: &'a Tensor,
    pub response_mask: &'a Tensor,
    /// The uid (prompt group) of every row. When absent it is taken from `keys`.
    pub index: Option<&'a [String]>,
    /// Critic values (gae).
    pub values: Option<&'a Tensor>,
    /// `[batch]` greedy-rollout scores (remax).
    pub reward_baselines: Option<&'a Tensor>,
    /// Trajectory keys `{uid}_{session}_{index}`: with GRPO, applies the multi-trajectory rule.
    pub keys: Option<&'a [String]>,
    /// `[batch]` reward components by name (gdpo).
    pub extra_scores: Option<&'a BTreeMap<String, Tensor>>,
    /// Old log-probs (optimal token baselines).
    pub old_log_probs: Option<&'a Tensor>,
    /// Σπ² per token (optimal token baselines).
    pub sum_pi_squared: Option<&'a Tensor>,
    /// Rollout IS weights (optimal token baselines scale the path variance by their square).
    pub rollout_is_weights: Option<&'a Tensor>,
}

impl<'a> AdvantageInputs<'a> {
    /// Rewards and mask only; set the optional fields with struct update syntax.
    pub fn new(token_level_rewards: &'a Tensor, response_mask: &'a Tensor) -> Self {
        Self {
            token_level_rewards,
            response_mask,
            index: None,
            values: None,
            reward_baselines: None,
            keys: None,
            extra_scores: None,
            old_log_probs: None,
            sum_pi_squared: None,
            rollout_is_weights: None,
        }
    }
}

/// `(advantages, returns)` of `estimator`; GRPO with `keys` follows the multi-trajectory rule: only the
/// final output of each session takes part in the group statistics, and its advantage is broadcast to every
/// row of the session.
pub fn compute_advantage(
    estimator: AdvantageEstimator,
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Result<(Tensor, Tensor), AlgoError> {
    let name = estimator.as_str();
    let fail = move |message: String| AlgoError::Advantage { estimator: name, message };
    let (batch, _) =
        check_same_2d(&[("token_level_rewards", inputs.token_level_rewards), ("response_mask", inputs.response_mask)])
            .map_err(fail)?;
    let rows = batch as usize;
    let device = inputs.token_level_rewards.device();
    for (label, list) in [("index", inputs.index), ("keys", inputs.keys)] {
        if let Some(list) = list {
            if list.len() != rows {
                return Err(fail(format!("{label} has {} entries for {rows} rows", list.len())));
            }
        }
    }
    let derived_index: Option<Vec<String>> = match (inputs.index, inputs.keys) {
        (None, Some(keys)) => {
            Some(keys.iter().map(|key| parse_key(key).map(|k| k.uid)).collect::<Result<_, _>>().map_err(fail)?)
        }
        _ => None,
    };
    let index: Option<&[String]> = inputs.index.or(derived_index.as_deref());
    let host = |tensor: &Tensor, label: &str| to_vec_f64(tensor).map_err(|e| fail(format!("reading {label}: {e}")));
    let batch_data = Batch {
        rows,
        cols: inputs.token_level_rewards.size()[1] as usize,
        rewards: host(inputs.token_level_rewards, "token_level_rewards")?,
        mask: host(inputs.response_mask, "response_mask")?,
        like: inputs.token_level_rewards,
        response_mask: inputs.response_mask,
    };
    let groups = match index {
        Some(index) => Some(Groups::new(index)),
        None if estimator.needs_groups() => {
            return Err(fail("needs the uid of every row (index, or keys `{uid}_{session}_{index}`)".into()))
        }
        None => None,
    };
    tch::no_grad(|| -> Result<(Tensor, Tensor), AlgoError> {
        if let (AdvantageEstimator::Grpo, Some(keys), Some(index)) = (estimator, inputs.keys, index) {
            return multi_trajectory_grpo(&batch_data, keys, index, cfg).map_err(fail);
        }
        let groups = groups.as_ref();
        let need_groups = || groups.ok_or_else(|| fail("needs index".into()));
        let result = match estimator {
            AdvantageEstimator::Gae => {
                let values = inputs.values.ok_or_else(|| fail("needs the critic values".into()))?;
                check_same_2d(&[("token_level_rewards", inputs.token_level_rewards), ("values", values)])
                    .map_err(fail)?;
                gae(&batch_data, &host(values, "values")?, cfg)
            }
            AdvantageEstimator::Grpo => Ok(batch_data.outcome(&grpo_rows(&batch_data.scores(), need_groups()?, cfg))),
            AdvantageEstimator::GrpoVectorized => {
                Ok(batch_data.outcome(&grpo_vectorized_rows(&batch_data.scores(), need_groups()?, cfg)))
            }
            AdvantageEstimator::GrpoPassk => {
                grpo_passk_rows(&batch_data.scores(), need_groups()?, cfg).map(|a| batch_data.outcome(&a))
            }
            AdvantageEstimator::Rloo => Ok(batch_data.outcome(&rloo_rows(&batch_data.scores(), need_groups()?))),
            AdvantageEstimator::RlooVectorized => {
                Ok(batch_data.outcome(&rloo_vectorized_rows(&batch_data.scores(), need_groups()?)))
            }
            AdvantageEstimator::Opo => Ok(batch_data.outcome(&opo_rows(&batch_data, need_groups()?))),
            AdvantageEstimator::ReinforcePlusPlus => reinforce_plus_plus(&batch_data, cfg),
            AdvantageEstimator::ReinforcePlusPlusBaseline => reinforce_plus_plus_baseline(&batch_data, need_groups()?),
            AdvantageEstimator::Remax => {
                let baselines = inputs.reward_baselines.ok_or_else(|| fail("needs reward_baselines".into()))?;
                check_rows("reward_baselines", baselines, batch, device).map_err(fail)?;
                Ok(remax(&batch_data, &host(baselines, "reward_baselines")?))
            }
            AdvantageEstimator::Gpg => Ok(batch_data.outcome(&gpg_rows(&batch_data.scores(), need_groups()?))),
            AdvantageEstimator::Gdpo => gdpo(&batch_data, need_groups()?, inputs.extra_scores, cfg),
            AdvantageEstimator::OptimalTokenBaseline | AdvantageEstimator::TirOptimalTokenBaseline => {
                let old = inputs.old_log_probs.ok_or_else(|| fail("needs old_log_probs".into()))?;
                let spsq = inputs
                    .sum_pi_squared
                    .ok_or_else(|| fail("needs sum_pi_squared (set actor.calculate_sum_pi_squared)".into()))?;
                let mut named = vec![
                    ("token_level_rewards", inputs.token_level_rewards),
                    ("old_log_probs", old),
                    ("sum_pi_squared", spsq),
                ];
                if let Some(weights) = inputs.rollout_is_weights {
                    named.push(("rollout_is_weights", weights));
                }
                check_same_2d(&named).map_err(fail)?;
                let weights = match inputs.rollout_is_weights {
                    Some(weights) => Some(host(weights, "rollout_is_weights")?),
                    None => None,
                };
                let path = PathVariance {
                    old: host(old, "old_log_probs")?,
                    spsq: host(spsq, "sum_pi_squared")?,
                    is_weights: weights,
                };
                Ok(optimal_token_baseline(
                    &batch_data,
                    need_groups()?,
                    &path,
                    cfg.handle_zero_tail,
                    estimator == AdvantageEstimator::TirOptimalTokenBaseline,
                ))
            }
        };
        result.map_err(|e| match e {
            AlgoError::Masked(message) => fail(message),
            other => other,
        })
    })
}

/// A trajectory key parsed by the wire contract's one parser ([`TrajectoryKey::parse`]), its error as this module's
/// messages are.
fn parse_key(key: &str) -> Result<TrajectoryKey, String> {
    TrajectoryKey::parse(key).map_err(|e| e.to_string())
}

/// Host copies of the rewards and mask, plus where results go back to.
struct Batch<'a> {
    rows: usize,
    cols: usize,
    rewards: Vec<f64>,
    mask: Vec<f64>,
    like: &'a Tensor,
    response_mask: &'a Tensor,
}

impl Batch<'_> {
    fn row_sums(&self, values: &[f64]) -> Vec<f64> {
        (0..self.rows).map(|i| values[i * self.cols..(i + 1) * self.cols].iter().sum()).collect()
    }

    fn scores(&self) -> Vec<f64> {
        self.row_sums(&self.rewards)
    }

    fn lengths(&self) -> Vec<f64> {
        self.row_sums(&self.mask)
    }

    /// A `[rows, cols]` host matrix as a tensor like the rewards.
    fn matrix(&self, values: &[f64]) -> Tensor {
        Tensor::from_slice(values)
            .reshape([self.rows as i64, self.cols as i64])
            .to_kind(self.like.kind())
            .to_device(self.like.device())
    }

    fn mask_tensor(&self) -> Tensor {
        mask_like(self.response_mask, self.like)
    }

    /// One scalar per row, on every token of the row: `a_i·m` (advantages = returns).
    fn outcome(&self, per_row: &[f64]) -> (Tensor, Tensor) {
        let values: Vec<f64> = (0..self.rows * self.cols).map(|k| per_row[k / self.cols] * self.mask[k]).collect();
        let advantages = self.matrix(&values);
        (advantages.shallow_clone(), advantages)
    }
}

/// Rows grouped by uid, in order of first appearance.
struct Groups {
    of_row: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Groups {
    fn new(index: &[String]) -> Self {
        let mut ids: HashMap<&str, usize> = HashMap::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let of_row = index
            .iter()
            .enumerate()
            .map(|(row, uid)| {
                let group = *ids.entry(uid.as_str()).or_insert_with(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
                members[group].push(row);
                group
            })
            .collect();
        Self { of_row, members }
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// Unbiased standard deviation (torch.std); needs at least 2 values.
fn std_unbiased(values: &[f64]) -> f64 {
    let mu = mean(values);
    (values.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / (values.len() as f64 - 1.0)).sqrt()
}

/// Group (mean, std) with verl's singleton convention (0, 1).
fn group_stats(scores: &[f64], groups: &Groups) -> Vec<(f64, f64)> {
    groups
        .members
        .iter()
        .map(|rows| {
            let values: Vec<f64> = rows.iter().map(|&r| scores[r]).collect();
            if values.len() == 1 {
                (0.0, 1.0)
            } else {
                (mean(&values), std_unbiased(&values))
            }
        })
        .collect()
}

fn grpo_rows(scores: &[f64], groups: &Groups, cfg: &AdvantageConfig) -> Vec<f64> {
    let stats = group_stats(scores, groups);
    scores
        .iter()
        .zip(&groups.of_row)
        .map(|(s, &g)| {
            let (mu, sigma) = stats[g];
            if !cfg.norm_adv_by_std_in_grpo {
                return s - mu;
            }
            // verl's singleton std is an f32 tensor, so `1 + ε` is rounded to f32 there.
            let denominator =
                if groups.members[g].len() == 1 { f64::from(1.0f32 + cfg.epsilon as f32) } else { sigma + cfg.epsilon };
            (s - mu) / denominator
        })
        .collect()
}

/// verl's `group_mean_std` works in f32 (`std = sqrt(max(Σ(x−μ)²/max(n−1, 1), 0))`, singleton (0, 1)); the
/// f32 rounding is kept so the results match verl's to the last bits that matter.
fn grpo_vectorized_rows(scores: &[f64], groups: &Groups, cfg: &AdvantageConfig) -> Vec<f64> {
    let stats: Vec<(f32, f32)> = groups
        .members
        .iter()
        .map(|rows| {
            let count = rows.len() as f32;
            let total: f32 = rows.iter().map(|&r| scores[r] as f32).sum();
            let mu = total / count.max(1.0);
            let squares: f32 = rows.iter().map(|&r| (scores[r] as f32 - mu) * (scores[r] as f32 - mu)).sum();
            let sigma = (squares / (count - 1.0).max(1.0)).max(0.0).sqrt();
            if count <= 1.0 {
                (0.0, 1.0)
            } else {
                (mu, sigma)
            }
        })
        .collect();
    scores
        .iter()
        .zip(&groups.of_row)
        .map(|(s, &g)| {
            let (mu, sigma) = stats[g];
            if cfg.norm_adv_by_std_in_grpo {
                (s - f64::from(mu)) / f64::from(sigma + cfg.epsilon as f32)
            } else {
                s - f64::from(mu)
            }
        })
        .collect()
}

fn grpo_passk_rows(scores: &[f64], groups: &Groups, cfg: &AdvantageConfig) -> Result<Vec<f64>, AlgoError> {
    let mut advantages = vec![0.0; scores.len()];
    for rows in &groups.members {
        if rows.len() < 2 {
            return Err(AlgoError::Advantage {
                estimator: "grpo_passk",
                message: format!("pass@k needs at least 2 samples per group, got {} for row {}", rows.len(), rows[0]),
            });
        }
        let values: Vec<f64> = rows.iter().map(|&r| scores[r]).collect();
        // The first occurrence of the maximum wins; on a tie the advantage is 0 whichever row gets it.
        let mut best = 0;
        for (i, v) in values.iter().enumerate() {
            if *v > values[best] {
                best = i;
            }
        }
        let second =
            values.iter().enumerate().filter(|(i, _)| *i != best).map(|(_, v)| *v).fold(f64::NEG_INFINITY, f64::max);
        let mut advantage = values[best] - second;
        if cfg.norm_adv_by_std_in_grpo {
            advantage /= std_unbiased(&values) + cfg.epsilon;
        }
        advantages[rows[best]] = advantage;
    }
    Ok(advantages)
}

fn rloo_rows(scores: &[f64], groups: &Groups) -> Vec<f64> {
    let stats = group_stats(scores, groups);
    scores
        .iter()
        .zip(&groups.of_row)
        .map(|(s, &g)| {
            let n = groups.members[g].len() as f64;
            if n > 1.0 {
                s * n / (n - 1.0) - stats[g].0 * n / (n - 1.0)
            } else {
                *s
            }
        })
        .collect()
}

fn rloo_vectorized_rows(scores: &[f64], groups: &Groups) -> Vec<f64> {
    let sums: Vec<f64> = groups.members.iter().map(|rows| rows.iter().map(|&r| scores[r]).sum()).collect();
    scores
        .iter()
        .zip(&groups.of_row)
        .map(|(s, &g)| {
            let c = groups.members[g].len() as f64;
            if c > 1.0 {
                (c * s - sums[g]) / (c - 1.0)
            } else {
                0.0
            }
        })
        .collect()
}

fn opo_rows(batch: &Batch, groups: &Groups) -> Vec<f64> {
    let scores = batch.scores();
    let lengths = batch.lengths();
    let baselines: Vec<f64> = groups
        .members
        .iter()
        .map(|rows| {
            let total_length: f64 = rows.iter().map(|&r| lengths[r]).sum();
            // verl divides 0 by 0 when a whole group is empty; its rows are fully masked, so 0 is as good.
            if rows.len() == 1 || total_length == 0.0 {
                0.0
            } else {
                rows.iter().map(|&r| lengths[r] * scores[r]).sum::<f64>() / total_length
            }
        })
        .collect();
    scores.iter().zip(&groups.of_row).map(|(s, &g)| s - baselines[g]).collect()
}

fn gpg_rows(scores: &[f64], groups: &Groups) -> Vec<f64> {
    let nonzero = scores.iter().filter(|s| **s != 0.0).count().max(1);
    // verl computes α as `int / int-tensor`, which torch returns in f32.
    let alpha = f64::from((scores.len() as f64 / nonzero as f64) as f32);
    let stats = group_stats(scores, groups);
    scores.iter().zip(&groups.of_row).map(|(s, &g)| alpha * (s - stats[g].0) / 1.0).collect()
}

fn gae(batch: &Batch, values: &[f64], cfg: &AdvantageConfig) -> Result<(Tensor, Tensor), AlgoError> {
    let (rows, cols) = (batch.rows, batch.cols);
    let mut advantages = vec![0.0; rows * cols];
    for i in 0..rows {
        let (mut next_value, mut last_gae) = (0.0, 0.0);
        for t in (0..cols).rev() {
            let k = i * cols + t;
            let m = batch.mask[k];
            let delta = batch.rewards[k] + cfg.gamma * next_value - values[k];
            let gae_t = delta + cfg.gamma * cfg.lam * last_gae;
            // Masked (observation) tokens pass the value and the advantage through unchanged.
            next_value = values[k] * m + (1.0 - m) * next_value;
            last_gae = gae_t * m + (1.0 - m) * last_gae;
            advantages[k] = last_gae;
        }
    }
    let returns: Vec<f64> = advantages.iter().zip(values).map(|(a, v)| a + v).collect();
    let advantages = masked_whiten(&batch.matrix(&advantages), &batch.mask_tensor(), true)?;
    Ok((advantages, batch.matrix(&returns)))
}

fn reinforce_plus_plus(batch: &Batch, cfg: &AdvantageConfig) -> Result<(Tensor, Tensor), AlgoError> {
    let (rows, cols) = (batch.rows, batch.cols);
    let mut returns = vec![0.0; rows * cols];
    for i in 0..rows {
        let mut running = 0.0;
        for t in (0..cols).rev() {
            let k = i * cols + t;
            let m = batch.mask[k];
            let candidate = batch.rewards[k] + cfg.gamma * running;
            returns[k] = candidate * m;
            running = candidate * m + running * (1.0 - m);
        }
    }
    let mask = batch.mask_tensor();
    let returns = batch.matrix(&returns);
    let advantages = masked_whiten(&returns, &mask, true)? * &mask;
    Ok((advantages, returns))
}

fn reinforce_plus_plus_baseline(batch: &Batch, groups: &Groups) -> Result<(Tensor, Tensor), AlgoError> {
    let scores = batch.scores();
    let stats = group_stats(&scores, groups);
    let centered: Vec<f64> = scores.iter().zip(&groups.of_row).map(|(s, &g)| s - stats[g].0).collect();
    let (tiled, _) = batch.outcome(&centered);
    let mask = batch.mask_tensor();
    let advantages = masked_whiten(&tiled, &mask, true)? * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// Σ_{t' ≥ t} r·m, accumulated from the end.
fn reward_to_go(batch: &Batch) -> Vec<f64> {
    let (rows, cols) = (batch.rows, batch.cols);
    let mut returns = vec![0.0; rows * cols];
    for i in 0..rows {
        let mut acc = 0.0;
        for t in (0..cols).rev() {
            let k = i * cols + t;
            acc += batch.rewards[k] * batch.mask[k];
            returns[k] = acc;
        }
    }
    returns
}

fn remax(batch: &Batch, baselines: &[f64]) -> (Tensor, Tensor) {
    let returns = reward_to_go(batch);
    let advantages: Vec<f64> =
        returns.iter().enumerate().map(|(k, g)| g - baselines[k / batch.cols] * batch.mask[k]).collect();
    (batch.matrix(&advantages), batch.matrix(&returns))
}

fn gdpo(
    batch: &Batch,
    groups: &Groups,
    extra_scores: Option<&BTreeMap<String, Tensor>>,
    cfg: &AdvantageConfig,
) -> Result<(Tensor, Tensor), AlgoError> {
    let fail = |message: String| AlgoError::Advantage { estimator: "gdpo", message };
    let components: Vec<Vec<f64>> = if cfg.gdpo_reward_keys.is_empty() {
        vec![batch.scores()]
    } else {
        let scores = extra_scores
            .ok_or_else(|| fail("algorithm.gdpo_reward_keys is set but no extra_scores were given".into()))?;
        cfg.gdpo_reward_keys
            .iter()
            .map(|key| {
                let tensor = scores.get(key).ok_or_else(|| {
                    fail(format!(
                        "reward component {key:?} is missing from extra_scores (have: {:?})",
                        scores.keys().collect::<Vec<_>>()
                    ))
                })?;
                if tensor.size() != [batch.rows as i64] {
                    return Err(fail(format!(
                        "extra_scores[{key:?}] must have shape [{}], got {:?}",
                        batch.rows,
                        tensor.size()
                    )));
                }
                // verl reads the components as f32.
                let values = to_vec_f64(tensor).map_err(|e| fail(format!("reading extra_scores[{key:?}]: {e}")))?;
                Ok(values.into_iter().map(|v| f64::from(v as f32)).collect())
            })
            .collect::<Result<_, _>>()?
    };
    let weights: Vec<f64> = match &cfg.gdpo_reward_weights {
        Some(weights) if weights.len() != components.len() => {
            return Err(fail(format!(
                "algorithm.gdpo_reward_weights has {} entries for {} reward keys",
                weights.len(),
                components.len()
            )))
        }
        Some(weights) => weights.iter().map(|w| f64::from(*w as f32)).collect(),
        None => vec![1.0; components.len()],
    };
    let mut combined = vec![0.0; batch.rows];
    for (scores, weight) in components.iter().zip(&weights) {
        for (total, a) in combined.iter_mut().zip(grpo_rows(scores, groups, cfg)) {
            *total += weight * a;
        }
    }
    let (summed, _) = batch.outcome(&combined);
    let mask = batch.mask_tensor();
    let advantages = masked_whiten(&summed, &mask, true)? * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// What the optimal-token-baseline estimators weight the baseline by.
struct PathVariance {
    old: Vec<f64>,
    spsq: Vec<f64>,
    is_weights: Option<Vec<f64>>,
}

fn optimal_token_baseline(
    batch: &Batch,
    groups: &Groups,
    path: &PathVariance,
    zero_tail: bool,
    compact: bool,
) -> (Tensor, Tensor) {
    const EPS: f64 = 1e-8;
    let (rows, cols) = (batch.rows, batch.cols);
    let returns = reward_to_go(batch);
    // W_t = Σ_{j ≤ t} (1 − 2π_j + Σπ²)·ρ_j²·m_j
    let mut cumulative = vec![0.0; rows * cols];
    for i in 0..rows {
        let mut acc = 0.0;
        for t in 0..cols {
            let k = i * cols + t;
            let mut w = 1.0 - 2.0 * path.old[k].exp() + path.spsq[k];
            if let Some(weights) = &path.is_weights {
                w *= weights[k] * weights[k];
            }
            acc += w * batch.mask[k];
            cumulative[k] = acc;
        }
    }
    let lengths: Vec<usize> = batch.lengths().iter().map(|l| *l as usize).collect();
    // The positions each row's baseline is indexed by: every column, or (compact) its valid tokens in order.
    let positions: Vec<Vec<usize>> = (0..rows)
        .map(|i| {
            if compact {
                (0..cols).filter(|&t| batch.mask[i * cols + t] != 0.0).collect()
            } else {
                (0..cols).collect()
            }
        })
        .collect();
    let width = if compact { lengths.iter().copied().max().unwrap_or(0) } else { cols };
    let weight_at = |i: usize, p: usize| -> f64 {
        match positions[i].get(p) {
            Some(&t) if compact => cumulative[i * cols + t],
            Some(&t) => cumulative[i * cols + t] * batch.mask[i * cols + t],
            None => 0.0,
        }
    };
    let return_at = |i: usize, p: usize| -> f64 { positions[i].get(p).map_or(0.0, |&t| returns[i * cols + t]) };
    let mut baselines: Vec<Vec<f64>> = vec![vec![0.0; width]; rows];
    for members in &groups.members {
        let members: Vec<usize> =
            if compact { members.iter().copied().filter(|&i| lengths[i] > 0).collect() } else { members.clone() };
        if members.len() < 2 {
            continue;
        }
        let baseline: Vec<f64> = (0..width)
            .map(|p| {
                let numerator: f64 = members.iter().map(|&i| return_at(i, p) * weight_at(i, p)).sum();
                let denominator: f64 = members.iter().map(|&i| weight_at(i, p)).sum::<f64>() + EPS;
                numerator / denominator
            })
            .collect();
        for &i in &members {
            baselines[i].clone_from(&baseline);
        }
        if zero_tail {
            let mut sorted: Vec<usize> = members.iter().map(|&i| lengths[i]).collect();
            sorted.sort_unstable();
            let (longest, second) = (sorted[sorted.len() - 1], sorted[sorted.len() - 2]);
            let holders: Vec<usize> = members.iter().copied().filter(|&i| lengths[i] == longest).collect();
            if holders.len() == 1 && longest > second {
                for value in baselines[holders[0]].iter_mut().skip(second) {
                    *value = 0.0;
                }
            }
        }
    }
    let mut advantages = vec![0.0; rows * cols];
    for i in 0..rows {
        for (p, &t) in positions[i].iter().enumerate() {
            let k = i * cols + t;
            advantages[k] = (returns[k] - baselines[i][p]) * batch.mask[k];
        }
    }
    (batch.matrix(&advantages), batch.matrix(&returns))
}

fn multi_trajectory_grpo(
    batch: &Batch,
    keys: &[String],
    index: &[String],
    cfg: &AdvantageConfig,
) -> Result<(Tensor, Tensor), String> {
    // Session `{uid}_{session}` → (largest output index, its row), in order of first appearance.
    let mut session_of_row = Vec::with_capacity(keys.len());
    let mut finals: Vec<(i64, usize)> = Vec::new();
    let mut session_slot: HashMap<String, usize> = HashMap::new();
    for (row, key) in keys.iter().enumerate() {
        let parsed = parse_key(key)?;
        let (session, output) = (format!("{}_{}", parsed.uid, parsed.session_id), i64::from(parsed.index));
        let slot = *session_slot.entry(session).or_insert_with(|| {
            finals.push((output, row));
            finals.len() - 1
        });
        if finals[slot].0 < output {
            finals[slot] = (output, row);
        }
        session_of_row.push(slot);
    }
    let final_rows: Vec<usize> = finals.iter().map(|(_, row)| *row).collect();
    let scores = batch.scores();
    let final_scores: Vec<f64> = final_rows.iter().map(|&r| scores[r]).collect();
    let final_index: Vec<String> = final_rows.iter().map(|&r| index[r].clone()).collect();
    let per_final = grpo_rows(&final_scores, &Groups::new(&final_index), cfg);
    // verl reads each final row's advantage at its first valid token (argmax of the mask: 0 if none).
    let cols = batch.cols;
    let read: Vec<f64> = final_rows
        .iter()
        .zip(&per_final)
        .map(|(&r, a)| {
            let row = &batch.mask[r * cols..(r + 1) * cols];
            let first = row.iter().enumerate().fold(0, |best, (t, m)| if *m > row[best] { t } else { best });
            row.get(first).map_or(0.0, |m| a * m)
        })
        .collect();
    let per_row: Vec<f64> = session_of_row.iter().map(|&slot| read[slot]).collect();
    Ok(batch.outcome(&per_row))
}

//! PF-PPO (verl `compute_pf_ppo_reweight_data`, `algorithm.use_pf_ppo`): after GAE, the batch is resampled
//! with replacement, rows drawn in proportion to a weight of their score.

use std::str::FromStr;

use rand::distributions::{Distribution, WeightedIndex};
use rand::SeedableRng;

use jetrl_config::PfPpoMethod;

use crate::AlgoError;

/// `algorithm.pf_ppo.reweight_method` with its `weight_pow`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PfPpoReweight {
    /// `|score|^weight_pow`.
    Pow(f64),
    /// 1 for the batch's best and worst scores, 0 otherwise.
    MaxMin,
    /// 0.4 for the best score, 0.1 otherwise.
    MaxRandom,
}

impl PfPpoReweight {
    pub fn from_config(cfg: &jetrl_config::PfPpoConfig) -> Self {
        Self::new(cfg.reweight_method, cfg.weight_pow)
    }

    pub fn new(method: PfPpoMethod, weight_pow: f64) -> Self {
        match method {
            PfPpoMethod::Pow => Self::Pow(weight_pow),
            PfPpoMethod::MaxMin => Self::MaxMin,
            PfPpoMethod::MaxRandom => Self::MaxRandom,
        }
    }
}

impl FromStr for PfPpoReweight {
    type Err = AlgoError;

    /// `pow` (with the default power 2), `max_min`, `max_random`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s.parse()?, 2.0))
    }
}

/// The sampling weight of every row (before verl's `+1e-8` floor).
pub fn pf_ppo_weights(scores: &[f64], method: PfPpoReweight) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = scores.iter().copied().fold(f64::INFINITY, f64::min);
    scores
        .iter()
        .map(|&s| match method {
            PfPpoReweight::Pow(power) => s.abs().powf(power),
            PfPpoReweight::MaxMin => f64::from(u8::from(s == max || s == min)),
            PfPpoReweight::MaxRandom => {
                if s == max {
                    0.4
                } else {
                    0.1
                }
            }
        })
        .collect()
}

/// Row indices of the resampled batch (as many as rows, drawn with replacement), from the per-row sequence
/// scores (Σ token_level_scores) and a seed.
pub fn pf_ppo_resample(scores: &[f64], method: PfPpoReweight, seed: u64) -> Result<Vec<usize>, AlgoError> {
    if scores.is_empty() {
        return Ok(Vec::new());
    }
    let weights: Vec<f64> = pf_ppo_weights(scores, method).into_iter().map(|w| (w + 1e-8).max(1e-8)).collect();
    let distribution =
        WeightedIndex::new(&weights).map_err(|e| AlgoError::PfPpo(format!("invalid sampling weights: {e}")))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    Ok((0..scores.len()).map(|_| distribution.sample(&mut rng)).collect())
}

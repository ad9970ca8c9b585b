//! RL math for jetrl on `tch` tensors: advantage estimators, policy and value losses, loss aggregation, KL
//! estimators and controllers, rollout correction. Losses are differentiable (autograd) and dtype-generic:
//! f64 reproduces verl's float64 reference to 1e-6, f32 is what training uses. Definitions follow verl
//! (`verl/trainer/ppo/core_algos.py`, `rollout_corr_helper.py`, `workers/utils/losses.py`,
//! `trainer/ppo/v1/utils.py`) so that a verl config means the same thing here.
//!
//! | verl | here |
//! | --- | --- |
//! | `AdvantageEstimator`, `get_adv_estimator_fn`, `ray_trainer.compute_advantage` | [`AdvantageEstimator`], [`compute_advantage`] |
//! | `compute_advantage_for_multi_trajectories` (V1, GRPO) | [`compute_advantage`] with [`AdvantageInputs::keys`] |
//! | `compute_gae_advantage_return`, `compute_grpo_outcome_advantage`, … | the variants of [`AdvantageEstimator`] |
//! | `get_policy_loss_fn(loss_mode)`, `compute_policy_loss_*` | [`PolicyLossMode`], [`compute_policy_loss`] |
//! | `actor.clip_ratio*`, `tau_*`, `policy_loss.*` | [`PolicyLossParams`] (`from_config`) |
//! | `losses.ppo_loss` (pg − entropy bonus + KL loss) | [`compute_actor_loss`] |
//! | `agg_loss(…, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)` | [`agg_loss`], [`AggMode`], [`GlobalBatchInfo`] |
//! | `kl_penalty`, `kl_penalty_forward` | [`kl_penalty`], [`KlPenalty`] |
//! | `apply_kl_penalty`, `compute_rewards` | [`apply_kl_penalty`], [`compute_rewards`] |
//! | `FixedKLController`, `AdaptiveKLController`, `get_kl_controller` | [`KlController`] (`from_config`, serde) |
//! | `compute_value_loss` | [`compute_value_loss`] |
//! | `verl_F.entropy_from_logits`, `logprobs_from_logits`, `calculate_sum_pi_squared_from_logits` | [`entropy_from_logits`], [`logprobs_from_logits`], [`sum_pi_squared_from_logits`] |
//! | `verl_F.masked_sum/mean/var/whiten` | [`masked_sum`], [`masked_mean`], [`masked_var`], [`masked_whiten`] |
//! | `compute_rollout_correction_and_rejection_mask` | [`compute_rollout_correction`], [`RolloutCorrectionParams`] |
//! | `compute_pf_ppo_reweight_data` | [`pf_ppo_resample`] (returns the row indices) |
//!
//! Deliberate differences, all where verl would produce NaN: `agg_loss` returns 0 (not 0/0) for a
//! micro-batch without valid tokens or sequences and no global count, and OPO's baseline is 0 for a group
//! whose rows are all empty. `grpo_vectorized` and `gdpo` honour `norm_adv_by_std_in_grpo` (verl's dispatch
//! does not pass it to them, so they always normalise there).
//!
//! [`golden::check_case`] runs one case of `tests/golden/algos_*.json` against these functions.

mod advantage;
mod agg;
mod error;
pub mod golden;
mod kl;
mod logits;
mod masked;
mod pf_ppo;
mod policy_loss;
mod rollout_correction;
mod util;
mod value;

pub use advantage::{compute_advantage, AdvantageConfig, AdvantageEstimator, AdvantageInputs};
pub use agg::{agg_loss, AggMode, GlobalBatchInfo};
pub use error::AlgoError;
pub use kl::{
    apply_kl_penalty, compute_rewards, f_kl_penalty, kl_penalty, KlController, KlEstimator, KlPenalty, KlPenaltyMetrics,
};
pub use logits::{
    entropy_from_logits, f_entropy_from_logits, f_logprobs_from_logits, logprobs_from_logits,
    sum_pi_squared_from_logits,
};
pub use masked::{masked_mean, masked_sum, masked_var, masked_whiten, Axis};
pub use pf_ppo::{pf_ppo_resample, pf_ppo_weights, PfPpoReweight};
pub use policy_loss::{
    compute_actor_loss, compute_policy_loss, ActorLossInputs, ActorLossMetrics, ActorLossParams, PolicyLossInputs,
    PolicyLossMetrics, PolicyLossMode, PolicyLossParams,
};
pub use rollout_correction::{
    compute_rollout_correction, parse_rejection, BypassLoss, IsLevel, IsThreshold, RejectionCriterion,
    RolloutCorrection, RolloutCorrectionParams, RsLevel, RsStatistic,
};
pub use value::{compute_value_loss, ValueLossMetrics};

//! Policy-gradient losses (verl `core_algos.compute_policy_loss_*`, registry `actor.policy_loss.loss_mode`)
//! and the total actor loss of an update (verl `losses.ppo_loss`: policy loss − entropy bonus + KL loss).
//!
//! Notation: Δ = log π_θ − log π_old, ρ = exp(Δ), A = advantages, m = response mask, ε_low / ε_high the
//! clip ratios. Every loss is multiplied by the rollout IS weights when given (geo_mean first reduces them
//! to a per-sequence geometric mean; bypass_mode computes its own).

use std::collections::BTreeMap;

use rand::SeedableRng;
use tch::{Device, Kind, Tensor};

use crate::agg::{agg_loss, AggMode, GlobalBatchInfo};
use crate::kl::{kl_penalty, KlPenalty};
use crate::masked::{masked_mean, Axis};
use crate::rollout_correction::{compute_rollout_correction, BypassLoss, RolloutCorrectionParams};
use crate::util::{check_same_2d, item, mask_like, sum_last, to_vec_f64};
use crate::AlgoError;

pub use jetrl_config::PolicyLossMode;

/// The knobs of the policy losses, named as verl's `actor.*` / `actor.policy_loss.*` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLossParams {
    pub clip_ratio: f64,
    /// `None` falls back to `clip_ratio`.
    pub clip_ratio_low: Option<f64>,
    /// `None` falls back to `clip_ratio`.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound (vanilla, must be > 1) and IS truncation (dppo_*).
    pub clip_ratio_c: f64,
    pub loss_agg_mode: AggMode,
    /// Used when the [`GlobalBatchInfo`] passed to the loss has none (verl `actor.loss_scale_factor`).
    pub loss_scale_factor: Option<f64>,
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    pub dro_beta: Option<f64>,
    /// Required by `bypass_mode` (verl `algorithm.rollout_correction`).
    pub rollout_correction: Option<RolloutCorrectionParams>,
    /// Seeds the random token pick of `clip_cov`; vary it per update for fresh picks.
    pub seed: u64,
}

impl Default for PolicyLossParams {
    fn default() -> Self {
        Self {
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            loss_agg_mode: AggMode::TokenMean,
            loss_scale_factor: None,
            tau_pos: 1.0,
            tau_neg: 1.05,
            clip_cov_ratio: 2e-4,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 2e-4,
            ppo_kl_coef: 0.1,
            dro_beta: None,
            rollout_correction: None,
            seed: 0,
        }
    }
}

impl PolicyLossParams {
    /// From `actor.*` (clip ratios, `loss_agg_mode`, `tau_*`, `policy_loss.*`); the clip_cov seed starts at
    /// `actor.data_loader_seed`. Add the rollout correction for bypass mode with [`Self::with_rollout_correction`].
    pub fn from_config(actor: &jetrl_config::ActorConfig) -> Result<Self, AlgoError> {
        let loss = &actor.policy_loss;
        Ok(Self {
            clip_ratio: actor.clip_ratio,
            clip_ratio_low: actor.clip_ratio_low,
            clip_ratio_high: actor.clip_ratio_high,
            clip_ratio_c: actor.clip_ratio_c,
            loss_agg_mode: actor.loss_agg_mode,
            loss_scale_factor: actor.loss_scale_factor,
            tau_pos: actor.tau_pos,
            tau_neg: actor.tau_neg,
            clip_cov_ratio: loss.clip_cov_ratio,
            clip_cov_lb: loss.clip_cov_lb,
            clip_cov_ub: loss.clip_cov_ub,
            kl_cov_ratio: loss.kl_cov_ratio,
            ppo_kl_coef: loss.ppo_kl_coef,
            dro_beta: loss.dro_beta,
            rollout_correction: None,
            seed: actor.data_loader_seed,
        })
    }

    /// Adds `algorithm.rollout_correction` (needed by `bypass_mode`).
    pub fn with_rollout_correction(mut self, cfg: &jetrl_config::RolloutCorrectionConfig) -> Result<Self, AlgoError> {
        self.rollout_correction = Some(RolloutCorrectionParams::from_config(cfg)?);
        Ok(self)
    }

    /// ε_low: `clip_ratio_low`, else `clip_ratio`.
    pub fn low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    /// ε_high: `clip_ratio_high`, else `clip_ratio`.
    pub fn high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }
}

/// The tensors of one (micro-)batch, all `[batch, response_len]`.
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInputs<'a> {
    pub old_log_prob: &'a Tensor,
    /// The current policy's log-probs: the loss is differentiable in them.
    pub log_prob: &'a Tensor,
    pub advantages: &'a Tensor,
    pub response_mask: &'a Tensor,
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// The metrics a loss reports (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`); `None` where
/// verl's loss does not report one. `extra` holds bypass mode's `rollout_corr/*` metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyLossMetrics {
    pub pg_clipfrac: Option<f64>,
    pub ppo_kl: Option<f64>,
    pub pg_clipfrac_lower: Option<f64>,
    pub extra: BTreeMap<String, f64>,
}

impl PolicyLossMetrics {
    /// verl's metric names.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        let mut map = self.extra.clone();
        for (name, value) in [
            ("actor/pg_clipfrac", self.pg_clipfrac),
            ("actor/ppo_kl", self.ppo_kl),
            ("actor/pg_clipfrac_lower", self.pg_clipfrac_lower),
        ] {
            if let Some(value) = value {
                map.insert(name.to_string(), value);
            }
        }
        map
    }

    fn clip(pg_clipfrac: &Tensor, ppo_kl: &Tensor, pg_clipfrac_lower: Option<&Tensor>) -> Self {
        Self {
            pg_clipfrac: Some(item(pg_clipfrac)),
            ppo_kl: Some(item(ppo_kl)),
            pg_clipfrac_lower: Some(pg_clipfrac_lower.map_or(0.0, item)),
            extra: BTreeMap::new(),
        }
    }
}

/// The policy loss of `mode` (a differentiable scalar) and its metrics.
pub fn compute_policy_loss(
    mode: PolicyLossMode,
    inputs: &PolicyLossInputs,
    params: &PolicyLossParams,
    info: &GlobalBatchInfo,
) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let fail = |message: String| AlgoError::PolicyLoss { mode: mode.as_str(), message };
    let mut named = vec![
        ("log_prob", inputs.log_prob),
        ("old_log_prob", inputs.old_log_prob),
        ("advantages", inputs.advantages),
        ("response_mask", inputs.response_mask),
    ];
    if let Some(weights) = inputs.rollout_is_weights {
        named.push(("rollout_is_weights", weights));
    }
    check_same_2d(&named).map_err(fail)?;
    let info = GlobalBatchInfo { loss_scale_factor: info.loss_scale_factor.or(params.loss_scale_factor), ..*info };
    let ctx = Ctx::new(inputs, params, &info);
    match mode {
        PolicyLossMode::Vanilla => vanilla(&ctx, inputs.response_mask, inputs.rollout_is_weights).map_err(fail),
        PolicyLossMode::Gspo => gspo(&ctx),
        PolicyLossMode::Sapo => sapo(&ctx),
        PolicyLossMode::Gpg => gpg(&ctx),
        PolicyLossMode::ClipCov => clip_cov(&ctx).map_err(fail),
        PolicyLossMode::KlCov => kl_cov(&ctx).map_err(fail),
        PolicyLossMode::GeoMean => Ok(geo_mean(&ctx)),
        PolicyLossMode::Cispo => cispo(&ctx),
        PolicyLossMode::DppoTv | PolicyLossMode::DppoKl => dppo(&ctx, mode == PolicyLossMode::DppoKl),
        PolicyLossMode::Dro => dro(&ctx).map_err(fail),
        PolicyLossMode::BypassMode => bypass(&ctx).map_err(fail),
    }
}

/// What every loss reads.
struct Ctx<'a> {
    old: &'a Tensor,
    lp: &'a Tensor,
    adv: &'a Tensor,
    mask: &'a Tensor,
    is_weights: Option<&'a Tensor>,
    params: &'a PolicyLossParams,
    info: &'a GlobalBatchInfo,
}

impl<'a> Ctx<'a> {
    fn new(inputs: &PolicyLossInputs<'a>, params: &'a PolicyLossParams, info: &'a GlobalBatchInfo) -> Self {
        Self {
            old: inputs.old_log_prob,
            lp: inputs.log_prob,
            adv: inputs.advantages,
            mask: inputs.response_mask,
            is_weights: inputs.rollout_is_weights,
            params,
            info,
        }
    }

    /// Δ = log π − log π_old, optionally clamped to ±20 before it is exponentiated.
    fn log_ratio(&self, clamp: bool) -> Tensor {
        let delta = self.lp - self.old;
        if clamp {
            delta.clamp(-20.0, 20.0)
        } else {
            delta
        }
    }

    fn weighted(&self, losses: Tensor) -> Tensor {
        match self.is_weights {
            Some(weights) => losses * weights,
            None => losses,
        }
    }

    fn agg(&self, losses: &Tensor, mode: AggMode) -> Result<Tensor, AlgoError> {
        agg_loss(losses, self.mask, mode, self.info)
    }

    /// `masked_mean(x)` of a detached, floating copy (metrics never join the graph).
    fn mean(&self, values: &Tensor) -> Tensor {
        tch::no_grad(|| masked_mean(&values.detach().to_kind(self.lp.kind()), self.mask, Axis::All))
    }
}

fn vanilla(ctx: &Ctx, mask: &Tensor, is_weights: Option<&Tensor>) -> Result<(Tensor, PolicyLossMetrics), String> {
    let p = ctx.params;
    if p.clip_ratio_c.is_nan() || p.clip_ratio_c <= 1.0 {
        return Err(format!("clip_ratio_c is the dual-clip lower bound and must be > 1, got {}", p.clip_ratio_c));
    }
    let ctx = Ctx { mask, is_weights, ..*ctx };
    let delta = ctx.log_ratio(true);
    let ratio = delta.exp();
    let neg_adv = -ctx.adv;
    let unclipped = &neg_adv * &ratio;
    let clipped = &neg_adv * ratio.clamp(1.0 - p.low(), 1.0 + p.high());
    let clip_loss = unclipped.maximum(&clipped);
    let dual_bound = &neg_adv * p.clip_ratio_c;
    let dual_loss = dual_bound.minimum(&clip_loss);
    let negative = ctx.adv.lt(0.0);
    let losses = dual_loss.where_self(&negative, &clip_loss);
    let loss = ctx.agg(&ctx.weighted(losses), p.loss_agg_mode).map_err(|e| e.to_string())?;
    let metrics = PolicyLossMetrics::clip(
        &ctx.mean(&clipped.gt_tensor(&unclipped)),
        &ctx.mean(&-&delta),
        Some(&ctx.mean(&clip_loss.gt_tensor(&dual_bound).logical_and(&negative))),
    );
    Ok((loss, metrics))
}

fn gspo(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let p = ctx.params;
    let delta = ctx.log_ratio(false);
    let mask = mask_like(ctx.mask, ctx.lp);
    let lengths = sum_last(&mask).clamp_min(1.0);
    let seq_log_ratio = sum_last(&(&delta * &mask)) / lengths;
    let log_ratio = (ctx.lp - ctx.lp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp_max(10.0);
    let ratio = log_ratio.exp();
    let neg_adv = -ctx.adv;
    let unclipped = &neg_adv * &ratio;
    let clipped = &neg_adv * ratio.clamp(1.0 - p.low(), 1.0 + p.high());
    let losses = ctx.weighted(unclipped.maximum(&clipped));
    let loss = ctx.agg(&losses, AggMode::SeqMeanTokenMean)?;
    let metrics = PolicyLossMetrics::clip(&ctx.mean(&clipped.gt_tensor(&unclipped)), &ctx.mean(&-&delta), None);
    Ok((loss, metrics))
}

fn sapo(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let p = ctx.params;
    let delta = ctx.log_ratio(true);
    let ratio = delta.exp();
    let positive = ctx.adv.gt(0.0);
    let taus = ctx.adv.full_like(p.tau_neg).masked_fill(&positive, p.tau_pos);
    let gates = ((ratio - 1.0) * &taus).sigmoid() * (taus.full_like(4.0) / &taus);
    let losses = ctx.weighted(-gates * ctx.adv);
    let loss = ctx.agg(&losses, AggMode::SeqMeanTokenMean)?;
    let zero = Tensor::zeros([], (ctx.lp.kind(), Device::Cpu));
    let metrics = PolicyLossMetrics::clip(&zero, &ctx.mean(&-&delta), None);
    Ok((loss, metrics))
}

fn gpg(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let losses = ctx.weighted(-ctx.lp * ctx.adv);
    Ok((ctx.agg(&losses, ctx.params.loss_agg_mode)?, PolicyLossMetrics::default()))
}

fn clip_cov(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), String> {
    let p = ctx.params;
    if p.clip_cov_ratio.is_nan() || p.clip_cov_ratio <= 0.0 {
        return Err(format!("clip_cov_ratio must be > 0, got {}", p.clip_cov_ratio));
    }
    let delta = ctx.log_ratio(false);
    let ratio = delta.exp();
    let neg_adv = -ctx.adv;
    let unclipped = &neg_adv * &ratio;
    let clipped = &neg_adv * ratio.clamp(1.0 - p.low(), 1.0 + p.high());
    let valid = ctx.mask.gt(0.0);
    // Which tokens lose their gradient is decided on detached values, on the host, with a seeded RNG.
    let corr = tch::no_grad(|| -> Result<Tensor, tch::TchError> {
        let clipped_by_ratio = clipped.gt_tensor(&unclipped).logical_and(&valid);
        let adv_mean = masked_mean(ctx.adv, ctx.mask, Axis::All);
        let lp_mean = masked_mean(&ctx.lp.detach(), ctx.mask, Axis::All);
        let cov = (ctx.adv - adv_mean) * (ctx.lp.detach() - lp_mean);
        let candidate = cov
            .lt(p.clip_cov_ub)
            .logical_and(&cov.gt(p.clip_cov_lb))
            .logical_and(&valid)
            .logical_and(&clipped_by_ratio.logical_not());
        let flags = to_vec_f64(&candidate)?;
        let candidates: Vec<usize> = flags.iter().enumerate().filter(|(_, f)| **f != 0.0).map(|(i, _)| i).collect();
        let valid_tokens = item(&mask_like(ctx.mask, ctx.lp).sum(None::<Kind>));
        let clip_num = ((p.clip_cov_ratio * valid_tokens) as usize).max(1).min(candidates.len());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(p.seed);
        let mut corr = vec![1.0f64; flags.len()];
        for pick in rand::seq::index::sample(&mut rng, candidates.len(), clip_num) {
            corr[candidates[pick]] = 0.0;
        }
        Tensor::f_from_slice(&corr)?.f_reshape(ctx.lp.size())?.f_to_kind(ctx.lp.kind())?.f_to_device(ctx.lp.device())
    })
    .map_err(|e| format!("selecting the clip-cov tokens failed: {e}"))?;
    let losses = ctx.weighted(unclipped.maximum(&clipped) * &corr);
    let loss = ctx.agg(&losses, p.loss_agg_mode).map_err(|e| e.to_string())?;
    let metrics = PolicyLossMetrics {
        pg_clipfrac: Some(item(&ctx.mean(&corr.eq(0.0)))),
        ppo_kl: Some(item(&ctx.mean(&-&delta))),
        pg_clipfrac_lower: None,
        extra: BTreeMap::new(),
    };
    Ok((loss, metrics))
}

fn kl_cov(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), String> {
    let p = ctx.params;
    if p.kl_cov_ratio.is_nan() || p.kl_cov_ratio <= 0.0 {
        return Err(format!("kl_cov_ratio must be > 0, got {}", p.kl_cov_ratio));
    }
    let delta = ctx.log_ratio(false);
    let abs_kl = delta.abs();
    let ratio = delta.exp();
    let plain = -ctx.adv * &ratio;
    let with_kl = &plain + &abs_kl * p.ppo_kl_coef;
    // The top-covariance tokens are chosen on detached host copies, with torch's own topk so that ties
    // resolve as in verl.
    let selected = tch::no_grad(|| -> Result<Tensor, tch::TchError> {
        let valid = ctx.mask.f_gt(0.0)?;
        let flat_valid = to_vec_f64(&valid)?;
        let positions: Vec<i64> =
            flat_valid.iter().enumerate().filter(|(_, v)| **v != 0.0).map(|(i, _)| i as i64).collect();
        let mut selected = vec![0.0f64; flat_valid.len()];
        if !positions.is_empty() {
            let adv = ctx.adv.f_detach()?.f_masked_select(&valid)?.f_to_device(Device::Cpu)?;
            let lp = ctx.lp.f_detach()?.f_masked_select(&valid)?.f_to_device(Device::Cpu)?;
            let cov = (&adv - adv.f_mean(None::<Kind>)?) * (&lp - lp.f_mean(None::<Kind>)?);
            let k = ((positions.len() as f64 * p.kl_cov_ratio) as i64).max(1);
            let (_, top) = cov.f_topk(k, -1, true, true)?;
            for index in Vec::<i64>::try_from(&top)? {
                selected[positions[index as usize] as usize] = 1.0;
            }
        }
        Tensor::f_from_slice(&selected)?.f_reshape(ctx.lp.size())?.f_to_device(ctx.lp.device())?.f_gt(0.5)
    })
    .map_err(|e| format!("selecting the kl-cov tokens failed: {e}"))?;
    let losses = ctx.weighted(with_kl.where_self(&selected, &plain));
    let loss = ctx.agg(&losses, p.loss_agg_mode).map_err(|e| e.to_string())?;
    let metrics = PolicyLossMetrics { ppo_kl: Some(item(&ctx.mean(&abs_kl))), ..PolicyLossMetrics::default() };
    Ok((loss, metrics))
}

fn geo_mean(ctx: &Ctx) -> (Tensor, PolicyLossMetrics) {
    let p = ctx.params;
    let delta = ctx.log_ratio(false);
    let sign = ctx.adv.sign();
    let delta_clamped = delta.clamp(-p.low(), p.high());
    let delta_min = (&sign * &delta).minimum(&(&sign * &delta_clamped)) * &sign;
    let mask = mask_like(ctx.mask, ctx.lp);
    let lengths = sum_last(&mask) + 1e-8;
    let ratio = (sum_last(&(&delta_min * &mask)) / &lengths).exp();
    let seq_adv = sum_last(&(ctx.adv * &mask)) / &lengths;
    let mut losses = -seq_adv * ratio;
    if let Some(weights) = ctx.is_weights {
        let seq_weights = (sum_last(&((weights + 1e-10).log() * &mask)) / &lengths).exp();
        losses *= seq_weights;
    }
    // GMPO averages over sequences, whatever loss_agg_mode and the global batch say (as verl).
    let loss = losses.mean(None::<Kind>);
    let clamped = delta.ne_tensor(&delta_clamped);
    let metrics = PolicyLossMetrics::clip(
        &ctx.mean(&clamped.logical_and(&ctx.adv.gt(0.0))),
        &ctx.mean(&-&delta),
        Some(&ctx.mean(&clamped.logical_and(&ctx.adv.lt(0.0)))),
    );
    (loss, metrics)
}

fn cispo(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let p = ctx.params;
    let delta = ctx.log_ratio(true);
    let ratio = delta.exp();
    let clipped_ratio = ratio.clamp(1.0 - p.low(), 1.0 + p.high());
    let losses = ctx.weighted(-clipped_ratio.detach() * ctx.adv * ctx.lp);
    let loss = ctx.agg(&losses, p.loss_agg_mode)?;
    let zero = Tensor::zeros([], (ctx.lp.kind(), Device::Cpu));
    let metrics =
        PolicyLossMetrics::clip(&ctx.mean(&ratio.ne_tensor(&clipped_ratio)), &ctx.mean(&-&delta), Some(&zero));
    Ok((loss, metrics))
}

fn dppo(ctx: &Ctx, binary_kl: bool) -> Result<(Tensor, PolicyLossMetrics), AlgoError> {
    let p = ctx.params;
    let delta = ctx.log_ratio(true);
    let ratio = delta.exp();
    let truncated = ratio.clamp_max(p.clip_ratio_c).detach();
    let prob = ctx.lp.exp();
    let old_prob = ctx.old.exp();
    let (valid_positive, valid_negative) = if binary_kl {
        let divergence = &old_prob * (ctx.old - ctx.lp)
            + (-&old_prob + 1.0) * ((-&old_prob + 1.0 + 1e-8) / (-&prob + 1.0 + 1e-8)).log();
        (
            divergence.le(p.high()).logical_or(&prob.le_tensor(&old_prob)),
            divergence.le(p.low()).logical_or(&prob.ge_tensor(&old_prob)),
        )
    } else {
        let change = &prob - &old_prob;
        (change.le(p.high()), change.ge(-p.low()))
    };
    let valid = valid_positive.where_self(&ctx.adv.gt(0.0), &valid_negative).to_kind(ctx.lp.kind()).detach();
    let losses = ctx.weighted(-ctx.adv * &truncated * ctx.lp * &valid);
    let loss = ctx.agg(&losses, p.loss_agg_mode)?;
    let metrics = PolicyLossMetrics::clip(
        &ctx.mean(&(-&valid + 1.0)),
        &ctx.mean(&-&delta),
        Some(&ctx.mean(&(ratio.gt(p.clip_ratio_c).to_kind(ctx.lp.kind()) * &valid))),
    );
    Ok((loss, metrics))
}

fn dro(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), String> {
    let beta = match ctx.params.dro_beta {
        Some(beta) if beta > 0.0 => beta,
        other => return Err(format!("policy_loss.dro_beta must be a positive number, got {other:?}")),
    };
    let delta = ctx.log_ratio(false);
    let losses = ctx.weighted(-(ctx.lp * ctx.adv - delta.square() * (0.5 * beta)));
    let loss = ctx.agg(&losses, ctx.params.loss_agg_mode).map_err(|e| e.to_string())?;
    let metrics = PolicyLossMetrics { ppo_kl: Some(item(&ctx.mean(&-&delta))), ..PolicyLossMetrics::default() };
    Ok((loss, metrics))
}

fn bypass(ctx: &Ctx) -> Result<(Tensor, PolicyLossMetrics), String> {
    let correction = ctx.params.rollout_correction.as_ref().ok_or_else(|| {
        "bypass_mode needs algorithm.rollout_correction (PolicyLossParams::with_rollout_correction)".to_string()
    })?;
    // In bypass mode the old log-probs are the rollout's: the IS ratio is π_θ / π_rollout.
    let corrected =
        compute_rollout_correction(&ctx.lp.detach(), ctx.old, ctx.mask, correction).map_err(|e| e.to_string())?;
    let (loss, mut metrics) = match correction.loss_type {
        BypassLoss::Reinforce => {
            let ctx = Ctx { mask: &corrected.response_mask, is_weights: corrected.weights.as_ref(), ..*ctx };
            let losses = ctx.weighted(-ctx.adv * ctx.lp);
            let loss = ctx.agg(&losses, ctx.params.loss_agg_mode).map_err(|e| e.to_string())?;
            let kl = ctx.mean(&-ctx.log_ratio(false));
            (loss, PolicyLossMetrics { ppo_kl: Some(item(&kl)), ..PolicyLossMetrics::default() })
        }
        // The clipped ratio already is the IS correction: applying the weights too would count it twice.
        BypassLoss::PpoClip => vanilla(ctx, &corrected.response_mask, None)?,
    };
    metrics.extra.extend(corrected.metrics);
    Ok((loss, metrics))
}

/// Everything the actor's update adds to the policy loss (verl `losses.ppo_loss`).
#[derive(Debug, Clone, PartialEq)]
pub struct ActorLossParams {
    pub mode: PolicyLossMode,
    pub policy: PolicyLossParams,
    /// The entropy bonus weight: `loss −= entropy_coeff·agg(entropy)`.
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: KlPenalty,
}

impl ActorLossParams {
    /// From `actor.*`; pass `algorithm.rollout_correction` for bypass mode. With its `bypass_mode` on, the loss is
    /// `bypass_mode` whatever `actor.policy_loss.loss_mode` says (verl's `apply_bypass_mode`).
    pub fn from_config(
        actor: &jetrl_config::ActorConfig,
        rollout_correction: Option<&jetrl_config::RolloutCorrectionConfig>,
    ) -> Result<Self, AlgoError> {
        let mut policy = PolicyLossParams::from_config(actor)?;
        if let Some(cfg) = rollout_correction {
            policy = policy.with_rollout_correction(cfg)?;
        }
        let bypass = rollout_correction.is_some_and(|rc| rc.bypass_mode);
        Ok(Self {
            mode: if bypass { PolicyLossMode::BypassMode } else { actor.policy_loss.loss_mode },
            policy,
            entropy_coeff: actor.entropy_coeff,
            use_kl_loss: actor.use_kl_loss,
            kl_loss_coef: actor.kl_loss_coef,
            kl_loss_type: actor.kl_loss_type,
        })
    }
}

/// The tensors of the actor loss: the policy-loss inputs plus the entropy (when computed) and the reference
/// log-probs (when `use_kl_loss`).
#[derive(Debug, Clone, Copy)]
pub struct ActorLossInputs<'a> {
    pub policy: PolicyLossInputs<'a>,
    pub entropy: Option<&'a Tensor>,
    pub ref_log_prob: Option<&'a Tensor>,
}

/// `actor/pg_loss`, `actor/entropy_loss`, `actor/kl_loss` (when computed) and the policy-loss metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActorLossMetrics {
    pub pg_loss: f64,
    pub entropy_loss: Option<f64>,
    pub kl_loss: Option<f64>,
    pub policy: PolicyLossMetrics,
}

impl ActorLossMetrics {
    /// verl's metric names.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        let mut map = self.policy.to_map();
        map.insert("actor/pg_loss".into(), self.pg_loss);
        if let Some(value) = self.entropy_loss {
            map.insert("actor/entropy_loss".into(), value);
        }
        if let Some(value) = self.kl_loss {
            map.insert("actor/kl_loss".into(), value);
        }
        map
    }
}

/// `pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl(log π, log π_ref))`, all aggregated with
/// `loss_agg_mode` and the same global-batch normalisation.
pub fn compute_actor_loss(
    inputs: &ActorLossInputs,
    params: &ActorLossParams,
    info: &GlobalBatchInfo,
) -> Result<(Tensor, ActorLossMetrics), AlgoError> {
    let (pg_loss, policy_metrics) = compute_policy_loss(params.mode, &inputs.policy, &params.policy, info)?;
    let info =
        GlobalBatchInfo { loss_scale_factor: info.loss_scale_factor.or(params.policy.loss_scale_factor), ..*info };
    let mode = params.policy.loss_agg_mode;
    let mask = inputs.policy.response_mask;
    let mut metrics =
        ActorLossMetrics { pg_loss: item(&pg_loss.detach()), policy: policy_metrics, ..Default::default() };
    let mut loss = pg_loss;
    if let Some(entropy) = inputs.entropy {
        let entropy_loss = agg_loss(entropy, mask, mode, &info)?;
        metrics.entropy_loss = Some(item(&entropy_loss.detach()));
        loss -= entropy_loss * params.entropy_coeff;
    }
    if params.use_kl_loss {
        let ref_log_prob = inputs.ref_log_prob.ok_or_else(|| AlgoError::PolicyLoss {
            mode: params.mode.as_str(),
            message: "actor.use_kl_loss is on but no ref_log_prob was given".into(),
        })?;
        check_same_2d(&[("log_prob", inputs.policy.log_prob), ("ref_log_prob", ref_log_prob)])
            .map_err(AlgoError::KlPenalty)?;
        let kl = kl_penalty(inputs.policy.log_prob, ref_log_prob, params.kl_loss_type);
        let kl_loss = agg_loss(&kl, mask, mode, &info)?;
        metrics.kl_loss = Some(item(&kl_loss.detach()));
        loss += kl_loss * params.kl_loss_coef;
    }
    Ok((loss, metrics))
}

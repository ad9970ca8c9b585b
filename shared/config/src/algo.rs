//! `algorithm.*`, `actor.*` and `critic.*`: the RL algorithm and the optimisation of the actor and critic
//! (verl's keys and defaults, from `_generated_ppo_trainer.yaml`).

use serde::{Deserialize, Serialize};

use crate::{
    ensure, AdvantageEstimator, AggMode, BypassLossType, ConfigError, CriticModelConfig, KlCtrlType, KlEstimator,
    KlPenalty, LrSchedulerType, PfPpoMethod, PolicyLossMode, RolloutIsLevel,
};

fn positive(value: f64, path: &str) -> Result<(), ConfigError> {
    ensure(value > 0.0, path, format!("must be > 0, got {value}"))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KlCtrlConfig {
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    pub kl_coef: f64,
    pub horizon: f64,
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self { kind: KlCtrlType::Fixed, kl_coef: 0.001, horizon: 10_000.0, target_kl: 0.1 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    pub metric: Option<String>,
    /// DAPO's cap on the prompts one batch may take, in generation batches of `data.train_batch_size` (the batch
    /// itself and its refills): a batch that still lacks groups with a reward spread after that many fails the
    /// run, as verl's DAPO trainer does; 0 = no cap
    pub max_num_gen_batches: u32,
    pub max_inflight_gen_batches: u32,
}

impl Default for FilterGroupsConfig {
    fn default() -> Self {
        Self { enable: false, metric: None, max_num_gen_batches: 0, max_inflight_gen_batches: 1 }
    }
}

/// verl's `algorithm.pf_ppo.*`: how PF-PPO reweights the batch before resampling it (GAE only).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PfPpoConfig {
    pub reweight_method: PfPpoMethod,
    pub weight_pow: f64,
}

impl Default for PfPpoConfig {
    fn default() -> Self {
        Self { reweight_method: PfPpoMethod::Pow, weight_pow: 2.0 }
    }
}

/// A threshold written either as a number (`2.0`) or as verl's string forms (`"0.5_2.0"`, `"2.0,0.01"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ThresholdSpec {
    Number(f64),
    Text(String),
}

impl std::fmt::Display for ThresholdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(value) => write!(f, "{value}"),
            Self::Text(text) => f.write_str(text),
        }
    }
}

/// verl's `algorithm.rollout_correction.*`: importance weights and rejection sampling that correct for the
/// gap between the rollout (behaviour) policy and the training policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutCorrectionConfig {
    /// IS weight level; null computes the metrics only
    pub rollout_is: Option<RolloutIsLevel>,
    /// a number truncates the weights at it (TIS); `"lo_hi"` zeroes weights outside [lo, hi] (IcePop)
    pub rollout_is_threshold: ThresholdSpec,
    /// rescale the IS weights to mean 1 over the batch
    pub rollout_is_batch_normalize: bool,
    /// rejection criteria, comma separated: token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3}, seq_max_k{2,3}
    pub rollout_rs: Option<String>,
    /// one threshold shared by every criterion, or one per criterion (comma separated); `*_k1` take `"lo_hi"`
    pub rollout_rs_threshold: Option<ThresholdSpec>,
    /// reuse the rollout log-probs as the old log-probs (no old-log-prob forward pass)
    pub bypass_mode: bool,
    /// loss in bypass mode
    pub loss_type: BypassLossType,
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        Self {
            rollout_is: None,
            rollout_is_threshold: ThresholdSpec::Number(2.0),
            rollout_is_batch_normalize: false,
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: BypassLossType::PpoClip,
        }
    }
}

/// verl's `algorithm.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmConfig {
    pub adv_estimator: AdvantageEstimator,
    pub norm_adv_by_std_in_grpo: bool,
    pub gamma: f64,
    pub lam: f64,
    pub use_kl_in_reward: bool,
    pub kl_penalty: KlPenalty,
    pub kl_ctrl: KlCtrlConfig,
    pub filter_groups: FilterGroupsConfig,
    /// resample the batch by score after GAE (PF-PPO)
    pub use_pf_ppo: bool,
    pub pf_ppo: PfPpoConfig,
    /// null disables rollout correction entirely
    pub rollout_correction: Option<RolloutCorrectionConfig>,
    /// GDPO: the `reward_extra_info` keys normalised one by one within each group
    pub gdpo_reward_keys: Option<Vec<String>>,
    /// GDPO: one weight per key (default: all 1)
    pub gdpo_reward_weights: Option<Vec<f64>>,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            adv_estimator: AdvantageEstimator::Grpo,
            norm_adv_by_std_in_grpo: true,
            gamma: 1.0,
            lam: 1.0,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::new(KlEstimator::K1),
            kl_ctrl: KlCtrlConfig::default(),
            filter_groups: FilterGroupsConfig::default(),
            use_pf_ppo: false,
            pf_ppo: PfPpoConfig::default(),
            rollout_correction: None,
            gdpo_reward_keys: None,
            gdpo_reward_weights: None,
        }
    }
}

impl AlgorithmConfig {
    /// Checks the names and ranges of `algorithm.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.kl_ctrl.kind == KlCtrlType::Adaptive {
            positive(self.kl_ctrl.horizon, "algorithm.kl_ctrl.horizon")?;
            positive(self.kl_ctrl.target_kl, "algorithm.kl_ctrl.target_kl")?;
        }
        if let Some(rc) = &self.rollout_correction {
            ensure(
                rc.rollout_rs.is_none() || rc.rollout_rs_threshold.is_some(),
                "algorithm.rollout_correction.rollout_rs_threshold",
                "required when rollout_rs is set",
            )?;
        }
        if self.adv_estimator == AdvantageEstimator::Gdpo {
            let keys = self.gdpo_reward_keys.as_deref().unwrap_or_default();
            ensure(
                !keys.is_empty(),
                "algorithm.gdpo_reward_keys",
                "gdpo needs the reward component keys to normalise",
            )?;
            if let Some(weights) = &self.gdpo_reward_weights {
                ensure(
                    weights.len() == keys.len(),
                    "algorithm.gdpo_reward_weights",
                    format!("has {} weights for {} gdpo_reward_keys", weights.len(), keys.len()),
                )?;
            }
        }
        Ok(())
    }
}

/// verl's `actor.optim.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    pub lr: f64,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    pub lr_scheduler_type: LrSchedulerType,
    pub lr_warmup_steps: Option<u64>,
    pub lr_warmup_steps_ratio: f64,
    pub min_lr_ratio: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            lr_scheduler_type: LrSchedulerType::Constant,
            lr_warmup_steps: None,
            lr_warmup_steps_ratio: 0.0,
            min_lr_ratio: 0.0,
        }
    }
}

/// verl's `actor.policy_loss.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyLossConfig {
    pub loss_mode: PolicyLossMode,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    pub dro_beta: Option<f64>,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: PolicyLossMode::Vanilla,
            clip_cov_ratio: 2e-4,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 2e-4,
            ppo_kl_coef: 0.1,
            dro_beta: None,
        }
    }
}

/// verl's `actor_rollout_ref.actor.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActorConfig {
    pub optim: OptimConfig,
    /// global-norm clip (verl `grad_clip`)
    pub grad_clip: f64,
    pub clip_ratio: f64,
    /// null falls back to `clip_ratio`
    pub clip_ratio_low: Option<f64>,
    /// null falls back to `clip_ratio`
    pub clip_ratio_high: Option<f64>,
    /// dual-clip bound for negative advantages (must be > 1); also the TIS cap of the DPPO losses
    pub clip_ratio_c: f64,
    /// SAPO gate temperature for positive advantages
    pub tau_pos: f64,
    /// SAPO gate temperature for non-positive advantages
    pub tau_neg: f64,
    pub loss_agg_mode: AggMode,
    /// divisor of `seq-mean-token-sum-norm`; null uses the padded response length
    pub loss_scale_factor: Option<f64>,
    pub policy_loss: PolicyLossConfig,
    /// prompt groups per optimizer update; default: the whole train batch
    pub ppo_mini_batch_size: Option<u32>,
    pub ppo_epochs: u32,
    /// token budget per micro-batch (gradient accumulation)
    pub ppo_max_token_len: u32,
    pub shuffle: bool,
    pub data_loader_seed: u64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: KlPenalty,
    pub entropy_coeff: f64,
    /// compute the entropy in the update even when `entropy_coeff` is 0 (for the metric)
    pub calculate_entropy: bool,
    /// compute Σπ² per token (needed by the optimal-token-baseline estimators)
    pub calculate_sum_pi_squared: bool,
    /// MoE router replay (verl's `router_replay`)
    pub router_replay: RouterReplayConfig,
    /// weight of the MoE load-balancing loss added to the policy loss (Megatron's `moe_aux_loss_coeff`, which verl
    /// sets through `actor.megatron.override_transformer_config`); 0 = off
    pub moe_aux_loss_coeff: f64,
}

/// verl's `actor.router_replay`: which routes an MoE policy's update forward uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterReplayConfig {
    pub mode: RouterReplayMode,
}

/// verl's router replay modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RouterReplayMode {
    /// every forward routes by its own router
    #[default]
    #[serde(rename = "disabled")]
    Disabled,
    /// the update passes route every token as the π_old pass did (routing replay within the trainer)
    R2,
    /// the trainer's passes route every token as the rollout did (rollout routing replay)
    R3,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            optim: OptimConfig::default(),
            grad_clip: 1.0,
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            tau_pos: 1.0,
            tau_neg: 1.05,
            loss_agg_mode: AggMode::TokenMean,
            loss_scale_factor: None,
            policy_loss: PolicyLossConfig::default(),
            ppo_mini_batch_size: None,
            ppo_epochs: 1,
            ppo_max_token_len: 16_384,
            shuffle: false,
            data_loader_seed: 42,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::new(KlEstimator::K3),
            entropy_coeff: 0.0,
            calculate_entropy: false,
            calculate_sum_pi_squared: false,
            router_replay: RouterReplayConfig::default(),
            moe_aux_loss_coeff: 0.0,
        }
    }
}

impl ActorConfig {
    /// Checks the names and ranges of the loss keys of `actor.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ensure(
            self.clip_ratio_c > 1.0,
            "actor.clip_ratio_c",
            format!("must be > 1 (dual-clip bound), got {}", self.clip_ratio_c),
        )?;
        for (value, path) in [
            (Some(self.clip_ratio), "actor.clip_ratio"),
            (self.clip_ratio_low, "actor.clip_ratio_low"),
            (self.clip_ratio_high, "actor.clip_ratio_high"),
        ] {
            if let Some(value) = value {
                ensure(value >= 0.0, path, format!("must be >= 0, got {value}"))?;
            }
        }
        ensure(
            self.moe_aux_loss_coeff >= 0.0 && self.moe_aux_loss_coeff.is_finite(),
            "actor.moe_aux_loss_coeff",
            format!("must be >= 0, got {}", self.moe_aux_loss_coeff),
        )?;
        positive(self.tau_pos, "actor.tau_pos")?;
        positive(self.tau_neg, "actor.tau_neg")?;
        if let Some(factor) = self.loss_scale_factor {
            positive(factor, "actor.loss_scale_factor")?;
        }
        match self.policy_loss.loss_mode {
            PolicyLossMode::Dro => positive(self.policy_loss.dro_beta.unwrap_or(0.0), "actor.policy_loss.dro_beta"),
            PolicyLossMode::ClipCov => positive(self.policy_loss.clip_cov_ratio, "actor.policy_loss.clip_cov_ratio"),
            PolicyLossMode::KlCov => positive(self.policy_loss.kl_cov_ratio, "actor.policy_loss.kl_cov_ratio"),
            _ => Ok(()),
        }
    }

    /// `clip_ratio_low`, or `clip_ratio` when it is null (verl's fallback).
    pub fn clip_ratio_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    /// `clip_ratio_high`, or `clip_ratio` when it is null (verl's fallback).
    pub fn clip_ratio_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }
}

/// verl's `critic.optim.*` defaults differ from the actor's only in the learning rate.
fn critic_optim_default() -> OptimConfig {
    OptimConfig { lr: 1e-5, ..OptimConfig::default() }
}

/// verl's `critic.*` (the value model used by GAE).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticConfig {
    /// null: on exactly when `algorithm.adv_estimator` is `gae` (verl's `need_critic`)
    pub enable: Option<bool>,
    pub optim: OptimConfig,
    pub grad_clip: f64,
    /// clip of the value prediction around the old value
    pub cliprange_value: f64,
    /// null inherits `actor.loss_agg_mode`
    pub loss_agg_mode: Option<AggMode>,
    /// null inherits `actor.loss_scale_factor`
    pub loss_scale_factor: Option<f64>,
    /// null inherits `actor.ppo_mini_batch_size`
    pub ppo_mini_batch_size: Option<u32>,
    /// null inherits `actor.ppo_epochs`
    pub ppo_epochs: Option<u32>,
    /// token budget per micro-batch; null inherits `actor.ppo_max_token_len`
    pub ppo_max_token_len: Option<u32>,
    pub shuffle: bool,
    pub data_loader_seed: u64,
    /// LoRA on the critic's trunk (verl's `critic.model.lora_*`)
    pub model: CriticModelConfig,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enable: None,
            optim: critic_optim_default(),
            grad_clip: 1.0,
            cliprange_value: 0.5,
            loss_agg_mode: None,
            loss_scale_factor: None,
            ppo_mini_batch_size: None,
            ppo_epochs: None,
            ppo_max_token_len: None,
            shuffle: true,
            data_loader_seed: 42,
            model: CriticModelConfig::default(),
        }
    }
}

impl CriticConfig {
    /// Checks the ranges and names of `critic.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ensure(
            self.cliprange_value >= 0.0,
            "critic.cliprange_value",
            format!("must be >= 0, got {}", self.cliprange_value),
        )?;
        if let Some(factor) = self.loss_scale_factor {
            positive(factor, "critic.loss_scale_factor")?;
        }
        self.model.validate()?;
        positive(self.optim.lr, "critic.optim.lr")
    }

    /// Whether a critic is trained: the explicit `critic.enable`, else only for GAE (verl's `need_critic`).
    pub fn is_enabled(&self, algorithm: &AlgorithmConfig) -> bool {
        self.enable.unwrap_or(algorithm.adv_estimator.needs_critic())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verl_algorithm_section_loads_with_rollout_correction_and_gdpo_keys() {
        let value = serde_json::json!({
            "adv_estimator": "gdpo",
            "gdpo_reward_keys": ["format", "accuracy"],
            "gdpo_reward_weights": [0.5, 1.0],
            "use_pf_ppo": true,
            "pf_ppo": {"reweight_method": "max_min", "weight_pow": 1.0},
            "filter_groups": {"enable": true, "metric": "acc", "max_num_gen_batches": 0},
            "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0",
                                   "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": 2}
        });
        let cfg: AlgorithmConfig = serde_json::from_value(value).expect("verl keys deserialize");
        let rc = cfg.rollout_correction.expect("rollout_correction is set");
        assert_eq!(rc.rollout_is_threshold, ThresholdSpec::Text("0.5_2.0".into()));
        assert_eq!(rc.rollout_rs_threshold, Some(ThresholdSpec::Number(2.0)));
        assert_eq!(rc.loss_type, BypassLossType::PpoClip);
        assert_eq!(cfg.gdpo_reward_weights, Some(vec![0.5, 1.0]));
    }

    #[test]
    fn clip_ratio_bounds_fall_back_to_clip_ratio() {
        let actor = ActorConfig { clip_ratio: 0.3, clip_ratio_high: Some(0.28), ..ActorConfig::default() };
        assert_eq!(actor.clip_ratio_low(), 0.3);
        assert_eq!(actor.clip_ratio_high(), 0.28);
    }

    #[test]
    fn critic_defaults_to_enabled_only_for_gae() {
        let critic = CriticConfig::default();
        let mut algorithm = AlgorithmConfig::default();
        assert!(!critic.is_enabled(&algorithm));
        algorithm.adv_estimator = AdvantageEstimator::Gae;
        assert!(critic.is_enabled(&algorithm));
        assert!(!CriticConfig { enable: Some(false), ..CriticConfig::default() }.is_enabled(&algorithm));
    }

    #[test]
    fn validation_names_the_offending_key() {
        let err = crate::from_value::<AlgorithmConfig>(serde_json::json!({"adv_estimator": "ppo"})).unwrap_err();
        assert!(err.to_string().contains("adv_estimator") && err.to_string().contains("grpo"), "{err}");
        let gdpo = AlgorithmConfig { adv_estimator: AdvantageEstimator::Gdpo, ..AlgorithmConfig::default() };
        assert!(gdpo.validate().unwrap_err().to_string().contains("algorithm.gdpo_reward_keys"));
        let err = crate::from_value::<ActorConfig>(serde_json::json!({"kl_loss_type": "k4+"})).unwrap_err();
        assert!(err.to_string().contains("kl_loss_type") && err.to_string().contains("k4+"), "{err}");
        let dro = ActorConfig {
            policy_loss: PolicyLossConfig { loss_mode: PolicyLossMode::Dro, ..PolicyLossConfig::default() },
            ..ActorConfig::default()
        };
        assert!(dro.validate().unwrap_err().to_string().contains("actor.policy_loss.dro_beta"));
        AlgorithmConfig::default().validate().expect("defaults are valid");
        let remax = AlgorithmConfig { adv_estimator: AdvantageEstimator::Remax, ..AlgorithmConfig::default() };
        remax.validate().expect("remax is valid: the rollout worker generates its greedy baseline");
        let mut capped = AlgorithmConfig::default();
        capped.filter_groups.max_num_gen_batches = 10;
        capped.validate().expect("max_num_gen_batches caps a DAPO batch's generation");
        let k3: ActorConfig = crate::from_value(serde_json::json!({"kl_loss_type": "k3+"})).expect("k3+ is valid");
        assert!(k3.kl_loss_type.straight_through);
        CriticConfig::default().validate().expect("defaults are valid");
    }

    #[test]
    fn unknown_actor_key_is_rejected() {
        let err = serde_json::from_value::<ActorConfig>(serde_json::json!({"tau_poss": 1.0})).unwrap_err();
        assert!(err.to_string().contains("tau_poss"), "{err}");
    }
}

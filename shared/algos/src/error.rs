//! The one error type of the crate: a variant per stage of the RL math, each message naming the bad input.

/// What went wrong, and in which stage.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    /// A name (estimator, loss mode, aggregation, KL type, rejection criterion, ...) that verl does not define.
    #[error(transparent)]
    UnknownName(#[from] jetrl_config::UnknownValue),
    #[error("masked statistics: {0}")]
    Masked(String),
    #[error("advantage ({estimator}): {message}")]
    Advantage { estimator: &'static str, message: String },
    #[error("loss aggregation ({mode}): {message}")]
    Aggregation { mode: &'static str, message: String },
    #[error("policy loss ({mode}): {message}")]
    PolicyLoss { mode: &'static str, message: String },
    #[error("kl penalty: {0}")]
    KlPenalty(String),
    #[error("kl controller: {0}")]
    KlController(String),
    #[error("rollout correction: {0}")]
    RolloutCorrection(String),
    #[error("value loss: {0}")]
    ValueLoss(String),
    #[error("logits: {0}")]
    Logits(String),
    #[error("pf-ppo: {0}")]
    PfPpo(String),
}

impl AlgoError {
    /// A stable, low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownName(_) => "unknown_name",
            Self::Masked(_) => "masked",
            Self::Advantage { .. } => "advantage",
            Self::Aggregation { .. } => "aggregation",
            Self::PolicyLoss { .. } => "policy_loss",
            Self::KlPenalty(_) => "kl_penalty",
            Self::KlController(_) => "kl_controller",
            Self::RolloutCorrection(_) => "rollout_correction",
            Self::ValueLoss(_) => "value_loss",
            Self::Logits(_) => "logits",
            Self::PfPpo(_) => "pf_ppo",
        }
    }
}

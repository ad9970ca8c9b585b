//! The engine's construction error.

/// Why a [`crate::RewardEngine`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    #[error("reward config: {0}")]
    Config(#[from] jetrl_config::ConfigError),
    #[error("custom reward function: {0}")]
    ExternalSetup(#[from] crate::external::ExternalError),
    #[error("reward model: {0}")]
    RewardModelSetup(#[from] crate::remote_rm::RemoteRmError),
}

impl RewardError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config(..) => "config",
            Self::ExternalSetup(..) => "external_setup",
            Self::RewardModelSetup(..) => "reward_model_setup",
        }
    }
}

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

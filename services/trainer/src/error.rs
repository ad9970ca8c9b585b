//! The trainer's errors: one enum for the service ([`TrainerError`]) and one for the model thread
//! ([`ActorError`]), each variant named for the stage that failed and keeping its cause.

use std::path::PathBuf;

use jetrl_bus::groups::GroupUpdateError;
use jetrl_bus::BusError;
use jetrl_config::TrainerMode;

use crate::checkpoint::CheckpointError;
use crate::optim::OptimError;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("actor: {0}")]
    Actor(#[from] ActorError),
    #[error("data: {0}")]
    Data(#[from] jetrl_data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("updating group records: {0}")]
    GroupRecord(#[source] GroupUpdateError),
    #[error("tokenizer of {path}: {source}")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: jetrl_model::TokenizerError,
    },
    #[error("model config {path}: {source}")]
    ModelConfig {
        path: PathBuf,
        #[source]
        source: jetrl_model::ModelError,
    },
    #[error("run directory {path}: {source}")]
    RunDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("replay buffer answered sample request {request_id} with {}: {message}", code.as_str_name())]
    Buffer { request_id: String, code: jetrl_wire::v1::ErrorCode, message: String },
    #[error("weight sync of version {version}: {reason}")]
    WeightSync { version: u64, reason: WeightSyncFailure },
    #[error("trainer.mode {0}: {1}")]
    Mode(TrainerMode, String),
    #[error("shutdown requested")]
    Shutdown,
}

/// Why a weight version could not be published.
#[derive(Debug, thiserror::Error)]
pub enum WeightSyncFailure {
    /// checkpoint-sync refused the announcement (it names the cause): permanent, not retried
    #[error("checkpoint-sync rejected the announcement: {0}")]
    Rejected(String),
    /// checkpoint-sync did not answer within the deadline (retried with backoff until then)
    #[error("checkpoint-sync did not acknowledge within {seconds:.0}s (last error: {last})")]
    Unacknowledged {
        seconds: f64,
        #[source]
        last: AnnounceAttempt,
    },
}

impl WeightSyncFailure {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Rejected(..) => "rejected",
            Self::Unacknowledged { .. } => "unacknowledged",
        }
    }
}

/// Why one announcement to checkpoint-sync went unanswered.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceAttempt {
    /// checkpoint-sync answered that it cannot register the version now (its store failed)
    #[error("checkpoint-sync unavailable: {0}")]
    Unavailable(String),
    /// the request itself failed (no responder, a timeout, the broker gone)
    #[error(transparent)]
    Bus(Box<jetrl_bus::BusError>),
}

impl AnnounceAttempt {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable(..) => "unavailable",
            Self::Bus(..) => "bus",
        }
    }
}

impl TrainerError {
    /// A stable, low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            TrainerError::Bus(e) => e.kind(),
            TrainerError::Metrics(_) => "metrics",
            TrainerError::Actor(_) => "actor",
            TrainerError::Data(_) => "data",
            TrainerError::Checkpoint(_) => "checkpoint",
            TrainerError::GroupRecord(_) => "group_record",
            TrainerError::Tokenizer { .. } => "tokenizer",
            TrainerError::ModelConfig { .. } => "model_config",
            TrainerError::RunDir { .. } => "run_dir",
            TrainerError::Buffer { .. } => "buffer",
            TrainerError::WeightSync { .. } => "weight_sync",
            TrainerError::Mode(..) => "mode",
            TrainerError::Shutdown => "shutdown",
        }
    }
}

/// Errors of the model thread: loading, the RL math, the optimizer, checkpoint files.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    #[error("model: {0}")]
    Model(#[from] jetrl_model::ModelError),
    #[error("algorithm: {0}")]
    Algo(#[from] jetrl_algos::AlgoError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// a collective among the trainer's ranks failed (a rank died, timed out, or the group could not form)
    #[error("trainer ranks: {0}")]
    Dist(#[from] jetrl_torch_ext::DistError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// a batch the actor cannot train on (it names why)
    #[error("batch: {0}")]
    Batch(String),
    /// a message between the trainer's ranks (a command, a rank's metrics) did not encode or decode
    #[error("rank message ({what}): {source}")]
    RankMessage {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot start the actor thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the actor thread has stopped")]
    Stopped,
    /// the actor thread panicked (its message); the thread is gone, and every later call gets the same error
    #[error("the actor thread panicked: {0}")]
    Panicked(String),
}

impl ActorError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model(..) => "model",
            Self::Algo(..) => "algo",
            Self::Torch(..) => "torch",
            Self::Optim(..) => "optim",
            Self::Dist(..) => "dist",
            Self::Checkpoint(..) => "checkpoint",
            Self::Batch(..) => "batch",
            Self::RankMessage { .. } => "rank_message",
            Self::Spawn(..) => "spawn",
            Self::Stopped => "stopped",
            Self::Panicked(..) => "panicked",
        }
    }
}

impl jetrl_telemetry::ServiceError for TrainerError {
    /// A dataset, tokenizer or model config that cannot be read, a schedule that cannot run, or a sample request
    /// the buffer refused as invalid: the same job fails the same way when started again.
    fn is_permanent(&self) -> bool {
        match self {
            TrainerError::Data(_)
            | TrainerError::Tokenizer { .. }
            | TrainerError::ModelConfig { .. }
            | TrainerError::Mode(..) => true,
            TrainerError::Buffer { code, .. } => *code == jetrl_wire::v1::ErrorCode::Invalid,
            _ => false,
        }
    }
}

//! jetrl's wire contract.
//!
//! - [`v1`]: the protobuf messages of `proto/jetrl/v1/jetrl.proto` (prost, `bytes::Bytes` fields).
//! - [`packed`]: token ids, masks and log-probs as packed little-endian bytes.
//! - [`keys`]: the verl key format: a group is `{uid}`, a trajectory `{uid}_{session_id}_{index}`.
//! - [`subjects`]: the stream, subject and bucket names of a job ([`subjects::Names`], one namespace per job).

pub mod keys;
pub mod packed;
pub mod score;
pub mod subjects;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/jetrl.v1.rs"));
}

pub use prost::Message;

/// The five services of a job: the names their heartbeats, dead letters and WORKERS keys carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServiceKind {
    Trainer,
    Rollout,
    Reward,
    Buffer,
    Checkpoint,
}

impl ServiceKind {
    /// Every service a job runs.
    pub const ALL: [ServiceKind; 5] =
        [ServiceKind::Trainer, ServiceKind::Rollout, ServiceKind::Reward, ServiceKind::Buffer, ServiceKind::Checkpoint];

    /// The name on the wire, which is also the service's section of the job file.
    pub const fn as_str(self) -> &'static str {
        match self {
            ServiceKind::Trainer => "trainer",
            ServiceKind::Rollout => "rollout",
            ServiceKind::Reward => "reward",
            ServiceKind::Buffer => "buffer",
            ServiceKind::Checkpoint => "checkpoint",
        }
    }
}

impl std::fmt::Display for ServiceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl v1::GroupState {
    /// `finished` or `failure`: the worker is done with the group.
    pub fn is_terminal(self) -> bool {
        matches!(self, v1::GroupState::Finished | v1::GroupState::Failure)
    }

    /// `pending` or `running`.
    pub fn is_inflight(self) -> bool {
        matches!(self, v1::GroupState::Pending | v1::GroupState::Running)
    }

    /// Short lowercase name, as verl spells the status (`pending`, `running`, ...).
    pub fn label(self) -> &'static str {
        match self {
            v1::GroupState::Unspecified => "unspecified",
            v1::GroupState::Pending => "pending",
            v1::GroupState::Running => "running",
            v1::GroupState::Finished => "finished",
            v1::GroupState::Failure => "failure",
            v1::GroupState::Sampled => "sampled",
            v1::GroupState::Evicted => "evicted",
        }
    }
}

impl v1::Eviction {
    /// Short lowercase name (`off_policy`, `rolled_back`, ...), for the ledger, logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            v1::Eviction::Unspecified => "evicted",
            v1::Eviction::OffPolicy => "off_policy",
            v1::Eviction::FilterGroups => "filter_groups",
            v1::Eviction::RolloutFailure => "rollout_failure",
            v1::Eviction::DiscardedSurplus => "discarded_surplus",
            v1::Eviction::Rejected => "rejected",
            v1::Eviction::SupersededByResume => "superseded_by_resume",
            v1::Eviction::RolledBack => "rolled_back",
        }
    }

    /// An eviction written by a resumed trainer's bookkeeping (superseded, rolled back): it does not decide the
    /// fate of its dataset row when another group of the row exists.
    pub fn is_bookkeeping(self) -> bool {
        matches!(self, v1::Eviction::SupersededByResume | v1::Eviction::RolledBack)
    }

    /// A row that could not be trained (the ledger's fate `failed`) rather than one left out by a rule.
    pub fn is_failure(self) -> bool {
        matches!(self, v1::Eviction::RolloutFailure | v1::Eviction::Rejected)
    }

    /// The label with its detail, as a person reads it: `off_policy: submission span 3`.
    pub fn describe(self, detail: &str) -> String {
        if detail.is_empty() {
            self.label().to_string()
        } else {
            format!("{}: {detail}", self.label())
        }
    }
}

impl v1::WorkerState {
    /// Short lowercase name (`ready`, `paused`, `load_failed`, ...), for logs, metrics and `jetrl status`.
    pub fn label(self) -> &'static str {
        match self {
            v1::WorkerState::Unspecified => "unspecified",
            v1::WorkerState::Ready => "ready",
            v1::WorkerState::Paused => "paused",
            v1::WorkerState::LoadFailed => "load_failed",
            v1::WorkerState::Stopped => "stopped",
            v1::WorkerState::Starting => "starting",
        }
    }
}

/// Milliseconds since the Unix epoch, for the `*_unix_ms` fields.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

//! Why one trajectory got no score: the stable kind (a bounded metric label and wire field) and the message.
//! A leaf: every scorer imports it, it imports none of them.

/// Why a trajectory got no score. The string form is a Prometheus label value and a wire field: it never
/// changes and never carries input text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// no rule scorer for the trajectory's `data_source`
    UnknownDataSource,
    /// the ground truth cannot be read the way the scorer needs it
    InvalidGroundTruth,
    /// a score that is missing, text, null or otherwise not a number
    NonNumericScore,
    /// NaN or ±infinity
    NonFiniteScore,
    /// the user function reported an error for this trajectory
    UserFunction,
    /// the user function did not answer within its timeout
    Timeout,
    /// the user function's process exited while the trajectory was being scored
    Crashed,
    /// the user function's process could not be started
    SpawnFailed,
    /// the user function answered something that is not the protocol
    BadResponse,
    /// the reward model server answered with an HTTP error status
    HttpStatus,
    /// the reward model server could not be reached, or the exchange broke or timed out
    HttpTransport,
    /// the reward model server's answer has no score where the API puts it
    RewardModelResponse,
    /// the prompt could not be rendered with the reward model's chat template (the template raised)
    PromptRender,
    /// a bug in a built-in scorer (it panicked); the service keeps running
    Internal,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownDataSource => "unknown_data_source",
            Self::InvalidGroundTruth => "invalid_ground_truth",
            Self::NonNumericScore => "non_numeric_score",
            Self::NonFiniteScore => "non_finite_score",
            Self::UserFunction => "user_function_error",
            Self::Timeout => "timeout",
            Self::Crashed => "crashed",
            Self::SpawnFailed => "spawn_failed",
            Self::BadResponse => "bad_response",
            Self::HttpStatus => "http_status",
            Self::HttpTransport => "http_transport",
            Self::RewardModelResponse => "reward_model_response",
            Self::PromptRender => "prompt_render",
            Self::Internal => "internal_error",
        }
    }
}

impl serde::Serialize for FailureKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why one trajectory got no score: a stable kind for metrics and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScoreFailure {
    pub kind: FailureKind,
    pub message: String,
}

impl ScoreFailure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }
}

impl std::fmt::Display for ScoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

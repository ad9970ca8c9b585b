//! The crate's one error type, with a variant per stage that can fail.

use std::path::PathBuf;

/// Everything that can go wrong loading, running or saving a model.
///
/// Variants are named for the stage that failed so a caller can tell a bad checkpoint from a bad request.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` (or a preset, a device or dtype string) is unusable.
    #[error("config: {0}")]
    Config(String),

    /// A device string that does not name a usable device.
    #[error("device: {0}")]
    Device(String),

    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (or a JSON string) did not parse.
    #[error("{what}: invalid JSON: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },

    /// A tensor the model needs is not in the checkpoint.
    #[error("weights: tensor `{name}` is missing from {location}")]
    MissingTensor { name: String, location: String },

    /// A tensor has a different shape in the checkpoint than the config implies.
    #[error("weights: tensor `{name}` has shape {found:?} in the checkpoint but the model expects {expected:?}")]
    TensorShape { name: String, expected: Vec<i64>, found: Vec<i64> },

    /// Any other problem with one tensor (unsupported dtype, unexpected name, copy failure).
    #[error("weights: tensor `{name}`: {reason}")]
    Weights { name: String, reason: String },

    /// A safetensors container (file or bytes) is malformed.
    #[error("safetensors {location}: {reason}")]
    Safetensors { location: String, reason: String },

    /// `tokenizer.json` (or the special tokens around it) is unusable, or encoding/decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The chat template is missing, does not compile, or raised while rendering.
    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A generation request is invalid (empty prompt, bad sampling parameters, cache overflow).
    #[error("generation: {0}")]
    Generation(String),

    /// Tensors handed to `forward` have the wrong shape or kind.
    #[error("input: {0}")]
    Input(String),

    /// libtorch raised.
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

impl ModelError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config(..) => "config",
            Self::Device(..) => "device",
            Self::Io { .. } => "io",
            Self::Json { .. } => "json",
            Self::MissingTensor { .. } => "missing_tensor",
            Self::TensorShape { .. } => "tensor_shape",
            Self::Weights { .. } => "weights",
            Self::Safetensors { .. } => "safetensors",
            Self::Tokenizer(..) => "tokenizer",
            Self::ChatTemplate(..) => "chat_template",
            Self::Generation(..) => "generation",
            Self::Input(..) => "input",
            Self::Torch(..) => "torch",
        }
    }
}

/// The crate's result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }

    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        ModelError::Json { what: what.into(), source }
    }
}

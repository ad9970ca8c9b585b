//! The crate's error type, a variant per stage that can fail.

use std::path::PathBuf;

/// Why a tokenizer could not be loaded, or a text could not be encoded, decoded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Reading a file of the checkpoint directory failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file of the checkpoint directory did not parse.
    #[error("{what}: invalid JSON: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },

    /// A token-id field of `config.json` or `generation_config.json` is not an id or a list of ids.
    #[error("config: {0}")]
    Config(String),

    /// `tokenizer.json` (or the special tokens around it) is unusable, or encoding/decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The chat template is missing, does not compile, or raised while rendering.
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

impl TokenizerError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Json { .. } => "json",
            Self::Config(..) => "config",
            Self::Tokenizer(..) => "tokenizer",
            Self::ChatTemplate(..) => "chat_template",
        }
    }
}

/// The crate's result type.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

impl TokenizerError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TokenizerError::Io { path: path.into(), source }
    }

    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        TokenizerError::Json { what: what.into(), source }
    }
}

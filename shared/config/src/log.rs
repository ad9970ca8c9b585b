//! Logging (`log.*`).

use serde::{Deserialize, Serialize};

use crate::LogFormat;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// an EnvFilter directive, e.g. `info` or `info,jetrl_bus=debug`; RUST_LOG wins when set
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { level: "info".into(), format: LogFormat::Text }
    }
}

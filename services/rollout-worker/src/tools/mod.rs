//! Tools a multi-turn agent loop can call. A tool is a [`Tool`]: a name, the OpenAI function schema the chat
//! template shows the model, and an async call on JSON arguments. Built in: [`Calculator`] and [`PythonTool`]
//! (a sandboxed subprocess). The agent loop, not the tool, turns failures and timeouts into error text with a
//! reward of 0, so a broken tool can never stall a group.

mod calculator;
mod python;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use jetrl_config::{MultiTurnConfig, ToolName};
use serde_json::Value;

pub use calculator::{evaluate, Calculator};
pub use python::{PythonLimits, PythonTool};

/// What a successful call returns: text for the model and the call's reward (verl's `tool_reward`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub text: String,
    pub reward: f64,
}

impl ToolOutput {
    pub fn text(text: impl Into<String>) -> Self {
        ToolOutput { text: text.into(), reward: 0.0 }
    }
}

/// Why a call failed, by stage.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ToolError {
    /// The arguments do not fit the tool's schema.
    #[error("invalid arguments: {0}")]
    Arguments(String),
    /// The tool ran and failed (a math error, a non-zero exit status).
    #[error("{0}")]
    Execution(String),
    /// The tool could not be started.
    #[error("could not start: {0}")]
    Start(String),
    /// It did not answer in time and was stopped.
    #[error("timed out after {0:.1} s")]
    Timeout(f64),
}

/// A function the model can call.
pub trait Tool: Send + Sync {
    fn name(&self) -> &str;

    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, as chat templates expect.
    fn schema(&self) -> Value;

    fn call(&self, arguments: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>>;
}

/// The tools a worker offers, by name.
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl std::fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.tools.keys()).finish()
    }
}

impl ToolRegistry {
    /// The built-in tools named in `rollout.multi_turn.tools`.
    pub fn from_config(cfg: &MultiTurnConfig) -> Self {
        let mut registry = ToolRegistry::default();
        for name in &cfg.tools {
            let tool: Arc<dyn Tool> = match name {
                ToolName::Calculator => Arc::new(Calculator),
                ToolName::Python => Arc::new(PythonTool::new(PythonLimits {
                    bin: cfg.python_bin.clone(),
                    timeout: Duration::from_secs_f64(cfg.python_timeout_s.max(0.1)),
                    memory_bytes: cfg.python_memory_mb.saturating_mul(1 << 20),
                    max_output_bytes: cfg.python_max_output_bytes.max(1) as usize,
                })),
            };
            registry.insert(tool);
        }
        registry
    }

    /// Adds (or replaces) a tool.
    pub fn insert(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.name().to_string(), tool);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    /// The tools of one row: all of them, or those named in its `extra_info.tool_selection` (verl).
    pub fn select(&self, selection: Option<&[String]>) -> ToolRegistry {
        match selection {
            None => self.clone(),
            Some(names) => ToolRegistry {
                tools: self
                    .tools
                    .iter()
                    .filter(|(n, _)| names.contains(n))
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .collect(),
            },
        }
    }

    pub fn schemas(&self) -> Vec<Value> {
        self.tools.values().map(|t| t.schema()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

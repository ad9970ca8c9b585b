//! The rollout engine a worker drives (`rollout.name`, verl's key) and the settings of vLLM's (`rollout.vllm.*`,
//! `rollout.engine_kwargs.vllm.*` and verl's vLLM keys under `rollout.*`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ensure, ConfigError, VllmUpdateMode};

/// `rollout.vllm.*`: how the worker reaches vLLM.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VllmConfig {
    /// the Python that runs `vllm serve`; null: `$JETRL_VLLM_PYTHON`, else `.venv-vllm/bin/python` of the
    /// checkout (what `scripts/setup-vllm.sh` makes), else `python3`
    pub python: Option<PathBuf>,
    /// a running vLLM server to use instead of starting one (`http://host:port`)
    pub url: Option<String>,
    /// a file holding the API key of the server `url` names (vLLM's `--api-key`); a started server gets a key
    /// made for the run
    pub api_key_file: Option<PathBuf>,
    /// how long a started server may take to answer `/health` (loading the model included)
    pub startup_timeout_s: f64,
    /// how long one generate request may take (a deadline, not a retry)
    pub request_timeout_s: f64,
    /// where a started server's stdout and stderr go (`vllm-<instance>.log`); null: `logs/` in `run.dir`
    pub log_dir: Option<PathBuf>,
    pub update_mode: VllmUpdateMode,
}

impl Default for VllmConfig {
    fn default() -> Self {
        Self {
            python: None,
            url: None,
            api_key_file: None,
            startup_timeout_s: 600.0,
            request_timeout_s: 3600.0,
            log_dir: None,
            update_mode: VllmUpdateMode::default(),
        }
    }
}

/// verl's `rollout.engine_kwargs`: keyword arguments of one engine, by engine name.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineKwargs {
    /// vLLM engine arguments (`swap_space: 4`, `disable_log_stats: false`): each becomes `--swap-space 4` for
    /// `vllm serve`; `true` a bare flag, `false` and null leave it out
    pub vllm: BTreeMap<String, serde_json::Value>,
    /// SGLang's: must stay empty (no SGLang backend)
    pub sglang: BTreeMap<String, serde_json::Value>,
}

impl VllmConfig {
    /// Checks of `rollout.vllm.*` and `rollout.engine_kwargs.*` (the engine's own checks run when it starts).
    pub fn validate(&self, kwargs: &EngineKwargs) -> Result<(), ConfigError> {
        ensure(
            self.startup_timeout_s > 0.0 && self.startup_timeout_s.is_finite(),
            "rollout.vllm.startup_timeout_s",
            "must be > 0",
        )?;
        ensure(
            self.request_timeout_s > 0.0 && self.request_timeout_s.is_finite(),
            "rollout.vllm.request_timeout_s",
            "must be > 0",
        )?;
        if let Some(url) = &self.url {
            ensure(
                url.starts_with("http://") || url.starts_with("https://"),
                "rollout.vllm.url",
                format!("{url:?} is not an http:// or https:// URL"),
            )?;
        }
        ensure(
            self.api_key_file.is_none() || self.url.is_some(),
            "rollout.vllm.api_key_file",
            "names the key of a server given by rollout.vllm.url; a server the worker starts gets a key of its own",
        )?;
        for name in kwargs.vllm.keys() {
            ensure(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
                "rollout.engine_kwargs.vllm",
                format!("{name:?} is not an engine argument name"),
            )?;
            let arg = name.replace('-', "_");
            if let Some((_, key)) = RESERVED_ARGS.iter().find(|(reserved, _)| *reserved == arg) {
                return Err(ConfigError::Invalid {
                    path: "rollout.engine_kwargs.vllm".into(),
                    message: format!("`{name}` is set by jetrl from its own keys: set {key} instead"),
                });
            }
        }
        ensure(
            kwargs.sglang.is_empty(),
            "rollout.engine_kwargs.sglang",
            "no SGLang backend is built; the engines are jetrl and vllm",
        )
    }
}

/// `vllm serve` arguments jetrl sets from its own keys (an engine kwarg may not override them), with the key.
pub const RESERVED_ARGS: &[(&str, &str)] = &[
    ("model", "model.path"),
    ("host", "rollout.vllm.url"),
    ("port", "rollout.vllm.url"),
    ("api_key", "rollout.vllm.api_key_file"),
    ("dtype", "model.dtype"),
    ("seed", "rollout.seed"),
    ("max_model_len", "rollout.max_model_len"),
    ("max_num_seqs", "rollout.max_num_seqs"),
    ("max_num_batched_tokens", "rollout.max_num_batched_tokens"),
    ("gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    ("tensor_parallel_size", "rollout.tensor_model_parallel_size"),
    ("enable_chunked_prefill", "rollout.enable_chunked_prefill"),
    ("enable_prefix_caching", "rollout.enable_prefix_caching"),
    ("enable_return_routed_experts", "rollout.enable_rollout_routing_replay"),
    ("enforce_eager", "rollout.enforce_eager"),
    ("enable_lora", "model.lora_rank"),
    ("max_lora_rank", "model.lora_rank"),
    ("enable_sleep_mode", "rollout.free_cache_engine"),
    ("logprobs_mode", "rollout.logprobs_mode"),
    ("served_model_name", "model.path"),
];

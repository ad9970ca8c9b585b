//! `reward.*`: the reward service and its scorers (verl's `reward.*` keys where verl has them).
//!
//! How a trajectory is scored, in verl's order of precedence:
//! 1. `reward.custom_reward_function` (a `command`, or a verl-style Python `path` + `name`) → an out-of-process
//!    user function speaking the JSON-lines protocol of `shared/reward/PROTOCOL.md`;
//! 2. `reward.reward_model.enable` → a discriminative reward model served over HTTP (vLLM or SGLang);
//! 3. otherwise the built-in rule scorers, chosen by the trajectory's `data_source`.
//!
//! The DAPO overlong penalty (`reward.reward_kwargs.overlong_buffer_cfg`) applies to paths 1 and 3, as verl's
//! `dapo` reward manager does; a reward model's score is used as it comes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ensure, ConfigError};

/// Upper bound of `reward.max_inflight` (see there).
pub const MAX_REWARD_INFLIGHT: u32 = 4096;

/// The reward service: how it runs and how it scores.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// how many reward-service processes `jetrl run` starts
    pub workers: u32,
    pub instance_id: Option<String>,
    pub metrics_addr: String,
    /// score requests (one per prompt group) one instance holds at once (pulled, not yet acknowledged): bounds
    /// its memory and how much work a crash sends back to the others. At most 4096: each held request may have a
    /// reward batch publish awaiting its acknowledgement, and the NATS client allows 5000 of those per connection
    /// (past that a publish waits for a permit that an unpolled acknowledgement holds)
    pub max_inflight: u32,
    /// trajectories scored per call of the scorer at most, and requests per micro-batch at most; several
    /// micro-batches are scored and published at once, up to `max_inflight` requests
    pub batch_size: u32,
    /// how long a request may go without an acknowledgement or an in-progress signal before the server offers it
    /// to another instance (the service signals progress every third of it while it holds one)
    pub ack_wait_s: f64,
    /// a user reward function run out of process (verl: `reward.custom_reward_function`)
    pub custom_reward_function: CustomRewardFunctionConfig,
    /// a discriminative reward model behind an HTTP server (verl: `reward.reward_model`)
    pub reward_model: RewardModelConfig,
    /// verl's `reward.reward_kwargs`: the keys the `dapo` reward manager reads
    pub reward_kwargs: RewardKwargsConfig,
    /// knobs of the built-in rule scorers that verl only exposes as function arguments (jetrl-only)
    pub rule: RuleScorerConfig,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            instance_id: None,
            metrics_addr: "127.0.0.1:0".into(),
            max_inflight: 256,
            batch_size: 64,
            ack_wait_s: 30.0,
            custom_reward_function: CustomRewardFunctionConfig::default(),
            reward_model: RewardModelConfig::default(),
            reward_kwargs: RewardKwargsConfig::default(),
            rule: RuleScorerConfig::default(),
            tokio_threads: None,
        }
    }
}

impl RewardConfig {
    /// Cross-field checks of `reward.*`; every error names the offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ensure(
            (1..=MAX_REWARD_INFLIGHT).contains(&self.max_inflight),
            "reward.max_inflight",
            format!("must be in 1..={MAX_REWARD_INFLIGHT} (got {})", self.max_inflight),
        )?;
        ensure(self.batch_size > 0, "reward.batch_size", "must be > 0")?;
        ensure(self.ack_wait_s >= 1.0 && self.ack_wait_s.is_finite(), "reward.ack_wait_s", "must be >= 1")?;
        self.custom_reward_function.validate()?;
        if self.reward_model.enable && !self.custom_reward_function.is_configured() {
            self.reward_model.validate()?;
        }
        self.reward_kwargs.validate()
    }
}

/// An out-of-process user reward function. Configured when `command` is non-empty or `path` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CustomRewardFunctionConfig {
    /// argv of a program speaking the JSON-lines protocol (`["python3", "my_reward.py"]`); wins over `path`
    pub command: Vec<String>,
    /// verl-style: a Python file defining `name(data_source, solution_str, ground_truth, extra_info, **kw)`,
    /// run under jetrl's bundled protocol adapter
    pub path: Option<String>,
    /// the function to call in `path`
    pub name: String,
    /// extra keyword arguments passed to the function in `path` (verl: `custom_reward_function.reward_kwargs`)
    pub reward_kwargs: BTreeMap<String, serde_json::Value>,
    /// the interpreter that runs the adapter for `path`
    pub python: String,
    /// wall-clock limit of one request (one batch); on expiry the process is killed and restarted
    pub timeout_s: f64,
    /// address-space limit of the process (RLIMIT_AS, virtual memory) in MiB; 0 = no limit
    pub memory_mb: u64,
    /// run the process without network access (a new network namespace via `unshare -rn`) where the platform
    /// allows; falls back with a warning where it does not
    pub no_network: bool,
    /// trajectories sent in one request line
    pub batch_size: usize,
    /// processes started (each is reused for every request it serves)
    pub processes: usize,
    /// first delay before restarting a crashed process; doubles per consecutive crash up to `max_restart_backoff_s`
    pub restart_backoff_s: f64,
    pub max_restart_backoff_s: f64,
}

impl Default for CustomRewardFunctionConfig {
    fn default() -> Self {
        Self {
            command: Vec::new(),
            path: None,
            name: "compute_score".into(),
            reward_kwargs: BTreeMap::new(),
            python: "python3".into(),
            timeout_s: 30.0,
            memory_mb: 8192,
            no_network: true,
            batch_size: 8,
            processes: 1,
            restart_backoff_s: 0.1,
            max_restart_backoff_s: 10.0,
        }
    }
}

impl CustomRewardFunctionConfig {
    /// Whether a user function replaces the built-in scorers.
    pub fn is_configured(&self) -> bool {
        !self.command.is_empty() || self.path.as_deref().is_some_and(|p| !p.trim().is_empty())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.is_configured() {
            return Ok(());
        }
        let key = "reward.custom_reward_function";
        ensure(
            self.command.first().is_none_or(|program| !program.trim().is_empty()),
            &format!("{key}.command"),
            "the program (first element) must not be empty",
        )?;
        ensure(!self.name.trim().is_empty(), &format!("{key}.name"), "must not be empty")?;
        ensure(self.timeout_s > 0.0 && self.timeout_s.is_finite(), &format!("{key}.timeout_s"), "must be > 0")?;
        ensure(self.batch_size > 0, &format!("{key}.batch_size"), "must be > 0")?;
        ensure(self.processes > 0, &format!("{key}.processes"), "must be > 0")?;
        ensure(self.restart_backoff_s >= 0.0, &format!("{key}.restart_backoff_s"), "must be >= 0")?;
        ensure(
            self.max_restart_backoff_s >= self.restart_backoff_s,
            &format!("{key}.max_restart_backoff_s"),
            "must be >= restart_backoff_s",
        )
    }
}

/// Which inference server hosts the reward model; decides the endpoint and where the score is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardModelApi {
    /// `POST /classify` → `data[-1].probs[-1]`
    #[default]
    Vllm,
    /// `POST /v1/embeddings` → `data[-1].embedding[-1]`
    Sglang,
}

/// A discriminative reward model served over HTTP.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardModelConfig {
    pub enable: bool,
    /// base address of the server, `http://host:port[/prefix]` or `https://…` (its certificate checked against the
    /// system's roots, or `SSL_CERT_FILE` / `SSL_CERT_DIR`)
    pub url: String,
    pub api: RewardModelApi,
    /// the `model` field of each request (verl sends `reward_model.model_path`)
    pub model: String,
    /// requests in flight at once
    pub max_concurrency: usize,
    /// attempts per trajectory (verl: 16); 4xx answers are never retried
    pub retries: u32,
    /// first retry delay; doubles per attempt up to `max_backoff_s` (verl: 1 s doubling, capped at 30 s)
    pub backoff_s: f64,
    pub max_backoff_s: f64,
    /// limit of one HTTP exchange (verl has none and can hang)
    pub request_timeout_s: f64,
    /// the reward model's HF directory (`tokenizer.json`, `tokenizer_config.json` with its chat template), verl's
    /// `reward_model.model_path` as far as the prompt is concerned: a trajectory's chat messages plus the response
    /// as the assistant turn are rendered with this template (a leading BOS stripped), as verl does
    pub tokenizer_path: Option<String>,
    /// text appended after the response when the prompt is not rendered with `tokenizer_path` (no tokenizer, or a
    /// trajectory without chat messages): prompt text, response, then this suffix (e.g. `<|im_end|>\n`)
    pub response_suffix: String,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            enable: false,
            url: "http://127.0.0.1:8000".into(),
            api: RewardModelApi::Vllm,
            model: String::new(),
            max_concurrency: 64,
            retries: 16,
            backoff_s: 1.0,
            max_backoff_s: 30.0,
            request_timeout_s: 120.0,
            tokenizer_path: None,
            response_suffix: String::new(),
        }
    }
}

impl RewardModelConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let key = "reward.reward_model";
        ensure(
            self.url.starts_with("http://") || self.url.starts_with("https://"),
            &format!("{key}.url"),
            format!("must start with http:// or https:// (got {:?})", self.url),
        )?;
        ensure(self.max_concurrency > 0, &format!("{key}.max_concurrency"), "must be > 0")?;
        ensure(self.retries > 0, &format!("{key}.retries"), "must be > 0 (it counts attempts)")?;
        ensure(self.backoff_s >= 0.0, &format!("{key}.backoff_s"), "must be >= 0")?;
        ensure(self.max_backoff_s >= self.backoff_s, &format!("{key}.max_backoff_s"), "must be >= backoff_s")?;
        ensure(
            self.tokenizer_path.as_deref().is_none_or(|path| !path.trim().is_empty()),
            &format!("{key}.tokenizer_path"),
            "must not be empty when set",
        )?;
        ensure(
            self.request_timeout_s > 0.0 && self.request_timeout_s.is_finite(),
            &format!("{key}.request_timeout_s"),
            "must be > 0",
        )
    }
}

/// verl's `reward.reward_kwargs` as the `dapo` reward manager reads it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardKwargsConfig {
    pub overlong_buffer_cfg: OverlongBufferConfig,
    /// the response budget in tokens the penalty is measured against; required when the penalty is enabled
    pub max_resp_len: Option<usize>,
}

impl RewardKwargsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let buffer = &self.overlong_buffer_cfg;
        if !buffer.enable {
            return Ok(());
        }
        let key = "reward.reward_kwargs";
        ensure(buffer.len > 0, &format!("{key}.overlong_buffer_cfg.len"), "must be > 0 when the penalty is enabled")?;
        let Some(max_resp_len) = self.max_resp_len else {
            return Err(ConfigError::Invalid {
                path: format!("{key}.max_resp_len"),
                message: "required when overlong_buffer_cfg.enable is true".into(),
            });
        };
        ensure(max_resp_len >= buffer.len, &format!("{key}.max_resp_len"), "must be >= overlong_buffer_cfg.len")?;
        ensure(
            buffer.penalty_factor.is_finite(),
            &format!("{key}.overlong_buffer_cfg.penalty_factor"),
            "must be finite",
        )
    }
}

/// DAPO's soft overlong punishment: responses longer than `max_resp_len − len` tokens lose up to
/// `penalty_factor` linearly over the last `len` tokens.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    pub len: usize,
    pub penalty_factor: f64,
    /// report `overlong_reward` and `overlong` as extra values
    pub log: bool,
}

impl Default for OverlongBufferConfig {
    // DAPO recipe values.
    fn default() -> Self {
        Self { enable: false, len: 4096, penalty_factor: 1.0, log: false }
    }
}

/// How gsm8k extracts the model's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gsm8kMethod {
    /// the last `#### <number>`
    #[default]
    Strict,
    /// the last number-like token anywhere
    Flexible,
}

/// Arguments of verl's rule scorers that verl's dispatcher leaves at their defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuleScorerConfig {
    pub gsm8k_method: Gsm8kMethod,
    /// score of a well-formed but wrong answer (gsm8k, search-R1 exact match)
    pub format_score: f64,
    /// score of a correct answer (gsm8k, search-R1 exact match)
    pub correct_score: f64,
    /// math_dapo: only accept `\boxed{}` in the last 100 characters, compared verbatim
    pub strict_box_verify: bool,
}

impl Default for RuleScorerConfig {
    fn default() -> Self {
        Self { gsm8k_method: Gsm8kMethod::Strict, format_score: 0.0, correct_score: 1.0, strict_box_verify: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verl_style_reward_section_parses_with_defaults_filled_in() {
        let yaml = r#"
custom_reward_function:
  path: my_reward.py
  reward_kwargs: {scale: 2}
reward_kwargs:
  overlong_buffer_cfg: {enable: true, len: 512, penalty_factor: 1.0, log: true}
  max_resp_len: 2048
"#;
        let cfg: RewardConfig = serde_yaml::from_str(yaml).unwrap();
        assert!(cfg.custom_reward_function.is_configured());
        assert_eq!(cfg.custom_reward_function.name, "compute_score");
        assert_eq!(cfg.reward_kwargs.max_resp_len, Some(2048));
        assert_eq!(cfg.workers, 1);
        cfg.validate().unwrap();
    }

    #[test]
    fn reward_keys_load_from_file_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("job.yaml");
        std::fs::write(&file, "custom_reward_function:\n  reward_kwargs: {topK: 3}\n  timeout_s: 5\n").unwrap();
        let overrides = [
            "custom_reward_function.command=[python3, reward_fn.py]".to_string(),
            "reward_model.api=sglang".to_string(),
            "rule.gsm8k_method=flexible".to_string(),
        ];
        let cfg: RewardConfig = crate::load(Some(&file), &overrides).unwrap();
        assert_eq!(cfg.custom_reward_function.command, ["python3", "reward_fn.py"]);
        assert_eq!(cfg.custom_reward_function.reward_kwargs["topK"], serde_json::json!(3));
        assert_eq!(cfg.custom_reward_function.timeout_s, 5.0);
        assert_eq!(cfg.reward_model.api, RewardModelApi::Sglang);
        assert_eq!(cfg.rule.gsm8k_method, Gsm8kMethod::Flexible);
    }

    #[test]
    fn reward_model_tokenizer_path_loads_from_an_override_and_must_not_be_blank() {
        let overrides = ["reward_model.tokenizer_path=/models/rm".to_string(), "reward_model.enable=true".to_string()];
        let mut cfg: RewardConfig = crate::load(None, &overrides).unwrap();
        assert_eq!(cfg.reward_model.tokenizer_path.as_deref(), Some("/models/rm"));
        cfg.validate().unwrap();
        cfg.reward_model.tokenizer_path = Some(" ".into());
        assert!(cfg.validate().unwrap_err().to_string().contains("reward.reward_model.tokenizer_path"));
    }

    #[test]
    fn reward_inflight_beyond_the_clients_publish_window_is_rejected() {
        let mut cfg = RewardConfig { max_inflight: MAX_REWARD_INFLIGHT + 1, ..RewardConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("reward.max_inflight"));
        cfg.max_inflight = 0;
        assert!(cfg.validate().is_err());
        cfg.max_inflight = MAX_REWARD_INFLIGHT;
        cfg.validate().unwrap();
        cfg.batch_size = 0;
        assert!(cfg.validate().unwrap_err().to_string().contains("reward.batch_size"));
    }

    #[test]
    fn unknown_reward_key_is_rejected() {
        assert!(serde_yaml::from_str::<RewardConfig>("reward_model: {enabled: true}").is_err());
        assert!(serde_yaml::from_str::<RewardConfig>("reward_model: {api: trtllm}").is_err());
    }

    #[test]
    fn enabled_overlong_penalty_requires_max_resp_len_at_least_the_buffer() {
        let mut cfg = RewardConfig::default();
        cfg.reward_kwargs.overlong_buffer_cfg.enable = true;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("reward.reward_kwargs.max_resp_len"), "{err}");
        cfg.reward_kwargs.max_resp_len = Some(100);
        assert!(cfg.validate().unwrap_err().to_string().contains("max_resp_len"));
        cfg.reward_kwargs.max_resp_len = Some(8192);
        cfg.validate().unwrap();
    }

    #[test]
    fn enabled_reward_model_needs_an_http_or_https_url() {
        let mut cfg = RewardConfig::default();
        cfg.reward_model.enable = true;
        cfg.reward_model.url = "grpc://rm.example".into();
        assert!(cfg.validate().unwrap_err().to_string().contains("reward.reward_model.url"));
        cfg.reward_model.url = "http://rm.example:8000".into();
        cfg.validate().unwrap();
        cfg.reward_model.url = "https://rm.example".into();
        cfg.validate().unwrap();
    }
}

//! The typed sections of a job configuration. Defaults follow verl's `ppo_trainer.yaml` where verl has the
//! key; jetrl-only keys are documented where they are declared.

use serde::{Deserialize, Serialize};

use crate::{ensure, ActorConfig, AlgorithmConfig, ConfigError, CriticConfig, RewardConfig};

/// A whole job: every service reads the sections it needs from the same file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    pub nats: NatsConfig,
    pub run: RunConfig,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub algorithm: AlgorithmConfig,
    pub actor: ActorConfig,
    pub critic: CriticConfig,
    pub rollout: RolloutConfig,
    pub reward: RewardConfig,
    pub buffer: BufferConfig,
    pub checkpoint: CheckpointConfig,
    pub trainer: TrainerConfig,
    pub log: LogConfig,
}

impl JobConfig {
    /// Loads a job file with environment and `key=value` overrides, then validates it.
    pub fn load(file: Option<&std::path::Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let cfg: JobConfig = crate::load(file, overrides)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Cross-field checks; every error names the offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.algorithm.validate()?;
        self.actor.validate()?;
        self.critic.validate()?;
        self.reward.validate()?;
        ensure(!self.nats.url.trim().is_empty(), "nats.url", "must not be empty")?;
        self.namespace()?;
        ensure(self.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")?;
        ensure(self.data.max_response_length > 0, "data.max_response_length", "must be > 0")?;
        ensure(self.rollout.n > 0, "rollout.n", "must be > 0")?;
        ensure(self.rollout.temperature >= 0.0, "rollout.temperature", "must be >= 0")?;
        ensure(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0, "rollout.top_p", "must be in (0, 1]")?;
        ensure(self.actor.optim.lr > 0.0, "actor.optim.lr", "must be > 0")?;
        ensure(self.actor.ppo_epochs > 0, "actor.ppo_epochs", "must be > 0")?;
        ensure(self.actor.clip_ratio_c > 1.0, "actor.clip_ratio_c", "must be > 1 (dual-clip lower bound)")?;
        ensure(
            ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
                .contains(&self.actor.loss_agg_mode.as_str()),
            "actor.loss_agg_mode",
            format!(
                "unknown mode {:?} (token-mean, token-sum, seq-mean-token-sum, seq-mean-token-sum-norm, seq-mean-token-mean)",
                self.actor.loss_agg_mode
            ),
        )?;
        ensure(
            ["sync", "colocate_async", "separate_async"].contains(&self.trainer.mode.as_str()),
            "trainer.mode",
            format!("unknown mode {:?} (sync, colocate_async, separate_async)", self.trainer.mode),
        )?;
        ensure(self.buffer.max_off_policy_threshold > 0, "buffer.max_off_policy_threshold", "must be > 0")?;
        ensure(
            ["drop", "wait"].contains(&self.buffer.max_off_policy_strategy.as_str()),
            "buffer.max_off_policy_strategy",
            format!("unknown strategy {:?} (drop, wait)", self.buffer.max_off_policy_strategy),
        )?;
        ensure(
            ["object_store", "shared_fs"].contains(&self.checkpoint.transport.as_str()),
            "checkpoint.transport",
            format!("unknown transport {:?} (object_store, shared_fs)", self.checkpoint.transport),
        )?;
        ensure(
            self.checkpoint.transport != "shared_fs" || self.checkpoint.shared_dir.is_some(),
            "checkpoint.shared_dir",
            "required when checkpoint.transport is shared_fs",
        )?;
        ensure(
            !self.data.train_files.is_empty() || self.data.task.is_some(),
            "data.task",
            "set data.task (a built-in task) or data.train_files",
        )?;
        ensure(["f32", "bf16"].contains(&self.model.dtype.as_str()), "model.dtype", "must be f32 or bf16")?;
        ensure(
            ["error", "left", "right", "middle"].contains(&self.data.truncation.as_str()),
            "data.truncation",
            format!("unknown value {:?} (error, left, right, middle)", self.data.truncation),
        )?;
        ensure(self.data.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")?;
        ensure(
            ["auto", "resume_path", "path", "disable"].contains(&self.trainer.resume_mode.as_str()),
            "trainer.resume_mode",
            format!("unknown mode {:?} (auto, resume_path, disable)", self.trainer.resume_mode),
        )?;
        ensure(
            !matches!(self.trainer.resume_mode.as_str(), "resume_path" | "path")
                || self.trainer.resume_from_path.as_deref().is_some_and(|p| p.contains("global_step_")),
            "trainer.resume_from_path",
            "resume_mode resume_path needs a path to a `global_step_<n>` directory",
        )?;
        for logger in &self.trainer.logger {
            ensure(
                TRAINER_LOGGERS.contains(&logger.as_str()),
                "trainer.logger",
                format!("unknown logger {logger:?} (expected one of: {})", TRAINER_LOGGERS.join(", ")),
            )?;
        }
        Ok(())
    }

    /// The job's namespace (`nats.namespace`, else `run.name`), checked: an error names the key it came from.
    pub fn namespace(&self) -> Result<&str, ConfigError> {
        let (key, namespace) = match &self.nats.namespace {
            Some(namespace) => ("nats.namespace", namespace.as_str()),
            None => ("run.name", self.run.name.as_str()),
        };
        jetrl_wire::subjects::validate_namespace(namespace).map(|()| namespace).map_err(|err| {
            let hint = if key == "run.name" { "; or set nats.namespace" } else { "" };
            ConfigError::Invalid { path: key.into(), message: format!("{err}{hint}") }
        })
    }

    /// Tokens generated per response at most.
    pub fn max_new_tokens(&self) -> u32 {
        self.rollout.max_new_tokens.unwrap_or(self.data.max_response_length)
    }
}

/// How to reach NATS.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    pub url: String,
    /// a `.creds` file (JWT + nkey)
    pub creds_file: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// how long to keep retrying the first connection (with backoff) before giving up
    pub connect_timeout_s: f64,
    /// default timeout of request/reply calls
    pub request_timeout_s: f64,
    /// the job's namespace: part of every stream, bucket and subject name, so jobs sharing a NATS server never
    /// see each other's records (default: `run.name`)
    pub namespace: Option<String>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            creds_file: None,
            user: None,
            password: None,
            token: None,
            connect_timeout_s: 30.0,
            request_timeout_s: 30.0,
            namespace: None,
        }
    }
}

/// Where a run writes its outputs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub name: String,
    /// run directory: metrics.jsonl, reward curve, checkpoints, logs
    pub dir: String,
    pub seed: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self { name: "jetrl".into(), dir: "runs/jetrl".into(), seed: 42 }
    }
}

/// The policy model (an HF model directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// HF-format directory: config.json, *.safetensors, tokenizer.json
    pub path: String,
    /// if set and `path` has no model, `jetrl run` writes a random-init model of this preset there
    pub init_preset: Option<String>,
    /// `cpu` or `cuda:N`
    pub device: String,
    /// `f32` or `bf16`
    pub dtype: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { path: "runs/models/tiny".into(), init_preset: None, device: "cpu".into(), dtype: "f32".into() }
    }
}

/// A built-in synthetic task (`data.task`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    /// `reverse` or `sort` (digit strings)
    pub name: String,
    pub min_len: u32,
    pub max_len: u32,
    pub train_size: u32,
    pub val_size: u32,
    /// the prompt text; `{task}` and `{digits}` are replaced (use `{digits}=` for the `tiny-digits` model,
    /// whose vocabulary has no letters)
    pub template: String,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            name: "reverse".into(),
            min_len: 4,
            max_len: 4,
            train_size: 20_000,
            val_size: 64,
            template: "{task} {digits}=".into(),
        }
    }
}

/// verl's `data.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    pub task: Option<TaskConfig>,
    /// verl-format `.parquet` or `.jsonl` files (rows with `prompt` chat messages, `data_source`,
    /// `reward_model.ground_truth`, `extra_info`)
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    /// rows kept from the train files; -1 = all (verl `train_max_samples`)
    pub train_max_samples: i64,
    /// rows kept from the val files; -1 = all (verl `val_max_samples`)
    pub val_max_samples: i64,
    /// prompt groups per step
    pub train_batch_size: u32,
    /// prompts per validation request; null = the whole validation set at once
    pub val_batch_size: Option<u32>,
    /// prompt tokens after the chat template; longer prompts are filtered or truncated
    pub max_prompt_length: u32,
    pub max_response_length: u32,
    pub shuffle: bool,
    /// shuffle the validation set (verl `validation_shuffle`)
    pub validation_shuffle: bool,
    pub seed: u64,
    pub prompt_key: String,
    /// drop rows whose templated prompt exceeds `max_prompt_length` when the dataset is loaded
    pub filter_overlong_prompts: bool,
    /// what to do with a prompt over `max_prompt_length`: `error`, `left`, `right` or `middle` (keep both ends)
    pub truncation: String,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            task: None,
            train_files: vec![],
            val_files: vec![],
            train_max_samples: -1,
            val_max_samples: -1,
            train_batch_size: 1024,
            val_batch_size: None,
            max_prompt_length: 512,
            max_response_length: 512,
            shuffle: true,
            validation_shuffle: false,
            seed: 42,
            prompt_key: "prompt".into(),
            filter_overlong_prompts: false,
            truncation: "error".into(),
        }
    }
}

/// verl's `rollout.val_kwargs.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValKwargs {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub n: u32,
}

impl Default for ValKwargs {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: -1, n: 1 }
    }
}

/// verl's `rollout.*` plus the rollout-worker service settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub repetition_penalty: f32,
    /// default: data.max_response_length
    pub max_new_tokens: Option<u32>,
    pub val_kwargs: ValKwargs,
    /// sequences decoded together (the engine's batch budget)
    pub max_num_seqs: u32,
    /// prompt groups a worker holds at once (pulled but not yet acknowledged)
    pub max_inflight_groups: u32,
    /// how many worker processes `jetrl run` starts
    pub workers: u32,
    /// this instance's name in heartbeats; default: hostname-pid
    pub instance_id: Option<String>,
    pub metrics_addr: String,
    pub heartbeat_interval_s: f64,
    /// redelivery delay of a task whose worker went silent (in-progress acks keep long groups alive)
    pub ack_wait_s: f64,
    /// positions per sequence in the engine's KV cache (context + response); default
    /// data.max_prompt_length + the response budget (multi-turn tool output counts towards it)
    pub max_model_len: Option<u32>,
    /// token positions in the preallocated KV cache, over all sequences; the engine runs
    /// min(max_num_seqs, kv_cache_tokens / max_model_len) sequences at once. Default: max_num_seqs rows,
    /// capped by kv_cache_memory_gb
    pub kv_cache_tokens: Option<u64>,
    /// memory cap of the default KV budget (ignored when kv_cache_tokens is set)
    pub kv_cache_memory_gb: f64,
    /// sampling seed of the worker's engine (requests without their own seed); default run.seed mixed with the
    /// instance id, so workers draw different streams
    pub seed: Option<u64>,
    /// `processed_logprobs` (after penalty, temperature, top-k/top-p: the distribution sampled from) or
    /// `raw_logprobs` (the model's log-softmax)
    pub logprobs_mode: String,
    pub multi_turn: MultiTurnConfig,
    pub agent: AgentConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            repetition_penalty: 1.0,
            max_new_tokens: None,
            val_kwargs: ValKwargs::default(),
            max_num_seqs: 256,
            max_inflight_groups: 64,
            workers: 1,
            instance_id: None,
            metrics_addr: "127.0.0.1:0".into(),
            heartbeat_interval_s: 1.0,
            ack_wait_s: 30.0,
            max_model_len: None,
            kv_cache_tokens: None,
            kv_cache_memory_gb: 4.0,
            seed: None,
            logprobs_mode: "processed_logprobs".into(),
            multi_turn: MultiTurnConfig::default(),
            agent: AgentConfig::default(),
        }
    }
}

/// verl's `rollout.multi_turn.*`: the tool agent loop (`tool_agent`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiTurnConfig {
    /// model turns per trajectory at most (none: until no tool call or the response budget)
    pub max_assistant_turns: Option<u32>,
    /// tool-response turns per trajectory at most
    pub max_user_turns: Option<u32>,
    /// tool calls of one turn run concurrently; calls beyond this are ignored
    pub max_parallel_calls: u32,
    /// characters of one tool response kept
    pub max_tool_response_length: u32,
    /// `left` (keep the start), `right` (keep the end) or `middle` (keep both ends)
    pub tool_response_truncate_side: String,
    /// tool-call syntax the model writes: `hermes` (`<tool_call>{json}</tool_call>`)
    pub format: String,
    /// built-in tools offered to `tool_agent` rows (`calculator`, `python`); a row's `extra_info.tool_selection`
    /// narrows the list
    pub tools: Vec<String>,
    /// seconds one tool call may take before it counts as failed (error text, reward 0)
    pub tool_timeout_s: f64,
    /// the python tool: interpreter, wall-clock limit, address-space limit, bytes of stdout+stderr kept
    pub python_bin: String,
    pub python_timeout_s: f64,
    pub python_memory_mb: u64,
    pub python_max_output_bytes: u64,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            max_assistant_turns: None,
            max_user_turns: None,
            max_parallel_calls: 1,
            max_tool_response_length: 256,
            tool_response_truncate_side: "middle".into(),
            format: "hermes".into(),
            tools: vec!["calculator".into(), "python".into()],
            tool_timeout_s: 30.0,
            python_bin: "python3".into(),
            python_timeout_s: 10.0,
            python_memory_mb: 512,
            python_max_output_bytes: 16 * 1024,
        }
    }
}

/// verl's `rollout.agent.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// the agent loop of rows without `agent_name`: `single_turn_agent` or `tool_agent`
    pub default_agent_loop: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self { default_agent_loop: "single_turn_agent".into() }
    }
}

/// The replay buffer (verl `trainer.v1.sampler.*`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BufferConfig {
    pub metrics_addr: String,
    pub max_off_policy_threshold: u64,
    /// `drop` or `wait`
    pub max_off_policy_strategy: String,
    pub sync_refill_failed_groups: bool,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            max_off_policy_threshold: 8,
            max_off_policy_strategy: "drop".into(),
            sync_refill_failed_groups: false,
        }
    }
}

/// Weight distribution and durable checkpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub metrics_addr: String,
    /// `object_store` (JetStream object store; works across hosts) or `shared_fs` (a directory every reader mounts)
    pub transport: String,
    pub shared_dir: Option<String>,
    /// weight versions kept in the store (older blobs are deleted)
    pub keep_versions: u32,
    /// object-store chunk size
    pub chunk_bytes: u32,
    /// where announced checkpoint versions are written as HF model directories; default `<run.dir>/checkpoints`
    pub dir: Option<String>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            transport: "object_store".into(),
            shared_dir: None,
            keep_versions: 2,
            chunk_bytes: 8 << 20,
            dir: None,
        }
    }
}

/// verl's `trainer.*` plus trainer service settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// `sync` (colocate_async and separate_async: later)
    pub mode: String,
    pub total_training_steps: Option<u64>,
    pub total_epochs: u32,
    /// save a checkpoint every this many steps (and at the last step); -1 = never
    pub save_freq: i64,
    /// checkpoint root: `global_step_<n>/` directories and `latest_checkpointed_iteration.txt`;
    /// default `<run.dir>/checkpoints`
    pub default_local_dir: Option<String>,
    /// checkpoints kept (oldest deleted first); null = all. `max_ckpt_to_keep` is the older spelling.
    pub max_actor_ckpt_to_keep: Option<u32>,
    pub max_critic_ckpt_to_keep: Option<u32>,
    pub max_ckpt_to_keep: Option<u32>,
    /// `auto` (latest checkpoint under default_local_dir, if any), `resume_path` (or `path`: exactly
    /// `resume_from_path`) or `disable`
    pub resume_mode: String,
    /// a `global_step_<n>` directory, for resume_mode `resume_path`
    pub resume_from_path: Option<String>,
    /// validate every this many steps (and at the last step); -1 = never
    pub test_freq: i64,
    pub val_before_train: bool,
    /// validate once and stop (verl `val_only`)
    pub val_only: bool,
    /// validation generations written to the log per validation (verl's generations table)
    pub log_val_generations: u32,
    /// the actor is not updated before this step; the critic is (verl `critic_warmup`)
    pub critic_warmup: u64,
    /// where metrics go besides `metrics.jsonl` (always written: `jetrl run` reads it): `console` (a log line
    /// per step), `tensorboard` (event files), `jsonl`; verl's other backends are accepted and ignored
    pub logger: Vec<String>,
    /// TensorBoard event directory; default `<run.dir>/tensorboard`
    pub tensorboard_dir: Option<String>,
    pub metrics_addr: String,
    /// how long to wait for rollout workers to load a new weight version
    pub weight_sync_timeout_s: f64,
    /// how long one sample request may be held by the buffer before it is re-sent
    pub sample_wait_s: f64,
    /// verl `trainer.rollout_data_dir`: a JSONL file of the step's rollouts per step (input, output, score)
    pub rollout_data_dir: Option<String>,
    /// verl `trainer.validation_data_dir`: a JSONL file of the validation generations per validation
    pub validation_data_dir: Option<String>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            mode: "sync".into(),
            total_training_steps: None,
            total_epochs: 1,
            save_freq: -1,
            default_local_dir: None,
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            max_ckpt_to_keep: None,
            resume_mode: "auto".into(),
            resume_from_path: None,
            test_freq: -1,
            val_before_train: false,
            val_only: false,
            log_val_generations: 0,
            critic_warmup: 0,
            logger: vec!["console".into(), "jsonl".into()],
            tensorboard_dir: None,
            metrics_addr: "127.0.0.1:0".into(),
            weight_sync_timeout_s: 300.0,
            sample_wait_s: 10.0,
            rollout_data_dir: None,
            validation_data_dir: None,
        }
    }
}

/// verl's `trainer.logger` backends: the first three are written by jetrl, the rest are accepted so verl
/// configs load, and ignored with a warning.
pub const TRAINER_LOGGERS: &[&str] =
    &["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow", "vemlp_wandb", "clearml", "trackio", "file"];

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// an EnvFilter directive, e.g. `info` or `info,jetrl_bus=debug`; RUST_LOG wins when set
    pub level: String,
    /// `text` or `json`
    pub format: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { level: "info".into(), format: "text".into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn with_task(mut cfg: JobConfig) -> JobConfig {
        cfg.data.task = Some(TaskConfig::default());
        cfg
    }

    #[test]
    fn unknown_key_is_rejected_with_its_full_path() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "actor:\n  optim:\n    lrr: 0.1\n").unwrap();
        let err = JobConfig::load(Some(file.path()), &[]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("actor.optim.lrr"), "{text}");
        assert!(matches!(err, ConfigError::Invalid { .. }));
    }

    #[test]
    fn overrides_beat_the_file_and_are_typed() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "data:\n  task: {{name: reverse}}\n  train_batch_size: 8\nactor:\n  optim:\n    lr: 0.5\n")
            .unwrap();
        let cfg = JobConfig::load(
            Some(file.path()),
            &["actor.optim.lr=1e-4".into(), "rollout.n=4".into(), "trainer.val_before_train=true".into()],
        )
        .unwrap();
        assert_eq!(cfg.actor.optim.lr, 1e-4);
        assert_eq!(cfg.rollout.n, 4);
        assert_eq!(cfg.data.train_batch_size, 8);
        assert!(cfg.trainer.val_before_train);
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err = crate::load::<JobConfig>(None, &["rollout.n=many".into()]).unwrap_err();
        assert!(err.to_string().contains("rollout.n"), "{err}");
    }

    #[test]
    fn override_without_equals_is_rejected() {
        let err = crate::load::<JobConfig>(None, &["rollout.n".into()]).unwrap_err();
        assert!(matches!(err, ConfigError::BadOverride(_)));
    }

    #[test]
    fn validation_names_the_key() {
        let mut cfg = with_task(JobConfig::default());
        cfg.actor.loss_agg_mode = "mean".into();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("actor.loss_agg_mode"), "{err}");
        let mut cfg = with_task(JobConfig::default());
        cfg.checkpoint.transport = "shared_fs".into();
        assert!(cfg.validate().unwrap_err().to_string().contains("checkpoint.shared_dir"));
        assert!(with_task(JobConfig::default()).validate().is_ok());
    }

    #[test]
    fn the_namespace_is_nats_namespace_else_run_name_and_an_invalid_one_names_its_key() {
        let mut cfg = with_task(JobConfig::default());
        cfg.run.name = "exp-1".into();
        assert_eq!(cfg.namespace().unwrap(), "exp-1");
        cfg.nats.namespace = Some("shared_ns".into());
        assert_eq!(cfg.namespace().unwrap(), "shared_ns");

        cfg.nats.namespace = Some("team.a".into());
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("nats.namespace") && err.contains("team.a"), "{err}");
        cfg.nats.namespace = None;
        cfg.run.name = "my run".into();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("run.name") && err.contains("my run") && err.contains("nats.namespace"), "{err}");
        // a run.name that cannot be a namespace is fine when nats.namespace is set
        cfg.nats.namespace = Some("my-run".into());
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = JobConfig::load(Some(std::path::Path::new("/nonexistent/job.yaml")), &[]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/job.yaml"));
    }
}

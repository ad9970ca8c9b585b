//! The typed sections of a job configuration. Defaults follow verl's `ppo_trainer.yaml` where verl has the
//! key; jetrl-only keys are documented where they are declared.

use serde::{Deserialize, Serialize};

use crate::{
    ensure, ActorConfig, AgentLoop, AlgorithmConfig, ConfigError, CriticConfig, DeviceSpec, EngineKwargs, LogFormat,
    Logger, LogprobsMode, ModelDtype, ModelPreset, OffPolicyStrategy, ResumeMode, RewardConfig, RolloutName, TaskName,
    ToolCallFormat, ToolName, TrainerMode, TruncateSide, Truncation, VllmConfig, WeightTransportKind,
};

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
        self.model.validate()?;
        ensure(!self.nats.url.trim().is_empty(), "nats.url", "must not be empty")?;
        ensure(
            self.nats.url.split(',').all(|url| !url.trim().is_empty()),
            "nats.url",
            format!("{:?}: an empty entry in the list of servers", self.nats.url),
        )?;
        ensure(
            matches!(self.nats.replicas, 1 | 3),
            "nats.replicas",
            format!("must be 1 (one NATS server) or 3 (a three-node JetStream cluster), got {}", self.nats.replicas),
        )?;
        self.namespace()?;
        ensure(self.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")?;
        ensure(self.data.max_response_length > 0, "data.max_response_length", "must be > 0")?;
        ensure(self.rollout.n > 0, "rollout.n", "must be > 0")?;
        ensure(self.rollout.temperature >= 0.0, "rollout.temperature", "must be >= 0")?;
        ensure(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0, "rollout.top_p", "must be in (0, 1]")?;
        self.validate_rollout_engine()?;
        ensure(self.actor.optim.lr > 0.0, "actor.optim.lr", "must be > 0")?;
        ensure(self.actor.ppo_epochs > 0, "actor.ppo_epochs", "must be > 0")?;
        ensure(self.actor.clip_ratio_c > 1.0, "actor.clip_ratio_c", "must be > 1 (dual-clip lower bound)")?;
        ensure(self.buffer.max_off_policy_threshold > 0, "buffer.max_off_policy_threshold", "must be > 0")?;
        ensure(
            self.buffer.reread_after_s >= 0.0 && self.buffer.reread_after_s.is_finite(),
            "buffer.reread_after_s",
            "must be >= 0 (0 = never)",
        )?;
        ensure(
            self.checkpoint.transport != WeightTransportKind::SharedFs || self.checkpoint.shared_dir.is_some(),
            "checkpoint.shared_dir",
            "required when checkpoint.transport is shared_fs",
        )?;
        ensure(
            !self.data.train_files.is_empty() || self.data.task.is_some(),
            "data.task",
            "set data.task (a built-in task) or data.train_files",
        )?;
        ensure(self.data.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")?;
        ensure(
            self.rollout.agent.default_agent_loop != AgentLoop::Tool || !self.rollout.multi_turn.tools.is_empty(),
            "rollout.multi_turn.tools",
            "is empty, but rollout.agent.default_agent_loop is tool_agent: name at least one tool (calculator, python)",
        )?;
        if let Some(task) = self.data.task.as_ref().filter(|t| t.name == TaskName::Multiply) {
            // the calculator computes in f64, exact below 2^53: two 7-digit operands' product has at most 14 digits
            ensure(task.max_len <= 7, "data.task.max_len", "multiply's operands have at most 7 digits")?;
        }
        self.validate_mode()?;
        self.validate_ranks()?;
        self.validate_liveness()?;
        self.validate_threads()?;
        self.run.supervisor.validate()?;
        self.validate_retention()?;
        ensure(
            self.trainer.resume_mode != ResumeMode::ResumePath
                || self.trainer.resume_from_path.as_deref().is_some_and(|p| p.contains("global_step_")),
            "trainer.resume_from_path",
            "resume_mode resume_path needs a path to a `global_step_<n>` directory",
        )?;
        Ok(())
    }

    /// The engine keys (`rollout.name` and vLLM's).
    fn validate_rollout_engine(&self) -> Result<(), ConfigError> {
        let r = &self.rollout;
        ensure(
            r.gpu_memory_utilization > 0.0 && r.gpu_memory_utilization <= 1.0,
            "rollout.gpu_memory_utilization",
            format!("must be in (0, 1], got {}", r.gpu_memory_utilization),
        )?;
        ensure(r.tensor_model_parallel_size >= 1, "rollout.tensor_model_parallel_size", "must be >= 1")?;
        ensure(r.max_num_batched_tokens != Some(0), "rollout.max_num_batched_tokens", "must be >= 1")?;
        r.vllm.validate(&r.engine_kwargs)?;
        ensure(
            r.name == RolloutName::Vllm || r.engine_kwargs.vllm.is_empty(),
            "rollout.engine_kwargs.vllm",
            "is set, but rollout.name is not vllm",
        )?;
        ensure(
            r.name == RolloutName::Vllm || r.vllm.url.is_none(),
            "rollout.vllm.url",
            "is set, but rollout.name is not vllm",
        )
    }

    /// The keys the trainer's mode needs, checked together.
    fn validate_mode(&self) -> Result<(), ConfigError> {
        match self.trainer.mode {
            TrainerMode::Sync => Ok(()),
            TrainerMode::SeparateAsync => {
                let sync_steps = self.trainer.separate_async.parameter_sync_step;
                ensure(sync_steps > 0, "trainer.separate_async.parameter_sync_step", "must be > 0")?;
                let mini = self.actor.ppo_mini_batch_size.unwrap_or(self.data.train_batch_size);
                ensure(
                    u64::from(self.data.train_batch_size) == u64::from(sync_steps) * u64::from(mini),
                    "trainer.separate_async.parameter_sync_step",
                    format!(
                        "data.train_batch_size ({}) must equal trainer.separate_async.parameter_sync_step ({sync_steps}) \
                         × actor.ppo_mini_batch_size ({mini}{}) in separate_async",
                        self.data.train_batch_size,
                        if self.actor.ppo_mini_batch_size.is_none() { ", null = the whole batch" } else { "" }
                    ),
                )
            }
            TrainerMode::ColocateAsync => {
                let c = &self.trainer.colocate_async;
                ensure(
                    c.rollout_instance.as_deref().is_some_and(|i| !i.trim().is_empty()),
                    "trainer.colocate_async.rollout_instance",
                    "required in colocate_async: the rollout.instance_id of the worker that shares the trainer's device",
                )?;
                ensure(
                    c.handshake_timeout_s > 0.0 && c.handshake_timeout_s.is_finite(),
                    "trainer.colocate_async.handshake_timeout_s",
                    "must be > 0",
                )
            }
        }
    }

    /// The trainer's ranks and their rendezvous.
    fn validate_ranks(&self) -> Result<(), ConfigError> {
        let t = &self.trainer;
        ensure(t.n_gpus_per_node > 0, "trainer.n_gpus_per_node", "must be > 0")?;
        ensure(t.nnodes > 0, "trainer.nnodes", "must be > 0")?;
        let world = u64::from(t.n_gpus_per_node) * u64::from(t.nnodes);
        ensure(
            u64::from(t.dist.rank) < world,
            "trainer.dist.rank",
            format!(
                "{} is not a rank of trainer.n_gpus_per_node ({}) × trainer.nnodes ({}) = {world} ranks",
                t.dist.rank, t.n_gpus_per_node, t.nnodes
            ),
        )?;
        ensure(!t.dist.master_addr.trim().is_empty(), "trainer.dist.master_addr", "must not be empty")?;
        ensure(t.dist.timeout_s > 0.0 && t.dist.timeout_s.is_finite(), "trainer.dist.timeout_s", "must be > 0")?;
        ensure(
            world == 1 || u64::from(self.data.train_batch_size) >= world,
            "trainer.n_gpus_per_node",
            format!(
                "{world} trainer ranks, but data.train_batch_size is {}: every rank needs at least one prompt group",
                self.data.train_batch_size
            ),
        )
    }

    /// Every `*_threads` key.
    fn validate_threads(&self) -> Result<(), ConfigError> {
        ensure_threads(self.trainer.torch_threads, "trainer.torch_threads")?;
        ensure_threads(self.trainer.torch_interop_threads, "trainer.torch_interop_threads")?;
        ensure_threads(self.trainer.tokio_threads, "trainer.tokio_threads")?;
        ensure_threads(self.rollout.torch_threads, "rollout.torch_threads")?;
        ensure_threads(self.rollout.torch_interop_threads, "rollout.torch_interop_threads")?;
        ensure_threads(self.rollout.tokio_threads, "rollout.tokio_threads")?;
        ensure_threads(self.reward.tokio_threads, "reward.tokio_threads")?;
        ensure_threads(self.buffer.tokio_threads, "buffer.tokio_threads")?;
        ensure_threads(self.checkpoint.tokio_threads, "checkpoint.tokio_threads")?;
        if let Some(sim) = &self.trainer.simulate {
            let positive = |v: f64| v.is_finite() && v >= 0.0;
            ensure(positive(sim.seconds_per_kilotoken), "trainer.simulate.seconds_per_kilotoken", "must be ≥ 0")?;
            ensure(positive(sim.publish_s), "trainer.simulate.publish_s", "must be ≥ 0")?;
            ensure(sim.time_scale.is_finite() && sim.time_scale > 0.0, "trainer.simulate.time_scale", "must be > 0")?;
        }
        Ok(())
    }

    /// The heartbeat interval, the liveness window and the weight-sync deadline, which only work together.
    fn validate_liveness(&self) -> Result<(), ConfigError> {
        let r = &self.rollout;
        ensure(
            r.heartbeat_interval_s > 0.0 && r.heartbeat_interval_s.is_finite(),
            "rollout.heartbeat_interval_s",
            "must be > 0",
        )?;
        ensure(
            r.heartbeat_timeout_s >= 3.0 * r.heartbeat_interval_s,
            "rollout.heartbeat_timeout_s",
            format!(
                "must be at least 3 × rollout.heartbeat_interval_s ({}) so that one late heartbeat does not make a \
                 worker look dead (got {})",
                r.heartbeat_interval_s, r.heartbeat_timeout_s
            ),
        )?;
        let hang_after = self.run.supervisor.hang_after_s;
        ensure(
            hang_after == 0.0 || hang_after >= 3.0 * r.heartbeat_interval_s,
            "run.supervisor.hang_after_s",
            format!(
                "must be 0 (never) or at least 3 × rollout.heartbeat_interval_s ({}): a service is killed as hung \
                 when its heartbeats stop this long (got {hang_after})",
                r.heartbeat_interval_s
            ),
        )?;
        ensure(
            self.trainer.weight_sync_timeout_s >= r.heartbeat_timeout_s,
            "trainer.weight_sync_timeout_s",
            format!(
                "must be at least rollout.heartbeat_timeout_s ({}): a weight sync must outlast the time it takes to \
                 notice a dead worker (got {})",
                r.heartbeat_timeout_s, self.trainer.weight_sync_timeout_s
            ),
        )
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

    /// Checkpoint retention: a checkpoint directory is deleted whole by the actor's retention (a checkpoint without
    /// its policy cannot be resumed), so the critic's can only keep fewer.
    fn validate_retention(&self) -> Result<(), ConfigError> {
        let t = &self.trainer;
        match (t.max_critic_ckpt_to_keep, t.max_actor_ckpt_to_keep.or(t.max_ckpt_to_keep)) {
            (Some(critics), Some(checkpoints)) => ensure(
                critics <= checkpoints,
                "trainer.max_critic_ckpt_to_keep",
                format!(
                    "{critics} critics cannot outlive the {checkpoints} checkpoints kept \
                     (trainer.max_actor_ckpt_to_keep, else trainer.max_ckpt_to_keep): older checkpoints are deleted \
                     whole; set it to at most {checkpoints}"
                ),
            ),
            _ => Ok(()),
        }
    }

    /// Tokens generated per response at most.
    pub fn max_new_tokens(&self) -> u32 {
        self.rollout.max_new_tokens.unwrap_or(self.data.max_response_length)
    }
}

/// How to reach NATS. Its `Debug` shows no secret (see the impl below).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// one server URL, or several (a cluster's nodes) separated by commas or given as a YAML list: the client
    /// connects to any of them and learns the rest of the cluster from the one it reaches
    #[serde(deserialize_with = "url_list")]
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
    /// a file holding the password of `user` (its first line): how systemd's LoadCredential and compose secrets
    /// hand secrets over, so the password is in neither the environment nor a command line
    pub password_file: Option<String>,
    /// a file holding the token (its first line)
    pub token_file: Option<String>,
    /// a file holding an nkey seed (`SU...`): nkey authentication
    pub nkey_seed_file: Option<String>,
    /// PEM CA certificate(s) the server's certificate must chain to (instead of the system's roots)
    pub tls_ca_file: Option<String>,
    /// PEM client certificate and its private key, for a server that verifies clients (mutual TLS)
    pub tls_cert_file: Option<String>,
    pub tls_key_file: Option<String>,
    /// the name the server's certificate must carry, when it is not the URL's host (e.g. a URL with an IP)
    pub tls_server_name: Option<String>,
    /// refuse to talk to the server without TLS (implied by any `tls_*` file and by a `tls://` URL)
    pub tls_required: bool,
    /// the prefix of this client's reply subjects (default `_INBOX`): a server that lets each user subscribe only
    /// to its own replies (`_INBOX_<user>.>`, as deploy/nats/gen.sh writes) needs it
    pub inbox_prefix: Option<String>,
    /// the job's namespace: part of every stream, bucket and subject name, so jobs sharing a NATS server never
    /// see each other's records (default: `run.name`)
    pub namespace: Option<String>,
    /// copies of every stream, KV bucket and object store the job declares: 1 (one server) or 3 (a three-node
    /// JetStream cluster: a write is acknowledged once two nodes have it, and one node may die)
    pub replicas: u8,
}

/// `nats.url` as one string, comma-separated (what an environment variable or a `key=value` override can say),
/// or a YAML list of URLs (joined with commas).
fn url_list<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Urls {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Urls::deserialize(deserializer)? {
        Urls::One(url) => url,
        Urls::Many(urls) => urls.join(","),
    })
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
            password_file: None,
            token_file: None,
            nkey_seed_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: None,
            tls_required: false,
            inbox_prefix: None,
            namespace: None,
            replicas: 1,
        }
    }
}

/// Secrets (password, token) print as `<redacted>`, so a logged or panicking config leaks none. The exhaustive
/// destructuring makes a new field a compile error here until someone decides whether it is a secret.
impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let NatsConfig {
            url,
            creds_file,
            user,
            password,
            token,
            connect_timeout_s,
            request_timeout_s,
            password_file,
            token_file,
            nkey_seed_file,
            tls_ca_file,
            tls_cert_file,
            tls_key_file,
            tls_server_name,
            tls_required,
            inbox_prefix,
            namespace,
            replicas,
        } = self;
        let redacted = |secret: &Option<String>| secret.as_ref().map(|_| "<redacted>");
        f.debug_struct("NatsConfig")
            .field("url", url)
            .field("creds_file", creds_file)
            .field("user", user)
            .field("password", &redacted(password))
            .field("token", &redacted(token))
            .field("connect_timeout_s", connect_timeout_s)
            .field("request_timeout_s", request_timeout_s)
            .field("password_file", password_file)
            .field("token_file", token_file)
            .field("nkey_seed_file", nkey_seed_file)
            .field("tls_ca_file", tls_ca_file)
            .field("tls_cert_file", tls_cert_file)
            .field("tls_key_file", tls_key_file)
            .field("tls_server_name", tls_server_name)
            .field("tls_required", tls_required)
            .field("inbox_prefix", inbox_prefix)
            .field("namespace", namespace)
            .field("replicas", replicas)
            .finish()
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
    /// how `jetrl run` restarts a service that exits abnormally
    pub supervisor: SupervisorConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self { name: "jetrl".into(), dir: "runs/jetrl".into(), seed: 42, supervisor: SupervisorConfig::default() }
    }
}

/// `jetrl run`'s restart policy, after systemd's `Restart=on-failure` with `StartLimitBurst`: a service that
/// exits non-zero or is killed by a signal is started again after a delay that doubles per consecutive failure;
/// a service that needs more than `max_restarts` restarts within `restart_window_s` is crash-looping and ends
/// the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SupervisorConfig {
    /// delay before the first restart after a failure
    pub restart_delay_s: f64,
    /// the doubling delay stops growing here
    pub max_restart_delay_s: f64,
    /// a service that ran at least this long before failing starts again from `restart_delay_s`
    pub healthy_after_s: f64,
    /// restarts allowed within `restart_window_s`; one more failure in the window ends the job (0 = any
    /// abnormal exit ends it)
    pub max_restarts: u32,
    pub restart_window_s: f64,
    /// a running service whose heartbeat has not come for this long while NATS was reachable is hung (stopped,
    /// deadlocked): it is killed and restarted like one that crashed (0 = never). Judged only after its first
    /// heartbeat, so a long start-up (a model load) is not taken for a hang
    pub hang_after_s: f64,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            restart_delay_s: 1.0,
            max_restart_delay_s: 30.0,
            healthy_after_s: 60.0,
            max_restarts: 5,
            restart_window_s: 120.0,
            hang_after_s: 120.0,
        }
    }
}

impl SupervisorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let positive = |v: f64| v > 0.0 && v.is_finite();
        ensure(positive(self.restart_delay_s), "run.supervisor.restart_delay_s", "must be > 0")?;
        ensure(
            positive(self.max_restart_delay_s) && self.max_restart_delay_s >= self.restart_delay_s,
            "run.supervisor.max_restart_delay_s",
            format!("must be >= run.supervisor.restart_delay_s ({})", self.restart_delay_s),
        )?;
        ensure(
            self.healthy_after_s >= 0.0 && self.healthy_after_s.is_finite(),
            "run.supervisor.healthy_after_s",
            "must be >= 0",
        )?;
        ensure(positive(self.restart_window_s), "run.supervisor.restart_window_s", "must be > 0")?;
        ensure(
            self.hang_after_s >= 0.0 && self.hang_after_s.is_finite(),
            "run.supervisor.hang_after_s",
            "must be >= 0 (0 = never)",
        )
    }
}

/// A thread count key: null picks a default, an explicit value must be at least 1.
fn ensure_threads(value: Option<u32>, path: &str) -> Result<(), ConfigError> {
    ensure(value != Some(0), path, "must be >= 1 (null = the default)")
}

/// The policy model (an HF model directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// HF-format directory: config.json, *.safetensors, tokenizer.json
    pub path: String,
    /// if set and `path` has no model, `jetrl run` writes a random-init model of this preset there
    pub init_preset: Option<ModelPreset>,
    /// `cpu`, `cuda`, `cuda:N` or `auto`
    pub device: DeviceSpec,
    pub dtype: ModelDtype,
    /// recompute each decoder layer's activations in the backward pass instead of keeping them (verl
    /// `actor_rollout_ref.model.enable_gradient_checkpointing`; here for the actor and the critic): less memory
    /// per micro-batch, about one more forward pass of compute per update
    pub enable_gradient_checkpointing: bool,
    /// pack each micro-batch's sequences end to end in one row, without padding, in the trainer's forward passes
    /// (verl `actor_rollout_ref.model.use_remove_padding`; the actor, π_old / reference log-probs and the critic):
    /// the same log-probs and values, no compute spent on padding
    pub use_remove_padding: bool,
    /// LoRA rank (verl `actor_rollout_ref.model.lora_rank`; 0 = full fine-tuning): the base stays frozen in
    /// `dtype`, f32 adapters train, the reference policy is the base with the adapters off, and weight sync and
    /// checkpoints carry the adapters only (PEFT's layout, `actor/lora_adapter/`)
    pub lora_rank: u32,
    /// LoRA alpha (verl `actor_rollout_ref.model.lora_alpha`): the adapter's output is scaled by alpha / rank
    pub lora_alpha: f64,
    /// the linear layers that get adapters (verl `actor_rollout_ref.model.target_modules`): `all-linear` or a
    /// list of module names as PEFT matches them (`q_proj`, `self_attn.o_proj`, ...)
    pub target_modules: ModuleList,
    /// modules left without adapters (verl `actor_rollout_ref.model.exclude_modules`), same matching
    pub exclude_modules: Option<ModuleList>,
    /// start from this PEFT adapter directory instead of a new adapter (verl
    /// `actor_rollout_ref.model.lora_adapter_path`); its rank and alpha must be `lora_rank` and `lora_alpha`
    pub lora_adapter_path: Option<String>,
}

/// The linear layers of every decoder jetrl loads (what LoRA can adapt).
pub const LINEAR_MODULES: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Module names as PEFT and verl take them: one string (`all-linear`, or one name) or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModuleList {
    One(String),
    Many(Vec<String>),
}

impl ModuleList {
    /// The names, `all-linear` included as a name.
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::One(name) => vec![name.clone()],
            Self::Many(names) => names.clone(),
        }
    }

    /// Whether this is PEFT's `all-linear`.
    pub fn is_all_linear(&self) -> bool {
        self.names().iter().any(|n| n == "all-linear")
    }
}

impl ModelConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.lora_rank == 0 {
            return Ok(());
        }
        ensure(self.lora_alpha.is_finite() && self.lora_alpha > 0.0, "model.lora_alpha", "must be > 0")?;
        let targets = self.target_modules.names();
        ensure(!targets.is_empty(), "model.target_modules", "names no module (use all-linear or a list)")?;
        ensure(
            !self.target_modules.is_all_linear() || targets.len() == 1,
            "model.target_modules",
            "is all-linear or a list of module names, not both",
        )?;
        // every name must end in a linear layer the decoders have; the model, once loaded, checks the whole name
        let lists = [
            ("model.target_modules", Some(&self.target_modules)),
            ("model.exclude_modules", self.exclude_modules.as_ref()),
        ];
        for (key, list) in lists {
            let names = list.map(ModuleList::names).unwrap_or_default();
            for name in names.iter().filter(|n| *n != "all-linear") {
                let last = name.rsplit('.').next().unwrap_or(name);
                ensure(
                    LINEAR_MODULES.contains(&last),
                    key,
                    format!(
                        "`{name}` names no linear layer of a Qwen2, Llama or Qwen3 decoder; they are {} (or all-linear)",
                        LINEAR_MODULES.join(", ")
                    ),
                )?;
            }
        }
        Ok(())
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "runs/models/tiny".into(),
            init_preset: None,
            device: DeviceSpec::Cpu,
            dtype: ModelDtype::F32,
            enable_gradient_checkpointing: false,
            use_remove_padding: false,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: ModuleList::One("all-linear".into()),
            exclude_modules: None,
            lora_adapter_path: None,
        }
    }
}

/// A built-in synthetic task (`data.task`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    pub name: TaskName,
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
            name: TaskName::Reverse,
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
    /// verl-format `.parquet`, `.jsonl` or `.arrow` files, or HF `datasets` directories (`save_to_disk`), of rows
    /// with `prompt` chat messages, `data_source`, `reward_model.ground_truth`, `extra_info`
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
    /// what to do with a prompt over `max_prompt_length`
    pub truncation: Truncation,
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
            truncation: Truncation::Error,
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
    /// the inference engine (verl's key): `jetrl` (in the worker's process) or `vllm` (a `vllm serve`)
    pub name: RolloutName,
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
    /// a worker whose last heartbeat is older than this counts as gone (left out of weight-sync waits; its
    /// in-flight groups are redelivered after `ack_wait_s`); at least 3 × `heartbeat_interval_s`
    pub heartbeat_timeout_s: f64,
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
    /// decode eagerly on CUDA instead of replaying one CUDA graph per batch bucket (vLLM's and verl's
    /// `enforce_eager`; graphs take a little memory and a capture per new shape). The CPU is always eager.
    pub enforce_eager: bool,
    /// sampling seed of the worker's engine (requests without their own seed); default run.seed mixed with the
    /// instance id, so workers draw different streams
    pub seed: Option<u64>,
    pub logprobs_mode: LogprobsMode,
    pub multi_turn: MultiTurnConfig,
    pub agent: AgentConfig,
    /// torch intra-op threads; null = `OMP_NUM_THREADS` if set, else every core this process may use
    /// (`jetrl run` passes an even share of the host's cores between the trainer and its rollout workers)
    pub torch_threads: Option<u32>,
    /// torch inter-op threads; null = 1 on the CPU (jetrl runs no parallel graph), torch's default on CUDA
    pub torch_interop_threads: Option<u32>,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
    /// vLLM: the fraction of each device's memory for weights, activations and KV cache (verl's key)
    pub gpu_memory_utilization: f64,
    /// vLLM: devices one server spans with tensor parallelism (the worker's visible devices, this many)
    pub tensor_model_parallel_size: u32,
    /// vLLM: tokens one scheduler step processes at most; null = vLLM's default
    pub max_num_batched_tokens: Option<u32>,
    /// vLLM: prefill long prompts in chunks between decode steps
    pub enable_chunked_prefill: bool,
    /// vLLM: reuse the KV of shared prompt prefixes (a group's n samples share their prompt)
    pub enable_prefix_caching: bool,
    /// colocate_async: the engine releases its KV cache while the trainer steps (vLLM sleeps: weights and cache)
    pub free_cache_engine: bool,
    /// engine arguments passed through as they are (verl's `engine_kwargs.vllm.*`)
    pub engine_kwargs: EngineKwargs,
    /// how the worker reaches vLLM (`rollout.name: vllm`)
    pub vllm: VllmConfig,
}

impl RolloutConfig {
    /// How long a stopping worker lets its in-flight groups finish before it naks them: `ack_wait_s`, between
    /// 1 and 30 s (a supervisor's stop grace allows at least this much more than its own margin).
    pub fn drain(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.ack_wait_s.clamp(1.0, 30.0))
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            name: RolloutName::default(),
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
            heartbeat_timeout_s: 10.0,
            ack_wait_s: 30.0,
            max_model_len: None,
            kv_cache_tokens: None,
            kv_cache_memory_gb: 4.0,
            enforce_eager: false,
            seed: None,
            logprobs_mode: LogprobsMode::Processed,
            multi_turn: MultiTurnConfig::default(),
            agent: AgentConfig::default(),
            torch_threads: None,
            torch_interop_threads: None,
            tokio_threads: None,
            gpu_memory_utilization: 0.5,
            tensor_model_parallel_size: 1,
            max_num_batched_tokens: None,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            free_cache_engine: true,
            engine_kwargs: EngineKwargs::default(),
            vllm: VllmConfig::default(),
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
    pub tool_response_truncate_side: TruncateSide,
    /// tool-call syntax the model writes
    pub format: ToolCallFormat,
    /// built-in tools offered to `tool_agent` rows; a row's `extra_info.tool_selection` narrows the list
    pub tools: Vec<ToolName>,
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
            tool_response_truncate_side: TruncateSide::Middle,
            format: ToolCallFormat::Hermes,
            tools: vec![ToolName::Calculator, ToolName::Python],
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
    /// the agent loop of rows without `agent_name`
    pub default_agent_loop: AgentLoop,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self { default_agent_loop: AgentLoop::SingleTurn }
    }
}

/// The replay buffer (verl `trainer.v1.sampler.*`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BufferConfig {
    pub metrics_addr: String,
    pub max_off_policy_threshold: u64,
    pub max_off_policy_strategy: OffPolicyStrategy,
    pub sync_refill_failed_groups: bool,
    /// seconds a sample request may wait, with nothing coming in, before the buffer reads the group records and
    /// rewards again from the stores (doubling up to 10×, while it finds nothing); 0 = never
    pub reread_after_s: f64,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            max_off_policy_threshold: 8,
            max_off_policy_strategy: OffPolicyStrategy::Drop,
            sync_refill_failed_groups: false,
            reread_after_s: 30.0,
            tokio_threads: None,
        }
    }
}

/// Weight distribution (checkpoint-sync). Durable checkpoints are the trainer's (`trainer.save_freq`,
/// `trainer.default_local_dir`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub metrics_addr: String,
    pub transport: WeightTransportKind,
    pub shared_dir: Option<String>,
    /// weight versions kept in the store (older blobs are deleted)
    pub keep_versions: u32,
    /// object-store chunk size
    pub chunk_bytes: u32,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            metrics_addr: "127.0.0.1:0".into(),
            transport: WeightTransportKind::ObjectStore,
            shared_dir: None,
            keep_versions: 2,
            chunk_bytes: 8 << 20,
            tokio_threads: None,
        }
    }
}

/// verl's `trainer.*` plus trainer service settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// verl `trainer.project_name`: the trackers' project (MLflow experiment, wandb project)
    pub project_name: String,
    /// verl `trainer.experiment_name`: the trackers' run name; null = `run.name`
    pub experiment_name: Option<String>,
    pub mode: TrainerMode,
    /// colocate_async settings (verl `trainer.v1.colocate_async.*`)
    pub colocate_async: ColocateAsyncConfig,
    /// separate_async settings (verl `trainer.v1.separate_async.*`)
    pub separate_async: SeparateAsyncConfig,
    pub total_training_steps: Option<u64>,
    pub total_epochs: u32,
    /// save a checkpoint every this many steps (and at the last step); -1 = never
    pub save_freq: i64,
    /// checkpoint root: `global_step_<n>/` directories and `latest_checkpointed_iteration.txt`;
    /// default `<run.dir>/checkpoints`
    pub default_local_dir: Option<String>,
    /// checkpoints kept (oldest deleted first); null = all. `max_ckpt_to_keep` is the older spelling.
    pub max_actor_ckpt_to_keep: Option<u32>,
    /// of the checkpoints kept, how many keep their `critic/` (older ones keep the policy); null = all; at most
    /// the checkpoints kept
    pub max_critic_ckpt_to_keep: Option<u32>,
    pub max_ckpt_to_keep: Option<u32>,
    pub resume_mode: ResumeMode,
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
    pub logger: Vec<Logger>,
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
    /// torch intra-op threads; null = `OMP_NUM_THREADS` if set, else every core this process may use
    /// (`jetrl run` passes an even share of the host's cores between the trainer and its rollout workers)
    pub torch_threads: Option<u32>,
    /// torch inter-op threads; null = 1 on the CPU (jetrl runs no parallel graph), torch's default on CUDA
    pub torch_interop_threads: Option<u32>,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
    /// trainer ranks on each node (verl `trainer.n_gpus_per_node`): one process per GPU (per share of the cores
    /// without one); the rollout workers' devices are counted apart (`rollout.workers`)
    pub n_gpus_per_node: u32,
    /// nodes the trainer's ranks span (verl `trainer.nnodes`): `n_gpus_per_node × nnodes` ranks in all
    pub nnodes: u32,
    /// where and how the trainer's ranks meet (the c10d process group)
    pub dist: DistConfig,
    /// a simulation knob, not for training: with it set the trainer loads no model and its learner is a paced
    /// stand-in that sleeps the time a device would take (`just bench cluster_sim`); null = the real model
    pub simulate: Option<SimulateConfig>,
}

/// `trainer.simulate`: the paced stand-in learner of `just bench cluster_sim`. An update sleeps
/// `seconds_per_kilotoken` per thousand tokens (prompt and response) of its batch; a weight version sleeps
/// `publish_s` before it is published; both divided by `time_scale`. It trains nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulateConfig {
    /// modelled seconds an update takes per thousand tokens of its batch (the whole trainer, all its devices)
    pub seconds_per_kilotoken: f64,
    /// modelled seconds to gather and publish one weight version
    pub publish_s: f64,
    /// the paced clock's speed: modelled seconds per real second (1 = real time)
    pub time_scale: f64,
}

impl Default for SimulateConfig {
    fn default() -> Self {
        Self { seconds_per_kilotoken: 0.02, publish_s: 1.0, time_scale: 1.0 }
    }
}

/// The trainer's process group: rank 0 hosts a c10d TCPStore at `master_addr:master_port`, every rank joins it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// this process's rank, `0 .. n_gpus_per_node × nnodes` (`jetrl run` and the systemd unit set it per process);
    /// rank 0 leads
    pub rank: u32,
    /// the address rank 0's store listens on and the others connect to (torchrun's `MASTER_ADDR`)
    pub master_addr: String,
    /// the store's port (torchrun's `MASTER_PORT`); 0 = `jetrl run` picks a free one (set it when ranks are started
    /// otherwise: systemd, compose, several nodes)
    pub master_port: u16,
    /// how long the rendezvous and each collective may take before the rank fails (naming the store and the rank)
    pub timeout_s: f64,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self { rank: 0, master_addr: "127.0.0.1".into(), master_port: 0, timeout_s: 300.0 }
    }
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            project_name: "jetrl".into(),
            experiment_name: None,
            mode: TrainerMode::Sync,
            colocate_async: ColocateAsyncConfig::default(),
            separate_async: SeparateAsyncConfig::default(),
            total_training_steps: None,
            total_epochs: 1,
            save_freq: -1,
            default_local_dir: None,
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            max_ckpt_to_keep: None,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            test_freq: -1,
            val_before_train: false,
            val_only: false,
            log_val_generations: 0,
            critic_warmup: 0,
            logger: vec![Logger::Console, Logger::Jsonl],
            tensorboard_dir: None,
            metrics_addr: "127.0.0.1:0".into(),
            weight_sync_timeout_s: 300.0,
            sample_wait_s: 10.0,
            rollout_data_dir: None,
            validation_data_dir: None,
            torch_threads: None,
            torch_interop_threads: None,
            tokio_threads: None,
            n_gpus_per_node: 1,
            nnodes: 1,
            dist: DistConfig::default(),
            simulate: None,
        }
    }
}

/// verl's `trainer.v1.colocate_async.*`: the trainer and one rollout worker share a device.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColocateAsyncConfig {
    /// full train batches submitted before step 1 (one more is submitted at every step)
    pub num_warmup_batches: u32,
    /// `rollout.instance_id` of the rollout worker that shares the trainer's device: it pauses (aborting its
    /// sequences, keeping their prefixes, freeing its KV cache) while the trainer updates, loads the new weights
    /// from a local file and resumes. Required in colocate_async (`jetrl run` names its worker `rollout-0`).
    pub rollout_instance: Option<String>,
    /// how long each side of the pause / resume handshake waits for the other before reporting it and going on
    pub handshake_timeout_s: f64,
}

impl Default for ColocateAsyncConfig {
    fn default() -> Self {
        Self { num_warmup_batches: 1, rollout_instance: None, handshake_timeout_s: 60.0 }
    }
}

/// verl's `trainer.v1.separate_async.*`: the trainer and the rollout workers on their own devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SeparateAsyncConfig {
    /// full train batches submitted before step 1 (one more is submitted at every step)
    pub num_warmup_batches: u32,
    /// mini-batch updates per global step, each on `actor.ppo_mini_batch_size` groups sampled oldest first;
    /// weights are published once per global step. `data.train_batch_size` must equal
    /// `parameter_sync_step × actor.ppo_mini_batch_size`
    pub parameter_sync_step: u32,
}

impl Default for SeparateAsyncConfig {
    fn default() -> Self {
        Self { num_warmup_batches: 1, parameter_sync_step: 4 }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A job of the built-in copy task with `overrides`, loaded and validated.
    fn load_copy_task(overrides: &[&str]) -> Result<JobConfig, ConfigError> {
        let mut all = vec!["data.task={name: copy}".to_string()];
        all.extend(overrides.iter().map(|s| s.to_string()));
        JobConfig::load(None, &all)
    }

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
        cfg.checkpoint.transport = WeightTransportKind::SharedFs;
        assert!(cfg.validate().unwrap_err().to_string().contains("checkpoint.shared_dir"));
        assert!(with_task(JobConfig::default()).validate().is_ok());
    }

    /// A tool job without tools, with an unknown tool, or multiply operands the calculator cannot multiply exactly.
    #[test]
    fn tool_jobs_name_the_key_of_a_bad_tool_list_or_task() {
        let mut cfg = with_task(JobConfig::default());
        cfg.rollout.agent.default_agent_loop = AgentLoop::Tool;
        assert!(cfg.validate().is_ok(), "the default tools");
        cfg.rollout.multi_turn.tools.clear();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("rollout.multi_turn.tools") && err.contains("tool_agent"), "{err}");
        let err =
            crate::load::<JobConfig>(None, &["rollout.multi_turn.tools=[\"calc\"]".into()]).unwrap_err().to_string();
        assert!(err.contains("rollout.multi_turn.tools") && err.contains("calculator"), "{err}");
        let mut cfg = with_task(JobConfig::default());
        cfg.data.task.as_mut().unwrap().name = TaskName::Multiply;
        cfg.data.task.as_mut().unwrap().max_len = 8;
        assert!(cfg.validate().unwrap_err().to_string().contains("data.task.max_len"));
    }

    /// A verl user's `trainer.*` and `data.*` keys load as they are; wrong values name their key.
    #[test]
    fn verl_trainer_and_data_keys_load_and_bad_values_name_the_key() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            file,
            "data:\n  train_files: [a.parquet]\n  val_files: [b.jsonl]\n  truncation: middle\n  filter_overlong_prompts: true\n  \
             val_batch_size: 8\n  train_max_samples: 100\n\
             trainer:\n  save_freq: 10\n  test_freq: 5\n  max_actor_ckpt_to_keep: 2\n  resume_mode: auto\n  \
             default_local_dir: /tmp/ck\n  log_val_generations: 4\n  validation_data_dir: /tmp/val\n  \
             logger: [console, tensorboard, wandb]\n  critic_warmup: 3\n  val_only: false"
        )
        .unwrap();
        let cfg = JobConfig::load(Some(file.path()), &[]).unwrap();
        assert_eq!(cfg.trainer.max_actor_ckpt_to_keep, Some(2));
        assert_eq!(cfg.data.truncation, Truncation::Middle);
        assert_eq!(cfg.trainer.logger, vec![Logger::Console, Logger::Tensorboard, Logger::Wandb]);
        let bad = |o: &str| JobConfig::load(Some(file.path()), &[o.to_string()]).unwrap_err().to_string();
        assert!(bad("data.truncation=both").contains("data.truncation"));
        assert!(bad("trainer.resume_mode=resume_path").contains("trainer.resume_from_path"));
        assert!(bad("trainer.logger=[\"neptune\"]").contains("trainer.logger"));
        let path = JobConfig::load(
            Some(file.path()),
            &["trainer.resume_mode=resume_path".into(), "trainer.resume_from_path=/ck/global_step_10".into()],
        );
        assert!(path.is_ok(), "{path:?}");
    }

    /// An enumerated key with an unknown value names its full path and every allowed value.
    #[test]
    fn unknown_enum_value_names_the_key_and_the_allowed_values() {
        let cases = [
            ("trainer.mode=asyn", "trainer.mode", "separate_async"),
            ("buffer.max_off_policy_strategy=keep", "buffer.max_off_policy_strategy", "wait"),
            ("checkpoint.transport=nfs", "checkpoint.transport", "shared_fs"),
            ("model.dtype=f16", "model.dtype", "bf16"),
            ("model.device=tpu", "model.device", "cuda:N"),
            ("actor.loss_agg_mode=mean", "actor.loss_agg_mode", "seq-mean-token-mean"),
            ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator", "grpo"),
            ("actor.policy_loss.loss_mode=ppo", "actor.policy_loss.loss_mode", "vanilla"),
            ("reward.reward_model.api=trtllm", "reward.reward_model.api", "sglang"),
            ("rollout.logprobs_mode=raw", "rollout.logprobs_mode", "raw_logprobs"),
        ];
        for (o, key, allowed) in cases {
            let err = crate::load::<JobConfig>(None, &[o.to_string()]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(allowed), "{o}: {err}");
        }
    }

    /// Each mode's required keys are checked at load, with every key involved named.
    #[test]
    fn mode_keys_are_checked_together_and_named() {
        let base = ["data.task={name: copy}".to_string(), "data.train_batch_size=32".to_string()];
        let load = |extra: &[&str]| {
            let mut o = base.to_vec();
            o.extend(extra.iter().map(|s| s.to_string()));
            JobConfig::load(None, &o)
        };
        let err = load(&["trainer.mode=separate_async"]).unwrap_err().to_string();
        assert!(
            err.contains("trainer.separate_async.parameter_sync_step")
                && err.contains("actor.ppo_mini_batch_size")
                && err.contains("data.train_batch_size"),
            "{err}"
        );
        assert!(load(&["trainer.mode=separate_async", "actor.ppo_mini_batch_size=8"]).is_ok());
        let err = load(&["trainer.mode=separate_async", "actor.ppo_mini_batch_size=6"]).unwrap_err().to_string();
        assert!(err.contains("(4) × actor.ppo_mini_batch_size (6)"), "{err}");
        let err = load(&["trainer.mode=colocate_async"]).unwrap_err().to_string();
        assert!(err.contains("trainer.colocate_async.rollout_instance"), "{err}");
        assert!(load(&["trainer.mode=colocate_async", "trainer.colocate_async.rollout_instance=rollout-0"]).is_ok());
        let err = load(&["trainer.separate_async.parameter_sync_step=0", "trainer.mode=separate_async"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be > 0"), "{err}");
        let err = load(&["buffer.max_off_policy_threshold=0"]).unwrap_err().to_string();
        assert!(err.contains("buffer.max_off_policy_threshold"), "{err}");
        let err = load(&["buffer.reread_after_s=-1"]).unwrap_err().to_string();
        assert!(err.contains("buffer.reread_after_s"), "{err}");
    }

    #[test]
    fn nats_url_takes_a_list_of_servers_and_replicas_are_1_or_3() {
        let load = |o: &[&str]| {
            let mut all = vec!["data.task={name: copy}".to_string()];
            all.extend(o.iter().map(|s| s.to_string()));
            JobConfig::load(None, &all)
        };
        let cfg = load(&["nats.url=[tls://h1:4222, tls://h2:4222]"]).unwrap();
        assert_eq!(cfg.nats.url, "tls://h1:4222,tls://h2:4222");
        let cfg = load(&["nats.url=tls://h1:4222,tls://h2:4222"]).unwrap();
        assert_eq!(cfg.nats.url, "tls://h1:4222,tls://h2:4222");
        let err = load(&["nats.url=tls://h1:4222,,tls://h2:4222"]).unwrap_err().to_string();
        assert!(err.contains("nats.url") && err.contains("empty entry"), "{err}");
        assert_eq!(load(&[]).unwrap().nats.replicas, 1);
        assert_eq!(load(&["nats.replicas=3"]).unwrap().nats.replicas, 3);
        for bad in ["2", "5", "0"] {
            let err = load(&[&format!("nats.replicas={bad}")]).unwrap_err().to_string();
            assert!(err.contains("nats.replicas") && err.contains("1 (one NATS server) or 3"), "{bad}: {err}");
        }
    }

    /// The heartbeat interval, the liveness window and the sync deadline are one set of keys checked together: an
    /// interval as long as the liveness window would make every weight sync time out.
    #[test]
    fn heartbeat_interval_liveness_window_and_sync_deadline_are_validated_together() {
        let err = load_copy_task(&["rollout.heartbeat_interval_s=10"]).unwrap_err().to_string();
        assert!(
            err.contains("rollout.heartbeat_timeout_s") && err.contains("3 × rollout.heartbeat_interval_s"),
            "{err}"
        );
        assert!(load_copy_task(&["rollout.heartbeat_interval_s=10", "rollout.heartbeat_timeout_s=30"]).is_ok());
        let err = load_copy_task(&["rollout.heartbeat_timeout_s=30", "trainer.weight_sync_timeout_s=20"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("trainer.weight_sync_timeout_s"), "{err}");
        let err = load_copy_task(&["rollout.heartbeat_interval_s=0"]).unwrap_err().to_string();
        assert!(err.contains("rollout.heartbeat_interval_s"), "{err}");
    }

    /// Thread counts are optional, but an explicit 0 is a mistake that names its key; so are supervisor delays
    /// that cannot work.
    #[test]
    fn thread_keys_and_supervisor_settings_are_validated_by_name() {
        let load = |o: &[&str]| {
            let mut all = vec!["data.task={name: copy}".to_string()];
            all.extend(o.iter().map(|s| s.to_string()));
            JobConfig::load(None, &all)
        };
        let cfg = load(&["trainer.torch_threads=3", "rollout.tokio_threads=2", "reward.tokio_threads=1"]).unwrap();
        assert_eq!((cfg.trainer.torch_threads, cfg.trainer.torch_interop_threads), (Some(3), None));
        assert_eq!((cfg.rollout.tokio_threads, cfg.reward.tokio_threads), (Some(2), Some(1)));
        for key in [
            "trainer.torch_threads",
            "trainer.torch_interop_threads",
            "trainer.tokio_threads",
            "rollout.torch_threads",
            "rollout.torch_interop_threads",
            "rollout.tokio_threads",
            "reward.tokio_threads",
            "buffer.tokio_threads",
            "checkpoint.tokio_threads",
        ] {
            let err = load(&[&format!("{key}=0")]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(">= 1"), "{key}: {err}");
        }
        let err = load(&["run.supervisor.restart_delay_s=5", "run.supervisor.max_restart_delay_s=2"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.max_restart_delay_s"), "{err}");
        let err = load(&["run.supervisor.restart_window_s=0"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.restart_window_s"), "{err}");
        let err = load(&["run.supervisor.hang_after_s=-1"]).unwrap_err();
        assert!(err.to_string().contains("run.supervisor.hang_after_s"), "{err}");
        assert_eq!(load(&["run.supervisor.max_restarts=0"]).unwrap().run.supervisor.max_restarts, 0);
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

    /// Old checkpoints are deleted whole, so the critic's retention can only be the same or shorter.
    #[test]
    fn critic_retention_longer_than_the_checkpoints_kept_is_refused() {
        let err =
            load_copy_task(&["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"]).unwrap_err();
        assert!(err.to_string().contains("trainer.max_critic_ckpt_to_keep"), "{err}");
        let err = load_copy_task(&["trainer.max_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=2"]).unwrap_err();
        assert!(err.to_string().contains("at most 1"), "{err}");
        assert!(load_copy_task(&["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=1"]).is_ok());
        assert!(
            load_copy_task(&["trainer.max_critic_ckpt_to_keep=1"]).is_ok(),
            "every checkpoint kept: any critic retention"
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = JobConfig::load(Some(std::path::Path::new("/nonexistent/job.yaml")), &[]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/job.yaml"));
    }
}

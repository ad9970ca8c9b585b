//! jetrl-rollout-worker: one inference engine that turns prompt groups into trajectories.
//!
//! - [`engine`]: the engine thread around [`jetrl_model::Engine`] (continuous batching, group forks, weight swaps
//!   between decode steps), driven through an async handle.
//! - [`agent`]: the agent loops (`single_turn_agent`, `tool_agent` with Hermes tool calls).
//! - [`tools`]: the [`tools::Tool`] trait and the built-in `calculator` and sandboxed `python`.
//!
//! Every worker pulls from the one durable work-queue consumer on PROMPTS, so workers share the work and can be
//! added or removed at any time. A worker pulls only as many groups as its engine has sequence slots for (each
//! pulled group reserves `n` of the engine's slots until it is settled). For each group it marks the group
//! `running`, runs its `n` sessions, publishes every trajectory as its session finishes (de-duplicated by key
//! `{uid}_{session}_{index}`), then the group's score request for the reward service (the trajectories without
//! their token arrays, one message per group), and only then writes the group's terminal status and
//! acknowledges the task. A
//! worker that dies before that leaves the task unacknowledged: the broker redelivers it after
//! `rollout.ack_wait_s` (long groups send in-progress acks so they are not redelivered while being worked on).
//! On SIGTERM it stops pulling, lets in-flight groups finish for a while, then naks what is left.
//!
//! A watcher follows the WEIGHTS bucket and swaps new versions into the engine between decode steps, without
//! dropping running sequences; each trajectory records the lowest and highest version its tokens were sampled
//! under. Heartbeats in the WORKERS bucket report the loaded version and the engine's load.

pub mod agent;
pub mod engine;
pub mod tools;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use jetrl_bus::groups::GroupUpdateError;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, weights, Bus, BusError, GroupStore, Publisher, ScoreRequestBuilder};
use jetrl_config::JobConfig;
use jetrl_model::engine::Detokenizer;
use jetrl_model::{EngineConfig, LogprobsMode, ModelConfig, Request, Sampling, Tokenizer};
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::{validate_uid, TrajectoryKey};
use jetrl_wire::v1::{self, GroupState, Heartbeat, PromptTask, Trajectory, WeightManifest};
use jetrl_wire::{packed, subjects, Message};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::agent::{AgentKind, AgentPrompt, SessionOutput, ToolAgent, ToolTurnEncoder};
use crate::engine::{EngineError, EngineHandle, EngineSettings};
use crate::tools::ToolRegistry;

const SERVICE: &str = "rollout";

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("config {key}: {message}")]
    Config { key: &'static str, message: String },
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("tokenizer of {path}: {message}")]
    Tokenizer { path: String, message: String },
}

/// The rollout settings checked once at start-up (the keys this service adds to `rollout.*`).
struct Settings {
    default_agent: AgentKind,
    logprobs_mode: LogprobsMode,
    tools: ToolRegistry,
}

fn settings(cfg: &JobConfig) -> Result<Settings, RolloutError> {
    let config = |key, message: String| RolloutError::Config { key, message };
    let r = &cfg.rollout;
    let logprobs_mode =
        r.logprobs_mode.parse().map_err(|e: jetrl_model::ModelError| config("rollout.logprobs_mode", e.to_string()))?;
    let default_agent =
        AgentKind::from_name(&r.agent.default_agent_loop).map_err(|e| config("rollout.agent.default_agent_loop", e))?;
    if r.multi_turn.format != "hermes" {
        return Err(config(
            "rollout.multi_turn.format",
            format!("unsupported format {:?} (hermes)", r.multi_turn.format),
        ));
    }
    if !["left", "right", "middle"].contains(&r.multi_turn.tool_response_truncate_side.as_str()) {
        return Err(config(
            "rollout.multi_turn.tool_response_truncate_side",
            format!("{:?} is not left, right or middle", r.multi_turn.tool_response_truncate_side),
        ));
    }
    if r.multi_turn.max_parallel_calls == 0 {
        return Err(config("rollout.multi_turn.max_parallel_calls", "must be >= 1".into()));
    }
    if r.max_num_seqs == 0 {
        return Err(config("rollout.max_num_seqs", "must be >= 1".into()));
    }
    if r.max_model_len.is_some_and(|l| l < 2) {
        return Err(config("rollout.max_model_len", "must be >= 2".into()));
    }
    let tools = ToolRegistry::from_config(&r.multi_turn).map_err(|e| config("rollout.multi_turn.tools", e))?;
    Ok(Settings { default_agent, logprobs_mode, tools })
}

/// The engine's budget from the config: `max_model_len` positions per sequence, `kv_cache_tokens` in all (by
/// default `max_num_seqs` rows, capped by `kv_cache_memory_gb` for this model's per-token KV size).
fn engine_config(cfg: &JobConfig, model: &ModelConfig, seed: u64, eos: Vec<u32>, mode: LogprobsMode) -> EngineConfig {
    let r = &cfg.rollout;
    let max_model_len =
        r.max_model_len.map(|l| l as usize).unwrap_or((cfg.data.max_prompt_length + cfg.max_new_tokens()) as usize);
    let elem = if cfg.model.dtype == "bf16" { 2 } else { 4 };
    let per_token = (2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * elem).max(1) as f64;
    let kv_cache_tokens = match r.kv_cache_tokens {
        Some(tokens) => tokens as usize,
        None => {
            let by_memory = (r.kv_cache_memory_gb.max(0.0) * (1u64 << 30) as f64 / per_token) as usize;
            (r.max_num_seqs as usize * max_model_len).min(by_memory.max(max_model_len))
        }
    };
    EngineConfig {
        max_num_seqs: r.max_num_seqs as usize,
        max_model_len,
        kv_cache_tokens: Some(kv_cache_tokens),
        seed,
        eos_token_ids: eos,
        logprobs_mode: mode,
    }
}

/// What a worker shares between its tasks.
struct Worker {
    bus: Bus,
    groups: GroupStore,
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    instance: String,
    max_prompt_len: usize,
    /// response tokens per trajectory when a task does not say (`data.max_response_length`)
    default_max_tokens: u32,
    ack_wait: Duration,
    default_agent: AgentKind,
    /// the tool agent, or why this model cannot run it (no chat template that renders tool turns)
    tool_agent: Result<ToolAgent, String>,
    /// sequence slots of the engine not reserved by a pulled group
    slots: Arc<Semaphore>,
    /// groups being worked on right now (for heartbeats)
    inflight: AtomicU64,
    /// set when the drain deadline after SIGTERM passes: tasks still running nak their message and stop
    hard_stop: Shutdown,
}

/// Runs one rollout worker until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RolloutError> {
    let settings = settings(&cfg)?;
    let shutdown = Shutdown::new(shutdown);
    let instance = cfg.rollout.instance_id.clone().unwrap_or_else(default_instance_id);
    let bus = Bus::connect_job(&cfg, &format!("jetrl-rollout-worker-{instance}")).await?;
    bus.declare_topology().await?;
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.rollout.metrics_addr, async move { stop.wait().await }).await?;
    describe_metrics();

    let model_dir = PathBuf::from(&cfg.model.path);
    let tokenizer_error = |message: String| RolloutError::Tokenizer { path: model_dir.display().to_string(), message };
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir).map_err(|e| tokenizer_error(e.to_string()))?);
    let model_config = ModelConfig::from_file(&model_dir.join("config.json"))
        .map_err(|e| RolloutError::Engine(EngineError::Load(e.to_string())))?;
    let seed = cfg.rollout.seed.unwrap_or_else(|| {
        cfg.run.seed.wrapping_add(instance.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))))
    });
    let engine_cfg =
        engine_config(&cfg, &model_config, seed, tokenizer.eos_token_ids().to_vec(), settings.logprobs_mode);
    let detokenizer: Detokenizer = {
        let tokenizer = tokenizer.clone();
        Arc::new(move |ids: &[u32]| tokenizer.decode(ids, true).ok())
    };
    let engine_settings = EngineSettings {
        model_dir: model_dir.clone(),
        device: cfg.model.device.clone(),
        dtype: cfg.model.dtype.clone(),
        config: engine_cfg,
        detokenizer: Some(detokenizer),
    };
    // Loading a model takes a while: off the reactor.
    let engine = tokio::task::spawn_blocking(move || EngineHandle::start(engine_settings))
        .await
        .map_err(|e| EngineError::Load(e.to_string()))??;
    tracing::info!(%instance, model = %model_dir.display(), device = %cfg.model.device, slots = engine.slots(), "rollout worker ready");

    let tool_agent = ToolTurnEncoder::new(&tokenizer).map(|encoder| ToolAgent {
        multi_turn: cfg.rollout.multi_turn.clone(),
        tools: settings.tools.clone(),
        tokenizer: tokenizer.clone(),
        encoder,
        max_model_len: engine.max_model_len(),
    });
    if let Err(reason) = &tool_agent {
        tracing::warn!(%reason, "the tool agent is unavailable for this model");
    }
    let (hard_tx, hard_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Arc::new(Worker {
        groups: GroupStore::open(&bus).await?,
        bus: bus.clone(),
        slots: Arc::new(Semaphore::new(engine.slots())),
        engine: engine.clone(),
        tokenizer,
        instance: instance.clone(),
        max_prompt_len: cfg.data.max_prompt_length as usize,
        default_max_tokens: cfg.max_new_tokens(),
        ack_wait: Duration::from_secs_f64(cfg.rollout.ack_wait_s.max(1.0)),
        default_agent: settings.default_agent,
        tool_agent,
        inflight: AtomicU64::new(0),
        hard_stop: Shutdown::new(async move {
            let _ = hard_rx.await;
        }),
    });

    // Load the newest announced weights before taking work, then follow new versions.
    let weights_task = tokio::spawn(follow_weights(worker.clone(), shutdown.clone()));
    let heartbeat_task = tokio::spawn(heartbeats(worker.clone(), cfg.rollout.heartbeat_interval_s, shutdown.clone()));

    let consumer = bus
        .shared_pull_consumer(
            bus.names().prompts_stream(),
            subjects::ROLLOUT_CONSUMER,
            &bus.names().prompts_filter(),
            worker.ack_wait,
            100_000,
        )
        .await?;
    let max_groups = cfg.rollout.max_inflight_groups.max(1) as usize;
    // Each pulled group reserves the slots a typical group needs (rollout.n); a task asks for more, or gives
    // back the surplus, once it knows its own n.
    let per_group = (cfg.rollout.n.max(1) as usize).min(engine.slots());
    let mut tasks: JoinSet<()> = JoinSet::new();
    while !shutdown.is_triggered() {
        while tasks.try_join_next().is_some() {}
        let by_slots = worker.slots.available_permits() / per_group;
        let free = max_groups.saturating_sub(tasks.len()).min(by_slots);
        if free == 0 {
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = tasks.join_next() => continue,
            }
        }
        let Ok(mut reserved) = worker.slots.clone().try_acquire_many_owned((free * per_group) as u32) else {
            // A task took slots since we looked: look again shortly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let batch = tokio::select! {
            _ = shutdown.wait() => break,
            batch = consume::pull(&consumer, free, Duration::from_millis(500)) => batch,
        };
        let mut batch = match batch {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(error = %err, "pull failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.wait() => None,
                next = batch.next() => next,
            };
            match next {
                Some(Ok(msg)) => {
                    let Some(slots) = reserved.split(per_group) else { break };
                    let w = worker.clone();
                    tasks.spawn(async move { w.handle(msg, slots).await });
                }
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "pull batch ended");
                    break;
                }
                None => break,
            }
        }
        // Slots reserved for messages that did not come are released here.
        drop(reserved);
    }
    // Stop pulling; give in-flight groups a chance to finish, then nak what is left.
    let drain = Duration::from_secs_f64(cfg.rollout.ack_wait_s.clamp(1.0, 30.0));
    tracing::info!(inflight = tasks.len(), drain_s = drain.as_secs_f64(), "draining in-flight groups");
    let drained = tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        let _ = hard_tx.send(());
        while tasks.join_next().await.is_some() {}
    }
    weights_task.abort();
    heartbeat_task.abort();
    let _ = worker.heartbeat("stopped").await;
    tracing::info!("rollout worker stopped");
    Ok(())
}

fn default_instance_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

/// The engine sampling settings of a task (proto zeros mean "unset").
fn sampling_of(task: &PromptTask, default_max_tokens: u32) -> Sampling {
    let s = task.sampling.clone().unwrap_or_default();
    let mut stop_token_ids = s.stop_token_ids;
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    Sampling {
        temperature: s.temperature.max(0.0),
        top_p: if s.top_p <= 0.0 || s.top_p > 1.0 { 1.0 } else { s.top_p },
        top_k: i64::from(s.top_k),
        repetition_penalty: if s.repetition_penalty <= 0.0 { 1.0 } else { s.repetition_penalty },
        max_tokens: if s.max_new_tokens == 0 { default_max_tokens } else { s.max_new_tokens } as usize,
        stop_token_ids,
        stop: s.stop.into_iter().filter(|t| !t.is_empty()).collect(),
        seed: s.seed,
        ignore_eos: false,
    }
}

/// `extra_info.tool_selection` of a row (verl), when present.
fn tool_selection(task: &PromptTask) -> Option<Vec<String>> {
    let extra: serde_json::Value = serde_json::from_str(&task.extra_info_json).ok()?;
    let names = extra.get("tool_selection")?.as_array()?;
    Some(names.iter().filter_map(|n| n.as_str().map(str::to_string)).collect())
}

impl Worker {
    /// Handles one delivered prompt task end to end; never panics, always settles the message.
    async fn handle(self: Arc<Self>, msg: jetstream::Message, mut slots: OwnedSemaphorePermit) {
        let Some(task) = consume::decode_or_term::<PromptTask>(&msg, SERVICE).await else { return };
        if let Err(err) = validate_uid(&task.uid) {
            consume::count_malformed(SERVICE, self.bus.names().prompts_stream());
            tracing::error!(subject = %msg.subject, error = %err, "task with an invalid uid terminated");
            consume::settle(&msg, AckKind::Term).await;
            return;
        }
        // Hold as many engine slots as the group has sessions (at most all of them).
        let need = (task.n.max(1) as usize).min(self.engine.slots());
        if slots.num_permits() > need {
            drop(slots.split(slots.num_permits() - need));
        }
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let work = async {
            if slots.num_permits() < need {
                let more = (need - slots.num_permits()) as u32;
                if let Ok(extra) = self.slots.clone().acquire_many_owned(more).await {
                    slots.merge(extra);
                }
            }
            self.run_group(&msg, &task).await
        };
        let outcome = tokio::select! {
            outcome = with_progress(work, &msg, self.ack_wait) => Some(outcome),
            _ = self.hard_stop.wait() => None,
        };
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        drop(slots);
        match outcome {
            Some(Ok(())) => {
                if let Err(err) = consume::ack_confirmed(&msg).await {
                    tracing::warn!(uid = %task.uid, error = %err, "task ack not confirmed (a redelivery will be de-duplicated)");
                }
            }
            Some(Err(TaskError::Skip(reason))) => {
                tracing::info!(uid = %task.uid, %reason, "task skipped");
                consume::settle(&msg, AckKind::Ack).await;
            }
            Some(Err(TaskError::Retry(reason))) => {
                tracing::warn!(uid = %task.uid, %reason, "task failed transiently; naking for redelivery");
                consume::settle(&msg, AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
            None => {
                tracing::info!(uid = %task.uid, "shutting down: task naked for another worker");
                consume::settle(&msg, AckKind::Nak(None)).await;
            }
        }
    }

    async fn run_group(&self, msg: &jetstream::Message, task: &PromptTask) -> Result<(), TaskError> {
        let received = Instant::now();
        // pending -> running (a redelivered task restarts a running group)
        let instance = self.instance.clone();
        let started = self
            .groups
            .update(&task.partition, &task.uid, |s| match s.state() {
                GroupState::Pending | GroupState::Running => {
                    s.worker_id = instance.clone();
                    Some(GroupState::Running)
                }
                _ => None,
            })
            .await;
        match started {
            Ok(Some(_)) => {}
            Ok(None) => return Err(TaskError::Skip("group is already terminal (duplicate delivery)".into())),
            Err(GroupUpdateError::Missing { key }) => return Err(TaskError::Skip(format!("no group record {key}"))),
            Err(err) => return Err(TaskError::Retry(err.to_string())),
        }
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        if delivered > 1 {
            metrics::counter!("jetrl_rollout_redelivered_tasks_total").increment(1);
        }

        let (keys, failure) = self.generate_and_publish(task, received).await?;
        // Terminal status last: every trajectory above is already durable.
        let terminal = if failure.is_some() { GroupState::Failure } else { GroupState::Finished };
        let reason = failure.clone().unwrap_or_default();
        let result = self
            .groups
            .update(&task.partition, &task.uid, |s| {
                s.trajectory_keys = keys.clone();
                s.failure_reason = reason.clone();
                Some(terminal)
            })
            .await;
        match result {
            Ok(_) => {
                metrics::counter!("jetrl_rollout_groups_total", "state" => terminal.label()).increment(1);
                if let Some(reason) = failure {
                    tracing::warn!(uid = %task.uid, published = keys.len(), %reason, "group failed");
                }
                Ok(())
            }
            Err(GroupUpdateError::IllegalTransition { .. }) => {
                Err(TaskError::Skip("group was settled elsewhere".into()))
            }
            Err(err) => Err(TaskError::Retry(err.to_string())),
        }
    }

    /// The prompt's token ids: given directly, or the chat messages rendered with the chat template.
    fn prompt_ids(&self, task: &PromptTask) -> Result<Vec<u32>, String> {
        let ids = if !task.prompt_ids.is_empty() {
            packed::unpack_u32(&task.prompt_ids).map_err(|e| e.to_string())?
        } else if !task.messages.is_empty() {
            self.tokenizer.apply_chat_template(&messages_of(task), true).map_err(|e| format!("chat template: {e}"))?
        } else {
            return Err("task has neither prompt_ids nor messages".into());
        };
        self.check_prompt(ids)
    }

    fn check_prompt(&self, ids: Vec<u32>) -> Result<Vec<u32>, String> {
        if ids.is_empty() {
            return Err("prompt is empty".into());
        }
        if ids.len() > self.max_prompt_len {
            return Err(format!(
                "prompt has {} tokens, more than data.max_prompt_length = {}",
                ids.len(),
                self.max_prompt_len
            ));
        }
        Ok(ids)
    }

    /// Runs the group's sessions with its agent loop and publishes each trajectory as its session ends. Returns
    /// the keys published and, for a group that could not be (fully) generated, the failure reason.
    async fn generate_and_publish(
        &self,
        task: &PromptTask,
        received: Instant,
    ) -> Result<(Vec<String>, Option<String>), TaskError> {
        let agent =
            if task.agent_name.is_empty() { Ok(self.default_agent) } else { AgentKind::from_name(&task.agent_name) };
        let agent = match agent {
            Ok(agent) => agent,
            Err(reason) => return Ok((Vec::new(), Some(reason))),
        };
        let sampling = sampling_of(task, self.default_max_tokens);
        let n = task.n.max(1) as usize;
        let mut out = GroupPublisher::new(self, task, agent, received);
        match agent {
            AgentKind::SingleTurn => {
                let prompt = match self.prompt_ids(task) {
                    Ok(prompt) => prompt,
                    Err(reason) => return Ok((Vec::new(), Some(reason))),
                };
                // One request for the whole group: the prompt is prefilled once and forked n times.
                let mut generation = match self.engine.submit(Request::new(prompt.clone(), n, sampling)).await {
                    Ok(g) => g,
                    Err(EngineError::Stopped) => return Err(TaskError::Retry("engine stopped".into())),
                    Err(err) => return Ok((Vec::new(), Some(err.to_string()))),
                };
                while let Some(result) = generation.next().await {
                    match result {
                        Ok(sample) => out.publish(&prompt, SessionOutput::single_turn(sample)).await?,
                        Err(EngineError::Stopped) => return Err(TaskError::Retry("engine stopped".into())),
                        Err(err) => out.fail(err.to_string()),
                    }
                }
            }
            AgentKind::Tool => {
                let tool_agent = match &self.tool_agent {
                    Ok(a) => a,
                    Err(reason) => return Ok((Vec::new(), Some(format!("tool_agent unavailable: {reason}")))),
                };
                let tools = tool_agent.tools.select(tool_selection(task).as_deref());
                let prompt = if !task.messages.is_empty() {
                    AgentPrompt::Messages(messages_of(task))
                } else {
                    match packed::unpack_u32(&task.prompt_ids) {
                        Ok(ids) => AgentPrompt::Ids(ids),
                        Err(err) => return Ok((Vec::new(), Some(err.to_string()))),
                    }
                };
                let prompt = match tool_agent.prompt_ids(&prompt, &tools).map_err(|e| e.to_string()) {
                    Ok(ids) => match self.check_prompt(ids) {
                        Ok(ids) => ids,
                        Err(reason) => return Ok((Vec::new(), Some(reason))),
                    },
                    Err(reason) => return Ok((Vec::new(), Some(reason))),
                };
                let budget = sampling.max_tokens;
                let mut sessions: FuturesUnordered<_> = (0..n)
                    .map(|session| tool_agent.run_session(&self.engine, &prompt, &tools, &sampling, budget, session))
                    .collect();
                while let Some(result) = sessions.next().await {
                    match result {
                        Ok(session) => out.publish(&prompt, session).await?,
                        Err(agent::AgentError::Engine(EngineError::Stopped)) => {
                            return Err(TaskError::Retry("engine stopped".into()))
                        }
                        Err(err) => out.fail(err.to_string()),
                    }
                }
            }
        }
        out.finish().await
    }

    async fn heartbeat(&self, state: &str) -> Result<(), BusError> {
        let load = self.engine.load();
        let beat = Heartbeat {
            service: "rollout".into(),
            instance_id: self.instance.clone(),
            policy_version: self.engine.version(),
            unix_ms: jetrl_wire::now_unix_ms(),
            state: state.into(),
            inflight: self.inflight.load(Ordering::SeqCst) as u32,
            tokens_per_s: load.tokens_per_s,
            host: default_instance_id(),
            running_sequences: load.running as u32,
            waiting_sequences: load.waiting as u32,
            kv_cache_usage: load.kv_usage,
        };
        let bucket = self.bus.names().workers_bucket();
        let kv = self.bus.key_value(bucket).await?;
        let key = format!("rollout.{}", self.instance);
        kv.put(&key, beat.encode_to_vec().into()).await.map_err(|e| BusError::Kv {
            bucket: bucket.into(),
            key,
            message: e.to_string(),
        })?;
        Ok(())
    }

    /// Loads one announced version into the engine.
    async fn load_version(&self, manifest: &WeightManifest) -> Result<(), String> {
        let started = Instant::now();
        let blob = self.bus.load_weights(&manifest.location).await.map_err(|e| e.to_string())?;
        weights::verify(manifest, &blob).map_err(|e| e.to_string())?;
        self.engine.swap(blob, manifest.version).await.map_err(|e| e.to_string())?;
        metrics::gauge!("jetrl_rollout_policy_version").set(manifest.version as f64);
        tracing::info!(version = manifest.version, elapsed_ms = started.elapsed().as_millis() as u64, "weights loaded");
        Ok(())
    }
}

fn messages_of(task: &PromptTask) -> Vec<serde_json::Value> {
    task.messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect()
}

/// Publishes one group's trajectories as its sessions finish (pipelined, de-duplicated by key) and collects
/// the keys for the terminal status.
struct GroupPublisher<'a> {
    worker: &'a Worker,
    task: &'a PromptTask,
    agent: AgentKind,
    received: Instant,
    publisher: Publisher,
    /// the group's score request, published once every trajectory is stored
    scoring: ScoreRequestBuilder,
    keys: Vec<String>,
    failure: Option<String>,
}

impl<'a> GroupPublisher<'a> {
    fn new(worker: &'a Worker, task: &'a PromptTask, agent: AgentKind, received: Instant) -> Self {
        GroupPublisher {
            worker,
            task,
            agent,
            received,
            publisher: Publisher::new(&worker.bus, 256),
            scoring: ScoreRequestBuilder::new(&task.partition, &task.uid),
            keys: Vec::new(),
            failure: None,
        }
    }

    /// A session that could not be generated: the group ends `failure`, with the sessions that succeeded.
    fn fail(&mut self, reason: String) {
        metrics::counter!("jetrl_rollout_failed_sessions_total").increment(1);
        self.failure.get_or_insert(reason);
    }

    async fn publish(&mut self, prompt: &[u32], out: SessionOutput) -> Result<(), TaskError> {
        let task = self.task;
        let key = TrajectoryKey::new(task.uid.clone(), out.session as u32, 0).to_string();
        let current = self.worker.engine.version();
        let lag = current.saturating_sub(out.min_version);
        let lag = if lag >= 3 { "3+".to_string() } else { lag.to_string() };
        metrics::counter!("jetrl_rollout_trajectories_total", "version_lag" => lag, "agent" => self.agent.name())
            .increment(1);
        if out.min_version != out.max_version {
            metrics::counter!("jetrl_rollout_mixed_version_trajectories_total").increment(1);
        }
        metrics::histogram!("jetrl_rollout_response_tokens").record(out.response_ids.len() as f64);
        let finish = if out.aborted {
            v1::FinishReason::Aborted
        } else if out.truncated {
            v1::FinishReason::Length
        } else {
            v1::FinishReason::Stop
        };
        let traj = Trajectory {
            key: key.clone(),
            uid: task.uid.clone(),
            session_id: out.session as u32,
            index: 0,
            partition: task.partition.clone(),
            submit_step: task.submit_step,
            prompt_ids: packed::pack_u32(prompt),
            response_ids: packed::pack_u32(&out.response_ids),
            response_mask: packed::pack_u8(&out.response_mask),
            logprobs: packed::pack_f32(&out.logprobs),
            min_version: out.min_version,
            max_version: out.max_version,
            finish_reason: finish as i32,
            timings: Some(v1::Timings {
                time_to_first_token_s: out.time_to_first_token.map_or(0.0, |d| d.as_secs_f64()),
                generate_s: self.received.elapsed().as_secs_f64(),
                completed_unix_ms: jetrl_wire::now_unix_ms(),
            }),
            response_text: self.worker.tokenizer.decode(&out.response_ids, true).unwrap_or_default(),
            data_source: task.data_source.clone(),
            ground_truth: task.ground_truth.clone(),
            extra_info_json: task.extra_info_json.clone(),
            worker_id: self.worker.instance.clone(),
            num_turns: out.num_turns,
            tool_rewards: out.tool_rewards,
            agent_name: self.agent.name().into(),
            stop_reason: out.stop_reason,
            raw_prompt: task.messages.clone(),
            ..Default::default()
        };
        let subject = self.worker.bus.names().traj_subject(&task.partition, &task.uid);
        self.publisher
            .publish(Outgoing::protobuf(subject, Some(key.clone()), &traj))
            .await
            .map_err(|e| TaskError::Retry(e.to_string()))?;
        self.scoring.add(&traj);
        self.keys.push(key);
        Ok(())
    }

    /// Waits until every trajectory is stored, then publishes the group's score request (the reward service's
    /// input) and waits until it is stored too; returns the keys (in session order) and the failure, if any.
    async fn finish(mut self) -> Result<(Vec<String>, Option<String>), TaskError> {
        let acks = self.publisher.drain().await.map_err(|e| TaskError::Retry(e.to_string()))?;
        self.scoring.publish(&self.worker.bus, &acks).await.map_err(|e| TaskError::Retry(e.to_string()))?;
        self.keys.sort();
        Ok((self.keys, self.failure))
    }
}

/// Why a task was not completed.
enum TaskError {
    /// nothing to do (duplicate delivery, group gone): acknowledge
    Skip(String),
    /// transient (broker or engine trouble): nak for redelivery
    Retry(String),
}

/// Runs `work` while sending in-progress acks every ack_wait/3, so a long group is not redelivered.
async fn with_progress<T>(
    work: impl std::future::Future<Output = T>,
    msg: &jetstream::Message,
    ack_wait: Duration,
) -> T {
    tokio::pin!(work);
    let mut ticker = tokio::time::interval(ack_wait / 3);
    ticker.tick().await;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => consume::settle(msg, AckKind::Progress).await,
        }
    }
}

/// Follows the `latest` manifest in the WEIGHTS bucket; loads each newer version.
async fn follow_weights(worker: Arc<Worker>, shutdown: Shutdown) {
    loop {
        let watch = async {
            let bucket = worker.bus.names().weights_bucket();
            let kv = worker.bus.key_value(bucket).await?;
            kv.watch_with_history("latest").await.map_err(|e| BusError::Kv {
                bucket: bucket.into(),
                key: "latest".into(),
                message: e.to_string(),
            })
        };
        let mut entries = match watch.await {
            Ok(w) => w,
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch weights; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            let entry = tokio::select! {
                _ = shutdown.wait() => return,
                e = entries.next() => e,
            };
            let Some(Ok(entry)) = entry else { break };
            let manifest = match WeightManifest::decode(entry.value.as_ref()) {
                Ok(m) => m,
                Err(err) => {
                    consume::count_malformed(SERVICE, worker.bus.names().weights_bucket());
                    tracing::error!(error = %err, "malformed weight manifest ignored");
                    continue;
                }
            };
            if manifest.version == worker.engine.version() && manifest.version != 0 {
                continue;
            }
            let mut attempt = 0;
            loop {
                match worker.load_version(&manifest).await {
                    Ok(()) => {
                        let _ = worker.heartbeat("ready").await;
                        break;
                    }
                    Err(err) => {
                        attempt += 1;
                        metrics::counter!("jetrl_rollout_weight_load_failures_total").increment(1);
                        tracing::error!(version = manifest.version, attempt, error = %err, "weight load failed");
                        if attempt >= 5 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }
    }
}

async fn heartbeats(worker: Arc<Worker>, interval_s: f64, shutdown: Shutdown) {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(interval_s.max(0.1)));
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = ticker.tick() => {
                if let Err(err) = worker.heartbeat("ready").await {
                    tracing::warn!(error = %err, "heartbeat failed");
                }
            }
        }
    }
}

/// Describes the service's metrics once, so `/metrics` documents them.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!("jetrl_rollout_generation_tokens_per_second", "tokens sampled per second (1 s windows)");
    describe_counter!("jetrl_rollout_generated_tokens_total", Unit::Count, "tokens sampled");
    describe_counter!("jetrl_rollout_prefill_tokens_total", Unit::Count, "context tokens prefilled");
    describe_gauge!("jetrl_rollout_queue_depth_sequences", "sequences submitted and waiting for a KV slot");
    describe_gauge!("jetrl_rollout_running_sequences", "sequences in KV slots");
    describe_gauge!("jetrl_rollout_batch_occupancy_ratio", "running sequences / engine slots");
    describe_gauge!("jetrl_rollout_kv_cache_usage_ratio", "KV positions holding tokens / KV capacity");
    describe_gauge!("jetrl_rollout_engine_slots", "sequences the engine runs at once");
    describe_gauge!("jetrl_rollout_kv_cache_bytes", Unit::Bytes, "preallocated KV cache");
    describe_histogram!("jetrl_rollout_time_to_first_token_seconds", Unit::Seconds, "submit to first sampled token");
    describe_histogram!("jetrl_rollout_step_seconds", Unit::Seconds, "one engine step (admission + decode + sample)");
    describe_histogram!("jetrl_rollout_weight_swap_seconds", Unit::Seconds, "copying a weight version in");
    describe_counter!(
        "jetrl_rollout_trajectories_total",
        Unit::Count,
        "trajectories published, by agent loop and by how many versions behind the engine their oldest token is"
    );
    describe_counter!("jetrl_rollout_mixed_version_trajectories_total", Unit::Count, "trajectories spanning versions");
    describe_gauge!("jetrl_rollout_policy_version", "weight version loaded");
    describe_counter!("jetrl_rollout_tool_calls_total", Unit::Count, "tool calls by outcome (ok, error, timeout)");
    describe_histogram!("jetrl_rollout_tool_call_seconds", Unit::Seconds, "one tool call");
    describe_histogram!("jetrl_rollout_response_tokens", Unit::Count, "response length of a trajectory");
}

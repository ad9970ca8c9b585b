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
//! under ([`weights`]). A worker that cannot load a version says so in its heartbeat and takes no new groups
//! until it can; a task that needs a newer version than the engine holds (sync mode) waits for it, bounded, or
//! goes back for another worker. Heartbeats in the WORKERS bucket report the state, the loaded version and the
//! engine's load. In colocate_async the worker that shares the trainer's device also serves the pause / resume
//! handshake ([`control`]).
//!
//! - [`group`]: one prompt group from task to acknowledgement.

pub mod agent;
mod control;
pub mod engine;
mod group;
pub mod tools;
mod vllm_backend;
mod weights;

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jetrl_bus::service::{self, Topology};
use jetrl_bus::{consume, Bus, BusError, GroupStore};
use jetrl_config::{JobConfig, RolloutName, TrainerMode};
use jetrl_model::engine::Detokenizer;
use jetrl_model::{EngineConfig, LogprobsMode, ModelConfig, Tokenizer};
use jetrl_telemetry::Shutdown;
use jetrl_wire::subjects;
use jetrl_wire::v1::WorkerState;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::agent::{AgentKind, ToolAgent, ToolTurnEncoder};
use crate::engine::{EngineError, EngineHandle, EngineSettings};
use crate::tools::ToolRegistry;

pub use vllm_backend::preflight as vllm_preflight;

pub(crate) const SERVICE: &str = jetrl_wire::ServiceKind::Rollout.as_str();

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
    /// the engine can serve nothing more (its vLLM server died): the worker stops so that its supervisor starts
    /// both again, and what it held is redelivered
    #[error("the rollout engine failed: {0}")]
    EngineFailed(String),
    #[error("tokenizer of {path}: {source}")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: jetrl_model::TokenizerError,
    },
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
    if r.multi_turn.max_parallel_calls == 0 {
        return Err(config("rollout.multi_turn.max_parallel_calls", "must be >= 1".into()));
    }
    if r.max_num_seqs == 0 {
        return Err(config("rollout.max_num_seqs", "must be >= 1".into()));
    }
    if r.max_model_len.is_some_and(|l| l < 2) {
        return Err(config("rollout.max_model_len", "must be >= 2".into()));
    }
    let tools = ToolRegistry::from_config(&r.multi_turn);
    Ok(Settings { default_agent: r.agent.default_agent_loop, logprobs_mode: r.logprobs_mode, tools })
}

/// The engine's budget from the config: `max_model_len` positions per sequence, `kv_cache_tokens` in all (by
/// default `max_num_seqs` rows, capped by `kv_cache_memory_gb` for this model's per-token KV size).
fn engine_config(cfg: &JobConfig, model: &ModelConfig, seed: u64, eos: Vec<u32>, mode: LogprobsMode) -> EngineConfig {
    let r = &cfg.rollout;
    let max_model_len =
        r.max_model_len.map(|l| l as usize).unwrap_or((cfg.data.max_prompt_length + cfg.max_new_tokens()) as usize);
    let elem = cfg.model.dtype.bytes() as i64;
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
        enforce_eager: r.enforce_eager,
        return_routed_experts: r.enable_rollout_routing_replay,
        ..EngineConfig::default()
    }
}

/// What a worker shares between its tasks.
pub(crate) struct Worker {
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
    /// what the heartbeat says (ready, paused, load_failed, ...)
    status: weights::Status,
    /// how long a task waits for the weight version it needs (`rollout.heartbeat_timeout_s`)
    version_wait: Duration,
    /// colocate_async: whether a pause releases the engine's memory (`rollout.free_cache_engine`)
    free_cache_engine: bool,
    /// the model's (sparse layers, experts per token): how the trajectories' routed experts are laid out (R3)
    routes_layout: (u32, u32),
}

/// Runs one rollout worker until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RolloutError> {
    let settings = settings(&cfg)?;
    let shutdown = Shutdown::new(shutdown);
    let instance = cfg.rollout.instance_id.clone().unwrap_or_else(default_instance_id);
    // the worker's heartbeat carries its engine's state: it beats by itself (`heartbeats`)
    let bus = service::connect(&cfg, &format!("jetrl-rollout-worker-{instance}"), Topology::Expect).await?;
    jetrl_telemetry::serve_metrics(&cfg.rollout.metrics_addr, shutdown.waiter()).await?;
    describe_metrics();

    let model_dir = PathBuf::from(&cfg.model.path);
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&model_dir)
            .map_err(|source| RolloutError::Tokenizer { path: model_dir.clone(), source })?,
    );
    let model_config = ModelConfig::from_file(&model_dir.join("config.json"))
        .map_err(|e| RolloutError::Engine(EngineError::load(&model_dir, e)))?;
    let seed = cfg.rollout.seed.unwrap_or_else(|| {
        cfg.run.seed.wrapping_add(instance.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))))
    });
    let engine_cfg =
        engine_config(&cfg, &model_config, seed, tokenizer.eos_token_ids().to_vec(), settings.logprobs_mode);
    let detokenizer: Detokenizer = {
        let tokenizer = tokenizer.clone();
        Arc::new(move |ids: &[u32]| tokenizer.decode(ids, true).ok())
    };
    let engine = match cfg.rollout.name {
        RolloutName::Jetrl => {
            let engine_settings = EngineSettings {
                model_dir: model_dir.clone(),
                device: cfg.model.device,
                dtype: cfg.model.dtype,
                config: engine_cfg,
                detokenizer: Some(detokenizer),
                lora: jetrl_model::lora::spec_of(&cfg.model),
            };
            // Loading a model takes a while: off the reactor.
            tokio::task::spawn_blocking(move || EngineHandle::start(engine_settings))
                .await
                .map_err(|e| EngineError::Thread(Arc::new(e)))??
        }
        RolloutName::Vllm => {
            let mut settings = vllm_backend::settings(&cfg, &instance, &engine_cfg)?;
            if cfg.rollout.enable_rollout_routing_replay {
                let moe = model_config.moe.as_ref().ok_or_else(|| RolloutError::Config {
                    key: "rollout.enable_rollout_routing_replay",
                    message: format!("{} is not a mixture of experts: it routes nothing", model_dir.display()),
                })?;
                settings.routes_per_token = moe.sparse_layer_count() as usize * moe.top_k as usize;
            }
            EngineHandle::start_vllm(settings).await?
        }
        RolloutName::Sglang => {
            return Err(RolloutError::Config { key: "rollout.name", message: "no SGLang backend is built".into() })
        }
    };
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
        status: weights::Status::default(),
        version_wait: Duration::from_secs_f64(cfg.rollout.heartbeat_timeout_s.max(1.0)),
        free_cache_engine: cfg.rollout.free_cache_engine,
        routes_layout: model_config
            .moe
            .as_ref()
            .map_or((0, 0), |moe| (moe.sparse_layer_count() as u32, moe.top_k as u32)),
    });
    worker.status.set(WorkerState::Starting, "loading the announced weights");

    // Load the newest announced weights, and every version after it.
    let weights_task = tokio::spawn(weights::follow_weights(worker.clone(), shutdown.clone()));
    let heartbeat_task = tokio::spawn(heartbeats(worker.clone(), cfg.rollout.heartbeat_interval_s, shutdown.clone()));
    let colocated = cfg.trainer.mode == TrainerMode::ColocateAsync
        && cfg.trainer.colocate_async.rollout_instance.as_deref() == Some(instance.as_str());
    let control_task = colocated.then(|| {
        let timeout = Duration::from_secs_f64(cfg.trainer.colocate_async.handshake_timeout_s);
        tokio::spawn(control::serve(worker.clone(), timeout, shutdown.clone()))
    });
    // Take work once the starting weights are in (or none are announced yet), within the liveness window.
    wait_for_first_weights(&worker, &shutdown).await;

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
    // Each pulled group reserves the slots a typical group needs (rollout.n, and remax's greedy baseline); a task
    // asks for more, or gives back the surplus, once it knows its own n.
    let baseline = usize::from(cfg.algorithm.adv_estimator == jetrl_config::AdvantageEstimator::Remax);
    let per_group = (cfg.rollout.n.max(1) as usize + baseline).min(engine.slots());
    let mut tasks: JoinSet<()> = JoinSet::new();
    // The pull loop stops at SIGTERM, or when the engine can serve nothing more (its vLLM server died).
    let engine_failure: Arc<std::sync::OnceLock<String>> = Arc::default();
    let shutdown = {
        let (engine, external, failure) = (engine.clone(), shutdown.clone(), engine_failure.clone());
        Shutdown::new(async move {
            tokio::select! {
                reason = engine.failed() => {
                    let _ = failure.set(reason);
                }
                _ = external.wait() => {}
            }
        })
    };
    while !shutdown.is_triggered() {
        while tasks.try_join_next().is_some() {}
        if worker.status.load_failed() {
            // no new groups on weights that are not the ones announced: wait for the watcher to load them
            let changed = worker.status.changed();
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            continue;
        }
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
                    // a pull refused while its consumer's leader is elected ("503, no responders") is asked again
                    // after a pause, not at once: without it one election cost 12,613 pulls in a second
                    tracing::debug!(error = %err, "pull batch ended");
                    tokio::select! {
                        _ = shutdown.wait() => {}
                        _ = tokio::time::sleep(PULL_ERROR_PAUSE) => {}
                    }
                    break;
                }
                None => break,
            }
        }
        // Slots reserved for messages that did not come are released here.
        drop(reserved);
    }
    // Stop pulling; give in-flight groups a chance to finish, then nak what is left. With the broker gone a
    // finished group could not be written anyway: nak at once (the naks reach the broker if it comes back;
    // otherwise the tasks are redelivered after their ack wait).
    let drain = cfg.rollout.drain();
    tracing::info!(inflight = tasks.len(), drain_s = drain.as_secs_f64(), "draining in-flight groups");
    let drained = tokio::select! {
        drained = tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }) => drained.is_ok(),
        _ = bus.unreachable_for(jetrl_bus::SETTLE_RECONNECT) => {
            tracing::warn!(inflight = tasks.len(), "NATS unreachable: in-flight groups are not drained");
            false
        }
    };
    if !drained {
        let _ = hard_tx.send(());
        // a task that finished before the hard stop still waits for its ack's confirmation, which a lost broker
        // never sends: it is left (its task is redelivered after the ack wait and its trajectories de-duplicated)
        let settled =
            tokio::time::timeout(jetrl_bus::SETTLE_RECONNECT, async { while tasks.join_next().await.is_some() {} })
                .await;
        if settled.is_err() {
            tracing::warn!(left = tasks.len(), "NATS unreachable: acks of finished groups not confirmed; left");
            tasks.abort_all();
        }
    }
    weights_task.abort();
    heartbeat_task.abort();
    if let Some(task) = control_task {
        task.abort();
    }
    worker.status.set(WorkerState::Stopped, "");
    if bus.wait_connected(Duration::ZERO).await {
        let _ = worker.heartbeat().await;
    }
    if let Some(reason) = engine_failure.get() {
        tracing::error!(%reason, "rollout worker stopped: its engine failed");
        return Err(RolloutError::EngineFailed(reason.clone()));
    }
    tracing::info!("rollout worker stopped");
    Ok(())
}

fn default_instance_id() -> String {
    format!("{}-{}", jetrl_telemetry::host_name(), std::process::id())
}

/// Waits until the engine holds the announced version, for at most the liveness window (a worker started before
/// any trainer finds nothing announced and starts when the window passes); a failed load ends the wait too (it
/// keeps the worker from taking groups).
async fn wait_for_first_weights(worker: &Worker, shutdown: &Shutdown) {
    let deadline = tokio::time::Instant::now() + worker.version_wait;
    loop {
        let changed = worker.status.changed();
        let loaded = worker.status.announced().is_some_and(|v| worker.engine.version() == v);
        if loaded || worker.status.load_failed() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    if !worker.status.load_failed() {
        worker.status.set(WorkerState::Ready, "");
    }
}

async fn heartbeats(worker: Arc<Worker>, interval_s: f64, shutdown: Shutdown) {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(interval_s.max(0.1)));
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = ticker.tick() => {
                if let Err(err) = worker.heartbeat().await {
                    tracing::warn!(error = %err, "heartbeat failed");
                }
            }
        }
    }
}

/// How long the pull loop waits after a pull that ended with an error (a consumer leader being elected).
const PULL_ERROR_PAUSE: Duration = Duration::from_millis(100);
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

impl jetrl_telemetry::ServiceError for RolloutError {}

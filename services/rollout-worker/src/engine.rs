//! The engine thread. libtorch stays off the async reactor: [`jetrl_model::Engine`] lives on one dedicated thread
//! fed by a bounded channel, and steps while it holds work. Between two decode steps the thread takes new
//! requests (they join the running batch), weight swaps (running sequences continue under the new version) and
//! aborts; a request whose receiver was dropped (its task was cancelled) is aborted so its rows free up at once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_model::engine::Detokenizer;
use jetrl_model::{CausalLm, DType, Engine, EngineConfig, Request, RequestId, SequenceOutput};
use tokio::sync::{mpsc, oneshot};

/// Why the engine could not serve a request.
#[derive(Debug, thiserror::Error, Clone)]
pub enum EngineError {
    #[error("loading the model: {0}")]
    Load(String),
    #[error("request refused: {0}")]
    Request(String),
    #[error("decode step failed: {0}")]
    Step(String),
    #[error("weight swap to version {version}: {message}")]
    Swap { version: u64, message: String },
    #[error("the engine thread has stopped")]
    Stopped,
}

impl EngineError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Load(_) => "load",
            EngineError::Request(_) => "request",
            EngineError::Step(_) => "step",
            EngineError::Swap { .. } => "swap",
            EngineError::Stopped => "stopped",
        }
    }
}

/// Where the model comes from and the engine's budget.
pub struct EngineSettings {
    pub model_dir: PathBuf,
    pub device: String,
    pub dtype: String,
    pub config: EngineConfig,
    /// For stop strings.
    pub detokenizer: Option<Detokenizer>,
}

/// The engine's load, published by the engine thread after every step (for heartbeats and admission).
#[derive(Debug, Default)]
struct Load {
    version: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    /// KV positions in use, in millionths of the capacity
    kv_usage_ppm: AtomicU64,
    /// generated tokens per second over the last window, as f64 bits
    tokens_per_s: AtomicU64,
}

/// A snapshot of [`Load`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSnapshot {
    pub version: u64,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    pub tokens_per_s: f64,
}

type Results = mpsc::Sender<Result<SequenceOutput, EngineError>>;

enum Command {
    Submit { id: RequestId, request: Request, results: Results },
    Abort { id: RequestId, reply: oneshot::Sender<Vec<SequenceOutput>> },
    Swap { bytes: bytes::Bytes, version: u64, reply: oneshot::Sender<Result<(), EngineError>> },
}

/// Cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Command>,
    next_id: Arc<AtomicU64>,
    load: Arc<Load>,
    slots: usize,
    max_model_len: usize,
}

/// The outputs of one submitted request, one per sample as each finishes. Dropping it before all arrived aborts
/// the request's remaining sequences.
pub struct Generation {
    id: RequestId,
    rx: mpsc::Receiver<Result<SequenceOutput, EngineError>>,
    remaining: usize,
    handle: EngineHandle,
}

impl Generation {
    /// The next finished sample; `None` once all have arrived.
    pub async fn next(&mut self) -> Option<Result<SequenceOutput, EngineError>> {
        if self.remaining == 0 {
            return None;
        }
        let item = match self.rx.recv().await {
            Some(item) => item,
            None => Err(EngineError::Stopped),
        };
        self.remaining = match &item {
            Ok(_) => self.remaining - 1,
            Err(_) => 0,
        };
        Some(item)
    }

    /// Stops the request and returns its unfinished samples with what they generated so far
    /// ([`jetrl_model::Finish::Aborted`]): a prefix to resume from.
    pub async fn abort(mut self) -> Vec<SequenceOutput> {
        self.remaining = 0;
        let (reply, rx) = oneshot::channel();
        if self.handle.send(Command::Abort { id: self.id, reply }).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }
}

impl EngineHandle {
    /// Loads the model on a new thread and allocates the KV cache; returns once it is ready (or failed).
    pub fn start(settings: EngineSettings) -> Result<Self, EngineError> {
        let device = jetrl_model::parse_device(&settings.device).map_err(|e| EngineError::Load(e.to_string()))?;
        let dtype: DType =
            settings.dtype.parse().map_err(|e: jetrl_model::ModelError| EngineError::Load(e.to_string()))?;
        let (tx, rx) = sync_channel::<Command>(1024);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let load = Arc::new(Load::default());
        let thread_load = load.clone();
        std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || {
                let EngineSettings { model_dir, config, detokenizer, .. } = settings;
                let built = CausalLm::load(&model_dir, device, dtype)
                    .and_then(|model| {
                        let bytes = Engine::kv_cache_bytes(&model, &config);
                        Engine::new(model, config).map(|e| (e, bytes))
                    })
                    .map_err(|e| EngineError::Load(format!("{}: {e}", model_dir.display())));
                match built {
                    Ok((engine, kv_bytes)) => {
                        let engine = match detokenizer {
                            Some(d) => engine.with_detokenizer(d),
                            None => engine,
                        };
                        let _ = ready_tx.send(Ok((engine.slots(), engine.config().max_model_len, kv_bytes)));
                        engine_loop(engine, rx, thread_load);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| EngineError::Load(e.to_string()))?;
        let (slots, max_model_len, kv_bytes) = ready_rx.recv().map_err(|_| EngineError::Stopped)??;
        metrics::gauge!("jetrl_rollout_engine_slots").set(slots as f64);
        metrics::gauge!("jetrl_rollout_kv_cache_bytes").set(kv_bytes as f64);
        tracing::info!(slots, max_model_len, kv_cache_mib = kv_bytes >> 20, "rollout engine ready");
        Ok(Self { tx, next_id: Arc::new(AtomicU64::new(1)), load, slots, max_model_len })
    }

    /// Submits a request; its samples arrive through the returned [`Generation`] as they finish.
    pub async fn submit(&self, request: Request) -> Result<Generation, EngineError> {
        let n = request.n;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // n results at most plus one error: sends from the engine thread never block.
        let (results, rx) = mpsc::channel(n + 1);
        self.send(Command::Submit { id, request, results }).await?;
        Ok(Generation { id, rx, remaining: n, handle: self.clone() })
    }

    /// One sequence (`request.n` must be 1).
    pub async fn generate_one(&self, request: Request) -> Result<SequenceOutput, EngineError> {
        let mut generation = self.submit(request).await?;
        generation.next().await.unwrap_or(Err(EngineError::Stopped))
    }

    /// Loads a weight blob between two decode steps; running sequences continue under it.
    pub async fn swap(&self, bytes: bytes::Bytes, version: u64) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Swap { bytes, version, reply }).await?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// The weight version new tokens are sampled under.
    pub fn version(&self) -> u64 {
        self.load.version.load(Ordering::SeqCst)
    }

    /// Sequences the engine runs at once.
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn load(&self) -> LoadSnapshot {
        LoadSnapshot {
            version: self.load.version.load(Ordering::SeqCst),
            running: self.load.running.load(Ordering::Relaxed),
            waiting: self.load.waiting.load(Ordering::Relaxed),
            kv_usage: self.load.kv_usage_ppm.load(Ordering::Relaxed) as f64 / 1e6,
            tokens_per_s: f64::from_bits(self.load.tokens_per_s.load(Ordering::Relaxed)),
        }
    }

    async fn send(&self, mut command: Command) -> Result<(), EngineError> {
        // Bounded channel: wait (without blocking the reactor) while the engine thread is behind.
        loop {
            match self.tx.try_send(command) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(c)) => {
                    command = c;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(TrySendError::Disconnected(_)) => return Err(EngineError::Stopped),
            }
        }
    }
}

/// A request the thread is serving: where its outputs go and how many are still due.
struct Serving {
    results: Results,
    remaining: usize,
}

/// Tokens/s over windows of about a second.
struct Throughput {
    since: Instant,
    tokens: u64,
    prefill: u64,
}

fn engine_loop(mut engine: Engine, rx: Receiver<Command>, load: Arc<Load>) {
    let mut serving: HashMap<RequestId, Serving> = HashMap::new();
    let stats = engine.stats();
    let mut window =
        Throughput { since: Instant::now(), tokens: stats.generated_tokens, prefill: stats.prefill_tokens };
    load.version.store(engine.version(), Ordering::SeqCst);
    loop {
        // Block for work only when idle; otherwise take what is queued and step.
        if !engine.has_work() {
            publish_load(&engine, &load, &mut window);
            match rx.recv() {
                Ok(command) => handle(&mut engine, &mut serving, &load, command),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(command) => handle(&mut engine, &mut serving, &load, command),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    if !engine.has_work() {
                        return;
                    }
                    break;
                }
            }
        }
        // Cancelled tasks dropped their receivers: free their rows now.
        let gone: Vec<RequestId> = serving.iter().filter(|(_, s)| s.results.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            serving.remove(&id);
            if let Err(err) = engine.abort(id) {
                tracing::warn!(request = id, error = %err, "aborting a cancelled request failed");
            }
            metrics::counter!("jetrl_rollout_cancelled_requests_total").increment(1);
        }
        if !engine.has_work() {
            continue;
        }
        let started = Instant::now();
        match engine.step() {
            Ok(outputs) => {
                metrics::histogram!("jetrl_rollout_step_seconds").record(started.elapsed().as_secs_f64());
                for output in outputs {
                    deliver(&mut serving, output);
                }
            }
            Err(err) => {
                // A failed step leaves the batch in an unknown state: fail everything held and start clean.
                tracing::error!(error = %err, "decode step failed; failing every request held");
                metrics::counter!("jetrl_rollout_engine_errors_total", "stage" => "step").increment(1);
                let _ = engine.abort_all();
                for (_, s) in serving.drain() {
                    let _ = s.results.try_send(Err(EngineError::Step(err.to_string())));
                }
            }
        }
        publish_load(&engine, &load, &mut window);
    }
}

fn handle(engine: &mut Engine, serving: &mut HashMap<RequestId, Serving>, load: &Load, command: Command) {
    match command {
        Command::Submit { id, request, results } => {
            let n = request.n;
            match engine.add_request(id, request) {
                Ok(()) => {
                    serving.insert(id, Serving { results, remaining: n });
                }
                Err(err) => {
                    metrics::counter!("jetrl_rollout_engine_errors_total", "stage" => "request").increment(1);
                    let _ = results.try_send(Err(EngineError::Request(err.to_string())));
                }
            }
        }
        Command::Abort { id, reply } => {
            serving.remove(&id);
            let _ = reply.send(engine.abort(id).unwrap_or_default());
        }
        Command::Swap { bytes, version, reply } => {
            let started = Instant::now();
            let result =
                engine.load_weights(&bytes, version).map_err(|e| EngineError::Swap { version, message: e.to_string() });
            if result.is_ok() {
                load.version.store(version, Ordering::SeqCst);
                metrics::histogram!("jetrl_rollout_weight_swap_seconds").record(started.elapsed().as_secs_f64());
                tracing::info!(version, running = engine.stats().running, "weights swapped between decode steps");
            }
            let _ = reply.send(result);
        }
    }
}

fn deliver(serving: &mut HashMap<RequestId, Serving>, output: SequenceOutput) {
    let id = output.request;
    if let Some(ttft) = output.time_to_first_token {
        metrics::histogram!("jetrl_rollout_time_to_first_token_seconds").record(ttft.as_secs_f64());
    }
    let Some(entry) = serving.get_mut(&id) else { return };
    let _ = entry.results.try_send(Ok(output));
    entry.remaining = entry.remaining.saturating_sub(1);
    if entry.remaining == 0 {
        serving.remove(&id);
    }
}

fn publish_load(engine: &Engine, load: &Load, window: &mut Throughput) {
    let stats = engine.stats();
    load.running.store(stats.running as u64, Ordering::Relaxed);
    load.waiting.store(stats.waiting as u64, Ordering::Relaxed);
    let usage = stats.kv_tokens_used as f64 / stats.kv_tokens_capacity.max(1) as f64;
    load.kv_usage_ppm.store((usage * 1e6) as u64, Ordering::Relaxed);
    metrics::gauge!("jetrl_rollout_running_sequences").set(stats.running as f64);
    metrics::gauge!("jetrl_rollout_queue_depth_sequences").set(stats.waiting as f64);
    metrics::gauge!("jetrl_rollout_batch_occupancy_ratio").set(stats.running as f64 / stats.slots.max(1) as f64);
    metrics::gauge!("jetrl_rollout_kv_cache_usage_ratio").set(usage);
    let elapsed = window.since.elapsed();
    if elapsed >= Duration::from_secs(1) || (stats.running == 0 && stats.waiting == 0) {
        let tokens = stats.generated_tokens.saturating_sub(window.tokens);
        metrics::counter!("jetrl_rollout_generated_tokens_total").increment(tokens);
        metrics::counter!("jetrl_rollout_prefill_tokens_total")
            .increment(stats.prefill_tokens.saturating_sub(window.prefill));
        let rate = if elapsed.as_secs_f64() > 0.0 { tokens as f64 / elapsed.as_secs_f64() } else { 0.0 };
        metrics::gauge!("jetrl_rollout_generation_tokens_per_second").set(rate);
        load.tokens_per_s.store(rate.to_bits(), Ordering::Relaxed);
        *window = Throughput { since: Instant::now(), tokens: stats.generated_tokens, prefill: stats.prefill_tokens };
    }
}

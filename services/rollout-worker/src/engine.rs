//! The engine thread. libtorch stays off the async reactor: [`jetrl_model::Engine`] lives on one dedicated thread
//! fed by a bounded channel, and steps while it holds work. Between two decode steps the thread takes new
//! requests (they join the running batch), weight swaps (running sequences continue under the new version),
//! aborts, and pause / resume; a request whose receiver was dropped (its task was cancelled) is aborted so its
//! rows free up at once.
//!
//! Pause and resume are the co-located worker's half of colocate_async: [`EngineHandle::pause`] aborts every
//! sequence keeping what it generated (the *prefix*), optionally frees the KV cache so the trainer can use the
//! memory, and holds new requests; [`EngineHandle::resume`] loads the new weights and resubmits each parked
//! sequence from its prefix (with its own random stream, so a seeded sequence draws what it would have drawn
//! uninterrupted). The callers awaiting a [`Generation`] see nothing of it but the version span of their outputs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_model::engine::Detokenizer;
use jetrl_model::{
    CausalLm, DType, Engine, EngineConfig, ModelError, Prefix, Request, RequestId, Sampling, SequenceOutput,
};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};

/// Why the engine could not serve a request. The model's error is kept as the source (shared: one failed step
/// fails every request it held, each receiver gets the same cause).
#[derive(Debug, thiserror::Error, Clone)]
pub enum EngineError {
    #[error("loading the model from {path}: {source}")]
    Load {
        path: PathBuf,
        #[source]
        source: Arc<ModelError>,
    },
    #[error("starting the engine thread: {0}")]
    Thread(#[source] Arc<dyn std::error::Error + Send + Sync>),
    #[error("request refused: {0}")]
    Request(#[source] Arc<ModelError>),
    #[error("resuming a sample after a pause: {0}")]
    Resume(#[source] Arc<ModelError>),
    #[error("decode step failed: {0}")]
    Step(#[source] Arc<ModelError>),
    #[error("weight swap to version {version}: {source}")]
    Swap {
        version: u64,
        #[source]
        source: Arc<ModelError>,
    },
    #[error("pause: {0}")]
    Pause(#[source] Arc<ModelError>),
    #[error("the engine thread has stopped")]
    Stopped,
}

impl EngineError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Load { .. } => "load",
            EngineError::Thread(_) => "thread",
            EngineError::Request(_) => "request",
            EngineError::Resume(_) => "resume",
            EngineError::Step(_) => "step",
            EngineError::Swap { .. } => "swap",
            EngineError::Pause(_) => "pause",
            EngineError::Stopped => "stopped",
        }
    }

    /// A model that could not be loaded from `path`.
    pub fn load(path: &std::path::Path, source: ModelError) -> Self {
        EngineError::Load { path: path.to_path_buf(), source: Arc::new(source) }
    }
}

/// Where the model comes from and the engine's budget.
pub struct EngineSettings {
    pub model_dir: PathBuf,
    pub device: jetrl_config::DeviceSpec,
    pub dtype: jetrl_config::ModelDtype,
    pub config: EngineConfig,
    /// For stop strings.
    pub detokenizer: Option<Detokenizer>,
    /// the trainer publishes adapters of this spec (`model.lora_rank`): each is merged into the working weights
    pub lora: Option<jetrl_model::LoraSpec>,
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
    /// microseconds the thread spent with nothing to decode (idle or paused) since it started
    idle_us: AtomicU64,
}

/// A snapshot of [`Load`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSnapshot {
    pub version: u64,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    pub tokens_per_s: f64,
    /// seconds without anything to decode since the engine started
    pub idle_seconds: f64,
}

/// What a pause did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Parked {
    /// sequences aborted and kept to be resumed
    pub sequences: usize,
    /// tokens their prefixes hold
    pub tokens: u64,
}

type Results = mpsc::Sender<Result<SequenceOutput, EngineError>>;

enum Command {
    Submit { id: RequestId, request: Request, results: Results },
    Abort { id: RequestId, reply: oneshot::Sender<Vec<SequenceOutput>> },
    Swap { bytes: bytes::Bytes, version: u64, reply: oneshot::Sender<Result<(), EngineError>> },
    Pause { free_cache: bool, reply: oneshot::Sender<Result<Parked, EngineError>> },
    Resume { weights: Option<(bytes::Bytes, u64)>, reply: oneshot::Sender<Result<usize, EngineError>> },
}

/// Cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
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
        let device =
            jetrl_model::resolve_device(settings.device).map_err(|e| EngineError::load(&settings.model_dir, e))?;
        let dtype = DType::from(settings.dtype);
        let (tx, rx) = mpsc::channel::<Command>(1024);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let load = Arc::new(Load::default());
        let thread_load = load.clone();
        std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || {
                let EngineSettings { model_dir, config, detokenizer, lora, .. } = settings;
                let built = CausalLm::load(&model_dir, device, dtype)
                    .and_then(|model| {
                        let bytes = Engine::kv_cache_bytes(&model, &config);
                        let mut engine = Engine::new(model, config)?;
                        if let Some(spec) = &lora {
                            let host_bytes = engine.with_lora(spec)?;
                            tracing::info!(
                                rank = spec.rank,
                                host_base_mib = host_bytes >> 20,
                                "weights arrive as LoRA adapters"
                            );
                        }
                        Ok((engine, bytes))
                    })
                    .map_err(|e| EngineError::load(&model_dir, e));
                match built {
                    Ok((engine, kv_bytes)) => {
                        let engine = match detokenizer {
                            Some(d) => engine.with_detokenizer(d),
                            None => engine,
                        };
                        let _ = ready_tx.send(Ok((engine.slots(), engine.config().max_model_len, kv_bytes)));
                        EngineThread::new(engine, thread_load).run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| EngineError::Thread(Arc::new(e)))?;
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

    /// Aborts every sequence keeping its prefix, frees the KV cache when asked, and holds all requests (new ones
    /// queue) until [`EngineHandle::resume`].
    pub async fn pause(&self, free_cache: bool) -> Result<Parked, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Pause { free_cache, reply }).await?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Loads `weights` (a blob and its version) if given, then continues every parked sequence from its prefix;
    /// returns how many were resumed. Resuming an engine that is not paused is a no-op apart from the load.
    pub async fn resume(&self, weights: Option<(bytes::Bytes, u64)>) -> Result<usize, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Resume { weights, reply }).await?;
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
            idle_seconds: self.load.idle_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }

    /// Bounded channel: waits (without blocking the reactor) while the engine thread is behind.
    async fn send(&self, command: Command) -> Result<(), EngineError> {
        self.tx.send(command).await.map_err(|_| EngineError::Stopped)
    }
}

/// A request the thread is serving: where its outputs go, how many are still due, and what it asked for (to
/// resubmit its unfinished samples from their prefixes after a pause).
struct Serving {
    results: Results,
    remaining: usize,
    prompt: Vec<u32>,
    /// with the seed made explicit, so that a resubmitted sample continues the same random stream
    sampling: Sampling,
}

/// Tokens/s over windows of about a second.
struct Throughput {
    since: Instant,
    tokens: u64,
    prefill: u64,
}

/// The state the engine thread owns besides the engine.
struct EngineThread {
    engine: Engine,
    load: Arc<Load>,
    /// by the id the caller submitted under
    serving: HashMap<RequestId, Serving>,
    /// engine request id → the submitted request it answers (a resubmitted sample runs under its own id)
    routes: HashMap<RequestId, RequestId>,
    /// ids for resubmitted samples, far above the handle's counter
    next_resume_id: RequestId,
    /// set by a pause: the sequences aborted with their prefixes, by submitted request id
    paused: Option<Vec<(RequestId, SequenceOutput)>>,
    window: Throughput,
}

impl EngineThread {
    fn new(engine: Engine, load: Arc<Load>) -> Self {
        let stats = engine.stats();
        load.version.store(engine.version(), Ordering::SeqCst);
        Self {
            engine,
            load,
            serving: HashMap::new(),
            routes: HashMap::new(),
            next_resume_id: 1 << 62,
            paused: None,
            window: Throughput { since: Instant::now(), tokens: stats.generated_tokens, prefill: stats.prefill_tokens },
        }
    }

    fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            // Block for a command only when there is nothing to decode (idle, or paused).
            if !self.can_step() {
                self.publish_load();
                let idle_since = Instant::now();
                let command = rx.blocking_recv();
                self.load.idle_us.fetch_add(idle_since.elapsed().as_micros() as u64, Ordering::Relaxed);
                match command {
                    Some(command) => self.handle(command),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(command) => self.handle(command),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if !self.can_step() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.abort_cancelled();
            if self.can_step() {
                self.step();
            }
        }
    }

    fn can_step(&self) -> bool {
        self.paused.is_none() && self.engine.has_work()
    }

    /// Cancelled tasks dropped their receivers: free their rows (or forget their parked prefixes) now.
    fn abort_cancelled(&mut self) {
        let gone: Vec<RequestId> =
            self.serving.iter().filter(|(_, s)| s.results.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.forget(id);
            metrics::counter!("jetrl_rollout_cancelled_requests_total").increment(1);
        }
    }

    /// Removes a submitted request wherever it is; returns its sequences aborted with their prefixes.
    fn forget(&mut self, id: RequestId) -> Vec<SequenceOutput> {
        self.serving.remove(&id);
        let engine_ids: Vec<RequestId> =
            self.routes.iter().filter(|(_, to)| **to == id).map(|(from, _)| *from).chain([id]).collect();
        let mut out = Vec::new();
        for engine_id in engine_ids {
            self.routes.remove(&engine_id);
            match self.engine.abort(engine_id) {
                Ok(outputs) => out.extend(outputs),
                Err(err) => tracing::warn!(request = id, error = %err, "aborting a request failed"),
            }
        }
        if let Some(parked) = self.paused.as_mut() {
            out.extend(parked.iter().filter(|(owner, _)| *owner == id).map(|(_, o)| o.clone()));
            parked.retain(|(owner, _)| *owner != id);
        }
        out.sort_by_key(|o| o.index);
        out
    }

    fn step(&mut self) {
        let started = Instant::now();
        match self.engine.step() {
            Ok(outputs) => {
                metrics::histogram!("jetrl_rollout_step_seconds").record(started.elapsed().as_secs_f64());
                for output in outputs {
                    self.deliver(output);
                }
            }
            Err(err) => {
                // A failed step leaves the batch in an unknown state: fail everything held and start clean.
                tracing::error!(error = %err, "decode step failed; failing every request held");
                metrics::counter!("jetrl_rollout_engine_errors_total", "stage" => "step").increment(1);
                let _ = self.engine.abort_all();
                self.routes.clear();
                let err = Arc::new(err);
                for (_, s) in self.serving.drain() {
                    let _ = s.results.try_send(Err(EngineError::Step(err.clone())));
                }
            }
        }
        self.publish_load();
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit { id, mut request, results } => {
                let n = request.n;
                request.sampling.seed = Some(self.engine.seed_for(id, &request.sampling));
                let (prompt, sampling) = (request.prompt.clone(), request.sampling.clone());
                match self.engine.add_request(id, request) {
                    Ok(()) => {
                        self.serving.insert(id, Serving { results, remaining: n, prompt, sampling });
                    }
                    Err(err) => {
                        metrics::counter!("jetrl_rollout_engine_errors_total", "stage" => "request").increment(1);
                        let _ = results.try_send(Err(EngineError::Request(Arc::new(err))));
                    }
                }
            }
            Command::Abort { id, reply } => {
                let _ = reply.send(self.forget(id));
            }
            Command::Swap { bytes, version, reply } => {
                let _ = reply.send(self.load_weights(&bytes, version));
            }
            Command::Pause { free_cache, reply } => {
                let _ = reply.send(self.pause(free_cache));
            }
            Command::Resume { weights, reply } => {
                let loaded = match weights {
                    Some((bytes, version)) => self.load_weights(&bytes, version),
                    None => Ok(()),
                };
                // The parked sequences resume even when the load failed: they continue under the old weights,
                // and the caller hears about the failure.
                let resumed = self.resume();
                let _ = reply.send(loaded.map(|()| resumed));
            }
        }
    }

    fn load_weights(&mut self, bytes: &[u8], version: u64) -> Result<(), EngineError> {
        let started = Instant::now();
        self.engine.load_weights(bytes, version).map_err(|e| EngineError::Swap { version, source: Arc::new(e) })?;
        self.load.version.store(version, Ordering::SeqCst);
        metrics::histogram!("jetrl_rollout_weight_swap_seconds").record(started.elapsed().as_secs_f64());
        tracing::info!(version, running = self.engine.stats().running, "weights swapped between decode steps");
        Ok(())
    }

    fn pause(&mut self, free_cache: bool) -> Result<Parked, EngineError> {
        if self.paused.is_none() {
            // Only running sequences hold KV rows: queued samples stay queued and start after the resume.
            let aborted = self.engine.preempt_running().map_err(|e| EngineError::Pause(Arc::new(e)))?;
            let parked: Vec<(RequestId, SequenceOutput)> = aborted
                .into_iter()
                .filter_map(|o| {
                    let owner = self.routes.remove(&o.request).unwrap_or(o.request);
                    self.serving.contains_key(&owner).then_some((owner, o))
                })
                .collect();
            self.paused = Some(parked);
        }
        if free_cache {
            self.engine.free_cache().map_err(|e| EngineError::Pause(Arc::new(e)))?;
        }
        let parked = self.paused.as_deref().unwrap_or_default();
        let report =
            Parked { sequences: parked.len(), tokens: parked.iter().map(|(_, o)| o.tokens.len() as u64).sum() };
        metrics::counter!("jetrl_rollout_pauses_total").increment(1);
        tracing::info!(parked = report.sequences, tokens = report.tokens, free_cache, "engine paused");
        self.publish_load();
        Ok(report)
    }

    /// Resubmits every parked sequence from its prefix under a new engine id routed to its request.
    fn resume(&mut self) -> usize {
        let Some(parked) = self.paused.take() else { return 0 };
        let mut resumed = 0;
        for (owner, output) in parked {
            let Some(serving) = self.serving.get(&owner) else { continue };
            let request = Request {
                prompt: serving.prompt.clone(),
                n: 1,
                sampling: serving.sampling.clone(),
                resume: Some(Prefix {
                    tokens: output.tokens,
                    logprobs: output.logprobs,
                    min_version: output.min_version,
                    max_version: output.max_version,
                    version_runs: output.version_runs,
                }),
                first_sample: output.index,
            };
            let id = self.next_resume_id;
            self.next_resume_id += 1;
            match self.engine.add_request(id, request) {
                Ok(()) => {
                    self.routes.insert(id, owner);
                    resumed += 1;
                }
                Err(err) => {
                    let _ = serving.results.try_send(Err(EngineError::Resume(Arc::new(err))));
                }
            }
        }
        metrics::counter!("jetrl_rollout_resumed_sequences_total").increment(resumed as u64);
        tracing::info!(resumed, version = self.engine.version(), "engine resumed");
        resumed
    }

    fn deliver(&mut self, output: SequenceOutput) {
        let owner = self.routes.remove(&output.request).unwrap_or(output.request);
        if let Some(ttft) = output.time_to_first_token {
            metrics::histogram!("jetrl_rollout_time_to_first_token_seconds").record(ttft.as_secs_f64());
        }
        let Some(entry) = self.serving.get_mut(&owner) else { return };
        let _ = entry.results.try_send(Ok(SequenceOutput { request: owner, ..output }));
        entry.remaining = entry.remaining.saturating_sub(1);
        if entry.remaining == 0 {
            self.serving.remove(&owner);
        }
    }

    fn publish_load(&mut self) {
        let stats = self.engine.stats();
        let load = &self.load;
        load.running.store(stats.running as u64, Ordering::Relaxed);
        load.waiting.store(stats.waiting as u64, Ordering::Relaxed);
        let usage = stats.kv_tokens_used as f64 / stats.kv_tokens_capacity.max(1) as f64;
        load.kv_usage_ppm.store((usage * 1e6) as u64, Ordering::Relaxed);
        metrics::gauge!("jetrl_rollout_running_sequences").set(stats.running as f64);
        metrics::gauge!("jetrl_rollout_queue_depth_sequences").set(stats.waiting as f64);
        metrics::gauge!("jetrl_rollout_batch_occupancy_ratio").set(stats.running as f64 / stats.slots.max(1) as f64);
        metrics::gauge!("jetrl_rollout_kv_cache_usage_ratio").set(usage);
        let elapsed = self.window.since.elapsed();
        if elapsed >= Duration::from_secs(1) || (stats.running == 0 && stats.waiting == 0) {
            let tokens = stats.generated_tokens.saturating_sub(self.window.tokens);
            metrics::counter!("jetrl_rollout_generated_tokens_total").increment(tokens);
            metrics::counter!("jetrl_rollout_prefill_tokens_total")
                .increment(stats.prefill_tokens.saturating_sub(self.window.prefill));
            let rate = if elapsed.as_secs_f64() > 0.0 { tokens as f64 / elapsed.as_secs_f64() } else { 0.0 };
            metrics::gauge!("jetrl_rollout_generation_tokens_per_second").set(rate);
            load.tokens_per_s.store(rate.to_bits(), Ordering::Relaxed);
            self.window =
                Throughput { since: Instant::now(), tokens: stats.generated_tokens, prefill: stats.prefill_tokens };
        }
    }
}

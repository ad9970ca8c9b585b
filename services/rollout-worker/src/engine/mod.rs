//! The rollout engine behind one handle. [`EngineHandle`] is the seam between the worker (group logic, agent
//! loops and tools, version tags, acks) and the engine that generates: the worker sends [`Command`]s (submit,
//! abort, swap weights, pause, resume) over a bounded channel and reads the engine's load, whichever engine
//! serves them:
//!
//! - [`local`]: jetrl's engine on a dedicated thread in this process (`rollout.name: jetrl`);
//! - [`vllm`]: a `vllm serve` the worker starts and supervises, or one it is given (`rollout.name: vllm`), driven
//!   over HTTP by tokens in and out.
//!
//! Pause and resume are the co-located worker's half of colocate_async: [`EngineHandle::pause`] aborts every
//! sequence keeping what it generated (the *prefix*), optionally frees the KV cache so the trainer can use the
//! memory, and holds new requests; [`EngineHandle::resume`] loads the new weights and resubmits each parked
//! sequence from its prefix. The callers awaiting a [`Generation`] see nothing of it but the version span of their
//! outputs.

mod local;
pub mod vllm;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use jetrl_model::engine::Detokenizer;
use jetrl_model::{EngineConfig, ModelError, Request, RequestId, SequenceOutput};
use tokio::sync::{mpsc, oneshot, Notify};

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
    /// the vLLM server: not started, gone, or answering with an error
    #[error("{0}")]
    Vllm(#[source] Arc<vllm::VllmError>),
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
            EngineError::Vllm(e) => e.kind(),
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

/// Set once when the engine can serve nothing more (its vLLM server died): the worker stops, and its supervisor
/// starts both again.
#[derive(Clone, Default)]
pub(crate) struct Failure {
    reason: Arc<Mutex<Option<String>>>,
    notify: Arc<Notify>,
}

impl Failure {
    pub(crate) fn fail(&self, reason: String) {
        let mut held = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_none() {
            *held = Some(reason);
        }
        self.notify.notify_waiters();
    }

    fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Resolves with the reason once the engine has failed.
    async fn wait(&self) -> String {
        loop {
            let notified = self.notify.notified();
            if let Some(reason) = self.reason() {
                return reason;
            }
            notified.await;
        }
    }
}

/// Cloneable handle to the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    load: Arc<Load>,
    slots: usize,
    max_model_len: usize,
    failure: Failure,
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
    /// jetrl's engine: loads the model on a new thread and allocates the KV cache; returns once it is ready (or
    /// failed).
    pub fn start(settings: EngineSettings) -> Result<Self, EngineError> {
        let (tx, rx) = mpsc::channel::<Command>(1024);
        let load = Arc::new(Load::default());
        let ready = local::spawn(settings, rx, load.clone())?;
        metrics::gauge!("jetrl_rollout_engine_slots").set(ready.slots as f64);
        metrics::gauge!("jetrl_rollout_kv_cache_bytes").set(ready.kv_bytes as f64);
        tracing::info!(
            slots = ready.slots,
            max_model_len = ready.max_model_len,
            kv_cache_mib = ready.kv_bytes >> 20,
            "rollout engine ready"
        );
        Ok(Self::new(tx, load, ready.slots, ready.max_model_len, Failure::default()))
    }

    fn new(tx: mpsc::Sender<Command>, load: Arc<Load>, slots: usize, max_model_len: usize, failure: Failure) -> Self {
        Self { tx, next_id: Arc::new(AtomicU64::new(1)), load, slots, max_model_len, failure }
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

    /// Resolves when the engine can serve nothing more, with why (a vLLM server that died).
    pub async fn failed(&self) -> String {
        self.failure.wait().await
    }

    /// Bounded channel: waits (without blocking the reactor) while the engine thread is behind.
    async fn send(&self, command: Command) -> Result<(), EngineError> {
        self.tx.send(command).await.map_err(|_| EngineError::Stopped)
    }
}

//! The inference engine thread. libtorch stays off the async reactor: the model lives on one dedicated
//! thread fed by a bounded channel. Generation requests that are waiting when the thread becomes free are
//! decoded together as one batch (up to `max_num_seqs` sequences); a weight swap is applied between
//! batches, so no sequence ever mixes two versions within a batch.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_model::{generate, CausalLm, DType, Generation, SamplingParams};
use tokio::sync::oneshot;

#[derive(Debug, thiserror::Error, Clone)]
pub enum EngineError {
    #[error("loading the model: {0}")]
    Load(String),
    #[error("generation: {0}")]
    Generate(String),
    #[error("weight swap to version {version}: {message}")]
    Swap { version: u64, message: String },
    #[error("the engine thread has stopped")]
    Stopped,
}

/// One prompt to sample `n` times.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub n: usize,
}

/// The `n` samples of one request, with the weight version they were generated under.
pub struct GenOutput {
    pub samples: Vec<Generation>,
    pub version: u64,
    /// when the batch holding this request started decoding
    pub started: Instant,
}

enum Command {
    Generate { request: GenRequest, reply: oneshot::Sender<Result<GenOutput, EngineError>> },
    Swap { bytes: bytes::Bytes, version: u64, reply: oneshot::Sender<Result<(), EngineError>> },
}

/// Cloneable handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    tx: SyncSender<Command>,
    version: Arc<AtomicU64>,
}

impl Engine {
    /// Loads the model on a new thread; returns once it is ready (or failed to load).
    pub fn start(
        model_dir: &Path,
        device: &str,
        dtype: &str,
        max_num_seqs: usize,
        seed: i64,
        eos_ids: Vec<u32>,
    ) -> Result<Self, EngineError> {
        let device = jetrl_model::parse_device(device).map_err(|e| EngineError::Load(e.to_string()))?;
        let dtype: DType = dtype.parse().map_err(|e: jetrl_model::ModelError| EngineError::Load(e.to_string()))?;
        let (tx, rx) = sync_channel::<Command>(1024);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let dir = model_dir.to_path_buf();
        let version = Arc::new(AtomicU64::new(0));
        let thread_version = version.clone();
        std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || {
                tch::manual_seed(seed);
                let model = match CausalLm::load(&dir, device, dtype) {
                    Ok(m) => {
                        let _ = ready_tx.send(Ok(()));
                        m
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(EngineError::Load(format!("{}: {e}", dir.display()))));
                        return;
                    }
                };
                engine_loop(model, rx, max_num_seqs.max(1), eos_ids, thread_version);
            })
            .map_err(|e| EngineError::Load(e.to_string()))?;
        ready_rx.recv().map_err(|_| EngineError::Stopped)??;
        Ok(Self { tx, version })
    }

    /// Generates `request.n` samples of one prompt.
    pub async fn generate(&self, request: GenRequest) -> Result<GenOutput, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Generate { request, reply }).await?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Loads a weight blob (applied between batches).
    pub async fn swap(&self, bytes: bytes::Bytes, version: u64) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Swap { bytes, version, reply }).await?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// The weight version currently loaded.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    async fn send(&self, mut command: Command) -> Result<(), EngineError> {
        // Bounded channel: wait (without blocking the reactor) while the engine is saturated.
        loop {
            match self.tx.try_send(command) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(c)) => {
                    command = c;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(TrySendError::Disconnected(_)) => return Err(EngineError::Stopped),
            }
        }
    }
}

fn engine_loop(
    mut model: CausalLm,
    rx: Receiver<Command>,
    max_num_seqs: usize,
    eos_ids: Vec<u32>,
    version: Arc<AtomicU64>,
) {
    let mut pending: Vec<(GenRequest, oneshot::Sender<Result<GenOutput, EngineError>>)> = Vec::new();
    loop {
        // Block for work only when nothing is queued.
        let first = if pending.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(0)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        let mut commands: Vec<Command> = first.into_iter().collect();
        while let Ok(c) = rx.try_recv() {
            commands.push(c);
        }
        for command in commands {
            match command {
                Command::Generate { request, reply } => pending.push((request, reply)),
                Command::Swap { bytes, version: v, reply } => {
                    // Finish what was queued under the old weights first.
                    run_batches(&model, &mut pending, max_num_seqs, &eos_ids, version.load(Ordering::SeqCst));
                    let started = Instant::now();
                    let result = model
                        .load_safetensors_bytes(&bytes)
                        .map_err(|e| EngineError::Swap { version: v, message: e.to_string() });
                    if result.is_ok() {
                        version.store(v, Ordering::SeqCst);
                        metrics::histogram!("jetrl_rollout_weight_swap_seconds")
                            .record(started.elapsed().as_secs_f64());
                    }
                    let _ = reply.send(result);
                }
            }
        }
        run_batches(&model, &mut pending, max_num_seqs, &eos_ids, version.load(Ordering::SeqCst));
    }
}

/// Decodes everything pending in batches of at most `max_num_seqs` sequences.
fn run_batches(
    model: &CausalLm,
    pending: &mut Vec<(GenRequest, oneshot::Sender<Result<GenOutput, EngineError>>)>,
    max_num_seqs: usize,
    eos_ids: &[u32],
    version: u64,
) {
    while !pending.is_empty() {
        let mut take = 0;
        let mut seqs = 0;
        while take < pending.len() && (take == 0 || seqs + pending[take].0.n <= max_num_seqs) {
            seqs += pending[take].0.n;
            take += 1;
        }
        let batch: Vec<_> = pending.drain(..take).collect();
        let mut prompts = Vec::with_capacity(seqs);
        let mut params = Vec::with_capacity(seqs);
        for (req, _) in &batch {
            for _ in 0..req.n {
                prompts.push(req.prompt.clone());
                params.push(req.params.clone());
            }
        }
        let started = Instant::now();
        metrics::gauge!("jetrl_rollout_batch_sequences").set(seqs as f64);
        metrics::gauge!("jetrl_rollout_batch_occupancy").set(seqs as f64 / max_num_seqs as f64);
        let result = generate(model, &prompts, &params, eos_ids);
        let elapsed = started.elapsed().as_secs_f64();
        match result {
            Ok(mut generations) => {
                let tokens: usize = generations.iter().map(|g| g.tokens.len()).sum();
                metrics::counter!("jetrl_rollout_generated_tokens_total").increment(tokens as u64);
                metrics::histogram!("jetrl_rollout_batch_seconds").record(elapsed);
                if elapsed > 0.0 {
                    metrics::gauge!("jetrl_rollout_tokens_per_second").set(tokens as f64 / elapsed);
                }
                for (req, reply) in batch.into_iter() {
                    let samples: Vec<Generation> = generations.drain(..req.n).collect();
                    let _ = reply.send(Ok(GenOutput { samples, version, started }));
                }
            }
            Err(err) => {
                let err = EngineError::Generate(err.to_string());
                for (_, reply) in batch {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}

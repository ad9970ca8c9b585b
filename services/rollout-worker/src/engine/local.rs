//! jetrl's engine behind the handle: [`jetrl_model::Engine`] on one dedicated thread (libtorch stays off the
//! async reactor), fed by the handle's bounded channel, stepping while it holds work. Between two decode steps the
//! thread takes new requests (they join the running batch), weight swaps (running sequences continue under the
//! new version), aborts, and pause / resume; a request whose receiver was dropped (its task was cancelled) is
//! aborted so its rows free up at once.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_model::{CausalLm, DType, Engine, Prefix, Request, RequestId, Sampling, SequenceOutput};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use super::{Command, EngineError, EngineSettings, Load, Parked, Results};

/// What a started engine thread reports once its model and KV cache are in place.
pub(super) struct Ready {
    pub slots: usize,
    pub max_model_len: usize,
    pub kv_bytes: u64,
}

/// Loads the model on a new thread that then serves `rx`; returns once it is ready (or failed).
pub(super) fn spawn(
    settings: EngineSettings,
    rx: mpsc::Receiver<Command>,
    load: Arc<Load>,
) -> Result<Ready, EngineError> {
    let device = jetrl_model::resolve_device(settings.device).map_err(|e| EngineError::load(&settings.model_dir, e))?;
    let dtype = DType::from(settings.dtype);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
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
                    let ready = Ready { slots: engine.slots(), max_model_len: engine.config().max_model_len, kv_bytes };
                    let _ = ready_tx.send(Ok(ready));
                    EngineThread::new(engine, load).run(rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| EngineError::Thread(Arc::new(e)))?;
    ready_rx.recv().map_err(|_| EngineError::Stopped)?
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

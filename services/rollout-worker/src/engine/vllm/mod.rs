//! One file: the vLLM driver's state (calls in flight, samples held for an update or a pause, the loaded version)
//! and the commands that change it are read together.
//!
//! vLLM behind the engine handle (`rollout.name: vllm`). A driver task serves the handle's commands against one
//! `vllm serve` ([`server`]: started and supervised by the worker, or the one `rollout.vllm.url` names) through its
//! HTTP routes ([`client`]): tokens in and out, never text, so the trainer scores exactly the ids vLLM sampled.
//!
//! - Each sample of a request is one `/inference/v1/generate` call (`n` = 1) with a seed of its own, so any sample
//!   can be aborted and continued from its prefix alone. The model's end-of-sequence ids go as stop ids.
//! - A weight version reaches vLLM without a restart: the blob is written as a directory of safetensors (or a PEFT
//!   adapter), then pause, `reload_weights` (or `/v1/load_lora_adapter`), the version tag (`/update_weight_version`,
//!   jetrl's number), resume. In `rollout.vllm.update_mode: abort` the pause aborts the requests in flight and each
//!   continues from its prefix under the new version (every token's version is known); in `keep` they stay in vLLM
//!   across the update and vLLM's weight-version spans say which tokens each version sampled.
//! - colocate_async: a pause parks every sample with its prefix and puts vLLM to sleep when
//!   `rollout.free_cache_engine` (a server that cannot sleep, as vLLM's CPU backend, keeps its memory: said once
//!   in the log); a resume wakes it, loads the trainer's weights and continues the parked samples.

pub mod client;
pub mod server;
mod weights;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jetrl_config::VllmUpdateMode;
use jetrl_model::{Finish, Request, RequestId, Sampling, SequenceOutput};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::{Command, EngineError, EngineHandle, Failure, Load, Parked, Results};
use client::{Client, GenerateRequest, Sample, SamplingParams};
use server::{Server, ServerCommand};

/// How often an abort is sent again for calls that have not come back (see [`Driver::collect`]).
const ABORT_RESEND: Duration = Duration::from_secs(1);

/// Why vLLM could not serve. Each variant names the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum VllmError {
    #[error("config {key}: {message}")]
    Config { key: &'static str, message: String },
    #[error(
        "vLLM is not installed for {python} ({reason}): run `scripts/setup-vllm.sh` (it makes .venv-vllm, a venv \
         of its own) or point rollout.vllm.python at a Python that has vllm"
    )]
    NotInstalled { python: PathBuf, reason: String },
    #[error("starting the vLLM server: {0}")]
    Start(String),
    #[error("{url}: {source}")]
    Http {
        url: String,
        #[source]
        source: Arc<jetrl_telemetry::http::HttpError>,
    },
    #[error("{path}: no answer within {after:?}")]
    Timeout { path: String, after: Duration },
    #[error("{path} answered {status}: {message}")]
    Status { path: String, status: u16, message: String },
    #[error("malformed answer: {0}")]
    Malformed(String),
    #[error("writing weight version {version} for vLLM: {message}")]
    Weights { version: u64, message: String },
}

impl VllmError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            VllmError::Config { .. } => "vllm_config",
            VllmError::NotInstalled { .. } => "vllm_not_installed",
            VllmError::Start(_) => "vllm_start",
            VllmError::Http { .. } => "vllm_http",
            VllmError::Timeout { .. } => "vllm_timeout",
            VllmError::Status { .. } => "vllm_status",
            VllmError::Malformed(_) => "vllm_malformed",
            VllmError::Weights { .. } => "vllm_weights",
        }
    }

    /// Whether the failure is the server's state rather than the request's: unreachable, too slow, or a server
    /// error (5xx: a dead engine core answers 500 before the server exits). The group goes back for redelivery;
    /// a request the server refused (4xx) fails its group with the server's reason.
    fn transient(&self) -> bool {
        match self {
            VllmError::Http { .. } | VllmError::Timeout { .. } => true,
            VllmError::Status { status, .. } => *status >= 500,
            _ => false,
        }
    }
}

impl From<VllmError> for EngineError {
    fn from(e: VllmError) -> Self {
        EngineError::Vllm(Arc::new(e))
    }
}

/// Where the server comes from.
pub enum Launch {
    /// start `vllm serve` (the worker's child)
    Start(ServerCommand),
    /// use a running server
    Given { url: String, api_key: Option<String> },
}

/// What the driver needs besides the server.
pub struct VllmSettings {
    pub launch: Launch,
    pub model_dir: PathBuf,
    /// sequences at once (the worker's slots; `--max-num-seqs`)
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// the model's end-of-sequence ids (sent as stop ids)
    pub eos_token_ids: Vec<u32>,
    /// seeds samples whose request brings no seed
    pub seed: u64,
    pub update_mode: VllmUpdateMode,
    /// the trainer publishes adapters of this spec: each version is loaded as a LoRA adapter
    pub lora: Option<jetrl_model::LoraSpec>,
    /// where versions are written for vLLM to read (a directory of the worker's own)
    pub work_dir: PathBuf,
    pub request_timeout: Duration,
    /// colocate_async may put the server to sleep (started with `--enable-sleep-mode`)
    pub sleep_mode: bool,
    /// with `rollout.enable_rollout_routing_replay`: the model's sparse layers × experts per token, what each
    /// token's routed experts must hold (0: routes are not asked for)
    pub routes_per_token: usize,
}

impl VllmSettings {
    /// The directory a started server loads (an untied copy of a tied checkpoint, see [`weights::serving_dir`]),
    /// and whether versions carry the output layer: whenever the checkpoint ties it (a server that serves the
    /// tied model skips `lm_head.weight`; an untied one needs it).
    fn prepare(&mut self) -> Result<bool, VllmError> {
        std::fs::create_dir_all(&self.work_dir)
            .map_err(|e| VllmError::Weights { version: 0, message: format!("{}: {e}", self.work_dir.display()) })?;
        let (served, ties) = weights::serving_dir(&self.model_dir, &self.work_dir)?;
        if let Launch::Start(command) = &mut self.launch {
            command.model_dir = served;
        }
        Ok(ties)
    }
}

impl EngineHandle {
    /// vLLM: starts (or connects to) the server and the driver task; returns once the server answers.
    pub async fn start_vllm(mut settings: VllmSettings) -> Result<Self, EngineError> {
        let failure = Failure::default();
        let untied = settings.prepare()?;
        let (client, server) = match settings.launch {
            Launch::Start(ref command) => {
                let server = Server::start(command.clone(), failure.clone()).await?;
                let client = Client::new(&server.url, Some(&server.api_key), settings.request_timeout)?;
                (client, Some(server))
            }
            Launch::Given { ref url, ref api_key } => {
                let client = Client::new(url, api_key.as_deref(), settings.request_timeout)?;
                if !server::health(&client.endpoint).await {
                    return Err(VllmError::Start(format!(
                        "rollout.vllm.url {url}: no answer from {url}/health (is the server running, and reachable \
                         from this host?)"
                    ))
                    .into());
                }
                (client, None)
            }
        };
        // the server's label before any version is loaded: the checkpoint's weights are version 0
        client.set_weight_version(0).await?;
        let (tx, rx) = mpsc::channel::<Command>(1024);
        let load = Arc::new(Load::default());
        let slots = settings.max_num_seqs;
        let max_model_len = settings.max_model_len;
        metrics::gauge!("jetrl_rollout_engine_slots").set(slots as f64);
        tracing::info!(url = %client.url, slots, max_model_len, update_mode = %settings.update_mode, "rollout engine ready: vLLM");
        let driver = Driver::new(settings, client, server, load.clone(), untied);
        tokio::spawn(driver.run(rx));
        Ok(EngineHandle::new(tx, load, slots, max_model_len, failure))
    }
}

/// A sample that waits to continue from its prefix (after an update's abort or a pause).
struct Slot {
    /// the request it belongs to (the id the caller submitted under)
    owner: RequestId,
    index: usize,
    /// what it generated so far, with the versions that sampled it
    prefix: Sample,
}

/// One generate call in flight: samples `first..first + n` of a request, or one sample continued from its prefix.
struct Call {
    owner: RequestId,
    first: usize,
    n: usize,
    /// what the one sample of a continued call had before it (empty for a fresh call)
    prefix: Sample,
}

/// A submitted request: where its outputs go and what it asked for.
struct Serving {
    results: Results,
    remaining: usize,
    prompt: Vec<u32>,
    sampling: Sampling,
    /// the seed its samples derive theirs from
    seed: u64,
}

/// The answer of one generate call, back at the driver.
struct Done {
    call: String,
    result: Result<Vec<Sample>, VllmError>,
}

fn empty() -> Sample {
    Sample {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        finish: Finish::Aborted,
        version_runs: Vec::new(),
        routed_experts: (Vec::new(), 0),
    }
}

/// Why the driver stopped the calls in flight, which decides what happens to the samples that come back aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// they continue at once (an abort the worker did not ask for)
    None,
    /// a weight update: they wait for the new version
    Update,
    /// colocate_async's pause: they wait for the resume
    Paused,
}

struct Driver {
    settings: VllmSettings,
    client: Client,
    /// the server the worker started (dropping it stops it)
    _server: Option<Server>,
    load: Arc<Load>,
    serving: HashMap<RequestId, Serving>,
    /// generate calls in flight, by vLLM request id (each call gets a new one)
    running: HashMap<String, Call>,
    /// samples aborted and waiting to continue (an update or a pause)
    held: Vec<Slot>,
    hold: Hold,
    calls: JoinSet<()>,
    done_tx: mpsc::Sender<Done>,
    done_rx: mpsc::Receiver<Done>,
    /// the loaded version, and the adapter name requests use (LoRA)
    version: u64,
    adapter: Option<String>,
    next_call: u64,
    asleep: bool,
    sleep_refused: bool,
    /// tokens delivered, for the load's tokens/s
    window: (Instant, u64),
    instance: String,
    /// the served model has an output layer of its own that versions carry ([`weights::serving_dir`])
    untied: bool,
}

impl Driver {
    fn new(settings: VllmSettings, client: Client, server: Option<Server>, load: Arc<Load>, untied: bool) -> Self {
        let (done_tx, done_rx) = mpsc::channel(settings.max_num_seqs.max(1) * 2 + 16);
        let instance = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        Self {
            settings,
            client,
            _server: server,
            load,
            serving: HashMap::new(),
            running: HashMap::new(),
            held: Vec::new(),
            hold: Hold::None,
            calls: JoinSet::new(),
            done_tx,
            done_rx,
            version: 0,
            adapter: None,
            next_call: 0,
            asleep: false,
            sleep_refused: false,
            window: (Instant::now(), 0),
            instance,
            untied,
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                command = rx.recv() => match command {
                    Some(command) => self.handle(command).await,
                    None => break,
                },
                Some(done) = self.done_rx.recv() => self.finished(done),
                _ = tick.tick() => {
                    self.abort_cancelled().await;
                    self.publish_load();
                }
                Some(_) = self.calls.join_next(), if !self.calls.is_empty() => {}
            }
        }
        self.calls.abort_all();
    }

    async fn handle(&mut self, command: Command) {
        match command {
            Command::Submit { id, request, results } => self.submit(id, request, results),
            Command::Abort { id, reply } => {
                let outputs = self.abort_request(id).await;
                let _ = reply.send(outputs);
            }
            Command::Swap { bytes, version, reply } => {
                let _ = reply.send(self.swap(bytes, version).await);
            }
            Command::Pause { free_cache, reply } => {
                let _ = reply.send(self.pause(free_cache).await);
            }
            Command::Resume { weights, reply } => {
                let _ = reply.send(self.resume(weights).await);
            }
        }
        self.publish_load();
    }

    fn submit(&mut self, id: RequestId, request: Request, results: Results) {
        let Request { prompt, n, sampling, resume, first_sample } = request;
        let seed = sampling.seed.unwrap_or_else(|| mix(self.settings.seed, id));
        let refuse = |results: &Results, message: String| {
            let _ = results.try_send(Err(EngineError::Request(Arc::new(jetrl_model::ModelError::Config(message)))));
        };
        if prompt.is_empty() || n == 0 {
            return refuse(&results, "a request needs a prompt and at least one sample".into());
        }
        if prompt.len() >= self.settings.max_model_len {
            return refuse(
                &results,
                format!(
                    "prompt of {} tokens leaves no room within max_model_len {}",
                    prompt.len(),
                    self.settings.max_model_len
                ),
            );
        }
        if resume.is_some() && n != 1 {
            return refuse(&results, "a resumed request has one sample".into());
        }
        self.serving.insert(id, Serving { results, remaining: n, prompt, sampling, seed });
        let slots: Vec<Slot> = match resume {
            Some(p) => vec![Slot {
                owner: id,
                index: first_sample,
                prefix: Sample {
                    tokens: p.tokens,
                    logprobs: p.logprobs,
                    finish: Finish::Aborted,
                    version_runs: p.version_runs,
                    routed_experts: (Vec::new(), 0),
                },
            }],
            None if self.hold == Hold::None => {
                self.start_call(id, first_sample, n, empty());
                return;
            }
            None => (first_sample..first_sample + n).map(|index| Slot { owner: id, index, prefix: empty() }).collect(),
        };
        for slot in slots {
            if self.hold == Hold::None {
                self.start_call(slot.owner, slot.index, 1, slot.prefix);
            } else {
                self.held.push(slot);
            }
        }
    }

    /// Starts one generate call: `n` fresh samples from `first`, or (`n` = 1) one sample from its prefix.
    fn start_call(&mut self, owner: RequestId, first: usize, n: usize, prefix: Sample) {
        let Some(serving) = self.serving.get(&owner) else { return };
        let budget = serving.sampling.max_tokens.min(self.settings.max_model_len.saturating_sub(serving.prompt.len()));
        let left = budget.saturating_sub(prefix.tokens.len());
        let last = prefix.tokens.last().copied();
        if left == 0 || last.is_some_and(|t| self.settings.eos_token_ids.contains(&t)) {
            // nothing more to generate: the prefix is the whole sample
            let finish = match last {
                Some(t) if self.settings.eos_token_ids.contains(&t) => Finish::Eos(t),
                _ => Finish::Length,
            };
            self.deliver(owner, first, Sample { finish, ..prefix });
            return;
        }
        self.next_call += 1;
        let call = format!("jetrl-{}-{}-{}-{}", self.instance, owner, first, self.next_call);
        let mut token_ids = serving.prompt.clone();
        token_ids.extend_from_slice(&prefix.tokens);
        // a continued sample draws a fresh stream: its seed moves on with the tokens it already has
        let seed = mix(mix(serving.seed, first as u64), prefix.tokens.len() as u64) & ((1 << 62) - 1);
        let mut sampling_params = SamplingParams::of(&serving.sampling, left, Some(seed), &self.settings.eos_token_ids);
        sampling_params.n = n as u32;
        let request =
            GenerateRequest { request_id: call.clone(), token_ids, sampling_params, model: self.adapter.clone() };
        let client = self.client.clone();
        let done = self.done_tx.clone();
        let eos = self.settings.eos_token_ids.clone();
        let id = call.clone();
        self.calls.spawn(async move {
            let result = client.generate(&request, &eos).await;
            let _ = done.send(Done { call: id, result }).await;
        });
        self.running.insert(call, Call { owner, first, n, prefix });
    }

    /// A generate call came back: each of its samples is delivered, or held (or continued) when it was aborted.
    fn finished(&mut self, done: Done) {
        let Some(call) = self.running.remove(&done.call) else { return };
        match done.result {
            Ok(samples) => {
                for (i, sample) in samples.into_iter().enumerate() {
                    let joined = join(&call.prefix, sample, self.version);
                    let index = call.first + i;
                    if joined.finish == Finish::Aborted {
                        let slot = Slot { owner: call.owner, index, prefix: joined };
                        match self.hold {
                            Hold::None => self.start_call(slot.owner, slot.index, 1, slot.prefix),
                            Hold::Update | Hold::Paused => self.held.push(slot),
                        }
                    } else {
                        self.deliver(call.owner, index, joined);
                    }
                }
            }
            Err(err) => {
                metrics::counter!("jetrl_rollout_engine_errors_total", "stage" => "vllm_generate").increment(1);
                tracing::warn!(request = call.owner, error = %err, "vLLM generate failed");
                let error = if err.transient() { EngineError::Stopped } else { EngineError::from(err) };
                self.fail_request(call.owner, error);
            }
        }
    }

    fn deliver(&mut self, owner: RequestId, index: usize, sample: Sample) {
        let (routes, per_token) = sample.routed_experts;
        let wanted = self.settings.routes_per_token;
        if wanted > 0 && !routes.is_empty() && per_token != wanted {
            let err = VllmError::Malformed(format!(
                "routed_experts: {per_token} experts per token, but the model routes {wanted} (sparse layers × \
                 num_experts_per_tok)"
            ));
            self.fail_request(owner, err.into());
            return;
        }
        let Some(serving) = self.serving.get_mut(&owner) else { return };
        self.window.1 += sample.tokens.len() as u64;
        let (min_version, max_version) = span(&sample.version_runs, self.version);
        let output = SequenceOutput {
            request: owner,
            index,
            tokens: sample.tokens,
            logprobs: sample.logprobs,
            finish: sample.finish,
            min_version,
            max_version,
            version_runs: sample.version_runs,
            time_to_first_token: None,
            routed_experts: if wanted > 0 { routes } else { Vec::new() },
        };
        let _ = serving.results.try_send(Ok(output));
        serving.remaining = serving.remaining.saturating_sub(1);
        if serving.remaining == 0 {
            self.serving.remove(&owner);
        }
    }

    /// The calls in flight of one request.
    fn calls_of(&self, owner: RequestId) -> Vec<String> {
        self.running.iter().filter(|(_, c)| c.owner == owner).map(|(id, _)| id.clone()).collect()
    }

    /// Fails every sample of a request (one error to its receiver) and stops its other calls.
    fn fail_request(&mut self, owner: RequestId, error: EngineError) {
        if let Some(serving) = self.serving.remove(&owner) {
            let _ = serving.results.try_send(Err(error));
        }
        let calls = self.calls_of(owner);
        self.running.retain(|_, c| c.owner != owner);
        self.held.retain(|s| s.owner != owner);
        self.abort_in_background(calls);
    }

    fn abort_in_background(&self, calls: Vec<String>) {
        if calls.is_empty() {
            return;
        }
        let client = self.client.clone();
        tokio::spawn(async move {
            if let Err(err) = client.abort(&calls).await {
                tracing::warn!(error = %err, "aborting vLLM requests failed");
            }
        });
    }

    /// Requests whose receiver was dropped (their task was cancelled): their calls are aborted in vLLM.
    async fn abort_cancelled(&mut self) {
        let gone: Vec<RequestId> =
            self.serving.iter().filter(|(_, s)| s.results.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.serving.remove(&id);
            let calls = self.calls_of(id);
            self.running.retain(|_, c| c.owner != id);
            self.held.retain(|s| s.owner != id);
            self.abort_in_background(calls);
            metrics::counter!("jetrl_rollout_cancelled_requests_total").increment(1);
        }
    }

    /// Stops one request: its samples come back with what they had (a prefix to resume from).
    async fn abort_request(&mut self, id: RequestId) -> Vec<SequenceOutput> {
        let calls = self.calls_of(id);
        if !calls.is_empty() {
            if let Err(err) = self.client.abort(&calls).await {
                tracing::warn!(error = %err, "aborting vLLM requests failed");
            }
            let hold = std::mem::replace(&mut self.hold, Hold::Update);
            self.collect(|c| c.owner == id).await;
            self.hold = hold;
        }
        let (prefixes, others): (Vec<Slot>, Vec<Slot>) =
            std::mem::take(&mut self.held).into_iter().partition(|s| s.owner == id);
        self.held = others;
        self.serving.remove(&id);
        let mut out: Vec<SequenceOutput> = prefixes
            .into_iter()
            .map(|slot| {
                let (min_version, max_version) = span(&slot.prefix.version_runs, self.version);
                SequenceOutput {
                    request: id,
                    index: slot.index,
                    tokens: slot.prefix.tokens,
                    logprobs: slot.prefix.logprobs,
                    finish: Finish::Aborted,
                    min_version,
                    max_version,
                    version_runs: slot.prefix.version_runs,
                    time_to_first_token: None,
                    routed_experts: Vec::new(),
                }
            })
            .collect();
        out.sort_by_key(|o| o.index);
        out
    }

    /// Waits until no call matching `which` is in flight (each comes back, finished or aborted), bounded. A call
    /// whose request reached vLLM only after the abort (it was on the wire) waits in vLLM's queue, not aborted: the
    /// abort is sent again, by id, every second for the calls still out.
    async fn collect(&mut self, which: impl Fn(&Call) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut resend = tokio::time::Instant::now() + ABORT_RESEND;
        while self.running.values().any(&which) {
            tokio::select! {
                Some(done) = self.done_rx.recv() => self.finished(done),
                _ = tokio::time::sleep_until(resend) => {
                    let left: Vec<String> =
                        self.running.iter().filter(|(_, c)| which(c)).map(|(id, _)| id.clone()).collect();
                    tracing::debug!(left = left.len(), "aborting again the calls still out");
                    if let Err(err) = self.client.abort(&left).await {
                        tracing::warn!(error = %err, "aborting vLLM requests failed");
                    }
                    resend = tokio::time::Instant::now() + ABORT_RESEND;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let owners: Vec<RequestId> = self.running.values().filter(|c| which(c)).map(|c| c.owner).collect();
                    tracing::error!(left = owners.len(), "vLLM did not answer aborted requests within 60 s; failing them");
                    for owner in owners {
                        self.fail_request(owner, EngineError::Stopped);
                    }
                    return;
                }
            }
        }
    }

    /// Stops generation for an update: in `abort` mode every call comes back with its prefix (held); in `keep`
    /// they stay in vLLM.
    async fn stop_for_update(&mut self) -> Result<(), VllmError> {
        match self.settings.update_mode {
            VllmUpdateMode::Abort => {
                self.hold = Hold::Update;
                self.client.pause("abort").await?;
                self.collect(|_| true).await;
            }
            VllmUpdateMode::Keep => self.client.pause("keep").await?,
        }
        Ok(())
    }

    /// Loads a version into the (paused) server and labels what it samples from now on.
    async fn load_version(&mut self, bytes: bytes::Bytes, version: u64) -> Result<(), VllmError> {
        let started = Instant::now();
        let work_dir = self.settings.work_dir.clone();
        let lora = self.settings.lora.clone();
        let model_dir = self.settings.model_dir.clone();
        let untied = self.untied;
        let dir = tokio::task::spawn_blocking(move || {
            weights::write_version(&work_dir, &model_dir, lora.as_ref(), untied, &bytes, version)
        })
        .await
        .map_err(|e| VllmError::Weights { version, message: e.to_string() })??;
        match &self.settings.lora {
            Some(_) => {
                let name = format!("jetrl-v{version}");
                self.client.load_lora_adapter(&name, &dir).await?;
                if let Some(old) = self.adapter.replace(name) {
                    if let Err(err) = self.client.unload_lora_adapter(&old).await {
                        tracing::warn!(adapter = %old, error = %err, "unloading the previous adapter failed");
                    }
                }
            }
            None => self.client.reload_weights(&dir).await?,
        }
        self.client.set_weight_version(version).await?;
        self.version = version;
        self.load.version.store(version, Ordering::SeqCst);
        weights::prune(&self.settings.work_dir, version);
        metrics::histogram!("jetrl_rollout_weight_swap_seconds").record(started.elapsed().as_secs_f64());
        tracing::info!(
            version,
            running = self.running.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "weights loaded into vLLM"
        );
        Ok(())
    }

    async fn swap(&mut self, bytes: bytes::Bytes, version: u64) -> Result<(), EngineError> {
        let paused = self.hold == Hold::Paused;
        if !paused {
            self.stop_for_update().await?;
        }
        let loaded = self.load_version(bytes, version).await;
        if !paused {
            // generation goes on whatever the load did: under the new version, or the old one on a failure
            self.client.resume().await?;
            self.release_held();
        }
        loaded.map_err(EngineError::from)
    }

    /// Continues every held sample from its prefix.
    fn release_held(&mut self) {
        self.hold = Hold::None;
        for slot in std::mem::take(&mut self.held) {
            self.start_call(slot.owner, slot.index, 1, slot.prefix);
        }
    }

    async fn pause(&mut self, free_cache: bool) -> Result<Parked, EngineError> {
        if self.hold != Hold::Paused {
            self.hold = Hold::Paused;
            self.client.pause("abort").await?;
            self.collect(|_| true).await;
        }
        if free_cache && !self.asleep {
            if !self.settings.sleep_mode {
                if !self.sleep_refused {
                    tracing::warn!("this vLLM server cannot sleep (no sleep mode: the CPU backend, or a given server started without --enable-sleep-mode); its memory stays held while the trainer steps");
                    self.sleep_refused = true;
                }
            } else {
                match self.client.sleep(1).await {
                    Ok(()) => self.asleep = true,
                    Err(err) => {
                        tracing::warn!(error = %err, "vLLM could not sleep; its memory stays held while the trainer steps");
                    }
                }
            }
        }
        let report =
            Parked { sequences: self.held.len(), tokens: self.held.iter().map(|s| s.prefix.tokens.len() as u64).sum() };
        metrics::counter!("jetrl_rollout_pauses_total").increment(1);
        tracing::info!(parked = report.sequences, tokens = report.tokens, asleep = self.asleep, "vLLM paused");
        Ok(report)
    }

    async fn resume(&mut self, weights: Option<(bytes::Bytes, u64)>) -> Result<usize, EngineError> {
        if self.asleep {
            self.client.wake_up().await?;
            self.asleep = false;
        }
        let loaded = match weights {
            Some((bytes, version)) => self.load_version(bytes, version).await.map_err(EngineError::from),
            None => Ok(()),
        };
        let was_paused = self.hold == Hold::Paused;
        if was_paused {
            self.client.resume().await?;
        }
        let resumed = self.held.len();
        self.release_held();
        metrics::counter!("jetrl_rollout_resumed_sequences_total").increment(resumed as u64);
        tracing::info!(resumed, version = self.version, "vLLM resumed");
        loaded.map(|()| resumed)
    }

    fn publish_load(&mut self) {
        let running: usize = self.running.values().map(|c| c.n).sum();
        let held = self.held.len();
        self.load.running.store(running as u64, Ordering::Relaxed);
        self.load.waiting.store(held as u64, Ordering::Relaxed);
        metrics::gauge!("jetrl_rollout_running_sequences").set(running as f64);
        metrics::gauge!("jetrl_rollout_queue_depth_sequences").set(held as f64);
        metrics::gauge!("jetrl_rollout_batch_occupancy_ratio")
            .set(running as f64 / self.settings.max_num_seqs.max(1) as f64);
        let elapsed = self.window.0.elapsed();
        if elapsed >= Duration::from_secs(1) {
            let rate = self.window.1 as f64 / elapsed.as_secs_f64();
            metrics::counter!("jetrl_rollout_generated_tokens_total").increment(self.window.1);
            metrics::gauge!("jetrl_rollout_generation_tokens_per_second").set(rate);
            self.load.tokens_per_s.store(rate.to_bits(), Ordering::Relaxed);
            self.window = (Instant::now(), 0);
        }
    }
}

/// A prefix continued by what one call generated: tokens, log-probs and version runs appended (the call's runs
/// shifted past the prefix; a call without spans counts as sampled under `version`).
fn join(prefix: &Sample, call: Sample, version: u64) -> Sample {
    let offset = prefix.tokens.len() as u32;
    let mut runs = prefix.version_runs.clone();
    let call_runs =
        if call.version_runs.is_empty() && !call.tokens.is_empty() { vec![(0, version)] } else { call.version_runs };
    for (first, v) in call_runs {
        if runs.last().map(|&(_, last)| last) != Some(v) {
            runs.push((first + offset, v));
        }
    }
    let mut tokens = prefix.tokens.clone();
    tokens.extend(call.tokens);
    let mut logprobs = prefix.logprobs.clone();
    logprobs.extend(call.logprobs);
    // the call's prompt held the prefix: its routes cover every token before its last
    let routed_experts =
        if call.routed_experts.0.is_empty() { prefix.routed_experts.clone() } else { call.routed_experts };
    Sample { tokens, logprobs, finish: call.finish, version_runs: runs, routed_experts }
}

/// Lowest and highest version of the runs (`current` when there are none).
fn span(runs: &[(u32, u64)], current: u64) -> (u64, u64) {
    let min = runs.iter().map(|&(_, v)| v).min().unwrap_or(current);
    let max = runs.iter().map(|&(_, v)| v).max().unwrap_or(current);
    (min, max)
}

/// splitmix64 of two words: per-sample seeds from a request's.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(tokens: &[u32], runs: &[(u32, u64)], finish: Finish) -> Sample {
        Sample {
            tokens: tokens.to_vec(),
            logprobs: tokens.iter().map(|&t| -(t as f32)).collect(),
            finish,
            version_runs: runs.to_vec(),
            routed_experts: (Vec::new(), 0),
        }
    }

    #[test]
    fn a_resumed_sample_keeps_its_prefix_and_the_versions_of_both_parts() {
        let prefix = sample(&[1, 2, 3], &[(0, 4)], Finish::Aborted);
        let call = sample(&[7, 8], &[(0, 5)], Finish::Length);
        let joined = join(&prefix, call, 5);
        assert_eq!(joined.tokens, vec![1, 2, 3, 7, 8]);
        assert_eq!(joined.logprobs, vec![-1.0, -2.0, -3.0, -7.0, -8.0]);
        assert_eq!(joined.version_runs, vec![(0, 4), (3, 5)]);
        assert_eq!(joined.finish, Finish::Length);
        assert_eq!(span(&joined.version_runs, 9), (4, 5));
    }

    #[test]
    fn a_call_without_spans_counts_as_the_loaded_version_and_equal_versions_merge() {
        let empty = sample(&[], &[], Finish::Aborted);
        let joined = join(&empty, sample(&[5], &[], Finish::Length), 2);
        assert_eq!(joined.version_runs, vec![(0, 2)]);
        let joined = join(&joined, sample(&[6], &[(0, 2)], Finish::Length), 2);
        assert_eq!(joined.version_runs, vec![(0, 2)]);
        assert_eq!(span(&[], 3), (3, 3));
    }

    #[test]
    fn server_errors_go_back_for_redelivery_and_refusals_fail_the_group() {
        let status = |status| VllmError::Status { path: "/g".into(), status, message: String::new() };
        assert!(status(500).transient() && status(503).transient());
        assert!(!status(400).transient() && !status(404).transient());
        assert!(VllmError::Timeout { path: "/g".into(), after: Duration::from_secs(1) }.transient());
        assert!(!VllmError::Malformed("x".into()).transient());
    }

    #[test]
    fn per_sample_seeds_differ_and_repeat() {
        assert_ne!(mix(mix(7, 0), 0), mix(mix(7, 1), 0));
        assert_eq!(mix(mix(7, 1), 3), mix(mix(7, 1), 3));
    }
}

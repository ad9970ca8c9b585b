//! One file: the `Engine` and the step that drives it; what it is made of is beside it in `engine/`.
//!
//! A continuous-batching inference engine over [`CausalLm`]: the rollout side of RL post-training.
//!
//! - A fixed budget: at most `slots` sequences run at once, each in a preallocated KV row of `max_model_len`
//!   positions ([`EngineConfig`]); the budget is set once, so memory never grows while serving.
//! - New sequences join between decode steps (their prompt is prefilled into a free slot and their first token
//!   sampled in the same step); a finished sequence leaves its slot at once and costs no copy. A decode step is
//!   one batched forward over slots `0..batch`, each sequence addressed by its slot; free slots inside that range
//!   compute masked garbage. When the running sequences would fit a smaller batch, the highest ones move down
//!   into free slots (on the CPU at every hole, where shapes are exact; with CUDA graphs only when the batch
//!   bucket can shrink).
//! - On CUDA the decode step is a CUDA graph per `(batch, width)` bucket ([`graphs`]), unless
//!   [`EngineConfig::enforce_eager`] or the model has MoE layers; the CPU runs the same step eagerly at exact
//!   shapes.
//! - A request with `n > 1` samples (a GRPO group) is prefilled once; its rows are forks (copies) of that row's
//!   prompt keys and values.
//! - Sampling per request: temperature (0 = greedy), top-p, top-k, repetition penalty, seed, stop token ids,
//!   stop strings, max tokens; every sampled token comes with its log-prob ([`LogprobsMode`]).
//! - [`Engine::load_weights`] swaps weights between two steps without dropping running sequences; each output
//!   records the lowest and highest weight version its tokens were sampled under.
//! - [`Engine::abort`] returns what a request has generated so far ([`Finish::Aborted`]); submitting it again
//!   with [`Request::resume`] continues from that prefix (partial rollout), and a seeded sequence draws the same
//!   random numbers it would have drawn without the interruption.
//!
//! The engine is synchronous and owns the model: it runs on the one thread that drives it (`Tensor` is not
//! `Sync`); services wrap it in a thread fed by a channel.

mod admission;
mod cache;
mod compaction;
mod config;
mod forward;
mod graphs;
mod request;
mod sampler;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::lora::{LoraMerger, LoraSpec};
use crate::model::CausalLm;
use cache::SlotCache;
use forward::DecodeInputs;
use graphs::{DecodeGraphs, Shapes};
use sampler::RowSampling;

use admission::mix;
pub use config::{EngineConfig, EngineStats};
pub use request::{Detokenizer, Finish, LogprobsMode, Prefix, Request, RequestId, Sampling, SequenceOutput};

/// What every sample of one request shares.
#[derive(Debug)]
struct Shared {
    id: RequestId,
    /// The prompt followed by the resumed prefix: what is prefilled.
    context: Vec<u32>,
    sampling: Sampling,
    row: RowSampling,
    seed: u64,
    prefix: Option<Prefix>,
    /// Generated tokens a sequence may have in total (prefix included), after clamping to the slot.
    max_tokens: usize,
    added: Instant,
    /// Longest stop string in bytes: the window of tokens re-decoded after each token.
    stop_window: usize,
    /// The experts the context's tokens were routed to in its prefill (with `return_routed_experts`), set once;
    /// the forks of the request share it.
    context_routes: std::sync::OnceLock<Vec<u16>>,
}

/// A request with samples not yet admitted.
#[derive(Debug)]
struct Waiting {
    shared: Arc<Shared>,
    /// Sample offsets (from `first_sample`) admitted so far, and the request's sample count.
    next: usize,
    n: usize,
    first_sample: usize,
    /// Logits after the context, kept while samples remain so later forks skip the prefill.
    first_logits: Option<Tensor>,
}

/// One running sequence, in KV slot = its index in `Engine::rows`.
#[derive(Debug)]
struct Row {
    shared: Arc<Shared>,
    index: usize,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    /// Positions of this row's KV filled.
    cached: i64,
    /// Logits of the first new token, set at admission (from the prefill) until the step samples it.
    fresh: Option<Tensor>,
    min_version: Option<u64>,
    max_version: u64,
    version_runs: Vec<(u32, u64)>,
    first_token: Option<Duration>,
    /// Which admission this is (unique per engine): how a pending token finds its sequence after slots change.
    serial: u64,
    /// Tokens sampled, those the host has not read yet included (`tokens.len()` when nothing is pending).
    sampled: usize,
    /// Its last sampled token ends it whatever it is (`max_tokens` reached, or the slot is full): it decodes no
    /// more and leaves when that token is read.
    closing: bool,
    /// The experts each of its decoded tokens was routed to (with `return_routed_experts`), token-major.
    routes: Vec<u16>,
}

/// The tokens one step sampled, read by the host one step later when stop checks are deferred (on CUDA: the
/// next step is already queued when the host waits for this one's copy), at once otherwise.
struct Pending {
    /// The serial of each sampled sequence, in sampling order.
    serials: Vec<u64>,
    /// `[B]` int64 on the device: the next step's input for sequences that keep decoding.
    device_tokens: Tensor,
    /// `[B]` int64 and f32 on the host (a non-blocking copy on CUDA, complete once `copied` is).
    tokens: Tensor,
    logprobs: Tensor,
    copied: Option<jetrl_torch_ext::CudaEvent>,
    version: u64,
}

/// The engine: a model, its slot cache, the running rows and the queue.
pub struct Engine {
    model: CausalLm,
    /// Fused decode weights (views shared with the model's parameters) and the RoPE table.
    fused: forward::Fused,
    config: EngineConfig,
    slots: usize,
    cache: Option<SlotCache>,
    /// One entry per KV slot.
    rows: Vec<Option<Row>>,
    /// What each decode step reads (tokens, positions), refilled in place.
    inputs: DecodeInputs,
    shapes: Shapes,
    /// On CUDA without `enforce_eager`: the decode step's graphs.
    graphs: Option<DecodeGraphs>,
    /// Read sampled tokens one step late (see [`Pending`]).
    defer: bool,
    pending: Option<Pending>,
    next_serial: u64,
    waiting: VecDeque<Waiting>,
    /// Outputs decided without a step (empty budgets, aborts), returned by the next `step`.
    ready: Vec<SequenceOutput>,
    /// `[slots, V]` bool: tokens in each row's context, allocated when a request first asks for a penalty.
    presence: Option<Tensor>,
    detokenizer: Option<Detokenizer>,
    /// with adapter-only weight sync: the base weights of the adapted layers, for merging each adapter version
    lora: Option<LoraMerger>,
    version: u64,
    stats: EngineStats,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.config).field("stats", &self.stats()).finish()
    }
}

impl Engine {
    /// Takes the model and allocates the KV cache for the budget in `config`.
    pub fn new(mut model: CausalLm, config: EngineConfig) -> Result<Self> {
        if config.max_num_seqs == 0 {
            return Err(ModelError::Config("max_num_seqs must be > 0".into()));
        }
        if config.max_model_len < 2 {
            return Err(ModelError::Config(format!("max_model_len must be >= 2, got {}", config.max_model_len)));
        }
        let by_memory = config.kv_cache_tokens.map_or(usize::MAX, |t| t / config.max_model_len);
        let slots = config.max_num_seqs.min(by_memory);
        if slots == 0 {
            return Err(ModelError::Config(format!(
                "a KV budget of {:?} tokens does not hold one sequence of max_model_len {}",
                config.kv_cache_tokens, config.max_model_len
            )));
        }
        if config.return_routed_experts {
            if model.sparse_layer_count() == 0 {
                return Err(ModelError::Config(format!(
                    "return_routed_experts needs a mixture-of-experts model; this one ({}) has no routed layer",
                    model.config().architecture.model_type()
                )));
            }
            model.record_routes(true);
        }
        // Inference only: parameters without autograd make every op cheaper, and weight swaps copy under no_grad.
        model.var_store_mut().freeze();
        let fused = forward::fuse(&mut model, config.max_model_len as i64)?;
        let cache = SlotCache::new(&model, slots as i64, config.max_model_len as i64)?;
        let inputs = DecodeInputs::new(&model, slots as i64, config.max_model_len as i64)?;
        // an MoE layer reads its experts' token counts on the host, which a captured graph cannot do
        let graphs = match model.device() {
            tch::Device::Cuda(index) if !config.enforce_eager && model.config().moe.is_none() => {
                Some(DecodeGraphs::new(index)?)
            }
            _ => None,
        };
        let shapes = if config.bucketed.unwrap_or(graphs.is_some()) { Shapes::Buckets } else { Shapes::Exact };
        let defer = config.defer_stop_checks.unwrap_or(model.device() != tch::Device::Cpu);
        let stats =
            EngineStats { slots, kv_tokens_capacity: (slots * config.max_model_len) as u64, ..EngineStats::default() };
        Ok(Engine {
            model,
            fused,
            config,
            slots,
            cache: Some(cache),
            rows: (0..slots).map(|_| None).collect(),
            inputs,
            shapes,
            graphs,
            defer,
            pending: None,
            next_serial: 1,
            waiting: VecDeque::new(),
            ready: Vec::new(),
            presence: None,
            detokenizer: None,
            lora: None,
            version: 0,
            stats,
        })
    }

    /// Bytes the KV cache of `config` would take for `model` (before creating the engine).
    pub fn kv_cache_bytes(model: &CausalLm, config: &EngineConfig) -> u64 {
        let by_memory = config.kv_cache_tokens.map_or(usize::MAX, |t| t / config.max_model_len.max(1));
        let slots = config.max_num_seqs.min(by_memory);
        SlotCache::bytes_for(model, slots as i64, config.max_model_len as i64)
    }

    /// Takes weights as LoRA adapters of `spec` ([`CausalLm::lora_to_safetensors_bytes`] blobs): each is merged
    /// into the working weights from a host copy of the base, so decode runs the plain model. Returns the bytes
    /// of base weights kept on the host.
    pub fn with_lora(&mut self, spec: &LoraSpec) -> Result<u64> {
        let merger = LoraMerger::new(&mut self.model, spec)?;
        let bytes = merger.host_bytes();
        self.lora = Some(merger);
        Ok(bytes)
    }

    /// Enables stop strings.
    pub fn with_detokenizer(mut self, detokenizer: Detokenizer) -> Self {
        self.detokenizer = Some(detokenizer);
        self
    }

    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Sequences that can run at once.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The weight version new tokens are sampled under.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Sets the version label of the current weights (e.g. after loading a checkpoint at start).
    pub fn set_version(&mut self, version: u64) {
        self.version = version;
    }

    /// The random seed a request's samples draw from: its own `sampling.seed`, else one derived from the engine's
    /// seed and the request id (what [`Engine::add_request`] uses). A caller that resubmits an aborted sample
    /// under a new id passes this seed explicitly, so the sample's random stream continues.
    pub fn seed_for(&self, id: RequestId, sampling: &Sampling) -> u64 {
        sampling.seed.unwrap_or_else(|| mix(self.config.seed, id))
    }

    /// Whether a `step` would do anything.
    pub fn has_work(&self) -> bool {
        self.running() > 0 || !self.waiting.is_empty() || !self.ready.is_empty() || self.pending.is_some()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running(),
            waiting: self.waiting.iter().map(|w| w.n - w.next).sum(),
            kv_tokens_used: self.rows.iter().flatten().map(|r| r.cached.max(0) as u64).sum(),
            version: self.version,
            graphs: self.graphs.as_ref().map_or(0, DecodeGraphs::captured),
            ..self.stats
        }
    }

    /// Sequences in KV slots.
    fn running(&self) -> usize {
        self.rows.iter().flatten().count()
    }

    /// Slots holding a sequence of request `id`.
    fn slots_of(&self, id: RequestId) -> Vec<usize> {
        (0..self.rows.len()).filter(|&s| self.rows[s].as_ref().is_some_and(|r| r.shared.id == id)).collect()
    }

    /// Queues a request; its sequences are admitted as rows free up, oldest request first.
    pub fn add_request(&mut self, id: RequestId, request: Request) -> Result<()> {
        if self.holds(id) {
            return Err(ModelError::Generation(format!("request id {id} is already in the engine")));
        }
        let Request { prompt, n, sampling, resume, first_sample } = request;
        sampling.validate()?;
        if n == 0 {
            return Err(ModelError::Generation("a request needs n >= 1 samples".into()));
        }
        if prompt.is_empty() {
            return Err(ModelError::Generation("the prompt is empty".into()));
        }
        if resume.is_some() && n != 1 {
            return Err(ModelError::Generation(format!("a resumed request continues one sequence, got n = {n}")));
        }
        if !sampling.stop.is_empty() && self.detokenizer.is_none() {
            return Err(ModelError::Generation("stop strings need an engine with a detokenizer".into()));
        }
        let vocab = self.model.config().vocab_size;
        let mut context = prompt;
        if let Some(prefix) = &resume {
            if prefix.logprobs.len() != prefix.tokens.len() {
                return Err(ModelError::Generation(format!(
                    "a resumed prefix has {} tokens but {} log-probs",
                    prefix.tokens.len(),
                    prefix.logprobs.len()
                )));
            }
            context.extend_from_slice(&prefix.tokens);
        }
        if let Some(bad) = context.iter().find(|&&t| i64::from(t) >= vocab) {
            return Err(ModelError::Generation(format!("token id {bad} is outside the vocabulary ({vocab})")));
        }
        let room = self.config.max_model_len.saturating_sub(context.len());
        if room == 0 {
            return Err(ModelError::Generation(format!(
                "a context of {} tokens leaves no room in max_model_len {}",
                context.len(),
                self.config.max_model_len
            )));
        }
        let already = resume.as_ref().map_or(0, |p| p.tokens.len());
        let max_tokens = sampling.max_tokens.min(already + room);
        let seed = sampling.seed.unwrap_or_else(|| mix(self.config.seed, id));
        let shared = Arc::new(Shared {
            id,
            context,
            row: sampling.row(),
            stop_window: sampling.stop.iter().map(String::len).max().unwrap_or(0),
            context_routes: std::sync::OnceLock::new(),
            sampling,
            seed,
            prefix: resume,
            max_tokens,
            added: Instant::now(),
        });
        if already >= max_tokens {
            // Nothing left to generate: answer without taking a row.
            for i in 0..n {
                let row = Self::new_row(&shared, first_sample + i, -1);
                self.ready.push(row.into_output(Finish::Length, self.version));
            }
            return Ok(());
        }
        self.waiting.push_back(Waiting { shared, next: 0, n, first_sample, first_logits: None });
        Ok(())
    }

    /// Removes a request wherever it is; returns its sequences with what they generated so far (finish
    /// [`Finish::Aborted`]; samples never admitted come back empty, or with their resumed prefix).
    pub fn abort(&mut self, id: RequestId) -> Result<Vec<SequenceOutput>> {
        self.settle_into_ready()?;
        let mut out: Vec<SequenceOutput> = Vec::new();
        let mut i = 0;
        while i < self.ready.len() {
            if self.ready[i].request == id {
                out.push(self.ready.remove(i));
            } else {
                i += 1;
            }
        }
        if let Some(pos) = self.waiting.iter().position(|w| w.shared.id == id) {
            if let Some(w) = self.waiting.remove(pos) {
                for i in w.next..w.n {
                    let row = Self::new_row(&w.shared, w.first_sample + i, -1);
                    out.push(row.into_output(Finish::Aborted, self.version));
                }
            }
        }
        for row in self.remove_rows(&self.slots_of(id)) {
            out.push(row.into_output(Finish::Aborted, self.version));
        }
        out.sort_by_key(|o| o.index);
        Ok(out)
    }

    /// Takes every running sequence out of its KV row (finish [`Finish::Aborted`], with what it generated so far)
    /// and leaves the queue as it is: samples not admitted yet hold no KV and wait for the next admission. With
    /// no row left, [`Engine::free_cache`] can release the cache (colocate_async's pause).
    pub fn preempt_running(&mut self) -> Result<Vec<SequenceOutput>> {
        // sequences that ended in the last step (read now) are outputs of the next `step`, not prefixes
        self.settle_into_ready()?;
        let version = self.version;
        let mut out: Vec<SequenceOutput> = self
            .rows
            .iter_mut()
            .filter_map(Option::take)
            .map(|row| row.into_output(Finish::Aborted, version))
            .collect();
        out.sort_by_key(|o| (o.request, o.index));
        Ok(out)
    }

    /// Aborts everything (e.g. before freeing the cache for training on the same device).
    pub fn abort_all(&mut self) -> Result<Vec<SequenceOutput>> {
        let mut ids: Vec<RequestId> = self.rows.iter().flatten().map(|r| r.shared.id).collect();
        ids.extend(self.waiting.iter().map(|w| w.shared.id));
        ids.extend(self.ready.iter().map(|o| o.request));
        ids.sort_unstable();
        ids.dedup();
        let mut out = Vec::new();
        for id in ids {
            out.extend(self.abort(id)?);
        }
        Ok(out)
    }

    /// Releases the KV cache memory; it is allocated again when the next sequence is admitted. Only when no
    /// sequence is running (abort them first).
    pub fn free_cache(&mut self) -> Result<()> {
        self.settle_into_ready()?;
        let running = self.running();
        if running > 0 {
            return Err(ModelError::Generation(format!("cannot free the KV cache while {running} sequences run")));
        }
        // The graphs read the cache at the addresses they were captured with; they are captured again on the
        // next cache's first steps.
        if let Some(graphs) = &self.graphs {
            self.graphs = Some(DecodeGraphs::new(graphs.device())?);
        }
        self.cache = None;
        self.presence = None;
        Ok(())
    }

    /// Swaps in weights (a blob from [`CausalLm::to_safetensors_bytes`], or an adapter's after
    /// [`Self::with_lora`]) between two steps. Running sequences
    /// keep their cached keys and values and continue under the new weights; their outputs' version span shows
    /// it.
    pub fn load_weights(&mut self, safetensors: &[u8], version: u64) -> Result<()> {
        match &self.lora {
            Some(merger) => merger.apply(&mut self.model, safetensors)?,
            None => self.model.load_safetensors_bytes(safetensors)?,
        }
        self.version = version;
        Ok(())
    }

    /// Admits waiting sequences into free slots, runs one decode step over the running ones, samples one token
    /// per sequence and returns the sequences that finished (with deferred stop checks: those whose stop the host
    /// read this step, which ended one step earlier).
    pub fn step(&mut self) -> Result<Vec<SequenceOutput>> {
        let mut out = std::mem::take(&mut self.ready);
        if self.cache.is_none() && !self.waiting.is_empty() {
            self.cache = Some(SlotCache::new(&self.model, self.slots as i64, self.config.max_model_len as i64)?);
        }
        self.admit()?;
        self.compact()?;
        // Sequences admitted this step carry their prefill logits; the others decode, except those whose last
        // token is sampled.
        let decoding: Vec<usize> = (0..self.slots)
            .filter(|&s| self.rows[s].as_ref().is_some_and(|r| r.fresh.is_none() && !r.closing))
            .collect();
        let fresh: Vec<usize> =
            (0..self.slots).filter(|&s| self.rows[s].as_ref().is_some_and(|r| r.fresh.is_some())).collect();
        if decoding.is_empty() && fresh.is_empty() {
            self.settle(&mut out)?;
            return Ok(out);
        }
        let mut parts: Vec<Tensor> = Vec::with_capacity(2);
        if let Some(logits) = self.decode(&decoding)? {
            parts.push(logits);
        }
        for &s in &fresh {
            if let Some(logits) = self.rows[s].as_mut().and_then(|r| r.fresh.take()) {
                parts.push(logits);
            }
        }
        // Sampling order: the decoded slots, then the admitted ones.
        let order: Vec<usize> = decoding.iter().chain(&fresh).copied().collect();
        let b = order.len();
        let logits = if parts.len() == 1 { parts.remove(0) } else { Tensor::f_cat(&parts, 0)? };
        let mut params: Vec<RowSampling> = Vec::with_capacity(b);
        let mut uniforms: Vec<f64> = Vec::with_capacity(b);
        let mut serials: Vec<u64> = Vec::with_capacity(b);
        let max_len = self.config.max_model_len as i64;
        for &s in &order {
            let row = self.rows[s].as_mut().ok_or_else(|| ModelError::Generation(format!("slot {s} is empty")))?;
            params.push(row.shared.row);
            uniforms.push(1.0 - row.rng.gen::<f64>());
            serials.push(row.serial);
            row.sampled += 1;
            // the next decode would write position `cached`, which must exist
            row.closing = row.sampled >= row.shared.max_tokens || row.cached >= max_len;
        }
        let order_index = match &self.presence {
            Some(p) => {
                let slots: Vec<i64> = order.iter().map(|&s| s as i64).collect();
                Some(Tensor::from_slice(&slots).f_to_device(p.device())?)
            }
            None => None,
        };
        let presence = match (&self.presence, &order_index) {
            (Some(p), Some(index)) => Some(p.f_index_select(0, index)?),
            _ => None,
        };
        let (tokens, logprobs) =
            sampler::sample(&logits, &params, &uniforms, presence.as_ref(), self.config.logprobs_mode)?;
        if let (Some(presence), Some(index)) = (&mut self.presence, &order_index) {
            let yes = Tensor::f_ones([b as i64], (Kind::Bool, presence.device()))?;
            let _ = presence.f_index_put_(&[Some(index), Some(&tokens)], &yes, false)?;
        }
        self.stats.steps += 1;
        let sampled = self.to_host(serials, tokens, logprobs)?;
        // The previous step's tokens (deferred) or this step's.
        let previous = self.pending.replace(sampled);
        if self.defer {
            self.settle_one(previous, &mut out)?;
        } else {
            self.settle(&mut out)?;
        }
        Ok(out)
    }

    /// Starts the copy of a step's samples to the host (on CUDA non-blocking, behind an event).
    fn to_host(&self, serials: Vec<u64>, tokens: Tensor, logprobs: Tensor) -> Result<Pending> {
        let version = self.version;
        match tokens.device() {
            tch::Device::Cuda(index) => {
                let host = |t: &Tensor, kind: Kind| t.f_to_device_(tch::Device::Cpu, kind, true, false);
                let (host_tokens, host_logprobs) = (host(&tokens, Kind::Int64)?, host(&logprobs, Kind::Float)?);
                let copied = jetrl_torch_ext::CudaEvent::record(index)
                    .map_err(|e| ModelError::Generation(format!("reading sampled tokens: {e}")))?;
                Ok(Pending {
                    serials,
                    device_tokens: tokens,
                    tokens: host_tokens,
                    logprobs: host_logprobs,
                    copied: Some(copied),
                    version,
                })
            }
            _ => {
                Ok(Pending { serials, device_tokens: tokens.shallow_clone(), tokens, logprobs, copied: None, version })
            }
        }
    }

    /// Reads the pending samples now; sequences they finish are returned by the next `step`.
    fn settle_into_ready(&mut self) -> Result<()> {
        let mut finished = Vec::new();
        self.settle(&mut finished)?;
        self.ready.extend(finished);
        Ok(())
    }

    /// Reads the pending samples, if any, into their sequences (see [`Self::settle_one`]).
    fn settle(&mut self, out: &mut Vec<SequenceOutput>) -> Result<()> {
        let pending = self.pending.take();
        self.settle_one(pending, out)
    }

    /// Appends a step's samples to their sequences (those still running: a sequence that ended meanwhile drops
    /// the token it sampled after its end) and moves the sequences that finished into `out`.
    fn settle_one(&mut self, pending: Option<Pending>, out: &mut Vec<SequenceOutput>) -> Result<()> {
        let Some(p) = pending else { return Ok(()) };
        if let Some(copied) = &p.copied {
            copied.synchronize().map_err(|e| ModelError::Generation(format!("reading sampled tokens: {e}")))?;
        }
        let tokens = Vec::<i64>::try_from(&p.tokens)?;
        let logprobs = Vec::<f32>::try_from(&p.logprobs)?;
        let slot_of: std::collections::HashMap<u64, usize> =
            (0..self.slots).filter_map(|s| self.rows[s].as_ref().map(|r| (r.serial, s))).collect();
        let mut finished: Vec<(usize, Finish)> = Vec::new();
        for ((serial, &token), &logprob) in p.serials.iter().zip(&tokens).zip(&logprobs) {
            let Some(&s) = slot_of.get(serial) else { continue };
            if finished.iter().any(|(f, _)| *f == s) {
                continue;
            }
            let token = u32::try_from(token)
                .map_err(|_| ModelError::Generation(format!("sampled an invalid token id {token}")))?;
            let version = p.version;
            let row = self.rows[s].as_mut().ok_or_else(|| ModelError::Generation(format!("slot {s} is empty")))?;
            if row.version_runs.last().is_none_or(|&(_, v)| v != version) {
                row.version_runs.push((row.tokens.len() as u32, version));
            }
            row.tokens.push(token);
            row.logprobs.push(logprob);
            row.min_version = Some(row.min_version.map_or(version, |v| v.min(version)));
            row.max_version = row.max_version.max(version);
            if row.first_token.is_none() {
                row.first_token = Some(row.shared.added.elapsed());
            }
            self.stats.generated_tokens += 1;
            if let Some(finish) = self.finish_of(s, token) {
                finished.push((s, finish));
            }
        }
        let slots: Vec<usize> = finished.iter().map(|(s, _)| *s).collect();
        for (row, (_, finish)) in self.remove_rows(&slots).into_iter().zip(finished) {
            out.push(row.into_output(finish, self.version));
        }
        Ok(())
    }

    /// One decode step for the sequences in `decoding` (ascending slots): the logits `[decoding.len(), V]`, in
    /// that order. The step runs over slots `0..batch`; the others in that range get a token of 0 at the scratch
    /// position `max_model_len - 1` (see [`forward::decode`]).
    fn decode(&mut self, decoding: &[usize]) -> Result<Option<Tensor>> {
        let Some(&highest) = decoding.last() else { return Ok(None) };
        let max_len = self.config.max_model_len as i64;
        let batch = self.shapes.batch(highest + 1, self.slots);
        let mut ids = vec![0i64; batch];
        let mut positions = vec![max_len - 1; batch];
        let mut furthest = 0;
        // sequences whose newest token the host has not read: (slot, its index in the pending samples)
        let mut unread: Vec<(i64, i64)> = Vec::new();
        let pending_index: std::collections::HashMap<u64, usize> = match &self.pending {
            Some(p) => p.serials.iter().enumerate().map(|(k, &serial)| (serial, k)).collect(),
            None => std::collections::HashMap::new(),
        };
        for &s in decoding {
            let row = self.rows[s].as_ref().ok_or_else(|| ModelError::Generation(format!("slot {s} is empty")))?;
            if row.sampled > row.tokens.len() {
                let k = pending_index.get(&row.serial).ok_or_else(|| {
                    ModelError::Generation(format!("slot {s}: its newest token is neither read nor pending"))
                })?;
                unread.push((s as i64, *k as i64));
            } else {
                ids[s] = i64::from(row.tokens.last().copied().unwrap_or(0));
            }
            positions[s] = row.cached;
            furthest = furthest.max(row.cached);
        }
        let width = self.shapes.width(furthest + 1, max_len);
        self.inputs.fill(&ids, &positions)?;
        if let (false, Some(p)) = (unread.is_empty(), &self.pending) {
            let (slots, picks): (Vec<i64>, Vec<i64>) = unread.into_iter().unzip();
            let device = p.device_tokens.device();
            let slots = Tensor::from_slice(&slots).f_to_device(device)?;
            let picks = Tensor::from_slice(&picks).f_to_device(device)?;
            self.inputs.set_ids(batch as i64, &slots, &p.device_tokens.f_index_select(0, &picks)?)?;
        }
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::Generation("the KV cache is freed".into()))?;
        let (b, w) = (batch as i64, width);
        let (model, fused, inputs) = (&self.model, &self.fused, &self.inputs);
        let mut step = || forward::decode(model, fused, cache, inputs, b, w);
        let logits = match &mut self.graphs {
            Some(graphs) => graphs.replay(b, w, step)?,
            None => step()?,
        };
        let routes = self.take_routes()?;
        let per_token = routes.as_ref().map_or(0, |r| r.len() / batch.max(1));
        for &s in decoding {
            if let Some(row) = self.rows[s].as_mut() {
                row.cached += 1;
                if let Some(routes) = &routes {
                    row.routes.extend_from_slice(&routes[s * per_token..(s + 1) * per_token]);
                }
            }
        }
        self.stats.decoded_slots += batch as u64;
        self.stats.decoded_rows += decoding.len() as u64;
        if decoding.len() == batch {
            // every slot of the batch decodes (decoding is ascending and within 0..batch): no gather; a graph's
            // logits stay valid until the next step's replay
            return Ok(Some(logits));
        }
        let index: Vec<i64> = decoding.iter().map(|&s| s as i64).collect();
        let index = Tensor::from_slice(&index).f_to_device(logits.device())?;
        Ok(Some(logits.f_index_select(0, &index)?))
    }

    fn take_routes(&self) -> Result<Option<Vec<u16>>> {
        take_routes(&self.model, self.config.return_routed_experts)
    }

    /// Runs steps until every request held has finished; outputs in completion order.
    /// Runs steps until every request held has finished; outputs in completion order.
    pub fn run_to_completion(&mut self) -> Result<Vec<SequenceOutput>> {
        let mut out = Vec::new();
        while self.has_work() {
            out.extend(self.step()?);
        }
        Ok(out)
    }

    fn holds(&self, id: RequestId) -> bool {
        self.rows.iter().flatten().any(|r| r.shared.id == id)
            || self.waiting.iter().any(|w| w.shared.id == id)
            || self.ready.iter().any(|o| o.request == id)
    }

    /// Why the sequence in slot `s` ends after sampling `token`, if it does.
    fn finish_of(&self, s: usize, token: u32) -> Option<Finish> {
        let row = self.rows[s].as_ref()?;
        let shared = &row.shared;
        if shared.sampling.stop_token_ids.contains(&token) {
            return Some(Finish::StopToken(token));
        }
        if !shared.sampling.ignore_eos && self.config.eos_token_ids.contains(&token) {
            return Some(Finish::Eos(token));
        }
        if let (Some(detok), false) = (&self.detokenizer, shared.sampling.stop.is_empty()) {
            // A stop string completed by this token lies within the last `stop_window` tokens (every token
            // decodes to at least one byte); anything earlier would have stopped the sequence before.
            let start = row.tokens.len().saturating_sub(shared.stop_window);
            if let Some(text) = detok(&row.tokens[start..]) {
                if let Some(hit) = shared.sampling.stop.iter().find(|s| text.contains(s.as_str())) {
                    return Some(Finish::StopString(hit.clone()));
                }
            }
        }
        // `max_tokens` reached or the slot full (decided when the token was sampled)
        if row.closing && row.tokens.len() == row.sampled {
            return Some(Finish::Length);
        }
        None
    }

    /// Takes the sequences out of `slots` (in that order), leaving the slots free.
    fn remove_rows(&mut self, slots: &[usize]) -> Vec<Row> {
        slots.iter().filter_map(|&s| self.rows[s].take()).collect()
    }
}

impl Row {
    fn with_sampled(mut self) -> Self {
        self.sampled = self.tokens.len();
        self
    }

    fn into_output(self, finish: Finish, version: u64) -> SequenceOutput {
        let routed_experts = match self.shared.context_routes.get() {
            Some(context) => {
                // a token's routes are recorded when a forward pass reads it: every token but the newest, and a
                // deferred stop check may have read one more
                let prefix = self.shared.prefix.as_ref().map_or(0, |p| p.tokens.len());
                let tokens = self.shared.context.len() + self.tokens.len().saturating_sub(prefix);
                let per_token =
                    if self.shared.context.is_empty() { 0 } else { context.len() / self.shared.context.len() };
                let mut all = context.clone();
                all.extend_from_slice(&self.routes);
                all.truncate(tokens.saturating_sub(1) * per_token);
                all
            }
            None => Vec::new(),
        };
        SequenceOutput {
            routed_experts,
            request: self.shared.id,
            index: self.index,
            tokens: self.tokens,
            logprobs: self.logprobs,
            finish,
            min_version: self.min_version.unwrap_or(version),
            max_version: if self.min_version.is_some() { self.max_version } else { version },
            version_runs: self.version_runs,
            time_to_first_token: self.first_token,
        }
    }
}

/// The routes `model` recorded since the last take, token-major (`[token][sparse layer][top_k]`) on the host;
/// `None` unless `recording` (the engine returns routed experts).
pub(super) fn take_routes(model: &CausalLm, recording: bool) -> Result<Option<Vec<u16>>> {
    if !recording {
        return Ok(None);
    }
    let layers = model.take_routes()?;
    if layers.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let stacked = Tensor::f_stack(&layers, 1)?.f_to_kind(tch::Kind::Int)?.f_to_device(tch::Device::Cpu)?;
    let flat = Vec::<i32>::try_from(stacked.f_reshape([-1])?)
        .map_err(|e| ModelError::Generation(format!("reading the routed experts: {e}")))?;
    Ok(Some(flat.into_iter().map(|e| e as u16).collect()))
}

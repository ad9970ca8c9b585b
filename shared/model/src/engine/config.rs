//! The engine's fixed budget ([`EngineConfig`]) and its counters ([`EngineStats`]).

use jetrl_config::LogprobsMode;

/// The fixed budget of an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_num_seqs: usize,
    /// Positions per sequence (context + generated); longer requests are refused, `max_tokens` is clamped.
    pub max_model_len: usize,
    /// Token positions in the KV cache over all sequences; the engine runs
    /// `min(max_num_seqs, kv_cache_tokens / max_model_len)` sequences at once. `None`: `max_num_seqs` rows.
    pub kv_cache_tokens: Option<usize>,
    /// Seeds requests that bring no seed of their own (mixed with the request id).
    pub seed: u64,
    /// Tokens that end a sequence unless its request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    pub logprobs_mode: LogprobsMode,
    /// Decode eagerly on CUDA instead of replaying CUDA graphs (vLLM's and verl's `enforce_eager`). The CPU is
    /// always eager.
    pub enforce_eager: bool,
    /// Round decode steps up to the graph buckets (batch 1, 2, 4, … slots; attention width a power of two).
    /// `None`: exactly when decoding through CUDA graphs. `Some(true)` on the CPU runs the graph path's shapes
    /// (padded slots, scratch positions, compaction at bucket boundaries) eagerly, to test them.
    pub bucketed: Option<bool>,
    /// A context longer than this is prefilled this many tokens at a time (its attention scores are `chunk ×
    /// context` per pass instead of `context²`).
    pub prefill_chunk: usize,
    /// Read each step's sampled tokens on the host one step later, while the next step runs: a sequence that
    /// stopped is found one step late and the token it sampled meanwhile is dropped (its outputs are unchanged).
    /// `None`: on any device but the CPU, where the host reads tensors without waiting anyway.
    pub defer_stop_checks: Option<bool>,
    /// Record the experts each token of an MoE model was routed to, returned with each sequence
    /// ([`crate::SequenceOutput::routed_experts`]; vLLM's `enable_return_routed_experts`). Refused for a dense
    /// model.
    pub return_routed_experts: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_model_len: 1024,
            kv_cache_tokens: None,
            seed: 0,
            eos_token_ids: Vec::new(),
            logprobs_mode: LogprobsMode::Processed,
            enforce_eager: false,
            bucketed: None,
            prefill_chunk: 2048,
            defer_stop_checks: None,
            return_routed_experts: false,
        }
    }
}

/// A snapshot of the engine's load, for metrics and heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Sequences in KV rows right now.
    pub running: usize,
    /// Samples submitted but not yet admitted (the queue).
    pub waiting: usize,
    pub slots: usize,
    /// Cached positions over running sequences, and the cache's capacity.
    pub kv_tokens_used: u64,
    pub kv_tokens_capacity: u64,
    /// Totals since start: tokens sampled, context tokens prefilled, decode steps.
    pub generated_tokens: u64,
    pub prefill_tokens: u64,
    pub steps: u64,
    pub version: u64,
    /// Slots computed by decode steps, free ones inside the batch included, and the sequences among them (the
    /// difference is what padding a batch up to its bucket costs); sequences moved to a lower slot.
    pub decoded_slots: u64,
    pub decoded_rows: u64,
    /// Forward passes prefill took (several contexts share one, up to `prefill_chunk` tokens).
    pub prefill_passes: u64,
    pub moved_rows: u64,
    /// CUDA graphs captured (0 when decoding eagerly).
    pub graphs: usize,
}

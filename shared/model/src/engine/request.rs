//! What a caller hands the engine and gets back: a [`Request`] with its [`Sampling`] (and a [`Prefix`] to resume
//! from), and one [`SequenceOutput`] per sample with its [`Finish`].

use std::sync::Arc;
use std::time::Duration;

use super::sampler::RowSampling;
use crate::error::{ModelError, Result};

/// A request's handle, chosen by the caller (unique among the requests the engine holds).
pub type RequestId = u64;

/// Turns generated token ids into text, for stop strings (the tokenizer's decode without special tokens).
pub type Detokenizer = Arc<dyn Fn(&[u32]) -> Option<String> + Send + Sync>;

/// Which log-prob is recorded per sampled token (verl's `rollout.logprobs_mode`).
pub use jetrl_config::LogprobsMode;

/// How one request is sampled (vLLM's `SamplingParams`, the subset RL rollouts use).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax; log-probs at temperature 1).
    pub temperature: f32,
    /// Nucleus mass kept, in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Most likely tokens kept; `<= 0` disables.
    pub top_k: i64,
    /// HF/vLLM repetition penalty over prompt and output tokens; 1 disables.
    pub repetition_penalty: f32,
    /// Tokens generated at most, a resumed prefix included (the stop token counts).
    pub max_tokens: usize,
    /// Ids that end the sequence besides the model's EOS ids (always honoured, also with `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Texts that end the sequence once the generated text contains one (the token completing it is kept).
    pub stop: Vec<String>,
    /// Seeds the sequence's random stream; `None` takes one from the engine's seed and the request id.
    pub seed: Option<u64>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            repetition_penalty: 1.0,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            seed: None,
            ignore_eos: false,
        }
    }
}

impl Sampling {
    /// The greedy settings verl validates with (`val_kwargs`: temperature 0, top-p 1, top-k off).
    pub fn greedy(max_tokens: usize) -> Self {
        Sampling { temperature: 0.0, max_tokens, ..Sampling::default() }
    }

    pub(super) fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(ModelError::Generation(what));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature must be finite and >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("a stop string is empty".into());
        }
        Ok(())
    }

    pub(super) fn row(&self) -> RowSampling {
        RowSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

/// Tokens generated before an abort, to continue from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Prefix {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub min_version: u64,
    pub max_version: u64,
    /// which version sampled which tokens, see [`SequenceOutput::version_runs`]
    pub version_runs: Vec<(u32, u64)>,
}

/// One prompt to sample `n` times.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub n: usize,
    pub sampling: Sampling,
    /// Continue a sequence that was aborted: its tokens are appended to the context and kept in the output.
    /// Requires `n == 1`.
    pub resume: Option<Prefix>,
    /// The sample index of the first sample (outputs are numbered `first_sample..first_sample + n`, and sample
    /// `i` draws from random stream `(seed, i)`); resuming sample 5 of a group passes 5.
    pub first_sample: usize,
}

impl Request {
    pub fn new(prompt: Vec<u32>, n: usize, sampling: Sampling) -> Self {
        Request { prompt, n, sampling, resume: None, first_sample: 0 }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// The model's EOS token (the last token).
    Eos(u32),
    /// One of the request's stop token ids (the last token).
    StopToken(u32),
    /// The generated text contains this stop string.
    StopString(String),
    /// `max_tokens`, or the KV slot is full.
    Length,
    /// [`Engine::abort`]: the tokens so far are a prefix to resume from.
    Aborted,
}

impl Finish {
    /// A natural end (EOS, stop token or stop string), as opposed to a truncation or an abort.
    pub fn is_stop(&self) -> bool {
        matches!(self, Finish::Eos(_) | Finish::StopToken(_) | Finish::StopString(_))
    }

    pub fn label(&self) -> &'static str {
        match self {
            Finish::Eos(_) | Finish::StopToken(_) | Finish::StopString(_) => "stop",
            Finish::Length => "length",
            Finish::Aborted => "aborted",
        }
    }
}

/// One finished (or aborted) sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceOutput {
    pub request: RequestId,
    /// Sample index (`first_sample + i`).
    pub index: usize,
    /// Generated tokens, a resumed prefix included.
    pub tokens: Vec<u32>,
    /// One per token, see [`LogprobsMode`].
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// Lowest and highest weight version the tokens were sampled under (the current version when there are
    /// none).
    pub min_version: u64,
    pub max_version: u64,
    /// `(first token index, version)` of each run of tokens sampled under one weight version, in order: a
    /// sequence that crossed a weight swap has more than one (what partial rollout is checked against).
    pub version_runs: Vec<(u32, u64)>,
    /// From [`Engine::add_request`] to this sequence's first new token.
    pub time_to_first_token: Option<Duration>,
    /// With [`crate::EngineConfig::return_routed_experts`]: the experts every token of the prompt and the
    /// generated tokens was routed to, token-major (`[token][sparse layer][top_k]`), for every token a forward
    /// pass read: all but the last generated one. Empty otherwise.
    pub routed_experts: Vec<u16>,
}

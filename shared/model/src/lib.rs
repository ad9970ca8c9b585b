//! jetrl's model: Qwen2 / Llama / Qwen3 decoders and the Qwen2-MoE / Qwen3-MoE mixtures of experts in libtorch (`tch`), loaded from and saved to HF checkpoints,
//! with the HF tokenizer and chat template, batched generation and the log-probs a trainer recomputes.
//!
//! - [`config`]: `config.json` → [`ModelConfig`] (both RoPE layouts, Llama-3 scaling, Qwen3 q/k norm).
//! - [`layers`]: one struct per layer (`RmsNorm`, `Attention`, `Mlp`, RoPE); [`decoder`]: `DecoderLayer`.
//! - [`moe`]: the mixture-of-experts feed-forward (Qwen2-MoE, Qwen3-MoE), router replay, the load-balancing loss.
//! - [`model`]: [`CausalLm`]: parameters in a `VarStore` under HF names; `forward` for training; safetensors
//!   load/save and in-memory weight swaps.
//! - [`tokenizer`] and [`chat_template`]: `tokenizer.json`, special tokens, `apply_chat_template` (re-exported from
//!   the libtorch-free `jetrl-tokenizer`, so services that only handle text need not link libtorch).
//! - [`recompute`]: the log-probs a trainer recomputes on the training forward ([`log_probs_of`],
//!   [`token_log_probs`]).
//! - [`engine`]: the rollout engine ([`Engine`]): continuous batching over a preallocated slot KV cache, group
//!   forks, per-request sampling and seeds, weight swaps between steps, abort and resume.
//! - [`lora`]: LoRA adapters in PEFT's layout: training, the reference with adapters off, adapter-only weight
//!   blobs, merging ([`LoraMerger`] for a rollout engine, [`CausalLm::merge_lora`] for export).
//! - [`init`]: random-init HF model directories ([`init_model`]).
//! - [`device`]: `cpu` / `cuda:N` and `f32` / `bf16` strings.
//!
//! Everything runs on the thread that owns the model: `Tensor` is `Send` but not `Sync`.

mod adapter;
pub mod config;
pub mod decoder;
pub mod device;
pub mod engine;
pub mod error;
pub mod init;
pub mod layers;
pub mod lora;
pub mod model;
pub mod moe;
pub mod recompute;
mod routing;
mod weights;

pub use config::{Architecture, ModelConfig, MoeConfig, RopeScaling};
pub use device::{parse_device, resolve_device, set_torch_threads, DType};
pub use engine::{
    Engine, EngineConfig, EngineStats, Finish, LogprobsMode, Prefix, Request, RequestId, Sampling, SequenceOutput,
};
pub use error::{ModelError, Result};
pub use init::{init_model, TOOL_CALL_TOKENS};
pub use jetrl_tokenizer::{chat_template, tokenizer, ChatTemplate, Tokenizer, TokenizerError};
pub use lora::{AdapterConfig, LoraMerger, LoraSpec, Targets, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
pub use model::{copy_side_files, CausalLm, Checkpoints, Packed, CONFIG_FILE};
pub use moe::load_balancing_loss;
pub use recompute::{log_probs_of, token_log_probs};
pub use weights::{WEIGHTS_FILE, WEIGHTS_INDEX_FILE};

/// Tokenizer failures keep the variants they had when the tokenizer lived in this crate.
impl From<TokenizerError> for ModelError {
    fn from(err: TokenizerError) -> Self {
        match err {
            TokenizerError::Io { path, source } => ModelError::Io { path, source },
            TokenizerError::Json { what, source } => ModelError::Json { what, source },
            TokenizerError::Config(reason) => ModelError::Config(reason),
            TokenizerError::Tokenizer(reason) => ModelError::Tokenizer(reason),
            TokenizerError::ChatTemplate(reason) => ModelError::ChatTemplate(reason),
        }
    }
}

//! The jetrl command line's library part: what its commands do that tests drive directly.
//!
//! - [`logprobs`]: the JSON-lines driver behind `jetrl logprobs`.
//! - [`export`]: `jetrl export --merge` (a LoRA adapter folded into its base model).

pub mod export;
pub mod logprobs;

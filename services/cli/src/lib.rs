//! The jetrl command line's library part: what its commands do that tests drive directly.
//!
//! - [`logprobs`]: the JSON-lines driver behind `jetrl logprobs`.

pub mod logprobs;

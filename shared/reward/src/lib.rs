//! Reward scoring for jetrl: verl's rule scorers, out-of-process user functions and remote reward models,
//! behind one batching façade the reward service calls.
//!
//! ```text
//! RewardEngine::score_batch(Vec<ScoreInput>) -> Vec<ScoreOutcome>
//!   ├─ reward.custom_reward_function set  → external::ExternalRunner   (JSON lines over stdin/stdout)
//!   ├─ reward.reward_model.enable         → remote_rm::RemoteRewardModel (vLLM /classify, SGLang /v1/embeddings;
//!   │                                       chat messages rendered with the RM's template, jetrl-tokenizer)
//!   └─ otherwise                          → rule::default_compute_score  (by data_source)
//!   then overlong::apply_overlong_penalty (DAPO, rule and external routes), metrics
//! ```
//!
//! # Public API
//!
//! - [`RewardEngine::new`]`(&RewardConfig) -> Result<RewardEngine, RewardError>` validates `reward.*`, picks the
//!   route verl would pick, and starts user-function processes.
//! - [`RewardEngine::score_batch`]`(&self, Vec<ScoreInput>) -> Vec<ScoreOutcome>`: one outcome per input, in
//!   order; never fails, never panics. A trajectory that cannot be scored gets `score = 0.0`, a
//!   `failure_reason` and a stable [`FailureKind`]. [`ScoreInput::raw_prompt`] (the prompt's [`ChatTurn`]s) is what
//!   a reward model with `reward.reward_model.tokenizer_path` renders, as verl does; otherwise it reads
//!   `prompt_str` + response + `response_suffix`.
//! - [`rule::default_compute_score`]`(data_source, solution_str, ground_truth, &RuleScorerConfig)
//!   -> Result<RewardResult, RuleError>`: verl's dispatcher (`openai/gsm8k`, the MATH sources, `math_dapo`/`math`/
//!   `aime*`, `searchR1_*`) plus jetrl's `jetrl/*` digit tasks; an unknown source is
//!   [`rule::RuleError::UnknownDataSource`].
//! - [`RewardResult`] `{score, extra, extra_text}` and its verl normalisation ([`RewardResult::from_json`]: a dict
//!   passes through, a number becomes the score and `acc`, a bool counts 0/1, a list gives its first element).
//! - [`overlong::apply_overlong_penalty`]: the DAPO soft overlong punishment.
//! - [`golden::check_case`]: checks one `"fn": "reward"` golden case.
//!
//! Metrics (the `metrics` facade): `jetrl_reward_scores_total{data_source}` (successful scores; at most 64
//! distinct sources, then `other`), `jetrl_reward_score_latency_seconds{scorer}`,
//! `jetrl_reward_failures_total{reason}` (the [`FailureKind`] strings) and
//! `jetrl_reward_external_restarts_total`.
//!
//! The user-function protocol is specified in `PROTOCOL.md` next to this crate's `Cargo.toml`;
//! `examples/reward_fn.py` implements it.

mod engine;
mod error;
pub mod external;
mod failure;
pub mod golden;
mod input;
pub mod overlong;
mod pytext;
pub mod remote_rm;
mod result;
pub mod rule;

pub use engine::{RewardEngine, ScoreOutcome, FAILURES_METRIC, LATENCY_METRIC, SCORES_METRIC};
pub use error::RewardError;
pub use failure::{FailureKind, ScoreFailure};
pub use input::{ChatTurn, ScoreInput};
pub use result::{ResultError, RewardResult};

//! A discriminative reward model behind an inference server (verl's `compute_score_disrm`): vLLM
//! `POST /classify` → `data[-1].probs[-1]`, SGLang `POST /v1/embeddings` → `data[-1].embedding[-1]`.
//! Failed exchanges and 5xx answers are retried with exponential backoff (capped); 4xx answers are not.
//! A semaphore bounds the requests in flight.
//!
//! What the model reads (verl's `RewardLoopWorker._preprocess_reward_inputs`): with the RM's tokenizer
//! (`reward.reward_model.tokenizer_path`) and the trajectory's chat messages, the messages plus the response as
//! the assistant turn rendered with the RM's chat template (`add_generation_prompt=False`), a leading BOS
//! stripped (the server adds its own). Without either, the prompt text the caller supplied, the response and
//! `response_suffix`.

use std::time::Duration;

use jetrl_config::{RewardModelApi, RewardModelConfig};
use jetrl_telemetry::http::{post_json, HttpEndpoint, HttpError};
use jetrl_telemetry::Delays;
use jetrl_tokenizer::{Tokenizer, TokenizerError};
use tokio::sync::Semaphore;

use crate::failure::FailureKind;
use crate::input::{ChatTurn, ScoreInput};
use crate::result::truncate_for_message;

/// Why the reward model gave no score.
#[derive(Debug, thiserror::Error)]
pub enum RemoteRmError {
    #[error("reward_model.url: {0}")]
    Endpoint(HttpError),
    #[error("reward_model.tokenizer_path {path}: {source}")]
    TokenizerSetup { path: String, source: TokenizerError },
    #[error("rendering the prompt with the reward model's chat template: {0}")]
    PromptRender(TokenizerError),
    #[error("request failed after {attempts} attempt(s): {last}")]
    Exchange { attempts: u32, last: HttpError },
    #[error("HTTP {status} after {attempts} attempt(s): {body}")]
    Status { status: u16, attempts: u32, body: String },
    #[error("answer is not JSON after {attempts} attempt(s): {message}")]
    UnreadableAnswer { attempts: u32, message: String },
    #[error("answer has no score at {location}: {body}")]
    MissingScore { location: &'static str, body: String },
    #[error("score is not finite: {0}")]
    NonFiniteScore(f64),
}

impl RemoteRmError {
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::Endpoint(_) | Self::Exchange { .. } => FailureKind::HttpTransport,
            Self::TokenizerSetup { .. } | Self::PromptRender(_) => FailureKind::PromptRender,
            Self::Status { .. } => FailureKind::HttpStatus,
            Self::UnreadableAnswer { .. } | Self::MissingScore { .. } => FailureKind::RewardModelResponse,
            Self::NonFiniteScore(_) => FailureKind::NonFiniteScore,
        }
    }
}

/// One attempt's outcome, before the retry decision.
enum AttemptError {
    Retryable(RemoteRmError),
    Final(RemoteRmError),
}

pub struct RemoteRewardModel {
    endpoint: HttpEndpoint,
    api: RewardModelApi,
    model: String,
    response_suffix: String,
    /// the RM's tokenizer and chat template, when configured: the prompt is rendered the way verl renders it
    tokenizer: Option<Tokenizer>,
    attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    request_timeout: Duration,
    in_flight: Semaphore,
}

impl RemoteRewardModel {
    pub fn new(config: &RewardModelConfig) -> Result<Self, RemoteRmError> {
        let tokenizer = match config.tokenizer_path.as_deref() {
            Some(path) => Some(
                Tokenizer::from_dir(std::path::Path::new(path))
                    .map_err(|source| RemoteRmError::TokenizerSetup { path: path.to_string(), source })?,
            ),
            None => None,
        };
        if let Some(tokenizer) = &tokenizer {
            if tokenizer.chat_template().is_none() {
                return Err(RemoteRmError::TokenizerSetup {
                    path: config.tokenizer_path.clone().unwrap_or_default(),
                    source: TokenizerError::ChatTemplate("the reward model's tokenizer has no chat template".into()),
                });
            }
        }
        Ok(Self {
            endpoint: HttpEndpoint::parse(&config.url).map_err(RemoteRmError::Endpoint)?,
            api: config.api,
            model: config.model.clone(),
            response_suffix: config.response_suffix.clone(),
            tokenizer,
            attempts: config.retries.max(1),
            first_backoff: Duration::from_secs_f64(config.backoff_s.max(0.0)),
            max_backoff: Duration::from_secs_f64(config.max_backoff_s.max(0.0)),
            request_timeout: Duration::from_secs_f64(config.request_timeout_s.max(0.001)),
            in_flight: Semaphore::new(config.max_concurrency.max(1)),
        })
    }

    /// Whether the RM's own chat template renders prompts (`reward.reward_model.tokenizer_path` is set).
    pub fn renders_chat(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The text the reward model reads for one trajectory (see the module docs): the chat messages and the
    /// response rendered with the RM's template when both exist, else prompt text + response + suffix.
    pub fn model_input(&self, input: &ScoreInput) -> Result<String, RemoteRmError> {
        match &self.tokenizer {
            Some(tokenizer) if !input.raw_prompt.is_empty() => {
                render_chat(tokenizer, &input.raw_prompt, &input.solution_str).map_err(RemoteRmError::PromptRender)
            }
            _ => Ok(format!("{}{}{}", input.prompt_str, input.solution_str, self.response_suffix)),
        }
    }

    /// Scores one text.
    pub async fn score(&self, input: &str) -> Result<f64, RemoteRmError> {
        let (path, payload) = match self.api {
            RewardModelApi::Vllm => {
                ("/classify", serde_json::json!({"model": self.model, "input": input, "use_activation": false}))
            }
            RewardModelApi::Sglang => ("/v1/embeddings", serde_json::json!({"model": self.model, "input": input})),
        };
        let body = payload.to_string().into_bytes();
        let answer = self.post_with_retries(path, &body).await?;
        let (location, score) = match self.api {
            RewardModelApi::Vllm => ("data[-1].probs[-1]", last(&answer["data"]).map(|item| last(&item["probs"]))),
            RewardModelApi::Sglang => {
                ("data[-1].embedding[-1]", last(&answer["data"]).map(|item| last(&item["embedding"])))
            }
        };
        let score = score
            .flatten()
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| RemoteRmError::MissingScore { location, body: truncate_for_message(&answer.to_string()) })?;
        if score.is_finite() {
            Ok(score)
        } else {
            Err(RemoteRmError::NonFiniteScore(score))
        }
    }

    async fn post_with_retries(&self, path: &str, body: &[u8]) -> Result<serde_json::Value, RemoteRmError> {
        // The semaphore is never closed, so acquiring only fails if it were; treat that as no limit.
        let _permit = self.in_flight.acquire().await.ok();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.attempt(path, body, attempt).await {
                Ok(answer) => return Ok(answer),
                Err(AttemptError::Final(error)) => return Err(error),
                Err(AttemptError::Retryable(error)) if attempt >= self.attempts => return Err(error),
                Err(AttemptError::Retryable(error)) => {
                    let delay = self.backoff(attempt);
                    tracing::warn!(attempt, max = self.attempts, ?delay, %error, "reward model request failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn attempt(&self, path: &str, body: &[u8], attempt: u32) -> Result<serde_json::Value, AttemptError> {
        let response = post_json(&self.endpoint, path, body, self.request_timeout)
            .await
            .map_err(|last| AttemptError::Retryable(RemoteRmError::Exchange { attempts: attempt, last }))?;
        let status_error = || RemoteRmError::Status {
            status: response.status,
            attempts: attempt,
            body: truncate_for_message(&String::from_utf8_lossy(&response.body)),
        };
        match response.status {
            200..=299 => serde_json::from_slice(&response.body).map_err(|e| {
                AttemptError::Retryable(RemoteRmError::UnreadableAnswer { attempts: attempt, message: e.to_string() })
            }),
            // A client error will not heal by itself.
            400..=499 => Err(AttemptError::Final(status_error())),
            _ => Err(AttemptError::Retryable(status_error())),
        }
    }

    /// 1×, 2×, 4×… the first backoff, capped.
    fn backoff(&self, failed_attempts: u32) -> Duration {
        Delays::new(self.first_backoff, self.max_backoff).nth(failed_attempts)
    }
}

/// verl: `apply_chat_template(raw_prompt + [{"role": "assistant", "content": response}],
/// add_generation_prompt=False, tokenize=False)`, then a leading BOS removed.
fn render_chat(tokenizer: &Tokenizer, raw_prompt: &[ChatTurn], response: &str) -> Result<String, TokenizerError> {
    let assistant = ChatTurn { role: "assistant".into(), content: response.to_string() };
    let chat: Vec<&ChatTurn> = raw_prompt.iter().chain(std::iter::once(&assistant)).collect();
    let rendered = tokenizer.render_chat(&chat, None::<&[serde_json::Value]>, false)?;
    Ok(match tokenizer.special_token("bos_token").filter(|bos| !bos.is_empty()) {
        Some(bos) => rendered.strip_prefix(bos).map(str::to_string).unwrap_or(rendered),
        None => rendered,
    })
}

fn last(value: &serde_json::Value) -> Option<&serde_json::Value> {
    value.as_array().and_then(|items| items.last())
}

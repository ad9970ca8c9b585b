//! Agent loops (verl's `AgentLoopBase` family): how one session of a prompt group becomes a trajectory.
//!
//! - `single_turn_agent`: one generation; the service submits the whole group as one engine request (one
//!   prefill, `n` forks), see `lib.rs`.
//! - `tool_agent` ([`ToolAgent`]): verl's ReAct state machine. The model generates; Hermes tool calls in its text
//!   are run (at most `max_parallel_calls`, concurrently, each under a timeout); their responses are appended
//!   as chat-template tool turns with response mask 0 and log-prob 0; repeat until no call, `max_assistant_turns`,
//!   `max_user_turns` or the response budget. A failed, hung or unknown tool answers with error text and reward 0.
//!
//! A row's `agent_name` picks the loop (`agent_name` parsed as [`AgentKind`]); empty means `rollout.agent.default_agent_loop`.

pub mod hermes;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use jetrl_config::{MultiTurnConfig, TruncateSide};
use jetrl_model::{Finish, Request, Sampling, SequenceOutput, Tokenizer};
use serde_json::{json, Value};

use crate::engine::{EngineError, EngineHandle};
use crate::tools::{ToolError, ToolOutput, ToolRegistry};

/// The agent loops a worker runs (verl's registered names, also without the `_agent` suffix).
pub use jetrl_config::AgentLoop as AgentKind;

/// One finished session: what becomes a `Trajectory`.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOutput {
    pub session: usize,
    pub response_ids: Vec<u32>,
    /// 1 = sampled by the policy, 0 = tool output
    pub response_mask: Vec<u8>,
    /// per response token; 0 where the mask is 0
    pub logprobs: Vec<f32>,
    pub min_version: u64,
    pub max_version: u64,
    /// `(first response position, version)` of each run of generated tokens under one weight version
    pub version_runs: Vec<(u32, u64)>,
    /// the response budget ran out (else it ended on its own or at a turn limit)
    pub truncated: bool,
    pub aborted: bool,
    pub stop_reason: StopReason,
    /// verl: user turns + assistant turns + 1 (2 for a single turn)
    pub num_turns: u32,
    /// one per tool call run, in call order (failed, hung and unknown-tool calls included, with reward 0): its
    /// length is the session's tool-call count (the trainer's `training/tool_calls/*`)
    pub tool_rewards: Vec<f64>,
    pub time_to_first_token: Option<Duration>,
    /// the experts each token of the prompt and response was routed to (R3), from the last turn's engine output,
    /// whose context held every earlier token; empty unless the engine returns them
    pub routed_experts: Vec<u16>,
}

impl SessionOutput {
    /// A single-turn session from one engine sequence.
    pub fn single_turn(output: SequenceOutput) -> Self {
        let n = output.tokens.len();
        SessionOutput {
            session: output.index,
            response_mask: vec![1; n],
            response_ids: output.tokens,
            logprobs: output.logprobs,
            min_version: output.min_version,
            max_version: output.max_version,
            version_runs: output.version_runs,
            truncated: output.finish == Finish::Length,
            aborted: output.finish == Finish::Aborted,
            stop_reason: StopReason::from(&output.finish),
            num_turns: 2,
            tool_rewards: Vec::new(),
            time_to_first_token: output.time_to_first_token,
            routed_experts: output.routed_experts,
        }
    }
}

/// Why a session ended: the last turn's own finish, or the loop's limit (the trajectory's `stop_reason` on the
/// wire is [`StopReason::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StopReason {
    /// the last turn ended with an end-of-sequence token
    #[default]
    Eos,
    /// ... with one of `rollout.stop_token_ids`
    StopToken,
    /// ... with one of `rollout.stop` strings
    StopString,
    /// the engine's per-turn token limit
    Length,
    /// the engine aborted the turn (shutdown, a superseded task)
    Aborted,
    /// the response budget (`data.max_response_length`) ran out, or the next tool turn did not fit in it
    ResponseBudget,
    /// `rollout.multi_turn.max_assistant_turns`
    MaxAssistantTurns,
    /// `rollout.multi_turn.max_user_turns`
    MaxUserTurns,
    /// the model's turn held no tool call: the answer
    NoToolCall,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::StopToken => "stop_token",
            StopReason::StopString => "stop_string",
            StopReason::Length => "length",
            StopReason::Aborted => "aborted",
            StopReason::ResponseBudget => "response_budget",
            StopReason::MaxAssistantTurns => "max_assistant_turns",
            StopReason::MaxUserTurns => "max_user_turns",
            StopReason::NoToolCall => "no_tool_call",
        }
    }
}

impl From<&Finish> for StopReason {
    fn from(finish: &Finish) -> Self {
        match finish {
            Finish::Eos(_) => StopReason::Eos,
            Finish::StopToken(_) => StopReason::StopToken,
            Finish::StopString(_) => StopReason::StopString,
            Finish::Length => StopReason::Length,
            Finish::Aborted => StopReason::Aborted,
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Generates one sequence: the engine in the service, a script in tests.
pub trait Llm: Send + Sync {
    fn generate(&self, request: Request) -> BoxFuture<'_, Result<SequenceOutput, EngineError>>;
}

impl Llm for EngineHandle {
    fn generate(&self, request: Request) -> BoxFuture<'_, Result<SequenceOutput, EngineError>> {
        Box::pin(self.generate_one(request))
    }
}

/// Why a session could not be run at all (the group fails with this reason).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("rendering the prompt: {0}")]
    Prompt(String),
    #[error("rendering tool responses: {0}")]
    ToolTurn(String),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
}

/// The tool agent's settings and the tools it offers (shared by every session of a worker).
pub struct ToolAgent {
    pub multi_turn: MultiTurnConfig,
    pub tools: ToolRegistry,
    pub tokenizer: Arc<Tokenizer>,
    pub encoder: ToolTurnEncoder,
    /// Positions an engine sequence may use (context + new tokens).
    pub max_model_len: usize,
}

/// The prompt of a tool-agent session: chat messages (rendered with the tools' schemas) or given ids.
#[derive(Debug, Clone)]
pub enum AgentPrompt {
    Messages(Vec<Value>),
    Ids(Vec<u32>),
}

/// Counters of one running session.
#[derive(Debug, Default)]
struct Turns {
    assistant: u32,
    user: u32,
}

impl ToolAgent {
    /// The prompt ids of a session (what every session of a group starts from).
    pub fn prompt_ids(&self, prompt: &AgentPrompt, tools: &ToolRegistry) -> Result<Vec<u32>, AgentError> {
        match prompt {
            AgentPrompt::Ids(ids) => Ok(ids.clone()),
            AgentPrompt::Messages(messages) => {
                let schemas = tools.schemas();
                let ids = if schemas.is_empty() {
                    self.tokenizer.apply_chat_template(messages, true)
                } else {
                    self.tokenizer.apply_chat_template_with_tools(messages, &schemas, true)
                };
                ids.map_err(|e| AgentError::Prompt(e.to_string()))
            }
        }
    }

    /// Runs session `session` of a group to its end. `budget` is the response length in tokens (generated and
    /// tool tokens together, verl's `response_length`).
    pub async fn run_session(
        &self,
        llm: &dyn Llm,
        prompt_ids: &[u32],
        tools: &ToolRegistry,
        sampling: &Sampling,
        budget: usize,
        session: usize,
    ) -> Result<SessionOutput, AgentError> {
        let mut context = prompt_ids.to_vec();
        let mut out = SessionOutput {
            session,
            response_ids: Vec::new(),
            response_mask: Vec::new(),
            logprobs: Vec::new(),
            min_version: u64::MAX,
            max_version: 0,
            version_runs: Vec::new(),
            truncated: false,
            aborted: false,
            stop_reason: StopReason::default(),
            num_turns: 0,
            tool_rewards: Vec::new(),
            time_to_first_token: None,
            routed_experts: Vec::new(),
        };
        let mut turns = Turns::default();
        let eos = self.tokenizer.eos_token_ids().to_vec();
        loop {
            let room = self.max_model_len.saturating_sub(context.len());
            let max_tokens = budget.saturating_sub(out.response_ids.len()).min(room);
            if max_tokens == 0 {
                out.truncated = true;
                out.stop_reason = StopReason::ResponseBudget;
                break;
            }
            let request = Request {
                prompt: context.clone(),
                n: 1,
                // Each turn draws from its own stream: (seed, session) for the first, shifted per turn after.
                sampling: Sampling {
                    max_tokens,
                    seed: sampling.seed.map(|s| s.wrapping_add(u64::from(turns.assistant) << 32)),
                    ..sampling.clone()
                },
                resume: None,
                first_sample: session,
            };
            let generated = llm.generate(request).await?;
            if out.time_to_first_token.is_none() {
                out.time_to_first_token = generated.time_to_first_token;
            }
            if !generated.tokens.is_empty() {
                out.min_version = out.min_version.min(generated.min_version);
                out.max_version = out.max_version.max(generated.max_version);
                // this turn's tokens start where the response is now
                let offset = out.response_ids.len() as u32;
                for &(first, version) in &generated.version_runs {
                    if out.version_runs.last().is_none_or(|&(_, v)| v != version) {
                        out.version_runs.push((offset + first, version));
                    }
                }
            }
            turns.assistant += 1;
            if !generated.routed_experts.is_empty() {
                out.routed_experts = generated.routed_experts;
            }
            context.extend_from_slice(&generated.tokens);
            out.response_mask.extend(std::iter::repeat_n(1u8, generated.tokens.len()));
            out.response_ids.extend_from_slice(&generated.tokens);
            out.logprobs.extend_from_slice(&generated.logprobs);
            out.stop_reason = StopReason::from(&generated.finish);
            if generated.finish == Finish::Aborted {
                out.aborted = true;
                break;
            }
            if generated.finish == Finish::Length {
                out.truncated = true;
                break;
            }
            if out.response_ids.len() >= budget {
                // The turn ended on its own (end-of-turn token) with the budget's last token: the loop ends for
                // the budget, as verl's does, and a tool call in it is not run.
                out.truncated = true;
                out.stop_reason = StopReason::ResponseBudget;
                break;
            }
            if self.multi_turn.max_assistant_turns.is_some_and(|m| turns.assistant >= m) {
                out.stop_reason = StopReason::MaxAssistantTurns;
                break;
            }
            if self.multi_turn.max_user_turns.is_some_and(|m| turns.user >= m) {
                out.stop_reason = StopReason::MaxUserTurns;
                break;
            }
            let text = self.tokenizer.decode(&generated.tokens, false).unwrap_or_default();
            let calls = hermes::parse(&text);
            if calls.is_empty() {
                out.stop_reason = StopReason::NoToolCall;
                break;
            }
            let parallel = (self.multi_turn.max_parallel_calls.max(1) as usize).min(calls.len());
            let results = futures::future::join_all(calls[..parallel].iter().map(|c| self.call(tools, c))).await;
            let messages: Vec<Value> = results.iter().map(|r| json!({"role": "tool", "content": r.text})).collect();
            out.tool_rewards.extend(results.iter().map(|r| r.reward));
            let ended_with_eos = generated.tokens.last().is_some_and(|t| eos.contains(t));
            let tool_ids =
                self.encoder.encode(&self.tokenizer, &messages, ended_with_eos).map_err(AgentError::ToolTurn)?;
            if out.response_ids.len() + tool_ids.len() >= budget {
                // verl: a tool turn that does not fit ends the trajectory without being appended.
                out.truncated = true;
                out.stop_reason = StopReason::ResponseBudget;
                break;
            }
            context.extend_from_slice(&tool_ids);
            out.response_mask.extend(std::iter::repeat_n(0u8, tool_ids.len()));
            out.logprobs.extend(std::iter::repeat_n(0.0f32, tool_ids.len()));
            out.response_ids.extend_from_slice(&tool_ids);
            turns.user += 1;
        }
        out.num_turns = turns.user + turns.assistant + 1;
        if out.min_version == u64::MAX {
            out.min_version = out.max_version;
        }
        Ok(out)
    }

    /// Runs one call: unknown tools, bad arguments, failures and timeouts become error text with reward 0.
    async fn call(&self, tools: &ToolRegistry, call: &hermes::ToolCall) -> ToolOutput {
        let started = std::time::Instant::now();
        let result = match tools.get(&call.name) {
            None => Err(ToolError::Arguments(format!("unknown tool `{}`", call.name))),
            Some(tool) => {
                let limit = Duration::from_secs_f64(self.multi_turn.tool_timeout_s.max(0.001));
                match tokio::time::timeout(limit, tool.call(call.arguments.clone())).await {
                    Ok(result) => result,
                    Err(_) => Err(ToolError::Timeout(limit.as_secs_f64())),
                }
            }
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(ToolError::Timeout(_)) => "timeout",
            Err(_) => "error",
        };
        metrics::counter!("jetrl_rollout_tool_calls_total", "outcome" => outcome).increment(1);
        metrics::histogram!("jetrl_rollout_tool_call_seconds").record(started.elapsed().as_secs_f64());
        let output = match result {
            Ok(output) => output,
            Err(err) => ToolOutput { text: format!("Error when executing tool: {err}"), reward: 0.0 },
        };
        ToolOutput {
            text: truncate_tool_response(
                &output.text,
                self.multi_turn.max_tool_response_length as usize,
                self.multi_turn.tool_response_truncate_side,
            ),
            reward: output.reward,
        }
    }
}

/// verl's truncation of a tool response longer than `max` characters: `left` keeps the start, `right` the end,
/// `middle` (default) both halves.
pub fn truncate_tool_response(text: &str, max: usize, side: TruncateSide) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= max {
        return text.to_string();
    }
    let take = |range: std::ops::Range<usize>| chars[range].iter().collect::<String>();
    match side {
        TruncateSide::Left => take(0..max) + "...(truncated)",
        TruncateSide::Right => "(truncated)...".to_string() + &take(chars.len() - max..chars.len()),
        TruncateSide::Middle => {
            let half = max / 2;
            take(0..half) + "...(truncated)..." + &take(chars.len() - half..chars.len())
        }
    }
}

/// Turns tool messages into the tokens that follow the assistant's turn, with the model's own chat template.
///
/// The tool turn is the text the template adds when tool messages follow a conversation (rendered once with
/// and once without them: the difference), preceded by what the template writes after an end-of-turn token
/// (ChatML's newline) and by the end-of-turn token itself when the model stopped without one.
#[derive(Debug, Clone)]
pub struct ToolTurnEncoder {
    prefix: Vec<Value>,
    base: String,
    /// text after the last end-of-turn token in `base`
    after_end: String,
    /// the end-of-turn token's text, when the template writes one
    end_text: String,
}

impl ToolTurnEncoder {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        let prefix = vec![json!({"role": "system", "content": "s"}), json!({"role": "user", "content": "u"})];
        let base = tokenizer.render_chat(&prefix, None::<&[Value]>, false).map_err(|e| e.to_string())?;
        let (end_text, after_end) = tokenizer
            .eos_token_ids()
            .iter()
            .filter_map(|&id| tokenizer.decode(&[id], false).ok().filter(|t| !t.is_empty()))
            .filter_map(|t| base.rfind(&t).map(|at| (at, t)))
            .max_by_key(|(at, _)| *at)
            .map(|(at, t)| (t.clone(), base[at + t.len()..].to_string()))
            .unwrap_or_default();
        Ok(ToolTurnEncoder { prefix, base, after_end, end_text })
    }

    /// The token ids of a tool turn holding `messages` (`{"role": "tool", "content": ...}`), ending with the
    /// template's generation prompt.
    pub fn encode(&self, tokenizer: &Tokenizer, messages: &[Value], ended_with_eos: bool) -> Result<Vec<u32>, String> {
        let mut all = self.prefix.clone();
        all.extend_from_slice(messages);
        let full = tokenizer.render_chat(&all, None::<&[Value]>, true).map_err(|e| e.to_string())?;
        let delta = full.strip_prefix(&self.base).ok_or_else(|| {
            "the chat template does not render tool messages by appending to the conversation".to_string()
        })?;
        let mut text = String::new();
        if !ended_with_eos {
            text.push_str(&self.end_text);
        }
        text.push_str(&self.after_end);
        text.push_str(delta);
        tokenizer.encode(&text, false).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_tool_responses_are_truncated_like_verl() {
        let text = "abcdefghij";
        assert_eq!(truncate_tool_response(text, 20, TruncateSide::Middle), text);
        assert_eq!(truncate_tool_response(text, 4, TruncateSide::Left), "abcd...(truncated)");
        assert_eq!(truncate_tool_response(text, 4, TruncateSide::Right), "(truncated)...ghij");
        assert_eq!(truncate_tool_response(text, 4, TruncateSide::Middle), "ab...(truncated)...ij");
    }

    #[test]
    fn agent_names_follow_verl() {
        assert_eq!("single_turn_agent".parse::<AgentKind>(), Ok(AgentKind::SingleTurn));
        assert_eq!("tool".parse::<AgentKind>(), Ok(AgentKind::Tool));
        assert!("react".parse::<AgentKind>().is_err());
    }
}

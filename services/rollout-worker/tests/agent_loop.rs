//! The tool agent loop against a scripted model: tool calls are parsed and run, tool output is appended as
//! chat-template tool turns with mask 0, and the loop stops where verl's does. Broken tools never stall it.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use jetrl_config::MultiTurnConfig;
use jetrl_model::{Finish, Request, Sampling, SequenceOutput, Tokenizer};
use jetrl_rollout_worker::agent::{AgentPrompt, Llm, SessionOutput, StopReason, ToolAgent, ToolTurnEncoder};
use jetrl_rollout_worker::engine::EngineError;
use jetrl_rollout_worker::tools::{Calculator, Tool, ToolError, ToolOutput, ToolRegistry};
use serde_json::{json, Value};

/// A model that answers each turn with the next scripted text (plus `<|im_end|>`), log-prob -0.25 per token,
/// under weight versions 3 then 4, and records the contexts it was asked to continue.
struct Script {
    tokenizer: Arc<Tokenizer>,
    turns: Mutex<VecDeque<String>>,
    seen: Mutex<Vec<Vec<u32>>>,
}

impl Script {
    fn new(tokenizer: &Arc<Tokenizer>, turns: &[&str]) -> Self {
        Script {
            tokenizer: tokenizer.clone(),
            turns: Mutex::new(turns.iter().map(|t| t.to_string()).collect()),
            seen: Mutex::new(Vec::new()),
        }
    }
}

impl Llm for Script {
    fn generate(&self, request: Request) -> BoxFuture<'_, Result<SequenceOutput, EngineError>> {
        Box::pin(async move {
            let turn = self.seen.lock().unwrap().len() as u64;
            self.seen.lock().unwrap().push(request.prompt.clone());
            let text = self.turns.lock().unwrap().pop_front().unwrap_or_else(|| "done".into());
            let mut tokens = self.tokenizer.encode(&text, false).unwrap();
            tokens.push(2);
            let (tokens, finish) = if tokens.len() > request.sampling.max_tokens {
                (tokens[..request.sampling.max_tokens].to_vec(), Finish::Length)
            } else {
                (tokens, Finish::Eos(2))
            };
            Ok(SequenceOutput {
                request: 0,
                index: request.first_sample,
                logprobs: vec![-0.25; tokens.len()],
                tokens,
                finish,
                min_version: 3 + turn.min(1),
                max_version: 3 + turn.min(1),
                version_runs: vec![(0, 3 + turn.min(1))],
                time_to_first_token: Some(Duration::from_millis(1)),
                routed_experts: Vec::new(),
            })
        })
    }
}

struct Failing;
impl Tool for Failing {
    fn name(&self) -> &str {
        "failing"
    }
    fn schema(&self) -> Value {
        json!({"type": "function", "function": {"name": "failing", "parameters": {"type": "object"}}})
    }
    fn call(&self, _: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>> {
        Box::pin(async { Err(ToolError::Execution("the disk is on fire".into())) })
    }
}

struct Hanging;
impl Tool for Hanging {
    fn name(&self) -> &str {
        "hanging"
    }
    fn schema(&self) -> Value {
        json!({"type": "function", "function": {"name": "hanging", "parameters": {"type": "object"}}})
    }
    fn call(&self, _: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>> {
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(ToolOutput::text("never"))
        })
    }
}

struct Rewarding;
impl Tool for Rewarding {
    fn name(&self) -> &str {
        "judge"
    }
    fn schema(&self) -> Value {
        json!({"type": "function", "function": {"name": "judge", "parameters": {"type": "object"}}})
    }
    fn call(&self, _: Value) -> BoxFuture<'_, Result<ToolOutput, ToolError>> {
        Box::pin(async { Ok(ToolOutput { text: "correct".into(), reward: 1.0 }) })
    }
}

fn tokenizer() -> Arc<Tokenizer> {
    let dir = tempfile::tempdir().unwrap();
    common::write_ascii_tokenizer(dir.path());
    Arc::new(Tokenizer::from_dir(dir.path()).unwrap())
}

fn agent(tokenizer: &Arc<Tokenizer>, multi_turn: MultiTurnConfig) -> ToolAgent {
    let mut tools = ToolRegistry::default();
    tools.insert(Arc::new(Calculator));
    tools.insert(Arc::new(Failing));
    tools.insert(Arc::new(Hanging));
    tools.insert(Arc::new(Rewarding));
    ToolAgent {
        multi_turn,
        tools,
        tokenizer: tokenizer.clone(),
        encoder: ToolTurnEncoder::new(tokenizer).unwrap(),
        max_model_len: 4096,
    }
}

fn call(name: &str, arguments: Value) -> String {
    format!("<tool_call>\n{}\n</tool_call>", json!({"name": name, "arguments": arguments}))
}

async fn run(agent: &ToolAgent, script: &Script, budget: usize) -> (Vec<u32>, SessionOutput) {
    let messages = vec![json!({"role": "user", "content": "what is 6*7?"})];
    let prompt = agent.prompt_ids(&AgentPrompt::Messages(messages), &agent.tools).unwrap();
    let sampling = Sampling { seed: Some(1), ..Sampling::default() };
    let out = agent.run_session(script, &prompt, &agent.tools, &sampling, budget, 3).await.unwrap();
    (prompt, out)
}

#[tokio::test]
async fn tool_calls_run_and_their_output_is_appended_with_mask_zero_until_the_model_stops_calling() {
    let tok = tokenizer();
    let agent = agent(&tok, MultiTurnConfig::default());
    let first = format!("let me compute. {}", call("calculator", json!({"expression": "6*7"})));
    let script = Script::new(&tok, &[&first, "the answer is 42."]);
    let (prompt, out) = run(&agent, &script, 1000).await;

    let text = tok.decode(&out.response_ids, false).unwrap();
    let expected = format!(
        "{first}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\nthe answer is 42.<|im_end|>"
    );
    assert_eq!(text, expected);
    // mask: generated = 1, tool turn = 0; log-probs 0 exactly where the mask is 0
    let first_len = tok.encode(&first, false).unwrap().len() + 1;
    let tool_len = tok.encode("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", false).unwrap().len();
    assert_eq!(out.response_mask.len(), out.response_ids.len());
    assert!(out.response_mask[..first_len].iter().all(|&m| m == 1));
    assert!(out.response_mask[first_len..first_len + tool_len].iter().all(|&m| m == 0));
    assert!(out.response_mask[first_len + tool_len..].iter().all(|&m| m == 1));
    for (m, l) in out.response_mask.iter().zip(&out.logprobs) {
        assert_eq!(*l, if *m == 1 { -0.25 } else { 0.0 });
    }
    // The second turn continued the whole context: prompt + turn 1 + tool turn.
    let seen = script.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], prompt);
    assert_eq!(seen[1], [prompt.clone(), out.response_ids[..first_len + tool_len].to_vec()].concat());
    assert_eq!(out.num_turns, 4, "verl: user turns + assistant turns + 1");
    assert_eq!(out.tool_rewards, vec![0.0]);
    assert_eq!(out.stop_reason, StopReason::NoToolCall);
    assert!(!out.truncated);
    assert_eq!((out.min_version, out.max_version), (3, 4), "the version span covers both turns");
    assert_eq!(out.version_runs.len(), 2, "one version run per turn version: {:?}", out.version_runs);
    assert_eq!(out.version_runs[0], (0, 3));
    assert_eq!(out.version_runs[1].1, 4);
    assert_eq!(out.response_mask[out.version_runs[1].0 as usize], 1, "the second run starts at a generated token");
    assert_eq!(out.session, 3);
}

#[tokio::test]
async fn failing_hanging_and_unknown_tools_answer_with_error_text_and_reward_zero() {
    let tok = tokenizer();
    let multi_turn = MultiTurnConfig { max_parallel_calls: 4, tool_timeout_s: 0.3, ..MultiTurnConfig::default() };
    let agent = agent(&tok, multi_turn);
    let calls = [
        call("failing", json!({})),
        call("hanging", json!({})),
        call("nonexistent", json!({})),
        call("judge", json!({})),
        call("calculator", json!({"expression": "1+1"})), // beyond max_parallel_calls: ignored
    ]
    .concat();
    let script = Script::new(&tok, &[&calls, "ok"]);
    let started = Instant::now();
    let (_, out) = run(&agent, &script, 4000).await;
    assert!(started.elapsed() < Duration::from_secs(5), "a hanging tool is cut off by its timeout");
    assert_eq!(out.tool_rewards, vec![0.0, 0.0, 0.0, 1.0]);
    let text = tok.decode(&out.response_ids, false).unwrap();
    assert!(text.contains("Error when executing tool: the disk is on fire"), "{text}");
    assert!(text.contains("Error when executing tool: timed out after 0.3 s"), "{text}");
    assert!(text.contains("Error when executing tool: invalid arguments: unknown tool `nonexistent`"), "{text}");
    assert!(text.contains("<|im_start|>tool\ncorrect<|im_end|>"), "{text}");
    assert!(!text.contains("<|im_start|>tool\n2<|im_end|>"), "the fifth call exceeded max_parallel_calls");
    assert_eq!(out.stop_reason, StopReason::NoToolCall);
}

#[tokio::test]
async fn turn_limits_and_the_response_budget_end_the_loop_like_verl() {
    let tok = tokenizer();
    let calc = call("calculator", json!({"expression": "2+2"}));
    let turns = [calc.as_str(), calc.as_str(), calc.as_str(), "done"];

    let limited = agent(&tok, MultiTurnConfig { max_assistant_turns: Some(2), ..MultiTurnConfig::default() });
    let (_, out) = run(&limited, &Script::new(&tok, &turns), 4000).await;
    assert_eq!(out.stop_reason, StopReason::MaxAssistantTurns);
    assert_eq!(out.tool_rewards.len(), 1, "one tool turn between the two assistant turns");
    assert_eq!(out.num_turns, 4);

    let limited = agent(&tok, MultiTurnConfig { max_user_turns: Some(1), ..MultiTurnConfig::default() });
    let (_, out) = run(&limited, &Script::new(&tok, &turns), 4000).await;
    assert_eq!(out.stop_reason, StopReason::MaxUserTurns);
    assert_eq!(out.tool_rewards.len(), 1);

    // A budget that ends inside the first tool turn: the tool turn is not appended.
    let plain = agent(&tok, MultiTurnConfig::default());
    let first_len = tok.encode(&calc, false).unwrap().len() + 1;
    let (_, out) = run(&plain, &Script::new(&tok, &turns), first_len + 5).await;
    assert_eq!(out.stop_reason, StopReason::ResponseBudget);
    assert!(out.truncated);
    assert_eq!(out.response_ids.len(), first_len);
    assert!(out.response_mask.iter().all(|&m| m == 1));

    // A budget that ends inside a generation: the engine stops at the budget.
    let (_, out) = run(&plain, &Script::new(&tok, &turns), 7).await;
    assert!(out.truncated);
    assert_eq!(out.response_ids.len(), 7);
    assert_eq!(out.stop_reason, StopReason::Length);

    // A turn whose end-of-turn token is the last one the budget allows: the loop ends for the budget (the tool
    // call is not run), and says so rather than "eos".
    let (_, out) = run(&plain, &Script::new(&tok, &turns), first_len).await;
    assert_eq!(out.response_ids.len(), first_len);
    assert!(out.tool_rewards.is_empty());
    assert!(out.truncated);
    assert_eq!(out.stop_reason, StopReason::ResponseBudget);
}

#[tokio::test]
async fn long_tool_output_is_truncated_to_max_tool_response_length() {
    let tok = tokenizer();
    let multi_turn = MultiTurnConfig {
        max_tool_response_length: 10,
        tool_response_truncate_side: jetrl_config::TruncateSide::Left,
        ..MultiTurnConfig::default()
    };
    let agent = agent(&tok, multi_turn);
    let script = Script::new(&tok, &[&call("calculator", json!({"expression": "2^80"})), "ok"]);
    let (_, out) = run(&agent, &script, 4000).await;
    let text = tok.decode(&out.response_ids, false).unwrap();
    assert!(text.contains("<|im_start|>tool\n1208925819...(truncated)<|im_end|>"), "{text}");
}

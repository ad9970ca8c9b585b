//! The remote reward model against a tiny HTTP server written here on tokio.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jetrl_config::{RewardConfig, RewardModelApi};
use jetrl_reward::{ChatTurn, FailureKind, RewardEngine, RewardError, ScoreInput};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// A request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    body: serde_json::Value,
}

/// Answers requests from a script of `(status, body)` (the last entry repeats), optionally after a delay,
/// recording each request and the highest number of requests handled at once.
struct FakeServer {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    peak_concurrency: Arc<AtomicUsize>,
}

async fn fake_server(script: Vec<(u16, &'static str)>, delay: Duration) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let peak_concurrency = Arc::new(AtomicUsize::new(0));
    let active = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let (seen_by_server, peak) = (Arc::clone(&seen), Arc::clone(&peak_concurrency));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (seen, peak, active, served, script) = (
                Arc::clone(&seen_by_server),
                Arc::clone(&peak),
                Arc::clone(&active),
                Arc::clone(&served),
                script.clone(),
            );
            tokio::spawn(async move {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let mut reader = BufReader::new(stream);
                let mut request_line = String::new();
                reader.read_line(&mut request_line).await.unwrap();
                let mut content_length = 0;
                loop {
                    let mut header = String::new();
                    reader.read_line(&mut header).await.unwrap();
                    if header.trim().is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            content_length = value.trim().parse().unwrap();
                        }
                    }
                }
                let mut body = vec![0; content_length];
                reader.read_exact(&mut body).await.unwrap();
                let path = request_line.split_whitespace().nth(1).unwrap_or_default().to_string();
                seen.lock().unwrap().push(Seen { path, body: serde_json::from_slice(&body).unwrap() });
                let index = served.fetch_add(1, Ordering::SeqCst).min(script.len() - 1);
                let (status, answer) = script[index];
                tokio::time::sleep(delay).await;
                let response = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
                    answer.len()
                );
                active.fetch_sub(1, Ordering::SeqCst);
                let mut stream = reader.into_inner();
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    FakeServer { url, seen, peak_concurrency }
}

fn config(url: &str, api: RewardModelApi) -> RewardConfig {
    let mut config = RewardConfig::default();
    config.reward_model.enable = true;
    config.reward_model.url = url.into();
    config.reward_model.api = api;
    config.reward_model.model = "my-rm".into();
    config.reward_model.backoff_s = 0.01;
    config.reward_model.max_backoff_s = 0.05;
    config.reward_model.request_timeout_s = 5.0;
    config.reward_model.response_suffix = "<|im_end|>".into();
    config
}

fn input(key: &str) -> ScoreInput {
    ScoreInput {
        key: key.into(),
        data_source: "anything".into(),
        solution_str: "the answer".into(),
        prompt_str: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n".into(),
        ..ScoreInput::default()
    }
}

const VLLM_ANSWER: &str = r#"{"data": [{"probs": [9.0]}, {"probs": [0.1, 0.75]}]}"#;

#[tokio::test]
async fn vllm_score_is_the_last_prob_of_the_last_item() {
    let server = fake_server(vec![(200, VLLM_ANSWER)], Duration::ZERO).await;
    let engine = RewardEngine::new(&config(&server.url, RewardModelApi::Vllm)).await.unwrap();
    assert_eq!(engine.route_name(), "reward_model");
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!((outcome.score, outcome.scorer, outcome.failure_kind), (0.75, "reward_model", None));
    assert!(outcome.extra.is_empty());
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen[0].path, "/classify");
    assert_eq!(seen[0].body["model"], "my-rm");
    assert_eq!(seen[0].body["use_activation"], false);
    assert_eq!(seen[0].body["input"], "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nthe answer<|im_end|>");
}

#[tokio::test]
async fn sglang_score_is_the_last_embedding_value_under_a_url_prefix() {
    let server = fake_server(vec![(200, r#"{"data": [{"embedding": [0.3, -1.5]}]}"#)], Duration::ZERO).await;
    let engine = RewardEngine::new(&config(&format!("{}/rm/", server.url), RewardModelApi::Sglang)).await.unwrap();
    assert_eq!(engine.score_batch(vec![input("k")]).await[0].score, -1.5);
    assert_eq!(server.seen.lock().unwrap()[0].path, "/rm/v1/embeddings");
}

#[tokio::test]
async fn server_error_is_retried_until_it_succeeds() {
    let server = fake_server(vec![(500, "busy"), (503, "busy"), (200, VLLM_ANSWER)], Duration::ZERO).await;
    let engine = RewardEngine::new(&config(&server.url, RewardModelApi::Vllm)).await.unwrap();
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!((outcome.score, outcome.failure_kind), (0.75, None));
    assert_eq!(server.seen.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn client_error_is_not_retried() {
    let server = fake_server(vec![(400, r#"{"error": "input too long"}"#), (200, VLLM_ANSWER)], Duration::ZERO).await;
    let engine = RewardEngine::new(&config(&server.url, RewardModelApi::Vllm)).await.unwrap();
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!((outcome.score, outcome.failure_kind), (0.0, Some(FailureKind::HttpStatus)));
    assert!(outcome.failure_reason.as_deref().unwrap_or_default().contains("input too long"));
    assert_eq!(server.seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn retries_stop_after_the_configured_attempts() {
    let server = fake_server(vec![(502, "bad gateway")], Duration::ZERO).await;
    let mut config = config(&server.url, RewardModelApi::Vllm);
    config.reward_model.retries = 3;
    let engine = RewardEngine::new(&config).await.unwrap();
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!(outcome.failure_kind, Some(FailureKind::HttpStatus));
    assert_eq!(server.seen.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn concurrency_limit_bounds_requests_in_flight() {
    let server = fake_server(vec![(200, VLLM_ANSWER)], Duration::from_millis(100)).await;
    let mut config = config(&server.url, RewardModelApi::Vllm);
    config.reward_model.max_concurrency = 2;
    let engine = RewardEngine::new(&config).await.unwrap();
    let outcomes = engine.score_batch((0..6).map(|i| input(&format!("k{i}"))).collect()).await;
    assert_eq!(outcomes.len(), 6);
    assert!(outcomes.iter().all(|o| o.score == 0.75));
    assert_eq!(server.peak_concurrency.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn answer_without_a_score_fails_the_trajectory() {
    let server = fake_server(vec![(200, r#"{"data": []}"#)], Duration::ZERO).await;
    let engine = RewardEngine::new(&config(&server.url, RewardModelApi::Vllm)).await.unwrap();
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!(outcome.failure_kind, Some(FailureKind::RewardModelResponse));
}

#[tokio::test]
async fn unreachable_server_is_a_transport_failure() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let mut config = config(&format!("http://{closed}"), RewardModelApi::Vllm);
    config.reward_model.retries = 2;
    let engine = RewardEngine::new(&config).await.unwrap();
    let outcome = &engine.score_batch(vec![input("k")]).await[0];
    assert_eq!(outcome.failure_kind, Some(FailureKind::HttpTransport));
}

/// A reward model directory with a word-level tokenizer and a ChatML template that starts with a BOS (`<s>`)
/// and refuses `tool` turns.
fn rm_tokenizer_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tokenizer/tests/fixtures/chatml-word-level").to_string()
}

fn chat_input(key: &str, turns: &[(&str, &str)]) -> ScoreInput {
    ScoreInput {
        raw_prompt: turns
            .iter()
            .map(|(role, content)| ChatTurn { role: (*role).into(), content: (*content).into() })
            .collect(),
        solution_str: "4321".into(),
        ..input(key)
    }
}

#[tokio::test]
async fn rm_tokenizer_renders_prompt_messages_plus_response_as_verl_does_without_the_bos() {
    let server = fake_server(vec![(200, VLLM_ANSWER)], Duration::ZERO).await;
    let mut config = config(&server.url, RewardModelApi::Vllm);
    config.reward_model.tokenizer_path = Some(rm_tokenizer_dir());
    let engine = RewardEngine::new(&config).await.unwrap();
    let outcome = &engine.score_batch(vec![chat_input("k", &[("system", "sort"), ("user", "reverse 1234")])]).await[0];
    assert_eq!((outcome.score, outcome.failure_kind), (0.75, None));
    // the whole conversation in the RM's template, no generation prompt, no BOS, no response_suffix
    assert_eq!(
        server.seen.lock().unwrap()[0].body["input"],
        "<|im_start|>system\nsort<|im_end|>\n<|im_start|>user\nreverse 1234<|im_end|>\n<|im_start|>assistant\n4321<|im_end|>\n"
    );
}

#[tokio::test]
async fn trajectory_without_messages_falls_back_to_prompt_text_response_and_suffix() {
    let server = fake_server(vec![(200, VLLM_ANSWER)], Duration::ZERO).await;
    let mut config = config(&server.url, RewardModelApi::Vllm);
    config.reward_model.tokenizer_path = Some(rm_tokenizer_dir());
    let engine = RewardEngine::new(&config).await.unwrap();
    engine.score_batch(vec![input("k")]).await;
    assert_eq!(
        server.seen.lock().unwrap()[0].body["input"],
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nthe answer<|im_end|>"
    );
}

#[tokio::test]
async fn chat_template_that_raises_fails_only_its_trajectory_without_a_request() {
    let server = fake_server(vec![(200, VLLM_ANSWER)], Duration::ZERO).await;
    let mut config = config(&server.url, RewardModelApi::Vllm);
    config.reward_model.tokenizer_path = Some(rm_tokenizer_dir());
    let engine = RewardEngine::new(&config).await.unwrap();
    let outcomes = engine
        .score_batch(vec![chat_input("bad", &[("tool", "42")]), chat_input("good", &[("user", "reverse 1234")])])
        .await;
    assert_eq!(outcomes[0].failure_kind, Some(FailureKind::PromptRender));
    assert!(outcomes[0].failure_reason.as_deref().unwrap_or_default().contains("tool turns are not supported"));
    assert_eq!((outcomes[1].score, outcomes[1].failure_kind), (0.75, None));
    assert_eq!(server.seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn unreadable_rm_tokenizer_directory_stops_the_engine_at_start_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config("http://127.0.0.1:9", RewardModelApi::Vllm);
    config.reward_model.tokenizer_path = Some(dir.path().display().to_string());
    let err = RewardEngine::new(&config).await.err().expect("a directory without tokenizer.json is refused");
    assert!(matches!(err, RewardError::RewardModelSetup(_)), "{err}");
    assert!(err.to_string().contains("tokenizer_path"), "{err}");
}

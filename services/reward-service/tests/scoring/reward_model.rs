//! The reward-model route through the service: what the model reads for a trajectory with chat messages
//! (`raw_prompt`, rendered with the RM's template, as verl does), for one without (its prompt ids decoded with
//! the policy tokenizer), and without any tokenizer (the response alone). The model is an HTTP server written
//! here; the tokenizers are `shared/tokenizer`'s word-level fixture (ChatML with a BOS).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Harness;
use jetrl_config::JobConfig;
use jetrl_wire::v1::ChatMessage;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/tokenizer/tests/fixtures/chatml-word-level");

/// A vLLM-style `/classify` server scoring 0.5 and recording each request's `input`.
async fn fake_reward_model() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let inputs = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&inputs);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream);
                let mut length = 0;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).await.unwrap_or(0) == 0 || header.trim().is_empty() {
                        break;
                    }
                    if let Some(value) = header.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).await.is_err() {
                    return;
                }
                let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                seen.lock().expect("lock").push(request["input"].as_str().unwrap_or_default().to_string());
                let answer = r#"{"data": [{"probs": [0.5]}]}"#;
                let response = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{answer}", answer.len());
                let mut stream = reader.into_inner();
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, inputs)
}

/// Runs one service instance until `count` rewards are stored.
async fn serve_until(harness: &Harness, cfg: JobConfig, count: usize) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(jetrl_reward_service::run(cfg, async move {
        let _ = stopped.await;
    }));
    harness.wait_for_rewards(count, Duration::from_secs(30)).await;
    let _ = stop.send(());
    service.await.expect("service task").expect("service ran");
}

fn rm_config(harness: &Harness, url: &str) -> JobConfig {
    let mut cfg = harness.config();
    cfg.reward.reward_model.enable = true;
    cfg.reward.reward_model.url = url.into();
    cfg.reward.reward_model.retries = 1;
    cfg.reward.reward_model.response_suffix = "<|im_end|>\n".into();
    cfg
}

/// Trajectory `rm_0_0` (response "4321") as a rollout worker publishes it for a task given as chat messages.
fn with_messages(messages: &[(&str, &str)]) -> jetrl_wire::v1::Trajectory {
    jetrl_wire::v1::Trajectory {
        raw_prompt: messages
            .iter()
            .map(|(role, content)| ChatMessage { role: (*role).into(), content: (*content).into() })
            .collect(),
        ..common::trajectory("rm", 0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trajectory_messages_are_rendered_with_the_reward_models_template_as_verl_does() {
    let harness = Harness::start().await;
    let (url, inputs) = fake_reward_model().await;
    let mut cfg = rm_config(&harness, &url);
    cfg.reward.reward_model.tokenizer_path = Some(FIXTURE.into());
    harness.publish(&[with_messages(&[("system", "sort"), ("user", "reverse 1234")])]).await;
    serve_until(&harness, cfg, 1).await;

    assert_eq!(
        inputs.lock().expect("lock").as_slice(),
        ["<|im_start|>system\nsort<|im_end|>\n<|im_start|>user\nreverse 1234<|im_end|>\n<|im_start|>assistant\n4321<|im_end|>\n"]
    );
    let rewards = harness.rewards_by_key().await;
    assert_eq!((rewards["rm_0_0"][0].score, rewards["rm_0_0"][0].failure_reason.as_str()), (0.5, ""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trajectory_without_messages_is_read_as_its_prompt_decoded_with_the_policy_tokenizer() {
    let harness = Harness::start().await;
    let (url, inputs) = fake_reward_model().await;
    let mut cfg = rm_config(&harness, &url);
    cfg.reward.reward_model.tokenizer_path = Some(FIXTURE.into());
    cfg.model.path = FIXTURE.into();
    harness.publish(&[common::trajectory("rm", 0)]).await;
    serve_until(&harness, cfg, 1).await;

    // the policy's own rendering of the prompt (special tokens kept, BOS dropped), the response, the suffix
    assert_eq!(
        inputs.lock().expect("lock").as_slice(),
        ["<|im_start|> user reverse 1234 <|im_end|> <|im_start|> assistant4321<|im_end|>\n"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_messages_or_policy_tokenizer_the_reward_model_reads_the_response_alone() {
    let harness = Harness::start().await;
    let (url, inputs) = fake_reward_model().await;
    let cfg = rm_config(&harness, &url);
    harness.publish(&[common::trajectory("rm", 0), common::trajectory("rm", 1)]).await;
    serve_until(&harness, cfg, 2).await;

    let mut seen = inputs.lock().expect("lock").clone();
    seen.sort();
    assert_eq!(seen, ["1234<|im_end|>\n", "4321<|im_end|>\n"]);
}

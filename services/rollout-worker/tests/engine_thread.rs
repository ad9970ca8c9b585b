//! The engine thread behind its async handle: requests join a running batch, a dropped request frees its
//! slots, an abort hands back a resumable prefix, and weights swap while sequences run.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::time::{Duration, Instant};

use jetrl_model::{CausalLm, DType, EngineConfig, Finish, Prefix, Request, Sampling};
use jetrl_rollout_worker::engine::{EngineHandle, EngineSettings};
use tch::Device;

fn start(dir: &Path, slots: usize) -> EngineHandle {
    EngineHandle::start(EngineSettings {
        model_dir: dir.to_path_buf(),
        device: jetrl_config::DeviceSpec::Cpu,
        dtype: jetrl_config::ModelDtype::F32,
        lora: None,
        // EOS outside the vocabulary: sequences run to their budget.
        config: EngineConfig {
            max_num_seqs: slots,
            max_model_len: 256,
            seed: 5,
            eos_token_ids: vec![1000],
            ..EngineConfig::default()
        },
        detokenizer: None,
    })
    .unwrap()
}

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    jetrl_model::init_model("tiny", dir.path(), 8).unwrap();
    dir
}

fn sampled(max_tokens: usize, seed: u64) -> Sampling {
    Sampling { temperature: 1.0, max_tokens, seed: Some(seed), ..Sampling::default() }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_request_is_aborted_and_its_slots_serve_the_next_one() {
    let dir = model_dir();
    let engine = start(dir.path(), 4);
    let long = engine.submit(Request::new(vec![5, 6, 7], 4, sampled(240, 1))).await.unwrap();
    until("the group to run", || engine.load().running == 4).await;
    let queued = engine.submit(Request::new(vec![8, 9], 2, sampled(5, 2))).await.unwrap();
    until("the second request to queue", || engine.load().waiting == 2).await;
    drop(long);
    let mut queued = queued;
    let mut done = 0;
    while let Some(out) = queued.next().await {
        assert_eq!(out.unwrap().tokens.len(), 5);
        done += 1;
    }
    assert_eq!(done, 2);
    until("the engine to go idle", || engine.load().running == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_request_returns_its_prefix_and_resuming_it_finishes_the_same_sequence() {
    let dir = model_dir();
    let engine = start(dir.path(), 2);
    let whole = engine.generate_one(Request::new(vec![3, 4, 5], 1, sampled(200, 9))).await.unwrap();
    let generation = engine.submit(Request::new(vec![3, 4, 5], 1, sampled(200, 9))).await.unwrap();
    until("some tokens", || engine.load().kv_usage > 0.0).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut partial = generation.abort().await;
    assert_eq!(partial.len(), 1);
    let partial = partial.remove(0);
    assert_eq!(partial.finish, Finish::Aborted);
    assert!(partial.tokens.len() < 200);
    assert_eq!(partial.tokens[..], whole.tokens[..partial.tokens.len()]);
    let resumed = engine
        .generate_one(Request {
            prompt: vec![3, 4, 5],
            n: 1,
            sampling: sampled(200, 9),
            resume: Some(Prefix {
                tokens: partial.tokens.clone(),
                logprobs: partial.logprobs.clone(),
                min_version: partial.min_version,
                max_version: partial.max_version,
                version_runs: partial.version_runs.clone(),
            }),
            first_sample: 0,
        })
        .await
        .unwrap();
    assert_eq!(resumed.tokens, whole.tokens);
    assert_eq!(resumed.finish, Finish::Length);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_swap_while_sequences_run_and_the_version_span_shows_it() {
    let dir = model_dir();
    let engine = start(dir.path(), 4);
    let mut generation = engine.submit(Request::new(vec![10, 11, 12], 3, sampled(230, 4))).await.unwrap();
    until("the group to run", || engine.load().running == 3).await;
    let blob = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap().to_safetensors_bytes().unwrap();
    engine.swap(blob.into(), 2).await.unwrap();
    assert_eq!(engine.version(), 2);
    let mut outs = Vec::new();
    while let Some(out) = generation.next().await {
        outs.push(out.unwrap());
    }
    assert_eq!(outs.len(), 3);
    for out in outs {
        assert_eq!(out.tokens.len(), 230, "no sequence was dropped by the swap");
        assert_eq!((out.min_version, out.max_version), (0, 2), "first tokens under v0, last under v2");
    }
    let refused = engine.generate_one(Request::new(vec![9; 300], 1, sampled(4, 1))).await;
    assert!(refused.is_err(), "a context longer than max_model_len is refused, not fatal");
    let fine = engine.generate_one(Request::new(vec![9; 3], 1, sampled(4, 1))).await.unwrap();
    assert_eq!((fine.min_version, fine.max_version), (2, 2));
}

/// colocate_async's pause / resume: every running sequence is parked with its prefix (the KV cache freed),
/// requests submitted meanwhile wait, and after the resume each parked sequence finishes from its prefix under
/// the new version — with the tokens an uninterrupted run draws, since its random stream continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_engine_parks_its_sequences_and_resumes_each_from_its_prefix_under_the_new_version() {
    let dir = model_dir();
    let engine = start(dir.path(), 4);
    let prompt = vec![7, 8, 9];
    let mut generation = engine.submit(Request::new(prompt.clone(), 2, sampled(200, 77))).await.unwrap();
    until("the group to run", || engine.load().running == 2).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    let parked = engine.pause(true).await.unwrap();
    assert_eq!(parked.sequences, 2);
    assert!(parked.tokens > 0, "the prefixes keep what was generated");
    assert_eq!(engine.load().running, 0, "nothing decodes while paused");
    let mut waiting = engine.submit(Request::new(vec![4, 5], 1, sampled(3, 2))).await.unwrap();
    let held = tokio::time::timeout(Duration::from_millis(150), waiting.next()).await;
    assert!(held.is_err(), "a request submitted during a pause waits for the resume");

    let blob = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap().to_safetensors_bytes().unwrap();
    let resumed = engine.resume(Some((blob.into(), 5))).await.unwrap();
    assert_eq!(resumed, 2);
    assert_eq!(engine.version(), 5);
    let mut outs = Vec::new();
    while let Some(out) = generation.next().await {
        outs.push(out.unwrap());
    }
    outs.sort_by_key(|o| o.index);
    assert_eq!(outs.len(), 2);
    for out in &outs {
        assert_eq!(out.tokens.len(), 200, "every parked sequence finished its budget");
        assert_eq!((out.min_version, out.max_version), (0, 5), "its tokens span the versions before and after");
        assert_eq!(out.finish, Finish::Length);
    }
    assert_eq!(waiting.next().await.unwrap().unwrap().tokens.len(), 3);

    // the same seeded group without a pause draws the same tokens (the weights were unchanged)
    let mut again = engine.submit(Request::new(prompt, 2, sampled(200, 77))).await.unwrap();
    let mut straight = Vec::new();
    while let Some(out) = again.next().await {
        straight.push(out.unwrap());
    }
    straight.sort_by_key(|o| o.index);
    for (a, b) in outs.iter().zip(&straight) {
        assert_eq!(a.tokens, b.tokens, "sample {}: resuming from the prefix continues the same stream", a.index);
    }
}

/// Partial rollout is exact: a sequence paused under weights v0 and resumed under different weights v1 records
/// where the version changed, and each of its behaviour log-probs is what the model of that token's version
/// gives it (teacher-forced over the whole context, which the resume re-prefills under v1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_sequence_records_its_version_runs_and_each_token_has_its_versions_log_prob() {
    let dir = model_dir();
    let engine = start(dir.path(), 2);
    let v0 = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let v1 = CausalLm::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    tch::manual_seed(3);
    tch::no_grad(|| {
        for (_, mut p) in v1.parameters() {
            let noise = p.randn_like() * 0.05;
            let _ = p.f_add_(&noise).unwrap();
        }
    });
    let blob = v1.to_safetensors_bytes().unwrap();

    let prompt = vec![11, 12, 13];
    let mut generation = engine.submit(Request::new(prompt.clone(), 1, sampled(120, 5))).await.unwrap();
    until("some tokens", || engine.load().kv_usage > 0.0).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    engine.pause(true).await.unwrap();
    engine.resume(Some((blob.into(), 1))).await.unwrap();
    let out = generation.next().await.unwrap().unwrap();
    assert_eq!(out.tokens.len(), 120);
    assert_eq!(out.version_runs.len(), 2, "one run per version: {:?}", out.version_runs);
    let (switch, _) = out.version_runs[1];
    assert_eq!(out.version_runs, vec![(0, 0), (switch, 1)]);
    assert!(switch > 0 && (switch as usize) < out.tokens.len());
    assert_eq!((out.min_version, out.max_version), (0, 1));

    let full: Vec<u32> = prompt.iter().chain(&out.tokens).copied().collect();
    let under = |model: &CausalLm| jetrl_model::log_probs_of(model, &full).unwrap();
    let (lp0, lp1) = (under(&v0), under(&v1));
    let first = prompt.len() - 1; // log_probs_of scores ids[1..]: response token i is at first + i
    let mut worst = 0f32;
    for (i, &behaviour) in out.logprobs.iter().enumerate() {
        let expected = if i < switch as usize { lp0[first + i] } else { lp1[first + i] };
        worst = worst.max((behaviour - expected).abs());
    }
    assert!(worst < 2e-3, "behaviour log-probs differ from their version's by up to {worst}");
    // and the versions really differ, so the check could fail
    let swapped =
        (switch as usize..out.tokens.len()).map(|i| (lp0[first + i] - out.logprobs[i]).abs()).fold(0f32, f32::max);
    assert!(swapped > 1e-2, "v0 and v1 give the same log-probs ({swapped}): the test would not see a wrong version");
}

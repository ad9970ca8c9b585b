//! The trainer's ranks (c10d, Gloo on the CPU, real processes of `jetrl-trainer-dp`) train as one rank does: on
//! the same global batches, with micro-batching, shuffled mini-batches, KL in the reward and in the loss, an
//! entropy bonus and (in the PPO case) a critic and rollout correction, two ranks end with the weights and metrics
//! of one rank; each holds about half the optimizer state; a checkpoint written by two ranks resumes on one and
//! the other way round, continuing as the uninterrupted run.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tch::Tensor;

const STEPS: u64 = 4;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs `world` ranks of `jetrl-trainer-dp` for steps `start..=end` with `extra` arguments; panics with their output
/// unless every rank exits 0 within a minute.
fn run(model: &Path, world: u32, start: u64, end: u64, out: &Path, extra: &[&str]) {
    let port = free_port().to_string();
    let (start, end, world_s) = (start.to_string(), end.to_string(), world.to_string());
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let rank = rank.to_string();
            let mut args =
                vec!["--rank", &rank, "--world", &world_s, "--port", &port, "--start", &start, "--end", &end];
            args.extend(["--horizon", "4"]);
            let out = out.display().to_string();
            let model = model.display().to_string();
            Command::new(env!("CARGO_BIN_EXE_jetrl-trainer-dp"))
                .args(&args)
                .args(["--out", &out, "--model", &model])
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (rank, mut child) in children.into_iter().enumerate() {
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "rank {rank} of {world} ran past a minute");
            std::thread::sleep(Duration::from_millis(50));
        }
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "rank {rank} of {world} failed: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

fn weights(out: &Path) -> BTreeMap<String, Tensor> {
    jetrl_trainer::checkpoint::read_tensors(&out.join("weights.safetensors")).unwrap().into_iter().collect()
}

fn report(out: &Path, rank: u32) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join(format!("rank{rank}.json"))).unwrap()).unwrap()
}

/// The largest |a − b| over every parameter.
fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = (0.0, String::new());
    for (name, x) in a {
        let d = f64::try_from((x - &b[name]).abs().max()).unwrap();
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

/// Every metric of every step of `a` is in `b`, within 1e-5 (relative to its size when above 1). A fraction of
/// tokens past a threshold (`*clipfrac*`, `*_fraction_*`) counts tokens, and a token whose ratio sits at the
/// threshold may fall on either side of it by the last bit of a sum taken in another order: those may differ by
/// up to two tokens' share.
fn same_metrics(a: &Value, b: &Value, what: &str) {
    let (sa, sb) = (a["steps"].as_array().unwrap(), b["steps"].as_array().unwrap());
    assert_eq!(sa.len(), sb.len(), "{what}");
    let mut wrong = Vec::new();
    for (x, y) in sa.iter().zip(sb) {
        let (mx, my) = (x["metrics"].as_object().unwrap(), y["metrics"].as_object().unwrap());
        assert_eq!(mx.keys().collect::<Vec<_>>(), my.keys().collect::<Vec<_>>(), "{what}: step {}", x["step"]);
        for (key, vx) in mx {
            let (vx, vy) = (vx.as_f64().unwrap(), my[key].as_f64().unwrap());
            let counts_tokens = key.contains("clipfrac") || key.contains("_fraction_");
            let tolerance = if counts_tokens { 0.03 } else { 1e-5 * vx.abs().max(1.0) };
            if (vx - vy).abs() > tolerance {
                wrong.push(format!("step {} {key}: {vx} vs {vy}", x["step"]));
            }
        }
    }
    assert!(wrong.is_empty(), "{what}:\n{}", wrong.join("\n"));
}

fn compare_one_and_two_ranks(critic: bool) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny", &model, 3).unwrap();
    let extra: &[&str] = if critic { &["--critic"] } else { &[] };
    let (one, two): (PathBuf, PathBuf) = (dir.path().join("one"), dir.path().join("two"));
    run(&model, 1, 1, STEPS, &one, extra);
    run(&model, 2, 1, STEPS, &two, extra);

    let (diff, name) = max_diff(&weights(&one), &weights(&two));
    println!("1 rank vs 2 ranks after {STEPS} steps: max |Δw| {diff:.2e} ({name})");
    assert!(diff <= 1e-5, "weights differ: {diff} in {name}");
    let initial: BTreeMap<String, Tensor> =
        jetrl_model::CausalLm::load(&model, tch::Device::Cpu, jetrl_model::DType::F32)
            .unwrap()
            .parameters()
            .into_iter()
            .collect();
    let (moved, _) = max_diff(&weights(&one), &initial);
    assert!(moved > 1e-3, "training barely moved the weights ({moved}): the comparison would prove nothing");
    // every rank reports the metrics of the whole batch
    let solo = report(&one, 0);
    same_metrics(&solo, &report(&two, 0), "rank 0 of 2");
    same_metrics(&solo, &report(&two, 1), "rank 1 of 2");
    // the last step's (with a critic, the actor is updated from step 2 on)
    let keys = solo["steps"][STEPS as usize - 1]["metrics"].as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    for key in ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "actor/reward_kl_penalty"] {
        assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
    }
    if critic {
        assert!(keys.iter().any(|k| k == "critic/vf_loss"), "{keys:?}");
    }

    // optimizer state: each of 2 ranks holds about half of 1 rank's
    let bytes = |v: &Value| v["optimizer_state_bytes"].as_f64().unwrap();
    let (b1, b2) = (bytes(&solo), bytes(&report(&two, 1)).max(bytes(&report(&two, 0))));
    println!("optimizer state bytes per rank: 1 rank {b1}, 2 ranks {b2} ({:.3}x)", b2 / b1);
    assert!(b2 <= 0.55 * b1, "{b2} vs {b1}");
}

#[test]
fn two_ranks_train_the_grpo_batches_as_one_rank_does() {
    compare_one_and_two_ranks(false);
}

#[test]
fn two_ranks_train_the_ppo_batches_with_a_critic_as_one_rank_does() {
    compare_one_and_two_ranks(true);
}

/// A checkpoint of 2 ranks resumes on 1 and a checkpoint of 1 on 2 (the optimizer state re-sharded), each
/// continuing as the uninterrupted run of one rank.
#[test]
fn a_checkpoint_resumes_on_another_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny", &model, 3).unwrap();
    let straight = dir.path().join("straight");
    run(&model, 1, 1, STEPS, &straight, &["--critic"]);
    for (before, after) in [(2u32, 1u32), (1, 2)] {
        let first = dir.path().join(format!("first-{before}"));
        run(&model, before, 1, 2, &first, &["--critic", "--save-at", "2"]);
        let ckpt = first.join("ckpt");
        let shards = std::fs::read_dir(ckpt.join("actor"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("optimizer"))
            .count();
        assert_eq!(shards, before as usize + 1, "one optimizer shard per rank and optimizer.json");
        let resumed = dir.path().join(format!("resumed-{before}-{after}"));
        let ckpt_s = ckpt.display().to_string();
        run(&model, after, 3, STEPS, &resumed, &["--critic", "--resume", &ckpt_s]);
        let (diff, name) = max_diff(&weights(&straight), &weights(&resumed));
        println!("{before} -> {after} ranks: max |Δw| against the straight run {diff:.2e} ({name})");
        assert!(diff <= 1e-5, "{before} -> {after}: weights differ by {diff} in {name}");
        let tail = serde_json::json!({"steps": report(&straight, 0)["steps"].as_array().unwrap()[2..].to_vec()});
        same_metrics(&tail, &report(&resumed, 0), &format!("{before} -> {after}"));
    }
}

/// A checkpoint that lacks one rank's optimizer shard is refused at resume, naming the missing file.
#[test]
fn a_checkpoint_missing_a_ranks_shard_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny", &model, 3).unwrap();
    let first = dir.path().join("first");
    run(&model, 2, 1, 1, &first, &["--save-at", "1"]);
    let shard = first.join("ckpt/actor/optimizer.rank1-of-2.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let ckpt = first.join("ckpt").display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_jetrl-trainer-dp"))
        .args(["--rank", "0", "--world", "1", "--start", "2", "--end", "2", "--resume", &ckpt])
        .args(["--model", &model.display().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "resumed without a shard:\n{stderr}");
    assert!(stderr.contains(&shard.display().to_string()) && stderr.contains("saved by 2 ranks"), "{stderr}");
}

//! The trainer as a group of ranks end to end (real processes, a real nats-server, the real tiny model, Gloo on the
//! CPU): the demo with two ranks repeats the one-rank run step for step and learns in every mode; ranks started
//! by hand on "two nodes" meet at the rendezvous; a rank without its group, or one started twice, fails with a
//! clear error within its deadline. (The kill -9 of rank 1 is in `crash_matrix.rs`, equivalence of the updates
//! and re-sharded resumes in `services/trainer/tests/data_parallel.rs`.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::time::{Duration, Instant};

use jetrl_tests::{demo_run, TestJob};

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn series(rows: &[serde_json::Value], key: &str) -> Vec<f64> {
    rows.iter().map(|m| m[key].as_f64().unwrap_or(f64::NAN)).collect()
}

/// The demo job through `jetrl run` with `ranks` trainer ranks in `mode` for `steps` steps; returns its metrics.
fn demo(dir: &Path, name: &str, mode: &str, ranks: u32, steps: u32) -> Vec<serde_json::Value> {
    let overrides = [
        format!("model.path={}", dir.join("model").display()),
        format!("trainer.mode={mode}"),
        format!("trainer.n_gpus_per_node={ranks}"),
        format!("trainer.total_training_steps={steps}"),
        "trainer.test_freq=-1".into(),
    ];
    let rows = metrics(&demo_run(dir, &format!("ranks-{name}"), &overrides, Duration::from_secs(600)));
    assert_eq!(rows.len(), steps as usize, "{name}: one metrics line per step");
    rows
}

/// Sync with a fixed seed and one rollout worker repeats itself across world sizes: the same rows are sampled
/// the same way (scores equal at every step), and the two ranks' update is the one rank's (loss and global
/// gradient norm within 1e-3).
#[test]
#[ignore = "slow tier: the demo with two trainer ranks against one"]
fn the_demo_in_sync_repeats_itself_with_two_trainer_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let one = demo(dir.path(), "sync-1", "sync", 1, 8);
    let two = demo(dir.path(), "sync-2", "sync", 2, 8);
    assert_eq!(series(&one, "critic/score/mean")[0], series(&two, "critic/score/mean")[0]);
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm"] {
        for (step, (a, b)) in series(&one, key).iter().zip(series(&two, key)).enumerate() {
            assert!((a - b).abs() <= 1e-3, "step {}: {key} {a} (1 rank) vs {b} (2 ranks)", step + 1);
        }
    }
}

/// The demo with two trainer ranks learns in each mode as it does with one: the last 5 steps' mean reward at
/// least 0.947, one rank's 0.997 (README, "What the demo shows") less 0.05. An async run that ends in the demo's
/// 0.9 trap (see `modes.rs`) runs once more.
#[test]
#[ignore = "slow tier: the demo with two trainer ranks in every mode, 200 steps each"]
fn the_demo_learns_with_two_trainer_ranks_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let last5 = |rows: &[serde_json::Value]| {
        let s = series(rows, "critic/score/mean");
        s[s.len() - 5..].iter().sum::<f64>() / 5.0
    };
    let mut finals = Vec::new();
    for mode in ["sync", "separate_async", "colocate_async"] {
        let mut reward = last5(&demo(dir.path(), mode, mode, 2, 200));
        if reward < 0.947 && mode != "sync" {
            eprintln!("{mode}: last-5 reward {reward:.3} (the trap?); running it once more");
            reward = last5(&demo(dir.path(), &format!("{mode}-again"), mode, 2, 200));
        }
        finals.push((mode, reward));
    }
    eprintln!("last-5 reward with 2 trainer ranks: {finals:?}");
    for (mode, reward) in finals {
        assert!(reward >= 0.947, "{mode} with 2 trainer ranks: last-5 reward {reward:.3}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Two nodes on one machine: `trainer.nnodes=2` with one rank each, each started as on its own host (the
/// services by hand, no `jetrl run`), meeting at 127.0.0.1; every step is trained. A third process claiming
/// rank 1 while the group runs is refused, naming the rank and the store, and the run goes on.
#[test]
#[ignore = "slow tier: trainer ranks started by hand as on two nodes"]
fn ranks_on_two_nodes_meet_and_a_rank_started_twice_is_refused() {
    let port = free_port();
    let mut job = TestJob::new(&format!(
        "data: {{train_batch_size: 4, max_response_length: 4}}\n\
         trainer: {{total_training_steps: 6, nnodes: 2, dist: {{master_port: {port}, timeout_s: 30}}}}"
    ));
    job.spawn_services(1, 1);
    job.spawn("trainer", "jetrl-trainer", &[]);
    job.spawn("trainer-1", "jetrl-trainer", &["trainer.dist.rank=1", "trainer.metrics_addr=127.0.0.1:0"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while job.metrics().len() < 2 {
        assert!(Instant::now() < deadline, "no step 2; trainer log:\n{}", job.log("trainer"));
        std::thread::sleep(Duration::from_millis(200));
    }
    job.spawn("trainer-1-again", "jetrl-trainer", &["trainer.dist.rank=1", "trainer.metrics_addr=127.0.0.1:0"]);
    let status = job.wait("trainer-1-again", Duration::from_secs(40));
    let log = job.log("trainer-1-again");
    assert!(!status.success(), "a second rank 1 was let in:\n{log}");
    assert!(log.contains("rank 1 started twice") && log.contains(&format!("127.0.0.1:{port}")), "{log}");

    let status = job.wait("trainer", Duration::from_secs(180));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));
    assert!(job.wait("trainer-1", Duration::from_secs(30)).success(), "{}", job.log("trainer-1"));
    assert_eq!(job.metrics().len(), 6, "every step trained");
}

/// A rank whose rank 0 never comes fails within `trainer.dist.timeout_s`, naming the store's address and itself.
#[test]
fn a_rank_without_its_group_fails_naming_the_store_and_itself() {
    let port = free_port();
    let mut job = TestJob::new(&format!(
        "trainer: {{total_training_steps: 2, n_gpus_per_node: 2, dist: {{master_port: {port}, timeout_s: 2}}}}"
    ));
    let started = Instant::now();
    job.spawn("trainer-1", "jetrl-trainer", &["trainer.dist.rank=1"]);
    let status = job.wait("trainer-1", Duration::from_secs(30));
    let log = job.log("trainer-1");
    assert!(!status.success(), "{log}");
    assert!(log.contains(&format!("127.0.0.1:{port}")) && log.contains("rank 1"), "{log}");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

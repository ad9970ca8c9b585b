//! The crash matrix: a training job under `jetrl run` (real processes, a real nats-server, the real tiny model), in
//! each of the three modes, with one process killed by SIGKILL at a named point of its work — reached
//! deterministically through the `JETRL_CRASH_AT` hook (`jetrl_telemetry::crash`), once — or the nats-server
//! itself killed and restarted on its file store, or (with two trainer ranks) the second rank killed. In every case the run completes and `ledger.jsonl` accounts for
//! every dataset row drawn exactly once: the 24 rows of 6 steps each trained once, none twice, every other row
//! drawn (the async modes' backlog) with one fate; sync trains on-policy at every step (staleness 0).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use jetrl_tests::{bin, job_yaml, NatsServer};

/// At most two jobs at a time (of the 27): more would only measure the machine's cores, and one at a time leaves
/// them idle while a job waits out a restart delay or an ack deadline.
const CONCURRENT_JOBS: usize = 2;

static RUNNING: Mutex<usize> = Mutex::new(0);
static SLOT_FREED: Condvar = Condvar::new();

/// A place among the [`CONCURRENT_JOBS`] running jobs, given back when dropped.
struct Slot;

fn slot() -> Slot {
    let mut running = RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    while *running >= CONCURRENT_JOBS {
        running = SLOT_FREED.wait(running).unwrap_or_else(std::sync::PoisonError::into_inner);
    }
    *running += 1;
    Slot
}

impl Drop for Slot {
    fn drop(&mut self) {
        *RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
        SLOT_FREED.notify_one();
    }
}

const STEPS: u64 = 6;
const BATCH: u64 = 4;

/// The crash job; `ranks` trainer ranks.
fn job(dir: &Path, nats_url: &str, mode: &str, save_freq: i64, ranks: u32) -> std::path::PathBuf {
    jetrl_model::init_model("tiny", &dir.join("model"), 1).unwrap();
    let yaml = job_yaml(
        dir,
        nats_url,
        &format!(
            "run: {{name: crash}}\n\
             data: {{train_batch_size: {BATCH}, max_response_length: 4}}\n\
             rollout: {{n: 4, ack_wait_s: 3, heartbeat_interval_s: 0.5, heartbeat_timeout_s: 2}}\n\
             reward: {{ack_wait_s: 3}}\n\
             actor: {{ppo_mini_batch_size: 2}}\n\
             trainer: {{mode: {mode}, total_training_steps: {STEPS}, save_freq: {save_freq}, weight_sync_timeout_s: 10, \
             sample_wait_s: 2, separate_async: {{parameter_sync_step: 2}}, colocate_async: {{handshake_timeout_s: 5}}, \
             n_gpus_per_node: {ranks}, dist: {{timeout_s: 30}}}}"
        ),
    );
    let path = dir.join("job.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    jetrl_tests::run_metrics(run_dir)
}

/// Runs the job under `jetrl run` (its own NATS unless `nats_url`), `during` called every 100 ms while it runs;
/// returns the console output.
fn run_job(
    dir: &Path,
    mode: &str,
    save_freq: i64,
    crash_at: Option<&str>,
    nats_url: Option<&str>,
    ranks: u32,
    mut during: impl FnMut(&Path),
) -> String {
    let config = job(dir, nats_url.unwrap_or("nats://127.0.0.1:4222"), mode, save_freq, ranks);
    let out = dir.join("console.txt");
    let mut command = Command::new(bin("jetrl"));
    command.arg("run").arg(&config).arg("--quiet");
    if let Some(url) = nats_url {
        command.arg("--nats-url").arg(url);
    }
    if let Some(point) = crash_at {
        command.env("JETRL_CRASH_AT", point).env("JETRL_CRASH_MARKER", dir.join("crashed"));
    }
    let log = std::fs::File::create(&out).unwrap();
    let mut child = command.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap();
    let run_dir = dir.join("run");
    let deadline = Instant::now() + Duration::from_secs(420);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the job did not finish; console:\n{}", std::fs::read_to_string(&out).unwrap_or_default());
        }
        during(&run_dir);
        std::thread::sleep(Duration::from_millis(100));
    };
    let console = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(status.success(), "jetrl run failed ({status}):\n{console}");
    console
}

/// What every crash must leave: all steps trained (sync: on-policy), every row drawn accounted for once.
fn check_exactly_once(dir: &Path, mode: &str, what: &str) {
    let run_dir = dir.join("run");
    let rows = metrics(&run_dir);
    let steps: Vec<u64> = rows.iter().filter_map(|m| m["training/global_step"].as_f64()).map(|s| s as u64).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{what}: one metrics line per step");
    for m in rows.iter().filter(|_| mode == "sync") {
        assert_eq!(
            m["training/off_policy/trajectory_staleness/max"].as_f64(),
            Some(0.0),
            "{what}: off-policy step {m}"
        );
    }
    let text = std::fs::read_to_string(run_dir.join("ledger.jsonl")).expect("ledger.jsonl");
    let mut seen: HashMap<(u64, u64), Vec<serde_json::Value>> = HashMap::new();
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let key = (row["epoch"].as_u64().unwrap(), row["row"].as_u64().unwrap());
        seen.entry(key).or_default().push(row);
    }
    let twice: Vec<_> = seen.values().filter(|v| v.len() > 1).collect();
    assert!(twice.is_empty(), "{what}: rows decided more than once: {twice:?}");
    let trained = seen.values().filter(|v| v[0]["fate"] == "trained").count();
    assert_eq!(trained as u64, STEPS * BATCH, "{what}: {STEPS} steps of {BATCH} rows trained: {seen:?}");
    if mode == "sync" {
        assert_eq!(seen.len() as u64, STEPS * BATCH, "{what}: no row drawn and left behind: {seen:?}");
    }
}

/// The job (a checkpoint every step) with a process killed at `point`.
fn crash_at(mode: &str, point: &str) {
    crash_with_checkpoints_every(mode, point, 1);
}

/// The job with `trainer.save_freq` = `save_freq` (-1: no checkpoint) and a process killed at `point`.
fn crash_with_checkpoints_every(mode: &str, point: &str, save_freq: i64) {
    crash_job(mode, point, save_freq, 1);
}

/// The job with `ranks` trainer ranks, a checkpoint every step, and a process killed at `point`.
fn crash_job(mode: &str, point: &str, save_freq: i64, ranks: u32) {
    let _slot = slot();
    let dir = tempfile::tempdir().unwrap();
    let what = format!("{mode}, {point}, save_freq {save_freq}, {ranks} trainer ranks");
    let console = run_job(dir.path(), mode, save_freq, Some(point), None, ranks, |_| {});
    assert!(dir.path().join("crashed").exists(), "{what}: the crash point was never reached");
    assert!(console.contains("restarting in"), "{what}: no restart on the console:\n{console}");
    check_exactly_once(dir.path(), mode, &what);
}

/// The nats-server killed at step 3 and started again on its file store: every client reconnects and the run
/// completes with nothing lost or trained twice.
fn nats_restart(mode: &str) {
    let _slot = slot();
    let dir = tempfile::tempdir().unwrap();
    let mut nats = Some(NatsServer::start().unwrap());
    let url = nats.as_ref().unwrap().url();
    let mut restarted = false;
    run_job(dir.path(), mode, 1, None, Some(&url), 1, |run_dir| {
        if !restarted && metrics(run_dir).len() >= 3 {
            let server = nats.as_mut().unwrap();
            server.kill();
            std::thread::sleep(Duration::from_secs(2));
            server.restart().unwrap();
            restarted = true;
        }
    });
    assert!(restarted, "{mode}: the job ended before step 3");
    check_exactly_once(dir.path(), mode, &format!("{mode}, nats-server restart"));
}

/// One test per mode and crash point.
macro_rules! matrix {
    ($($module:ident => $mode:literal),+ $(,)?) => {$(
        mod $module {
            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_killed_before_submitting_a_step() {
                super::crash_at($mode, "trainer.before_submit@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_killed_after_submitting_a_step() {
                super::crash_at($mode, "trainer.after_submit@3");
            }

            /// No checkpoint to resume from: the restarted trainer starts again from step 0, the rows the dead
            /// one trained are rolled back, and each is trained once in the new timeline.
            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_killed_before_any_checkpoint() {
                super::crash_with_checkpoints_every($mode, "trainer.after_submit@3", -1);
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_killed_mid_update() {
                super::crash_at($mode, "trainer.mid_update@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_killed_between_checkpoint_and_weight_publish() {
                super::crash_at($mode, "trainer.between_checkpoint_and_publish@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn rollout_worker_killed_mid_group() {
                super::crash_at($mode, "rollout.mid_group@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn reward_service_killed_mid_batch() {
                super::crash_at($mode, "reward.mid_batch");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn replay_buffer_killed_mid_sample() {
                super::crash_at($mode, "buffer.mid_sample@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn checkpoint_sync_killed_mid_announce() {
                super::crash_at($mode, "checkpoint.mid_announce@3");
            }

            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn nats_server_killed_and_restarted_on_its_file_store() {
                super::nats_restart($mode);
            }

            /// Two trainer ranks; rank 1 is killed in the middle of a step: the group stops and restarts
            /// together from the last checkpoint.
            #[test]
            #[ignore = "slow tier: kills a service mid-run in every mode and checks the ledger"]
            fn trainer_rank_1_killed_mid_step() {
                super::crash_job($mode, "trainer.follower_train@3", 1, 2);
            }
        }
    )+};
}

matrix!(sync => "sync", colocate_async => "colocate_async", separate_async => "separate_async");

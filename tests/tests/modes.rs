//! The three training schedules end to end (`jetrl run` or the services as processes, a real nats-server, real
//! libtorch): each async mode learns the demo task as well as sync (separate_async with two trainer ranks); the
//! staleness bound holds under `drop` and `wait`; colocate_async's partial rollout is exact against the trainer's
//! checkpoints of each version.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::time::Duration;

use jetrl_tests::TestJob;
use jetrl_wire::Message;

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    jetrl_tests::run_metrics(run_dir).into_iter().filter(|m| m.get("critic/score/mean").is_some()).collect()
}

fn series(rows: &[serde_json::Value], key: &str) -> Vec<f64> {
    rows.iter().filter_map(|m| m[key].as_f64()).collect()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Steps whose mean reward is a run's final reward. Not fewer: one run's reward moves over a few steps (at the
/// constant learning rate the demo once had, a last-10 mean of 0.915 against sync's 0.997 was seen in a
/// separate_async run whose other steps were at sync's level).
const FINAL_STEPS: usize = 30;

/// The demo job (copy 4 digits, tiny-digits model, the demo's seed) in `mode` with `ranks` trainer ranks for
/// `steps` steps through `jetrl run`; returns the mean reward of the last [`FINAL_STEPS`] steps and the run's
/// metrics.
fn demo_in(dir: &Path, mode: &str, ranks: u32, steps: u32) -> (f64, Vec<serde_json::Value>) {
    let overrides = [
        format!("model.path={}", dir.join("model").display()),
        format!("trainer.mode={mode}"),
        format!("trainer.n_gpus_per_node={ranks}"),
        format!("trainer.total_training_steps={steps}"),
        "trainer.test_freq=-1".into(),
    ];
    let rows = metrics(&jetrl_tests::demo_run(dir, &format!("modes-{mode}"), &overrides, Duration::from_secs(600)));
    assert_eq!(rows.len(), steps as usize, "{mode}: one metrics line per step");
    let scores = series(&rows, "critic/score/mean");
    (mean(&scores[scores.len() - FINAL_STEPS..]), rows)
}

/// How much one run's final reward varies, and why the test runs the demo's full 200 steps. The demo task has a
/// trap: the policy can stop copying one of the ten digits (it writes `2` or `3` for `9`, say) while its entropy
/// falls, and the reward then sits near 0.9 (one position in ten wrong) until exploration finds the digit again.
/// Every mode can fall in: sync with seed 3 (validating every 10 steps) sat at 0.87–0.90 from step 50 to 100 of a
/// 200-step run, then left. A sync run repeats itself for a job file and seed (it falls in every time or never);
/// in the async modes timing decides which weights sample which token, so each run is a new draw. The demo's 200
/// steps decay the rate slowly enough that a run trapped early usually leaves (the measurements are in
/// docs/architecture.md, "Learning in the async modes"), but a late trap still ends a run near 0.9. So an async mode
/// whose run misses is run once more (a second draw), and fails the test only if that one misses too.
/// The learning test still runs alone (it takes this lock to write); the other tests of this file may run beside
/// each other (they read).
static EXCLUSIVE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    EXCLUSIVE.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    EXCLUSIVE.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Each async mode reaches the same final reward as sync on the demo task (within 0.05), and shows the off-policy
/// signature of its schedule. separate_async (the demo's mode) trains with two trainer ranks (Gloo, the rows split
/// between them, the optimizer state sharded): the ranks take the same commands in every mode, so this run is
/// also the check that a group of ranks learns as one rank does. Runs alone ([`EXCLUSIVE`]).
#[test]
#[ignore = "slow tier: the schedules end to end through jetrl run"]
fn each_async_mode_learns_the_demo_task_as_well_as_sync() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let steps = 200;
    let (sync, sync_rows) = demo_in(dir.path(), "sync", 1, steps);
    // An async run is a new draw each time (timing decides which weights sample which token), and one can end in
    // the trap above; a mode whose run missed runs once more, and that second run is the one judged. Sync repeats
    // itself, so it is run once.
    let draw = |mode: &str, ranks: u32| {
        let first = demo_in(dir.path(), mode, ranks, steps);
        if (first.0 - sync).abs() <= 0.05 {
            return first;
        }
        eprintln!("{mode}: final reward {:.3} against sync's {sync:.3} (the trap?); running it once more", first.0);
        demo_in(&dir.path().join("again"), mode, ranks, steps)
    };
    let (separate, separate_rows) = draw("separate_async", 2);
    let (colocate, colocate_rows) = draw("colocate_async", 1);
    eprintln!(
        "final reward (last {FINAL_STEPS} steps): sync {sync:.3}, separate_async (2 trainer ranks) {separate:.3}, \
         colocate_async {colocate:.3}"
    );
    assert!(sync > 0.8, "sync did not learn the demo task: {sync:.3}");
    assert!((separate - sync).abs() <= 0.05, "separate_async {separate:.3} vs sync {sync:.3}");
    assert!((colocate - sync).abs() <= 0.05, "colocate_async {colocate:.3} vs sync {sync:.3}");
    // sync is on-policy at every step; the async modes train on data from before the last update
    assert!(series(&sync_rows, "training/off_policy/trajectory_staleness/max").iter().all(|&s| s == 0.0));
    assert!(series(&separate_rows, "training/off_policy/trajectory_staleness/mean").iter().any(|&s| s > 0.0));
    assert!(series(&separate_rows, "training/local_updates").iter().all(|&n| n == 4.0));
    assert!(series(&colocate_rows, "colocate/parked_sequences").iter().any(|&n| n > 0.0), "the worker was paused");
}

/// A separate_async job with `max_off_policy_threshold: 2` never trains a group submitted more than 2 steps
/// before (`group_submit_span` ≤ 2 at every step); `drop` evicts stale groups and refills exactly as many;
/// `wait` evicts nothing.
#[test]
#[ignore = "slow tier: the schedules end to end through jetrl run"]
fn staleness_bound_holds_under_drop_and_wait() {
    let _shared = shared();
    for (strategy, warmup) in [("drop", 2), ("wait", 1)] {
        let mut job = TestJob::new(&format!(
            "run: {{name: stale-{strategy}}}\n\
             data: {{train_batch_size: 8, max_response_length: 4}}\n\
             actor: {{ppo_mini_batch_size: 4}}\n\
             buffer: {{max_off_policy_threshold: 2, max_off_policy_strategy: {strategy}}}\n\
             trainer: {{mode: separate_async, total_training_steps: 10, separate_async: {{num_warmup_batches: {warmup}, parameter_sync_step: 2}}}}"
        ));
        job.spawn_services(1, 1);
        job.spawn("trainer", "jetrl-trainer", &[]);
        let status = job.wait("trainer", Duration::from_secs(300));
        assert!(status.success(), "{strategy}: trainer failed:\n{}", job.log("trainer"));
        let rows = metrics(&job.run_dir());
        assert_eq!(rows.len(), 10);
        let spans = series(&rows, "training/off_policy/group_submit_span/max");
        assert!(spans.iter().all(|&s| s <= 2.0), "{strategy}: a trained group exceeded span 2: {spans:?}");
        let evicted: f64 = series(&rows, "training/off_policy/evicted_samples").iter().sum();
        let refilled: f64 = series(&rows, "training/refilled_prompts").iter().sum();
        match strategy {
            "drop" => {
                assert!(evicted > 0.0, "drop: with 2 warm-up batches and threshold 2 some groups go stale");
                assert_eq!(evicted, refilled, "drop refills exactly the evicted count");
            }
            _ => assert_eq!((evicted, refilled), (0.0, 0.0), "wait never evicts"),
        }
    }
}

/// colocate_async with responses long enough to be cut by a pause: some trained trajectories span two versions,
/// and every behaviour log-prob equals the log-prob that the checkpoint of its token's version gives it.
#[test]
#[ignore = "slow tier: the schedules end to end through jetrl run"]
fn colocate_partial_rollout_log_probs_match_each_versions_checkpoint() {
    let _shared = shared();
    let mut job = TestJob::new(
        "run: {name: partial}\n\
         data: {train_batch_size: 4, max_response_length: 48}\n\
         rollout: {n: 4, temperature: 1.0, max_num_seqs: 8}\n\
         trainer: {mode: colocate_async, total_training_steps: 6, save_freq: 1, colocate_async: {rollout_instance: rollout-0, num_warmup_batches: 2}}",
    );
    let dump = job.dir.path().join("rollouts");
    job.spawn_services(1, 1);
    job.spawn("trainer", "jetrl-trainer", &[&format!("trainer.rollout_data_dir={}", dump.display())]);
    let status = job.wait("trainer", Duration::from_secs(300));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));

    let ckpt = job.run_dir().join("checkpoints");
    let model_at = |version: u64| {
        let dir =
            if version == 0 { job.dir.path().join("model") } else { ckpt.join(format!("global_step_{version}/actor")) };
        jetrl_model::CausalLm::load(&dir, tch::Device::Cpu, jetrl_model::DType::F32).unwrap()
    };
    let mut models = std::collections::BTreeMap::new();
    let (mut mixed, mut checked, mut worst) = (0, 0, 0f32);
    for step in 1..=6u64 {
        let text = std::fs::read_to_string(dump.join(format!("{step}.jsonl"))).unwrap();
        for line in text.lines() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let ids = |k: &str| -> Vec<u32> {
                row[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
            };
            let (prompt, response) = (ids("prompt_ids"), ids("response_ids"));
            let behaviour: Vec<f32> =
                row["rollout_log_probs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            let runs: Vec<(usize, u64)> = row["version_runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| (r[0].as_u64().unwrap() as usize, r[1].as_u64().unwrap()))
                .collect();
            if runs.len() > 1 {
                mixed += 1;
            }
            let full: Vec<u32> = prompt.iter().chain(&response).copied().collect();
            for (k, &(start, version)) in runs.iter().enumerate() {
                let end = runs.get(k + 1).map_or(response.len(), |r| r.0);
                let model = models.entry(version).or_insert_with(|| model_at(version));
                let lp = jetrl_model::log_probs_of(model, &full).unwrap();
                for i in start..end {
                    worst = worst.max((lp[prompt.len() - 1 + i] - behaviour[i]).abs());
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{mixed} trajectories spanned versions; {checked} tokens checked, worst |Δ log-prob| = {worst:.2e}");
    assert!(mixed > 0, "no trained trajectory crossed a pause: partial rollout was not exercised");
    assert!(checked > 0);
    assert!(worst < 2e-3, "a behaviour log-prob differs from its version's by {worst}");
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a pid this test spawned, with a valid signal number.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

fn wait_for_step(job: &TestJob, step: usize, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while metrics(&job.run_dir()).len() < step {
        assert!(std::time::Instant::now() < deadline, "step {step} not reached; trainer log:\n{}", job.log("trainer"));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A rollout worker SIGSTOPped during training: the trainer's weight syncs go on past it (it is reported silent),
/// its groups are redelivered to the other worker, and after SIGCONT it loads the newest version and takes work
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: the schedules end to end through jetrl run"]
#[allow(clippy::await_holding_lock)] // the guard only orders the tests of this file
async fn a_stopped_worker_is_left_out_of_weight_syncs_and_rejoins_after_sigcont() {
    let _shared = shared();
    let mut job = TestJob::new(
        "run: {name: sigstop}\n\
         rollout: {n: 4, ack_wait_s: 3, heartbeat_interval_s: 0.5, heartbeat_timeout_s: 2}\n\
         trainer: {total_training_steps: 14, weight_sync_timeout_s: 5}",
    );
    job.spawn_services(2, 1);
    job.spawn("trainer", "jetrl-trainer", &[]);
    tokio::task::block_in_place(|| wait_for_step(&job, 2, Duration::from_secs(120)));
    let pid = job.pid("rollout-1");
    signal(pid, libc::SIGSTOP);
    tokio::task::block_in_place(|| wait_for_step(&job, 7, Duration::from_secs(120)));
    signal(pid, libc::SIGCONT);
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(240)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));

    let rows = metrics(&job.run_dir());
    assert_eq!(rows.len(), 14, "every step trained");
    let silent = series(&rows, "weight_sync/silent_workers");
    assert!(silent.iter().any(|&n| n > 0.0), "the stopped worker was never reported: {silent:?}");
    assert_eq!(silent.last(), Some(&0.0), "the worker is back by the last step: {silent:?}");
    assert!(
        series(&rows, "training/off_policy/trajectory_staleness/max").iter().all(|&s| s == 0.0),
        "sync stayed on-policy"
    );
    // it loaded the newest weights and took groups again after SIGCONT
    let cfg = job.config();
    let bus = jetrl_bus::Bus::connect_job(&cfg, "sigstop-check").await.unwrap();
    let store = jetrl_bus::GroupStore::open(&bus).await.unwrap();
    let late: Vec<_> = jetrl_tests::group_records(&store)
        .await
        .into_iter()
        .filter(|g| g.partition == "train" && g.submit_step >= 11 && g.worker_id == "rollout-1")
        .collect();
    assert!(!late.is_empty(), "rollout-1 took no group after SIGCONT");
    let beats = bus.key_value(bus.names().workers_bucket()).await.unwrap();
    let beat =
        jetrl_wire::v1::Heartbeat::decode(beats.get("rollout.rollout-1").await.unwrap().unwrap().as_ref()).unwrap();
    assert!(beat.policy_version >= 13, "rollout-1 holds v{}", beat.policy_version);
    assert!(job.log("trainer").contains("silent"), "the trainer log does not report the silent worker");
}

/// kill -9 of a rollout worker mid-run in separate_async: the run completes, and the buffer's ledger shows every
/// group trained once or evicted with a reason (none lost in the dead worker's hands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: the schedules end to end through jetrl run"]
#[allow(clippy::await_holding_lock)] // the guard only orders the tests of this file
async fn separate_async_survives_a_killed_worker_and_every_group_is_accounted_for() {
    let _shared = shared();
    let mut job = TestJob::new(
        "run: {name: killworker}\n\
         rollout: {n: 4, ack_wait_s: 3, heartbeat_interval_s: 0.5, heartbeat_timeout_s: 2}\n\
         actor: {ppo_mini_batch_size: 4}\n\
         trainer: {mode: separate_async, total_training_steps: 10, weight_sync_timeout_s: 5, separate_async: {parameter_sync_step: 2}}",
    );
    job.spawn_services(2, 1);
    job.spawn("trainer", "jetrl-trainer", &[]);
    tokio::task::block_in_place(|| wait_for_step(&job, 3, Duration::from_secs(120)));
    let cfg = job.config();
    let bus = jetrl_bus::Bus::connect_job(&cfg, "kill-check").await.unwrap();
    let store = jetrl_bus::GroupStore::open(&bus).await.unwrap();
    // the kill point, by watching state: the worker holds a group it is generating
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let held: Vec<String> = loop {
        let held: Vec<String> = jetrl_tests::group_records(&store)
            .await
            .into_iter()
            .filter(|g| g.worker_id == "rollout-1" && g.state() == jetrl_wire::v1::GroupState::Running)
            .map(|g| g.uid)
            .collect();
        if !held.is_empty() {
            job.kill("rollout-1");
            break held;
        }
        assert!(std::time::Instant::now() < deadline, "rollout-1 never held a group: the test would check nothing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(240)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));
    assert_eq!(metrics(&job.run_dir()).len(), 10);

    let request = jetrl_wire::v1::LedgerRequest { partition: "train".into(), uids: vec![], limit: 100_000 };
    let ledger: jetrl_wire::v1::LedgerResponse =
        bus.request(bus.names().buffer_ledger(), &request, Duration::from_secs(10)).await.unwrap();
    assert!(ledger.error.is_empty(), "{}", ledger.error);
    let mut trained = std::collections::HashMap::new();
    for entry in &ledger.entries {
        let state = jetrl_wire::v1::GroupState::try_from(entry.state).unwrap();
        match state {
            jetrl_wire::v1::GroupState::Sampled => {
                assert!(entry.sampled_step >= 1, "{} sampled without a step", entry.uid);
                *trained.entry(entry.uid.clone()).or_insert(0) += 1;
            }
            jetrl_wire::v1::GroupState::Evicted => {
                assert_ne!(entry.eviction(), jetrl_wire::v1::Eviction::Unspecified, "{} evicted silently", entry.uid)
            }
            _ => {}
        }
    }
    assert!(trained.values().all(|&n| n == 1), "a group was trained twice");
    assert_eq!(trained.len(), 10 * 8, "10 steps of 8 groups trained");
    // the dead worker's groups were redelivered (another worker took them over) and trained or evicted with a
    // reason, not lost; the run may end before a late one is taken over, so the survivor gets ack_wait to do it
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let records = jetrl_tests::group_records(&store).await;
        let stuck: Vec<String> = held
            .iter()
            .filter(|uid| {
                let record = records.iter().find(|g| &g.uid == *uid).expect("a held group keeps its record");
                let decided =
                    matches!(record.state(), jetrl_wire::v1::GroupState::Sampled | jetrl_wire::v1::GroupState::Evicted);
                !decided && record.worker_id == "rollout-1"
            })
            .map(|uid| format!("{uid}: {:?}", records.iter().find(|g| &g.uid == uid).map(|g| g.state())))
            .collect();
        if stuck.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "groups still held by the killed worker: {stuck:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for uid in &held {
        let entry = ledger.entries.iter().find(|e| &e.uid == uid).expect("a held group is in the ledger");
        let state = jetrl_wire::v1::GroupState::try_from(entry.state).unwrap();
        assert_ne!(state, jetrl_wire::v1::GroupState::Failure, "group {uid} held by the killed worker failed");
    }
}

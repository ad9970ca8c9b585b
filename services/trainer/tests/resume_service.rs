//! A trainer stopped after a checkpoint and started again continues the run through the real services (a
//! real nats-server, the other four services as processes from `cargo build --bins`, the trainer in-process,
//! the real tiny model). The rollout worker is killed after step 2, so the first trainer leaves step 3's
//! groups pending when it stops; the second trainer resumes at step 3,
//! re-issues the prompt groups the first incarnation left in flight, and the run ends with one metrics line
//! per step and the final checkpoint.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::time::{Duration, Instant};

use jetrl_bus::{Bus, GroupStore};
use jetrl_tests::TestJob;
use jetrl_trainer::checkpoint::{self, TrainerState};
use jetrl_wire::v1::{Eviction, GroupState};
use tokio::sync::watch;

/// A shutdown future that resolves when the sender says so.
fn until(rx: &watch::Receiver<bool>) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = rx.clone();
    async move {
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

fn metric_steps(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["training/global_step"].as_f64().map(|s| s as u64))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn trainer_restarted_after_a_checkpoint_resumes_and_finishes_the_run() {
    // the in-process trainer's log goes to the captured output (shown when the test fails)
    jetrl_telemetry::init_tracing("info", jetrl_config::LogFormat::Text);
    let mut job = TestJob::new(
        "run: {name: resume}\n\
         data: {task: {name: reverse, min_len: 4, max_len: 4, train_size: 400, val_size: 4}, train_batch_size: 4, \
         max_response_length: 4}\n\
         trainer: {total_training_steps: 4, save_freq: 2, weight_sync_timeout_s: 60, sample_wait_s: 2}",
    );
    let cfg = job.config();
    let run_dir = job.run_dir();
    let ckpt_root = checkpoint::root_dir(&cfg);
    job.spawn("checkpoint-sync", "jetrl-checkpoint-sync", &[]);
    job.spawn("replay-buffer", "jetrl-replay-buffer", &[]);
    job.spawn("reward-0", "jetrl-reward-service", &[]);
    job.spawn("rollout-0", "jetrl-rollout-worker", &["rollout.instance_id=rollout-0"]);
    let bus = Bus::connect_job(&cfg, "resume-check").await.unwrap();
    // (the trainer declares the same topology when it starts; the test reads the records before that)
    bus.declare_topology().await.unwrap();
    let groups = GroupStore::open(&bus).await.unwrap();

    // first incarnation: once step 2 is checkpointed and logged, the only rollout worker is killed; the
    // trainer is stopped when step 3's groups are waiting in vain
    let (first_stop, first_rx) = watch::channel(false);
    let stopper = async {
        let deadline = Instant::now() + Duration::from_secs(240);
        while std::fs::read_to_string(ckpt_root.join(checkpoint::LATEST_FILE)).ok().as_deref() != Some("2")
            || !metric_steps(&run_dir).contains(&2)
        {
            assert!(Instant::now() < deadline, "no step-2 checkpoint");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        job.kill("rollout-0");
        loop {
            let step3 = groups.records("train").await.unwrap().into_iter().filter(|g| g.submit_step == 3).count();
            if step3 == 4 {
                break;
            }
            assert!(Instant::now() < deadline, "step 3 was never submitted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first_stop.send(true).unwrap();
    };
    let (first, ()) = tokio::join!(jetrl_trainer::run(cfg.clone(), until(&first_rx)), stopper);
    first.unwrap();
    assert_eq!(metric_steps(&run_dir), vec![1, 2]);
    let stranded: Vec<String> = groups
        .list("train")
        .await
        .unwrap()
        .into_iter()
        .filter(|g| matches!(g.state(), GroupState::Pending | GroupState::Running))
        .map(|g| g.uid)
        .collect();
    assert_eq!(stranded.len(), 4, "step 3's groups are left in flight");

    // second incarnation (same config, resume_mode auto); a new worker is started once the stranded groups
    // have been re-issued (until then the dead worker's last heartbeat still counts as live)
    let (_second_stop, second_rx) = watch::channel(false);
    let new_worker = async {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let all = groups.records("train").await.unwrap();
            let superseded = all.iter().filter(|g| g.eviction() == Eviction::SupersededByResume).count();
            if superseded == stranded.len() {
                break;
            }
            assert!(Instant::now() < deadline, "stranded groups never superseded ({superseded})");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        job.spawn("rollout-1", "jetrl-rollout-worker", &["rollout.instance_id=rollout-1"]);
    };
    let (second, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(240), jetrl_trainer::run(cfg.clone(), until(&second_rx))),
        new_worker
    );
    if second.is_err() {
        // what the records say when the second trainer hangs
        for g in groups.records("train").await.unwrap() {
            let (uid, step, state, worker, reason) =
                (&g.uid, g.submit_step, g.state(), &g.worker_id, g.eviction().describe(&g.evicted_reason));
            eprintln!("group {uid}: submitted at step {step}, {state:?}, worker {worker:?}, reason {reason:?}");
        }
    }
    second.expect("second trainer finishes").unwrap();

    assert_eq!(metric_steps(&run_dir), vec![1, 2, 3, 4], "one metrics line per step, the redone ones once");
    let last = checkpoint::resolve_resume(&cfg).unwrap().expect("a checkpoint");
    assert_eq!(checkpoint::step_of(&last), Some(4));
    let state: TrainerState = checkpoint::read_json(&last.join(checkpoint::TRAINER_STATE_FILE)).unwrap();
    assert_eq!(state.global_step, 4);
    assert_eq!(state.actor.actor_updates, 4, "each step updated the actor once, across both incarnations");
    assert_eq!(state.dataloader.cursor, 16, "the dataloader continued from the checkpoint's cursor");
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    for line in text.lines().skip(2) {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(m["training/num_groups"].as_f64(), Some(4.0), "{m}");
        assert!(m["actor/pg_loss"].as_f64().is_some_and(f64::is_finite), "{m}");
    }

    // the stranded groups were generated after the checkpoint: superseded under their old uids, their rows drawn
    // again by the restored dataloader and trained on once
    let all = groups.records("train").await.unwrap();
    for uid in &stranded {
        let g = all.iter().find(|g| &g.uid == uid).expect("stranded group record");
        assert_eq!((g.state(), g.eviction()), (GroupState::Evicted, Eviction::SupersededByResume));
    }
    let sampled = all.iter().filter(|g| g.state() == GroupState::Sampled).count();
    assert_eq!(sampled, 16, "4 steps of 4 groups were trained on");
    // the ledger by dataset row: the 16 rows the 4 steps drew, each trained exactly once, none twice
    let (rows, duplicates) = jetrl_bus::ledger::ledger(&all);
    assert!(duplicates.is_empty(), "rows decided twice: {duplicates:?}");
    let trained: Vec<_> = rows.iter().filter(|r| r.fate == jetrl_bus::ledger::Fate::Trained).collect();
    assert_eq!(trained.len(), 16, "{rows:?}");
    assert_eq!(rows.len(), 16, "no row drawn beyond the 16 trained: {rows:?}");
    let ledger = std::fs::read_to_string(run_dir.join("ledger.jsonl")).expect("the trainer wrote ledger.jsonl");
    assert_eq!(ledger.lines().count(), 16);
}

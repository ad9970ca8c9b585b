//! End to end: the five services as separate processes started one by one (not through `jetrl run`), a real
//! nats-server, the real tiny model, two rollout workers sharing one work queue. Whether the services learn is the
//! schedules' tests' question (`modes.rs`, 200 steps of the demo in every mode); this one checks the wiring those
//! do not: services started by hand find each other, both workers take groups, every step is trained and written.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashSet;
use std::time::Duration;

use jetrl_bus::{Bus, GroupStore};
use jetrl_tests::TestJob;

const STEPS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: the five services as processes (not jetrl run), two workers sharing the queue"]
async fn five_services_as_processes_train_every_step_with_two_workers_sharing_the_queue() {
    let mut job = TestJob::new(&format!(
        "data: {{train_batch_size: 16, max_response_length: 4}}\n\
         rollout: {{n: 4}}\n\
         actor: {{optim: {{lr: 1.0e-3, weight_decay: 0.0}}, ppo_mini_batch_size: 8}}\n\
         trainer: {{total_training_steps: {STEPS}}}"
    ));
    // two rollout workers share one work queue
    job.spawn_services(2, 1);
    job.spawn("trainer", "jetrl-trainer", &[]);
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(180)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));

    let scores: Vec<f64> = job.metrics().iter().filter_map(|m| m["critic/score/mean"].as_f64()).collect();
    assert_eq!(scores.len(), STEPS, "one metrics line per step");
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)), "{scores:?}");

    // both workers took groups from the shared queue
    let bus = Bus::connect_job(&job.config(), "e2e-check").await.unwrap();
    let store = GroupStore::open(&bus).await.unwrap();
    let workers: HashSet<String> = jetrl_tests::group_records(&store).await.into_iter().map(|s| s.worker_id).collect();
    assert!(workers.contains("rollout-0") && workers.contains("rollout-1"), "workers seen: {workers:?}");
    assert!(job.run_dir().join("reward_curve.svg").exists());
}

//! End to end: the five services as separate processes, a real nats-server, the real tiny model, learning
//! the demo's task on a smaller budget.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashSet;
use std::time::{Duration, Instant};

use jetrl_bus::{Bus, GroupStore};
use jetrl_tests::TestJob;

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_services_as_processes_learn_the_reverse_task() {
    let started = Instant::now();
    let mut job = TestJob::new(
        "data: {train_batch_size: 32, max_response_length: 4}\n\
         rollout: {n: 8}\n\
         actor: {optim: {lr: 1.0e-3, weight_decay: 0.0}, ppo_mini_batch_size: 8}\n\
         trainer: {total_training_steps: 60}",
    );
    // two rollout workers share one work queue
    job.spawn_services(2, 1);
    job.spawn("trainer", "jetrl-trainer", &[]);
    let status = tokio::task::block_in_place(|| job.wait("trainer", Duration::from_secs(280)));
    assert!(status.success(), "trainer failed:\n{}", job.log("trainer"));

    let scores: Vec<f64> = job.metrics().iter().filter_map(|m| m["critic/score/mean"].as_f64()).collect();
    assert_eq!(scores.len(), 60, "one metrics line per step");
    let (first, last) = (mean(&scores[..5]), mean(&scores[scores.len() - 5..]));
    eprintln!("first-5 mean reward {first:.3}, last-5 {last:.3}, {:.0}s", started.elapsed().as_secs_f64());
    assert!(last >= first + 0.3, "reward did not rise: first-5 {first:.3}, last-5 {last:.3}; curve {scores:?}");

    // both workers took groups from the shared queue
    let bus = Bus::connect_job(&job.config(), "e2e-check").await.unwrap();
    let store = GroupStore::open(&bus).await.unwrap();
    let workers: HashSet<String> = jetrl_tests::group_records(&store).await.into_iter().map(|s| s.worker_id).collect();
    assert!(workers.contains("rollout-0") && workers.contains("rollout-1"), "workers seen: {workers:?}");
    assert!(job.run_dir().join("reward_curve.svg").exists());
}

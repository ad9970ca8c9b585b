//! Several reward-service processes on one durable consumer of score requests: the work is shared and every
//! trajectory is scored once; a process killed mid-batch loses nothing and duplicates nothing.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{Harness, ServiceProcess};
use jetrl_wire::subjects;

/// Waits until `count` pull requests of the reward consumer are waiting at the server, i.e. that many instances
/// are up and asking for work.
async fn wait_for_waiting_pulls(harness: &Harness, count: usize) {
    let stream = harness.bus.stream(harness.bus.names().score_stream()).await.expect("SCORE");
    let started = Instant::now();
    loop {
        if let Ok(mut consumer) =
            stream.get_consumer::<async_nats::jetstream::consumer::pull::Config>(subjects::REWARD_CONSUMER).await
        {
            if let Ok(info) = consumer.info().await {
                if info.num_waiting >= count {
                    return;
                }
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{count} reward services did not start pulling");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_the_work_and_score_every_trajectory_exactly_once() {
    let harness = Harness::start().await;
    let (addr_a, addr_b) = (common::free_addr(), common::free_addr());
    // Small pulls, so that neither instance takes the whole backlog at once.
    let job = harness.job_file("job", "max_inflight: 16\nbatch_size: 8");
    let _a = ServiceProcess::spawn(&job, harness.dir.path().join("a.log"), &[format!("reward.metrics_addr={addr_a}")]);
    let _b = ServiceProcess::spawn(&job, harness.dir.path().join("b.log"), &[format!("reward.metrics_addr={addr_b}")]);
    wait_for_waiting_pulls(&harness, 2).await;

    let trajectories = common::trajectories(250, 8);
    harness.publish(&trajectories).await;
    harness.wait_for_rewards(trajectories.len(), Duration::from_secs(60)).await;

    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards.len(), trajectories.len(), "every trajectory has a reward");
    assert!(rewards.values().all(|copies| copies.len() == 1), "no trajectory has two rewards");
    for traj in &trajectories {
        let reward = &rewards[&traj.key][0];
        let expected = if traj.session_id & 1 == 0 { 1.0 } else { 0.0 };
        assert_eq!((reward.score, reward.failure_reason.as_str()), (expected, ""), "{}", traj.key);
    }
    let page_a = common::scrape(addr_a).await;
    let page_b = common::scrape(addr_b).await;
    let scored_a = common::sample(&page_a, "jetrl_reward_trajectories_total", "").unwrap_or(0.0);
    let scored_b = common::sample(&page_b, "jetrl_reward_trajectories_total", "").unwrap_or(0.0);
    eprintln!("instance a scored {scored_a}, instance b scored {scored_b}");
    assert!(scored_a > 0.0 && scored_b > 0.0, "both instances did work: a {scored_a}, b {scored_b}");
    assert_eq!(scored_a + scored_b, trajectories.len() as f64, "no trajectory was scored by both");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_killed_mid_batch_and_restarted_leaves_exactly_one_reward_per_trajectory() {
    common::require_python3();
    let harness = Harness::start().await;
    // 0.3 s per call of two trajectories (one group), at most two groups held: the process is almost always in
    // the middle of a batch.
    let (command, scored_log) = common::slow_logging_function(harness.dir.path(), 0.3);
    let reward_yaml = format!(
        "max_inflight: 2\nbatch_size: 2\nack_wait_s: 2\ncustom_reward_function: {{command: {}, batch_size: 2, no_network: false}}",
        serde_json::to_string(&command).expect("command as YAML")
    );
    let job = harness.job_file("job", &reward_yaml);
    let trajectories = common::trajectories(16, 2);
    harness.publish(&trajectories).await;

    let mut first = ServiceProcess::spawn(&job, harness.dir.path().join("first.log"), &[]);
    // Kill once some rewards are stored and a batch is being scored (handed to the function, not yet stored).
    let started = Instant::now();
    loop {
        let stored = harness.stored_rewards().await;
        let handed: usize = common::scored_counts(&scored_log).values().sum();
        if stored >= 6 && handed > stored {
            break;
        }
        assert!(stored < trajectories.len(), "the first process finished before it could be killed");
        assert!(started.elapsed() < Duration::from_secs(60), "the first process made no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill();
    let stored_at_kill = harness.stored_rewards().await;

    let _second = ServiceProcess::spawn(&job, harness.dir.path().join("second.log"), &[]);
    harness.wait_for_rewards(trajectories.len(), Duration::from_secs(90)).await;
    // Whatever the dead process left unacknowledged has been redelivered by now (ack_wait 2 s): nothing more
    // may arrive.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards.len(), trajectories.len(), "no trajectory lost");
    let doubled: Vec<_> = rewards.iter().filter(|(_, copies)| copies.len() > 1).map(|(key, _)| key).collect();
    assert!(doubled.is_empty(), "trajectories with two rewards: {doubled:?}");
    assert!(rewards.values().all(|copies| copies[0].failure_reason.is_empty() && copies[0].score == 1.0));
    let rescored: HashMap<_, _> = common::scored_counts(&scored_log).into_iter().filter(|(_, n)| *n > 1).collect();
    eprintln!("{stored_at_kill} rewards stored at the kill; scored again after the restart: {rescored:?}");
    assert!(!rescored.is_empty(), "the kill interrupted a batch, whose trajectories were scored again");
}

//! A user function slower than `ack_wait`: the service keeps every score request it holds alive with in-progress
//! acks, from the moment it arrives (also while it waits for the function) until it is acknowledged, so no
//! request is redelivered to the other instance and scored twice.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use crate::common;

use std::time::Duration;

use common::Harness;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scorer_slower_than_ack_wait_scores_each_trajectory_once_across_two_instances() {
    common::require_python3();
    let harness = Harness::start().await;
    // Each call takes 2.5 s, against an ack_wait of 1 s; an instance holds 2 groups of 2 trajectories (one call
    // each), so the second waits 2.5 s for the single function process before it is even handed over.
    let (command, scored_log) = common::slow_logging_function(harness.dir.path(), 2.5);
    let mut cfg = harness.config();
    cfg.reward.ack_wait_s = 1.0;
    cfg.reward.max_inflight = 2;
    cfg.reward.batch_size = 2;
    cfg.reward.custom_reward_function.command = command;
    cfg.reward.custom_reward_function.batch_size = 2;
    cfg.reward.custom_reward_function.no_network = false;
    let trajectories = common::trajectories(4, 2);
    harness.publish(&trajectories).await;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let instances: Vec<_> = (0..2)
        .map(|_| {
            let mut stopped = stopped.clone();
            tokio::spawn(jetrl_reward_service::run(cfg.clone(), async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }))
        })
        .collect();
    harness.wait_for_rewards(trajectories.len(), Duration::from_secs(60)).await;
    let _ = stop.send(true);
    for instance in instances {
        instance.await.expect("instance task").expect("instance ran");
    }

    let scored = common::scored_counts(&scored_log);
    assert_eq!(scored.len(), trajectories.len(), "every trajectory reached the function: {scored:?}");
    assert!(scored.values().all(|&times| times == 1), "a trajectory was scored twice: {scored:?}");
    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards.len(), trajectories.len());
    assert!(rewards.values().all(|copies| copies.len() == 1 && copies[0].score == 1.0));
}

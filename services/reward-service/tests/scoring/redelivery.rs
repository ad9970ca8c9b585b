//! A score request redelivered after its rewards were stored (the instance that scored it died before
//! acknowledging) is acknowledged without being scored again, whatever the de-duplication window.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use crate::common;

use std::time::{Duration, Instant};

use common::Harness;
use jetrl_bus::consume;
use jetrl_wire::subjects;
use jetrl_wire::v1::{Reward, RewardBatch};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_request_whose_rewards_are_stored_is_acknowledged_without_scoring_again() {
    common::require_python3();
    let harness = Harness::start().await;
    let ids = harness
        .publish(&[
            common::trajectory("done", 0),
            common::trajectory("done", 1),
            common::trajectory("fresh", 0),
            common::trajectory("fresh", 1),
        ])
        .await;
    // The reward batch an earlier instance stored for group `done` before it died.
    let earlier = Reward {
        key: "done_0_0".into(),
        uid: "done".into(),
        partition: "train".into(),
        score: 0.25,
        ..Reward::default()
    };
    let batch =
        RewardBatch { rewards: vec![earlier, Reward { key: "done_1_0".into(), score: 0.5, ..Reward::default() }] };
    let stored = jetrl_bus::score::reward_message(harness.bus.names(), "train", &batch, &[ids["done"].clone()]);
    harness.bus.publish_durable(stored).await.expect("rewards");
    // That instance had received both requests: delivered once, never acknowledged.
    let ack_wait = Duration::from_secs(1);
    let names = harness.bus.names();
    let consumer = harness
        .bus
        .shared_pull_consumer(names.score_stream(), subjects::REWARD_CONSUMER, &names.score_filter(), ack_wait, 100_000)
        .await
        .expect("consumer");
    let first_delivery = consume::pull_collect(&consumer, 2, Duration::from_secs(2)).await.expect("pull");
    assert_eq!(first_delivery.len(), 2);
    tokio::time::sleep(ack_wait + Duration::from_millis(500)).await;

    let (command, scored_log) = common::slow_logging_function(harness.dir.path(), 0.0);
    let mut cfg = harness.config();
    cfg.reward.ack_wait_s = ack_wait.as_secs_f64();
    cfg.reward.custom_reward_function.command = command;
    cfg.reward.custom_reward_function.no_network = false;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(jetrl_reward_service::run(cfg, async move {
        let _ = stopped.await;
    }));
    harness.wait_for_rewards(4, Duration::from_secs(30)).await;
    let stream = harness.bus.stream(names.score_stream()).await.expect("SCORE");
    let started = Instant::now();
    loop {
        let mut consumer = stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(subjects::REWARD_CONSUMER)
            .await
            .expect("consumer");
        let info = consumer.info().await.expect("consumer info");
        if info.num_ack_pending == 0 && info.num_pending == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "requests not acknowledged: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // acknowledged requests are purged from SCORE (in bulk, below the consumer's ack floor)
    let started = Instant::now();
    loop {
        let info = harness.bus.stream(names.score_stream()).await.expect("SCORE").get_info().await.expect("info");
        if info.state.messages == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "settled requests not purged: {:?}", info.state);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    service.await.expect("service task").expect("service ran");

    let scored = common::scored_counts(&scored_log);
    assert_eq!(scored.get("fresh_0_0"), Some(&1), "the other group is scored: {scored:?}");
    assert_eq!(scored.get("fresh_1_0"), Some(&1), "the other group is scored: {scored:?}");
    assert_eq!(scored.get("done_0_0"), None, "the already-scored group is not scored again: {scored:?}");
    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards["done_0_0"].len(), 1);
    assert_eq!(rewards["done_0_0"][0].score, 0.25, "the stored reward stands");
}

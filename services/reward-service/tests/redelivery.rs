//! A trajectory redelivered after its reward was stored (the instance that scored it died before acknowledging)
//! is acknowledged without being scored again, whatever the de-duplication window.

mod common;

use std::time::{Duration, Instant};

use common::Harness;
use jetrl_bus::consume;
use jetrl_bus::publish::Outgoing;
use jetrl_wire::subjects;
use jetrl_wire::v1::Reward;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_trajectory_whose_reward_is_stored_is_acknowledged_without_scoring_again() {
    if !common::python3_available() {
        return;
    }
    let harness = Harness::start().await;
    // The reward an earlier instance stored for `done_0_0` before it died.
    let earlier = Reward {
        key: "done_0_0".into(),
        uid: "done".into(),
        partition: "train".into(),
        score: 0.25,
        ..Reward::default()
    };
    let subject = subjects::reward_subject("train", "done");
    harness
        .bus
        .publish_durable(Outgoing::protobuf(subject, Some(earlier.key.clone()), &earlier))
        .await
        .expect("reward");
    harness.publish(&[common::trajectory("done", 0), common::trajectory("done", 1)]).await;
    // That instance had received both trajectories: delivered once, never acknowledged.
    let ack_wait = Duration::from_secs(1);
    let consumer = harness
        .bus
        .shared_pull_consumer(subjects::TRAJ_STREAM, subjects::REWARD_CONSUMER, "jetrl.traj.>", ack_wait, 100_000)
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
    harness.wait_for_rewards(2, Duration::from_secs(30)).await;
    let stream = harness.bus.stream(subjects::TRAJ_STREAM).await.expect("TRAJ");
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
        assert!(started.elapsed() < Duration::from_secs(20), "trajectories not acknowledged: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    service.await.expect("service task").expect("service ran");

    let scored = common::scored_counts(&scored_log);
    assert_eq!(scored.get("done_1_0"), Some(&1), "the other trajectory is scored: {scored:?}");
    assert_eq!(scored.get("done_0_0"), None, "the already-scored trajectory is not scored again");
    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards["done_0_0"].len(), 1);
    assert_eq!(rewards["done_0_0"][0].score, 0.25, "the stored reward stands");
}

//! A running service exports scores by data source, scorer latency, failures by reason and queue lag on
//! `/metrics`. (Its own test binary: the Prometheus recorder is process-wide.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::Harness;
use jetrl_wire::v1::Trajectory;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_service_exports_scores_latency_failures_and_queue_lag() {
    let harness = Harness::start().await;
    let addr = common::free_addr();
    let mut cfg = harness.config();
    cfg.reward.metrics_addr = addr.to_string();
    let gsm8k = Trajectory {
        data_source: "openai/gsm8k".into(),
        response_text: "6 * 12 = 72\n#### 72".into(),
        ground_truth: "72".into(),
        ..common::trajectory("met", 0)
    };
    let unknown = Trajectory { data_source: "nobody/knows".into(), ..common::trajectory("met", 1) };
    harness.publish(&[gsm8k, unknown]).await;
    harness.publish_raw_request("bad", b"\xff\xff not a score request".to_vec()).await;

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(jetrl_reward_service::run(cfg, async move {
        let _ = stopped.await;
    }));
    harness.wait_for_rewards(3, Duration::from_secs(30)).await;
    // Acknowledgement (and its counters) follows the rewards being stored by a moment.
    let started = std::time::Instant::now();
    let page = loop {
        let page = common::scrape(addr).await;
        if common::sample(&page, "jetrl_reward_trajectories_total", "") == Some(3.0) {
            break page;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "trajectories never counted as done: {page}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = stop.send(());
    service.await.expect("service task").expect("service ran");

    let has = |name: &str, labels: &str| common::sample(&page, name, labels).unwrap_or(0.0);
    assert_eq!(has("jetrl_reward_scores_total", "data_source=\"openai/gsm8k\""), 1.0, "{page}");
    assert_eq!(has("jetrl_reward_score_latency_seconds_count", "scorer=\"gsm8k\""), 1.0, "{page}");
    assert_eq!(has("jetrl_reward_failures_total", "reason=\"unknown_data_source\""), 1.0, "{page}");
    assert_eq!(has("jetrl_reward_failures_total", "reason=\"malformed_score_request\""), 1.0, "{page}");
    assert_eq!(has("jetrl_reward_queue_lag_seconds_count", ""), 2.0, "{page}");
    assert!(common::sample(&page, "jetrl_reward_queue_pending_messages", "").is_some(), "{page}");
    assert_eq!(has("jetrl_reward_trajectories_total", ""), 3.0, "{page}");

    let rewards = harness.rewards_by_key().await;
    assert_eq!(rewards["met_0_0"][0].score, 1.0);
    assert!(rewards["met_1_0"][0].failure_reason.contains("unknown_data_source"));
    // the malformed request's group still gets a failure reward for its stored trajectory
    assert!(rewards["bad_0_0"][0].failure_reason.starts_with("malformed score request"), "{:?}", rewards["bad_0_0"]);
    assert!(rewards["bad_0_0"][0].traj_seq > 0);
}

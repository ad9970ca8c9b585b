//! jetrl-reward-service: turns trajectories into scores, off the rollout's critical path.
//!
//! Every instance pulls from one durable consumer on the TRAJ stream (so instances share the work and
//! scale horizontally), scores a batch with [`jetrl_reward::RewardEngine`] (rule scorers by `data_source`,
//! a user function out of process, or a remote reward model), publishes one [`Reward`] per trajectory on
//! `jetrl.rewards.<partition>.<uid>` with `Nats-Msg-Id` = the trajectory key (a trajectory scored twice
//! after a crash is stored once), and acknowledges the trajectories only after the rewards are durable.
//!
//! A trajectory that cannot even be decoded is terminated, counted, and — since its key is in the
//! message's `Nats-Msg-Id` — still gets a zero reward with a failure reason, so its group is never stuck.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::{FutureExt, StreamExt};
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, Bus, BusError, Publisher};
use jetrl_config::JobConfig;
use jetrl_reward::{RewardEngine, ScoreInput, ScoreOutcome};
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{Reward, Trajectory};
use jetrl_wire::{packed, subjects, Message};

const SERVICE: &str = "reward";

#[derive(Debug, thiserror::Error)]
pub enum RewardServiceError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("reward engine: {0}")]
    Engine(#[from] jetrl_reward::RewardError),
}

/// Runs one reward-service instance until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RewardServiceError> {
    let shutdown = Shutdown::new(shutdown);
    let bus = Bus::connect(&cfg.nats, "jetrl-reward-service").await?;
    bus.declare_topology().await?;
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.reward.metrics_addr, async move { stop.wait().await }).await?;
    let engine = RewardEngine::new(&cfg.reward).await?;
    let ack_wait = Duration::from_secs_f64(cfg.reward.ack_wait_s.max(1.0));
    let consumer = bus
        .shared_pull_consumer(
            subjects::TRAJ_STREAM,
            subjects::REWARD_CONSUMER,
            &format!("{}.>", subjects::TRAJ_SUBJECT),
            ack_wait,
            100_000,
        )
        .await?;
    let batch_max = cfg.reward.max_inflight.max(1) as usize;
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(batch_max)
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await
        .map_err(|e| BusError::Consume { what: subjects::REWARD_CONSUMER.into(), message: e.to_string() })?;
    let mut publisher = Publisher::new(&bus, 1024);
    tracing::info!(route = engine.route_name(), batch_max, "reward service consuming trajectories");
    loop {
        // Wait for one message (or shutdown), then take whatever else is already buffered: a batch forms
        // without adding latency.
        let first = tokio::select! {
            _ = shutdown.wait() => break,
            next = messages.next() => next,
        };
        let Some(first) = first else { break };
        let mut batch = Vec::with_capacity(batch_max);
        match first {
            Ok(msg) => batch.push(msg),
            Err(err) => {
                tracing::warn!(error = %err, "trajectory consumer error");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        }
        while batch.len() < batch_max {
            match messages.next().now_or_never() {
                Some(Some(Ok(msg))) => batch.push(msg),
                _ => break,
            }
        }
        if let Err(err) = score_and_publish(&engine, &mut publisher, batch, ack_wait).await {
            // Nothing was acknowledged: the batch is redelivered after ack_wait and de-duplication absorbs
            // whatever was already published.
            tracing::error!(error = %err, "batch not published; it will be redelivered");
            metrics::counter!("jetrl_reward_batch_errors_total").increment(1);
        }
    }
    tracing::info!("reward service stopped");
    Ok(())
}

/// A trajectory of the batch, decoded or not.
enum Item {
    Decoded {
        msg: jetstream::Message,
        traj: Box<Trajectory>,
        seq: u64,
    },
    /// undecodable, but its key is known from `Nats-Msg-Id`: it gets a failure reward
    Malformed {
        key: String,
        partition: String,
        seq: u64,
        error: String,
    },
}

async fn score_and_publish(
    engine: &RewardEngine,
    publisher: &mut Publisher,
    batch: Vec<jetstream::Message>,
    ack_wait: Duration,
) -> Result<(), BusError> {
    let started = Instant::now();
    let mut items = Vec::with_capacity(batch.len());
    let mut malformed_msgs = Vec::new();
    for msg in batch {
        let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
        match Trajectory::decode(msg.payload.as_ref()) {
            Ok(traj) => items.push(Item::Decoded { msg, traj: Box::new(traj), seq }),
            Err(err) => {
                consume::count_malformed(SERVICE, subjects::TRAJ_STREAM);
                tracing::error!(subject = %msg.subject, error = %err, "malformed trajectory terminated");
                let key = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                    .map(|v| v.as_str().to_string());
                let partition = msg.subject.split('.').nth(2).unwrap_or("train").to_string();
                if let Some(key) = key.filter(|k| TrajectoryKey::parse(k).is_ok()) {
                    items.push(Item::Malformed { key, partition, seq, error: err.to_string() });
                }
                malformed_msgs.push(msg);
            }
        }
    }
    let inputs: Vec<ScoreInput> = items
        .iter()
        .filter_map(|item| match item {
            Item::Decoded { traj, .. } => Some(score_input(traj)),
            Item::Malformed { .. } => None,
        })
        .collect();
    let outcomes = with_progress_acks(engine.score_batch(inputs), &items, ack_wait).await;
    let mut outcomes = outcomes.into_iter();
    for item in &items {
        let reward = match item {
            Item::Decoded { traj, seq, .. } => {
                let outcome = outcomes.next().unwrap_or_else(|| missing_outcome(&traj.key));
                reward_for(traj, *seq, outcome)
            }
            Item::Malformed { key, partition, seq, error } => malformed_reward(key, partition, *seq, error),
        };
        let subject = subjects::reward_subject(&reward.partition, &reward.uid);
        publisher.publish(Outgoing::protobuf(subject, Some(reward.key.clone()), &reward)).await?;
    }
    publisher.drain().await?;
    // Every reward is durable: now the trajectories may be acknowledged.
    for item in &items {
        if let Item::Decoded { msg, .. } = item {
            consume::settle(msg, AckKind::Ack).await;
        }
    }
    for msg in &malformed_msgs {
        consume::settle(msg, AckKind::Term).await;
    }
    metrics::counter!("jetrl_reward_trajectories_total").increment(items.len() as u64);
    metrics::histogram!("jetrl_reward_batch_seconds").record(started.elapsed().as_secs_f64());
    for item in &items {
        if let Item::Decoded { traj, .. } = item {
            if let Some(done) = traj.timings.as_ref().map(|t| t.completed_unix_ms).filter(|&ms| ms > 0) {
                let lag = (jetrl_wire::now_unix_ms() - done).max(0) as f64 / 1000.0;
                metrics::histogram!("jetrl_reward_queue_lag_seconds").record(lag);
            }
        }
    }
    Ok(())
}

/// Runs `scoring` while telling the server every ack_wait/3 that the batch is still being worked on.
async fn with_progress_acks(
    scoring: impl std::future::Future<Output = Vec<ScoreOutcome>>,
    items: &[Item],
    ack_wait: Duration,
) -> Vec<ScoreOutcome> {
    tokio::pin!(scoring);
    let mut ticker = tokio::time::interval(ack_wait / 3);
    ticker.tick().await;
    loop {
        tokio::select! {
            outcomes = &mut scoring => return outcomes,
            _ = ticker.tick() => {
                for item in items {
                    if let Item::Decoded { msg, .. } = item {
                        consume::settle(msg, AckKind::Progress).await;
                    }
                }
            }
        }
    }
}

fn score_input(traj: &Trajectory) -> ScoreInput {
    ScoreInput {
        key: traj.key.clone(),
        data_source: traj.data_source.clone(),
        solution_str: traj.response_text.clone(),
        ground_truth: traj.ground_truth.clone(),
        extra_info: serde_json::from_str(&traj.extra_info_json).unwrap_or(serde_json::Value::Null),
        prompt_str: String::new(),
        response_len: packed::u32_len(&traj.response_ids),
    }
}

fn missing_outcome(key: &str) -> ScoreOutcome {
    ScoreOutcome {
        key: key.to_string(),
        score: 0.0,
        extra: Default::default(),
        extra_text: Default::default(),
        failure_reason: Some("scorer returned no outcome".into()),
        failure_kind: None,
        scorer: "none",
    }
}

fn reward_for(traj: &Trajectory, traj_seq: u64, outcome: ScoreOutcome) -> Reward {
    Reward {
        key: traj.key.clone(),
        uid: traj.uid.clone(),
        partition: traj.partition.clone(),
        traj_seq,
        score: outcome.score,
        extra: outcome.extra.into_iter().collect(),
        extra_text: outcome.extra_text.into_iter().collect(),
        failure_reason: outcome.failure_reason.unwrap_or_default(),
        prompt_len: packed::u32_len(&traj.prompt_ids) as u32,
        response_len: packed::u32_len(&traj.response_ids) as u32,
        min_version: traj.min_version,
        max_version: traj.max_version,
        submit_step: traj.submit_step,
        session_id: traj.session_id,
        index: traj.index,
        data_source: traj.data_source.clone(),
    }
}

fn malformed_reward(key: &str, partition: &str, traj_seq: u64, error: &str) -> Reward {
    let parsed = TrajectoryKey::parse(key).ok();
    Reward {
        key: key.to_string(),
        uid: parsed.as_ref().map(|k| k.uid.clone()).unwrap_or_default(),
        partition: partition.to_string(),
        traj_seq,
        failure_reason: format!("malformed trajectory: {error}"),
        session_id: parsed.as_ref().map(|k| k.session_id).unwrap_or(0),
        index: parsed.as_ref().map(|k| k.index).unwrap_or(0),
        ..Default::default()
    }
}

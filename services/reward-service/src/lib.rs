//! jetrl-reward-service: turns trajectories into scores, off the rollout's critical path.
//!
//! ```text
//! SCORE (durable consumer `reward-service`, shared by every instance; acknowledged requests are purged in bulk)
//!   │ one ScoreRequest per prompt group, written by the rollout worker once the group's trajectories are in
//!   │ TRAJ: the trajectories without their token arrays, each naming its stored sequence
//!   │ pull::Puller: asks only for what there is room for (reward.max_inflight requests); a lease on each message
//!   │               (an in-progress ack every ack_wait/3 until it is settled)
//!   ▼
//! micro-batches of the requests that have arrived, several in flight at once
//!   │ batch::score_batch: decode → RewardEngine (rules | user function | reward model), at most
//!   ▼                     reward.batch_size trajectories a call → one RewardBatch per micro-batch → stored → ack
//! REWARDS
//! ```
//!
//! - [`pull`]: requests messages from the shared durable consumer only when there is room for them
//!   (`reward.max_inflight`), and holds a lease on each one: an in-progress ack every `ack_wait / 3` from the
//!   moment it arrives until it is acknowledged, so a slow scorer never has its request redelivered to another
//!   instance while it works.
//! - [`batch`]: decodes a micro-batch, scores it with [`jetrl_reward::RewardEngine`], publishes one
//!   [`RewardBatch`] per partition for the whole micro-batch on `jetrl.<ns>.rewards.<partition>.batch`, naming the
//!   requests it answers in its `Jetrl-Score-Requests` header, and acknowledges the requests only once it is
//!   durable. Several micro-batches are in flight at once.
//! - [`prompt`]: what a reward model or a user function reads as the prompt: the trajectory's chat messages, or
//!   its prompt ids decoded with the policy tokenizer.
//!
//! One message in per group and one out per micro-batch, not per trajectory, and never the token arrays: that is
//! what lets one instance keep up with the broker (see `just bench reward`).
//!
//! Every trajectory is scored once: instances share one durable consumer (each request goes to one of them), and
//! a micro-batch holding a redelivered request (its instance died, or its ack was lost) first reads the headers of
//! the REWARDS stream from the time that request was stored; a request already answered there is acknowledged
//! without scoring it again. Whatever slips through (a batch still in flight at another instance) is scored
//! twice, and the buffer keeps the first reward of each trajectory. A request that
//! cannot even be decoded is terminated and counted, and every trajectory of its group stored in TRAJ still gets a
//! zero reward with a failure reason, so the group is never stuck.
//!
//! SCORE is a limits stream, not a work queue: a work queue deletes each request from the store as its ack
//! arrives, and that per-message delete was a third of the broker's work per group. Instead every instance reads
//! the consumer's ack floor once a second and purges everything at or below it in one request ([`compact`]);
//! what it has not purged yet is acknowledged, so it is never delivered again.
//!
//! [`RewardBatch`]: jetrl_wire::v1::RewardBatch

pub mod batch;
pub mod prompt;
pub mod pull;

use std::sync::Arc;
use std::time::Duration;

use jetrl_bus::service::{self, Start, Started};
use jetrl_bus::BusError;
use jetrl_config::JobConfig;
use jetrl_reward::RewardEngine;
use jetrl_telemetry::Shutdown;
use jetrl_wire::subjects;
use tokio::task::JoinSet;

use crate::batch::BatchContext;
use crate::prompt::PromptSource;
use crate::pull::{Leases, Puller};

const SERVICE: &str = jetrl_wire::ServiceKind::Reward.as_str();
/// Trajectories whose requests were scored and acknowledged (whatever their outcome).
pub const TRAJECTORIES_METRIC: &str = "jetrl_reward_trajectories_total";
/// Seconds from a trajectory's completion (its `timings.completed_unix_ms`) to its reward being durable.
pub const QUEUE_LAG_METRIC: &str = "jetrl_reward_queue_lag_seconds";
/// Score requests (groups) in the SCORE stream not yet delivered to any instance (from the consumer's info).
pub const QUEUE_PENDING_METRIC: &str = "jetrl_reward_queue_pending_messages";
/// Micro-batches whose rewards could not be published (their requests are redelivered).
pub const BATCH_ERRORS_METRIC: &str = "jetrl_reward_batch_errors_total";
const BATCH_SECONDS_METRIC: &str = "jetrl_reward_batch_seconds";
/// Settled score requests purged from SCORE.
pub const COMPACTED_METRIC: &str = "jetrl_reward_compacted_requests_total";
/// How often the consumer's state is read: its backlog for [`QUEUE_PENDING_METRIC`], its ack floor for
/// [`compact`].
const CONSUMER_POLL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum RewardServiceError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("reward engine: {0}")]
    Engine(#[from] jetrl_reward::RewardError),
}

impl RewardServiceError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bus(..) => "bus",
            Self::Metrics(..) => "metrics",
            Self::Engine(..) => "engine",
        }
    }
}

/// Runs one reward-service instance until `shutdown` resolves. Several instances (processes) share the work.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RewardServiceError> {
    let shutdown = Shutdown::new(shutdown);
    let start = Start {
        client: "jetrl-reward-service",
        service: SERVICE,
        instance: cfg.reward.instance_id.as_deref(),
        metrics_addr: &cfg.reward.metrics_addr,
    };
    let Started { bus, heartbeat } = service::start::<RewardServiceError>(&cfg, start, &shutdown).await?;
    describe_metrics();
    let engine = Arc::new(RewardEngine::new(&cfg.reward).await?);
    let ack_wait = Duration::from_secs_f64(cfg.reward.ack_wait_s.max(1.0));
    let consumer = bus
        .shared_pull_consumer(
            bus.names().score_stream(),
            subjects::REWARD_CONSUMER,
            &bus.names().score_filter(),
            ack_wait,
            100_000,
        )
        .await?;
    let max_inflight = cfg.reward.max_inflight.max(1) as usize;
    let batch_size = cfg.reward.batch_size.max(1) as usize;
    let (leases, renewal) = Leases::start(bus.client().clone(), ack_wait);
    let (puller, mut pulled) = Puller::start(consumer.clone(), max_inflight, leases.clone(), shutdown.clone());
    tokio::spawn(watch_consumer(consumer, bus.stream(bus.names().score_stream()).await?, shutdown.clone()));
    let context = Arc::new(BatchContext {
        rewards: bus.stream(bus.names().rewards_stream()).await?,
        trajectories: bus.stream(bus.names().traj_stream()).await?,
        batch_size,
        prompts: PromptSource::new(&cfg, &engine),
        bus,
        engine,
        leases,
        room: puller.room(),
    });
    let instance = cfg.reward.instance_id.clone().unwrap_or_default();
    tracing::info!(route = context.engine.route_name(), max_inflight, batch_size, %instance, "reward service consuming score requests");

    let mut batches = JoinSet::new();
    loop {
        // Wait for one request (or shutdown), then take whatever else has already arrived (up to batch_size
        // requests): a micro-batch forms without adding latency, and several are scored and published at once.
        let first = tokio::select! {
            _ = shutdown.wait() => break,
            next = pulled.recv() => next,
        };
        let Some(first) = first else { break };
        let mut batch = Vec::with_capacity(batch_size);
        batch.push(first);
        while batch.len() < batch_size {
            match pulled.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        batches.spawn(batch::score_batch(Arc::clone(&context), batch));
        while let Some(finished) = batches.try_join_next() {
            log_join_error(finished);
        }
    }
    // Requests pulled but not started go back at once; batches in flight finish and acknowledge. With the broker
    // gone neither can: what is left is redelivered after reward.ack_wait_s.
    puller.stop().await;
    pulled.close();
    let settle = async {
        while let Some(held) = pulled.recv().await {
            context.release_unscored(held).await;
        }
        while let Some(finished) = batches.join_next().await {
            log_join_error(finished);
        }
    };
    tokio::select! {
        () = settle => {}
        () = context.bus.unreachable_for(jetrl_bus::SETTLE_RECONNECT) => {
            tracing::warn!("NATS unreachable: the batches in flight are left to redelivery after reward.ack_wait_s");
        }
    }
    renewal.stop();
    heartbeat.stop().await;
    tracing::info!("reward service stopped");
    Ok(())
}

fn log_join_error(finished: Result<(), tokio::task::JoinError>) {
    if let Err(err) = finished {
        // A panic in a batch task: its requests are not acknowledged and come back after ack_wait.
        tracing::error!(error = %err, "a scoring task failed");
        metrics::counter!(BATCH_ERRORS_METRIC).increment(1);
    }
}

/// Every [`CONSUMER_POLL`]: publishes the consumer's backlog (not yet delivered to any instance) as a gauge, and
/// purges the requests every instance has settled.
async fn watch_consumer(
    mut consumer: async_nats::jetstream::consumer::PullConsumer,
    score: async_nats::jetstream::stream::Stream,
    shutdown: Shutdown,
) {
    let mut ticker = tokio::time::interval(CONSUMER_POLL);
    let mut purged_through = 0;
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = ticker.tick() => {}
        }
        match consumer.info().await {
            Ok(info) => {
                metrics::gauge!(QUEUE_PENDING_METRIC).set(info.num_pending as f64);
                purged_through = compact(&score, info.ack_floor.stream_sequence, purged_through).await;
            }
            Err(err) => tracing::debug!(error = %err, "consumer info unavailable"),
        }
    }
}

/// Purges the SCORE stream through `ack_floor` (every request up to that stream sequence is acknowledged or
/// terminated) in one request, unless that was done already. Several instances may purge the same range: the
/// second purge removes nothing. Returns how far the stream is known to be purged.
pub async fn compact(score: &async_nats::jetstream::stream::Stream, ack_floor: u64, purged_through: u64) -> u64 {
    if ack_floor <= purged_through {
        return purged_through;
    }
    match score.purge().sequence(ack_floor + 1).await {
        Ok(purged) => {
            metrics::counter!(COMPACTED_METRIC).increment(purged.purged);
            ack_floor
        }
        Err(err) => {
            tracing::warn!(ack_floor, error = %err, "settled score requests not purged; retrying");
            purged_through
        }
    }
}

fn describe_metrics() {
    metrics::describe_counter!(TRAJECTORIES_METRIC, "trajectories whose rewards were published and acknowledged");
    metrics::describe_histogram!(
        QUEUE_LAG_METRIC,
        metrics::Unit::Seconds,
        "time from a trajectory's completion by the rollout worker to its reward being durable"
    );
    metrics::describe_gauge!(
        QUEUE_PENDING_METRIC,
        "score requests (groups) waiting in the SCORE stream for any reward service"
    );
    metrics::describe_counter!(COMPACTED_METRIC, "settled score requests purged from the SCORE stream");
    metrics::describe_counter!(BATCH_ERRORS_METRIC, "micro-batches not published; their requests are redelivered");
    metrics::describe_histogram!(
        BATCH_SECONDS_METRIC,
        metrics::Unit::Seconds,
        "time to decode, score, publish and acknowledge one micro-batch"
    );
}

impl jetrl_telemetry::ServiceError for RewardServiceError {}

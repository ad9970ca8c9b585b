//! The replay-buffer service loop: one task owns [`BufferState`]; every input is an event, dispatched by
//! [`Buffer::serve`] to its handler:
//!
//! - [`records`]: group records from the GROUPS watch (a [`Follower`] of the bucket);
//! - [`rewards`]: reward batches and release markers from the REWARDS stream (a [`Follower`] of the stream), and
//!   the floor purge;
//! - [`requests`]: sample requests, answered by the sampling policy or kept waiting until their deadline;
//! - [`release`]: releases of trained groups, and ledger queries;
//! - here: the marks of how far the GROUPS bucket had come, re-reads of both inputs, and the gauges.
//!
//! The state beside [`BufferState`] is in small parts, each unit-tested without a server: [`GroupsCursor`] (how
//! far the GROUPS watch has read), [`RewardsInput`] (the REWARDS replay, orphans and floor purge),
//! [`WaitingRequests`] and [`Answers`] (answers kept for retried requests).

mod answers;
mod groups_cursor;
mod records;
mod release;
mod requests;
mod rewards;
mod rewards_input;
#[cfg(test)]
mod tests;
mod waiting;

use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use futures::StreamExt;
use jetrl_bus::service::{self, Start, Started};
use jetrl_bus::watch::{Follower, Messages, Resume};
use jetrl_bus::{Bus, BusError, Cause, GroupStore};
use jetrl_config::JobConfig;
use jetrl_telemetry::Shutdown;
use jetrl_wire::Message;

use self::answers::Answers;
use self::groups_cursor::GroupsCursor;
use self::rewards_input::RewardsInput;
use self::waiting::WaitingRequests;
use crate::reread::Reread;
use crate::sampler::SamplerConfig;
use crate::state::BufferState;

const SERVICE: &str = jetrl_wire::ServiceKind::Buffer.as_str();
/// Answers remembered for retried requests (a retry comes right after a timeout, so a few suffice).
const ANSWER_CACHE: usize = 64;
/// Release markers kept in REWARDS (the newest; older ones go with each floor purge). A marker matters only while
/// a left-over reward of one of its groups (a redelivered score request's late copy) can still be above the
/// floor, which is a few steps at most.
const MARKERS_KEPT: u64 = 1000;
/// How long a stopping buffer waits for the archiver to store what it was handed.
const ARCHIVE_FLUSH: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
}

impl BufferError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bus(..) => "bus",
            Self::Metrics(..) => "metrics",
        }
    }
}

/// The buffer's two stores as it reads them.
struct Inputs {
    /// GROUPS: every record's newest value, then every change (opened again after what it delivered when it fails
    /// or stalls)
    records: Follower,
    /// REWARDS: reward batches and release markers, in stream order (opened again after the last sequence
    /// delivered when it fails or stalls)
    rewards: Follower<Messages>,
    /// when anything last came in on either
    last_input: Instant,
}

/// Runs the replay buffer until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), BufferError> {
    let shutdown = Shutdown::new(shutdown);
    let start = Start {
        client: "jetrl-replay-buffer",
        service: SERVICE,
        instance: None,
        metrics_addr: &cfg.buffer.metrics_addr,
    };
    let Started { bus, heartbeat } = service::start::<BufferError>(&cfg, start, &shutdown).await?;
    let reread = Reread::new(Duration::from_secs_f64(cfg.buffer.reread_after_s));
    let served = Buffer::start(bus, SamplerConfig::from_job(&cfg), reread).await?.serve(shutdown).await;
    heartbeat.stop().await;
    served
}

struct Buffer {
    bus: Bus,
    groups: GroupStore,
    /// TRAJ, whose released groups' subjects are purged (handle kept: opening one is a round trip)
    traj: async_nats::jetstream::stream::Stream,
    /// REWARDS: release markers go in; everything below the floor of the rewards still indexed is purged
    rewards: async_nats::jetstream::stream::Stream,
    /// how far the GROUPS watch has read the bucket
    groups_cursor: GroupsCursor,
    /// the REWARDS input's replay, orphans and floor purge
    rewards_input: RewardsInput,
    state: BufferState,
    sampler: SamplerConfig,
    /// sample requests waiting for enough complete groups
    waiting: WaitingRequests,
    /// reading both inputs again when a request has waited long with nothing coming in
    reread: Reread,
    /// answers given, for retried requests
    answers: Answers,
    /// the replay's already-released groups have been retired (once, when both replays are current)
    replay_retired: bool,
}

impl Buffer {
    async fn start(bus: Bus, sampler: SamplerConfig, reread: Reread) -> Result<Self, BufferError> {
        let groups = GroupStore::open(&bus).await?;
        let empty_bucket =
            groups.kv().stream.get_info().await.map(|i| i.state.messages == 0).map_err(|e| BusError::Kv {
                bucket: groups.kv().name.clone(),
                key: "*".into(),
                cause: Cause::of(e),
            })?;
        let mut rewards = bus.stream(bus.names().rewards_stream()).await?;
        let empty_stream = rewards
            .info()
            .await
            .map(|i| i.state.messages == 0)
            .map_err(|e| BusError::Consume { what: bus.names().rewards_stream().into(), cause: Cause::of(e) })?;
        let traj = bus.stream(bus.names().traj_stream()).await?;
        Ok(Self {
            bus,
            groups,
            traj,
            rewards,
            groups_cursor: GroupsCursor::new(empty_bucket),
            rewards_input: RewardsInput::new(empty_stream),
            state: BufferState::default(),
            sampler,
            waiting: WaitingRequests::default(),
            reread,
            answers: Answers::new(ANSWER_CACHE),
            replay_retired: false,
        })
    }

    async fn serve(mut self, shutdown: Shutdown) -> Result<(), BufferError> {
        let (client, names) = (self.bus.client().clone(), self.bus.names().clone());
        let sub_err =
            |e: async_nats::SubscribeError| BusError::Consume { what: "subscribe".into(), cause: Cause::of(e) };
        let subscribe = |subject: &str| client.queue_subscribe(subject.to_string(), "replay-buffer".into());
        let mut sample_sub = subscribe(names.buffer_sample()).await.map_err(sub_err)?;
        let mut release_sub = subscribe(names.buffer_release()).await.map_err(sub_err)?;
        let mut ledger_sub = subscribe(names.buffer_ledger()).await.map_err(sub_err)?;
        let (archive, archiver) = crate::archiver::start(self.groups.clone());
        let mut inputs = Inputs {
            records: Follower::new(
                self.groups.kv().clone(),
                ">",
                "group records",
                "jetrl_buffer_watch_restarts_total",
                Resume::After,
            ),
            rewards: Follower::messages(
                self.bus.jetstream().clone(),
                names.rewards_stream(),
                &names.rewards_filter(),
                "rewards",
                "jetrl_buffer_watch_restarts_total",
            )
            .reason_prefix("rewards_"),
            last_input: Instant::now(),
        };
        tracing::info!("replay buffer serving");
        let mut gauge_tick = tokio::time::interval(Duration::from_secs(1));
        let mut watch_check = tokio::time::interval(jetrl_bus::watch::WATCH_CHECK);
        loop {
            let next_deadline = self.waiting.next_deadline();
            let expiry = async move {
                match next_deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            // Whether this event could let a waiting request be answered. Most cannot (a group created or
            // started, the buffer's own `sampled` write, a reward of a group still running), and running the
            // policy after each of those would be most of the buffer's work.
            let mut may_answer = tokio::select! {
                _ = shutdown.wait() => break,
                entry = inputs.records.next() => self.on_record(&entry?, &mut inputs),
                msg = inputs.rewards.next() => self.on_reward(&msg?, &mut inputs),
                Some(msg) = sample_sub.next() => {
                    self.on_sample_request(msg);
                    true
                }
                Some(msg) = release_sub.next() => {
                    self.on_release(msg).await;
                    false
                }
                Some(msg) = ledger_sub.next() => {
                    self.on_ledger(msg).await;
                    false
                }
                _ = expiry => {
                    self.expire_waiting().await;
                    false
                }
                _ = watch_check.tick() => {
                    self.mark_groups().await;
                    false
                }
                _ = gauge_tick.tick() => {
                    self.every_second(&mut inputs);
                    false
                }
            };
            if !self.replay_retired && self.groups_cursor.is_current() && self.rewards_input.is_current() {
                self.state.retire_replayed_releases();
                self.replay_retired = true;
                may_answer = true;
            }
            let retired = self.state.take_retired_records();
            if !retired.is_empty() {
                // waits while the archiver is QUEUED hand-overs behind (its memory stays bounded)
                let _ = archive.send(retired).await;
            }
            if may_answer {
                self.answer_waiting().await;
            }
        }
        tracing::info!(waiting = self.waiting.len(), "replay buffer stopping");
        // what left the working set is archived before the buffer goes (or when it next replays the bucket)
        drop(archive);
        if tokio::time::timeout(ARCHIVE_FLUSH, archiver).await.is_err() {
            tracing::warn!("archiving not finished at shutdown: the rest is archived at the next start");
        }
        Ok(())
    }

    /// A group record from the watch (or a re-read): applied; returns whether it could let a waiting request be
    /// answered.
    fn on_record(&mut self, entry: &kv::Entry, inputs: &mut Inputs) -> bool {
        inputs.last_input = Instant::now();
        let reached = self.groups_cursor.delivered(inputs.records.seen(), entry.delta);
        let applied = if self.reread.replays_record(entry.revision) {
            self.on_replayed_record(entry)
        } else {
            self.on_group_entry(entry)
        };
        // a request that waited for this revision can be decided now
        applied || self.waiting.names_revision_in(reached)
    }

    /// A message of the REWARDS stream (or a re-read's): indexed; returns whether it could let a waiting request
    /// be answered.
    fn on_reward(&mut self, msg: &async_nats::jetstream::Message, inputs: &mut Inputs) -> bool {
        inputs.last_input = Instant::now();
        let (seq, pending) = msg.info().map(|i| (i.stream_sequence, i.pending)).unwrap_or((0, 1));
        self.rewards_input.delivered(pending);
        let replay = self.reread.replays_reward(seq);
        self.state.rewards_read_through(seq);
        if replay || !jetrl_telemetry::crash::missed_input("buffer.reward") {
            self.on_rewards_message(msg, seq, replay)
        } else {
            false
        }
    }

    /// Every [`WATCH_CHECK`](jetrl_bus::watch::WATCH_CHECK): marks how far the GROUPS bucket had come (once the
    /// watch has delivered that revision, it had everything the bucket held at this moment). Both inputs check
    /// themselves for stalls ([`Follower`]).
    async fn mark_groups(&mut self) {
        if self.groups_cursor.is_current() {
            let asked = Instant::now();
            if let Some(newest) = jetrl_bus::watch::newest(self.groups.kv(), None).await {
                self.groups_cursor.mark(asked, newest);
            }
        }
    }

    /// Once a second: the gauges, the rewards purge, and a re-read of both inputs when a request has waited long
    /// with nothing coming in ([`Reread`]).
    fn every_second(&mut self, inputs: &mut Inputs) {
        self.export_gauges();
        self.purge_rewards();
        let now = Instant::now();
        if let Some(pass) = self.reread.finish(now) {
            self.report_reread(&pass);
        }
        let waiting_since = self.waiting.waiting_since();
        if !(self.groups_cursor.is_current()
            && self.rewards_input.is_current()
            && self.reread.due(now, waiting_since, inputs.last_input))
        {
            return;
        }
        let view = self.state.waiting_view(self.waiting.partition());
        tracing::debug!(
            waited_s = waiting_since.map_or(0, |t| t.elapsed().as_secs()),
            complete = view.complete,
            generating = view.generating,
            scoring = view.scoring,
            orphan_rewards = view.orphan_rewards,
            "a sample request waits and nothing came in: reading the group records and rewards again"
        );
        metrics::counter!("jetrl_buffer_rereads_total").increment(1);
        // every record's newest value, then every change; every message REWARDS still holds
        inputs.records.replay();
        inputs.rewards.replay();
        self.reread.begin(now, self.groups_cursor.revision(), self.state.rewards_read());
    }

    async fn reply<M: Message>(&self, subject: &async_nats::Subject, message: &M) {
        if let Err(err) = self.bus.client().publish(subject.clone(), message.encode_to_vec().into()).await {
            tracing::warn!(error = %err, "reply not sent");
        }
    }

    fn export_gauges(&self) {
        for partition in ["train", "val"] {
            let counts = self.state.counts(partition);
            for state in ["pending", "running", "finished", "failure", "sampled", "evicted"] {
                let n = counts.get(state).copied().unwrap_or(0);
                metrics::gauge!("jetrl_buffer_groups", "partition" => partition, "state" => state).set(n as f64);
            }
        }
        metrics::gauge!("jetrl_buffer_indexed_trajectories").set(self.state.indexed_trajectories() as f64);
        metrics::gauge!("jetrl_buffer_waiting_requests").set(self.waiting.len() as f64);
    }
}

impl jetrl_telemetry::ServiceError for BufferError {}

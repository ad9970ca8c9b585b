//! The replay-buffer service loop: one task owns [`BufferState`]; every input is an event.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use futures::StreamExt;
use jetrl_bus::groups::decode_entry;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, Bus, BusError, Cause, Delays, GroupStore, Patience};
use jetrl_config::JobConfig;
use jetrl_telemetry::Shutdown;
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{
    ErrorCode, GroupState, LedgerRequest, LedgerResponse, ReleaseRequest, ReleaseResponse, ReleasedGroups, RewardBatch,
    SampleRequest, SampleResponse,
};
use jetrl_wire::Message;

use crate::reread::{Pass, Reread};
use crate::sampler::{next_action, Action, EvictReason, Progress, SamplerConfig};
use crate::state::BufferState;

const SERVICE: &str = jetrl_wire::ServiceKind::Buffer.as_str();
/// Answers remembered for retried requests (a retry comes right after a timeout, so a few suffice).
const ANSWER_CACHE: usize = 64;
/// Release markers kept in REWARDS (the newest; older ones go with each floor purge). A marker matters only while
/// a left-over reward of one of its groups (a redelivered score request's late copy) can still be above the
/// floor, which is a few steps at most.
const MARKERS_KEPT: u64 = 1000;
/// Rewards of a group whose record has not arrived this long after them are forgotten (the record of a live
/// group is created before its prompt is sent; these belong to deleted or foreign groups and would hold the purge
/// floor down for ever), once the groups watch has delivered everything the bucket held since they came.
const ORPHAN_TTL: Duration = Duration::from_secs(120);
/// Bucket revisions remembered for the watch to reach at most (one per watch check; the oldest go first).
const MAX_GROUPS_MARKS: usize = 1024;
/// How long a stopping buffer waits for the archiver to store what it was handed.
const ARCHIVE_FLUSH: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("{what} subscription ended")]
    InputClosed { what: &'static str },
}

/// A sample request waiting for enough complete groups.
struct Waiting {
    request: SampleRequest,
    reply: async_nats::Subject,
    deadline: Instant,
    received: Instant,
}

/// Runs the replay buffer until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), BufferError> {
    let shutdown = Shutdown::new(shutdown);
    let bus = Bus::connect_job(&cfg, "jetrl-replay-buffer").await?;
    bus.expect_topology().await?;
    jetrl_bus::consume::route_dead_letters(&bus);
    let heartbeat = jetrl_bus::heartbeat::start(&bus, &cfg, SERVICE, None, shutdown.clone());
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.buffer.metrics_addr, async move { stop.wait().await }).await?;
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
    /// `(when, the newest REWARDS sequence read)` at each tick of the last ORPHAN_TTL, oldest first
    reward_seq_history: VecDeque<(Instant, u64)>,
    /// `(when, the GROUPS bucket's last revision then)`, oldest first, not yet delivered by the watch
    groups_marks: VecDeque<(Instant, u64)>,
    /// the latest time as of which the groups watch is known to have delivered everything the bucket held: orphan
    /// rewards are forgotten only when their groups' records would have come by then (a watch whose consumer sits
    /// on a cluster node still catching up delivers late, and its rewards must not be dropped meanwhile)
    groups_seen_through: Option<Instant>,
    /// REWARDS is purged below this sequence (written by the purge task)
    rewards_purged_below: Arc<AtomicU64>,
    /// the floor purge in flight, if any (one at a time)
    rewards_purge: Option<tokio::task::JoinHandle<()>>,
    state: BufferState,
    sampler: SamplerConfig,
    /// per request id: the sample loop's memory (refill credit, metrics) between iterations
    progress: HashMap<String, Progress>,
    waiting: VecDeque<Waiting>,
    /// since when a sample request has waited with none answered (None: the last one was answered)
    waiting_since: Option<Instant>,
    /// reading both inputs again when a request has waited long with nothing coming in
    reread: Reread,
    /// the newest trainer incarnation a sample request came from (0: none named yet)
    incarnation: u64,
    answers: HashMap<String, SampleResponse>,
    answer_order: VecDeque<String>,
    /// the initial replay of the GROUPS bucket is done
    groups_current: bool,
    /// the initial replay of the REWARDS stream is done
    rewards_current: bool,
    /// the replay's already-released groups have been retired (once, when both replays are current)
    replay_retired: bool,
}

impl Buffer {
    async fn start(bus: Bus, sampler: SamplerConfig, reread: Reread) -> Result<Self, BufferError> {
        let groups = GroupStore::open(&bus).await?;
        let empty_bucket = groups.kv().status().await.map(|s| s.values() == 0).map_err(|e| BusError::Kv {
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
            reward_seq_history: VecDeque::new(),
            groups_marks: VecDeque::new(),
            groups_seen_through: None,
            rewards_purged_below: Arc::new(AtomicU64::new(0)),
            rewards_purge: None,
            state: BufferState::default(),
            sampler,
            progress: HashMap::new(),
            waiting: VecDeque::new(),
            waiting_since: None,
            reread,
            incarnation: 0,
            answers: HashMap::new(),
            answer_order: VecDeque::new(),
            groups_current: empty_bucket,
            rewards_current: empty_stream,
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
        let mut watch = self.groups.watch().await?;
        let mut rewards = self.follow_rewards(DeliverPolicy::All).await?;
        tracing::info!("replay buffer serving");
        let mut gauge_tick = tokio::time::interval(Duration::from_secs(1));
        // the newest GROUPS revision seen: a watch that fails (its consumer lost with a cluster node) is started
        // again from the next one
        let mut groups_revision = 0u64;
        // A watch can also stall without an error (its consumer's node died and the consumer was not recreated):
        // while no entry comes, the bucket's last revision is compared with the newest seen now and then.
        let mut last_entry = Instant::now();
        // the same for the rewards consumer: its stream's last sequence against the newest reward read
        let mut last_reward = Instant::now();
        // when anything last came in on either input (the two above are also moved on by their stall checks)
        let mut last_input = Instant::now();
        let mut watch_check = tokio::time::interval(jetrl_bus::watch::WATCH_CHECK);
        loop {
            // Whether this event could let a waiting request be answered. Most cannot (a group created or
            // started, the buffer's own `sampled` write, a reward of a group still running), and running the
            // policy after each of those would be most of the buffer's work.
            let mut may_answer = false;
            let next_deadline = self.waiting.iter().map(|w| w.deadline).min();
            let expiry = async move {
                match next_deadline {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.wait() => break,
                entry = watch.next() => {
                    let entry = entry.ok_or(BufferError::InputClosed { what: "groups watch" })?;
                    match entry {
                        Ok(entry) => {
                            last_entry = Instant::now();
                            last_input = last_entry;
                            groups_revision = groups_revision.max(entry.revision);
                            self.groups_seen(groups_revision);
                            if entry.delta == 0 { self.groups_current = true; }
                            may_answer = if self.reread.replays_record(entry.revision) {
                                self.on_replayed_record(&entry)
                            } else {
                                self.on_group_entry(&entry)
                            };
                        }
                        Err(err) => {
                            // the watch's consumer may be gone (a cluster node died): start a new one after what
                            // was seen, retried with backoff while JetStream elects leaders
                            tracing::warn!(error = %err, revision = groups_revision, "groups watch error; watching again from the next revision");
                            watch = self.watch_again(groups_revision, "error").await?;
                            last_entry = Instant::now();
                        }
                    }
                }
                msg = rewards.next() => {
                    let msg = msg.ok_or(BufferError::InputClosed { what: "rewards stream" })?;
                    match msg {
                        Ok(msg) => {
                            last_reward = Instant::now();
                            last_input = last_reward;
                            let (seq, pending) = msg.info().map(|i| (i.stream_sequence, i.pending)).unwrap_or((0, 1));
                            if pending == 0 { self.rewards_current = true; }
                            let replay = self.reread.replays_reward(seq);
                            self.state.rewards_read_through(seq);
                            if replay || !jetrl_telemetry::crash::missed_input("buffer.reward") {
                                may_answer = self.on_rewards_message(&msg, seq, replay);
                            }
                        }
                        Err(err) => tracing::warn!(error = %err, "rewards consumer error"),
                    }
                }
                Some(msg) = sample_sub.next() => {
                    self.on_sample_request(msg);
                    may_answer = true;
                }
                Some(msg) = release_sub.next() => self.on_release(msg).await,
                Some(msg) = ledger_sub.next() => self.on_ledger(msg).await,
                _ = expiry => self.expire_waiting().await,
                _ = watch_check.tick() => {
                    if self.groups_current {
                        // the bucket's last revision now: once the watch has delivered it, it had everything
                        // the bucket held at this moment
                        let asked = Instant::now();
                        let newest = jetrl_bus::watch::newest(self.groups.kv(), None).await;
                        if let Some(newest) = newest {
                            if self.groups_marks.len() >= MAX_GROUPS_MARKS {
                                self.groups_marks.pop_front();
                            }
                            self.groups_marks.push_back((asked, newest));
                            self.groups_seen(groups_revision);
                        }
                        if last_entry.elapsed() >= jetrl_bus::watch::WATCH_CHECK {
                            if newest.is_some_and(|newest| newest > groups_revision) {
                                tracing::warn!(revision = groups_revision, "groups watch stalled behind the bucket; watching again from the next revision");
                                watch = self.watch_again(groups_revision, "stalled").await?;
                            }
                            last_entry = Instant::now();
                        }
                    }
                    if self.rewards_current && last_reward.elapsed() >= jetrl_bus::watch::WATCH_CHECK {
                        if self.rewards_behind().await {
                            let next = self.state.rewards_read() + 1;
                            tracing::warn!(next, "rewards consumer stalled behind its stream; reading again from the next sequence");
                            metrics::counter!("jetrl_buffer_watch_restarts_total", "reason" => "rewards_stalled").increment(1);
                            rewards = self.follow_rewards(DeliverPolicy::ByStartSequence { start_sequence: next }).await?;
                        }
                        last_reward = Instant::now();
                    }
                }
                _ = gauge_tick.tick() => {
                    self.export_gauges();
                    self.purge_rewards();
                    let now = Instant::now();
                    if let Some(pass) = self.reread.finish(now) {
                        self.report_reread(&pass);
                    }
                    let waiting_since = self.waiting_since.filter(|_| !self.waiting.is_empty());
                    if self.groups_current
                        && self.rewards_current
                        && self.reread.due(now, waiting_since, last_input)
                    {
                        let view = self.state.waiting_view(self.waiting_partition());
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
                        watch = self.groups.watch().await?;
                        rewards = self.follow_rewards(DeliverPolicy::All).await?;
                        self.reread.begin(now, groups_revision, self.state.rewards_read());
                        last_entry = now;
                        last_reward = now;
                    }
                }
            }
            if !self.replay_retired && self.groups_current && self.rewards_current {
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

    /// A GROUPS entry from the watch: the record applied (or the group forgotten, for a delete). Returns whether it
    /// could let a waiting request be answered.
    fn on_group_entry(&mut self, entry: &async_nats::jetstream::kv::Entry) -> bool {
        match decode_entry(entry) {
            Some(Ok(status)) => {
                if status.state().is_terminal() && jetrl_telemetry::crash::missed_input("buffer.terminal_record") {
                    return false;
                }
                // terminal (may complete a batch) or evicted (leaves the in-flight set, which `wait` and sync
                // DAPO's refill room look at)
                let may_answer = status.state().is_terminal() || status.state() == GroupState::Evicted;
                self.state.apply_group_at(status, entry.revision);
                may_answer
            }
            Some(Err(err)) => {
                let reason = format!("malformed group record: {err}");
                let bucket = self.bus.names().groups_bucket();
                consume::dead_letter(SERVICE, bucket, &entry.key, &reason, &entry.value);
                tracing::error!(key = %entry.key, error = %err, "malformed group record ignored");
                false
            }
            None => {
                if let Some((partition, uid)) = subjects::parse_group_key(&entry.key) {
                    self.state.remove_group(partition, uid);
                }
                true
            }
        }
    }

    /// A GROUPS entry a re-read reads again: applied only when it is news (a record the watch had not delivered),
    /// then counted and logged. Deletes and malformed records were handled when first read.
    fn on_replayed_record(&mut self, entry: &async_nats::jetstream::kv::Entry) -> bool {
        let Some(Ok(status)) = decode_entry(entry) else { return false };
        if !self.state.is_news(&status.partition, &status.uid, entry.revision) {
            return false;
        }
        tracing::warn!(
            key = %entry.key,
            revision = entry.revision,
            state = status.state().label(),
            "re-read found a group record the watch had not delivered"
        );
        self.reread.found_record();
        self.on_group_entry(entry)
    }

    /// The partition of the oldest waiting request (`train` when none waits).
    fn waiting_partition(&self) -> &str {
        self.waiting.front().map_or("train", |w| w.request.partition.as_str())
    }

    /// Says what a finished re-read found: a warning and a count when the inputs had missed something, otherwise
    /// what the waiting request waits on (the stores hold nothing more).
    fn report_reread(&self, pass: &Pass) {
        let view = self.state.waiting_view(self.waiting_partition());
        let waited_s = self.waiting_since.map_or(0, |t| t.elapsed().as_secs());
        if pass.found() > 0 {
            metrics::counter!("jetrl_buffer_reread_found_total", "kind" => "records").increment(pass.found_records);
            metrics::counter!("jetrl_buffer_reread_found_total", "kind" => "rewards").increment(pass.found_rewards);
            tracing::warn!(
                found_records = pass.found_records,
                found_rewards = pass.found_rewards,
                complete = view.complete,
                generating = view.generating,
                scoring = view.scoring,
                "reading the inputs again found updates the buffer had missed; applied"
            );
        } else {
            tracing::info!(
                waited_s,
                complete = view.complete,
                generating = view.generating,
                scoring = view.scoring,
                orphan_rewards = view.orphan_rewards,
                "a sample request is still waiting; the buffer holds every group record and reward the stores hold"
            );
        }
    }

    /// The watch has delivered revision `revision`: every mark at or below it is reached.
    fn groups_seen(&mut self, revision: u64) {
        while let Some(&(at, newest)) = self.groups_marks.front() {
            if newest > revision {
                break;
            }
            self.groups_seen_through = Some(at);
            self.groups_marks.pop_front();
        }
    }

    /// A new watch of the group records from the revision after `seen`, asked again (with backoff) until it
    /// starts; a permanent failure (the bucket gone, a refusal) ends the service, for its supervisor to restart.
    async fn watch_again(&self, seen: u64, why: &'static str) -> Result<async_nats::jetstream::kv::Watch, BufferError> {
        metrics::counter!("jetrl_buffer_watch_restarts_total", "reason" => why).increment(1);
        let mut delays = Delays::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            match self.groups.watch_from(seen + 1).await {
                Ok(watch) => return Ok(watch),
                Err(err) if !err.recovery().retryable() => return Err(err.into()),
                Err(err) => {
                    tracing::warn!(error = %err, "groups watch not restarted; retrying");
                    delays.sleep().await;
                }
            }
        }
    }

    /// An ordered consumer of the REWARDS stream (reward batches and release markers) from `start`, created again
    /// with backoff through a cluster's election (within nats.connect_timeout_s).
    async fn follow_rewards(
        &self,
        start: DeliverPolicy,
    ) -> Result<async_nats::jetstream::consumer::pull::Ordered, BusError> {
        let names = self.bus.names();
        let rewards_err = |cause: Cause| BusError::Consume { what: names.rewards_stream().into(), cause };
        let config = consumer::pull::OrderedConfig {
            filter_subject: names.rewards_filter(),
            deliver_policy: start,
            ..Default::default()
        };
        Patience::within(self.bus.topology_wait())
            .retry("follow the rewards stream", || async {
                let stream = self.bus.stream(names.rewards_stream()).await?;
                let ordered = stream.create_consumer(config.clone()).await.map_err(|e| rewards_err(Cause::of(e)))?;
                ordered.messages().await.map_err(|e| rewards_err(Cause::of(e)))
            })
            .await
    }

    /// Whether the REWARDS stream holds messages after the newest one this buffer read (so a consumer that
    /// delivered nothing for a while is stalled). A stream that cannot be asked now is not taken as behind.
    async fn rewards_behind(&self) -> bool {
        let ask = async {
            let mut stream = self.bus.stream(self.bus.names().rewards_stream()).await.ok()?;
            stream.info().await.ok().map(|i| i.state.last_sequence)
        };
        matches!(tokio::time::timeout(Duration::from_secs(2), ask).await, Ok(Some(last)) if last > self.state.rewards_read())
    }

    /// A message of the REWARDS stream: a reward batch (indexed), or a release marker. Returns whether it could
    /// let a waiting request be answered.
    ///
    /// A `replay` (a message a re-read reads again) only adds rewards the buffer lacks, and counts those of live
    /// groups; its release markers and malformed messages were handled when first read.
    fn on_rewards_message(&mut self, msg: &async_nats::jetstream::Message, seq: u64, replay: bool) -> bool {
        let marker = msg.subject.as_str() == self.bus.names().released_subject();
        if replay && marker {
            return false;
        }
        if marker {
            match ReleasedGroups::decode(msg.payload.as_ref()) {
                Ok(marker) => {
                    // Live, this buffer released these groups itself and this finds none of them. After a
                    // restart it retires them, and purges their payloads again in case that was cut short.
                    let released = self.state.apply_release_marker(&marker.groups);
                    if !released.is_empty() {
                        tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), released));
                    }
                }
                Err(err) => {
                    let reason = format!("malformed release marker: {err}");
                    consume::dead_letter(
                        SERVICE,
                        self.bus.names().rewards_stream(),
                        &msg.subject,
                        &reason,
                        &msg.payload,
                    );
                    tracing::error!(subject = %msg.subject, error = %err, "malformed release marker ignored");
                }
            }
            return false;
        }
        let mut may_answer = false;
        match RewardBatch::decode(msg.payload.as_ref()) {
            Ok(batch) => {
                let mut found = 0;
                for reward in batch.rewards {
                    // a reward can only complete a group that is already terminal
                    let group = self.state.group(&reward.partition, &reward.uid);
                    let (live, terminal) = (group.is_some(), group.is_some_and(|g| g.state().is_terminal()));
                    let key = replay.then(|| (reward.uid.clone(), reward.session_id, reward.index));
                    if self.state.apply_reward(reward, seq) {
                        may_answer |= terminal;
                        if let Some((uid, session, index)) = key.filter(|_| live) {
                            tracing::warn!(%uid, session, index, seq, "re-read found a reward the rewards consumer had not delivered");
                            found += 1;
                        }
                    }
                }
                self.reread.found_rewards(found);
            }
            Err(_) if replay => {}
            Err(err) => {
                let reason = format!("malformed reward batch: {err}");
                consume::dead_letter(SERVICE, self.bus.names().rewards_stream(), &msg.subject, &reason, &msg.payload);
                tracing::error!(subject = %msg.subject, error = %err, "malformed reward batch ignored");
            }
        }
        may_answer
    }

    /// Once a second, after the restart's replay: forgets orphan rewards older than [`ORPHAN_TTL`], then purges
    /// every reward batch below the oldest reward still indexed (in the background, one purge at a time), and
    /// release markers beyond the newest [`MARKERS_KEPT`]. One purge request per second, whatever the rate.
    fn purge_rewards(&mut self) {
        if !self.replay_retired {
            return;
        }
        let now = Instant::now();
        self.reward_seq_history.push_back((now, self.state.rewards_read()));
        let mut horizon = 0;
        while let Some(&(at, seq)) = self.reward_seq_history.front() {
            // older than the TTL, and the watch has delivered every record the bucket held since
            if now.duration_since(at) < ORPHAN_TTL || self.groups_seen_through.is_none_or(|seen| seen < at) {
                break;
            }
            horizon = seq;
            self.reward_seq_history.pop_front();
        }
        let dropped = self.state.drop_orphans_below(horizon);
        if dropped > 0 {
            tracing::warn!(dropped, "rewards whose group record never came are forgotten");
            metrics::counter!("jetrl_buffer_orphan_rewards_dropped_total").increment(dropped as u64);
        }
        if self.rewards_purge.as_ref().is_some_and(|task| !task.is_finished()) {
            return;
        }
        let floor = self.state.reward_floor().unwrap_or(self.state.rewards_read() + 1);
        if floor <= self.rewards_purged_below.load(Ordering::Relaxed) {
            return;
        }
        let (rewards, purged_below) = (self.rewards.clone(), Arc::clone(&self.rewards_purged_below));
        let (batches, markers) =
            (self.bus.names().reward_batches_filter(), self.bus.names().released_subject().to_string());
        self.rewards_purge = Some(tokio::spawn(async move {
            match rewards.purge().filter(batches).sequence(floor).await {
                Ok(purged) => {
                    metrics::counter!("jetrl_buffer_purged_reward_messages_total").increment(purged.purged);
                    purged_below.store(floor, Ordering::Relaxed);
                }
                Err(err) => tracing::warn!(floor, error = %err, "rewards below the floor not purged; retrying"),
            }
            if let Err(err) = rewards.purge().filter(markers).keep(MARKERS_KEPT).await {
                tracing::warn!(error = %err, "old release markers not purged");
            }
        }));
    }

    fn on_sample_request(&mut self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        match SampleRequest::decode(msg.payload.as_ref()) {
            Ok(request) if request.incarnation != 0 && request.incarnation < self.incarnation => {
                tracing::warn!(
                    request_id = %request.request_id,
                    incarnation = request.incarnation,
                    newest = self.incarnation,
                    "sample request from a superseded trainer incarnation refused"
                );
                let response = SampleResponse {
                    request_id: request.request_id.clone(),
                    error: format!(
                        "trainer incarnation {} is superseded by {} (a newer trainer holds the job)",
                        request.incarnation, self.incarnation
                    ),
                    code: ErrorCode::Superseded as i32,
                    ..Default::default()
                };
                let client = self.bus.client().clone();
                tokio::spawn(async move { client.publish(reply, response.encode_to_vec().into()).await });
            }
            Ok(request) => {
                if request.incarnation > self.incarnation {
                    self.supersede_incarnations_below(request.incarnation);
                }
                let wait = Duration::from_millis(u64::from(request.wait_ms.max(1)));
                let now = Instant::now();
                self.waiting_since.get_or_insert(now);
                self.waiting.push_back(Waiting { request, reply, deadline: now + wait, received: now });
            }
            Err(err) => {
                let reason = format!("malformed SampleRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_sample(), &msg.subject, &reason, &msg.payload);
                tracing::error!(subject = %msg.subject, error = %err, "malformed sample request");
                let response = SampleResponse {
                    error: format!("malformed SampleRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                };
                let client = self.bus.client().clone();
                tokio::spawn(async move { client.publish(reply, response.encode_to_vec().into()).await });
            }
        }
    }

    /// A newer trainer holds the job: the waiting requests of older incarnations are dropped unanswered (their
    /// sender is gone; groups handed to them would never be trained on, nor given to the new trainer).
    fn supersede_incarnations_below(&mut self, incarnation: u64) {
        let (stale, keep): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(|w| w.request.incarnation != 0 && w.request.incarnation < incarnation);
        self.waiting = keep.into();
        for w in &stale {
            self.progress.remove(&w.request.request_id);
        }
        if self.incarnation != 0 || !stale.is_empty() {
            tracing::info!(
                incarnation,
                previous = self.incarnation,
                dropped_requests = stale.len(),
                "a new trainer incarnation; requests of older ones dropped"
            );
        }
        self.incarnation = incarnation;
    }

    /// Answers every waiting request that can be answered now, in arrival order.
    async fn answer_waiting(&mut self) {
        if !(self.groups_current && self.rewards_current) || self.waiting.is_empty() {
            return;
        }
        let mut still_waiting = VecDeque::new();
        while let Some(w) = self.waiting.pop_front() {
            match self.try_answer(&w.request).await {
                Some(response) => {
                    metrics::histogram!("jetrl_buffer_sample_wait_seconds").record(w.received.elapsed().as_secs_f64());
                    self.reply(&w.reply, &response).await;
                    self.waiting_since = None;
                    self.reread.answered();
                }
                None => still_waiting.push_back(w),
            }
        }
        self.waiting = still_waiting;
    }

    async fn expire_waiting(&mut self) {
        let now = Instant::now();
        let (expired, keep): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|w| w.deadline <= now);
        self.waiting = keep.into();
        for w in expired {
            let response =
                SampleResponse { request_id: w.request.request_id.clone(), not_ready: true, ..Default::default() };
            self.reply(&w.reply, &response).await;
        }
    }

    /// The answer to `request` if it can be given now: a remembered answer (retry), the groups a previous
    /// incarnation already consumed for it (retry after a restart), or the sampling policy's verdict
    /// (which may first evict groups and ask the trainer for refills).
    async fn try_answer(&mut self, request: &SampleRequest) -> Option<SampleResponse> {
        if let Some(previous) = self.answers.get(&request.request_id) {
            return Some(previous.clone());
        }
        let prior: Vec<String> =
            self.state.sampled_by(&request.request_id).iter().map(|g| g.status.uid.clone()).collect();
        if !prior.is_empty() && prior.len() >= request.batch_size as usize {
            return Some(self.respond(request, &prior, Default::default()));
        }
        if !prior.is_empty() {
            // Marking the batch sampled stopped part-way (a write refused, or a restart between the writes): the
            // groups marked stay this request's, and the rest of the batch is sampled beside them. Answered with
            // only these, a sync step trained three groups of four in the three-node cluster test.
            tracing::warn!(
                request_id = %request.request_id,
                marked = prior.len(),
                batch = request.batch_size,
                "part of this request's batch is marked sampled; sampling the rest"
            );
        }
        let mut progress = self.progress.remove(&request.request_id).unwrap_or_default();
        let response = self.run_policy(request, &prior, &mut progress).await;
        if response.as_ref().is_none_or(|r| r.not_ready) {
            self.progress.insert(request.request_id.clone(), progress);
        }
        response
    }

    /// Runs the sampling policy for one request until it answers, asks for refills, fails or must wait. `prior`:
    /// groups already marked sampled for it; the policy picks the rest of the batch.
    async fn run_policy(
        &mut self,
        request: &SampleRequest,
        prior: &[String],
        progress: &mut Progress,
    ) -> Option<SampleResponse> {
        let rest =
            SampleRequest { batch_size: request.batch_size.saturating_sub(prior.len() as u32), ..request.clone() };
        let mut iterations = 0;
        loop {
            iterations += 1;
            if iterations > 64 {
                // every eviction shrinks the candidate set, so this never loops; stay safe anyway
                return None;
            }
            match next_action(&self.state, &self.sampler, &rest, progress) {
                Action::Evict(evicted) => {
                    let done = self.evict(&request.partition, request.step, &evicted).await;
                    progress.record_eviction(&done);
                }
                Action::Refill(n) => {
                    progress.record_refill(n);
                    metrics::counter!("jetrl_buffer_refills_total", "partition" => request.partition.clone())
                        .increment(u64::from(n));
                    return Some(SampleResponse {
                        request_id: request.request_id.clone(),
                        not_ready: true,
                        refill: n,
                        ..Default::default()
                    });
                }
                Action::Answer { selected, discard } => {
                    let surplus: Vec<(String, EvictReason)> =
                        discard.into_iter().map(|uid| (uid, EvictReason::DiscardedSurplus)).collect();
                    let done = self.evict(&request.partition, request.step, &surplus).await;
                    progress.record_eviction(&done);
                    match self.consume(request, &selected).await {
                        Some(uids) => {
                            let prefix = if request.partition == "val" { "validation" } else { "training" };
                            let uids: Vec<String> = prior.iter().cloned().chain(uids).collect();
                            let response = self.respond(request, &uids, progress.metrics(prefix));
                            self.remember(response.clone());
                            return Some(response);
                        }
                        None => return None,
                    }
                }
                Action::Wait => return None,
                Action::Fail(error) => {
                    tracing::error!(request_id = %request.request_id, %error, "sample request cannot be answered");
                    return Some(SampleResponse {
                        request_id: request.request_id.clone(),
                        error,
                        code: ErrorCode::Invalid as i32,
                        ..Default::default()
                    });
                }
            }
        }
    }

    /// Marks groups evicted (CAS), locally too; returns those actually evicted.
    async fn evict(
        &mut self,
        partition: &str,
        step: u64,
        groups: &[(String, EvictReason)],
    ) -> Vec<(String, EvictReason)> {
        // Owned inputs (no borrowed closure arguments) keep this future `Send` for every lifetime.
        let jobs: Vec<(GroupStore, String, String, EvictReason)> = groups
            .iter()
            .map(|(uid, reason)| (self.groups.clone(), partition.to_string(), uid.clone(), reason.clone()))
            .collect();
        let results = futures::future::join_all(jobs.into_iter().map(|(store, partition, uid, reason)| async move {
            store.evict(&partition, &uid, reason.eviction(), &reason.detail(), step).await
        }))
        .await;
        let mut done = Vec::new();
        for ((uid, reason), result) in groups.iter().zip(results) {
            match result {
                Ok(revision) => {
                    self.state.mark_evicted(partition, uid, reason.eviction(), &reason.detail(), revision.unwrap_or(0));
                    metrics::counter!("jetrl_buffer_evicted_groups_total", "reason" => reason.label()).increment(1);
                    done.push((uid.clone(), reason.clone()));
                }
                Err(err) => tracing::error!(%uid, error = %err, "could not evict group"),
            }
        }
        // Nothing reads an evicted group's payloads again (the ledger keeps the reason): they go as released
        // ones do, in the background.
        if !done.is_empty() {
            let evicted = done.iter().map(|(uid, _)| (partition.to_string(), uid.clone(), 0)).collect();
            tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), evicted));
        }
        done
    }

    /// Marks the selected groups sampled (CAS, all in flight at once). None if any record changed under us:
    /// what was confirmed is found again by request id next time.
    async fn consume(&mut self, request: &SampleRequest, selected: &[String]) -> Option<Vec<String>> {
        let groups = &self.groups;
        let updates = selected.iter().map(|uid| {
            // the record and revision the watch delivered: one round trip instead of a read and a write
            let known = self.state.group(&request.partition, uid).and_then(|g| g.known_record());
            async move {
                if jetrl_telemetry::crash::missed_input("buffer.mark_sampled") {
                    let (bucket, key) = (groups.kv().name.clone(), subjects::group_key(&request.partition, uid));
                    let cause = Cause::permanent("write refused (JETRL_MISS_AT)");
                    return (uid, Err(BusError::Kv { bucket, key, cause }.into()));
                }
                let result = groups
                    .update_from(&request.partition, uid, known, |s| {
                        s.sampled_step = request.step;
                        s.sample_request_id = request.request_id.clone();
                        Some(GroupState::Sampled)
                    })
                    .await;
                (uid, result)
            }
        });
        let mut confirmed = Vec::with_capacity(selected.len());
        for (uid, result) in futures::future::join_all(updates).await {
            match result {
                Ok(written) => confirmed.push((uid.clone(), written.map_or(0, |(_, revision)| revision))),
                Err(err) => tracing::error!(%uid, error = %err, "could not mark group sampled"),
            }
        }
        for (uid, revision) in &confirmed {
            self.state.mark_sampled(&request.partition, uid, request.step, &request.request_id, *revision);
        }
        let confirmed: Vec<String> = confirmed.into_iter().map(|(uid, _)| uid).collect();
        // fault injection (inert unless JETRL_CRASH_AT names it): groups marked sampled, the trainer not answered
        jetrl_telemetry::crash::crash_point("buffer.mid_sample", request.step);
        (confirmed.len() == selected.len()).then_some(confirmed)
    }

    fn respond(
        &self,
        request: &SampleRequest,
        uids: &[String],
        metrics: std::collections::BTreeMap<String, f64>,
    ) -> SampleResponse {
        let groups = uids
            .iter()
            .filter_map(|uid| self.state.group(&request.partition, uid))
            .map(|g| self.state.sampled_group(g))
            .collect::<Vec<_>>();
        metrics::counter!("jetrl_buffer_sampled_groups_total", "partition" => request.partition.clone())
            .increment(groups.len() as u64);
        SampleResponse {
            request_id: request.request_id.clone(),
            groups,
            metrics: metrics.into_iter().collect(),
            ..Default::default()
        }
    }

    fn remember(&mut self, response: SampleResponse) {
        self.answer_order.push_back(response.request_id.clone());
        self.answers.insert(response.request_id.clone(), response);
        while self.answer_order.len() > ANSWER_CACHE {
            if let Some(old) = self.answer_order.pop_front() {
                self.answers.remove(&old);
            }
        }
    }

    async fn reply<M: Message>(&self, subject: &async_nats::Subject, message: &M) {
        if let Err(err) = self.bus.client().publish(subject.clone(), message.encode_to_vec().into()).await {
            tracing::warn!(error = %err, "reply not sent");
        }
    }

    async fn on_release(&mut self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        let request = match ReleaseRequest::decode(msg.payload.as_ref()) {
            Ok(r) => r,
            Err(err) => {
                let reason = format!("malformed ReleaseRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_release(), &msg.subject, &reason, &msg.payload);
                let response = ReleaseResponse {
                    error: format!("malformed ReleaseRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                };
                self.reply(&reply, &response).await;
                return;
            }
        };
        let groups = self.state.release(&request.request_ids);
        for id in &request.request_ids {
            self.answers.remove(id);
            self.progress.remove(id);
        }
        let released: usize = groups.iter().map(|g| g.2).sum();
        self.record_release(&request, &groups).await;
        // The index is gone; the payload purge runs in the background so the trainer's step never waits
        // on storage. A purge that did not happen (a crash) leaves bytes behind for the streams' max age,
        // never a group that can be sampled again (its record says sampled); a restart purges again.
        tokio::spawn(purge_payloads(self.traj.clone(), self.bus.names().clone(), groups));
        let response = ReleaseResponse { released_trajectories: released as u64, ..Default::default() };
        self.reply(&reply, &response).await;
    }

    /// Writes the release marker of `groups` to REWARDS and waits until it is stored, before the release is
    /// answered: their rewards stay in the stream until the floor passes them, and a restarted buffer must not
    /// take those for groups still waiting for their trainer. A marker that cannot be written is logged and
    /// counted; the release goes on (after a restart those groups would hold the floor until the stream's max
    /// age).
    async fn record_release(&self, request: &ReleaseRequest, groups: &[(String, String, usize)]) {
        if groups.is_empty() {
            return;
        }
        let marker = ReleasedGroups {
            step: request.step,
            request_ids: request.request_ids.clone(),
            groups: groups.iter().map(|(partition, uid, _)| subjects::group_key(partition, uid)).collect(),
        };
        let subject = self.bus.names().released_subject();
        if let Err(err) = self.bus.publish_durable(Outgoing::protobuf(subject, None, &marker)).await {
            tracing::error!(step = request.step, error = %err, "release marker not stored");
            metrics::counter!("jetrl_buffer_release_marker_errors_total").increment(1);
        }
    }

    async fn on_ledger(&self, msg: async_nats::Message) {
        let Some(reply) = msg.reply.clone() else { return };
        let response = match LedgerRequest::decode(msg.payload.as_ref()) {
            Ok(req) => {
                let limit = if req.limit == 0 { 10_000 } else { req.limit as usize };
                LedgerResponse {
                    entries: self.state.ledger(&req.partition, &req.uids, limit),
                    counts: self.state.counts(&req.partition).into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                    ..Default::default()
                }
            }
            Err(err) => {
                let reason = format!("malformed LedgerRequest: {err}");
                consume::dead_letter(SERVICE, self.bus.names().buffer_ledger(), &msg.subject, &reason, &msg.payload);
                LedgerResponse {
                    error: format!("malformed LedgerRequest: {err}"),
                    code: ErrorCode::Malformed as i32,
                    ..Default::default()
                }
            }
        };
        self.reply(&reply, &response).await;
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

/// Purges released (or evicted) groups' payloads: one TRAJ subject per group (`jetrl.<ns>.traj.<partition>.<uid>`),
/// so a whole group goes in one request, many requests in flight. `groups` are (partition, uid, trajectories
/// released). Their rewards go with the floor purge ([`Buffer::purge_rewards`]).
async fn purge_payloads(
    traj: async_nats::jetstream::stream::Stream,
    names: Names,
    groups: Vec<(String, String, usize)>,
) {
    let trajectories: usize = groups.iter().map(|g| g.2).sum();
    let subjects: Vec<String> = groups.iter().map(|(partition, uid, _)| names.traj_subject(partition, uid)).collect();
    futures::stream::iter(subjects.into_iter().map(|subject| {
        let traj = traj.clone();
        async move {
            if let Err(err) = traj.purge().filter(subject.clone()).await {
                tracing::warn!(%subject, error = %err, "purge failed");
            }
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    metrics::counter!("jetrl_buffer_released_trajectories_total").increment(trajectories as u64);
}

impl jetrl_telemetry::ServiceError for BufferError {}

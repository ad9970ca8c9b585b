//! One file: every stream, consumer, bucket and object store of a job is declared here, their limits side by side.
//!
//! The streams, consumers, KV buckets and object store of a jetrl job. Every name comes from the bus's
//! [`jetrl_wire::subjects::Names`]: one job's topology never touches another's.
//!
//! One identity declares the topology: the trainer (or an admin), with [`Bus::declare_topology`], which reads
//! what exists, creates what is missing and updates only what differs from what this jetrl declares (the
//! settings jetrl chooses: subjects, retention, storage, ages, history, direct get, `nats.replicas`). Every other
//! service calls [`Bus::expect_topology`]: it reads, never writes, so it needs no right to create or update
//! streams; it waits (up to `nats.connect_timeout_s`) for what is missing, so services still start in any order,
//! and then fails naming what is missing and who declares it.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, kv, object_store, stream};

use crate::{Bus, BusError, Cause, Delays, Recovery};

/// The shortest time a published id (a trajectory key, a reward batch, a prompt task, an archived record) is
/// remembered for de-duplication; the job's streams use [`dedup_window`].
pub const DEDUP_WINDOW: Duration = Duration::from_secs(60);

/// The duplicate window of the job's streams: twice the longest a publish is retried
/// (`nats.connect_timeout_s`, see [`crate::publish`]), at least [`DEDUP_WINDOW`]. No longer: the broker keeps
/// every id of the window in memory (`just bench soak`: ~600k trajectory ids, ~120 MB, at 5,000 trajectories/s
/// with a 120 s window).
pub fn dedup_window(publish_retried_for: Duration) -> Duration {
    DEDUP_WINDOW.max(publish_retried_for * 2)
}

/// Safety net for payload streams: anything not released by the trainer within a day is dropped.
const PAYLOAD_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Dead letters are kept this long (and at most [`DEAD_LETTER_MAX_MESSAGES`] / [`DEAD_LETTER_MAX_BYTES`]).
pub const DEAD_LETTER_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
pub const DEAD_LETTER_MAX_MESSAGES: i64 = 100_000;
pub const DEAD_LETTER_MAX_BYTES: i64 = 256 * 1024 * 1024;

/// Heartbeats older than this disappear from the WORKERS bucket.
pub const HEARTBEAT_MAX_AGE: Duration = Duration::from_secs(15);

/// A lease not refreshed for this long disappears from the LEASE bucket (its holder died): how long a restarted
/// trainer may wait for the lease of the one that crashed.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

/// Who creates a missing part of a job's topology, for errors and logs.
const WHO_DECLARES: &str = "the job's trainer declares its streams and buckets when it starts (or an admin, \
                            with the admin identity): start the trainer";

fn declare_err(what: &str, cause: Cause) -> BusError {
    BusError::Declare { what: what.to_string(), cause }
}

/// A stream of the data path (TRAJ, SCORE, REWARDS): kept until purged (by the buffer on release or eviction, or
/// by the reward services below their ack floor), at most [`PAYLOAD_MAX_AGE`]; de-duplicated by `Nats-Msg-Id`;
/// readable by direct get.
fn payload_stream(name: &str, filter: String, replicas: usize, duplicate_window: Duration) -> stream::Config {
    stream::Config {
        name: name.into(),
        subjects: vec![filter],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        duplicate_window,
        max_age: PAYLOAD_MAX_AGE,
        allow_direct: true,
        num_replicas: replicas,
        ..Default::default()
    }
}

/// Whether a KV bucket of `replicas` replicas is read by direct get. A direct get is answered by any replica,
/// and a follower answers from what it has applied: just after a write, or while a restarted node catches up, it
/// returns an older revision or nothing at all for a key the leader holds (nats-server issues 4162, 4710). The
/// group records are read to decide fates and written by compare-and-set, and the ledger lists them, so a
/// replicated bucket is read from its stream leader (`STREAM.MSG.GET`) instead; a single server has one copy.
pub fn bucket_reads_direct(replicas: usize) -> bool {
    replicas <= 1
}

/// One stream, KV bucket or object store of the job, as this jetrl declares it.
#[allow(clippy::large_enum_variant)] // a dozen, built once per declaration
enum Part {
    Stream(Box<stream::Config>),
    Bucket(kv::Config),
    Objects(object_store::Config),
}

impl Part {
    /// "stream X", "KV bucket X", "object store X": how errors and logs name it.
    fn what(&self) -> String {
        match self {
            Part::Stream(c) => format!("stream {}", c.name),
            Part::Bucket(c) => format!("KV bucket {}", c.bucket),
            Part::Objects(c) => format!("object store {}", c.bucket),
        }
    }

    /// The JetStream stream that holds it.
    fn stream_name(&self) -> String {
        match self {
            Part::Stream(c) => c.name.clone(),
            Part::Bucket(c) => format!("KV_{}", c.bucket),
            Part::Objects(c) => format!("OBJ_{}", c.bucket),
        }
    }

    /// The settings jetrl chooses, as (name, value) pairs, read from `config` (the stream's configuration, ours
    /// or the server's). Everything else (limits an operator set, the server's defaults) is left alone.
    fn settings(&self, config: &stream::Config) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Part::Stream(_) = self {
            out.push(("subjects", format!("{:?}", config.subjects)));
            out.push(("retention", format!("{:?}", config.retention)));
            out.push(("duplicate_window", format!("{:?}", config.duplicate_window)));
            out.push(("allow_direct", config.allow_direct.to_string()));
        }
        if let Part::Bucket(_) = self {
            out.push(("history", config.max_messages_per_subject.to_string()));
            out.push(("allow_direct", config.allow_direct.to_string()));
        }
        if !matches!(self, Part::Objects(_)) {
            out.push(("max_age", format!("{:?}", config.max_age)));
        }
        out.push(("storage", format!("{:?}", config.storage)));
        // the server stores "unset" (0) as 1
        out.push(("replicas", config.num_replicas.max(1).to_string()));
        out
    }

    /// What jetrl declares, as a stream configuration (only [`Part::settings`] are read from it).
    fn wanted(&self) -> stream::Config {
        match self {
            Part::Stream(c) => (**c).clone(),
            Part::Bucket(c) => stream::Config {
                max_messages_per_subject: c.history,
                max_age: c.max_age,
                storage: c.storage,
                num_replicas: c.num_replicas,
                allow_direct: bucket_reads_direct(c.num_replicas),
                ..Default::default()
            },
            Part::Objects(c) => {
                stream::Config { storage: c.storage, num_replicas: c.num_replicas, ..Default::default() }
            }
        }
    }

    /// `existing` with jetrl's settings applied: what an update sends (everything else kept as it is).
    fn updated(&self, existing: &stream::Config) -> stream::Config {
        let wanted = self.wanted();
        let mut config = existing.clone();
        if let Part::Stream(_) = self {
            config.subjects = wanted.subjects;
            config.retention = wanted.retention;
            config.duplicate_window = wanted.duplicate_window;
            config.allow_direct = wanted.allow_direct;
        }
        if let Part::Bucket(_) = self {
            config.max_messages_per_subject = wanted.max_messages_per_subject;
            config.allow_direct = wanted.allow_direct;
        }
        if !matches!(self, Part::Objects(_)) {
            config.max_age = wanted.max_age;
        }
        config.storage = wanted.storage;
        config.num_replicas = wanted.num_replicas;
        config
    }

    /// How the settings of `existing` differ from what jetrl declares: `"replicas 1 -> 3"`, ...
    fn differences(&self, existing: &stream::Config) -> Vec<String> {
        let have = self.settings(existing);
        let want = self.settings(&self.wanted());
        have.into_iter()
            .zip(want)
            .filter(|((_, h), (_, w))| h != w)
            .map(|((name, h), (_, w))| format!("{name} {h} -> {w}"))
            .collect()
    }
}

/// What declaring a job's topology found and did, part by part (for logs and tests).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Declared {
    /// parts that did not exist and were created
    pub created: Vec<String>,
    /// parts whose settings differed, with what changed
    pub updated: Vec<(String, Vec<String>)>,
    /// parts already as declared: nothing was written
    pub unchanged: Vec<String>,
}

/// Whether a JetStream lookup failed because the stream does not exist (not for another reason: a timeout, a
/// stream leader being elected in a cluster, a refused request).
fn is_not_found(err: &jetstream::context::GetStreamError) -> bool {
    matches!(
        err.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(e)
            if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// Whether a creation failed because the cluster has no peers to place it on now (JetStream error 10005).
fn is_no_placement(cause: &Cause) -> bool {
    let text = cause.to_string();
    text.contains("no suitable peers for placement") || text.contains("error code 10005")
}

impl Bus {
    /// Every stream, bucket and object store of the job, as this jetrl declares them.
    fn parts(&self) -> Vec<Part> {
        let (names, replicas) = (self.names(), self.replicas());
        let duplicate_window = dedup_window(self.topology_wait());
        let bucket = |name: &str, history: i64, max_age: Duration, storage: stream::StorageType| kv::Config {
            bucket: name.into(),
            history,
            max_age,
            storage,
            num_replicas: replicas,
            ..Default::default()
        };
        vec![
            Part::Stream(Box::new(stream::Config {
                name: names.prompts_stream().into(),
                subjects: vec![names.prompts_filter()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                duplicate_window,
                num_replicas: replicas,
                ..Default::default()
            })),
            Part::Stream(Box::new(payload_stream(
                names.traj_stream(),
                names.traj_filter(),
                replicas,
                duplicate_window,
            ))),
            // A limits stream, not a work queue: the reward services purge acknowledged requests in bulk (below
            // their consumer's ack floor), which costs the broker far less than deleting each one on its ack.
            Part::Stream(Box::new(payload_stream(
                names.score_stream(),
                names.score_filter(),
                replicas,
                duplicate_window,
            ))),
            Part::Stream(Box::new(payload_stream(
                names.rewards_stream(),
                names.rewards_filter(),
                replicas,
                duplicate_window,
            ))),
            // what the services refused (consume::dead_letter): bounded, oldest dropped first
            Part::Stream(Box::new(stream::Config {
                name: names.dlq_stream().into(),
                subjects: vec![format!("{}>", names.dlq_subject(""))],
                retention: stream::RetentionPolicy::Limits,
                storage: stream::StorageType::File,
                max_age: DEAD_LETTER_MAX_AGE,
                max_messages: DEAD_LETTER_MAX_MESSAGES,
                max_bytes: DEAD_LETTER_MAX_BYTES,
                discard: stream::DiscardPolicy::Old,
                duplicate_window,
                allow_direct: true,
                num_replicas: replicas,
                ..Default::default()
            })),
            // the ledger's archive (groups that left the working set): the job's record, kept as long as the job
            Part::Stream(Box::new(stream::Config {
                name: names.ledger_stream().into(),
                subjects: vec![names.ledger_filter()],
                retention: stream::RetentionPolicy::Limits,
                storage: stream::StorageType::File,
                duplicate_window,
                num_replicas: replicas,
                ..Default::default()
            })),
            Part::Bucket(bucket(names.groups_bucket(), 1, Duration::ZERO, stream::StorageType::File)),
            Part::Bucket(bucket(names.weights_bucket(), 4, Duration::ZERO, stream::StorageType::File)),
            // File, though heartbeats are worth nothing after HEARTBEAT_MAX_AGE: a memory bucket is gone after a
            // restart of the NATS server, and only the trainer may declare it again (every other service only
            // opens it), so heartbeats would fail and weight syncs wait on workers nobody hears.
            Part::Bucket(bucket(names.workers_bucket(), 1, HEARTBEAT_MAX_AGE, stream::StorageType::File)),
            // File storage: a lease outlives a restart of the NATS server, as its holder does.
            Part::Bucket(bucket(names.lease_bucket(), 1, LEASE_TTL, stream::StorageType::File)),
            Part::Objects(object_store::Config {
                bucket: names.blobs_store().into(),
                storage: stream::StorageType::File,
                num_replicas: replicas,
                ..Default::default()
            }),
        ]
    }

    /// Declares every stream, bucket and object store of the job: creates what is missing, updates what differs
    /// from what this jetrl declares, writes nothing for what is already as declared. The trainer (and
    /// `jetrl run`, and tests) call it; it needs the rights to create and update the job's streams.
    pub async fn declare_topology(&self) -> Result<Declared, BusError> {
        let mut declared = Declared::default();
        let started = Instant::now();
        for part in self.parts() {
            let what = part.what();
            match self.look_up(&part, started).await? {
                Some(existing) => {
                    let differences = part.differences(&existing.cached_info().config);
                    if differences.is_empty() {
                        declared.unchanged.push(what);
                    } else {
                        self.update_part(&part, &existing.cached_info().config, &differences).await?;
                        declared.updated.push((what, differences));
                    }
                }
                None => {
                    self.create_part(&part, started).await?;
                    declared.created.push(what);
                }
            }
        }
        if !declared.created.is_empty() || !declared.updated.is_empty() {
            tracing::info!(created = ?declared.created, updated = ?declared.updated, replicas = self.replicas(), "declared the job's topology");
        }
        Ok(declared)
    }

    /// The part's stream as the server has it (None: it does not exist). A lookup that times out (a cluster that
    /// just started and has no JetStream leader yet, a stream leader being elected) is transient: asked again
    /// with backoff (0.1 s doubling to 2 s) while the declaration is younger than `nats.connect_timeout_s`. A
    /// refusal by the server is permanent and ends it at once.
    async fn look_up(&self, part: &Part, started: Instant) -> Result<Option<jetstream::stream::Stream>, BusError> {
        let mut delays = Delays::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let (refusals, since) = (self.refusals(), Instant::now());
            let lookup = tokio::select! {
                result = self.jetstream().get_stream(part.stream_name()) => result,
                refused = refusals.refused_under("$JS.API.", since) => {
                    return Err(declare_err(&part.what(), Cause::permanent(format!("{refused}; {WHO_DECLARES}"))));
                }
            };
            match lookup {
                Ok(existing) => return Ok(Some(existing)),
                Err(err) if is_not_found(&err) => return Ok(None),
                Err(err) if started.elapsed() + delays.peek() < self.topology_wait() => {
                    tracing::warn!(part = %part.what(), error = %err, delay = ?delays.peek(), "JetStream did not answer a lookup; asking again");
                    delays.sleep().await;
                }
                Err(err) => {
                    let waited = started.elapsed().as_secs_f64();
                    let cause = Cause::of(err).context(format!("still failing after {waited:.1}s"));
                    return Err(declare_err(&part.what(), cause));
                }
            }
        }
    }

    /// Runs a JetStream API call that an identity without the right to it would wait out its timeout for: a
    /// refusal by the server ends it at once.
    async fn api_call<T>(&self, call: impl std::future::Future<Output = Result<T, Cause>>) -> Result<T, Cause> {
        let (refusals, since) = (self.refusals(), Instant::now());
        tokio::select! {
            result = call => result,
            refused = refusals.refused_under("$JS.API.", since) => {
                Err(Cause::permanent(format!("{refused}; {WHO_DECLARES} (this identity may only read the job's topology)")))
            }
        }
    }

    /// Creates the part. A cluster that cannot place it yet ("no suitable peers for placement": a node that just
    /// started is not yet known to be online) is asked again with backoff (0.1 s doubling to 2 s) while the
    /// declaration is younger than `nats.connect_timeout_s`; a cluster too small for `nats.replicas` fails then,
    /// with the hint.
    async fn create_part(&self, part: &Part, started: Instant) -> Result<(), BusError> {
        let js = self.jetstream();
        let mut delays = Delays::new(Duration::from_millis(100), Duration::from_secs(2));
        let created = loop {
            let created = self
                .api_call(async {
                    match part {
                        Part::Stream(c) => js.create_stream((**c).clone()).await.map(drop).map_err(Cause::of),
                        Part::Bucket(c) => js.create_key_value(c.clone()).await.map(drop).map_err(Cause::of),
                        Part::Objects(c) => js.create_object_store(c.clone()).await.map(drop).map_err(Cause::of),
                    }
                })
                .await;
            match created {
                Err(cause) if is_no_placement(&cause) && started.elapsed() + delays.peek() < self.topology_wait() => {
                    tracing::warn!(part = %part.what(), error = %cause, delay = ?delays.peek(), "JetStream cannot place it yet; asking again");
                    delays.sleep().await;
                }
                created => break created,
            }
        };
        let cause = match created {
            Ok(()) if !matches!(part, Part::Bucket(_)) => return Ok(()),
            // the client creates a bucket with its own settings (direct get on): made as declared below
            Ok(()) => Cause::transient("the new bucket could not be read back"),
            Err(cause) if cause.to_string().contains("permissions violation") => {
                return Err(declare_err(&part.what(), cause));
            }
            Err(cause) => cause,
        };
        // Another declarer may have created it meanwhile (or we just created a bucket): then it only has to be as
        // declared.
        if let Ok(existing) = js.get_stream(part.stream_name()).await {
            let differences = part.differences(&existing.cached_info().config);
            if differences.is_empty() {
                return Ok(());
            }
            return self.update_part(part, &existing.cached_info().config, &differences).await;
        }
        Err(declare_err(&part.what(), self.replicas_hint(cause)))
    }

    async fn update_part(
        &self,
        part: &Part,
        existing: &stream::Config,
        differences: &[String],
    ) -> Result<(), BusError> {
        let updated =
            self.api_call(async { self.jetstream().update_stream(part.updated(existing)).await.map_err(Cause::of) });
        let Err(cause) = updated.await else {
            return Ok(());
        };
        let mut message = format!("updating {}", differences.join(", "));
        // The server cannot change a stream to or from a work queue in place (SCORE was one before).
        if let Part::Stream(wanted) = part {
            if existing.retention != wanted.retention {
                let name = &wanted.name;
                message = format!(
                    "{message}; it exists with retention {:?} but this jetrl needs {:?}: stop the job's services, \
                     let it drain (its consumers show nothing pending), delete it (`nats stream rm {name}`) and \
                     start them again",
                    existing.retention, wanted.retention
                );
            }
        }
        if existing.storage != part.wanted().storage {
            message = format!(
                "{message}; the server cannot change a stream's storage in place: delete it (`nats stream rm {}`) \
                 while the job is stopped",
                part.stream_name()
            );
        }
        Err(declare_err(&part.what(), self.replicas_hint(cause.context(message))))
    }

    /// Adds what `nats.replicas` needs to a failed declaration's message, when replicas may be the cause.
    fn replicas_hint(&self, cause: Cause) -> Cause {
        if self.replicas() > 1 {
            cause.context(format!(
                "nats.replicas is {}: that needs a JetStream cluster of at least {} nodes; a single server takes \
                 nats.replicas 1",
                self.replicas(),
                self.replicas()
            ))
        } else {
            cause
        }
    }

    /// Waits until every stream, bucket and object store of the job exists, reading only (no right to create or
    /// update anything is needed): what services other than the trainer call at start-up. A part whose settings
    /// differ from what this jetrl declares is logged (the trainer updates it). Gives up after
    /// `nats.connect_timeout_s` with an error naming what is missing and who declares it.
    pub async fn expect_topology(&self) -> Result<(), BusError> {
        let started = Instant::now();
        let mut delays = Delays::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut last_log = None::<Instant>;
        loop {
            let mut missing = Vec::new();
            for part in self.parts() {
                match self.jetstream().get_stream(part.stream_name()).await {
                    Ok(existing) => {
                        let differences = part.differences(&existing.cached_info().config);
                        if !differences.is_empty() {
                            tracing::warn!(part = %part.what(), ?differences, "differs from what this jetrl declares; the trainer updates it when it starts");
                        }
                    }
                    Err(err) if is_not_found(&err) => missing.push(part.what()),
                    // a timeout, or a leader being elected: not there yet, for now
                    Err(err) => missing.push(format!("{} ({err})", part.what())),
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            let waited = started.elapsed();
            if waited + delays.peek() > self.topology_wait() {
                return Err(BusError::Declare {
                    what: format!("job {}", self.names().namespace()),
                    cause: Cause::new(
                        Recovery::Unavailable,
                        format!(
                            "after waiting {:.1}s these are still missing: {}; {WHO_DECLARES} (this service only \
                             reads them)",
                            waited.as_secs_f64(),
                            missing.join(", ")
                        ),
                    ),
                });
            }
            if last_log.is_none_or(|at| at.elapsed() > Duration::from_secs(5)) {
                tracing::info!(?missing, "waiting for the job's topology: {WHO_DECLARES}");
                last_log = Some(Instant::now());
            }
            delays.sleep().await;
        }
    }

    /// Opens one of the job's KV buckets (declared by [`Bus::declare_topology`]).
    pub async fn key_value(&self, bucket: &str) -> Result<kv::Store, BusError> {
        self.jetstream()
            .get_key_value(bucket)
            .await
            .map_err(|e| declare_err(&format!("KV bucket {bucket}"), Cause::of(e).context(WHO_DECLARES)))
    }

    /// Opens one of the job's object stores (declared by [`Bus::declare_topology`]).
    pub async fn object_store(&self, bucket: &str) -> Result<object_store::ObjectStore, BusError> {
        self.jetstream()
            .get_object_store(bucket)
            .await
            .map_err(|e| declare_err(&format!("object store {bucket}"), Cause::of(e).context(WHO_DECLARES)))
    }

    /// The durable pull consumer shared by all instances of one service (a work-sharing group). It belongs to
    /// the service that consumes: that service creates it (idempotent for an identical config) and updates it.
    pub async fn shared_pull_consumer(
        &self,
        stream_name: &str,
        durable: &str,
        filter_subject: &str,
        ack_wait: Duration,
        max_ack_pending: i64,
    ) -> Result<consumer::PullConsumer, BusError> {
        let what = format!("consumer {stream_name}/{durable}");
        let stream = self.jetstream().get_stream(stream_name).await.map_err(|e| declare_err(&what, Cause::of(e)))?;
        let config = consumer::pull::Config {
            durable_name: Some(durable.to_string()),
            filter_subject: filter_subject.to_string(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            max_ack_pending,
            // unlimited: a worker that dies must not make its prompts disappear; poison messages are
            // terminated by the consumer code instead.
            max_deliver: -1,
            ..Default::default()
        };
        // create_consumer is idempotent for an identical config; on a config change update it.
        match stream.create_consumer(config.clone()).await {
            Ok(consumer) => Ok(consumer),
            Err(_) => {
                self.jetstream()
                    .update_consumer_on_stream(config, stream_name)
                    .await
                    .map_err(|e| declare_err(&what, Cause::of(e)))?;
                stream.get_consumer(durable).await.map_err(|e| declare_err(&what, Cause::other(e)))
            }
        }
    }

    /// A handle on one of the job's streams.
    pub async fn stream(&self, name: &str) -> Result<jetstream::stream::Stream, BusError> {
        self.jetstream().get_stream(name).await.map_err(|e| declare_err(&format!("stream {name}"), Cause::of(e)))
    }
}

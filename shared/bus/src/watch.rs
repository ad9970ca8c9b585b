//! Following a KV watch, or a stream, for as long as its owner wants ([`Follower`]): the one way jetrl reads a
//! bucket's changes (the buffer's group records, the rollout workers' `latest` weights, the trainer's view of the
//! fleet) and follows a stream it must not miss a message of (the buffer's rewards). Either is an ordered consumer;
//! in a cluster, when the node holding that consumer dies, it can go quiet without an error and without being
//! recreated (seen in `tests/tests/nats_cluster.rs`: a rollout worker never loaded the next version and the run
//! stood still). The follower compares, while nothing arrives, the newest revision (or sequence) it was given with
//! the store's, and opens the watch or consumer again when it is behind.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{Ordered, OrderedConfig};
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::{self, kv};

use crate::{BusError, Cause, Recovery};

/// How often a watch that has delivered nothing is compared with its bucket.
pub const WATCH_CHECK: Duration = Duration::from_secs(5);

/// How long the comparison may take; a bucket that cannot be read now is not taken for a stalled watch.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// The newest revision of `key` in `kv` (None: no such key), or of the whole bucket when `key` is None (its last
/// sequence, which counts deleted and expired entries too: read it before opening a watch, and take what the
/// watch delivers after that as new). None also when the bucket cannot be read within [`ASK_TIMEOUT`].
pub async fn newest(kv: &kv::Store, key: Option<&str>) -> Option<u64> {
    let newest = async {
        match key {
            Some(key) => kv.entry(key).await.ok().flatten().map(|entry| entry.revision),
            // asked of the server: the store's `status()` answers from the stream info cached when it was opened
            None => kv.stream.get_info().await.ok().map(|info| info.state.last_sequence),
        }
    };
    tokio::time::timeout(ASK_TIMEOUT, newest).await.ok().flatten()
}

/// The last sequence of stream `name` (None: it cannot be read within [`ASK_TIMEOUT`]).
async fn last_sequence(js: &jetstream::Context, name: &str) -> Option<u64> {
    let last = async { js.get_stream(name).await.ok()?.get_info().await.ok().map(|info| info.state.last_sequence) };
    tokio::time::timeout(ASK_TIMEOUT, last).await.ok().flatten()
}

/// What a [`Follower`] reads: the entries of a KV watch ([`Keys`]) or the messages of a stream ([`Messages`]),
/// each with a position (a revision, a stream sequence) that only grows.
pub trait Source: Send + Sync {
    type Item: Send;
    type ReadError: std::fmt::Display + Send;
    type Reader: futures::Stream<Item = Result<Self::Item, Self::ReadError>> + Unpin + Send;

    /// Opens a reader: from the start when `replay` (each key's newest value, or every message), else after `seen`.
    fn open(&self, replay: bool, seen: u64) -> impl Future<Output = Result<Self::Reader, BusError>> + Send;

    /// The position of `item`.
    fn position(item: &Self::Item) -> u64;

    /// The newest position the store holds (None: it cannot be read now).
    fn newest(&self) -> impl Future<Output = Option<u64>> + Send;
}

/// The keys of a bucket under a filter, as a KV watch delivers them.
pub struct Keys {
    kv: kv::Store,
    filter: String,
    /// the key whose revision tells a stall (a filter without wildcards), None: the bucket's last sequence
    key: Option<String>,
}

impl Source for Keys {
    type Item = kv::Entry;
    type ReadError = kv::WatcherError;
    type Reader = kv::Watch;

    async fn open(&self, replay: bool, seen: u64) -> Result<kv::Watch, BusError> {
        let opened = if replay {
            self.kv.watch_with_history(self.filter.as_str()).await
        } else {
            self.kv.watch_from_revision(self.filter.as_str(), seen + 1).await
        };
        opened.map_err(|e| BusError::Kv { bucket: self.kv.name.clone(), key: self.filter.clone(), cause: Cause::of(e) })
    }

    fn position(entry: &kv::Entry) -> u64 {
        entry.revision
    }

    async fn newest(&self) -> Option<u64> {
        newest(&self.kv, self.key.as_deref()).await
    }
}

/// The messages of a stream under a filter, as an ordered consumer delivers them.
pub struct Messages {
    js: jetstream::Context,
    stream: String,
    filter: String,
}

impl Source for Messages {
    type Item = jetstream::Message;
    type ReadError = async_nats::jetstream::consumer::pull::OrderedError;
    type Reader = Ordered;

    async fn open(&self, replay: bool, seen: u64) -> Result<Ordered, BusError> {
        let failed = |cause: Cause| BusError::Consume { what: self.stream.clone(), cause };
        let stream = self.js.get_stream(self.stream.as_str()).await.map_err(|e| failed(Cause::of(e)))?;
        let deliver_policy =
            if replay { DeliverPolicy::All } else { DeliverPolicy::ByStartSequence { start_sequence: seen + 1 } };
        let config = OrderedConfig { filter_subject: self.filter.clone(), deliver_policy, ..Default::default() };
        let consumer = stream.create_consumer(config).await.map_err(|e| failed(Cause::of(e)))?;
        consumer.messages().await.map_err(|e| failed(Cause::of(e)))
    }

    fn position(msg: &jetstream::Message) -> u64 {
        msg.info().map_or(0, |info| info.stream_sequence)
    }

    async fn newest(&self) -> Option<u64> {
        last_sequence(&self.js, &self.stream).await
    }
}

/// How long opening a watch may take before it is tried again.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a watch that ended waits before it is opened again.
const PAUSE: Duration = Duration::from_millis(200);

/// Where a watch that is opened again starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Each key's newest value again, then each change: for a reader that keeps only the newest value of a key
    /// (heartbeats, the `latest` weights). What the bucket held before the watch opened counts as delivered.
    Newest,
    /// After the newest revision delivered: nothing twice, nothing missed, for a reader that applies every
    /// change (the buffer's group records). Only delivered revisions count.
    After,
}

/// Why a watch was opened again (the `reason` label of the restarts counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Restart {
    /// the watch ended or failed (a broker restart, its consumer lost with a cluster node)
    Ended,
    /// it delivered nothing while the bucket moved past what it had delivered
    Stalled,
    /// nothing at all came for the follower's quiet window
    Quiet,
}

impl Restart {
    fn label(self) -> &'static str {
        match self {
            Restart::Ended => "error",
            Restart::Stalled => "stalled",
            Restart::Quiet => "quiet",
        }
    }
}

/// One KV watch (or one stream's ordered consumer) followed for as long as its owner wants: every current entry
/// first (`with_history`; every message), then each change. The watch is opened again, with a warning naming
/// `what` and a count in `restarts_metric{reason}`, when it ends or fails (a broker restart), when it has stalled
/// behind its store (checked while nothing comes, every [`WATCH_CHECK`]; for a filter without wildcards the key's
/// revision, else the bucket's or stream's last sequence), and, when a quiet window is set, when nothing at all
/// came for that long (keys written all the time, heartbeats: a watch that went deaf in a way the revisions do not
/// show is replaced too). Opening is retried with backoff (1 s doubling to 5 s) for as long as it fails
/// transiently; a permanent refusal (an invalid filter, a denied subscription) is returned to the owner.
///
/// [`Follower::next`] is cancel-safe (an entry taken from the watch is returned in the same poll), so it can sit
/// in a `select!` beside the owner's other inputs.
pub struct Follower<S: Source = Keys> {
    source: S,
    what: &'static str,
    restarts_metric: &'static str,
    /// put before each restart's `reason` label (a second input counted in the same metric tells its own)
    reason_prefix: &'static str,
    resume: Resume,
    quiet: Option<Duration>,
    check_every: Duration,
    watch: Option<S::Reader>,
    /// the next open replays each key's newest value (the first open, or a re-read asked for by the owner)
    replay: bool,
    seen: u64,
    last_entry: tokio::time::Instant,
    next_check: tokio::time::Instant,
    reopen: crate::Delays,
    /// the next open waits this long first (a watch that ended, one refused: neither may spin)
    pause: Option<Duration>,
    restarts: u64,
    /// opens refused in a row (for a transient cause); from [`LOUD_AFTER`] on each one is logged as an error
    refused: u32,
}

/// Refused opens in a row after which each further one is an error in the log, not a warning (about a minute).
const LOUD_AFTER: u32 = 12;

impl Follower<Keys> {
    /// A follower of `filter` in `kv`; nothing is opened until the first [`Follower::next`].
    pub fn new(kv: kv::Store, filter: &str, what: &'static str, restarts_metric: &'static str, resume: Resume) -> Self {
        let wildcard = filter.split('.').any(|token| token == "*" || token == ">");
        let keys = Keys { kv, filter: filter.to_string(), key: (!wildcard).then(|| filter.to_string()) };
        Follower::of(keys, what, restarts_metric, resume)
    }
}

impl Follower<Messages> {
    /// A follower of the messages of `stream` under `filter`, each delivered once ([`Resume::After`]: opened again
    /// after the newest sequence delivered); nothing is opened until the first [`Follower::next`].
    pub fn messages(
        js: jetstream::Context,
        stream: &str,
        filter: &str,
        what: &'static str,
        restarts_metric: &'static str,
    ) -> Self {
        let messages = Messages { js, stream: stream.to_string(), filter: filter.to_string() };
        Follower::of(messages, what, restarts_metric, Resume::After)
    }
}

impl<S: Source> Follower<S> {
    fn of(source: S, what: &'static str, restarts_metric: &'static str, resume: Resume) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            source,
            what,
            restarts_metric,
            reason_prefix: "",
            resume,
            quiet: None,
            check_every: WATCH_CHECK,
            watch: None,
            replay: true,
            seen: 0,
            last_entry: now,
            next_check: now + WATCH_CHECK,
            reopen: crate::Delays::new(Duration::from_secs(1), Duration::from_secs(5)),
            pause: None,
            restarts: 0,
            refused: 0,
        }
    }

    /// Opens the watch again when nothing at all came for `quiet`.
    pub fn quiet(mut self, quiet: Duration) -> Self {
        self.quiet = Some(quiet);
        self
    }

    /// How often a watch that delivers nothing is compared with its bucket ([`WATCH_CHECK`] unless set).
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    /// Counts each restart with `prefix` before its `reason` label (`rewards_stalled`), for a follower that
    /// shares its restarts metric with another input of the same owner.
    pub fn reason_prefix(mut self, prefix: &'static str) -> Self {
        self.reason_prefix = prefix;
        self
    }

    /// The newest revision delivered (with [`Resume::Newest`], also what the bucket held when the watch opened).
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// How many times the watch was opened again (not counting the first open or [`Follower::replay`]).
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// The next [`Follower::next`] opens a new watch that delivers each key's newest value again, then each
    /// change (a reader that suspects it missed something reads the bucket again).
    pub fn replay(&mut self) {
        self.watch = None;
        self.replay = true;
    }

    /// The next entry, opening the watch (again) as needed; an error only when opening was refused for good (a
    /// caller that asks again waits a backoff first). Drop the future (or the follower) to stop.
    pub async fn next(&mut self) -> Result<S::Item, BusError> {
        use futures::StreamExt;
        loop {
            if self.watch.is_none() {
                self.open().await?;
                continue;
            }
            let check_at = self.next_check;
            let Some(watch) = self.watch.as_mut() else { continue };
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        self.seen = self.seen.max(S::position(&entry));
                        self.heard();
                        return Ok(entry);
                    }
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, what = self.what, seen = self.seen, "watch failed; watching again");
                        self.restart(Restart::Ended);
                    }
                    None => {
                        tracing::warn!(what = self.what, seen = self.seen, "watch ended; watching again");
                        self.restart(Restart::Ended);
                    }
                },
                _ = tokio::time::sleep_until(check_at) => {
                    self.next_check = tokio::time::Instant::now() + self.check_every;
                    if self.source.newest().await.is_some_and(|newest| newest > self.seen) {
                        tracing::warn!(what = self.what, seen = self.seen, "watch stalled behind the bucket; watching again");
                        self.restart(Restart::Stalled);
                    } else if self.quiet.is_some_and(|quiet| self.last_entry.elapsed() >= quiet) {
                        tracing::debug!(what = self.what, "nothing watched for a while; watching again");
                        self.restart(Restart::Quiet);
                    }
                }
            }
        }
    }

    /// Something came (an entry, or a watch just opened): the quiet window and the next check start now.
    fn heard(&mut self) {
        self.last_entry = tokio::time::Instant::now();
        self.next_check = self.last_entry + self.check_every;
    }

    fn restart(&mut self, why: Restart) {
        let reason = format!("{}{}", self.reason_prefix, why.label());
        metrics::counter!(self.restarts_metric, "reason" => reason).increment(1);
        self.restarts += 1;
        self.watch = None;
        self.pause = (why == Restart::Ended).then_some(PAUSE);
    }

    /// Opens the watch: from the start (each key's newest value) on the first open, a replay, or with
    /// [`Resume::Newest`]; after the newest revision delivered with [`Resume::After`]. Waits and tries again while
    /// opening fails transiently.
    async fn open(&mut self) -> Result<(), BusError> {
        if let Some(pause) = self.pause.take() {
            tokio::time::sleep(pause).await;
        }
        let replay = self.replay || self.resume == Resume::Newest;
        if self.resume == Resume::Newest {
            // what the bucket held before the watch opened counts as delivered (deleted and expired entries too,
            // which a replay does not deliver)
            if let Some(newest) = self.source.newest().await {
                self.seen = self.seen.max(newest);
            }
        }
        match tokio::time::timeout(OPEN_TIMEOUT, self.source.open(replay, self.seen)).await {
            Ok(Ok(watch)) => {
                self.watch = Some(watch);
                self.replay = false;
                self.reopen.reset();
                self.refused = 0;
                self.heard();
            }
            Ok(Err(err)) => {
                let delay = self.reopen.next_delay();
                if err.recovery() == Recovery::Permanent {
                    self.pause = Some(delay);
                    return Err(err);
                }
                self.refused += 1;
                if self.refused >= LOUD_AFTER {
                    // still not permanent (a consumer limit frees as the consumers of dead processes expire), but
                    // the owner has heard nothing of its input for a minute
                    tracing::error!(error = %err, what = self.what, attempts = self.refused, retry_in_s = delay.as_secs_f64(), "cannot watch; retrying");
                } else {
                    tracing::warn!(error = %err, what = self.what, retry_in_s = delay.as_secs_f64(), "cannot watch; retrying");
                }
                tokio::time::sleep(delay).await;
            }
            Err(_) => {
                tracing::warn!(
                    what = self.what,
                    timeout_s = OPEN_TIMEOUT.as_secs(),
                    "opening the watch got no answer; retrying"
                );
            }
        }
        Ok(())
    }
}

/// Follows `kv`'s keys under `filter` for ever (spawn it; abort the task to stop), handing each entry to `each`:
/// a [`Follower`] with [`Resume::Newest`] that is opened again when nothing at all came for `quiet`.
pub async fn follow(
    kv: kv::Store,
    filter: &str,
    what: &'static str,
    restarts_metric: &'static str,
    quiet: Duration,
    mut each: impl FnMut(kv::Entry),
) {
    let mut follower = Follower::new(kv, filter, what, restarts_metric, Resume::Newest).quiet(quiet);
    loop {
        match follower.next().await {
            Ok(entry) => each(entry),
            Err(err) => tracing::error!(error = %err, what, "cannot watch; asking again"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::stream::{self, BoxStream, StreamExt};

    use super::*;

    /// A store of items 1..=`len` whose first reader delivers item 1 and then nothing, without an error (a
    /// consumer lost with its node); each open is recorded as `(replay, seen)`.
    struct StallsOnce {
        len: u64,
        opens: Mutex<Vec<(bool, u64)>>,
    }

    impl Source for StallsOnce {
        type Item = u64;
        type ReadError = String;
        type Reader = BoxStream<'static, Result<u64, String>>;

        async fn open(&self, replay: bool, seen: u64) -> Result<Self::Reader, BusError> {
            let mut opens = self.opens.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            opens.push((replay, seen));
            let last = if opens.len() == 1 { 1 } else { self.len };
            Ok(stream::iter((seen + 1..=last).map(Ok)).chain(stream::pending()).boxed())
        }

        fn position(item: &u64) -> u64 {
            *item
        }

        async fn newest(&self) -> Option<u64> {
            Some(self.len)
        }
    }

    #[tokio::test]
    async fn a_follower_behind_its_store_opens_again_after_what_it_delivered() {
        let source = StallsOnce { len: 3, opens: Mutex::new(Vec::new()) };
        let mut follower =
            Follower::of(source, "test", "test_restarts_total", Resume::After).check_every(Duration::from_millis(20));
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(tokio::time::timeout(Duration::from_secs(5), follower.next()).await.expect("in time").unwrap());
        }
        assert_eq!(got, [1, 2, 3]);
        assert_eq!((follower.seen(), follower.restarts()), (3, 1));
        let opens = follower.source.opens.lock().unwrap().clone();
        assert_eq!(opens, [(true, 0), (false, 1)], "from the start, then after the one delivered");
    }
}

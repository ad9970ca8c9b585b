//! Experiment trackers of `trainer.logger` that live outside the run directory: MLflow ([`mlflow`], its REST
//! API) and Weights & Biases ([`wandb`], the `wandb` Python package in a subprocess); and verl's `file` logger
//! ([`file`], a local JSONL file written in line like `metrics.jsonl`).
//!
//! A remote tracker never slows or stops training. Each runs in its own task behind a bounded queue: the step loop
//! only offers a step to the queue (`TrackerHandle::record`) and a full queue drops the step. The task sends
//! what is queued in batches; a failure that may pass (no connection, a timeout, HTTP 5xx or 429) is retried with
//! doubling backoff up to `Policy::max_attempts` tries, a permanent one (another 4xx) is not retried; either way
//! the batch is then dropped. The first loss of each kind is a warning that says what was lost and why; the
//! count of every step not delivered comes in one warning when the run ends. A tracker that cannot work at all
//! (no wandb package, a bridge that died) says so once and drops everything after. Finishing (the end state,
//! the reward curve and `summary.json` as files of the run) waits at most [`FINISH_WAIT`] for all trackers
//! together, then leaves what is still queued.

pub(crate) mod file;
pub(crate) mod mlflow;
pub(crate) mod wandb;

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jetrl_config::JobConfig;
use tokio::sync::mpsc;

use crate::dump::Generation;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long finishing waits for all trackers together to deliver what is queued and record the run's end.
pub const FINISH_WAIT: Duration = Duration::from_secs(10);

/// One step's metrics, as offered to a tracker.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub step: u64,
    /// when the step was recorded, milliseconds since the Unix epoch
    pub timestamp_ms: u64,
    /// finite values only (the same keys as the step's `metrics.jsonl` line)
    pub metrics: Arc<BTreeMap<String, f64>>,
    /// the step's validation generations (`trainer.log_val_generations` of them), when it validated
    pub generations: Option<Arc<Vec<Generation>>>,
}

impl Step {
    pub fn now(step: u64, metrics: Arc<BTreeMap<String, f64>>) -> Self {
        let timestamp_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Self { step, timestamp_ms, metrics, generations: None }
    }
}

/// How the run ended, as a tracker records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// training ran to its last step (or validated once, `val_only`)
    Finished,
    /// training failed
    Failed,
    /// the trainer was stopped (a signal, or the lease lost) before its last step
    Stopped,
}

/// The end of the run, sent after the last step.
#[derive(Debug, Clone)]
pub(crate) struct Finish {
    pub end: RunEnd,
    /// files of the run kept with it (the reward curve, `summary.json`), those that exist
    pub files: Vec<PathBuf>,
}

/// Why a delivery failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// may pass: tried again after a backoff
    Retry(String),
    /// will not pass for this batch: dropped without retrying
    Permanent(String),
    /// the tracker cannot work at all: this and everything after are dropped
    Disabled(String),
}

/// One tracker's side of the queue: what it does with a batch of steps and with the end of the run.
pub(crate) trait Tracker: Send + 'static {
    /// Sets the run up; called before each delivery until it succeeds once.
    fn start(&mut self) -> impl Future<Output = Result<(), Failure>> + Send;
    /// Delivers steps from the front of `pending`, removing each once it is delivered (what is left on an
    /// error is tried again, or dropped).
    fn send(&mut self, pending: &mut VecDeque<Step>) -> impl Future<Output = Result<(), Failure>> + Send;
    /// Records the end of the run (after every step was delivered or dropped).
    fn finish(&mut self, finish: &Finish) -> impl Future<Output = Result<(), Failure>> + Send;
}

/// The queue and retry settings of a tracker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    /// steps queued at most; a step offered to a full queue is dropped
    pub queue: usize,
    /// steps handed to the tracker at once at most
    pub batch: usize,
    /// tries of one delivery (the first included) while its failures may pass
    pub max_attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            queue: 1024,
            batch: 64,
            max_attempts: 5,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
        }
    }
}

enum Msg {
    Step(Step),
    Finish(Finish),
}

/// What the tracker's task did, read when the run ends.
#[derive(Debug, Default)]
struct Counters {
    delivered: AtomicU64,
    /// dropped after failed deliveries (or because the tracker could not work)
    failed: AtomicU64,
    /// whether the end of the run was recorded
    finished: AtomicU64,
}

/// The trainer's side of one tracker: its queue and task.
pub(crate) struct TrackerHandle {
    name: &'static str,
    tx: mpsc::Sender<Msg>,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
    /// steps accepted by the queue
    queued: u64,
    /// steps dropped because the queue was full
    queue_full: u64,
}

/// How one tracker ended: counts of steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Report {
    pub delivered: u64,
    pub failed: u64,
    pub queue_full: u64,
    /// queued but neither delivered nor dropped when finishing stopped waiting
    pub unsent: u64,
    /// whether the end of the run was recorded
    pub finished: bool,
}

impl TrackerHandle {
    /// Starts `tracker`'s task (on the current tokio runtime).
    pub fn spawn<T: Tracker>(name: &'static str, tracker: T, policy: Policy) -> Self {
        let (tx, rx) = mpsc::channel(policy.queue.max(1));
        let counters = Arc::new(Counters::default());
        let task = tokio::spawn(work(name, tracker, rx, counters.clone(), policy));
        Self { name, tx, counters, task, queued: 0, queue_full: 0 }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Offers a step to the queue; never waits. A full queue drops it (the first time with a warning).
    pub fn record(&mut self, step: Step) {
        match self.tx.try_send(Msg::Step(step)) {
            Ok(()) => self.queued += 1,
            Err(mpsc::error::TrySendError::Full(Msg::Step(step))) => {
                if self.queue_full == 0 {
                    tracing::warn!(
                        tracker = self.name,
                        step = step.step,
                        queue = self.tx.max_capacity(),
                        "tracker queue full (the tracker is slower than training): steps are dropped until it \
                         catches up; the count comes when the run ends"
                    );
                }
                self.queue_full += 1;
            }
            // the task ended (it cannot, before a finish); the step counts as not delivered
            Err(_) => self.queue_full += 1,
        }
    }

    /// Sends the end of the run and waits until `deadline` for the task to deliver what is queued and record
    /// it; then leaves the rest.
    pub async fn finish(mut self, finish: Finish, deadline: Instant) -> Report {
        // the queue may be full: wait for room, as long as finishing may wait
        let _ = tokio::time::timeout_at(deadline, self.tx.send(Msg::Finish(finish))).await;
        if tokio::time::timeout_at(deadline, &mut self.task).await.is_err() {
            self.task.abort();
        }
        let delivered = self.counters.delivered.load(Ordering::Relaxed);
        let failed = self.counters.failed.load(Ordering::Relaxed);
        Report {
            delivered,
            failed,
            queue_full: self.queue_full,
            unsent: self.queued.saturating_sub(delivered + failed),
            finished: self.counters.finished.load(Ordering::Relaxed) > 0,
        }
    }
}

/// The tracker's task: batches what is queued, delivers with retries, then records the end of the run.
async fn work<T: Tracker>(
    name: &'static str,
    mut tracker: T,
    mut rx: mpsc::Receiver<Msg>,
    counters: Arc<Counters>,
    policy: Policy,
) {
    let mut state = Delivery { name, started: false, disabled: false, warned: false, policy, counters };
    let mut pending: VecDeque<Step> = VecDeque::new();
    let mut finish = None;
    while finish.is_none() {
        match rx.recv().await {
            Some(Msg::Step(step)) => pending.push_back(step),
            Some(Msg::Finish(f)) => finish = Some(f),
            // the trainer dropped its side without finishing: nothing more will come
            None => return,
        }
        while pending.len() < policy.batch.max(1) && finish.is_none() {
            match rx.try_recv() {
                Ok(Msg::Step(step)) => pending.push_back(step),
                Ok(Msg::Finish(f)) => finish = Some(f),
                Err(_) => break,
            }
        }
        if !pending.is_empty() {
            state.deliver(&mut tracker, &mut pending).await;
        }
    }
    if let Some(finish) = finish {
        if state.end(&mut tracker, &finish).await {
            state.counters.finished.store(1, Ordering::Relaxed);
        }
    }
}

/// The task's state between deliveries.
struct Delivery {
    name: &'static str,
    started: bool,
    /// the tracker cannot work: everything is dropped
    disabled: bool,
    /// whether a loss was reported already
    warned: bool,
    policy: Policy,
    counters: Arc<Counters>,
}

impl Delivery {
    /// Delivers `pending` (starting the tracker first if it is not yet), retrying what may pass; what is left
    /// after that is dropped and counted.
    async fn deliver<T: Tracker>(&mut self, tracker: &mut T, pending: &mut VecDeque<Step>) {
        let before = pending.len() as u64;
        let mut outcome = Ok(());
        if !self.disabled {
            let mut backoff = Backoff::new(self.policy);
            outcome = loop {
                let result = match self.start(tracker).await {
                    Ok(()) => tracker.send(pending).await,
                    Err(failure) => Err(failure),
                };
                match result {
                    Ok(()) => break Ok(()),
                    Err(failure) => {
                        if let Err(failure) = backoff.wait(failure).await {
                            break Err(failure);
                        }
                    }
                }
            };
        }
        let dropped = pending.len() as u64;
        self.counters.delivered.fetch_add(before - dropped, Ordering::Relaxed);
        if dropped == 0 {
            return;
        }
        let (first, last) = (pending.front().map_or(0, |s| s.step), pending.back().map_or(0, |s| s.step));
        pending.clear();
        self.counters.failed.fetch_add(dropped, Ordering::Relaxed);
        if let Err(failure) = outcome {
            self.lost(&failure, &format!("steps {first}..={last} not delivered"));
        }
    }

    /// Starts the tracker unless it started already.
    async fn start<T: Tracker>(&mut self, tracker: &mut T) -> Result<(), Failure> {
        if !self.started {
            tracker.start().await?;
            self.started = true;
        }
        Ok(())
    }

    /// Records the end of the run (start first, if no step ever started the tracker); whether it was recorded.
    async fn end<T: Tracker>(&mut self, tracker: &mut T, finish: &Finish) -> bool {
        if self.disabled {
            return false;
        }
        let mut backoff = Backoff::new(self.policy);
        loop {
            let result = match self.start(tracker).await {
                Ok(()) => tracker.finish(finish).await,
                Err(failure) => Err(failure),
            };
            match result {
                Ok(()) => return true,
                Err(failure) => {
                    if let Err(failure) = backoff.wait(failure).await {
                        self.lost(&failure, "the end of the run not recorded");
                        return false;
                    }
                }
            }
        }
    }

    /// Says what was lost and why: a tracker that cannot work once, other losses the first time.
    fn lost(&mut self, failure: &Failure, what: &str) {
        match failure {
            Failure::Disabled(why) => {
                if !self.disabled {
                    tracing::error!(tracker = self.name, "{why}; nothing more is sent to this tracker this run");
                }
                self.disabled = true;
            }
            Failure::Retry(why) | Failure::Permanent(why) => {
                if !self.warned {
                    tracing::warn!(
                        tracker = self.name,
                        "{what}: {why}; training goes on, later losses are counted and reported when the run ends"
                    );
                }
                self.warned = true;
            }
        }
    }
}

/// The tries of one delivery: a doubling sleep between them, at most [`Policy::max_attempts`] of them.
struct Backoff {
    policy: Policy,
    tries: u32,
    delays: jetrl_bus::Delays,
}

impl Backoff {
    fn new(policy: Policy) -> Self {
        Self { policy, tries: 1, delays: jetrl_bus::Delays::new(policy.first_backoff, policy.max_backoff) }
    }

    /// After a failed try: sleeps and returns `Ok` when the failure may pass and tries are left, else the
    /// failure to give up with.
    async fn wait(&mut self, failure: Failure) -> Result<(), Failure> {
        match failure {
            Failure::Retry(why) if self.tries < self.policy.max_attempts => {
                tracing::debug!(why, tries = self.tries, backoff = ?self.delays.peek(), "tracker delivery failed; retrying");
                self.delays.sleep().await;
                self.tries += 1;
                Ok(())
            }
            Failure::Retry(why) => Err(Failure::Retry(format!("{why} (after {} tries)", self.tries))),
            other => Err(other),
        }
    }
}

/// Finishes every tracker together, waiting at most [`FINISH_WAIT`], and reports each one's losses.
pub(crate) async fn finish_all(trackers: Vec<TrackerHandle>, finish: Finish) {
    finish_all_by(trackers, finish, Instant::now() + FINISH_WAIT).await;
}

async fn finish_all_by(trackers: Vec<TrackerHandle>, finish: Finish, deadline: Instant) -> Vec<Report> {
    let names: Vec<&'static str> = trackers.iter().map(TrackerHandle::name).collect();
    let reports = futures::future::join_all(trackers.into_iter().map(|t| t.finish(finish.clone(), deadline))).await;
    for (name, r) in names.iter().zip(&reports) {
        let lost = r.failed + r.queue_full + r.unsent;
        if lost > 0 || !r.finished {
            tracing::warn!(
                tracker = name,
                delivered = r.delivered,
                lost,
                failed = r.failed,
                queue_full = r.queue_full,
                unsent = r.unsent,
                end_recorded = r.finished,
                "tracker: {lost} of {} steps not delivered{}",
                lost + r.delivered,
                if r.finished { "" } else { "; the end of the run not recorded" }
            );
        } else {
            tracing::info!(tracker = name, steps = r.delivered, "tracker finished");
        }
    }
    reports
}

/// The resolved job config as trackers record it: secrets (`nats.password`, `nats.token`, credentials inside
/// `nats.url`) replaced by `<redacted>`.
pub(crate) fn redacted_config(cfg: &JobConfig) -> serde_json::Value {
    let mut value = serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null);
    if let Some(nats) = value.get_mut("nats").and_then(|n| n.as_object_mut()) {
        for key in ["password", "token"] {
            if nats.get(key).is_some_and(|v| !v.is_null()) {
                nats.insert(key.into(), "<redacted>".into());
            }
        }
        if let Some(url) = nats.get("url").and_then(|u| u.as_str()) {
            let urls: Vec<String> = url.split(',').map(without_userinfo).collect();
            nats.insert("url".into(), urls.join(",").into());
        }
    }
    value
}

/// `scheme://user:pass@host` → `scheme://<redacted>@host`.
fn without_userinfo(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) if scheme.is_empty() => format!("<redacted>{}", &rest[at..]),
        Some(at) => format!("{scheme}://<redacted>{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// The tracker's run name: `trainer.experiment_name`, else `run.name`.
pub(crate) fn experiment_name(cfg: &JobConfig) -> String {
    cfg.trainer.experiment_name.clone().unwrap_or_else(|| cfg.run.name.clone())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;

    use super::*;

    fn step(n: u64) -> Step {
        Step::now(n, Arc::new(BTreeMap::from([("critic/score/mean".to_string(), n as f64)])))
    }

    fn quick() -> Policy {
        Policy {
            queue: 8,
            batch: 4,
            max_attempts: 3,
            first_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(4),
        }
    }

    /// What a fake tracker was asked, and how it answers.
    #[derive(Default)]
    struct Log {
        starts: u32,
        sends: u32,
        delivered: Vec<u64>,
        finished: Option<RunEnd>,
    }

    struct Fake {
        log: Arc<Mutex<Log>>,
        /// the answer of each `send`, in order; once used up, success
        script: VecDeque<Failure>,
        start_fails: Option<Failure>,
        /// a send that never completes
        stuck: bool,
    }

    impl Fake {
        fn new(script: Vec<Failure>) -> (Self, Arc<Mutex<Log>>) {
            let log = Arc::new(Mutex::new(Log::default()));
            (Self { log: log.clone(), script: script.into(), start_fails: None, stuck: false }, log)
        }
    }

    impl Tracker for Fake {
        async fn start(&mut self) -> Result<(), Failure> {
            self.log.lock().unwrap().starts += 1;
            self.start_fails.clone().map_or(Ok(()), Err)
        }

        async fn send(&mut self, pending: &mut VecDeque<Step>) -> Result<(), Failure> {
            self.log.lock().unwrap().sends += 1;
            if self.stuck {
                std::future::pending::<()>().await;
            }
            if let Some(failure) = self.script.pop_front() {
                return Err(failure);
            }
            let mut log = self.log.lock().unwrap();
            log.delivered.extend(pending.drain(..).map(|s| s.step));
            Ok(())
        }

        async fn finish(&mut self, finish: &Finish) -> Result<(), Failure> {
            self.log.lock().unwrap().finished = Some(finish.end);
            Ok(())
        }
    }

    fn finished() -> Finish {
        Finish { end: RunEnd::Finished, files: Vec::new() }
    }

    async fn run(fake: Fake, policy: Policy, steps: u64) -> Report {
        let mut handle = TrackerHandle::spawn("fake", fake, policy);
        for n in 1..=steps {
            handle.record(step(n));
            tokio::task::yield_now().await;
        }
        handle.finish(finished(), Instant::now() + Duration::from_secs(5)).await
    }

    #[tokio::test]
    async fn failures_that_may_pass_are_retried_until_delivered() {
        let (fake, log) = Fake::new(vec![Failure::Retry("refused".into()), Failure::Retry("refused".into())]);
        let report = run(fake, quick(), 3).await;
        assert_eq!((report.delivered, report.failed, report.unsent, report.finished), (3, 0, 0, true));
        let log = log.lock().unwrap();
        assert_eq!(log.delivered, [1, 2, 3]);
        assert_eq!(log.starts, 1, "started once");
        assert_eq!(log.finished, Some(RunEnd::Finished));
    }

    #[tokio::test]
    async fn retries_stop_at_the_cap_and_the_batch_is_dropped() {
        let (fake, log) = Fake::new(vec![Failure::Retry("down".into()); 3]);
        let mut handle = TrackerHandle::spawn("fake", fake, quick());
        handle.record(step(1));
        // the first batch fails three times (the cap) and is dropped; the next is delivered
        while log.lock().unwrap().sends < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.record(step(2));
        let report = handle.finish(finished(), Instant::now() + Duration::from_secs(5)).await;
        assert_eq!((report.delivered, report.failed, report.finished), (1, 1, true));
        assert_eq!(log.lock().unwrap().delivered, [2]);
        assert_eq!(log.lock().unwrap().sends, 4);
    }

    #[tokio::test]
    async fn a_permanent_failure_is_not_retried() {
        let (fake, log) = Fake::new(vec![Failure::Permanent("HTTP 400".into())]);
        let mut handle = TrackerHandle::spawn("fake", fake, quick());
        handle.record(step(1));
        while log.lock().unwrap().sends < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.record(step(2));
        let report = handle.finish(finished(), Instant::now() + Duration::from_secs(5)).await;
        assert_eq!((report.delivered, report.failed), (1, 1));
        assert_eq!(log.lock().unwrap().sends, 2, "the failed batch was tried once");
    }

    #[tokio::test]
    async fn a_tracker_that_cannot_start_drops_everything_and_is_not_retried() {
        let (mut fake, log) = Fake::new(Vec::new());
        fake.start_fails = Some(Failure::Disabled("wandb not importable".into()));
        let report = run(fake, quick(), 5).await;
        assert_eq!((report.delivered, report.failed + report.queue_full, report.finished), (0, 5, false));
        let log = log.lock().unwrap();
        assert_eq!((log.starts, log.sends), (1, 0), "started once, never sent");
    }

    #[tokio::test]
    async fn a_stuck_tracker_never_blocks_recording_and_finishing_waits_a_bounded_time() {
        let (mut fake, _log) = Fake::new(Vec::new());
        fake.stuck = true;
        let mut handle = TrackerHandle::spawn("fake", fake, quick());
        let t = std::time::Instant::now();
        for n in 1..=100 {
            handle.record(step(n));
        }
        assert!(t.elapsed() < Duration::from_millis(500), "recording waited: {:?}", t.elapsed());
        let t = std::time::Instant::now();
        let report = handle.finish(finished(), Instant::now() + Duration::from_millis(200)).await;
        assert!(t.elapsed() < Duration::from_secs(2), "finishing waited {:?}", t.elapsed());
        // queue of 8: the rest were dropped at once; what was queued is left unsent
        assert_eq!(report.delivered, 0);
        assert!(report.queue_full >= 100 - 8 - 4, "{report:?}");
        assert_eq!(report.queue_full + report.unsent, 100, "{report:?}");
        assert!(!report.finished);
    }

    #[test]
    fn secrets_are_redacted_from_the_recorded_config() {
        let mut cfg = JobConfig::default();
        cfg.nats.url = "nats://alice:s3cret@a:4222,nats://b:4222".into();
        cfg.nats.password = Some("s3cret".into());
        cfg.nats.token = None;
        let value = redacted_config(&cfg);
        let text = value.to_string();
        assert!(!text.contains("s3cret"), "{text}");
        assert_eq!(value["nats"]["url"], "nats://<redacted>@a:4222,nats://b:4222");
        assert_eq!(value["nats"]["password"], "<redacted>");
        assert!(value["nats"]["token"].is_null());
    }
}

//! The rollout fleet as the trainer sees it: the newest heartbeat of every rollout worker (WORKERS bucket), kept
//! current by one watch task. Weight-sync waits ask it which workers are alive and which version each holds;
//! the step metrics ask it how much of the fleet's engine time was idle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::kv;
use jetrl_bus::{watch, Bus, BusError};
use jetrl_wire::v1::{Heartbeat, WorkerState};
use jetrl_wire::Message;
use tokio::sync::Notify;

/// What the watch task shares with the trainer.
#[derive(Default)]
struct Shared {
    /// by WORKERS key (`rollout.<instance>`)
    beats: Mutex<HashMap<String, Heartbeat>>,
    /// woken at every heartbeat
    changed: Notify,
}

/// The fleet's heartbeats. Cheap to clone; the watch stops when the last clone is dropped.
#[derive(Clone)]
pub struct Fleet {
    shared: Arc<Shared>,
    /// a worker whose newest heartbeat is older than this counts as gone (`rollout.heartbeat_timeout_s`)
    liveness: Duration,
    _watch: Arc<WatchTask>,
}

struct WatchTask(tokio::task::JoinHandle<()>);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A worker as a weight sync reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub instance: String,
    pub version: u64,
    pub state: WorkerState,
    /// why it is in that state (a load failure), empty otherwise
    pub message: String,
}

impl std::fmt::Display for WorkerView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@v{} ({})", self.instance, self.version, self.state.label())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl Fleet {
    /// Starts watching the WORKERS bucket (every current entry first, then each change; the watch is re-opened
    /// after a broker hiccup).
    pub async fn watch(bus: &Bus, liveness: Duration) -> Result<Self, BusError> {
        let shared = Arc::new(Shared::default());
        let kv = bus.key_value(bus.names().workers_bucket()).await?;
        let malformed_source = bus.names().workers_bucket().to_string();
        let task_shared = shared.clone();
        let task = tokio::spawn(watch::follow(
            kv,
            "rollout.>",
            "rollout heartbeats",
            "jetrl_trainer_fleet_watch_restarts_total",
            // a live worker beats every rollout.heartbeat_interval_s: a watch that hears none for the liveness
            // window is opened again (a deaf watch would leave the weight sync waiting for its deadline)
            liveness,
            move |entry| {
                if entry.operation != kv::Operation::Put {
                    // deleted or purged: the worker is gone (an expiry by max age sends nothing; liveness by the
                    // heartbeat's own time covers it)
                    task_shared.beats.lock().unwrap_or_else(PoisonError::into_inner).remove(&entry.key);
                    task_shared.changed.notify_waiters();
                    return;
                }
                match Heartbeat::decode(entry.value.as_ref()) {
                    Ok(beat) => {
                        task_shared.beats.lock().unwrap_or_else(PoisonError::into_inner).insert(entry.key, beat);
                    }
                    Err(err) => {
                        let reason = format!("malformed heartbeat: {err}");
                        jetrl_bus::consume::dead_letter(
                            jetrl_bus::heartbeat::TRAINER,
                            &malformed_source,
                            &entry.key,
                            &reason,
                            &entry.value,
                        );
                        tracing::warn!(key = %entry.key, error = %err, "malformed heartbeat ignored");
                    }
                }
                task_shared.changed.notify_waiters();
            },
        ));
        Ok(Self { shared, liveness, _watch: Arc::new(WatchTask(task)) })
    }

    /// Rollout workers whose newest heartbeat is within the liveness window and which did not stop.
    pub fn live(&self) -> Vec<Heartbeat> {
        let now = jetrl_wire::now_unix_ms();
        let window = self.liveness.as_millis() as i64;
        let beats = self.shared.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let mut live: Vec<Heartbeat> = beats
            .values()
            .filter(|b| b.state() != WorkerState::Stopped && now - b.unix_ms <= window)
            .cloned()
            .collect();
        live.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
        live
    }

    /// Workers that sent a heartbeat within this run but whose newest one is now older than the liveness window
    /// (stopped, hung, partitioned or dead without a goodbye): left out of every wait, reported.
    pub fn silent(&self) -> Vec<WorkerView> {
        let now = jetrl_wire::now_unix_ms();
        let window = self.liveness.as_millis() as i64;
        let beats = self.shared.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let mut silent: Vec<WorkerView> = beats
            .values()
            .filter(|b| b.state() != WorkerState::Stopped && now - b.unix_ms > window)
            .map(|b| WorkerView {
                instance: b.instance_id.clone(),
                version: b.policy_version,
                state: b.state(),
                message: format!("silent for {:.1}s", (now - b.unix_ms) as f64 / 1000.0),
            })
            .collect();
        silent.sort_by(|a, b| a.instance.cmp(&b.instance));
        silent
    }

    /// The live workers as a weight sync reports them.
    pub fn views(&self) -> Vec<WorkerView> {
        self.live()
            .into_iter()
            .map(|b| WorkerView {
                state: b.state(),
                instance: b.instance_id,
                version: b.policy_version,
                message: b.message,
            })
            .collect()
    }

    /// Every rollout heartbeat held (live or not), and the age in seconds of the newest: what a weight sync that
    /// sees no live worker reports (none held, or only old ones: the workers are gone, or their beats do not
    /// reach the trainer).
    pub fn heard(&self) -> (usize, Option<f64>) {
        let beats = self.shared.beats.lock().unwrap_or_else(PoisonError::into_inner);
        let now = jetrl_wire::now_unix_ms();
        let newest = beats.values().map(|b| b.unix_ms).max();
        (beats.len(), newest.map(|ms| now.saturating_sub(ms) as f64 / 1000.0))
    }

    /// Sum over live workers of (engine idle seconds, slots): the growth of the first between two readings,
    /// divided by the elapsed time and the number of workers, is the fleet's idle ratio.
    pub fn idle_seconds(&self) -> (f64, usize) {
        let live = self.live();
        (live.iter().map(|b| b.engine_idle_seconds).sum(), live.len())
    }

    /// Waits until `done(live workers)` holds or `deadline` passes; returns whether it held.
    pub async fn wait_until(&self, deadline: tokio::time::Instant, mut done: impl FnMut(&[Heartbeat]) -> bool) -> bool {
        loop {
            let changed = self.shared.changed.notified();
            if done(&self.live()) {
                return true;
            }
            // Liveness also changes with time alone (a worker falling silent): look again at least every 250 ms.
            let next = (tokio::time::Instant::now() + Duration::from_millis(250)).min(deadline);
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(next) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return done(&self.live());
            }
        }
    }
}

//! Weight versions into the engine, and what the worker tells the world about itself.
//!
//! [`follow_weights`] watches the `latest` manifest in the WEIGHTS bucket and loads each new version between
//! decode steps. A version that cannot be loaded is retried with backoff (1 s doubling to 30 s) until it loads or
//! a newer one is announced; meanwhile the worker says `load_failed` (with the error) in its heartbeat and takes
//! no new groups, rather than generating on old weights unnoticed. [`Status`] is that state, shared with the pull
//! loop, the heartbeat and the tasks that wait for a version.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use jetrl_bus::{consume, watch, weights, BusError, Cause, Delays};
use jetrl_telemetry::Shutdown;
use jetrl_wire::v1::{Heartbeat, WeightManifest, WorkerState};
use jetrl_wire::Message;
use tokio::sync::Notify;

use crate::{Worker, SERVICE};

/// The worker's state as its heartbeat reports it.
#[derive(Default)]
pub struct Status {
    state: Mutex<(WorkerState, String)>,
    /// the version `latest` names in WEIGHTS, plus one (0: none seen yet)
    announced: AtomicU64,
    /// woken when the state changes or a version is loaded
    changed: Notify,
}

impl Status {
    pub fn set(&self, state: WorkerState, message: impl Into<String>) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = (state, message.into());
        self.changed.notify_waiters();
    }

    pub fn get(&self) -> (WorkerState, String) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn load_failed(&self) -> bool {
        self.get().0 == WorkerState::LoadFailed
    }

    /// A future that resolves at the next change (create it before checking the condition it waits for).
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// The version `latest` last named, if any.
    pub fn announced(&self) -> Option<u64> {
        self.announced.load(Ordering::SeqCst).checked_sub(1)
    }

    fn loaded(&self) {
        self.changed.notify_waiters();
    }
}

impl Worker {
    /// Writes this worker's heartbeat (WORKERS bucket, key `rollout.<instance>`).
    pub(crate) async fn heartbeat(&self) -> Result<(), BusError> {
        let load = self.engine.load();
        let (state, message) = self.status.get();
        let beat = Heartbeat {
            service: crate::SERVICE.into(),
            instance_id: self.instance.clone(),
            policy_version: self.engine.version(),
            unix_ms: jetrl_wire::now_unix_ms(),
            state: state as i32,
            message,
            inflight: self.inflight.load(Ordering::SeqCst) as u32,
            tokens_per_s: load.tokens_per_s,
            host: jetrl_telemetry::host_name().to_string(),
            pid: std::process::id(),
            slots: self.engine.slots() as u32,
            engine_idle_seconds: load.idle_seconds,
            running_sequences: load.running as u32,
            waiting_sequences: load.waiting as u32,
            kv_cache_usage: load.kv_usage,
            ..Default::default()
        };
        let bucket = self.bus.names().workers_bucket();
        let kv = self.bus.key_value(bucket).await?;
        let key = format!("rollout.{}", self.instance);
        kv.put(&key, beat.encode_to_vec().into()).await.map_err(|e| BusError::Kv {
            bucket: bucket.into(),
            key,
            cause: Cause::of(e),
        })?;
        Ok(())
    }

    /// Reads, checks (size and per-tensor CRCs) and loads one announced version into the engine.
    pub(crate) async fn load_version(&self, manifest: &WeightManifest) -> Result<(), WeightLoadError> {
        let started = Instant::now();
        let blob = self.read_version(manifest).await?;
        self.engine.swap(blob, manifest.version).await.map_err(WeightLoadError::Swap)?;
        metrics::gauge!("jetrl_rollout_policy_version").set(manifest.version as f64);
        tracing::info!(version = manifest.version, elapsed_ms = started.elapsed().as_millis() as u64, "weights loaded");
        self.status.loaded();
        Ok(())
    }

    /// The blob of `manifest`, checked against it.
    pub(crate) async fn read_version(&self, manifest: &WeightManifest) -> Result<bytes::Bytes, WeightLoadError> {
        let blob = self.bus.load_weights(&manifest.location).await.map_err(WeightLoadError::Read)?;
        weights::verify(manifest, &blob).map_err(WeightLoadError::Verify)?;
        Ok(blob)
    }
}

/// Why a weight version did not load (each keeps its cause).
#[derive(Debug, thiserror::Error)]
pub(crate) enum WeightLoadError {
    #[error("reading the blob: {0}")]
    Read(#[source] BusError),
    #[error("the blob does not match its manifest: {0}")]
    Verify(#[source] BusError),
    #[error(transparent)]
    Swap(crate::engine::EngineError),
}

/// Follows the `latest` manifest in the WEIGHTS bucket and loads each new version (a `latest` that goes back is
/// a resumed trainer's: it is loaded too). Failed loads are retried with backoff until they succeed or a newer
/// version replaces them; the worker reports `load_failed` meanwhile. The watch is a [`watch::Follower`]: it is
/// opened again when it fails or stalls behind the bucket (in a cluster, when the node holding its consumer dies
/// and the consumer is not recreated).
pub(crate) async fn follow_weights(worker: Arc<Worker>, shutdown: Shutdown) {
    let bucket = worker.bus.names().weights_bucket();
    // the bucket's handle (the broker may be restarting: asked again until it answers or the job is stopping)
    let mut reopen = Delays::new(Duration::from_secs(1), Duration::from_secs(5));
    let kv = loop {
        match worker.bus.key_value(bucket).await {
            Ok(kv) => break kv,
            Err(err) => {
                tracing::warn!(error = %err, retry_in_s = reopen.peek().as_secs_f64(), "cannot watch weights; retrying");
                tokio::select! {
                    _ = shutdown.wait() => return,
                    _ = reopen.sleep() => {}
                }
            }
        }
    };
    let mut entries = watch::Follower::new(
        kv,
        "latest",
        "weights",
        "jetrl_rollout_weight_watch_restarts_total",
        watch::Resume::Newest,
    );
    let mut pending: Option<WeightManifest> = None;
    let mut backoff = Delays::new(Duration::from_secs(1), Duration::from_secs(30));
    let mut attempt = 0u32;
    // when a failed load is tried again (a deadline, not a sleep: the watch check must not keep postponing it)
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        // wait for a new manifest, or (after a failed load) for the retry
        let retry = async {
            match (&pending, retry_at) {
                (Some(_), Some(at)) => tokio::time::sleep_until(at).await,
                _ => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            _ = shutdown.wait() => return,
            entry = entries.next() => match entry {
                Ok(entry) => Some(entry),
                Err(err) => {
                    // refused for good (the follower waits a backoff before asking again)
                    tracing::error!(error = %err, "cannot watch the weights; asking again");
                    continue;
                }
            },
            _ = retry => None,
        };
        if let Some(entry) = next {
            match WeightManifest::decode(entry.value.as_ref()) {
                Ok(m) => {
                    worker.status.announced.store(m.version + 1, Ordering::SeqCst);
                    worker.status.changed.notify_waiters();
                    if !(m.version == worker.engine.version() && m.version != 0) {
                        pending = Some(m);
                        attempt = 0;
                        backoff.reset();
                        retry_at = None;
                    }
                }
                Err(err) => {
                    let reason = format!("malformed weight manifest: {err}");
                    consume::dead_letter(SERVICE, bucket, &entry.key, &reason, &entry.value);
                    tracing::error!(error = %err, "malformed weight manifest ignored");
                    continue;
                }
            }
        }
        let Some(manifest) = pending.clone() else { continue };
        match worker.load_version(&manifest).await {
            Ok(()) => {
                pending = None;
                attempt = 0;
                backoff.reset();
                retry_at = None;
                if worker.status.get().0 == WorkerState::LoadFailed {
                    worker.status.set(WorkerState::Ready, "");
                }
                let _ = worker.heartbeat().await;
            }
            Err(err) => {
                attempt += 1;
                let delay = backoff.next_delay();
                metrics::counter!("jetrl_rollout_weight_load_failures_total").increment(1);
                tracing::error!(version = manifest.version, attempt, retry_in_s = delay.as_secs_f64(), error = %err, "weight load failed; taking no new groups until it loads");
                worker.status.set(WorkerState::LoadFailed, format!("v{}: {err}", manifest.version));
                let _ = worker.heartbeat().await;
                retry_at = Some(tokio::time::Instant::now() + delay);
            }
        }
    }
}

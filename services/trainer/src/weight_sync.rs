//! Weight versions from the trainer to the rollout workers, with a deadline on every wait.
//!
//! - [`WeightSync::publish`] stores a blob (object store, or a file for `shared_fs` and colocate_async) and
//!   announces it to checkpoint-sync, which writes the manifest every worker watches. An announcement that is not
//!   acknowledged is retried with backoff until `trainer.weight_sync_timeout_s`; a rejection is final.
//! - [`WeightSync::wait_for_workers`] waits until every live worker reports the version, until the same deadline;
//!   a worker that misses it is reported (log, metric, the step's `weight_sync/*` metrics; `jetrl status` shows
//!   its version and state) and left out: no single worker can stop the run. Tasks carry the version they need
//!   (sync mode), so a lagging worker never generates off-policy data.
//! - colocate_async: [`WeightSync::pause_colocated`] / [`WeightSync::resume_colocated`], the handshake with the
//!   rollout worker that shares the trainer's device. The weights move through a local file, never the broker.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetrl_bus::weights::{manifest_for, WeightTransport};
use jetrl_bus::{Bus, Delays};
use jetrl_config::{JobConfig, TrainerMode, WeightTransportKind};
use jetrl_telemetry::Shutdown;
use jetrl_wire::v1::{
    ErrorCode, PauseRequest, PauseResponse, ResumeRequest, ResumeResponse, WeightAnnounce, WeightAnnounceResponse,
    WeightManifest,
};

use crate::error::{AnnounceAttempt, TrainerError, WeightSyncFailure};
use crate::fleet::{Fleet, WorkerView};

/// How a wait for the workers ended.
#[derive(Debug, Clone)]
pub struct SyncReport {
    pub version: u64,
    /// live workers that reported the version in time
    pub loaded: usize,
    /// live workers that did not (left out of the wait, reported)
    pub lagging: Vec<WorkerView>,
    /// workers that went silent (no heartbeat within the liveness window): left out, reported
    pub silent: Vec<WorkerView>,
    pub seconds: f64,
}

/// A co-located worker that did not answer the handshake in time (the trainer goes on without it).
#[derive(Debug, thiserror::Error)]
#[error("co-located rollout worker {instance} did not {what} within {seconds:.0}s: {cause}")]
pub struct HandshakeMissed {
    pub instance: String,
    pub what: &'static str,
    pub seconds: f64,
    pub cause: String,
}

pub struct WeightSync {
    bus: Bus,
    fleet: Fleet,
    transport: WeightTransport,
    deadline: Duration,
    shutdown: Shutdown,
    /// colocate_async: the worker on the trainer's device and the handshake deadline
    colocated: Option<(String, Duration)>,
}

impl WeightSync {
    pub fn new(cfg: &JobConfig, bus: Bus, fleet: Fleet, shutdown: Shutdown) -> Self {
        let shared_dir = || {
            cfg.checkpoint
                .shared_dir
                .clone()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(&cfg.run.dir).join("weights"))
        };
        // colocate_async: always a local file (the worker is on this node); otherwise as configured
        let transport = match (cfg.trainer.mode, cfg.checkpoint.transport) {
            (TrainerMode::ColocateAsync, _) | (_, WeightTransportKind::SharedFs) => {
                WeightTransport::SharedFs { dir: shared_dir() }
            }
            (_, WeightTransportKind::ObjectStore) => {
                WeightTransport::ObjectStore { chunk_bytes: cfg.checkpoint.chunk_bytes as usize }
            }
        };
        let colocated = (cfg.trainer.mode == TrainerMode::ColocateAsync).then(|| {
            (
                cfg.trainer.colocate_async.rollout_instance.clone().unwrap_or_default(),
                Duration::from_secs_f64(cfg.trainer.colocate_async.handshake_timeout_s),
            )
        });
        Self {
            bus,
            fleet,
            transport,
            deadline: Duration::from_secs_f64(cfg.trainer.weight_sync_timeout_s),
            shutdown,
            colocated,
        }
    }

    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// Stores `blob` as version `version` and has checkpoint-sync announce it. Returns the manifest.
    pub async fn publish(&self, version: u64, blob: Bytes) -> Result<WeightManifest, TrainerError> {
        let manifest = self.store(version, blob).await?;
        self.announce(manifest).await
    }

    /// Stores `blob` as version `version` where the transport says (object store or file); returns its manifest.
    pub async fn store(&self, version: u64, blob: Bytes) -> Result<WeightManifest, TrainerError> {
        // A store that fails (a chunk not acknowledged while a cluster elects a leader, a full disk being
        // cleared) is tried again with backoff until the weight-sync deadline; then the error is the trainer's.
        let started = Instant::now();
        let mut backoff = Delays::new(Duration::from_millis(200), Duration::from_secs(5));
        // A stop lets a store in progress finish (one cut short leaves chunks behind), unless the broker has been
        // gone for `jetrl_bus::SETTLE_RECONNECT` (then it cannot finish); it starts no other.
        let stopped = async {
            self.shutdown.wait().await;
            self.bus.unreachable_for(jetrl_bus::SETTLE_RECONNECT).await;
        };
        tokio::pin!(stopped);
        let location = loop {
            let attempt = tokio::select! {
                _ = &mut stopped => {
                    tracing::warn!(version, "NATS unreachable: the weight store in progress is cut short by the stop");
                    return Err(TrainerError::Shutdown);
                }
                attempt = self.bus.store_weights(&self.transport, version, blob.clone()) => attempt,
            };
            match attempt {
                Ok(location) => break location,
                Err(err) if started.elapsed() + backoff.peek() < self.deadline => {
                    tracing::warn!(version, error = %err, delay = ?backoff.peek(), "weights not stored; trying again");
                    metrics::counter!("jetrl_trainer_weight_store_retries_total").increment(1);
                    tokio::select! {
                        _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                        _ = backoff.sleep() => {}
                    }
                }
                Err(err) => return Err(err.into()),
            }
        };
        Ok(manifest_for(&blob, version, version, &location)?)
    }

    /// Has checkpoint-sync register a stored version (the manifest every worker watches). Retried with backoff
    /// until the deadline; a rejection is final.
    pub async fn announce(&self, manifest: WeightManifest) -> Result<WeightManifest, TrainerError> {
        let version = manifest.version;
        let announce = WeightAnnounce { manifest: Some(manifest.clone()) };
        let started = Instant::now();
        let mut backoff = Delays::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut attempt = 0u32;
        // an attempt sent to a checkpoint-sync that dies with it must not use up the whole deadline
        let attempt_timeout = (self.deadline / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            let reply = tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                reply = self.bus.request::<_, WeightAnnounceResponse>(
                    self.bus.names().weights_announce(),
                    &announce,
                    attempt_timeout,
                ) => reply,
            };
            let last = match reply {
                Ok(resp) if resp.error.is_empty() => return Ok(manifest),
                // checkpoint-sync could not do it now (its store failed): worth another attempt
                Ok(resp) if resp.code() == ErrorCode::Unavailable => AnnounceAttempt::Unavailable(resp.error),
                Ok(resp) => {
                    return Err(TrainerError::WeightSync { version, reason: WeightSyncFailure::Rejected(resp.error) })
                }
                Err(err) => AnnounceAttempt::Bus(Box::new(err)),
            };
            attempt += 1;
            metrics::counter!("jetrl_trainer_announce_retries_total").increment(1);
            if attempt % 5 == 1 {
                tracing::warn!(error = %last, version, attempt, "checkpoint-sync not answering; retrying");
            }
            if started.elapsed() + backoff.peek() > self.deadline {
                return Err(TrainerError::WeightSync {
                    version,
                    reason: WeightSyncFailure::Unacknowledged { seconds: started.elapsed().as_secs_f64(), last },
                });
            }
            tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                _ = backoff.sleep() => {}
            }
        }
    }

    /// Waits until every live rollout worker reports `version` (exactly, with `exact`; else that version or a
    /// later one) and at least one does, for at most `trainer.weight_sync_timeout_s`. Workers that miss the
    /// deadline are reported and left out.
    pub async fn wait_for_workers(&self, version: u64, exact: bool) -> Result<SyncReport, TrainerError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.deadline;
        let loaded = |v: u64| if exact { v == version } else { v >= version };
        // a long wait is said every minute, with what each worker reports (the deadline may be minutes away)
        let mut next_warn = tokio::time::Instant::now() + crate::rollout_client::SLOW_BATCH_WARN;
        let waited = loop {
            let until = next_warn.min(deadline);
            let held = tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                held = self.fleet.wait_until(until, |live| !live.is_empty() && live.iter().all(|b| loaded(b.policy_version))) => held,
            };
            if held || until >= deadline {
                break held;
            }
            let workers: Vec<String> = self.fleet.views().iter().map(ToString::to_string).collect();
            let (heartbeats_held, newest_heartbeat_age_s) = self.fleet.heard();
            tracing::warn!(
                version,
                waited_s = started.elapsed().as_secs(),
                deadline_s = self.deadline.as_secs_f64(),
                ?workers,
                heartbeats_held,
                ?newest_heartbeat_age_s,
                "weight sync still waiting: not every live rollout worker reports the new version"
            );
            next_warn += crate::rollout_client::SLOW_BATCH_WARN;
        };
        let views = self.fleet.views();
        let lagging: Vec<WorkerView> = views.iter().filter(|w| !loaded(w.version)).cloned().collect();
        let report = SyncReport {
            version,
            loaded: views.len() - lagging.len(),
            lagging,
            silent: self.fleet.silent(),
            seconds: started.elapsed().as_secs_f64(),
        };
        metrics::gauge!("jetrl_trainer_lagging_workers").set(report.lagging.len() as f64);
        metrics::gauge!("jetrl_trainer_silent_workers").set(report.silent.len() as f64);
        if !report.silent.is_empty() {
            let silent: Vec<String> = report.silent.iter().map(ToString::to_string).collect();
            tracing::warn!(version, ?silent, "rollout workers silent: left out of the weight sync; their groups are redelivered after rollout.ack_wait_s");
        }
        if !waited {
            metrics::counter!("jetrl_trainer_weight_sync_timeouts_total").increment(1);
            let lagging: Vec<String> = report.lagging.iter().map(ToString::to_string).collect();
            if report.loaded == 0 {
                tracing::error!(
                    version,
                    deadline_s = self.deadline.as_secs_f64(),
                    ?lagging,
                    "no live rollout worker loaded the new weights in time; going on (tasks wait for a worker that has them)"
                );
            } else {
                tracing::warn!(
                    version,
                    loaded = report.loaded,
                    ?lagging,
                    "rollout workers missed the weight-sync deadline; left out (they catch up when they load it)"
                );
            }
        }
        Ok(report)
    }

    /// colocate_async: asks the co-located worker to park its sequences and free its KV cache.
    pub async fn pause_colocated(&self, step: u64) -> Result<PauseResponse, HandshakeMissed> {
        let (instance, timeout) = self.colocated.clone().unwrap_or_default();
        let request = PauseRequest { step, free_cache: true };
        let subject = self.bus.names().control_subject(&instance, "pause");
        self.handshake::<_, PauseResponse>(&subject, &request, &instance, "pause", timeout, |r| &r.error).await
    }

    /// colocate_async: has the co-located worker load `manifest` (a local file) and continue its sequences.
    pub async fn resume_colocated(
        &self,
        step: u64,
        manifest: Option<WeightManifest>,
    ) -> Result<ResumeResponse, HandshakeMissed> {
        let (instance, timeout) = self.colocated.clone().unwrap_or_default();
        let request = ResumeRequest { step, manifest };
        let subject = self.bus.names().control_subject(&instance, "resume");
        self.handshake::<_, ResumeResponse>(&subject, &request, &instance, "resume", timeout, |r| &r.error).await
    }

    async fn handshake<Req: jetrl_wire::Message, Resp: jetrl_wire::Message + Default>(
        &self,
        subject: &str,
        request: &Req,
        instance: &str,
        what: &'static str,
        timeout: Duration,
        error_of: impl Fn(&Resp) -> &String,
    ) -> Result<Resp, HandshakeMissed> {
        let missed = |cause: String| {
            metrics::counter!("jetrl_trainer_handshake_missed_total", "what" => what).increment(1);
            HandshakeMissed { instance: instance.to_string(), what, seconds: timeout.as_secs_f64(), cause }
        };
        match self.bus.request::<Req, Resp>(subject, request, timeout).await {
            Ok(resp) if error_of(&resp).is_empty() => Ok(resp),
            Ok(resp) => Err(missed(error_of(&resp).clone())),
            Err(err) => Err(missed(err.to_string())),
        }
    }
}

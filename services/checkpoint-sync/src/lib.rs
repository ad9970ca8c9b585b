//! One file: the service is small (the registry, its requests and the weight store).
//!
//! jetrl-checkpoint-sync: the weight-version registry.
//!
//! The trainer writes a weight blob (object store or shared filesystem) and announces it on
//! `jetrl.<ns>.weights.announce`. This service checks the blob is where the manifest says and of the announced
//! size, writes the manifest to the WEIGHTS bucket (`v.<version>`, then `latest`, which rollout workers
//! watch), and deletes blobs older than `checkpoint.keep_versions`. Durable checkpoints are the trainer's own
//! (`global_step_<n>/actor/` is an HF model directory); this service keeps only the versions in flight.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::service::{self, Start, Started};
use jetrl_bus::{consume, Bus, BusError, Cause, Delays, Patience};
use jetrl_config::JobConfig;
use jetrl_telemetry::Shutdown;
use jetrl_wire::v1::{ErrorCode, WeightAnnounce, WeightAnnounceResponse, WeightManifest};
use jetrl_wire::Message;

const SERVICE: &str = jetrl_wire::ServiceKind::Checkpoint.as_str();

/// How long an announced blob may stay invisible (a lagging replica) before the announcement is rejected.
const BLOB_LOOKUP_PATIENCE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("announcement of version {version}: {message}")]
    Announce { version: u64, message: String },
}

impl CheckpointError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bus(..) => "bus",
            Self::Metrics(..) => "metrics",
            Self::Announce { .. } => "announce",
        }
    }
}

impl CheckpointError {
    /// The code of the answer to the trainer: a store that failed in a way a retry can pass (a timeout, a cluster
    /// electing a leader) is `UNAVAILABLE`, and the trainer announces again; anything else is refused for good.
    fn code(&self) -> ErrorCode {
        match self {
            CheckpointError::Bus(err) if err.recovery().retryable() => ErrorCode::Unavailable,
            _ => ErrorCode::Invalid,
        }
    }
}

/// Runs checkpoint-sync until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CheckpointError> {
    let shutdown = Shutdown::new(shutdown);
    let start = Start {
        client: "jetrl-checkpoint-sync",
        service: SERVICE,
        instance: None,
        metrics_addr: &cfg.checkpoint.metrics_addr,
    };
    let Started { bus, heartbeat } = service::start::<CheckpointError>(&cfg, start, &shutdown).await?;
    let mut registry = Registry::load(&bus, &cfg).await?;
    let mut announcements = bus
        .client()
        .queue_subscribe(bus.names().weights_announce().to_string(), "checkpoint-sync".into())
        .await
        .map_err(|e| BusError::Consume { what: bus.names().weights_announce().into(), cause: Cause::of(e) })?;
    tracing::info!(versions = registry.versions.len(), "checkpoint-sync serving");
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            msg = announcements.next() => {
                let Some(msg) = msg else { break };
                let started = Instant::now();
                let response = match WeightAnnounce::decode(msg.payload.as_ref()) {
                    // storing retries a lost broker for up to its deadline; a stop does not wait for it (the
                    // trainer announces again to the next checkpoint-sync)
                    Ok(announce) => match tokio::select! {
                        accepted = registry.accept(announce) => accepted,
                        () = shutdown.wait() => break,
                    } {
                        Ok(version) => WeightAnnounceResponse { version, ..Default::default() },
                        Err(err) if err.code() == ErrorCode::Unavailable => {
                            tracing::warn!(error = %err, "weight announcement not stored yet; the trainer announces again");
                            WeightAnnounceResponse { version: 0, error: err.to_string(), code: ErrorCode::Unavailable as i32 }
                        }
                        Err(err) => {
                            metrics::counter!("jetrl_checkpoint_rejected_total").increment(1);
                            tracing::error!(error = %err, "weight announcement rejected");
                            WeightAnnounceResponse { version: 0, error: err.to_string(), code: err.code() as i32 }
                        }
                    },
                    Err(err) => {
                        let reason = format!("malformed WeightAnnounce: {err}");
                        consume::dead_letter(SERVICE, bus.names().weights_announce(), &msg.subject, &reason, &msg.payload);
                        tracing::error!(subject = %msg.subject, error = %err, "malformed weight announcement");
                        WeightAnnounceResponse {
                            version: 0,
                            error: format!("malformed WeightAnnounce: {err}"),
                            code: ErrorCode::Malformed as i32,
                        }
                    }
                };
                metrics::histogram!("jetrl_checkpoint_announce_seconds").record(started.elapsed().as_secs_f64());
                if let Some(reply) = msg.reply {
                    if let Err(err) = bus.client().publish(reply, response.encode_to_vec().into()).await {
                        tracing::warn!(error = %err, "announce reply not sent");
                    }
                }
            }
        }
    }
    heartbeat.stop().await;
    tracing::info!("checkpoint-sync stopped");
    Ok(())
}

struct Registry {
    bus: Bus,
    kv: async_nats::jetstream::kv::Store,
    /// announced versions still stored, oldest first, with their blob location
    versions: BTreeMap<u64, String>,
    keep: usize,
}

impl Registry {
    /// Rebuilds the list of stored versions from the WEIGHTS bucket (so GC survives a restart).
    async fn load(bus: &Bus, cfg: &JobConfig) -> Result<Self, CheckpointError> {
        let kv = bus.key_value(bus.names().weights_bucket()).await?;
        let mut versions = BTreeMap::new();
        let kv_err = |cause: Cause| BusError::Kv { bucket: kv.name.clone(), key: "v.*".into(), cause };
        let mut keys = kv.keys().await.map_err(|e| kv_err(Cause::of(e)))?;
        while let Some(key) = keys.next().await {
            let key = key.map_err(|e| kv_err(Cause::of(e)))?;
            let Some(v) = key.strip_prefix("v.").and_then(|v| v.parse::<u64>().ok()) else { continue };
            if let Ok(Some(bytes)) = kv.get(&key).await {
                if let Ok(manifest) = WeightManifest::decode(bytes.as_ref()) {
                    versions.insert(v, manifest.location);
                }
            }
        }
        Ok(Self { bus: bus.clone(), kv, versions, keep: cfg.checkpoint.keep_versions.max(1) as usize })
    }

    async fn accept(&mut self, announce: WeightAnnounce) -> Result<u64, CheckpointError> {
        let manifest = announce.manifest.unwrap_or_default();
        let version = manifest.version;
        let reject = |message: String| CheckpointError::Announce { version, message };
        if manifest.location.is_empty() || manifest.tensors.is_empty() {
            return Err(reject("manifest has no location or no tensors".into()));
        }
        // In a cluster the blob's metadata may be read from a replica that has not caught up with the trainer's
        // write yet: a lookup that fails is asked again with backoff for a few seconds before it counts.
        let started = std::time::Instant::now();
        let mut delays = Delays::new(Duration::from_millis(100), Duration::from_secs(1));
        let size = loop {
            match self.bus.weights_size(&manifest.location).await {
                Ok(size) => break size,
                Err(err) if started.elapsed() < BLOB_LOOKUP_PATIENCE => {
                    tracing::debug!(version, error = %err, "weight blob not visible yet; looking again");
                    delays.sleep().await;
                }
                Err(err) => return Err(err.into()),
            }
        };
        if size != manifest.total_bytes {
            return Err(reject(format!(
                "blob at {} has {size} bytes, manifest says {}",
                manifest.location, manifest.total_bytes
            )));
        }
        let encoded: bytes::Bytes = manifest.encode_to_vec().into();
        // a put is idempotent: asked again through a timeout or a leader election, within nats.connect_timeout_s
        let patience = Patience::within(self.bus.topology_wait());
        let put = |key: String, value: bytes::Bytes| {
            let kv = self.kv.clone();
            async move {
                patience
                    .retry("store weight version", || async {
                        kv.put(&key, value.clone()).await.map_err(|e| BusError::Kv {
                            bucket: kv.name.clone(),
                            key: key.clone(),
                            cause: Cause::of(e),
                        })
                    })
                    .await
            }
        };
        put(format!("v.{version}"), encoded.clone()).await?;
        // fault injection (inert unless JETRL_CRASH_AT names it): v.<n> written, `latest` and the reply not yet
        jetrl_telemetry::crash::crash_point("checkpoint.mid_announce", version);
        // `latest` last: a reader that sees it can always find the versioned entry.
        put("latest".into(), encoded).await?;
        self.versions.insert(version, manifest.location.clone());
        metrics::gauge!("jetrl_checkpoint_latest_version").set(version as f64);
        metrics::counter!("jetrl_checkpoint_versions_total").increment(1);
        metrics::counter!("jetrl_checkpoint_bytes_total").increment(manifest.total_bytes);
        tracing::info!(version, step = manifest.step, bytes = manifest.total_bytes, location = %manifest.location, "weight version published");
        self.collect_garbage(version).await;
        Ok(version)
    }

    /// Deletes the blobs and entries of versions older than the newest `keep`.
    async fn collect_garbage(&mut self, newest: u64) {
        let stale: Vec<u64> = self.versions.keys().copied().filter(|v| *v < newest).collect();
        let excess = self.versions.len().saturating_sub(self.keep);
        for v in stale.into_iter().take(excess) {
            if let Some(location) = self.versions.remove(&v) {
                if let Err(err) = self.bus.delete_weights(&location).await {
                    tracing::warn!(version = v, error = %err, "old weight blob not deleted");
                }
                let _ = self.kv.purge(format!("v.{v}")).await;
            }
        }
    }
}

impl jetrl_telemetry::ServiceError for CheckpointError {}

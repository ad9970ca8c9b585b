//! What every service runs in the background so that an operator sees it: a heartbeat, key
//! `<service>.<instance>` in the job's WORKERS bucket (expiring with the bucket's max age, so a dead process
//! disappears), every `rollout.heartbeat_interval_s`, and a count of the JetStream leader elections and lost
//! quorums of the job's streams (`jetrl_bus_leader_elections_total`, `jetrl_bus_quorum_lost_total`: in a
//! cluster, a node that dies moves the leadership of what it led).
//!
//! The rollout worker writes its own, richer heartbeat (engine load, loaded version). The trainer's says the step
//! it last finished, how long it took and its mean reward: its metrics sink hands each step's metrics line to
//! [`Heartbeats::step_metrics`] in the process (no round trip through `jetrl.<ns>.trainer.metrics` to tell a
//! process's own step). A beat carries the step last finished when it was written, so a reader may see a step up
//! to one interval old.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use jetrl_config::JobConfig;
use jetrl_telemetry::Shutdown;
use jetrl_wire::v1::{Heartbeat, WorkerState};
use jetrl_wire::Message;
use tokio::sync::Notify;

use crate::{Bus, BusError, Cause};

/// The service whose heartbeat carries its step metrics.
pub const TRAINER: &str = jetrl_wire::ServiceKind::Trainer.as_str();

/// What the heartbeat reports, updated between beats.
#[derive(Default, Clone)]
struct Progress {
    step: u64,
    total_steps: u64,
    step_seconds: f64,
    reward: f64,
}

impl Progress {
    /// Folds in one line of the trainer's step metrics (JSON, verl's names).
    fn record(&mut self, line: &[u8]) {
        let Ok(metrics) = serde_json::from_slice::<serde_json::Value>(line) else { return };
        let Some(step) = metrics["training/global_step"].as_f64() else { return };
        // validation-only lines (before the first step) carry no timing
        let Some(step_seconds) = metrics["timing_s/step"].as_f64() else { return };
        self.step = step as u64;
        self.step_seconds = step_seconds;
        self.total_steps = metrics["training/total_steps"].as_f64().map_or(self.total_steps, |t| t as u64);
        self.reward = metrics["critic/score/mean"].as_f64().unwrap_or(f64::NAN);
    }
}

/// Where the trainer's step metrics reach its heartbeat: each line recorded is in the next beat.
#[derive(Clone, Default)]
pub struct StepMetrics(Arc<Mutex<Progress>>);

impl StepMetrics {
    /// Folds in one line of step metrics (JSON, verl's names: `training/global_step`, `timing_s/step`, ...).
    pub fn record(&self, line: &[u8]) {
        if let Ok(mut progress) = self.0.lock() {
            progress.record(line);
        }
    }

    fn now(&self) -> Progress {
        self.0.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// A running heartbeat. Dropping it leaves it running until the service's shutdown; [`Heartbeats::stop`] ends it
/// with a last beat that says `stopped`, written before the process exits.
pub struct Heartbeats {
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
    progress: StepMetrics,
}

impl Heartbeats {
    /// The handle the trainer's metrics sink records its step metrics into.
    pub fn step_metrics(&self) -> StepMetrics {
        self.progress.clone()
    }

    /// Writes the last beat (`stopped`, the trainer's last step) and ends the heartbeat.
    pub async fn stop(self) {
        self.stop.notify_one();
        let _ = tokio::time::timeout(Duration::from_secs(3), self.task).await;
    }
}

/// Starts `service`'s heartbeat and leader-election counting, until `shutdown` fires or [`Heartbeats::stop`].
/// `instance` defaults to `<host>-<pid>`. A failed beat is logged and the next one tried: the connection
/// reconnects by itself.
pub fn start(
    bus: &Bus,
    cfg: &JobConfig,
    service: &'static str,
    instance: Option<&str>,
    shutdown: Shutdown,
) -> Heartbeats {
    let host = jetrl_telemetry::host_name();
    let instance = instance.map_or_else(|| format!("{host}-{}", std::process::id()), str::to_string);
    let interval = Duration::from_secs_f64(cfg.rollout.heartbeat_interval_s.max(0.1));
    let bus = bus.clone();
    let stop = Arc::new(Notify::new());
    let stopped = stop.clone();
    let progress = StepMetrics::default();
    let shared = progress.clone();
    let task = tokio::spawn(async move {
        tokio::spawn(count_leader_elections(bus.clone(), shutdown.clone()));
        let mut ticker = tokio::time::interval(interval);
        loop {
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = stopped.notified() => break,
                _ = ticker.tick() => {
                    if let Err(err) = beat(&bus, service, &instance, WorkerState::Ready, &shared.now()).await {
                        tracing::warn!(error = %err, "heartbeat failed");
                    }
                }
            }
        }
        if let Err(err) = beat(&bus, service, &instance, WorkerState::Stopped, &shared.now()).await {
            tracing::debug!(error = %err, "last heartbeat not written");
        }
    });
    Heartbeats { stop, task, progress }
}

async fn beat(
    bus: &Bus,
    service: &str,
    instance: &str,
    state: WorkerState,
    progress: &Progress,
) -> Result<(), BusError> {
    let beat = Heartbeat {
        service: service.into(),
        instance_id: instance.into(),
        unix_ms: jetrl_wire::now_unix_ms(),
        state: state as i32,
        host: jetrl_telemetry::host_name().into(),
        pid: std::process::id(),
        step: progress.step,
        total_steps: progress.total_steps,
        step_seconds: progress.step_seconds,
        reward: progress.reward,
        ..Default::default()
    };
    let bucket = bus.names().workers_bucket();
    let key = format!("{service}.{instance}");
    let kv = bus.key_value(bucket).await?;
    kv.put(&key, beat.encode_to_vec().into()).await.map_err(|e| BusError::Kv {
        bucket: bucket.into(),
        key,
        cause: Cause::of(e),
    })?;
    Ok(())
}

/// The JetStream streams of the job (its KV buckets' and object store's included).
fn job_streams(bus: &Bus) -> Vec<String> {
    let names = bus.names();
    let mut streams: Vec<String> =
        [names.prompts_stream(), names.traj_stream(), names.score_stream(), names.rewards_stream(), names.dlq_stream()]
            .map(str::to_string)
            .into();
    for bucket in [names.groups_bucket(), names.weights_bucket(), names.workers_bucket(), names.lease_bucket()] {
        streams.push(format!("KV_{bucket}"));
    }
    streams.push(format!("OBJ_{}", names.blobs_store()));
    streams
}

/// `$JS.EVENT.ADVISORY.<STREAM|CONSUMER>.<LEADER_ELECTED|QUORUM_LOST>.<stream>[.<consumer>]` →
/// (kind, event, stream).
fn parse_advisory(subject: &str) -> Option<(&'static str, &'static str, &str)> {
    let mut tokens = subject.strip_prefix("$JS.EVENT.ADVISORY.")?.split('.');
    let kind = match tokens.next()? {
        "STREAM" => "stream",
        "CONSUMER" => "consumer",
        _ => return None,
    };
    let event = match tokens.next()? {
        "LEADER_ELECTED" => "leader_elected",
        "QUORUM_LOST" => "quorum_lost",
        _ => return None,
    };
    Some((kind, event, tokens.next()?))
}

/// Counts the leader elections and lost quorums of the job's streams and consumers, from the server's
/// JetStream advisories (a single server elects nobody: the counters stay absent).
async fn count_leader_elections(bus: Bus, shutdown: Shutdown) {
    let client = bus.client();
    let mut subscriptions = Vec::new();
    for subject in ["$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>", "$JS.EVENT.ADVISORY.*.QUORUM_LOST.>"] {
        match client.subscribe(subject).await {
            Ok(subscription) => subscriptions.push(subscription),
            Err(err) => tracing::debug!(subject, error = %err, "JetStream advisories not followed"),
        }
    }
    let streams = job_streams(&bus);
    // exported from the start (at zero), so a dashboard shows "none" rather than "no data"
    for stream in &streams {
        metrics::counter!("jetrl_bus_leader_elections_total", "kind" => "stream", "stream" => stream.clone())
            .increment(0);
    }
    let mut advisories = futures::stream::select_all(subscriptions);
    loop {
        let message = tokio::select! {
            _ = shutdown.wait() => return,
            message = advisories.next() => message,
        };
        let Some(message) = message else { return };
        let Some((kind, event, stream)) = parse_advisory(&message.subject) else { continue };
        if !streams.iter().any(|s| s == stream) {
            continue;
        }
        let leader = serde_json::from_slice::<serde_json::Value>(&message.payload)
            .ok()
            .and_then(|v| v["leader"].as_str().map(str::to_string))
            .unwrap_or_default();
        let stream = stream.to_string();
        match event {
            "leader_elected" => {
                metrics::counter!("jetrl_bus_leader_elections_total", "kind" => kind, "stream" => stream.clone())
                    .increment(1);
                tracing::info!(kind, %stream, %leader, "JetStream leader elected");
            }
            _ => {
                metrics::counter!("jetrl_bus_quorum_lost_total", "kind" => kind, "stream" => stream.clone())
                    .increment(1);
                tracing::warn!(kind, %stream, "JetStream quorum lost");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_subjects_name_the_kind_the_event_and_the_stream() {
        assert_eq!(
            parse_advisory("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.JETRL_a_TRAJ"),
            Some(("stream", "leader_elected", "JETRL_a_TRAJ"))
        );
        assert_eq!(
            parse_advisory("$JS.EVENT.ADVISORY.CONSUMER.QUORUM_LOST.JETRL_a_PROMPTS.rollout-workers"),
            Some(("consumer", "quorum_lost", "JETRL_a_PROMPTS"))
        );
        assert_eq!(parse_advisory("$JS.EVENT.ADVISORY.API"), None);
        assert_eq!(parse_advisory("$JS.EVENT.ADVISORY.STREAM.CREATED.X"), None);
    }

    #[test]
    fn the_trainers_step_metrics_give_its_step_duration_and_reward() {
        let mut progress = Progress::default();
        progress.record(br#"{"training/global_step": 0, "val-core/reward": 0.1}"#);
        assert_eq!(progress.step, 0, "a validation line before the first step is no step");
        progress.record(
            br#"{"training/global_step": 7, "training/total_steps": 20, "timing_s/step": 2.5, "critic/score/mean": 0.75}"#,
        );
        assert_eq!((progress.step, progress.total_steps), (7, 20));
        assert_eq!((progress.step_seconds, progress.reward), (2.5, 0.75));
        progress.record(b"not json");
        assert_eq!(progress.step, 7);
    }
}

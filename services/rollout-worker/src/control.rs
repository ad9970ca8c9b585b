//! The co-located worker's half of colocate_async (served only by the worker named in
//! `trainer.colocate_async.rollout_instance`): on `pause` it parks every sequence with its prefix and frees the KV
//! cache for the trainer; on `resume` it loads the weights the trainer wrote to a local file and continues every
//! parked sequence from its prefix. A pause that no resume follows within
//! `trainer.colocate_async.handshake_timeout_s` is ended by the worker itself (reported in its heartbeat and a
//! metric): a trainer that died mid-update cannot leave its worker parked forever.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jetrl_bus::consume;
use jetrl_telemetry::Shutdown;
use jetrl_wire::v1::{ErrorCode, PauseRequest, PauseResponse, ResumeRequest, ResumeResponse, WorkerState};
use jetrl_wire::Message;

use crate::{Worker, SERVICE};

/// Serves pause / resume requests for this worker until shutdown.
pub(crate) async fn serve(worker: Arc<Worker>, handshake_timeout: Duration, shutdown: Shutdown) {
    let client = worker.bus.client().clone();
    let subscribe = |verb: &'static str| {
        let client = client.clone();
        let subject = worker.bus.names().control_subject(&worker.instance, verb);
        async move { client.subscribe(subject).await }
    };
    let (mut pauses, mut resumes) = match (subscribe("pause").await, subscribe("resume").await) {
        (Ok(p), Ok(r)) => (p, r),
        (Err(err), _) | (_, Err(err)) => {
            tracing::error!(error = %err, "cannot subscribe to colocate_async control subjects; the trainer's handshakes will time out");
            return;
        }
    };
    tracing::info!(instance = %worker.instance, "serving colocate_async pause / resume");
    // set while paused: when the trainer's resume is overdue
    let mut overdue: Option<tokio::time::Instant> = None;
    loop {
        let deadline = overdue.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            _ = shutdown.wait() => break,
            msg = pauses.next() => {
                let Some(msg) = msg else { break };
                let response = match PauseRequest::decode(msg.payload.as_ref()) {
                    Ok(request) => match worker.engine.pause(request.free_cache && worker.free_cache_engine).await {
                        Ok(parked) => {
                            worker.status.set(WorkerState::Paused, format!("paused for trainer step {}", request.step));
                            overdue = Some(tokio::time::Instant::now() + handshake_timeout);
                            PauseResponse { parked_sequences: parked.sequences as u32, parked_tokens: parked.tokens, ..Default::default() }
                        }
                        Err(err) => PauseResponse { error: err.to_string(), code: ErrorCode::Unavailable as i32, ..Default::default() },
                    },
                    Err(err) => {
                        consume::dead_letter(SERVICE, &msg.subject, &msg.subject, &format!("malformed PauseRequest: {err}"), &msg.payload);
                        PauseResponse { error: format!("malformed PauseRequest: {err}"), code: ErrorCode::Malformed as i32, ..Default::default() }
                    }
                };
                reply(&worker, msg.reply, response.encode_to_vec()).await;
                let _ = worker.heartbeat().await;
            }
            msg = resumes.next() => {
                let Some(msg) = msg else { break };
                let response = match ResumeRequest::decode(msg.payload.as_ref()) {
                    Ok(request) => resume(&worker, request).await,
                    Err(err) => {
                        consume::dead_letter(SERVICE, &msg.subject, &msg.subject, &format!("malformed ResumeRequest: {err}"), &msg.payload);
                        ResumeResponse { error: format!("malformed ResumeRequest: {err}"), code: ErrorCode::Malformed as i32, ..Default::default() }
                    }
                };
                overdue = None;
                reply(&worker, msg.reply, response.encode_to_vec()).await;
                let _ = worker.heartbeat().await;
            }
            _ = tokio::time::sleep_until(deadline), if overdue.is_some() => {
                overdue = None;
                metrics::counter!("jetrl_rollout_handshake_missed_total").increment(1);
                let resumed = worker.engine.resume(None).await.unwrap_or(0);
                tracing::warn!(resumed, timeout_s = handshake_timeout.as_secs_f64(), "no resume from the trainer in time; resumed on the weights held");
                worker.status.set(WorkerState::Ready, format!("resumed on its own after {:.0}s without the trainer's resume", handshake_timeout.as_secs_f64()));
                let _ = worker.heartbeat().await;
            }
        }
    }
}

/// Loads the trainer's new weights (if named) and continues the parked sequences.
async fn resume(worker: &Worker, request: ResumeRequest) -> ResumeResponse {
    let weights = match &request.manifest {
        Some(manifest) => match worker.read_version(manifest).await {
            Ok(blob) => Some((blob, manifest.version)),
            Err(err) => {
                // Resume anyway (the trainer goes on either way); the weight watcher retries the load.
                let resumed = worker.engine.resume(None).await.unwrap_or(0);
                worker.status.set(WorkerState::Ready, "");
                return ResumeResponse {
                    version: worker.engine.version(),
                    resumed_sequences: resumed as u32,
                    error: format!("weights v{} not loaded: {err}", manifest.version),
                    code: ErrorCode::Unavailable as i32,
                };
            }
        },
        None => None,
    };
    let result = worker.engine.resume(weights).await;
    worker.status.set(WorkerState::Ready, "");
    match result {
        Ok(resumed) => {
            if let Some(manifest) = &request.manifest {
                metrics::gauge!("jetrl_rollout_policy_version").set(manifest.version as f64);
            }
            ResumeResponse { version: worker.engine.version(), resumed_sequences: resumed as u32, ..Default::default() }
        }
        Err(err) => ResumeResponse {
            version: worker.engine.version(),
            error: err.to_string(),
            code: ErrorCode::Unavailable as i32,
            ..Default::default()
        },
    }
}

async fn reply(worker: &Worker, to: Option<async_nats::Subject>, payload: Vec<u8>) {
    if let Some(to) = to {
        if let Err(err) = worker.bus.client().publish(to, payload.into()).await {
            tracing::warn!(error = %err, "control reply not sent");
        }
    }
}

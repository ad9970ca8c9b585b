//! jetrl-rollout-worker: one inference engine that turns prompt groups into trajectories.
//!
//! Every worker pulls from the one durable work-queue consumer on PROMPTS, so workers share the work and
//! can be added or removed at any time. For each prompt group it marks the group `running`, generates the
//! `n` samples, publishes every trajectory (de-duplicated by key `{uid}_{session}_{index}`), and only then
//! writes the group's terminal status and acknowledges the task. A worker that dies before that leaves the
//! task unacknowledged: the broker redelivers it to another worker after `rollout.ack_wait_s` (long groups
//! send in-progress acks so they are not redelivered while still being worked on).
//!
//! A watcher follows the WEIGHTS bucket and swaps new versions into the engine between batches; heartbeats
//! in the WORKERS bucket report the loaded version (the trainer waits on them in sync mode).

pub mod engine;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use jetrl_bus::groups::GroupUpdateError;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, weights, Bus, BusError, GroupStore, Publisher};
use jetrl_config::JobConfig;
use jetrl_model::{FinishReason, SamplingParams, Tokenizer};
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::{validate_uid, TrajectoryKey};
use jetrl_wire::v1::{self, GroupState, Heartbeat, PromptTask, Trajectory, WeightManifest};
use jetrl_wire::{packed, subjects, Message};
use tokio::task::JoinSet;

use crate::engine::{Engine, EngineError, GenRequest};

const SERVICE: &str = "rollout";

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("tokenizer of {path}: {message}")]
    Tokenizer { path: String, message: String },
}

/// What a worker shares between its tasks.
struct Worker {
    bus: Bus,
    groups: GroupStore,
    engine: Engine,
    tokenizer: Tokenizer,
    instance: String,
    max_prompt_len: usize,
    ack_wait: Duration,
    /// groups being worked on right now (for heartbeats)
    inflight: AtomicU64,
    /// set when the drain deadline after SIGTERM passes: tasks still running nak their message and stop
    hard_stop: Shutdown,
}

/// Runs one rollout worker until `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RolloutError> {
    let shutdown = Shutdown::new(shutdown);
    let instance = cfg.rollout.instance_id.clone().unwrap_or_else(default_instance_id);
    let bus = Bus::connect(&cfg.nats, &format!("jetrl-rollout-worker-{instance}")).await?;
    bus.declare_topology().await?;
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.rollout.metrics_addr, async move { stop.wait().await }).await?;

    let model_dir = PathBuf::from(&cfg.model.path);
    let tokenizer = Tokenizer::from_dir(&model_dir)
        .map_err(|e| RolloutError::Tokenizer { path: model_dir.display().to_string(), message: e.to_string() })?;
    let seed = (cfg.run.seed as i64)
        .wrapping_add(instance.bytes().fold(0i64, |h, b| h.wrapping_mul(31).wrapping_add(b as i64)));
    let engine = Engine::start(
        &model_dir,
        &cfg.model.device,
        &cfg.model.dtype,
        cfg.rollout.max_num_seqs as usize,
        seed,
        tokenizer.eos_token_ids().to_vec(),
    )?;
    tracing::info!(%instance, model = %model_dir.display(), device = %cfg.model.device, "rollout engine ready");

    let (hard_tx, hard_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Arc::new(Worker {
        groups: GroupStore::open(&bus).await?,
        bus: bus.clone(),
        engine: engine.clone(),
        tokenizer,
        instance: instance.clone(),
        max_prompt_len: cfg.data.max_prompt_length as usize,
        ack_wait: Duration::from_secs_f64(cfg.rollout.ack_wait_s.max(1.0)),
        inflight: AtomicU64::new(0),
        hard_stop: Shutdown::new(async move {
            let _ = hard_rx.await;
        }),
    });

    // Load the newest announced weights before taking work, then follow new versions.
    let weights_task = tokio::spawn(follow_weights(worker.clone(), shutdown.clone()));
    let heartbeat_task = tokio::spawn(heartbeats(worker.clone(), cfg.rollout.heartbeat_interval_s, shutdown.clone()));

    let consumer = bus
        .shared_pull_consumer(
            subjects::PROMPTS_STREAM,
            subjects::ROLLOUT_CONSUMER,
            &format!("{}.>", subjects::PROMPTS_SUBJECT),
            worker.ack_wait,
            100_000,
        )
        .await?;
    let capacity = cfg.rollout.max_inflight_groups.max(1) as usize;
    let mut tasks: JoinSet<()> = JoinSet::new();
    while !shutdown.is_triggered() {
        while tasks.try_join_next().is_some() {}
        let free = capacity.saturating_sub(tasks.len());
        if free == 0 {
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = tasks.join_next() => continue,
            }
        }
        let batch = tokio::select! {
            _ = shutdown.wait() => break,
            batch = consume::pull(&consumer, free, Duration::from_millis(500)) => batch,
        };
        let mut batch = match batch {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(error = %err, "pull failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.wait() => None,
                next = batch.next() => next,
            };
            match next {
                Some(Ok(msg)) => {
                    let w = worker.clone();
                    tasks.spawn(async move { w.handle(msg).await });
                }
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "pull batch ended");
                    break;
                }
                None => break,
            }
        }
    }
    // Stop pulling; give in-flight groups a chance to finish, then nak what is left.
    let drain = Duration::from_secs_f64(cfg.rollout.ack_wait_s.clamp(1.0, 30.0));
    tracing::info!(inflight = tasks.len(), drain_s = drain.as_secs_f64(), "draining in-flight groups");
    let drained = tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        let _ = hard_tx.send(());
        while tasks.join_next().await.is_some() {}
    }
    weights_task.abort();
    heartbeat_task.abort();
    let _ = worker.heartbeat("stopped").await;
    tracing::info!("rollout worker stopped");
    Ok(())
}

fn default_instance_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

impl Worker {
    /// Handles one delivered prompt task end to end; never panics, always settles the message.
    async fn handle(self: Arc<Self>, msg: jetstream::Message) {
        let Some(task) = consume::decode_or_term::<PromptTask>(&msg, SERVICE).await else { return };
        if let Err(err) = validate_uid(&task.uid) {
            consume::count_malformed(SERVICE, subjects::PROMPTS_STREAM);
            tracing::error!(subject = %msg.subject, error = %err, "task with an invalid uid terminated");
            consume::settle(&msg, AckKind::Term).await;
            return;
        }
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let work = self.run_group(&msg, &task);
        let outcome = tokio::select! {
            outcome = with_progress(work, &msg, self.ack_wait) => Some(outcome),
            _ = self.hard_stop.wait() => None,
        };
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        match outcome {
            Some(Ok(())) => {
                if let Err(err) = consume::ack_confirmed(&msg).await {
                    tracing::warn!(uid = %task.uid, error = %err, "task ack not confirmed (a redelivery will be de-duplicated)");
                }
            }
            Some(Err(TaskError::Skip(reason))) => {
                tracing::info!(uid = %task.uid, %reason, "task skipped");
                consume::settle(&msg, AckKind::Ack).await;
            }
            Some(Err(TaskError::Retry(reason))) => {
                tracing::warn!(uid = %task.uid, %reason, "task failed transiently; naking for redelivery");
                consume::settle(&msg, AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
            None => {
                tracing::info!(uid = %task.uid, "shutting down: task naked for another worker");
                consume::settle(&msg, AckKind::Nak(None)).await;
            }
        }
    }

    async fn run_group(&self, msg: &jetstream::Message, task: &PromptTask) -> Result<(), TaskError> {
        let received = Instant::now();
        // pending -> running (a redelivered task restarts a running group)
        let instance = self.instance.clone();
        let started = self
            .groups
            .update(&task.partition, &task.uid, |s| match s.state() {
                GroupState::Pending | GroupState::Running => {
                    s.worker_id = instance.clone();
                    Some(GroupState::Running)
                }
                _ => None,
            })
            .await;
        match started {
            Ok(Some(_)) => {}
            Ok(None) => return Err(TaskError::Skip("group is already terminal (duplicate delivery)".into())),
            Err(GroupUpdateError::Missing { key }) => return Err(TaskError::Skip(format!("no group record {key}"))),
            Err(err) => return Err(TaskError::Retry(err.to_string())),
        }
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        if delivered > 1 {
            metrics::counter!("jetrl_rollout_redelivered_tasks_total").increment(1);
        }

        let (keys, failure) = match self.prompt_ids(task) {
            Ok(prompt) => self.generate_and_publish(task, prompt, received).await?,
            Err(reason) => (Vec::new(), Some(reason)),
        };
        // Terminal status last: every trajectory above is already durable.
        let terminal = if failure.is_some() { GroupState::Failure } else { GroupState::Finished };
        let reason = failure.clone().unwrap_or_default();
        let result = self
            .groups
            .update(&task.partition, &task.uid, |s| {
                s.trajectory_keys = keys.clone();
                s.failure_reason = reason.clone();
                Some(terminal)
            })
            .await;
        match result {
            Ok(_) => {
                metrics::counter!("jetrl_rollout_groups_total", "state" => terminal.label()).increment(1);
                Ok(())
            }
            Err(GroupUpdateError::IllegalTransition { .. }) => {
                Err(TaskError::Skip("group was settled elsewhere".into()))
            }
            Err(err) => Err(TaskError::Retry(err.to_string())),
        }
    }

    /// The prompt's token ids: given directly, or the chat messages rendered with the chat template.
    fn prompt_ids(&self, task: &PromptTask) -> Result<Vec<u32>, String> {
        let ids = if !task.prompt_ids.is_empty() {
            packed::unpack_u32(&task.prompt_ids).map_err(|e| e.to_string())?
        } else if !task.messages.is_empty() {
            let messages: Vec<serde_json::Value> =
                task.messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
            self.tokenizer.apply_chat_template(&messages, true).map_err(|e| format!("chat template: {e}"))?
        } else {
            return Err("task has neither prompt_ids nor messages".into());
        };
        if ids.is_empty() {
            return Err("prompt is empty".into());
        }
        if ids.len() > self.max_prompt_len {
            return Err(format!(
                "prompt has {} tokens, more than data.max_prompt_length = {}",
                ids.len(),
                self.max_prompt_len
            ));
        }
        Ok(ids)
    }

    /// Generates the group and publishes its trajectories. Returns the keys published and, for a group
    /// that could not be generated, the failure reason.
    async fn generate_and_publish(
        &self,
        task: &PromptTask,
        prompt: Vec<u32>,
        received: Instant,
    ) -> Result<(Vec<String>, Option<String>), TaskError> {
        let sampling = task.sampling.clone().unwrap_or_default();
        let mut stop_token_ids = sampling.stop_token_ids.clone();
        stop_token_ids.sort_unstable();
        let params = SamplingParams {
            temperature: sampling.temperature,
            top_p: if sampling.top_p <= 0.0 { 1.0 } else { sampling.top_p },
            top_k: i64::from(sampling.top_k),
            max_new_tokens: sampling.max_new_tokens.max(1) as usize,
            stop_token_ids,
        };
        let n = task.n.max(1) as usize;
        let output = match self.engine.generate(GenRequest { prompt: prompt.clone(), params, n }).await {
            Ok(out) => out,
            Err(EngineError::Stopped) => return Err(TaskError::Retry("engine stopped".into())),
            Err(err) => return Ok((Vec::new(), Some(err.to_string()))),
        };
        let generate_s = output.started.elapsed().as_secs_f64();
        let ttft = (output.started - received).as_secs_f64();
        metrics::histogram!("jetrl_rollout_time_to_first_token_seconds").record(ttft);
        metrics::counter!("jetrl_rollout_trajectories_total", "version" => output.version.to_string())
            .increment(n as u64);
        let packed_prompt = packed::pack_u32(&prompt);
        let mut publisher = Publisher::new(&self.bus, 256);
        let mut keys = Vec::with_capacity(n);
        for (session, sample) in output.samples.iter().enumerate() {
            let key = TrajectoryKey::new(task.uid.clone(), session as u32, 0).to_string();
            let text = self.tokenizer.decode(&sample.tokens, true).unwrap_or_default();
            let traj = Trajectory {
                key: key.clone(),
                uid: task.uid.clone(),
                session_id: session as u32,
                index: 0,
                partition: task.partition.clone(),
                submit_step: task.submit_step,
                prompt_ids: packed_prompt.clone(),
                response_ids: packed::pack_u32(&sample.tokens),
                response_mask: packed::pack_u8(&vec![1u8; sample.tokens.len()]),
                logprobs: packed::pack_f32(&sample.logprobs),
                min_version: output.version,
                max_version: output.version,
                finish_reason: match sample.finish {
                    FinishReason::Stop => v1::FinishReason::Stop as i32,
                    FinishReason::Length => v1::FinishReason::Length as i32,
                },
                timings: Some(v1::Timings {
                    time_to_first_token_s: ttft,
                    generate_s,
                    completed_unix_ms: jetrl_wire::now_unix_ms(),
                }),
                response_text: text,
                data_source: task.data_source.clone(),
                ground_truth: task.ground_truth.clone(),
                extra_info_json: task.extra_info_json.clone(),
                worker_id: self.instance.clone(),
                num_turns: 2,
            };
            let subject = subjects::traj_subject(&task.partition, &task.uid);
            publisher
                .publish(Outgoing::protobuf(subject, Some(key.clone()), &traj))
                .await
                .map_err(|e| TaskError::Retry(e.to_string()))?;
            keys.push(key);
        }
        publisher.drain().await.map_err(|e| TaskError::Retry(e.to_string()))?;
        Ok((keys, None))
    }

    async fn heartbeat(&self, state: &str) -> Result<(), BusError> {
        let beat = Heartbeat {
            service: "rollout".into(),
            instance_id: self.instance.clone(),
            policy_version: self.engine.version(),
            unix_ms: jetrl_wire::now_unix_ms(),
            state: state.into(),
            inflight: self.inflight.load(Ordering::SeqCst) as u32,
            tokens_per_s: 0.0,
            host: default_instance_id(),
        };
        let kv = self.bus.key_value(subjects::WORKERS_BUCKET).await?;
        let key = format!("rollout.{}", self.instance);
        kv.put(&key, beat.encode_to_vec().into()).await.map_err(|e| BusError::Kv {
            bucket: subjects::WORKERS_BUCKET.into(),
            key,
            message: e.to_string(),
        })?;
        Ok(())
    }

    /// Loads one announced version into the engine.
    async fn load_version(&self, manifest: &WeightManifest) -> Result<(), String> {
        let started = Instant::now();
        let blob = self.bus.load_weights(&manifest.location).await.map_err(|e| e.to_string())?;
        weights::verify(manifest, &blob).map_err(|e| e.to_string())?;
        self.engine.swap(blob, manifest.version).await.map_err(|e| e.to_string())?;
        metrics::gauge!("jetrl_rollout_policy_version").set(manifest.version as f64);
        tracing::info!(version = manifest.version, elapsed_ms = started.elapsed().as_millis() as u64, "weights loaded");
        Ok(())
    }
}

/// Why a task was not completed.
enum TaskError {
    /// nothing to do (duplicate delivery, group gone): acknowledge
    Skip(String),
    /// transient (broker or engine trouble): nak for redelivery
    Retry(String),
}

/// Runs `work` while sending in-progress acks every ack_wait/3, so a long group is not redelivered.
async fn with_progress<T>(
    work: impl std::future::Future<Output = T>,
    msg: &jetstream::Message,
    ack_wait: Duration,
) -> T {
    tokio::pin!(work);
    let mut ticker = tokio::time::interval(ack_wait / 3);
    ticker.tick().await;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => consume::settle(msg, AckKind::Progress).await,
        }
    }
}

/// Follows the `latest` manifest in the WEIGHTS bucket; loads each newer version.
async fn follow_weights(worker: Arc<Worker>, shutdown: Shutdown) {
    loop {
        let watch = async {
            let kv = worker.bus.key_value(subjects::WEIGHTS_BUCKET).await?;
            kv.watch_with_history("latest").await.map_err(|e| BusError::Kv {
                bucket: subjects::WEIGHTS_BUCKET.into(),
                key: "latest".into(),
                message: e.to_string(),
            })
        };
        let mut entries = match watch.await {
            Ok(w) => w,
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch weights; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            let entry = tokio::select! {
                _ = shutdown.wait() => return,
                e = entries.next() => e,
            };
            let Some(Ok(entry)) = entry else { break };
            let manifest = match WeightManifest::decode(entry.value.as_ref()) {
                Ok(m) => m,
                Err(err) => {
                    consume::count_malformed(SERVICE, subjects::WEIGHTS_BUCKET);
                    tracing::error!(error = %err, "malformed weight manifest ignored");
                    continue;
                }
            };
            if manifest.version == worker.engine.version() && manifest.version != 0 {
                continue;
            }
            let mut attempt = 0;
            loop {
                match worker.load_version(&manifest).await {
                    Ok(()) => {
                        let _ = worker.heartbeat("ready").await;
                        break;
                    }
                    Err(err) => {
                        attempt += 1;
                        metrics::counter!("jetrl_rollout_weight_load_failures_total").increment(1);
                        tracing::error!(version = manifest.version, attempt, error = %err, "weight load failed");
                        if attempt >= 5 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }
    }
}

async fn heartbeats(worker: Arc<Worker>, interval_s: f64, shutdown: Shutdown) {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(interval_s.max(0.1)));
    loop {
        tokio::select! {
            _ = shutdown.wait() => return,
            _ = ticker.tick() => {
                if let Err(err) = worker.heartbeat("ready").await {
                    tracing::warn!(error = %err, "heartbeat failed");
                }
            }
        }
    }
}

//! jetrl-trainer: owns the policy weights, the optimizer, the step counter and the dataloader cursor.
//!
//! One step in `sync` mode (strictly on-policy, verl's `PPOTrainerSync`):
//!
//! 1. submit one batch of `data.train_batch_size` prompt groups: a `pending` record in the GROUPS bucket,
//!    then a task on the PROMPTS work queue, for each;
//! 2. ask the replay buffer for the whole batch (`jetrl.buffer.sample`, retried with the same request id);
//! 3. fetch the trajectory payloads from the TRAJ stream by sequence;
//! 4. on the actor thread: recompute log-probs, compute advantages, PPO update ([`actor`]);
//! 5. release the step's payloads, publish the new weights as version `step` and wait until every live
//!    rollout worker has loaded it;
//! 6. write the step's metrics (verl's names) to `metrics.jsonl`, NATS and Prometheus.
//!
//! - [`actor`]: model, optimizer and the PPO math on a dedicated thread.
//! - [`optim`]: AdamW with saveable state and verl's LR schedules.
//! - [`metrics_sink`]: metrics.jsonl, progress messages and the reward-curve picture.

pub mod actor;
pub mod metrics_sink;
pub mod optim;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::weights::{manifest_for, WeightTransport};
use jetrl_bus::{Bus, BusError, GroupStore, Publisher};
use jetrl_config::JobConfig;
use jetrl_data::{DataLoader, Example, Prompt};
use jetrl_model::Tokenizer;
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::new_uid;
use jetrl_wire::v1::{
    self, GroupState, GroupStatus, Heartbeat, PromptTask, ReleaseRequest, ReleaseResponse, SampleRequest,
    SampleResponse, Trajectory, WeightAnnounce, WeightAnnounceResponse,
};
use jetrl_wire::{packed, subjects, Message};

use crate::actor::{ActorError, ActorHandle, Sample};
use crate::metrics_sink::MetricsSink;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("metrics endpoint: {0}")]
    Metrics(#[from] jetrl_telemetry::TelemetryError),
    #[error("actor: {0}")]
    Actor(#[from] ActorError),
    #[error("data: {0}")]
    Data(#[from] jetrl_data::DataError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("run directory {path}: {message}")]
    RunDir { path: String, message: String },
    #[error("replay buffer: {0}")]
    Buffer(String),
    #[error("weight sync of version {version}: {message}")]
    WeightSync { version: u64, message: String },
    #[error("data.{key}: {message}")]
    Prompt { key: &'static str, message: String },
    #[error("trainer.mode {0:?} is not implemented yet (only sync)")]
    Mode(String),
    #[error("shutdown requested")]
    Shutdown,
}

/// Runs the trainer until training completes or `shutdown` resolves.
pub async fn run(
    cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), TrainerError> {
    if cfg.trainer.mode != "sync" {
        return Err(TrainerError::Mode(cfg.trainer.mode.clone()));
    }
    let shutdown = Shutdown::new(shutdown);
    let bus = Bus::connect(&cfg.nats, "jetrl-trainer").await?;
    bus.declare_topology().await?;
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.trainer.metrics_addr, async move { stop.wait().await }).await?;
    let mut trainer = Trainer::new(cfg, bus, shutdown).await?;
    let result = trainer.train().await;
    trainer.sink.write_curve();
    match result {
        Err(TrainerError::Shutdown) => {
            tracing::info!("trainer stopped by shutdown");
            Ok(())
        }
        other => other,
    }
}

struct Trainer {
    cfg: JobConfig,
    bus: Bus,
    groups: GroupStore,
    actor: ActorHandle,
    tokenizer: Tokenizer,
    loader: DataLoader,
    val: Vec<Example>,
    sink: MetricsSink,
    shutdown: Shutdown,
    total_steps: u64,
    transport: WeightTransport,
}

impl Trainer {
    async fn new(cfg: JobConfig, bus: Bus, shutdown: Shutdown) -> Result<Self, TrainerError> {
        let (train, val) = jetrl_data::load_datasets(&cfg.data)?;
        let batch = cfg.data.train_batch_size as u64;
        let steps_per_epoch = (train.len() as u64 / batch).max(1);
        let total_steps =
            cfg.trainer.total_training_steps.unwrap_or(steps_per_epoch * u64::from(cfg.trainer.total_epochs.max(1)));
        let groups_per_update = cfg.actor.ppo_mini_batch_size.map(u64::from).unwrap_or(batch).max(1);
        let updates_per_step = batch.div_ceil(groups_per_update) * u64::from(cfg.actor.ppo_epochs.max(1));
        let loader = DataLoader::new(train, cfg.data.shuffle, cfg.data.seed)?;
        let model_dir = PathBuf::from(&cfg.model.path);
        let tokenizer = Tokenizer::from_dir(&model_dir)
            .map_err(|e| TrainerError::Tokenizer(format!("{}: {e}", model_dir.display())))?;
        let actor_cfg = cfg.clone();
        let actor = tokio::task::spawn_blocking(move || ActorHandle::spawn(actor_cfg, total_steps * updates_per_step))
            .await
            .map_err(|_| ActorError::Stopped)??;
        let run_dir = PathBuf::from(&cfg.run.dir);
        let sink = MetricsSink::open(&bus, &run_dir, false)
            .map_err(|e| TrainerError::RunDir { path: run_dir.display().to_string(), message: e.to_string() })?;
        let transport = match cfg.checkpoint.transport.as_str() {
            "shared_fs" => {
                WeightTransport::SharedFs { dir: PathBuf::from(cfg.checkpoint.shared_dir.clone().unwrap_or_default()) }
            }
            _ => WeightTransport::ObjectStore { chunk_bytes: cfg.checkpoint.chunk_bytes as usize },
        };
        tracing::info!(total_steps, train_examples = loader.len(), val_examples = val.len(), batch, "trainer ready");
        Ok(Self {
            groups: GroupStore::open(&bus).await?,
            cfg,
            bus,
            actor,
            tokenizer,
            loader,
            val,
            sink,
            shutdown,
            total_steps,
            transport,
        })
    }

    async fn train(&mut self) -> Result<(), TrainerError> {
        let started = Instant::now();
        // Every worker starts from the trainer's weights, whatever it loaded from disk.
        self.publish_weights(0, false).await?;
        if self.cfg.trainer.val_before_train && !self.val.is_empty() {
            let val = self.validate(0).await?;
            tracing::info!(?val, "validation before training");
            self.sink.record(0, &val).await;
        }
        for step in 1..=self.total_steps {
            if self.shutdown.is_triggered() {
                return Err(TrainerError::Shutdown);
            }
            let mut metrics = self.step(step).await?;
            let test_freq = self.cfg.trainer.test_freq;
            if test_freq > 0 && (step % test_freq as u64 == 0 || step == self.total_steps) && !self.val.is_empty() {
                let t = Instant::now();
                metrics.extend(self.validate(step).await?);
                metrics.insert("timing_s/testing".into(), t.elapsed().as_secs_f64());
            }
            metrics.insert("training/global_step".into(), step as f64);
            metrics.insert("training/epoch".into(), self.loader.state().epoch as f64);
            metrics.insert("training/total_steps".into(), self.total_steps as f64);
            metrics.insert("timing_s/elapsed".into(), started.elapsed().as_secs_f64());
            tracing::info!(
                step,
                score = metrics.get("critic/score/mean").copied().unwrap_or(f64::NAN),
                pg_loss = metrics.get("actor/pg_loss").copied().unwrap_or(f64::NAN),
                step_s = metrics.get("timing_s/step").copied().unwrap_or(f64::NAN),
                "step done"
            );
            self.sink.record(step, &metrics).await;
        }
        self.write_summary(started.elapsed().as_secs_f64());
        Ok(())
    }

    async fn step(&mut self, step: u64) -> Result<BTreeMap<String, f64>, TrainerError> {
        let step_started = Instant::now();
        let mut metrics = BTreeMap::new();
        let examples = self.loader.next_batch(self.cfg.data.train_batch_size as usize);
        let sampling = v1::SamplingParams {
            temperature: self.cfg.rollout.temperature,
            top_p: self.cfg.rollout.top_p,
            top_k: self.cfg.rollout.top_k,
            repetition_penalty: self.cfg.rollout.repetition_penalty,
            max_new_tokens: self.cfg.max_new_tokens(),
            ..Default::default()
        };
        let submitted = self.submit("train", step, &examples, self.cfg.rollout.n, &sampling).await?;

        let t = Instant::now();
        let request_id = format!("train-{step}");
        let response = self.sample(&request_id, step, "train", submitted as u32).await?;
        metrics.insert("timing_s/gen".into(), t.elapsed().as_secs_f64());
        metrics.extend(response.metrics.clone());

        let t = Instant::now();
        let samples = self.fetch_samples(&response).await?;
        metrics.insert("timing_s/fetch".into(), t.elapsed().as_secs_f64());
        batch_metrics(&samples, &response, step, &mut metrics);
        if let Some(dir) = &self.cfg.trainer.rollout_data_dir {
            self.dump_samples(Path::new(dir), step, &samples);
        }

        let t = Instant::now();
        let train_samples = samples.clone();
        let actor_metrics = self.actor.call(move |actor| actor.train(&train_samples)).await??;
        metrics.insert("timing_s/update_actor".into(), t.elapsed().as_secs_f64());
        metrics.extend(actor_metrics);

        self.release(step, vec![request_id]).await;

        let t = Instant::now();
        self.publish_weights(step, false).await?;
        metrics.insert("timing_s/update_weights".into(), t.elapsed().as_secs_f64());

        let step_s = step_started.elapsed().as_secs_f64();
        let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
        metrics.insert("timing_s/step".into(), step_s);
        metrics.insert("perf/total_num_tokens".into(), tokens as f64);
        metrics.insert("perf/throughput".into(), tokens as f64 / step_s.max(1e-9));
        Ok(metrics)
    }

    /// Tokenizes raw-text prompts; chat prompts are rendered by the worker with the model's template.
    fn task_for(
        &self,
        example: &Example,
        partition: &str,
        step: u64,
        n: u32,
        sampling: &v1::SamplingParams,
    ) -> Result<PromptTask, TrainerError> {
        let mut task = PromptTask {
            uid: new_uid(),
            partition: partition.into(),
            n,
            submit_step: step,
            sampling: Some(sampling.clone()),
            data_source: example.data_source.clone(),
            ground_truth: example.ground_truth.clone(),
            extra_info_json: example.extra_info.to_string(),
            agent_name: example.agent_name.clone().unwrap_or_default(),
            row_index: example.index,
            ..Default::default()
        };
        match &example.prompt {
            Prompt::Text(text) => {
                let ids = self.tokenizer.encode(text, true).map_err(|e| TrainerError::Tokenizer(e.to_string()))?;
                if ids.len() > self.cfg.data.max_prompt_length as usize {
                    return Err(TrainerError::Prompt {
                        key: "max_prompt_length",
                        message: format!(
                            "row {} has {} prompt tokens (limit {})",
                            example.index,
                            ids.len(),
                            self.cfg.data.max_prompt_length
                        ),
                    });
                }
                task.prompt_ids = packed::pack_u32(&ids);
            }
            Prompt::Messages(messages) => {
                task.messages = messages
                    .iter()
                    .map(|m| v1::ChatMessage { role: m.role.clone(), content: m.content.clone() })
                    .collect();
            }
        }
        Ok(task)
    }

    /// Writes a pending record then publishes the task, for every example. Returns the number submitted.
    async fn submit(
        &self,
        partition: &str,
        step: u64,
        examples: &[Example],
        n: u32,
        sampling: &v1::SamplingParams,
    ) -> Result<usize, TrainerError> {
        let mut tasks = Vec::with_capacity(examples.len());
        for e in examples {
            tasks.push(self.task_for(e, partition, step, n, sampling)?);
        }
        let records: Vec<GroupStatus> = tasks
            .iter()
            .map(|t| {
                let mut s = GroupStatus {
                    uid: t.uid.clone(),
                    partition: t.partition.clone(),
                    submit_step: step,
                    n: t.n,
                    task: Some(t.clone()),
                    updated_unix_ms: jetrl_wire::now_unix_ms(),
                    ..Default::default()
                };
                s.set_state(GroupState::Pending);
                s
            })
            .collect();
        // the record first: a worker must never see a task without one
        self.groups.create_many(&records).await?;
        let mut publisher = Publisher::new(&self.bus, 512);
        for task in &tasks {
            publisher
                .publish(Outgoing::protobuf(subjects::prompt_subject(partition), Some(task.uid.clone()), task))
                .await?;
        }
        publisher.drain().await?;
        Ok(tasks.len())
    }

    /// Asks the buffer for `batch_size` groups, re-asking with the same request id until it answers.
    async fn sample(
        &self,
        request_id: &str,
        step: u64,
        partition: &str,
        batch_size: u32,
    ) -> Result<SampleResponse, TrainerError> {
        let wait = Duration::from_secs_f64(self.cfg.trainer.sample_wait_s.max(0.1));
        let request = SampleRequest {
            request_id: request_id.to_string(),
            step,
            partition: partition.to_string(),
            batch_size,
            wait_ms: wait.as_millis() as u32,
        };
        let mut failures = 0u32;
        loop {
            if self.shutdown.is_triggered() {
                return Err(TrainerError::Shutdown);
            }
            let reply = tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                r = self.bus.request::<_, SampleResponse>(subjects::BUFFER_SAMPLE, &request, wait + Duration::from_secs(5)) => r,
            };
            match reply {
                Ok(resp) if !resp.error.is_empty() => return Err(TrainerError::Buffer(resp.error)),
                Ok(resp) if resp.not_ready => continue,
                Ok(resp) => return Ok(resp),
                Err(err) => {
                    failures += 1;
                    if failures % 10 == 1 {
                        tracing::warn!(error = %err, request_id, "replay buffer not answering; retrying");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Fetches every sampled trajectory's payload from the TRAJ stream (many direct gets in flight).
    async fn fetch_samples(&self, response: &SampleResponse) -> Result<Vec<Sample>, TrainerError> {
        let stream = self.bus.stream(subjects::TRAJ_STREAM).await?;
        let rewards: Vec<&v1::Reward> = response.groups.iter().flat_map(|g| g.trajectories.iter()).collect();
        let fetched: Vec<(usize, Result<Trajectory, String>)> =
            futures::stream::iter(rewards.iter().enumerate().map(|(i, r)| {
                let stream = &stream;
                let seq = r.traj_seq;
                async move {
                    let result = match stream.direct_get(seq).await {
                        Ok(msg) => Trajectory::decode(msg.payload.as_ref()).map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    (i, result)
                }
            }))
            .buffered(64)
            .collect()
            .await;
        let mut samples = Vec::with_capacity(fetched.len());
        for (i, result) in fetched {
            let reward = rewards[i];
            match result {
                Ok(traj) => match sample_from(&traj, reward) {
                    Ok(s) => samples.push(s),
                    Err(err) => {
                        tracing::error!(key = %reward.key, error = %err, "malformed trajectory payload skipped")
                    }
                },
                Err(err) => {
                    tracing::error!(key = %reward.key, seq = reward.traj_seq, error = %err, "trajectory payload missing; skipped")
                }
            }
        }
        Ok(samples)
    }

    async fn release(&self, step: u64, request_ids: Vec<String>) {
        let request = ReleaseRequest { step, request_ids };
        match self.bus.request::<_, ReleaseResponse>(subjects::BUFFER_RELEASE, &request, Duration::from_secs(30)).await
        {
            Ok(resp) if resp.error.is_empty() => {}
            Ok(resp) => tracing::warn!(error = %resp.error, "release failed"),
            Err(err) => tracing::warn!(error = %err, "release not acknowledged"),
        }
    }

    /// Ships the current weights as version `version` and waits for every live rollout worker to load them.
    async fn publish_weights(&self, version: u64, checkpoint: bool) -> Result<(), TrainerError> {
        let blob = self.actor.call(|actor| actor.weights_blob()).await??;
        let blob = bytes::Bytes::from(blob);
        let location = self.bus.store_weights(&self.transport, version, blob.clone()).await?;
        let manifest = manifest_for(&blob, version, version, &location)?;
        let announce = WeightAnnounce { manifest: Some(manifest), checkpoint };
        let mut attempt = 0;
        loop {
            match self
                .bus
                .request::<_, WeightAnnounceResponse>(subjects::WEIGHTS_ANNOUNCE, &announce, Duration::from_secs(60))
                .await
            {
                Ok(resp) if resp.error.is_empty() => break,
                Ok(resp) => return Err(TrainerError::WeightSync { version, message: resp.error }),
                Err(err) => {
                    attempt += 1;
                    if attempt % 10 == 1 {
                        tracing::warn!(error = %err, version, "checkpoint-sync not answering; retrying");
                    }
                    if self.shutdown.is_triggered() {
                        return Err(TrainerError::Shutdown);
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        self.wait_for_workers(version).await
    }

    /// Waits until at least one rollout worker is alive and every live one reports `version`.
    async fn wait_for_workers(&self, version: u64) -> Result<(), TrainerError> {
        let timeout = Duration::from_secs_f64(self.cfg.trainer.weight_sync_timeout_s.max(1.0));
        let kv = self.bus.key_value(subjects::WORKERS_BUCKET).await?;
        let mut watch = kv.watch_with_history("rollout.>").await.map_err(|e| BusError::Kv {
            bucket: subjects::WORKERS_BUCKET.into(),
            key: "rollout.>".into(),
            message: e.to_string(),
        })?;
        let mut beats: HashMap<String, Heartbeat> = HashMap::new();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut recheck = tokio::time::interval(Duration::from_millis(250));
        loop {
            let now = jetrl_wire::now_unix_ms();
            let live: Vec<&Heartbeat> =
                beats.values().filter(|b| b.state != "stopped" && now - b.unix_ms < 10_000).collect();
            if !live.is_empty() && live.iter().all(|b| b.policy_version >= version) {
                return Ok(());
            }
            tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                _ = tokio::time::sleep_until(deadline) => {
                    let seen: Vec<String> = live.iter().map(|b| format!("{}@v{}", b.instance_id, b.policy_version)).collect();
                    return Err(TrainerError::WeightSync {
                        version,
                        message: format!("no complete rollout-worker acknowledgement within {:.0}s (live workers: {seen:?})", timeout.as_secs_f64()),
                    });
                }
                entry = watch.next() => {
                    if let Some(Ok(entry)) = entry {
                        if let Ok(beat) = Heartbeat::decode(entry.value.as_ref()) {
                            beats.insert(entry.key.clone(), beat);
                        }
                    }
                }
                _ = recheck.tick() => {}
            }
        }
    }

    /// Generates every validation prompt greedily (verl val_kwargs) and scores it.
    async fn validate(&mut self, step: u64) -> Result<BTreeMap<String, f64>, TrainerError> {
        let kw = &self.cfg.rollout.val_kwargs;
        let sampling = v1::SamplingParams {
            temperature: kw.temperature,
            top_p: kw.top_p,
            top_k: kw.top_k,
            max_new_tokens: self.cfg.max_new_tokens(),
            ..Default::default()
        };
        let n = kw.n.max(1);
        let chunk = self.cfg.data.val_batch_size.map(|b| b as usize).unwrap_or(self.val.len()).max(1);
        let val = self.val.clone();
        let mut per_source: BTreeMap<String, (f64, f64, f64)> = BTreeMap::new();
        let mut request_ids = Vec::new();
        for (i, examples) in val.chunks(chunk).enumerate() {
            let submitted = self.submit("val", step, examples, n, &sampling).await?;
            let request_id = format!("val-{step}-{i}");
            let response = self.sample(&request_id, step, "val", submitted as u32).await?;
            request_ids.push(request_id);
            for t in response.groups.iter().flat_map(|g| g.trajectories.iter()) {
                let entry = per_source.entry(t.data_source.clone()).or_default();
                entry.0 += t.score;
                entry.1 += t.extra.get("acc").copied().unwrap_or(t.score);
                entry.2 += 1.0;
            }
        }
        self.release(step, request_ids).await;
        let mut out = BTreeMap::new();
        for (source, (score, acc, count)) in per_source {
            let count = count.max(1.0);
            out.insert(format!("val-core/{source}/acc/mean@{n}"), acc / count);
            out.insert(format!("val-aux/{source}/reward/mean@{n}"), score / count);
        }
        Ok(out)
    }

    /// verl's rollout dump: one JSON line per trajectory (input, output, score, ground truth, step).
    fn dump_samples(&self, dir: &Path, step: u64, samples: &[Sample]) {
        let mut out = String::new();
        for s in samples {
            let line = serde_json::json!({
                "input": self.tokenizer.decode(&s.prompt, false).unwrap_or_default(),
                "output": self.tokenizer.decode(&s.response, false).unwrap_or_default(),
                "score": s.score,
                "gts": s.ground_truth,
                "step": step,
                "uid": s.uid,
                "key": s.key,
            });
            out.push_str(&line.to_string());
            out.push('\n');
        }
        let path = dir.join(format!("{step}.jsonl"));
        if let Err(err) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, out)) {
            tracing::warn!(error = %err, path = %path.display(), "rollout dump not written");
        }
    }

    fn write_summary(&self, wall_s: f64) {
        let curve = self.sink.curve();
        let mean = |pts: &[(u64, f64)]| {
            if pts.is_empty() {
                f64::NAN
            } else {
                pts.iter().map(|p| p.1).sum::<f64>() / pts.len() as f64
            }
        };
        let first = mean(&curve[..curve.len().min(5)]);
        let last = mean(&curve[curve.len().saturating_sub(5)..]);
        let summary = serde_json::json!({
            "steps": curve.len(),
            "first5_mean_reward": first,
            "last5_mean_reward": last,
            "train_wall_s": wall_s,
        });
        let path = Path::new(&self.cfg.run.dir).join("summary.json");
        if let Err(err) = std::fs::write(&path, serde_json::to_string_pretty(&summary).unwrap_or_default()) {
            tracing::warn!(error = %err, "summary not written");
        }
        tracing::info!(first5 = first, last5 = last, wall_s, "training finished");
    }
}

fn sample_from(traj: &Trajectory, reward: &v1::Reward) -> Result<Sample, String> {
    let response = packed::unpack_u32(&traj.response_ids).map_err(|e| e.to_string())?;
    let mut mask = traj.response_mask.to_vec();
    mask.resize(response.len(), 1);
    let mut logprobs = packed::unpack_f32(&traj.logprobs).map_err(|e| e.to_string())?;
    logprobs.resize(response.len(), 0.0);
    let prompt = packed::unpack_u32(&traj.prompt_ids).map_err(|e| e.to_string())?;
    if response.is_empty() || prompt.is_empty() {
        return Err("empty prompt or response".into());
    }
    Ok(Sample {
        key: traj.key.clone(),
        uid: traj.uid.clone(),
        prompt,
        response,
        response_mask: mask,
        rollout_logprobs: logprobs,
        score: reward.score,
        min_version: traj.min_version,
        max_version: traj.max_version,
        submit_step: traj.submit_step,
        data_source: traj.data_source.clone(),
        ground_truth: traj.ground_truth.clone(),
        truncated: traj.finish_reason == v1::FinishReason::Length as i32,
    })
}

/// verl's data metrics for a batch (critic/score, response_length, prompt_length, off-policy spans).
fn batch_metrics(samples: &[Sample], response: &SampleResponse, step: u64, out: &mut BTreeMap<String, f64>) {
    let stats = |values: Vec<f64>, name: &str, out: &mut BTreeMap<String, f64>| {
        if values.is_empty() {
            return;
        }
        let n = values.len() as f64;
        out.insert(format!("{name}/mean"), values.iter().sum::<f64>() / n);
        out.insert(format!("{name}/max"), values.iter().copied().fold(f64::MIN, f64::max));
        out.insert(format!("{name}/min"), values.iter().copied().fold(f64::MAX, f64::min));
    };
    stats(samples.iter().map(|s| s.score).collect(), "critic/score", out);
    stats(samples.iter().map(|s| s.score).collect(), "critic/rewards", out);
    stats(samples.iter().map(|s| s.response.len() as f64).collect(), "response_length", out);
    stats(samples.iter().map(|s| s.prompt.len() as f64).collect(), "prompt_length", out);
    if !samples.is_empty() {
        let clipped = samples.iter().filter(|s| s.truncated).count() as f64 / samples.len() as f64;
        out.insert("response_length/clip_ratio".into(), clipped);
    }
    stats(
        samples.iter().map(|s| (s.max_version - s.min_version + 1) as f64).collect(),
        "training/off_policy/trajectory_spans",
        out,
    );
    stats(
        samples.iter().map(|s| (step.saturating_sub(1)) as f64 - s.max_version as f64).collect(),
        "training/off_policy/trajectory_staleness",
        out,
    );
    let failed = response.groups.iter().filter(|g| g.state == GroupState::Failure as i32).count();
    out.insert("training/rollout_failure/groups".into(), failed as f64);
    out.insert("training/num_groups".into(), response.groups.len() as f64);
    out.insert("training/num_trajectories".into(), samples.len() as f64);
}

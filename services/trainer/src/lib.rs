//! jetrl-trainer: owns the policy weights, the optimizer, the step counter and the dataloader cursor.
//!
//! One step in `sync` mode (strictly on-policy, verl's `PPOTrainerSync`):
//!
//! 1. submit one batch of `data.train_batch_size` prompt groups: a `pending` record in the GROUPS bucket,
//!    then a task on the PROMPTS work queue, for each;
//! 2. ask the replay buffer for the whole batch (`jetrl.<ns>.buffer.sample`, retried with the same request id);
//! 3. fetch the trajectory payloads from the TRAJ stream by sequence;
//! 4. on the actor thread: old, reference and value passes, advantages, critic and actor updates ([`actor`]);
//! 5. every `trainer.save_freq` steps, a checkpoint ([`checkpoint`]);
//! 6. release the step's payloads, publish the new weights as version `step` and wait until every live
//!    rollout worker has loaded it;
//! 7. every `trainer.test_freq` steps, validation ([`validation`]);
//! 8. write the step's metrics (verl's names) to `metrics.jsonl`, NATS, Prometheus and TensorBoard.
//!
//! A trainer started where a checkpoint exists (`trainer.resume_mode: auto`, or a given path) loads it,
//! re-issues the prompt groups that were still pending or running, re-publishes the checkpoint's weights and
//! continues with the next step.
//!
//! - [`actor`]: the actor, reference and critic models, optimizers and the PPO math on a dedicated thread.
//! - [`batch`]: trajectories as padded tensors, micro-batches by token budget, mini-batches of groups.
//! - [`critic`]: the value model.
//! - [`optim`]: AdamW with saveable state (fp32 master weights for bf16) and verl's LR schedules.
//! - [`checkpoint`]: checkpoint directories (HF-compatible), resume resolution, retention.
//! - [`validation`]: verl's validation metrics (`mean@N`, bootstrap `best@k`/`worst@k`, `maj@k`).
//! - [`metrics_sink`]: metrics.jsonl, progress messages, TensorBoard, the reward-curve picture.
//! - [`tensorboard`]: event files without TensorFlow.

pub mod actor;
pub mod batch;
pub mod checkpoint;
pub mod critic;
pub mod metrics_sink;
pub mod optim;
pub mod tensorboard;
pub mod validation;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::weights::{manifest_for, WeightTransport};
use jetrl_bus::{Bus, BusError, GroupStore, Lease, Publisher};
use jetrl_config::JobConfig;
use jetrl_data::prompt::{PromptLimits, PromptTokenizer};
use jetrl_data::{ChatMessage, DataLoader, Example, Prompt};
use jetrl_model::Tokenizer;
use jetrl_telemetry::Shutdown;
use jetrl_wire::keys::new_uid;
use jetrl_wire::v1::{
    self, GroupState, GroupStatus, Heartbeat, PromptTask, ReleaseRequest, ReleaseResponse, SampleRequest,
    SampleResponse, Trajectory, WeightAnnounce, WeightAnnounceResponse,
};
use jetrl_wire::{packed, subjects, Message};

use crate::actor::{stats, ActorError, ActorHandle, Sample};
use crate::checkpoint::{CheckpointError, TrainerState};
use crate::metrics_sink::MetricsSink;
use crate::validation::ValSample;

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
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("re-issuing in-flight groups: {0}")]
    Reissue(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("run directory {path}: {message}")]
    RunDir { path: String, message: String },
    #[error("replay buffer: {0}")]
    Buffer(String),
    #[error("weight sync of version {version}: {message}")]
    WeightSync { version: u64, message: String },
    #[error("trainer.mode {0:?} is not implemented yet (only sync)")]
    Mode(String),
    #[error("shutdown requested")]
    Shutdown,
}

/// Keeps freed memory in the process heap instead of returning it to the kernel (glibc `mallopt`: no mmap for
/// allocations under 1 GiB, no trimming below 4 GiB of free heap). libtorch's CPU allocator does not cache, so
/// with glibc's defaults every large activation, gradient and temporary of a training step is a fresh `mmap`
/// whose pages fault in again at every step; on the CPU that costs a sizeable share of the step (the same
/// reason PyTorch users preload jemalloc or tcmalloc). Called once at start-up by the trainer binaries; a no-op
/// elsewhere than glibc.
pub fn keep_freed_memory_in_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before the trainer allocates tensors.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
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
    let bus = Bus::connect_job(&cfg, "jetrl-trainer").await?;
    bus.declare_topology().await?;
    // One trainer per job: a second one is refused here; a trainer that loses the lease stops.
    let lease = Lease::acquire(&bus, subjects::TRAINER_LEASE_KEY).await?;
    let stop = shutdown.clone();
    let shutdown = Shutdown::new(lease.or_lost(async move { stop.wait().await }));
    let stop = shutdown.clone();
    jetrl_telemetry::serve_metrics(&cfg.trainer.metrics_addr, async move { stop.wait().await }).await?;
    let mut trainer = Trainer::new(cfg, bus, shutdown).await?;
    let result = trainer.train().await;
    trainer.finish_releases().await;
    trainer.sink.write_curve();
    lease.release().await?;
    match result {
        Err(TrainerError::Shutdown) => {
            tracing::info!("trainer stopped by shutdown");
            Ok(())
        }
        other => other,
    }
}

/// The model's tokenizer as the dataset's prompt tokenizer (chat template from `tokenizer_config.json`).
struct ModelPrompts<'a>(&'a Tokenizer);

impl PromptTokenizer for ModelPrompts<'_> {
    fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        let messages: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        self.0.apply_chat_template(&messages, true).map_err(|e| format!("chat template: {e}"))
    }

    fn text_ids(&self, text: &str) -> Result<Vec<u32>, String> {
        self.0.encode(text, true).map_err(|e| e.to_string())
    }
}

struct Trainer {
    cfg: JobConfig,
    bus: Bus,
    groups: GroupStore,
    actor: ActorHandle,
    tokenizer: Tokenizer,
    limits: PromptLimits,
    loader: DataLoader,
    val: Vec<Example>,
    sink: MetricsSink,
    shutdown: Shutdown,
    total_steps: u64,
    /// the last step of the checkpoint this run resumed from (0: a fresh run)
    start_step: u64,
    resumed: bool,
    ckpt_root: PathBuf,
    transport: WeightTransport,
    /// releases sent in the background (nothing waits on one), awaited before the run ends
    releases: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Trainer {
    async fn new(cfg: JobConfig, bus: Bus, shutdown: Shutdown) -> Result<Self, TrainerError> {
        let (mut train, mut val) = jetrl_data::load_datasets(&cfg.data)?;
        let model_dir = PathBuf::from(&cfg.model.path);
        let tokenizer = Tokenizer::from_dir(&model_dir)
            .map_err(|e| TrainerError::Tokenizer(format!("{}: {e}", model_dir.display())))?;
        let limits = PromptLimits::from_config(&cfg.data)?;
        if cfg.data.filter_overlong_prompts {
            let prompts = ModelPrompts(&tokenizer);
            let (kept, dropped) = jetrl_data::prompt::filter_overlong(train, &prompts, limits.max_len)?;
            train = kept;
            let (kept, dropped_val) = jetrl_data::prompt::filter_overlong(val, &prompts, limits.max_len)?;
            val = kept;
            tracing::info!(dropped, dropped_val, max_prompt_length = limits.max_len, "overlong prompts filtered");
        }
        let batch = cfg.data.train_batch_size as u64;
        let steps_per_epoch = (train.len() as u64 / batch).max(1);
        let total_steps =
            cfg.trainer.total_training_steps.unwrap_or(steps_per_epoch * u64::from(cfg.trainer.total_epochs.max(1)));
        let mut loader = DataLoader::new(train, cfg.data.shuffle, cfg.data.seed)?;

        let ckpt_root = checkpoint::root_dir(&cfg);
        let resume = match checkpoint::resolve_resume(&cfg)? {
            Some(dir) => {
                let state: TrainerState = checkpoint::read_json(&dir.join(checkpoint::TRAINER_STATE_FILE))?;
                Some((dir, state))
            }
            None => None,
        };
        let start_step = resume.as_ref().map_or(0, |(_, s)| s.global_step);
        if let Some((dir, state)) = &resume {
            loader.restore(state.dataloader);
            tracing::info!(dir = %dir.display(), step = state.global_step, "resuming from checkpoint");
        }
        let actor_cfg = cfg.clone();
        let actor_resume = resume.as_ref().map(|(dir, state)| (dir.clone(), state.actor.clone()));
        let actor = tokio::task::spawn_blocking(move || ActorHandle::spawn(actor_cfg, total_steps, actor_resume))
            .await
            .map_err(|_| ActorError::Stopped)??;
        let pad_id = tokenizer.pad_token_id().or_else(|| tokenizer.eos_token_ids().first().copied()).unwrap_or(0);
        actor.call(move |a| a.set_pad_id(pad_id)).await?;
        let run_dir = PathBuf::from(&cfg.run.dir);
        let sink = MetricsSink::open(&bus, &run_dir, &cfg.trainer, resume.as_ref().map(|_| start_step))
            .map_err(|e| TrainerError::RunDir { path: run_dir.display().to_string(), message: e.to_string() })?;
        let transport = match cfg.checkpoint.transport.as_str() {
            "shared_fs" => {
                WeightTransport::SharedFs { dir: PathBuf::from(cfg.checkpoint.shared_dir.clone().unwrap_or_default()) }
            }
            _ => WeightTransport::ObjectStore { chunk_bytes: cfg.checkpoint.chunk_bytes as usize },
        };
        tracing::info!(
            total_steps,
            start_step,
            train_examples = loader.len(),
            val_examples = val.len(),
            batch,
            "trainer ready"
        );
        Ok(Self {
            groups: GroupStore::open(&bus).await?,
            cfg,
            bus,
            actor,
            tokenizer,
            limits,
            loader,
            val,
            sink,
            shutdown,
            total_steps,
            start_step,
            resumed: resume.is_some(),
            ckpt_root,
            transport,
            releases: Default::default(),
        })
    }

    async fn train(&mut self) -> Result<(), TrainerError> {
        let started = Instant::now();
        // Every worker starts from the trainer's weights, whatever it loaded from disk; after a resume the
        // workers may hold newer weights than the checkpoint, so they must report exactly its version.
        self.publish_weights(self.start_step, self.resumed).await?;
        if self.resumed {
            self.reissue_inflight().await?;
        }
        if (self.cfg.trainer.val_before_train || self.cfg.trainer.val_only) && !self.val.is_empty() {
            let t = Instant::now();
            let mut val = self.validate(self.start_step).await?;
            val.insert("timing_s/testing".into(), t.elapsed().as_secs_f64());
            val.insert("training/global_step".into(), self.start_step as f64);
            tracing::info!(?val, "validation before training");
            self.sink.record(self.start_step, &val).await;
            if self.cfg.trainer.val_only {
                return Ok(());
            }
        }
        for step in self.start_step + 1..=self.total_steps {
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
            self.sink.record(step, &metrics).await;
        }
        self.write_summary(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// verl's `_reissue_inflight_prompts`: prompt groups the previous incarnation left pending or running are
    /// re-created under fresh uids and published again, before any new work.
    async fn reissue_inflight(&self) -> Result<(), TrainerError> {
        let reissued = self
            .groups
            .reissue_inflight("train", self.start_step + 1)
            .await
            .map_err(|e| TrainerError::Reissue(e.to_string()))?;
        if reissued.is_empty() {
            return Ok(());
        }
        let mut publisher = Publisher::new(&self.bus, 512);
        for r in &reissued {
            let subject = self.bus.names().prompt_subject(&r.task.partition);
            publisher.publish(Outgoing::protobuf(subject, Some(r.task.uid.clone()), &r.task)).await?;
        }
        publisher.drain().await?;
        tracing::info!(groups = reissued.len(), "in-flight prompt groups re-issued");
        Ok(())
    }

    async fn step(&mut self, step: u64) -> Result<BTreeMap<String, f64>, TrainerError> {
        let step_started = Instant::now();
        let mut metrics = BTreeMap::new();
        let mut timings: BTreeMap<String, f64> = BTreeMap::new();
        let examples = self.loader.next_batch(self.cfg.data.train_batch_size as usize);
        let sampling = self.train_sampling();
        let submitted = self.submit("train", step, &examples, self.cfg.rollout.n, &sampling).await?;

        let t = Instant::now();
        let request_id = format!("train-{step}");
        let response = self.sample(&request_id, step, "train", submitted as u32).await?;
        timings.insert("gen".into(), t.elapsed().as_secs_f64());
        metrics.extend(response.metrics.clone());

        let t = Instant::now();
        let samples = self.fetch_samples(&response).await?;
        timings.insert("fetch".into(), t.elapsed().as_secs_f64());
        batch_metrics(&samples, &response, step, &self.cfg, &mut metrics);
        if let Some(dir) = &self.cfg.trainer.rollout_data_dir {
            self.dump_samples(Path::new(dir), step, &samples);
        }

        let train_samples = samples.clone();
        let out = self.actor.call(move |actor| actor.train(&train_samples, step)).await??;
        metrics.extend(out.metrics);
        timings.extend(out.timings);

        let save_freq = self.cfg.trainer.save_freq;
        if save_freq > 0 && (step % save_freq as u64 == 0 || step == self.total_steps) {
            let t = Instant::now();
            self.save_checkpoint(step).await?;
            timings.insert("save_checkpoint".into(), t.elapsed().as_secs_f64());
        }

        self.release(step, vec![request_id]);

        let t = Instant::now();
        self.publish_weights(step, false).await?;
        timings.insert("update_weights".into(), t.elapsed().as_secs_f64());

        let step_s = step_started.elapsed().as_secs_f64();
        timings.insert("step".into(), step_s);
        let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
        let response_tokens: usize = samples.iter().map(|s| s.response.len()).sum();
        for (phase, seconds) in &timings {
            metrics.insert(format!("timing_s/{phase}"), *seconds);
            // verl's per-token timings: generation per response token, the rest per token of the batch
            let per = if phase == "gen" { response_tokens } else { tokens };
            if phase != "step" && phase != "fetch" && per > 0 {
                metrics.insert(format!("timing_per_token_ms/{phase}"), seconds * 1000.0 / per as f64);
            }
        }
        metrics.insert("perf/total_num_tokens".into(), tokens as f64);
        metrics.insert("perf/time_per_step".into(), step_s);
        metrics.insert("perf/throughput".into(), tokens as f64 / step_s.max(1e-9));
        Ok(metrics)
    }

    /// Writes `global_step_<step>/` (models and optimizers on the actor thread, then the trainer state),
    /// commits it and prunes old checkpoints.
    async fn save_checkpoint(&self, step: u64) -> Result<(), TrainerError> {
        let staging = checkpoint::staging_dir(&self.ckpt_root, step);
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| CheckpointError::io(&staging, e))?;
        }
        std::fs::create_dir_all(&staging).map_err(|e| CheckpointError::io(&staging, e))?;
        let dir = staging.clone();
        let actor_state = self.actor.call(move |a| a.save_checkpoint(&dir)).await??;
        let state = TrainerState {
            global_step: step,
            total_training_steps: self.total_steps,
            dataloader: self.loader.state(),
            actor: actor_state,
            seeds: checkpoint::Seeds::of(&self.cfg),
        };
        checkpoint::write_json(&staging.join(checkpoint::TRAINER_STATE_FILE), &state)?;
        let dir = checkpoint::commit(&self.ckpt_root, step, checkpoint::keep_count(&self.cfg))?;
        tracing::info!(dir = %dir.display(), step, "checkpoint saved");
        Ok(())
    }

    /// The task of one prompt: its ids rendered and limited here (chat template, `data.truncation`), so the
    /// prompt a worker generates from is exactly the one the dataset settings describe; chat messages travel
    /// along for agent loops that need them.
    fn task_for(
        &self,
        example: &Example,
        partition: &str,
        step: u64,
        n: u32,
        sampling: &v1::SamplingParams,
    ) -> Result<PromptTask, TrainerError> {
        let ids = jetrl_data::prompt::tokenize_prompt(example, &ModelPrompts(&self.tokenizer), self.limits)?;
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
            prompt_ids: packed::pack_u32(&ids),
            ..Default::default()
        };
        if let Prompt::Messages(messages) = &example.prompt {
            task.messages =
                messages.iter().map(|m| v1::ChatMessage { role: m.role.clone(), content: m.content.clone() }).collect();
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
                .publish(Outgoing::protobuf(self.bus.names().prompt_subject(partition), Some(task.uid.clone()), task))
                .await?;
        }
        publisher.drain().await?;
        Ok(tasks.len())
    }

    /// Asks the buffer for `batch_size` groups, re-asking with the same request id until it answers.
    /// Sampling parameters of training rollouts (verl `rollout.*`).
    fn train_sampling(&self) -> v1::SamplingParams {
        v1::SamplingParams {
            temperature: self.cfg.rollout.temperature,
            top_p: self.cfg.rollout.top_p,
            top_k: self.cfg.rollout.top_k,
            repetition_penalty: self.cfg.rollout.repetition_penalty,
            max_new_tokens: self.cfg.max_new_tokens(),
            ..Default::default()
        }
    }

    /// Asks the buffer for `batch_size` groups, re-asking with the same request id until it answers. When
    /// the buffer evicted groups (DAPO filter, failures, staleness) it asks for refills: the trainer submits
    /// that many new prompts at this step (verl's `refill_fn`) and reports them in `refilled`, so a lost
    /// reply can neither lose nor double a refill.
    async fn sample(
        &mut self,
        request_id: &str,
        step: u64,
        partition: &str,
        batch_size: u32,
    ) -> Result<SampleResponse, TrainerError> {
        let wait = Duration::from_secs_f64(self.cfg.trainer.sample_wait_s.max(0.1));
        let mut request = SampleRequest {
            request_id: request_id.to_string(),
            step,
            partition: partition.to_string(),
            batch_size,
            wait_ms: wait.as_millis() as u32,
            ..Default::default()
        };
        let mut failures = 0u32;
        loop {
            if self.shutdown.is_triggered() {
                return Err(TrainerError::Shutdown);
            }
            let reply = tokio::select! {
                _ = self.shutdown.wait() => return Err(TrainerError::Shutdown),
                r = self.bus.request::<_, SampleResponse>(self.bus.names().buffer_sample(), &request, wait + Duration::from_secs(5)) => r,
            };
            match reply {
                Ok(resp) if !resp.error.is_empty() => return Err(TrainerError::Buffer(resp.error)),
                Ok(resp) if resp.refill > 0 => {
                    let examples = self.loader.next_batch(resp.refill as usize);
                    let sampling = self.train_sampling();
                    let n = self.cfg.rollout.n;
                    let submitted = self.submit(partition, step, &examples, n, &sampling).await?;
                    request.refilled += submitted as u32;
                    metrics::counter!("jetrl_trainer_refilled_prompts_total").increment(submitted as u64);
                    tracing::info!(step, refill = resp.refill, "buffer evicted groups; submitted refills");
                }
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

    /// Fetches every sampled trajectory's payload from the TRAJ stream (one batched direct get per group).
    async fn fetch_samples(&self, response: &SampleResponse) -> Result<Vec<Sample>, TrainerError> {
        let rewards: Vec<&v1::Reward> = response.groups.iter().flat_map(|g| g.trajectories.iter()).collect();
        let wanted: Vec<(String, u64)> =
            rewards.iter().map(|r| (self.bus.names().traj_subject(&r.partition, &r.uid), r.traj_seq)).collect();
        let mut payloads = self.bus.fetch_by_sequence(self.bus.names().traj_stream(), &wanted).await?;
        let fetched: Vec<(usize, Result<Trajectory, String>)> = rewards
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let result = match payloads.remove(&r.traj_seq) {
                    Some(payload) => Trajectory::decode(payload.as_ref()).map_err(|e| e.to_string()),
                    None => Err("not in the TRAJ stream".to_string()),
                };
                (i, result)
            })
            .collect();
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

    /// Tells the buffer the step's payloads may go, in the background: the groups are already consumed (their
    /// records say sampled), so nothing the trainer does next depends on it. A failed release only leaves
    /// payloads behind until the streams' max age.
    fn release(&self, step: u64, request_ids: Vec<String>) {
        let bus = self.bus.clone();
        let task = tokio::spawn(async move {
            let request = ReleaseRequest { step, request_ids };
            match bus
                .request::<_, ReleaseResponse>(bus.names().buffer_release(), &request, Duration::from_secs(30))
                .await
            {
                Ok(resp) if resp.error.is_empty() => {}
                Ok(resp) => tracing::warn!(error = %resp.error, "release failed"),
                Err(err) => tracing::warn!(error = %err, "release not acknowledged"),
            }
        });
        let mut releases = self.releases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        releases.retain(|t| !t.is_finished());
        releases.push(task);
    }

    /// Waits for the releases still in flight.
    async fn finish_releases(&self) {
        let pending: Vec<_> =
            std::mem::take(&mut *self.releases.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for task in pending {
            let _ = task.await;
        }
    }

    /// Ships the current weights as version `version` and waits for every live rollout worker to load them
    /// (`exact`: to report exactly that version, not a later one).
    async fn publish_weights(&self, version: u64, exact: bool) -> Result<(), TrainerError> {
        let blob = self.actor.call(|actor| actor.weights_blob()).await??;
        let blob = bytes::Bytes::from(blob);
        let location = self.bus.store_weights(&self.transport, version, blob.clone()).await?;
        let manifest = manifest_for(&blob, version, version, &location)?;
        let announce = WeightAnnounce { manifest: Some(manifest), checkpoint: false };
        let mut attempt = 0;
        loop {
            match self
                .bus
                .request::<_, WeightAnnounceResponse>(
                    self.bus.names().weights_announce(),
                    &announce,
                    Duration::from_secs(60),
                )
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
        self.wait_for_workers(version, exact).await
    }

    /// Waits until at least one rollout worker is alive and every live one reports `version` (or a later one,
    /// unless `exact`).
    async fn wait_for_workers(&self, version: u64, exact: bool) -> Result<(), TrainerError> {
        let timeout = Duration::from_secs_f64(self.cfg.trainer.weight_sync_timeout_s.max(1.0));
        let kv = self.bus.key_value(self.bus.names().workers_bucket()).await?;
        let mut watch = kv.watch_with_history("rollout.>").await.map_err(|e| BusError::Kv {
            bucket: kv.name.clone(),
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
            let loaded = |b: &&Heartbeat| if exact { b.policy_version == version } else { b.policy_version >= version };
            if !live.is_empty() && live.iter().all(loaded) {
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

    /// verl's `_validate`: every validation prompt generated with `val_kwargs` (greedy by default), `n` times,
    /// scored; metrics per data source ([`validation::validation_metrics`]); the generations dumped to
    /// `validation_data_dir/<step>.jsonl` and `log_val_generations` of them logged.
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
        let mut request_ids = Vec::new();
        let mut responses = Vec::new();
        for (i, examples) in val.chunks(chunk).enumerate() {
            let submitted = self.submit("val", step, examples, n, &sampling).await?;
            let request_id = format!("val-{step}-{i}");
            responses.push(self.sample(&request_id, step, "val", submitted as u32).await?);
            request_ids.push(request_id);
        }
        // one score per session: its final output (the largest output index), as verl
        let mut finals: BTreeMap<(String, u32), &v1::Reward> = BTreeMap::new();
        for t in responses.iter().flat_map(|r| r.groups.iter()).flat_map(|g| g.trajectories.iter()) {
            let slot = finals.entry((t.uid.clone(), t.session_id)).or_insert(t);
            if t.index > slot.index {
                *slot = t;
            }
        }
        let samples: Vec<ValSample> = finals
            .values()
            .map(|r| ValSample {
                uid: r.uid.clone(),
                data_source: r.data_source.clone(),
                score: r.score,
                extra: r.extra.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                pred: r.extra_text.get("pred").cloned(),
            })
            .collect();
        let out = validation::validation_metrics(&samples);
        let dump_dir = self.cfg.trainer.validation_data_dir.clone();
        let log_n = self.cfg.trainer.log_val_generations as usize;
        if dump_dir.is_some() || log_n > 0 {
            let finals_only = SampleResponse {
                groups: vec![v1::SampledGroup {
                    trajectories: finals.values().map(|r| (*r).clone()).collect(),
                    ..Default::default()
                }],
                ..Default::default()
            };
            let generations = self.fetch_samples(&finals_only).await?;
            let rows = self.generation_rows(step, &generations, &finals_only.groups[0].trajectories);
            if let Some(dir) = dump_dir {
                write_jsonl(&Path::new(&dir).join(format!("{step}.jsonl")), &rows);
            }
            log_generations(&rows, log_n, step);
        }
        self.release(step, request_ids);
        Ok(out)
    }

    /// verl's `_dump_generations` rows: input, output, gts, score, step and the reward extras.
    fn generation_rows(&self, step: u64, samples: &[Sample], rewards: &[v1::Reward]) -> Vec<serde_json::Value> {
        let by_key: HashMap<&str, &v1::Reward> = rewards.iter().map(|r| (r.key.as_str(), r)).collect();
        samples
            .iter()
            .map(|s| {
                let mut row = serde_json::json!({
                    "input": self.tokenizer.decode(&s.prompt, false).unwrap_or_default(),
                    "output": self.tokenizer.decode(&s.response, true).unwrap_or_default(),
                    "gts": s.ground_truth,
                    "score": s.score,
                    "step": step,
                    "uid": s.uid,
                    "data_source": s.data_source,
                });
                if let (Some(obj), Some(r)) = (row.as_object_mut(), by_key.get(s.key.as_str())) {
                    for (k, v) in &r.extra {
                        obj.insert(k.clone(), serde_json::json!(v));
                    }
                    for (k, v) in &r.extra_text {
                        obj.insert(k.clone(), serde_json::json!(v));
                    }
                }
                row
            })
            .collect()
    }

    /// verl's rollout dump: one JSON line per trajectory (input, output, score, ground truth, step).
    fn dump_samples(&self, dir: &Path, step: u64, samples: &[Sample]) {
        let rows: Vec<serde_json::Value> = samples
            .iter()
            .map(|s| {
                serde_json::json!({
                    "input": self.tokenizer.decode(&s.prompt, false).unwrap_or_default(),
                    "output": self.tokenizer.decode(&s.response, false).unwrap_or_default(),
                    "score": s.score,
                    "gts": s.ground_truth,
                    "step": step,
                    "uid": s.uid,
                    "key": s.key,
                })
            })
            .collect();
        write_jsonl(&dir.join(format!("{step}.jsonl")), &rows);
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

/// Writes one JSON object per line; a failure is logged, not fatal (dumps are diagnostics).
fn write_jsonl(path: &Path, rows: &[serde_json::Value]) {
    let mut out = String::new();
    for row in rows {
        out.push_str(&row.to_string());
        out.push('\n');
    }
    let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::write(path, out));
    if let Err(err) = written {
        tracing::warn!(error = %err, path = %path.display(), "dump not written");
    }
}

/// verl's `_maybe_log_val_generations` for the console: `n` generations (sorted by input, then shuffled with
/// seed 42) written to the log.
fn log_generations(rows: &[serde_json::Value], n: usize, step: u64) {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    if n == 0 {
        return;
    }
    let mut rows: Vec<&serde_json::Value> = rows.iter().collect();
    rows.sort_by(|a, b| a["input"].as_str().cmp(&b["input"].as_str()));
    rows.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(42));
    for row in rows.into_iter().take(n) {
        tracing::info!(
            step,
            input = row["input"].as_str().unwrap_or_default(),
            output = row["output"].as_str().unwrap_or_default(),
            score = row["score"].as_f64().unwrap_or(f64::NAN),
            "validation generation"
        );
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
        extra: reward.extra.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        min_version: traj.min_version,
        max_version: traj.max_version,
        submit_step: traj.submit_step,
        data_source: traj.data_source.clone(),
        ground_truth: traj.ground_truth.clone(),
        truncated: traj.finish_reason == v1::FinishReason::Length as i32,
        num_turns: traj.num_turns,
    })
}

/// verl's data metrics of a batch that do not need the actor: response and prompt lengths (with their clip
/// ratios), off-policy spans and staleness, turns, failures.
fn batch_metrics(
    samples: &[Sample],
    response: &SampleResponse,
    step: u64,
    cfg: &JobConfig,
    out: &mut BTreeMap<String, f64>,
) {
    stats(&samples.iter().map(|s| s.response.len() as f64).collect::<Vec<_>>(), "response_length", out);
    stats(&samples.iter().map(|s| s.prompt.len() as f64).collect::<Vec<_>>(), "prompt_length", out);
    if !samples.is_empty() {
        let n = samples.len() as f64;
        let clipped = samples.iter().filter(|s| s.truncated).count() as f64 / n;
        out.insert("response_length/clip_ratio".into(), clipped);
        let max_prompt = cfg.data.max_prompt_length as usize;
        let prompt_clipped = samples.iter().filter(|s| s.prompt.len() >= max_prompt).count() as f64 / n;
        out.insert("prompt_length/clip_ratio".into(), prompt_clipped);
        if samples.iter().any(|s| s.num_turns > 0) {
            stats(&samples.iter().map(|s| f64::from(s.num_turns)).collect::<Vec<_>>(), "training/num_turns", out);
        }
    }
    stats(
        &samples.iter().map(|s| (s.max_version - s.min_version + 1) as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_spans",
        out,
    );
    stats(
        &samples.iter().map(|s| step.saturating_sub(1) as f64 - s.max_version as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_staleness",
        out,
    );
    stats(
        &samples.iter().map(|s| step.saturating_sub(1) as f64 - s.min_version as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_staleness_worst",
        out,
    );
    let failed = response.groups.iter().filter(|g| g.state == GroupState::Failure as i32).count();
    out.insert("training/rollout_failure/groups".into(), failed as f64);
    out.insert("training/num_groups".into(), response.groups.len() as f64);
    out.insert("training/num_trajectories".into(), samples.len() as f64);
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use jetrl_config::JobConfig;

    /// A verl user's `trainer.*` and `data.*` keys load as they are; wrong values name their key.
    #[test]
    fn verl_trainer_and_data_keys_load_and_bad_values_name_the_key() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            file,
            "data:\n  train_files: [a.parquet]\n  val_files: [b.jsonl]\n  truncation: middle\n  filter_overlong_prompts: true\n  \
             val_batch_size: 8\n  train_max_samples: 100\n\
             trainer:\n  save_freq: 10\n  test_freq: 5\n  max_actor_ckpt_to_keep: 2\n  resume_mode: auto\n  \
             default_local_dir: /tmp/ck\n  log_val_generations: 4\n  validation_data_dir: /tmp/val\n  \
             logger: [console, tensorboard, wandb]\n  critic_warmup: 3\n  val_only: false"
        )
        .unwrap();
        let cfg = JobConfig::load(Some(file.path()), &[]).unwrap();
        assert_eq!(cfg.trainer.max_actor_ckpt_to_keep, Some(2));
        assert_eq!(cfg.data.truncation, "middle");
        assert_eq!(cfg.trainer.logger, vec!["console", "tensorboard", "wandb"]);
        let bad = |o: &str| JobConfig::load(Some(file.path()), &[o.to_string()]).unwrap_err().to_string();
        assert!(bad("data.truncation=both").contains("data.truncation"));
        assert!(bad("trainer.resume_mode=resume_path").contains("trainer.resume_from_path"));
        assert!(bad("trainer.logger=[\"neptune\"]").contains("trainer.logger"));
        let path = JobConfig::load(
            Some(file.path()),
            &["trainer.resume_mode=resume_path".into(), "trainer.resume_from_path=/ck/global_step_10".into()],
        );
        assert!(path.is_ok(), "{path:?}");
    }
}

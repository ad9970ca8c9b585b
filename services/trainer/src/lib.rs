//! jetrl-trainer: owns the policy weights, the optimizer, the step counter and the dataloader cursor.
//!
//! One run: publish the starting weights and wait for the rollout workers to load them; bring the groups a
//! previous incarnation left to this run's timeline (after a resume, or a restart from step 0); validate first if
//! asked; submit the warm-up batches of the async modes; then one global step after another in the configured
//! schedule ([`schedule`]: `sync`, `colocate_async`, `separate_async`), validation every `trainer.test_freq`
//! steps, the step's metrics to `metrics.jsonl`, NATS, Prometheus and TensorBoard.
//!
//! A trainer started where a checkpoint exists (`trainer.resume_mode: auto`, or a given path) loads it and
//! continues with the next step.
//!
//! - [`schedule`]: the three schedules of a global step, over shared phases.
//! - [`planes`]: what a schedule asks of the data plane and the weight plane, as traits.
//! - [`rollout_client`]: prompt tasks out, sample requests to the replay buffer, payloads in, releases.
//! - [`weight_sync`]: weight versions to the workers, every wait with a deadline; the colocate handshake.
//! - [`fleet`]: the rollout workers' heartbeats (liveness, loaded versions, idle time).
//! - [`step_metrics`]: verl's batch metrics, timings, idle ratios, the local-update aggregator.
//! - [`actor`]: the actor, reference and critic models, optimizers and the PPO math on a dedicated thread.
//! - [`ranks`]: the trainer as a group of ranks; [`command`]: what rank 0 tells the others.
//! - [`batch`]: trajectories as padded tensors (checked at the boundary), micro-batches, mini-batches of groups.
//! - [`critic`]: the value model. [`optim`]: AdamW with saveable state and verl's LR schedules.
//! - [`paced`]: the paced stand-in learner of `trainer.simulate` (a simulation knob: no model, modelled time).
//! - [`checkpoint`]: checkpoint directories (HF-compatible), resume resolution, retention.
//! - [`validation`]: verl's `_validate` and its metrics. [`dump`]: generation dumps. [`numpy_rng`]: numpy's legacy RNG.
//! - [`metrics_sink`]: metrics.jsonl, progress messages, TensorBoard, the reward-curve picture.
//! - [`trackers`]: verl's `file` logger and the experiment trackers (MLflow, wandb) behind bounded queues.
//! - [`tensorboard`]: event files without TensorFlow. [`error`]: the error types.

pub mod actor;
pub mod batch;
pub mod checkpoint;
pub mod command;
pub mod critic;
pub mod dist;
pub mod dump;
pub mod error;
pub mod fleet;
pub mod learner;
pub mod metrics_sink;
pub mod numpy_rng;
pub mod optim;
pub mod paced;
pub mod planes;
pub mod ranks;
pub mod rollout_client;
pub mod schedule;
pub mod step_metrics;
pub mod synthetic;
pub mod tensorboard;
pub mod trackers;
pub mod validation;
pub mod weight_sync;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jetrl_bus::service::{self, Topology};
use jetrl_bus::{Bus, Lease};
use jetrl_config::{JobConfig, TrainerMode};
use jetrl_data::prompt::PromptLimits;
use jetrl_data::{DataLoader, Example};
use jetrl_model::{ModelConfig, Tokenizer};
use jetrl_telemetry::Shutdown;
use jetrl_wire::subjects;

use crate::actor::ActorHandle;
use crate::batch::SampleLimits;
use crate::checkpoint::TrainerState;
use crate::fleet::Fleet;
use crate::learner::{Learner, Ranks};
use crate::metrics_sink::MetricsSink;
use crate::ranks::RankPlan;
use crate::rollout_client::{ModelPrompts, RolloutClient};
use crate::weight_sync::WeightSync;

pub use crate::error::{ActorError, TrainerError};

/// Keeps freed memory in the process heap instead of returning it to the kernel (glibc `mallopt`: no mmap for
/// allocations under 1 GiB, no trimming below 4 GiB of free heap). libtorch's CPU allocator does not cache, so
/// with glibc's defaults every large activation, gradient and temporary of a training step is a fresh `mmap`
/// whose pages fault in again at every step; on the CPU that costs a sizeable share of the step (the same
/// reason PyTorch users preload jemalloc or tcmalloc). Called once at start-up by the trainer binaries; a no-op
/// elsewhere than glibc.
pub fn keep_freed_memory_in_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before the trainer allocates tensors.
    #[allow(unsafe_code)]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Runs the trainer until training completes or `shutdown` resolves: rank 0 (the trainer of one rank) leads the
/// job; ranks 1..N ([`ranks::run_follower`]) follow it.
pub async fn run(
    mut cfg: JobConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), TrainerError> {
    ranks::place_on_device(&mut cfg);
    if !RankPlan::of(&cfg).is_leader() {
        let shutdown = Shutdown::new(shutdown);
        jetrl_telemetry::serve_metrics(&cfg.trainer.metrics_addr, shutdown.waiter()).await?;
        return match ranks::run_follower(cfg, shutdown).await {
            Err(TrainerError::Shutdown) => {
                tracing::info!("trainer rank stopped by shutdown");
                Ok(())
            }
            other => other,
        };
    }
    let bus = service::connect(&cfg, "jetrl-trainer", Topology::Declare).await?;
    // One trainer per job: a second one is refused here; a trainer that loses the lease stops.
    let lease = Lease::acquire(&bus, subjects::TRAINER_LEASE_KEY).await?;
    let shutdown = Shutdown::new(lease.or_lost(shutdown));
    let plan = RankPlan::of(&cfg);
    let instance = (plan.world > 1).then(|| format!("rank-{}", plan.rank));
    let heartbeat =
        jetrl_bus::heartbeat::start(&bus, &cfg, jetrl_bus::heartbeat::TRAINER, instance.as_deref(), shutdown.clone());
    let result = train(cfg, bus.clone(), shutdown.clone(), heartbeat.step_metrics()).await;
    heartbeat.stop().await;
    // released whatever happened, so a restarted trainer need not wait for the lease to expire; with the broker
    // gone it expires by its max age (a stopped trainer has just waited for the broker in `train`)
    let patience = if shutdown.is_triggered() { Duration::ZERO } else { bus.topology_wait() };
    let released = tokio::select! {
        released = lease.release() => released,
        () = bus.unreachable_for(patience) => {
            tracing::warn!("NATS unreachable: the trainer lease is not released; it expires by its max age");
            Ok(())
        }
    };
    match result.and(released.map_err(TrainerError::from)) {
        Err(TrainerError::Shutdown) => {
            tracing::info!("trainer stopped by shutdown");
            Ok(())
        }
        other => other,
    }
}

/// Builds the trainer and trains; the run directory's curve is written however training ended.
async fn train(
    cfg: JobConfig,
    bus: Bus,
    shutdown: Shutdown,
    heartbeat: jetrl_bus::heartbeat::StepMetrics,
) -> Result<(), TrainerError> {
    // served once this trainer holds the lease (a second one, refused, binds nothing)
    jetrl_telemetry::serve_metrics(&cfg.trainer.metrics_addr, shutdown.waiter()).await?;
    let mut trainer = Trainer::new(cfg, bus.clone(), shutdown.clone()).await?;
    trainer.sink.report_to(heartbeat);
    let result = trainer.train().await;
    // the other ranks leave however training ended (a failed group leaves them anyway: their store goes with us)
    if let Err(err) = trainer.learner.finish().await {
        tracing::warn!(error = %err, "the other trainer ranks were not told to stop");
    }
    let end = match &result {
        Ok(()) => trackers::RunEnd::Finished,
        Err(TrainerError::Shutdown) => trackers::RunEnd::Stopped,
        Err(_) => trackers::RunEnd::Failed,
    };
    trainer.sink.finish(end).await;
    // With the broker gone for longer than a stop waits ([`jetrl_bus::SETTLE_RECONNECT`]) or a finished run
    // waits (`nats.connect_timeout_s`: its ledger is worth a cluster failover), the broker work is left.
    let patience = if shutdown.is_triggered() { jetrl_bus::SETTLE_RECONNECT } else { bus.topology_wait() };
    let settled = tokio::select! {
        () = async {
            trainer.client.finish_releases().await;
            trainer.write_ledger().await;
        } => true,
        () = bus.unreachable_for(patience) => false,
    };
    if !settled {
        trainer.client.abandon_releases();
        tracing::warn!(
            "NATS unreachable: ledger.jsonl not written and the last releases not sent (`jetrl status --ledger \
             --json` prints the ledger once the broker is back; the buffer's next trainer settles the groups)"
        );
    }
    result
}

/// What every schedule shares.
pub(crate) struct Trainer {
    cfg: JobConfig,
    /// the ranks, or the paced stand-in with `trainer.simulate`
    learner: Box<dyn Learner>,
    client: RolloutClient,
    weights: WeightSync,
    val: Vec<Example>,
    sink: MetricsSink,
    shutdown: Shutdown,
    total_steps: u64,
    /// the last step of the checkpoint this run resumed from (0: a fresh run)
    start_step: u64,
    ckpt_root: PathBuf,
    /// names this trainer process in its sample request ids (`train-<incarnation>-<step>`): a request id is
    /// idempotent at the buffer, so a restarted trainer redoing a step must not reuse the dead one's ids
    incarnation: String,
}

impl Trainer {
    async fn new(cfg: JobConfig, bus: Bus, shutdown: Shutdown) -> Result<Self, TrainerError> {
        let (mut train, mut val) = jetrl_data::load_datasets(&cfg.data)?;
        let model_dir = PathBuf::from(&cfg.model.path);
        let tokenizer = Tokenizer::from_dir(&model_dir)
            .map_err(|source| TrainerError::Tokenizer { path: model_dir.clone(), source })?;
        let model_config = ModelConfig::from_file(&model_dir.join("config.json"))
            .map_err(|source| TrainerError::ModelConfig { path: model_dir.join("config.json"), source })?;
        let limits = PromptLimits::from_config(&cfg.data);
        if cfg.data.filter_overlong_prompts {
            let prompts = ModelPrompts(&tokenizer);
            let (kept, dropped) = jetrl_data::prompt::filter_overlong(train, &prompts, limits.max_len)?;
            train = kept;
            let (kept, dropped_val) = jetrl_data::prompt::filter_overlong(val, &prompts, limits.max_len)?;
            val = kept;
            tracing::info!(dropped, dropped_val, max_prompt_length = limits.max_len, "overlong prompts filtered");
        }
        let batch = u64::from(cfg.data.train_batch_size);
        let steps_per_epoch = (train.len() as u64 / batch).max(1);
        let total_steps =
            cfg.trainer.total_training_steps.unwrap_or(steps_per_epoch * u64::from(cfg.trainer.total_epochs.max(1)));
        // verl: the LR horizon counts update calls, `parameter_sync_step` per global step in separate_async
        let updates_per_step = match cfg.trainer.mode {
            TrainerMode::SeparateAsync => u64::from(cfg.trainer.separate_async.parameter_sync_step.max(1)),
            TrainerMode::Sync | TrainerMode::ColocateAsync => 1,
        };
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
        let horizon = total_steps * updates_per_step;
        let pad_id = tokenizer.pad_token_id().or_else(|| tokenizer.eos_token_ids().first().copied()).unwrap_or(0);
        let plan = RankPlan::of(&cfg);
        let world = plan.world;
        let learner: Box<dyn Learner> = match cfg.trainer.simulate.clone() {
            // a simulation: no model is loaded, the paced stand-in takes a device's time
            Some(sim) => {
                tracing::warn!(?sim, "trainer.simulate: the learner is a paced stand-in; nothing is trained");
                Box::new(paced::PacedLearner::new(sim))
            }
            None => {
                // joining the group waits for every rank (up to trainer.dist.timeout_s): off the reactor
                let actor = tokio::task::spawn_blocking(move || {
                    let comm = ranks::join(&actor_cfg, &plan).map_err(ActorError::from)?;
                    ActorHandle::spawn(actor_cfg, horizon, actor_resume, comm, pad_id)
                })
                .await
                .map_err(|_| ActorError::Stopped)??;
                Box::new(Ranks::new(actor, world))
            }
        };
        let run_dir = PathBuf::from(&cfg.run.dir);
        let mut sink = MetricsSink::open(&bus, &run_dir, &cfg, resume.as_ref().map(|_| start_step))
            .map_err(|source| TrainerError::RunDir { path: run_dir.clone(), source })?;
        // The previous incarnation committed this checkpoint and died before writing the step's metrics line.
        if let Some((dir, _)) = &resume {
            let saved = dir.join(checkpoint::STEP_METRICS_FILE);
            if sink.last_step() < Some(start_step) && saved.exists() {
                let metrics: std::collections::BTreeMap<String, f64> = checkpoint::read_json(&saved)?;
                sink.record(start_step, &metrics, Vec::new()).await;
                tracing::info!(step = start_step, "metrics line of the checkpoint's step written from the checkpoint");
            }
        }
        let fleet = Fleet::watch(&bus, Duration::from_secs_f64(cfg.rollout.heartbeat_timeout_s)).await?;
        let sample_limits = SampleLimits {
            vocab_size: model_config.vocab_size.max(0) as u64,
            max_len: model_config.max_position_embeddings.max(1) as usize,
        };
        let client =
            RolloutClient::new(&cfg, bus.clone(), tokenizer, limits, sample_limits, loader, shutdown.clone()).await?;
        let weights = WeightSync::new(&cfg, bus, fleet, shutdown.clone());
        tracing::info!(
            mode = %cfg.trainer.mode,
            total_steps,
            start_step,
            train_examples = client.loader_len(),
            val_examples = val.len(),
            batch,
            "trainer ready"
        );
        let incarnation = format!("{:x}", client.incarnation());
        Ok(Self { cfg, learner, client, weights, val, sink, shutdown, total_steps, start_step, ckpt_root, incarnation })
    }

    /// What the schedules drive, borrowed from this trainer for one call.
    fn schedule(&mut self) -> schedule::Schedule<'_> {
        schedule::Schedule {
            cfg: &self.cfg,
            learner: self.learner.as_ref(),
            client: &mut self.client,
            weights: &self.weights,
            incarnation: &self.incarnation,
            ckpt_root: &self.ckpt_root,
            total_steps: self.total_steps,
            start_step: self.start_step,
        }
    }

    async fn train(&mut self) -> Result<(), TrainerError> {
        let started = Instant::now();
        // Every worker starts from the trainer's weights, whatever it loaded from disk; after a restart (from a
        // checkpoint, or from step 0 when a trainer died before its first one) the workers may hold newer weights
        // than the trainer's, so they must report exactly its version.
        let blob = self.learner.weights_blob().await?;
        self.weights.publish(self.start_step, blob).await?;
        self.weights.wait_for_workers(self.start_step, true).await?;
        // the group records of an earlier trainer of this job, if any, are brought to this timeline: without a
        // checkpoint its trained rows are rolled back and trained again from step 1, never counted twice
        self.client.resume(self.start_step).await?;
        if self.cfg.trainer.val_before_train || self.cfg.trainer.val_only {
            if self.val.is_empty() {
                tracing::warn!("trainer.val_before_train / val_only: the validation set is empty; nothing to validate");
            } else {
                let t = Instant::now();
                let validation =
                    validation::validate(&mut self.client, &self.cfg, &self.val, self.start_step, &self.incarnation)
                        .await?;
                let mut val = validation.metrics;
                val.insert("timing_s/testing".into(), t.elapsed().as_secs_f64());
                val.insert("training/global_step".into(), self.start_step as f64);
                tracing::info!(?val, "validation before training");
                self.sink.record(self.start_step, &val, validation.generations).await;
            }
            if self.cfg.trainer.val_only {
                return Ok(());
            }
        }
        schedule::warm_up(&mut self.schedule()).await?;
        for step in self.start_step + 1..=self.total_steps {
            if self.shutdown.is_triggered() {
                return Err(TrainerError::Shutdown);
            }
            let mut metrics = schedule::step(&mut self.schedule(), step).await?;
            let test_freq = self.cfg.trainer.test_freq;
            let mut generations = Vec::new();
            if test_freq > 0 && (step % test_freq as u64 == 0 || step == self.total_steps) && !self.val.is_empty() {
                let t = Instant::now();
                let validation =
                    validation::validate(&mut self.client, &self.cfg, &self.val, step, &self.incarnation).await?;
                metrics.extend(validation.metrics);
                generations = validation.generations;
                metrics.insert("timing_s/testing".into(), t.elapsed().as_secs_f64());
            }
            metrics.insert("training/global_step".into(), step as f64);
            metrics.insert("training/epoch".into(), self.client.loader_state().epoch as f64);
            metrics.insert("training/total_steps".into(), self.total_steps as f64);
            metrics.insert("timing_s/elapsed".into(), started.elapsed().as_secs_f64());
            self.sink.record(step, &metrics, generations).await;
        }
        self.write_summary(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// `<run.dir>/ledger.jsonl`: one JSON object per dataset row drawn (its fate), however the run ended. A row
    /// decided by more than one group (trained twice) is logged as an error and counted in the summary line.
    async fn write_ledger(&self) {
        let records = match self.client.train_records().await {
            Ok(records) => records,
            Err(err) => {
                tracing::warn!(error = %err, "ledger not written: the group records could not be read");
                return;
            }
        };
        let (rows, duplicates) = jetrl_bus::ledger::ledger(&records);
        let mut out = String::new();
        for row in &rows {
            out.push_str(&serde_json::to_string(row).unwrap_or_default());
            out.push('\n');
        }
        let path = Path::new(&self.cfg.run.dir).join("ledger.jsonl");
        if let Err(err) = std::fs::write(&path, out) {
            tracing::warn!(error = %err, path = %path.display(), "ledger not written");
        }
        for dup in &duplicates {
            tracing::error!(?dup, "a dataset row was decided by more than one group");
        }
        tracing::info!(rows = rows.len(), duplicates = duplicates.len(), path = %path.display(), "ledger written");
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
            "mode": self.cfg.trainer.mode.as_str(),
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

//! The three schedules of one global step (verl V1's trainers), over the shared phases below:
//!
//! - [`sync`]: submit a batch, wait for all of it, train, publish the weights and wait for the workers to load
//!   them. Strictly on-policy.
//! - [`colocate_async`]: batches in flight ahead of the trainer; the co-located worker pauses while the trainer
//!   updates, loads the new weights from a local file and resumes its sequences from their prefixes.
//! - [`separate_async`]: rollout never stops; `parameter_sync_step` decoupled-PPO local updates per global step,
//!   weights published once per step.
//!
//! Who waits for whom, per step:
//!
//! ```text
//! sync            trainer |submit|--- wait for the batch ---|train|publish+wait|
//!                 rollout |-------- generate batch t --------|.....idle.....|load|
//! colocate_async  trainer |submit|-- wait for B groups --|pause|train|resume|
//!                 rollout |== generate t, t+1 (warm-up) ==|parked.......|load|== continue ==>
//! separate_async  trainer |submit|sample|train|sample|train|...|publish|
//!                 rollout |================ generate continuously, swap weights between decode steps ==>
//! ```

pub mod colocate_async;
pub mod separate_async;
pub mod sync;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::Path;

use jetrl_config::{JobConfig, TrainerMode};
use jetrl_wire::subjects;
use jetrl_wire::v1::SampleResponse;
use tokio::time::Instant;

use crate::actor::{OldPolicy, TrainOutput};
use crate::batch::Sample;
use crate::checkpoint::{self, CheckpointError, TrainerState};
use crate::error::TrainerError;
use crate::learner::Learner;
use crate::planes::{DataPlane, WeightPlane};
use crate::step_metrics::{Metrics, Phase, StepTimings};
use crate::weight_sync::SyncReport;

/// What a schedule drives: the learner, the data plane and the weight plane (the services' clients in a run,
/// stand-ins in the schedules' unit tests), and the run's settings.
pub(crate) struct Schedule<'a> {
    pub cfg: &'a JobConfig,
    pub learner: &'a dyn Learner,
    pub client: &'a mut dyn DataPlane,
    pub weights: &'a dyn WeightPlane,
    /// names this trainer process in its sample request ids (`train-<incarnation>-<step>`)
    pub incarnation: &'a str,
    /// the checkpoints' root (`global_step_<n>/` below it)
    pub ckpt_root: &'a Path,
    pub total_steps: u64,
    /// the last step of the checkpoint this run resumed from (0: a fresh run)
    pub start_step: u64,
}

/// What one sample request brought: the buffer's answer, the rows to train on, and the wait.
pub(crate) struct SampledBatch {
    pub response: SampleResponse,
    pub samples: Vec<Sample>,
    /// groups failed at the boundary (uid → reason), not trained on
    pub rejected: BTreeMap<String, String>,
    pub refilled: u32,
    /// seconds spent waiting for the buffer's answer (the trainer idle)
    pub wait_s: f64,
    pub fetch_s: f64,
}

/// Before step 1: the async modes submit `num_warmup_batches` full batches, so rollout runs ahead of training.
pub(crate) async fn warm_up(t: &mut Schedule<'_>) -> Result<(), TrainerError> {
    let batches = match t.cfg.trainer.mode {
        TrainerMode::Sync => 0,
        TrainerMode::ColocateAsync => t.cfg.trainer.colocate_async.num_warmup_batches,
        TrainerMode::SeparateAsync => t.cfg.trainer.separate_async.num_warmup_batches,
    };
    let step = t.start_step + 1;
    // after a resume the rows submitted again count towards the warm-up: the backlog stays what it was
    let wanted = batches as usize * t.cfg.data.train_batch_size as usize;
    let inflight = if batches > 0 { t.client.inflight_groups().await? } else { 0 };
    let missing = wanted.saturating_sub(inflight);
    if missing > 0 {
        t.client.submit_train(step, missing).await?;
        tracing::info!(batches, groups = missing, already_in_flight = inflight, "warm-up submitted");
    }
    Ok(())
}

/// One global step in the configured mode; returns its metrics.
pub(crate) async fn step(t: &mut Schedule<'_>, step: u64) -> Result<Metrics, TrainerError> {
    match t.cfg.trainer.mode {
        TrainerMode::Sync => sync::step(t, step).await,
        TrainerMode::ColocateAsync => colocate_async::step(t, step).await,
        TrainerMode::SeparateAsync => separate_async::step(t, step).await,
    }
}

impl Schedule<'_> {
    /// Asks the buffer for `groups` train groups of `step` and fetches their payloads.
    pub(crate) async fn sample_batch(
        &mut self,
        request_id: &str,
        step: u64,
        groups: u32,
    ) -> Result<SampledBatch, TrainerError> {
        let t = Instant::now();
        let (response, refilled) = self.client.sample(request_id, step, subjects::TRAIN_PARTITION, groups).await?;
        let wait_s = t.elapsed().as_secs_f64();
        tracing::debug!(step, request_id, groups = response.groups.len(), wait_s, "buffer answered; fetching");
        let t = Instant::now();
        let fetched = self.client.fetch(&response).await?;
        for (uid, reason) in &fetched.rejected {
            self.client.reject(uid, reason, step).await?;
        }
        let fetch_s = t.elapsed().as_secs_f64();
        if let Some(dir) = &self.cfg.trainer.rollout_data_dir {
            let rows = self.client.rollout_rows(step, &fetched.samples);
            crate::dump::write_jsonl(&std::path::Path::new(dir).join(format!("{step}.jsonl")), &rows);
        }
        Ok(SampledBatch { response, samples: fetched.samples, rejected: fetched.rejected, refilled, wait_s, fetch_s })
    }

    /// One update on `batch`'s samples by the learner (nothing to train on: no update, said in the metrics).
    pub(crate) async fn train_on(
        &self,
        batch: &SampledBatch,
        step: u64,
        pi_old: OldPolicy,
    ) -> Result<TrainOutput, TrainerError> {
        let samples = batch.samples.clone();
        if samples.is_empty() {
            tracing::warn!(step, "no trajectory left to train on (every sampled group was rejected); update skipped");
            let mut out = TrainOutput::default();
            out.metrics.insert("training/skipped_updates".into(), 1.0);
            return Ok(out);
        }
        self.learner.train(samples, &batch.response, step, pi_old).await
    }

    /// Every `trainer.save_freq` steps (and at the last): `global_step_<step>/` (models and optimizers on the
    /// actor thread, then the trainer state, and the step's metrics so far: a trainer that dies after the commit
    /// resumes after this step and writes its metrics line from them), committed, old ones pruned. Timed as
    /// `save_checkpoint`.
    pub(crate) async fn maybe_checkpoint(
        &self,
        step: u64,
        metrics: &Metrics,
        timings: &mut StepTimings,
    ) -> Result<(), TrainerError> {
        let save_freq = self.cfg.trainer.save_freq;
        if !(save_freq > 0 && (step % save_freq as u64 == 0 || step == self.total_steps)) {
            return Ok(());
        }
        let t = Instant::now();
        let staging = checkpoint::staging_dir(self.ckpt_root, step);
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(|e| CheckpointError::io(&staging, e))?;
        }
        std::fs::create_dir_all(&staging).map_err(|e| CheckpointError::io(&staging, e))?;
        let dir = staging.clone();
        let actor_state = self.learner.save_checkpoint(dir).await?;
        let state = TrainerState {
            global_step: step,
            total_training_steps: self.total_steps,
            dataloader: self.client.loader_state(),
            actor: actor_state,
            seeds: checkpoint::Seeds::of(self.cfg),
        };
        checkpoint::write_json(&staging.join(checkpoint::TRAINER_STATE_FILE), &state)?;
        let mut known = metrics.clone();
        timings.write(&mut known);
        known.insert("training/global_step".into(), step as f64);
        known.insert("training/epoch".into(), state.dataloader.epoch as f64);
        known.insert("training/total_steps".into(), self.total_steps as f64);
        checkpoint::write_json(&staging.join(checkpoint::STEP_METRICS_FILE), &known)?;
        let dir = checkpoint::commit(self.ckpt_root, step, checkpoint::keep_count(self.cfg))?;
        tracing::info!(dir = %dir.display(), step, "checkpoint saved");
        timings.since(Phase::SaveCheckpoint, t);
        Ok(())
    }
}

impl Schedule<'_> {
    /// Submits the step's batch of prompts, between the crash points every schedule offers there.
    pub(crate) async fn submit_step(&mut self, step: u64, batch_size: usize) -> Result<(), TrainerError> {
        jetrl_telemetry::crash::crash_point("trainer.before_submit", step);
        self.client.submit_train(step, batch_size).await?;
        jetrl_telemetry::crash::crash_point("trainer.after_submit", step);
        Ok(())
    }

    /// After a step's updates, in every schedule: the checkpoint when due, then the release of what the step
    /// sampled (a trainer that dies between the two resumes after a step whose payloads are still there), before
    /// the weights are published.
    pub(crate) async fn checkpoint_and_release(
        &self,
        step: u64,
        metrics: &Metrics,
        timings: &mut StepTimings,
        request_ids: Vec<String>,
    ) -> Result<(), TrainerError> {
        self.maybe_checkpoint(step, metrics, timings).await?;
        jetrl_telemetry::crash::crash_point("trainer.between_checkpoint_and_publish", step);
        self.client.release(step, request_ids);
        Ok(())
    }
}

/// A sampled batch's record: the sample request's metrics and the batch's own (scores, lengths, staleness).
pub(crate) fn batch_record(batch: &SampledBatch, step: u64, max_prompt: usize) -> Metrics {
    let mut metrics = Metrics::new();
    sample_metrics(batch, &mut metrics);
    crate::step_metrics::batch_metrics(&batch.samples, &batch.response, step, max_prompt, &mut metrics);
    metrics
}

/// A sample request's own metrics: the buffer's (evictions), refills and rejections.
pub(crate) fn sample_metrics(batch: &SampledBatch, out: &mut Metrics) {
    out.extend(batch.response.metrics.clone());
    out.insert("training/refilled_prompts".into(), f64::from(batch.refilled));
    out.insert("training/rejected_groups".into(), batch.rejected.len() as f64);
}

/// How the step's weight sync went: `weight_sync/{loaded_workers,lagging_workers,seconds}`.
pub(crate) fn sync_metrics(report: &SyncReport, out: &mut Metrics) {
    out.insert("weight_sync/loaded_workers".into(), report.loaded as f64);
    out.insert("weight_sync/lagging_workers".into(), report.lagging.len() as f64);
    out.insert("weight_sync/silent_workers".into(), report.silent.len() as f64);
    out.insert("weight_sync/seconds".into(), report.seconds);
}

//! `sync` (verl's `PPOTrainerSync`): one batch of prompts at version `step − 1`, sampled whole, trained on,
//! then the weights of `step` published and loaded by every live worker before the next batch. Tasks carry the
//! version they need, so a worker that could not load it never generates for the step: staleness stays 0.

use tokio::time::Instant;

use crate::actor::OldPolicy;
use crate::error::TrainerError;
use crate::schedule::{batch_record, sync_metrics, Schedule};
use crate::step_metrics::{timing_metrics, IdleClock, Metrics, Phase, StepTimings};

pub(crate) async fn step(t: &mut Schedule<'_>, step: u64) -> Result<Metrics, TrainerError> {
    let started = Instant::now();
    let clock = IdleClock::start(t.weights.fleet_idle_seconds());
    let mut timings = StepTimings::default();
    let batch_size = t.cfg.data.train_batch_size;
    t.submit_step(step, batch_size as usize).await?;

    let request_id = format!("train-{}-{step}", t.incarnation);
    let batch = t.sample_batch(&request_id, step, batch_size).await?;
    tracing::debug!(step, groups = batch.response.groups.len(), "batch sampled");
    timings.set(Phase::Gen, batch.wait_s);
    timings.set(Phase::Fetch, batch.fetch_s);
    let mut metrics = batch_record(&batch, step, t.cfg.data.max_prompt_length as usize);

    let out = t.train_on(&batch, step, OldPolicy::Current).await?;
    tracing::debug!(step, "actor updated");
    metrics.extend(out.metrics);
    timings.extend(out.timings);
    t.checkpoint_and_release(step, &metrics, &mut timings, vec![request_id]).await?;

    let t0 = Instant::now();
    let blob = t.learner.weights_blob().await?;
    metrics.insert("weight_sync/bytes".into(), blob.len() as f64);
    t.weights.publish(step, blob).await?;
    tracing::debug!(step, "weights published; waiting for the workers to load them");
    let report = t.weights.wait_for_workers(step, false).await?;
    timings.since(Phase::UpdateWeights, t0);
    sync_metrics(&report, &mut metrics);

    timing_metrics(&timings, &batch.samples, started.elapsed().as_secs_f64(), &mut metrics);
    clock.finish(t.weights.fleet_idle_seconds(), batch.wait_s, &mut metrics);
    Ok(metrics)
}

//! `colocate_async` (verl's `PPOTrainerColocateAsync`): the trainer and one rollout worker share a device. The
//! worker runs ahead (warm-up batches before step 1, one more batch per step); sampling returns as soon as
//! `train_batch_size` groups are terminal, oldest first. Then the worker pauses — its sequences are aborted with
//! their prefixes kept and its KV cache freed, so the trainer has the device — the trainer updates, writes the
//! weights to a local file (never through the broker) and resumes the worker, which loads them and continues
//! every sequence from its prefix: trajectories then span versions, within the buffer's staleness bound. Both
//! handshakes have a deadline; a worker that misses one is reported and the trainer goes on.

use tokio::time::Instant;

use crate::actor::OldPolicy;
use crate::error::TrainerError;
use crate::schedule::{batch_record, Schedule};
use crate::step_metrics::{timing_metrics, IdleClock, Metrics, Phase, StepTimings};

pub(crate) async fn step(t: &mut Schedule<'_>, step: u64) -> Result<Metrics, TrainerError> {
    let started = Instant::now();
    let clock = IdleClock::start(t.weights.fleet_idle_seconds());
    let mut timings = StepTimings::default();
    let batch_size = t.cfg.data.train_batch_size;
    t.submit_step(step, batch_size as usize).await?;

    let request_id = format!("train-{}-{step}", t.incarnation);
    let batch = t.sample_batch(&request_id, step, batch_size).await?;
    timings.set(Phase::Gen, batch.wait_s);
    timings.set(Phase::Fetch, batch.fetch_s);
    let mut metrics = batch_record(&batch, step, t.cfg.data.max_prompt_length as usize);

    let t0 = Instant::now();
    match t.weights.pause_colocated(step).await {
        Ok(paused) => {
            metrics.insert("colocate/parked_sequences".into(), f64::from(paused.parked_sequences));
            metrics.insert("colocate/parked_tokens".into(), paused.parked_tokens as f64);
        }
        Err(missed) => {
            tracing::warn!(step, error = %missed, "co-located worker not paused; training beside it");
            metrics.insert("colocate/handshake_missed".into(), 1.0);
        }
    }
    timings.since(Phase::Pause, t0);

    let samples = batch.samples.clone();
    let out = t.train_on(&batch, step, OldPolicy::Current).await?;
    metrics.extend(out.metrics);
    timings.extend(out.timings);
    t.checkpoint_and_release(step, &metrics, &mut timings, vec![request_id]).await?;

    let t0 = Instant::now();
    let blob = t.learner.weights_blob().await?;
    metrics.insert("weight_sync/bytes".into(), blob.len() as f64);
    let manifest = t.weights.store(step, blob).await?;
    match t.weights.resume_colocated(step, Some(manifest.clone())).await {
        Ok(resumed) => {
            metrics.insert("colocate/resumed_sequences".into(), f64::from(resumed.resumed_sequences));
        }
        Err(missed) => {
            tracing::warn!(step, error = %missed, "co-located worker not resumed; it loads the weights when it returns");
            *metrics.entry("colocate/handshake_missed".into()).or_insert(0.0) += 1.0;
        }
    }
    timings.since(Phase::Resume, t0);
    // the registry last: a worker that restarts finds this version, and the co-located one already has it
    t.weights.announce(manifest).await?;
    timings.since(Phase::UpdateWeights, t0);

    timing_metrics(&timings, &samples, started.elapsed().as_secs_f64(), &mut metrics);
    clock.finish(t.weights.fleet_idle_seconds(), batch.wait_s, &mut metrics);
    Ok(metrics)
}

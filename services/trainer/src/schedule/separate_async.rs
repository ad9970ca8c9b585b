//! `separate_async` (verl's `PPOTrainerSeparateAsync`): the rollout workers generate continuously on their own
//! devices; the buffer bounds staleness (`buffer.max_off_policy_*`). One global step submits one batch (after the
//! warm-up batches submitted before step 1), then makes `parameter_sync_step` local updates, each on
//! `ppo_mini_batch_size` groups sampled oldest first, and publishes the weights once. Decoupled PPO: every local
//! update takes π_old from the policy as it was at the start of the step (a snapshot), and rollout correction
//! reweights by the behaviour log-probs the trajectories carry. Workers swap the new weights in between decode
//! steps; the trainer does not wait for them (their lag shows in `training/off_policy/*` and `weight_sync/*`).

use tokio::time::Instant;

use crate::actor::OldPolicy;
use crate::error::TrainerError;
use crate::schedule::{batch_record, Schedule};
use crate::step_metrics::{timing_metrics, Aggregator, IdleClock, Metrics, Phase, StepTimings};

pub(crate) async fn step(t: &mut Schedule<'_>, step: u64) -> Result<Metrics, TrainerError> {
    let started = Instant::now();
    let clock = IdleClock::start(t.weights.fleet_idle_seconds());
    let local_updates = t.cfg.trainer.separate_async.parameter_sync_step.max(1);
    let batch_size = t.cfg.data.train_batch_size;
    let mini = t.cfg.actor.ppo_mini_batch_size.unwrap_or(batch_size / local_updates).max(1);
    t.submit_step(step, batch_size as usize).await?;
    t.learner.snapshot().await?;

    let mut local = Aggregator::default();
    let mut request_ids = Vec::with_capacity(local_updates as usize);
    let mut trained = Vec::new();
    let mut waited = 0.0;
    for i in 0..local_updates {
        let request_id = format!("train-{}-{step}-{i}", t.incarnation);
        let batch = t.sample_batch(&request_id, step, mini).await?;
        waited += batch.wait_s;
        let mut metrics = batch_record(&batch, step, t.cfg.data.max_prompt_length as usize);
        let mut timings = StepTimings::default();
        timings.set(Phase::Gen, batch.wait_s);
        timings.set(Phase::Fetch, batch.fetch_s);
        let weight = batch.samples.len() as f64;
        trained.extend(batch.samples.iter().cloned());
        // the first local update's π_old is the current policy itself; later ones read the snapshot
        let pi_old = if i == 0 { OldPolicy::Current } else { OldPolicy::CycleStart };
        let out = t.train_on(&batch, step, pi_old).await?;
        metrics.extend(out.metrics);
        timings.extend(out.timings);
        timings.write(&mut metrics);
        local.add(metrics, weight);
        request_ids.push(request_id);
    }
    let mut metrics = local.finish();
    // each phase's seconds averaged over the local updates (weighted by their batches)
    let mut timings = StepTimings::read(&metrics);
    t.checkpoint_and_release(step, &metrics, &mut timings, request_ids).await?;

    let t0 = Instant::now();
    let blob = t.learner.weights_blob().await?;
    metrics.insert("weight_sync/bytes".into(), blob.len() as f64);
    t.weights.publish(step, blob).await?;
    timings.since(Phase::UpdateWeights, t0);
    // rollout does not wait for the trainer, nor the trainer for rollout: report who is behind
    let behind = t.weights.workers().into_iter().filter(|w| w.version + 1 < step).count();
    metrics.insert("weight_sync/lagging_workers".into(), behind as f64);
    metrics.insert("weight_sync/silent_workers".into(), t.weights.silent_workers().len() as f64);
    metrics.insert("training/local_updates".into(), f64::from(local_updates));

    timing_metrics(&timings, &trained, started.elapsed().as_secs_f64(), &mut metrics);
    clock.finish(t.weights.fleet_idle_seconds(), waited, &mut metrics);
    Ok(metrics)
}

//! A stand-in learner for `just bench cluster_sim` (`trainer.simulate`): it trains nothing and loads no model. An
//! update sleeps the time the configured device model gives its batch (`seconds_per_kilotoken` per thousand
//! prompt and response tokens), a weight version the time it takes to publish (`publish_s`), both divided by
//! `time_scale`, and it returns plausible metrics. The schedules drive it through [`Learner`] exactly as they
//! drive the real ranks, so what is measured is the orchestration around a device of those timings.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use jetrl_config::SimulateConfig;
use jetrl_wire::v1::SampleResponse;

use crate::actor::{OldPolicy, TrainOutput};
use crate::batch::Sample;
use crate::checkpoint::ActorState;
use crate::error::TrainerError;
use crate::learner::Learner;
use crate::step_metrics::Phase;

/// The paced stand-in learner.
pub struct PacedLearner {
    simulate: SimulateConfig,
    updates: AtomicU64,
}

impl PacedLearner {
    pub fn new(simulate: SimulateConfig) -> Self {
        Self { simulate, updates: AtomicU64::new(0) }
    }

    /// Real time for `modelled` seconds of the simulated device.
    fn real(&self, modelled: f64) -> Duration {
        Duration::from_secs_f64((modelled / self.simulate.time_scale).max(0.0))
    }
}

/// A one-tensor safetensors blob (`sim.weight`, one bf16 zero): what the paced learner publishes as a weight
/// version, so the weight path (store, manifest, the workers' watch) runs without a model.
pub fn dummy_weights() -> Bytes {
    let header = br#"{"sim.weight":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}"#;
    // the header is padded with spaces to a multiple of 8 bytes, as safetensors writers do
    let padded = header.len().div_ceil(8) * 8;
    let mut blob = Vec::with_capacity(8 + padded + 2);
    blob.extend_from_slice(&(padded as u64).to_le_bytes());
    blob.extend_from_slice(header);
    blob.resize(8 + padded, b' ');
    blob.extend_from_slice(&[0, 0]);
    Bytes::from(blob)
}

impl Learner for PacedLearner {
    fn train(
        &self,
        samples: Vec<Sample>,
        _response: &SampleResponse,
        _step: u64,
        _pi_old: OldPolicy,
    ) -> BoxFuture<'_, Result<TrainOutput, TrainerError>> {
        Box::pin(async move {
            let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
            let modelled = tokens as f64 / 1000.0 * self.simulate.seconds_per_kilotoken;
            tokio::time::sleep(self.real(modelled)).await;
            let updates = self.updates.fetch_add(1, Ordering::Relaxed) + 1;
            let mut out = TrainOutput::default();
            // plausible values of the metrics a real update reports; nothing was trained
            out.metrics.insert("actor/pg_loss".into(), 0.0);
            out.metrics.insert("actor/entropy".into(), 0.5);
            out.metrics.insert("actor/grad_norm".into(), 1.0);
            out.metrics.insert("actor/lr".into(), 1.0e-6);
            out.metrics.insert("actor/pg_clipfrac".into(), 0.0);
            out.metrics.insert("actor/ppo_kl".into(), 0.0);
            out.metrics.insert("simulate/updates".into(), updates as f64);
            out.metrics.insert("simulate/modelled_update_s".into(), modelled);
            out.timings.set(Phase::UpdateActor, modelled / self.simulate.time_scale);
            Ok(out)
        })
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async { Ok(()) })
    }

    fn weights_blob(&self) -> BoxFuture<'_, Result<Bytes, TrainerError>> {
        Box::pin(async move {
            tokio::time::sleep(self.real(self.simulate.publish_s)).await;
            Ok(dummy_weights())
        })
    }

    fn save_checkpoint(&self, _dir: PathBuf) -> BoxFuture<'_, Result<ActorState, TrainerError>> {
        Box::pin(async move {
            Ok(ActorState { actor_updates: self.updates.load(Ordering::Relaxed), critic_updates: 0, kl_ctrl: None })
        })
    }

    fn finish(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async { Ok(()) })
    }
}

//! What the schedules ask of the model side, whether it is one rank or many: train a batch, snapshot π_old, the
//! weights to publish, a checkpoint's model part, the end of training. The schedules know nothing else of it, so
//! [`Ranks`] (the trainer's rank 0, leading 0..N followers) is one implementation and a test's stand-in another.

use std::collections::BTreeMap;
use std::path::PathBuf;

use bytes::Bytes;
use futures::future::BoxFuture;
use jetrl_wire::v1::{self, SampleResponse};

use crate::actor::{ActorHandle, OldPolicy, TrainOutput};
use crate::batch::Sample;
use crate::checkpoint::ActorState;
use crate::command::Command;
use crate::error::TrainerError;
use crate::ranks;

/// The model side of a trainer.
pub trait Learner: Send + Sync {
    /// One training step on `samples` (the payloads of `response`'s trajectories, checked), with π_old from `pi_old`.
    fn train(
        &self,
        samples: Vec<Sample>,
        response: &SampleResponse,
        step: u64,
        pi_old: OldPolicy,
    ) -> BoxFuture<'_, Result<TrainOutput, TrainerError>>;

    /// Keeps the current weights as π_old of the local updates that follow (separate_async).
    fn snapshot(&self) -> BoxFuture<'_, Result<(), TrainerError>>;

    /// The current weights as a safetensors blob in `model.dtype`.
    fn weights_blob(&self) -> BoxFuture<'_, Result<Bytes, TrainerError>>;

    /// Writes the models and optimizer state into the checkpoint being staged in `dir`; returns what the trainer
    /// state must hold of the actor.
    fn save_checkpoint(&self, dir: PathBuf) -> BoxFuture<'_, Result<ActorState, TrainerError>>;

    /// Training is over (or stopping): the other ranks leave.
    fn finish(&self) -> BoxFuture<'_, Result<(), TrainerError>>;
}

/// Rank 0's learner: its own actor thread, and the commands that make ranks 1..N do the same work with their share
/// of the rows (nothing to command with one rank).
#[derive(Clone)]
pub struct Ranks {
    actor: ActorHandle,
    world: usize,
}

impl Ranks {
    pub fn new(actor: ActorHandle, world: usize) -> Self {
        Self { actor, world }
    }

    pub fn actor(&self) -> &ActorHandle {
        &self.actor
    }
}

impl Learner for Ranks {
    fn train(
        &self,
        samples: Vec<Sample>,
        response: &SampleResponse,
        step: u64,
        pi_old: OldPolicy,
    ) -> BoxFuture<'_, Result<TrainOutput, TrainerError>> {
        let rewards: BTreeMap<String, v1::Reward> =
            response.groups.iter().flat_map(|g| g.trajectories.iter()).map(|r| (r.key.clone(), r.clone())).collect();
        let world = self.world;
        Box::pin(async move {
            Ok(self
                .actor
                .call(move |rank0| {
                    let (batch, command) = ranks::split_batch(samples, world, &rewards, step, pi_old)?;
                    rank0.lead(&command)?;
                    rank0.actor.train(&batch, step, pi_old)
                })
                .await??)
        })
    }

    fn snapshot(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async move {
            Ok(self
                .actor
                .call(|rank0| {
                    rank0.lead(&Command::Snapshot)?;
                    rank0.actor.snapshot()
                })
                .await??)
        })
    }

    fn weights_blob(&self) -> BoxFuture<'_, Result<Bytes, TrainerError>> {
        Box::pin(async move { Ok(Bytes::from(self.actor.call(|rank0| rank0.actor.weights_blob()).await??)) })
    }

    fn save_checkpoint(&self, dir: PathBuf) -> BoxFuture<'_, Result<ActorState, TrainerError>> {
        Box::pin(async move {
            Ok(self
                .actor
                .call(move |rank0| {
                    rank0.lead(&Command::SaveCheckpoint { dir: dir.clone() })?;
                    let state = rank0.actor.save_checkpoint(&dir)?;
                    // the checkpoint is complete only when every rank's shard is written
                    rank0.actor.comm().barrier()?;
                    Ok::<_, crate::error::ActorError>(state)
                })
                .await??)
        })
    }

    fn finish(&self) -> BoxFuture<'_, Result<(), TrainerError>> {
        Box::pin(async move { Ok(self.actor.call(|rank0| rank0.lead(&Command::Stop)).await??) })
    }
}

//! What the schedules ask of the two planes around the learner, as traits: the data plane (prompts out, sampled
//! batches in: [`RolloutClient`] over the replay buffer) and the weight plane (versions out to the rollout fleet,
//! the colocate handshake: [`WeightSync`]). With [`Learner`](crate::learner::Learner) they are all a schedule
//! touches, so a schedule runs as well against in-process stand-ins (the schedules' unit tests, under a paused
//! clock) as against the services.

use bytes::Bytes;
use futures::future::BoxFuture;
use jetrl_data::LoaderState;
use jetrl_wire::v1::{PauseResponse, ResumeResponse, SampleResponse, WeightManifest};

use crate::batch::Sample;
use crate::error::TrainerError;
use crate::fleet::WorkerView;
use crate::rollout_client::{Fetched, RolloutClient};
use crate::weight_sync::{HandshakeMissed, SyncReport, WeightSync};

/// Prompts out, sampled batches in.
pub trait DataPlane: Send + Sync {
    /// Groups of the train partition in flight (pending, running, or terminal and not yet sampled).
    fn inflight_groups(&self) -> BoxFuture<'_, Result<usize, TrainerError>>;

    /// Draws `count` rows and submits them as train groups of `step`; returns how many were submitted.
    fn submit_train(&mut self, step: u64, count: usize) -> BoxFuture<'_, Result<usize, TrainerError>>;

    /// Asks for `groups` groups of `partition` for `step` (request ids are idempotent); returns the answer and how
    /// many prompts were drawn again to refill filtered groups.
    fn sample<'a>(
        &'a mut self,
        request_id: &'a str,
        step: u64,
        partition: &'a str,
        groups: u32,
    ) -> BoxFuture<'a, Result<(SampleResponse, u32), TrainerError>>;

    /// The payloads of an answer's trajectories, checked; the groups that failed the checks apart.
    fn fetch<'a>(&'a self, response: &'a SampleResponse) -> BoxFuture<'a, Result<Fetched, TrainerError>>;

    /// Records that the sampled group `uid` could not be trained on.
    fn reject<'a>(&'a self, uid: &'a str, reason: &'a str, step: u64) -> BoxFuture<'a, Result<(), TrainerError>>;

    /// The dataloader's cursor, for a checkpoint.
    fn loader_state(&self) -> LoaderState;

    /// The step's payloads may go (in the background).
    fn release(&self, step: u64, request_ids: Vec<String>);

    /// `trainer.rollout_data_dir`'s rows of a sampled batch (the responses decoded).
    fn rollout_rows(&self, step: u64, samples: &[Sample]) -> Vec<serde_json::Value>;
}

/// Weight versions out to the rollout fleet, and what the fleet reports back.
pub trait WeightPlane: Send + Sync {
    /// Stores `blob` as `version` and announces it; returns the manifest.
    fn publish(&self, version: u64, blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>>;

    /// Stores `blob` as `version` without announcing it (colocate_async announces after the resume).
    fn store(&self, version: u64, blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>>;

    /// Announces a stored version to the fleet.
    fn announce(&self, manifest: WeightManifest) -> BoxFuture<'_, Result<WeightManifest, TrainerError>>;

    /// Waits (with a deadline) until every live worker reports `version` (exactly, with `exact`).
    fn wait_for_workers(&self, version: u64, exact: bool) -> BoxFuture<'_, Result<SyncReport, TrainerError>>;

    /// colocate_async: the co-located worker parks its sequences and frees its cache.
    fn pause_colocated(&self, step: u64) -> BoxFuture<'_, Result<PauseResponse, HandshakeMissed>>;

    /// colocate_async: the co-located worker loads `manifest` and continues its sequences.
    fn resume_colocated(
        &self,
        step: u64,
        manifest: Option<WeightManifest>,
    ) -> BoxFuture<'_, Result<ResumeResponse, HandshakeMissed>>;

    /// The live workers: instance, version held, state.
    fn workers(&self) -> Vec<WorkerView>;

    /// Workers gone silent (no heartbeat within the liveness window).
    fn silent_workers(&self) -> Vec<WorkerView>;

    /// Sum over live workers of engine idle seconds, and how many live workers there are.
    fn fleet_idle_seconds(&self) -> (f64, usize);
}

impl DataPlane for RolloutClient {
    fn inflight_groups(&self) -> BoxFuture<'_, Result<usize, TrainerError>> {
        Box::pin(RolloutClient::inflight_groups(self))
    }

    fn submit_train(&mut self, step: u64, count: usize) -> BoxFuture<'_, Result<usize, TrainerError>> {
        Box::pin(RolloutClient::submit_train(self, step, count))
    }

    fn sample<'a>(
        &'a mut self,
        request_id: &'a str,
        step: u64,
        partition: &'a str,
        groups: u32,
    ) -> BoxFuture<'a, Result<(SampleResponse, u32), TrainerError>> {
        Box::pin(RolloutClient::sample(self, request_id, step, partition, groups))
    }

    fn fetch<'a>(&'a self, response: &'a SampleResponse) -> BoxFuture<'a, Result<Fetched, TrainerError>> {
        Box::pin(RolloutClient::fetch(self, response))
    }

    fn reject<'a>(&'a self, uid: &'a str, reason: &'a str, step: u64) -> BoxFuture<'a, Result<(), TrainerError>> {
        Box::pin(RolloutClient::reject(self, uid, reason, step))
    }

    fn loader_state(&self) -> LoaderState {
        RolloutClient::loader_state(self)
    }

    fn release(&self, step: u64, request_ids: Vec<String>) {
        RolloutClient::release(self, step, request_ids);
    }

    fn rollout_rows(&self, step: u64, samples: &[Sample]) -> Vec<serde_json::Value> {
        crate::dump::rollout_rows(self.tokenizer(), step, samples)
    }
}

impl WeightPlane for WeightSync {
    fn publish(&self, version: u64, blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(WeightSync::publish(self, version, blob))
    }

    fn store(&self, version: u64, blob: Bytes) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(WeightSync::store(self, version, blob))
    }

    fn announce(&self, manifest: WeightManifest) -> BoxFuture<'_, Result<WeightManifest, TrainerError>> {
        Box::pin(WeightSync::announce(self, manifest))
    }

    fn wait_for_workers(&self, version: u64, exact: bool) -> BoxFuture<'_, Result<SyncReport, TrainerError>> {
        Box::pin(WeightSync::wait_for_workers(self, version, exact))
    }

    fn pause_colocated(&self, step: u64) -> BoxFuture<'_, Result<PauseResponse, HandshakeMissed>> {
        Box::pin(WeightSync::pause_colocated(self, step))
    }

    fn resume_colocated(
        &self,
        step: u64,
        manifest: Option<WeightManifest>,
    ) -> BoxFuture<'_, Result<ResumeResponse, HandshakeMissed>> {
        Box::pin(WeightSync::resume_colocated(self, step, manifest))
    }

    fn workers(&self) -> Vec<WorkerView> {
        self.fleet().views()
    }

    fn silent_workers(&self) -> Vec<WorkerView> {
        self.fleet().silent()
    }

    fn fleet_idle_seconds(&self) -> (f64, usize) {
        self.fleet().idle_seconds()
    }
}

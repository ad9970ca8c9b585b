//! Where verl's GPU keys put the rollout: in verl, `trainer.n_gpus_per_node` GPUs both train and roll out (its
//! hybrid engine), and the fully-async recipe's `rollout.n_gpus_per_node` (with `rollout.nnodes`) gives rollout GPUs
//! apart. `jetrl run --verl` reproduces both (services/cli's layout module places the processes).

use serde_json::json;

use super::VerlJob;
use crate::{ConfigError, DeviceSpec, RolloutName, TrainerMode};

/// Whether the rollout workers share the trainer ranks' GPUs or have their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutGpus {
    /// verl's hybrid engine: on the trainer ranks' GPUs
    Shared,
    /// verl's fully-async recipe (`rollout.n_gpus_per_node`): GPUs of their own
    Apart,
}

impl VerlJob {
    /// What the job's keys say about the rollout's GPUs.
    pub fn rollout_gpus(&self) -> RolloutGpus {
        if self.verl_key("rollout.workers") == "rollout.n_gpus_per_node" {
            RolloutGpus::Apart
        } else {
            RolloutGpus::Shared
        }
    }

    /// verl's hybrid engine rolls out on every trainer GPU: on CUDA, a job whose rollout shares the trainer's GPUs
    /// and that does not say how many workers (`actor_rollout_ref.rollout.workers`) gets one per trainer rank of a
    /// node, or with vLLM one per `tensor_model_parallel_size` of them (verl's replicas). colocate_async keeps its
    /// one worker.
    pub fn with_hybrid_workers(mut self) -> Result<Self, ConfigError> {
        let cfg = self.typed()?;
        if self.rollout_gpus() == RolloutGpus::Shared
            && self.value["rollout"]["workers"].is_null()
            && cfg.model.device != DeviceSpec::Cpu
            && cfg.trainer.mode != TrainerMode::ColocateAsync
        {
            let per = match cfg.rollout.name {
                RolloutName::Vllm => cfg.rollout.tensor_model_parallel_size.max(1),
                _ => 1,
            };
            self.value["rollout"]["workers"] = json!((cfg.trainer.n_gpus_per_node / per).max(1));
            self.origin.push(("rollout.workers".into(), "trainer.n_gpus_per_node".into()));
        }
        Ok(self)
    }
}

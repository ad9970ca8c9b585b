//! The trainer (`trainer.*`): the schedule, steps, checkpoints, ranks and the async modes' keys.

use serde::{Deserialize, Serialize};

use crate::{Logger, ResumeMode, TrainerMode};

/// verl's `trainer.*` plus trainer service settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// verl `trainer.project_name`: the trackers' project (MLflow experiment, wandb project)
    pub project_name: String,
    /// verl `trainer.experiment_name`: the trackers' run name; null = `run.name`
    pub experiment_name: Option<String>,
    pub mode: TrainerMode,
    /// colocate_async settings (verl `trainer.v1.colocate_async.*`)
    pub colocate_async: ColocateAsyncConfig,
    /// separate_async settings (verl `trainer.v1.separate_async.*`)
    pub separate_async: SeparateAsyncConfig,
    pub total_training_steps: Option<u64>,
    pub total_epochs: u32,
    /// save a checkpoint every this many steps (and at the last step); -1 = never
    pub save_freq: i64,
    /// checkpoint root: `global_step_<n>/` directories and `latest_checkpointed_iteration.txt`;
    /// default `<run.dir>/checkpoints`
    pub default_local_dir: Option<String>,
    /// checkpoints kept (oldest deleted first); null = all. `max_ckpt_to_keep` is the older spelling.
    pub max_actor_ckpt_to_keep: Option<u32>,
    /// of the checkpoints kept, how many keep their `critic/` (older ones keep the policy); null = all; at most
    /// the checkpoints kept
    pub max_critic_ckpt_to_keep: Option<u32>,
    pub max_ckpt_to_keep: Option<u32>,
    pub resume_mode: ResumeMode,
    /// a `global_step_<n>` directory, for resume_mode `resume_path`
    pub resume_from_path: Option<String>,
    /// validate every this many steps (and at the last step); -1 = never
    pub test_freq: i64,
    pub val_before_train: bool,
    /// validate once and stop (verl `val_only`)
    pub val_only: bool,
    /// validation generations written to the log per validation (verl's generations table)
    pub log_val_generations: u32,
    /// the actor is not updated before this step; the critic is (verl `critic_warmup`)
    pub critic_warmup: u64,
    /// where metrics go besides `metrics.jsonl` (always written: `jetrl run` reads it): `console` (a log line
    /// per step), `tensorboard` (event files), `jsonl`; verl's other backends are accepted and ignored
    pub logger: Vec<Logger>,
    /// TensorBoard event directory; default `<run.dir>/tensorboard`
    pub tensorboard_dir: Option<String>,
    pub metrics_addr: String,
    /// how long to wait for rollout workers to load a new weight version
    pub weight_sync_timeout_s: f64,
    /// how long one sample request may be held by the buffer before it is re-sent
    pub sample_wait_s: f64,
    /// verl `trainer.rollout_data_dir`: a JSONL file of the step's rollouts per step (input, output, score)
    pub rollout_data_dir: Option<String>,
    /// verl `trainer.validation_data_dir`: a JSONL file of the validation generations per validation
    pub validation_data_dir: Option<String>,
    /// torch intra-op threads; null = `OMP_NUM_THREADS` if set, else every core this process may use
    /// (`jetrl run` passes an even share of the host's cores between the trainer and its rollout workers)
    pub torch_threads: Option<u32>,
    /// torch inter-op threads; null = 1 on the CPU (jetrl runs no parallel graph), torch's default on CUDA
    pub torch_interop_threads: Option<u32>,
    /// tokio worker threads; null = one per core (`jetrl run` passes 2)
    pub tokio_threads: Option<u32>,
    /// trainer ranks on each node (verl `trainer.n_gpus_per_node`): one process per GPU (per share of the cores
    /// without one); the rollout workers' devices are counted apart (`rollout.workers`)
    pub n_gpus_per_node: u32,
    /// nodes the trainer's ranks span (verl `trainer.nnodes`): `n_gpus_per_node × nnodes` ranks in all
    pub nnodes: u32,
    /// where and how the trainer's ranks meet (the c10d process group)
    pub dist: DistConfig,
    /// a simulation knob, not for training: with it set the trainer loads no model and its learner is a paced
    /// stand-in that sleeps the time a device would take (`just bench cluster_sim`); null = the real model
    pub simulate: Option<SimulateConfig>,
}

/// `trainer.simulate`: the paced stand-in learner of `just bench cluster_sim`. An update sleeps
/// `seconds_per_kilotoken` per thousand tokens (prompt and response) of its batch; a weight version sleeps
/// `publish_s` before it is published; both divided by `time_scale`. It trains nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulateConfig {
    /// modelled seconds an update takes per thousand tokens of its batch (the whole trainer, all its devices)
    pub seconds_per_kilotoken: f64,
    /// modelled seconds to gather and publish one weight version
    pub publish_s: f64,
    /// the paced clock's speed: modelled seconds per real second (1 = real time)
    pub time_scale: f64,
}

impl Default for SimulateConfig {
    fn default() -> Self {
        Self { seconds_per_kilotoken: 0.02, publish_s: 1.0, time_scale: 1.0 }
    }
}

/// The trainer's process group: rank 0 hosts a c10d TCPStore at `master_addr:master_port`, every rank joins it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// this process's rank, `0 .. n_gpus_per_node × nnodes` (`jetrl run` and the systemd unit set it per process);
    /// rank 0 leads
    pub rank: u32,
    /// the address rank 0's store listens on and the others connect to (torchrun's `MASTER_ADDR`)
    pub master_addr: String,
    /// the store's port (torchrun's `MASTER_PORT`); 0 = `jetrl run` picks a free one (set it when ranks are started
    /// otherwise: systemd, compose, several nodes)
    pub master_port: u16,
    /// how long the rendezvous and each collective may take before the rank fails (naming the store and the rank)
    pub timeout_s: f64,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self { rank: 0, master_addr: "127.0.0.1".into(), master_port: 0, timeout_s: 300.0 }
    }
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            project_name: "jetrl".into(),
            experiment_name: None,
            mode: TrainerMode::Sync,
            colocate_async: ColocateAsyncConfig::default(),
            separate_async: SeparateAsyncConfig::default(),
            total_training_steps: None,
            total_epochs: 1,
            save_freq: -1,
            default_local_dir: None,
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            max_ckpt_to_keep: None,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            test_freq: -1,
            val_before_train: false,
            val_only: false,
            log_val_generations: 0,
            critic_warmup: 0,
            logger: vec![Logger::Console, Logger::Jsonl],
            tensorboard_dir: None,
            metrics_addr: "127.0.0.1:0".into(),
            weight_sync_timeout_s: 300.0,
            sample_wait_s: 10.0,
            rollout_data_dir: None,
            validation_data_dir: None,
            torch_threads: None,
            torch_interop_threads: None,
            tokio_threads: None,
            n_gpus_per_node: 1,
            nnodes: 1,
            dist: DistConfig::default(),
            simulate: None,
        }
    }
}

/// verl's `trainer.v1.colocate_async.*`: the trainer and one rollout worker share a device.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColocateAsyncConfig {
    /// full train batches submitted before step 1 (one more is submitted at every step)
    pub num_warmup_batches: u32,
    /// `rollout.instance_id` of the rollout worker that shares the trainer's device: it pauses (aborting its
    /// sequences, keeping their prefixes, freeing its KV cache) while the trainer updates, loads the new weights
    /// from a local file and resumes. Required in colocate_async (`jetrl run` names its worker `rollout-0`).
    pub rollout_instance: Option<String>,
    /// how long each side of the pause / resume handshake waits for the other before reporting it and going on
    pub handshake_timeout_s: f64,
}

impl Default for ColocateAsyncConfig {
    fn default() -> Self {
        Self { num_warmup_batches: 1, rollout_instance: None, handshake_timeout_s: 60.0 }
    }
}

/// verl's `trainer.v1.separate_async.*`: the trainer and the rollout workers on their own devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SeparateAsyncConfig {
    /// full train batches submitted before step 1 (one more is submitted at every step)
    pub num_warmup_batches: u32,
    /// mini-batch updates per global step, each on `actor.ppo_mini_batch_size` groups sampled oldest first;
    /// weights are published once per global step. `data.train_batch_size` must equal
    /// `parameter_sync_step × actor.ppo_mini_batch_size`
    pub parameter_sync_step: u32,
}

impl Default for SeparateAsyncConfig {
    fn default() -> Self {
        Self { num_warmup_batches: 1, parameter_sync_step: 4 }
    }
}

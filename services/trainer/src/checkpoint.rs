//! Checkpoint directories, laid out as verl's so its users find their way:
//!
//! ```text
//! <default_local_dir>/
//!   latest_checkpointed_iteration.txt      the step of the newest complete checkpoint (written last)
//!   global_step_<n>/
//!     actor/        HF model directory (model.safetensors, config.json, tokenizer files) — loads with
//!                   `AutoModelForCausalLM.from_pretrained` unchanged — plus the optimizer state: AdamW
//!                   moments and fp32 master weights over the flat parameters, one shard per trainer rank
//!                   (optimizer.safetensors for one rank, optimizer.rank<r>-of-<n>.safetensors for n), and
//!                   optimizer.json (step count, ranks, elements)
//!     critic/       when a critic is trained: HF `*ForTokenClassification` directory (num_labels 1, the value
//!                   head is `score`), plus its optimizer files
//!     trainer_state.json   global step, dataloader cursor, KL controller, update counters, seeds
//! ```
//!
//! A checkpoint is written into `global_step_<n>.tmp/` and renamed when complete, so a crash while saving
//! never leaves a directory that looks complete; `latest_checkpointed_iteration.txt` is replaced atomically
//! after the rename.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use jetrl_config::{JobConfig, ResumeMode};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// What a checkpoint holds besides tensors: enough to continue exactly where the run stopped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// the last completed step; training resumes at the next one
    pub global_step: u64,
    pub total_training_steps: u64,
    /// the dataloader's position after the batch of `global_step` was drawn (verl's `data.pt`)
    pub dataloader: jetrl_data::LoaderState,
    /// update counters and the KL controller
    pub actor: ActorState,
    /// The seeds every random choice derives from (with the step number): libtorch's generator is re-seeded
    /// from `run` at every step, mini-batch shuffles from `actor_shuffle`, the dataloader from `data`. Together
    /// with the step they are the complete RNG state.
    pub seeds: Seeds,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Seeds {
    pub run: u64,
    pub data: u64,
    pub actor_shuffle: u64,
}

impl Seeds {
    pub fn of(cfg: &JobConfig) -> Self {
        Self { run: cfg.run.seed, data: cfg.data.seed, actor_shuffle: cfg.actor.data_loader_seed }
    }
}

/// What the actor carries from step to step besides tensors (saved in `trainer_state.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActorState {
    /// actor update calls made: the position of the actor's LR schedule
    pub actor_updates: u64,
    /// critic update calls made: the position of the critic's LR schedule
    pub critic_updates: u64,
    /// the in-reward KL coefficient and its controller (adaptive ones change every step)
    pub kl_ctrl: Option<jetrl_algos::KlController>,
}

/// verl's tracker file: the newest complete checkpoint's step.
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// The metrics of the checkpoint's step as known when it was saved (a resumed run writes its line from them
/// when the first incarnation died before writing it).
pub const STEP_METRICS_FILE: &str = "step_metrics.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const OPTIMIZER_META_FILE: &str = "optimizer.json";
/// The critic's part of a checkpoint.
pub const CRITIC_DIR: &str = "critic";
const STEP_PREFIX: &str = "global_step_";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("checkpoint {path}: {source}")]
    Format { path: String, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("resume: {0}")]
    Resume(String),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

impl CheckpointError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Format { .. } => "format",
            Self::Resume(..) => "resume",
            Self::Torch(..) => "torch",
        }
    }
}

impl CheckpointError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.display().to_string(), source }
    }

    pub fn format(path: &Path, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Format { path: path.display().to_string(), source: source.into() }
    }
}

/// The checkpoint root of a job: `trainer.default_local_dir`, else `<run.dir>/checkpoints`.
pub fn root_dir(cfg: &JobConfig) -> PathBuf {
    cfg.trainer
        .default_local_dir
        .clone()
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&cfg.run.dir).join("checkpoints"))
}

pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{STEP_PREFIX}{step}"))
}

/// The step of a `global_step_<n>` directory.
pub fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?.to_str()?.strip_prefix(STEP_PREFIX)?.parse().ok()
}

/// Complete checkpoints under `root`, oldest first.
pub fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut steps: Vec<u64> = entries
        .flatten()
        .filter(|e| e.path().is_dir() && e.path().join(TRAINER_STATE_FILE).exists())
        .filter_map(|e| step_of(&e.path()))
        .collect();
    steps.sort_unstable();
    steps
}

/// What [`commit`] keeps, as verl's two retention keys (each role deletes its own part of old checkpoints).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// checkpoints kept whole, newest first (`None`: all): a checkpoint without its policy cannot be resumed, so
    /// the actor's retention deletes the whole directory
    pub checkpoints: Option<usize>,
    /// of those, how many keep their `critic/` (`None`: all); older ones keep `actor/` and the trainer state
    pub critics: Option<usize>,
}

/// The retention of a job: `max_actor_ckpt_to_keep` (else `max_ckpt_to_keep`) checkpoints, the newest
/// `max_critic_ckpt_to_keep` of them with their critic (validation refuses more critics than checkpoints).
pub fn keep_count(cfg: &JobConfig) -> Retention {
    let keep = |k: u32| k.max(1) as usize;
    Retention {
        checkpoints: cfg.trainer.max_actor_ckpt_to_keep.or(cfg.trainer.max_ckpt_to_keep).map(keep),
        critics: cfg.trainer.max_critic_ckpt_to_keep.map(keep),
    }
}

/// The checkpoint to resume from, by `trainer.resume_mode`: `auto` takes the tracker file's step (or the
/// newest complete directory) under the root, if any; `resume_path`/`path` takes `resume_from_path`, which
/// must exist; `disable` starts fresh.
pub fn resolve_resume(cfg: &JobConfig) -> Result<Option<PathBuf>, CheckpointError> {
    match cfg.trainer.resume_mode {
        ResumeMode::Disable => Ok(None),
        ResumeMode::ResumePath => {
            let path = cfg.trainer.resume_from_path.as_deref().unwrap_or_default();
            let dir = PathBuf::from(path);
            if step_of(&dir).is_none() {
                return Err(CheckpointError::Resume(format!(
                    "trainer.resume_from_path {path:?} is not a `global_step_<n>` directory"
                )));
            }
            if !dir.join(TRAINER_STATE_FILE).exists() {
                return Err(CheckpointError::Resume(format!(
                    "trainer.resume_from_path {path:?} has no {TRAINER_STATE_FILE} (not a complete checkpoint)"
                )));
            }
            if cfg.critic.is_enabled(&cfg.algorithm) && !dir.join(CRITIC_DIR).is_dir() {
                return Err(CheckpointError::Resume(format!(
                    "trainer.resume_from_path {path:?} has no {CRITIC_DIR}/ (older than the newest \
                     trainer.max_critic_ckpt_to_keep checkpoints), and this job trains a critic"
                )));
            }
            Ok(Some(dir))
        }
        ResumeMode::Auto => {
            let root = root_dir(cfg);
            let tracked = std::fs::read_to_string(root.join(LATEST_FILE))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .map(|step| step_dir(&root, step))
                .filter(|dir| dir.join(TRAINER_STATE_FILE).exists());
            Ok(tracked.or_else(|| list_steps(&root).last().map(|&s| step_dir(&root, s))))
        }
    }
}

/// Where a checkpoint of `step` is assembled before it is complete.
pub fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{STEP_PREFIX}{step}.tmp"))
}

/// Makes a fully written staging directory the checkpoint of `step`, points the tracker file at it, and
/// deletes what `keep` no longer retains: the oldest checkpoints, and the critics of the older ones kept.
/// Returns the final directory.
pub fn commit(root: &Path, step: u64, keep: Retention) -> Result<PathBuf, CheckpointError> {
    let staging = staging_dir(root, step);
    let dir = step_dir(root, step);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
    }
    std::fs::rename(&staging, &dir).map_err(|e| CheckpointError::io(&staging, e))?;
    write_atomic(&root.join(LATEST_FILE), step.to_string().as_bytes())?;
    let expired = |kept: &[u64], limit: Option<usize>| -> Vec<PathBuf> {
        let excess = limit.map_or(0, |limit| kept.len().saturating_sub(limit));
        kept.iter().take(excess).map(|&s| step_dir(root, s)).collect()
    };
    for old in expired(&list_steps(root), keep.checkpoints) {
        if let Err(err) = std::fs::remove_dir_all(&old) {
            tracing::warn!(dir = %old.display(), error = %err, "old checkpoint not deleted");
        }
    }
    for old in expired(&list_steps(root), keep.critics) {
        let critic = old.join(CRITIC_DIR);
        if critic.exists() {
            if let Err(err) = std::fs::remove_dir_all(&critic) {
                tracing::warn!(dir = %critic.display(), error = %err, "old critic checkpoint not deleted");
            }
        }
    }
    Ok(dir)
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| CheckpointError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))
}

/// `optimizer.json`: what AdamW's state needs besides its tensors. The step count drives the bias correction, so
/// a file that does not say it is an error, never a silent restart from step 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// AdamW steps taken
    pub step: u64,
    /// the ranks that saved the state, one shard file each ([`optimizer_shard_file`])
    #[serde(default = "one_rank")]
    pub world_size: u32,
    /// elements of the flat state (all parameters); 0: the state is one file of tensors named by parameter
    /// (`exp_avg.<param>`, ...), as one rank saved it before the state was sharded
    #[serde(default)]
    pub numel: i64,
}

fn one_rank() -> u32 {
    1
}

/// The file rank `rank` of `world` ranks saves its optimizer shard in (`optimizer.safetensors` for one rank).
pub fn optimizer_shard_file(rank: usize, world: usize) -> String {
    if world <= 1 {
        OPTIMIZER_FILE.to_string()
    } else {
        format!("optimizer.rank{rank}-of-{world}.safetensors")
    }
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), CheckpointError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CheckpointError::format(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| CheckpointError::io(path, e))
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read_to_string(path).map_err(|e| CheckpointError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::format(path, e))
}

/// The PEFT adapter directory of a LoRA run's `actor/` (the base model is `model.path`).
pub const LORA_ADAPTER_DIR: &str = "lora_adapter";

/// Copies the tokenizer and generation files of an HF model directory (everything but weights and
/// `config.json`, which the model writes itself), so the checkpoint is a complete model directory.
pub fn copy_model_side_files(model_dir: &Path, out: &Path) -> Result<(), CheckpointError> {
    jetrl_model::copy_side_files(model_dir, out).map_err(|e| match e {
        jetrl_model::ModelError::Io { path, source } => CheckpointError::io(&path, source),
        other => CheckpointError::io(model_dir, std::io::Error::other(other)),
    })
}

fn safetensors_dtype(kind: Kind) -> Option<safetensors::Dtype> {
    Some(match kind {
        Kind::Float => safetensors::Dtype::F32,
        Kind::BFloat16 => safetensors::Dtype::BF16,
        Kind::Half => safetensors::Dtype::F16,
        Kind::Double => safetensors::Dtype::F64,
        Kind::Int64 => safetensors::Dtype::I64,
        _ => return None,
    })
}

fn tch_kind(dtype: safetensors::Dtype) -> Option<Kind> {
    Some(match dtype {
        safetensors::Dtype::F32 => Kind::Float,
        safetensors::Dtype::BF16 => Kind::BFloat16,
        safetensors::Dtype::F16 => Kind::Half,
        safetensors::Dtype::F64 => Kind::Double,
        safetensors::Dtype::I64 => Kind::Int64,
        _ => return None,
    })
}

/// Writes named tensors (any device, kept in their dtype) as one safetensors file.
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), CheckpointError> {
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dtype = safetensors_dtype(t.kind())
            .ok_or_else(|| CheckpointError::format(path, format!("{name}: unsupported dtype {:?}", t.kind())))?;
        let t = t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        owned.push((name.clone(), dtype, shape, bytes));
    }
    let views = owned
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| CheckpointError::format(path, format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::tensor::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| CheckpointError::io(path, std::io::Error::other(e)))
}

/// Reads every tensor of a safetensors file onto the CPU, in file order.
pub fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|e| CheckpointError::io(path, e))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::format(path, e))?;
    let mut out = Vec::new();
    for (name, view) in file.tensors() {
        let kind = tch_kind(view.dtype())
            .ok_or_else(|| CheckpointError::format(path, format!("{name}: unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.push((name, Tensor::f_from_data_size(view.data(), &shape, kind)?));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_through_safetensors_in_their_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0]).view([2, 2]);
        let b = Tensor::from_slice(&[0.5f32, 1.0]).to_kind(Kind::BFloat16);
        write_tensors(&path, &[("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())]).unwrap();
        let back: HashMap<String, Tensor> = read_tensors(&path).unwrap().into_iter().collect();
        assert_eq!(back["a"].size(), vec![2, 2]);
        assert!(back["a"].equal(&a));
        assert_eq!(back["b"].kind(), Kind::BFloat16);
        assert!(back["b"].equal(&b));
    }

    #[test]
    fn commit_moves_staging_into_place_updates_the_tracker_and_keeps_the_newest() {
        let root = tempfile::tempdir().unwrap();
        for step in [2u64, 4, 6] {
            let staging = staging_dir(root.path(), step);
            std::fs::create_dir_all(&staging).unwrap();
            std::fs::write(staging.join(TRAINER_STATE_FILE), "{}").unwrap();
            commit(root.path(), step, Retention { checkpoints: Some(2), critics: None }).unwrap();
        }
        assert_eq!(list_steps(root.path()), vec![4, 6]);
        assert_eq!(std::fs::read_to_string(root.path().join(LATEST_FILE)).unwrap(), "6");
        assert!(!staging_dir(root.path(), 6).exists());
    }

    /// verl's `max_critic_ckpt_to_keep`: older checkpoints lose their critic and keep the policy and trainer state;
    /// resuming a critic job from one of them is refused naming why.
    #[test]
    fn critic_retention_removes_the_critic_of_older_checkpoints_and_keeps_their_actor() {
        let root = tempfile::tempdir().unwrap();
        let mut cfg = cfg_with(root.path(), "auto", None);
        cfg.trainer.max_actor_ckpt_to_keep = Some(3);
        cfg.trainer.max_critic_ckpt_to_keep = Some(1);
        for step in [1u64, 2, 3, 4] {
            let staging = staging_dir(root.path(), step);
            for part in ["actor", CRITIC_DIR] {
                std::fs::create_dir_all(staging.join(part)).unwrap();
            }
            std::fs::write(staging.join(TRAINER_STATE_FILE), "{}").unwrap();
            commit(root.path(), step, keep_count(&cfg)).unwrap();
        }
        assert_eq!(list_steps(root.path()), vec![2, 3, 4]);
        for step in [2u64, 3, 4] {
            assert!(step_dir(root.path(), step).join("actor").is_dir(), "step {step} keeps its actor");
            assert_eq!(step_dir(root.path(), step).join(CRITIC_DIR).exists(), step == 4, "critic of step {step}");
        }
        cfg.algorithm.adv_estimator = jetrl_config::AdvantageEstimator::Gae;
        cfg.trainer.resume_mode = ResumeMode::ResumePath;
        cfg.trainer.resume_from_path = Some(step_dir(root.path(), 3).display().to_string());
        let err = resolve_resume(&cfg).unwrap_err().to_string();
        assert!(err.contains("max_critic_ckpt_to_keep"), "{err}");
        cfg.trainer.resume_from_path = Some(step_dir(root.path(), 4).display().to_string());
        assert!(resolve_resume(&cfg).unwrap().is_some());
    }

    fn cfg_with(root: &Path, mode: &str, path: Option<String>) -> JobConfig {
        let mut cfg = JobConfig::default();
        cfg.trainer.default_local_dir = Some(root.display().to_string());
        cfg.trainer.resume_mode = mode.parse().unwrap();
        cfg.trainer.resume_from_path = path;
        cfg
    }

    #[test]
    fn resume_mode_auto_finds_the_latest_complete_checkpoint_and_ignores_partial_ones() {
        let root = tempfile::tempdir().unwrap();
        assert!(resolve_resume(&cfg_with(root.path(), "auto", None)).unwrap().is_none());
        for step in [3u64, 5] {
            std::fs::create_dir_all(step_dir(root.path(), step)).unwrap();
            std::fs::write(step_dir(root.path(), step).join(TRAINER_STATE_FILE), "{}").unwrap();
        }
        // a crashed save: no trainer_state.json
        std::fs::create_dir_all(step_dir(root.path(), 9)).unwrap();
        let found = resolve_resume(&cfg_with(root.path(), "auto", None)).unwrap().unwrap();
        assert_eq!(step_of(&found), Some(5));
        std::fs::write(root.path().join(LATEST_FILE), "3").unwrap();
        let tracked = resolve_resume(&cfg_with(root.path(), "auto", None)).unwrap().unwrap();
        assert_eq!(step_of(&tracked), Some(3));
        assert!(resolve_resume(&cfg_with(root.path(), "disable", None)).unwrap().is_none());
        let explicit = step_dir(root.path(), 5).display().to_string();
        let chosen = resolve_resume(&cfg_with(root.path(), "resume_path", Some(explicit))).unwrap().unwrap();
        assert_eq!(step_of(&chosen), Some(5));
        let partial = step_dir(root.path(), 9).display().to_string();
        assert!(matches!(
            resolve_resume(&cfg_with(root.path(), "resume_path", Some(partial))),
            Err(CheckpointError::Resume(_))
        ));
    }
}

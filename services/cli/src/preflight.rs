//! What `jetrl run` can know before it starts anything. A job that asks for more CUDA devices than this machine
//! has would otherwise start every service and crash-loop each trainer rank and rollout worker (`cuda:0
//! requested but 0 CUDA device(s) are visible`) until the supervisor gives up; here it is refused at once, naming
//! the key the user wrote and the fix.

use jetrl_config::{DeviceSpec, JobConfig};

/// How the keys the check names are spelled in the user's file: jetrl's tree, or verl's (`--verl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    Jetrl,
    Verl,
}

impl Spelling {
    /// The key that set `model.device`, and the value that runs on the CPU.
    fn device_key(self) -> (&'static str, &'static str) {
        match self {
            Spelling::Jetrl => ("model.device", "model.device=cpu"),
            Spelling::Verl => ("trainer.device", "trainer.device=cpu"),
        }
    }
}

/// The CUDA devices libtorch sees on this machine (after `CUDA_VISIBLE_DEVICES`).
pub fn visible_cuda_devices() -> usize {
    if tch::Cuda::is_available() {
        usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
    } else {
        0
    }
}

/// Refuses a job whose services on this host need CUDA devices it does not have. `model.device: auto` never
/// fails (it falls back to the CPU); `cuda`/`cuda:N` needs device N, and the trainer's ranks on this node need
/// one device each (rank r takes `cuda:<r mod n_gpus_per_node>`).
pub fn check_devices(cfg: &JobConfig, visible: usize, spelling: Spelling) -> Result<(), String> {
    let DeviceSpec::Cuda(index) = cfg.model.device else {
        return Ok(());
    };
    let (key, fix) = spelling.device_key();
    let value = if spelling == Spelling::Verl { "cuda".to_string() } else { format!("cuda:{index}") };
    if visible == 0 {
        return Err(format!(
            "{key}={value}: the trainer and the rollout workers would run on CUDA, but libtorch sees no CUDA device on \
             this machine (CUDA_VISIBLE_DEVICES={}); set {fix} to run on the CPU, or run on a GPU host",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        ));
    }
    if index >= visible {
        return Err(format!(
            "{key}={value}: device {index} requested but libtorch sees {visible} CUDA device(s) on this machine; \
             name a device below {visible}, or set {fix}"
        ));
    }
    let ranks = cfg.trainer.n_gpus_per_node as usize;
    if ranks > visible {
        return Err(format!(
            "trainer.n_gpus_per_node={ranks}: one trainer rank per GPU, but libtorch sees {visible} CUDA device(s) on \
             this machine; set trainer.n_gpus_per_node={visible} (or fewer), or {fix}"
        ));
    }
    Ok(())
}

/// Refuses a model directory whose `config.json` names an architecture jetrl does not build (or does not parse):
/// every trainer rank and rollout worker would fail on it at each restart.
pub fn check_model(dir: &std::path::Path) -> Result<(), String> {
    let file = dir.join(jetrl_model::CONFIG_FILE);
    jetrl_model::ModelConfig::from_file(&file)
        .map(|_| ())
        .map_err(|e| format!("model.path (verl: actor_rollout_ref.model.path): {}: {e}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(overrides: &[&str]) -> JobConfig {
        let overrides: Vec<String> = ["data.task.name=copy"].iter().chain(overrides).map(|s| s.to_string()).collect();
        JobConfig::load(None, &overrides).expect("job")
    }

    #[test]
    fn cuda_without_a_gpu_is_refused_naming_the_key_the_user_wrote_and_the_cpu_fix() {
        let cfg = job(&["model.device=cuda"]);
        let err = check_devices(&cfg, 0, Spelling::Verl).unwrap_err();
        assert!(err.starts_with("trainer.device=cuda:") && err.contains("set trainer.device=cpu"), "{err}");
        let err = check_devices(&cfg, 0, Spelling::Jetrl).unwrap_err();
        assert!(err.starts_with("model.device=cuda:0:") && err.contains("set model.device=cpu"), "{err}");
    }

    #[test]
    fn cpu_and_auto_pass_anywhere_and_cuda_passes_where_the_devices_exist() {
        for device in ["cpu", "auto"] {
            assert_eq!(check_devices(&job(&[&format!("model.device={device}")]), 0, Spelling::Verl), Ok(()));
        }
        assert_eq!(check_devices(&job(&["model.device=cuda:1"]), 2, Spelling::Jetrl), Ok(()));
        let err = check_devices(&job(&["model.device=cuda:2"]), 2, Spelling::Jetrl).unwrap_err();
        assert!(err.contains("device 2 requested but libtorch sees 2"), "{err}");
    }

    #[test]
    fn a_model_of_an_architecture_jetrl_lacks_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("config.json"), r#"{"model_type": "gemma3"}"#).expect("write");
        let err = check_model(dir.path()).unwrap_err();
        assert!(err.contains("model.path") && err.contains("gemma3"), "{err}");
    }

    #[test]
    fn more_trainer_ranks_than_gpus_are_refused_with_the_count_that_fits() {
        let cfg = job(&["model.device=cuda", "trainer.n_gpus_per_node=8", "data.train_batch_size=64"]);
        let err = check_devices(&cfg, 2, Spelling::Verl).unwrap_err();
        assert!(err.contains("trainer.n_gpus_per_node=8") && err.contains("trainer.n_gpus_per_node=2"), "{err}");
        assert_eq!(check_devices(&cfg, 8, Spelling::Verl), Ok(()));
    }
}

//! The thread counts `jetrl run` gives the services it starts on this host.
//!
//! Left to themselves, the trainer and every rollout worker would each run torch on every core, and each
//! service would start a tokio worker per core: two jobs on one machine then ran ~7× slower each (torch's
//! OpenMP threads of one process spin while another's need the cores). A key the job sets is passed as it is.

use jetrl_config::JobConfig;

/// tokio workers per service: the services wait on NATS; the tensor work runs on their own threads.
const TOKIO_THREADS_PER_SERVICE: usize = 2;

/// `section.key=value` overrides for every `*_threads` key the job leaves null: the host's `cores` shared evenly
/// between the torch processes (the trainer's ranks on this host and `rollout.workers` workers), unless
/// `OMP_NUM_THREADS` is set (then torch reads it in each process), and [`TOKIO_THREADS_PER_SERVICE`] tokio workers
/// per service.
pub fn job_thread_overrides(cfg: &JobConfig, cores: usize, omp_num_threads_set: bool) -> Vec<String> {
    let torch_processes = cfg.trainer.n_gpus_per_node.max(1) as usize + cfg.rollout.workers.max(1) as usize;
    let torch_share = (cores / torch_processes).max(1);
    let tokio = TOKIO_THREADS_PER_SERVICE.min(cores).max(1);
    let mut overrides = Vec::new();
    let mut default = |key: &str, value: Option<u32>, default: usize| {
        if value.is_none() {
            overrides.push(format!("{key}={default}"));
        }
    };
    if !omp_num_threads_set {
        default("trainer.torch_threads", cfg.trainer.torch_threads, torch_share);
        default("rollout.torch_threads", cfg.rollout.torch_threads, torch_share);
    }
    default("trainer.tokio_threads", cfg.trainer.tokio_threads, tokio);
    default("rollout.tokio_threads", cfg.rollout.tokio_threads, tokio);
    default("reward.tokio_threads", cfg.reward.tokio_threads, tokio);
    default("buffer.tokio_threads", cfg.buffer.tokio_threads, tokio);
    default("checkpoint.tokio_threads", cfg.checkpoint.tokio_threads, tokio);
    overrides
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn job(overrides: &[&str]) -> JobConfig {
        let mut all = vec!["data.task={name: copy}".to_string()];
        all.extend(overrides.iter().map(|s| s.to_string()));
        JobConfig::load(None, &all).unwrap()
    }

    #[test]
    fn cores_are_shared_between_the_trainer_and_the_rollout_workers() {
        let overrides = job_thread_overrides(&job(&["rollout.workers=3"]), 16, false);
        assert!(overrides.contains(&"trainer.torch_threads=4".to_string()), "{overrides:?}");
        assert!(overrides.contains(&"rollout.torch_threads=4".to_string()), "{overrides:?}");
        for section in ["trainer", "rollout", "reward", "buffer", "checkpoint"] {
            assert!(overrides.contains(&format!("{section}.tokio_threads=2")), "{section}: {overrides:?}");
        }
        // the overrides load: each service gets exactly these values
        let cfg = job(&overrides.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(cfg.rollout.torch_threads, Some(4));
    }

    #[test]
    fn a_small_host_still_gives_every_process_one_thread() {
        let overrides = job_thread_overrides(&job(&["rollout.workers=2"]), 1, false);
        assert!(overrides.contains(&"trainer.torch_threads=1".to_string()), "{overrides:?}");
        assert!(overrides.contains(&"reward.tokio_threads=1".to_string()), "{overrides:?}");
    }

    #[test]
    fn keys_the_job_sets_and_omp_num_threads_are_respected() {
        let overrides = job_thread_overrides(&job(&["trainer.torch_threads=6", "reward.tokio_threads=8"]), 16, false);
        assert!(!overrides.iter().any(|o| o.starts_with("trainer.torch_threads")), "{overrides:?}");
        assert!(!overrides.iter().any(|o| o.starts_with("reward.tokio_threads")), "{overrides:?}");
        assert!(overrides.contains(&"rollout.torch_threads=8".to_string()), "{overrides:?}");
        let with_omp = job_thread_overrides(&job(&[]), 16, true);
        assert!(!with_omp.iter().any(|o| o.contains("torch_threads")), "{with_omp:?}");
    }
}

//! Which GPUs `jetrl run` gives the trainer's ranks and the rollout workers of this host, said at start-up.
//!
//! Trainer rank `r` takes GPU `r mod trainer.n_gpus_per_node` (the trainer's own rule; a trainer of one rank stays
//! on the device `model.device` names). Each rollout worker is
//! started with `CUDA_VISIBLE_DEVICES` naming its GPU and `model.device=cuda:0`, the way the systemd units and the
//! compose GPU files pin them. Where the workers go:
//! - `Separate`: on GPUs of their own, the first ones the ranks leave: verl's fully-async recipe
//!   (`rollout.n_gpus_per_node`), or a jetrl job on a host with GPUs to spare;
//! - `Colocated`: worker `i` on the GPU of rank `i`: verl's hybrid engine (`trainer.n_gpus_per_node` GPUs that
//!   both train and roll out), and `colocate_async` (its one worker on rank 0's GPU).

use jetrl_config::{DeviceSpec, JobConfig, RolloutName, TrainerMode};

/// Where the rollout workers go relative to the trainer's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// separate GPUs when the host has enough for ranks and workers, else on the ranks' GPUs (jetrl's own jobs)
    Auto,
    /// on the trainer ranks' GPUs (verl's hybrid engine)
    Colocated,
    /// on GPUs of their own (verl's `rollout.n_gpus_per_node`)
    Separate,
}

/// The GPUs of this host's services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLayout {
    /// GPU of each of this host's trainer ranks (local rank order)
    pub trainer: Vec<usize>,
    /// GPUs of each rollout worker: one, or `rollout.tensor_model_parallel_size` for a vLLM worker
    pub workers: Vec<Vec<usize>>,
}

impl GpuLayout {
    /// The start-up line: what runs where.
    pub fn describe(&self) -> String {
        let shared = self.workers.iter().filter(|w| w.iter().any(|g| self.trainer.contains(g))).count();
        let how = if shared == 0 {
            "on GPUs of their own".to_string()
        } else if shared == self.workers.len() {
            "sharing the trainer's GPUs (verl's hybrid engine layout)".to_string()
        } else {
            format!("{shared} of them on the trainer's GPUs")
        };
        let workers: Vec<String> =
            self.workers.iter().map(|w| w.iter().map(usize::to_string).collect::<Vec<_>>().join("+")).collect();
        format!(
            "GPU layout: trainer ranks on GPU {}; rollout workers on GPU {} ({how})",
            list(&self.trainer),
            workers.join(", ")
        )
    }
}

fn list(gpus: &[usize]) -> String {
    gpus.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// The layout of a job whose model runs on CUDA with `visible` GPUs here; `None` on the CPU (and for `auto`
/// without a GPU). An error when the GPUs cannot hold what the job asks for.
pub fn plan(cfg: &JobConfig, visible: usize, placement: Placement) -> Result<Option<GpuLayout>, String> {
    let index = match cfg.model.device {
        DeviceSpec::Cpu => return Ok(None),
        DeviceSpec::Cuda(index) => index,
        DeviceSpec::Auto if visible > 0 => 0,
        DeviceSpec::Auto => return Ok(None),
    };
    let ranks = cfg.trainer.n_gpus_per_node as usize;
    let workers = cfg.rollout.workers.max(1) as usize;
    // a vLLM worker spans rollout.tensor_model_parallel_size GPUs; jetrl's engine one
    let per =
        if cfg.rollout.name == RolloutName::Vllm { cfg.rollout.tensor_model_parallel_size.max(1) as usize } else { 1 };
    // several ranks take GPUs 0..n_gpus_per_node; a trainer of one rank stays on the device the job names
    let world = ranks * cfg.trainer.nnodes as usize;
    let trainer: Vec<usize> = if world > 1 { (0..ranks).collect() } else { vec![index] };
    let groups = |gpus: &[usize], n: usize| gpus.chunks(per).take(n).map(<[usize]>::to_vec).collect::<Vec<_>>();
    if cfg.trainer.mode == TrainerMode::ColocateAsync {
        if per > trainer.len() {
            return Err(format!(
                "rollout.tensor_model_parallel_size={per}: colocate_async puts its worker on the trainer's GPUs, and \
                 the trainer has {}",
                trainer.len()
            ));
        }
        return Ok(Some(GpuLayout { workers: groups(&trainer, 1), trainer }));
    }
    let need = workers * per;
    let separate = match placement {
        Placement::Separate => true,
        Placement::Colocated => false,
        Placement::Auto => trainer.len() + need <= visible,
    };
    if separate {
        if trainer.len() + need > visible {
            return Err(format!(
                "rollout.workers={workers} workers of {per} GPU(s) each, on GPUs of their own beside \
                 trainer.n_gpus_per_node={ranks} ranks, need {} GPUs; {visible} are visible here",
                trainer.len() + need
            ));
        }
        let spare: Vec<usize> = (0..visible).filter(|g| !trainer.contains(g)).collect();
        return Ok(Some(GpuLayout { workers: groups(&spare, workers), trainer }));
    }
    if need > trainer.len() {
        return Err(format!(
            "rollout.workers={workers} workers of {per} GPU(s) each would share trainer.n_gpus_per_node={ranks} GPUs \
             with the trainer's ranks and only {visible} GPUs are visible: run at most {} workers, or give them GPUs \
             of their own",
            trainer.len() / per
        ));
    }
    Ok(Some(GpuLayout { workers: groups(&trainer, workers), trainer }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(overrides: &[&str]) -> JobConfig {
        let overrides: Vec<String> = ["data.task.name=copy"].iter().chain(overrides).map(|s| s.to_string()).collect();
        JobConfig::load(None, &overrides).expect("job")
    }

    const EIGHT_RANKS: [&str; 3] = ["model.device=cuda", "trainer.n_gpus_per_node=8", "data.train_batch_size=64"];

    #[test]
    fn verls_hybrid_engine_puts_one_worker_on_each_trainer_gpu() {
        let cfg = job(&[&EIGHT_RANKS[..], &["rollout.workers=8"]].concat());
        let layout = plan(&cfg, 8, Placement::Colocated).unwrap().unwrap();
        assert_eq!(layout.trainer, (0..8).collect::<Vec<_>>());
        assert_eq!(layout.workers, (0..8).map(|g| vec![g]).collect::<Vec<_>>());
        assert!(layout.describe().contains("sharing the trainer's GPUs"), "{}", layout.describe());
    }

    #[test]
    fn verls_fully_async_rollout_gpus_come_after_the_trainers() {
        let cfg =
            job(&["model.device=cuda", "trainer.n_gpus_per_node=4", "data.train_batch_size=64", "rollout.workers=4"]);
        let layout = plan(&cfg, 8, Placement::Separate).unwrap().unwrap();
        assert_eq!((layout.trainer, layout.workers), (vec![0, 1, 2, 3], vec![vec![4], vec![5], vec![6], vec![7]]));
        let err = plan(&cfg, 6, Placement::Separate).unwrap_err();
        assert!(err.contains("need 8 GPUs; 6 are visible"), "{err}");
    }

    #[test]
    fn a_jetrl_job_uses_spare_gpus_first_and_shares_the_ranks_gpus_when_there_are_none() {
        let cfg = job(&["model.device=cuda", "rollout.workers=2"]);
        assert_eq!(plan(&cfg, 4, Placement::Auto).unwrap().unwrap().workers, [[1], [2]]);
        let shared = job(&[&EIGHT_RANKS[..], &["rollout.workers=2"]].concat());
        assert_eq!(plan(&shared, 8, Placement::Auto).unwrap().unwrap().workers, [[0], [1]]);
        let too_many = job(&["model.device=cuda", "rollout.workers=3"]);
        assert!(plan(&too_many, 2, Placement::Auto).unwrap_err().contains("at most 1 workers"));
        // one rank on the GPU the job names; the workers take the others
        let named = job(&["model.device=cuda:1", "rollout.workers=2"]);
        let layout = plan(&named, 3, Placement::Auto).unwrap().unwrap();
        assert_eq!((layout.trainer, layout.workers), (vec![1], vec![vec![0], vec![2]]));
    }

    /// What `jetrl run --verl` passes: the fully-async recipe's `rollout.n_gpus_per_node` is the number of workers
    /// and marks them as apart from the trainer's GPUs.
    #[test]
    fn verls_rollout_n_gpus_per_node_names_the_workers_and_their_own_gpus() {
        let args: Vec<String> = [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.n_gpus_per_node=4",
            "rollout.n_gpus_per_node=4",
        ]
        .map(String::from)
        .to_vec();
        let job = jetrl_config::load_verl(None, &args).expect("verl job");
        assert_eq!(job.verl_key("rollout.workers"), "rollout.n_gpus_per_node");
        let cfg = job.typed().expect("typed");
        assert_eq!(cfg.rollout.workers, 4);
        let layout = plan(&cfg, 8, Placement::Separate).unwrap().unwrap();
        assert_eq!(layout.workers, [[4], [5], [6], [7]]);
    }

    /// verl's hybrid engine with vLLM at tensor parallel 2: 8 GPUs, 4 servers of 2 GPUs each (verl's replicas).
    #[test]
    fn vllm_workers_span_tensor_parallel_gpus() {
        let args: Vec<String> = [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        ]
        .map(String::from)
        .to_vec();
        let job = jetrl_config::load_verl(None, &args).and_then(|j| j.with_hybrid_workers()).expect("verl job");
        let cfg = job.typed().expect("typed");
        assert_eq!(cfg.rollout.workers, 4);
        let layout = plan(&cfg, 8, Placement::Colocated).unwrap().unwrap();
        assert_eq!(layout.workers, [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert!(layout.describe().contains("GPU 0+1, 2+3, 4+5, 6+7"), "{}", layout.describe());
    }

    #[test]
    fn colocate_async_puts_its_worker_on_rank_zeros_gpu_and_the_cpu_has_no_layout() {
        let cfg = job(&[
            "model.device=cuda",
            "trainer.mode=colocate_async",
            "trainer.colocate_async.rollout_instance=rollout-0",
        ]);
        assert_eq!(plan(&cfg, 2, Placement::Auto).unwrap().unwrap().workers, [[0]]);
        assert_eq!(plan(&job(&["model.device=cpu"]), 8, Placement::Auto), Ok(None));
        assert_eq!(plan(&job(&["model.device=auto"]), 0, Placement::Auto), Ok(None));
    }
}

//! One rank of a data-parallel training run on fixed synthetic batches, without NATS: the learner of the
//! trainer's ranks (`Actor` over a c10d group, Gloo on the CPU) and nothing else. `tests/data_parallel.rs` starts
//! one or two of these and compares what they end with; `just bench dp` times them.
//!
//! Every rank builds the same batches (4 prompt groups of 4 trajectories per step, from the step number), keeps
//! the rows `ranks::balance` gives it, and trains. With `--out` rank 0 writes the final actor weights
//! (`weights.safetensors`) and every rank its per-step metrics and optimizer state bytes (`rank<r>.json`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use jetrl_config::JobConfig;
use jetrl_trainer::actor::{Actor, ActorState, OldPolicy, RankBatch, RowInfo, Sample};
use jetrl_trainer::checkpoint;
use jetrl_trainer::ranks::{self, RankPlan};
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(Parser)]
#[command(about = "one rank of a data-parallel training run on synthetic batches (a test and bench helper)")]
struct Args {
    #[arg(long)]
    rank: u32,
    #[arg(long)]
    world: u32,
    /// the store port (rank 0 hosts it on 127.0.0.1)
    #[arg(long, default_value_t = 29500)]
    port: u16,
    /// an HF model directory
    #[arg(long)]
    model: PathBuf,
    /// train steps `start..=end`
    #[arg(long, default_value_t = 1)]
    start: u64,
    #[arg(long)]
    end: u64,
    /// the LR schedules' horizon
    #[arg(long, default_value_t = 8)]
    horizon: u64,
    /// train a critic too (GAE), as PPO does
    #[arg(long)]
    critic: bool,
    /// rows per step: prompt groups of 4
    #[arg(long, default_value_t = 4)]
    groups: usize,
    /// response tokens of the longest row
    #[arg(long, default_value_t = 6)]
    max_response: usize,
    /// write a checkpoint into `<out>/ckpt` after this step
    #[arg(long)]
    save_at: Option<u64>,
    /// resume from this checkpoint directory (as `--save-at` wrote it)
    #[arg(long)]
    resume: Option<PathBuf>,
    /// where to write what the run ended with
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    threads: i32,
}

/// The fixed batch of a step: prompt groups of 4 trajectories, lengths varying, scores in [0, 1].
fn batch(step: u64, groups: usize, max_response: usize) -> Vec<Sample> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1000 + step);
    let mut out = Vec::new();
    for g in 0..groups {
        let uid = format!("s{step}g{g}");
        let prompt: Vec<u32> = (0..rng.gen_range(3..7)).map(|_| rng.gen_range(3..60)).collect();
        for session in 0..4 {
            let len = rng.gen_range(2..=max_response.max(2));
            let response: Vec<u32> = (0..len).map(|_| rng.gen_range(3..60)).collect();
            out.push(Sample {
                key: format!("{uid}_{session}_0"),
                uid: uid.clone(),
                prompt: prompt.clone(),
                response,
                response_mask: vec![1; len],
                rollout_logprobs: (0..len).map(|_| -rng.gen_range(3.5f32..4.5)).collect(),
                score: f64::from(rng.gen_range(0..=4u8)) / 4.0,
                ..Sample::default()
            });
        }
    }
    out
}

/// Every piece of state that must agree across ranks in play: shuffled mini-batches of 2 groups split into
/// micro-batches, warmup + cosine LR, weight decay, an entropy bonus, KL loss and an adaptive in-reward KL against
/// the reference; with `critic`, GAE, a critic with warm-up and token-level rollout correction.
fn config(args: &Args) -> JobConfig {
    let mut cfg = JobConfig::default();
    cfg.model.path = args.model.display().to_string();
    cfg.run.seed = 5;
    cfg.rollout.temperature = 0.9;
    cfg.actor.optim.lr = 1e-3;
    cfg.actor.optim.weight_decay = 0.01;
    cfg.actor.optim.lr_warmup_steps = Some(1);
    cfg.actor.optim.lr_scheduler_type = jetrl_config::LrSchedulerType::Cosine;
    cfg.actor.optim.min_lr_ratio = 0.1;
    cfg.actor.ppo_mini_batch_size = Some(2);
    cfg.actor.ppo_epochs = 2;
    cfg.actor.shuffle = true;
    cfg.actor.ppo_max_token_len = 30;
    cfg.actor.entropy_coeff = 0.01;
    cfg.actor.use_kl_loss = true;
    cfg.algorithm.use_kl_in_reward = true;
    cfg.algorithm.kl_ctrl.kind = jetrl_config::KlCtrlType::Adaptive;
    cfg.algorithm.kl_ctrl.kl_coef = 0.05;
    if args.critic {
        cfg.algorithm.adv_estimator = jetrl_config::AdvantageEstimator::Gae;
        cfg.algorithm.lam = 0.95;
        cfg.critic.optim.lr = 1e-3;
        cfg.trainer.critic_warmup = 2;
        cfg.algorithm.rollout_correction = Some(jetrl_config::RolloutCorrectionConfig {
            rollout_is: Some(jetrl_config::RolloutIsLevel::Token),
            ..Default::default()
        });
    }
    cfg.trainer.n_gpus_per_node = args.world;
    cfg.trainer.dist.rank = args.rank;
    cfg.trainer.dist.master_port = args.port;
    cfg.trainer.dist.timeout_s = 60.0;
    cfg
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    jetrl_model::set_torch_threads(Some(args.threads.max(1) as usize), Some(1));
    let cfg = config(&args);
    let plan = RankPlan::of(&cfg);
    let comm = ranks::join(&cfg, &plan).context("joining the group")?;
    let state: Option<ActorState> = match &args.resume {
        Some(dir) => Some(checkpoint::read_json(&dir.join("actor_state.json"))?),
        None => None,
    };
    let resume = args.resume.as_deref().zip(state.as_ref());
    let mut actor = Actor::new(&cfg, args.horizon, resume, comm.clone())?;
    let mut steps = Vec::new();
    for step in args.start..=args.end {
        let samples = batch(step, args.groups, args.max_response);
        let owner = ranks::balance(&samples, plan.world);
        let rows: Vec<RowInfo> = samples.iter().map(RowInfo::of).collect();
        let local = samples.into_iter().enumerate().filter(|(i, _)| owner[*i] == plan.rank).collect();
        let started = Instant::now();
        let out = actor.train(&RankBatch { rows, local }, step, OldPolicy::Current)?;
        steps.push(json!({"step": step, "seconds": started.elapsed().as_secs_f64(), "metrics": out.metrics}));
        if args.save_at == Some(step) {
            let dir = args.out.as_ref().context("--save-at needs --out")?.join("ckpt");
            let state = actor.save_checkpoint(&dir)?;
            comm.barrier()?;
            if plan.rank == 0 {
                checkpoint::write_json(&dir.join("actor_state.json"), &state)?;
            }
        }
    }
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        if plan.rank == 0 {
            let weights: Vec<(String, tch::Tensor)> = actor.model().parameters().into_iter().collect();
            checkpoint::write_tensors(&out.join("weights.safetensors"), &weights)?;
        }
        let report = json!({
            "rank": plan.rank,
            "world": plan.world,
            "optimizer_state_bytes": actor.optimizer_state_bytes(),
            "parameters": actor.model().parameters().values().map(|t| t.numel()).sum::<usize>(),
            "steps": steps,
        });
        std::fs::write(out.join(format!("rank{}.json", plan.rank)), serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

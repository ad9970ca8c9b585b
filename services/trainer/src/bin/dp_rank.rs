//! One rank of a data-parallel training run on fixed synthetic batches, without NATS: the learner of the
//! trainer's ranks (`Actor` over a c10d group, Gloo on the CPU) and nothing else. `tests/data_parallel.rs` starts
//! one or two of these and compares what they end with; `just bench dp` times them.
//!
//! Every rank builds the same batches (`jetrl_trainer::synthetic`: prompt groups of 4 trajectories per step), keeps
//! the rows `ranks::balance` gives it, and trains. With `--out` rank 0 writes the final actor weights
//! (`weights.safetensors`) and every rank its per-step metrics and optimizer state bytes (`rank<r>.json`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use jetrl_config::JobConfig;
use jetrl_trainer::actor::{Actor, OldPolicy};
use jetrl_trainer::batch::{RankBatch, RowInfo};
use jetrl_trainer::checkpoint;
use jetrl_trainer::checkpoint::ActorState;
use jetrl_trainer::ranks::{self, RankPlan};
use jetrl_trainer::synthetic;
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
    /// responses are shorter than this
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

fn config(args: &Args) -> JobConfig {
    let mut cfg = synthetic::job_config(&args.model, args.critic);
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
        let samples = synthetic::batch(step, args.groups, args.max_response);
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

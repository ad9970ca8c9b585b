//! The jetrl side of `just bench rollout_engine`: sampled decoding throughput of [`jetrl_model::Engine`] on a
//! tiny model, with the same prompts, batch and lengths the HF `generate` reference uses
//! (`benches/rollout_engine/`).
//!
//! ```text
//! rollout_engine_bench prepare DIR [--groups G] [--prompt-len P] [--seed S]    # model + prompts.json in DIR
//! rollout_engine_bench run DIR --workload grpo|fixed [--n N] [--new-tokens T] [--reps R] [--threads K]
//! ```
//!
//! Workloads (batch = G prompts × N samples, temperature 1, top-k and top-p off):
//! - `grpo`: a GRPO rollout — every sequence ends at EOS or at T tokens; tokens counted through the EOS.
//! - `fixed`: every sequence runs exactly T tokens (EOS ignored): decode speed alone.
//!
//! Prints one JSON line with the median tokens/s over the repetitions.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use jetrl_model::{init_model, CausalLm, DType, Engine, EngineConfig, Request, Sampling, Tokenizer};
use rand::{Rng, SeedableRng};
use tch::Device;

struct Args {
    command: String,
    dir: PathBuf,
    workload: String,
    groups: usize,
    n: usize,
    prompt_len: usize,
    new_tokens: usize,
    reps: usize,
    threads: i32,
    seed: u64,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("usage: rollout_engine_bench prepare|run DIR [options]")?;
    let dir = PathBuf::from(it.next().ok_or("missing DIR")?);
    let mut args = Args {
        command,
        dir,
        workload: "grpo".into(),
        groups: 4,
        n: 8,
        prompt_len: 32,
        new_tokens: 128,
        reps: 3,
        threads: 0,
        seed: 1,
    };
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--workload" => args.workload = value,
            "--groups" => args.groups = number(&value)?.max(1) as usize,
            "--n" => args.n = number(&value)?.max(1) as usize,
            "--prompt-len" => args.prompt_len = number(&value)?.max(1) as usize,
            "--new-tokens" => args.new_tokens = number(&value)?.max(1) as usize,
            "--reps" => args.reps = number(&value)?.max(1) as usize,
            "--threads" => args.threads = number(&value)? as i32,
            "--seed" => args.seed = number(&value)?,
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

/// Writes the tiny model and `prompts.json`: random ids of ordinary tokens (ids 0..3 are the special tokens of
/// the character vocabulary).
fn prepare(args: &Args) -> Result<(), String> {
    init_model("tiny", &args.dir, args.seed).map_err(|e| e.to_string())?;
    let model = CausalLm::load(&args.dir, Device::Cpu, DType::F32).map_err(|e| e.to_string())?;
    let vocab = model.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let prompts: Vec<Vec<u32>> =
        (0..args.groups).map(|_| (0..args.prompt_len).map(|_| rng.gen_range(3..vocab)).collect()).collect();
    let path = args.dir.join("prompts.json");
    std::fs::write(&path, serde_json::to_string(&prompts).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn read_prompts(dir: &Path) -> Result<Vec<Vec<u32>>, String> {
    let path = dir.join("prompts.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn run(args: &Args) -> Result<(), String> {
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    let ignore_eos = match args.workload.as_str() {
        "grpo" => false,
        "fixed" => true,
        other => return Err(format!("unknown workload {other} (grpo, fixed)")),
    };
    let prompts = read_prompts(&args.dir)?;
    let model = CausalLm::load(&args.dir, Device::Cpu, DType::F32).map_err(|e| e.to_string())?;
    let eos = Tokenizer::from_dir(&args.dir).map_err(|e| e.to_string())?.eos_token_ids().to_vec();
    let config = EngineConfig {
        max_num_seqs: prompts.len() * args.n,
        max_model_len: prompts.iter().map(Vec::len).max().unwrap_or(0) + args.new_tokens,
        seed: args.seed,
        eos_token_ids: eos,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, config).map_err(|e| e.to_string())?;
    let sampling = Sampling { temperature: 1.0, max_tokens: args.new_tokens, ignore_eos, ..Sampling::default() };
    let mut next_id = 0u64;
    let mut run_once = |max_tokens: usize| -> Result<(usize, f64), String> {
        let started = Instant::now();
        for prompt in &prompts {
            let request = Request::new(prompt.clone(), args.n, Sampling { max_tokens, ..sampling.clone() });
            engine.add_request(next_id, request).map_err(|e| e.to_string())?;
            next_id += 1;
        }
        let outs = engine.run_to_completion().map_err(|e| e.to_string())?;
        Ok((outs.iter().map(|o| o.tokens.len()).sum(), started.elapsed().as_secs_f64()))
    };
    run_once(8)?; // warm-up
    let mut rates = Vec::with_capacity(args.reps);
    let mut tokens = Vec::with_capacity(args.reps);
    for _ in 0..args.reps {
        let (n, seconds) = run_once(args.new_tokens)?;
        tokens.push(n);
        rates.push(n as f64 / seconds);
    }
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "impl": "jetrl",
            "workload": args.workload,
            "tok_per_s": sorted[sorted.len() / 2],
            "rates": rates,
            "tokens_per_rep": tokens,
            "batch": prompts.len() * args.n,
            "new_tokens": args.new_tokens,
            "threads": tch::get_num_threads(),
        })
    );
    Ok(())
}

fn main() -> ExitCode {
    let result = parse().and_then(|args| match args.command.as_str() {
        "prepare" => prepare(&args),
        "run" => run(&args),
        other => Err(format!("unknown command {other} (prepare, run)")),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("rollout_engine_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

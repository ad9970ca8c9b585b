//! The jetrl side of `just bench rollout_engine`: sampled decoding throughput of [`jetrl_model::Engine`] on a
//! tiny model, with the same prompts, batch and lengths the HF `generate` reference uses
//! (`benches/rollout_engine/`).
//!
//! ```text
//! rollout_engine_bench prepare DIR [--groups G] [--prompt-len P] [--seed S] [SHAPE]   # model + prompts.json
//! rollout_engine_bench run DIR --workload grpo|fixed [--n N] [--new-tokens T] [--reps R] [--threads K]
//!                          [--device cpu|cuda|cuda:N] [--dtype f32|bf16] [--enforce-eager 1]
//! rollout_engine_bench check DIR [--n N] [--new-tokens T] [--device D] [--dtype T]    # graph against eager
//! rollout_engine_bench score DIR --samples FILE                                         # log-probs against f32
//! ```
//!
//! `run --dump FILE` writes the last repetition's samples as JSON lines `{"prompt", "tokens", "logprobs"}` (the
//! vLLM side, `vllm_generate.py`, writes the same); `score` recomputes every sample's log-probs with the training
//! forward in float32 and prints the largest and the mean difference (the trainer scoring the rollout's tokens).
//!
//! `prepare` writes the `tiny` preset unless SHAPE is given: `--hidden H --layers L --heads A --kv-heads K
//! --intermediate I --vocab V` (a random-init Qwen2 of that shape, EOS id 2, no tokenizer: the prompts are ids).
//!
//! Workloads (batch = G prompts × N samples, temperature 1, top-k and top-p off):
//! - `grpo`: a GRPO rollout — every sequence ends at EOS or at T tokens; tokens counted through the EOS.
//! - `fixed`: every sequence runs exactly T tokens (EOS ignored): decode speed alone.
//!
//! `run` prints one JSON line with the median tokens/s over the repetitions (a warm-up run first, not counted) and
//! the median milliseconds per decode step. `check` samples the same seeded requests with the engine's default
//! decode (CUDA graphs on a GPU) and with `enforce_eager`, and prints whether the tokens match, the largest
//! log-prob difference between the two, and the largest difference between the engine's log-probs and the
//! training forward's recomputation (on the CPU both sides are eager: the check shows the comparison runs).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use jetrl_model::{
    init_model, log_probs_of, parse_device, CausalLm, DType, Engine, EngineConfig, ModelConfig, Request, Sampling,
    SequenceOutput, Tokenizer,
};
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
    device: String,
    dtype: String,
    enforce_eager: bool,
    /// hidden, layers, heads, kv heads, intermediate, vocab (0: the `tiny` preset)
    shape: [i64; 6],
    /// `run`: where the last repetition's samples go; `score`: the samples to score
    samples: Option<PathBuf>,
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
        device: "cpu".into(),
        dtype: "f32".into(),
        enforce_eager: false,
        shape: [0; 6],
        samples: None,
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
            "--device" => args.device = value,
            "--dtype" => args.dtype = value,
            "--enforce-eager" => args.enforce_eager = number(&value)? != 0,
            "--hidden" => args.shape[0] = number(&value)? as i64,
            "--layers" => args.shape[1] = number(&value)? as i64,
            "--heads" => args.shape[2] = number(&value)? as i64,
            "--kv-heads" => args.shape[3] = number(&value)? as i64,
            "--intermediate" => args.shape[4] = number(&value)? as i64,
            "--vocab" => args.shape[5] = number(&value)? as i64,
            "--dump" | "--samples" => args.samples = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

/// Writes the model (the tiny preset, or a random-init Qwen2 of the given shape) and `prompts.json`: random ids
/// of ordinary tokens (ids 0..3 are the special tokens of the character vocabulary).
fn prepare(args: &Args) -> Result<(), String> {
    if args.shape == [0; 6] {
        init_model("tiny", &args.dir, args.seed).map_err(|e| e.to_string())?;
    } else {
        write_shaped_model(args)?;
    }
    let config_path = args.dir.join("config.json");
    let config = std::fs::read_to_string(&config_path).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&config).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let vocab = config["vocab_size"].as_u64().ok_or("config.json has no vocab_size")? as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let prompts: Vec<Vec<u32>> =
        (0..args.groups).map(|_| (0..args.prompt_len).map(|_| rng.gen_range(3..vocab)).collect()).collect();
    let path = args.dir.join("prompts.json");
    std::fs::write(&path, serde_json::to_string(&prompts).map_err(|e| e.to_string())?)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// A random-init Qwen2 of `args.shape` (every dimension required), saved in f32 with a generation config naming
/// its EOS, which both sides of the bench read.
fn write_shaped_model(args: &Args) -> Result<(), String> {
    let [hidden, layers, heads, kv_heads, intermediate, vocab] = args.shape;
    if args.shape.contains(&0) {
        return Err("a shape needs all of --hidden --layers --heads --kv-heads --intermediate --vocab".into());
    }
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": true,
        "use_sliding_window": false,
        "eos_token_id": 2,
        "dtype": "float32",
    });
    let config = ModelConfig::from_json(config).map_err(|e| e.to_string())?;
    tch::manual_seed(args.seed as i64);
    let model = CausalLm::random(config, Device::Cpu, DType::F32, 0.02).map_err(|e| e.to_string())?;
    model.save(&args.dir).map_err(|e| e.to_string())?;
    let generation = serde_json::json!({ "eos_token_id": [2], "pad_token_id": 0 });
    let path = args.dir.join("generation_config.json");
    std::fs::write(&path, generation.to_string()).map_err(|e| format!("{}: {e}", path.display()))
}

/// EOS ids: the tokenizer's, or (a shaped model has none) the generation config's.
fn eos_ids(dir: &Path) -> Result<Vec<u32>, String> {
    if dir.join("tokenizer.json").exists() {
        return Ok(Tokenizer::from_dir(dir).map_err(|e| e.to_string())?.eos_token_ids().to_vec());
    }
    let path = dir.join("generation_config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(value["eos_token_id"].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as u32).collect())
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
    let device = parse_device(&args.device).map_err(|e| e.to_string())?;
    let dtype: DType = args.dtype.parse().map_err(|e: jetrl_model::ModelError| e.to_string())?;
    let model = CausalLm::load(&args.dir, device, dtype).map_err(|e| e.to_string())?;
    let eos = eos_ids(&args.dir)?;
    let config = EngineConfig {
        max_num_seqs: prompts.len() * args.n,
        max_model_len: prompts.iter().map(Vec::len).max().unwrap_or(0) + args.new_tokens,
        seed: args.seed,
        eos_token_ids: eos,
        enforce_eager: args.enforce_eager,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, config).map_err(|e| e.to_string())?;
    let sampling = Sampling { temperature: 1.0, max_tokens: args.new_tokens, ignore_eos, ..Sampling::default() };
    let mut next_id = 0u64;
    let mut last: Vec<(Vec<u32>, SequenceOutput)> = Vec::new();
    let mut run_once = |max_tokens: usize| -> Result<(usize, f64, u64), String> {
        let started = Instant::now();
        let first_id = next_id;
        for prompt in &prompts {
            let request = Request::new(prompt.clone(), args.n, Sampling { max_tokens, ..sampling.clone() });
            engine.add_request(next_id, request).map_err(|e| e.to_string())?;
            next_id += 1;
        }
        let steps_before = engine.stats().steps;
        let outs = engine.run_to_completion().map_err(|e| e.to_string())?;
        let steps = engine.stats().steps - steps_before;
        let tokens = outs.iter().map(|o| o.tokens.len()).sum();
        let seconds = started.elapsed().as_secs_f64();
        last = outs.into_iter().map(|o| (prompts[(o.request - first_id) as usize].clone(), o)).collect();
        Ok((tokens, seconds, steps))
    };
    // warm-up at full length: on CUDA it captures the decode graphs every later run replays
    run_once(args.new_tokens)?;
    let mut rates = Vec::with_capacity(args.reps);
    let mut tokens = Vec::with_capacity(args.reps);
    let mut step_ms = Vec::with_capacity(args.reps);
    for _ in 0..args.reps {
        let (n, seconds, steps) = run_once(args.new_tokens)?;
        tokens.push(n);
        rates.push(n as f64 / seconds);
        step_ms.push(1000.0 * seconds / steps.max(1) as f64);
    }
    if let Some(path) = &args.samples {
        let lines: Vec<String> = last
            .iter()
            .map(|(prompt, o)| {
                serde_json::json!({"prompt": prompt, "tokens": o.tokens, "logprobs": o.logprobs}).to_string()
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let stats = engine.stats();
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    step_ms.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "impl": "jetrl",
            "workload": args.workload,
            "tok_per_s": sorted[sorted.len() / 2],
            "ms_per_step": step_ms[step_ms.len() / 2],
            "rates": rates,
            "cuda_graphs": stats.graphs,
            "padded_slot_share": 1.0 - stats.decoded_rows as f64 / stats.decoded_slots.max(1) as f64,
            "tokens_per_rep": tokens,
            "batch": prompts.len() * args.n,
            "new_tokens": args.new_tokens,
            "threads": tch::get_num_threads(),
            "device": args.device,
            "dtype": args.dtype,
            "enforce_eager": args.enforce_eager,
        })
    );
    Ok(())
}

/// One seeded GRPO-shaped rollout of every prompt (`--n` samples, `--new-tokens` at most, EOS honoured) with
/// the default decode and with `enforce_eager`; see the module comment.
fn check(args: &Args) -> Result<(), String> {
    let prompts = read_prompts(&args.dir)?;
    let device = parse_device(&args.device).map_err(|e| e.to_string())?;
    let dtype: DType = args.dtype.parse().map_err(|e: jetrl_model::ModelError| e.to_string())?;
    let eos = eos_ids(&args.dir)?;
    let sample = |enforce_eager: bool| -> Result<(Vec<SequenceOutput>, Engine), String> {
        let model = CausalLm::load(&args.dir, device, dtype).map_err(|e| e.to_string())?;
        let config = EngineConfig {
            max_num_seqs: prompts.len() * args.n,
            max_model_len: prompts.iter().map(Vec::len).max().unwrap_or(0) + args.new_tokens,
            seed: args.seed,
            eos_token_ids: eos.clone(),
            enforce_eager,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(model, config).map_err(|e| e.to_string())?;
        for (i, prompt) in prompts.iter().enumerate() {
            let sampling = Sampling { temperature: 1.0, max_tokens: args.new_tokens, ..Sampling::default() };
            engine.add_request(i as u64, Request::new(prompt.clone(), args.n, sampling)).map_err(|e| e.to_string())?;
        }
        let mut outs = engine.run_to_completion().map_err(|e| e.to_string())?;
        outs.sort_by_key(|o| (o.request, o.index));
        Ok((outs, engine))
    };
    let (graph, engine) = sample(false)?;
    let graphs = engine.stats().graphs;
    let (eager, _) = sample(true)?;
    let same_tokens = graph.iter().zip(&eager).filter(|(a, b)| a.tokens == b.tokens).count();
    // log-probs compared over the common prefix of each pair (a bf16 tie can fork two samples)
    let mut graph_vs_eager = 0f32;
    for (a, b) in graph.iter().zip(&eager) {
        for (x, y) in a.logprobs.iter().zip(&b.logprobs).take(common_prefix(&a.tokens, &b.tokens)) {
            graph_vs_eager = graph_vs_eager.max((x - y).abs());
        }
    }
    let mut vs_trainer = 0f32;
    for out in graph.iter().take(8) {
        let context: Vec<u32> = prompts[out.request as usize].iter().chain(&out.tokens).copied().collect();
        let recomputed = log_probs_of(engine.model(), &context).map_err(|e| e.to_string())?;
        let tail = &recomputed[recomputed.len() - out.tokens.len()..];
        for (x, y) in out.logprobs.iter().zip(tail) {
            vs_trainer = vs_trainer.max((x - y).abs());
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "check": "graph_vs_eager",
            "device": args.device,
            "dtype": args.dtype,
            "cuda_graphs": graphs,
            "sequences": graph.len(),
            "same_tokens": same_tokens,
            "graph_matches_eager": same_tokens == graph.len(),
            "max_logprob_diff_graph_vs_eager": graph_vs_eager,
            "max_logprob_diff_rollout_vs_trainer": vs_trainer,
        })
    );
    Ok(())
}

/// Scores the samples of `--samples` with the training forward in float32: the largest and the mean |difference|
/// between the rollout's log-probs and the trainer's, over every token.
fn score(args: &Args) -> Result<(), String> {
    let path = args.samples.as_ref().ok_or("score needs --samples FILE")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let device = parse_device(&args.device).map_err(|e| e.to_string())?;
    let model = CausalLm::load(&args.dir, device, DType::F32).map_err(|e| e.to_string())?;
    let (mut max, mut sum, mut tokens, mut samples) = (0f64, 0f64, 0usize, 0usize);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let sample: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{}: {e}", path.display()))?;
        let ids = |key: &str| -> Vec<u32> {
            sample[key].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as u32).collect()
        };
        let (prompt, generated) = (ids("prompt"), ids("tokens"));
        let logprobs: Vec<f64> =
            sample["logprobs"].as_array().into_iter().flatten().filter_map(|v| v.as_f64()).collect();
        if generated.is_empty() {
            continue;
        }
        if logprobs.len() != generated.len() {
            return Err(format!("a sample of {} tokens has {} log-probs", generated.len(), logprobs.len()));
        }
        let context: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let recomputed = log_probs_of(&model, &context).map_err(|e| e.to_string())?;
        let tail = &recomputed[recomputed.len() - generated.len()..];
        for (x, y) in logprobs.iter().zip(tail) {
            let diff = (x - f64::from(*y)).abs();
            max = max.max(diff);
            sum += diff;
            tokens += 1;
        }
        samples += 1;
    }
    println!(
        "{}",
        serde_json::json!({"check": "logprobs_vs_trainer_f32", "samples": samples, "tokens": tokens,
                           "max_logprob_diff": max, "mean_logprob_diff": sum / tokens.max(1) as f64})
    );
    Ok(())
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn main() -> ExitCode {
    let result = parse().and_then(|args| match args.command.as_str() {
        "prepare" => prepare(&args),
        "run" => run(&args),
        "check" => check(&args),
        "score" => score(&args),
        other => Err(format!("unknown command {other} (prepare, run, check, score)")),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("rollout_engine_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

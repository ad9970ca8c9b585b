//! `just bench trainer_step`: one PPO update (forward, backward, global-norm clipping, AdamW) on the same model
//! and batch in jetrl's trainer and in a PyTorch reference (`benches/trainer_step/reference.py`, transformers'
//! Qwen2 + torch.optim.AdamW), same process tree, same thread count, CPU.
//!
//! The bench writes a random-init Qwen2 model directory and the batch (token ids, masks, old log-probs,
//! advantages) to a scratch directory, starts the reference on the same files, then alternates one jetrl update
//! (`Actor::ppo_update`) and one reference update, `--warmup` untimed pairs then `--iters` timed ones, so load
//! from other processes on a shared CPU falls on both sides alike; each side's median counts. Both sides must
//! compute the same first update (pg_loss, grad_norm) or the bench fails. `--device cuda --dtype bf16` runs both
//! sides on a GPU in bf16 (jetrl keeps fp32 master weights in its AdamW; the reference steps torch's AdamW on
//! the bf16 parameters, which is less work). Then jetrl alone: a long-tail batch padded against packed, the peak
//! memory of one long update without and with gradient checkpointing (each in a process of its own: RSS on the
//! CPU, `max_memory_allocated` on CUDA), and LoRA against full fine-tuning. Last line:
//! `{"bench":"trainer_step","jetrl_tok_per_s":…,"reference_tok_per_s":…,"ratio":…,"packed_vs_padded":…,
//! "peak_mb_plain":…,"peak_mb_checkpointed":…,"lora_vs_full":…,…}`.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use jetrl_config::JobConfig;
use jetrl_model::{CausalLm, DType, ModelConfig};
use jetrl_trainer::actor::Actor;
use jetrl_trainer::batch::Sample;
use jetrl_trainer::dist::Comm;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
struct Args {
    /// the PyTorch reference script
    #[arg(long, default_value = "benches/trainer_step/reference.py")]
    reference: PathBuf,
    /// the Python with torch and transformers
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    #[arg(long, default_value_t = 4)]
    layers: i64,
    #[arg(long, default_value_t = 4096)]
    vocab: i64,
    /// attention heads (default hidden / 64)
    #[arg(long)]
    heads: Option<i64>,
    /// key/value heads (default hidden / 128, at least 1)
    #[arg(long)]
    kv_heads: Option<i64>,
    /// MLP width (default 3 × hidden)
    #[arg(long)]
    intermediate: Option<i64>,
    /// every sequence exactly `prompt_len` + `response_len` tokens (default: 3/4 to full prompts, 2/3 to full
    /// responses)
    #[arg(long)]
    exact_lengths: bool,
    /// `auto` (CUDA when libtorch sees one), `cpu`, `cuda`, `cuda:N`: both sides
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `f32` or `bf16` (bf16 only on a GPU: jetrl trains in f32 on the CPU)
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// sequences in the batch (groups of 4)
    #[arg(long, default_value_t = 16)]
    rows: usize,
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    #[arg(long, default_value_t = 96)]
    response_len: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 6)]
    iters: usize,
    /// intra-op threads, the same on both sides. One by default: on shared CI cores a multi-threaded OpenMP
    /// update is at the mercy of every other process (updates 5-10× slower, at random); on a dedicated
    /// machine pass the core count.
    #[arg(long, default_value_t = 1)]
    threads: i32,
    /// responses of the long batch the peak-memory figures train on (16 rows, every response this long)
    #[arg(long, default_value_t = 1024)]
    long_response_len: usize,
    /// internal: measure this process's peak RSS over one update of the long batch, `plain` or
    /// `checkpointed` (gradient checkpointing), print it and exit. The bench runs itself once per figure: a
    /// process's peak RSS only grows.
    #[arg(long, hide = true)]
    memory_probe: Option<String>,
}

fn model_config(a: &Args) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate.unwrap_or(a.hidden * 3),
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads.unwrap_or(a.hidden / 64),
        "num_key_value_heads": a.kv_heads.unwrap_or((a.hidden / 128).max(1)),
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "use_sliding_window": false,
        "attention_dropout": 0.0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
    })
}

/// The batch both sides train on: prompts of 3/4 to full `prompt_len`, responses of 2/3 to full
/// `response_len`, GRPO-like advantages (one value per sequence), old log-probs near the model's own.
fn batch(a: &Args) -> (Vec<Sample>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut samples = Vec::new();
    let (mut old, mut adv) = (Vec::new(), Vec::new());
    for i in 0..a.rows {
        let p = if a.exact_lengths { a.prompt_len } else { rng.gen_range(a.prompt_len * 3 / 4..=a.prompt_len) };
        let r = if a.exact_lengths { a.response_len } else { rng.gen_range(a.response_len * 2 / 3..=a.response_len) };
        let tok = |rng: &mut rand_chacha::ChaCha8Rng| rng.gen_range(3..a.vocab as u32);
        samples.push(Sample {
            key: format!("g{}_{}_0", i / 4, i % 4),
            uid: format!("g{}", i / 4),
            prompt: (0..p).map(|_| tok(&mut rng)).collect(),
            response: (0..r).map(|_| tok(&mut rng)).collect(),
            response_mask: vec![1; r],
            ..Sample::default()
        });
        old.push((0..r).map(|_| -(a.vocab as f32).ln() + rng.gen_range(-0.05f32..0.05)).collect());
        let a_i: f32 = rng.gen_range(-1.5f32..1.5);
        adv.push(vec![a_i; r]);
    }
    (samples, old, adv)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// This process's peak resident set size in MiB (`VmHWM`).
fn peak_rss_mib() -> anyhow::Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb / 1024.0)
}

/// One update of the long batch (16 rows of `prompt_len` + `long_response_len` tokens, one micro-batch), with or
/// without gradient checkpointing; prints `{"peak_mb": …}`: the process's peak RSS on the CPU, the CUDA caching
/// allocator's peak (`max_memory_allocated`, reset after the model is loaded) on a GPU.
fn memory_probe(args: &Args, mode: &str) -> anyhow::Result<()> {
    let work = tempfile::tempdir()?;
    let model_dir = work.path().join("model");
    tch::manual_seed(11);
    CausalLm::random(ModelConfig::from_json(model_config(args))?, tch::Device::Cpu, DType::F32, 0.02)?
        .save(&model_dir)?;
    let long = Args { rows: 16, exact_lengths: true, response_len: args.long_response_len, ..Args::parse() };
    let (samples, old, adv) = batch(&long);
    let mut cfg = JobConfig::default();
    cfg.model.path = model_dir.display().to_string();
    cfg.model.enable_gradient_checkpointing = match mode {
        "plain" => false,
        "checkpointed" => true,
        other => bail!("--memory-probe {other}: plain or checkpointed"),
    };
    cfg.actor.ppo_max_token_len = 1 << 30;
    set_device(&mut cfg, args)?;
    let mut actor = Actor::new(&cfg, 1, None, Comm::Solo)?;
    if let tch::Device::Cuda(d) = actor.model().device() {
        let before = cuda_peak_mib(d, true)?;
        actor.ppo_update(&samples, &old, &adv, 1e-5)?;
        tch::Cuda::synchronize(d as i64);
        println!("{}", serde_json::json!({"peak_mb": cuda_peak_mib(d, false)?, "before_update_mb": before}));
        return Ok(());
    }
    let before = peak_rss_mib()?;
    actor.ppo_update(&samples, &old, &adv, 1e-5)?;
    println!("{}", serde_json::json!({"peak_mb": peak_rss_mib()?, "before_update_mb": before}));
    Ok(())
}

/// The CUDA caching allocator's peak on `device` in MiB (then reset when `reset`).
fn cuda_peak_mib(device: usize, reset: bool) -> anyhow::Result<f64> {
    let bytes = jetrl_torch_ext::cuda_peak_allocated(device, reset)
        .context("the CUDA allocator's statistics: this build's torch-ext has no CUDA part (see its README)")?;
    Ok(bytes as f64 / (1u64 << 20) as f64)
}

/// `--device` and `--dtype` into the job.
fn set_device(cfg: &mut JobConfig, args: &Args) -> anyhow::Result<()> {
    cfg.model.device = args.device.parse().map_err(|e| anyhow::anyhow!("--device {}: {e}", args.device))?;
    cfg.model.dtype = args.dtype.parse().map_err(|e| anyhow::anyhow!("--dtype {}: {e}", args.dtype))?;
    Ok(())
}

/// Full fine-tuning against LoRA (rank 16, alpha 16, all-linear) on the same weights and batch, one update at a
/// time alternating; returns (full, LoRA) median seconds and optimizer-state bytes.
fn lora_against_full(
    args: &Args,
    samples: &[Sample],
    old: &[Vec<f32>],
    adv: &[Vec<f32>],
    base: &JobConfig,
) -> anyhow::Result<[(f64, u64); 2]> {
    let actor = |lora: bool| -> anyhow::Result<Actor> {
        let mut cfg = base.clone();
        cfg.model.lora_rank = if lora { 16 } else { 0 };
        cfg.model.lora_alpha = 16.0;
        Ok(Actor::new(&cfg, 1, None, Comm::Solo)?)
    };
    let mut actors = [actor(false)?, actor(true)?];
    let mut times = [Vec::new(), Vec::new()];
    for i in 0..1 + args.iters.min(3) {
        for (actor, times) in actors.iter_mut().zip(times.iter_mut()) {
            let t = Instant::now();
            actor.ppo_update(samples, old, adv, 1e-5)?;
            if let tch::Device::Cuda(d) = actor.model().device() {
                tch::Cuda::synchronize(d as i64);
            }
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    let [full, lora] = times;
    Ok([(median(full), actors[0].optimizer_state_bytes()), (median(lora), actors[1].optimizer_state_bytes())])
}

/// Long-tail responses as RL produces them (16 rows, 16 to `long_response_len` tokens, log-uniform), one update
/// at a time alternating padded and packed micro-batches (`model.use_remove_padding`) on the same weights and
/// batch; returns (padded, packed) median seconds and the batch's tokens.
fn long_tail(args: &Args, base: &JobConfig) -> anyhow::Result<(f64, f64, usize)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    let (lo, hi) = (16f64.ln(), (args.long_response_len.max(17) as f64).ln());
    let mut samples = Vec::new();
    let (mut old, mut adv) = (Vec::new(), Vec::new());
    for i in 0..16 {
        let r = rng.gen_range(lo..=hi).exp().round() as usize;
        let tok = |rng: &mut rand_chacha::ChaCha8Rng| rng.gen_range(3..args.vocab as u32);
        samples.push(Sample {
            key: format!("g{}_{}_0", i / 4, i % 4),
            uid: format!("g{}", i / 4),
            prompt: (0..args.prompt_len).map(|_| tok(&mut rng)).collect(),
            response: (0..r).map(|_| tok(&mut rng)).collect(),
            response_mask: vec![1; r],
            ..Sample::default()
        });
        old.push((0..r).map(|_| -(args.vocab as f32).ln() + rng.gen_range(-0.05f32..0.05)).collect::<Vec<f32>>());
        adv.push(vec![rng.gen_range(-1.5f32..1.5); r]);
    }
    let tokens = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
    let actor = |packed: bool| -> anyhow::Result<Actor> {
        let mut cfg = base.clone();
        cfg.model.use_remove_padding = packed;
        Ok(Actor::new(&cfg, 1, None, Comm::Solo)?)
    };
    let (mut padded, mut packed) = (actor(false)?, actor(true)?);
    let (mut padded_s, mut packed_s) = (Vec::new(), Vec::new());
    for i in 0..1 + args.iters.min(3) {
        for (actor, times) in [(&mut padded, &mut padded_s), (&mut packed, &mut packed_s)] {
            let t = Instant::now();
            actor.ppo_update(&samples, &old, &adv, 1e-5)?;
            if let tch::Device::Cuda(d) = actor.model().device() {
                tch::Cuda::synchronize(d as i64);
            }
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    Ok((median(padded_s), median(packed_s), tokens))
}

/// Runs this binary once with `--memory-probe mode` and returns its peak RSS in MiB.
fn probe_in_own_process(mode: &str) -> anyhow::Result<f64> {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    argv.extend(["--memory-probe".to_string(), mode.to_string()]);
    let out = Command::new(std::env::current_exe()?).args(&argv).stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("the {mode} memory probe failed ({})", out.status);
    }
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).context("the memory probe's output")?;
    line["peak_mb"].as_f64().context("peak_mb")
}

fn main() -> anyhow::Result<()> {
    // the trainer binary's allocator setting, so the bench measures the trainer as it runs
    jetrl_trainer::keep_freed_memory_in_heap();
    let args = Args::parse();
    if let Some(mode) = &args.memory_probe {
        tch::set_num_threads(args.threads.max(1));
        return memory_probe(&args, mode);
    }
    tch::set_num_threads(args.threads.max(1));
    let threads = tch::get_num_threads();
    let work = tempfile::tempdir()?;
    let model_dir = work.path().join("model");
    tch::manual_seed(11);
    let config = ModelConfig::from_json(model_config(&args))?;
    CausalLm::random(config, tch::Device::Cpu, DType::F32, 0.02)?.save(&model_dir)?;
    let (samples, old, adv) = batch(&args);
    let batch_file = work.path().join("batch.json");
    let rows: Vec<serde_json::Value> = samples
        .iter()
        .zip(&old)
        .zip(&adv)
        .map(|((s, o), a)| serde_json::json!({"prompt": s.prompt, "response": s.response, "old_log_probs": o, "advantages": a}))
        .collect();
    std::fs::write(&batch_file, serde_json::to_string(&rows)?)?;
    let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();

    let mut cfg = JobConfig::default();
    cfg.model.path = model_dir.display().to_string();
    set_device(&mut cfg, &args)?;
    let (device, dtype) = jetrl_trainer::actor::compute_dtype(&cfg)?;
    let (device_name, dtype_name) = match device {
        tch::Device::Cuda(i) => (format!("cuda:{i}"), if dtype == DType::BF16 { "bf16" } else { "f32" }),
        _ => ("cpu".to_string(), "f32"),
    };
    cfg.rollout.temperature = 1.0;
    cfg.actor.optim.lr = 1e-5;
    cfg.actor.optim.weight_decay = 0.01;
    cfg.actor.grad_clip = 1.0;
    // one micro-batch: the whole batch is one padded tensor on both sides
    cfg.actor.ppo_max_token_len = 1 << 30;
    let mut actor = Actor::new(&cfg, 1, None, Comm::Solo)?;
    // The reference at the bf16-parameter precision a PyTorch trainer often runs; on bf16 also one at jetrl's own
    // precision (fp32 master weights, bf16 autocast, fused AdamW). In f32 the two are the same run.
    let precisions: &[&str] = if dtype == DType::BF16 { &["params", "master"] } else { &["params"] };
    let mut references = Vec::new();
    for precision in precisions {
        let launch = Reference::launch(&args, &model_dir, &batch_file, threads, &device_name, dtype_name, precision)?;
        let (reference, ready) = launch;
        if ready["tokens"].as_u64() != Some(tokens as u64) {
            bail!("the reference ({precision}) counts {} tokens, jetrl {tokens}", ready["tokens"]);
        }
        references.push(reference);
    }

    let (mut jetrl_times, mut ref_times) = (Vec::new(), vec![Vec::new(); references.len()]);
    for i in 0..args.warmup + args.iters {
        let t = Instant::now();
        let m = actor.ppo_update(&samples, &old, &adv, cfg.actor.optim.lr)?;
        if let tch::Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        let jetrl_s = t.elapsed().as_secs_f64();
        if i >= args.warmup {
            jetrl_times.push(jetrl_s);
        }
        for (reference, times) in references.iter_mut().zip(&mut ref_times) {
            let r = reference.step()?;
            if i == 0 {
                // bf16 kernels differ between the two sides in the last bits of every product
                let tolerance = if dtype == DType::BF16 { 5e-2 } else { 1e-3 };
                check_same_update(m["actor/pg_loss"], m["actor/grad_norm"], &r, tolerance)?;
                eprintln!(
                    "first update: pg_loss {:.6} / {:.6}, grad_norm {:.6} / {:.6} (jetrl / reference {})",
                    m["actor/pg_loss"], r["pg_loss"], m["actor/grad_norm"], r["grad_norm"], reference.precision
                );
            }
            if i >= args.warmup {
                times.push(r["s"].as_f64().context("reference time")?);
            }
        }
    }
    for reference in references {
        reference.quit();
    }
    let same_precision_s = ref_times.get(1).cloned().map(median);
    let ref_times = ref_times.swap_remove(0);
    let (jetrl_s, ref_s) = (median(jetrl_times), median(ref_times));
    let same_precision_s = same_precision_s.unwrap_or(ref_s);
    eprintln!(
        "{tokens} tokens per update, {threads} threads, median of {} updates: jetrl {jetrl_s:.3}s, reference {ref_s:.3}s",
        args.iters
    );
    let jetrl_tps = tokens as f64 / jetrl_s;
    let ref_tps = tokens as f64 / ref_s;
    let (padded_s, packed_s, long_tokens) = long_tail(&args, &cfg)?;
    eprintln!(
        "long-tail batch ({long_tokens} tokens, responses 16-{}): padded {padded_s:.3}s, packed {packed_s:.3}s per update",
        args.long_response_len
    );
    let (peak_plain, peak_checkpointed) = (probe_in_own_process("plain")?, probe_in_own_process("checkpointed")?);
    let peak_kind = if device == tch::Device::Cpu { "rss" } else { "cuda_max_memory_allocated" };
    eprintln!(
        "peak memory ({peak_kind}) over one update of 16 x ({} + {}) tokens: plain {peak_plain:.0} MiB, checkpointed {peak_checkpointed:.0} MiB",
        args.prompt_len, args.long_response_len
    );
    let [(full_s, full_optim), (lora_s, lora_optim)] = lora_against_full(&args, &samples, &old, &adv, &cfg)?;
    eprintln!(
        "LoRA (rank 16, all-linear) against full fine-tuning: {lora_s:.3}s vs {full_s:.3}s per update, optimizer state {lora_optim} vs {full_optim} bytes"
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "trainer_step",
            "jetrl_tok_per_s": (jetrl_tps * 10.0).round() / 10.0,
            "reference_tok_per_s": (ref_tps * 10.0).round() / 10.0,
            "ratio": (jetrl_tps / ref_tps * 1000.0).round() / 1000.0,
            "ratio_same_precision": (same_precision_s / jetrl_s * 1000.0).round() / 1000.0,
            "reference_same_precision_s": (same_precision_s * 10000.0).round() / 10000.0,
            "jetrl_update_s": (jetrl_s * 10000.0).round() / 10000.0,
            "tokens_per_update": tokens,
            "device": device_name,
            "dtype": dtype_name,
            "packed_vs_padded": (padded_s / packed_s * 1000.0).round() / 1000.0,
            "long_tail_tokens": long_tokens,
            "peak_mb_plain": peak_plain.round(),
            "peak_mb_checkpointed": peak_checkpointed.round(),
            "peak_mb_kind": peak_kind,
            "lora_vs_full": (full_s / lora_s * 1000.0).round() / 1000.0,
            "lora_update_s": (lora_s * 1000.0).round() / 1000.0,
            "full_update_s": (full_s * 1000.0).round() / 1000.0,
            "optim_bytes_full": full_optim,
            "optim_bytes_lora": lora_optim,
        })
    );
    Ok(())
}

/// One PyTorch reference process, driven update by update over its stdin and stdout.
struct Reference {
    child: std::process::Child,
    to: std::process::ChildStdin,
    from: BufReader<std::process::ChildStdout>,
    precision: String,
}

impl Reference {
    /// Starts the reference at `precision` (`params` or `master`) and returns it with its ready line.
    fn launch(
        args: &Args,
        model_dir: &std::path::Path,
        batch_file: &std::path::Path,
        threads: i32,
        device: &str,
        dtype: &str,
        precision: &str,
    ) -> anyhow::Result<(Self, serde_json::Value)> {
        let mut child = Command::new(&args.python)
            .arg(&args.reference)
            .args(["--model".as_ref(), model_dir.as_os_str(), "--batch".as_ref(), batch_file.as_os_str()])
            .args(["--threads", &threads.to_string(), "--device", device, "--dtype", dtype, "--precision", precision])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} {}", args.python.display(), args.reference.display()))?;
        let to = child.stdin.take().context("reference stdin")?;
        let from = BufReader::new(child.stdout.take().context("reference stdout")?);
        let mut reference = Reference { child, to, from, precision: precision.to_string() };
        let ready = reference.read()?;
        Ok((reference, ready))
    }

    fn read(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        if self.from.read_line(&mut line)? == 0 {
            bail!("the reference ({}) exited", self.precision);
        }
        serde_json::from_str(&line).with_context(|| format!("reference said {line:?}"))
    }

    fn step(&mut self) -> anyhow::Result<serde_json::Value> {
        writeln!(self.to, "step")?;
        self.to.flush()?;
        self.read()
    }

    fn quit(mut self) {
        let _ = writeln!(self.to, "quit");
        drop(self.to);
        let _ = self.child.wait();
    }
}

/// Both sides must compute the same update, or the comparison means nothing.
fn check_same_update(loss: f64, grad_norm: f64, reference: &serde_json::Value, tolerance: f64) -> anyhow::Result<()> {
    let ref_loss = reference["pg_loss"].as_f64().unwrap_or(f64::NAN);
    let ref_norm = reference["grad_norm"].as_f64().unwrap_or(f64::NAN);
    let close = |a: f64, b: f64| (a - b).abs() <= tolerance * b.abs().max(1e-3);
    if !close(loss, ref_loss) || !close(grad_norm, ref_norm) {
        bail!("jetrl and the reference disagree: pg_loss {loss} vs {ref_loss}, grad_norm {grad_norm} vs {ref_norm}");
    }
    Ok(())
}

//! Microbenchmark of the shim's collectives: all_reduce and reduce_scatter of one size with N Gloo ranks on the
//! CPU (N processes on this host), printed by rank 0 as one JSON line, so the same calls from Python's
//! torch.distributed can be timed against it.
//!
//! ```text
//! bench_collectives [--mib 64] [--world 2] [--iters 10] [--warmup 2] [--dtype f32|bf16] [--port P]
//! ```
//!
//! Bandwidth is reported as nccl-tests does: `algbw = bytes / time`, `busbw = algbw · 2(n−1)/n` for all_reduce
//! and `algbw · (n−1)/n` for reduce_scatter, where `bytes` is the full (input) tensor's size.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use jetrl_torch_ext::{Backend, ProcessGroup, ProcessGroupOptions, ReduceOp};
use tch::{Device, Kind, Tensor};

struct Args {
    mib: f64,
    world: usize,
    iters: usize,
    warmup: usize,
    kind: Kind,
    port: Option<u16>,
    /// Set on the re-executed ranks only.
    rank: Option<usize>,
}

type BoxError = Box<dyn std::error::Error>;

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args { mib: 64.0, world: 2, iters: 10, warmup: 2, kind: Kind::Float, port: None, rank: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--mib" => args.mib = value()?.parse()?,
            "--world" => args.world = value()?.parse()?,
            "--iters" => args.iters = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--port" => args.port = Some(value()?.parse()?),
            "--rank" => args.rank = Some(value()?.parse()?),
            "--dtype" => {
                args.kind = match value()?.as_str() {
                    "f32" => Kind::Float,
                    "bf16" => Kind::BFloat16,
                    other => return Err(format!("unknown dtype {other} (f32 or bf16)").into()),
                }
            }
            "-h" | "--help" => {
                println!("bench_collectives [--mib 64] [--world 2] [--iters 10] [--warmup 2] [--dtype f32|bf16]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if args.world < 2 || args.iters == 0 || args.mib <= 0.0 {
        return Err("need --world >= 2, --iters >= 1, --mib > 0".into());
    }
    Ok(args)
}

fn dtype_name(kind: Kind) -> &'static str {
    if kind == Kind::BFloat16 {
        "bf16"
    } else {
        "f32"
    }
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|args| match args.rank {
        Some(rank) => run_rank(&args, rank),
        None => launch(&args),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("bench_collectives: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Starts `world` copies of this binary, one per rank, and waits for them.
fn launch(args: &Args) -> Result<(), BoxError> {
    let port = match args.port {
        Some(port) => port,
        None => std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
    };
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..args.world {
        let child = Command::new(&exe)
            .args(["--rank", &rank.to_string(), "--world", &args.world.to_string(), "--port", &port.to_string()])
            .args(["--mib", &args.mib.to_string(), "--iters", &args.iters.to_string()])
            .args(["--warmup", &args.warmup.to_string(), "--dtype", dtype_name(args.kind)])
            .stdout(if rank == 0 { Stdio::inherit() } else { Stdio::null() })
            .spawn()?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        if !child.wait()?.success() {
            failed.push(rank);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("ranks {failed:?} failed").into())
    }
}

fn time_op(
    iters: usize,
    warmup: usize,
    mut op: impl FnMut() -> Result<(), jetrl_torch_ext::DistError>,
) -> Result<Vec<f64>, BoxError> {
    for _ in 0..warmup {
        op()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        op()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn report(name: &str, bytes: f64, times: &[f64], bus_factor: f64) -> serde_json::Value {
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let algbw = bytes / median / 1e9;
    serde_json::json!({
        "op": name,
        "median_ms": median * 1e3,
        "mean_ms": mean * 1e3,
        "min_ms": times[0] * 1e3,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor,
    })
}

fn run_rank(args: &Args, rank: usize) -> Result<(), BoxError> {
    let port = args.port.ok_or("--rank needs --port")?;
    let opts = ProcessGroupOptions::new(Backend::Gloo, rank, args.world, "127.0.0.1", port)
        .with_timeout(Duration::from_secs(120));
    let mut pg = ProcessGroup::new(opts)?;

    let elem_size = if args.kind == Kind::BFloat16 { 2.0 } else { 4.0 };
    let world = args.world as i64;
    // a multiple of the world size, so the reduce_scatter input splits evenly
    let numel = (((args.mib * 1024.0 * 1024.0 / elem_size) as i64) / world).max(1) * world;
    let bytes = numel as f64 * elem_size;
    let n = args.world as f64;

    let mut buf = Tensor::ones([numel], (args.kind, Device::Cpu));
    pg.barrier()?;
    let all_reduce = time_op(args.iters, args.warmup, || pg.all_reduce(&mut buf, ReduceOp::Sum))?;

    let input = Tensor::ones([numel], (args.kind, Device::Cpu));
    let mut out = Tensor::zeros([numel / world], (args.kind, Device::Cpu));
    pg.barrier()?;
    let reduce_scatter = time_op(args.iters, args.warmup, || pg.reduce_scatter(&mut out, &input, ReduceOp::Sum))?;
    pg.barrier()?;

    if rank == 0 {
        let line = serde_json::json!({
            "bench": "collectives",
            "impl": "rust-jetrl-torch-ext",
            "backend": "gloo",
            "device": "cpu",
            "world_size": args.world,
            "dtype": dtype_name(args.kind),
            "numel": numel,
            "bytes": bytes,
            "iters": args.iters,
            "warmup": args.warmup,
            "threads": tch::get_num_threads(),
            "results": [
                report("all_reduce", bytes, &all_reduce, 2.0 * (n - 1.0) / n),
                report("reduce_scatter", bytes, &reduce_scatter, (n - 1.0) / n),
            ],
        });
        println!("{line}");
    }
    Ok(())
}

//! One file: a benchmark binary reads top to bottom (set-up, the measured rounds, the report).
//!
//! `just bench weight_sync`: one weight version of ≥ 500 MB into two rollout workers, jetrl's two paths against
//! moving the same bytes by hand, side by side in one run against one nats-server.
//!
//! - same node (`checkpoint.transport: shared_fs`): jetrl's `Bus::store_weights` into a shared directory plus
//!   the manifest (`weights::manifest_for`: every tensor's CRC-32 and the blob's), then two readers at once, each
//!   `Bus::load_weights` + `weights::verify` — against writing the same bytes to a file and two concurrent
//!   reads of it (`raw_copy`).
//! - broker (`checkpoint.transport: object_store`): the same through the JetStream object store, each reader on
//!   its own connection — against a raw async-nats object-store put with the same chunk size and two
//!   concurrent gets on their own connections.
//! - the swap into two engines (`Engine::load_weights`, what a worker does after the verify) is timed on its own
//!   (`swap_s`, per worker, not part of `jetrl_s`: the raw sides have no engine).
//!
//! - LoRA (`model.lora_rank`): the adapter-only version of the same model (rank `--lora-rank`, 16, all-linear)
//!   through the broker into the two readers, plus each worker's merge into its engine (`Engine::with_lora`:
//!   `base + scale·B A` into the working weights) — against the full-model broker sync plus its swap:
//!   `lora_speedup` = full / adapter-only, with `lora_bytes`. `unmerged_step_ratio` is the other way a worker
//!   could apply an adapter, measured: a decode-shaped forward (64 rows of one token) with the adapter unmerged,
//!   over the same forward of the merged model.
//!
//! The model is a random-init Qwen2 shape in f32 (`--hidden`, `--layers`, `--vocab`; the default is 520 MB).
//! Each round runs the four sides, in reverse order every other round, so load from other processes falls on
//! all alike; after `--warmup` untimed rounds (1), the figures are medians over `--rounds` (5). The jetrl sides are also broken down by phase
//! (store, manifest, read, verify). Last line: `{"bench":"weight_sync","bytes":…,"jetrl_s":…,"raw_copy_s":…,
//! "ratio":…,"broker_jetrl_s":…,"broker_raw_s":…,"broker_ratio":…,"lora_speedup":…,"lora_bytes":…}`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use async_nats::jetstream::object_store;
use bytes::Bytes;
use jetrl_bus::weights::{self, WeightTransport};
use jetrl_bus::{Bus, NatsServer};
use jetrl_config::JobConfig;
use jetrl_model::{CausalLm, DType, Engine, EngineConfig, LoraSpec, ModelConfig, Targets};
use jetrl_wire::v1::WeightManifest;
use tokio::io::AsyncReadExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Readers of each version: two rollout workers.
const READERS: usize = 2;

struct Args {
    hidden: i64,
    layers: i64,
    vocab: i64,
    rounds: usize,
    warmup: usize,
    chunk_bytes: usize,
    lora_rank: i64,
    /// MLP width (default 3 × hidden)
    intermediate: Option<i64>,
    /// key/value heads (default hidden / 256, at least 1)
    kv_heads: Option<i64>,
}

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        hidden: 1024,
        layers: 8,
        vocab: 32768,
        rounds: 5,
        warmup: 1,
        chunk_bytes: 8 << 20,
        lora_rank: 16,
        intermediate: None,
        kv_heads: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: usize = it.next().ok_or(format!("{flag} needs a value"))?.parse()?;
        match flag.as_str() {
            "--hidden" => args.hidden = value as i64,
            "--layers" => args.layers = value as i64,
            "--vocab" => args.vocab = value as i64,
            "--rounds" => args.rounds = value.max(1),
            "--warmup" => args.warmup = value,
            "--chunk-bytes" => args.chunk_bytes = value,
            "--lora-rank" => args.lora_rank = value.max(1) as i64,
            "--intermediate" => args.intermediate = Some(value as i64),
            "--kv-heads" => args.kv_heads = Some(value as i64),
            other => {
                let known = "--hidden, --layers, --vocab, --intermediate, --kv-heads, --rounds, --warmup, --chunk-bytes, --lora-rank";
                return Err(format!("unknown option {other} ({known})").into());
            }
        }
    }
    Ok(args)
}

fn model_config(a: &Args) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate.unwrap_or(a.hidden * 3),
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.hidden / 64,
        "num_key_value_heads": a.kv_heads.unwrap_or((a.hidden / 256).max(1)),
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "use_sliding_window": false,
        "eos_token_id": 2,
        "dtype": "float32",
    })
}

/// Seconds per phase of one jetrl trial; readers run at once, so their phases are the slower reader's.
#[derive(Default)]
struct Phases(BTreeMap<&'static str, f64>);

impl Phases {
    fn max(&mut self, phase: &'static str, seconds: f64) {
        let slot = self.0.entry(phase).or_insert(0.0);
        *slot = slot.max(seconds);
    }
}

/// jetrl: store, manifest, then READERS readers at once, each reading and verifying the blob.
async fn jetrl_trial(
    writer: &Bus,
    readers: &[Bus],
    transport: &WeightTransport,
    version: u64,
    blob: &Bytes,
) -> Result<(f64, Phases, Bytes), BoxError> {
    let mut phases = Phases::default();
    let started = Instant::now();
    let location = writer.store_weights(transport, version, blob.clone()).await?;
    phases.max("store", started.elapsed().as_secs_f64());
    let t = Instant::now();
    let manifest = weights::manifest_for(blob, version, version, &location)?;
    phases.max("manifest", t.elapsed().as_secs_f64());
    let mut tasks = Vec::new();
    for reader in readers {
        let (reader, manifest) = (reader.clone(), manifest.clone());
        tasks.push(tokio::spawn(async move { read_and_verify(&reader, &manifest).await }));
    }
    let mut last = Bytes::new();
    for task in tasks {
        let (read_s, verify_s, bytes) = task.await??;
        phases.max("read", read_s);
        phases.max("verify", verify_s);
        last = bytes;
    }
    let total = started.elapsed().as_secs_f64();
    writer.delete_weights(&location).await?;
    Ok((total, phases, last))
}

async fn read_and_verify(reader: &Bus, manifest: &WeightManifest) -> Result<(f64, f64, Bytes), BoxError> {
    let t = Instant::now();
    let bytes = reader.load_weights(&manifest.location).await?;
    let read_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    weights::verify(manifest, &bytes)?;
    Ok((read_s, t.elapsed().as_secs_f64(), bytes))
}

/// The same bytes by hand on one node: write a file, READERS concurrent reads.
async fn raw_copy_trial(dir: &Path, blob: &Bytes) -> Result<f64, BoxError> {
    let path = dir.join("raw.bin");
    let started = Instant::now();
    tokio::fs::write(&path, blob).await?;
    let mut tasks = Vec::new();
    for _ in 0..READERS {
        let path = path.clone();
        tasks.push(tokio::spawn(async move { tokio::fs::read(&path).await }));
    }
    for task in tasks {
        let bytes = task.await??;
        if bytes.len() != blob.len() {
            return Err(format!("raw read {} bytes of {}", bytes.len(), blob.len()).into());
        }
    }
    let total = started.elapsed().as_secs_f64();
    tokio::fs::remove_file(&path).await?;
    Ok(total)
}

/// The same bytes through the broker by hand: an object-store put with the same chunk size, READERS concurrent
/// gets, each on its own connection.
async fn raw_broker_trial(writer: &Bus, readers: &[Bus], chunk: usize, blob: &Bytes) -> Result<f64, BoxError> {
    const BUCKET: &str = "BENCH_RAW_BLOBS";
    let store = writer
        .jetstream()
        .create_object_store(object_store::Config {
            bucket: BUCKET.into(),
            storage: async_nats::jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    let name = "raw-blob";
    let started = Instant::now();
    let meta = object_store::ObjectMetadata { name: name.into(), chunk_size: Some(chunk), ..Default::default() };
    store.put(meta, &mut blob.as_ref()).await?;
    let mut tasks = Vec::new();
    for reader in readers {
        let js = reader.jetstream().clone();
        tasks.push(tokio::spawn(async move {
            let store = js.get_object_store(BUCKET).await?;
            let mut object = store.get(name).await?;
            let mut out = Vec::with_capacity(object.info().size);
            object.read_to_end(&mut out).await?;
            Ok::<usize, BoxError>(out.len())
        }));
    }
    for task in tasks {
        let n = task.await??;
        if n != blob.len() {
            return Err(format!("raw get returned {n} bytes of {}", blob.len()).into());
        }
    }
    let total = started.elapsed().as_secs_f64();
    store.delete(name).await?;
    Ok(total)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let args = parse_args()?;
    let load_before = load_average();
    tch::manual_seed(3);
    let config = ModelConfig::from_json(model_config(&args))?;
    let model = CausalLm::random(config.clone(), tch::Device::Cpu, DType::F32, 0.02)?;
    let blob = Bytes::from(model.to_safetensors_bytes()?);
    let spec = LoraSpec::new(args.lora_rank, 2.0 * args.lora_rank as f64, Targets::AllLinear, Vec::new());
    let mut adapted = CausalLm::random(config.clone(), tch::Device::Cpu, DType::F32, 0.02)?;
    adapted.add_lora(&spec)?;
    tch::no_grad(|| {
        for (name, mut t) in adapted.lora_parameters() {
            if name.contains("lora_B") {
                let _ = t.normal_(0.0, 0.01);
            }
        }
    });
    let adapter = Bytes::from(adapted.lora_to_safetensors_bytes()?);
    let unmerged_step_ratio = unmerged_step_ratio(&model, &adapted)?;
    drop((model, adapted));
    if blob.len() < 500_000_000 {
        eprintln!("note: the version is {} bytes, under the 500 MB the benchmark is specified for", blob.len());
    }
    eprintln!("weight version: {} bytes (Qwen2 shape, f32)", blob.len());

    let server = NatsServer::start()?;
    let mut job = JobConfig::default();
    job.nats.url = server.url();
    job.run.name = "bench-weights".into();
    let connect = |name: String| {
        let job = job.clone();
        async move { Bus::connect_job(&job, &name).await }
    };
    let writer = connect("bench-writer".into()).await?;
    writer.declare_topology().await?;
    let mut readers = Vec::new();
    for i in 0..READERS {
        readers.push(connect(format!("bench-reader-{i}")).await?);
    }
    let shared_dir = tempfile::tempdir()?;
    let shared: PathBuf = shared_dir.path().to_path_buf();
    let shared_fs = WeightTransport::SharedFs { dir: shared.join("weights") };
    let object = WeightTransport::ObjectStore { chunk_bytes: args.chunk_bytes };
    // what store_weights uses: the configured chunk, capped by the server's max_payload
    let chunk = args.chunk_bytes.min(writer.max_payload().saturating_sub(64 * 1024)).max(64 * 1024);

    let sides = ["jetrl_fs", "raw_copy", "jetrl_broker", "raw_broker", "lora_broker"];
    let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut phases: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    let mut received = Bytes::new();
    let mut version = 0u64;
    for round in 0..args.warmup + args.rounds {
        let order: Vec<&str> = if round % 2 == 0 { sides.to_vec() } else { sides.iter().rev().copied().collect() };
        let timed = round >= args.warmup;
        for side in order {
            version += 1;
            let seconds = match side {
                "jetrl_fs" | "jetrl_broker" => {
                    let transport = if side == "jetrl_fs" { &shared_fs } else { &object };
                    let (s, p, bytes) = jetrl_trial(&writer, &readers, transport, version, &blob).await?;
                    for (phase, v) in p.0.into_iter().filter(|_| timed) {
                        phases.entry((side, phase)).or_default().push(v);
                    }
                    received = bytes;
                    s
                }
                "lora_broker" => jetrl_trial(&writer, &readers, &object, version, &adapter).await?.0,
                "raw_copy" => raw_copy_trial(&shared, &blob).await?,
                _ => raw_broker_trial(&writer, &readers, chunk, &blob).await?,
            };
            eprintln!("{} {round}: {side} {seconds:.3}s", if timed { "round" } else { "warm-up" });
            if timed {
                times.entry(side).or_default().push(seconds);
            }
        }
    }

    // The swap a worker makes after the verify, timed on its own: READERS engines, one after the other.
    let mut swap_s = Vec::new();
    for i in 0..READERS {
        let model = CausalLm::random(config.clone(), tch::Device::Cpu, DType::F32, 0.02)?;
        let mut engine = Engine::new(model, EngineConfig::default())?;
        let t = Instant::now();
        engine.load_weights(&received, 1 + i as u64)?;
        swap_s.push(t.elapsed().as_secs_f64());
    }
    // and a LoRA worker's merge of the adapter into its engine
    let mut merge_s = Vec::new();
    for i in 0..READERS {
        let model = CausalLm::random(config.clone(), tch::Device::Cpu, DType::F32, 0.02)?;
        let mut engine = Engine::new(model, EngineConfig::default())?;
        engine.with_lora(&spec)?;
        let t = Instant::now();
        engine.load_weights(&adapter, 1 + i as u64)?;
        merge_s.push(t.elapsed().as_secs_f64());
    }
    drop(shared_dir);
    drop(server);

    let med = |side: &str| median(times[side].clone());
    let phase_medians = |side: &str| -> serde_json::Value {
        phases
            .iter()
            .filter(|((s, _), _)| *s == side)
            .map(|((_, phase), v)| ((*phase).to_string(), serde_json::json!(round3(median(v.clone())))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let (jetrl_s, raw_copy_s) = (med("jetrl_fs"), med("raw_copy"));
    let (broker_jetrl_s, broker_raw_s) = (med("jetrl_broker"), med("raw_broker"));
    let (lora_s, merge_s) = (med("lora_broker"), median(merge_s));
    let full_s = broker_jetrl_s + median(swap_s.clone());
    let load_after = load_average();
    println!(
        "{}",
        serde_json::json!({
            "bench": "weight_sync",
            "bytes": blob.len(),
            "jetrl_s": round3(jetrl_s),
            "raw_copy_s": round3(raw_copy_s),
            "ratio": round3(jetrl_s / raw_copy_s),
            "broker_jetrl_s": round3(broker_jetrl_s),
            "broker_raw_s": round3(broker_raw_s),
            "broker_ratio": round3(broker_jetrl_s / broker_raw_s),
            "swap_s_per_worker": round3(median(swap_s)),
            "lora_speedup": round3(full_s / (lora_s + merge_s)),
            "lora_bytes": adapter.len(),
            "lora_rank": args.lora_rank,
            "lora_broker_s": round3(lora_s),
            "lora_merge_s_per_worker": round3(merge_s),
            "unmerged_step_ratio": round3(unmerged_step_ratio),
            "jetrl_phases_s": phase_medians("jetrl_fs"),
            "broker_jetrl_phases_s": phase_medians("jetrl_broker"),
            "readers": READERS,
            "chunk_bytes": chunk,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "machine": format!(
                "{} cores shared with other processes; load average {load_before} before, {load_after} after; medians over rounds",
                std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
            ),
        })
    );
    Ok(())
}

/// Seconds of a decode-shaped forward (64 rows of one token) with the adapter unmerged, over the same forward of
/// the plain model (what a merged worker runs), medians of alternating reps.
fn unmerged_step_ratio(plain: &CausalLm, adapted: &CausalLm) -> Result<f64, BoxError> {
    let ids = tch::Tensor::from_slice(&(0..64).map(|i| i * 7 + 3).collect::<Vec<i64>>()).view([64, 1]);
    let mask = ids.ones_like();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    tch::no_grad(|| -> Result<(), BoxError> {
        for rep in 0..12 {
            for (model, out) in [(plain, &mut a), (adapted, &mut b)] {
                let t = Instant::now();
                let _ = model.forward_hidden(&ids, &mask)?;
                if rep >= 2 {
                    out.push(t.elapsed().as_secs_f64());
                }
            }
        }
        Ok(())
    })?;
    Ok(median(b) / median(a))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

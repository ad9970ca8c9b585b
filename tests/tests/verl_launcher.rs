//! `jetrl run --verl`: verl's launch command with only the launcher replaced. The argument list of verl's GRPO
//! example (`examples/grpo_trainer/run_qwen2-7b_seq_balance.sh`), verbatim, runs the five services on a GSM8K-format
//! sample the project writes (scripts/make_gsm8k_sample.py) and a tiny model, with sizes overridden after it as a
//! user would (`… $@`), the rollout on vLLM (`actor_rollout_ref.rollout.name=vllm`: the example's SGLang has no
//! backend in jetrl and is refused by name). A key jetrl refuses fails before anything starts, naming the key.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use jetrl_tests::{run_binary, run_metrics, test_dir};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The example's arguments, `$HOME/data/gsm8k` and the model path replaced by this test's.
fn seq_balance_example(model: &Path, data: &Path) -> Vec<String> {
    let text = format!(
        "algorithm.adv_estimator=grpo \
         data.train_files={data}/train.parquet \
         data.val_files={data}/test.parquet \
         data.return_raw_chat=True \
         data.train_batch_size=1024 \
         data.max_prompt_length=512 \
         data.max_response_length=1024 \
         data.filter_overlong_prompts=True \
         data.truncation=error \
         actor_rollout_ref.model.path={model} \
         actor_rollout_ref.actor.optim.lr=1e-6 \
         actor_rollout_ref.model.use_remove_padding=True \
         actor_rollout_ref.actor.ppo_mini_batch_size=256 \
         actor_rollout_ref.actor.use_dynamic_bsz=True \
         actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000 \
         actor_rollout_ref.actor.use_kl_loss=True \
         actor_rollout_ref.actor.kl_loss_coef=0.001 \
         actor_rollout_ref.actor.kl_loss_type=low_var_kl \
         actor_rollout_ref.actor.entropy_coeff=0 \
         actor_rollout_ref.model.enable_gradient_checkpointing=True \
         actor_rollout_ref.actor.fsdp_config.param_offload=False \
         actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
         actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
         actor_rollout_ref.rollout.name=sglang \
         actor_rollout_ref.rollout.mode=async \
         actor_rollout_ref.rollout.multi_turn.format=hermes \
         actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
         actor_rollout_ref.rollout.n=5 \
         actor_rollout_ref.ref.fsdp_config.param_offload=True \
         algorithm.use_kl_in_reward=False \
         trainer.critic_warmup=0 \
         trainer.logger=[console,wandb] \
         trainer.project_name=verl_grpo_example_gsm8k \
         trainer.experiment_name=qwen2_7b_function_rm_kl1e-3 \
         trainer.val_before_train=False \
         trainer.n_gpus_per_node=8 \
         trainer.nnodes=1 \
         trainer.save_freq=20 \
         trainer.test_freq=5 \
         trainer.total_epochs=15",
        data = data.display(),
        model = model.display()
    );
    text.split_whitespace().map(str::to_string).collect()
}

fn python() -> PathBuf {
    let venv = repo().join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// The project's GSM8K-format sample (verl's preprocess layout) in `dir`.
fn gsm8k_sample(dir: &Path) {
    let status = std::process::Command::new(python())
        .arg(repo().join("scripts/make_gsm8k_sample.py"))
        .args(["--out", &dir.display().to_string(), "--train-size", "64", "--test-size", "16"])
        .status()
        .unwrap();
    assert!(status.success(), "scripts/make_gsm8k_sample.py failed (it needs pyarrow: ./dev.sh test installs it)");
}

#[test]
#[ignore = "slow tier: verl's GRPO example through jetrl run --verl, five services on a GSM8K-format sample, vLLM"]
fn verls_grpo_example_runs_with_only_the_launcher_replaced() {
    let dir = test_dir("verl-example");
    let (data, model, run_dir, checkpoints) =
        (dir.path().join("gsm8k"), dir.path().join("model"), dir.path().join("run"), dir.path().join("ckpt"));
    gsm8k_sample(&data);
    let (status, output) = run_binary(
        "jetrl",
        &["init-model", "--preset", "tiny", "--out", &model.display().to_string()],
        Duration::from_secs(60),
    );
    assert!(status.success(), "{output}");

    let mut args = vec!["run".to_string(), "--verl".into()];
    args.extend(seq_balance_example(&model, &data));
    // the user's `$@`: vLLM instead of the example's SGLang, and this machine's sizes
    args.extend(
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
            "+actor_rollout_ref.rollout.kv_cache_memory_gb=1",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "data.max_prompt_length=256",
            "data.max_response_length=16",
            "trainer.n_gpus_per_node=1",
            "trainer.device=cpu",
            "trainer.total_training_steps=3",
            "trainer.test_freq=2",
            "trainer.logger=[console]",
        ]
        .map(String::from),
    );
    args.push(format!("+run.dir={}", run_dir.display()));
    args.push(format!("trainer.default_local_dir={}", checkpoints.display()));
    args.push("--quiet".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, output) = run_binary("jetrl", &args, Duration::from_secs(300));
    assert!(status.success(), "jetrl run --verl failed:\n{output}");

    // one start-up line says what was ignored
    let ignored = output.lines().find(|l| l.starts_with("verl keys ignored")).unwrap_or_else(|| panic!("{output}"));
    for key in ["actor_rollout_ref.rollout.mode", "fsdp_config.param_offload"] {
        assert!(ignored.contains(key), "{key} not in {ignored}");
    }
    assert!(!ignored.contains("rollout.name"), "the engine was ignored: {ignored}");
    // the job that ran, in jetrl's tree: verl's values where the example set them
    let cfg = jetrl_config::JobConfig::load(Some(&run_dir.join("job.yaml")), &[]).unwrap();
    assert_eq!(cfg.actor.optim.lr, 1e-6);
    assert_eq!(cfg.rollout.n, 5);
    assert!(cfg.actor.use_kl_loss);
    assert_eq!(cfg.actor.ppo_max_token_len, 24_000);
    assert_eq!(cfg.trainer.project_name, "verl_grpo_example_gsm8k");
    assert_eq!(cfg.run.name, "qwen2_7b_function_rm_kl1e-3");
    assert_eq!(cfg.rollout.name, jetrl_config::RolloutName::Vllm);
    let vllm_log = run_dir.join("logs").read_dir().unwrap().flatten().find(|e| {
        let name = e.file_name().to_string_lossy().to_string();
        name.starts_with("vllm-") && name.ends_with(".log")
    });
    let vllm_log =
        std::fs::read_to_string(vllm_log.expect("no vLLM server log: the rollout did not run on vLLM").path()).unwrap();
    assert!(vllm_log.contains("/inference/v1/generate"), "vLLM served no generate request:\n{vllm_log}");

    let metrics = run_metrics(&run_dir);
    let steps: Vec<f64> = metrics.iter().filter_map(|m| m["training/global_step"].as_f64()).collect();
    assert_eq!(steps, vec![1.0, 2.0, 3.0], "{metrics:?}");
    for m in &metrics {
        assert!(m["actor/kl_loss"].as_f64().is_some_and(f64::is_finite), "use_kl_loss: {m}");
        assert!(m["actor/pg_loss"].as_f64().is_some_and(f64::is_finite), "{m}");
        assert_eq!(m["critic/score/mean"].as_f64().map(|s| (0.0..=1.0).contains(&s)), Some(true), "{m}");
    }
    // test_freq=2: validated at step 2 and at the last step, under verl's name for the data source
    let validated: Vec<f64> = metrics
        .iter()
        .filter(|m| m["val-core/openai/gsm8k/acc/mean@1"].is_number())
        .filter_map(|m| m["training/global_step"].as_f64())
        .collect();
    assert_eq!(validated, vec![2.0, 3.0], "{metrics:?}");
    // the last step saves (save_freq=20 is past the end), in trainer.default_local_dir
    assert!(checkpoints.join("global_step_3").is_dir(), "no checkpoint in {}", checkpoints.display());
}

/// A key jetrl refuses, and a key of another schedule, fail before anything starts (no run directory), naming the
/// key, the value and what to do.
#[test]
fn a_refused_verl_key_fails_before_anything_starts() {
    let dir = test_dir("verl-refused");
    let run_dir = dir.path().join("run");
    let base = [
        "trainer.device=cpu".to_string(),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        format!("+run.dir={}", run_dir.display()),
    ];
    let cases: [(&[&str], &[&str]); 3] = [
        (
            &["actor_rollout_ref.actor.strategy=megatron"],
            &["actor_rollout_ref.actor.strategy", "megatron", "data parallel"],
        ),
        (
            &["trainer.v1.trainer_mode=separate_async", "trainer.v1.colocate_async.num_warmup_batches=2"],
            &["trainer.v1.colocate_async.num_warmup_batches", "trainer.v1.separate_async.num_warmup_batches"],
        ),
        (&["actor_rollout_ref.actor.optim.lrr=1e-6"], &["actor_rollout_ref.actor.optim.lrr"]),
    ];
    for (extra, expected) in cases {
        let mut args: Vec<String> = vec!["run".into(), "--verl".into()];
        args.extend(base.iter().cloned());
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, output) = run_binary("jetrl", &args, Duration::from_secs(30));
        assert!(!status.success(), "{extra:?} ran:\n{output}");
        for text in expected {
            assert!(output.contains(text), "{extra:?}: {text} not in\n{output}");
        }
        assert!(!run_dir.exists(), "{extra:?} created {}", run_dir.display());
    }
    // what ran is shown in jetrl's tree
    let mut args: Vec<String> = vec!["config".into(), "show".into(), "--verl".into()];
    args.extend(base.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, output) = run_binary("jetrl", &args, Duration::from_secs(30));
    assert!(status.success(), "{output}");
    let shown: serde_yaml::Value = serde_yaml::from_str(&output).unwrap();
    assert_eq!(shown["actor"]["ppo_mini_batch_size"].as_u64(), Some(256), "verl's default:\n{output}");
    assert_eq!(shown["actor"]["ppo_max_token_len"].as_u64(), Some(4 * 1024), "4 × (512 + 512):\n{output}");
}

/// verl's default `trainer.device=cuda` (and jetrl's `model.device=cuda`) on a machine without a GPU (here: none
/// made visible to libtorch) is refused before anything starts, naming the key the user wrote and the fix, instead
/// of crash-looping every trainer rank and rollout worker.
#[test]
fn cuda_without_a_gpu_is_refused_before_anything_starts() {
    let dir = test_dir("verl-no-gpu");
    let run_dir = dir.path().join("run");
    let verl = vec![
        "run".to_string(),
        "--verl".into(),
        "algorithm.adv_estimator=grpo".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
        format!("+run.dir={}", run_dir.display()),
    ];
    let demo = vec![
        "run".to_string(),
        repo().join("configs/demo.yaml").display().to_string(),
        "model.device=cuda".into(),
        format!("run.dir={}", run_dir.display()),
    ];
    for (args, expected) in
        [(verl, ["trainer.device=cuda", "trainer.device=cpu"]), (demo, ["model.device=cuda:0", "model.device=cpu"])]
    {
        let out = std::process::Command::new(jetrl_tests::bin("jetrl"))
            .args(&args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{args:?} ran:\n{text}");
        for needed in expected {
            assert!(text.contains(needed), "{args:?}: {needed} not in\n{text}");
        }
        assert!(!run_dir.exists(), "{args:?} created {}", run_dir.display());
    }
}

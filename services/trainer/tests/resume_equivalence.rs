//! Resuming from a checkpoint gives the same training as not stopping: N steps straight and N/2 steps, a
//! checkpoint, a fresh actor loaded from it and N/2 more steps end with the same weights, on fixed batches
//! (the real tiny model, every piece of state in play: shuffled mini-batches, micro-batches, warmup + cosine
//! LR, AdamW moments, the reference model, an adaptive in-reward KL controller, the critic).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::path::Path;

use jetrl_config::JobConfig;
use jetrl_trainer::actor::{Actor, OldPolicy};
use jetrl_trainer::batch::{RankBatch, Sample};
use jetrl_trainer::checkpoint;
use jetrl_trainer::checkpoint::ActorState;
use jetrl_trainer::dist::Comm;
use jetrl_trainer::synthetic;
use tch::Tensor;

const STEPS: u64 = 4;

/// The fixed batch of a step: 4 prompt groups of 4 trajectories, lengths varying, scores in [0, 1].
fn batch(step: u64) -> Vec<Sample> {
    synthetic::batch(step, 4, 6)
}

fn config(model: &Path, critic: bool) -> JobConfig {
    synthetic::job_config(model, critic)
}

/// Every trainable tensor the run ends with: the actor's, and the critic's as its checkpoint holds them (with
/// LoRA, its adapter file: the adapters and the head).
fn final_weights(actor: &Actor, scratch: &Path) -> BTreeMap<String, Tensor> {
    let model = actor.model();
    let mut out: BTreeMap<String, Tensor> = model
        .parameters()
        .into_iter()
        .chain(model.lora_parameters())
        .map(|(k, v)| (format!("actor.{k}"), v.detach().copy()))
        .collect();
    if actor.has_critic() {
        actor.save_checkpoint(scratch).unwrap();
        let critic = scratch.join("critic");
        let adapter = critic.join(checkpoint::LORA_ADAPTER_DIR).join(jetrl_model::ADAPTER_WEIGHTS_FILE);
        let file = if adapter.exists() { adapter } else { critic.join("model.safetensors") };
        for (k, v) in checkpoint::read_tensors(&file).unwrap() {
            out.insert(format!("critic.{k}"), v);
        }
    }
    out
}

/// A directory holding the tiny model, and the job of [`config`] on it.
fn tiny_job(critic: bool) -> (tempfile::TempDir, JobConfig) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    jetrl_model::init_model("tiny", &model, 3).unwrap();
    let cfg = config(&model, critic);
    (dir, cfg)
}

fn run_and_compare(critic: bool) {
    let (dir, cfg) = tiny_job(critic);
    compare(&dir, &cfg, critic);
}

fn compare(dir: &tempfile::TempDir, cfg: &JobConfig, critic: bool) {
    let cfg = cfg.clone();

    let mut straight = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    let mut straight_metrics = Vec::new();
    for step in 1..=STEPS {
        straight_metrics
            .push(straight.train(&RankBatch::whole(batch(step)), step, OldPolicy::Current).unwrap().metrics);
    }

    let mut first = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    for step in 1..=STEPS / 2 {
        first.train(&RankBatch::whole(batch(step)), step, OldPolicy::Current).unwrap();
    }
    let ckpt = dir.path().join("global_step_2");
    let state: ActorState = first.save_checkpoint(&ckpt).unwrap();
    drop(first);
    let mut resumed = Actor::new(&cfg, STEPS, Some((&ckpt, &state)), Comm::Solo).unwrap();
    let mut resumed_metrics = Vec::new();
    for step in STEPS / 2 + 1..=STEPS {
        resumed_metrics.push(resumed.train(&RankBatch::whole(batch(step)), step, OldPolicy::Current).unwrap().metrics);
    }

    let a = final_weights(&straight, &dir.path().join("scratch_a"));
    let b = final_weights(&resumed, &dir.path().join("scratch_b"));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let initial = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    let initial: BTreeMap<String, Tensor> =
        initial.model().parameters().into_iter().chain(initial.model().lora_parameters()).collect();
    let mut worst = (0.0f64, String::new());
    let mut moved = 0.0f64;
    for (name, x) in &a {
        let diff = f64::try_from((x - &b[name]).abs().max()).unwrap();
        if diff > worst.0 {
            worst = (diff, name.clone());
        }
        if let Some(start) = name.strip_prefix("actor.").and_then(|n| initial.get(n)) {
            moved = moved.max(f64::try_from((x - start).abs().max()).unwrap());
        }
    }
    assert!(worst.0 <= 1e-6, "weights differ after resume: max |Δ| {} in {}", worst.0, worst.1);
    assert!(moved > 1e-3, "training barely moved the weights ({moved}): the comparison would prove nothing");
    // the loss curve is the same too, step for step
    let mut keys = vec!["actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/reward_kl_penalty_coeff"];
    if critic {
        keys.push("critic/vf_loss");
    }
    assert_eq!(resumed_metrics.len(), STEPS as usize / 2);
    for (s, r) in straight_metrics[STEPS as usize / 2..].iter().zip(&resumed_metrics) {
        for key in &keys {
            let (expected, got) = (s[*key], r[*key]);
            assert!((expected - got).abs() <= 1e-6 * expected.abs().max(1.0), "{key}: {expected} vs {got}");
        }
    }
    // the adaptive controller moved, so its state mattered
    let coeffs: Vec<f64> = straight_metrics.iter().map(|m| m["actor/reward_kl_penalty_coeff"]).collect();
    assert!(coeffs.windows(2).any(|w| w[0] != w[1]), "{coeffs:?}");
}

#[test]
fn grpo_run_resumed_at_half_way_ends_with_the_same_weights_as_the_straight_run() {
    run_and_compare(false);
}

#[test]
fn gae_run_with_critic_resumed_at_half_way_ends_with_the_same_actor_and_critic_weights() {
    run_and_compare(true);
}

/// LoRA: the checkpoint holds the adapter in PEFT's layout (no base weights) and the optimizer state of the
/// adapters only; the resumed run's adapters equal the straight run's, and the base never moves.
#[test]
fn lora_run_resumed_at_half_way_ends_with_the_same_adapter_as_the_straight_run() {
    let (dir, mut cfg) = tiny_job(false);
    cfg.model.lora_rank = 8;
    cfg.model.lora_alpha = 16.0;
    cfg.actor.optim.lr = 1e-2;
    compare(&dir, &cfg, false);
    let mut actor = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    actor.train(&RankBatch::whole(batch(1)), 1, OldPolicy::Current).unwrap();
    let ckpt = dir.path().join("lora_ckpt");
    actor.save_checkpoint(&ckpt).unwrap();
    let adapter = ckpt.join("actor").join(checkpoint::LORA_ADAPTER_DIR);
    assert!(adapter.join("adapter_config.json").is_file() && adapter.join("adapter_model.safetensors").is_file());
    assert!(!ckpt.join("actor/model.safetensors").exists(), "a LoRA checkpoint holds no base weights");
    let optim: BTreeMap<String, Tensor> =
        checkpoint::read_tensors(&ckpt.join("actor/optimizer.safetensors")).unwrap().into_iter().collect();
    let adapter_numel: i64 = actor.model().lora_parameters().values().map(|t| t.numel() as i64).sum();
    assert_eq!(optim["exp_avg"].size(), vec![adapter_numel], "the optimizer holds the adapters' state only");
    let base = jetrl_model::CausalLm::load(Path::new(&cfg.model.path), tch::Device::Cpu, jetrl_model::DType::F32)
        .unwrap()
        .parameters();
    for (name, p) in actor.model().parameters() {
        assert!(f64::try_from((&p - &base[&name]).abs().max()).unwrap() == 0.0, "the base moved: {name}");
    }
}

fn copies(tensors: BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    tensors.into_iter().map(|(k, v)| (k, v.detach().copy())).collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

/// The critic's LoRA (`critic.model.lora_rank`, the actor in full), in-process on the real tiny model: the
/// resumed run ends with the straight run's critic adapters and head (and actor). With the actor held back
/// (`critic_warmup`) on one batch, the critic's loss falls; its adapters and head move and its trunk does not;
/// the checkpoint's `critic/` is a PEFT `TOKEN_CLS` adapter (the adapters and `score`, listed in
/// `modules_to_save`; no trunk weights) beside the optimizer state of the adapters and the head only.
#[test]
fn critic_lora_trains_adapters_and_head_and_resumes_to_the_same_values() {
    let (dir, mut cfg) = tiny_job(true);
    cfg.critic.model.lora_rank = 8;
    cfg.critic.model.lora_alpha = 16.0;
    cfg.critic.optim.lr = 1e-2;
    compare(&dir, &cfg, true);

    cfg.trainer.critic_warmup = 100;
    let mut actor = Actor::new(&cfg, 8, None, Comm::Solo).unwrap();
    let critic = actor.critic().unwrap();
    let (head, adapters) = (copies(critic.head()), copies(critic.model().lora_parameters()));
    assert_eq!(adapters.len(), 2 * 7 * critic.model().config().num_hidden_layers as usize, "all-linear");
    let losses: Vec<f64> = (1..=8)
        .map(|step| {
            actor.train(&RankBatch::whole(batch(1)), step, OldPolicy::Current).unwrap().metrics["critic/vf_loss"]
        })
        .collect();
    eprintln!("critic/vf_loss over 8 steps on one batch: {losses:?}");
    assert!(losses[7] < 0.5 * losses[0], "the critic's loss did not fall: {losses:?}");
    let critic = actor.critic().unwrap();
    let trunk = jetrl_model::CausalLm::load(Path::new(&cfg.model.path), tch::Device::Cpu, jetrl_model::DType::F32)
        .unwrap()
        .parameters();
    for (name, p) in critic.model().parameters() {
        assert_eq!(max_abs_diff(&p, &trunk[&name]), 0.0, "the critic's trunk moved: {name}");
    }
    let moved = |before: &BTreeMap<String, Tensor>, after: BTreeMap<String, Tensor>| {
        after.iter().map(|(k, v)| max_abs_diff(v, &before[k])).fold(0.0, f64::max)
    };
    assert!(moved(&head, critic.head()) > 1e-3, "the value head did not train");
    assert!(moved(&adapters, critic.model().lora_parameters()) > 1e-3, "the adapters did not train");

    let ckpt = dir.path().join("critic_lora_ckpt");
    actor.save_checkpoint(&ckpt).unwrap();
    let adapter = ckpt.join("critic").join(checkpoint::LORA_ADAPTER_DIR);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["task_type"], "TOKEN_CLS");
    assert_eq!(config["modules_to_save"], serde_json::json!(["score"]));
    assert_eq!((config["r"].as_i64(), config["lora_alpha"].as_f64()), (Some(8), Some(16.0)));
    let saved: BTreeMap<String, Tensor> =
        checkpoint::read_tensors(&adapter.join(jetrl_model::ADAPTER_WEIGHTS_FILE)).unwrap().into_iter().collect();
    let mut expected: Vec<String> =
        adapters.keys().chain(head.keys()).map(|k| format!("base_model.model.{k}")).collect();
    expected.sort();
    assert_eq!(saved.keys().cloned().collect::<Vec<_>>(), expected, "the adapters and the head, nothing else");
    assert!(!ckpt.join("critic/model.safetensors").exists(), "a LoRA critic's checkpoint holds no trunk weights");
    let optim: BTreeMap<String, Tensor> =
        checkpoint::read_tensors(&ckpt.join("critic/optimizer.safetensors")).unwrap().into_iter().collect();
    let numel: i64 = adapters.values().chain(head.values()).map(|t| t.numel() as i64).sum();
    assert_eq!(optim["exp_avg"].size(), vec![numel], "the critic's optimizer holds the adapters' and head's state");
}

#[test]
fn checkpoint_holds_hf_model_directories_and_optimizer_state() {
    let (dir, cfg) = tiny_job(true);
    let mut actor = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    for step in 1..=2 {
        actor.train(&RankBatch::whole(batch(step)), step, OldPolicy::Current).unwrap();
    }
    let ckpt = dir.path().join("global_step_2");
    actor.save_checkpoint(&ckpt).unwrap();
    for file in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "optimizer.safetensors"]
    {
        assert!(ckpt.join("actor").join(file).exists(), "actor/{file}");
        assert!(ckpt.join("critic").join(file).exists(), "critic/{file}");
    }
    let critic_cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("critic/config.json")).unwrap()).unwrap();
    assert_eq!(critic_cfg["architectures"][0], "Qwen2ForTokenClassification");
    assert_eq!(critic_cfg["num_labels"], 1);
    let critic_tensors: BTreeMap<String, Tensor> =
        checkpoint::read_tensors(&ckpt.join("critic/model.safetensors")).unwrap().into_iter().collect();
    assert_eq!(critic_tensors["score.weight"].size(), vec![1, 128]);
    let optim: BTreeMap<String, Tensor> =
        checkpoint::read_tensors(&ckpt.join("actor/optimizer.safetensors")).unwrap().into_iter().collect();
    // the flat state of the one rank: moments and fp32 master weights of every parameter, end to end
    let numel: i64 = jetrl_model::CausalLm::load(&ckpt.join("actor"), tch::Device::Cpu, jetrl_model::DType::F32)
        .unwrap()
        .parameters()
        .values()
        .map(|t| t.numel() as i64)
        .sum();
    for name in ["exp_avg", "exp_avg_sq", "master"] {
        assert_eq!(optim[name].size(), vec![numel], "{name}");
    }
    // the actor directory is a model the trainer (and transformers) can load as is
    jetrl_model::CausalLm::load(&ckpt.join("actor"), tch::Device::Cpu, jetrl_model::DType::F32).unwrap();
}

/// AdamW's bias correction depends on its step count: a checkpoint whose `optimizer.json` does not say it (a
/// missing key, a wrong type, not JSON) must fail the resume naming the file, never restart the count at 0.
#[test]
fn resume_with_a_malformed_optimizer_json_fails_naming_the_file() {
    let (dir, cfg) = tiny_job(true);
    let mut actor = Actor::new(&cfg, STEPS, None, Comm::Solo).unwrap();
    actor.train(&RankBatch::whole(batch(1)), 1, OldPolicy::Current).unwrap();
    let ckpt = dir.path().join("global_step_1");
    let state = actor.save_checkpoint(&ckpt).unwrap();
    drop(actor);
    Actor::new(&cfg, STEPS, Some((&ckpt, &state)), Comm::Solo).expect("the checkpoint as written resumes");
    for role in ["actor", "critic"] {
        let file = ckpt.join(role).join(checkpoint::OPTIMIZER_META_FILE);
        let written = std::fs::read_to_string(&file).unwrap();
        for bad in [r#"{"steps": 1}"#, r#"{"step": "1"}"#, r#"{"step": -1}"#, "step: 1"] {
            std::fs::write(&file, bad).unwrap();
            let err = Actor::new(&cfg, STEPS, Some((&ckpt, &state)), Comm::Solo)
                .err()
                .unwrap_or_else(|| panic!("{role}: {bad} resumed"));
            assert!(err.to_string().contains(&file.display().to_string()), "{role}: {bad}: {err}");
        }
        std::fs::write(&file, written).unwrap();
    }
}

//! LoRA adapters: a new adapter changes nothing, switched off it is the base, merged it is the same model, its
//! files and blobs round-trip, a rollout engine's merger reproduces the adapted forward, and bad specs or files
//! are refused by name. (PEFT itself reading and writing these files: `tests/tests/peft.rs`.)

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{token_log_probs, CausalLm, DType, LoraMerger, LoraSpec, Targets};
use tch::{Device, Kind, Tensor};

fn model() -> CausalLm {
    CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap()
}

fn batch() -> (Tensor, Tensor) {
    let ids = Tensor::from_slice(&[1i64, 87, 85, 266, 201, 57, 0, 0, 9, 14]).view([2, 5]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 0, 1, 1, 1, 1]).view([2, 5]);
    (ids, mask)
}

fn log_probs(model: &CausalLm) -> Tensor {
    let (ids, mask) = batch();
    tch::no_grad(|| token_log_probs(&model.forward(&ids, &mask).unwrap(), &ids, 1.0).unwrap())
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn all_linear(rank: i64) -> LoraSpec {
    LoraSpec::new(rank, 2.0 * rank as f64, Targets::AllLinear, Vec::new())
}

/// Gives every `B` random values, so the adapter changes the model.
fn perturb(model: &CausalLm) {
    tch::no_grad(|| {
        for (name, mut t) in model.lora_parameters() {
            if name.contains("lora_B") {
                let _ = t.normal_(0.0, 0.05);
            }
        }
    });
}

#[test]
fn a_new_adapter_changes_nothing_and_only_adapters_train() {
    tch::manual_seed(1);
    let base = log_probs(&model());
    let mut lora = model();
    lora.add_lora(&all_linear(4)).unwrap();
    assert_eq!(max_diff(&base, &log_probs(&lora)), 0.0);
    let (_, modules) = lora.lora_spec().unwrap();
    assert_eq!(modules.len(), 7 * lora.config().num_hidden_layers as usize);
    let trainable = lora.trainable_parameters();
    assert_eq!(trainable.len(), 2 * modules.len());
    assert!(trainable.keys().all(|k| k.contains(".lora_A.weight") || k.contains(".lora_B.weight")), "{trainable:?}");
    assert!(lora.parameters().values().all(|p| !p.requires_grad()), "the base is frozen");
    assert!(trainable.values().all(|p| p.requires_grad() && p.kind() == Kind::Float));

    // gradients reach the adapters (B first: A's gradient is zero while B is)
    let (ids, mask) = batch();
    let loss = token_log_probs(&lora.forward(&ids, &mask).unwrap(), &ids, 1.0).unwrap().sum(Kind::Float);
    loss.backward();
    let b = &trainable["model.layers.0.self_attn.q_proj.lora_B.weight"];
    assert!(b.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0);
}

#[test]
fn switched_off_the_adapter_is_the_base_and_merged_it_is_the_same_model() {
    tch::manual_seed(2);
    let base = log_probs(&model());
    let mut lora = model();
    lora.add_lora(&all_linear(4)).unwrap();
    perturb(&lora);
    let adapted = log_probs(&lora);
    assert!(max_diff(&base, &adapted) > 1e-3, "the perturbed adapter changes the log-probs");
    lora.set_lora_enabled(false);
    assert_eq!(max_diff(&base, &log_probs(&lora)), 0.0);
    lora.set_lora_enabled(true);
    lora.merge_lora().unwrap();
    assert!(lora.lora_spec().is_none());
    let merged = log_probs(&lora);
    assert!(max_diff(&adapted, &merged) < 1e-5, "merged differs by {}", max_diff(&adapted, &merged));
}

#[test]
fn peft_files_and_weight_blobs_round_trip() {
    tch::manual_seed(3);
    let spec = LoraSpec::new(8, 16.0, Targets::Names(vec!["q_proj".into(), "v_proj".into()]), Vec::new());
    let mut lora = model();
    lora.add_lora(&spec).unwrap();
    perturb(&lora);
    let adapted = log_probs(&lora);
    let dir = tempfile::tempdir().unwrap();
    lora.save_lora(dir.path(), "/models/base").unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["r"], 8);
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["base_model_name_or_path"], "/models/base");
    assert_eq!(config["target_modules"], serde_json::json!(["q_proj", "v_proj"]));
    let keys = safetensors_keys(&dir.path().join("adapter_model.safetensors"));
    assert!(keys.contains(&"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string()), "{keys:?}");
    assert_eq!(keys.len(), 2 * 2 * lora.config().num_hidden_layers as usize);

    let mut loaded = model();
    let read = loaded.load_lora(dir.path()).unwrap();
    assert_eq!(read.spec, spec);
    assert_eq!(max_diff(&adapted, &log_probs(&loaded)), 0.0);

    let mut fresh = model();
    fresh.add_lora(&spec).unwrap();
    fresh.load_lora_bytes(&lora.lora_to_safetensors_bytes().unwrap()).unwrap();
    assert_eq!(max_diff(&adapted, &log_probs(&fresh)), 0.0);
}

/// A head trained in full beside the adapters (a critic's `score`, PEFT's `modules_to_save`) is saved in the
/// adapter file as PEFT names it and read back with the adapters; a causal LM's `load_lora` refuses such an
/// adapter, and a config that does not list the head is refused naming `modules_to_save`.
#[test]
fn modules_to_save_round_trip_beside_the_adapters() {
    tch::manual_seed(5);
    let spec = LoraSpec::new(4, 8.0, Targets::Names(vec!["v_proj".into()]), Vec::new());
    let mut lora = model();
    lora.add_lora(&spec).unwrap();
    perturb(&lora);
    let head = |w: &Tensor, b: &Tensor| {
        std::collections::BTreeMap::from([
            ("score.bias".to_string(), b.shallow_clone()),
            ("score.weight".to_string(), w.shallow_clone()),
        ])
    };
    let (w, b) = (Tensor::randn([1, 64], (Kind::Float, Device::Cpu)), Tensor::randn([1], (Kind::Float, Device::Cpu)));
    let dir = tempfile::tempdir().unwrap();
    lora.save_lora_with_modules(dir.path(), "/models/base", "TOKEN_CLS", &head(&w, &b)).unwrap();
    let config_path = dir.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (config["task_type"].as_str(), &config["modules_to_save"]),
        (Some("TOKEN_CLS"), &serde_json::json!(["score"]))
    );
    let keys = safetensors_keys(&dir.path().join("adapter_model.safetensors"));
    assert!(keys.contains(&"base_model.model.score.weight".to_string()), "{keys:?}");
    assert!(keys.contains(&"base_model.model.score.bias".to_string()), "{keys:?}");

    let (w2, b2) = (Tensor::zeros([1, 64], (Kind::Float, Device::Cpu)), Tensor::zeros([1], (Kind::Float, Device::Cpu)));
    let mut loaded = model();
    let read = loaded.load_lora_with_modules(dir.path(), &head(&w2, &b2)).unwrap();
    assert_eq!((read.spec, read.modules_to_save), (spec, vec!["score".to_string()]));
    assert!(w2.equal(&w) && b2.equal(&b), "the head read back");
    assert_eq!(max_diff(&log_probs(&lora), &log_probs(&loaded)), 0.0);

    let err = model().load_lora(dir.path()).unwrap_err().to_string();
    assert!(err.contains("modules_to_save"), "{err}");
    // PEFT's TOKEN_CLS config lists classifier names the model lacks: allowed; one without `score` is not
    std::fs::write(&config_path, text.replace("\"score\"", "\"classifier\", \"score\", \"pre_classifier\"")).unwrap();
    model().load_lora_with_modules(dir.path(), &head(&w2, &b2)).unwrap();
    std::fs::write(&config_path, text.replace("\"score\"", "\"classifier\"")).unwrap();
    let err = model().load_lora_with_modules(dir.path(), &head(&w2, &b2)).unwrap_err().to_string();
    assert!(err.contains("modules_to_save") && err.contains("`score`"), "{err}");
}

#[test]
fn a_merger_writes_the_adapted_weights_into_a_plain_model() {
    tch::manual_seed(4);
    let spec = all_linear(4);
    let mut lora = model();
    lora.add_lora(&spec).unwrap();
    let mut plain = model();
    let merger = LoraMerger::new(&mut plain, &spec).unwrap();
    assert!(merger.host_bytes() > 0);
    for _ in 0..2 {
        perturb(&lora);
        merger.apply(&mut plain, &lora.lora_to_safetensors_bytes().unwrap()).unwrap();
        let d = max_diff(&log_probs(&lora), &log_probs(&plain));
        assert!(d < 1e-5, "merged engine weights differ by {d}");
    }
    // a blob for another adapter is refused before any weight changes
    let before = log_probs(&plain);
    let mut other = model();
    other.add_lora(&LoraSpec::new(4, 8.0, Targets::Names(vec!["q_proj".into()]), Vec::new())).unwrap();
    let err = merger.apply(&mut plain, &other.lora_to_safetensors_bytes().unwrap()).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
    assert_eq!(max_diff(&before, &log_probs(&plain)), 0.0);
}

#[test]
fn unknown_modules_and_bad_files_are_refused_by_name() {
    let mut m = model();
    let bad = LoraSpec::new(4, 8.0, Targets::Names(vec!["q_proj".into(), "qkv".into()]), Vec::new());
    let err = m.add_lora(&bad).unwrap_err().to_string();
    assert!(err.contains("`qkv`") && err.contains("q_proj") && err.contains("down_proj"), "{err}");
    let bad = LoraSpec::new(4, 8.0, Targets::AllLinear, vec!["lm_head".into()]);
    assert!(m.add_lora(&bad).unwrap_err().to_string().contains("exclude_modules `lm_head`"));
    let bad = LoraSpec::new(0, 8.0, Targets::AllLinear, Vec::new());
    assert!(m.add_lora(&bad).unwrap_err().to_string().contains("rank >= 1"));
    // exclude leaves the rest
    let spec = LoraSpec::new(4, 8.0, Targets::AllLinear, vec!["mlp.down_proj".into()]);
    m.add_lora(&spec).unwrap();
    let (_, modules) = m.lora_spec().unwrap();
    assert!(modules.iter().all(|n| !n.ends_with("down_proj")) && modules.len() == 6 * 2);

    let dir = tempfile::tempdir().unwrap();
    m.save_lora(dir.path(), "base").unwrap();
    let config_path = dir.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, text.replace("\"use_dora\": false", "\"use_dora\": true")).unwrap();
    let err = model().load_lora(dir.path()).unwrap_err().to_string();
    assert!(err.contains("use_dora"), "{err}");
    std::fs::write(&config_path, text.replace("\"r\": 4", "\"r\": 5")).unwrap();
    let mut wrong_rank = model();
    let err = wrong_rank.load_lora(dir.path()).unwrap_err().to_string();
    assert!(err.contains("adapter_model.safetensors") && err.contains("shape"), "{err}");
    assert!(wrong_rank.lora_spec().is_none(), "a refused adapter is not left attached");
}

fn safetensors_keys(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect()
}

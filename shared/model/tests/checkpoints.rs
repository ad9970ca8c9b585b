//! Saving, loading and swapping weights.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;

use common::*;
use jetrl_model::{init_model, CausalLm, DType, ModelConfig, ModelError};
use tch::{Device, Kind, Tensor};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

fn logits(model: &CausalLm) -> Tensor {
    let ids = Tensor::from_slice(&[1i64, 5, 9, 30, 2, 7]).view([1, 6]);
    tch::no_grad(|| model.forward(&ids, &ids.ones_like())).unwrap()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn save_then_load_round_trips_weights_and_config() {
    let src = hf_sample_llama();
    let model = CausalLm::load(&src, Device::Cpu, DType::F32).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    model.save(tmp.path()).unwrap();
    let again = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    assert_eq!(max_abs(&logits(&model), &logits(&again)), 0.0);
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap()).unwrap();
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert_eq!(saved, original, "an f32 save writes back the config it loaded");
    let st = std::fs::read(tmp.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st).unwrap();
    assert!(st.names().contains(&"lm_head.weight"), "untied models save lm_head");
    assert!(st.names().contains(&"model.layers.1.mlp.down_proj.weight"));
}

#[test]
fn tied_model_saves_without_lm_head_and_shares_one_parameter() {
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny", tmp.path(), 0).unwrap();
    let bytes = std::fs::read(tmp.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(!st.names().contains(&"lm_head.weight"));
    let model = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    assert!(!model.parameters().contains_key("lm_head.weight"));
    assert_eq!(model.var_store().trainable_variables().len(), model.parameters().len());
}

#[test]
fn weight_bytes_swap_in_place_and_reproduce_the_source_model() {
    let src = CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap();
    let config = ModelConfig::from_file(&hf_sample_llama().join("config.json")).unwrap();
    tch::manual_seed(11);
    let mut dst = CausalLm::random(config, Device::Cpu, DType::F32, 0.02).unwrap();
    let before: Vec<(String, usize)> = dst.parameters().into_iter().map(|(n, t)| (n, t.data_ptr() as usize)).collect();
    assert!(max_abs(&logits(&src), &logits(&dst)) > 1e-3);

    let bytes = src.to_safetensors_bytes().unwrap();
    dst.load_safetensors_bytes(&bytes).unwrap();
    assert_eq!(max_abs(&logits(&src), &logits(&dst)), 0.0);
    let after: Vec<(String, usize)> = dst.parameters().into_iter().map(|(n, t)| (n, t.data_ptr() as usize)).collect();
    assert_eq!(before, after, "weights are copied into the existing parameter storage");

    // A bf16 blob converts into the f32 model.
    let half = src.to_safetensors_bytes_as(DType::BF16).unwrap();
    assert!(half.len() < bytes.len() * 6 / 10);
    dst.load_safetensors_bytes(&half).unwrap();
    let delta = max_abs(&logits(&src), &logits(&dst));
    assert!(delta > 0.0 && delta < 0.5, "{delta}");
}

#[test]
fn weight_bytes_from_another_shape_are_rejected_without_touching_the_model() {
    let mut model = CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::F32).unwrap();
    let reference = logits(&model);
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny", tmp.path(), 0).unwrap();
    let other = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    let err = model.load_safetensors_bytes(&other.to_safetensors_bytes().unwrap()).unwrap_err();
    assert!(
        matches!(err, ModelError::TensorShape { .. } | ModelError::MissingTensor { .. } | ModelError::Weights { .. }),
        "{err}"
    );
    assert_eq!(max_abs(&reference, &logits(&model)), 0.0);
    let err = model.load_safetensors_bytes(b"not safetensors").unwrap_err();
    assert!(matches!(err, ModelError::Safetensors { .. }), "{err}");
}

#[test]
fn misshaped_tensor_error_names_the_tensor_and_both_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&hf_sample_llama(), tmp.path());
    edit_config(tmp.path(), |cfg| cfg["intermediate_size"] = serde_json::json!(128));
    let err = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::TensorShape { .. }), "{msg}");
    let both = (msg.contains("[128, 64]") && msg.contains("[160, 64]"))
        || (msg.contains("[64, 128]") && msg.contains("[64, 160]"));
    assert!(msg.contains("mlp.") && both, "{msg}");
}

#[test]
fn missing_tensor_error_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny", tmp.path(), 0).unwrap();
    edit_config(tmp.path(), |cfg| cfg["tie_word_embeddings"] = serde_json::json!(false));
    let err = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap_err();
    assert!(matches!(&err, ModelError::MissingTensor { name, .. } if name == "lm_head.weight"), "{err}");
}

#[test]
fn unknown_architecture_error_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&hf_sample_llama(), tmp.path());
    edit_config(tmp.path(), |cfg| {
        cfg["model_type"] = serde_json::json!("gemma3");
        cfg["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
    });
    let err = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap_err();
    assert!(matches!(err, ModelError::Config(_)) && err.to_string().contains("gemma3"), "{err}");
}

#[test]
fn bf16_model_saves_bf16_weights_and_records_the_dtype() {
    let model = CausalLm::load(&hf_sample_llama(), Device::Cpu, DType::BF16).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    model.save(tmp.path()).unwrap();
    let bytes = std::fs::read(tmp.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("model.norm.weight").unwrap().dtype(), safetensors::Dtype::BF16);
    let cfg = ModelConfig::from_file(&tmp.path().join("config.json")).unwrap();
    assert_eq!(cfg.raw()["dtype"], "bfloat16");
    let again = CausalLm::load(tmp.path(), Device::Cpu, DType::BF16).unwrap();
    assert_eq!(max_abs(&logits(&model), &logits(&again)), 0.0);
    assert_eq!(again.parameters()["model.norm.weight"].kind(), Kind::BFloat16);
}

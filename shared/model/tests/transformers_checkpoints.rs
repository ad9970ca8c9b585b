//! Checkpoints written by HF transformers in every layout jetrl reads (made locally by
//! `make_hf_checkpoints.py`); each must reproduce transformers' log-probs within 1e-4 (CPU, f32) and its chat
//! ids exactly. Ignored by a plain `cargo test` (python with transformers is needed); `./dev.sh test` runs them.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{CausalLm, DType};

fn check(name: &str) {
    check_against_reference(&hf_checkpoints().join(name));
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_tied_embeddings_match_transformers() {
    check("qwen2_tied");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_untied_lm_head_matches_transformers() {
    check("qwen2_untied");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_bf16_stored_weights_load_into_f32_and_match_transformers() {
    check("qwen2_bf16");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_sharded_checkpoint_with_index_matches_transformers() {
    assert!(hf_checkpoints().join("qwen2_sharded/model.safetensors.index.json").exists());
    check("qwen2_sharded");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_old_layout_top_level_rope_theta_and_template_in_tokenizer_config_match_transformers() {
    check("qwen2_old_layout");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn llama_biases_and_llama3_rope_scaling_in_rope_parameters_match_transformers() {
    check("llama");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn llama_old_layout_rope_scaling_at_top_level_matches_transformers() {
    check("llama_old_layout");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen3_qk_norm_explicit_head_dim_and_template_list_match_transformers() {
    check("qwen3");
}

/// An MoE checkpoint's log-probs (per sequence and padded), and its load-balancing loss against transformers'
/// `aux_loss` for the same forward.
fn check_moe(name: &str) {
    let dir = hf_checkpoints().join(name);
    check_against_reference(&dir);
    let reference = read_reference(&dir);
    assert_eq!(reference.aux_loss.len(), reference.sequences.len(), "{name}: reference.json has aux_loss");
    let model = CausalLm::load(&dir, tch::Device::Cpu, DType::F32).unwrap();
    let top_k = model.config().moe.as_ref().unwrap().top_k;
    model.collect_router_logits(true);
    for (ids, expected) in reference.sequences.iter().zip(&reference.aux_loss) {
        let ids: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        let input = tch::Tensor::from_slice(&ids).unsqueeze(0);
        let _ = tch::no_grad(|| model.forward(&input, &input.ones_like())).unwrap();
        let loss =
            jetrl_model::load_balancing_loss(&model.take_router_logits(), top_k, None).unwrap().double_value(&[]);
        assert!((loss - f64::from(*expected)).abs() < 1e-5, "{name}: aux loss {loss} vs transformers' {expected}");
    }
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen2_moe_shared_expert_and_qkv_bias_match_transformers() {
    check_moe("qwen2_moe");
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn qwen3_moe_normalised_top_k_and_a_dense_mlp_only_layer_match_transformers() {
    let model = CausalLm::load(&hf_checkpoints().join("qwen3_moe"), tch::Device::Cpu, DType::F32).unwrap();
    assert_eq!(model.sparse_layer_count(), 1, "mlp_only_layers [1] leaves layer 0 sparse, layer 1 dense");
    check_moe("qwen3_moe");
}

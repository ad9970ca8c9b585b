//! Checkpoints written by HF transformers in every layout jetrl reads (made locally by
//! `make_hf_checkpoints.py`); each must reproduce transformers' log-probs within 1e-4 (CPU, f32) and its chat
//! ids exactly. Skipped, with the reason printed, when python cannot import transformers.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;

fn check(name: &str) {
    let Some(root) = hf_checkpoints() else { return };
    check_against_reference(&root.join(name));
}

#[test]
fn qwen2_tied_embeddings_match_transformers() {
    check("qwen2_tied");
}

#[test]
fn qwen2_untied_lm_head_matches_transformers() {
    check("qwen2_untied");
}

#[test]
fn qwen2_bf16_stored_weights_load_into_f32_and_match_transformers() {
    check("qwen2_bf16");
}

#[test]
fn qwen2_sharded_checkpoint_with_index_matches_transformers() {
    let Some(root) = hf_checkpoints() else { return };
    assert!(root.join("qwen2_sharded/model.safetensors.index.json").exists());
    check("qwen2_sharded");
}

#[test]
fn qwen2_old_layout_top_level_rope_theta_and_template_in_tokenizer_config_match_transformers() {
    check("qwen2_old_layout");
}

#[test]
fn llama_biases_and_llama3_rope_scaling_in_rope_parameters_match_transformers() {
    check("llama");
}

#[test]
fn llama_old_layout_rope_scaling_at_top_level_matches_transformers() {
    check("llama_old_layout");
}

#[test]
fn qwen3_qk_norm_explicit_head_dim_and_template_list_match_transformers() {
    check("qwen3");
}

//! Checkpoints written by HF transformers in every layout jetrl reads (made locally by
//! `make_hf_checkpoints.py`); each must reproduce transformers' log-probs within 1e-4 (CPU, f32) and its chat
//! ids exactly. Ignored by a plain `cargo test` (python with transformers is needed); `./dev.sh test` runs them.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;

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

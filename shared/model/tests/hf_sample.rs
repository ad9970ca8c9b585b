//! The golden checkpoint written by transformers 5 (`tests/golden/hf-sample/llama`): jetrl must reproduce its
//! log-probs within 1e-4 on the CPU in f32 and its chat ids exactly.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use common::*;
use jetrl_model::{CausalLm, DType, Tokenizer};
use tch::Device;

#[test]
fn hf_sample_llama_log_probs_match_transformers_per_sequence_and_padded() {
    let d = check_against_reference(&hf_sample_llama());
    assert!(d.count > 100, "the reference should cover many tokens, got {}", d.count);
}

#[test]
fn hf_sample_chat_template_ids_match_transformers() {
    let dir = hf_sample_llama();
    let reference = read_reference(&dir);
    assert!(!reference.chat.is_empty());
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    for case in &reference.chat {
        let ids = tokenizer.apply_chat_template(&case.messages, case.add_generation_prompt).unwrap();
        assert_eq!(ids, case.ids, "add_generation_prompt={}", case.add_generation_prompt);
    }
}

#[test]
fn hf_sample_special_tokens_come_from_generation_config_and_tokenizer_config() {
    let tokenizer = Tokenizer::from_dir(&hf_sample_llama()).unwrap();
    assert_eq!(tokenizer.eos_token_ids(), &[2, 0]);
    assert_eq!(tokenizer.pad_token_id(), Some(0));
    let ids = tokenizer.encode("What is 7 times 6?", false).unwrap();
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), "What is 7 times 6?");
}

#[test]
fn hf_sample_loads_in_bf16_close_to_the_f32_reference() {
    let dir = hf_sample_llama();
    let reference = read_reference(&dir);
    let model = CausalLm::load(&dir, Device::Cpu, DType::BF16).unwrap();
    let ours = per_sequence_logprobs(&model, &reference.sequences);
    let d = diff(&ours, &reference.logprobs);
    println!("bf16 vs f32 reference: max {:.3e} mean {:.3e}", d.max, d.mean);
    assert!(d.mean < 0.05 && d.max < 0.5, "{d:?}");
}

//! `init_model` writes an HF model directory that jetrl and transformers both load.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::process::Command;

use common::*;
use jetrl_model::{init_model, log_probs_of, CausalLm, DType, ModelError, Tokenizer, TOOL_CALL_TOKENS};
use serde::Deserialize;
use tch::Device;

#[test]
fn tiny_preset_writes_a_complete_hf_directory() {
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny", tmp.path(), 1).unwrap();
    for file in
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    {
        assert!(tmp.path().join(file).exists(), "{file} missing");
    }
    let model = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    let cfg = model.config();
    assert_eq!(cfg.raw()["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(cfg.raw()["model_type"], "qwen2");
    assert_eq!(
        (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads),
        (2, 128, 4, 2)
    );
    assert_eq!((cfg.intermediate_size, cfg.max_position_embeddings, cfg.rope_theta), (512, 512, 10000.0));
    assert!(cfg.tie_word_embeddings);

    let params = model.parameters();
    let std = f64::try_from(params["model.layers.0.mlp.up_proj.weight"].std(true)).unwrap();
    assert!((std - 0.02).abs() < 0.002, "linear init std {std}");
    let norm = &params["model.layers.1.input_layernorm.weight"];
    assert_eq!(f64::try_from(norm.min()).unwrap(), 1.0);
    assert_eq!(f64::try_from(params["model.layers.0.self_attn.q_proj.bias"].abs().max()).unwrap(), 0.0);

    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.vocab_size() as i64, cfg.vocab_size);
    assert_eq!(tok.eos_token_ids(), &[0, 2]);
    assert_eq!(tok.pad_token_id(), Some(0));
    let ids = tok.encode("12+30=42", false).unwrap();
    assert_eq!(ids.len(), 8, "one token per character");
    assert_eq!(tok.decode(&ids, false).unwrap(), "12+30=42");
    let text = "what is (3+4)*2?\nanswer: #### 14.";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids.len(), text.chars().count(), "one token per character");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.encode("What", false).unwrap(),
        tok.encode("hat", false).unwrap(),
        "out-of-vocabulary characters are dropped"
    );
    let chat = tok.apply_chat_template(&[serde_json::json!({"role": "user", "content": "2+2?"})], true).unwrap();
    assert_eq!(tok.decode(&chat, false).unwrap(), "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(chat[0], 1, "<|im_start|> is one special token");
}

#[test]
fn tiny_init_is_a_function_of_the_seed() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let c = tempfile::tempdir().unwrap();
    init_model("tiny", a.path(), 5).unwrap();
    init_model("tiny", b.path(), 5).unwrap();
    init_model("tiny", c.path(), 6).unwrap();
    let weights = |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors")).unwrap();
    assert_eq!(weights(&a), weights(&b));
    assert_ne!(weights(&a), weights(&c));
}

#[test]
fn unknown_preset_is_a_config_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let err = init_model("huge", tmp.path(), 0).unwrap_err();
    assert!(matches!(err, ModelError::Config(_)) && err.to_string().contains("huge"), "{err}");
}

#[derive(Deserialize)]
struct Scored {
    sequences: Vec<Vec<u32>>,
    logprobs: Vec<Vec<f32>>,
    chat: Vec<ScoredChat>,
    texts: Vec<ScoredText>,
    eos_token_id: serde_json::Value,
    decoded: String,
}

#[derive(Deserialize)]
struct ScoredChat {
    messages: Vec<minijinja::Value>,
    add_generation_prompt: bool,
    ids: Vec<u32>,
    hf_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ScoredText {
    text: String,
    ids: Vec<u32>,
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn tiny_preset_loads_in_transformers_with_matching_tokens_and_logprobs() {
    let python = python_with_transformers();
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny", tmp.path(), 3).unwrap();
    let out = Command::new(python).arg(script()).arg("score").arg(tmp.path()).output().unwrap();
    assert!(
        out.status.success(),
        "transformers could not load the tiny model:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let scored: Scored = serde_json::from_slice(&out.stdout).unwrap();

    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert!(!scored.chat.is_empty() && scored.texts.len() > 1, "the score script returned no cases to compare");
    for case in &scored.chat {
        let ids = tok.apply_chat_template(&case.messages, case.add_generation_prompt).unwrap();
        assert_eq!(ids, case.ids, "chat ids vs tokenizer.json");
        assert_eq!(ids, case.hf_ids, "chat ids vs transformers' AutoTokenizer");
    }
    for text in &scored.texts {
        assert_eq!(tok.encode(&text.text, false).unwrap(), text.ids, "{:?}", text.text);
    }
    assert_eq!(tok.decode(&scored.texts[1].ids, false).unwrap(), scored.decoded);
    assert_eq!(scored.eos_token_id, serde_json::json!([0, 2]));

    let model = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    let ours: Vec<Vec<f32>> = scored.sequences.iter().map(|ids| log_probs_of(&model, ids).unwrap()).collect();
    let d = diff(&ours, &scored.logprobs);
    println!("tiny init vs transformers: max {:.3e} mean {:.3e} over {}", d.max, d.mean, d.count);
    assert!(d.max <= LOGPROB_TOL, "{d:?}");
}

#[test]
fn tiny_tools_writes_a_calculator_call_with_two_added_tokens_that_decode_to_their_text() {
    let tmp = tempfile::tempdir().unwrap();
    init_model("tiny-tools", tmp.path(), 1).unwrap();
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let model = CausalLm::load(tmp.path(), Device::Cpu, DType::F32).unwrap();
    assert_eq!(tok.vocab_size() as i64, model.config().vocab_size);
    let [open, close] = TOOL_CALL_TOKENS;
    let (open_id, close_id) = (tok.token_to_id(open).unwrap(), tok.token_to_id(close).unwrap());
    assert_eq!((open_id, close_id), (17, 18), "after the 3 special tokens and 14 characters");

    let call = format!("{open}37*58{close}");
    let ids = tok.encode(&call, false).unwrap();
    assert_eq!(ids.len(), 7, "open, 5 characters, close: {ids:?}");
    assert_eq!((ids[0], ids[6]), (open_id, close_id));
    for skip_special in [false, true] {
        let text = tok.decode(&ids, skip_special).unwrap();
        assert_eq!(text, call, "the added tokens are not special: kept when special tokens are skipped");
        let body = text.strip_prefix("<tool_call>").unwrap().strip_suffix("</tool_call>").unwrap();
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json, serde_json::json!({"name": "calculator", "arguments": {"expression": "37*58"}}));
    }
    // a response's tool turn is the template's appended `tool` message (its letters are not in the vocabulary)
    let messages = [
        serde_json::json!({"role": "user", "content": "37*58="}),
        serde_json::json!({"role": "assistant", "content": call}),
        serde_json::json!({"role": "tool", "content": "2146"}),
    ];
    let chat = tok.apply_chat_template(&messages, true).unwrap();
    // what transformers 5.25's AutoTokenizer (Qwen2Tokenizer) gives for this directory and these messages
    let hf: [u32; 31] =
        [1, 14, 6, 10, 16, 8, 11, 15, 2, 14, 1, 14, 17, 6, 10, 16, 8, 11, 18, 2, 14, 1, 14, 5, 4, 7, 9, 2, 14, 1, 14];
    assert_eq!(chat, hf);
    assert_eq!(
        tok.decode(&chat, false).unwrap(),
        format!("<|im_start|>\n37*58=<|im_end|>\n<|im_start|>\n{call}<|im_end|>\n<|im_start|>\n2146<|im_end|>\n<|im_start|>\n")
    );
}

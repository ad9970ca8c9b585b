//! Random-init model directories in exact HF format, for tests, demos and from-scratch runs.
//!
//! The `tiny` preset is a 2-layer Qwen2 with a character-level tokenizer: digits, lowercase letters, space,
//! newline and arithmetic punctuation, one token each. A random policy over 62 symbols can stumble onto digit
//! answers, which a 150k-token vocabulary would make hopeless.
//!
//! The tokenizer is a byte-level BPE with no merges whose pipeline is exactly Qwen2's (NFC, Qwen's split
//! regex, byte-level alphabet: space is `Ġ`, newline `Ċ`). transformers 5 always rebuilds that pipeline in code
//! for `model_type: qwen2` (`Qwen2Tokenizer`, whatever `tokenizer_class` says) and keeps only the vocabulary,
//! so any other pipeline in tokenizer.json would tokenize differently in HF than here. Characters outside the
//! vocabulary (upper case included) are dropped by both, so callers should lower-case text for this model.

use std::path::Path;

use serde_json::{json, Value};
use tch::Device;

use crate::config::ModelConfig;
use crate::device::DType;
use crate::error::{ModelError, Result};
use crate::model::CausalLm;

/// Presets [`init_model`] knows.
pub const PRESETS: &[&str] = &["tiny", "tiny-digits", "tiny-digits-lora", "tiny-digits-moe", "tiny-tools"];

/// Special tokens of the character tokenizer, at ids 0, 1, 2. `<|endoftext|>` is also the pad token.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ordinary symbols of the character tokenizer, ids 3.. in this order.
pub const CHARACTERS: &str = "0123456789abcdefghijklmnopqrstuvwxyz \n=+-*/.,:;?!#()[]<>'\"_";

/// The symbols of `tiny-digits`: the same first ids as `tiny`, but only what digit tasks need (`4821=` →
/// `1284`), so a random policy answers with a digit about 10 times in 16 — the starting point of the demo's
/// learning curve — instead of 10 in 62.
pub const DIGIT_CHARACTERS: &str = "0123456789 \n=";

/// The symbols of `tiny-tools`: `tiny-digits`' symbols (same ids) and `*`, what `37*58=` and a calculator call on
/// it need.
pub const TOOL_CHARACTERS: &str = "0123456789 \n=*";

/// The added (non-special) tokens of `tiny-tools`, after its characters: the text before and after a
/// calculator expression in a Hermes tool call. A character vocabulary has no `{`, `}` or letters, so a call is
/// written as `TOOL_CALL_OPEN`, the expression's characters, `TOOL_CALL_CLOSE`; both decode to exactly this text,
/// which the rollout worker's Hermes parser reads as `{"name": "calculator", "arguments": {"expression": ...}}`.
pub const TOOL_CALL_TOKENS: [&str; 2] =
    ["<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"", "\"}}</tool_call>"];

/// Qwen-style ChatML, without Qwen's default system prompt (it would cost ~60 character tokens per prompt).
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Writes a random-init model directory: config.json (Qwen2ForCausalLM), model.safetensors, tokenizer.json,
/// tokenizer_config.json (with a ChatML `chat_template`) and generation_config.json. `seed` seeds libtorch's
/// global generator (`tch::manual_seed`) before the weights are drawn.
///
/// `tiny-tools` is `tiny-digits` with `*` and the two [`TOOL_CALL_TOKENS`], for the calculator tool agent. Its
/// chat template is the same ChatML: a tool message is one more `<|im_start|>tool` turn appended to the
/// conversation (what the tool agent needs), and the tools' JSON schemas are not rendered (a character
/// vocabulary would spend hundreds of tokens on them, and could not spell them); the model learns the one call
/// it can write from the reward alone.
pub fn init_model(preset: &str, out_dir: &Path, seed: u64) -> Result<()> {
    let (characters, added): (&str, &[&str]) = match preset {
        "tiny" => (CHARACTERS, &[]),
        "tiny-digits" | "tiny-digits-lora" | "tiny-digits-moe" => (DIGIT_CHARACTERS, &[]),
        "tiny-tools" => (TOOL_CHARACTERS, &TOOL_CALL_TOKENS),
        other => {
            return Err(ModelError::Config(format!("unknown model preset `{other}` (known: {})", PRESETS.join(", "))))
        }
    };
    let vocab = vocab_size(characters) + added.len();
    let config = if preset == "tiny-digits-moe" { tiny_moe_config(vocab) } else { tiny_config(vocab) };
    let init_std = 0.02;
    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let config = ModelConfig::from_json(config)?;
    // libtorch's generator is process-global: hold a lock from seeding to the last draw so that two
    // threads initialising at once each get their seed's weights.
    static SEEDED_DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let model = {
        let _guard = SEEDED_DRAW.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(seed as i64);
        CausalLm::random(config, Device::Cpu, DType::F32, init_std)?
    };
    if preset == "tiny-digits-lora" {
        // A LoRA run cannot move the final norm or the (tied) embeddings, and with HF's init (std 0.02) the
        // logits span about ±2.6, which caps a token's probability near one half. This base has the output scale
        // of a trained model instead: the final norm's weight at 4, everything else `tiny-digits`' (same seed,
        // same weights).
        let norm = model.parameters().remove("model.norm.weight");
        if let Some(mut norm) = norm {
            let _ = tch::no_grad(|| norm.f_fill_(4.0))?;
        }
    }
    model.save(out_dir)?;
    write_json(&out_dir.join("tokenizer.json"), &char_tokenizer_json(characters, added))?;
    write_json(&out_dir.join("tokenizer_config.json"), &tokenizer_config_json(characters, added))?;
    write_json(&out_dir.join("generation_config.json"), &json!({ "eos_token_id": [0, 2], "pad_token_id": 0 }))?;
    Ok(())
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::json(path.display().to_string(), e))?;
    std::fs::write(path, text + "\n").map_err(|e| ModelError::io(path, e))
}

fn vocab_size(characters: &str) -> usize {
    SPECIAL_TOKENS.len() + characters.chars().count()
}

/// Qwen3-MoE at the tiny scale: 2 layers 128 wide, 8 experts of width 128, each token routed to 2 (renormalised).
fn tiny_moe_config(vocab_size: usize) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_parameters": { "rope_theta": 10000.0, "rope_type": "default" },
        "tie_word_embeddings": true,
        "use_cache": true,
        "use_sliding_window": false,
        "sliding_window": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "eos_token_id": 2,
        "dtype": "float32",
    })
}

fn tiny_config(vocab_size: usize) -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": { "rope_theta": 10000.0, "rope_type": "default" },
        "tie_word_embeddings": true,
        "use_cache": true,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": 2,
        "attention_dropout": 0.0,
        "eos_token_id": 2,
        "dtype": "float32",
    })
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": special,
    })
}

/// Every added token with its id: the special tokens (0, 1, 2), then `added` after the characters.
fn added_tokens(characters: &str, added: &[&str]) -> Vec<Value> {
    let special = SPECIAL_TOKENS.iter().enumerate().map(|(id, t)| added_token(id, t, true));
    let first = vocab_size(characters);
    special.chain(added.iter().enumerate().map(|(i, t)| added_token(first + i, t, false))).collect()
}

/// Qwen2's pre-tokenizer split (transformers' `Qwen2Tokenizer.PRETOKENIZE_REGEX`).
const QWEN2_SPLIT_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The GPT-2 byte-level alphabet for the ASCII characters used here: printable characters stand for
/// themselves, space and newline are shifted to `Ġ` and `Ċ`.
fn byte_level(c: char) -> char {
    match c {
        ' ' => '\u{120}',
        '\n' => '\u{10a}',
        c => c,
    }
}

/// A byte-level BPE with one token per character and no merges, in Qwen2's pipeline; `added` are whole-text
/// tokens after the characters (matched in the raw text before the pipeline runs, as added tokens are).
fn char_tokenizer_json(characters: &str, added: &[&str]) -> Value {
    let mut vocab = serde_json::Map::new();
    for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
        vocab.insert((*token).to_string(), json!(id));
    }
    for (offset, c) in characters.chars().enumerate() {
        vocab.insert(byte_level(c).to_string(), json!(SPECIAL_TOKENS.len() + offset));
    }
    for (offset, token) in added.iter().enumerate() {
        vocab.insert((*token).to_string(), json!(vocab_size(characters) + offset));
    }
    let added = added_tokens(characters, added);
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": { "type": "NFC" },
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": QWEN2_SPLIT_REGEX },
                    "behavior": "Isolated",
                    "invert": false,
                },
                { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
            ],
        },
        "post_processor": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
        "decoder": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

fn tokenizer_config_json(characters: &str, added: &[&str]) -> Value {
    let mut decoder = serde_json::Map::new();
    for mut entry in added_tokens(characters, added) {
        let id = entry["id"].clone();
        if let Some(map) = entry.as_object_mut() {
            map.remove("id");
        }
        decoder.insert(id.to_string(), entry);
    }
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
    })
}

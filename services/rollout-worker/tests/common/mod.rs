//! Shared helpers: a character tokenizer covering printable ASCII (so scripted model turns can write JSON tool
//! calls), the tiny random model, a real nats-server with the job config pointing at it.
#![allow(dead_code)]

use std::path::Path;

use serde_json::{json, Value};

/// Special tokens at ids 0, 1, 2, as in the `tiny` preset.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Writes tokenizer.json (one token per printable ASCII character, byte-level like Qwen2), tokenizer_config.json
/// with the ChatML template, and generation_config.json (EOS = <|im_end|>, <|endoftext|>) into `dir`.
pub fn write_ascii_tokenizer(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let mut vocab = serde_json::Map::new();
    for (id, token) in SPECIALS.iter().enumerate() {
        vocab.insert((*token).to_string(), json!(id));
    }
    let chars: Vec<char> = (32u8..127).map(char::from).chain(['\n']).collect();
    for (offset, c) in chars.iter().enumerate() {
        let shown = match c {
            ' ' => '\u{120}',
            '\n' => '\u{10a}',
            c => *c,
        };
        vocab.insert(shown.to_string(), json!(SPECIALS.len() + offset));
    }
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, t)| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "bos_token": null,
                        "chat_template": jetrl_model::init::CHATML_TEMPLATE});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("generation_config.json"), json!({"eos_token_id": [2, 0]}).to_string()).unwrap();
}

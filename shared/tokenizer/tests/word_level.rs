//! A checkpoint directory written by hand (`tests/fixtures/chatml-word-level`: a word-level `tokenizer.json`, a
//! ChatML template that starts with a BOS) loads, renders and round-trips without libtorch. Other crates' tests
//! (the reward service's) use the same fixture.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use jetrl_tokenizer::{Tokenizer, TokenizerError};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chatml-word-level")
}

#[test]
fn chat_template_renders_with_the_special_tokens_of_tokenizer_config() {
    let tokenizer = Tokenizer::from_dir(&fixture()).unwrap();
    let chat = [
        serde_json::json!({"role": "user", "content": "reverse 1234"}),
        serde_json::json!({"role": "assistant", "content": "4321"}),
    ];
    let text = tokenizer.render_chat(&chat, None::<&[serde_json::Value]>, false).unwrap();
    assert_eq!(text, "<s><|im_start|>user\nreverse 1234<|im_end|>\n<|im_start|>assistant\n4321<|im_end|>\n");
    assert_eq!(tokenizer.special_token("bos_token"), Some("<s>"));
    assert_eq!(tokenizer.special_token("cls_token"), None);
    assert_eq!(tokenizer.eos_token_ids(), &[3]);
}

#[test]
fn encode_then_decode_keeps_special_tokens_unless_asked_to_skip_them() {
    let tokenizer = Tokenizer::from_dir(&fixture()).unwrap();
    let ids =
        tokenizer.apply_chat_template(&[serde_json::json!({"role": "user", "content": "reverse 1234"})], true).unwrap();
    assert_eq!(ids, [1, 2, 4, 7, 8, 3, 2, 5]);
    assert_eq!(
        tokenizer.decode(&ids, false).unwrap(),
        "<s> <|im_start|> user reverse 1234 <|im_end|> <|im_start|> assistant"
    );
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "user reverse 1234 assistant");
}

#[test]
fn template_that_raises_is_a_chat_template_error_with_its_message() {
    let tokenizer = Tokenizer::from_dir(&fixture()).unwrap();
    let chat = [serde_json::json!({"role": "tool", "content": "42"})];
    let err = tokenizer.render_chat(&chat, None::<&[serde_json::Value]>, false).unwrap_err();
    assert!(matches!(err, TokenizerError::ChatTemplate(_)), "{err}");
    assert!(err.to_string().contains("tool turns are not supported"), "{err}");
}

#[test]
fn directory_without_tokenizer_json_is_a_tokenizer_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::Tokenizer(_)), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

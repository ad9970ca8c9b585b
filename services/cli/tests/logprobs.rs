//! `jetrl logprobs` with real models and real libtorch: the tiny preset (`init_model("tiny", ...)`, 512
//! positions, 62 tokens) and the golden checkpoint written by transformers 5 (`tests/golden/hf-sample/llama`).
//! Output line i answers input line i; a bad line is reported with its number and the run goes on.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use jetrl_cli::logprobs::{logprobs_jsonl, Driver, LineError, Summary};
use jetrl_model::{log_probs_of, CausalLm, DType};
use serde_json::{json, Value};
use tch::Device;

/// The tiny preset, written once per test binary.
fn tiny() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        jetrl_model::init_model("tiny", dir.path(), 7).unwrap();
        dir
    })
    .path()
}

fn hf_sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/hf-sample/llama")
}

/// Runs the driver on `input`; the output lines as JSON.
fn run(dir: &Path, input: &str) -> (Summary, Vec<Value>) {
    let mut output = Vec::new();
    let summary = logprobs_jsonl(dir, None, Device::Cpu, DType::F32, input.as_bytes(), &mut output).unwrap();
    let lines = String::from_utf8(output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (summary, lines)
}

fn ids_of(answer: &Value) -> Vec<u32> {
    serde_json::from_value(answer["ids"].clone()).unwrap()
}

fn logprobs_of(answer: &Value) -> Vec<f32> {
    serde_json::from_value(answer["logprobs"].clone()).unwrap()
}

#[test]
fn every_input_line_gets_its_own_output_line_and_a_bad_one_does_not_stop_the_rest() {
    let input = [
        r#"{"ids": [3, 4, 5, 6]}"#,
        r#"{"ids": "nope"}"#,
        "",
        "not json",
        r#"{"ids": [3, 4], "messages": []}"#,
        r#"{"ids": [3, 4], "add_generation_promt": true}"#,
        r#"{"messages": [{"role": "user", "content": "what is 2+2?"}], "add_generation_prompt": true}"#,
        r#"{"ids": [3, 4]} trailing"#,
        r#"{"ids": [7, 8, 9]}"#,
    ]
    .join("\n");
    let (summary, lines) = run(tiny(), &input);
    assert_eq!(summary, Summary { lines: 9, refused: 6 });
    assert_eq!(lines.len(), 9);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["line"], json!(i + 1), "{line}");
    }
    let error = |i: usize| lines[i]["error"].as_str().unwrap_or_default().to_string();
    assert_eq!(ids_of(&lines[0]), [3, 4, 5, 6]);
    assert_eq!(logprobs_of(&lines[0]).len(), 3);
    assert!(error(1).contains("`ids`: invalid type: string \"nope\""), "{}", error(1));
    assert_eq!(error(2), "empty line: expected a JSON request");
    assert!(error(3).starts_with("invalid request: expected ident at line 1 column 2"), "{}", error(3));
    assert_eq!(error(4), "a request has exactly one of `ids` and `messages`");
    assert!(error(5).contains("unknown field `add_generation_promt`"), "{}", error(5));
    assert!(lines[6]["error"].is_null(), "{}", lines[6]);
    assert!(error(7).contains("trailing characters"), "{}", error(7));
    assert_eq!(ids_of(&lines[8]), [7, 8, 9]);
}

#[test]
fn an_input_longer_than_the_context_is_refused_naming_both_numbers_without_running_the_model() {
    let ids: Vec<u32> = (0..40_000).map(|i| 3 + i % 59).collect();
    let input = format!("{}\n{}\n", json!({ "ids": ids }), json!({ "ids": ids[..512] }));
    let started = std::time::Instant::now();
    let (summary, lines) = run(tiny(), &input);
    assert_eq!(summary.refused, 1);
    assert_eq!(lines[0]["error"], "40000 tokens exceed the model's context of 512 positions (max_position_embeddings)");
    assert_eq!(logprobs_of(&lines[1]).len(), 511, "exactly the context is accepted");
    // 40,000 ids took 8.4 GB before the check; refusing them costs parsing only.
    assert!(started.elapsed().as_secs() < 60, "took {:?}", started.elapsed());
}

#[test]
fn ids_outside_the_vocabulary_are_refused_naming_the_id_and_its_position() {
    let mut driver = Driver::load(tiny(), Device::Cpu, DType::F32).unwrap();
    let err = driver.answer(br#"{"ids": [3, 4, 62, 5]}"#).unwrap_err();
    assert_eq!(err, LineError::OutOfVocabulary { index: 2, id: 62, vocab: 62 });
    assert_eq!(err.to_string(), "ids[2] = 62 is outside the vocabulary of 62 tokens");
    let err = driver.answer(br#"{"ids": [4294967295]}"#).unwrap_err();
    assert!(matches!(err, LineError::OutOfVocabulary { index: 0, id: u32::MAX, .. }), "{err}");
    let err = driver.answer(br#"{"ids": [3, -1]}"#).unwrap_err();
    assert!(err.to_string().contains("`ids[1]`: invalid value: integer `-1`"), "{err}");
    assert_eq!(driver.answer(br#"{"ids": [61]}"#).unwrap().logprobs, Vec::<f32>::new());
}

#[test]
fn a_line_that_is_not_utf8_or_too_long_is_refused_and_the_next_one_answered() {
    let mut input = b"{\"ids\": [3, \xff]}\n".to_vec();
    input.extend(std::iter::repeat_n(b' ', jetrl_cli::logprobs::MAX_LINE_BYTES + 1));
    input.extend(b"\n{\"ids\": [5, 6]}\n");
    let mut driver = Driver::load(tiny(), Device::Cpu, DType::F32).unwrap();
    let mut output = Vec::new();
    let summary = jetrl_cli::logprobs::run(&mut driver, input.as_slice(), &mut output).unwrap();
    assert_eq!(summary, Summary { lines: 3, refused: 2 });
    let lines: Vec<Value> =
        String::from_utf8(output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines[0]["error"].as_str().unwrap().starts_with("the line is not UTF-8"), "{}", lines[0]);
    assert_eq!(lines[1]["error"], format!("the line is longer than {} bytes", jetrl_cli::logprobs::MAX_LINE_BYTES));
    assert_eq!(ids_of(&lines[2]), [5, 6]);
}

#[test]
fn answers_match_the_model_and_chat_lines_use_the_template() {
    let model = CausalLm::load(tiny(), Device::Cpu, DType::F32).unwrap();
    let ids = [3u32, 10, 20, 30, 40];
    let input = format!(
        "{}\n{}\n",
        json!({ "ids": ids }),
        json!({"messages": [{"role": "user", "content": "2+2"}], "add_generation_prompt": true})
    );
    let (_, lines) = run(tiny(), &input);
    assert_eq!(logprobs_of(&lines[0]), log_probs_of(&model, &ids).unwrap());
    let tokenizer = jetrl_model::Tokenizer::from_dir(tiny()).unwrap();
    let expected = tokenizer.apply_chat_template(&[json!({"role": "user", "content": "2+2"})], true).unwrap();
    assert_eq!(ids_of(&lines[1]), expected);
    assert_eq!(logprobs_of(&lines[1]), log_probs_of(&model, &expected).unwrap());
}

#[test]
fn a_model_directory_without_a_tokenizer_refuses_chat_lines_and_answers_ids_lines() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(tiny().join(file), dir.path().join(file)).unwrap();
    }
    let input = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"ids\": [3, 4]}\n";
    let (summary, lines) = run(dir.path(), input);
    assert_eq!(summary, Summary { lines: 2, refused: 1 });
    assert!(lines[0]["error"].as_str().unwrap().contains("tokenizer.json"), "{}", lines[0]);
    assert_eq!(ids_of(&lines[1]), [3, 4]);
}

/// The golden checkpoint: ids and chat lines reproduce transformers' log-probs and chat ids.
#[test]
fn hf_sample_ids_and_messages_lines_match_transformers() {
    #[derive(serde::Deserialize)]
    struct ChatCase {
        add_generation_prompt: bool,
        ids: Vec<u32>,
    }
    #[derive(serde::Deserialize)]
    struct Reference {
        sequences: Vec<Vec<u32>>,
        logprobs: Vec<Vec<f32>>,
        chat: Vec<ChatCase>,
    }
    let dir = hf_sample();
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let chat = &reference.chat[0];
    let input = format!(
        "{}\n{}\n",
        json!({ "ids": reference.sequences[1] }),
        json!({
            "messages": [{"role": "user", "content": "What is 7 times 6?"}],
            "add_generation_prompt": chat.add_generation_prompt,
        })
    );
    let (summary, lines) = run(&dir, &input);
    assert_eq!(summary.refused, 0, "{lines:?}");
    assert_eq!(ids_of(&lines[0]), reference.sequences[1]);
    let max_diff =
        logprobs_of(&lines[0]).iter().zip(&reference.logprobs[1]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff <= 1e-4, "max |diff| {max_diff}");
    assert_eq!(ids_of(&lines[1]), chat.ids);
    assert_eq!(logprobs_of(&lines[1]).len(), chat.ids.len() - 1);
}

//! Fuzzing the reward user-function protocol (`PROTOCOL.md`) with proptest: the answer lines a user function
//! writes on its stdout, read by `read_response_line`, and the NaN/Infinity rewriting in front of it.
//!
//! Inputs are random text, and valid answer lines mutated structurally (results of every shape, ids and counts
//! that do not match, nested and non-finite values) and byte by byte. Properties: no panic; a line is either
//! skipped (not an answer to the request in flight) or read as an answer with exactly one result per item;
//! failures carry a kind and a message that says what was wrong; scores written as Python writes them read back
//! bit-exactly.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../wire/tests/fuzz_support/json.rs"]
mod json_mutate;
#[path = "../../wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use jetrl_reward::external::protocol::{read_response_line, sanitize_non_finite, ResponseLine};
use jetrl_reward::FailureKind;
use proptest::prelude::*;
use serde_json::{json, Value};

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

const ID: u64 = 17;
const ITEMS: usize = 3;

fn answer_seeds() -> Vec<Value> {
    vec![
        json!({"id": ID, "results": [1.0, {"score": -1.0, "acc": false, "pred": "71"}, {"error": "ValueError: x"}]}),
        json!({"id": ID, "results": [true, [0.5, "extra"], {"score": 2, "a": 1, "b": null, "c": [1], "d": {"e": 1}}]}),
        json!({"id": ID, "error": "model not loaded"}),
        json!({"id": ID - 1, "results": [0, 0, 0]}),
    ]
}

/// Answer lines as a function writes them, including Python's bare `NaN`/`Infinity`.
fn line_input() -> impl Strategy<Value = String> {
    let texts: Vec<Vec<u8>> = answer_seeds()
        .iter()
        .map(Value::to_string)
        .chain([
            format!(r#"{{"id": {ID}, "results": [NaN, {{"score": -Infinity}}, {{"score": 1, "x": Infinity}}]}}"#),
            "loading model...".to_string(),
        ])
        .map(String::into_bytes)
        .collect();
    let python_tokens: &'static [&'static [u8]] = &[b"NaN", b"Infinity", b"-Infinity", b"\"\\u0000NaN\"", b"\\"];
    prop_oneof![
        1 => any::<String>(),
        3 => mutate::mutated(texts, mutate::JSON_TOKENS).prop_map(|b| mutate::lossy(&b)),
        1 => mutate::mutated(
            answer_seeds().iter().map(|v| v.to_string().into_bytes()).collect(),
            python_tokens,
        ).prop_map(|b| mutate::lossy(&b)),
        4 => json_mutate::json_mutated(answer_seeds()).prop_map(|v| v.to_string()),
    ]
}

fn check_line(line: &str) -> Result<(), TestCaseError> {
    match read_response_line(line, ID, ITEMS) {
        ResponseLine::Unrelated => {}
        ResponseLine::Answer(Err(failure)) => {
            prop_assert!(matches!(failure.kind, FailureKind::UserFunction | FailureKind::BadResponse));
            prop_assert!(!failure.message.is_empty() || failure.kind == FailureKind::UserFunction);
            prop_assert!(failure.message.chars().count() <= 201, "messages are truncated: {}", failure.message);
        }
        ResponseLine::Answer(Ok(results)) => {
            prop_assert_eq!(results.len(), ITEMS);
            for result in results {
                match result {
                    Ok(reward) => {
                        prop_assert!(reward.score.is_finite(), "score {}", reward.score);
                        prop_assert!(reward.extra.values().all(|v| v.is_finite()));
                    }
                    Err(failure) => prop_assert!(
                        matches!(
                            failure.kind,
                            FailureKind::UserFunction | FailureKind::NonFiniteScore | FailureKind::NonNumericScore
                        ),
                        "{:?}",
                        failure
                    ),
                }
            }
        }
    }
    Ok(())
}

/// A score as Python's `json.dumps` writes it.
fn python_number(score: f64) -> String {
    if score.is_nan() {
        "NaN".into()
    } else if score.is_infinite() {
        if score > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        serde_json::to_string(&score).unwrap_or_default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn answer_lines_are_read_or_skipped_never_misread(line in line_input()) {
        check_line(&line)?;
    }

    #[test]
    fn text_without_python_non_finite_numbers_is_left_alone(line in line_input()) {
        let sanitized = sanitize_non_finite(&line);
        if !line.contains("NaN") && !line.contains("Infinity") {
            prop_assert_eq!(sanitized.as_ref(), line.as_str());
        }
        // Valid JSON stays valid JSON with the same meaning outside the rewritten tokens.
        if let Ok(value) = serde_json::from_str::<Value>(&line) {
            prop_assert_eq!(serde_json::from_str::<Value>(&sanitized).ok(), Some(value));
        }
    }

    #[test]
    fn scores_written_as_python_writes_them_read_back_exactly(
        scores in proptest::collection::vec(
            prop_oneof![4 => any::<f64>(), 1 => Just(f64::NAN), 1 => Just(f64::INFINITY), 1 => Just(f64::NEG_INFINITY)],
            1..6,
        ),
        as_dict in proptest::collection::vec(any::<bool>(), 6),
    ) {
        let results: Vec<String> = scores
            .iter()
            .zip(&as_dict)
            .map(|(score, dict)| {
                if *dict { format!(r#"{{"score": {}, "pred": "x"}}"#, python_number(*score)) } else { python_number(*score) }
            })
            .collect();
        let line = format!(r#"{{"id": {ID}, "results": [{}]}}"#, results.join(", "));
        let ResponseLine::Answer(Ok(read)) = read_response_line(&line, ID, scores.len()) else {
            return Err(TestCaseError::fail(format!("not read as an answer: {line}")));
        };
        for (score, result) in scores.iter().zip(read) {
            match result {
                Ok(reward) => prop_assert_eq!(reward.score.to_bits(), score.to_bits(), "{}", line),
                Err(failure) => {
                    prop_assert!(!score.is_finite(), "{} failed: {:?}", score, failure);
                    prop_assert_eq!(failure.kind, FailureKind::NonFiniteScore);
                }
            }
        }
    }
}

#[test]
fn seed_lines_read_as_their_shapes_say() {
    assert!(matches!(read_response_line(&answer_seeds()[0].to_string(), ID, ITEMS), ResponseLine::Answer(Ok(_))));
    assert!(matches!(read_response_line(&answer_seeds()[2].to_string(), ID, ITEMS), ResponseLine::Answer(Err(_))));
    assert_eq!(read_response_line(&answer_seeds()[3].to_string(), ID, ITEMS), ResponseLine::Unrelated);
}

/// Found by this suite: serde_json's default float parser read `-3.249124610985743e+136` (what Python writes for
/// that score) one ulp off; the crate now parses floats exactly (serde_json's `float_roundtrip`).
#[test]
fn a_score_reads_back_to_the_same_bits() {
    let score = -3.249124610985743e136_f64;
    let line = format!(r#"{{"id": {ID}, "results": [{}]}}"#, python_number(score));
    let ResponseLine::Answer(Ok(results)) = read_response_line(&line, ID, 1) else { panic!("not an answer") };
    assert_eq!(results[0].as_ref().unwrap().score.to_bits(), score.to_bits());
}

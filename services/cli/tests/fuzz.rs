//! Fuzzing `jetrl logprobs` input lines with proptest, against the real tiny model (`init_model("tiny", ...)`:
//! 62 tokens, 512 positions) and real libtorch.
//!
//! Inputs are random bytes and valid request lines (ids, chat messages, tools) mutated structurally and byte by
//! byte. Properties: no panic; an answered line holds ids inside the vocabulary and the context and one finite
//! log-prob per next token, exactly what the model computes; a refused line says why; over a whole input,
//! output line i answers input line i.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../../shared/wire/tests/fuzz_support/json.rs"]
mod json_mutate;
#[path = "../../../shared/wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use std::cell::RefCell;
use std::path::Path;
use std::sync::OnceLock;

use jetrl_cli::logprobs::{run, Driver, LineError};
use jetrl_model::{log_probs_of, CausalLm, DType};
use proptest::prelude::*;
use serde_json::{json, Value};
use tch::Device;

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

const VOCAB: u32 = 62;
const CONTEXT: usize = 512;

fn tiny() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        // One torch thread per test thread: a forward of a few tokens is all dispatch, and a thread pool per
        // test thread on a small machine only adds contention (measured: 7 ms a case with the pool).
        tch::set_num_threads(1);
        let dir = tempfile::tempdir().expect("a temporary directory");
        jetrl_model::init_model("tiny", dir.path(), 11).expect("the tiny preset");
        dir
    })
    .path()
}

thread_local! {
    static DRIVER: RefCell<Driver> =
        RefCell::new(Driver::load(tiny(), Device::Cpu, DType::F32).expect("the driver loads the tiny model"));
    static MODEL: CausalLm = CausalLm::load(tiny(), Device::Cpu, DType::F32).expect("the tiny model loads");
}

fn request_seeds() -> Vec<Value> {
    vec![
        json!({"ids": [3, 4, 5, 6]}),
        json!({"ids": []}),
        json!({"ids": [61, 0, 1, 2, 60]}),
        json!({"messages": [{"role": "user", "content": "what is 2+2?"}], "add_generation_prompt": true}),
        json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"},
            {"role": "assistant", "content": "2"}], "add_generation_prompt": false,
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {"a": 1}}}]}),
    ]
}

fn line_input() -> impl Strategy<Value = Vec<u8>> {
    json_mutate::json_bytes(request_seeds(), 96)
}

/// What an answer must be, whatever the line was.
fn check_answer(line: &[u8], result: &Result<jetrl_cli::logprobs::Answer, LineError>) -> Result<(), TestCaseError> {
    match result {
        Ok(answer) => {
            prop_assert!(answer.ids.len() <= CONTEXT);
            prop_assert!(answer.ids.iter().all(|&id| id < VOCAB), "{:?}", answer.ids);
            prop_assert_eq!(answer.logprobs.len(), answer.ids.len().saturating_sub(1));
            prop_assert!(answer.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0), "{:?}", answer.logprobs);
            // Exactly what the model computes for these ids.
            let expected = MODEL.with(|model| log_probs_of(model, &answer.ids)).ok();
            prop_assert_eq!(expected.as_ref(), Some(&answer.logprobs));
        }
        Err(err) => {
            prop_assert!(!err.to_string().is_empty());
            // An ids request the parser accepts is refused only for the ids themselves.
            if let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(line) {
                if let (1, Some(Value::Array(ids))) = (fields.len(), fields.get("ids")) {
                    if let Some(ids) =
                        ids.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect::<Option<Vec<u32>>>()
                    {
                        prop_assert!(
                            matches!(err, LineError::OutOfVocabulary { .. } | LineError::ContextExceeded { .. }),
                            "{:?} refused: {}",
                            ids,
                            err
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn request_lines_are_answered_exactly_or_refused_saying_why(line in line_input()) {
        let line: Vec<u8> = line.into_iter().filter(|&b| b != b'\n').collect();
        let result = DRIVER.with(|driver| driver.borrow_mut().answer(&line));
        check_answer(&line, &result)?;
    }

    #[test]
    fn ids_lines_round_trip_and_out_of_vocabulary_ids_are_named(
        ids in proptest::collection::vec(prop_oneof![20 => 0u32..VOCAB, 1 => VOCAB.., 1 => Just(VOCAB)], 0..24),
    ) {
        let line = json!({ "ids": ids }).to_string();
        let result = DRIVER.with(|driver| driver.borrow_mut().answer(line.as_bytes()));
        match ids.iter().position(|&id| id >= VOCAB) {
            None => {
                let answer = result.map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(&answer.ids, &ids);
                check_answer(line.as_bytes(), &Ok(answer))?;
            }
            Some(index) => prop_assert_eq!(
                result,
                Err(LineError::OutOfVocabulary { index, id: ids[index], vocab: i64::from(VOCAB) })
            ),
        }
    }
}

proptest! {
    // Whole inputs of several lines: fewer cases, each one runs up to eight lines through the driver.
    #![proptest_config(ProptestConfig { cases: mutate::CASES / 10, ..config() })]

    #[test]
    fn output_line_i_answers_input_line_i(lines in proptest::collection::vec(line_input(), 0..8)) {
        let lines: Vec<Vec<u8>> = lines.into_iter().map(|l| l.into_iter().filter(|&b| b != b'\n').collect()).collect();
        let input = lines.join(&b'\n');
        let mut output = Vec::new();
        let summary = DRIVER.with(|driver| run(&mut driver.borrow_mut(), input.as_slice(), &mut output))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let answers: Vec<Value> = String::from_utf8(output)
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .lines()
            .map(|l| serde_json::from_str(l).map_err(|e| TestCaseError::fail(e.to_string())))
            .collect::<Result<_, _>>()?;
        // A final newline ends the line before it rather than starting an empty one.
        let expected = if input.is_empty() {
            0
        } else {
            input.split(|&b| b == b'\n').count() - usize::from(input.ends_with(b"\n"))
        };
        prop_assert_eq!(answers.len(), expected);
        prop_assert_eq!(summary.lines, expected);
        let refused = answers.iter().filter(|a| a.get("error").is_some()).count();
        prop_assert_eq!(summary.refused, refused);
        for (i, answer) in answers.iter().enumerate() {
            prop_assert_eq!(&answer["line"], &json!(i + 1));
            prop_assert!(answer.get("error").is_some() != answer.get("logprobs").is_some(), "{}", answer);
        }
    }
}

#[test]
fn seed_requests_are_answered() {
    DRIVER.with(|driver| {
        for seed in request_seeds() {
            let line = seed.to_string();
            driver.borrow_mut().answer(line.as_bytes()).unwrap();
        }
    });
}

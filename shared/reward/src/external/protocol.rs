//! The JSON-lines protocol between jetrl and a user reward function (see `PROTOCOL.md`): the wire types and
//! the reading of an answer into per-trajectory results.

use std::borrow::Cow;

use serde::Serialize;

use crate::failure::{FailureKind, ScoreFailure};
use crate::input::ScoreInput;
use crate::result::{truncate_for_message, RewardResult, NON_FINITE_MARKER};

/// Protocol revision, sent in every request so a function can refuse one it does not speak.
pub const PROTOCOL_VERSION: u32 = 1;

/// One request line: a batch of trajectories.
#[derive(Debug, Serialize)]
pub struct Request<'a> {
    pub protocol: u32,
    pub id: u64,
    pub items: Vec<RequestItem<'a>>,
}

/// One trajectory, with verl's `compute_score` arguments plus jetrl's key and prompt.
#[derive(Debug, Serialize)]
pub struct RequestItem<'a> {
    pub key: &'a str,
    pub data_source: &'a str,
    pub solution_str: &'a str,
    pub ground_truth: &'a str,
    pub extra_info: &'a serde_json::Value,
    pub prompt_str: &'a str,
}

impl<'a> From<&'a ScoreInput> for RequestItem<'a> {
    fn from(input: &'a ScoreInput) -> Self {
        Self {
            key: &input.key,
            data_source: &input.data_source,
            solution_str: &input.solution_str,
            ground_truth: &input.ground_truth,
            extra_info: &input.extra_info,
            prompt_str: &input.prompt_str,
        }
    }
}

/// How a response line relates to the request in flight.
#[derive(Debug, PartialEq)]
pub enum ResponseLine {
    /// The answer to request `id`: one result per item, in order, or one error for the whole batch.
    Answer(Result<Vec<Result<RewardResult, ScoreFailure>>, ScoreFailure>),
    /// A line that is not an answer to the request in flight (stray output, an old id): skipped.
    Unrelated,
}

/// Reads one line of the function's stdout as the answer to request `expected_id` with `item_count` items.
pub fn read_response_line(line: &str, expected_id: u64, item_count: usize) -> ResponseLine {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(&sanitize_non_finite(line)) else {
        return ResponseLine::Unrelated;
    };
    if fields.get("id").and_then(serde_json::Value::as_u64) != Some(expected_id) {
        return ResponseLine::Unrelated;
    }
    if let Some(error) = fields.get("error") {
        let message = error.as_str().map_or_else(|| error.to_string(), str::to_string);
        return ResponseLine::Answer(Err(ScoreFailure::new(FailureKind::UserFunction, truncate_for_message(&message))));
    }
    let Some(serde_json::Value::Array(results)) = fields.get("results") else {
        return ResponseLine::Answer(Err(ScoreFailure::new(
            FailureKind::BadResponse,
            "the answer has neither `results` (a list) nor `error`",
        )));
    };
    if results.len() != item_count {
        return ResponseLine::Answer(Err(ScoreFailure::new(
            FailureKind::BadResponse,
            format!("{} results for {item_count} items", results.len()),
        )));
    }
    ResponseLine::Answer(Ok(results.iter().map(read_item_result).collect()))
}

fn read_item_result(value: &serde_json::Value) -> Result<RewardResult, ScoreFailure> {
    if let serde_json::Value::Object(fields) = value {
        if let (Some(error), false) = (fields.get("error"), fields.contains_key("score")) {
            let message = error.as_str().map_or_else(|| error.to_string(), str::to_string);
            return Err(ScoreFailure::new(FailureKind::UserFunction, truncate_for_message(&message)));
        }
    }
    RewardResult::from_json(value).map_err(|e| ScoreFailure::new(e.kind(), e.to_string()))
}

/// Python's `json.dumps` writes NaN and ±Infinity as bare `NaN`/`Infinity`/`-Infinity`, which strict JSON
/// parsers reject. Rewriting them (outside strings) as marked strings lets one NaN score fail one trajectory
/// instead of the whole line.
pub fn sanitize_non_finite(line: &str) -> Cow<'_, str> {
    if !line.contains("NaN") && !line.contains("Infinity") {
        return Cow::Borrowed(line);
    }
    let mut output = String::with_capacity(line.len() + 16);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            output.push(c);
            rest = &rest[c.len_utf8()..];
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        let token = ["-Infinity", "Infinity", "NaN"].into_iter().find(|token| rest.starts_with(token));
        match token {
            Some(token) => {
                output.push_str(&format!("\"\\u{:04x}{token}\"", NON_FINITE_MARKER as u32));
                rest = &rest[token.len()..];
            }
            None => {
                in_string = c == '"';
                output.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    Cow::Owned(output)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(line: &str, items: usize) -> Result<Vec<Result<RewardResult, ScoreFailure>>, ScoreFailure> {
        match read_response_line(line, 7, items) {
            ResponseLine::Answer(answer) => answer,
            ResponseLine::Unrelated => panic!("line was skipped"),
        }
    }

    #[test]
    fn numbers_and_dicts_become_results_in_order() {
        let results = answer(r#"{"id": 7, "results": [1, {"score": 0.5, "acc": true, "pred": "x"}]}"#, 2).unwrap();
        assert_eq!(results[0].as_ref().unwrap().score, 1.0);
        let second = results[1].as_ref().unwrap();
        assert_eq!((second.score, second.extra["acc"], second.extra_text["pred"].as_str()), (0.5, 1.0, "x"));
    }

    #[test]
    fn python_nan_fails_only_its_own_item() {
        let results =
            answer(r#"{"id": 7, "results": [NaN, {"score": -Infinity}, 0.0, {"score": 1, "x": NaN}]}"#, 4).unwrap();
        assert_eq!(results[0].as_ref().unwrap_err().kind, FailureKind::NonFiniteScore);
        assert_eq!(results[1].as_ref().unwrap_err().kind, FailureKind::NonFiniteScore);
        assert_eq!(results[2].as_ref().unwrap().score, 0.0);
        assert!(!results[3].as_ref().unwrap().extra.contains_key("x"));
    }

    #[test]
    fn non_numeric_score_and_item_error_fail_their_item() {
        let results = answer(r#"{"id": 7, "results": ["high", {"error": "boom"}, null]}"#, 3).unwrap();
        assert_eq!(results[0].as_ref().unwrap_err().kind, FailureKind::NonNumericScore);
        assert_eq!(results[1].as_ref().unwrap_err(), &ScoreFailure::new(FailureKind::UserFunction, "boom"));
        assert_eq!(results[2].as_ref().unwrap_err().kind, FailureKind::NonNumericScore);
    }

    #[test]
    fn wrong_result_count_or_batch_error_fails_the_batch() {
        assert_eq!(answer(r#"{"id": 7, "results": [1]}"#, 2).unwrap_err().kind, FailureKind::BadResponse);
        assert_eq!(answer(r#"{"id": 7, "error": "no model"}"#, 2).unwrap_err().kind, FailureKind::UserFunction);
    }

    #[test]
    fn stray_output_and_other_ids_are_skipped() {
        assert_eq!(read_response_line("loading model...", 7, 1), ResponseLine::Unrelated);
        assert_eq!(read_response_line(r#"{"id": 6, "results": [1]}"#, 7, 1), ResponseLine::Unrelated);
        assert_eq!(read_response_line("[1, 2]", 7, 1), ResponseLine::Unrelated);
    }

    #[test]
    fn non_finite_tokens_inside_strings_are_left_alone() {
        let line = r#"{"pred": "NaN \" Infinity", "score": NaN}"#;
        let sanitized = sanitize_non_finite(line);
        let value: serde_json::Value = serde_json::from_str(&sanitized).unwrap();
        assert_eq!(value["pred"], "NaN \" Infinity");
        assert_eq!(value["score"], "\u{0}NaN");
    }
}

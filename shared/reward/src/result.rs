//! What a scorer returns, normalised the way verl's reward managers normalise it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::failure::FailureKind;

/// One trajectory's reward.
///
/// verl's `naive`/`dapo` managers turn a scorer's answer into `reward_score` plus `reward_extra_info`: a dict
/// passes through (its `score` is the reward, every other key is extra info), a bare number becomes the score
/// and is also reported as `acc`, a bool counts as 0/1. Numbers and bools land in `extra`, strings in
/// `extra_text`; nested values are not carried.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RewardResult {
    pub score: f64,
    pub extra: BTreeMap<String, f64>,
    pub extra_text: BTreeMap<String, String>,
}

/// Why a scorer's answer could not be read as a reward.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ResultError {
    #[error("the result has no `score`")]
    MissingScore,
    #[error("the score is not a number: {0}")]
    NonNumericScore(String),
    #[error("the score is not finite: {0}")]
    NonFiniteScore(String),
}

impl ResultError {
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::MissingScore | Self::NonNumericScore(_) => FailureKind::NonNumericScore,
            Self::NonFiniteScore(_) => FailureKind::NonFiniteScore,
        }
    }
}

impl RewardResult {
    /// A bare number, reported as `acc` too (verl's naive manager).
    pub fn from_number(score: f64) -> Self {
        Self { score, extra: BTreeMap::from([("acc".to_string(), score)]), extra_text: BTreeMap::new() }
    }

    pub fn from_bool(correct: bool) -> Self {
        Self::from_number(bool_to_f64(correct))
    }

    /// Reads a scorer's JSON answer: a number, a bool, `[number, ...]` (verl takes the first element), or an
    /// object with `score` and extra values. Non-finite numbers arrive as the markers that
    /// [`crate::external::protocol::sanitize_non_finite`] writes.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, ResultError> {
        use serde_json::Value;
        match value {
            Value::Object(fields) => {
                let score = fields.get("score").ok_or(ResultError::MissingScore)?;
                let mut result = Self { score: read_score(score)?, ..Self::default() };
                for (key, field) in fields.iter().filter(|(key, _)| key.as_str() != "score") {
                    match field {
                        Value::Bool(flag) => {
                            result.extra.insert(key.clone(), bool_to_f64(*flag));
                        }
                        Value::Number(number) => {
                            if let Some(number) = number.as_f64() {
                                result.extra.insert(key.clone(), number);
                            }
                        }
                        // A non-finite extra value cannot travel as JSON downstream; dropping it keeps the score.
                        Value::String(text) if non_finite_marker(text).is_some() => {}
                        Value::String(text) => {
                            result.extra_text.insert(key.clone(), text.clone());
                        }
                        Value::Null | Value::Array(_) | Value::Object(_) => {}
                    }
                }
                Ok(result)
            }
            Value::Array(items) => match items.first() {
                Some(first) => Ok(Self::from_number(read_score(first)?)),
                None => Err(ResultError::NonNumericScore("[]".into())),
            },
            other => Ok(Self::from_number(read_score(other)?)),
        }
    }

    /// verl's `dapo` manager adds the overlong penalty to the score only.
    pub(crate) fn add_to_score(&mut self, delta: f64) {
        self.score += delta;
    }
}

/// The text form of a non-finite number inside a sanitised JSON line.
pub(crate) const NON_FINITE_MARKER: char = '\u{0}';

fn non_finite_marker(text: &str) -> Option<&str> {
    text.strip_prefix(NON_FINITE_MARKER)
}

fn read_score(value: &serde_json::Value) -> Result<f64, ResultError> {
    use serde_json::Value;
    match value {
        Value::Bool(flag) => Ok(bool_to_f64(*flag)),
        Value::Number(number) => number.as_f64().ok_or_else(|| ResultError::NonNumericScore(number.to_string())),
        Value::String(text) => match non_finite_marker(text) {
            Some(spelling) => Err(ResultError::NonFiniteScore(spelling.to_string())),
            None => Err(ResultError::NonNumericScore(truncate_for_message(&value.to_string()))),
        },
        other => Err(ResultError::NonNumericScore(truncate_for_message(&other.to_string()))),
    }
}

pub(crate) fn bool_to_f64(flag: bool) -> f64 {
    if flag {
        1.0
    } else {
        0.0
    }
}

/// Keeps failure messages short enough for a log line and a wire field.
pub(crate) fn truncate_for_message(text: &str) -> String {
    const LIMIT: usize = 200;
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn bare_number_becomes_score_and_acc() {
        let result = RewardResult::from_json(&json!(0.25)).unwrap();
        assert_eq!(result.score, 0.25);
        assert_eq!(result.extra["acc"], 0.25);
    }

    #[test]
    fn bool_counts_as_zero_or_one() {
        assert_eq!(RewardResult::from_json(&json!(true)).unwrap().score, 1.0);
        assert_eq!(RewardResult::from_json(&json!(false)).unwrap().extra["acc"], 0.0);
    }

    #[test]
    fn dict_passes_through_with_numbers_bools_and_strings_split() {
        let result =
            RewardResult::from_json(&json!({"score": -1.0, "acc": false, "pred": "42", "len": 7, "nested": [1]}))
                .unwrap();
        assert_eq!(result.score, -1.0);
        assert_eq!(result.extra, BTreeMap::from([("acc".into(), 0.0), ("len".into(), 7.0)]));
        assert_eq!(result.extra_text, BTreeMap::from([("pred".into(), "42".into())]));
    }

    #[test]
    fn list_result_takes_its_first_element_as_verl_does() {
        assert_eq!(RewardResult::from_json(&json!([0.5, "why"])).unwrap().score, 0.5);
    }

    #[test]
    fn dict_without_score_or_with_text_score_is_rejected() {
        assert_eq!(RewardResult::from_json(&json!({"acc": 1})), Err(ResultError::MissingScore));
        assert!(matches!(RewardResult::from_json(&json!("high")), Err(ResultError::NonNumericScore(_))));
        assert!(matches!(RewardResult::from_json(&json!(null)), Err(ResultError::NonNumericScore(_))));
    }

    #[test]
    fn non_finite_marker_is_reported_as_non_finite() {
        let marked = format!("{NON_FINITE_MARKER}NaN");
        let err = RewardResult::from_json(&json!({ "score": marked })).unwrap_err();
        assert_eq!(err, ResultError::NonFiniteScore("NaN".into()));
        assert_eq!(err.kind(), FailureKind::NonFiniteScore);
    }
}

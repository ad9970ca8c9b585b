//! Search-R1 exact match (verl `search_r1_like_qa_em.py`): the last `<answer>…</answer>` span, normalised
//! SQuAD-style, equal to one of the ground-truth targets.

use std::sync::LazyLock;

use regex::Regex;

use crate::pytext::{is_py_word_char, py_split_whitespace, py_strip};

/// More answer tags than this suggests tag spamming: a correct answer then earns a quarter.
const MAX_ANSWER_TAGS: usize = 10;

static ANSWER_SPAN: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<answer>(.*?)</answer>").expect("constant pattern compiles"));

/// The ground truth could not be read as targets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("search-R1 ground truth {0}")]
pub struct InvalidTargets(pub String);

/// The stripped content of the last answer span.
pub fn extract_solution(solution_str: &str) -> Option<&str> {
    ANSWER_SPAN.captures_iter(solution_str).last().and_then(|caps| caps.get(1)).map(|span| py_strip(span.as_str()))
}

/// Lower case, no ASCII punctuation, no articles, single spaces.
pub fn normalize_answer(text: &str) -> String {
    let lowered = text.to_lowercase();
    let without_punctuation: String = lowered.chars().filter(|c| !c.is_ascii_punctuation()).collect();
    let without_articles = remove_articles(&without_punctuation);
    py_split_whitespace(&without_articles).collect::<Vec<_>>().join(" ")
}

/// Python's `re.sub(r"\b(a|an|the)\b", " ", text)`: a whole word equal to an article becomes a space.
fn remove_articles(text: &str) -> String {
    let mut output = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let starts_with_word = rest.chars().next().is_some_and(is_py_word_char);
        let run_end = rest.find(|c: char| is_py_word_char(c) != starts_with_word).unwrap_or(rest.len());
        let (run, tail) = rest.split_at(run_end);
        if starts_with_word && matches!(run, "a" | "an" | "the") {
            output.push(' ');
        } else {
            output.push_str(run);
        }
        rest = tail;
    }
    output
}

/// The targets of a search-R1 ground truth, given as text: verl's `{"target": [...]}` (or `{"target": "..."}`),
/// a JSON list of answers, or the answer itself.
pub fn parse_targets(ground_truth: &str) -> Result<Vec<serde_json::Value>, InvalidTargets> {
    use serde_json::Value;
    let trimmed = ground_truth.trim_start();
    if !(trimmed.starts_with('{') || trimmed.starts_with('[')) {
        return Ok(vec![Value::String(ground_truth.to_string())]);
    }
    let parsed: Value =
        serde_json::from_str(ground_truth).map_err(|e| InvalidTargets(format!("is not valid JSON: {e}")))?;
    let target = match parsed {
        Value::Object(mut fields) => {
            fields.remove("target").ok_or_else(|| InvalidTargets("has no `target` key".into()))?
        }
        list => list,
    };
    match target {
        Value::Array(items) => Ok(items),
        Value::String(_) => Ok(vec![target]),
        other => Err(InvalidTargets(format!("`target` is neither text nor a list: {other}"))),
    }
}

/// Whether the normalised prediction equals a normalised target, checked in order; a target that is not text
/// fails the check when it is reached, as `str.lower` fails in verl.
pub fn em_check(prediction: &str, targets: &[serde_json::Value]) -> Result<bool, InvalidTargets> {
    let normalized_prediction = normalize_answer(prediction);
    for target in targets {
        let text = target.as_str().ok_or_else(|| InvalidTargets(format!("target {target} is not text")))?;
        if normalize_answer(text) == normalized_prediction {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `score` for an exact match (a quarter of it when the response has more than 10 opening or closing answer
/// tags), `format_score` for a wrong answer, 0 without an answer span.
pub fn compute_score(
    solution_str: &str,
    ground_truth: &str,
    format_score: f64,
    score: f64,
) -> Result<f64, InvalidTargets> {
    let Some(answer) = extract_solution(solution_str) else { return Ok(0.0) };
    if !em_check(answer, &parse_targets(ground_truth)?)? {
        return Ok(format_score);
    }
    let opening_tags = solution_str.matches("<answer>").count();
    let closing_tags = solution_str.matches("</answer>").count();
    if opening_tags > MAX_ANSWER_TAGS || closing_tags > MAX_ANSWER_TAGS {
        Ok(score / 4.0)
    } else {
        Ok(score)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARIS: &str = r#"{"target": ["Paris", "City of Light"]}"#;

    #[test]
    fn normalisation_drops_case_punctuation_articles_and_extra_spaces() {
        assert_eq!(normalize_answer("  The  Eiffel-Tower, in  PARIS! "), "eiffeltower in paris");
        assert_eq!(normalize_answer("an apple a day"), "apple day");
        assert_eq!(normalize_answer("theatre"), "theatre");
    }

    #[test]
    fn last_answer_span_across_lines_is_matched_against_any_target() {
        assert_eq!(
            compute_score("<answer>London</answer> <answer>\n the city of light.\n</answer>", PARIS, 0.0, 1.0),
            Ok(1.0)
        );
        assert_eq!(compute_score("<answer>Paris</answer><answer>Rome</answer>", PARIS, 0.0, 1.0), Ok(0.0));
    }

    #[test]
    fn no_answer_span_scores_zero_even_with_a_format_score() {
        assert_eq!(compute_score("Paris", PARIS, 0.2, 1.0), Ok(0.0));
        assert_eq!(compute_score("<answer>Rome</answer>", PARIS, 0.2, 1.0), Ok(0.2));
    }

    #[test]
    fn more_than_ten_answer_tags_quarter_a_correct_score() {
        let spam = format!("{}<answer>Paris</answer>", "</answer>".repeat(10));
        assert_eq!(compute_score(&spam, PARIS, 0.0, 1.0), Ok(0.25));
        let ten = format!("{}<answer>Paris</answer>", "</answer>".repeat(9));
        assert_eq!(compute_score(&ten, PARIS, 0.0, 1.0), Ok(1.0));
    }

    #[test]
    fn target_may_be_a_string_a_list_or_plain_text() {
        assert_eq!(compute_score("<answer>paris</answer>", r#"{"target": "Paris"}"#, 0.0, 1.0), Ok(1.0));
        assert_eq!(compute_score("<answer>paris</answer>", r#"["Rome", "Paris"]"#, 0.0, 1.0), Ok(1.0));
        assert_eq!(compute_score("<answer>paris</answer>", "Paris", 0.0, 1.0), Ok(1.0));
    }

    #[test]
    fn ground_truth_without_target_is_an_error_only_when_an_answer_is_checked() {
        assert!(compute_score("<answer>x</answer>", r#"{"answers": ["x"]}"#, 0.0, 1.0).is_err());
        assert_eq!(compute_score("no span", r#"{"answers": ["x"]}"#, 0.0, 1.0), Ok(0.0));
    }
}

//! GSM8K (verl `gsm8k.py`): the answer after the last `#### `, compared verbatim with the ground truth.

use std::sync::LazyLock;

use jetrl_config::Gsm8kMethod;
use regex::Regex;

use crate::pytext::last_chars;

/// Only the tail is searched: the final answer sits at the end, and a regex over a long response is slow.
const SOLUTION_CLIP_CHARS: usize = 300;

static STRICT_ANSWER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### (-?[0-9.,]+)").expect("constant pattern compiles"));
static NUMBER_LIKE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"-?[0-9.,]+").expect("constant pattern compiles"));

/// The model's final answer, or `None` when there is none.
pub fn extract_solution(solution_str: &str, method: Gsm8kMethod) -> Option<String> {
    let tail = last_chars(solution_str, SOLUTION_CLIP_CHARS);
    match method {
        Gsm8kMethod::Strict => {
            let last = STRICT_ANSWER.captures_iter(tail).last()?;
            Some(last[1].replace([',', '$'], ""))
        }
        Gsm8kMethod::Flexible => {
            let candidates: Vec<&str> = NUMBER_LIKE.find_iter(tail).map(|m| m.as_str()).collect();
            // verl walks backwards to the last token that is not "" or "."; when every token is invalid its loop
            // variable is left on the first one.
            let valid = candidates.iter().rev().find(|token| !matches!(**token, "" | "."));
            valid.or(candidates.first()).map(|token| token.to_string())
        }
    }
}

/// `score` when the answer equals the ground truth, `format_score` when it differs, 0 when there is none.
pub fn compute_score(
    solution_str: &str,
    ground_truth: &str,
    method: Gsm8kMethod,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(solution_str, method) {
        None => 0.0,
        Some(answer) if answer == ground_truth => score,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict(solution: &str, truth: &str) -> f64 {
        compute_score(solution, truth, Gsm8kMethod::Strict, 0.0, 1.0)
    }

    #[test]
    fn strict_takes_the_last_hash_answer() {
        assert_eq!(strict("#### 3\n#### 72", "72"), 1.0);
        assert_eq!(strict("#### 72\n#### 3", "72"), 0.0);
    }

    #[test]
    fn strict_removes_thousands_commas_before_comparing() {
        assert_eq!(strict("so #### 1,234", "1234"), 1.0);
    }

    #[test]
    fn strict_needs_the_number_right_after_the_hashes() {
        assert_eq!(extract_solution("#### $1488", Gsm8kMethod::Strict), None);
        assert_eq!(strict("#### $1488", "1488"), 0.0);
        assert_eq!(strict("####72", "72"), 0.0);
    }

    #[test]
    fn strict_answer_may_run_into_following_text() {
        assert_eq!(strict("#### 4112We multiply", "4112"), 1.0);
    }

    #[test]
    fn only_the_last_300_characters_are_searched() {
        let filler = "x".repeat(300);
        assert_eq!(strict(&format!("#### 5{filler}"), "5"), 0.0);
        let filler = "x".repeat(294);
        assert_eq!(strict(&format!("#### 5{filler}"), "5"), 1.0);
    }

    #[test]
    fn the_300_character_window_counts_code_points() {
        let filler = "é".repeat(294);
        assert_eq!(strict(&format!("#### 5{filler}"), "5"), 1.0);
    }

    #[test]
    fn comparison_is_verbatim_so_decimals_and_signs_matter() {
        assert_eq!(strict("#### 72.0", "72"), 0.0);
        assert_eq!(strict("#### -869", "869"), 0.0);
        assert_eq!(strict("#### -869", "-869"), 1.0);
    }

    #[test]
    fn wrong_answer_scores_format_score_and_missing_answer_scores_zero() {
        assert_eq!(compute_score("#### 1", "2", Gsm8kMethod::Strict, 0.1, 1.0), 0.1);
        assert_eq!(compute_score("no answer", "2", Gsm8kMethod::Strict, 0.1, 1.0), 0.0);
    }

    #[test]
    fn flexible_takes_the_last_number_skipping_lone_dots_and_keeps_commas() {
        assert_eq!(extract_solution("it is 1,000 dollars.", Gsm8kMethod::Flexible).as_deref(), Some("1,000"));
        assert_eq!(extract_solution("total 12. then .", Gsm8kMethod::Flexible).as_deref(), Some("12."));
        assert_eq!(extract_solution("only . here", Gsm8kMethod::Flexible).as_deref(), Some("."));
        assert_eq!(extract_solution("no digits", Gsm8kMethod::Flexible), None);
    }
}

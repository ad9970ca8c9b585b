//! jetrl's built-in synthetic digit tasks (`jetrl/reverse`, `jetrl/sort`, any `jetrl/…`): partial credit for
//! every position that matches, so a small model gets a learning signal before it is ever fully right.
//! `jetrl/multiply`, the tool task, scores only the response's last line: a tool-agent response holds the
//! model's calls and the tools' answers before its final answer.

use crate::result::{bool_to_f64, RewardResult};

/// `score` = matching positions / the longer of target and response (response stripped of surrounding
/// whitespace; an empty response scores 0); `acc` = 1 only for an exact match.
pub fn compute_score(response: &str, target: &str) -> RewardResult {
    let response = response.trim();
    let response_chars: Vec<char> = response.chars().collect();
    let target_chars: Vec<char> = target.chars().collect();
    let longer = response_chars.len().max(target_chars.len());
    let score = if response_chars.is_empty() || longer == 0 {
        0.0
    } else {
        let matching = response_chars.iter().zip(&target_chars).filter(|(got, want)| got == want).count();
        matching as f64 / longer as f64
    };
    let mut result = RewardResult { score, ..RewardResult::default() };
    result.extra.insert("acc".into(), bool_to_f64(response == target));
    result
}

/// [`compute_score`] of the last line of the response (stripped of surrounding whitespace first): the final
/// answer of a multi-turn response, whose earlier lines are tool calls and tool turns. The tool turns are part of
/// the response, as in verl, so a response whose last line is the tool's own answer scores as if the model had
/// written it.
pub fn compute_final_line_score(response: &str, target: &str) -> RewardResult {
    let response = response.trim();
    compute_score(response.rsplit('\n').next().unwrap_or(response), target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_line_score_reads_the_answer_after_the_tool_turns() {
        let call = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"37*58\"}}</tool_call>";
        let result = compute_final_line_score(&format!("{call}\n\n2146\n\n2146\n"), "2146");
        assert_eq!((result.score, result.extra["acc"]), (1.0, 1.0));
        assert_eq!(compute_final_line_score(&format!("{call}\n\n2146\n\n21"), "2146").score, 0.5);
        assert_eq!(compute_final_line_score("2146", "2146").score, 1.0, "a single line is the answer");
        assert_eq!(compute_final_line_score("2146\n", "2146").score, 1.0, "a trailing newline is stripped");
    }

    #[test]
    fn exact_answer_scores_one_with_acc() {
        let result = compute_score(" 4321\n", "4321");
        assert_eq!((result.score, result.extra["acc"]), (1.0, 1.0));
    }

    #[test]
    fn partial_answer_earns_matching_positions_over_the_longer_length() {
        let result = compute_score("4300", "4321");
        assert_eq!((result.score, result.extra["acc"]), (0.5, 0.0));
        assert_eq!(compute_score("43", "4321").score, 0.5);
        assert_eq!(compute_score("432100", "4321").score, 4.0 / 6.0);
    }

    #[test]
    fn empty_response_scores_zero() {
        assert_eq!(compute_score("  \n", "12").score, 0.0);
        assert_eq!(compute_score("", "").score, 0.0);
    }
}

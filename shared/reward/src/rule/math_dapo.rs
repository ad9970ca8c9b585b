//! DAPO math (verl `math_dapo.py`): the Minerva answer line `Answer: …`, normalised, compared with the
//! normalised ground truth; without one, the last `\boxed{}` near the end, compared verbatim. Score 1 or -1.

use std::sync::LazyLock;

use regex::{Captures, Regex};

use crate::pytext::{last_chars, py_isdigit, py_strip, PY_SPACE_CLASS};
use crate::result::{bool_to_f64, RewardResult};

/// Long responses are cut to their tail; the longest MATH-500 answer has 159 characters.
const SOLUTION_CLIP_CHARS: usize = 300;
/// The `\boxed{}` fallback only looks this far back from the end.
const BOXED_WINDOW_CHARS: usize = 100;
/// What a response without an answer line is normalised from.
pub const INVALID_PREDICTION: &str = "[INVALID]";

const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED_EXPRESSIONS: &[&str] = &[
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

fn compile(pattern: &str) -> Regex {
    Regex::new(pattern).expect("constant pattern compiles")
}

// Python's `\s` is wider than Rust's, hence the explicit class.
static ANSWER_LINE: LazyLock<Regex> =
    LazyLock::new(|| compile(&format!("(?i)Answer[{PY_SPACE_CLASS}]*:[{PY_SPACE_CLASS}]*([^\n]+)")));
static DOLLAR_MATH: LazyLock<Regex> = LazyLock::new(|| compile(r"(.*?)(\$)(.*?)(\$)(.*)"));
static TEXT: LazyLock<Regex> = LazyLock::new(|| compile(r"(\\text\{)(.*?)(\})"));
static TEXTBF: LazyLock<Regex> = LazyLock::new(|| compile(r"(\\textbf\{)(.*?)(\})"));
static OVERLINE: LazyLock<Regex> = LazyLock::new(|| compile(r"(\\overline\{)(.*?)(\})"));
static BOXED: LazyLock<Regex> = LazyLock::new(|| compile(r"(\\boxed\{)(.*)(\})"));
static FRAC_SHORTHAND: LazyLock<Regex> = LazyLock::new(|| compile(r"(frac)([^{])(.)"));
static SQRT_SHORTHAND: LazyLock<Regex> = LazyLock::new(|| compile(r"(sqrt)([^{])"));

/// Normalises a final answer to a quantitative question (Minerva's `normalize_final_answer`).
pub fn normalize_final_answer(final_answer: &str) -> String {
    let mut text = final_answer.rsplit('=').next().unwrap_or_default().to_string();
    for (before, after) in SUBSTITUTIONS {
        text = text.replace(before, after);
    }
    for expression in REMOVED_EXPRESSIONS {
        text = text.replace(expression, "");
    }

    text = DOLLAR_MATH.replace_all(&text, |caps: &Captures| format!("${}$", &caps[3])).into_owned();
    for wrapper in [&*TEXT, &*TEXTBF, &*OVERLINE, &*BOXED] {
        text = wrapper.replace_all(&text, |caps: &Captures| caps[2].to_string()).into_owned();
    }
    // \fracab → \frac{a}{b}, \fracabc → \frac{a}{b}c, \sqrta → \sqrt{a}
    text = FRAC_SHORTHAND
        .replace_all(&text, |caps: &Captures| format!("frac{{{}}}{{{}}}", &caps[2], &caps[3]))
        .into_owned();
    text = SQRT_SHORTHAND.replace_all(&text, |caps: &Captures| format!("sqrt{{{}}}", &caps[2])).into_owned();
    text = text.replace('$', "");

    let without_commas = text.replace(',', "");
    if py_isdigit(&without_commas) {
        text = without_commas;
    }
    py_strip(&text).to_string()
}

/// Minerva check: the last `Answer: …` line, normalised, against the normalised ground truth. Returns
/// `(correct, normalised prediction)`; the prediction is `[INVALID]` when there is no answer line.
pub fn is_correct_minerva(solution_str: &str, ground_truth: &str) -> (bool, String) {
    let extracted = ANSWER_LINE.captures_iter(solution_str).last().map(|caps| caps[1].to_string());
    let prediction = normalize_final_answer(extracted.as_deref().unwrap_or(INVALID_PREDICTION));
    (prediction == normalize_final_answer(ground_truth), prediction)
}

/// Strict box check: the last `\boxed{…}` in the final 100 characters, compared verbatim with the ground truth.
pub fn is_correct_strict_box(solution_str: &str, ground_truth: &str) -> (bool, Option<String>) {
    let window = last_chars(solution_str, BOXED_WINDOW_CHARS);
    let extracted = last_boxed_content(window);
    (extracted == Some(ground_truth), extracted.map(str::to_string))
}

/// The content of the last `\boxed{…}` with balanced braces.
fn last_boxed_content(text: &str) -> Option<&str> {
    const OPEN: &str = "\\boxed{";
    let start = text.rfind(OPEN)?;
    let end = super::math_hendrycks::balanced_brace_end(text, start)?;
    Some(&text[start + OPEN.len()..end])
}

/// Minerva first; when it finds no answer line, the boxed fallback (unless `strict_box_verify` asks for the
/// boxed check alone).
pub fn verify(solution_str: &str, ground_truth: &str, strict_box_verify: bool) -> (bool, Option<String>) {
    if strict_box_verify {
        return is_correct_strict_box(solution_str, ground_truth);
    }
    let (correct, prediction) = is_correct_minerva(solution_str, ground_truth);
    if prediction != INVALID_PREDICTION {
        return (correct, Some(prediction));
    }
    match is_correct_strict_box(solution_str, ground_truth) {
        (box_correct, Some(box_prediction)) => (box_correct, Some(box_prediction)),
        (_, None) => (correct, Some(prediction)),
    }
}

/// `{score: 1.0 | -1.0, acc: 1 | 0, pred}`; `pred` is absent only when strict box verification finds no box.
pub fn compute_score(solution_str: &str, ground_truth: &str, strict_box_verify: bool) -> RewardResult {
    let tail = last_chars(solution_str, SOLUTION_CLIP_CHARS);
    let (correct, prediction) = verify(tail, ground_truth, strict_box_verify);
    let mut result = RewardResult { score: if correct { 1.0 } else { -1.0 }, ..RewardResult::default() };
    result.extra.insert("acc".into(), bool_to_f64(correct));
    if let Some(prediction) = prediction {
        result.extra_text.insert("pred".into(), prediction);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score_and_pred(solution: &str, truth: &str) -> (f64, String) {
        let result = compute_score(solution, truth, false);
        (result.score, result.extra_text.get("pred").cloned().unwrap_or_default())
    }

    #[test]
    fn units_and_words_are_removed_from_the_answer() {
        assert_eq!(normalize_final_answer("40 dollars"), "40");
        assert_eq!(normalize_final_answer("12 square units"), "12");
        assert_eq!(normalize_final_answer("5 \\text{ cm}"), "5");
        assert_eq!(normalize_final_answer("90^\\circ"), "90");
        assert_eq!(normalize_final_answer("\\text{m}"), "");
    }

    #[test]
    fn articles_and_all_spaces_are_removed() {
        assert_eq!(normalize_final_answer("an apple"), "apple");
        assert_eq!(normalize_final_answer("a banana"), "banana");
        assert_eq!(normalize_final_answer("mega byte"), "megbyte");
        assert_eq!(normalize_final_answer("1 2 3"), "123");
    }

    #[test]
    fn only_the_right_hand_side_of_an_equation_counts() {
        assert_eq!(normalize_final_answer("x = y = 7"), "7");
    }

    #[test]
    fn thousands_commas_are_dropped_only_from_pure_numbers() {
        assert_eq!(normalize_final_answer("1,000,000"), "1000000");
        assert_eq!(normalize_final_answer("(1,2)"), "(1,2)");
        assert_eq!(normalize_final_answer("1,000.5"), "1,000.5");
    }

    #[test]
    fn inline_math_keeps_only_the_first_dollar_pair() {
        assert_eq!(normalize_final_answer("so $x$ and $y$"), "x");
        assert_eq!(normalize_final_answer("$\\frac{1}{2}$."), "\\frac{1}{2}");
    }

    #[test]
    fn text_boxed_and_overline_wrappers_are_unwrapped() {
        assert_eq!(normalize_final_answer("\\boxed{\\frac{1}{2}}"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\textbf{7}"), "7");
        assert_eq!(normalize_final_answer("0.\\overline{3}"), "0.3");
    }

    #[test]
    fn shorthand_frac_and_sqrt_get_braces() {
        assert_eq!(normalize_final_answer("\\frac12"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\frac123"), "\\frac{1}{2}3");
        assert_eq!(normalize_final_answer("\\sqrt2"), "\\sqrt{2}");
        assert_eq!(normalize_final_answer("\\frac{1}{2}"), "\\frac{1}{2}");
    }

    #[test]
    fn decimal_is_not_equated_with_a_fraction() {
        assert_eq!(score_and_pred("Answer: 0.5", "\\frac{1}{2}").0, -1.0);
    }

    #[test]
    fn answer_line_is_case_insensitive_and_the_last_one_wins() {
        assert_eq!(score_and_pred("answer : 3\nANSWER: 4", "4"), (1.0, "4".into()));
    }

    #[test]
    fn missing_answer_line_without_box_is_invalid() {
        assert_eq!(score_and_pred("nothing to see", "95"), (-1.0, "[INVALID]".into()));
    }

    #[test]
    fn boxed_fallback_compares_verbatim_without_normalising() {
        assert_eq!(score_and_pred("The result is \\boxed{104}.", "104"), (1.0, "104".into()));
        assert_eq!(score_and_pred("so \\boxed{\\frac12}", "\\frac{1}{2}"), (-1.0, "\\frac12".into()));
    }

    #[test]
    fn boxed_fallback_only_looks_at_the_last_100_characters() {
        let far = format!("\\boxed{{7}}{}", "x".repeat(100));
        assert_eq!(score_and_pred(&far, "7"), (-1.0, "[INVALID]".into()));
        let near = format!("\\boxed{{7}}{}", "x".repeat(91));
        assert_eq!(score_and_pred(&near, "7"), (1.0, "7".into()));
    }

    #[test]
    fn answer_line_outside_the_last_300_characters_is_ignored() {
        let solution = format!("Answer: 7\n{}", "y".repeat(300));
        assert_eq!(score_and_pred(&solution, "7"), (-1.0, "[INVALID]".into()));
    }

    #[test]
    fn strict_box_verify_ignores_the_answer_line() {
        let result = compute_score("Answer: 7", "7", true);
        assert_eq!(result.score, -1.0);
        assert!(!result.extra_text.contains_key("pred"));
        assert_eq!(compute_score("\\boxed{7}", "7", true).extra["acc"], 1.0);
    }
}

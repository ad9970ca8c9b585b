//! Hendrycks MATH (verl `math_reward.py`, from lm-evaluation-harness): the last `\boxed{…}` answer, equal to
//! the ground truth after `strip_string` normalisation.
//!
//! Python raises inside a few normalisation steps (an assertion on repeated `\text{ `, indexing past the end
//! after a trailing `\sqrt` or `\frac`); verl then compares the raw strings, so those steps return
//! [`Unnormalisable`] here and [`is_equiv`] falls back the same way.

/// A normalisation step that raises in verl's Python.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unnormalisable;

/// 1.0 when the last boxed answer is equivalent to the ground truth, else 0.0.
pub fn compute_score(solution_str: &str, ground_truth: &str) -> f64 {
    let Some(boxed) = last_boxed_only_string(solution_str) else { return 0.0 };
    // verl's `remove_boxed` asserts on `\fbox{…}` and on `\boxed` without a brace; the exception scores 0.
    match remove_boxed(&boxed) {
        Some(answer) if is_equiv(answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

/// The last `\boxed{…}` (braces balanced), or everything after the last `\boxed ` up to a `$`, or the last
/// `\fbox{…}` when there is no `\boxed`.
pub fn last_boxed_only_string(text: &str) -> Option<String> {
    const SPACED: &str = "\\boxed ";
    if text.contains(SPACED) {
        let after = text.rsplit(SPACED).next().unwrap_or_default();
        let until_dollar = after.split('$').next().unwrap_or_default();
        return Some(format!("{SPACED}{until_dollar}"));
    }
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    balanced_brace_end(text, start).map(|end| text[start..=end].to_string())
}

/// Index of the `}` that brings the brace depth counted from `start` back to zero (a `}` before any `{`
/// drives the depth negative, as in verl).
pub(crate) fn balanced_brace_end(text: &str, start: usize) -> Option<usize> {
    let mut depth = 0i64;
    for (offset, byte) in text.as_bytes()[start..].iter().enumerate() {
        match byte {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(start + offset);
                }
            }
            _ => {}
        }
    }
    None
}

/// The content of `\boxed <answer>` or `\boxed{<answer>}`; `None` where verl's assertions fail.
pub fn remove_boxed(boxed: &str) -> Option<&str> {
    if boxed.contains("\\boxed ") {
        return boxed.strip_prefix("\\boxed ");
    }
    boxed.strip_prefix("\\boxed{")?.strip_suffix('}')
}

/// Whether two answers are equal after `strip_string` (or verbatim, when either cannot be normalised).
pub fn is_equiv(answer: &str, ground_truth: &str) -> bool {
    match (strip_string(answer), strip_string(ground_truth)) {
        (Ok(left), Ok(right)) => left == right,
        _ => answer == ground_truth,
    }
}

/// Hendrycks' answer normalisation, step for step.
pub fn strip_string(input: &str) -> Result<String, Unnormalisable> {
    let mut text = input.replace('\n', "");
    text = text.replace("\\!", "");
    text = text.replace("\\\\", "\\");
    text = text.replace("tfrac", "frac").replace("dfrac", "frac");
    text = text.replace("\\left", "").replace("\\right", "");
    text = text.replace("^{\\circ}", "").replace("^\\circ", "");
    text = text.replace("\\$", "");
    text = remove_right_units(&text)?;
    text = text.replace("\\\\%", "").replace("\\%", "");
    // " 0." is " ." and "{0." is "{.": add the leading zero everywhere.
    text = text.replace(" .", " 0.").replace("{.", "{0.");
    if text.is_empty() {
        return Ok(text);
    }
    if text.starts_with('.') {
        text.insert(0, '0');
    }
    // Drop a short "k = " style prefix.
    let sides: Vec<&str> = text.split('=').collect();
    if sides.len() == 2 && sides[0].chars().count() <= 2 {
        text = sides[1].to_string();
    }
    text = fix_sqrt(&text)?;
    text = text.replace(' ', "");
    text = fix_fracs(&text)?;
    if text == "0.5" {
        text = "\\frac{1}{2}".into();
    }
    Ok(fix_a_slash_b(&text))
}

/// `\text{ ` only ever introduces units at the end: keep what precedes it.
fn remove_right_units(text: &str) -> Result<String, Unnormalisable> {
    const UNITS: &str = "\\text{ ";
    if !text.contains(UNITS) {
        return Ok(text.to_string());
    }
    let pieces: Vec<&str> = text.split(UNITS).collect();
    match pieces.as_slice() {
        [before, _] => Ok(before.to_string()),
        _ => Err(Unnormalisable),
    }
}

/// `\sqrt3` → `\sqrt{3}`.
fn fix_sqrt(text: &str) -> Result<String, Unnormalisable> {
    if !text.contains("\\sqrt") {
        return Ok(text.to_string());
    }
    let mut pieces = text.split("\\sqrt");
    let mut fixed = pieces.next().unwrap_or_default().to_string();
    for piece in pieces {
        let mut chars = piece.chars();
        let first = chars.next().ok_or(Unnormalisable)?;
        if first == '{' {
            fixed.push_str("\\sqrt");
            fixed.push_str(piece);
        } else {
            fixed.push_str(&format!("\\sqrt{{{first}}}{}", chars.as_str()));
        }
    }
    Ok(fixed)
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{72}` → `\frac{1}{72}`; `\frac{…}` is left alone.
fn fix_fracs(text: &str) -> Result<String, Unnormalisable> {
    let mut pieces = text.split("\\frac");
    let mut fixed = pieces.next().unwrap_or_default().to_string();
    for piece in pieces {
        fixed.push_str("\\frac");
        let mut chars = piece.chars();
        let numerator = chars.next().ok_or(Unnormalisable)?;
        if numerator == '{' {
            fixed.push_str(piece);
            continue;
        }
        // A single character after `\frac`: verl gives up on the whole string.
        let Some(denominator) = chars.next() else { return Ok(text.to_string()) };
        let rest = chars.as_str();
        if denominator == '{' {
            fixed.push_str(&format!("{{{numerator}}}{{{rest}"));
        } else {
            fixed.push_str(&format!("{{{numerator}}}{{{denominator}}}{rest}"));
        }
    }
    Ok(fixed)
}

/// `3/4` → `\frac{3}{4}`, only for two integers written canonically (Python's `int` round trip).
fn fix_a_slash_b(text: &str) -> String {
    let sides: Vec<&str> = text.split('/').collect();
    match sides.as_slice() {
        [numerator, denominator] if is_canonical_int(numerator) && is_canonical_int(denominator) => {
            format!("\\frac{{{numerator}}}{{{denominator}}}")
        }
        _ => text.to_string(),
    }
}

/// Whether `str(int(text)) == text` in Python: an optional `-`, no leading zeros, no `+`, no `-0`.
fn is_canonical_int(text: &str) -> bool {
    // CPython refuses to convert integers longer than this (`sys.int_info.default_max_str_digits`).
    const PYTHON_MAX_INT_DIGITS: usize = 4300;
    let digits = text.strip_prefix('-').unwrap_or(text);
    let all_ascii_digits = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    let no_leading_zero = digits == "0" || !digits.starts_with('0');
    all_ascii_digits && no_leading_zero && text != "-0" && digits.len() <= PYTHON_MAX_INT_DIGITS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorthand_frac_equals_braced_frac() {
        assert!(is_equiv("\\frac12", "\\frac{1}{2}"));
        assert!(is_equiv("\\dfrac79", "\\frac{7}{9}"));
        assert!(is_equiv("\\frac1{72}", "\\frac{1}{72}"));
    }

    #[test]
    fn one_half_in_decimal_or_slash_form_equals_frac_one_half_but_other_decimals_do_not() {
        assert!(is_equiv("0.5", "\\frac{1}{2}"));
        assert!(is_equiv(".5", "\\frac12"));
        assert!(is_equiv("1/2", "\\frac{1}{2}"));
        assert!(!is_equiv("0.25", "\\frac{1}{4}"));
    }

    #[test]
    fn slash_form_needs_canonical_integers() {
        assert!(is_equiv("-1/2", "\\frac{-1}{2}"));
        assert!(!is_equiv("01/2", "\\frac{01}{2}"));
        assert!(!is_equiv("+1/2", "\\frac{+1}{2}"));
    }

    #[test]
    fn units_degrees_percent_dollars_and_left_right_are_removed() {
        assert!(is_equiv("7\\text{ cm}", "7"));
        assert!(is_equiv("30^\\circ", "30"));
        assert!(is_equiv("30^{\\circ}", "30"));
        assert!(is_equiv("50\\%", "50"));
        assert!(is_equiv("\\$5", "5"));
        assert!(is_equiv("\\left( 8, 9 \\right)", "(8,9)"));
    }

    #[test]
    fn short_variable_prefix_is_dropped_but_long_one_is_kept() {
        assert!(is_equiv("k = 5", "5"));
        assert!(!is_equiv("abc = 5", "5"));
    }

    #[test]
    fn unnormalisable_answers_fall_back_to_verbatim_comparison() {
        assert_eq!(strip_string("\\text{ a}\\text{ b}"), Err(Unnormalisable));
        assert_eq!(strip_string("2\\sqrt"), Err(Unnormalisable));
        assert_eq!(strip_string("\\frac"), Err(Unnormalisable));
        assert!(is_equiv("2\\sqrt", "2\\sqrt"));
        assert!(!is_equiv("\\text{ a}\\text{ b}", "a"));
    }

    #[test]
    fn frac_with_a_single_trailing_character_is_left_unchanged() {
        assert_eq!(strip_string("\\frac1").as_deref(), Ok("\\frac1"));
    }

    #[test]
    fn sqrt_shorthand_gets_braces_but_a_space_after_sqrt_is_braced_as_is() {
        assert!(is_equiv("\\sqrt3", "\\sqrt{3}"));
        // verl braces the space before removing spaces: `\sqrt 3` becomes `\sqrt{}3`.
        assert_eq!(strip_string("2\\sqrt 3").as_deref(), Ok("2\\sqrt{}3"));
    }

    #[test]
    fn last_boxed_answer_with_nested_braces_is_extracted() {
        assert_eq!(compute_score("\\boxed{1} so \\boxed{\\frac{1}{2}}", "0.5"), 1.0);
        assert_eq!(compute_score("\\boxed{\\frac{1}{2}} so \\boxed{1}", "0.5"), 0.0);
    }

    #[test]
    fn spaced_boxed_answer_runs_to_the_next_dollar() {
        assert_eq!(last_boxed_only_string("is $\\boxed 53$ ok").as_deref(), Some("\\boxed 53"));
        assert_eq!(compute_score("The answer is \\boxed 53", "53"), 1.0);
    }

    #[test]
    fn fbox_and_unbraced_boxed_score_zero() {
        assert_eq!(compute_score("\\fbox{5}", "5"), 0.0);
        assert_eq!(compute_score("\\boxed\\frac12", "\\frac12"), 0.0);
        assert_eq!(compute_score("no box 5", "5"), 0.0);
    }

    #[test]
    fn unbalanced_box_scores_zero() {
        assert_eq!(compute_score("\\boxed{5", "5"), 0.0);
    }
}

//! Checks one golden case of `tests/golden/*.json` (`"fn": "reward"`) against the rule scorers.
//!
//! A case: `{"fn": "reward", "name": <data_source>, "config": {...}, "inputs": {"solution_str", "ground_truth"},
//! "expected": {"score", and extra values such as "acc" (number or bool), "pred" (text, or null for none)}}`.
//! `config` may set the scorer arguments verl's functions take: `method` (gsm8k), `format_score`, `score`,
//! `strict_box_verify` (math_dapo). Numbers must agree within 1e-6, absolute plus relative.

use jetrl_config::{Gsm8kMethod, RuleScorerConfig};
use serde_json::Value;

use crate::result::RewardResult;
use crate::rule::default_compute_score;

const TOLERANCE: f64 = 1e-6;

/// `Ok` when the rule scorers reproduce the case; `Err` says which value differs.
pub fn check_case(case: &Value) -> Result<(), String> {
    let family = case.get("fn").and_then(Value::as_str).unwrap_or_default();
    if family != "reward" {
        return Err(format!("not a reward case (fn = {family:?})"));
    }
    let data_source = case.get("name").and_then(Value::as_str).ok_or("case has no `name` (the data_source)")?;
    let inputs = case.get("inputs").ok_or("case has no `inputs`")?;
    let solution_str = inputs.get("solution_str").and_then(Value::as_str).ok_or("inputs.solution_str is not text")?;
    let ground_truth = match inputs.get("ground_truth") {
        Some(Value::String(text)) => text.clone(),
        // search-R1 style `{"target": [...]}` travels as JSON text
        Some(structured @ (Value::Object(_) | Value::Array(_))) => structured.to_string(),
        Some(other) => other.to_string(),
        None => return Err("inputs.ground_truth is missing".into()),
    };
    let options = rule_options(case.get("config"))?;
    let expected = case.get("expected").and_then(Value::as_object).ok_or("case has no `expected` object")?;

    let result = default_compute_score(data_source, solution_str, &ground_truth, &options)
        .map_err(|e| format!("{data_source}: scorer failed: {e}"))?;
    for (key, want) in expected {
        compare(&result, key, want)
            .map_err(|why| format!("{data_source} {solution_str:?} vs {ground_truth:?}: {why}"))?;
    }
    Ok(())
}

fn rule_options(config: Option<&Value>) -> Result<RuleScorerConfig, String> {
    let mut options = RuleScorerConfig::default();
    let Some(config) = config.and_then(Value::as_object) else { return Ok(options) };
    for (key, value) in config {
        match key.as_str() {
            "method" => {
                options.gsm8k_method = match value.as_str() {
                    Some("strict") => Gsm8kMethod::Strict,
                    Some("flexible") => Gsm8kMethod::Flexible,
                    _ => return Err(format!("config.method {value} is neither strict nor flexible")),
                }
            }
            "format_score" => options.format_score = value.as_f64().ok_or("config.format_score is not a number")?,
            "score" => options.correct_score = value.as_f64().ok_or("config.score is not a number")?,
            "strict_box_verify" => {
                options.strict_box_verify = value.as_bool().ok_or("config.strict_box_verify is not a bool")?
            }
            other => return Err(format!("config.{other} is not a scorer argument jetrl knows")),
        }
    }
    Ok(options)
}

fn compare(result: &RewardResult, key: &str, want: &Value) -> Result<(), String> {
    let got_number = if key == "score" { Some(result.score) } else { result.extra.get(key).copied() };
    match want {
        Value::Number(number) => {
            let want = number.as_f64().ok_or_else(|| format!("expected {key} is not a float"))?;
            let got = got_number.ok_or_else(|| format!("{key}: missing, expected {want}"))?;
            close(got, want).then_some(()).ok_or_else(|| format!("{key}: got {got}, expected {want}"))
        }
        Value::Bool(flag) => {
            let want = if *flag { 1.0 } else { 0.0 };
            let got = got_number.ok_or_else(|| format!("{key}: missing, expected {flag}"))?;
            close(got, want).then_some(()).ok_or_else(|| format!("{key}: got {got}, expected {flag}"))
        }
        Value::String(text) => match result.extra_text.get(key) {
            Some(got) if got == text => Ok(()),
            got => Err(format!("{key}: got {got:?}, expected {text:?}")),
        },
        Value::Null => match (result.extra_text.get(key), got_number) {
            (None, None) => Ok(()),
            (text, number) => Err(format!("{key}: expected none, got {text:?} / {number:?}")),
        },
        other => Err(format!("{key}: expected value {other} has no scorer counterpart")),
    }
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= TOLERANCE + TOLERANCE * want.abs()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn every_sample_reward_case_passes() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/rewards_sample.json");
        let text = std::fs::read_to_string(path).unwrap();
        let file: Value = serde_json::from_str(&text).unwrap();
        let cases = file["cases"].as_array().unwrap();
        let reward_cases: Vec<&Value> = cases.iter().filter(|case| case["fn"] == "reward").collect();
        assert!(!reward_cases.is_empty());
        let failures: Vec<String> = reward_cases.iter().filter_map(|case| check_case(case).err()).collect();
        assert!(
            failures.is_empty(),
            "{} of {} cases fail:\n{}",
            failures.len(),
            reward_cases.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn a_wrong_expectation_is_reported_with_the_key() {
        let case = json!({"fn": "reward", "name": "math_dapo", "config": {},
            "inputs": {"solution_str": "Answer: 5", "ground_truth": "5"},
            "expected": {"score": 1.0, "acc": true, "pred": "6"}});
        let err = check_case(&case).unwrap_err();
        assert!(err.contains("pred"), "{err}");
    }

    #[test]
    fn config_arguments_reach_the_scorer() {
        let case = json!({"fn": "reward", "name": "openai/gsm8k", "config": {"method": "flexible", "format_score": 0.1},
            "inputs": {"solution_str": "it is 72", "ground_truth": "73"}, "expected": {"score": 0.1}});
        check_case(&case).unwrap();
    }

    #[test]
    fn search_r1_targets_may_be_given_as_json() {
        let case = json!({"fn": "reward", "name": "searchR1_nq", "config": {},
            "inputs": {"solution_str": "<answer>The Paris</answer>", "ground_truth": {"target": ["paris"]}},
            "expected": {"score": 1.0}});
        check_case(&case).unwrap();
    }
}

//! `golden_extra.json` (written by `scripts/gen_golden_extra.py` from verl's own code) covers what the
//! sample does not: every estimator and loss, singleton groups, empty rows, global-batch normalisation,
//! gradients, bypass mode, rollout correction and float32 cases.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use serde_json::Value;

const EXTRA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden_extra.json");

#[test]
fn every_extra_verl_case_is_reproduced() {
    let text = std::fs::read_to_string(EXTRA).expect("golden_extra.json is readable");
    let file: Value = serde_json::from_str(&text).expect("golden_extra.json is JSON");
    let cases = file["cases"].as_array().expect("\"cases\" is a list");
    let failures: Vec<String> = cases.iter().filter_map(|case| jetrl_algos::golden::check_case(case).err()).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

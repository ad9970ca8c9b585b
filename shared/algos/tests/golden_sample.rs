//! Every case of `tests/golden/algos_sample.json` (verl's reference implementation, float64) must pass.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use serde_json::Value;

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/algos_sample.json");

#[test]
fn every_verl_sample_case_is_reproduced() {
    let text = std::fs::read_to_string(SAMPLE).expect("the golden sample file is readable");
    let file: Value = serde_json::from_str(&text).expect("the golden sample file is JSON");
    let cases = file["cases"].as_array().expect("\"cases\" is a list");
    let failures: Vec<String> = cases.iter().filter_map(|case| jetrl_algos::golden::check_case(case).err()).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
    assert_eq!(cases.len(), 39);
}

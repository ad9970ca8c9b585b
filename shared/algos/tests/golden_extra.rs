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

#[test]
fn every_golden_case_also_passes_on_the_gpu_when_one_is_present() {
    if !tch::Cuda::is_available() {
        eprintln!("no CUDA device: the GPU run of the golden cases is skipped");
        return;
    }
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/algos_sample.json");
    let mut failures = Vec::new();
    for path in [sample, EXTRA] {
        let file: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("JSON");
        for case in file["cases"].as_array().expect("\"cases\" is a list") {
            if let Err(e) = jetrl_algos::golden::check_case_on(case, tch::Device::Cuda(0)) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{} cases failed on the GPU:\n{}", failures.len(), failures.join("\n"));
}

//! Every golden case (`tests/golden/algos_sample.json` and `golden_extra.json`) on a CUDA device. Compiled only
//! with the `cuda-tests` feature (a GPU host); fails when libtorch sees no CUDA device.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use serde_json::Value;

const EXTRA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden_extra.json");

#[test]
fn every_golden_case_also_passes_on_the_gpu() {
    assert!(tch::Cuda::is_available(), "the cuda-tests feature is on, but libtorch sees no CUDA device");
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

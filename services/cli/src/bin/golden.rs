//! `jetrl-golden FILE...`: checks every case of golden-vector files (schema: tests/golden/README.md)
//! against jetrl's implementations. Prints one line per failing case, then `N passed, M failed`; exits
//! non-zero on any failure. A case whose fn/name is not implemented counts as failed.

use std::process::ExitCode;

fn main() -> ExitCode {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: jetrl-golden FILE [FILE...]");
        return ExitCode::from(2);
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in &files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(err) => {
                println!("{file}: cannot read: {err}");
                failed += 1;
                continue;
            }
        };
        let doc: serde_json::Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(err) => {
                println!("{file}: not JSON: {err}");
                failed += 1;
                continue;
            }
        };
        let Some(cases) = doc.get("cases").and_then(|c| c.as_array()) else {
            println!("{file}: no \"cases\" array");
            failed += 1;
            continue;
        };
        for (i, case) in cases.iter().enumerate() {
            let family = case.get("fn").and_then(|v| v.as_str()).unwrap_or("?");
            let name = case.get("name").and_then(|v| v.as_str()).unwrap_or("?");
            let result = std::panic::catch_unwind(|| {
                if family == "reward" {
                    jetrl_reward::golden::check_case(case)
                } else {
                    jetrl_algos::golden::check_case(case)
                }
            })
            .unwrap_or_else(|_| Err("panicked".into()));
            match result {
                Ok(()) => passed += 1,
                Err(err) => {
                    failed += 1;
                    println!("FAIL {file} case {i} {family}/{name}: {err}");
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

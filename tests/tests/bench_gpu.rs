//! `just bench gpu` in its CPU mode: the same script, binaries and reference programs as on a GPU, at tiny shapes
//! (`JETRL_BENCH_GPU_SHAPE=tiny`), so the GPU benchmark cannot rot on machines without one. The script builds the
//! GPU bench bundle (`just gpu-bundle`) and runs it from another directory in a clean environment, as a lent
//! device does. It needs the
//! project's python with transformers, so it is `#[ignore]`d for a plain `cargo test`; `./dev.sh test` installs
//! transformers and runs it (`--include-ignored`).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
#[ignore = "slow tier: against transformers (python with transformers: `./dev.sh test` installs it)"]
fn gpu_bench_runs_at_tiny_shapes_on_the_cpu_and_prints_one_json_line() {
    let root = repo_root();
    let mut command = Command::new(root.join("benches/gpu/run.sh"));
    // The script's own `cargo build`s must see the environment a person's shell has: the variables cargo sets
    // for this test (OUT_DIR above all, CARGO_MANIFEST_DIR, ...) change the fingerprints of crates that read them
    // (ring, async-nats and every crate above), which then rebuild twice: here, and in the next build outside.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let set_by_cargo_test =
            ["CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_BIN_", "CARGO_CRATE_NAME"].iter().any(|p| name.starts_with(p))
                || ["OUT_DIR", "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "CARGO_RUSTC_CURRENT_DIR"]
                    .contains(&name.as_str());
        if set_by_cargo_test {
            command.env_remove(&name);
        }
    }
    command.env("JETRL_BENCH_GPU_SHAPE", "tiny").current_dir(&root);
    let jetrl_tests::BenchRun { status, stdout, stderr, elapsed } =
        jetrl_tests::run_bench(command, Duration::from_secs(420));
    assert!(status.success(), "benches/gpu/run.sh failed ({status}):\n{stderr}");
    eprintln!("benches/gpu/run.sh (tiny, CPU) took {:.0} s", elapsed.as_secs_f64());

    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stdout is exactly the JSON line:\n{stdout}");
    let line: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(line["bench"], "gpu");
    assert_eq!((line["device"].as_str(), line["shape"].as_str()), (Some("cpu"), Some("tiny")));
    let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|x| x > 0.0);
    for side in ["rollout", "trainer_step"] {
        for key in ["jetrl_tok_per_s", "reference_tok_per_s", "ratio"] {
            assert!(positive(&line[side][key]), "{side}.{key} = {}", line[side][key]);
        }
    }
    for key in ["vs_graph_loop", "ms_per_step_b32", "ms_per_step_b256", "grpo_vs_fixed"] {
        assert!(positive(&line[key]), "{key} = {}", line[key]);
    }
    assert!(positive(&line["trainer_step"]["ratio_same_precision"]));
    assert_eq!(line["graph_matches_eager"], true, "{}", line["rollout"]["graph_check"]);
    let check = &line["rollout"]["graph_check"];
    assert!(check["max_logprob_diff_rollout_vs_trainer"].as_f64().is_some_and(|d| d <= 1e-4), "{check}");
    assert!(line["bundle_mb"].as_f64().is_some_and(|mb| mb > 1.0 && mb <= 32.0), "bundle_mb {}", line["bundle_mb"]);
    let schedule = &line["separate_vs_sync"];
    for key in ["sync_s", "separate_async_s", "speedup_separate"] {
        assert!(positive(&schedule[key]), "separate_vs_sync.{key} = {}", schedule[key]);
    }
    for key in ["final_reward_sync", "final_reward_separate"] {
        assert!(schedule[key].as_f64().is_some_and(|r| (0.0..=1.0).contains(&r)), "{key} = {}", schedule[key]);
    }
    assert!(line.get("targets").is_none(), "GPU targets are not judged at tiny shapes");
}

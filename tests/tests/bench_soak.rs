//! `just bench soak` shortened, so the soak benchmark cannot rot: the same binary with 8 stand-in rollout workers
//! for 20 s (reports every 5 s) instead of 10 minutes. Everything the workers completed is trained exactly once.
//! Memory growth is not judged here: 20 s is mostly the services' warm-up. Needs the service binaries
//! (`cargo build --bins`, which `just test` runs first).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::process::Command;
use std::time::Duration;

#[test]
#[ignore = "slow tier: the soak benchmark's smoke run"]
fn a_short_soak_loses_and_duplicates_nothing_and_reports_every_interval() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_bench-soak"));
    command.env("SOAK_SECONDS", "20").env("SOAK_REPORT_S", "5").env("SOAK_WORKERS", "8");
    let jetrl_tests::BenchRun { status, stdout: out, stderr, .. } =
        jetrl_tests::run_bench(command, Duration::from_secs(180));
    assert!(status.success(), "bench-soak failed ({status}):\n{out}\n{stderr}");
    let intervals: Vec<&str> = out.lines().filter(|l| l.starts_with("soak interval ")).collect();
    assert_eq!(intervals.len(), 4, "one line per 5 s interval:\n{out}");
    for line in &intervals {
        for process in
            ["nats-server", "reward-service", "replay-buffer", "trainer", "rollout-worker-0", "rollout-worker-7"]
        {
            assert!(line.contains(process), "{process}'s RSS is in every interval line: {line}");
        }
        assert_eq!(line.matches("(peak ").count(), 12, "each process's peak RSS in the interval: {line}");
    }
    let last = out.lines().last().unwrap();
    let json: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}\n{stderr}"));
    assert_eq!(json["bench"], "soak");
    assert_eq!(json["workers"], 8);
    assert_eq!(json["lost"], 0, "{last}\n{stderr}");
    assert_eq!(json["duplicated"], 0, "{last}\n{stderr}");
    assert_eq!(json["in_flight"], 0, "{last}\n{stderr}");
    assert!(json["traj_per_s"].as_f64().unwrap() > 0.0, "{last}");
    assert!(json["trained_groups"].as_u64().unwrap() > 0, "{last}");
    assert_eq!(json["trained_groups"], json["submitted_groups"], "{last}");
    for service in ["nats-server", "reward-service", "replay-buffer", "rollout-worker"] {
        assert!(json["rss_growth_pct"][service].is_number(), "{service} growth in {last}");
        assert!(json["rss_end_growth_pct"][service].is_number(), "{service} end-of-interval growth in {last}");
    }
    assert_eq!(json["nats_live_heap_mib"].as_array().map(Vec::len), Some(4), "the broker's heap each interval: {last}");
    // the broker runs under the soak's memory limit, and the CPU each process used is reported
    assert_eq!(json["nats_gomemlimit"], "160MiB", "{last}");
    assert!(json["nats_gogc"].is_null(), "Go's default GOGC unless SOAK_NATS_GOGC sets one: {last}");
    // the services' heap in use, read from their /metrics every interval
    for service in ["reward-service", "replay-buffer"] {
        let readings = json["heap_in_use_mib"][service].as_array().unwrap_or_else(|| panic!("{service}: {last}"));
        assert_eq!(readings.len(), 4, "{service}'s heap in use each interval: {last}");
        assert!(readings.iter().all(|r| r.as_f64().is_some_and(|mib| mib > 0.0)), "{service}: {last}");
        assert!(json["heap_in_use_growth_pct"][service].is_number(), "{service}: {last}");
    }
    for process in ["nats-server", "reward-service", "replay-buffer", "rollout-workers"] {
        assert!(json["cpu_s"][process].as_f64().is_some_and(|s| s > 0.0), "{process}'s CPU seconds in {last}");
    }
    // every trained group left GROUPS for the ledger's archive: the bucket holds the working set, not the history
    assert_eq!(json["groups_bucket_records_end"], 0, "{last}");
    assert_eq!(json["ledger_archived_records"], json["submitted_groups"], "{last}");
}

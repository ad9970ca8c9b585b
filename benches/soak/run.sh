#!/usr/bin/env bash
# `just bench soak`: 10 minutes of steady load through the real data plane. SOAK_WORKERS (8) stand-in rollout
# workers, each its own process with a fast stand-in generator (no model: synthetic trajectories written exactly as
# a rollout worker writes them), push groups through the real reward service and replay buffer (separate
# processes) to a sampling trainer stand-in that samples, fetches every payload and releases each step. Every
# minute: trajectories/s and every process's RSS. At the end every group is accounted for.
# Knobs (env): SOAK_MINUTES (10; SOAK_SECONDS wins when set), SOAK_REPORT_S (60), SOAK_WORKERS (8),
# SOAK_WORKER_INFLIGHT (4 groups per worker), SOAK_GROUP (8 trajectories), SOAK_PAYLOAD_BYTES (4096),
# SOAK_BATCH_GROUPS (16), SOAK_TRAJ_PER_S (3000: the pace of the trainer stand-in, a steady load every minute;
# 0: as fast as it goes), SOAK_NATS_GOMEMLIMIT (160MiB: the broker's Go memory limit, docs/operations.md; off: none),
# SOAK_NATS_GOGC (unset: Go's default, 100; off, with a limit: Go collects only at the limit).
# Last line: {"bench":"soak","minutes":…,"traj_per_s":…,"rss_growth_pct":{"<process>":…},"lost":…,"duplicated":…,…}
# (the growth of each process's peak RSS in a minute, read every second, from the first minute to the last; the
# target is ≤ 5% and nothing lost or duplicated: "targets_met").
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --bin jetrl-reward-service --bin jetrl-replay-buffer
cargo build --quiet --bin bench-soak
exec "${CARGO_TARGET_DIR:-target}/debug/bench-soak"

#!/usr/bin/env bash
# Data plane: real path (producers -> reward service -> replay buffer -> sampling consumer) vs raw JetStream.
# Knobs (env): BENCH_GROUPS (1000), BENCH_BATCH_GROUPS (16), BENCH_PRODUCERS (4), BENCH_MEMORY_TRAJECTORIES (100000).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec ./target/debug/bench-dataplane

#!/usr/bin/env bash
# Data plane: real path (producers -> reward service -> replay buffer -> sampling consumer) vs raw JetStream.
# Knobs (env): BENCH_GROUPS (1000), BENCH_BATCH_GROUPS (16), BENCH_PRODUCERS (4), BENCH_MEMORY_TRAJECTORIES (100000),
# BENCH_CONSUMER_DEPTH (2: sample requests the consumer keeps in flight; 1 samples, fetches and releases in turn).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec ./target/debug/bench-dataplane

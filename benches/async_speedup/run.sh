#!/usr/bin/env bash
# `just bench async_speedup`: the demo task (GRPO, tiny-digits model) on a long-tail response-length workload,
# the same job, model, data and number of steps in sync, colocate_async and separate_async, side by side in one
# run (rounds alternate the order of the modes), one rollout worker and the same intra-op thread count in every
# process of every mode. See bench.py for the workload and what is measured.
# Knobs (env): JETRL_BENCH_STEPS (60), JETRL_BENCH_ROUNDS (2), JETRL_BENCH_THREADS (1),
# JETRL_BENCH_LONG_FRACTION (0.15), JETRL_BENCH_MODES (sync,colocate_async,separate_async).
# Last line: {"bench":"async_speedup","sync_s":…,"colocate_async_s":…,"separate_async_s":…,
# "speedup_separate":…,"speedup_colocate":…,"final_reward_sync":…,"final_reward_separate":…,…}
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --workspace --exclude jetrl-benches --bins  # the services and jetrl, not the benchmark drivers
exec .venv/bin/python benches/async_speedup/bench.py

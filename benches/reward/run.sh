#!/usr/bin/env bash
# Reward service throughput: rule-scored trajectories per second through the service (real nats-server) against
# RewardEngine::score_batch in-process on the same inputs. Arguments pass through to jetrl-reward-bench
# (`--trajectories M`, `--response-tokens N`, reward overrides such as `batch_size=64`).
# Last line: {"bench":"reward","service_per_s":…,"inprocess_per_s":…,"ratio":…}
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --bin jetrl-reward-bench
exec ./target/debug/jetrl-reward-bench "$@"

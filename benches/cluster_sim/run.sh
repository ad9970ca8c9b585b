#!/usr/bin/env bash
# `just bench cluster_sim`: the trainer's three schedules (sync, colocate_async, separate_async) at cluster scale,
# by a paced simulation on this machine: the real trainer (with `trainer.simulate`, a paced stand-in learner: no
# model, an update sleeps a modelled device time), the real replay buffer, reward service and checkpoint-sync over
# a real nats-server, and a fleet of paced stand-in rollout workers (tokio tasks of bench-cluster-sim, each with
# its own pull on PROMPTS, heartbeat and continuous batch, sleeping a modelled decode time). The profiles
# (benches/cluster_sim/*.yaml) say where each number comes from. The paced clock runs `time_scale` times faster
# than real time; separate_async is run again at half the scale to show the result does not depend on it.
# Knobs (env): JETRL_SIM_PROFILE (h100-7b-grpo-math; or demo, or a path), JETRL_SIM_WORKERS (the profile's
# largest fleet), JETRL_SIM_MODES (sync,colocate_async,separate_async), JETRL_SIM_TIME_SCALE (the profile's),
# JETRL_SIM_STEPS (the profile's), JETRL_SIM_KEEP (1: keep the logs and run directories, path printed),
# JETRL_SIM_SCALE_CHECK (1; 0: no second run), JETRL_SIM_CHAOS (1: kill -9 a random stand-in every 10 s and a
# random service every 60 s, the trainer included, each restarted; the lines report the kills, the trainer's
# longest stall and the longest step), JETRL_SIM_CHAOS_KILL (the services chaos may kill; default
# checkpoint-sync,replay-buffer,reward-service,trainer).
# One JSON line per mode, then {"bench":"cluster_sim","profile":…,"workers":…,"speedup_separate":…,
# "speedup_colocate":…,"ideal_bound":…,"trainer_wait_share":…,"sample_p99_ms":…,"lost":…,"duplicated":…,…}.
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --bin jetrl-trainer --bin jetrl-replay-buffer --bin jetrl-reward-service \
    --bin jetrl-checkpoint-sync --bin bench-cluster-sim
exec "${CARGO_TARGET_DIR:-target}/debug/bench-cluster-sim"

#!/usr/bin/env bash
# `just bench weight_sync`: one weight version of ≥ 500 MB (random-init Qwen2 shape, f32) into two rollout
# workers on both of jetrl's paths, each against moving the same bytes by hand, in the same run:
#   same node  jetrl's shared_fs store + per-tensor CRC manifest + two readers that read and verify it,
#              against writing the bytes to a file and reading it twice
#   broker     the JetStream object store through Bus::store_weights / load_weights + verify, against a raw
#              async-nats object-store put (same chunk size) and two gets
# plus the swap into the engine, reported on its own; and LoRA: the same model's adapter-only version (rank 16,
# all-linear) through the broker plus each worker's merge, against the full sync plus its swap (lora_speedup).
# Arguments pass through to bench-weight-sync (`--hidden`, `--layers`, `--vocab`, `--intermediate`,
# `--kv-heads`, `--rounds` (5), `--warmup` (1), `--chunk-bytes`, `--lora-rank` (16)); the Qwen2.5-0.5B shape is
# `--hidden 896 --layers 24 --vocab 151936 --intermediate 4864 --kv-heads 2` (2 GB in f32). Medians over the rounds;
# the sides alternate order round by round (this machine class is shared: load from others falls on all alike).
# Last line: {"bench":"weight_sync","bytes":…,"jetrl_s":…,"raw_copy_s":…,"ratio":…,"broker_jetrl_s":…,
# "broker_raw_s":…,"broker_ratio":…,"lora_speedup":…,"lora_bytes":…,…}
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --bin bench-weight-sync
exec ./target/debug/bench-weight-sync "$@"

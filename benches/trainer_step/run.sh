#!/usr/bin/env bash
# One PPO update (forward, backward, global-norm clipping, AdamW) on the same model config and batch in jetrl's
# trainer (Actor::ppo_update) and in a PyTorch reference (benches/trainer_step/reference.py: transformers'
# Qwen2 + torch.optim.AdamW), same run, CPU. The two sides alternate update by update (load from other
# processes falls on both alike), with the same intra-op thread count: 1 by default, because on shared CI cores
# a multi-threaded OpenMP update is at the mercy of every other process; pass `--threads N` on a dedicated
# machine. The bench checks both compute the same first update (pg_loss and grad_norm) before comparing speed.
# Arguments pass through to jetrl-trainer-bench (`--hidden`, `--layers`, `--vocab`, `--rows`, `--prompt-len`,
# `--response-len`, `--warmup`, `--iters`, `--threads`). Default: Qwen2 shape, hidden 256, 4 layers, vocab 4096,
# 16 sequences of ≤32 prompt + ≤96 response tokens.
# It also times a long-tail batch (16 responses of 16 to `--long-response-len` tokens, log-uniform) with padded
# and with packed micro-batches (`model.use_remove_padding`), alternating, and measures jetrl's peak RSS over one
# update of a long batch (16 x (32 + `--long-response-len` 1024)
# tokens), without and with gradient checkpointing, each in a process of its own (peak RSS only grows).
# Peak memory is RSS on the CPU and the CUDA caching allocator's max_memory_allocated on a GPU (`--device cuda`).
# Last, LoRA (rank 16, alpha 16, all-linear) against full fine-tuning on the main batch, alternating: update time
# and optimizer-state bytes.
# Last line: {"bench":"trainer_step","jetrl_tok_per_s":…,"reference_tok_per_s":…,"ratio":…,"packed_vs_padded":…,
# "peak_mb_plain":…,"peak_mb_checkpointed":…,"peak_mb_kind":…,"lora_vs_full":…,"optim_bytes_full":…,
# "optim_bytes_lora":…}
set -euo pipefail
cd "$(dirname "$0")/../.."
# `just bench` has built the workspace; this keeps the script usable on its own.
cargo build --quiet --bin jetrl-trainer-bench
exec ./target/debug/jetrl-trainer-bench --python .venv/bin/python --reference benches/trainer_step/reference.py "$@"

#!/usr/bin/env bash
# `just bench gpu`: the GPU figures in one run, from the existing benches with shape arguments:
#   rollout   benches/rollout_engine: jetrl's engine against HF `generate`, batch 256 (32 prompts x 8), 32 prompt
#             + 128 new tokens, sampled (HF measured there: 3.6k tok/s; target: jetrl >= 36k tok/s)
#   trainer   benches/trainer_step: one PPO update on 16 x 512 tokens against the PyTorch reference (measured
#             there: 80.9k tok/s; target: ratio >= 1.0); with it packed against padded micro-batches on a
#             long-tail batch, peak memory of one update of 16 x 1,056 tokens without and with gradient
#             checkpointing (max_memory_allocated on CUDA), and LoRA (rank 16, all-linear) against full
#             fine-tuning (update time, optimizer-state bytes)
#   schedule  benches/async_speedup on the demo job: separate_async against sync
# On a CUDA device: the Qwen2.5-0.5B shape (random init, bf16; hidden 896, 24 layers, 14 heads, 2 kv heads,
# intermediate 4864, vocab 151936), in under 8 minutes. Without one (or with JETRL_BENCH_GPU_SHAPE=tiny) the
# same code runs at tiny shapes on the CPU, and the JSON says so ("device":"cpu","shape":"tiny");
# tests/tests/bench_gpu.rs runs it that way so it cannot rot.
# Last line: {"bench":"gpu","device":…,"shape":…,"rollout":{…},"trainer_step":{…},"separate_vs_sync":{…},…}
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"

# (benches/rollout_engine/run.sh installs transformers through scripts/setup.sh, if missing)
# `just bench` has built the workspace; this keeps the script usable on its own. Targets are named without `-p`:
# one package alone resolves its dependencies' features apart from the workspace's, and rebuilds them (minutes).
cargo build -q --bins
cargo build -q --example rollout_engine_bench

cuda="$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')"
if [ "${JETRL_BENCH_GPU_SHAPE:-}" = tiny ] || [ "$cuda" != 1 ]; then
  device=cpu dtype=f32 shape=tiny
  rollout_env=(JETRL_BENCH_GROUPS=2 JETRL_BENCH_N=4 JETRL_BENCH_PROMPT_LEN=8 JETRL_BENCH_NEW_TOKENS=16
               JETRL_BENCH_ROUNDS=1 JETRL_BENCH_REPS=1 JETRL_BENCH_SHAPE=)
  trainer_args=(--hidden 64 --layers 1 --vocab 256 --rows 4 --prompt-len 8 --response-len 8 --exact-lengths
                --warmup 1 --iters 2)
  async_env=(JETRL_BENCH_STEPS=3 JETRL_BENCH_ROUNDS=1)
else
  device=cuda dtype=bf16 shape=qwen2.5-0.5b
  qwen=(--hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936)
  rollout_env=(JETRL_BENCH_GROUPS=32 JETRL_BENCH_N=8 JETRL_BENCH_PROMPT_LEN=32 JETRL_BENCH_NEW_TOKENS=128
               JETRL_BENCH_ROUNDS=1 JETRL_BENCH_REPS=2 "JETRL_BENCH_SHAPE=${qwen[*]}")
  trainer_args=("${qwen[@]}" --rows 16 --prompt-len 128 --response-len 384 --exact-lengths --warmup 2 --iters 5)
  async_env=(JETRL_BENCH_STEPS=40 JETRL_BENCH_ROUNDS=1)
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
echo "[gpu bench] device $device, shape $shape: rollout engine against HF generate" >&2
env "${rollout_env[@]}" JETRL_BENCH_DEVICE="$device" JETRL_BENCH_DTYPE="$dtype" benches/rollout_engine/run.sh \
  | tee "$work/rollout.out" >&2
echo "[gpu bench] PPO step against the PyTorch reference" >&2
benches/trainer_step/run.sh "${trainer_args[@]}" --device "$device" --dtype "$dtype" | tee "$work/trainer.out" >&2
echo "[gpu bench] separate_async against sync on the demo job" >&2
env "${async_env[@]}" JETRL_BENCH_WORKLOAD=demo JETRL_BENCH_MODES=sync,separate_async \
  "$py" benches/async_speedup/bench.py | tee "$work/async.out" >&2

"$py" - "$work" "$device" "$shape" "$((SECONDS - started))" <<'PY'
import json, os, sys
work, device, shape, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def last(name):
    with open(os.path.join(work, name)) as f:
        return json.loads([line for line in f if line.strip()][-1])
rollout, trainer, schedule = last("rollout.out"), last("trainer.out"), last("async.out")
line = {
    "bench": "gpu",
    "device": device,
    "shape": shape,
    "rollout": {k: rollout[k] for k in ("jetrl_tok_per_s", "reference_tok_per_s", "ratio", "batch", "new_tokens",
                                        "dtype", "fixed_length")},
    "trainer_step": {k: trainer[k] for k in ("jetrl_tok_per_s", "reference_tok_per_s", "ratio",
                                             "tokens_per_update", "dtype", "packed_vs_padded", "peak_mb_plain",
                                             "peak_mb_checkpointed", "peak_mb_kind", "lora_vs_full",
                                             "optim_bytes_full", "optim_bytes_lora")},
    "separate_vs_sync": {k: schedule.get(k) for k in ("sync_s", "separate_async_s", "speedup_separate",
                                                      "final_reward_sync", "final_reward_separate", "steps")},
    "seconds": seconds,
}
if device == "cuda":
    line["targets"] = {
        "rollout_tok_per_s": 36000, "rollout_met": rollout["jetrl_tok_per_s"] >= 36000,
        "trainer_ratio": 1.0, "trainer_met": trainer["ratio"] >= 1.0,
        "under_8_min": seconds < 480,
    }
print(json.dumps(line))
PY

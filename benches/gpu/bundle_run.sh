#!/usr/bin/env bash
# The GPU bench bundle's entry point (`just gpu-bundle DIR` copies this file to DIR/run.sh). Self-contained: it
# needs only `python3` on the PATH with torch (the build the binaries were linked against) and transformers; no
# cargo, no nats-server, no repository. `bash DIR/run.sh` from any directory prints one JSON line on stdout
# (progress goes to stderr):
#   rollout       jetrl's engine at batch 256 (32 prompts x 8 samples, 32 prompt + 128 new tokens, sampled) in
#                 a GRPO rollout (stop at EOS) against HF `generate`, and at fixed length against a plain
#                 PyTorch decode loop with a static KV cache and one CUDA graph per step (graph_loop.py); batch
#                 32 fixed length for the per-step latency. Before timing: the engine's CUDA-graph decode
#                 against its eager decode (same seeded requests) and against the training forward.
#   trainer_step  one PPO update of 16 x 512 tokens against the PyTorch reference, at bf16 parameters and at
#                 jetrl's own precision (fp32 master weights, bf16 autocast, fused AdamW)
# On a CUDA device: the Qwen2.5-0.5B shape (random init, bf16), in under 6 minutes on an H100/H200. Without one,
# or with JETRL_BENCH_GPU_SHAPE=tiny: tiny shapes on the CPU ("device":"cpu","shape":"tiny"). Every side drops
# its warm-up repetitions and reports the median of the rest; rounds alternate the sides.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
torch_lib="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1

cuda="$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')"
if [ "${JETRL_BENCH_GPU_SHAPE:-}" = tiny ] || [ "$cuda" != 1 ]; then
  device=cpu dtype=f32 shape=tiny threads=1
  shape_args=()
  groups=4 n=4 groups_small=2 prompt_len=8 new_tokens=16 reps=2 rounds=1
  trainer_args=(--hidden 64 --layers 1 --vocab 256 --rows 4 --prompt-len 8 --response-len 8 --exact-lengths
                --warmup 1 --iters 2)
else
  device=cuda dtype=bf16 shape=qwen2.5-0.5b threads=0
  shape_args=(--hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936)
  groups=32 n=8 groups_small=4 prompt_len=32 new_tokens=128 reps=3 rounds=2
  trainer_args=("${shape_args[@]}" --rows 16 --prompt-len 128 --response-len 384 --exact-lengths --warmup 2
                --iters 5)
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
bench="$here/bin/rollout_engine_bench"
echo "[gpu bundle] device $device, shape $shape: preparing the model" >&2
"$bench" prepare "$work/model" --groups "$groups" --prompt-len "$prompt_len" ${shape_args[@]+"${shape_args[@]}"}
# the small batch: the same model, the first prompts
mkdir "$work/small"
for f in "$work/model"/*; do ln -s "$f" "$work/small/$(basename "$f")"; done
rm "$work/small/prompts.json"
"$py" -c 'import json,sys; p=json.load(open(sys.argv[1])); json.dump(p[:int(sys.argv[3])], open(sys.argv[2],"w"))' \
  "$work/model/prompts.json" "$work/small/prompts.json" "$groups_small"

common=(--device "$device" --dtype "$dtype" --threads "$threads" --new-tokens "$new_tokens")
echo "[gpu bundle] CUDA-graph decode against eager decode" >&2
"$bench" check "$work/small" --n "$n" --device "$device" --dtype "$dtype" --new-tokens "$new_tokens" \
  | tee "$work/check.jsonl" >&2
for round in $(seq "$rounds"); do
  echo "[gpu bundle] rollout round $round of $rounds" >&2
  "$bench" run "$work/model" --workload fixed --n "$n" --reps "$reps" --seed "$round" "${common[@]}" \
    | tee -a "$work/jetrl-fixed.jsonl" >&2
  "$py" "$here/graph_loop.py" "$work/model" --n "$n" --reps "$reps" "${common[@]}" | tee -a "$work/loop.jsonl" >&2
  "$bench" run "$work/model" --workload grpo --n "$n" --reps "$reps" --seed "$round" "${common[@]}" \
    | tee -a "$work/jetrl-grpo.jsonl" >&2
  "$py" "$here/hf_generate.py" "$work/model" --workload grpo --n "$n" --reps "$reps" --seed "$round" \
    "${common[@]}" | tee -a "$work/hf-grpo.jsonl" >&2
  "$bench" run "$work/small" --workload fixed --n "$n" --reps "$reps" --seed "$round" "${common[@]}" \
    | tee -a "$work/jetrl-fixed-small.jsonl" >&2
  "$py" "$here/graph_loop.py" "$work/small" --n "$n" --reps "$reps" "${common[@]}" \
    | tee -a "$work/loop-small.jsonl" >&2
done

echo "[gpu bundle] PPO step against the PyTorch reference" >&2
"$here/bin/jetrl-trainer-bench" --python "$py" --reference "$here/trainer_reference.py" "${trainer_args[@]}" \
  --device "$device" --dtype "$dtype" | tee "$work/trainer.jsonl" >&2

"$py" "$here/summary.py" "$work" "$device" "$shape" "$((SECONDS - started))"

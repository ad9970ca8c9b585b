#!/usr/bin/env bash
# `just bench rollout_engine`: jetrl's rollout engine against HF transformers `generate` and against vLLM's engine
# (`vllm.LLM` from .venv-vllm, which scripts/setup-vllm.sh installs), on the CPU (or the device JETRL_BENCH_DEVICE
# names), in the same run: the same random-init model (by default the `tiny` preset:
# Qwen2, 2 layers, hidden 128, vocabulary 65; JETRL_BENCH_SHAPE sets another), the same
# prompts, batch (groups x n samples) and lengths, sampled decoding (temperature 1, top-k and top-p off).
#
# Two workloads, each measured on both sides:
#   grpo   a GRPO rollout: sequences end at EOS or at NEW_TOKENS; tokens counted through the EOS
#          (`generate` keeps computing finished rows until the whole batch is done; the engine drops them)
#   fixed  every sequence runs exactly NEW_TOKENS (EOS ignored): per-step decode speed alone
# jetrl and HF run in alternation, ROUNDS times, REPS repetitions each (so a change in machine load hits both
# alike); vLLM (whose start takes about a minute here) runs once per workload after them, ROUNDS x REPS
# repetitions in one process. The figures are medians over all repetitions. Each side's samples of its last `grpo`
# repetition are scored by the training forward in float32 (`rollout_engine_bench score`): the largest
# |log-prob difference| is the rollout-vs-trainer gap of that engine. The last line printed is the `grpo`
# comparison, with the `fixed` one nested under "fixed_length".
#
# Knobs (environment): JETRL_BENCH_GROUPS (4), JETRL_BENCH_N (8), JETRL_BENCH_PROMPT_LEN (32),
# JETRL_BENCH_NEW_TOKENS (128), JETRL_BENCH_ROUNDS (3), JETRL_BENCH_REPS (2), JETRL_BENCH_THREADS (1: intra-op
# threads on both sides; a tiny model gains nothing from more, and on a shared machine spinning threads only add
# noise), JETRL_BENCH_DEVICE (cpu; or cuda) and JETRL_BENCH_DTYPE (f32; bf16 on a GPU) on both sides,
# JETRL_BENCH_SHAPE (empty: the tiny preset; else the model's shape, e.g. `--hidden 896 --layers 24 --heads 14
# --kv-heads 2 --intermediate 4864 --vocab 151936`, random init; `benches/gpu/run.sh` uses this).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

groups="${JETRL_BENCH_GROUPS:-4}"
n="${JETRL_BENCH_N:-8}"
prompt_len="${JETRL_BENCH_PROMPT_LEN:-32}"
new_tokens="${JETRL_BENCH_NEW_TOKENS:-128}"
rounds="${JETRL_BENCH_ROUNDS:-3}"
reps="${JETRL_BENCH_REPS:-2}"
threads="${JETRL_BENCH_THREADS:-1}"
device="${JETRL_BENCH_DEVICE:-cpu}"
dtype="${JETRL_BENCH_DTYPE:-f32}"
read -r -a shape <<<"${JETRL_BENCH_SHAPE:-}"

scripts/setup.sh transformers >&2
scripts/setup-vllm.sh >&2
cargo build -q --example rollout_engine_bench
bin="$root/target/debug/examples/rollout_engine_bench"
py="$root/.venv/bin/python"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin" prepare "$work/model" --groups "$groups" --prompt-len "$prompt_len" ${shape[@]+"${shape[@]}"}

export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
common=(--n "$n" --new-tokens "$new_tokens" --reps "$reps" --threads "$threads" --device "$device" --dtype "$dtype")
for round in $(seq "$rounds"); do
  for workload in fixed grpo; do
    "$bin" run "$work/model" --workload "$workload" --seed "$round" "${common[@]}" --dump "$work/jetrl-samples.jsonl" \
      | tee -a "$work/jetrl-$workload.jsonl"
    if ! "$py" benches/rollout_engine/hf_generate.py "$work/model" --workload "$workload" --seed "$round" \
        "${common[@]}" >>"$work/hf-$workload.jsonl" 2>"$work/hf.log"; then
      cat "$work/hf.log" >&2
      exit 1
    fi
    tail -n 1 "$work/hf-$workload.jsonl"
  done
done
# the last jetrl run was `grpo`: its samples are the ones scored
vllm_py="$root/.venv-vllm/bin/python"
vllm_common=(--n "$n" --new-tokens "$new_tokens" --reps "$((rounds * reps))" --threads "$threads" --device "$device" --dtype "$dtype")
for workload in fixed grpo; do
  if ! "$vllm_py" benches/rollout_engine/vllm_generate.py "$work/model" --workload "$workload" --seed 1 \
      "${vllm_common[@]}" --dump "$work/vllm-samples.jsonl" >>"$work/vllm-$workload.jsonl" 2>"$work/vllm.log"; then
    tail -n 40 "$work/vllm.log" >&2
    exit 1
  fi
  # vLLM logs to stdout too: its result is the JSON line
  grep '^{' "$work/vllm-$workload.jsonl" | tail -n 1
done
"$bin" score "$work/model" --samples "$work/jetrl-samples.jsonl" --device "$device" | tee "$work/jetrl-score.json"
"$bin" score "$work/model" --samples "$work/vllm-samples.jsonl" --device "$device" | tee "$work/vllm-score.json"

"$py" - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
def runs(name):
    with open(f"{work}/{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.startswith('{')]
def median_rate(name):
    items = runs(name)
    return statistics.median(r for item in items for r in item["rates"]), items[-1]
def pair(workload):
    ours, ours_meta = median_rate(f"jetrl-{workload}")
    ref, ref_meta = median_rate(f"hf-{workload}")
    return ours_meta, ref_meta, {
        "jetrl_tok_per_s": round(ours, 1),
        "reference_tok_per_s": round(ref, 1),
        "ratio": round(ours / ref, 2),
    }
def with_vllm(workload, figures):
    ours, _ = median_rate(f"jetrl-{workload}")
    theirs, meta = median_rate(f"vllm-{workload}")
    return {**figures, "vllm_tok_per_s": round(theirs, 1), "jetrl_vs_vllm": round(ours / theirs, 2)}, meta
def score(name):
    with open(f"{work}/{name}-score.json") as f:
        return json.load(f)
ours, ref, grpo = pair("grpo")
_, _, fixed = pair("fixed")
grpo, vllm_meta = with_vllm("grpo", grpo)
fixed, _ = with_vllm("fixed", fixed)
line = {"bench": "rollout_engine", "device": ours["device"], "dtype": ours["dtype"], **grpo, "workload": "grpo_sampled_until_eos",
        "vllm_logprob_diff_max": round(score("vllm")["max_logprob_diff"], 6),
        "jetrl_logprob_diff_max": round(score("jetrl")["max_logprob_diff"], 6),
        "fixed_length": fixed, "batch": ours["batch"], "new_tokens": ours["new_tokens"],
        "threads": ours["threads"], "reference": f"transformers {ref['transformers']} generate (torch {ref['torch']})",
        "vllm": f"vllm {vllm_meta['vllm']} (LLM.generate from token ids, one process, {vllm_meta['device']})"}
print(json.dumps(line))
PY

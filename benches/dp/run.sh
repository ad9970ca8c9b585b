#!/usr/bin/env bash
# `just bench dp`: the trainer's ranks (c10d, Gloo on the CPU) in one run:
#   - per-step time of the same global batches with 1 and with 2 ranks (jetrl-trainer-dp: the Actor over a real
#     process group, synthetic batches of DP_GROUPS groups x 4 trajectories, tiny model, one torch thread per rank;
#     the first DP_WARMUP steps dropped, the median of the rest);
#   - the shim's all-reduce and reduce-scatter bandwidth against the same c10d calls made from Python's
#     torch.distributed (shared/torch-ext/bench/bench_collectives.py), DP_MIB MiB f32, 2 ranks, 20 calls a round,
#     the two sides alternating DP_ROUNDS times (the median of the rounds' medians of each side);
#   - optimizer state bytes per parameter per rank with 1 and 2 ranks.
# On a 2-core machine the two ranks share the cores the one rank has to itself: the step-time ratio says what the
# collectives and the split cost, not the speedup of two devices.
# Last line: {"bench":"dp","step_s_1rank":…,"step_s_2ranks":…,"allreduce_ratio":…,"reduce_scatter_ratio":…,
# "optim_bytes_per_param_1rank":…,"optim_bytes_per_param_2ranks":…}
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --quiet --bin jetrl-trainer-dp --bin bench_collectives
steps=${DP_STEPS:-8}; warmup=${DP_WARMUP:-2}; groups=${DP_GROUPS:-8}; mib=${DP_MIB:-16}; rounds=${DP_ROUNDS:-3}
py=.venv/bin/python
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
./target/debug/jetrl init-model --preset tiny --out "$work/model" >/dev/null 2>&1

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ranks() { # world out
  local port; port=$(free_port); local pids=()
  for ((r = 0; r < $1; r++)); do
    ./target/debug/jetrl-trainer-dp --rank "$r" --world "$1" --port "$port" --model "$work/model" --start 1 \
      --end "$steps" --horizon "$steps" --groups "$groups" --max-response 24 --out "$2" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
}
ranks 1 "$work/one" >&2
ranks 2 "$work/two" >&2
# Both sides under the same glibc malloc settings (the trainer's own, `keep_freed_memory_in_heap`): Gloo's
# reduce-scatter clones its input at every call, and whether that 16 MiB comes back from the heap or from a fresh
# mmap (page faults) otherwise depends on each process's allocation history, not on the collective.
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647
for ((i = 0; i < rounds; i++)); do
  ./target/debug/bench_collectives --mib "$mib" --iters 20 >>"$work/rust.jsonl"
  "$py" shared/torch-ext/bench/bench_collectives.py --mib "$mib" --iters 20 >>"$work/python.jsonl"
done
"$py" - "$work" "$warmup" <<'PY'
import json, statistics, sys
work, warmup = sys.argv[1], int(sys.argv[2])
def rank(d, r):
    return json.load(open(f"{work}/{d}/rank{r}.json"))
def step_s(d):
    return statistics.median(s["seconds"] for s in rank(d, 0)["steps"][warmup:])
def best(path, op):
    # the median over the rounds of each round's median bandwidth: this machine class is shared and noisy
    lines = [json.loads(l) for l in open(path) if l.strip()]
    return statistics.median(r["algbw_gbps"] for l in lines for r in l["results"] if r["op"] == op)
one, two = rank("one", 0), [rank("two", 0), rank("two", 1)]
line = {
    "bench": "dp",
    "device": "cpu",
    "backend": "gloo",
    "parameters": one["parameters"],
    "step_s_1rank": step_s("one"),
    "step_s_2ranks": step_s("two"),
    "allreduce_gbps": {"jetrl": best(f"{work}/rust.jsonl", "all_reduce"), "torch_distributed": best(f"{work}/python.jsonl", "all_reduce")},
    "reduce_scatter_gbps": {"jetrl": best(f"{work}/rust.jsonl", "reduce_scatter"), "torch_distributed": best(f"{work}/python.jsonl", "reduce_scatter")},
    "optim_bytes_per_param_1rank": one["optimizer_state_bytes"] / one["parameters"],
    "optim_bytes_per_param_2ranks": max(r["optimizer_state_bytes"] for r in two) / one["parameters"],
}
line["allreduce_ratio"] = line["allreduce_gbps"]["jetrl"] / line["allreduce_gbps"]["torch_distributed"]
line["reduce_scatter_ratio"] = line["reduce_scatter_gbps"]["jetrl"] / line["reduce_scatter_gbps"]["torch_distributed"]
line["step_ratio_2_vs_1"] = line["step_s_2ranks"] / line["step_s_1rank"]
print(json.dumps(line))
PY

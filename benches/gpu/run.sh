#!/usr/bin/env bash
# `just bench gpu`: the GPU figures in one run. The rollout and trainer parts are the GPU bench bundle
# (`just gpu-bundle`, benches/gpu/bundle_run.sh: built here into a scratch folder and run from another directory
# in a clean environment, exactly as a lent device runs it); this script adds the schedule part:
#   schedule  benches/async_speedup on the demo job: separate_async against sync
# On a CUDA device: the Qwen2.5-0.5B shape (random init, bf16; hidden 896, 24 layers, 14 heads, 2 kv heads,
# intermediate 4864, vocab 151936). Without one (or with JETRL_BENCH_GPU_SHAPE=tiny) the same code runs at tiny
# shapes on the CPU, and the JSON says so ("device":"cpu","shape":"tiny"); tests/tests/bench_gpu.rs runs it that
# way so it cannot rot.
# Last line: the bundle's line ({"bench":"gpu","device":…,"shape":…,"vs_graph_loop":…,"rollout":{…},
# "trainer_step":{…},…}) with "separate_vs_sync":{…} and "bundle_mb" added.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"
scripts/setup.sh transformers >&2

cuda="$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')"
if [ "${JETRL_BENCH_GPU_SHAPE:-}" = tiny ] || [ "$cuda" != 1 ]; then
  async_env=(JETRL_BENCH_STEPS=3 JETRL_BENCH_ROUNDS=1)
else
  async_env=(JETRL_BENCH_STEPS=40 JETRL_BENCH_ROUNDS=1)
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
scripts/gpu-bundle.sh "$work/bundle"
bundle_kb="$(du -sk "$work/bundle" | cut -f1)"
echo "[gpu bench] the bundle, from another directory, in a clean environment" >&2
mkdir "$work/elsewhere"
(cd "$work/elsewhere" && env -i HOME="$HOME" PATH="$root/.venv/bin:/usr/bin:/bin" \
  ${JETRL_BENCH_GPU_SHAPE:+JETRL_BENCH_GPU_SHAPE="$JETRL_BENCH_GPU_SHAPE"} bash "$work/bundle/run.sh") \
  | tee "$work/bundle.out" >&2
echo "[gpu bench] separate_async against sync on the demo job" >&2
cargo build -q --workspace --exclude jetrl-benches --bins  # the services and jetrl, not the benchmark drivers
env "${async_env[@]}" JETRL_BENCH_WORKLOAD=demo JETRL_BENCH_MODES=sync,separate_async \
  "$py" benches/async_speedup/bench.py | tee "$work/async.out" >&2

"$py" - "$work" "$bundle_kb" <<'PY'
import json, os, sys
work, bundle_kb = sys.argv[1], int(sys.argv[2])
def last(name):
    with open(os.path.join(work, name)) as f:
        return json.loads([line for line in f if line.strip()][-1])
line, schedule = last("bundle.out"), last("async.out")
line["separate_vs_sync"] = {k: schedule.get(k) for k in ("sync_s", "separate_async_s", "speedup_separate",
                                                         "final_reward_sync", "final_reward_separate", "steps")}
line["bundle_mb"] = round(bundle_kb / 1024, 1)
print(json.dumps(line))
PY

#!/usr/bin/env bash
# `just gpu-bundle [DIR]` (default target/gpu-bundle): a self-contained folder that runs the GPU bench's rollout
# and trainer parts on a machine with python3 (torch 2.11 + transformers) and no Rust toolchain: the stripped
# benchmark binaries (they find libtorch through LD_LIBRARY_PATH, which run.sh sets from python's torch) and the
# scripts. At most 32 MB. Run it as `bash DIR/run.sh` from anywhere (see benches/gpu/bundle_run.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/target/gpu-bundle}"
cd "$root"
# named targets without `-p`: one package alone resolves its dependencies' features apart from the workspace's
cargo build -q --bin jetrl-trainer-bench
cargo build -q --example rollout_engine_bench
rm -rf "$dir"
mkdir -p "$dir/bin"
objcopy --strip-all target/debug/examples/rollout_engine_bench "$dir/bin/rollout_engine_bench"
objcopy --strip-all target/debug/jetrl-trainer-bench "$dir/bin/jetrl-trainer-bench"
cp benches/gpu/bundle_run.sh "$dir/run.sh"
cp benches/gpu/summary.py "$dir/summary.py"
cp benches/rollout_engine/hf_generate.py benches/rollout_engine/bench_args.py benches/rollout_engine/graph_loop.py "$dir/"
cp benches/trainer_step/reference.py "$dir/trainer_reference.py"
chmod +x "$dir/run.sh" "$dir/bin/"*
kb="$(du -sk "$dir" | cut -f1)"
if [ "$kb" -gt $((32 * 1024)) ]; then
  echo "gpu-bundle: $dir is $((kb / 1024)) MB, over the 32 MB a device run may carry" >&2
  exit 1
fi
echo "gpu-bundle: $dir ($((kb / 1024)) MB): run it with \`bash $dir/run.sh\`" >&2

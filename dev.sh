#!/usr/bin/env bash
# The README's two commands. Each installs what is missing (idempotently), then builds and runs:
#   ./dev.sh demo    the demo training job (GRPO on a tiny model, five services, embedded NATS)
#   ./dev.sh test    the whole test suite
# Any other argument is passed to `just` (see the justfile).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# On a clone whose .venv has no libtorch yet, pip's install of torch takes minutes that leave the cores idle: cargo
# builds every crate that does not link libtorch meanwhile (LIBTORCH points nowhere, so the crates that need it
# fail at once and are built after the setup; --keep-going builds the rest). Its log is target/warm-build.log.
warm=""
if [ ! -e .venv/libtorch ] && command -v cargo >/dev/null 2>&1; then
  case "${1:-demo}" in
    test) targets=(--bins --tests --examples) ;;
    demo) targets=(--bins) ;;
    *) targets=() ;;
  esac
  if [ ${#targets[@]} -gt 0 ]; then
    mkdir -p target
    # its own process group (setsid), so that stopping it stops the compilers it started too
    CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" LIBTORCH=/nonexistent/libtorch \
      setsid cargo build --workspace "${targets[@]}" --keep-going >target/warm-build.log 2>&1 &
    warm=$!
    trap 'kill -TERM -- "-$warm" 2>/dev/null || true' EXIT
  fi
fi
# The suite's vLLM tests need vLLM in a venv of its own (.venv-vllm): installed beside the main setup, waited for
# before the tests run. Its log is target/setup-vllm.log.
vllm_setup=""
if [ "${1:-demo}" = test ]; then
  mkdir -p target
  scripts/setup-vllm.sh >target/setup-vllm.log 2>&1 &
  vllm_setup=$!
fi
case "${1:-demo}" in
  test) scripts/setup.sh transformers peft wandb mlflow-server datasets tensorboard ;;
  bench) scripts/setup.sh transformers peft ;;
  *) scripts/setup.sh ;;
esac
# Once torch is in place the real build starts at once: libtorch's own C++ (torch-sys, jetrl-torch-ext) then
# compiles beside what the early build had left, instead of after it. What the early build had finished stays.
if [ -n "$warm" ]; then
  kill -TERM -- "-$warm" 2>/dev/null || true
  wait "$warm" 2>/dev/null || true
  trap - EXIT
fi
if [ -n "$vllm_setup" ] && ! wait "$vllm_setup"; then
  cat target/setup-vllm.log >&2
  echo "dev.sh: installing vLLM (scripts/setup-vllm.sh) failed" >&2
  exit 1
fi
export PATH="$PWD/.venv/bin:$PATH"
# From a clean clone, incremental compilation only writes caches (2 GB of a 7 GB build) that nothing reads
# again. Someone editing code who wants them can run `just` directly, or set CARGO_INCREMENTAL=1.
case "${1:-demo}" in
  test|demo) export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" ;;
esac
exec just "${@:-demo}"

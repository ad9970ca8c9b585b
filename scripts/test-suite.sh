#!/usr/bin/env bash
# The whole test suite, both tiers (`just test`, `./dev.sh test`, `.ci/run`): `cargo test` with the slow tier
# included, then the golden vectors; at the end the ten slowest test binaries with their times, so the cost of
# each test binary stays visible. Arguments go to `cargo test` before `--` (e.g. `-p jetrl-trainer`).
# The full log is kept in target/test-suite.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log=target/test-suite.log
mkdir -p target
started=$(date +%s)
cargo test --workspace --no-fail-fast "$@" -- --include-ignored 2>&1 | tee "$log"
tests_rc=${PIPESTATUS[0]}
./target/debug/jetrl-golden tests/golden/algos_sample.json tests/golden/rewards_sample.json
golden_rc=$?
elapsed=$(( $(date +%s) - started ))

# `Running <source> (<binary>)` opens a binary's output; its `test result: ... finished in <s>s` closes it.
echo
echo "== slowest test binaries (of this run, $((elapsed / 60)) min $((elapsed % 60)) s in all) =="
awk '
  /^ *Running / { name = $2 }
  /^ *Doc-tests / { name = "doc-tests " $2 }
  /^test result:/ {
    for (i = 1; i <= NF; i++) if ($i == "in") { t = $(i + 1); sub(/s$/, "", t) }
    printf "%8.1f s  %s  (%s)\n", t, name, $4 " passed, " $6 " failed, " $8 " ignored"
  }
' "$log" | sort -rn | head -10
echo "passed: $(grep -o '[0-9]* passed' "$log" | awk '{s += $1} END {print s + 0}'), failed: $(grep -o '[0-9]* failed' "$log" | awk '{s += $1} END {print s + 0}')"
[ "$tests_rc" -eq 0 ] && [ "$golden_rc" -eq 0 ]

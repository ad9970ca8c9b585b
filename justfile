# Commands a person types. `./dev.sh <recipe>` installs prerequisites first; `just` works once they exist.
set shell := ["bash", "-euo", "pipefail", "-c"]
export PATH := justfile_directory() + "/.venv/bin:" + env_var("PATH")

# run the demo training job
default: demo

# build every binary (one dev profile for tests, demo and benchmarks)
build:
    cargo build --workspace --bins

# the demo: GRPO on "copy 4 digits" with a tiny model; writes runs/demo/
demo config="configs/demo.yaml" *overrides="": build
    ./target/debug/jetrl run {{config}} {{overrides}}

# the whole test suite, both tiers: the fast tier (`cargo test`: unit tests, state machines, decoders, golden
# checks, short fuzz counts) and the slow tier (`#[ignore = "slow tier: ..."]`: end to end, crash matrix, broker
# cluster, soak and bench smoke runs, full fuzz counts, the tests that need python with transformers), then the
# golden vectors; test binaries in two lanes and a third for those that wait (scripts/run-test-binaries.py);
# prints the ten slowest test binaries with wall and CPU seconds at the end (`./dev.sh test` installs
# transformers first)
test *args="":
    scripts/test-suite.sh {{args}}

# the fast tier alone (minutes): what to run after every change
test-fast *args="": build
    cargo test --workspace {{args}}

# the three-node cluster failover test alone (it is part of `test` too)
test-cluster: build
    cargo test -p jetrl-tests --test nats_cluster -- --nocapture

# deploy/docker-compose.yml on a real container engine (root, podman with runc, podman-compose): images built here
# without a registry, `up --scale rollout-worker=2`, a short job with one worker killed mid-run, the ledger and
# `jetrl status` through the read-only identity, `down` (scripts/compose-check.sh; about a minute once the images
# exist, five with them; not part of `test`)
compose-check: build
    scripts/compose-check.sh

# format and lint checks
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# golden vectors from any file in the schema of tests/golden/README.md
golden *files="tests/golden/algos_sample.json tests/golden/rewards_sample.json": build
    ./target/debug/jetrl-golden {{files}}

# the GPU bench bundle: stripped binaries and scripts (at most 32 MB) that run `bash DIR/run.sh` on a machine
# with python3 (torch 2.11 + transformers) and no Rust toolchain; prints the gpu bench's rollout and trainer line
gpu-bundle dir="target/gpu-bundle":
    scripts/gpu-bundle.sh {{dir}}

# a benchmark (benches/<name>/run.sh): dataplane, trainer_step, rollout_engine, reward, async_speedup,
# weight_sync, gpu, dp (the trainer's ranks), soak (10 minutes, stand-in rollout workers), cluster_sim (the three
# modes at 64-256 paced stand-in rollout GPUs); the last line printed is one JSON object with the figures
bench name: build
    benches/{{name}}/run.sh

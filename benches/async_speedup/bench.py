"""`just bench async_speedup`: the same job in sync, colocate_async and separate_async, side by side in one run.

Every run is `jetrl run benches/async_speedup/job.yaml` (five services as processes, an embedded nats-server,
real libtorch) with the same model (one random-init `tiny-digits` directory), the same data, the same number of
steps and the same resources: one rollout worker, one reward worker, and every process at the same intra-op
thread count (OMP_NUM_THREADS / MKL_NUM_THREADS, 1 by default). Only `trainer.mode` changes.

The workload has a long tail of response lengths: copy prompts (`copy 4821=` -> `4821`, data_source
`jetrl/copy`, scored by the built-in rule: matching positions over the longer length) whose digit strings are
2-4 long for most rows and 16-24 long for about 15% of them, so once the policy learns to stop, most answers are
short and a few run up to the length limit (25 tokens with the EOS).

Rounds alternate the order of the modes (sync, colocate, separate; then separate, colocate, sync; ...) so that
load from other processes on a shared machine falls on each mode alike; each mode's figures are medians over
the rounds. Time is the trainer's `train_wall_s` (summary.json): from the first weight publish through the
warm-up batches to the last step; the final reward is the mean `critic/score/mean` of the last 10 steps.

Knobs (environment): JETRL_BENCH_STEPS (60), JETRL_BENCH_ROUNDS (2), JETRL_BENCH_THREADS (1),
JETRL_BENCH_LONG_FRACTION (0.15), JETRL_BENCH_MODES (sync,colocate_async,separate_async),
JETRL_BENCH_WORKLOAD (longtail; `demo` runs configs/demo.yaml as it is, 4-digit copy: `benches/gpu` uses it),
JETRL_BENCH_KEEP (a directory: keep every run's metrics and logs there).
The last line printed is one JSON object.
"""
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = {
    "longtail": os.path.join(ROOT, "benches", "async_speedup", "job.yaml"),
    "demo": os.path.join(ROOT, "configs", "demo.yaml"),
}
JETRL = os.path.join(ROOT, "target", "debug", "jetrl")


def env_int(name, default):
    return int(os.environ.get(name, default))


def write_dataset(path, rows, long_fraction, seed):
    """Copy prompts with a long-tail length mix: 2-4 digits, or 16-24 with probability `long_fraction`."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for index in range(rows):
            length = rng.randint(16, 24) if rng.random() < long_fraction else rng.randint(2, 4)
            digits = "".join(rng.choice("0123456789") for _ in range(length))
            row = {
                "data_source": "jetrl/copy",
                "prompt": f"copy {digits}=",
                "reward_model": {"style": "rule", "ground_truth": digits},
                "extra_info": {"index": index, "digits": length},
            }
            f.write(json.dumps(row) + "\n")


def metrics(run_dir):
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                m = json.loads(line)
                if "critic/score/mean" in m:
                    rows.append(m)
    return rows


def mean_of(rows, key):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def run_mode(mode, round_index, work, job, model_dir, data_file, steps, threads):
    run_dir = os.path.join(work, f"{mode}-{round_index}")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [
        JETRL, "run", job,
        f"run.dir={run_dir}",
        f"run.name=bench-{mode.replace('_', '-')}-{round_index}",
        f"model.path={model_dir}",
        f"trainer.mode={mode}",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "--quiet",
    ]
    if data_file:
        cmd.insert(-1, f"data.train_files=[{data_file}]")
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"jetrl run in {mode} failed (exit {proc.returncode}); logs in {run_dir}/logs")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rows = metrics(run_dir)
    if len(rows) != steps:
        raise SystemExit(f"{mode}: {len(rows)} metrics lines for {steps} steps")
    last = rows[-10:]
    step_total = sum(r["timing_s/step"] for r in rows)
    gen_total = sum(r.get("timing_s/gen", 0.0) for r in rows)
    result = {
        "mode": mode,
        "round": round_index,
        "train_s": summary["train_wall_s"],
        "command_s": wall,
        "final_reward": statistics.fmean(r["critic/score/mean"] for r in last),
        "first_reward": statistics.fmean(r["critic/score/mean"] for r in rows[:5]),
        "staleness_mean": mean_of(rows, "training/off_policy/trajectory_staleness/mean") or 0.0,
        "trainer_idle_ratio": mean_of(rows, "perf/trainer_idle_ratio"),
        "rollout_idle_ratio": mean_of(rows, "perf/rollout_idle_ratio"),
        "response_length_mean": mean_of(rows, "response_length/mean"),
        "response_length_max": mean_of(rows, "response_length/max"),
        "step_s": mean_of(rows, "timing_s/step"),
        # the share of the trainer's step spent waiting for generation: in sync, what overlap could hide
        "gen_wait_share": gen_total / step_total if step_total > 0 else None,
        "gen_wait_s": mean_of(rows, "timing_s/gen"),
        "update_actor_s": mean_of(rows, "timing_s/update_actor"),
        "old_log_prob_s": mean_of(rows, "timing_s/old_log_prob"),
        "update_weights_s": mean_of(rows, "timing_s/update_weights"),
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}), flush=True)
    return result


def median_of(results, key):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def main():
    steps = env_int("JETRL_BENCH_STEPS", 60)
    rounds = env_int("JETRL_BENCH_ROUNDS", 2)
    threads = env_int("JETRL_BENCH_THREADS", 1)
    long_fraction = float(os.environ.get("JETRL_BENCH_LONG_FRACTION", "0.15"))
    modes = os.environ.get("JETRL_BENCH_MODES", "sync,colocate_async,separate_async").split(",")
    workload = os.environ.get("JETRL_BENCH_WORKLOAD", "longtail")
    if workload not in JOBS:
        raise SystemExit(f"JETRL_BENCH_WORKLOAD={workload}: expected one of {', '.join(JOBS)}")
    load_before = os.getloadavg()
    keep = os.environ.get("JETRL_BENCH_KEEP")  # a directory to keep the runs in (metrics, logs), for a closer look
    if keep:
        os.makedirs(keep, exist_ok=True)
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="jetrl-bench-async-")) as work:
        data_file = None
        if workload == "longtail":
            data_file = os.path.join(work, "copy_longtail.jsonl")
            write_dataset(data_file, 20000, long_fraction, seed=7)
        model_dir = os.path.join(work, "model")
        subprocess.run([JETRL, "init-model", "--preset", "tiny-digits", "--out", model_dir, "--seed", "1"],
                       check=True, stdout=subprocess.DEVNULL)
        results = {m: [] for m in modes}
        for r in range(rounds):
            order = modes if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                results[mode].append(run_mode(mode, r, work, JOBS[workload], model_dir, data_file, steps, threads))
    load_after = os.getloadavg()

    med = {m: {k: median_of(results[m], k) for k in results[m][0] if k not in ("mode", "round")} for m in modes}
    line = {"bench": "async_speedup"}
    for m in modes:
        line[f"{m}_s"] = round(med[m]["train_s"], 2)
    if "sync" in med:
        for m, short in (("separate_async", "separate"), ("colocate_async", "colocate")):
            if m in med:
                line[f"speedup_{short}"] = round(med["sync"]["train_s"] / med[m]["train_s"], 3)
    for m in modes:
        short = m.replace("_async", "")
        line[f"final_reward_{short}"] = round(med[m]["final_reward"], 3)
    for m in modes:
        short = m.replace("_async", "")
        line[f"staleness_mean_{short}"] = round(med[m]["staleness_mean"], 3)
    if "sync" in med and med["sync"]["gen_wait_share"] is not None and med["sync"]["gen_wait_share"] < 1:
        # with rollout fully hidden behind training a step costs what sync's costs minus its wait for generation
        line["overlap_bound_speedup"] = round(1 / (1 - med["sync"]["gen_wait_share"]), 3)
    line["per_mode_medians"] = {
        m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in med[m].items()} for m in modes
    }
    line.update({
        "steps": steps,
        "rounds": rounds,
        "threads_per_process": threads,
        "workload": f"copy, digits 2-4 (p={1 - long_fraction:.2f}) or 16-24 (p={long_fraction:.2f}), "
                    "max_response_length 25, 32 prompts x 8 samples" if workload == "longtail"
                    else "the demo job (configs/demo.yaml: copy 4 digits, 32 prompts x 8 samples)",
        "machine": f"{os.cpu_count()} cores shared with other processes; load average "
                   f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; figures are medians over rounds",
    })
    print(json.dumps(line))


if __name__ == "__main__":
    main()

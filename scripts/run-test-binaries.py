#!/usr/bin/env python3
"""Runs the test binaries `cargo build --tests --message-format=json` built, in two lanes (and a third for those
that mostly wait), each as `cargo test` would (working directory = its package's root, the arguments after `--`
passed on), and prints each binary's whole output when it ends, headed by cargo's own `Running <source> (<binary>)`
line. Exits 1 if any binary failed.

Why two lanes: most of the slow binaries wait rather than compute (a nats-server restart, an ack deadline, a
service's restart delay: replay_buffer spends 2 CPU-seconds in 60 s, crash_matrix 92 in 168), so the suite's wall
time was twice its CPU time on two cores. Binaries that train the demo for hundreds of steps keep both cores busy;
at most one of those ([`CPU_BOUND`]) runs at a time, beside one that waits. Longest first, from [`EXPECTED_S`].
A third lane runs only the binaries that hardly use the CPU at all ([`IDLE`]: under 15% of one core), so their
minutes of waiting overlap the other two lanes instead of taking turns with them; the two main lanes take an IDLE
binary only while the third lane is busy.

Usage: run-test-binaries.py ARTIFACTS.jsonl TIMES.tsv [-- ARGS...]
TIMES.tsv gets one line per binary: wall seconds, CPU seconds (user + system, children included), exit status, name.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

WORKERS = 2

# Wall seconds of a binary alone on the 2-core machine (measured 2026-12-05, both tiers): the longest start first.
# A binary not listed counts as short and waiting.
EXPECTED_S = {
    "modes": 240, "crash_matrix": 165, "trainer_ranks": 90, "algorithms": 100, "replay_buffer": 60,
    "supervisor": 55, "nats_cluster": 44, "trackers": 37, "bench_gpu": 45, "service": 27, "bench_soak": 22,
    "peft": 18, "faults": 12, "resume_service": 11, "scoring": 20, "c10d": 8, "cluster_sim": 8, "fuzz": 7,
    "jetrl_bus": 16,
}

# Binaries whose CPU time is about their wall time on both cores (they train the demo, or a model for many steps):
# never two of them at once.
CPU_BOUND = {"modes", "trainer_ranks", "algorithms", "bench_gpu", "bench_soak", "peft"}

# Binaries that wait on a broker, a deadline or a restart nearly all the time (CPU seconds per wall second in the
# suite of 2026-12-07: replay_buffer 3.5/62, the rollout worker's service 2.7/28, jetrl-bus's unit tests 2.0/16,
# the reward service's scoring 1.6/10, resume_service 3.1/12): they also run in the third lane.
IDLE = {"replay_buffer", "service", "jetrl_bus", "scoring", "resume_service"}


def artifacts(path):
    """(name, source, executable, package root) of each test binary, in cargo's build order."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("reason") != "compiler-artifact" or not msg.get("profile", {}).get("test"):
                continue
            exe = msg.get("executable")
            if not exe:
                continue
            root = os.path.dirname(msg["manifest_path"])
            src = os.path.relpath(msg["target"]["src_path"], root)
            kind = msg["target"]["kind"][0]
            # cargo's own header: `unittests src/lib.rs` for a crate's unit tests, the file for the others
            shown = src if kind == "test" else f"unittests {src}"
            out.append((msg["target"]["name"], shown, exe, root))
    return out


def label(item):
    """How the times table names a binary: its package's folder and its source (several packages have a fuzz.rs)."""
    name, shown, _, root = item
    return f"{os.path.relpath(root)}: {shown}"


def main():
    argv = sys.argv[1:]
    test_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, test_args = argv[:at], argv[at + 1:]
    artifacts_path, times_path = argv
    queue = artifacts(artifacts_path)
    queue.sort(key=lambda a: -EXPECTED_S.get(a[0], 0))
    lock = threading.Condition()
    running = []
    results = []
    print_lock = threading.Lock()

    idle_busy = [False]  # the idle lane runs a binary

    def take(idle_lane):
        """The next binary this worker may start, or None when there is none left for its lane. The idle lane
        takes only [`IDLE`] binaries; the other two leave those to it while it is free."""
        with lock:
            while queue:
                cpu_running = any(name in CPU_BOUND for name in running)
                idle_lane_free = not idle_busy[0]
                for i, item in enumerate(queue):
                    if idle_lane and item[0] not in IDLE:
                        continue
                    if not idle_lane and item[0] in IDLE and idle_lane_free:
                        continue
                    if not (item[0] in CPU_BOUND and cpu_running):
                        running.append(item[0])
                        if idle_lane:
                            idle_busy[0] = True
                            # a main lane that left the IDLE binaries to a free third lane may take them now
                            lock.notify_all()
                        return queue.pop(i)
                if idle_lane and not any(item[0] in IDLE for item in queue):
                    return None
                lock.wait()
            return None

    def run(item):
        name, shown, exe, root = item
        with tempfile.TemporaryFile() as out:
            started = time.monotonic()
            child = subprocess.Popen([exe, *test_args], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            wall = time.monotonic() - started
            cpu = usage.ru_utime + usage.ru_stime
            out.seek(0)
            text = out.read().decode(errors="replace")
        with print_lock:
            sys.stdout.write(f"     Running {shown} ({os.path.relpath(exe)})\n{text}")
            sys.stdout.flush()
        return wall, cpu, child.returncode

    def worker(idle_lane=False):
        while True:
            item = take(idle_lane)
            if item is None:
                return
            try:
                wall, cpu, code = run(item)
            except OSError as err:
                with print_lock:
                    print(f"error: could not run {item[2]}: {err}", flush=True)
                wall, cpu, code = 0.0, 0.0, 127
            with lock:
                running.remove(item[0])
                if idle_lane:
                    idle_busy[0] = False
                results.append((wall, cpu, code, label(item)))
                lock.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    threads.append(threading.Thread(target=worker, kwargs={"idle_lane": True}))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(times_path, "w") as f:
        for wall, cpu, code, name in sorted(results, reverse=True):
            f.write(f"{wall:.1f}\t{cpu:.1f}\t{code}\t{name}\n")
    failed = [name for _, _, code, name in results if code != 0]
    if failed:
        print(f"\nfailed test binaries: {' '.join(sorted(failed))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

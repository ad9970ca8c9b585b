"""The Python twin of src/bin/bench_collectives.rs: the same collectives through torch.distributed (Gloo, CPU),
timed the same way and printed as the same JSON line, for a like-for-like comparison.

    python bench_collectives.py [--mib 64] [--world 2] [--iters 10] [--warmup 2] [--dtype f32|bf16]
"""

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(iters, warmup, op):
    for _ in range(warmup):
        op()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return sorted(times)


def report(name, nbytes, times, bus_factor):
    median = times[len(times) // 2]
    algbw = nbytes / median / 1e9
    return {
        "op": name,
        "median_ms": median * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
        "min_ms": times[0] * 1e3,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor,
    }


def rank_main(rank, args, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    elem = 2 if args.dtype == "bf16" else 4
    world = args.world
    numel = max(int(args.mib * 1024 * 1024 / elem) // world, 1) * world
    nbytes = numel * elem
    n = float(world)

    buf = torch.ones(numel, dtype=dtype)
    dist.barrier()
    all_reduce = timed(args.iters, args.warmup, lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))

    inp = torch.ones(numel, dtype=dtype)
    out = torch.zeros(numel // world, dtype=dtype)
    dist.barrier()
    reduce_scatter = timed(
        args.iters, args.warmup, lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
    )
    dist.barrier()
    if rank == 0:
        print(json.dumps({
            "bench": "collectives",
            "impl": "python-torch.distributed",
            "backend": "gloo",
            "device": "cpu",
            "world_size": world,
            "dtype": args.dtype,
            "numel": numel,
            "bytes": nbytes,
            "iters": args.iters,
            "warmup": args.warmup,
            "threads": torch.get_num_threads(),
            "results": [
                report("all_reduce", nbytes, all_reduce, 2 * (n - 1) / n),
                report("reduce_scatter", nbytes, reduce_scatter, (n - 1) / n),
            ],
        }), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()

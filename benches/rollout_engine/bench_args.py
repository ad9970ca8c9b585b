"""The arguments both reference sides of `just bench rollout_engine` take (`hf_generate.py`, `vllm_generate.py`):
the same model directory, workload, batch, lengths, threads, seed, device and dtype as jetrl's side."""
import argparse


def workload_parser(default_threads: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--workload", choices=["grpo", "fixed"], default="grpo")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    return parser

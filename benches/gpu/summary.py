"""The GPU bench bundle's summary: reads what DIR/run.sh wrote into its work folder and prints the one JSON line.

Each side's figure is the median over the rounds of each run's steady-state median (warm-up runs are dropped by
every program). Top-level keys: vs_graph_loop (jetrl / the CUDA-graph PyTorch loop, fixed length, batch 256),
ms_per_step_b32 and ms_per_step_b256 (jetrl's decode step, fixed length), grpo_vs_fixed (jetrl's GRPO rollout /
its fixed-length rollout, tokens per second), graph_matches_eager (the check before timing), and the rollout and
trainer_step objects.
"""
import json
import os
import statistics
import sys


def lines(work, name):
    with open(os.path.join(work, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def median(work, name, key):
    return statistics.median(item[key] for item in lines(work, name))


def main():
    work, device, shape, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fixed = median(work, "jetrl-fixed.jsonl", "tok_per_s")
    grpo = median(work, "jetrl-grpo.jsonl", "tok_per_s")
    hf = median(work, "hf-grpo.jsonl", "tok_per_s")
    loop = median(work, "loop.jsonl", "tok_per_s")
    loop_small = median(work, "loop-small.jsonl", "tok_per_s")
    small = median(work, "jetrl-fixed-small.jsonl", "tok_per_s")
    check = lines(work, "check.jsonl")[-1]
    trainer = lines(work, "trainer.jsonl")[-1]
    jetrl_run = lines(work, "jetrl-fixed.jsonl")[-1]
    r = lambda x, d=3: round(x, d)
    line = {
        "bench": "gpu",
        "device": device,
        "shape": shape,
        "vs_graph_loop": r(fixed / loop),
        "ms_per_step_b32": r(median(work, "jetrl-fixed-small.jsonl", "ms_per_step")),
        "ms_per_step_b256": r(median(work, "jetrl-fixed.jsonl", "ms_per_step")),
        "grpo_vs_fixed": r(grpo / fixed),
        "graph_matches_eager": check["graph_matches_eager"],
        "rollout": {
            "jetrl_tok_per_s": r(grpo, 1),
            "reference_tok_per_s": r(hf, 1),
            "ratio": r(grpo / hf),
            "workload": "grpo_sampled_until_eos",
            "batch": jetrl_run["batch"],
            "new_tokens": jetrl_run["new_tokens"],
            "dtype": jetrl_run["dtype"],
            "cuda_graphs": jetrl_run["cuda_graphs"],
            "fixed_length": {
                "jetrl_tok_per_s": r(fixed, 1),
                "graph_loop_tok_per_s": r(loop, 1),
                "graph_loop_cuda_graph": lines(work, "loop.jsonl")[-1]["cuda_graph"],
                "graph_loop_ms_per_step": r(median(work, "loop.jsonl", "ms_per_step")),
                "padded_slot_share": r(jetrl_run["padded_slot_share"]),
            },
            "batch_small": {
                "batch": lines(work, "jetrl-fixed-small.jsonl")[-1]["batch"],
                "jetrl_tok_per_s": r(small, 1),
                "graph_loop_tok_per_s": r(loop_small, 1),
                "graph_loop_ms_per_step": r(median(work, "loop-small.jsonl", "ms_per_step")),
            },
            "graph_check": {k: check[k] for k in ("sequences", "same_tokens", "cuda_graphs",
                                                  "max_logprob_diff_graph_vs_eager",
                                                  "max_logprob_diff_rollout_vs_trainer")},
        },
        "trainer_step": {k: trainer[k] for k in ("jetrl_tok_per_s", "reference_tok_per_s", "ratio",
                                                 "ratio_same_precision", "jetrl_update_s",
                                                 "reference_same_precision_s", "tokens_per_update", "dtype",
                                                 "packed_vs_padded", "peak_mb_plain", "peak_mb_checkpointed",
                                                 "peak_mb_kind", "lora_vs_full", "optim_bytes_full",
                                                 "optim_bytes_lora")},
        "seconds": seconds,
    }
    if device == "cuda":
        line["targets"] = {
            "vs_graph_loop": 1.0, "vs_graph_loop_met": line["vs_graph_loop"] >= 1.0,
            "grpo_vs_fixed": 0.9, "grpo_vs_fixed_met": line["grpo_vs_fixed"] >= 0.9,
            "ms_per_step_b32": 3.0, "ms_per_step_b32_met": line["ms_per_step_b32"] <= 3.0,
            "ratio_same_precision": 1.0,
            "ratio_same_precision_met": trainer["ratio_same_precision"] >= 1.0,
            "under_6_min": seconds < 360,
        }
    print(json.dumps(line))


if __name__ == "__main__":
    main()

"""The vLLM side of `just bench rollout_engine`: vLLM's engine (`vllm.LLM`, in the venv `scripts/setup-vllm.sh`
makes) on the same model, prompt ids, batch and lengths as jetrl's engine, sampled decoding (temperature 1, top-k
and top-p off), prompts given as token ids (as the rollout worker sends them).

Workloads (batch = G prompts x N samples, `n` = N):
- grpo:  sequences end at EOS or at T new tokens; tokens counted through the EOS.
- fixed: every sequence runs exactly T tokens (`ignore_eos`).

Prints one JSON line with the median tokens/s over the repetitions; `--dump FILE` writes the last repetition's
samples (prompt, tokens, per-token log-probs) for `rollout_engine_bench score`.
"""
import json
import os
import statistics
import time

from bench_args import workload_parser


def main() -> None:
    parser = workload_parser(default_threads=1)
    parser.add_argument("--dump", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        # threads unbound (the machine is shared), the KV cache in GiB
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(args.threads, 1)))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(args.dir, "prompts.json")) as f:
        prompts = json.load(f)
    with open(os.path.join(args.dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    llm = LLM(
        model=args.dir,
        dtype="float32" if args.dtype == "f32" else "bfloat16",
        enforce_eager=args.device == "cpu",
        gpu_memory_utilization=0.2 if args.device == "cpu" else 0.8,
        max_model_len=max(len(p) for p in prompts) + args.new_tokens + 8,
        max_num_seqs=len(prompts) * args.n,
        seed=args.seed,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        skip_tokenizer_init=not os.path.exists(os.path.join(args.dir, "tokenizer.json")),
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(new_tokens: int):
        params = SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=new_tokens,
            ignore_eos=args.workload == "fixed",
            stop_token_ids=list(eos) if args.workload == "grpo" else None,
            logprobs=0,
            detokenize=False,
            seed=args.seed,
        )
        started = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        samples = [
            (list(out.prompt_token_ids), list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for out in outputs
            for c in out.outputs
        ]
        return sum(len(s[1]) for s in samples), seconds, samples

    run(8)  # warm-up
    rates, tokens, samples = [], [], []
    for _ in range(args.reps):
        count, seconds, samples = run(args.new_tokens)
        tokens.append(count)
        rates.append(count / seconds)
    if args.dump:
        with open(args.dump, "w") as f:
            for prompt, ids, logprobs in samples:
                f.write(json.dumps({"prompt": prompt, "tokens": ids, "logprobs": logprobs}) + "\n")
    print(
        json.dumps(
            {
                "impl": "vllm",
                "workload": args.workload,
                "tok_per_s": statistics.median(rates),
                "rates": rates,
                "tokens_per_rep": tokens,
                "batch": len(prompts) * args.n,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
                "device": args.device,
                "dtype": args.dtype,
                "vllm": vllm.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()

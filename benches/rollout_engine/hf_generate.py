"""The reference side of `just bench rollout_engine`: HF transformers `generate` on the same tiny model, prompts,
batch and lengths as jetrl's engine (`rollout_engine_bench`), sampled decoding (temperature 1, top-k and top-p
off), on the CPU by default (`--device cuda`, `--dtype bf16` for a GPU).

Workloads (batch = G prompts x N samples via `num_return_sequences`):
- grpo:  a GRPO rollout: rows end at EOS or at T new tokens; tokens are counted through each row's first EOS
         (the padding `generate` writes after it is not counted).
- fixed: every row runs exactly T tokens (`min_new_tokens` = T): decode speed alone.

Prints one JSON line with the median tokens/s over the repetitions.
"""
import json
import os
import statistics
import time

import torch
import transformers

from bench_args import workload_parser


def main() -> None:
    parser = workload_parser(default_threads=0)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.dir, "prompts.json")) as f:
        prompts = json.load(f)
    # every prompt has the same length: no padding
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    attention_mask = torch.ones_like(input_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    prompt_len = input_ids.shape[1]

    def run(new_tokens: int) -> tuple[int, float]:
        kwargs = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=args.n,
            max_new_tokens=new_tokens,
            pad_token_id=0,
        )
        if args.workload == "fixed":
            kwargs["min_new_tokens"] = new_tokens
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        tokens = 0
        for row in out[:, prompt_len:].tolist():
            if args.workload == "fixed":
                tokens += len(row)
                continue
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens += end
        return tokens, seconds

    run(8)  # warm-up
    rates, tokens = [], []
    for _ in range(args.reps):
        n, seconds = run(args.new_tokens)
        tokens.append(n)
        rates.append(n / seconds)
    print(
        json.dumps(
            {
                "impl": "hf_generate",
                "workload": args.workload,
                "tok_per_s": statistics.median(rates),
                "rates": rates,
                "tokens_per_rep": tokens,
                "batch": input_ids.shape[0] * args.n,
                "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads(),
                "device": args.device,
                "dtype": args.dtype,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()

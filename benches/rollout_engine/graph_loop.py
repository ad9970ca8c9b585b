"""The third side of the rollout bench: a plain PyTorch decode loop, what a hand-written vLLM-style decoder does
without any engine around it. The model prepared by `rollout_engine_bench prepare` (its config.json: a Qwen2
shape; the weights are random, as the bench's are, so they are drawn here rather than loaded), a static KV cache
of batch x (prompt + new tokens) positions, the batch prefilled at once, then one token per step for every row
(fixed length: EOS ignored), sampled on the device (Gumbel-max). On CUDA each decode step is one CUDA graph
captured once and replayed (the loop writes the step's token and position into the graph's input tensors); on
the CPU, or with --eager, the same step runs eagerly.

Prints one JSON line: {"impl": "graph_loop", "tok_per_s": median, "ms_per_step": ..., "rates": [...], ...}; the
first repetition is a warm-up and is not counted.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with open(os.path.join(args.dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(args.dir, "prompts.json")) as f:
        prompts = json.load(f)
    hidden, layers_n = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    d = hidden // heads
    eps, theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 1e6)
    prompt = torch.tensor(prompts, dtype=torch.long, device=dev).repeat_interleave(args.n, 0)
    b, p = prompt.shape
    t_max = p + args.new_tokens
    torch.manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    emb = w(vocab, hidden)
    layers = [
        dict(qkv=w(hidden + 2 * kv_heads * d, hidden), qkvb=w(hidden + 2 * kv_heads * d), o=w(hidden, hidden),
             gu=w(2 * inter, hidden), down=w(hidden, inter), n1=torch.ones(hidden, device=dev, dtype=dt),
             n2=torch.ones(hidden, device=dev, dtype=dt))
        for _ in range(layers_n)
    ]
    final_norm = torch.ones(hidden, device=dev, dtype=dt)
    k_cache = torch.zeros(layers_n, b, kv_heads, t_max, d, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=dev).float() / d))
    angles = torch.arange(t_max, device=dev).float()[:, None] * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dt)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dt)
    positions_all = torch.arange(t_max, device=dev)

    def rms(x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt) * weight

    def rotate(x):
        a, c = x.chunk(2, -1)
        return torch.cat([-c, a], -1)

    def forward(ids, pos):  # ids [B, S], pos [S] -> the next token of every row [B]
        s = ids.shape[1]
        x = emb[ids]
        c, sn = cos[pos][None, None], sin[pos][None, None]
        mask = (positions_all[None, :] <= pos[:, None])[None, None]
        for i, layer in enumerate(layers):
            h = rms(x, layer["n1"])
            q, k, v = F.linear(h, layer["qkv"], layer["qkvb"]).split([hidden, kv_heads * d, kv_heads * d], -1)
            q = q.view(b, s, heads, d).transpose(1, 2)
            k = k.view(b, s, kv_heads, d).transpose(1, 2)
            v = v.view(b, s, kv_heads, d).transpose(1, 2)
            q = q * c + rotate(q) * sn
            k = k * c + rotate(k) * sn
            k_cache[i].index_copy_(2, pos, k)
            v_cache[i].index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, s, hidden), layer["o"])
            gate, up = F.linear(rms(x, layer["n2"]), layer["gu"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        logits = F.linear(rms(x[:, -1], final_norm), emb).float()
        u = torch.rand_like(logits).clamp_(1e-10, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    cuda = dev.type == "cuda"
    token = torch.zeros(b, 1, dtype=torch.long, device=dev)
    position = torch.zeros(1, dtype=torch.long, device=dev)
    graph, graph_out = None, None
    if cuda and not args.eager:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):
                forward(token, position)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            graph_out = forward(token, position)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def generate():
        with torch.inference_mode():
            nxt = forward(prompt, torch.arange(p, device=dev))
            for step in range(args.new_tokens - 1):
                token.copy_(nxt[:, None])
                position.fill_(p + step)
                if graph is not None:
                    graph.replay()
                    nxt = graph_out
                else:
                    nxt = forward(token, position)
            return nxt

    rates = []
    for rep in range(args.reps + 1):
        sync()
        started = time.perf_counter()
        generate()
        sync()
        if rep > 0:
            rates.append(b * args.new_tokens / (time.perf_counter() - started))
    rate = statistics.median(rates)
    print(json.dumps({
        "impl": "graph_loop", "cuda_graph": graph is not None, "tok_per_s": round(rate, 1),
        "ms_per_step": round(1000 * b / rate, 3), "rates": rates, "batch": b, "new_tokens": args.new_tokens,
        "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()

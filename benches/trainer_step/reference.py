"""PyTorch reference of one PPO update for `just bench trainer_step`.

The same update jetrl's trainer makes, written the way a PyTorch trainer (verl's dp_actor) makes it:
transformers' Qwen2ForCausalLM (sdpa attention), prompts left-padded and responses right-padded into one
batch, log-probs of the response positions at temperature 1, verl's vanilla PPO loss (dual clip, token-mean),
backward, `clip_grad_norm_(1.0)`, torch.optim.AdamW with matrices decayed and 1-D parameters not.
`--device cuda --dtype bf16`: the model in bf16 on the GPU, AdamW stepping the bf16 parameters (no fp32 master
copies: less work than jetrl's trainer does). With `--precision master` instead: fp32 parameters, the forward
under bf16 autocast, fused AdamW on the fp32 parameters: jetrl's own precision, the second reference side.

Driven step by step over stdin/stdout so the two sides alternate update by update (a shared, noisy CPU then
slows both alike): it prints `{"ready": true, "tokens", "threads"}`, then for every `step` line it reads, one
update and `{"s", "pg_loss", "grad_norm"}`; `quit` ends it.
"""
import sys
import argparse
import json
import time

import torch
from transformers import Qwen2ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--precision", choices=["params", "master"], default="params")
    args = ap.parse_args()
    device = torch.device(args.device)
    bf16 = args.dtype == "bf16"
    master = args.precision == "master" and bf16
    dtype = torch.bfloat16 if bf16 and not master else torch.float32
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    model = Qwen2ForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device)
    model.train()
    rows = json.load(open(args.batch))
    n = len(rows)
    P = max(len(r["prompt"]) for r in rows)
    R = max(len(r["response"]) for r in rows)
    ids = torch.zeros(n, P + R, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    resp = torch.zeros(n, R, dtype=torch.long)
    mask = torch.zeros(n, R)
    old = torch.zeros(n, R)
    adv = torch.zeros(n, R)
    for i, r in enumerate(rows):
        p, q = len(r["prompt"]), len(r["response"])
        ids[i, P - p:P] = torch.tensor(r["prompt"])
        ids[i, P:P + q] = torch.tensor(r["response"])
        attn[i, P - p:P + q] = 1
        resp[i, :q] = torch.tensor(r["response"])
        mask[i, :q] = 1
        old[i, :q] = torch.tensor(r["old_log_probs"])
        adv[i, :q] = torch.tensor(r["advantages"])
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    tokens = int(attn.sum())
    ids, attn, resp, mask, old, adv, position_ids = (
        t.to(device) for t in (ids, attn, resp, mask, old, adv, position_ids)
    )

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-5, betas=(0.9, 0.999), eps=1e-8, fused=True if master and device.type == "cuda" else None,
    )
    clip_low, clip_high, clip_c = 0.2, 0.2, 3.0

    def update():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=master):
            hidden = model.model(input_ids=ids, attention_mask=attn, position_ids=position_ids).last_hidden_state
            logits = model.lm_head(hidden[:, P - 1:P - 1 + R]).float()
        log_prob = logits.gather(-1, resp.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        # verl compute_policy_loss_vanilla
        neg_kl = torch.clamp(log_prob - old, min=-20.0, max=20.0)
        ratio = torch.exp(neg_kl)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        clipped = torch.maximum(l1, l2)
        l3 = -adv * clip_c
        pg = torch.where(adv < 0, torch.minimum(l3, clipped), clipped)
        loss = (pg * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=False)
        return loss.item(), grad_norm.item()

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "tokens": tokens, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t = time.perf_counter()
        loss, grad_norm = update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        reply({"s": time.perf_counter() - t, "pg_loss": loss, "grad_norm": grad_norm})


if __name__ == "__main__":
    main()

# A plain PyTorch GRPO loop on a jetrl model directory, for comparing learning curves on the built-in digit
# tasks (not part of jetrl). Usage: .venv/bin/python scripts/grpo_reference.py --task reverse --len 4 --ent 0.1
import json, random, sys, torch, time, argparse
p = argparse.ArgumentParser()
p.add_argument("--task", default="reverse"); p.add_argument("--len", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-3); p.add_argument("--steps", type=int, default=300)
p.add_argument("--B", type=int, default=32); p.add_argument("--N", type=int, default=8)
p.add_argument("--mini", type=int, default=1); p.add_argument("--temp", type=float, default=1.0)
p.add_argument("--ent", type=float, default=0.0); p.add_argument("--model", default="runs/models/tiny-digits")
p.add_argument("--eos", type=int, default=0); p.add_argument("--nostd", type=int, default=0)
a = p.parse_args()
from transformers import AutoModelForCausalLM
torch.set_num_threads(1); torch.manual_seed(0); random.seed(0)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
tok = json.load(open(a.model + "/tokenizer.json"))["model"]["vocab"]
inv = {v: k for k, v in tok.items()}
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
B, N, L, P = a.B, a.N, a.len + a.eos, a.len + 1
def target(d):
    return {"reverse": d[::-1], "copy": d, "sort": "".join(sorted(d))}[a.task]
def score(resp, t):
    r = resp.strip(); longer = max(len(r), len(t))
    return 0.0 if not r else sum(x == y for x, y in zip(r, t)) / longer
t0 = time.time(); hist = []
for step in range(a.steps):
    digits = ["".join(random.choice("0123456789") for _ in range(a.len)) for _ in range(B)]
    prompts = torch.tensor([[tok[c] for c in d + "="] for d in digits]).repeat_interleave(N, 0)
    with torch.no_grad():
        seq = prompts
        for _ in range(L):
            logits = model(seq).logits[:, -1, :] / a.temp
            seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
    resp = seq[:, P:]
    mask = torch.ones_like(resp, dtype=torch.float32); texts = []
    for i, row in enumerate(resp.tolist()):
        s = ""
        for j, t in enumerate(row):
            if t in (0, 2):
                mask[i, j + 1:] = 0; break
            s += inv.get(t, "")
        texts.append(s)
    rewards = torch.tensor([score(texts[i], target(digits[i // N])) for i in range(B * N)])
    g = rewards.view(B, N)
    adv = ((g - g.mean(1, keepdim=True)) / (1.0 if a.nostd else (g.std(1, keepdim=True) + 1e-6))).view(-1)
    with torch.no_grad():
        old = torch.log_softmax(model(seq).logits[:, P - 1:-1, :] / a.temp, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    perm = torch.randperm(B)
    for m in range(a.mini):
        groups = perm[m * B // a.mini:(m + 1) * B // a.mini]
        idx = (groups.unsqueeze(1) * N + torch.arange(N)).view(-1)
        lp_all = torch.log_softmax(model(seq[idx]).logits[:, P - 1:-1, :] / a.temp, -1)
        lp = lp_all.gather(-1, resp[idx].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(lp - old[idx]); ad = adv[idx].unsqueeze(1); mk = mask[idx]
        pg = torch.max(-ad * ratio, -ad * ratio.clamp(0.8, 1.2))
        ent = -(lp_all.exp() * lp_all).sum(-1)
        loss = ((pg - a.ent * ent) * mk).sum() / mk.sum()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    hist.append(rewards.mean().item())
    if step % 25 == 24:
        print(f"step {step+1} reward(last5) {sum(hist[-5:])/5:.3f} ent {(ent*mk).sum()/mk.sum():.3f} {time.time()-t0:.0f}s", flush=True)
print("first5", sum(hist[:5])/5, "last5", sum(hist[-5:])/5)

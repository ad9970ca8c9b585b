"""The PEFT side of tests/peft.rs: real transformers and peft on the CPU, f32.

  peft_reference.py score BASE ADAPTER IDS_JSON    log-probs of each id sequence under PeftModel(BASE, ADAPTER)
  peft_reference.py score-plain MODEL IDS_JSON     the same under a plain transformers model (a merged export)
  peft_reference.py make BASE OUT                  a random-init adapter (B non-zero) saved by PEFT into OUT

Prints one JSON list of lists: logprobs[t] = log p(ids[t+1] | ids[..=t]), as `jetrl logprobs` writes them.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def logprobs(model, sequences):
    out = []
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def base(path):
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def main():
    cmd = sys.argv[1]
    if cmd == "score":
        from peft import PeftModel

        model = PeftModel.from_pretrained(base(sys.argv[2]), sys.argv[3]).eval()
        print(json.dumps(logprobs(model, json.loads(sys.argv[4]))))
    elif cmd == "score-plain":
        print(json.dumps(logprobs(base(sys.argv[2]), json.loads(sys.argv[3]))))
    elif cmd == "make":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            lora_dropout=0.0,
            init_lora_weights=False,  # B random too, so the adapter changes the model
        )
        model = get_peft_model(base(sys.argv[2]), config)
        model.save_pretrained(sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()

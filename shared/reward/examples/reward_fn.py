#!/usr/bin/env python3
"""An example jetrl reward function speaking the JSON-lines protocol directly (shared/reward/PROTOCOL.md).

Configure it with

    reward:
      custom_reward_function:
        command: ["python3", "shared/reward/examples/reward_fn.py"]

Each request line is {"protocol": 1, "id": N, "items": [{"key", "data_source", "solution_str", "ground_truth",
"extra_info", "prompt_str"}, ...]}; the answer line is {"id": N, "results": [...]} with one result per item, in
order: a number, or {"score": number, ...extra values}, or {"error": "why"} for an item that cannot be scored.

This one rewards the last number in the response: 1.0 when it equals the ground truth as a number, 0.1 when
the response contains a number at all (a format reward), 0.0 otherwise. Standard library only.
"""

import json
import re
import sys

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info):
    numbers = NUMBER.findall(solution_str.replace(",", ""))
    if not numbers:
        return {"score": 0.0, "acc": False, "pred": ""}
    prediction = numbers[-1]
    correct = float(prediction) == float(ground_truth)  # a non-numeric ground truth raises: an item error
    return {"score": 1.0 if correct else 0.1, "acc": correct, "pred": prediction}


def main():
    protocol_out = sys.stdout
    # Anything printed while scoring goes to stderr, which jetrl logs; stdout carries protocol lines only.
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        results = []
        for item in request["items"]:
            try:
                results.append(
                    compute_score(item["data_source"], item["solution_str"], item["ground_truth"], item["extra_info"])
                )
            except Exception as error:
                results.append({"error": f"{type(error).__name__}: {error}"})
        protocol_out.write(json.dumps({"id": request["id"], "results": results}) + "\n")
        protocol_out.flush()


if __name__ == "__main__":
    main()

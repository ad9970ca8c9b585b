"""jetrl's bridge to Weights & Biases (`trainer.logger` `wandb`).

The trainer starts this script with its Python (`JETRL_PYTHON`, else `python3`) and writes JSON lines to its
stdin:

    {"init": {"project": ..., "name": ..., "id": ..., "resume": "allow" | null, "config": {...}}}
    {"step": 3, "metrics": {"critic/score/mean": 0.5, ...}}        (one per step)
    {"step": 5, "metrics": {...}, "generations": [[input, output, score], ...]}   (a step that validated)
    {"finish": {"exit_code": 0, "files": ["/run/dir/reward_curve.svg", ...]}}

A step's generations are logged as verl's ValidationGenerationsLogger logs them: a wandb.Table under
`val/generations` with one row per validation (step, then input_i, output_i, score_i of each generation), the
rows of earlier validations kept.

It answers the init line with one JSON line on stdout: {"ready": true, "id": ..., "url": ...} or
{"error": "..."} (then exits). Everything else it (and wandb) prints goes to stderr, into the trainer's log.
wandb reads its own environment (WANDB_MODE, WANDB_DIR, WANDB_API_KEY, WANDB_ENTITY, ...). stdin closed
without a finish line (the trainer died) ends the run with exit code 1.
"""

import json
import os
import shutil
import sys


def main():
    # The protocol keeps the real stdout; anything printed to stdout from here on goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    first = sys.stdin.readline()
    if not first:
        return 0
    init = json.loads(first)["init"]
    try:
        import wandb
    except Exception as err:  # ImportError, or an install that fails to import
        reply({"error": f"the wandb Python package is not importable by {sys.executable} ({err!r}): "
                        f"pip install wandb into it, or point JETRL_PYTHON at a Python that has it"})
        return 3
    try:
        run = wandb.init(
            project=init["project"],
            name=init["name"],
            id=init.get("id"),
            resume=init.get("resume"),
            config=init.get("config"),
            entity=os.environ.get("WANDB_ENTITY"),
            settings=wandb.Settings(console="off"),
        )
    except Exception as err:
        reply({"error": f"wandb.init failed: {err!r}"})
        return 4
    url = None if getattr(run, "offline", False) else getattr(run, "url", None)
    reply({"ready": True, "id": run.id, "url": url})

    exit_code = 1
    table_rows, table_columns = [], None
    for line in sys.stdin:
        message = json.loads(line)
        if "step" in message:
            data = dict(message["metrics"])
            generations = message.get("generations")
            if generations:
                columns = ["step"] + [f"{name}_{i + 1}" for i in range(len(generations))
                                      for name in ("input", "output", "score")]
                if columns != table_columns:
                    # another number of generations than before: verl's table would refuse the row; start anew
                    table_rows, table_columns = [], columns
                table_rows.append([message["step"]] + [value for sample in generations for value in sample])
                data["val/generations"] = wandb.Table(columns=columns, data=table_rows)
            run.log(data, step=message["step"])
        elif "finish" in message:
            finish = message["finish"]
            # a file in the run's directory is kept (and uploaded) with the run
            for path in finish.get("files", []):
                try:
                    shutil.copy(path, run.dir)
                except Exception as err:
                    print(f"wandb bridge: {path} not saved with the run: {err!r}", file=sys.stderr)
            exit_code = int(finish.get("exit_code", 0))
            break
    run.finish(exit_code=exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())

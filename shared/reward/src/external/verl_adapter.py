"""jetrl reward protocol adapter for a verl-style reward function.

Runs `compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)` from a user's Python
file behind jetrl's JSON-lines protocol (shared/reward/PROTOCOL.md). Started by jetrl as

    python3 verl_adapter.py <path/to/reward.py> <function name> <reward_kwargs as JSON>

The function may be sync or async, and may return a number, a bool, a dict with "score", or a list/tuple
(jetrl takes the first element, as verl does). Standard library only.
"""

import asyncio
import importlib.util
import inspect
import json
import os
import sys
import traceback


def load_function(path, name):
    module_name = "jetrl_user_reward"
    spec = importlib.util.spec_from_file_location(module_name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def to_plain(value):
    # numpy scalars and 0-d tensors: .item() gives the Python number
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except Exception:
            pass
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def to_wire(result):
    if isinstance(result, dict):
        return {str(key): to_plain(value) for key, value in result.items()}
    if isinstance(result, (list, tuple)):
        return [to_plain(value) for value in result]
    return to_plain(result)


def failure(error):
    traceback.print_exc(file=sys.stderr)
    return {"error": f"{type(error).__name__}: {error}"}


def score_batch(function, items, reward_kwargs):
    def arguments(item):
        # verl merges the configured reward_kwargs over the call's arguments
        return {
            "data_source": item.get("data_source"),
            "solution_str": item.get("solution_str"),
            "ground_truth": item.get("ground_truth"),
            # verl always hands the function a dict
            "extra_info": {} if item.get("extra_info") is None else item["extra_info"],
            **reward_kwargs,
        }

    if inspect.iscoroutinefunction(function):

        async def one(item):
            try:
                return to_wire(await function(**arguments(item)))
            except Exception as error:
                return failure(error)

        async def everything():
            return await asyncio.gather(*(one(item) for item in items))

        return asyncio.run(everything())

    results = []
    for item in items:
        try:
            results.append(to_wire(function(**arguments(item))))
        except Exception as error:
            results.append(failure(error))
    return results


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: verl_adapter.py <reward.py> <function name> [reward_kwargs JSON]")
    path, name = sys.argv[1], sys.argv[2]
    reward_kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    protocol_out = sys.stdout
    # The user's prints must not land between protocol lines.
    sys.stdout = sys.stderr
    function = load_function(path, name)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            request_id = request["id"]
        except Exception:
            print(f"unreadable request line: {line[:200]!r}", file=sys.stderr)
            continue
        try:
            answer = {"id": request_id, "results": score_batch(function, request.get("items", []), reward_kwargs)}
        except Exception as error:
            traceback.print_exc(file=sys.stderr)
            answer = {"id": request_id, "error": f"{type(error).__name__}: {error}"}
        protocol_out.write(json.dumps(answer) + "\n")
        protocol_out.flush()


if __name__ == "__main__":
    main()

"""Writes the same rows twice for jetrl-data's HF `datasets` tests (src/hf_dataset.rs): as `Dataset.save_to_disk`
writes them (`<out>/hf`, three shards), as parquet written by pyarrow from the same Arrow table
(`<out>/rows.parquet`), and as single `.arrow` files: an IPC stream of several record batches (`batches.arrow`) and
the IPC file format (`file_format.arrow`), and a stream without continuation markers (`legacy.arrow`, as Arrow
before 0.15 wrote them). Needs the `datasets` package (and its pyarrow).

    python hf_rows.py <out>

The rows are verl-shaped (`prompt` a list of chat-message structs, `reward_model`, `extra_info`) with a column of
every kind jetrl reads: strings (unicode, empty, null), int8/int32/int64/uint64, float32/float64 (NaN, infinities,
negative zero), bools, nulls, null structs, empty and null lists, lists of ints and of lists, large strings and
large lists, binary (text and not).
"""
import math
import os
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Features, LargeList, List, Value

out = sys.argv[1]
datasets.disable_progress_bars()

features = Features({
    "data_source": Value("string"),
    "prompt": List({"role": Value("string"), "content": Value("string")}),
    "ability": Value("string"),
    "reward_model": {"style": Value("string"), "ground_truth": Value("string")},
    "extra_info": {
        "split": Value("string"),
        "index": Value("int64"),
        "score": Value("float64"),
        "weight": Value("float32"),
        "small": Value("int8"),
        "medium": Value("int32"),
        "big": Value("uint64"),
        "flag": Value("bool"),
        "tags": List(Value("string")),
        "matrix": List(List(Value("int64"))),
        "nested": {"a": Value("int64"), "b": {"c": Value("string")}},
    },
    "notes": Value("large_string"),
    "steps": LargeList(Value("int32")),
    "blob": Value("binary"),
    "nothing": Value("null"),
})


def row(i):
    return {
        "data_source": ["openai/gsm8k", "lighteval/MATH", "ünïcødé/日本"][i % 3],
        "prompt": None if i == 5 else [
            {"role": "system", "content": "" if i % 4 == 0 else "be brief"},
            {"role": "user", "content": f"what is {i} × {i}? 🙂" + "\n" * (i % 2)},
        ][: 1 + (i % 3 != 1)],
        "ability": None if i % 5 == 0 else "math",
        "reward_model": None if i == 7 else {"style": "rule", "ground_truth": None if i == 3 else str(i * i)},
        "extra_info": {
            "split": "train",
            "index": 1000 + i if i % 6 else -i,
            "score": [1.5, float("nan"), float("inf"), -0.0, 1e-300, 2.0 ** 60][i % 6],
            "weight": [0.1, None, 3.0, -2.5][i % 4],
            "small": -128 + i,
            "medium": 2 ** 31 - 1 - i,
            "big": 2 ** 64 - 1 - i,
            "flag": [True, False, None][i % 3],
            "tags": [[], None, ["a"], ["b", "c", None]][i % 4],
            "matrix": [[[1, 2], [], [3]], [], None][i % 3],
            "nested": None if i % 4 == 3 else {"a": i, "b": {"c": None if i % 2 else f"c{i}"}},
        },
        "notes": "x" * (i * 3),
        "steps": list(range(i % 4)),
        "blob": [b"text", b"\xff\x00\x01", None, b""][i % 4],
        "nothing": None,
    }


# three pieces concatenated: an Arrow table of several chunks, so shards hold several record batches
# (built by pyarrow with the features' schema: datasets' own inference cannot hold a uint64 above 2**63)
parts = [
    datasets.Dataset(pa.Table.from_pylist([row(i) for i in range(lo, hi)], schema=features.arrow_schema),
                     info=datasets.DatasetInfo(features=features))
    for lo, hi in [(0, 5), (5, 9), (9, 14)]
]
ds = datasets.concatenate_datasets(parts)
ds.save_to_disk(os.path.join(out, "hf"), num_shards=3)
table = ds.data.table
pq.write_table(table, os.path.join(out, "rows.parquet"))
# the same table as one IPC stream of record batches of 4 rows, and in the IPC file format
with pa.ipc.new_stream(os.path.join(out, "batches.arrow"), table.schema) as writer:
    for batch in table.to_batches(max_chunksize=4):
        writer.write_batch(batch)
with pa.ipc.new_file(os.path.join(out, "file_format.arrow"), table.schema) as writer:
    writer.write_table(table, max_chunksize=6)
# and as Arrow 0.8 to 0.14 wrote streams: no continuation marker before each message's length
legacy = pa.ipc.IpcWriteOptions(use_legacy_format=True)
with pa.ipc.new_stream(os.path.join(out, "legacy.arrow"), table.schema, options=legacy) as writer:
    writer.write_table(table, max_chunksize=5)
assert math.isnan(row(1)["extra_info"]["score"])
print(len(ds), "rows")

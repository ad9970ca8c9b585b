#!/usr/bin/env python3
"""Writes a GSM8K-format sample: synthetic grade-school arithmetic word problems in exactly the layout verl's
`examples/data_preprocess/gsm8k.py` gives the real GSM8K (no network needed).

    scripts/make_gsm8k_sample.py --out data/gsm8k_sample                 # train.parquet, test.parquet
    scripts/make_gsm8k_sample.py --out data/gsm8k_sample --format arrow  # train/, test/ (Dataset.save_to_disk)

Each row, as verl writes it (columns in this order):
    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the number after "#### " in the answer, commas removed}
    extra_info    {"split": "train" | "test", "index": row number in the split, "answer": worked solution with
                   GSM8K's <<calculator>> annotations ending in "#### <number>", "question": the question}

The problems are seeded and deterministic (the same --seed gives the same bytes of rows), every answer is a whole
number computed from the problem, so a response ending in "#### <answer>" scores 1.0 with verl's (and jetrl's)
gsm8k scorer. Parquet needs pyarrow; --format arrow needs the `datasets` package.
"""
import argparse
import os
import random
import re

DATA_SOURCE = "openai/gsm8k"
# verl examples/data_preprocess/gsm8k.py
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

NAMES = [
    ("Natalia", "she"), ("James", "he"), ("Maria", "she"), ("Tom", "he"), ("Aisha", "she"), ("Kenji", "he"),
    ("Lena", "she"), ("Omar", "he"), ("Priya", "she"), ("Diego", "he"), ("Sofia", "she"), ("Ben", "he"),
]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards", "cupcakes", "stamps"]
THINGS = ["bike", "game", "jacket", "backpack", "lamp", "watch"]
VEHICLES = ["train", "car", "bus", "truck"]


def calc(expr, value):
    """GSM8K's calculator annotation: `<<48/2=24>>24`."""
    return f"<<{expr}={value}>>{value}"


def buy_and_give(rng):
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    total, left = a + b, a + b - c
    q = (f"{name} had {a} {item}. {he.capitalize()} bought {b} more and then gave {c} to friends. "
         f"How many {item} does {name} have now?")
    s = (f"After buying more, {name} had {a} + {b} = {calc(f'{a}+{b}', total)} {item}.\n"
         f"After giving {c} away, {he} has {total} - {c} = {calc(f'{total}-{c}', left)} {item}.")
    return q, s, left


def change_from_bill(rng):
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    n, price = rng.randint(2, 12), rng.randint(1, 9)
    cost = n * price
    bill = rng.choice([b for b in (20, 50, 100) if b >= cost])
    change = bill - cost
    q = (f"{name} buys {n} {item} that cost ${price} each and pays with a ${bill} bill. "
         f"How much change does {he} get, in dollars?")
    s = (f"The {item} cost {n} * ${price} = ${calc(f'{n}*{price}', cost)}.\n"
         f"The change is ${bill} - ${cost} = ${calc(f'{bill}-{cost}', change)}.")
    return q, s, change


def share_equally(rng):
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 15)
    kept = rng.randint(0, 10)
    total = friends * each + kept
    q = (f"{name} has {total} {item}. {he.capitalize()} keeps {kept} and shares the rest equally among "
         f"{friends} friends. How many {item} does each friend get?")
    rest = total - kept
    s = (f"{name} shares {total} - {kept} = {calc(f'{total}-{kept}', rest)} {item}.\n"
         f"Each friend gets {rest} / {friends} = {calc(f'{rest}/{friends}', each)} {item}.")
    return q, s, each


def two_legs(rng):
    vehicle = rng.choice(VEHICLES)
    s1, h1 = rng.randint(20, 80), rng.randint(1, 5)
    s2, h2 = rng.randint(20, 80), rng.randint(1, 5)
    d1, d2 = s1 * h1, s2 * h2
    q = (f"A {vehicle} travels at {s1} miles per hour for {h1} hours, then at {s2} miles per hour for {h2} hours. "
         f"How many miles does it travel in total?")
    s = (f"First it travels {s1} * {h1} = {calc(f'{s1}*{h1}', d1)} miles.\n"
         f"Then it travels {s2} * {h2} = {calc(f'{s2}*{h2}', d2)} miles.\n"
         f"In total it travels {d1} + {d2} = {calc(f'{d1}+{d2}', d1 + d2)} miles.")
    return q, s, d1 + d2


def weekly_savings(rng):
    name, he = rng.choice(NAMES)
    thing = rng.choice(THINGS)
    per_week, weeks = rng.randint(5, 40), rng.randint(3, 52)
    saved = per_week * weeks
    price = rng.randint(1, saved)
    left = saved - price
    q = (f"{name} saves ${per_week} every week. After {weeks} weeks, {he} spends ${price} on a {thing}. "
         f"How many dollars does {he} have left?")
    s = (f"{name} saves {per_week} * {weeks} = ${calc(f'{per_week}*{weeks}', saved)}.\n"
         f"After buying the {thing}, {he} has {saved} - {price} = ${calc(f'{saved}-{price}', left)} left.")
    return q, s, left


def sale_price(rng):
    thing = rng.choice(THINGS)
    pct = rng.choice([10, 20, 25, 50])
    price = rng.randint(2, 60) * 20
    off = price * pct // 100
    q = (f"A store sells a {thing} for ${price}. During a sale the price is {pct}% off. "
         f"How much does the {thing} cost during the sale, in dollars?")
    s = (f"The discount is {pct}/100 * ${price} = ${calc(f'{pct}/100*{price}', off)}.\n"
         f"The sale price is ${price} - ${off} = ${calc(f'{price}-{off}', price - off)}.")
    return q, s, price - off


TEMPLATES = [buy_and_give, change_from_bill, share_equally, two_legs, weekly_savings, sale_price]


def extract_solution(solution_str):
    """verl examples/data_preprocess/gsm8k.py: the ground truth is the number after the first "#### "."""
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    return solution.group(0).split("#### ")[1].replace(",", "")


def rows(split, size, seed):
    rng = random.Random(seed * 2 + (split == "test"))
    out = []
    for idx in range(size):
        question_raw, steps, answer = rng.choice(TEMPLATES)(rng)
        answer_raw = f"{steps}\n#### {answer}"
        solution = extract_solution(answer_raw)
        assert solution == str(answer), (answer_raw, solution)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
        })
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/gsm8k_sample", help="output directory")
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=["parquet", "arrow", "both"], default="parquet",
                        help="parquet: train.parquet, test.parquet; arrow: train/ and test/ written by "
                             "datasets.Dataset.save_to_disk; both: all four")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split, size in [("train", args.train_size), ("test", args.test_size)]:
        data = rows(split, size, args.seed)
        if args.format in ("parquet", "both"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(data), os.path.join(args.out, f"{split}.parquet"))
        if args.format in ("arrow", "both"):
            import datasets

            datasets.disable_progress_bars()
            datasets.Dataset.from_list(data).save_to_disk(os.path.join(args.out, split))
        print(f"{split}: {size} rows", flush=True)


if __name__ == "__main__":
    main()

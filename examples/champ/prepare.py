"""CHAMP's competition math problems as prompt sets in verl's layout: train.parquet and test.parquet.

CHAMP (Mao, Kim and Zhou, 2024; the `champ-dataset` package on PyPI, MIT licence) holds 270
competition problems in number theory, polynomials, inequalities, sequences and combinatorics.
Kept are those whose answer is one number (an integer or a fraction), which the `math` reward
compares with a response's \\boxed{} answer; a fixed-seed fifth of them is held out for `eval`.

    pip install champ-dataset
    python examples/champ/prepare.py              # writes examples/champ/data/{train,test}.parquet
    spotrl runs submit examples/champ/run.yaml    # uploads both, then submits the run

Each row is what verl's math preprocessing writes: `data_source`, `prompt` (one user message:
the problem and the instruction), `ability`, `reward_model: {style, ground_truth}` and
`extra_info` (split, index, CHAMP's identifier and category).
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

DATA_SOURCE = "champ"
# verl's instruction for MATH (examples/data_preprocess/math_dataset.py).
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
HELD_OUT = 0.2
SEED = 0
# One number: CHAMP writes math between @@ marks, and some answers in words or as formulas in n.
NUMBER = re.compile(r"-?\d+(/\d+)?")


def rows(split: str, problems: list) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{p.text} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer.strip()},
            "extra_info": {"split": split, "index": i, "id": p.identifier, "category": p.category},
        }
        for i, p in enumerate(problems)
    ]


def prepare(out_dir: Path) -> dict[str, int]:
    """Write train.parquet and test.parquet into ``out_dir``; returns each one's row count."""
    import champ_dataset
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = champ_dataset.load("v0")
    problems = sorted(
        (p for p in dataset.problems.values() if NUMBER.fullmatch(p.answer.strip())), key=lambda p: p.identifier
    )
    random.Random(SEED).shuffle(problems)
    n_test = round(len(problems) * HELD_OUT)
    splits = {"train": problems[n_test:], "test": problems[:n_test]}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, chosen in splits.items():
        pq.write_table(pa.Table.from_pylist(rows(split, chosen)), out_dir / f"{split}.parquet")
    return {split: len(chosen) for split, chosen in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "data", help="Folder of the two Parquet files."
    )
    counts = prepare(parser.parse_args().out)
    print(", ".join(f"{split}: {n} problems" for split, n in counts.items()))


if __name__ == "__main__":
    main()

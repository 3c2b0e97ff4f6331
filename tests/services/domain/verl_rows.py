"""Rows of a prompt set in verl's layout, as verl's examples/data_preprocess/gsm8k.py writes them,
and the files the tests write them to (JSONL, Parquet with pyarrow)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# verl's instruction for GSM8K, appended to each question.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int, split: str = "train") -> list[dict]:
    """``n`` GSM8K-style rows: ``{data_source, prompt, ability, reward_model, extra_info}``."""
    rows = []
    for idx in range(n):
        question = f"Natalia sold clips to {idx + 2} friends, 3 each. How many clips did she sell?"
        solution = str(3 * (idx + 2))
        answer_raw = f"She sold {idx + 2} * 3 = <<{idx + 2}*3={solution}>>{solution} clips.\n#### {solution}"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question},
            }
        )
    return rows


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(rows: list[dict], path: Path | None = None, **write_options) -> bytes:
    """``rows`` as a Parquet file (written to ``path`` too, when given); its bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink, **write_options)
    data = sink.getvalue().to_pybytes()
    if path is not None:
        path.write_bytes(data)
    return data

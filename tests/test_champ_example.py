"""examples/champ: prepare.py turns CHAMP's problems into verl-layout Parquet, and run.yaml, naming
those files, is a run the API takes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import yaml

from services.domain.prompts import load_prompts
from services.domain.runspec import RunSpec

EXAMPLE = Path(__file__).parents[1] / "examples" / "champ"


def prepare_module():
    spec = importlib.util.spec_from_file_location("champ_prepare", EXAMPLE / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_prepared_champ_problems_are_a_run_with_a_held_out_eval(api: httpx.AsyncClient, tmp_path: Path) -> None:
    out = tmp_path / "data" / "champ"  # inside the server's data directory
    counts = prepare_module().prepare(out)
    assert counts == {"train": 68, "test": 17}
    assert all((out / f"{split}.parquet").stat().st_size < 200_000 for split in counts)
    # verl's layout, column for column.
    assert pq.read_schema(out / "train.parquet").names == [
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    ]

    spec = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    assert (spec["prompts"], spec["eval"]["prompts"], spec["reward"]) == (
        "data/train.parquet",
        "data/test.parquet",
        [{"fn": "math"}],
    )
    spec["prompts"], spec["eval"]["prompts"] = str(out / "train.parquet"), str(out / "test.parquet")
    run = RunSpec.model_validate(spec)
    train = load_prompts(run.prompts, None, fields=run.dataset)
    test = load_prompts(run.eval.prompts, None, fields=run.dataset)
    assert (len(train), len(test)) == (68, 17)
    assert {i.extra_info["id"] for i in train}.isdisjoint({i.extra_info["id"] for i in test})
    for item in train + test:
        assert item.data_source == "champ" and item.extra_info["ability"] == "math"
        assert re.fullmatch(r"-?\d+(/\d+)?", item.answer)
        [message] = item.prompt
        assert message.role == "user" and message.content.endswith("output the final answer within \\boxed{}.")
        assert "@@" not in message.content  # CHAMP's math marks are taken out

    r = await api.post("/v1/runs", json=spec)
    assert (r.status_code, r.json()["prompt_count"]) == (201, 68), r.text

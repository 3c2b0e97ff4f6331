"""Prompt sets in the formats users have: JSONL and Parquet in verl's layout, a directory saved by
Hugging Face datasets, field mappings; each bounded, each bad row named without its content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.domain import prompts
from services.domain.prompt_items import ChatMessage, DatasetFields, PromptItem
from services.domain.prompts import InvalidPromptsError, load_prompts, parse_jsonl, to_jsonl
from tests.services.domain.verl_rows import INSTRUCTION, gsm8k_rows, jsonl, parquet

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def load(path: Path, data_dir: Path, **kwargs) -> list[PromptItem]:
    """The prompt set at ``path`` as the API reads a server path (inside its data directories)."""
    return load_prompts(str(path), None, allowed_dirs=[data_dir.resolve()], **kwargs)


def refusal(path: Path, data_dir: Path, **kwargs) -> str:
    with pytest.raises(InvalidPromptsError) as e:
        load(path, data_dir, **kwargs)
    assert SECRET not in str(e.value)
    return str(e.value)


def test_a_verl_row_maps_to_a_prompt_item_with_its_other_fields_in_extra_info() -> None:
    [item] = parse_jsonl(jsonl(gsm8k_rows(1)), "the upload")
    question = "Natalia sold clips to 2 friends, 3 each. How many clips did she sell?"
    assert item.prompt == [ChatMessage(role="user", content=f"{question} {INSTRUCTION}")]
    assert (item.answer, item.data_source) == ("6", "openai/gsm8k")
    # `ability` reaches the reward beside verl's extra_info; reward_model gave the answer and is not passed on.
    assert item.extra_info == {
        "ability": "math",
        "split": "train",
        "index": 0,
        "answer": gsm8k_rows(1)[0]["extra_info"]["answer"],
        "question": question,
    }
    # Stored as normalised JSONL, the item reads back as itself (the scheduler reads every set so).
    assert parse_jsonl(to_jsonl([item]), "the stored set") == [item]


def test_the_plain_jsonl_form_reads_as_before() -> None:
    data = b'{"prompt": "What is 2 + 3?", "answer": "5"}\n{"prompt": "caf\xc3\xa9"}\n'
    assert parse_jsonl(data, "the upload") == [
        PromptItem(prompt="What is 2 + 3?", answer="5"),
        PromptItem(prompt="caf\u00e9"),
    ]
    assert [i.extra_info for i in parse_jsonl(data, "the upload")] == [None, None]
    with pytest.raises(InvalidPromptsError, match=r"line 2 is not a prompt row: prompt: Field required"):
        parse_jsonl(b'{"prompt": "x"}\n{"question": "y"}\n', "the upload")


def test_parquet_in_verls_gsm8k_layout_reads_as_its_jsonl(data_dir: Path) -> None:
    rows = gsm8k_rows(2500)
    # Three row groups, each decoded in batches of PARQUET_BATCH_ROWS.
    parquet(rows, data_dir / "train.parquet", row_group_size=1000)
    assert pq.ParquetFile(data_dir / "train.parquet").num_row_groups == 3
    items = load(data_dir / "train.parquet", data_dir)
    assert items == parse_jsonl(jsonl(rows), "the same rows as JSONL")
    assert [i.answer for i in items[:3]] == ["6", "9", "12"] and items[-1].extra_info["index"] == 2499
    # A Parquet file is told by its first bytes, not its name.
    (data_dir / "train.data").write_bytes((data_dir / "train.parquet").read_bytes())
    assert load(data_dir / "train.data", data_dir) == items


def test_fields_are_mapped_by_the_specs_dataset(data_dir: Path) -> None:
    rows = [{"question": f"{i} + 1?", "solution": {"steps": "add one", "final": i + 1}, "level": 2} for i in range(3)]
    (data_dir / "q.jsonl").write_bytes(jsonl(rows))
    parquet(rows, data_dir / "q.parquet")
    fields = DatasetFields(prompt_key="question", answer_key="solution.final")
    for name in ("q.jsonl", "q.parquet"):
        items = load(data_dir / name, data_dir, fields=fields)
        assert [(i.prompt, i.answer, i.extra_info) for i in items] == [
            (f"{i} + 1?", i + 1, {"level": 2}) for i in range(3)
        ], name
        # Without the mapping the rows hold no prompt: refused, naming the row and the field.
        assert "row 1 is not a prompt row: prompt: Field required" in refusal(data_dir / name, data_dir).replace(
            "line", "row"
        )
        missing = refusal(
            data_dir / name, data_dir, fields=DatasetFields(prompt_key="question", answer_key="solution.score")
        )
        assert "1 is not a prompt row: solution.score: Field required" in missing, missing


def test_a_directory_saved_by_datasets_reads_as_its_rows(data_dir: Path) -> None:
    import datasets

    rows = gsm8k_rows(50)
    datasets.Dataset.from_list(rows).save_to_disk(str(data_dir / "gsm8k-train"), num_shards=3)
    assert len(list((data_dir / "gsm8k-train").glob("data-*.arrow"))) == 3
    assert load(data_dir / "gsm8k-train", data_dir) == parse_jsonl(
        jsonl(rows), "the same rows"
    )  # in order, over the shards
    mapped = datasets.Dataset.from_list([{"q": "1 + 1?", "gt": "2"}]).map(lambda r: {"id": 7})
    mapped.save_to_disk(str(data_dir / "mapped"))
    [item] = load(data_dir / "mapped", data_dir, fields=DatasetFields(prompt_key="q", answer_key="gt"))
    assert (item.prompt, item.answer, item.extra_info) == ("1 + 1?", "2", {"id": 7})
    # A DatasetDict (a folder per split) is refused, naming the splits to choose from.
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows[2:4])}
    ).save_to_disk(str(data_dir / "gsm8k"))
    assert "holds a DatasetDict: name the folder of one of its splits inside it (test, train)" in refusal(
        data_dir / "gsm8k", data_dir
    )
    assert len(load(data_dir / "gsm8k" / "test", data_dir)) == 2
    (data_dir / "empty").mkdir()
    assert "not one written by datasets' save_to_disk" in refusal(data_dir / "empty", data_dir)


def test_a_saved_datasets_files_may_not_lead_out_of_the_data_dir(tmp_path: Path, data_dir: Path) -> None:
    import datasets

    datasets.Dataset.from_list(gsm8k_rows(2)).save_to_disk(str(tmp_path / "outside"))
    (data_dir / "escape").mkdir()
    (data_dir / "escape" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "../../outside/data-00000-of-00001.arrow"}]})
    )
    assert "state.json is not one that datasets' save_to_disk writes" in refusal(data_dir / "escape", data_dir)
    (data_dir / "linked").mkdir()
    (data_dir / "linked" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (data_dir / "linked" / "data-00000-of-00001.arrow").symlink_to(tmp_path / "outside" / "data-00000-of-00001.arrow")
    assert "SPOTRL_DATA_DIRS" in refusal(data_dir / "linked", data_dir)


def test_bad_rows_are_named_by_row_and_field_never_by_content(data_dir: Path) -> None:
    rows = gsm8k_rows(3)
    rows[1]["prompt"] = [{"role": "robot", "content": SECRET}]
    parquet(rows, data_dir / "role.parquet")
    assert "row 2 is not a prompt row: prompt.0.role: Input should be" in refusal(data_dir / "role.parquet", data_dir)
    # A column of a type JSON has no value for, a column of the wrong type, a chat message short of its content.
    when = pa.table({"prompt": [SECRET, "b"], "created": pa.array([1, 2], pa.timestamp("s"))})
    pq.write_table(when, data_dir / "when.parquet")
    assert "row 1 is not a prompt row: (field 2): input was not a valid JSON value" in refusal(
        data_dir / "when.parquet", data_dir
    )
    pq.write_table(pa.table({"prompt": [1, 2]}), data_dir / "number.parquet")
    assert "row 1 is not a prompt row: prompt: Input should be a valid" in refusal(
        data_dir / "number.parquet", data_dir
    )
    rows = gsm8k_rows(2)
    rows[1]["reward_model"] = {
        "style": "rule"
    }  # no ground_truth: asked for by name, it is missing (in Parquet, a null)
    (data_dir / "no-answer.jsonl").write_bytes(jsonl(rows))
    fields = DatasetFields(answer_key="reward_model.ground_truth")
    assert "line 2 is not a prompt row: reward_model.ground_truth: Field required" in refusal(
        data_dir / "no-answer.jsonl", data_dir, fields=fields
    )
    rows = [{"prompt": "x", "extra_info": SECRET}]
    parquet(rows, data_dir / "extra.parquet")
    assert "row 1 is not a prompt row: extra_info: Input should be a valid dictionary" in refusal(
        data_dir / "extra.parquet", data_dir
    )
    # Not Parquet after all: the magic bytes, then anything.
    (data_dir / "fake.parquet").write_bytes(b"PAR1" + SECRET.encode() * 10)
    assert refusal(data_dir / "fake.parquet", data_dir) == "the prompt file is not a Parquet file that can be read"
    (data_dir / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n" + SECRET + "\n")
    assert (
        refusal(data_dir / "bad.jsonl", data_dir)
        == "the prompt file line 2 is not a JSON object (one prompt row a line)"
    )


def test_parquet_is_bounded_on_disk_once_decoded_and_in_rows(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = gsm8k_rows(200)
    size = len(parquet(rows, data_dir / "train.parquet"))
    assert f"larger than the {size - 1}-byte limit" in refusal(data_dir / "train.parquet", data_dir, max_bytes=size - 1)
    # 100 prompts of 50,000 characters compress to a few kB: refused once decoded past the limit.
    pq.write_table(pa.table({"prompt": ["x" * 50_000] * 100}), data_dir / "inflates.parquet", compression="zstd")
    small = (data_dir / "inflates.parquet").stat().st_size
    assert small < 64 << 10
    assert "larger than the 1048576-byte limit once decoded" in refusal(
        data_dir / "inflates.parquet", data_dir, max_bytes=1 << 20
    )
    assert len(load(data_dir / "inflates.parquet", data_dir, max_bytes=8 << 20)) == 100
    monkeypatch.setattr(prompts, "MAX_PROMPTS", 150)
    assert "holds more than 150 rows" in refusal(data_dir / "train.parquet", data_dir)


def test_the_api_loads_no_pyarrow_until_a_parquet_set_comes() -> None:
    probe = (
        "import sys\nfrom services.control.api.main import create_app\ncreate_app()\nprint('pyarrow' in sys.modules)\n"
    )
    assert (
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.strip()
        == "False"
    )

"""What a run may name as its model or reward model, checked without loading anything (no torch):
the API checks a submitted spec with these, and the trainer's loaders check again before loading."""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN_MODELS = ("tiny", "smollm2-135m")

# A reward model saved by `spotrl train-rm`: its config, score head and backbone directory.
RM_CONFIG_FILE = "reward_model.json"
RM_FORMAT = "spotrl.reward_model/v1"
RM_HEAD_FILE = "head.safetensors"
RM_BACKBONE_DIR = "backbone"


def check_model_source(source: str) -> None:
    """Raise ValueError, saying what is accepted, unless `source` names a loadable model."""
    path = Path(source)
    if source in BUILTIN_MODELS:
        return
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.suffix == ".gguf" and path.is_file():
        return
    raise ValueError(
        f"model source {source!r} is not usable: give a builtin name "
        f"({', '.join(BUILTIN_MODELS)}), a model directory containing config.json, "
        "or the path of an existing .gguf file"
    )


def check_reward_model_dir(path: Path) -> dict:
    """The saved config of the reward model at `path`; ValueError unless it is one."""
    config_file = Path(path) / RM_CONFIG_FILE
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(
            f"{path} is not a saved reward model: it lacks a readable {RM_CONFIG_FILE} (train one with `spotrl train-rm`)"
        ) from None
    if not isinstance(config, dict) or config.get("format") != RM_FORMAT:
        raise ValueError(f"{config_file} is not a {RM_FORMAT} reward model config")
    for name in (RM_HEAD_FILE, f"{RM_BACKBONE_DIR}/config.json"):
        if not (Path(path) / name).is_file():
            raise ValueError(f"the reward model at {path} is incomplete: {name} is missing")
    return config

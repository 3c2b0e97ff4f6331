"""Checkpoints that hold everything a run needs to resume exactly where it stopped.

Layout of one checkpoint, `<root>/step-<8-digit step>/`:

    policy/          save_pretrained weights, config and tokenizer; only the adapter when the
                     policy is a peft (LoRA) model
    optimizer.pt     the optimizer's state_dict
    value_head.pt    the PPO critic's state_dict (PPO runs only)
    rng.pt           python `random`, numpy, torch CPU and CUDA generator states
    meta.json        format, step, whether the policy is an adapter, the resolved config and
                     caller metadata

A checkpoint is written into a hidden temp dir under `root` and renamed into place: rename is
atomic, so a crash mid-save leaves only a hidden temp dir that `latest_checkpoint` never
picks up, and the next successful save deletes it. After a save the last `keep` checkpoints
are kept and older ones deleted (nanoGPT `train.py` keeps one; keeping a few survives a
corrupt newest one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contracts.durable import fsync, fsync_tree
from trainer_core.models.loading import load_weights
from trainer_core.models.lora import is_lora, load_adapter

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-"  # crashed saves; hidden, so neither _NAME nor a glance at `ls` sees them
_OLD_PREFIX = ".old-"  # a checkpoint being replaced by a re-save of the same step
_POLICY_DIR = "policy"
_META = "meta.json"
_OPTIMIZER = "optimizer.pt"
_VALUE_HEAD = "value_head.pt"
_RNG = "rng.pt"


@dataclass
class CheckpointState:
    """What `load_checkpoint` restored, and what the caller needs to carry on."""

    path: Path
    step: int  # the step (iteration) counter saved with the checkpoint
    config: dict[str, Any] | None  # the resolved config, as JSON
    metadata: dict[str, Any]  # caller metadata saved with the checkpoint (JSON)
    model: nn.Module  # the model holding the restored weights (see `load_checkpoint`)


def checkpoint_dir(root: Path | str, step: int) -> Path:
    """Where step `step`'s checkpoint lives under `root`."""
    if not 0 <= step < 10**8:
        raise ValueError(f"checkpoint step must be in [0, 1e8), got {step}")
    return Path(root) / f"step-{step:08d}"


def list_checkpoints(root: Path | str) -> list[Path]:
    """The complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / _META).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path | str) -> Path | None:
    """The checkpoint with the highest step under `root`, or None; crashed saves are ignored."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Path | str,
    step: int,
    *,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    value_head: nn.Module | None = None,
    config: Any = None,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Write step `step`'s checkpoint under `root` atomically and return its path.

    `policy` is a `trainer_core.models.Policy` (its tokenizer is saved too) or a bare model; a
    peft model saves only its adapter. `config` (a dataclass, pydantic model or mapping) and
    `metadata` must be JSON-serialisable once converted. Then all but the last `keep`
    checkpoints (None: all kept) are deleted, and temp dirs of crashed saves with them.
    Saving a step that exists replaces it.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None to keep all), got {keep}")
    final = checkpoint_dir(root, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _model_and_tokenizer(policy)
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "adapter": is_lora(model),
        "config": _jsonable(config),
        "metadata": dict(metadata or {}),
        "saved_at": time.time(),
    }
    json.dumps(meta)  # fail before writing anything if the config is not JSON-able

    tmp = _new_dir(root, f"{_TMP_PREFIX}{final.name}-")
    try:
        model.save_pretrained(tmp / _POLICY_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / _POLICY_DIR)
        torch.save(optimizer.state_dict(), tmp / _OPTIMIZER)
        if value_head is not None:
            torch.save(value_head.state_dict(), tmp / _VALUE_HEAD)
        torch.save(_rng_state(), tmp / _RNG)
        (tmp / _META).write_text(json.dumps(meta, indent=2))
        fsync_tree(tmp)
        _rename_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _rotate(root, final, keep)
    return final


def load_checkpoint(
    path: Path | str,
    *,
    policy_or_model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    value_head: nn.Module | None = None,
    restore_rng: bool = True,
) -> CheckpointState:
    """Restore the checkpoint at `path` in place: weights (or adapter), optimizer, value head
    and, unless `restore_rng` is False, the RNG states; returns its step and config.

    The weights are copied into the given model's own parameters, so an optimizer built over
    them stays valid. An adapter checkpoint loaded into a plain base model wraps that model in
    a new peft model (returned as `state.model`; a `Policy` given gets it as `.model`); an
    optimizer built before that would hold the wrong parameters, so it must then be None and
    built afterwards.
    """
    path = Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {_META})")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')}, expected {FORMAT_VERSION}")

    model, _ = _model_and_tokenizer(policy_or_model)
    policy_dir = path / _POLICY_DIR
    if meta["adapter"]:
        if not is_lora(model) and optimizer is not None:
            raise ValueError(
                f"{path} holds a LoRA adapter and the model has none: load with optimizer=None, "
                "then build the optimizer over state.model and load it with a second call"
            )
        model = load_adapter(model, policy_dir, trainable=True)
    else:
        if is_lora(model):
            raise ValueError(f"{path} holds full weights, but the model is a peft (LoRA) model")
        load_weights(model, policy_dir)
    if policy_or_model is not model and hasattr(policy_or_model, "model"):
        policy_or_model.model = model

    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / _OPTIMIZER, weights_only=True))
    if value_head is not None:
        if not (path / _VALUE_HEAD).is_file():
            raise ValueError(f"{path} holds no value head (it was saved by a run without a critic)")
        value_head.load_state_dict(torch.load(path / _VALUE_HEAD, weights_only=True))
    if restore_rng:
        _set_rng_state(torch.load(path / _RNG, weights_only=True))
    return CheckpointState(path=path, step=meta["step"], config=meta["config"], metadata=meta["metadata"], model=model)


def _model_and_tokenizer(policy: Any) -> tuple[nn.Module, Any]:
    """(model, tokenizer or None) of a `Policy` or a bare model."""
    if isinstance(policy, nn.Module):
        return policy, None
    return policy.model, getattr(policy, "tokenizer", None)


def _jsonable(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif hasattr(config, "model_dump"):  # a pydantic model
        config = config.model_dump(mode="json")
    # Round-trip so that the returned config is exactly what a later load gives (tuples become
    # lists, enums and paths strings).
    return json.loads(json.dumps(config, default=str))


def _rng_state() -> dict[str, Any]:
    """Every generator a training loop may draw from, as tensors and plain lists so that
    `torch.load(weights_only=True)` reads it back."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": None,
    }
    if "numpy" in sys.modules:  # numpy's global RNG matters only to code that uses numpy
        import numpy as np

        np_state = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("checkpoint has CUDA RNG states for %d devices; not restored here", len(state["cuda"]))
    if state["numpy"] is not None:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": np_state["bit_generator"],
                "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
                "has_gauss": np_state["has_gauss"],
                "gauss": np_state["gauss"],
            }
        )


def _new_dir(parent: Path, prefix: str) -> Path:
    """A fresh, uniquely named directory; unlike `tempfile.mkdtemp` (always 0700) it gets the
    umask's permissions, which the checkpoint keeps after the rename."""
    path = parent / f"{prefix}{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        # A re-save of the same step: move the old one aside first (rename cannot replace a
        # non-empty directory). A crash in between leaves the previous step as the latest.
        old = _new_dir(final.parent, f"{_OLD_PREFIX}{final.name}-")
        os.rename(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync(final.parent)


def _rotate(root: Path, saved: Path, keep: int | None) -> None:
    """Delete all but the last `keep` checkpoints (never `saved`) and leftovers of crashed saves.

    One run writes to a root at a time, so any temp dir present now belongs to a dead save.
    """
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    found = list_checkpoints(root)
    if found and found[-1] != saved:
        log.warning(
            "checkpoints newer than %s exist in %s; latest_checkpoint() returns %s", saved.name, root, found[-1].name
        )
    if keep is None:
        return
    for p in found[:-keep]:
        if p != saved:
            shutil.rmtree(p, ignore_errors=True)

"""Policy versions in the object store: publish v<N>, fetch any version to train (v0 is the
spec's base model), or load one into a rollout worker's model in place.

A version is what `save_policy` writes: full weights as safetensors shards of at most
`SHARD_BYTES` beside their index (`model.safetensors.index.json`, Hugging Face's layout), or
only the LoRA adapter; then config and tokenizer files. Versions published before shards were
written hold one `model.safetensors`, and are read alike. A worker streams full weights from the
store into its model, shard by shard (`load_version`): no shard, let alone the model, is held
twice, nor written to its disk.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch import nn

from services.domain.names import policy_prefix
from services.ports.objects.object_store import ObjectStore
from trainer_core.models.loading import Policy, load_policy, save_policy
from trainer_core.models.lora import ADAPTER_CONFIG, is_adapter_dir, load_adapter
from trainer_core.models.safetensors_stream import SHARD_BYTES, load_weight_files


def publish_policy(
    objects: ObjectStore, run_id: str, version: int, policy: Policy, scratch: Path, *, shard_bytes: int = SHARD_BYTES
) -> None:
    """Upload ``policy`` as ``runs/<run>/policy/v<version>/``: its weights in shards of at most
    ``shard_bytes``, or only its adapter (a few MB for the workers to download) when it is a
    LoRA policy."""
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        save_policy(policy, Path(tmp), shard_bytes=shard_bytes)
        objects.upload_dir(Path(tmp), policy_prefix(run_id, version))


def fetch_policy(objects: ObjectStore, run_id: str, version: int, *, base_model: str, model_cache: Path) -> Policy:
    """Policy ``version`` of a run to train further; version 0 is ``base_model`` itself. A
    published adapter is applied to ``base_model`` as a trainable LoRA policy."""
    if version == 0:
        return load_policy(base_model, cache_dir=model_cache)
    local = policy_dir(objects, run_id, version, model_cache)
    if not is_adapter_dir(local):
        return load_policy(local, cache_dir=model_cache)
    base = load_policy(base_model, cache_dir=model_cache)
    return Policy(model=load_adapter(base.model, local, trainable=True), tokenizer=base.tokenizer)


def load_version(model: nn.Module, objects: ObjectStore, run_id: str, version: int, model_cache: Path) -> nn.Module:
    """`model` (the base, or an earlier version of the same run) serving policy ``version``
    (>= 1), in place: full weights are streamed from the store into its parameters, a shard at a
    time (`stream_weights`); an adapter is downloaded (`policy_dir`) and injected into the base,
    or replaces the adapter's weights, unmerged. No second copy of the model is made, so a
    rollout worker holds one."""
    if is_adapter_version(objects, run_id, version):
        return load_adapter(model, policy_dir(objects, run_id, version, model_cache), trainable=False)
    stream_weights(model, objects, policy_prefix(run_id, version))
    return model


def stream_weights(model: nn.Module, objects: ObjectStore, prefix: str) -> int:
    """Copy the full weights stored under ``prefix`` (a model directory's files) into `model`'s
    parameters in place, each shard read from the store as a stream; the number of shards."""
    names = [key.removeprefix(prefix) for key in objects.list(prefix)]
    return load_weight_files(model, names, lambda name: objects.open(prefix + name))


def is_adapter_version(objects: ObjectStore, run_id: str, version: int) -> bool:
    """True when policy ``version`` is a LoRA adapter rather than full weights."""
    return objects.exists(policy_prefix(run_id, version) + ADAPTER_CONFIG)


def policy_dir(objects: ObjectStore, run_id: str, version: int, model_cache: Path) -> Path:
    """The local directory of policy ``version`` (>= 1), downloaded on first use."""
    local = model_cache / "runs" / run_id / f"v{version}"
    if not local.exists():
        # Several pods may fetch the same version at once: download apart, then rename into place.
        local.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".v{version}-"))
        objects.download_dir(policy_prefix(run_id, version), staging)
        try:
            staging.rename(local)
        except OSError:  # another pod won the race
            shutil.rmtree(staging, ignore_errors=True)
    return local

"""Policy versions in the object store: publish v<N>, fetch any version to train (v0 is the
spec's base model), or load one into a rollout worker's model in place."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch import nn

from services.domain.names import policy_prefix
from services.ports.objects.object_store import ObjectStore
from trainer_core.models.loading import Policy, load_policy, load_weights, save_policy
from trainer_core.models.lora import is_adapter_dir, load_adapter


def publish_policy(objects: ObjectStore, run_id: str, version: int, policy: Policy, scratch: Path) -> None:
    """Upload ``policy`` as ``runs/<run>/policy/v<version>/``: its weights, or only its adapter
    (a few MB for the workers to download) when it is a LoRA policy."""
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        save_policy(policy, Path(tmp))
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


def load_version(model: nn.Module, local: Path) -> nn.Module:
    """`model` (the base, or an earlier version of the same run) serving the version saved in
    `local` (`policy_dir`), in place: full weights are copied into its parameters; an adapter
    is injected into the base, or replaces the adapter's weights, unmerged. No second copy of
    the model is made, so a rollout worker's device holds one."""
    if is_adapter_dir(local):
        return load_adapter(model, local, trainable=False)
    load_weights(model, local)
    return model


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

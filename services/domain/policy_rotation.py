"""Rotation of a run's policy versions and trainer states in the object store (torch-free).

A training job publishes policy v<N> under ``runs/<run>/policy/v<N>/`` and its trainer state
(optimizer, critic) under ``runs/<run>/trainer/v<N>/``, next to ``result.json``, the marker that
v<N> is published. Each is as large as the model or larger (Adam's state is twice the fp32
weights), so older ones are deleted:

- kept: the last ``keep`` versions, ``latest - keep + 1 .. latest`` (``latest``: the run's
  recorded policy version, the pointer in the state store that rollout workers follow);
- kept: every version in ``in_use`` (one a live pod is known to hold);
- kept: every version newer than ``latest`` (published by a job, not yet recorded), and the
  ``result.json`` of every version (a few hundred bytes each; the scheduler and the audits read
  them, and a retried job looks for its own);
- deleted: the rest (v0 is the base model, never stored).

``keep`` is at least 2. Workers load the latest version between batches, so when v<N> is
recorded a worker may still be generating with v<N-1>, or have read the pointer v<N-1> just
before and be downloading it; the next training job reads the policy and trainer state of
v<N>. The default, 3, leaves one more version of slack for a worker that is slow to move on.

Example (keep 3): v1..v5 stored, v5 recorded, a worker known to hold v1: v2 is deleted; v1,
v3, v4, v5 are kept. Once v6 is recorded and no worker holds v1: v1 and v3 are deleted.
Applying is idempotent and looks at what is stored, not at what the last call deleted, so a
call that died halfway, or a run whose jobs deleted nothing, is caught up by the next one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from services.domain.names import policy_prefix, result_key, trainer_prefix
from services.ports.objects.object_store import ObjectStore

# Policy versions (and trainer states) kept by default; SPOTRL-wide settings may pass another.
KEEP_VERSIONS = 3
MIN_KEEP = 2


def versions_to_delete(
    present: Iterable[int], *, latest: int, in_use: Iterable[int] = (), keep: int = KEEP_VERSIONS
) -> list[int]:
    """The versions of ``present`` to delete, oldest first, by the rule of the module docstring."""
    if keep < MIN_KEEP:
        raise ValueError(
            f"keep must be at least {MIN_KEEP} (got {keep}): a rollout worker may still be on the version before the"
            " latest while the latest is recorded"
        )
    protected = set(in_use)
    oldest_kept = latest - keep + 1
    return sorted(v for v in set(present) if 1 <= v < oldest_kept and v not in protected)


@dataclass(frozen=True)
class Rotated:
    """What one ``rotate`` call deleted."""

    policies: list[int]  # versions whose policy folder was deleted
    trainer_states: list[int]  # versions whose trainer state (all but result.json) was deleted


def rotate(
    objects: ObjectStore, run_id: str, *, latest: int, in_use: Iterable[int] = (), keep: int = KEEP_VERSIONS
) -> Rotated:
    """Delete the policy versions and trainer states of ``run_id`` that ``versions_to_delete``
    names, through the object store port; ``result.json`` of each version stays."""
    in_use = set(in_use)
    policies = versions_to_delete(
        stored_versions(objects, policy_prefix(run_id, 0)), latest=latest, in_use=in_use, keep=keep
    )
    for version in policies:
        objects.delete_prefix(policy_prefix(run_id, version))

    states = _trainer_state_parts(objects, run_id)
    deleted_states = versions_to_delete(states, latest=latest, in_use=in_use, keep=keep)
    for version in deleted_states:
        for part in sorted(states[version]):
            objects.delete_prefix(part)
    return Rotated(policies=policies, trainer_states=deleted_states)


def stored_versions(objects: ObjectStore, v0_prefix: str) -> set[int]:
    """The versions N with an object under the folder ``v0_prefix`` with v0 replaced by vN."""
    root = v0_prefix.removesuffix("v0/")
    pattern = re.compile(rf"{re.escape(root)}v(\d+)/")
    return {int(m.group(1)) for key in objects.list(root) if (m := pattern.match(key))}


def _trainer_state_parts(objects: ObjectStore, run_id: str) -> dict[int, set[str]]:
    """For each version with a trainer state, the prefixes that delete it and not its result:
    each entry under ``trainer/v<N>/`` (a folder ``optimizer/``, a file ``value_head.pt``) but
    ``result.json``."""
    root = trainer_prefix(run_id, 0).removesuffix("v0/")
    pattern = re.compile(rf"{re.escape(root)}v(\d+)/([^/]+)(/?)")
    parts: dict[int, set[str]] = {}
    for key in objects.list(root):
        m = pattern.match(key)
        if m is None:
            continue
        version, name, folder = int(m.group(1)), m.group(2), m.group(3)
        part = f"{trainer_prefix(run_id, version)}{name}{folder}"
        # Deleting by prefix: never a prefix that would take the result along.
        if result_key(run_id, version).startswith(part):
            continue
        parts.setdefault(version, set()).add(part)
    return parts

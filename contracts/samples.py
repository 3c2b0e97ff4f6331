"""One rollout sample, and the compact wire format of a GRPO group of them.

A queue record holds one group (one prompt's samples, ``encode_group``): a group is queued
whole or not at all on any broker, so a rollout worker killed while it queues its batch leaves
no part of a group behind (Kafka appends a record atomically, not a producer's several records),
and the group is the unit a training job takes.

Layout of a group: magic b"SRG1" | count u32 | count x (sample_len u32 | encoded sample).

Layout of an encoded sample (all little-endian):

    magic b"SRS1" | header_len u32 | n_prompt u32 | n_response u32
    | header (UTF-8 JSON object: the strings and scalars)
    | prompt_ids int32[n_prompt] | response_ids int32[n_response] | logprobs float32[n_response]

Token ids and log-probs are packed arrays rather than JSON lists: a 1k-token response is
8 KB instead of ~25 KB, and decoding is a memcpy instead of a float parse per token.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

_MAGIC = b"SRS1"
_PREFIX = struct.Struct("<4sIII")  # magic, header_len, n_prompt, n_response
_GROUP_MAGIC = b"SRG1"
_GROUP_PREFIX = struct.Struct("<4sI")  # magic, samples in the group
_LENGTH = struct.Struct("<I")
_ARRAY_FIELDS = ("prompt_ids", "response_ids", "logprobs")
# array() uses the machine's byte order; the wire format is little-endian.
_SWAP = sys.byteorder != "little"


@dataclass(frozen=True, slots=True)
class Sample:
    """A scored completion of one prompt, as produced by a rollout worker."""

    sample_id: str  # uuid hex, the dedupe key
    run_id: str
    prompt_id: str
    group_id: str  # GRPO group = one prompt's n samples
    prompt_ids: list[int]
    response_ids: list[int]  # includes the EOS token when the model stopped
    logprobs: list[float]  # behaviour log-probs, one per response token
    reward: float
    reward_source: str
    policy_version: int
    worker_id: str
    generation_seconds: float
    created_at: float
    # ReMax's baseline: the reward of the prompt's greedy response (None when none was made).
    baseline_reward: float | None = None
    # What the reward reported beside the score (a user's function returning a dict), by name.
    reward_metrics: dict[str, float] | None = None


def _pack(typecode: str, values: list[int] | list[float]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: memoryview) -> array:
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if _SWAP:
        unpacked.byteswap()
    return unpacked


def encode_sample(sample: Sample) -> bytes:
    """Serialise `sample`; log-probs are stored as float32 (decode gives float32-rounded values)."""
    if len(sample.logprobs) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.sample_id}: {len(sample.logprobs)} logprobs for {len(sample.response_ids)} response tokens"
        )
    scalars = {k: v for k, v in asdict(sample).items() if k not in _ARRAY_FIELDS}
    header = json.dumps(scalars, separators=(",", ":")).encode()
    return b"".join(
        (
            _PREFIX.pack(_MAGIC, len(header), len(sample.prompt_ids), len(sample.response_ids)),
            header,
            _pack("i", sample.prompt_ids),
            _pack("i", sample.response_ids),
            _pack("f", sample.logprobs),
        )
    )


def decode_sample(data: bytes) -> Sample:
    """Inverse of `encode_sample`; raises ValueError on a truncated or foreign payload."""
    if len(data) < _PREFIX.size:
        raise ValueError(f"sample payload too short: {len(data)} bytes")
    magic, header_len, n_prompt, n_response = _PREFIX.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"not an encoded sample (magic {magic!r})")
    expected = _PREFIX.size + header_len + 4 * (n_prompt + 2 * n_response)
    if len(data) != expected:
        raise ValueError(f"sample payload is {len(data)} bytes, header says {expected}")

    view = memoryview(data)
    offset = _PREFIX.size
    scalars = json.loads(bytes(view[offset : offset + header_len]))
    offset += header_len
    arrays = {}
    for name, typecode, count in (
        ("prompt_ids", "i", n_prompt),
        ("response_ids", "i", n_response),
        ("logprobs", "f", n_response),
    ):
        arrays[name] = _unpack(typecode, view[offset : offset + 4 * count]).tolist()
        offset += 4 * count
    return Sample(**scalars, **arrays)


def encode_group(samples: Sequence[Sample]) -> bytes:
    """One GRPO group as one record: samples of one run and one ``group_id``, in order."""
    if not samples:
        raise ValueError("a group has at least one sample")
    groups = {(s.run_id, s.group_id) for s in samples}
    if len(groups) != 1:
        raise ValueError(f"samples of {len(groups)} groups in one group record: {sorted(groups)[:3]}")
    parts = [_GROUP_PREFIX.pack(_GROUP_MAGIC, len(samples))]
    for sample in samples:
        data = encode_sample(sample)
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


def decode_group(data: bytes) -> list[Sample]:
    """Inverse of `encode_group`; raises ValueError on a truncated or foreign payload."""
    if len(data) < _GROUP_PREFIX.size:
        raise ValueError(f"group payload too short: {len(data)} bytes")
    magic, count = _GROUP_PREFIX.unpack_from(data)
    if magic != _GROUP_MAGIC:
        raise ValueError(f"not an encoded group of samples (magic {magic!r})")
    samples, offset = [], _GROUP_PREFIX.size
    for _ in range(count):
        if offset + _LENGTH.size > len(data):
            raise ValueError(f"group payload truncated after {len(samples)} of {count} samples")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            raise ValueError(f"group payload truncated in sample {len(samples) + 1} of {count}")
        samples.append(decode_sample(data[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise ValueError(f"group payload has {len(data) - offset} bytes after its {count} samples")
    return samples

"""One rollout sample and its compact wire format.

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
from dataclasses import asdict, dataclass

_MAGIC = b"SRS1"
_PREFIX = struct.Struct("<4sIII")  # magic, header_len, n_prompt, n_response
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
            f"sample {sample.sample_id}: {len(sample.logprobs)} logprobs for "
            f"{len(sample.response_ids)} response tokens"
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

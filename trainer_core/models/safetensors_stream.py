"""Full weights read front to back into a live model, a piece of a tensor at a time.

A model directory in Hugging Face's layout holds its weights as `model.safetensors`, or as
shards of bounded size (`model-00001-of-00004.safetensors`, ...) named by an index,
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`): `save_policy`
writes shards of at most `SHARD_BYTES`. A safetensors file is an 8-byte little-endian header
length, a JSON header (each tensor's dtype, shape and `data_offsets` into the data), then the
data (https://github.com/huggingface/safetensors#format). So a file can be read as a stream,
from a local file or an object store alike, each tensor's bytes landing straight in the
parameter that holds it: the extra memory of a load is one `CHUNK_BYTES` staging buffer
(none where the parameter is on the CPU in the file's dtype), never a second copy of the
model, nor of a shard.

Tensors are matched by name with the model's `state_dict()`. A checkpoint whose names
transformers converts on load (some mixture-of-experts and vision-language models) does not
match, and is refused before any weight is written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MiB = 1 << 20
# Shards of at most this size (each tensor whole: one larger than this is a shard alone).
SHARD_BYTES = 512 * MiB
# What a read asks of the stream at a time, and the staging buffer of a dtype or device change.
CHUNK_BYTES = 8 * MiB
# A header larger than this is not a weights file (safetensors' own limit).
_MAX_HEADER_BYTES = 100_000_000

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Readable(Protocol):
    """What a weights file is read through: a file opened "rb", or an object store's stream."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int: ...


Opener = Callable[[str], AbstractContextManager[Readable]]


def weight_files(names: Collection[str], open_file: Opener) -> list[str]:
    """The safetensors files holding a model directory's weights, given the names of its files:
    the shards its index names, in order, or its single file. ValueError if it has neither."""
    if INDEX_FILE in names:
        with open_file(INDEX_FILE) as stream:
            index = json.loads(stream.read())
        shards = sorted(set(index["weight_map"].values()))
        if absent := [s for s in shards if s not in names]:
            raise ValueError(f"{INDEX_FILE} names shards that are not there: {absent[:3]}; the upload is incomplete")
        return shards
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    raise ValueError(
        f"no {INDEX_FILE} or {SINGLE_FILE} among {sorted(names)[:5]}: not a full-weight model directory "
        "(save it with save_policy)"
    )


def load_weight_files(model: nn.Module, names: Collection[str], open_file: Opener) -> int:
    """Copy the full weights of a model directory into `model`'s parameters and buffers in place,
    file by file; `names` are the directory's files and `open_file(name)` opens one. Returns the
    number of weight files read.

    Names and shapes are checked against the model before a file's data is read; every weight
    of the model must be in the files (a tied weight once). A file that fails midway (the store
    cut off, say) leaves the model holding parts of two versions: serve it only after a load
    that returned."""
    targets = model.state_dict()  # detached tensors that share the parameters' storage
    files = weight_files(names, open_file)
    loaded: set[str] = set()
    for name in files:
        with open_file(name) as stream:
            loaded |= _read_file(stream, targets, name)
    held = {targets[n].data_ptr() for n in loaded}
    missing = [n for n, t in targets.items() if n not in loaded and t.data_ptr() not in held]
    if missing:
        raise ValueError(
            f"the weight files hold no value for {len(missing)} of the model's weights, e.g. {missing[:3]}"
        )
    return len(files)


def _read_file(stream: Readable, targets: Mapping[str, torch.Tensor], file: str) -> set[str]:
    """Read one safetensors file from `stream` into `targets`; the names it held."""
    (size,) = struct.unpack("<Q", _read_exact(stream, 8, file))
    if size > _MAX_HEADER_BYTES:
        raise ValueError(f"{file} is not a safetensors file (its header would be {size} bytes)")
    header = json.loads(_read_exact(stream, size, file))
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    for name, entry in entries:
        _check(name, entry, targets, file)
    position = 0
    with torch.no_grad():
        for name, entry in entries:
            begin, end = entry["data_offsets"]
            _read_exact(stream, begin - position, file)  # padding between tensors, if any
            _read_tensor(stream, targets[name], _DTYPES[entry["dtype"]], end - begin, file)
            position = end
    if stream.read(1):  # also the read that lets a checksumming stream check the whole object
        raise ValueError(f"{file} holds data after its last tensor: it is not a safetensors file")
    return set(header)


def _check(name: str, entry: Mapping[str, Any], targets: Mapping[str, torch.Tensor], file: str) -> None:
    if name not in targets:
        raise ValueError(
            f"{file} holds {name!r}, which the model does not have: the weights are of another architecture, or "
            "named as a checkpoint transformers converts on load; load them with from_pretrained"
        )
    target, dtype = targets[name], _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{file}: {name!r} has dtype {entry['dtype']}, which this reader does not know")
    if list(entry["shape"]) != list(target.shape):
        raise ValueError(f"{file}: {name!r} has shape {entry['shape']}, the model's is {list(target.shape)}")
    begin, end = entry["data_offsets"]
    if end - begin != target.numel() * dtype.itemsize:
        raise ValueError(f"{file}: {name!r} spans {end - begin} bytes, not {target.numel()} x {dtype.itemsize}")
    if not target.is_contiguous():
        raise ValueError(f"the model's {name!r} is not contiguous in memory: it cannot be read into in place")


def _read_tensor(stream: Readable, target: torch.Tensor, dtype: torch.dtype, nbytes: int, file: str) -> None:
    """`nbytes` of `dtype` values from `stream` into `target` (contiguous, checked by `_check`):
    straight into its memory when it is on the CPU in that dtype, else through a staging buffer
    of `CHUNK_BYTES`, converted and copied a chunk at a time."""
    flat = target.view(-1)
    if target.device.type == "cpu" and target.dtype == dtype:
        _read_into(stream, memoryview(flat.view(torch.uint8).numpy()), file)
        return
    staging = torch.empty(min(nbytes, CHUNK_BYTES), dtype=torch.uint8)
    buffer = memoryview(staging.numpy())
    for start in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - start)
        _read_into(stream, buffer[:n], file)
        first = start // dtype.itemsize
        flat[first : first + n // dtype.itemsize].copy_(staging[:n].view(dtype))


def _read_into(stream: Readable, buffer: memoryview, file: str) -> None:
    """Fill `buffer` from `stream`, `CHUNK_BYTES` at a time at most."""
    done = 0
    while done < len(buffer):
        n = stream.readinto(buffer[done : done + CHUNK_BYTES])
        if not n:
            raise ValueError(f"{file} ended early: the file is truncated")
        done += n


def _read_exact(stream: Readable, n: int, file: str) -> bytes:
    data = bytearray(n)
    _read_into(stream, memoryview(data), file)
    return bytes(data)

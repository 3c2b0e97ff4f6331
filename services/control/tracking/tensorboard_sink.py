"""TensorBoard: event files in the object store, under ``runs/<run>/tensorboard/``.

Written here rather than with a writer package: an event file is a TFRecord file (each record
framed by its length and masked CRC32C checksums) of ``Event`` protobufs, and the one kind of
event needed, ``Event{wall_time, step, summary{value{tag, simple_value}}}``, takes a few lines
of protobuf encoding. tensorboardX would bring numpy and protobuf into the control plane and
writes to local files from a thread of its own; the object store takes bytes.

The object store has no append, so each sync writes new files, each a whole event file, which
TensorBoard reads as one directory (in file-name order). A file is named by the first step it
holds and its kind (iterations, evaluations), zero-padded so that names sort by step:
``events.out.tfevents.0000000007.spotrl-train``. A sync that is repeated from the same cursor (a
scheduler that died after writing and before advancing the cursor) starts at the same step, so
it overwrites that file with the same points and perhaps more, and repeats none. Iterations and
evaluations go to files of their own: an evaluation of an older version, arriving after newer
iterations were written, never changes which step an iteration file starts at.

Sources: the record framing and checksum mask of TensorFlow's ``core/lib/io/record_writer.cc``
and ``core/lib/hash/crc32c.h``; the messages of ``core/util/event.proto`` and
``core/framework/summary.proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from services.control.tracking.points import Point
from services.ports.objects.object_store import ObjectStore

FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> list[int]:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of each byte value."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data``; ``crc32c(b"123456789") == 0xE3069283`` (RFC 3720's check value)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant, so that a CRC of
    data that holds CRCs is not trivially related to them (``crc32c.h``: ``Mask``)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One record: length (uint64), its masked CRC, the data, the data's masked CRC (little-endian)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string or an embedded message."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def event(
    wall_time: float, step: int, values: dict[str, float] | None = None, *, file_version: bytes | None = None
) -> bytes:
    """An ``Event``: wall_time (1, double), step (2, int64), and file_version (3) or a summary (5)
    of ``Summary.Value``s, each a tag (1) and a simple_value (2, float)."""
    if step < 0:
        raise ValueError(f"a step is a count from 0, not {step}")
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version)
    if values:
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in values.items()
        )
        out += _bytes_field(5, summary)
    return out


def event_file(points: Sequence[Point]) -> bytes:
    """A whole event file of ``points``: the file-version event first, as TensorFlow writes it,
    at the first point's time (so a file rewritten from the same step starts with the same bytes)."""
    first = points[0]
    records = [tfrecord(event(first.wall_time, first.step, file_version=FILE_VERSION))]
    records += [tfrecord(event(p.wall_time, p.step, p.values)) for p in points if p.values]
    return b"".join(records)


def tensorboard_prefix(run_id: str) -> str:
    """The run's TensorBoard directory in the object store (``tensorboard --logdir s3://bucket/<prefix>``)."""
    return f"runs/{run_id}/tensorboard/"


class TensorBoardSink:
    """Event files of a run's points in the object store; nothing to open, nothing to end."""

    name = "tensorboard"

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects

    def write(self, run_id: str, points: Sequence[Point]) -> None:
        for kind, part in (
            ("train", [p for p in points if not p.is_eval()]),
            ("eval", [p for p in points if p.is_eval()]),
        ):
            if part:
                key = f"{tensorboard_prefix(run_id)}events.out.tfevents.{part[0].step:010d}.spotrl-{kind}"
                self._objects.put_bytes(key, event_file(part))

    def end_run(self, run_id: str, status: str, ended_at: float) -> None:
        """TensorBoard has no notion of a run's end."""

    def close(self) -> None:
        """Nothing held open."""

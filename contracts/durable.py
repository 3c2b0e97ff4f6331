"""Flushing files and directory entries to disk (fsync), so that a write-then-rename survives a
power loss; shared by checkpoints and the local object store. No torch import."""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush `path` to disk: a file's contents, or a directory's entries (a rename into a
    directory is durable only once they are)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """`fsync` every file under `directory`."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fsync(Path(dirpath, name))

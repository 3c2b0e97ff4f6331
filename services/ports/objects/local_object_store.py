"""The object store's embedded adapter: objects as files under a directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from contracts.durable import fsync
from services.ports.objects.object_store import (
    STAGING,
    ObjectNotFoundError,
    check_key,
    check_prefix,
    folder_key,
)

# A concurrent delete_prefix may remove the folder a put just made; the put then makes it again.
_PUT_ATTEMPTS = 3


class LocalObjectStore:
    """Objects as files under ``root``: key ``a/b/c`` is the file ``root/a/b/c``.

    Unlike S3, a key cannot also be a folder of other keys (``a`` and ``a/b`` cannot both exist).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put(key, lambda out: out.write(data))

    def put_file(self, key: str, path: Path) -> None:
        with path.open("rb") as src:
            self._put(key, lambda out: shutil.copyfileobj(src, out))

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as stream:
            return stream.read()

    def open(self, key: str) -> BinaryIO:
        try:
            return self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {key!r} in {self.root}", key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        # Only the folder holding the prefix's last (possibly partial) part can contain matches.
        folder = prefix.rpartition("/")[0]
        keys = []
        for dirpath, dirnames, filenames in os.walk(self.root / folder):
            relative = Path(dirpath).relative_to(self.root).as_posix()
            if relative == ".":
                dirnames[:] = [d for d in dirnames if d != STAGING]
            keys += [folder_key("" if relative == "." else relative, name) for name in filenames]
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("refusing to delete every object: pass a non-empty prefix")
        for key in self.list(prefix):
            path = self._path(key)
            path.unlink(missing_ok=True)
            # Remove folders left empty, so the name can become a key again.
            for folder in path.parents:
                if folder == self.root:
                    break
                try:
                    folder.rmdir()
                except OSError:  # not empty (or gone): the folders above are in use too
                    break

    def upload_dir(self, local_dir: Path, prefix: str) -> None:
        if not local_dir.is_dir():
            raise NotADirectoryError(f"cannot upload {local_dir}: it is not a directory")
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            key = folder_key(prefix, path.relative_to(local_dir).as_posix())
            with path.open("rb") as src:
                self._put(key, lambda out: shutil.copyfileobj(src, out))

    def download_dir(self, prefix: str, local_dir: Path) -> None:
        folder = folder_key(prefix, "")
        keys = self.list(folder)
        if not keys:
            raise ObjectNotFoundError(f"no objects under {folder!r} in {self.root}", folder)
        for key in keys:
            target = local_dir / key[len(folder) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(self._path(key), target)
            except FileNotFoundError:
                raise ObjectNotFoundError(f"object {key!r} was deleted during the download", key) from None

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    def _put(self, key: str, write: Callable[[BinaryIO], object]) -> None:
        """Write to a staging file, fsync, and rename it over ``key``: the rename is the atomic step."""
        path = self._path(key)
        staging = self.root / STAGING
        staging.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=staging)
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            for attempt in range(_PUT_ATTEMPTS):
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, path)
                    break
                except FileNotFoundError:
                    if attempt == _PUT_ATTEMPTS - 1:
                        raise
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise ValueError(
                f"cannot store {key!r} in {self.root}: a key on its path is an object, or it is itself a folder"
                " of other keys, and a local store cannot hold both 'a' and 'a/b'"
            ) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        fsync(path.parent)

"""The contract every ObjectStore adapter passes (the adapters: tests/services/ports/objects/adapters.py).

Beyond each method's own: a policy version is published as files, then a marker that says so
(``services.domain.names.result_key``), and read only once the marker is there. That holds because
``upload_dir`` returns only once every file is stored, and a new client sees what was stored
(``test_a_marker_put_after_upload_dir_is_seen_with_every_file``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectNotFoundError, ObjectStore
from tests.services.ports.objects.adapters import ADAPTERS


@pytest.fixture(params=sorted(ADAPTERS))
def new_client(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ObjectStore]:
    return lambda: ADAPTERS[request.param](request, tmp_path)


@pytest.fixture
def store(new_client: Callable[[], ObjectStore]) -> ObjectStore:
    return new_client()


def test_put_then_get(store: ObjectStore) -> None:
    store.put_bytes("runs/r1/a.bin", b"\x00hello")
    assert store.get_bytes("runs/r1/a.bin") == b"\x00hello"
    assert store.exists("runs/r1/a.bin")
    store.put_bytes("runs/r1/a.bin", b"")
    assert store.get_bytes("runs/r1/a.bin") == b""


def test_put_file_stores_the_file_as_it_is(store: ObjectStore, tmp_path: Path) -> None:
    source = tmp_path / "set.jsonl"
    data = bytes(range(256)) * 4096 + b"end"  # 1 MiB and a tail
    source.write_bytes(data)
    store.put_file("datasets/d.jsonl", source)
    assert store.get_bytes("datasets/d.jsonl") == data
    source.write_bytes(b"")
    store.put_file("datasets/d.jsonl", source)
    assert store.get_bytes("datasets/d.jsonl") == b""
    assert store.list("") == ["datasets/d.jsonl"]
    with pytest.raises(ValueError):
        store.put_file("../escape", source)


def test_open_reads_an_object_front_to_back_in_parts(store: ObjectStore) -> None:
    data = bytes(range(256)) * 4096 * 3 + b"end"  # 3 MiB and a tail
    store.put_bytes("runs/r/v1/model.safetensors", data)
    buffer = bytearray(1 << 20)
    with store.open("runs/r/v1/model.safetensors") as stream:
        head = stream.read(1000)
        filled = stream.readinto(memoryview(buffer))
        rest = stream.read()
        assert stream.read(10) == b"" and stream.readinto(memoryview(buffer)) == 0
    assert len(head) == 1000 and 0 < filled <= len(buffer)
    assert head + buffer[:filled] + rest == data
    with pytest.raises(ObjectNotFoundError, match="runs/none"):
        store.open("runs/none")


def test_a_missing_object_is_an_error_naming_the_key(store: ObjectStore) -> None:
    assert not store.exists("runs/none")
    with pytest.raises(ObjectNotFoundError, match="runs/none") as caught:
        store.get_bytes("runs/none")
    assert isinstance(caught.value, KeyError)
    store.put_bytes("runs/r1/a", b"x")
    assert not store.exists("runs/r1")  # a folder is not an object
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("runs/r1")


def test_list_is_sorted_and_matches_by_string_prefix(store: ObjectStore) -> None:
    for key in ["runs/r/v10/x", "runs/r/v1/b", "runs/r/v1/a", "runs/q/z", "top"]:
        store.put_bytes(key, key.encode())
    assert store.list("runs/r/v1/") == ["runs/r/v1/a", "runs/r/v1/b"]
    assert store.list("runs/r/v1") == ["runs/r/v1/a", "runs/r/v1/b", "runs/r/v10/x"]
    assert store.list("runs/r/v1/a") == ["runs/r/v1/a"]
    assert store.list("runs/") == ["runs/q/z", "runs/r/v1/a", "runs/r/v1/b", "runs/r/v10/x"]
    assert store.list("") == ["runs/q/z", "runs/r/v1/a", "runs/r/v1/b", "runs/r/v10/x", "top"]
    assert store.list("nothing/") == []


def test_delete_prefix(store: ObjectStore) -> None:
    for key in ["runs/r/v1/a", "runs/r/v1/sub/b", "runs/r/v10/x", "runs/r/opt.pt", "runs/r/opt.pt.old"]:
        store.put_bytes(key, b"x")
    store.delete_prefix("runs/r/v1/")
    assert store.list("") == ["runs/r/opt.pt", "runs/r/opt.pt.old", "runs/r/v10/x"]
    store.delete_prefix("runs/r/opt.pt")
    assert store.list("") == ["runs/r/v10/x"]
    store.delete_prefix("runs/none/")  # nothing to delete is fine
    with pytest.raises(ValueError, match="non-empty prefix"):
        store.delete_prefix("")
    store.put_bytes("runs/r/v1", b"a key where a folder was")
    assert store.get_bytes("runs/r/v1") == b"a key where a folder was"


def test_upload_then_download_a_directory(store: ObjectStore, tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "sub" / "deeper").mkdir(parents=True)
    files = {"model.safetensors": b"\x01" * 100_000, "sub/config.json": b"{}", "sub/deeper/.hidden": b"h"}
    for relative, data in files.items():
        (source / relative).write_bytes(data)

    store.upload_dir(source, "runs/r/policy/v1/")
    store.upload_dir(source, "runs/r/policy/v2")  # with or without the trailing '/'
    assert store.list("runs/r/policy/v1/") == sorted(f"runs/r/policy/v1/{k}" for k in files)
    assert store.list("runs/r/policy/v2/") == sorted(f"runs/r/policy/v2/{k}" for k in files)

    store.put_bytes("runs/r/policy/v10/other", b"not part of v1")
    target = tmp_path / "dst"
    store.download_dir("runs/r/policy/v1", target)
    downloaded = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert downloaded == files


def test_downloading_an_empty_prefix_is_an_error(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError, match="runs/r/policy/v9/"):
        store.download_dir("runs/r/policy/v9/", tmp_path / "dst")


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a/"])
def test_keys_escaping_the_store_or_empty_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        store.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="invalid"):
        store.get_bytes(key)


def test_readers_see_the_old_or_the_whole_new_object(store: ObjectStore) -> None:
    old, new = b"o" * 1_000_000, b"n" * 2_000_000
    store.put_bytes("k", old)
    seen: set[bytes] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(store.get_bytes("k"))

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(20):
        store.put_bytes("k", new)
        store.put_bytes("k", old)
    done.set()
    reader.join()
    assert seen <= {old, new}


def test_a_marker_put_after_upload_dir_is_seen_with_every_file(
    new_client: Callable[[], ObjectStore], tmp_path: Path
) -> None:
    """Publication as the training job does it: the files, then the marker. A reader (another
    client, as a rollout worker is) that sees the marker downloads every file whole."""
    writer, reader = new_client(), new_client()
    source = tmp_path / "v1"
    (source / "sub").mkdir(parents=True)
    files = {"model.safetensors": b"w" * 3_000_000, "config.json": b"{}", "sub/tokenizer.json": b"t" * 10_000}
    for relative, data in files.items():
        (source / relative).write_bytes(data)
    marker = "runs/r/trainer/v1/result.json"
    seen: list[dict[str, bytes]] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            if reader.exists(marker):
                target = tmp_path / f"read-{len(seen)}"
                reader.download_dir("runs/r/policy/v1/", target)
                seen.append(
                    {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
                )
                return

    thread = threading.Thread(target=read)
    thread.start()
    try:
        writer.upload_dir(source, "runs/r/policy/v1/")
        writer.put_bytes(marker, b"{}")
        thread.join(timeout=60)
    finally:
        done.set()
        thread.join()
    assert seen == [files]


def test_local_store_keeps_no_staging_files_and_reads_through_a_new_client(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put_bytes("a/b", b"1")
    assert LocalObjectStore(tmp_path / "objects").list("") == ["a/b"]
    assert sorted(p.name for p in (tmp_path / "objects").iterdir()) == [".staging", "a"]
    assert list((tmp_path / "objects" / ".staging").iterdir()) == []
    with pytest.raises(ValueError, match="invalid"):
        store.put_bytes(".staging/x", b"")


def test_local_store_cannot_hold_a_key_and_a_folder_of_the_same_name(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put_bytes("a/b", b"1")
    with pytest.raises(ValueError, match="cannot store 'a'"):
        store.put_bytes("a", b"2")
    with pytest.raises(ValueError, match="cannot store 'a/b/c'"):
        store.put_bytes("a/b/c", b"3")
    assert store.list("") == ["a/b"]

"""The persister's shard write (:func:`storage.write_shard`): the crc32 of a file of
several pieces is computed while each piece is written, and is the crc32 of the bytes
on disk. No Ray."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from dlrover_core import atomic_io
from dlrover_plugin_flashckpt import storage

PIECE = 4096  # storage.CHUNK for these tests: many pieces from a small payload


def _payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


def _files(marker: dict, tmp: str) -> dict[str, bytes]:
    out = {}
    for plain, f in marker["files"].items():
        with open(os.path.join(tmp, f["tmp"]), "rb") as fh:
            out[plain] = fh.read()
    return out


@pytest.mark.parametrize("n", [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 17])
def test_crc32_is_of_the_bytes_written_at_every_size(tmp_path, monkeypatch, n):
    monkeypatch.setattr(storage, "CHUNK", PIECE)
    data = _payload(n)
    marker = storage.write_shard(str(tmp_path), 3, 0, 1, b"meta" * 3000, memoryview(data))
    files = _files(marker, storage.tmp_dir(str(tmp_path), 3))
    data_name, meta_name = storage.rank_files(0)
    assert files[data_name] == data and files[meta_name] == b"meta" * 3000
    assert marker["files"][data_name] == {"bytes": n, "crc32": zlib.crc32(data),
                                          "tmp": marker["files"][data_name]["tmp"]}
    assert marker["files"][meta_name]["crc32"] == zlib.crc32(b"meta" * 3000)


def test_crc32_of_a_piece_runs_while_that_piece_is_written(tmp_path, monkeypatch):
    """Each piece's crc32 waits (up to 10 s) for the write of the same piece to have
    begun: done one after the other in one thread, as before, it never would."""
    monkeypatch.setattr(storage, "CHUNK", PIECE)
    data = _payload(4 * PIECE)
    writing: dict[int, threading.Event] = {i: threading.Event() for i in range(4)}
    overlapped: list[int] = []
    crc_threads: set[str] = set()
    real_crc, real_write = zlib.crc32, atomic_io.write_all

    class Zlib:
        @staticmethod
        def crc32(chunk, value=0):
            piece = bytes(chunk[:16])
            i = next((k for k in range(4) if data[k * PIECE:k * PIECE + 16] == piece
                      and len(chunk) == PIECE), None)
            if i is not None:
                crc_threads.add(threading.current_thread().name)
                if writing[i].wait(10):
                    overlapped.append(i)
            return real_crc(chunk, value)

    def write_all(f, chunk):
        for k in range(4):
            if len(chunk) == PIECE and bytes(chunk[:16]) == data[k * PIECE:k * PIECE + 16]:
                writing[k].set()
        return real_write(f, chunk)

    monkeypatch.setattr(storage, "zlib", Zlib)
    monkeypatch.setattr(storage, "write_all", write_all)
    marker = storage.write_shard(str(tmp_path), 1, 0, 1, b"m", memoryview(data))
    data_name, _ = storage.rank_files(0)
    assert overlapped == [0, 1, 2, 3]
    assert threading.current_thread().name not in crc_threads
    assert marker["files"][data_name]["crc32"] == real_crc(data)


def test_a_failed_write_leaves_no_file_and_no_crc_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "CHUNK", PIECE)
    calls = []
    real_write = atomic_io.write_all

    def write_all(f, chunk):
        calls.append(len(chunk))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(f, chunk)

    pools: list[ThreadPoolExecutor] = []

    class Pool(ThreadPoolExecutor):  # records the helper pools this write makes
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            pools.append(self)

    monkeypatch.setattr(storage, "write_all", write_all)
    monkeypatch.setattr(storage, "ThreadPoolExecutor", Pool)
    with pytest.raises(OSError) as e:
        storage.write_shard(str(tmp_path), 2, 0, 1, b"m", memoryview(_payload(6 * PIECE)))
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(storage.tmp_dir(str(tmp_path), 2)) == []
    threads = [t for p in pools for t in p._threads]
    assert threads and not [t for t in threads if t.is_alive()]

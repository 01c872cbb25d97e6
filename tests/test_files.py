"""Open files (files.py) racing the ordered log, with the mount's components built over an
in-memory S3: the log applies an earlier put at a moment the test chooses, which a real
server cannot be made to show on cue. Through FUSE these races are in test_pjdfstest.py
(truncate/05.t lost one once: the log moved the file's bytes while a truncate copied them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs import files as files_module
from ckptfs.config import Config
from ckptfs.daemon import Mount, build_mount
from ckptfs.inodes import ROOT_INODE, Inode
from ckptfs.listing import SYMLINK_MAX
from fakes3 import MemoryS3


@asynccontextmanager
async def mounted(tmp_path: Path, s3: MemoryS3, durability: str) -> AsyncIterator[Mount]:
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability=durability, upload_timeout=10)
    async with trio.open_nursery() as nursery:
        yield await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()


def gate_puts(s3: MemoryS3) -> trio.Event:
    """Hold every PutObject until the event is set."""
    go = trio.Event()
    s3.faults.hold("PUT", go)
    return go


async def closed_file(mount: Mount, name: str, data: bytes) -> Inode:
    """A file written and closed through the mount's components, its handle released."""
    node = mount.files.create(mount.fs.table[ROOT_INODE], name, 0o644, 0, 0)
    assert await mount.files.write(node, 0, data) == len(data)
    await mount.files.close(node, None)
    await mount.files.release(node, writable=True)
    return node


def staged_files(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "cache" / "staging"))


async def test_a_truncate_by_path_while_the_log_publishes_the_bytes_it_copies(
        tmp_path: Path, monkeypatch) -> None:
    """truncate(2) of a closed file whose put waits in the log copies the staged bytes (the
    entry keeps them). If the put is applied during that copy, its bytes move to the read
    cache: the truncate must start from them there, not fail with ENOENT."""
    s3 = MemoryS3()
    puts = gate_puts(s3)
    copying, go_on = threading.Event(), threading.Event()
    copy_file = files_module.copy_file

    def slow_copy(src: str, fd: int, size: int) -> None:
        copying.set()
        assert go_on.wait(10)
        copy_file(src, fd, size)
    monkeypatch.setattr(files_module, "copy_file", slow_copy)
    data = os.urandom(200)
    async with mounted(tmp_path, s3, "async") as mount:
        node = await closed_file(mount, "f", data)
        assert node.pending == 1 and node.staged is not None and node.staged.held
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mount.files.truncate, node, 1234)
            with trio.fail_after(10):
                while not copying.is_set():
                    await trio.sleep(0.01)
                puts.set()  # the put is applied while the truncate copies
                await mount.log.drain()
            assert node.pending == 0
            go_on.set()
        assert node.size == 1234 and node.staged is not None
        assert node.staged.pread(2000, 0) == data + bytes(1034)
        await mount.changes.publish(node, background=False)
        with trio.fail_after(10):
            await mount.log.drain()
        assert len(staged_files(tmp_path)) <= 1
    assert s3.objects["p/f"] == data + bytes(1034)


async def test_two_opens_for_writing_at_once_share_one_staged_copy(tmp_path: Path) -> None:
    """Two writers open a file S3 has at the same time: both wait for its download, and then
    write into the same staged copy (never each into their own, one of them lost)."""
    s3 = MemoryS3()
    s3.store._store("p/f", b"a" * 100, {}, "put", '"e1"')
    fetched = trio.Event()
    s3.faults.hold("GET", fetched)
    async with mounted(tmp_path, s3, "close") as mount:
        node = await mount.fs.ns.lookup(mount.fs.table[ROOT_INODE], "f")
        assert node is not None and node.size == 100
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mount.files.open_for_write, node, False)
            nursery.start_soon(mount.files.open_for_write, node, False)
            await trio.sleep(0.1)
            fetched.set()
        assert node.writers == 2 and node.staged is not None
        assert len(staged_files(tmp_path)) == 1
        await mount.files.write(node, 0, b"b" * 10)
        await mount.files.write(node, 90, b"c" * 10)
        for _ in range(2):
            await mount.files.close(node, None)
            await mount.files.release(node, writable=True)
    assert s3.objects["p/f"] == b"b" * 10 + b"a" * 80 + b"c" * 10


async def test_an_answer_from_s3_never_overrules_a_write_made_while_it_was_on_its_way(
        tmp_path: Path) -> None:
    """A lookup HEADs a clean file; before S3 answers, a writer opens the file and makes it
    longer. The answer (the old size) predates the write: it must not shrink the file, or
    close would upload only the old size's bytes."""
    s3 = MemoryS3()
    s3.store._store("p/f", b"a" * 100, {}, "put", '"e1"')
    async with mounted(tmp_path, s3, "close") as mount:
        root = mount.fs.table[ROOT_INODE]
        node = await mount.fs.ns.lookup(root, "f")
        assert node is not None and node.size == 100
        node.validated_at = 0.0  # past the TTL: the next lookup asks S3
        answer = trio.Event()
        head = s3.head

        async def slow_head(*args, **kwargs):  # type: ignore[no-untyped-def]
            info = await head(*args, **kwargs)
            await answer.wait()
            return info
        s3.head = slow_head  # type: ignore[method-assign]
        found: list[Inode | None] = []

        async def look() -> None:
            found.append(await mount.fs.ns.lookup(root, "f"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await trio.sleep(0.05)
            await mount.files.open_for_write(node, False)
            await mount.files.write(node, 100, b"b" * 200)
            answer.set()
        assert found == [node] and node.size == 300
        await mount.files.close(node, None)
        await mount.files.release(node, writable=True)
    assert s3.objects["p/f"] == b"a" * 100 + b"b" * 200


async def test_a_stat_answered_by_s3_never_shrinks_a_file_written_meanwhile(tmp_path: Path) -> None:
    """stat() of a clean file past the TTL HEADs it; before S3 answers, a writer opens the
    file and makes it longer. The old size must not replace the new one (close would then
    upload only the old size's bytes)."""
    s3 = MemoryS3()
    s3.store._store("p/f", b"a" * 100, {}, "put", '"e1"')
    async with mounted(tmp_path, s3, "close") as mount:
        node = await mount.fs.ns.lookup(mount.fs.table[ROOT_INODE], "f")
        assert node is not None and node.size == 100
        node.validated_at = 0.0  # past the TTL: getattr asks S3
        answer = trio.Event()
        s3.faults.hold("HEAD", answer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mount.fs.getattr, node.ino, None)
            await trio.sleep(0.05)
            await mount.files.open_for_write(node, False)
            await mount.files.write(node, 100, b"b" * 200)
            answer.set()
        assert node.size == 300
        await mount.files.close(node, None)
        await mount.files.release(node, writable=True)
    assert s3.objects["p/f"] == b"a" * 100 + b"b" * 200


@pytest.mark.parametrize("asked_by", ["head", "listing"])
async def test_an_answer_from_s3_never_shows_a_version_older_than_the_mount_just_wrote(
        tmp_path: Path, asked_by: str) -> None:
    """A lookup asks S3 about a clean file (a HEAD; or, in a listed directory, one LIST
    page); before it answers, the mount writes a new version and the log puts it. The
    answer names the old version: the name must go on showing the new one."""
    s3 = MemoryS3()
    s3.store._store("p/f", b"a" * SYMLINK_MAX * 2, {}, "put", '"e1"')  # no HEAD for its kind
    async with mounted(tmp_path, s3, "async") as mount:
        root, ns = mount.fs.table[ROOT_INODE], mount.fs.ns
        if asked_by == "listing":
            await ns.list_dir(root)
        node = await ns.lookup(root, "f")
        assert node is not None and node.etag == '"e1"'
        node.lookups = 1  # the kernel knows it
        node.validated_at = 0.0
        ns.invalidate_listing(root.ino)
        if asked_by == "listing":
            ns._listed[root.ino] = 0.0  # listed once, long ago
        answer = trio.Event()
        op = "head" if asked_by == "head" else "list_page"
        ask = getattr(s3, op)

        async def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            info = await ask(*args, **kwargs)
            if not answer.is_set():
                setattr(s3, op, ask)  # only the lookup's request waits (the log asks too)
                await answer.wait()
            return info
        setattr(s3, op, slow)
        found: list[Inode | None] = []

        async def look() -> None:
            found.append(await ns.lookup(root, "f"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await trio.sleep(0.05)
            await mount.files.open_for_write(node, True)
            await mount.files.write(node, 0, b"b" * SYMLINK_MAX * 3)
            await mount.files.close(node, None)
            await mount.files.release(node, writable=True)
            with trio.fail_after(10):
                await mount.log.drain()
            assert node.etag != '"e1"'
            answer.set()
        assert found == [node] and node.size == SYMLINK_MAX * 3 and node.etag == s3.etags["p/f"]


def gate_journal(mount: Mount) -> tuple[trio.Event, trio.Event]:
    """Hold the log's journal writes (an append) until `go` is set; `waiting` says one waits."""
    waiting, go = trio.Event(), trio.Event()
    write = mount.log._write

    async def held(rec):  # type: ignore[no-untyped-def]
        waiting.set()
        await go.wait()
        await write(rec)
    mount.log._write = held  # type: ignore[method-assign]
    return waiting, go


async def test_a_write_racing_a_close_goes_into_the_next_put_not_the_one_close_appended(
        tmp_path: Path) -> None:
    """A second writer of a file writes while the first one's close is appending the put (its
    journal write). The put must publish the file as it was at that close, never with part of
    the later write in it: S3 shows only states the file had."""
    s3 = MemoryS3()
    puts = gate_puts(s3)
    async with mounted(tmp_path, s3, "async") as mount:
        node = mount.files.create(mount.fs.table[ROOT_INODE], "f", 0o644, 0, 0)
        await mount.files.write(node, 0, b"a" * 100)
        waiting, go = gate_journal(mount)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mount.files.close, node, None)
            with trio.fail_after(10):
                await waiting.wait()
            await mount.files.write(node, 50, b"b" * 100)  # the other writer, meanwhile
            go.set()
        assert node.dirty and node.size == 150
        puts.set()
        with trio.fail_after(10):
            await mount.log.drain()
        assert s3.objects["p/f"] == b"a" * 100  # not a * 50 + b * 50: the file never held that
        await mount.files.close(node, None)
        await mount.files.release(node, writable=True)
        with trio.fail_after(10):
            await mount.log.drain()
        assert len(staged_files(tmp_path)) <= 1
    assert s3.objects["p/f"] == b"a" * 50 + b"b" * 100


async def test_two_closes_at_once_append_one_put(tmp_path: Path) -> None:
    """Two handles of a file written in parts close at the same moment (two FLUSHes). Only
    one put is appended, with the parts streamed during the write (two puts both took over
    the one multipart upload: the second found it completed, NoSuchUpload, and published
    the same bytes again)."""
    s3 = MemoryS3()
    async with mounted(tmp_path, s3, "async") as mount:
        part = mount.uploader.plan.base_size
        data = os.urandom(2 * part + 1000)
        node = mount.files.create(mount.fs.table[ROOT_INODE], "f", 0o644, 0, 0)
        await mount.files.open_for_write(node, False)  # a second handle
        await mount.files.write(node, 0, data)
        waiting, go = gate_journal(mount)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mount.files.close, node, None)
            nursery.start_soon(mount.files.close, node, None)
            with trio.fail_after(10):
                await waiting.wait()
            await trio.sleep(0.05)
            go.set()
        assert node.pending <= 1 and len(mount.log) <= 1
        with trio.fail_after(10):
            await mount.log.drain()
        for _ in range(2):
            await mount.files.release(node, writable=True)
    assert s3.objects["p/f"] == data
    assert [k for _, k in s3.visible].count("p/f") == 1  # published once

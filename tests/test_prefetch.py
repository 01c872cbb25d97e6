"""The read path's buffer pool and disk cache, against a fake S3 that answers slowly and out
of order (the real mount and server are in test_reads.py; these need sizes it cannot set)."""

from __future__ import annotations

import errno
import mmap
import os
import random
from pathlib import Path

import pytest
import trio

from ckptfs.cache import ObjectCache
from ckptfs.errors import LocalWriteError, S3Error
from ckptfs.localread import LocalView, store_file
from ckptfs.handles import ReadStream
from ckptfs.prefetch import ChunkReader
from ckptfs.s3wire import read_body_into as _read_body_into

KiB = 1024
CHUNK = 64 * KiB


def content(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


class SlowS3:
    """Answers ranged GETs after a random delay, buffer by buffer like the real client."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.gets = 0  # requests
        self.chunks = 0  # buffers filled
        self.rng = random.Random(7)
        self.hold: trio.Event | None = None  # set: multi-chunk GETs wait here after their first buffer
        self.fail_after_first = False  # multi-chunk GETs fail after their first buffer
        self.failed = 0
        self.full_disk = False  # GETs into files fail as on a full cache disk
        self.file_gets = 0

    async def get_range_into(self, key: str, start: int, buf, length: int, etag=None) -> None:
        await self.get_ranges_into(key, start, [memoryview(buf)[:length]], etag)

    async def get_ranges_into(self, key: str, start: int, outs, etag=None, filled=None) -> None:
        self.gets += 1
        await trio.sleep(self.rng.random() / 200)
        for i, out in enumerate(outs):
            if i == 1 and self.fail_after_first:
                self.failed += 1
                raise S3Error("injected: the connection dropped mid-body", retryable=True)
            out[:] = self.objects[key][start:start + len(out)]
            start += len(out)
            self.chunks += 1
            if filled is not None:
                filled(i)
            if i == 0 and len(outs) > 1 and self.hold is not None:
                await trio.sleep(0.01)  # let the loop run ready() first, as a thread would
                await self.hold.wait()

    async def get_ranges_to_files(self, key: str, start: int, targets, etag=None, filled=None) -> int:
        self.file_gets += 1
        if self.full_disk:
            raise LocalWriteError(errno.ENOSPC, "No space left on device")
        bufs = [bytearray(n) for _, n, _ in targets]

        def written(i: int) -> None:
            os.pwrite(targets[i][0], bufs[i], targets[i][2])
            if filled is not None:
                filled(i)
        await self.get_ranges_into(key, start, [memoryview(b) for b in bufs], etag, written)
        return 0


@pytest.mark.parametrize("into_files", [False, True], ids=["buffers", "files"])
async def test_many_readers_share_a_pool_smaller_than_their_windows_and_get_right_bytes(
        tmp_path: Path, into_files: bool) -> None:
    objects = {f"shard{i}": content(f"shard{i}", 20 * CHUNK + 123) for i in range(8)}
    s3 = SlowS3(objects)
    # Two buffers (or 16 chunks received into files at once) for eight sequential readers
    # with windows of up to eight chunks each, and random readers besides: demand reads
    # must wait for a buffer or a slot, never deadlock.
    reader: ChunkReader

    async def sequential(key: str) -> None:
        data, stream, got = objects[key], ReadStream(), []
        for off in range(0, len(data), 16 * KiB):
            got.append(bytes(await reader.read(key, "e", len(data), off, 16 * KiB, stream)))
        assert b"".join(got) == data

    async def scattered(key: str) -> None:
        data, rng = objects[key], random.Random(key)
        for _ in range(40):
            off, n = rng.randrange(len(data)), rng.randrange(1, 3 * CHUNK)  # some span chunks
            assert bytes(await reader.read(key, "e", len(data), off, n, ReadStream())) == data[off:off + n]

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(s3, ObjectCache(str(tmp_path), 1 << 30),  # type: ignore[arg-type]
                                 chunk_size=CHUNK, memory_budget=2 * CHUNK, max_window=8,
                                 nursery=nursery, into_files=into_files)
            assert reader.to_files == into_files
            for key in objects:
                nursery.start_soon(sequential, key)
            for key in list(objects)[:3]:
                nursery.start_soon(scattered, key)
            while s3.chunks < 8 * 21:  # every chunk fetched at least once
                await trio.sleep(0.01)
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
    assert reader._buffers == (0 if into_files else 2)
    assert reader._receiving == 0


async def test_readahead_fetches_runs_of_chunks_with_one_get_each(tmp_path: Path) -> None:
    data = content("big", 32 * CHUNK + 1)
    s3 = SlowS3({"big": data})
    got, stream = [], ReadStream()
    async with trio.open_nursery() as nursery:
        reader = ChunkReader(s3, None, chunk_size=CHUNK, memory_budget=16 * CHUNK,  # type: ignore[arg-type]
                             max_window=8, get_chunks=4, nursery=nursery)
        for off in range(0, len(data), 32 * KiB):
            got.append(bytes(await reader.read("big", "e", len(data), off, 32 * KiB, stream)))
    assert b"".join(got) == data
    assert s3.chunks == 33  # each chunk fetched once
    assert s3.gets <= 12, s3.gets  # two demand reads, then runs of up to four


async def test_a_chunk_of_a_run_is_served_before_the_rest_of_its_get_arrives(tmp_path: Path) -> None:
    data = content("k", 16 * CHUNK)
    s3 = SlowS3({"k": data})
    s3.hold = trio.Event()
    stream = ReadStream()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(s3, None, chunk_size=CHUNK, memory_budget=16 * CHUNK,  # type: ignore[arg-type]
                                 max_window=8, get_chunks=4, nursery=nursery)
            for off in range(0, 2 * CHUNK, 16 * KiB):  # sequential: readahead of runs begins
                await reader.read("k", "e", len(data), off, 16 * KiB, stream)
            # Chunk 2 heads a run whose GET is held after its first buffer: it is served anyway.
            assert bytes(await reader.read("k", "e", len(data), 2 * CHUNK, 100, stream)) == \
                data[2 * CHUNK:2 * CHUNK + 100]
            assert s3.gets < 2 + 16  # it came from a run, not a GET of its own
            s3.hold.set()
            for off in range(2 * CHUNK, len(data), 16 * KiB):
                assert bytes(await reader.read("k", "e", len(data), off, 16 * KiB, stream)) == \
                    data[off:off + 16 * KiB]


async def test_a_run_that_fails_midway_keeps_its_full_chunks_and_refetches_the_rest(tmp_path: Path) -> None:
    data = content("k", 12 * CHUNK)
    s3 = SlowS3({"k": data})
    cache = ObjectCache(str(tmp_path), 1 << 30)
    s3.fail_after_first = True
    got, stream = [], ReadStream()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(s3, cache, chunk_size=CHUNK, memory_budget=16 * CHUNK,  # type: ignore[arg-type]
                                 max_window=8, get_chunks=4, nursery=nursery)
            for off in range(0, len(data), 16 * KiB):
                got.append(bytes(await reader.read("k", "e", len(data), off, 16 * KiB, stream)))
    assert b"".join(got) == data  # readahead failures cost refetches, never errors
    await reader.settle()
    # The first chunk of every failed run was kept (it went to the disk cache); the others
    # were fetched again by the reader, one GET each.
    assert sorted(p.stat().st_size for p in (tmp_path / "cache").iterdir()) == [CHUNK] * 12
    assert s3.failed >= 2 and s3.chunks == 12  # no chunk fetched twice


async def test_chunks_that_cannot_be_written_to_the_cache_disk_are_read_through_buffers(
        tmp_path: Path) -> None:
    data = content("k", 6 * CHUNK + 7)
    s3 = SlowS3({"k": data})
    s3.full_disk = True
    got, stream = [], ReadStream()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(s3, ObjectCache(str(tmp_path), 1 << 30), chunk_size=CHUNK,  # type: ignore[arg-type]
                                 memory_budget=4 * CHUNK, max_window=8, nursery=nursery)
            assert reader.to_files
            for off in range(0, len(data), 16 * KiB):
                got.append(bytes(await reader.read("k", "e", len(data), off, 16 * KiB, stream)))
    assert b"".join(got) == data
    # One GET into files failed; the reads went on through the buffer pool, and for a while
    # nothing more was sent to the full disk.
    assert s3.file_gets == 1 and reader._buffers > 0
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


async def test_fetched_chunks_are_kept_on_disk_and_served_from_there(tmp_path: Path) -> None:
    data = content("k", 3 * CHUNK + 5)
    s3 = SlowS3({"k": data})
    cache = ObjectCache(str(tmp_path), 1 << 30)
    async with trio.open_nursery() as nursery:
        reader = ChunkReader(s3, cache, chunk_size=CHUNK, memory_budget=2 * CHUNK,  # type: ignore[arg-type]
                             nursery=nursery)
        for off in range(0, len(data), CHUNK):
            await reader.read("k", "e", len(data), off, CHUNK, ReadStream())
    files = sorted((tmp_path / "cache").iterdir())
    assert sorted(p.stat().st_size for p in files) == [5, CHUNK, CHUNK, CHUNK]  # padding dropped
    gets = s3.gets
    async with trio.open_nursery() as nursery:
        again = ChunkReader(s3, ObjectCache(str(tmp_path), 1 << 30), chunk_size=CHUNK,  # type: ignore[arg-type]
                            nursery=nursery)
        got = [bytes(await again.read("k", "e", len(data), off, 1000, ReadStream()))
               for off in range(0, len(data), 1000)]
    assert b"".join(got) == data and s3.gets == gets
    assert again.disk_hits >= len(got) and again.hits == 0  # a read across two chunk files counts two


async def test_a_torn_chunk_file_is_dropped_and_fetched_again(tmp_path: Path) -> None:
    data = content("k", 2 * CHUNK)
    s3 = SlowS3({"k": data})
    async with trio.open_nursery() as nursery:
        reader = ChunkReader(s3, ObjectCache(str(tmp_path), 1 << 30), chunk_size=CHUNK,  # type: ignore[arg-type]
                             nursery=nursery)
        await reader.read("k", "e", len(data), 0, 10, ReadStream())
    (entry,) = (tmp_path / "cache").iterdir()
    os.truncate(entry, 1000)  # a crash wrote it only in part (the sizes are in the index)
    async with trio.open_nursery() as nursery:
        again = ChunkReader(s3, ObjectCache(str(tmp_path), 1 << 30), chunk_size=CHUNK,  # type: ignore[arg-type]
                            nursery=nursery)
        assert bytes(await again.read("k", "e", len(data), 500, 1000, ReadStream())) == data[500:1500]
    assert s3.gets == 2


def _evict_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def test_local_reads_answer_exact_bytes_whether_or_not_their_pages_are_in_memory(
        tmp_path: Path, monkeypatch) -> None:
    data = random.Random(3).randbytes(3 * 1024 * KiB + 123)
    path = tmp_path / "local.bin"
    path.write_bytes(data)
    loads = []
    real_load = LocalView.load
    monkeypatch.setattr(LocalView, "load", lambda self, fd: (loads.append(self.offset), real_load(self, fd)))
    fd = os.open(path, os.O_RDONLY)
    try:
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(None, nursery=nursery)  # type: ignore[arg-type]
            _evict_pages(path)
            assert not LocalView(fd, 4096, 8192).resident()
            # Offsets off the page grid, ranges past the end, the last byte, nothing at all.
            for off, n in [(0, 128 * KiB), (5, 1000), (4097, 1024 * KiB), (len(data) - 1, 10),
                           (len(data) - 5000, 1 << 20), (len(data), 10), (len(data) + 4096, 10)]:
                assert bytes(await reader.read_local(fd, n, off)) == data[off:off + n]
            assert loads, "the pages were out of memory: they must be loaded in a thread"
            loads.clear()
            assert LocalView(fd, 0, 128 * KiB).resident()  # read once: in the page cache now
            assert bytes(await reader.read_local(fd, 100, 200)) == data[200:300]
            assert loads == []  # served straight from memory
    finally:
        os.close(fd)


async def test_a_local_file_that_shrinks_while_its_pages_load_is_answered_up_to_its_new_end(
        tmp_path: Path, monkeypatch) -> None:
    # A truncate (on the FUSE loop) can run while a read waits for the disk. Replying from the
    # mapping past the new end would kill the daemon with SIGBUS.
    data = random.Random(4).randbytes(1024 * KiB)
    path = tmp_path / "staged.bin"
    path.write_bytes(data)
    real_load = LocalView.load

    def load_then_shrink(self: LocalView, fd: int) -> None:
        os.truncate(path, 10 * KiB + 7)
        real_load(self, fd)
    monkeypatch.setattr(LocalView, "load", load_then_shrink)
    fd = os.open(path, os.O_RDONLY)
    try:
        async with trio.open_nursery() as nursery:
            reader = ChunkReader(None, nursery=nursery)  # type: ignore[arg-type]
            _evict_pages(path)
            got = await reader.read_local(fd, 512 * KiB, 8 * KiB)
            assert bytes(got) == data[8 * KiB:10 * KiB + 7]
            path.write_bytes(data)
            _evict_pages(path)
            os.truncate(path, 4 * KiB)  # shrinks below the offset asked for: nothing to answer
            got = await reader.read_local(fd, 512 * KiB, 8 * KiB)
            assert bytes(got) == b""
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_a_fetched_chunk_is_stored_whole_with_or_without_o_direct(tmp_path: Path, monkeypatch,
                                                                   direct: bool) -> None:
    # O_DIRECT needs aligned lengths (padding, then a truncate); a file system without it
    # (EINVAL) gets buffered writes of the exact length.
    real_open = os.open
    opened: list[int] = []

    def spy(path, flags, *args):
        if flags & os.O_DIRECT and not direct:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        fd = real_open(path, flags, *args)
        opened.append(flags)
        return fd
    monkeypatch.setattr(os, "open", spy)
    buf = mmap.mmap(-1, 64 * KiB)
    data = random.Random(5).randbytes(40 * KiB + 123)  # not a multiple of the block size
    buf[:len(data)] = data
    out = tmp_path / "chunk.tmp"
    store_file(str(out), buf, len(data))
    assert out.read_bytes() == data
    assert bool(opened[0] & os.O_DIRECT) == direct  # tmp_path is on ext4, which has O_DIRECT


class _Fp:
    """The http.client response under urllib3: readinto in pieces, maybe failing midway."""

    def __init__(self, data: bytes, piece: int, fail_at: int | None = None) -> None:
        self.data, self.pos, self.piece, self.fail_at = data, 0, piece, fail_at
        self.closed = False

    def readinto(self, out: memoryview) -> int:
        if self.fail_at is not None and self.pos >= self.fail_at:
            raise ConnectionResetError("reset by peer")
        n = min(len(out), self.piece, len(self.data) - self.pos)
        out[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.closed = True


class _Body:
    def __init__(self, data: bytes, fast: bool = True, **fp_args) -> None:
        self.data = data
        self.closed = self.released = False
        if fast:
            self._raw_stream = self
            self._fp = _Fp(data, **fp_args)

    def release_conn(self) -> None:
        self.released = True

    def read(self) -> bytes:
        return self.data

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fast", [True, False])
def test_a_get_body_fills_its_buffers_in_order(fast: bool) -> None:
    data = random.Random(6).randbytes(3 * 10_000)
    outs = [memoryview(bytearray(10_000)) for _ in range(3)]
    filled: list[int] = []
    body = _Body(data, fast, piece=4096) if fast else _Body(data, fast)
    _read_body_into("k", body, outs, filled.append)
    assert b"".join(bytes(o) for o in outs) == data and filled == [0, 1, 2]
    if fast:  # read to its end: the connection goes back to the pool
        assert body._fp.closed and body.released and not body.closed


@pytest.mark.parametrize("fast", [True, False])
def test_a_short_get_body_is_a_retryable_error_and_keeps_the_full_buffers(fast: bool) -> None:
    data = random.Random(7).randbytes(25_000)
    outs = [memoryview(bytearray(10_000)) for _ in range(3)]
    filled: list[int] = []
    body = _Body(data, fast, piece=4096) if fast else _Body(data, fast)
    with pytest.raises(S3Error) as err:
        _read_body_into("k", body, outs, filled.append)
    assert err.value.retryable and "short body" in str(err.value)
    if fast:
        assert filled == [0, 1] and bytes(outs[1]) == data[10_000:20_000]
        assert body.closed and not body.released  # never pool a connection in that state
    else:
        assert filled == []


def test_a_get_body_that_breaks_midway_drops_its_connection() -> None:
    data = random.Random(8).randbytes(30_000)
    outs = [memoryview(bytearray(10_000)) for _ in range(3)]
    filled: list[int] = []
    body = _Body(data, piece=4096, fail_at=12_000)
    with pytest.raises(S3Error) as err:
        _read_body_into("k", body, outs, filled.append)
    assert err.value.retryable and filled == [0]
    assert body.closed and not body.released

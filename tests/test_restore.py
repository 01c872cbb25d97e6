"""Cold reads of whole objects (issue 42): chunks land in the object's own cache file, which
is whole (and a passthrough backing file) the moment its last chunk is in, and local bytes
are replied as FileSlices that pyfuse3's threads send. Against a fake S3 that answers
slowly and out of order (test_prefetch.py's); test_reads.py and test_passthrough.py have
the real mount and server."""

from __future__ import annotations

import os
import random
from pathlib import Path

import trio

from ckptfs.cache import ObjectCache
from ckptfs.handles import ReadStream
from ckptfs.localread import FileSlice, reply_bytes
from ckptfs.prefetch import ChunkReader
from tests.test_prefetch import CHUNK, KiB, SlowS3, content


def _reader(s3: SlowS3, cache: ObjectCache | None, nursery: trio.Nursery,
            **kw) -> ChunkReader:
    reader = ChunkReader(s3, cache, chunk_size=CHUNK, memory_budget=4 * CHUNK,  # type: ignore[arg-type]
                         max_window=8, nursery=nursery, slices=True, **kw)
    if reader.whole is not None:
        reader.whole.enabled = True  # as once the kernel took passthrough
    return reader


async def _read_all(reader: ChunkReader, key: str, data: bytes, step: int = 16 * KiB) -> bytes:
    stream, got = ReadStream(), []
    for off in range(0, len(data), step):
        got.append(reply_bytes(await reader.read(key, "e", len(data), off, step, stream)))
    return b"".join(got)


async def test_a_cold_object_lands_in_one_file_that_is_whole_once_its_last_chunk_is_in(
        tmp_path: Path) -> None:
    data = content("obj", 21 * CHUNK + 77)
    s3 = SlowS3({"obj": data})
    cache = ObjectCache(str(tmp_path), 1 << 30)
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, cache, nursery)
        # The end first (torch.load reads the zip's directory there), then the start.
        tail = await reader.read("obj", "e", len(data), len(data) - 50, 50, ReadStream())
        assert isinstance(tail, FileSlice) and reply_bytes(tail) == data[-50:]
        assert cache.whole_path("obj", "e", len(data)) is None  # not whole yet: no passthrough
        assert await _read_all(reader, "obj", data) == data
    assert cache.whole_path("obj", "e", len(data)) is not None
    assert cache.objects_received == 1 and reader.whole is not None and reader.whole.assembled == 0
    (entry,) = (tmp_path / "cache").iterdir()  # one file, no chunk files, nothing to assemble
    assert entry.name.endswith("-all") and entry.read_bytes() == data
    assert s3.chunks == 22  # each chunk fetched once
    assert reader.bytes_sliced > 0 and cache.total == len(data)


async def test_a_partial_object_does_not_outlive_its_mount(tmp_path: Path) -> None:
    data = content("obj", 8 * CHUNK)
    s3 = SlowS3({"obj": data})
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, ObjectCache(str(tmp_path), 1 << 30), nursery)
        assert reply_bytes(await reader.read("obj", "e", len(data), 0, 100, ReadStream())) == data[:100]
    assert [p.name[-8:] for p in (tmp_path / "cache").iterdir()] == ["-partial"]
    again = ObjectCache(str(tmp_path), 1 << 30)  # the next mount: which chunks are in is unknown
    assert again.total == 0 and list((tmp_path / "cache").iterdir()) == []


async def test_an_object_evicted_while_it_arrives_is_still_read_right(tmp_path: Path) -> None:
    """A cache of two objects' size, three readers: each new partial object evicts an older
    one mid-download. Chunks that land in an evicted (unlinked) file are fetched again, into
    memory; no reader gets wrong bytes, and the cache stays within its budget."""
    objects = {f"o{i}": content(f"o{i}", 16 * CHUNK) for i in range(3)}
    s3 = SlowS3(objects)
    cache = ObjectCache(str(tmp_path), 2 * 16 * CHUNK + CHUNK)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            reader = _reader(s3, cache, nursery, into_files=True)
            reader.to_files = True  # (a cache this small would otherwise take buffers only)

            async def read(key: str) -> None:
                assert await _read_all(reader, key, objects[key], 24 * KiB) == objects[key]
            async with trio.open_nursery() as readers:
                for key in objects:
                    readers.start_soon(read, key)
    assert cache.total <= cache.budget
    on_disk = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache").iterdir())
    assert on_disk <= cache.budget + 64 * KiB  # a partial file holds only what landed (sparse)


async def test_two_readers_of_one_object_one_while_it_arrives(tmp_path: Path) -> None:
    data = content("obj", 12 * CHUNK + 1)
    s3 = SlowS3({"obj": data})
    cache = ObjectCache(str(tmp_path), 1 << 30)
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, cache, nursery)
        results: list[bytes] = []

        async def late() -> None:
            await trio.sleep(0.01)  # starts once the first reader's chunks are on their way
            results.append(await _read_all(reader, "obj", data, 40 * KiB))
        nursery.start_soon(late)
        results.append(await _read_all(reader, "obj", data))
    assert results == [data, data]
    assert s3.chunks == 13  # the second reader waited on the first one's fetches


async def test_random_reads_of_a_partial_object_get_exact_bytes(tmp_path: Path) -> None:
    data = content("obj", 10 * CHUNK + 3)
    s3 = SlowS3({"obj": data})
    rng = random.Random(5)
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, ObjectCache(str(tmp_path), 1 << 30), nursery)
        for _ in range(60):
            off, n = rng.randrange(len(data)), rng.randrange(1, 3 * CHUNK)  # some span chunks
            got = reply_bytes(await reader.read("obj", "e", len(data), off, n, ReadStream()))
            assert got == data[off:off + n]


def test_a_file_slice_is_read_as_the_range_it_names(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert reply_bytes(FileSlice(fd, 300, 20)) == (bytes(range(256)) * 10)[300:320]
        assert reply_bytes(FileSlice(fd, 2550, 100)) == bytes(range(246, 256))  # to its end
    finally:
        os.close(fd)


async def test_a_whole_fetch_shares_a_readers_fetches_and_leaves_the_object_whole(
        tmp_path: Path) -> None:
    data = content("obj", 40 * CHUNK + 9)
    s3 = SlowS3({"obj": data})
    cache = ObjectCache(str(tmp_path), 1 << 30)
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, cache, nursery)
        got: list[bytes] = []

        async def read() -> None:  # a reader already streaming it (another handle)
            got.append(await _read_all(reader, "obj", data, 32 * KiB))
        nursery.start_soon(read)
        await trio.sleep(0.005)
        assert await reader.fetch_whole("obj", "e", len(data), gets=4)
        assert cache.whole_path("obj", "e", len(data)) is not None
    assert got == [data] and s3.chunks == 41  # no chunk fetched twice
    assert s3.gets <= 20  # GETs of several chunks each


async def test_a_whole_fetch_that_fails_says_so_and_the_reader_still_gets_the_error(
        tmp_path: Path) -> None:
    data = content("obj", 16 * CHUNK)
    s3 = SlowS3({"obj": data})
    s3.fail_after_first = True  # every multi-chunk GET breaks after its first chunk
    cache = ObjectCache(str(tmp_path), 1 << 30)
    async with trio.open_nursery() as nursery:
        reader = _reader(s3, cache, nursery)
        assert not await reader.fetch_whole("obj", "e", len(data))
        assert cache.whole_path("obj", "e", len(data)) is None
        s3.fail_after_first = False
        assert await _read_all(reader, "obj", data) == data  # the daemon's path, as a fallback
    assert reader._receiving == 0 and not reader._chunks

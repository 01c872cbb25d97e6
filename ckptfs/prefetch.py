"""Reads of files that are not on local disk: the read cache, then ranged GETs with readahead.

A read is answered from the whole object in the on-disk cache if it is there (a file written
on this host, or fully fetched before), else chunk by chunk: the in-memory LRU, the on-disk
chunk cache, then one ranged GET per chunk. A chunk is fetched at most once at a time (other
readers wait on the same fetch). Each handle keeps its own stream state: a handle that keeps
reading sequentially gets a readahead window that doubles every time it enters a new chunk,
up to `max_window` chunks fetched in parallel ahead of it (the Mountpoint-s3 pattern); a
random read (torch.load's zip directory at the tail, DCP slices) fetches just its chunks and
resets only its own handle's window.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import cachetools
import trio

from ckptfs.cache import ObjectCache
from ckptfs.errors import S3Error
from ckptfs.parts import MiB
from ckptfs.s3 import S3Client

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # key, etag, chunk index


@dataclass
class _Fetch:
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: BaseException | None = None


@dataclass
class ReadStream:
    """Per-handle read state used to tell sequential readers from random ones."""
    next_offset: int = 0
    sequential_reads: int = 0
    window: int = 0  # chunks to keep fetched ahead of the reader
    last_chunk: int = -1

    def advance(self, offset: int, end: int, chunk_size: int, max_window: int) -> None:
        """Account for a read of [offset, end): continue the sequential stream or reset it."""
        last = (end - 1) // chunk_size
        # The kernel's own readahead keeps several requests in flight, so a sequential reader's
        # requests may arrive a little out of order: anything near the stream continues it.
        near = (self.next_offset - chunk_size <= offset
                <= self.next_offset + max(self.window, 1) * chunk_size)
        if self.sequential_reads and near or offset == self.next_offset:
            self.sequential_reads += 1
        else:
            self.sequential_reads = 0
            self.window = 0
        self.next_offset = max(end, self.next_offset) if near else end
        if self.sequential_reads >= 2 and last > self.last_chunk:
            self.window = min(max(2, self.window * 2), max_window)
        self.last_chunk = max(last, self.last_chunk) if self.sequential_reads else last


class ChunkReader:
    def __init__(self, s3: S3Client, cache: ObjectCache | None = None, chunk_size: int = 8 * MiB,
                 memory_budget: int = 256 * MiB, max_window: int = 16) -> None:
        self.s3 = s3
        self.cache = cache
        self.chunk_size = chunk_size
        self.max_window = max_window
        self.readahead = True  # off after a spot notice: the bandwidth goes to uploads
        self._chunks: cachetools.LRUCache[ChunkId, bytes] = cachetools.LRUCache(
            maxsize=memory_budget, getsizeof=len)
        self._fetching: dict[ChunkId, _Fetch] = {}
        self.nursery: trio.Nursery | None = None  # set by the daemon; holds readahead fetches
        # Local reads run in threads so the kernel's parallel readahead requests overlap the
        # disk with the FUSE loop instead of queueing behind each pread.
        self._local_reads = trio.CapacityLimiter(4)
        self.hits = 0  # chunks (or whole-object reads) served from memory or the disk cache
        self.misses = 0  # chunks fetched from S3
        self.bytes_downloaded = 0
        self.gets = 0

    async def read(self, key: str, etag: str, size: int, offset: int, length: int,
                   stream: ReadStream) -> bytes:
        end = min(offset + length, size)
        if offset >= end:
            return b""
        if self.cache is not None:
            fd = self.cache.whole_fd(key, etag)
            if fd is not None:
                self.hits += 1
                return await self.pread_local(fd, end - offset, offset)
        first, last = offset // self.chunk_size, (end - 1) // self.chunk_size
        stream.advance(offset, end, self.chunk_size, self.max_window)
        if stream.window and self.readahead and self.nursery is not None:
            n_chunks = (size + self.chunk_size - 1) // self.chunk_size
            for k in range(last + 1, min(last + 1 + stream.window, n_chunks)):
                self._start((key, etag, k), size)
        pieces = []
        for k in range(first, last + 1):
            chunk = await self._chunk((key, etag, k), size)
            base = k * self.chunk_size
            pieces.append(chunk[max(offset, base) - base:min(end, base + len(chunk)) - base])
        return b"".join(pieces)

    async def pread_local(self, fd: int, size: int, offset: int) -> bytes:
        """pread off the FUSE loop. The dup keeps the file open if its owner closes `fd`
        meanwhile (cache eviction, release), so a reused descriptor number is never read."""
        own = os.dup(fd)
        try:
            return await trio.to_thread.run_sync(os.pread, own, size, offset, limiter=self._local_reads)
        finally:
            os.close(own)

    def _start(self, cid: ChunkId, size: int) -> None:
        if cid in self._fetching or cid in self._chunks:
            return
        fetch = self._fetching[cid] = _Fetch()
        assert self.nursery is not None
        self.nursery.start_soon(self._run, cid, size, fetch)

    async def _chunk(self, cid: ChunkId, size: int) -> bytes:
        data = self._chunks.get(cid)
        if data is not None:
            self.hits += 1
            return data
        fetch = self._fetching.get(cid)
        if fetch is None:
            fetch = self._fetching[cid] = _Fetch()
            await self._run(cid, size, fetch)
        else:
            await fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        return fetch.data

    async def _run(self, cid: ChunkId, size: int, fetch: _Fetch) -> None:
        key, etag, k = cid
        start = k * self.chunk_size
        want = min(start + self.chunk_size, size) - start
        from_s3 = False
        try:
            data = None
            path = self.cache.chunk_path(key, etag, k) if self.cache is not None else None
            if path is not None:
                data = await trio.to_thread.run_sync(ObjectCache.read_file, path)
                if data is not None and len(data) != want:
                    data = None  # a torn entry: fetch it again
            if data is None:
                self.misses += 1
                self.gets += 1
                data = await self.s3.get_range(key, start, start + want, etag)
                self.bytes_downloaded += len(data)
                from_s3 = True
            else:
                self.hits += 1
            fetch.data = data
            self._chunks[cid] = data
        except Exception as exc:  # handed to every waiter; readahead failures are only logged
            fetch.error = exc
            log.debug("fetch of %s chunk %d failed: %s", key, k, exc)
        finally:
            if fetch.error is None and not fetch.data and want > 0:
                fetch.error = S3Error(f"fetch of {key} chunk {k} was cancelled")
            self._fetching.pop(cid, None)
            fetch.done.set()
        if from_s3 and self.cache is not None:
            await self._keep(key, etag, k, fetch.data)

    async def _keep(self, key: str, etag: str, k: int, data: bytes) -> None:
        """Write a fetched chunk to the disk cache, after its readers have it."""
        assert self.cache is not None
        name, tmp = self.cache.chunk_tmp(key, etag, k)
        try:
            await trio.to_thread.run_sync(ObjectCache.write_file, tmp, data)
            self.cache.commit_chunk(key, etag, name, tmp, len(data))
        except OSError as exc:  # a full cache disk only costs a later GET
            log.debug("could not cache chunk %d of %s: %s", k, key, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

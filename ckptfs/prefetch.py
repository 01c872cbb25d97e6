"""Reads of files that are not on local disk: ranged GETs in fixed chunks, with readahead.

Chunks are fetched at most once at a time (other readers wait on the same
fetch) and kept in a bounded in-memory LRU. A reader that keeps going
sequentially gets the next chunks fetched in parallel before it asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import cachetools
import trio

from ckptfs.parts import MiB
from ckptfs.errors import S3Error
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


class ChunkReader:
    def __init__(self, s3: S3Client, chunk_size: int = 8 * MiB, memory_budget: int = 256 * MiB,
                 readahead_chunks: int = 4) -> None:
        self.s3 = s3
        self.chunk_size = chunk_size
        self.readahead_chunks = readahead_chunks
        self._chunks: cachetools.LRUCache[ChunkId, bytes] = cachetools.LRUCache(
            maxsize=memory_budget, getsizeof=len)
        self._fetching: dict[ChunkId, _Fetch] = {}
        self.nursery: trio.Nursery | None = None  # set by the daemon; holds readahead fetches
        self.hits = 0  # chunks served from memory
        self.misses = 0  # chunks fetched from S3
        self.bytes_downloaded = 0

    async def read(self, key: str, etag: str, size: int, offset: int, length: int,
                   stream: ReadStream) -> bytes:
        end = min(offset + length, size)
        if offset >= end:
            return b""
        if offset == stream.next_offset:
            stream.sequential_reads += 1
        else:
            stream.sequential_reads = 0
        stream.next_offset = end
        first, last = offset // self.chunk_size, (end - 1) // self.chunk_size
        if stream.sequential_reads >= 2 and self.nursery is not None:
            n_chunks = (size + self.chunk_size - 1) // self.chunk_size
            for k in range(last + 1, min(last + 1 + self.readahead_chunks, n_chunks)):
                self._start((key, etag, k), size)
        pieces = []
        for k in range(first, last + 1):
            chunk = await self._chunk((key, etag, k), size)
            base = k * self.chunk_size
            pieces.append(chunk[max(offset, base) - base:min(end, base + len(chunk)) - base])
        return b"".join(pieces)

    def _start(self, cid: ChunkId, size: int) -> _Fetch:
        fetch = self._fetching.get(cid)
        if fetch is None and cid not in self._chunks:
            fetch = self._fetching[cid] = _Fetch()
            if self.nursery is not None:
                self.nursery.start_soon(self._run, cid, size, fetch)
        return fetch  # type: ignore[return-value]

    async def _chunk(self, cid: ChunkId, size: int) -> bytes:
        data = self._chunks.get(cid)
        if data is not None:
            self.hits += 1
            return data
        self.misses += 1
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
        try:
            fetch.data = await self.s3.get_range(key, start, min(start + self.chunk_size, size), etag)
            self.bytes_downloaded += len(fetch.data)
            self._chunks[cid] = fetch.data
        except Exception as exc:  # handed to every waiter; readahead failures are only logged
            fetch.error = exc
            log.debug("fetch of %s chunk %d failed: %s", key, k, exc)
        finally:
            if fetch.error is None and not fetch.data:
                fetch.error = S3Error(f"fetch of {key} chunk {k} was cancelled")
            self._fetching.pop(cid, None)
            fetch.done.set()

"""Reads of files that are not staged here: the read cache on disk, else S3 through buffers.

A read of a clean object is answered chunk by chunk (8 MiB). A chunk on disk here (the whole
object in the read cache, a file written here and adopted after its upload, or the chunk's
own cache file) is answered with a view of a mapping of the bytes asked for (localread.py):
pyfuse3's copy into the kernel is the only one. A chunk that is not is fetched by a ranged
GET received straight into a new chunk file of the disk cache (over plain HTTP spliced from
the socket into the file's page cache: one copy, no buffer of this process), published as
soon as it is whole, and then read like any chunk on disk. Readahead fetches up to four
consecutive chunks with one GET into four files, each usable as soon as it is full: a
quarter of the requests, less CPU per byte on both sides. This path counts copies: on a
small machine memory bandwidth is what a read costs.

Where the disk cache cannot take chunks (smaller than 1 GiB, or its disk refused a write:
then for 10 s) they go into a fixed pool of page-aligned buffers instead (`--read-memory`),
received straight into the buffer, served as memoryviews of it, and then written to the
disk cache with O_DIRECT where the file system allows it.

A chunk is fetched at most once at a time (other readers wait on the same fetch). Each
handle keeps its own stream state: a handle that keeps reading sequentially gets a
readahead window that doubles every time it enters a new chunk, up to `max_window` chunks
ahead of it (the Mountpoint-s3 pattern): those on disk are advised into the page cache,
the others fetched in parallel. A random read (torch.load's zip directory at the tail, DCP
slices) touches just its chunks and resets only its own handle's window.

Readahead takes only buffers that are free or hold chunks nobody is using (or one of the
slots for chunks being received into files), and evicts chunks already read before
readahead not yet read; a demand read waits for a buffer or a slot. A buffer is never
reused while a reader or a cache write holds its chunk, and no reader holds one chunk while
it waits for another, so the pool cannot deadlock.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ckptfs.assembly import WholeObjects
from ckptfs.broadcast import Broadcast
from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache, unlink_quietly
from ckptfs.errors import LocalWriteError, S3Error
from ckptfs.handles import ReadStream
from ckptfs.landing import Landing, close_landing, open_landings
from ckptfs.localread import (ALIGN, FileSlice, LocalView, Reply, reply_bytes, reply_size,
                              store_file)
from ckptfs.parts import MiB

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # key, etag, chunk index

_FILES_BACKOFF = 10.0  # seconds reads use buffers after a chunk file could not be written
@dataclass(eq=False)
class _Chunk:
    cid: ChunkId
    buf: mmap.mmap | None  # None: received into its file in the disk cache
    ready: trio.Event = field(default_factory=trio.Event)
    length: int = 0
    error: BaseException | None = None
    users: int = 0  # readers waiting for it or replying from it, and its cache write
    read: bool = False  # a reader has used it (readahead not yet read is worth more)


class ChunkReader:
    def __init__(self, s3: Bucket, cache: ObjectCache | None = None, chunk_size: int = 8 * MiB,
                 memory_budget: int = 48 * MiB, max_window: int = 16, get_chunks: int = 4, *,
                 nursery: trio.Nursery, into_files: bool = True, slices: bool = False) -> None:
        assert chunk_size % ALIGN == 0
        self.s3 = s3
        self.cache = cache
        self.chunk_size = chunk_size
        self.max_window = max_window
        self.get_chunks = get_chunks  # readahead fetches up to this many chunks with one GET
        self.readahead = True  # off after a spot notice: the bandwidth goes to uploads
        # Local bytes are replied as FileSlices, sent by pyfuse3's threads (localread.py), where
        # pyfuse3 can (the daemon says).
        self.slices = slices
        self.bytes_sliced = 0  # replied by pyfuse3's threads, never touched by the FUSE loop
        self._slots = max(2, memory_budget // chunk_size)
        # With a disk cache big enough not to evict a window's chunks before they are read,
        # chunks are received into its files (spliced from the socket over plain HTTP) and
        # read from there: no buffer of this process holds them. The pool serves the rest.
        self._file_slots = 2 * max_window  # chunks being received into files at once
        self.to_files = (into_files and cache is not None
                         and cache.budget >= 4 * self._file_slots * chunk_size)
        self._receiving = 0
        self._files_failed_at = -_FILES_BACKOFF  # trio time a chunk file last could not be written
        self._buffers = 0  # allocated so far (lazily: an idle mount holds none)
        self._free: list[mmap.mmap] = []
        self._chunks: OrderedDict[ChunkId, _Chunk] = OrderedDict()  # loading or loaded, LRU
        self._released = Broadcast()  # fired whenever a chunk's last user lets go
        self._nursery = nursery  # holds readahead loads, advice and writes to the disk cache
        # Local reads run in threads so the kernel's parallel readahead requests overlap the
        # disk with the FUSE loop instead of queueing behind each read.
        self._local_reads = trio.CapacityLimiter(4)
        # Readahead advice for cached files goes out one call at a time, in order.
        self._advice = trio.CapacityLimiter(1)
        self._writes = 0  # chunks being written to the disk cache
        self._written = Broadcast()  # fired whenever none are
        self.hits = 0  # reads served from a loaded buffer without waiting
        self.disk_hits = 0  # reads served from the disk cache
        self.misses = 0  # chunks fetched from S3
        self.bytes_downloaded = 0
        self.bytes_spliced = 0  # of those, received into the disk cache by splice(2)
        self.gets = 0
        # Whole objects for passthrough (assembly.py): on once the kernel can read local files.
        self.whole = WholeObjects(cache, chunk_size, nursery) if cache is not None else None

    def _chunk_stored(self, key: str, etag: str) -> None:
        if self.whole is not None:
            self.whole.chunk_stored(key, etag)

    def stats(self) -> dict[str, int]:
        return {"bytes_downloaded": self.bytes_downloaded, "bytes_spliced": self.bytes_spliced,
                "bytes_sliced": self.bytes_sliced,
                "objects_assembled": self.whole.assembled if self.whole else 0,
                "chunk_cache_hits": self.hits,
                "chunk_cache_misses": self.misses, "chunk_disk_hits": self.disk_hits}

    async def read(self, key: str, etag: str, size: int, offset: int, length: int,
                   stream: ReadStream) -> Reply:
        end = min(offset + length, size)
        if offset >= end:
            return b""
        first, last = offset // self.chunk_size, (end - 1) // self.chunk_size
        stream.advance(offset, end, self.chunk_size, self.max_window)
        if stream.window and self.readahead:
            self._read_ahead(key, etag, size, last, stream)
        pieces: list[bytes] = []
        for k in range(first, last + 1):
            base = k * self.chunk_size
            data = await self._read_chunk(key, etag, size, k, max(offset, base),
                                          min(end, base + self.chunk_size))
            if first == last:
                self._reached(key, etag, size, end)
                # pyfuse3 replies from this view before any other task runs, so a buffer it
                # points into cannot be reused under it.
                return data
            pieces.append(reply_bytes(data))  # never hold one chunk while waiting for the next
        self._reached(key, etag, size, end)
        return b"".join(pieces)

    def _reached(self, key: str, etag: str, size: int, end: int) -> None:
        if end == size and self.whole is not None:
            self.whole.reached(key, etag, size)  # a reader reached the end: all cached?

    async def _read_chunk(self, key: str, etag: str, size: int, k: int, lo: int,
                          hi: int) -> Reply:
        """Bytes [lo, hi) of the object, all in chunk k: from a local file if one holds the
        chunk, else fetched (into the disk cache's file, else into a buffer)."""
        cid = (key, etag, k)
        base = k * self.chunk_size
        for attempt in range(8):
            local = None
            if cid not in self._chunks and self.cache is not None:
                local = self.cache.local_fd(key, etag, k, self.chunk_size, size)
            if local is not None:
                # On disk here: read just what was asked, straight into a reply that is
                # still in the CPU's cache when pyfuse3 copies it to the kernel.
                fd, file_base = local
                self.disk_hits += 1
                data = await self.read_local(fd, hi - lo, lo - file_base, within=True)
                if reply_size(data) != hi - lo:
                    raise OSError(errno.EIO, f"read cache entry of {key} is short")
                return data
            try:
                # Into a file the first time; into a buffer if that file did not stay (a
                # full cache disk, or evicted before this reader came).
                chunk = await self._use(cid, size, to_file=attempt == 0)
            except LocalWriteError:
                continue
            if chunk.buf is None:  # in the disk cache now: read it from there
                self._unuse(chunk)
                continue
            try:
                return memoryview(chunk.buf)[lo - base:hi - base]
            finally:
                self._unuse(chunk)
        raise OSError(errno.EIO, f"chunk {k} of {key} was fetched but not kept")

    async def fetch_whole(self, key: str, etag: str, size: int, gets: int = 16,
                          per_get: int = 8) -> bool:
        """Fetch every chunk of the object not local yet into its own cache file, `gets` GETs of
        up to `per_get` chunks in flight: at full speed, not a reader's pace. True once the
        object is whole in the cache (then a passthrough open's backing file). A chunk a
        reader fetches into a buffer (no room in the cache) leaves it not whole: False."""
        cache = self.cache
        if cache is None or self.whole is None or not self.whole.enabled:
            return False
        partial = cache.receiving(key, etag, size)
        if partial is not None:
            limiter, waits = trio.Semaphore(gets), list[trio.Event]()
            n = (size + self.chunk_size - 1) // self.chunk_size
            # All `gets` busy on a small object, but GETs of at least 4 chunks: each costs
            # botocore milliseconds of CPU, and 8 ranks' objects share the `gets` threads.
            per_get = min(n, max(4, min(per_get, -(-n // gets))))
            async with trio.open_nursery() as nursery:
                k = 0
                while k < n:
                    await limiter.acquire()
                    run: list[_Chunk] = []
                    while k < n and len(run) < per_get:
                        cid, k = (key, etag, k), k + 1
                        if (chunk := self._chunks.get(cid)) is not None:
                            waits.append(chunk.ready)  # a reader's fetch of it is under way
                        elif cid[2] not in partial.present:
                            chunk = self._chunks[cid] = _Chunk(cid, None)
                            run.append(chunk)
                            self._receiving += 1
                    nursery.start_soon(self._load_then_release, run, size, limiter)
            for ready in waits:
                await ready.wait()
        return cache.whole_path(key, etag, size) is not None

    async def _load_then_release(self, run: list[_Chunk], size: int,
                                 limiter: trio.Semaphore) -> None:
        try:
            if run:
                await self._load(run, size)
        finally:
            limiter.release()

    def _read_ahead(self, key: str, etag: str, size: int, last: int, stream: ReadStream) -> None:
        """Keep the stream's window ahead of `last` loading: chunks on disk here are advised
        into the page cache, the others are fetched into buffers."""
        n_chunks = (size + self.chunk_size - 1) // self.chunk_size
        stop = min(last + 1 + stream.window, n_chunks)
        if not last <= stream.ahead < stop:
            stream.ahead = last
        run: list[_Chunk] = []  # consecutive chunks to fetch with one GET
        # The window grows a chunk at a time as the reader moves on: start runs of the full
        # length (smaller while the window is small, and at the end of the object), or every
        # GET would fetch one chunk.
        target = max(1, min(self.get_chunks, stream.window // 2))

        def fetch_run() -> None:
            if run:
                self._nursery.start_soon(self._load, run.copy(), size)
                run.clear()

        for k in range(stream.ahead + 1, stop):
            cid = (key, etag, k)
            if cid in self._chunks:  # loaded or loading
                fetch_run()
                stream.ahead = k
                continue
            local = None
            if self.cache is not None:
                local = self.cache.local_fd(key, etag, k, self.chunk_size, size)
            if local is not None:
                fetch_run()
                if not self.slices:  # (a FileSlice's read triggers the kernel's readahead)
                    fd, file_base = local
                    self._advise(fd, k * self.chunk_size - file_base,
                                 min(self.chunk_size, size - k * self.chunk_size))
                stream.ahead = k
                continue
            if not run and k + target > stop < n_chunks:
                break  # wait for a window that has room for a whole run
            chunk = self._claim(cid)
            if chunk is None:
                break  # no buffer to spare: the reader catches up first
            run.append(chunk)
            stream.ahead = k
            if len(run) == self.get_chunks:
                fetch_run()
        fetch_run()

    def _advise(self, fd: int, offset: int, length: int) -> None:
        own = os.dup(fd)

        async def advise() -> None:
            try:
                await trio.to_thread.run_sync(os.posix_fadvise, own, offset, length,
                                              os.POSIX_FADV_WILLNEED, limiter=self._advice)
            except OSError:
                pass  # only a hint
            finally:
                os.close(own)
        self._nursery.start_soon(advise)

    async def read_local(self, fd: int, size: int, offset: int, within: bool = False) -> Reply:
        """Up to `size` bytes at `offset` of a local file. With `slices` (pyfuse3 can reply from
        a file) that is a FileSlice: one of pyfuse3's worker threads sends the bytes, spliced
        from the page cache into the kernel, and the FUSE loop never touches them. Otherwise a
        view of a mapping of the file, so the only copy is pyfuse3's into the kernel: pages
        already in the page cache (the usual case: readahead advice went out ahead of the
        reader) are mapped on the FUSE loop, others are faulted in by a worker thread first,
        so the loop never waits for the disk. `within`: the file holds the whole range
        (a cache file: they never shrink)."""
        if self.slices and within:
            self.bytes_sliced += size
            return FileSlice(fd, offset, size)
        end = min(offset + size, os.fstat(fd).st_size)
        if end <= offset:
            return b""
        if self.slices:
            self.bytes_sliced += end - offset
            return FileSlice(fd, offset, end - offset)
        view = LocalView(fd, offset, end)
        if not view.resident():
            # The dup keeps the file open if its owner closes `fd` meanwhile (release).
            own = os.dup(fd)
            try:
                await trio.to_thread.run_sync(view.load, own, limiter=self._local_reads)
            finally:
                os.close(own)
        return view.reply()

    # ----- the buffer pool ---------------------------------------------------

    def _claim(self, cid: ChunkId, to_file: bool = True) -> _Chunk | None:
        """A new chunk entry for `cid`: one to receive into a file of the disk cache, or in a
        buffer that is free, never used, or holds the least recently used chunk nobody is
        using; None if every buffer (or every file slot) is busy."""
        if (to_file and self.to_files
                and trio.current_time() - self._files_failed_at >= _FILES_BACKOFF):
            if self._receiving >= self._file_slots:
                return None
            self._receiving += 1
            chunk = self._chunks[cid] = _Chunk(cid, None)
            return chunk
        if self._free:
            buf = self._free.pop()
        elif self._buffers < self._slots:
            self._buffers += 1
            buf = mmap.mmap(-1, self.chunk_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            idle = [c for c in self._chunks.values() if not c.users and c.ready.is_set()]
            # The least recently used chunk that was read; readahead nobody read yet goes last.
            victim = next((c for c in idle if c.read), idle[0] if idle else None)
            if victim is None:
                return None
            del self._chunks[victim.cid]
            buf = victim.buf
        chunk = self._chunks[cid] = _Chunk(cid, buf)
        return chunk

    def _unuse(self, chunk: _Chunk) -> None:
        chunk.users -= 1
        if not chunk.users:
            self._released.fire()

    async def _use(self, cid: ChunkId, size: int, to_file: bool = True) -> _Chunk:
        """The loaded chunk `cid`, held for the caller until it calls _unuse (a chunk received
        into a file has no buffer: the caller reads the file)."""
        while (chunk := self._chunks.get(cid)) is None:
            chunk = self._claim(cid, to_file)
            if chunk is not None:
                chunk.users += 1
                await self._load([chunk], size)
                break
            await self._released.wait()  # every buffer is loading or in use
        else:
            chunk.users += 1
            self._chunks.move_to_end(cid)
            if chunk.ready.is_set():
                self.hits += 1
            await chunk.ready.wait()
        if chunk.error is not None:
            self._unuse(chunk)
            raise chunk.error
        chunk.read = True
        return chunk

    # ----- loading -----------------------------------------------------------

    async def _load(self, chunks: list[_Chunk], size: int) -> None:
        """Fetch consecutive chunks with one ranged GET, each ready, and its waiters woken, as
        soon as it is whole: received into buffers (then written to the disk cache), or,
        where the chunks have none, straight into new files of the disk cache (published
        as each is whole; its readers read the file)."""
        key = chunks[0].cid[0]
        wants = self._wants(chunks, size)
        to_files = chunks[0].buf is None
        files: list[Landing] = []
        token = trio.lowlevel.current_trio_token()
        full = [False] * len(chunks)
        error: BaseException | None = None

        def settle(i: int) -> None:  # on the trio thread, outside any task; once per chunk
            chunk, whole = chunks[i], full[i]
            if chunk.ready.is_set():
                return
            if whole:
                chunk.length = wants[i]
                self.bytes_downloaded += wants[i]
            if i < len(files):
                assert self.cache is not None
                if close_landing(self.cache, files[i], chunk.cid, wants[i], whole):
                    self._chunk_stored(*chunk.cid[:2])
            if not whole:  # its waiters only look at the error
                chunk.error = error or S3Error(f"load of {key} chunk {chunk.cid[2]} was cancelled")
                if chunk.buf is not None:
                    self._free.append(chunk.buf)
            if (to_files or not whole) and self._chunks.get(chunk.cid) is chunk:
                del self._chunks[chunk.cid]  # gone, or in the disk cache now
            if to_files:
                self._receiving -= 1
            elif whole and self.cache is not None:
                chunk.users += 1  # the buffer stays put until the disk has it
                self._writes += 1
            chunk.ready.set()
            self._released.fire()

        def filled(i: int) -> None:  # in the GET's worker thread
            full[i] = True
            token.run_sync_soon(settle, i)

        try:
            if to_files:
                assert self.cache is not None
                open_landings(self.cache, [c.cid for c in chunks], size, self.chunk_size,
                              self.whole is not None and self.whole.enabled, files)
            self.misses += len(chunks)
            self.gets += 1
            await self._get(chunks, wants, files if to_files else None, filled)
        except Exception as exc:  # handed to every waiter; readahead failures are only logged
            error = exc
            self._load_failed(exc, chunks)
        finally:
            for i in range(len(chunks)):
                settle(i)  # if its queued call has not run yet
        if not to_files and self.cache is not None:
            for chunk in chunks:
                if chunk.error is None:
                    self._nursery.start_soon(self._keep, chunk)  # its readers need not wait

    async def _get(self, chunks: list[_Chunk], wants: list[int],
                   files: list[Landing] | None, filled: Callable[[int], None]) -> None:
        """The one ranged GET of a run of chunks: into `files`, or else into their buffers."""
        key, etag, first = chunks[0].cid
        start = first * self.chunk_size
        if files is not None:
            spliced = await self.s3.get_ranges_to_files(
                key, start, [(f.fd, want, f.offset) for f, want in zip(files, wants)], etag, filled)
            self.bytes_spliced += spliced  # (not `+= await`: that adds to a stale value)
            return
        outs = []
        for chunk, want in zip(chunks, wants):
            assert chunk.buf is not None  # a run is all buffers or all files
            outs.append(memoryview(chunk.buf)[:want])
        await self.s3.get_ranges_into(key, start, outs, etag, filled)

    def _wants(self, chunks: list[_Chunk], size: int) -> list[int]:
        """The bytes of each chunk (the object's last one may be short)."""
        return [min((c.cid[2] + 1) * self.chunk_size, size) - c.cid[2] * self.chunk_size
                for c in chunks]

    def _load_failed(self, exc: Exception, chunks: list[_Chunk]) -> None:
        key, _, first = chunks[0].cid
        if isinstance(exc, LocalWriteError):  # a full cache disk: buffers for a while
            self._files_failed_at = trio.current_time()
            log.warning("read cache: cannot write chunks of %s (%s); reads use memory "
                        "buffers for %d s", key, exc, _FILES_BACKOFF)
        else:
            log.debug("load of %s chunks %d-%d failed: %s", key, first, first + len(chunks) - 1, exc)

    async def _keep(self, chunk: _Chunk) -> None:
        """Write a fetched chunk to the disk cache, then let go of its buffer."""
        assert self.cache is not None
        key, etag, k = chunk.cid
        name, tmp = self.cache.chunk_tmp(key, etag, k)
        assert chunk.buf is not None
        try:
            await trio.to_thread.run_sync(store_file, tmp, chunk.buf, chunk.length,
                                          limiter=self._local_reads)
            self.cache.commit_chunk(key, etag, name, tmp, chunk.length)
            self._chunk_stored(key, etag)
        except OSError as exc:  # a full cache disk only costs a later GET
            log.debug("could not cache chunk %d of %s: %s", k, key, exc)
            unlink_quietly(tmp)
        finally:
            self._unuse(chunk)
            self._writes -= 1
            if not self._writes:
                self._written.fire()

    async def settle(self, timeout: float = 30) -> None:
        """Wait for the cache writes in flight (at unmount: a fetched chunk is not fetched again
        after the next mount)."""
        with trio.move_on_after(timeout):
            while self._writes:
                await self._written.wait()


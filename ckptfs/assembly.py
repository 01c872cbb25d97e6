"""Whole objects for passthrough: once every chunk of an object a reader read to the end is
in the disk cache, the chunks are copied (copy_file_range, in the kernel) into one file of
the cache, which later opens of the object give the kernel to read itself (passthrough.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict

import trio

from ckptfs.cache import ObjectCache, concatenate

log = logging.getLogger(__name__)

_WANT_WHOLE = 64  # objects read to the end whose chunks are awaited for assembly


class WholeObjects:
    def __init__(self, cache: ObjectCache, chunk_size: int, nursery: trio.Nursery) -> None:
        self.cache = cache
        self.chunk_size = chunk_size
        self._nursery = nursery
        self.enabled = False  # set when the kernel can read local files itself
        self._assembling: set[tuple[str, str]] = set()
        # Objects a reader read to the end before all their chunks were in the cache: looked
        # at again as chunks of them are stored (at most _WANT_WHOLE, the latest).
        self._want_whole: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.assembled = 0

    def reached(self, key: str, etag: str, size: int) -> None:
        """A reader read the object to its end."""
        if self.enabled:
            self._assemble_soon(key, etag, size)

    def chunk_stored(self, key: str, etag: str) -> None:
        size = self._want_whole.get((key, etag))
        if size is not None:
            self._assemble_soon(key, etag, size)

    def _assemble_soon(self, key: str, etag: str, size: int) -> None:
        if (key, etag) in self._assembling or self.cache.whole_path(key, etag, size) is not None:
            return
        chunks = self.cache.open_chunks(key, etag, size, self.chunk_size)
        if chunks is None:  # not all cached (yet)
            self._want_whole[(key, etag)] = size
            while len(self._want_whole) > _WANT_WHOLE:
                self._want_whole.popitem(last=False)
            return
        self._want_whole.pop((key, etag), None)
        self._assembling.add((key, etag))
        self._nursery.start_soon(self._assemble, key, etag, size, chunks)

    async def _assemble(self, key: str, etag: str, size: int, chunks: list[int]) -> None:
        """Copy an object's cached chunks, in the kernel, into one file of the cache."""
        name, tmp = self.cache.whole_tmp(key, etag)
        try:
            await trio.to_thread.run_sync(concatenate, chunks, tmp, size, self.chunk_size)
            self.cache.commit_whole(key, etag, name, tmp, size)
            self.assembled += 1
        except OSError as exc:
            log.debug("read cache: could not assemble %s: %s", key, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        finally:
            for fd in chunks:
                os.close(fd)
            self._assembling.discard((key, etag))

"""Where a GET's chunks land on disk: the object's own file in the read cache (each chunk at
its offset; the object is whole, ready for passthrough, once its last chunk is in: no
assembly, no copy), or a new temporary file per chunk, published as the chunk's cache
entry when whole (cache.py has both). The object's own file is used where whole objects
are wanted (passthrough on) and the object takes at most half the cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ckptfs.cache import ObjectCache, Partial, unlink_quietly
from ckptfs.errors import LocalWriteError

log = logging.getLogger(__name__)

ChunkId = tuple[str, str, int]  # key, etag, chunk index


@dataclass
class Landing:
    """Where one chunk of a GET is received: `length` bytes into `fd` at `offset`."""
    name: str
    tmp: str  # a chunk file's temporary path, published as `name` when whole ("" for a partial)
    fd: int  # this fetch's own descriptor
    offset: int = 0
    partial: Partial | None = None  # the object's own file, of `chunks` chunks
    chunks: int = 0


def open_landings(cache: ObjectCache, cids: list[ChunkId], size: int, chunk_size: int,
                  whole: bool, out: list[Landing]) -> None:
    """A landing for each chunk, appended to `out` as each is opened (so the caller closes
    them all if one fails). `whole`: into the object's own file where the cache takes it."""
    key, etag, _ = cids[0]
    partial = cache.receiving(key, etag, size) if whole else None
    if partial is not None:
        n = (size + chunk_size - 1) // chunk_size
        for _, _, k in cids:
            out.append(Landing(partial.name, "", os.dup(partial.wfd), k * chunk_size, partial, n))
        return
    for key, etag, k in cids:
        name, tmp = cache.chunk_tmp(key, etag, k)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LocalWriteError(exc.errno, exc.strerror) from None
        out.append(Landing(name, tmp, fd))


def close_landing(cache: ObjectCache, landing: Landing, cid: ChunkId, length: int,
                  whole: bool) -> bool:
    """A chunk's landing after its GET: marked or published in the cache if `whole`, else
    removed. True if the cache gained bytes a whole object may be assembled from."""
    key, etag, k = cid
    os.close(landing.fd)
    if landing.partial is not None:  # the object's own file: the chunk is there now
        return whole and cache.chunk_received(landing.partial, k, landing.chunks, length)
    if not whole:
        unlink_quietly(landing.tmp)
        return False
    try:
        cache.commit_chunk(key, etag, landing.name, landing.tmp, length)
        return True
    except OSError as exc:  # its readers fetch it again, into a buffer
        log.debug("could not cache chunk %d of %s: %s", k, key, exc)
        unlink_quietly(landing.tmp)
        return False


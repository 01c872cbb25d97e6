"""Request bodies held in memory: one byte budget for every upload of the mount.

Over HTTPS a part (or a small file's PUT) whose CRC32 its writes did not compute is read
into a buffer once, then checksummed and sent from there: streaming it from the staged file
would take a second pass over it for the checksum. (A part with a known CRC32 streams from
the file a MiB at a time and needs no buffer; over plain HTTP sendfile needs none either.)
The budget (`--upload-memory`, default 48 MiB) bounds how many such bodies exist at once,
so the daemon's memory does not grow with `--concurrency` or the part size; an upload
waits for a buffer. Buffers are kept and reused by size (parts of a plan share a few
sizes), so they are allocated and zero-filled once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ckptfs.broadcast import Broadcast


class BufferBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[bytearray]] = {}
        self._allocated = 0  # bytes in buffers, lent or free
        self._released = Broadcast()  # a buffer came back

    def fits(self, size: int) -> bool:
        return size <= self.limit

    @contextlib.asynccontextmanager
    async def borrow(self, size: int) -> AsyncIterator[bytearray]:
        """A buffer of exactly `size` bytes (size <= limit), waiting while the budget is lent."""
        buf = await self._take(size)
        try:
            yield buf
        finally:
            self._free.setdefault(size, []).append(buf)
            self._released.fire()

    async def _take(self, size: int) -> bytearray:
        assert self.fits(size)
        while True:
            free = self._free.get(size)
            if free:
                return free.pop()
            if self._allocated + size <= self.limit:
                self._allocated += size
                return bytearray(size)
            if self._drop_one_not(size):
                continue  # a free buffer of another size made room
            await self._released.wait()

    def _drop_one_not(self, size: int) -> bool:
        for other, bufs in self._free.items():
            if other != size and bufs:
                bufs.pop()
                self._allocated -= other
                return True
        return False

    def stats(self) -> dict[str, int]:
        return {"upload_memory_bytes": self._allocated, "upload_memory_limit": self.limit}

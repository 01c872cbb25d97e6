"""Request bodies read from a staged file: a seekable view of a byte range, and its CRC32."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ckptfs.checksum import crc32
from ckptfs.errors import S3Error

_READ_CHUNK = 1 << 20
_local = threading.local()  # each worker thread's read buffer


def scatter(data: bytes, outs: list[memoryview], filled: Callable[[int], None] | None) -> None:
    """Copy `data` into the buffers `outs` in order, calling `filled(i)` as each is full."""
    pos = 0
    for i, out in enumerate(outs):
        out[:] = data[pos:pos + len(out)]
        pos += len(out)
        if filled is not None:
            filled(i)


class FileRange(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of a file, for a request body."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self.length

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        self._pos = max(0, min(self.length, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        remaining = self.length - self._pos
        if size is None or size < 0 or size > remaining:
            size = remaining
        if size == 0:
            return b""
        data = os.pread(self.fd, size, self.start + self._pos)
        if len(data) != size:
            raise S3Error("the staged file is shorter than its recorded size", retryable=False)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def pieces(self) -> Iterator[memoryview]:
        """The bytes from the current position on, read a MiB at a time into this thread's
        buffer: each piece is valid until the next one is asked for."""
        buf = thread_buffer()
        while self._pos < self.length:
            n = min(len(buf), self.length - self._pos)
            got = os.preadv(self.fd, [buf[:n]], self.start + self._pos)
            if got <= 0:
                raise S3Error("the staged file is shorter than its recorded size", retryable=False)
            self._pos += got
            yield buf[:got]


def send_in_pieces(boto_client: Any) -> None:
    """Have botocore send FileRange bodies (UploadPart and PutObject of staged bytes) a MiB at
    a time. Given a file, urllib3 reads it 16 KiB at a time (a Python round trip per 16 KiB,
    1,024 per 16 MiB part); given an iterable, it sends each piece as it comes. Over HTTPS,
    where the kernel cannot send the file itself (zerocopy.py), this is how a part goes up
    without a buffer of its size."""
    for op in ("UploadPart", "PutObject"):
        boto_client.meta.events.register(f"before-send.s3.{op}", _in_pieces)


def _in_pieces(request: Any, **_: Any) -> None:
    if isinstance(request.body, FileRange):  # Content-Length is set already: not chunked
        request.body = request.body.pieces()


def thread_buffer() -> memoryview:
    """This worker thread's 1 MiB buffer, for one request at a time: a part's CRC32 pass and
    its pieces (here), or a GET body on its way into a file over TLS (zerocopy.py)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(_READ_CHUNK))
    return buf


def crc_of_range(fd: int, start: int, length: int) -> int:
    """CRC32 of bytes [start, start + length) of a file, read a chunk at a time into one
    buffer per thread. Not through a mapping: a file truncated meanwhile (a writer's
    O_TRUNC while its part streams) would kill the daemon with SIGBUS."""
    buf = thread_buffer()
    crc = 0
    done = 0
    while done < length:
        n = min(_READ_CHUNK, length - done)
        got = os.preadv(fd, [buf[:n]], start + done)
        if got <= 0:
            raise S3Error("the staged file is shorter than its recorded size", retryable=False)
        crc = crc32(buf[:got], crc)
        done += got
    return crc


def crcs_of_ranges(fd: int, ranges: list[tuple[int, int]]) -> list[int]:
    """CRC32 of each (offset, length) range of the file, -1 for one the file no longer
    holds whole (it never equals a CRC32); call from a worker thread."""
    out = []
    for start, length in ranges:
        try:
            out.append(crc_of_range(fd, start, length))
        except S3Error:
            out.append(-1)
    return out

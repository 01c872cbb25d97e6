"""What the components call S3: any implementation of the primitives (s3types.S3), every
request retried, and the helpers written once over the primitives.

Retries: each primitive is one attempt; `Bucket` sends it again, by the one policy of
retry.py, while its error is transient (`S3Error.retryable`), until the call's `deadline`
(trio time: an upload's or a change's; by default `timeout` seconds from now). Two
primitives carry state from one attempt to the next:
- a ranged GET asks again only for the buffers or files not yet filled;
- a body sent with the CRC32 its writes computed is sent again with the file's own CRC32
  (the server refused the first: the bytes on disk are what counts).

Helpers: whole listings, has_children, get_range, download_to, put of bytes (a symlink or
special file goes up marked: one part of a multipart upload, s3types.needs_mark), copy
(UploadPartCopy beyond CopyObject's 5 GiB, and for a marked source), abort_quietly, delete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import trio

from ckptfs.checksum import b64_crc32, crc32
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.parts import GiB
from ckptfs.retry import RetryPolicy, attempt_deadline
from ckptfs.s3types import S3, ListPage, ObjectInfo, is_marked, needs_mark

log = logging.getLogger(__name__)

T = TypeVar("T")

# CopyObject copies at most 5 GiB; larger objects go through UploadPartCopy.
COPY_LIMIT = 5 * GiB
COPY_PART_SIZE = 1 * GiB


class Bucket:
    def __init__(self, s3: S3, policy: RetryPolicy | None = None, timeout: float = 120.0) -> None:
        self.s3 = s3
        self.limiter = s3.limiter
        self.policy = policy or RetryPolicy()
        self.timeout = timeout  # how long a request without a deadline of its own is retried

    async def _retried(self, what: str, deadline: float | None,
                       attempt: Callable[[], Awaitable[T]]) -> T:
        if deadline is None:
            deadline = trio.current_time() + self.timeout
        return await self.policy.call(what, deadline, attempt)

    # ----- the primitives, retried ----------------------------------------------

    async def head(self, key: str, checksum: bool = False, deadline: float | None = None) -> ObjectInfo:
        return await self._retried(f"HEAD {key}", deadline, lambda: self.s3.head(key, checksum))

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000,
                        start_after: str | None = None) -> tuple[ListPage, str | None]:
        return await self._retried(f"LIST {prefix}", None, lambda: self.s3.list_page(
            prefix, token, delimiter, max_keys, start_after))

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        """One ranged GET of the bytes from `start` that fill the buffers `outs` in order.
        `filled(i)` runs in the worker thread as soon as outs[i] is full (the rest may still
        fail). Fewer, larger GETs cost the client and the server less CPU per byte."""
        await self._ranged(key, start, [len(o) for o in outs], filled,
                           lambda at, first, done: self.s3.get_ranges_into(
                               key, at, outs[first:], etag, done))

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        """As get_ranges_into, into the files `targets` ((fd, length, offset): `length` bytes
        into the file at `offset`). A file that cannot be written raises LocalWriteError (an
        OSError), never retried. Returns the bytes the kernel spliced from the socket."""
        spliced = 0

        async def attempt(at: int, first: int, done: Callable[[int], None]) -> None:
            nonlocal spliced
            spliced += await self.s3.get_ranges_to_files(key, at, targets[first:], etag, done)
        await self._ranged(key, start, [n for _, n, _ in targets], filled, attempt)
        return spliced

    async def _ranged(self, key: str, start: int, lengths: list[int],
                      filled: Callable[[int], None] | None,
                      get: Callable[[int, int, Callable[[int], None]], Awaitable[Any]]) -> None:
        full = 0  # targets filled so far, in order: a retry asks only for the rest

        async def attempt() -> None:
            first = full

            def done(i: int) -> None:
                nonlocal full
                full = first + i + 1
                if filled is not None:
                    filled(first + i)
            await get(start + sum(lengths[:first]), first, done)
        await self._retried(f"GET {key}", None, attempt)

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       deadline: float | None = None, crc: int | None = None,
                       reread: bool = False) -> tuple[str, int]:
        """PutObject of the first `size` bytes of `fd`, with their CRC32 (`crc`, if the writes
        computed it; a retry takes the file's own); (ETag, CRC32)."""
        first = [crc]
        return await self._retried(f"PUT {key}", deadline, lambda: self.s3.put_file(
            key, fd, size, metadata, first.pop() if first else None, reread))

    async def create_multipart(self, key: str, metadata: dict[str, str], checksum: bool = True,
                               deadline: float | None = None) -> str:
        """With `checksum`, every part carries a CRC32 and the object gets a FULL_OBJECT CRC32."""
        return await self._retried(f"CreateMultipartUpload {key}", deadline,
                                   lambda: self.s3.create_multipart(key, metadata, checksum))

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, deadline: float | None = None,
                          crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        """Upload bytes [start, start + size) of `fd` as part `number`, with their CRC32
        (which the server checks: a part damaged on the way is refused, and sent again).
        `crc`: their CRC32 as the writes computed it, if known; a retry reads it again from
        the file. `reread`: the bytes are in the page cache (the kernel wrote them: FUSE
        passthrough), so a pass for the CRC32 costs less than a buffer. Returns (ETag, CRC32)."""
        first = [crc]
        return await self._retried(f"UploadPart {number} of {key}", deadline,
                                   lambda: self.s3.upload_part(key, upload_id, number, fd, start,
                                                               size, first.pop() if first else None,
                                                               reread))

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None, deadline: float | None = None) -> str:
        return await self._retried(f"CompleteMultipartUpload {key}", deadline,
                                   lambda: self.s3.complete_multipart(key, upload_id, parts, crc))

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._retried(f"AbortMultipartUpload {key}", None,
                            lambda: self.s3.abort_multipart(key, upload_id))

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """Part number -> (size, ETag) of every part S3 holds for the multipart upload."""
        return await self._retried(f"ListParts {key}", None,
                                   lambda: self.s3.list_parts(key, upload_id))

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """(key, upload id, initiated as a Unix time) of every open multipart upload under `prefix`."""
        return await self._retried(f"ListMultipartUploads {prefix}", None,
                                   lambda: self.s3.list_uploads(prefix))

    async def delete_many(self, keys: list[str], deadline: float | None = None) -> None:
        if keys:
            await self._retried(f"DELETE {keys[0]}", deadline, lambda: self.s3.delete_many(keys))

    async def probe(self, prefix: str) -> None:
        """One LIST of one key under `prefix`, not retried, given `timeout` (at most 10 s) for
        its answer: does S3 answer at all? (health.py's probe during an outage)"""
        token = attempt_deadline.set(time.monotonic() + min(10.0, self.timeout))
        try:
            with trio.fail_after(min(10.0, self.timeout) + 5):
                await self.s3.list_page(prefix, None, "/", 1)
        finally:
            attempt_deadline.reset(token)

    # ----- helpers ------------------------------------------------------------------

    async def list_pages(self, prefix: str, delimiter: str = "/") -> AsyncIterator[ListPage]:
        token: str | None = None
        while True:
            page, token = await self.list_page(prefix, token, delimiter)
            yield page
            if not token:
                return

    async def list_keys(self, prefix: str) -> list[ObjectInfo]:
        """Every object under `prefix`, recursively."""
        return [o async for page in self.list_pages(prefix, delimiter="") for o in page.objects]

    async def has_children(self, prefix: str) -> bool:
        page, _ = await self.list_page(prefix, None, delimiter="/", max_keys=2)
        return any(o.key != prefix for o in page.objects) or bool(page.prefixes)

    async def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes:
        """Bytes [start, end) of `key`; with `etag`, fail if the object changed."""
        if end <= start:
            return b""
        buf = bytearray(end - start)
        await self.get_ranges_into(key, start, [memoryview(buf)], etag)
        return bytes(buf)

    async def download_to(self, key: str, fd: int, size: int, chunk: int,
                          etag: str | None = None) -> None:
        """Fetch a whole object into `fd` with parallel ranged GETs, chunk bytes each."""
        async def one(start: int) -> None:
            buf = bytearray(min(chunk, size - start))
            await self.get_ranges_into(key, start, [memoryview(buf)], etag)
            await trio.to_thread.run_sync(os.pwrite, fd, buf, start)

        async with trio.open_nursery() as nursery:
            for start in range(0, size, chunk):
                nursery.start_soon(one, start)

    async def put(self, key: str, body: bytes, metadata: dict[str, str],
                  deadline: float | None = None) -> str:
        """PutObject of `body` with a CRC32 the server verifies and keeps as the object's
        checksum; a symlink or special file goes up marked (one part of a multipart upload)."""
        fd = os.memfd_create("ckptfs-put", os.MFD_CLOEXEC)
        try:
            if os.write(fd, body) != len(body):
                raise OSError("short write to a memfd")
            if not needs_mark(metadata):
                return (await self.put_file(key, fd, len(body), metadata, deadline, crc32(body)))[0]
            upload_id = await self.create_multipart(key, metadata, deadline=deadline)
            async with self._aborted_on_error(key, upload_id):
                etag, crc = await self.upload_part(key, upload_id, 1, fd, 0, len(body), deadline,
                                                   crc32(body))
                return await self.complete_multipart(
                    key, upload_id, [{"ETag": etag, "PartNumber": 1, "ChecksumCRC32": b64_crc32(crc)}],
                    crc, deadline)
        finally:
            os.close(fd)

    async def copy(self, src: str, dst: str, size: int, metadata: dict[str, str] | None = None,
                   deadline: float | None = None, etag: str | None = None,
                   content_type: str | None = None) -> str:
        """Server-side copy, returning the new ETag; `metadata` replaces the source's when given
        (and the Content-Type with it: `content_type`, for a copy of one object onto itself
        that must keep its own). A marked source (its `etag`, s3types.is_marked) is copied in
        one part: CopyObject would give the copy a plain ETag, and listings would take a
        symlink for a file."""
        if size <= COPY_LIMIT and not is_marked(etag, size):
            return await self._retried(f"COPY {dst}", deadline,
                                       lambda: self.s3.copy(src, dst, metadata, content_type))
        if metadata is None:
            metadata = (await self.head(src, deadline=deadline)).metadata
        upload_id = await self.create_multipart(dst, metadata, checksum=False, deadline=deadline)
        async with self._aborted_on_error(dst, upload_id):
            parts: list[dict[str, Any]] = []

            async def one(number: int, start: int) -> None:
                end = min(start + COPY_PART_SIZE, size)
                etag = await self._retried(
                    f"UploadPartCopy {number} of {dst}", deadline,
                    lambda: self.s3.copy_part(dst, upload_id, number, src, start, end))
                parts.append({"ETag": etag, "PartNumber": number})

            async with trio.open_nursery() as nursery:
                for i, start in enumerate(range(0, size, COPY_PART_SIZE) or [0]):
                    nursery.start_soon(one, i + 1, start)
            parts.sort(key=lambda p: p["PartNumber"])
            return await self.complete_multipart(dst, upload_id, parts, deadline=deadline)

    @contextlib.asynccontextmanager
    async def _aborted_on_error(self, key: str, upload_id: str) -> AsyncIterator[None]:
        try:
            yield
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.abort_quietly(key, upload_id)
            raise

    async def abort_quietly(self, key: str, upload_id: str) -> bool:
        """Abort a multipart upload; True once it is gone (now, or already before). A refusal
        is logged, and the upload stays for the next mount's sweep."""
        try:
            await self.abort_multipart(key, upload_id)
        except NoSuchKey:
            pass
        except S3Error as exc:
            log.warning("could not abort the multipart upload of %s: %s", key, exc)
            return False
        return True

    async def delete(self, key: str, deadline: float | None = None) -> None:
        """Delete `key` (a missing key is no error, as in S3)."""
        await self.delete_many([key], deadline)

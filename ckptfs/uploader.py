"""Make a staged file durable in S3: one PUT, or parallel multipart from the staging file.

Part bytes are read from the staging file inside the worker thread that sends
them, so memory holds at most `concurrency` parts whatever the file size. An
upload that fails aborts its multipart upload; the staged file is untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import trio

from ckptfs.errors import NoSuchKey, S3Error, UploadError
from ckptfs.parts import PartPlan
from ckptfs.s3 import S3Client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadResult:
    etag: str
    parts: int


def multipart_etag(digests: list[bytes]) -> str:
    """The ETag S3 gives a multipart object: md5 of the part md5s, dash, part count."""
    return f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(digests)}"'


class Uploader:
    def __init__(self, s3: S3Client, plan: PartPlan, concurrency: int) -> None:
        self.s3 = s3
        self.plan = plan
        self.concurrency = concurrency
        self.in_flight = 0
        self.idle = trio.Event()
        self.idle.set()

    async def upload(self, fd: int, key: str, size: int, metadata: dict[str, str]) -> UploadResult:
        """Upload `size` bytes of `fd` to `key`; returns once the object is complete and verified."""
        self.in_flight += 1
        self.idle = trio.Event() if self.in_flight == 1 else self.idle
        try:
            if size <= self.plan.base_size:
                body = await trio.to_thread.run_sync(os.pread, fd, size, 0)
                if len(body) != size:
                    raise UploadError(f"staged file for {key} is shorter than {size} bytes")
                etag = await self.s3.put(key, body, metadata)
                expected = f'"{hashlib.md5(body).hexdigest()}"'
                parts = 1
            else:
                etag, expected, parts = await self._multipart(fd, key, size, metadata)
            await self._verify(key, size, etag, expected)
            return UploadResult(etag, parts)
        except S3Error as exc:
            if isinstance(exc, UploadError):
                raise
            raise UploadError(str(exc), exc.code) from None
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def _multipart(self, fd: int, key: str, size: int,
                         metadata: dict[str, str]) -> tuple[str, str, int]:
        ranges = self.plan.ranges(size)
        upload_id = await self.s3.create_multipart(key, metadata)
        try:
            done: dict[int, tuple[str, bytes]] = {}
            limiter = trio.CapacityLimiter(self.concurrency)

            async def send(number: int, start: int, length: int) -> None:
                def read() -> bytes:
                    data = os.pread(fd, length, start)
                    if len(data) != length:
                        raise UploadError(f"staged file for {key} is shorter than {size} bytes")
                    return data
                async with limiter:
                    done[number] = await self.s3.upload_part_from(key, upload_id, number, read)

            async with trio.open_nursery() as nursery:
                for r in ranges:
                    nursery.start_soon(send, r.number, r.start, r.size)
            parts: list[dict[str, Any]] = [{"ETag": done[n][0], "PartNumber": n} for n in sorted(done)]
            etag = await self.s3.complete_multipart(key, upload_id, parts)
            return etag, multipart_etag([done[n][1] for n in sorted(done)]), len(parts)
        except BaseException:
            with trio.CancelScope(shield=True), contextlib.suppress(S3Error):
                await self.s3.abort_multipart(key, upload_id)
            raise

    async def _verify(self, key: str, size: int, etag: str, expected: str) -> None:
        """Confirm the object under `key` is the one just written, whole."""
        try:
            info = await self.s3.head(key)
        except NoSuchKey:
            raise UploadError(f"{key} is missing right after its upload") from None
        if info.size != size:
            raise UploadError(f"{key} has {info.size} bytes in S3, expected {size}")
        if etag and info.etag != etag:
            raise UploadError(f"{key} changed during its upload (ETag {info.etag}, expected {etag})")
        if etag.strip('"') != expected.strip('"'):
            # Servers that use other ETag schemes (SSE-KMS, some gateways) are only size-checked.
            log.debug("ETag of %s is %s, not the MD5-derived %s", key, etag, expected)

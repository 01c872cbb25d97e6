"""The S3 seam: the primitives an implementation of S3 provides, and their answers.

`S3` is the protocol of primitives: one attempt of one S3 request each (or of one listing's
pages), no retries, no helpers. s3.py implements it with boto3; tests/fakes3.py implements it
in memory, and wraps any implementation in injectable faults. The components never call an
implementation directly: they call bucket.Bucket, which retries every primitive by the one
policy of retry.py and writes the helpers (whole listings, a marked put, a large copy, a
quiet abort) once over the primitives.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio


# A symlink or special file (fifo, socket, device) is a small object whose kind only its
# metadata tells, and a LIST entry carries no metadata. Written as a multipart upload of one
# part, its ETag ends in "-1", which an object that small PUT in one request never has: a
# listing then knows which small objects to HEAD ("marked"), and every other one is a file.
MARKED_MAX = 4095  # the longest symlink target
_MULTIPART_ETAG = re.compile(r'-[0-9]+"?$')
_MARKED_KINDS = (stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)


def needs_mark(metadata: dict[str, str] | None) -> bool:
    """An object of this metadata is written marked (a symlink or special file)."""
    try:
        return stat.S_IFMT(int((metadata or {}).get("mode", "0"))) in _MARKED_KINDS
    except ValueError:
        return False


def is_marked(etag: str | None, size: int) -> bool:
    """A small object written as a multipart upload: a symlink or special file, most likely."""
    return etag is not None and size <= MARKED_MAX and _MULTIPART_ETAG.search(etag) is not None


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    last_modified: float
    metadata: dict[str, str] = field(default_factory=dict)
    checksum_crc32: str | None = None  # S3's full-object CRC32, where the server keeps one
    content_type: str | None = None  # from a HEAD


@dataclass(frozen=True)
class ListPage:
    prefixes: list[str]
    objects: list[ObjectInfo]


class S3(Protocol):
    """One attempt of each request. A transient fault raises S3Error with `retryable`."""

    limiter: trio.CapacityLimiter  # worker threads of requests; readers share it

    async def head(self, key: str, checksum: bool = False) -> ObjectInfo: ...

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000,
                        start_after: str | None = None) -> tuple[ListPage, str | None]: ...

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        """One ranged GET from `start` filling the buffers `outs` in order; `filled(i)` (in
        any thread) once outs[i] is full. With `etag`, fail if the object changed."""

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        """As get_ranges_into, into the files `targets` ((fd, length, offset): `length` bytes
        into the file at `offset`); returns the bytes the kernel spliced (0 where it did not)."""

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        """PutObject of the first `size` bytes of `fd` with their CRC32 (`crc`, if known);
        `reread`: the bytes are in the page cache. Returns (ETag, CRC32)."""

    async def create_multipart(self, key: str, metadata: dict[str, str],
                               checksum: bool = True) -> str: ...

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, crc: int | None = None,
                          reread: bool = False) -> tuple[str, int]: ...

    async def copy_part(self, key: str, upload_id: str, number: int, src: str,
                        start: int, end: int) -> str:
        """UploadPartCopy of bytes [start, end) of `src`; the part's ETag."""

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None) -> str: ...

    async def abort_multipart(self, key: str, upload_id: str) -> None: ...

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]: ...

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]: ...

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   content_type: str | None = None) -> str:
        """CopyObject (at most 5 GiB); `metadata` replaces the source's when given, and the
        copy's Content-Type with it (`content_type`, else the store's default)."""

    async def delete_many(self, keys: list[str]) -> None: ...

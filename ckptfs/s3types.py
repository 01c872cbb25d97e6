"""The S3 seam: what the components ask of S3, and the answers.

`S3` is the protocol the components are written against. s3.py implements it with boto3;
tests/fakes3.py implements it in memory (with injectable faults) for unit tests. Every
implementation retries transient faults itself, by the one policy of retry.py, until the
call's `deadline` (trio time; by default the client's own timeout from now).
"""

from __future__ import annotations

import re
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from ckptfs.retry import RetryPolicy

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
    limiter: trio.CapacityLimiter  # worker threads of requests; readers share it
    policy: RetryPolicy

    async def head(self, key: str, checksum: bool = False,
                   deadline: float | None = None) -> ObjectInfo: ...

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000,
                        start_after: str | None = None) -> tuple[ListPage, str | None]: ...

    def list_pages(self, prefix: str, delimiter: str = "/") -> AsyncIterator[ListPage]: ...

    async def list_keys(self, prefix: str) -> list[ObjectInfo]: ...

    async def has_children(self, prefix: str) -> bool: ...

    async def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes: ...

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None: ...

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int: ...

    async def download_to(self, key: str, fd: int, size: int, chunk: int,
                          etag: str | None = None) -> None: ...

    async def put(self, key: str, body: bytes, metadata: dict[str, str],
                  deadline: float | None = None) -> str: ...

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       deadline: float | None = None, crc: int | None = None,
                       reread: bool = False) -> tuple[str, int]: ...

    async def create_multipart(self, key: str, metadata: dict[str, str], checksum: bool = True,
                               deadline: float | None = None) -> str: ...

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, deadline: float | None = None,
                          crc: int | None = None, reread: bool = False) -> tuple[str, int]: ...

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None, deadline: float | None = None) -> str: ...

    async def abort_multipart(self, key: str, upload_id: str) -> None: ...

    async def abort_quietly(self, key: str, upload_id: str) -> bool: ...

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]: ...

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]: ...

    async def copy(self, src: str, dst: str, size: int, metadata: dict[str, str] | None = None,
                   deadline: float | None = None, etag: str | None = None) -> str: ...

    async def delete(self, key: str, deadline: float | None = None) -> None: ...

    async def delete_many(self, keys: list[str]) -> None: ...

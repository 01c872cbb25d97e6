"""The FUSE request boundary: the handle objects of fs.py (with each handle's read pattern,
ReadStream, which prefetch.py's readahead follows), and `guarded`, which counts each request
and turns every error into the errno the kernel gets (an unexpected exception becomes EIO
and a log line, never a traceback that takes the mount down)."""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3

from ckptfs.errors import CkptfsError, Refused, first_leaf
from ckptfs.inodes import Inode
from ckptfs.opener import Opener

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def guarded(fn: F) -> F:
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        args[0].requests[op] += 1
        try:
            try:  # (not raise_first_error(): a context manager costs every read microseconds)
                return await fn(*args, **kwargs)
            except ExceptionGroup as group:  # a nursery's group: report its first failure
                raise first_leaf(group) from None
        except pyfuse3.FUSEError:
            raise
        except Refused as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except CkptfsError as exc:
            log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper  # type: ignore[return-value]


def fail(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


@dataclass
class ReadStream:
    """Per-handle read state used to tell sequential readers from random ones."""
    next_offset: int = 0
    sequential_reads: int = 0
    window: int = 0  # chunks to keep loaded ahead of the reader
    last_chunk: int = -1
    ahead: int = -1  # the last chunk readahead has started on

    def advance(self, offset: int, end: int, chunk_size: int, max_window: int) -> None:
        """Account for a read of [offset, end): continue the sequential stream or reset it."""
        last = (end - 1) // chunk_size
        # The kernel's own readahead keeps several requests in flight, so a sequential reader's
        # requests arrive out of order (a later batch can be answered before an earlier one):
        # anything within the window either side of the stream continues it.
        near = abs(offset - self.next_offset) <= max(self.window, 2) * chunk_size
        if self.sequential_reads and near or offset == self.next_offset:
            self.sequential_reads += 1
        else:
            self.sequential_reads = 0
            self.window = 0
        self.next_offset = max(end, self.next_offset) if near else end
        if self.sequential_reads >= 2 and last > self.last_chunk:
            self.window = min(max(2, self.window * 2), max_window)
        self.last_chunk = max(last, self.last_chunk) if self.sequential_reads else last


@dataclass(eq=False)
class Handle:
    inode: Inode
    writable: bool
    stream: ReadStream = field(default_factory=ReadStream)
    opener: Opener | None = None  # who opened it for writing (FLUSH does not say who closes)
    backing_id: int = 0  # the inode's backing file, named by this handle (passthrough.py)
    direct_io: bool = False  # ... but the daemon serves the handle's reads and writes

    @property
    def kernel_writes(self) -> bool:
        """The kernel writes the backing file itself for this handle."""
        return self.writable and bool(self.backing_id) and not self.direct_io


class OpenCounts:
    """Which path each open took, and the bytes each served (status, metrics). The kernel
    reads a passthrough handle's file itself, unseen: for those, the bytes opened."""

    def __init__(self) -> None:
        self.opens = {"passthrough_staged": 0, "passthrough_cached": 0, "daemon": 0}
        self.bytes_read = 0  # replied to READs by the daemon (from its threads or its loop)
        self.bytes_opened_passthrough = 0  # sizes of the files read opens passed through

    def opened(self, handle: Handle) -> None:
        node = handle.inode
        if handle.backing_id and not handle.direct_io:
            self.opens["passthrough_staged" if node.staged is not None else "passthrough_cached"] += 1
            if not handle.writable:
                self.bytes_opened_passthrough += node.size
        else:
            self.opens["daemon"] += 1

    def stats(self) -> dict[str, int]:
        return {**{f"opens_{path}": n for path, n in self.opens.items()},
                "bytes_read_daemon": self.bytes_read,
                "bytes_opened_passthrough": self.bytes_opened_passthrough}


@dataclass(eq=False)
class DirHandle:
    inode: Inode
    entries: list[Inode] | None = None

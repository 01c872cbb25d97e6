"""Close mode's background retries: a file whose close() failed to upload goes up later.

A file queued here is retried with backoff until it is in S3 or unlinked; `wait()`
(behind `ckptfs sync` and the drain at unmount) returns when every file under a
path is in S3, or reports the ones whose latest attempt failed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ckptfs.backlog import Backlog
from ckptfs.errors import UploadError
from ckptfs.inodes import Inode
from ckptfs.retry import Backoff

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    inode: Inode
    attempts: int = 0
    error: str | None = None


class UploadQueue(Backlog[int, _Entry]):
    """Files whose close failed, by inode number."""

    def __init__(self, commit: Callable[[Inode], Awaitable[None]],
                 path_of: Callable[[Inode], str], backoff: Backoff, nursery: trio.Nursery) -> None:
        super().__init__()
        self._commit = commit
        self._path_of = path_of
        self._backoff = backoff
        self._nursery = nursery  # runs the retries
        self.uploaded = 0

    def _path(self, item: _Entry) -> str:
        return self._path_of(item.inode)

    def _size(self, item: _Entry) -> int:
        return item.inode.size

    def add(self, inode: Inode) -> None:
        if inode.ino in self._items or not inode.dirty or inode.unlinked:
            return
        entry = self._items[inode.ino] = _Entry(inode)
        self._nursery.start_soon(self._run, entry)

    async def _run(self, entry: _Entry) -> None:
        inode = entry.inode
        attempt = 0
        try:
            while inode.dirty and not inode.unlinked:
                try:
                    await self._commit(inode)
                    entry.error = None
                    self.uploaded += 1
                except Exception as exc:  # noqa: BLE001 - one file's failure never ends the daemon
                    if not isinstance(exc, UploadError):
                        log.exception("upload of %s failed unexpectedly; retrying", self._path_of(inode))
                    entry.error = str(exc) or type(exc).__name__
                    entry.attempts += 1
                    self._notify()
                    attempt = await self._backoff.sleep(attempt)
                    continue
                if inode.dirty and inode.writers == 0:
                    continue  # written again while it uploaded
                break
        finally:
            self._items.pop(inode.ino, None)
            self._notify()

    async def wait(self, path: str = "") -> list[tuple[str, str]]:
        """Wait until everything pending under `path` is in S3 or has failed an attempt since now.

        Returns (path, reason) for each file that failed; [] means all of it is in S3.
        """
        under = self._under(path)
        start = self._attempts(ino for ino, e in self._items.items() if under(e))
        while any(ino in self._items and self._items[ino].attempts == n for ino, n in start.items()):
            await self._changed.wait()
        return self._failed_since(start)

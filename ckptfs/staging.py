"""Staged files: the local copy of a file being written, on the cache disk.

A staged file always holds the file's whole content (a file opened for writing
without O_TRUNC is downloaded first), so reads of a staged file never go to S3.
"""

from __future__ import annotations

import itertools
import os
import logging
import time

from ckptfs.broadcast import Broadcast

log = logging.getLogger(__name__)


class StagedFile:
    """One file's bytes on local disk; readable only by the mount's owner.

    The descriptor is opened on demand and closed while no handle uses the
    file, so thousands of clean local copies do not exhaust descriptors.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        # An entry of the ordered log publishes these bytes: they must not change until it is
        # applied (a writer gets a copy instead), nor be removed by anyone but the log.
        self.held = False

    @property
    def fd(self) -> int:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        return self._fd

    def pwrite(self, data: bytes, offset: int) -> int:
        return os.pwrite(self.fd, data, offset)

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Close and delete; safe to call twice."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def copy_file(src_path: str, dst_fd: int, size: int) -> None:
    """Copy the first `size` bytes of a file into `dst_fd` in the kernel (copy_file_range:
    a reflink where the file system has them); call from a worker thread."""
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(src, dst_fd, size - done, done, done)
            if n == 0:
                raise OSError(f"{src_path} is shorter than {size} bytes")
            done += n
    finally:
        os.close(src)


class StagingArea:
    """The staging directory under the cache dir, and the files in it."""

    def __init__(self, cache_dir: str) -> None:
        self.dir = os.path.join(cache_dir, "staging")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._names = itertools.count(1)
        self._run = f"{time.time_ns():x}-{os.getpid()}"
        # Where files of an earlier run that cannot be delivered are kept for the operator.
        self.preserved_dir = os.path.join(cache_dir, "preserved", time.strftime("%Y%m%dT%H%M%S"))
        self.preserved: str | None = None
        self._freed = Broadcast()

    def freed(self) -> None:
        """Staged bytes left the disk, or can now (uploaded, set aside, dropped): writers
        waiting for space look again."""
        self._freed.fire()

    async def wait_freed(self, deadline: float) -> None:
        """Until the next `freed()`, or the trio time `deadline`."""
        await self._freed.wait_until(deadline)

    def preserve_leftovers(self, keep: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """Move staged files of an earlier daemon that no journal record claims aside, never
        deleting them: they may hold the only copy of something a writer never closed."""
        leftovers = [n for n in os.listdir(self.dir) if n not in keep]
        if not leftovers:
            return
        os.makedirs(self.preserved_dir, mode=0o700, exist_ok=True)
        for name in leftovers:
            os.rename(os.path.join(self.dir, name), os.path.join(self.preserved_dir, name))
        log.warning("moved %d staged files of an earlier run (never closed) to %s",
                    len(leftovers), self.preserved_dir)
        self.preserved = self.preserved_dir

    def preserve(self, staged: StagedFile) -> str:
        """Move a staged file that must never be published (a killed writer's torn bytes)
        to the preserved dir, for the operator; returns its new path."""
        staged.close()
        os.makedirs(self.preserved_dir, mode=0o700, exist_ok=True)
        dest = os.path.join(self.preserved_dir, os.path.basename(staged.path))
        os.rename(staged.path, dest)
        self.preserved = self.preserved_dir
        return dest

    def new_file(self) -> StagedFile:
        # The start time keeps names unique across daemons, whatever pids the kernel hands out.
        return StagedFile(os.path.join(self.dir, f"{self._run}-{next(self._names)}"))

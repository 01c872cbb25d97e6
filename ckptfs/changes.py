"""How the mount's changes reach S3: the interface fs.py, files.py and tree.py call.

Two implementations, one per durability mode (`--durability close|async`), named for it:
- `CloseModeChanges` (closemode.py): every change is made in S3 before the call that made it
  returns; a close whose upload fails keeps retrying in the background (queue.py).
- `AsyncModeChanges` (asyncmode.py): every change is journaled and appended to the ordered
  log (oplog.py); S3 gets the changes in the order they were made.

Also here: `LocalCopies`, the one rule for an uploaded file's staged bytes once nobody has
the file open (they become a clean copy in the read cache), which both modes apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ckptfs.backlog import Backlog
from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache
from ckptfs.inodes import Inode, InodeTable
from ckptfs.staging import StagedFile, StagingArea
from ckptfs.uploader import Uploader
from ckptfs.uploads import UploadRecords

log = logging.getLogger(__name__)


class Changes(Protocol):
    backlog: Backlog[Any, Any]

    async def publish(self, node: Inode, *, fsynced: bool = False, background: bool = True) -> None:
        """The file's staged bytes as they are now become its object: close mode uploads them
        (UploadError if that fails; with `background`, it then keeps retrying), async mode
        appends their put to the log."""

    async def fsync(self, node: Inode) -> None:
        """fsync(2) of a file: close mode uploads its bytes now; async mode makes them durable
        on the cache disk, and its put follows in the log, in order."""

    async def metadata(self, node: Inode) -> None:
        """chmod/chown/utime of a file or directory whose bytes are not being written."""

    async def create(self, node: Inode, body: bytes) -> None:
        """A new directory marker or symlink object (`body`: the link's target)."""

    async def remove_file(self, node: Inode) -> None:
        """unlink: the object goes, and the name (the caller holds the upload lock)."""

    async def remove_dir(self, node: Inode, effect: Callable[[], None]) -> None:
        """rmdir of an empty directory; `effect` applies it to the mount."""

    async def rename(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                     move: Callable[[], None]) -> None:
        """`src` (file or directory) takes `new_name`, replacing `dst`; `move` applies it to
        the mount's table."""

    def could_free_space(self) -> bool:
        """Some closed file is on its way to S3: its staged copy can go after that."""

    def hand_over(self, torn: Inode, back: Inode) -> tuple[StagedFile, int] | None:
        """A torn file's name shows `back` again: its pending changes become `back`'s; the
        staged bytes (and size) of the version still waiting to be published, if any."""

    def stats(self) -> dict[str, Any]:
        ...


class ChangesBase:
    """What both modes' Changes work with."""

    def __init__(self, *, s3: Bucket, table: InodeTable, uploader: Uploader, records: UploadRecords,
                 cache: ObjectCache, staging: StagingArea, local: LocalCopies) -> None:
        self.s3 = s3
        self.table = table
        self.uploader = uploader
        self.records = records  # the one writer of journal records
        self.cache = cache
        self.staging = staging
        self.local = local


class LocalCopies:
    """An uploaded file nobody has open: its staged bytes move into the read cache, where
    reads find them and the cache's budget reclaims them."""

    def __init__(self, cache: ObjectCache, table: InodeTable) -> None:
        self.cache = cache
        self.table = table
        # Files gone from their names (unlinked, or replaced by a rename) that handles still
        # read: inode -> the version in the cache they read, dropped at the last release.
        self._read_while_gone: dict[int, tuple[str, str]] = {}

    def gone(self, inode: Inode, key: str) -> None:
        """The file's name is gone (unlink): its cached bytes go too, but those of the
        version an open handle reads, which go at its last release: a file stays readable
        through an open descriptor after its unlink, as POSIX has it."""
        self.replaced(inode, key)
        self.cache.drop_key(key, keep=inode.etag if inode.open_handles > 0 else None)

    def replaced(self, inode: Inode, key: str) -> None:
        """Another file took the name of `inode` (a rename), whose handles still read it."""
        if inode.open_handles > 0 and inode.etag is not None:
            self._read_while_gone[inode.ino] = (key, inode.etag)

    def read_under(self, key: str) -> str | None:
        """The ETag of a version of `key` that a handle still reads though its name is gone."""
        return next((etag for k, etag in self._read_while_gone.values() if k == key), None)

    def closed(self, inode: Inode) -> None:
        """The last handle of a file whose name is gone was released."""
        version = self._read_while_gone.pop(inode.ino, None)
        if version is not None:
            self.cache.drop_version(*version)

    def keep(self, inode: Inode) -> None:
        staged = inode.staged
        assert staged is not None
        staged.close()
        if staged.held:
            return  # the log publishes it first, then hands it back
        inode.stage(None)
        if inode.etag is None or inode.unlinked:
            staged.remove()
            return
        try:
            self.cache.adopt(self.table.key_of(inode), inode.etag, staged.path, inode.size)
        except OSError as exc:
            log.warning("could not keep %s in the read cache: %s", self.table.path_of(inode), exc)
            staged.remove()

    def keep_if_idle(self, inode: Inode) -> None:
        """`keep`, if the file is closed and S3 has all of it."""
        if inode.open_handles == 0 and inode.staged is not None and not inode.is_local:
            self.keep(inode)

"""Close mode: every change is in S3 before the call that made it returns.

close() and fsync() upload the file's staged bytes (parts already streamed during the write
are not sent again) and return once the object is complete and verified. If that fails the
caller gets EIO, the staged bytes are kept, and the file keeps retrying in the background
(queue.py), so `ckptfs sync` reports it and delivers it once S3 is back.

Renames go through renames.py (an intent in S3 first), as async mode's directory renames do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache
from ckptfs.changes import ChangesBase, LocalCopies
from ckptfs.errors import UploadError
from ckptfs.inodes import ROOT_INODE, Inode, InodeTable
from ckptfs.listing import DIRECTORY_TYPE, keeps_metadata
from ckptfs.metadata import object_metadata
from ckptfs.queue import UploadQueue
from ckptfs.renames import Renames, rename_in_s3
from ckptfs.staging import StagedFile, StagingArea
from ckptfs.uploader import Uploader
from ckptfs.uploads import UploadRecords

log = logging.getLogger(__name__)


class CloseModeChanges(ChangesBase):
    def __init__(self, *, s3: Bucket, table: InodeTable, uploader: Uploader, records: UploadRecords,
                 cache: ObjectCache, staging: StagingArea, local: LocalCopies,
                 nursery: trio.Nursery, renames: Renames) -> None:
        super().__init__(s3=s3, table=table, uploader=uploader, records=records, cache=cache,
                         staging=staging, local=local)
        self.renames = renames
        self.queue = UploadQueue(self._commit_in_background, table.path_of,
                                 uploader.policy.changes, nursery)
        self.backlog = self.queue  # what S3 does not have yet: files whose close failed
        self._committing = 0  # uploads of closed files in progress

    # ----- files ------------------------------------------------------------

    async def fsync(self, node: Inode) -> None:
        await self.publish(node, fsynced=True)

    async def publish(self, node: Inode, *, fsynced: bool = False, background: bool = True) -> None:
        try:
            await self.commit(node)
        except UploadError:
            if background:
                self.queue.add(node)
            raise

    async def commit(self, inode: Inode) -> None:
        """Make the inode's staged bytes the object in S3; returns when it is complete and verified.

        Raises UploadError (EIO at the FUSE boundary); the staged bytes are kept either way.
        """
        if inode.unlinked or not inode.dirty:
            return
        async with inode.upload_lock:
            if inode.unlinked or not inode.dirty or inode.staged is None:
                return
            if inode.write_error:
                raise UploadError(f"a write to {self.table.path_of(inode)} failed; it is not uploaded")
            clock = inode.clock
            key = self.table.key_of(inode)
            started = time.monotonic()
            metadata = object_metadata(inode)
            # Journaled first: if the daemon dies mid-upload, the next mount finishes it.
            await self.records.closed(inode.upload, key, inode.size, metadata)
            self._committing += 1
            try:
                result = await self.uploader.finish(inode.upload, inode.staged.path, key, inode.size,
                                                    metadata)
            except UploadError as exc:
                log.error("upload of %s failed, staged copy kept at %s: %s",
                          key, inode.staged.path, exc)
                raise
            finally:
                self._committing -= 1
            if inode.uploaded(result.etag, clock):
                await self.records.forget(inode.upload)
            self.staging.freed()
            log.debug("uploaded %s (%d bytes, %d parts) in %.2fs", key, inode.size, result.parts,
                      time.monotonic() - started)

    async def _commit_in_background(self, inode: Inode) -> None:
        await self.commit(inode)
        self.local.keep_if_idle(inode)

    def could_free_space(self) -> bool:
        return self._committing > 0 or bool(self.queue.pending())

    def hand_over(self, torn: Inode, back: Inode) -> tuple[StagedFile, int] | None:
        return None  # nothing waits: S3 has the previous version, if there is one

    # ----- names and metadata -------------------------------------------------

    async def metadata(self, node: Inode) -> None:
        if node.is_local or node.ino == ROOT_INODE:
            return
        key = self.table.key_of(node)
        if node.is_dir:
            marker = node.marker_key
            if marker is not None and keeps_metadata(marker):
                await self.s3.copy(marker, marker, 0, object_metadata(node),
                                   content_type=DIRECTORY_TYPE)
            else:
                await self.s3.put(key, b"", object_metadata(node))
            return
        if node.etag is None:
            return
        async with node.upload_lock:
            node.stored(await self.s3.copy(key, key, node.size, object_metadata(node), etag=node.etag))
            node.confirmed()

    async def create(self, node: Inode, body: bytes) -> None:
        etag = await self.s3.put(self.table.key_of(node), body, object_metadata(node))
        if not node.is_dir:
            node.stored(etag)

    async def remove_file(self, node: Inode) -> None:
        if node.etag is not None:
            await self.s3.delete(self.table.key_of(node))
        node.saved()
        self.local.gone(node, self.table.key_of(node))
        self.table.detach(node)

    async def remove_dir(self, node: Inode, effect: Callable[[], None]) -> None:
        await self.s3.delete(self.table.key_of(node))
        if node.marker_key is not None:
            await self.s3.delete(node.marker_key)
        effect()

    async def rename(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                     move: Callable[[], None]) -> None:
        await rename_in_s3(self.renames, self.table, self.cache, self.records, src, new_parent,
                           new_name, dst, move)

    def stats(self) -> dict[str, Any]:
        return {"uploads_retried_in_background": self.queue.uploaded}

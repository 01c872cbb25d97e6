"""Close mode: every change is in S3 before the call that made it returns.

close() and fsync() upload the file's staged bytes (parts already streamed during the write
are not sent again) and return once the object is complete and verified. If that fails the
caller gets EIO, the staged bytes are kept, and the file keeps retrying in the background
(queue.py), so `ckptfs sync` reports it and delivers it once S3 is back.

`rename_in_s3` is also how async mode renames a directory, once S3 has every earlier change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from ckptfs.cache import ObjectCache
from ckptfs.changes import ChangesBase, LocalCopies
from ckptfs.errors import CkptfsError, UploadError
from ckptfs.inodes import ROOT_INODE, Inode, InodeTable
from ckptfs.namespace import object_metadata
from ckptfs.queue import UploadQueue
from ckptfs.s3types import S3
from ckptfs.staging import StagedFile, StagingArea
from ckptfs.uploader import Uploader

log = logging.getLogger(__name__)


class DirectChanges(ChangesBase):
    def __init__(self, *, s3: S3, table: InodeTable, uploader: Uploader, cache: ObjectCache,
                 staging: StagingArea, local: LocalCopies, nursery: trio.Nursery) -> None:
        super().__init__(s3=s3, table=table, uploader=uploader, cache=cache, staging=staging,
                         local=local)
        self.stages_first = False
        self.queue = UploadQueue(self._commit_in_background, table.path_of,
                                 uploader.policy.changes, nursery)
        self.backlog = self.queue  # what S3 does not have yet: files whose close failed
        self._committing = 0  # uploads of closed files in progress

    # ----- files ------------------------------------------------------------

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
            await self.uploader.records.closed(inode.upload, key, inode.size, metadata)
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
            inode.etag = inode.page_etag = result.etag
            inode.meta_known = True
            inode.validated_at = time.monotonic()
            if inode.clock == clock:
                inode.dirty = False
                await self.uploader.records.forget(inode.upload)
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
            await self.s3.put(key, b"", object_metadata(node))
            return
        if node.etag is None:
            return
        async with node.upload_lock:
            node.etag = await self.s3.copy(key, key, node.size, object_metadata(node), etag=node.etag)
            node.validated_at = time.monotonic()

    async def create(self, node: Inode, body: bytes) -> None:
        etag = await self.s3.put(self.table.key_of(node), body, object_metadata(node))
        if not node.is_dir:
            node.etag = etag

    async def remove_file(self, node: Inode) -> None:
        if node.etag is not None:
            await self.s3.delete(self.table.key_of(node))
        node.dirty = False
        self.cache.drop_key(self.table.key_of(node))
        self.table.detach(node)

    async def remove_dir(self, node: Inode, effect: Callable[[], None]) -> None:
        await self.s3.delete(self.table.key_of(node))
        effect()

    async def rename(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                     move: Callable[[], None]) -> None:
        await rename_in_s3(self.s3, self.table, self.cache, self.uploader, src, new_parent,
                           new_name, dst, move)

    def stats(self) -> dict[str, Any]:
        return {"uploads_retried_in_background": self.queue.uploaded}


async def rename_in_s3(s3: S3, table: InodeTable, cache: ObjectCache, uploader: Uploader,
                       src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                       move: Callable[[], None]) -> None:
    """A rename made in S3 at once: copy then delete (every object under a directory)."""
    new_key = table.key_of(new_parent) + new_name
    if dst is not None and dst.is_dir:
        # Before the move, not after: the empty target's marker is the key the moved
        # directory's marker takes, and stores with real folders delete recursively.
        await s3.delete(table.key_of(dst))
    if src.is_dir:
        await _rename_dir(s3, table, src, new_key + "/")
    else:
        await _rename_object(s3, table, cache, src, new_key, dst)
    if dst is not None:
        await uploader.records.forget(dst.upload)
    move()
    await _rejournal(table, uploader, src)


async def _rejournal(table: InodeTable, uploader: Uploader, node: Inode) -> None:
    """Closed files not yet in S3 under a renamed name: their records must name the new key."""
    if node.is_dir:
        for child in table.children(node.ino):
            await _rejournal(table, uploader, child)
        return
    rec = node.upload.record
    if rec is not None and rec.closed:
        await uploader.records.closed(node.upload, table.key_of(node), node.size,
                                      object_metadata(node), rec.fsynced)


async def _rename_object(s3: S3, table: InodeTable, cache: ObjectCache, src: Inode,
                         new_key: str, dst: Inode | None) -> None:
    async with src.upload_lock:
        old_key = table.key_of(src)
        if src.etag is not None:
            old_etag = src.etag
            src.etag = await s3.copy(old_key, new_key, src.size, etag=old_etag)
            await s3.delete(old_key)
            if not src.is_local:
                cache.rekey(old_key, old_etag, new_key, src.etag)
            src.page_etag = src.etag if src.page_etag == old_etag else src.page_etag
        elif dst is not None and dst.etag is not None:
            # The new name must not keep showing the replaced object until src's upload.
            await s3.delete(new_key)


async def _rename_dir(s3: S3, table: InodeTable, src: Inode, new_prefix: str) -> None:
    """Copy every object under the directory to its new name, then delete the old ones."""
    old_prefix = table.key_of(src)
    objects = await s3.list_keys(old_prefix)
    new_etags: dict[str, str] = {}

    async def move_one(key: str, size: int, etag: str) -> None:
        rest = key[len(old_prefix):]
        if key.endswith("/"):  # a directory marker: some stores cannot copy those
            info = await s3.head(key)
            await s3.put(new_prefix + rest, b"", info.metadata)
        else:
            new_etags[rest] = await s3.copy(key, new_prefix + rest, size, etag=etag)

    async with trio.open_nursery() as nursery:
        for obj in objects:
            nursery.start_soon(move_one, obj.key, obj.size, obj.etag)
    if old_prefix not in {o.key for o in objects}:
        await s3.put(new_prefix, b"", object_metadata(src))  # keep even an empty implicit dir
    await s3.delete_many([o.key for o in objects])
    # Stores with real folders (SeaweedFS) keep emptied folders; delete them deepest first.
    folders = {old_prefix}
    for obj in objects:
        parts = obj.key[len(old_prefix):].split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            folders.add(old_prefix + "/".join(parts[:depth]) + "/")
    for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):
        try:
            await s3.delete(folder)
        except CkptfsError:
            pass
    _refresh_etags(table, src, "", new_etags)


def _refresh_etags(table: InodeTable, directory: Inode, rel: str, etags: dict[str, str]) -> None:
    for child in table.children(directory.ino):
        path = rel + child.name
        if child.is_dir:
            _refresh_etags(table, child, path + "/", etags)
        elif path in etags and child.etag is not None:
            child.etag = etags[path]

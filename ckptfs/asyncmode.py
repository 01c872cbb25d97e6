"""Async mode: every change reaches S3 through the ordered log (oplog.py), in order.

A close or fsync appends the put of the file's bytes as they are then; from there the
staged file is held (a later write works on a copy, files.py). Parts stream while the file
is written, as in close mode, and the put takes that multipart upload over. Deletes,
directory markers, symlinks, renames (a directory's too) and metadata are entries too. The
mount shows each change at once; S3 gets it in its turn, and `on_done` brings the inode up
to date with what S3 then holds.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import trio

from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache
from ckptfs.changes import ChangesBase, LocalCopies
from ckptfs.errors import Refused
from ckptfs.inodes import ROOT_INODE, Inode, InodeTable
from ckptfs.journal import Record
from ckptfs.listing import keeps_metadata
from ckptfs.metadata import object_metadata
from ckptfs.oplog import Entry, OrderedLog
from ckptfs.renames import files_under, locked
from ckptfs.staging import StagedFile, StagingArea, copy_file
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload, UploadRecords


class AsyncModeChanges(ChangesBase):
    def __init__(self, *, log: OrderedLog, s3: Bucket, table: InodeTable, uploader: Uploader,
                 records: UploadRecords, cache: ObjectCache, staging: StagingArea,
                 local: LocalCopies) -> None:
        super().__init__(s3=s3, table=table, uploader=uploader, records=records, cache=cache,
                         staging=staging, local=local)
        self.log = log
        self.backlog = log  # what S3 does not have yet: the log's entries

    # ----- files ------------------------------------------------------------

    async def fsync(self, node: Inode) -> None:
        """The staged bytes become durable here (the put appended below then is too, at a
        power loss); S3 gets them in their turn."""
        if node.staged is None:
            return
        await trio.to_thread.run_sync(os.fsync, node.staged.fd)
        node.own_close()
        await self.publish(node, fsynced=True)

    async def publish(self, node: Inode, *, fsynced: bool = False, background: bool = True) -> None:
        """Append the put of the file's bytes as they are now; S3 gets them in their turn."""
        async with node.upload_lock:  # two FLUSHes at once append one put, not two
            if not node.dirty or node.unlinked or node.staged is None:
                return
            if node.write_error:
                raise Refused(node.write_error)
            staged = node.staged
            if staged.held:
                # An earlier put publishes this very file, and the kernel wrote it since
                # (passthrough: the write did not go to a copy, files._unshare). This put
                # gets a copy of its own: one staged file, and journal record, per entry.
                staged = await self._snapshot(staged, node.size)
            key = self.table.key_of(node)
            # No object at the name before this put: a rename right after may retarget it.
            fresh = not node.has_object
            rec = Record(os.path.basename(staged.path), key, True, node.size, object_metadata(node),
                         fsynced=fsynced, part_size=self.uploader.plan.base_size)
            clock = node.clock
            up = node.upload  # the parts streamed while it was written: the entry takes them over
            appended = False

            def effect() -> None:
                nonlocal appended
                appended = True
                node.logged()
                node.saved(clock)
                if node.upload is up:  # (a write meanwhile moved to a copy, with its own upload)
                    # The inode's next bytes (a copy, files.py) get an upload of their own.
                    node.next_upload(FileUpload(clock=up.clock))

            # Held from here, not from the append: a write that comes while the record is
            # journaled goes to a copy (files._unshare), so the put publishes the file as it
            # was at this call, never with part of a later write in it.
            staged.held = True
            try:
                await self.log.append(rec, self.table.path_of(node), staged=staged, owner=node,
                                      on_done=self._entry_done, fresh=fresh, effect=effect, up=up)
            finally:
                if not appended:
                    staged.held = False
                    if node.staged is not staged:  # a copy, or a write moved to a copy
                        staged.remove()

    async def _snapshot(self, live: StagedFile, size: int) -> StagedFile:
        copy = self.staging.new_file()
        try:
            await trio.to_thread.run_sync(copy_file, live.path, copy.fd, size)
        except BaseException:
            copy.remove()
            raise
        return copy

    def _entry_done(self, entry: Entry, etag: str | None) -> None:
        """S3 has applied a log entry about this inode (its `owner`)."""
        node: Inode = entry.owner
        node.applied()
        rec = entry.rec
        renamed_since = node.unlinked or rec.key != self.table.key_of(node)
        # Renamed since the entry (a rename in the log after it): S3 holds the object at
        # `rec.key` all the same, and moves it in that rename's turn. The mount must know it
        # has an object: an unlink before then appends the delete that removes it (without
        # it, a file in a directory renamed after its put came back under the new name).
        if rec.op == "put":
            staged = entry.staged
            assert staged is not None
            staged.held = False
            if etag and not node.unlinked:
                node.stored(etag)
            if node.staged is staged and not node.unlinked:
                node.published(etag)
                self.local.keep_if_idle(node)
            elif node.staged is not staged:
                staged.remove()  # an older version, or the file is gone
            self.staging.freed()
        elif rec.op == "copy":
            later = [e.rec.src for e in self.log.entries_of(node) if e.rec.op == "copy"]
            node.reads_from(later[0] if later else None)
            if etag and not node.unlinked:
                old = node.etag
                node.moved(etag)
                if old is not None and rec.src and not node.is_local:
                    # As close mode's rename; a replaced version a handle reads stays.
                    self.cache.rekey(rec.src, old, rec.key, etag,
                                     keep=self.local.read_under(rec.key))
        elif etag and not node.is_dir and not renamed_since:
            node.moved(etag)
        node.confirmed()

    def could_free_space(self) -> bool:
        return self.log.pending_bytes() > 0

    def hand_over(self, torn: Inode, back: Inode) -> tuple[StagedFile, int] | None:
        previous = self.log.latest_put(torn)
        for entry in self.log.entries_of(torn):
            entry.owner = back
        torn.handed_over()
        if previous is not None and previous.staged is not None:
            return previous.staged, previous.rec.size  # still held: published in its turn
        return None

    # ----- names and metadata -------------------------------------------------

    async def _append(self, node: Inode, rec: Record, body: bytes | None = None,
                      effect: Callable[[], None] | None = None) -> None:
        """Append a change of `node` that is not a put (marker, symlink, metadata, rename)."""
        if body is not None:
            rec = dataclasses.replace(rec, body=base64.b64encode(body).decode())

        def counted() -> None:
            node.logged()
            if effect is not None:
                effect()

        await self.log.append(rec, self.table.path_of(node), owner=node, on_done=self._entry_done,
                              masks=(rec.src,) if rec.src else (), effect=counted)

    async def metadata(self, node: Inode) -> None:
        """chmod/chown/utime: S3 gets the new metadata after everything before it."""
        if node.ino == ROOT_INODE:
            return
        key = self.table.key_of(node)
        if node.is_dir:
            marker = node.marker_key
            if marker is not None and keeps_metadata(marker):  # in place (listing.py)
                await self._append(node, Record("", marker, True, metadata=object_metadata(node),
                                                op="meta"))
            else:
                await self._append(node, Record("", key, True, metadata=object_metadata(node),
                                                op="object"), b"")
            return
        if node.dirty or node.writers > 0:
            return  # still being written: the put at close carries it
        if not node.has_object:
            return  # never closed: nothing in S3 to change
        entry = self.log.latest_put(node)
        if entry is not None and await self.log.amend_metadata(entry, object_metadata(node)):
            return
        await self._append(node, Record("", key, True, metadata=object_metadata(node), op="meta"))

    async def create(self, node: Inode, body: bytes) -> None:
        await self._append(node, Record("", self.table.key_of(node), True,
                                        metadata=object_metadata(node), op="object"), body)

    async def remove_file(self, node: Inode) -> None:
        key = self.table.key_of(node)

        def effect() -> None:
            node.saved()
            self.local.gone(node, self.table.object_key(node))
            self.table.detach(node)

        if node.has_object:
            await self.log.append(Record("", key, True, op="delete"), self.table.path_of(node),
                                  masks=(key,), effect=effect)
        else:
            effect()

    async def remove_dir(self, node: Inode, effect: Callable[[], None]) -> None:
        # Masks the whole prefix: S3 lists what is under it until the delete's turn.
        marker = node.marker_key
        await self.log.append(Record("", self.table.key_of(node), True, op="delete"),
                              self.table.path_of(node), masks=(self.table.key_of(node),),
                              effect=effect if marker is None else None)
        if marker is not None:  # another tool's marker object of the directory goes too
            await self.log.append(Record("", marker, True, op="delete"), self.table.path_of(node),
                                  masks=(marker,), effect=effect)

    async def rename(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                     move: Callable[[], None]) -> None:
        if src.is_dir:
            await self._rename_dir(src, new_parent, new_name, dst, move)
            return
        # A file: the put it follows is retargeted, or S3 copies and deletes in turn.
        old_key = self.table.key_of(src)
        new_key = self.table.key_of(new_parent) + new_name
        new_path = (self.table.path_of(new_parent) + "/" + new_name).lstrip("/")
        entry = self.log.latest_put(src)
        replaces = dst is not None and dst.has_object
        if entry is not None and await self.log.retarget(entry, new_key, new_path, move,
                                                         replaces=replaces):
            return
        if src.has_object:
            def effect() -> None:
                if src.read_key is None:
                    src.reads_from(old_key)  # reads find the object there until the copy
                move()
            await self._append(src, Record("", new_key, True, op="copy", src=old_key),
                               effect=effect)
        elif dst is not None and dst.has_object:
            # The name shows a file never closed: S3 must not keep the replaced object.
            await self.log.append(Record("", new_key, True, op="delete"), new_path, effect=move)
        else:
            move()

    async def _rename_dir(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                          move: Callable[[], None]) -> None:
        """A directory's rename is an entry of the log like any other change: the mount shows
        it at once, and in its turn S3 moves every object under the directory
        (`Renames.move_dir`, under an intent: all or nothing through any crash). Until then
        the table maps the new names back to where S3 holds them (`InodeTable.redirect`),
        and the old ones are masked. The upload locks of its files are held while it is
        appended: a put of one of them is appended before it (and moved with the rest) or
        after it (under the new name)."""
        old_prefix = self.table.key_of(src)
        new_prefix = self.table.key_of(new_parent) + new_name + "/"
        new_path = (self.table.path_of(new_parent) + "/" + new_name).lstrip("/")
        also = (src.marker_key,) if src.marker_key is not None else ()
        replaced = () if dst is None else tuple(
            k for k in (self.table.key_of(dst), dst.marker_key) if k is not None)
        rec = Record("", new_prefix, True, metadata=object_metadata(src), op="dirmove",
                     src=old_prefix, body=json.dumps({"also_delete": also, "replaced": replaced}))
        token: list[object] = []  # the redirect, while S3 holds the objects at the old keys

        def effect() -> None:
            src.logged()
            src.marked_by(None)  # moved (or deleted) with the rest; a "dir/" marker is made
            token.append(self.table.redirect(new_prefix, old_prefix))
            self.log.masks.follow(old_prefix, new_prefix)
            move()

        def at_new_keys() -> None:
            if token:
                self.table.unredirect(token.pop())

        def copied(etags: dict[str, str]) -> None:
            # S3 holds every object at its new key, and deletes the old ones next: requests
            # go to the new keys from here (a LIST or GET of the old ones, while they are
            # deleted, found nothing: a listing emptied of files the kernel had forgotten).
            at_new_keys()
            self._moved(src, "", old_prefix, new_prefix, etags)

        def done(entry: Entry, etags: Any) -> None:
            src.applied()
            at_new_keys()  # (nothing was under the old prefix: nothing was copied)

        async with locked(files_under(self.table, src)):
            await self.log.append(rec, new_path, owner=src, on_done=done,
                                  masks=(old_prefix, *also), effect=effect, on_copied=copied)

    def _moved(self, directory: Inode, rel: str, old_prefix: str, new_prefix: str,
               etags: dict[str, str]) -> None:
        """S3 moved the directory's objects: its files' new ETags, and their cached bytes
        under the new keys."""
        for child in self.table.children(directory.ino):
            path = rel + child.name
            if child.is_dir:
                if child.marker_key is not None and child.marker_key.startswith(old_prefix):
                    child.marked_by(new_prefix + child.marker_key[len(old_prefix):])
                self._moved(child, path + "/", old_prefix, new_prefix, etags)
            elif path in etags and not child.unlinked:
                old, new = child.etag, etags[path]
                if old is not None:
                    self.cache.rekey(old_prefix + path, old, new_prefix + path, new)
                child.moved(new)

    def stats(self) -> dict[str, Any]:
        return {"log_entries": len(self.log)}

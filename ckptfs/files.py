"""The open-file lifecycle: a file's bytes from open to S3, and back to the read cache.

- Stage: a new file gets an empty staged file; opening an existing one for writing takes
  its cached copy or downloads it (a truncating open starts empty).
- Write: a pwrite into the staged file. On a full cache disk the read cache is emptied
  first, then the writer waits while some closed file is on its way to S3 (whose copy can
  go after that), up to `--upload-timeout`; then ENOSPC.
- Close and fsync hand the bytes to `changes` (changes.py): close mode uploads them now,
  async mode appends them to the ordered log. A writer killed mid-write, or a file one of
  whose writes failed, is never published.
- The last release keeps an uploaded file's bytes as a clean copy in the read cache.

Bytes a pending log entry publishes are held: a rewrite works on a copy (`_unshare`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from typing import Any

import pyfuse3
import trio

from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache
from ckptfs.changes import Changes, LocalCopies
from ckptfs.errors import CkptfsError, NoSpace
from ckptfs.handles import ReadStream
from ckptfs.inodes import Inode, InodeTable
from ckptfs.localread import Reply, reply_size
from ckptfs.metadata import object_metadata
from ckptfs.namespace import Namespace
from ckptfs.opener import Opener, killing_signal
from ckptfs.passthrough import Passthrough
from ckptfs.prefetch import ChunkReader
from ckptfs.staging import StagedFile, StagingArea, copy_file
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload, UploadRecords

log = logging.getLogger(__name__)

_DOWNLOAD_CHUNK = 16 * 1024 * 1024
_TORN_KEPT = 100  # status shows the latest hundred torn writes


class OpenFiles:
    def __init__(self, *, s3: Bucket, table: InodeTable, ns: Namespace, staging: StagingArea,
                 cache: ObjectCache, uploader: Uploader, records: UploadRecords,
                 reader: ChunkReader, changes: Changes, local: LocalCopies) -> None:
        self.s3 = s3
        self.table = table
        self.ns = ns
        self.staging = staging
        self.cache = cache
        self.uploader = uploader
        self.records = records  # the one writer of journal records
        self.reader = reader
        self.changes = changes
        self.local = local
        self.space_wait = uploader.upload_timeout  # how long a writer waits for space
        self.write_calls = 0
        self.bytes_written = 0  # through the daemon's write handler
        self.local_read_bytes = 0  # reads answered from staged files and local copies
        self.whole_fetches = 0  # read opens that fetched their object whole first
        self.torn_writes: list[dict] = []  # writers killed mid-write: not published

    def stats(self) -> dict[str, Any]:
        return {"write_calls": self.write_calls, "bytes_written": self.bytes_written,
                "local_read_bytes": self.local_read_bytes, "whole_fetches": self.whole_fetches,
                "torn_writes": list(self.torn_writes)}

    # ----- open ---------------------------------------------------------------

    def create(self, parent: Inode, name: str, mode: int, uid: int, gid: int) -> Inode:
        """A new regular file, open for writing, with an empty staged file."""
        now = time.time_ns()
        self.ns.forget_absent(parent.ino, name)
        node = self.table.add(parent.ino, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid,
                              mtime_ns=now, ctime_ns=now, atime_ns=now, meta_known=True)
        node.stage(self._new_staged(node))
        node.opened(writable=True)
        node.changed()
        parent.touch()
        return node

    async def open_for_write(self, node: Inode, truncate: bool) -> None:
        """A writable handle of an existing file: its whole content staged (none if truncating)."""
        node.opened(writable=True)
        try:
            if truncate:
                await self.records.changing(node.upload)
            await self._ensure_staged(node, truncate)
        except BaseException:
            node.released(writable=True)
            raise
        if truncate:
            node.truncated(0)

    async def _ensure_staged(self, inode: Inode, truncate: bool) -> None:
        """Give `inode` a staged file holding its whole content (or none, if truncating)."""
        while True:
            if inode.staged is not None:
                await self._unshare(inode, keep_bytes=not truncate)
            # (The log may have applied the staged bytes meanwhile and, with no handle
            # open, moved them to the read cache: then they are staged again from there.)
            if inode.staged is not None:
                if truncate:
                    inode.staged.truncate(0)
                    self.uploader.note_truncate(inode.upload, 0)
                return
            staged = self.staging.new_file()
            try:
                if not truncate and inode.etag is not None and inode.size > 0:
                    key = self.table.object_key(inode)
                    staged.close()
                    # A cached whole copy becomes the staged file (a rename); else download it.
                    if not self.cache.take(key, inode.etag, staged.path):
                        await self.s3.download_to(key, staged.fd, inode.size, _DOWNLOAD_CHUNK,
                                                  inode.etag)
            except BaseException:
                staged.remove()
                raise
            if inode.staged is not None:  # another open staged it while this one downloaded
                staged.remove()
                continue
            inode.stage(staged)
            inode.upload.journal_name = os.path.basename(staged.path)
            inode.upload.crcs.clear()  # they describe bytes written to an earlier staged file
            return

    async def _unshare(self, inode: Inode, keep_bytes: bool) -> None:
        """Before the staged bytes change: if a pending log entry publishes them, the inode
        moves to a copy (or, when truncating, a new empty file); the entry keeps its bytes.
        Copy rather than wait: the entry may sit behind a long backlog."""
        while inode.staged is not None and inode.staged.held:
            old = inode.staged
            new = self.staging.new_file()
            try:
                if keep_bytes and inode.size > 0:
                    await trio.to_thread.run_sync(copy_file, old.path, new.fd, inode.size)
            except BaseException as exc:
                new.remove()
                if isinstance(exc, OSError) and inode.staged is not old:
                    continue  # the log published `old` and moved it on while it was copied
                raise
            if inode.staged is not old:  # changed while copying: start from what it is now
                new.remove()
                continue
            # The write clock goes on: a put appended before the copy compares against it.
            inode.stage(new, upload=FileUpload(journal_name=os.path.basename(new.path),
                                               clock=inode.upload.clock))
            if not old.held:  # published while copying: nobody refers to it any more
                old.remove()

    def _new_staged(self, inode: Inode) -> StagedFile:
        staged = self.staging.new_file()
        inode.upload.journal_name = os.path.basename(staged.path)
        return staged

    # ----- read and write -------------------------------------------------------

    async def fetch_whole(self, node: Inode, pt: Passthrough) -> None:
        """Before a read open of an object not local (--cold-open whole): fetch all of it, at
        full parallelism, into its cache file, which the open then passes through: the reader's
        own thread copies the bytes, the daemon only receives them. Not where the open could not
        pass through anyway, or the object does not fit the cache: the daemon streams those."""
        if (not pt.enabled or node.staged is not None or node.etag is None or not node.size
                or pt.serving_cached(node)):
            return
        self.whole_fetches += 1
        await self.reader.fetch_whole(self.table.object_key(node), node.etag, node.size)

    async def read(self, node: Inode, off: int, size: int, stream: ReadStream) -> Reply:
        if node.staged is not None:
            data = await self.reader.read_local(node.staged.fd, size, off)
            self.local_read_bytes += reply_size(data)
            return data
        if node.etag is None or off >= node.size:
            return b""
        return await self.reader.read(self.table.object_key(node), node.etag, node.size, off,
                                      size, stream)

    async def write(self, node: Inode, off: int, buf: bytes) -> int:
        assert node.staged is not None
        self.write_calls += 1
        if node.upload.record is not None:
            await self.records.changing(node.upload)
        try:
            written = await self._pwrite(node, buf, off)
        except (OSError, NoSpace) as exc:
            # The file now lacks bytes its writer meant it to have: it must never be uploaded.
            node.write_failed(exc.errno or errno.EIO)
            log.error("write to %s failed, the file will not be uploaded: %s",
                      self.table.path_of(node), exc)
            raise
        self.bytes_written += written
        node.wrote(off + written)
        if not node.unlinked:  # an unlinked file is never uploaded
            self.uploader.note_write(node.upload, node.staged.path, lambda: self.table.key_of(node),
                                     lambda: object_metadata(node), off, off + written,
                                     buf if written == len(buf) else buf[:written])
        return written

    async def _pwrite(self, node: Inode, buf: bytes, off: int) -> int:
        """Write all of `buf`; on a full cache disk, free space or wait for uploads to free it."""
        assert node.staged is not None
        done = 0
        waited_until = trio.current_time() + self.space_wait
        while done < len(buf):
            if node.staged.held:  # a pending log entry publishes these bytes: write a copy
                await self._unshare(node, keep_bytes=True)
                continue
            try:
                done += node.staged.pwrite(buf[done:] if done else buf, off + done)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
            if self.cache.reclaim() > 0:  # the read cache holds clean bytes only
                continue
            if not self.changes.could_free_space() or trio.current_time() >= waited_until:
                raise NoSpace(f"cache disk full ({self.staging.dir}) writing {self.table.path_of(node)}")
            log.warning("cache disk full: %s waits for uploads to free space", self.table.path_of(node))
            await self.staging.wait_freed(waited_until)
        return done

    async def truncate(self, node: Inode, size: int, in_place: bool = False) -> None:
        """`in_place`: the kernel writes the staged file itself (passthrough), so the truncate
        goes to that very file, even one a pending put holds (it never moves to a copy)."""
        await self.records.changing(node.upload)
        if not (in_place and node.staged is not None):
            await self._ensure_staged(node, truncate=size == 0)
        assert node.staged is not None
        node.staged.truncate(size)
        self.uploader.note_truncate(node.upload, size)
        node.truncated(size)

    # ----- close ------------------------------------------------------------------

    async def close(self, node: Inode, opener: Opener | None) -> None:
        """FLUSH of a writable handle: publish, unless the kernel closes for a killed writer."""
        if opener is not None and node.dirty:
            signal_number = killing_signal(opener)
            if signal_number:
                # The kernel closes a dying writer's files: that is no close() of its own.
                node.torn_by(signal_number)
                if node.writers <= 1:  # no other writer may still finish the file: now,
                    await self._discard_torn(node)  # before the dying process is gone
                return
            node.own_close()
        await self.changes.publish(node)

    async def fsync(self, node: Inode) -> None:
        await self.changes.fsync(node)

    async def publish_now(self, node: Inode) -> None:
        """A change no close() will follow (truncate(2) by path): S3 gets it as at a close,
        and a failure is the caller's."""
        await self.changes.publish(node, background=False)

    async def release(self, node: Inode, writable: bool) -> None:
        node.released(writable)
        if writable and node.writers == 0 and node.torn and node.dirty and not node.unlinked:
            await self._discard_torn(node)  # the last writer was the one killed
        if node.open_handles > 0:
            return
        if node.unlinked:
            await self.uploader.abort(node.upload)
            node.drop_staged()
            self.local.closed(node)
        elif node.write_error:
            await self._discard_failed_write(node)
        elif node.staged is not None and not node.is_local:
            self.local.keep(node)
        elif node.staged is not None:
            # Still to reach S3 (a failed close-mode upload, or waiting in the log): keep
            # every byte; only the descriptor goes.
            node.staged.close()
        self.table.forget(node.ino, 0)

    async def _discard_failed_write(self, node: Inode) -> None:
        """Forget the bytes of a file whose write failed: the name shows S3's object again."""
        async with node.upload_lock:
            if node.etag is None:  # it never existed in S3: the name goes at once, before
                parent, name = node.parent, node.name  # the wait for parts in flight below
                self.table.detach(node)
                pyfuse3.invalidate_entry_async(parent, os.fsencode(name), ignore_enoent=True)
            await self.uploader.abort(node.upload)
            await self.records.forget(node.upload)
            staged = node.discarded()
            if staged is not None and not staged.held:
                staged.remove()
            if node.etag is not None:
                node.expired()  # size and mtime come from S3 again
        self.staging.freed()

    async def _discard_torn(self, node: Inode) -> None:
        """A writer was killed mid-write: its bytes are set aside, never published, and the
        name shows what it showed before (the version S3 or the log has), or nothing."""
        signal_number, path = node.torn, self.table.path_of(node)
        async with node.upload_lock:
            await self.uploader.abort(node.upload)
            await self.records.forget(node.upload)
            staged = node.discarded()
            kept = "nothing staged"
            if staged is not None and not staged.held:
                try:
                    kept = self.staging.preserve(staged)
                except OSError as exc:
                    kept = f"could not keep them: {exc.strerror}"
                    staged.remove()
            log.warning("%s: its writer was killed by signal %d before closing it; not published "
                        "(the bytes it had written are in %s)", path, signal_number, kept)
            self.torn_writes.append({"path": path, "signal": signal_number, "preserved": kept})
            del self.torn_writes[:-_TORN_KEPT]
            parent, name = node.parent, node.name
            if node.has_object:
                await self._restore_previous(node)
            else:
                self.table.detach(node)
        # The kernel must drop its dentry before the dying writer is gone: its page cache
        # holds the torn bytes under the old inode. From a worker thread (the kernel may call
        # back into this loop), never longer than a few seconds.
        with trio.move_on_after(5):
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, os.fsencode(name),
                                              abandon_on_cancel=True)
            except OSError:
                pass
        self.staging.freed()

    async def _restore_previous(self, torn: Inode) -> None:
        """The torn inode leaves the name (the kernel's pages of it must not be read again);
        a new one shows the version S3 or the log has."""
        self.table.detach(torn)
        back = self.table.add(torn.parent, torn.name, torn.mode, torn.uid, torn.gid,
                              mtime_ns=torn.mtime_ns, ctime_ns=torn.ctime_ns,
                              atime_ns=torn.atime_ns, etag=torn.etag, read_key=torn.read_key,
                              pending=torn.pending)
        previous = self.changes.hand_over(torn, back)
        if previous is not None:
            back.stage(*previous)
        elif back.is_local:  # a rename waits in the log: S3 has the object elsewhere
            try:
                await self.ns.reload(back, self.table.object_key(back))
            except CkptfsError:
                pass

    async def shutdown(self) -> None:
        """At unmount: streamed parts of files never closed go; clean staged bytes stay
        readable after the next mount. Closed files not yet in S3 keep their records."""
        for inode in self.table.all():
            await self.uploader.abort(inode.upload)
            if inode.staged is not None and not inode.is_local and not inode.staged.held:
                self.local.keep(inode)

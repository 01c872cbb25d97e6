"""pyfuse3.Operations: unpack arguments, call components, map errors to errno.

Every handler runs under `_guarded`, so an unexpected exception becomes EIO
(and a log line) instead of taking the whole mount down.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio

from ckptfs.errors import CkptfsError, NoSpace, NoSuchKey, UploadError, raise_first_error
from ckptfs.inodes import ROOT_INODE, Inode, InodeTable
from ckptfs.journal import Record
from ckptfs.namespace import KEY_MAX, NAME_MAX, Namespace, object_metadata
from ckptfs.opener import Opener, killing_signal, opener_of
from ckptfs.oplog import Entry, OrderedLog
from ckptfs.prefetch import ChunkReader, ReadStream
from ckptfs.queue import UploadQueue
from ckptfs.s3 import S3Client
from ckptfs.cache import ObjectCache
from ckptfs.staging import StagedFile, StagingArea, copy_file
from ckptfs.uploader import FileUpload, Uploader

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
_DOWNLOAD_CHUNK = 16 * 1024 * 1024


def _guarded(fn: F) -> F:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with raise_first_error():  # a nursery's group: report its first failure
                return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
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


def _fail(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


@dataclass(eq=False)
class Handle:
    inode: Inode
    writable: bool
    stream: ReadStream = field(default_factory=ReadStream)
    opener: Opener | None = None  # who opened it for writing (FLUSH does not say who closes)


@dataclass(eq=False)
class DirHandle:
    inode: Inode
    entries: list[Inode] | None = None


class CheckpointFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = True

    def __init__(self, *, s3: S3Client, prefix: str, staging: StagingArea, uploader: Uploader,
                 reader: ChunkReader, uid: int, gid: int, read_only: bool, metadata_ttl: float,
                 cache: ObjectCache, durability: str = "close", log: OrderedLog | None = None) -> None:
        super().__init__()
        self.s3 = s3
        self.table = InodeTable(prefix, uid, gid)
        # Async mode: every change reaches S3 through the ordered log, in order.
        self.log = log if durability == "async" else None
        self.ns = Namespace(s3, self.table, uid, gid, metadata_ttl,
                            masked=self.log.masked if self.log is not None else None)
        self.staging = staging
        self.uploader = uploader
        self.reader = reader
        self.read_only = read_only
        self.ttl = metadata_ttl
        self.cache = cache
        self.draining = False
        self.initialized = trio.Event()  # set once the kernel's FUSE INIT has been answered
        self.spot_notice: dict | None = None
        self.durability = durability
        self.queue = UploadQueue(self._commit_in_background, self.table.path_of,
                                 uploader.policy.changes)
        self.write_calls = 0
        self.local_read_bytes = 0  # reads answered from staged files and local copies
        self.space_freed = trio.Event()  # set whenever an upload completes (its copy can go)
        self.space_wait = uploader.upload_timeout  # how long a writer waits for space
        self._handles: dict[int, Handle | DirHandle] = {}
        self._next_fh = 1
        self.torn_writes: list[dict] = []  # writers killed mid-write: not published

    # ----- helpers -------------------------------------------------------

    def init(self) -> None:
        # libfuse calls this while it answers the kernel's INIT; the reply goes out right after.
        self.initialized.set()

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = self.ttl
        a.attr_timeout = self.ttl
        a.st_mode = inode.mode
        a.st_nlink = 2 if inode.is_dir else 1
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = 0
        a.st_size = len(inode.symlink_target) if inode.symlink_target is not None else inode.size
        a.st_blksize = 1 << 20
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = inode.atime_ns
        a.st_mtime_ns = inode.mtime_ns
        a.st_ctime_ns = inode.ctime_ns
        return a

    def _inode(self, ino: int) -> Inode:
        inode = self.table.get(ino)
        if inode is None:
            raise _fail(errno.ENOENT)
        return inode

    def _new_fh(self, handle: Handle | DirHandle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        return fh

    def _file_handle(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if not isinstance(handle, Handle):
            raise _fail(errno.EBADF)
        return handle

    def _check_writable(self) -> None:
        if self.read_only or self.draining:
            raise _fail(errno.EROFS)

    def _name(self, parent: Inode, raw: bytes) -> str:
        """A child name checked against POSIX and S3 key limits."""
        name = os.fsdecode(raw)
        if len(raw) > NAME_MAX:
            raise _fail(errno.ENAMETOOLONG)
        key = self.table.key_of(parent) + name
        if len((key + "/").encode("utf-8", "surrogateescape")) > KEY_MAX:
            raise _fail(errno.ENAMETOOLONG)
        return name

    async def _child(self, parent_ino: int, raw: bytes) -> tuple[Inode, str, Inode | None]:
        parent = self._inode(parent_ino)
        if not parent.is_dir:
            raise _fail(errno.ENOTDIR)
        name = self._name(parent, raw)
        return parent, name, await self.ns.lookup(parent, name)

    async def _ensure_staged(self, inode: Inode, truncate: bool) -> None:
        """Give `inode` a staged file holding its whole content (or none, if truncating)."""
        if inode.staged is not None:
            await self._unshare(inode, keep_bytes=not truncate)
            if truncate:
                inode.staged.truncate(0)
                self.uploader.note_truncate(inode.upload, 0)
            return
        staged = self._new_staged(inode)
        try:
            if not truncate and inode.etag is not None and inode.size > 0:
                key = self.table.object_key(inode)
                staged.close()
                # A cached whole copy becomes the staged file (a rename); else download it.
                if not self.cache.take(key, inode.etag, staged.path):
                    await self.s3.download_to(key, staged.fd, inode.size, _DOWNLOAD_CHUNK, inode.etag)
        except BaseException:
            staged.remove()
            raise
        inode.staged = staged

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
            except BaseException:
                new.remove()
                raise
            if inode.staged is not old:  # changed while copying: start from what it is now
                new.remove()
                continue
            inode.staged = new
            inode.upload = FileUpload(journal_name=os.path.basename(new.path))
            if not old.held:  # published while copying: nobody refers to it any more
                old.remove()

    def _new_staged(self, inode: Inode) -> StagedFile:
        staged = self.staging.new_file()
        inode.upload.journal_name = os.path.basename(staged.path)
        return staged

    def _changed(self, inode: Inode) -> None:
        inode.dirty = True
        inode.generation += 1
        inode.touch()

    def _keep_local_copy(self, inode: Inode) -> None:
        """An uploaded file nobody has open: its staged bytes move into the read cache."""
        staged = inode.staged
        assert staged is not None
        staged.close()
        if staged.held:
            return  # the log publishes it first, then hands it back
        inode.staged = None
        if inode.etag is None or inode.unlinked:
            staged.remove()
            return
        try:
            self.cache.adopt(self.table.key_of(inode), inode.etag, staged.path, inode.size)
        except OSError as exc:
            log.warning("could not keep %s in the read cache: %s", self.table.path_of(inode), exc)
            staged.remove()

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
            generation = inode.generation
            key = self.table.key_of(inode)
            started = time.monotonic()
            metadata = object_metadata(inode)
            # Journaled first: if the daemon dies mid-upload, the next mount finishes it.
            await self.uploader.journal_closed(inode.upload, key, inode.size, metadata)
            try:
                result = await self.uploader.finish(inode.upload, inode.staged.path, key, inode.size,
                                                    metadata)
            except UploadError as exc:
                log.error("upload of %s failed, staged copy kept at %s: %s",
                          key, inode.staged.path, exc)
                raise
            inode.etag = inode.page_etag = result.etag
            inode.meta_known = True
            inode.validated_at = time.monotonic()
            if inode.generation == generation:
                inode.dirty = False
                await self.uploader.forget_record(inode.upload)
            self.space_freed.set()
            self.space_freed = trio.Event()
            log.debug("uploaded %s (%d bytes, %d parts) in %.2fs", key, inode.size, result.parts,
                      time.monotonic() - started)

    async def _commit_or_queue(self, inode: Inode) -> None:
        """Close-mode commit; on failure the caller gets EIO and the file keeps retrying in the
        background, so `ckptfs sync` reports it and delivers it once S3 is back."""
        try:
            await self.commit(inode)
        except UploadError:
            self.queue.add(inode)
            raise

    async def _commit_in_background(self, inode: Inode) -> None:
        await self.commit(inode)
        if inode.open_handles == 0 and inode.staged is not None and not inode.is_local:
            self._keep_local_copy(inode)

    async def _persist_metadata(self, inode: Inode) -> None:
        """Write changed mode/owner/mtime of a clean object back to S3."""
        if inode.unlinked:
            # Gone from its name (the kernel flushes times of a replaced inode after the
            # rename): the object under that name now is another file's.
            return
        if self.log is not None:
            await self._log_metadata(inode)
            return
        if inode.is_local or inode.ino == ROOT_INODE:
            return
        key = self.table.key_of(inode)
        if inode.is_dir:
            await self.s3.put(key, b"", object_metadata(inode))
            return
        if inode.etag is None:
            return
        async with inode.upload_lock:
            inode.etag = await self.s3.copy(key, key, inode.size, object_metadata(inode))
            inode.validated_at = time.monotonic()

    # ----- what is not in S3 yet, for sync, status and drain ------------

    def pending(self) -> list[tuple[str, int, str | None]]:
        """(path, bytes, last error) of every change S3 does not have yet."""
        out = self.queue.pending()
        if self.log is not None:
            out += self.log.pending()
        return out

    async def wait_in_s3(self, path: str = "") -> list[tuple[str, str]]:
        """`ckptfs sync PATH`: wait for everything closed under PATH; (path, reason) of failures."""
        failed = await self.queue.wait(path)
        if self.log is not None:
            failed += await self.log.wait(path)
        return failed

    async def drain(self) -> None:
        await self.queue.drain()
        if self.log is not None:
            await self.log.drain()

    def hurry(self) -> None:
        """Every retry waiting in backoff goes now (a spot notice arrived)."""
        self.uploader.policy.hurry.now()

    # ----- async mode: every change reaches S3 through the ordered log ----

    async def _publish(self, node: Inode, fsynced: bool = False) -> None:
        """Append the put of the file's bytes as they are now; S3 gets them in their turn.

        From here the staged file is held: a later write or truncate works on a copy.
        """
        assert self.log is not None
        if not node.dirty or node.unlinked or node.staged is None:
            return
        if node.write_error:
            raise _fail(node.write_error)
        staged = node.staged
        key = self.table.key_of(node)
        # No object at the name before this put: a rename right after may retarget it.
        fresh = node.etag is None and node.pending == 0 and node.read_key is None
        rec = Record(os.path.basename(staged.path), key, True, node.size, object_metadata(node),
                     fsynced=fsynced, part_size=self.uploader.plan.base_size)
        generation = node.generation

        def effect() -> None:
            staged.held = True
            node.pending += 1
            if node.generation == generation:
                node.dirty = False

        await self.log.append(rec, self.table.path_of(node), staged=staged, owner=node,
                              on_done=self._entry_done, fresh=fresh, effect=effect)

    def _entry_done(self, entry: Entry, etag: str | None) -> None:
        """S3 has applied a log entry about this inode (its `owner`)."""
        node: Inode = entry.owner
        node.pending -= 1
        rec = entry.rec
        renamed_since = node.unlinked or rec.key != self.table.key_of(node)
        if rec.op == "put":
            staged = entry.staged
            assert staged is not None
            staged.held = False
            if etag and not renamed_since:
                node.etag = etag
            if node.staged is staged and not node.unlinked:
                node.page_etag = etag  # the kernel's pages came from these very bytes
                node.meta_known = True
                if node.open_handles == 0 and not node.is_local:
                    self._keep_local_copy(node)
            elif node.staged is not staged:
                staged.remove()  # an older version, or the file is gone
            self.space_freed.set()
            self.space_freed = trio.Event()
        elif rec.op == "copy":
            later = [e.rec.src for e in self.log.entries_of(node) if e.rec.op == "copy"] if self.log else []
            node.read_key = later[0] if later else None
            if etag and not node.unlinked:
                if node.page_etag == node.etag:
                    node.page_etag = etag
                node.etag = etag
        elif etag and not node.is_dir and not renamed_since:
            if node.page_etag == node.etag:
                node.page_etag = etag
            node.etag = etag
        node.validated_at = time.monotonic()

    async def _log_entry(self, node: Inode, rec: Record, body: bytes | None = None,
                         effect: Callable[[], None] | None = None) -> None:
        """Append a change of `node` that is not a put (marker, symlink, metadata, rename)."""
        assert self.log is not None
        if body is not None:
            rec = dataclasses.replace(rec, body=base64.b64encode(body).decode())

        def counted() -> None:
            node.pending += 1
            if effect is not None:
                effect()

        await self.log.append(rec, self.table.path_of(node), owner=node, on_done=self._entry_done,
                              masks=(rec.src,) if rec.src else (), effect=counted)

    async def _log_metadata(self, node: Inode) -> None:
        """chmod/chown/utime: S3 gets the new metadata after everything before it."""
        assert self.log is not None
        if node.ino == ROOT_INODE:
            return
        key = self.table.key_of(node)
        if node.is_dir:
            await self._log_entry(node, Record("", key, True, metadata=object_metadata(node),
                                               op="object"), b"")
            return
        if node.dirty or node.writers > 0:
            return  # still being written: the put at close carries it
        if node.etag is None and node.pending == 0 and node.read_key is None:
            return  # never closed: nothing in S3 to change
        entry = self.log.latest_put(node)
        if entry is not None and await self.log.amend_metadata(entry, object_metadata(node)):
            return
        await self._log_entry(node, Record("", key, True, metadata=object_metadata(node), op="meta"))

    def _has_object(self, node: Inode) -> bool:
        """S3 holds an object for the node, or will once the log is applied."""
        return node.etag is not None or node.pending > 0 or node.read_key is not None

    async def _log_unlink(self, node: Inode) -> None:
        assert self.log is not None
        key = self.table.key_of(node)

        def effect() -> None:
            node.dirty = False
            self.cache.drop_key(self.table.object_key(node))
            self.table.detach(node)

        if self._has_object(node):
            await self.log.append(Record("", key, True, op="delete"), self.table.path_of(node),
                                  masks=(key,), effect=effect)
        else:
            effect()

    async def _log_rename(self, src: Inode, new_parent: Inode, new_name: str, dst: Inode | None,
                          move: Callable[[], None]) -> None:
        """A file's rename: the put it follows is retargeted, or S3 copies and deletes in turn."""
        assert self.log is not None
        old_key = self.table.key_of(src)
        new_key = self.table.key_of(new_parent) + new_name
        new_path = (self.table.path_of(new_parent) + "/" + new_name).lstrip("/")
        entry = self.log.latest_put(src)
        if entry is not None and await self.log.retarget(entry, new_key, new_path, move):
            return
        if self._has_object(src):
            def effect() -> None:
                if src.read_key is None:
                    src.read_key = old_key  # reads find the object there until the copy
                move()
            await self._log_entry(src, Record("", new_key, True, op="copy", src=old_key),
                                  effect=effect)
        elif dst is not None and self._has_object(dst):
            # The name shows a file never closed: S3 must not keep the replaced object.
            await self.log.append(Record("", new_key, True, op="delete"), new_path, effect=move)
        else:
            move()

    async def _discard_torn(self, node: Inode) -> None:
        """A writer was killed mid-write: its bytes are set aside, never published, and the
        name shows what it showed before (the version S3 or the log has), or nothing."""
        signal_number, path = node.torn, self.table.path_of(node)
        async with node.upload_lock:
            await self.uploader.abort(node.upload)
            await self.uploader.forget_record(node.upload)
            node.dirty = False
            node.torn = 0
            staged, node.staged = node.staged, None
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
            del self.torn_writes[:-100]  # status shows the latest hundred
            parent, name = node.parent, node.name
            previous = self.log.latest_put(node) if self.log is not None else None
            had_object = self._has_object(node)
            # The torn inode leaves the name: the kernel's pages of it must not be read again.
            self.table.detach(node)
            if had_object:
                back = self.table.add(parent, name, node.mode, node.uid, node.gid,
                                      mtime_ns=node.mtime_ns, ctime_ns=node.ctime_ns,
                                      atime_ns=node.atime_ns, etag=node.etag,
                                      read_key=node.read_key, pending=node.pending)
                if self.log is not None:
                    for entry in self.log.entries_of(node):
                        entry.owner = back
                node.pending = 0
                if previous is not None and previous.staged is not None:
                    back.staged = previous.staged  # still held: published in its turn
                    back.size = previous.rec.size
                    back.meta_known = True
                elif back.is_local:  # a rename waits in the log: S3 has the object elsewhere
                    with contextlib.suppress(CkptfsError):
                        self.ns.apply_object(back, await self.s3.head(self.table.object_key(back)),
                                             True)
        # The kernel must drop its dentry before the dying writer is gone: its page cache
        # holds the torn bytes under the old inode. From a worker thread (the kernel may call
        # back into this loop), never longer than a few seconds.
        with trio.move_on_after(5):
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, os.fsencode(name),
                                              abandon_on_cancel=True)
            except OSError:
                pass
        self.space_freed.set()
        self.space_freed = trio.Event()

    # ----- names ---------------------------------------------------------

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        _, _, child = await self._child(parent_inode, name)
        if child is None:
            raise _fail(errno.ENOENT)
        child.lookups += 1
        return self._attrs(child)

    @_guarded
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.table.forget(ino, count)

    @_guarded
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._inode(inode)
        # A LIST entry is trusted like a HEAD for the TTL: `ls -l` of a big directory costs
        # its LIST pages, not one HEAD per file (modes show defaults until a HEAD). An open
        # file keeps the version it opened (see Namespace._refresh_file): no HEAD for it.
        if (not node.is_dir and not node.is_local and node.etag is not None
                and node.open_handles == 0 and not self.ns.fresh(node.validated_at)):
            try:
                self.ns.apply_object(node, await self.s3.head(self.table.key_of(node)), True)
            except NoSuchKey:
                pass  # removed behind our back; the next lookup finds out
        return self._attrs(node)

    @_guarded
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._inode(inode)
        meta_changed = False
        if fields.update_size:
            self._check_writable()
            if node.is_dir:
                raise _fail(errno.EISDIR)
            await self.uploader.journal_changing(node.upload)
            await self._ensure_staged(node, truncate=attr.st_size == 0)
            assert node.staged is not None
            node.staged.truncate(attr.st_size)
            self.uploader.note_truncate(node.upload, attr.st_size)
            node.size = attr.st_size
            self._changed(node)
        if fields.update_mode or fields.update_uid or fields.update_gid or fields.update_mtime:
            if self.read_only:
                raise _fail(errno.EROFS)
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            meta_changed = True
        if fields.update_uid:
            node.uid = attr.st_uid
            meta_changed = True
        if fields.update_gid:
            node.gid = attr.st_gid
            meta_changed = True
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
            meta_changed = True
        if fields.update_atime:
            node.atime_ns = attr.st_atime_ns
        if meta_changed:
            node.ctime_ns = time.time_ns()
            await self._persist_metadata(node)
        if fields.update_size and node.writers == 0:  # truncate(2) by path: no close() will follow
            if self.log is not None:
                await self._publish(node)
            else:
                await self.commit(node)
        return self._attrs(node)

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._inode(inode)
        if not node.is_symlink:
            raise _fail(errno.EINVAL)
        if node.symlink_target is None:
            node.symlink_target = await self.s3.get_range(self.table.object_key(node), 0, node.size)
        return node.symlink_target

    async def _make_entry(self, parent_inode: int, name: bytes, mode: int,
                          ctx: pyfuse3.RequestContext, body: bytes) -> Inode:
        """Create a new name whose object (`body`) is PUT now; nothing is left behind on failure."""
        self._check_writable()
        parent, child_name, existing = await self._child(parent_inode, name)
        if existing is not None:
            raise _fail(errno.EEXIST)
        now = time.time_ns()
        self.ns.forget_absent(parent.ino, child_name)
        node = self.table.add(parent.ino, child_name, mode, ctx.uid, ctx.gid, mtime_ns=now,
                              ctime_ns=now, atime_ns=now, meta_known=True)
        if node.is_symlink:
            node.symlink_target, node.size = body, len(body)
        try:
            if self.log is not None:
                etag = None
                await self._log_entry(node, Record("", self.table.key_of(node), True,
                                                   metadata=object_metadata(node), op="object"), body)
            else:
                etag = await self.s3.put(self.table.key_of(node), body, object_metadata(node))
        except BaseException:
            self.table.detach(node)
            raise
        if not node.is_dir:
            node.etag = etag
        node.validated_at = time.monotonic()
        parent.touch()
        node.lookups += 1
        return node

    @_guarded
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(await self._make_entry(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target))

    @_guarded
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        mode = stat.S_IFDIR | (stat.S_IMODE(mode) & ~ctx.umask)
        return self._attrs(await self._make_entry(parent_inode, name, mode, ctx, b""))

    async def _dir_is_empty(self, node: Inode) -> bool:
        if any(not c.unlinked and c.is_local for c in self.table.children(node.ino)):
            return False
        key = self.table.key_of(node)
        if self.log is None or not len(self.log):
            return not await self.s3.has_children(key)
        # S3 may still hold objects the mount removed (deletes waiting their turn).
        return all(o.key == key or self.log.masked(o.key) for o in await self.s3.list_keys(key))

    @_guarded
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        parent, _, node = await self._child(parent_inode, name)
        if node is None:
            raise _fail(errno.ENOENT)
        if not node.is_dir:
            raise _fail(errno.ENOTDIR)
        if not await self._dir_is_empty(node):
            raise _fail(errno.ENOTEMPTY)
        key = self.table.key_of(node)

        def effect() -> None:
            self.table.detach(node)
            self.ns.invalidate_listing(node.ino)
            parent.touch()

        if self.log is not None:
            # Masks the whole prefix: S3 lists what is under it until the delete's turn.
            await self.log.append(Record("", key, True, op="delete"), self.table.path_of(node),
                                  masks=(key,), effect=effect)
            return
        await self.s3.delete(key)
        effect()

    @_guarded
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        parent, _, node = await self._child(parent_inode, name)
        if node is None:
            raise _fail(errno.ENOENT)
        if node.is_dir:
            raise _fail(errno.EISDIR)
        async with node.upload_lock:
            await self.uploader.abort(node.upload)
            if self.log is not None:
                await self._log_unlink(node)
            else:
                if node.etag is not None:
                    await self.s3.delete(self.table.key_of(node))
                node.dirty = False
                self.cache.drop_key(self.table.key_of(node))
                self.table.detach(node)
            await self.uploader.forget_record(node.upload)
        if node.open_handles == 0 and node.staged is not None:
            if not node.staged.held:
                node.staged.remove()
            node.staged = None
        parent.touch()

    @_guarded
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise _fail(errno.EINVAL)
        old_parent, _, src = await self._child(parent_inode_old, name_old)
        new_parent, new_name, dst = await self._child(parent_inode_new, name_new)
        if src is None:
            raise _fail(errno.ENOENT)
        if dst is src:
            return
        if dst is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise _fail(errno.EEXIST)
            if src.is_dir and not dst.is_dir:
                raise _fail(errno.ENOTDIR)
            if not src.is_dir and dst.is_dir:
                raise _fail(errno.EISDIR)
            if dst.is_dir and not await self._dir_is_empty(dst):
                raise _fail(errno.ENOTEMPTY)
        if src.is_dir and self.table.is_ancestor(src, new_parent):
            raise _fail(errno.EINVAL)
        if self.log is not None:
            if not src.is_dir:
                def move() -> None:
                    self._renamed(src, old_parent, new_parent, new_name, dst)
                await self._log_rename(src, new_parent, new_name, dst, move)
                return
            # A directory's rename is a copy of everything under it, which the log does not
            # order: once S3 has every earlier change, it runs as in close mode.
            await self.log.settle(self.uploader.upload_timeout)
        new_key = self.table.key_of(new_parent) + new_name
        if dst is not None and dst.is_dir:
            # Before the move, not after: the empty target's marker is the key the moved
            # directory's marker takes, and stores with real folders delete recursively.
            await self.s3.delete(self.table.key_of(dst))
        if src.is_dir:
            await self._rename_dir(src, new_key + "/")
        else:
            await self._rename_object(src, new_key, dst)
        if dst is not None:
            await self.uploader.forget_record(dst.upload)
        self._renamed(src, old_parent, new_parent, new_name, dst)
        await self._rejournal(src)

    def _renamed(self, src: Inode, old_parent: Inode, new_parent: Inode, new_name: str,
                 dst: Inode | None) -> None:
        """The mount's side of a rename: `src` takes the name, a replaced `dst` is gone."""
        if dst is not None:
            dst.dirty = False
            self.table.detach(dst)
            if dst.open_handles == 0 and dst.staged is not None:
                if not dst.staged.held:
                    dst.staged.remove()
                dst.staged = None
        self.table.move(src, new_parent.ino, new_name)
        self.ns.forget_absent(new_parent.ino, new_name)
        src.ctime_ns = time.time_ns()
        old_parent.touch()
        new_parent.touch()

    async def _rejournal(self, node: Inode) -> None:
        """Closed files not yet in S3 under a renamed name: their records must name the new key."""
        if node.is_dir:
            for child in self.table.children(node.ino):
                await self._rejournal(child)
            return
        rec = node.upload.record
        if rec is not None and rec.closed:
            await self.uploader.journal_closed(node.upload, self.table.key_of(node), node.size,
                                               object_metadata(node), rec.fsynced)

    async def _rename_object(self, src: Inode, new_key: str, dst: Inode | None) -> None:
        async with src.upload_lock:
            old_key = self.table.key_of(src)
            if src.etag is not None:
                old_etag = src.etag
                src.etag = await self.s3.copy(old_key, new_key, src.size)
                await self.s3.delete(old_key)
                if not src.is_local:
                    self.cache.rekey(old_key, old_etag, new_key, src.etag)
                src.page_etag = src.etag if src.page_etag == old_etag else src.page_etag
            elif dst is not None and dst.etag is not None:
                # The new name must not keep showing the replaced object until src's upload.
                await self.s3.delete(new_key)

    async def _rename_dir(self, src: Inode, new_prefix: str) -> None:
        """Copy every object under the directory to its new name, then delete the old ones."""
        old_prefix = self.table.key_of(src)
        objects = await self.s3.list_keys(old_prefix)
        new_etags: dict[str, str] = {}

        async def move_one(key: str, size: int) -> None:
            rest = key[len(old_prefix):]
            if key.endswith("/"):  # a directory marker: some stores cannot copy those
                info = await self.s3.head(key)
                await self.s3.put(new_prefix + rest, b"", info.metadata)
            else:
                new_etags[rest] = await self.s3.copy(key, new_prefix + rest, size)

        async with trio.open_nursery() as nursery:
            for obj in objects:
                nursery.start_soon(move_one, obj.key, obj.size)
        if old_prefix not in {o.key for o in objects}:
            await self.s3.put(new_prefix, b"", object_metadata(src))  # keep even an empty implicit dir
        await self.s3.delete_many([o.key for o in objects])
        # Stores with real folders (SeaweedFS) keep emptied folders; delete them deepest first.
        folders = {old_prefix}
        for obj in objects:
            parts = obj.key[len(old_prefix):].split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folders.add(old_prefix + "/".join(parts[:depth]) + "/")
        for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):
            try:
                await self.s3.delete(folder)
            except CkptfsError:
                pass
        self._refresh_etags(src, "", new_etags)

    def _refresh_etags(self, directory: Inode, rel: str, etags: dict[str, str]) -> None:
        for child in self.table.children(directory.ino):
            path = rel + child.name
            if child.is_dir:
                self._refresh_etags(child, path + "/", etags)
            elif path in etags and child.etag is not None:
                child.etag = etags[path]

    @_guarded
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EPERM)

    @_guarded
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EPERM)

    # ----- directories ---------------------------------------------------

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self._inode(inode)
        if not node.is_dir:
            raise _fail(errno.ENOTDIR)
        return self._new_fh(DirHandle(node))

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise _fail(errno.EBADF)
        if handle.entries is None or start_id == 0:
            handle.entries = await self.ns.list_dir(handle.inode)
        for index in range(start_id, len(handle.entries)):
            # A FORGET between two READDIR calls (or during the listing) may have dropped an
            # entry: never hand the kernel an inode number the table does not know.
            child = self.table.revive(handle.entries[index])
            if child is None:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(child.name), self._attrs(child), index + 1):
                return
            child.lookups += 1

    @_guarded
    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    @_guarded
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are made in S3 synchronously

    # ----- files ---------------------------------------------------------

    @_guarded
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._check_writable()
        parent, child_name, existing = await self._child(parent_inode, name)
        if existing is not None and existing.is_dir:
            raise _fail(errno.EISDIR)
        if existing is not None and flags & os.O_EXCL:
            raise _fail(errno.EEXIST)
        if existing is not None:
            node = existing
            node.writers += 1
            node.open_handles += 1
            try:
                if flags & os.O_TRUNC:
                    await self.uploader.journal_changing(node.upload)
                await self._ensure_staged(node, truncate=bool(flags & os.O_TRUNC))
            except BaseException:
                node.writers -= 1
                node.open_handles -= 1
                raise
            if flags & os.O_TRUNC:
                node.size = 0
                self._changed(node)
        else:
            now = time.time_ns()
            self.ns.forget_absent(parent.ino, child_name)
            node = self.table.add(parent.ino, child_name, stat.S_IFREG | (stat.S_IMODE(mode) & ~ctx.umask),
                                  ctx.uid, ctx.gid, mtime_ns=now, ctime_ns=now, atime_ns=now,
                                  meta_known=True)
            node.staged = self._new_staged(node)
            node.writers += 1
            node.open_handles += 1
            self._changed(node)
            parent.touch()
        node.lookups += 1
        fh = self._new_fh(Handle(node, writable=True, opener=opener_of(ctx.pid)))
        return pyfuse3.FileInfo(fh=fh), self._attrs(node)

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._inode(inode)
        if node.is_dir:
            raise _fail(errno.EISDIR)
        # O_RDONLY|O_TRUNC truncates on Linux, so it counts as a writer too.
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if writable:
            self._check_writable()
            node.writers += 1
        node.open_handles += 1
        try:
            if writable:
                if flags & os.O_TRUNC:
                    await self.uploader.journal_changing(node.upload)
                await self._ensure_staged(node, truncate=bool(flags & os.O_TRUNC))
                if flags & os.O_TRUNC:
                    node.size = 0
                    self._changed(node)
        except BaseException:
            node.open_handles -= 1
            node.writers -= writable
            raise
        # The kernel's page cache stays valid while the object is the version it cached.
        keep_cache = node.is_local or node.page_etag == node.etag
        node.page_etag = node.etag
        opener = opener_of(ctx.pid) if writable else None
        return pyfuse3.FileInfo(fh=self._new_fh(Handle(node, writable, opener=opener)),
                                keep_cache=keep_cache)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._file_handle(fh)
        node = handle.inode
        if node.staged is not None:
            data = await self.reader.read_local(node.staged.fd, size, off)
            self.local_read_bytes += len(data)
            return data
        if node.etag is None or off >= node.size:
            return b""
        try:
            return await self.reader.read(self.table.object_key(node), node.etag, node.size, off,
                                          size, handle.stream)
        except NoSuchKey:  # not ENOENT: read(2) of an open file has no such meaning
            log.warning("read of %s: the object was deleted from S3 while open here",
                        self.table.path_of(node))
            raise _fail(errno.EIO) from None

    @_guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node = self._file_handle(fh).inode
        if node.staged is None:
            raise _fail(errno.EBADF)
        if node.write_error:
            raise _fail(node.write_error)
        self.write_calls += 1
        if node.upload.record is not None:
            await self.uploader.journal_changing(node.upload)
        try:
            written = await self._pwrite(node, buf, off)
        except (OSError, NoSpace) as exc:
            # The file now lacks bytes its writer meant it to have: it must never be uploaded.
            node.write_error = exc.errno or errno.EIO
            log.error("write to %s failed, the file will not be uploaded: %s",
                      self.table.path_of(node), exc)
            raise
        if off + written > node.size:
            node.size = off + written
        self._changed(node)
        if not node.unlinked:  # an unlinked file is never uploaded
            self.uploader.note_write(node.upload, node.staged.path, lambda: self.table.key_of(node),
                                     lambda: object_metadata(node), off, off + written)
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
            if self._reclaim_space():
                continue
            if not self._uploads_could_free(node) or trio.current_time() >= waited_until:
                raise NoSpace(f"cache disk full ({self.staging.dir}) writing {self.table.path_of(node)}")
            log.warning("cache disk full: %s waits for uploads to free space", self.table.path_of(node))
            with trio.move_on_at(waited_until):
                await self.space_freed.wait()
        return done

    def _reclaim_space(self) -> bool:
        """Empty the read cache (clean bytes only); True if that freed anything."""
        return self.cache.reclaim() > 0

    def _uploads_could_free(self, writer: Inode) -> bool:
        """Some other closed file is on its way to S3; its staged copy can go after that."""
        if self.log is not None:
            return self.log.pending_bytes() > 0
        return any(i is not writer and i.dirty and i.writers == 0 and i.staged is not None
                   and not i.unlinked for i in self.table.all())

    @_guarded
    async def flush(self, fh: int) -> None:
        handle = self._file_handle(fh)
        if not handle.writable:
            return
        node = handle.inode
        if node.write_error:
            raise _fail(node.write_error)
        if handle.opener is not None and node.dirty:
            signal_number = killing_signal(handle.opener)
            if signal_number:
                # The kernel closes a dying writer's files: that is no close() of its own.
                node.torn = signal_number
                if node.writers <= 1:  # no other writer may still finish the file: now,
                    await self._discard_torn(node)  # before the dying process is gone
                return
            node.torn = 0
        if self.log is not None:
            # Staged on local disk and journaled in order; S3 follows in the background.
            await self._publish(node)
        else:
            await self._commit_or_queue(node)

    @_guarded
    async def fsync(self, fh: int, datasync: bool) -> None:
        node = self._file_handle(fh).inode
        if node.write_error:
            raise _fail(node.write_error)
        if self.log is not None:
            if node.staged is not None:
                await trio.to_thread.run_sync(os.fsync, node.staged.fd)
                node.torn = 0
                await self._publish(node, fsynced=True)
        else:
            await self._commit_or_queue(node)

    @_guarded
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if not isinstance(handle, Handle):
            return
        node = handle.inode
        node.open_handles -= 1
        if handle.writable:
            node.writers -= 1
            if node.writers == 0 and node.torn and node.dirty and not node.unlinked:
                await self._discard_torn(node)  # the last writer was the one killed
        if node.open_handles > 0:
            return
        if node.unlinked:
            await self.uploader.abort(node.upload)
            if node.staged is not None:
                if not node.staged.held:
                    node.staged.remove()
                node.staged = None
        elif node.write_error:
            await self._discard_failed_write(node)
        elif node.staged is not None and not node.is_local:
            self._keep_local_copy(node)
        elif node.staged is not None:
            # Still to reach S3 (a failed close-mode upload, or waiting in the log): keep
            # every byte; only the descriptor goes.
            node.staged.close()
        self.table.forget(node.ino, 0)

    async def _discard_failed_write(self, node: Inode) -> None:
        """Forget the bytes of a file whose write failed: the name shows S3's object again."""
        async with node.upload_lock:
            await self.uploader.abort(node.upload)
            await self.uploader.forget_record(node.upload)
            node.dirty = False
            node.write_error = 0
            if node.staged is not None:
                node.staged.remove()
                node.staged = None
            if node.etag is None:
                parent, name = node.parent, node.name
                self.table.detach(node)  # it never existed in S3
                pyfuse3.invalidate_entry_async(parent, os.fsencode(name), ignore_enoent=True)
            else:
                node.meta_known = False  # size and mtime come from S3 again
                node.validated_at = 0.0
                node.page_etag = None
        self.space_freed.set()
        self.space_freed = trio.Event()

    # ----- extended attributes and statfs --------------------------------

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        raise _fail(pyfuse3.ENOATTR)

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    @_guarded
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _fail(errno.ENOTSUP)

    @_guarded
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _fail(pyfuse3.ENOATTR)

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        # What can be written at once is bounded by the staging disk, so report its space.
        st = os.statvfs(self.staging.dir)
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.f_bsize
        out.f_frsize = st.f_frsize
        out.f_blocks = st.f_blocks
        out.f_bfree = st.f_bfree
        out.f_bavail = st.f_bavail
        out.f_files = 1 << 32
        out.f_ffree = 1 << 32
        out.f_favail = 1 << 32
        out.f_namemax = NAME_MAX
        return out


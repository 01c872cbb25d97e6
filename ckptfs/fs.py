"""pyfuse3.Operations: check arguments, keep the handle table, call components, map errors.

Nothing here talks to S3 or keeps state of its own beyond the handles: open files go to
files.py, namespace mutations to tree.py, lookups and listings to namespace.py. Every
handler runs under `guarded` (handles.py), so an unexpected exception becomes EIO (and a
log line) instead of taking the whole mount down.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from ckptfs.errors import NoSuchKey
from ckptfs.files import OpenFiles
from ckptfs.handles import DirHandle, Handle, OpenCounts
from ckptfs.handles import fail as _fail
from ckptfs.handles import guarded as _guarded
from ckptfs.inodes import SPECIAL_TYPES, Inode, InodeTable
from ckptfs.listing import NAME_MAX
from ckptfs.localread import Reply, reply_size
from ckptfs.namespace import KEY_MAX, Namespace, is_reserved
from ckptfs.opener import opener_of
from ckptfs.passthrough import Passthrough
from ckptfs.tree import Tree

log = logging.getLogger(__name__)


class CheckpointFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = True  # unless passthrough is granted: the kernel allows one only

    def __init__(self, *, table: InodeTable, ns: Namespace, files: OpenFiles, tree: Tree,
                 staging_dir: str, read_only: bool, metadata_ttl: float,
                 passthrough: Passthrough | None = None, cold_open: str = "whole") -> None:
        super().__init__()
        self.passthrough = passthrough
        # Read by pyfuse3 at INIT (the patched binding of third_party/pyfuse3); the daemon
        # sets it from Passthrough.want() before mounting.
        self.enable_passthrough = False
        self.passthrough_stack_depth = passthrough.depth if passthrough is not None else 0
        self.table = table
        self.ns = ns
        self.files = files
        self.tree = tree
        self.staging_dir = staging_dir
        self.read_only = read_only
        self.ttl = metadata_ttl
        self.draining = False  # set by the daemon on SIGTERM: no new writes
        self.initialized = trio.Event()  # set once the kernel's FUSE INIT has been answered
        self._handles: dict[int, Handle | DirHandle] = {}
        self._next_fh = 1
        self.requests: collections.Counter[str] = collections.Counter()  # FUSE requests, by op
        self.counts = OpenCounts()
        self.cold_open = cold_open  # "whole": a cold object is fetched whole at its first open
        # How a READDIR entry reaches the kernel (tests/inprocess.py, with no kernel, collects them).
        self.reply_entry: Callable[..., bool] = pyfuse3.readdir_reply

    def stats(self) -> dict[str, Any]:
        return {"fuse_requests": dict(self.requests), **self.counts.stats()}

    # ----- helpers -------------------------------------------------------

    def init(self) -> None:
        # libfuse calls this while it answers the kernel's INIT; the reply goes out right after.
        if self.passthrough is not None:
            self.passthrough.negotiated()
        self.initialized.set()

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        if self.passthrough is not None:  # size and times of what the kernel wrote itself
            self.passthrough.refresh(inode)
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = self.ttl
        a.attr_timeout = self.ttl
        a.st_mode = inode.mode
        # A file unlinked while open has no name left (pjdfstest unlink/14). A directory's
        # count of subdirectories is not known without listing it: 2, whatever it holds.
        a.st_nlink = 0 if inode.unlinked else 2 if inode.is_dir else 1
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
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

    async def _new_child(self, parent_ino: int, raw: bytes) -> tuple[Inode, str, Inode | None]:
        """`_child` for a name the call may make: never ckptfs's own (namespace.RESERVED_NAME)."""
        parent, name, child = await self._child(parent_ino, raw)
        if is_reserved(parent, name):
            raise _fail(errno.EPERM)
        return parent, name, child

    async def _child(self, parent_ino: int, raw: bytes) -> tuple[Inode, str, Inode | None]:
        parent = self._inode(parent_ino)
        if not parent.is_dir:
            raise _fail(errno.ENOTDIR)
        name = self._name(parent, raw)
        return parent, name, await self.ns.lookup(parent, name)

    # ----- names ---------------------------------------------------------

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        _, _, child = await self._child(parent_inode, name)
        if child is None:
            raise _fail(errno.ENOENT)
        child.looked_up()
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
                await self.ns.revalidate(node)
            except NoSuchKey:
                pass  # removed behind our back; the next lookup finds out
        return self._attrs(node)

    @_guarded
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._inode(inode)
        if self.passthrough is not None:
            # What the kernel wrote before this call, first: a time set now (`cp -p`, `rsync
            # -a` set the mtime before close) must not give way to those writes' own.
            self.passthrough.refresh(node)
        if fields.update_size:
            self._check_writable()
            if node.is_dir:
                raise _fail(errno.EISDIR)
            # While the kernel writes the staged file, a truncate goes to that file too.
            in_place = self.passthrough is not None and self.passthrough.busy(node)
            await self.files.truncate(node, attr.st_size, in_place=in_place)
        meta_changed = (fields.update_mode or fields.update_uid or fields.update_gid
                        or fields.update_mtime)
        if meta_changed and self.read_only:
            raise _fail(errno.EROFS)
        node.set_attributes(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None)  # the kernel's own
        if not fields.update_ctime and (meta_changed or fields.update_atime):
            # Any change of the inode's times is one of its status (`touch -a` of a directory:
            # the kernel sends the ctime of files itself, never of directories).
            node.status_changed()
        if meta_changed:
            await self.tree.metadata(node)
        if fields.update_size and node.writers == 0:  # truncate(2) by path: no close() will follow
            await self.files.publish_now(node)
        return self._attrs(node)

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._inode(inode)
        if not node.is_symlink:
            raise _fail(errno.EINVAL)
        return await self.ns.symlink_target(node)

    async def _make_entry(self, parent_inode: int, name: bytes, mode: int,
                          ctx: pyfuse3.RequestContext, body: bytes, rdev: int = 0) -> pyfuse3.EntryAttributes:
        self._check_writable()
        parent, child_name, existing = await self._new_child(parent_inode, name)
        if existing is not None:
            raise _fail(errno.EEXIST)
        node = await self.tree.make_entry(parent, child_name, mode, ctx.uid, ctx.gid, body, rdev)
        node.looked_up()
        return self._attrs(node)

    @_guarded
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return await self._make_entry(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target)

    @_guarded
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        mode = stat.S_IFDIR | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make_entry(parent_inode, name, mode, ctx, b"")

    @_guarded
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        parent, _, node = await self._child(parent_inode, name)
        if node is None:
            raise _fail(errno.ENOENT)
        if not node.is_dir:
            raise _fail(errno.ENOTDIR)
        await self.tree.rmdir(parent, node)

    @_guarded
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        parent, _, node = await self._child(parent_inode, name)
        if node is None:
            raise _fail(errno.ENOENT)
        if node.is_dir:
            raise _fail(errno.EISDIR)
        await self.tree.unlink(parent, node)

    @_guarded
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise _fail(errno.EINVAL)
        old_parent, _, src = await self._child(parent_inode_old, name_old)
        new_parent, new_name, dst = await self._new_child(parent_inode_new, name_new)
        if src is None:
            raise _fail(errno.ENOENT)
        await self.tree.rename(old_parent, src, new_parent, new_name, dst,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    @_guarded
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EPERM)

    @_guarded
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        kind = stat.S_IFMT(mode)
        if kind not in SPECIAL_TYPES and kind != stat.S_IFREG:
            raise _fail(errno.EINVAL)
        mode = kind | (stat.S_IMODE(mode) & ~ctx.umask)
        return await self._make_entry(parent_inode, name, mode, ctx, b"",
                                      rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0)

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
            if not self.reply_entry(token, os.fsencode(child.name), self._attrs(child), index + 1):
                return
            child.looked_up()

    @_guarded
    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    @_guarded
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are in S3 (close mode) or journaled (async) on return

    # ----- files ---------------------------------------------------------

    @_guarded
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._check_writable()
        parent, child_name, existing = await self._new_child(parent_inode, name)
        if existing is not None and existing.is_dir:
            raise _fail(errno.EISDIR)
        if existing is not None and flags & os.O_EXCL:
            raise _fail(errno.EEXIST)
        await self._make_room("/".join(filter(None, (self.table.path_of(parent), child_name))))
        if existing is not None:
            node = existing
            await self._unheld(node)
            await self.files.open_for_write(node, truncate=bool(flags & os.O_TRUNC))
        else:
            node = self.files.create(parent, child_name, mode & ~ctx.umask, ctx.uid, ctx.gid)
        node.looked_up()
        handle = Handle(node, writable=True, opener=opener_of(ctx.pid))
        info = self._file_info(handle)
        return info, self._attrs(node)

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._inode(inode)
        if node.is_dir:
            raise _fail(errno.EISDIR)
        # O_RDONLY|O_TRUNC truncates on Linux, so it counts as a writer too.
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if writable:
            self._check_writable()
            await self._make_room(self.table.path_of(node))
            await self._unheld(node)
            await self.files.open_for_write(node, truncate=bool(flags & os.O_TRUNC))
        else:
            node.opened(writable=False)
            if self.cold_open == "whole" and self.passthrough is not None:
                await self.files.fetch_whole(node, self.passthrough)
        opener = opener_of(ctx.pid) if writable else None
        return self._file_info(Handle(node, writable, opener=opener))

    def _file_info(self, handle: Handle) -> pyfuse3.FileInfo:
        """The open reply: the kernel reads and writes the local file itself where the bytes
        are local (passthrough.py), else the daemon serves the handle."""
        node = handle.inode
        pt = self.passthrough
        pages_valid = True
        if pt is not None and pt.enabled:
            path, staged = None, True
            if node.staged is not None:
                path = node.staged.path
            elif node.etag is not None:
                path, staged = self.files.cache.whole_path(
                    self.table.object_key(node), node.etag, node.size), False
            handle.backing_id, handle.direct_io, pages_valid = pt.open(
                node, path, handle.writable, staged)
        self.counts.opened(handle)
        if handle.backing_id:
            node.pages_bypassed()
            return pyfuse3.FileInfo(fh=self._new_fh(handle), backing_id=handle.backing_id,
                                    direct_io=handle.direct_io, keep_cache=False)
        # The kernel's page cache stays valid while the object is the version it cached.
        keep_cache = pages_valid and (node.is_local or node.page_etag == node.etag)
        node.pages_cached()
        return pyfuse3.FileInfo(fh=self._new_fh(handle), keep_cache=keep_cache)

    async def _make_room(self, path: str) -> None:
        if self.passthrough is not None and self.passthrough.enabled:
            await self.passthrough.make_room(path)

    async def _unheld(self, node: Inode) -> None:
        """Before the staged bytes may move to a copy (files._unshare): while passthrough
        handles still write the held file, wait until they are released or the log has
        published it; the kernel writes only where the handle was opened."""
        pt = self.passthrough
        while (pt is not None and pt.busy(node) and node.staged is not None
               and node.staged.held):
            await trio.sleep(0.005)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> Reply:
        handle = self._file_handle(fh)
        try:
            data = await self.files.read(handle.inode, off, size, handle.stream)
            self.counts.bytes_read += reply_size(data)
            return data
        except NoSuchKey:  # not ENOENT: read(2) of an open file has no such meaning
            log.warning("read of %s: the object was deleted from S3 while open here",
                        self.table.path_of(handle.inode))
            raise _fail(errno.EIO) from None

    @_guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node = self._file_handle(fh).inode
        if node.staged is None:
            raise _fail(errno.EBADF)
        if node.write_error:
            raise _fail(node.write_error)
        return await self.files.write(node, off, buf)

    @_guarded
    async def flush(self, fh: int) -> None:
        handle = self._file_handle(fh)
        if not handle.writable:
            return
        if self.passthrough is not None:
            self.passthrough.refresh(handle.inode)  # what the kernel wrote since the last look
            self.passthrough.check_full(handle.inode)
        if handle.inode.write_error:
            raise _fail(handle.inode.write_error)
        await self.files.close(handle.inode, handle.opener)

    @_guarded
    async def fsync(self, fh: int, datasync: bool) -> None:
        node = self._file_handle(fh).inode
        if self.passthrough is not None:
            self.passthrough.refresh(node)
            self.passthrough.check_full(node)
        if node.write_error:
            raise _fail(node.write_error)
        await self.files.fsync(node)

    @_guarded
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, Handle):
            if self.passthrough is not None:
                self.passthrough.released(handle.inode, handle.backing_id, handle.kernel_writes)
            await self.files.release(handle.inode, handle.writable)

    # ----- extended attributes and statfs --------------------------------

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # No xattrs here, said as ENOSYS: the kernel then answers every getxattr itself
        # (ENOTSUP), and stops asking for security.capability before each write() (each ask
        # was a round trip through the FUSE thread that the writer waited for).
        raise _fail(errno.ENOSYS)

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    @_guarded
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _fail(errno.ENOTSUP)

    @_guarded
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _fail(errno.ENOSYS)

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        # What can be written at once is bounded by the staging disk, so report its space.
        st = os.statvfs(self.staging_dir)
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


"""Namespace mutations: mkdir, symlink, unlink, rmdir, rename and metadata changes.

Each checks what POSIX requires of the names involved, makes the change through
`changes` (at once in S3 in close mode, through the ordered log in async mode), and then
applies it to the inode table. Name validation and errno mapping stay in fs.py.
"""

from __future__ import annotations

import errno
import time

from ckptfs.bucket import Bucket
from ckptfs.changes import Changes, LocalCopies
from ckptfs.errors import Refused
from ckptfs.inodes import Inode, InodeTable
from ckptfs.namespace import Namespace
from ckptfs.uploader import Uploader
from ckptfs.uploads import UploadRecords


class Tree:
    def __init__(self, *, s3: Bucket, table: InodeTable, ns: Namespace, uploader: Uploader,
                 records: UploadRecords, changes: Changes, local: LocalCopies) -> None:
        self.s3 = s3
        self.table = table
        self.ns = ns
        self.uploader = uploader
        self.records = records  # the one writer of journal records
        self.changes = changes
        self.local = local  # uploaded bytes nobody has open (changes.py)

    async def make_entry(self, parent: Inode, name: str, mode: int, uid: int, gid: int,
                         body: bytes, rdev: int = 0) -> Inode:
        """A new directory, symlink, special file or empty file (mknod) whose object (`body`)
        is made now; nothing is left behind on failure."""
        now = time.time_ns()
        self.ns.forget_absent(parent.ino, name)
        node = self.table.add(parent.ino, name, mode, uid, gid, mtime_ns=now, ctime_ns=now,
                              atime_ns=now, meta_known=True, rdev=rdev)
        if node.is_symlink:
            node.link_target(body, sized=True)
        try:
            await self.changes.create(node, body)
        except BaseException:
            self.table.detach(node)
            raise
        node.confirmed()
        if node.is_dir:
            self.ns.made_dir(node)
        parent.touch()
        return node

    async def dir_is_empty(self, node: Inode) -> bool:
        if any(not c.unlinked and c.is_local for c in self.table.children(node.ino)):
            return False
        key = self.table.key_of(node)
        physical = self.table.physical(key)  # (a directory rename waiting in the log)

        async def ask() -> bool:
            if not self.changes.backlog.pending():
                return not await self.s3.has_children(physical)
            # S3 may still hold objects the mount removed (deletes waiting their turn in async
            # mode; in close mode nothing is masked, and this is the same question, slower).
            with self.ns.masks() as masked:
                return all(o.key == physical or masked(key + o.key[len(physical):])
                           for o in await self.s3.list_keys(physical))
        return await self.ns.is_empty(node, ask)

    async def rmdir(self, parent: Inode, node: Inode) -> None:
        if not await self.dir_is_empty(node):
            raise Refused(errno.ENOTEMPTY)

        def effect() -> None:
            self.table.detach(node)
            self.ns.invalidate_listing(node.ino)
            parent.touch()

        await self.changes.remove_dir(node, effect)

    async def unlink(self, parent: Inode, node: Inode) -> None:
        async with node.upload_lock:
            await self.uploader.abort(node.upload)
            await self.changes.remove_file(node)
            await self.records.forget(node.upload)
        if node.open_handles == 0:
            node.drop_staged()
        parent.touch()

    async def rename(self, old_parent: Inode, src: Inode, new_parent: Inode, new_name: str,
                     dst: Inode | None, noreplace: bool) -> None:
        if dst is src:
            return
        if dst is not None:
            if noreplace:
                raise Refused(errno.EEXIST)
            if src.is_dir and not dst.is_dir:
                raise Refused(errno.ENOTDIR)
            if not src.is_dir and dst.is_dir:
                raise Refused(errno.EISDIR)
            if dst.is_dir and not await self.dir_is_empty(dst):
                raise Refused(errno.ENOTEMPTY)
        if src.is_dir and self.table.is_ancestor(src, new_parent):
            raise Refused(errno.EINVAL)

        def move() -> None:
            """The mount's side of a rename: `src` takes the name, a replaced `dst` is gone."""
            if dst is not None:
                dst.saved()
                self.local.replaced(dst, self.table.object_key(dst))
                self.table.detach(dst)
                if dst.open_handles == 0:
                    dst.drop_staged()
            self.table.move(src, new_parent.ino, new_name)
            self.ns.forget_absent(new_parent.ino, new_name)
            src.status_changed()
            old_parent.touch()
            new_parent.touch()

        await self.changes.rename(src, new_parent, new_name, dst, move)

    async def metadata(self, node: Inode) -> None:
        """Changed mode/owner/mtime go to S3."""
        if node.unlinked:
            # Gone from its name (the kernel flushes times of a replaced inode after the
            # rename): the object under that name now is another file's.
            return
        await self.changes.metadata(node)

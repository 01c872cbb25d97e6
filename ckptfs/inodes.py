"""The inode table: inode numbers, names, attributes and kernel lookup counts.

A path is never stored: each inode knows its parent and its name, so renaming
a directory re-homes everything under it in O(1) and a key is derived when it
is needed (`key_of`).
"""

from __future__ import annotations

import itertools
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ckptfs.staging import StagedFile
from ckptfs.uploads import FileUpload

ROOT_INODE = 1
SPECIAL_TYPES = frozenset({stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK})


@dataclass(eq=False)
class Inode:
    ino: int
    parent: int
    name: str
    mode: int  # full st_mode: type bits and permissions
    uid: int
    gid: int
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    atime_ns: int = 0
    # The ETag of this file's object in S3; None if no object exists (yet).
    etag: str | None = None
    page_etag: str | None = None  # the version the kernel's page cache holds
    # True once mode/uid/gid/mtime came from the object's own metadata (HEAD),
    # not defaults derived from a LIST entry.
    meta_known: bool = False
    staged: StagedFile | None = None
    dirty: bool = False  # the staged bytes are newer than what S3 has (or will have)
    symlink_target: bytes | None = None
    rdev: int = 0  # a character or block device's number (x-amz-meta-rdev)
    # A directory that another tool marked with an object of its own rather than "dir/": an
    # s3fs "dir" (Content-Type application/x-directory) or a Hadoop "dir_$folder$". Its
    # rmdir and rename remove that object too.
    marker_key: str | None = None
    lookups: int = 0
    open_handles: int = 0
    writers: int = 0
    unlinked: bool = False
    write_error: int = 0  # errno of a failed write: the file must not be uploaded
    torn: int = 0  # signal that killed a writer at its close: the bytes must never be published
    pending: int = 0  # entries of the ordered log about this inode that S3 has not applied
    # While a rename is pending in the log, S3 still holds the object under its old key.
    read_key: str | None = None
    validated_at: float = 0.0  # time.monotonic() of the last S3 confirmation
    upload_lock: trio.Lock = field(default_factory=trio.Lock)
    upload: FileUpload = field(default_factory=FileUpload)  # streamed parts of the staged bytes

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    @property
    def is_special(self) -> bool:
        """A fifo, socket or device: a zero-byte object for its name, mode and rdev; the
        kernel serves its data (a pipe, a socket), never ckptfs."""
        return stat.S_IFMT(self.mode) in SPECIAL_TYPES

    @property
    def is_local(self) -> bool:
        """The mount's own state is authoritative: S3 must not overrule it."""
        return (self.dirty or self.writers > 0 or self.pending > 0
                or (self.staged is not None and self.etag is None))

    @property
    def has_object(self) -> bool:
        """S3 holds an object for the file, or will once the ordered log is applied."""
        return self.etag is not None or self.pending > 0 or self.read_key is not None

    @property
    def clock(self) -> int:
        """The write clock: advances with every change of the staged bytes (the upload's
        own, so a part knows whether it is older than the last write of its range)."""
        return self.upload.clock

    def touch(self) -> None:
        self.ctime_ns = self.mtime_ns = time.time_ns()

    def changed(self) -> None:
        """The staged bytes changed: S3 must get them again."""
        self.dirty = True
        self.upload.clock += 1
        self.touch()

    def opened(self, writable: bool) -> None:
        self.open_handles += 1
        self.writers += writable

    def released(self, writable: bool) -> None:
        self.open_handles -= 1
        self.writers -= writable

    def drop_staged(self) -> None:
        """Let go of the staged file: it is removed, unless the ordered log still holds it
        (the log removes it once published)."""
        if self.staged is not None:
            if not self.staged.held:
                self.staged.remove()
            self.staged = None


class InodeTable:
    def __init__(self, prefix: str, uid: int, gid: int) -> None:
        self.prefix = prefix
        self._by_ino: dict[int, Inode] = {}
        self._children: dict[int, dict[str, int]] = {}
        self._next = itertools.count(ROOT_INODE + 1)
        self._redirects: list[tuple[str, str]] = []  # (new "dir/" prefix, old), oldest first
        # Told of every inode dropped while it still had its name (the kernel forgot it and it
        # held nothing unsaved): the namespace still vouches for that name (Namespace.dropped).
        self.on_drop: Callable[[Inode], None] = lambda inode: None
        now = time.time_ns()
        root = Inode(ROOT_INODE, ROOT_INODE, "", stat.S_IFDIR | 0o755, uid, gid,
                     mtime_ns=now, ctime_ns=now, atime_ns=now, meta_known=True)
        root.lookups = 1 << 62  # the kernel never forgets the root
        self._by_ino[ROOT_INODE] = root
        self._children[ROOT_INODE] = {}

    def __getitem__(self, ino: int) -> Inode:
        return self._by_ino[ino]

    def get(self, ino: int) -> Inode | None:
        return self._by_ino.get(ino)

    def child(self, parent: int, name: str) -> Inode | None:
        ino = self._children.get(parent, {}).get(name)
        return None if ino is None else self._by_ino[ino]

    def children(self, parent: int) -> list[Inode]:
        return [self._by_ino[i] for i in self._children.get(parent, {}).values()]

    def add(self, parent: int, name: str, mode: int, uid: int, gid: int, **attrs: object) -> Inode:
        """A new inode under `parent`, replacing (and detaching) any entry of that name."""
        old = self.child(parent, name)
        if old is not None:
            self.detach(old)
        inode = Inode(next(self._next), parent, name, mode, uid, gid, **attrs)  # type: ignore[arg-type]
        self._by_ino[inode.ino] = inode
        self._children.setdefault(parent, {})[name] = inode.ino
        if inode.is_dir:
            self._children.setdefault(inode.ino, {})
        return inode

    def revive(self, inode: Inode) -> Inode | None:
        """`inode` as the table knows it now: itself, put back if a FORGET dropped it while a
        caller still held it (a directory listing being returned), or the inode that took its
        name meanwhile; None if it was unlinked."""
        if self._by_ino.get(inode.ino) is inode:
            return inode
        if inode.unlinked:
            return None
        current = self.child(inode.parent, inode.name)
        if current is not None or inode.parent not in self._by_ino:
            return current
        self._by_ino[inode.ino] = inode
        self._children.setdefault(inode.parent, {})[inode.name] = inode.ino
        if inode.is_dir:
            self._children.setdefault(inode.ino, {})
        return inode

    def detach(self, inode: Inode) -> None:
        """Remove the name; the inode lives on while the kernel or a handle holds it."""
        siblings = self._children.get(inode.parent, {})
        if siblings.get(inode.name) == inode.ino:
            del siblings[inode.name]
        inode.unlinked = True
        self._maybe_drop(inode)

    def move(self, inode: Inode, new_parent: int, new_name: str) -> None:
        siblings = self._children.get(inode.parent, {})
        if siblings.get(inode.name) == inode.ino:
            del siblings[inode.name]
        inode.parent, inode.name = new_parent, new_name
        self._children.setdefault(new_parent, {})[new_name] = inode.ino

    def forget(self, ino: int, count: int) -> None:
        inode = self._by_ino.get(ino)
        if inode is None:
            return
        inode.lookups = max(0, inode.lookups - count)
        self._maybe_drop(inode)

    def _maybe_drop(self, inode: Inode) -> None:
        """Forget an inode nobody refers to, unless it carries unsaved state."""
        if inode.ino == ROOT_INODE or inode.lookups > 0 or inode.open_handles > 0:
            return
        if inode.unlinked:
            inode.drop_staged()
        elif inode.is_local or self._children.get(inode.ino):
            return  # still named, and the only record of a local change or of children
        elif inode.staged is not None:
            return  # a clean local copy: kept for reads, reclaimed by the local-copy budget
        self._by_ino.pop(inode.ino, None)
        self._children.pop(inode.ino, None)
        siblings = self._children.get(inode.parent, {})
        if siblings.get(inode.name) == inode.ino:
            del siblings[inode.name]
            if not inode.unlinked:
                self.on_drop(inode)

    def path_of(self, inode: Inode) -> str:
        """The inode's path relative to the mount, '' for the root."""
        names: list[str] = []
        node = inode
        while node.ino != ROOT_INODE:
            names.append(node.name)
            node = self._by_ino[node.parent]
        return "/".join(reversed(names))

    def object_key(self, inode: Inode) -> str:
        """Where S3 holds the file's object now (its old name while a rename is pending)."""
        return self.physical(inode.read_key or self.key_of(inode))

    def redirect(self, new_prefix: str, old_prefix: str) -> object:
        """A directory rename waits in the ordered log: until it is applied, what the mount
        shows under `new_prefix` is in S3 under `old_prefix`. Returns the token that
        `unredirect` takes once it is applied."""
        token = (new_prefix, old_prefix)
        self._redirects.append(token)
        return token

    def unredirect(self, token: object) -> None:
        self._redirects.remove(token)  # type: ignore[arg-type]

    def physical(self, key: str) -> str:
        """The key S3 holds `key`'s object (or "dir/" prefix) under now: the mount's name
        mapped back through the directory renames still waiting in the log, newest first."""
        for new_prefix, old_prefix in reversed(self._redirects):
            if key.startswith(new_prefix):
                key = old_prefix + key[len(new_prefix):]
        return key

    def key_of(self, inode: Inode) -> str:
        """The S3 key: the object's key for a file, the 'dir/' marker key for a directory."""
        path = self.path_of(inode)
        if inode.is_dir:
            return self.prefix + path + "/" if path else self.prefix
        return self.prefix + path

    def is_ancestor(self, maybe_ancestor: Inode, inode: Inode) -> bool:
        node = inode
        while True:
            if node.ino == maybe_ancestor.ino:
                return True
            if node.ino == ROOT_INODE:
                return False
            node = self._by_ino[node.parent]

    def all(self) -> list[Inode]:
        return list(self._by_ino.values())

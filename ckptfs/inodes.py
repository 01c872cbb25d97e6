"""The inode table: inode numbers, names, attributes and kernel lookup counts.

A path is never stored: each inode knows its parent and its name, so renaming
a directory re-homes everything under it in O(1) and a key is derived when it
is needed (`key_of`).
"""

from __future__ import annotations

import enum
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


class Write(enum.Enum):
    """Where an inode's staged bytes stand against S3 (`Inode.write`, `Inode.write_cause`).

    CLEAN   S3 has (or the log will give it) the staged bytes, or there are none.
    DIRTY   written since (changed): S3 must get them again (saved -> CLEAN).
    TORN    a writer was killed before its close (cause: the signal): never published, set
            aside at the last writer's release; its own close or fsync makes it DIRTY again.
    FAILED  a write failed (cause: the errno): never uploaded; later writes, flushes and
            fsyncs get the errno until the last release lets the bytes go.

    Precedence: FAILED yields only to `discarded` (a kill, a write or a save later changes
    nothing); TORN yields to FAILED, `own_close`, a save (of bytes sent before) and `discarded`.
    """

    CLEAN = "clean"
    DIRTY = "dirty"
    TORN = "torn"
    FAILED = "failed"


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
    write: Write = Write.CLEAN  # the staged bytes against S3 (Write says which moves are allowed)
    write_cause: int = 0  # TORN: the signal that killed the writer; FAILED: the write's errno
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
    def dirty(self) -> bool:
        """The staged bytes are newer than what S3 has (or will have)."""
        return self.write is not Write.CLEAN

    @property
    def write_error(self) -> int:
        """The errno of a failed write (the file is never uploaded), or 0."""
        return self.write_cause if self.write is Write.FAILED else 0

    @property
    def torn(self) -> int:
        """The signal that killed a writer before its close (never published), or 0."""
        return self.write_cause if self.write is Write.TORN else 0

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

    # ----- what happens to an inode ------------------------------------------------
    # The only code that assigns an inode's fields (besides InodeTable's own, below):
    # other modules say what happened (tests/test_inode_owner.py checks it). Every method
    # runs on the trio thread, between two awaits: none is ever seen half done.

    # The kernel and POSIX.

    def looked_up(self) -> None:
        """The kernel got a reference (LOOKUP, CREATE, MKNOD, READDIRPLUS)."""
        self.lookups += 1

    def opened(self, writable: bool) -> None:
        self.open_handles += 1
        self.writers += writable

    def released(self, writable: bool) -> None:
        self.open_handles -= 1
        self.writers -= writable

    def touch(self) -> None:
        self.ctime_ns = self.mtime_ns = time.time_ns()

    def status_changed(self) -> None:
        self.ctime_ns = time.time_ns()

    def set_attributes(self, *, mode: int | None = None, uid: int | None = None,
                       gid: int | None = None, mtime_ns: int | None = None,
                       atime_ns: int | None = None, ctime_ns: int | None = None) -> None:
        """chmod, chown, utimens (SETATTR), or the object's metadata read from S3 (`mode`:
        the permission bits; the type never changes)."""
        if mode is not None:
            self.mode = stat.S_IFMT(self.mode) | stat.S_IMODE(mode)
        if uid is not None:
            self.uid = uid
        if gid is not None:
            self.gid = gid
        if mtime_ns is not None:
            self.mtime_ns = mtime_ns
        if atime_ns is not None:
            self.atime_ns = atime_ns
        if ctime_ns is not None:
            self.ctime_ns = ctime_ns

    def times_at_least_mtime(self) -> None:
        """ctime and atime are never older than mtime (an object read from S3)."""
        self.ctime_ns = max(self.ctime_ns, self.mtime_ns)
        self.atime_ns = max(self.atime_ns, self.mtime_ns)

    def link_target(self, target: bytes, sized: bool = False) -> None:
        """A symlink's target, read from S3 or (`sized`: its size is the target's) made here."""
        self.symlink_target = target
        if sized:
            self.size = len(target)

    def marked_by(self, key: str | None) -> None:
        """The directory's marker of another tool's kind (None: its own "dir/", or none)."""
        self.marker_key = key

    # What S3 holds.

    def confirmed(self, at: float | None = None) -> None:
        """S3 (or the log about to apply it) agrees with this inode, as of `at`
        (time.monotonic(); by default now)."""
        self.validated_at = time.monotonic() if at is None else at

    def expired(self) -> None:
        """Size, times and metadata come from S3 again at the next look."""
        self.meta_known = False
        self.validated_at = 0.0
        self.page_etag = None

    def listed(self, size: int, etag: str) -> None:
        """S3 has an object of `size` with `etag` (a HEAD or a LIST entry)."""
        if etag != self.etag:
            self.drop_staged()  # the local copy is of an older version
            self.meta_known = False
        self.size = size
        self.etag = etag
        self.confirmed()

    def described(self) -> None:
        """Mode, owner and times came from the object's own metadata (a HEAD)."""
        self.meta_known = True

    def stored(self, etag: str | None) -> None:
        """S3 holds the object (or, None, no object) with `etag`."""
        self.etag = etag

    def moved(self, etag: str) -> None:
        """S3 copied the object to a new one of the same bytes (a rename, new metadata):
        the kernel's pages of the old one still hold them."""
        if self.page_etag == self.etag:
            self.page_etag = etag
        self.etag = etag

    def uploaded(self, etag: str, clock: int) -> bool:
        """The staged bytes as they were at `clock` are the object `etag` now. True if no
        write came since (the inode is clean)."""
        self.etag = self.page_etag = etag
        self.meta_known = True
        self.confirmed()
        return self.saved(clock)

    def published(self, etag: str | None) -> None:
        """The log put the staged file this inode still has (the kernel's pages came from
        these very bytes)."""
        self.page_etag = etag
        self.meta_known = True

    def pages_bypassed(self) -> None:
        """An open through passthrough: the kernel's own pages of the inode go stale."""
        self.page_etag = None

    def pages_cached(self) -> None:
        """An open through the page cache: the kernel's pages are of the current object."""
        self.page_etag = self.etag

    def reads_from(self, key: str | None) -> None:
        """Until a rename in the log is applied, S3 holds the object under `key`."""
        self.read_key = key

    # The ordered log (async mode).

    def logged(self) -> None:
        """An entry about this inode joined the log."""
        self.pending += 1

    def applied(self) -> None:
        """S3 applied an entry of the log about this inode."""
        self.pending -= 1

    def handed_over(self) -> None:
        """Its entries of the log now belong to the inode that replaced it."""
        self.pending = 0

    # Writes.

    def _moves_to(self, state: Write, cause: int = 0) -> None:
        self.write, self.write_cause = state, cause

    def changed(self) -> None:
        """The staged bytes changed: S3 must get them again."""
        if self.write is Write.CLEAN:
            self._moves_to(Write.DIRTY)
        self.upload.clock += 1
        self.touch()

    def wrote(self, end: int) -> None:
        """Bytes were written up to offset `end`."""
        if end > self.size:
            self.size = end
        self.changed()

    def truncated(self, size: int) -> None:
        self.size = size
        self.changed()

    def written_behind(self, size: int, mtime_ns: int) -> None:
        """The kernel wrote the staged file itself (passthrough): what its stat says."""
        self.size = size
        self.changed()
        self.mtime_ns = mtime_ns

    def saved(self, clock: int | None = None) -> bool:
        """The staged bytes (as of `clock`; None: whatever they are) reached S3 or the log:
        the inode is clean, unless written since `clock` (then False)."""
        if clock is not None and clock != self.clock:
            return False
        if self.write is not Write.FAILED:
            self._moves_to(Write.CLEAN)
        return True

    def write_failed(self, errno_: int) -> None:
        """A write failed with `errno_`: the file lacks bytes its writer meant it to have and
        must never be uploaded."""
        if self.write is not Write.FAILED:
            self._moves_to(Write.FAILED, errno_)

    def torn_by(self, signal_number: int) -> None:
        """The kernel closed the file for a writer killed by `signal_number`."""
        if self.write is Write.DIRTY:
            self._moves_to(Write.TORN, signal_number)

    def own_close(self) -> None:
        """A close or fsync of the writer's own: the file is not torn."""
        if self.write is Write.TORN:
            self._moves_to(Write.DIRTY)

    def discarded(self) -> StagedFile | None:
        """The unpublished bytes are let go (a failed write, a killed writer): the inode is
        clean and its staged file, returned, is the caller's."""
        self._moves_to(Write.CLEAN)
        staged, self.staged = self.staged, None
        return staged

    def stage(self, staged: StagedFile | None, size: int | None = None,
              upload: FileUpload | None = None) -> None:
        """The inode's bytes are in `staged` now (of `size`; with the streamed parts of
        `upload`, if a new one)."""
        self.staged = staged
        if size is not None:
            self.size = size
            self.meta_known = True
        if upload is not None:
            self.upload = upload

    def next_upload(self, upload: FileUpload) -> None:
        """The inode's next bytes stream to an upload of their own (a put took the last)."""
        self.upload = upload

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

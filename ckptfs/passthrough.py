"""FUSE passthrough: the kernel reads and writes a local file itself, not through the daemon.

An open whose bytes are wholly local (a staged file, or a whole object in the read cache)
names that file as its "backing" file (pyfuse3.backing_open, kernel >= 6.9). The kernel then
does the handle's reads, writes and mmap on it directly: the bytes never cross Python.
The daemon still sees OPEN, FLUSH, FSYNC, RELEASE, SETATTR and GETATTR.

Because writes no longer reach the daemon, what they changed is learned from the backing
file itself (`refresh`): its size, mtime and ctime. Each file being written is looked at
every `poll` seconds so its parts stream to S3 as it grows, and again at every FLUSH, FSYNC,
GETATTR and SETATTR. The parts sent while the file was written are checked against it
before the upload completes (uploader.py, `FileUpload.unseen_writes`): a part whose bytes
changed since (a rewrite, a seek back, an mmap write) is sent again.

The kernel allows one backing file per inode at a time, requires every open of an inode
with one to name it, and allows no passthrough open beside a cached one. An open whose bytes
are elsewhere names the inode's backing file with FOPEN_DIRECT_IO (the daemon then serves
its reads and writes), and one beside a cached open is served by the daemon: never an
error (`open`).
"""

from __future__ import annotations

import errno
import logging
import os
import platform
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio

from ckptfs.cache import ObjectCache, disk_bytes, free_bytes
from ckptfs.changes import Changes
from ckptfs.inodes import Inode, InodeTable
from ckptfs.metadata import object_metadata
from ckptfs.staging import StagingArea
from ckptfs.uploader import Uploader

log = logging.getLogger(__name__)

_CAP_SYS_ADMIN = 21
_POLL = 0.05  # seconds between looks at a file being written through passthrough
# The kernel's writes fail with ENOSPC where the daemon cannot see them; below this much free
# space a file written meanwhile may lack bytes, so it is never published (close: ENOSPC).
FULL = 1 << 20
HEADROOM = 8 << 30  # free space kept for writers (at most half the cache disk): read cache goes


class PassthroughError(Exception):
    """`--passthrough on` and it cannot be had: the one-line reason."""


def _kernel_allows() -> str | None:
    """Why this kernel cannot do passthrough (None if it can)."""
    release = platform.release()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return None  # an unusual release string: let INIT tell
    if (major, minor) < (6, 9):
        return f"kernel {release} has no FUSE passthrough (needs 6.9 or later)"
    return None


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def stack_depth(path: str) -> int:
    """How many stacked file systems `path` sits on, as far as passthrough cares: 1 on
    overlayfs (a container's own disk), else 0."""
    best, fstype = "", ""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                target = fields[4]
                sep = fields.index("-")
                if (real == target or real.startswith(target.rstrip("/") + "/")) and len(target) >= len(best):
                    best, fstype = target, fields[sep + 1]
    except (OSError, ValueError, IndexError):
        return 0
    return 1 if fstype == "overlay" else 0


@dataclass(eq=False)
class Backing:
    """One inode's backing file while handles use it."""
    id: int
    fd: int  # the daemon's own descriptor of the file, for fstat
    path: str
    users: int = 0
    writing: int = 0  # of those, the handles that write
    seen: tuple[int, int, int] = (0, 0, 0)  # size, mtime, ctime when last looked at
    full: bool = False  # the cache disk was full while the kernel wrote the file


class Passthrough:
    def __init__(self, mode: str, cache_dir: str, *, uploader: Uploader, table: InodeTable,
                 staging: StagingArea, cache: ObjectCache, changes: Changes, space_wait: float,
                 nursery: trio.Nursery, poll: float = _POLL) -> None:
        self.mode = mode
        self.uploader = uploader
        self.table = table
        self.staging = staging
        self.staging_dir = staging.dir
        self.cache = cache
        self.changes = changes
        self.space_wait = space_wait  # how long a writer waits for space (files.py's too)
        self.headroom = min(HEADROOM, disk_bytes(self.staging_dir) // 2)
        self._nursery = nursery
        self.poll = poll
        self.depth = stack_depth(cache_dir)
        self.enabled = False
        self.reason = ""
        self._by_ino: dict[int, Backing] = {}
        self._daemon_handles: dict[int, int] = {}  # ino -> cached opens served by the daemon
        self._unseen_pages: set[int] = set()  # inodes whose kernel pages passthrough bypassed
        self.bytes_grown = 0  # what files written by the kernel grew by (rewrites not seen)
        self.opens = 0  # opens given a backing file
        self.fallbacks = 0  # opens that could not have one
        self._warned = False

    def stats(self) -> dict[str, Any]:
        return {"passthrough": self.enabled, "passthrough_reason": self.reason,
                "passthrough_opens": self.opens, "passthrough_fallbacks": self.fallbacks,
                "bytes_written_passthrough": self.bytes_grown}

    # ----- at mount ---------------------------------------------------------

    def want(self) -> bool:
        """Before INIT: whether to ask the kernel for passthrough. Raises PassthroughError
        when `on` and something already says no."""
        if self.mode == "off":
            self.reason = "--passthrough off"
            return False
        if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
            why = "pyfuse3 was built without passthrough: run scripts/install_fuse.sh"
        elif (kernel := _kernel_allows()) is not None:
            why = kernel
        elif not _has_cap_sys_admin():
            why = "the daemon lacks CAP_SYS_ADMIN, which registering backing files needs"
        else:
            return True
        if self.mode == "on":
            raise PassthroughError(f"--passthrough on: {why}")
        self.reason = why
        return False

    def negotiated(self) -> None:
        """After INIT: what the kernel granted."""
        granted = getattr(pyfuse3, "passthrough_enabled", None)  # (a stock pyfuse3 lacks it)
        if granted is not None and granted():
            self.enabled = True
            self.reason = "kernel passthrough of local files" + (
                " (cache dir on overlayfs)" if self.depth else "")
        elif not self.reason:
            self.reason = "the kernel did not offer passthrough at INIT (CONFIG_FUSE_PASSTHROUGH?)"

    # ----- opens ------------------------------------------------------------

    def serving_cached(self, node: Inode) -> bool:
        """The daemon serves open handles of `node` through the page cache: a new open cannot
        pass through (the kernel: ETXTBSY)."""
        return bool(self._daemon_handles.get(node.ino))

    def open(self, node: Inode, path: str | None, writable: bool,
             staged: bool = True) -> tuple[int, bool, bool]:
        """How the kernel serves a new handle of `node`: (backing id, direct_io, keep the
        kernel's cached pages). `path`: the local file with all of its bytes (the staged
        file, or with `staged` False a whole object of the read cache), or None.

        - The file becomes (or already is) the inode's backing file: (id, False, False).
        - The inode has a backing file, but not this one: the kernel allows one per inode,
          and beside it only opens that name it. The handle names it with FOPEN_DIRECT_IO,
          which sends the handle's reads and writes to the daemon: (id, True, False).
        - Else the daemon serves the handle through the page cache: (0, False, valid?).
        """
        if not self.enabled:
            return 0, False, True
        b = self._by_ino.get(node.ino)
        if b is not None and b.path != path:
            b.users += 1  # (released like any other handle of the backing file)
            self.fallbacks += 1
            return b.id, True, False
        if b is None and path is not None and not self._daemon_handles.get(node.ino):
            b = self._register(node, path, staged)  # (beside a cached open: ETXTBSY)
        if b is None:
            self.fallbacks += path is not None
            self._daemon_handles[node.ino] = self._daemon_handles.get(node.ino, 0) + 1
            # Passthrough writes bypassed the kernel's pages of this inode: they may be stale.
            stale = node.ino in self._unseen_pages
            self._unseen_pages.discard(node.ino)
            return 0, False, not stale
        b.users += 1
        if writable:
            b.writing += 1
            self._unseen_pages.add(node.ino)
            if b.writing == 1:
                self._nursery.start_soon(self._watch, node, b)
        self.opens += 1
        return b.id, False, False

    def _register(self, node: Inode, path: str, staged: bool) -> Backing | None:
        try:
            fd = os.open(path, (os.O_RDWR if staged else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            backing_id = pyfuse3.backing_open(fd)
        except OSError as exc:
            os.close(fd)
            if not self._warned:
                self._warned = True
                log.warning("passthrough: the kernel refused a backing file (%s); such opens "
                            "go through the daemon", exc.strerror)
            if exc.errno == errno.EPERM:
                self.reason = f"registering backing files failed: {exc.strerror}"
            return None
        st = os.fstat(fd)
        b = Backing(backing_id, fd, path, seen=(st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        self._by_ino[node.ino] = b
        return b

    def released(self, node: Inode, backing_id: int, writer: bool) -> None:
        """A handle of `node` was released: the backing id `open` gave it (0: the daemon
        served it through the page cache); `writer`: the kernel wrote through it."""
        if not self.enabled:
            return
        if not backing_id:
            n = self._daemon_handles.get(node.ino, 0)
            if n > 1:
                self._daemon_handles[node.ino] = n - 1
            else:
                self._daemon_handles.pop(node.ino, None)
            return
        b = self._by_ino.get(node.ino)
        if b is None or b.id != backing_id:
            return
        self.refresh(node)
        b.users -= 1
        b.writing -= writer
        if b.users == 0:
            del self._by_ino[node.ino]
            try:
                pyfuse3.backing_close(b.id)
            except OSError as exc:
                log.debug("backing_close(%d): %s", b.id, exc)
            os.close(b.fd)

    def busy(self, node: Inode) -> bool:
        """Handles write `node`'s staged file through the kernel."""
        b = self._by_ino.get(node.ino)
        return b is not None and b.writing > 0

    # ----- what the kernel wrote ------------------------------------------------

    def refresh(self, node: Inode) -> bool:
        """Learn from the backing file what passthrough writes changed; True if anything did."""
        b = self._by_ino.get(node.ino)
        if b is None or b.writing == 0:
            return False
        st = os.fstat(b.fd)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if stamp == b.seen:
            return False
        b.seen = stamp
        if node.staged is None or node.staged.path != b.path:
            return False
        before = node.size
        # An unlinked file too: fstat through its open descriptors tells what was written.
        node.written_behind(st.st_size, st.st_mtime_ns)
        # A part sent earlier may have been written over since: checked before completion.
        node.upload.unseen_writes = True
        if node.write_error or node.unlinked:
            return True  # never uploaded: nothing more streams (its discard waits for parts)
        if st.st_size > before:  # the parts the file grew over may stream now
            self.bytes_grown += st.st_size - before
            self.uploader.note_write(node.upload, b.path, lambda: self.table.key_of(node),
                                     lambda: object_metadata(node), before, st.st_size)
        return True

    async def _watch(self, node: Inode, b: Backing) -> None:
        """While handles write the file: look at it every `poll` seconds, so its parts
        stream to S3 as it grows, and at the cache disk's free space."""
        while b.writing > 0 and self._by_ino.get(node.ino) is b:
            await trio.sleep(self.poll)
            try:
                self.refresh(node)
                self._look_at_space()
            except OSError as exc:
                log.debug("passthrough: fstat of %s: %s", b.path, exc)

    # ----- the cache disk's space -------------------------------------------------

    def _look_at_space(self) -> None:
        """A full disk marks every file the kernel is writing (a write of it may have failed
        with ENOSPC, unseen here); below the headroom the read cache gives back space."""
        free = free_bytes(self.staging_dir)
        if free < FULL:
            for b in self._by_ino.values():
                if b.writing > 0:
                    b.full = True
        if free < self.headroom and self.cache.make_room(self.headroom):
            self.staging.freed()

    async def make_room(self, path: str) -> None:
        """Before the kernel writes the staged file of `path`: free space for the writer, from
        the read cache, else by waiting (up to --upload-timeout) while uploads free some; the
        daemon cannot make a writer wait once the kernel writes for it."""
        deadline = trio.current_time() + self.space_wait
        said = False
        while True:
            self._look_at_space()
            if (free_bytes(self.staging_dir) >= self.headroom or trio.current_time() >= deadline
                    or not self.changes.could_free_space()):
                return
            if not said:
                said = True
                log.warning("cache disk full: %s waits for uploads to free space", path)
            await self.staging.wait_freed(deadline)

    def check_full(self, node: Inode) -> None:
        """At FLUSH and FSYNC: a file the kernel wrote while the cache disk was full is never
        published; the close gets ENOSPC, as the write may have."""
        b = self._by_ino.get(node.ino)
        if b is None or b.writing == 0:
            return
        self._look_at_space()
        if b.full and not node.write_error:
            node.write_failed(errno.ENOSPC)
            log.error("%s: the cache disk was full while it was written; not uploaded",
                      self.table.path_of(node))

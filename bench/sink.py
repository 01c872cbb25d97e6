"""A bare pyfuse3 file system that only pwrites what it is given into staging files.

    python bench/sink.py MOUNTPOINT STAGING_DIR

The limit of any pyfuse3 write path on this host: the kernel (with the writeback cache,
as ckptfs mounts) hands each write to the one FUSE thread, which copies it into a bytes
object and pwrites it; nothing else happens. It runs pyfuse3's request loop as ckptfs
does (ckptfs/fuseloop.py: a lighter read lock and wait than trio's), so it stays the floor
of ckptfs's own write path. write_bench.py mounts it beside ckptfs and reads its CPU
seconds from /proc. Unmount with fusermount3 -u; it then exits.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time

import pyfuse3
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptfs import fuseloop  # noqa: E402

ROOT = pyfuse3.ROOT_INODE


class Sink(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, staging: str) -> None:
        super().__init__()
        self.staging = staging
        self.names: dict[tuple[int, bytes], int] = {}
        self.dirs = {ROOT}
        self.sizes: dict[int, int] = {}
        self.fds: dict[int, int] = {}
        self.next = ROOT + 1
        self.writes = 0

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        is_dir = ino in self.dirs
        a.st_mode = (stat.S_IFDIR | 0o755) if is_dir else (stat.S_IFREG | 0o644)
        a.st_nlink = 2 if is_dir else 1
        a.st_size = self.sizes.get(ino, 0)
        a.st_blksize = 1 << 20
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = time.time_ns()
        a.attr_timeout = a.entry_timeout = 60
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(inode)

    async def lookup(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if (parent, name) not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self.names[parent, name])

    async def mkdir(self, parent: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        ino = self.next
        self.next += 1
        self.names[parent, name] = ino
        self.dirs.add(ino)
        return self._attrs(ino)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if fields.update_size:
            os.ftruncate(self.fds[inode], attr.st_size)
            self.sizes[inode] = attr.st_size
        return self._attrs(inode)

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        ino = self.next
        self.next += 1
        self.names[parent, name] = ino
        self.sizes[ino] = 0
        self.fds[ino] = os.open(os.path.join(self.staging, str(ino)),
                                os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        return pyfuse3.FileInfo(fh=ino), self._attrs(ino)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.writes += 1
        n = os.pwrite(self.fds[fh], buf, off)
        if off + n > self.sizes[fh]:
            self.sizes[fh] = off + n
        return n

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        pass


def main() -> int:
    mountpoint, staging = sys.argv[1], sys.argv[2]
    os.makedirs(staging, exist_ok=True)
    options = set(pyfuse3.default_options) | {"fsname=sink"}
    sink = Sink(staging)
    pyfuse3.init(sink, mountpoint, options)
    fuseloop.install()
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        if os.environ.get("SINK_REPORT"):
            print(f"sink: {sink.writes} write requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

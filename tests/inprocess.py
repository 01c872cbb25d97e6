"""A mount's components in this process, over the in-memory S3, driven as the kernel would.

`Kernel` sends CheckpointFS the requests a system call becomes (LOOKUP per path component,
OPEN/CREATE, WRITE, FLUSH, RELEASE, SETATTR, ...), and keeps the kernel's references so a
test can FORGET them all (drop its caches). No FUSE mount, no S3 server: the fast tier.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import trio

from ckptfs.config import Config
from ckptfs.daemon import Mount, build_mount
from ckptfs.inodes import ROOT_INODE
from ckptfs.localread import reply_bytes
from fakes3 import MemoryS3

CTX = pyfuse3.RequestContext()


@asynccontextmanager
async def mounted(tmp_path: Path, s3: MemoryS3, durability: str, **options) -> AsyncIterator[Mount]:
    options.setdefault("upload_timeout", 10)
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability=durability, **options)
    async with trio.open_nursery() as nursery:
        yield await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()


async def serve(tmp_path: Path, durability: str, s3: MemoryS3, n: int, stop: trio.Event, *,
                task_status=trio.TASK_STATUS_IGNORED, **options) -> None:
    """One mount's components over `s3` (cache dir number `n`) until `stop`, for
    `nursery.start`: a state machine's mount, and the fresh one that checks S3 after it."""
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / f"cache{n}"), durability=durability, upload_timeout=10,
                    **options)
    async with trio.open_nursery() as nursery:
        task_status.started(await build_mount(config, s3, nursery))  # type: ignore[arg-type]
        await stop.wait()
        nursery.cancel_scope.cancel()


def _split(path: str) -> tuple[str, bytes]:
    parent, _, name = path.rpartition("/")
    return parent, name.encode()


class Kernel:
    """The kernel's side of inode references: what it looked up, and FORGET for all of it."""

    def __init__(self, mount: Mount) -> None:
        self.fs = mount.fs
        self.refs: dict[int, int] = {}

    def took(self, ino: int) -> None:
        self.refs[ino] = self.refs.get(ino, 0) + 1

    async def resolve(self, path: str) -> int:
        """The inode of `path`, one LOOKUP per component (the dentry cache was dropped)."""
        ino = ROOT_INODE
        for part in filter(None, path.split("/")):
            attrs = await self.fs.lookup(ino, part.encode(), CTX)
            ino = attrs.st_ino
            self.took(ino)
        return ino

    async def drop_caches(self) -> None:
        refs, self.refs = self.refs, {}
        await self.fs.forget(list(refs.items()))

    async def stat(self, path: str) -> pyfuse3.EntryAttributes:
        return await self.fs.getattr(await self.resolve(path), CTX)

    async def listdir(self, path: str) -> list[str]:
        ino = await self.resolve(path)
        fh = await self.fs.opendir(ino, CTX)
        names: list[str] = []

        def reply(token, name: bytes, attrs: pyfuse3.EntryAttributes, next_id: int) -> bool:
            names.append(os.fsdecode(name))
            self.took(attrs.st_ino)
            return True
        real, self.fs.reply_entry = self.fs.reply_entry, reply
        try:
            await self.fs.readdir(fh, 0, None)
        finally:
            self.fs.reply_entry = real
            await self.fs.releasedir(fh)
        return sorted(names)

    async def open(self, path: str, flags: int = os.O_RDONLY) -> int:
        """A handle of `path` (created if O_CREAT and missing): its fh."""
        try:
            ino = await self.resolve(path)
        except pyfuse3.FUSEError as exc:
            if exc.errno != errno.ENOENT or not flags & os.O_CREAT:
                raise
            parent, name = _split(path)
            info, attrs = await self.fs.create(await self.resolve(parent), name, 0o644, flags, CTX)
            self.took(attrs.st_ino)
            return info.fh
        return (await self.fs.open(ino, flags & ~os.O_CREAT, CTX)).fh

    async def close(self, fh: int) -> None:
        """close(2) of the last descriptor: FLUSH, then RELEASE."""
        await self.fs.flush(fh)
        await self.fs.release(fh)

    async def write(self, path: str, data: bytes) -> None:
        fh = await self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await self.fs.write(fh, 0, data)
        await self.close(fh)

    async def read(self, path: str) -> bytes:
        fh = await self.open(path)
        try:
            return await self.read_fh(fh, 0, 1 << 20)
        finally:
            await self.fs.release(fh)

    async def read_fh(self, fh: int, off: int, size: int) -> bytes:
        """READ of an open handle; a FileSlice reply is read as pyfuse3's thread would."""
        return reply_bytes(await self.fs.read(fh, off, size))

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        parent, name = _split(path)
        attrs = await self.fs.mkdir(await self.resolve(parent), name, mode, CTX)
        self.took(attrs.st_ino)

    async def rmdir(self, path: str) -> None:
        parent, name = _split(path)
        await self.fs.rmdir(await self.resolve(parent), name, CTX)

    async def unlink(self, path: str) -> None:
        parent, name = _split(path)
        await self.fs.unlink(await self.resolve(parent), name, CTX)

    async def rename(self, src: str, dst: str) -> None:
        sp, sn = _split(src)
        dp, dn = _split(dst)
        await self.fs.rename(await self.resolve(sp), sn, await self.resolve(dp), dn, 0, CTX)

    async def setattr(self, path: str, fh: int | None = None, **values: int) -> None:
        """SETATTR of the fields given: size, mode, uid, gid, mtime_ns, atime_ns."""
        attr = pyfuse3.EntryAttributes()
        names = {"size": "st_size", "mode": "st_mode", "uid": "st_uid", "gid": "st_gid",
                 "mtime_ns": "st_mtime_ns", "atime_ns": "st_atime_ns"}
        for name, value in values.items():
            setattr(attr, names[name], value)
        fields = SimpleNamespace(
            update_size="size" in values, update_mode="mode" in values,
            update_uid="uid" in values, update_gid="gid" in values,
            update_mtime="mtime_ns" in values, update_atime="atime_ns" in values,
            update_ctime=False)
        await self.fs.setattr(await self.resolve(path), attr, fields, fh, CTX)

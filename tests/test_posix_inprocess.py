"""POSIX semantics of CheckpointFS, in the fast tier: its handlers driven in this process as
the kernel would (tests/inprocess.py), over the in-memory S3, in both durability modes.

test_posix.py checks the same rules through a real FUSE mount on a real S3 server; these
run in a second each, so every rule is also checked where a failure points at the handler.
What S3 holds is judged once the mode's backlog is drained (async mode: the ordered log).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pyfuse3
import pytest

from ckptfs.daemon import Mount
from ckptfs.inodes import ROOT_INODE
from fakes3 import MemoryS3
from inprocess import CTX, Kernel, mounted

pytestmark = pytest.mark.parametrize("durability", ["close", "async"])


@pytest.fixture
async def world(tmp_path: Path, durability: str) -> AsyncIterator[tuple[Kernel, Mount, MemoryS3]]:
    s3 = MemoryS3()
    async with mounted(tmp_path, s3, durability) as mount:
        yield Kernel(mount), mount, s3


async def in_s3(mount: Mount, s3: MemoryS3) -> dict[str, bytes]:
    """What S3 holds under the prefix once everything the mount owes it has gone."""
    await mount.changes.backlog.drain()
    return {k[len("p/"):]: v for k, v in s3.objects.items() if k.startswith("p/")}


async def fails(errno_: int, call) -> None:
    with pytest.raises(pyfuse3.FUSEError) as caught:
        await call
    assert caught.value.errno == errno_, os.strerror(caught.value.errno)


async def test_random_writes_truncate_and_otrunc(world) -> None:
    kernel, mount, s3 = world
    await kernel.write("r.bin", b"0123456789")
    fh = await kernel.open("r.bin", os.O_RDWR)
    await kernel.fs.write(fh, 3, b"abc")
    await kernel.fs.write(fh, 20, b"Z")
    await kernel.close(fh)
    expected = b"012abc6789" + b"\0" * 10 + b"Z"
    assert await kernel.read("r.bin") == expected
    assert (await in_s3(mount, s3))["r.bin"] == expected
    await kernel.setattr("r.bin", size=4)  # truncate(2) by path: no close follows
    assert (await in_s3(mount, s3))["r.bin"] == b"012a"
    assert (await kernel.stat("r.bin")).st_size == 4
    await kernel.write("r.bin", b"new")  # O_TRUNC
    assert (await in_s3(mount, s3))["r.bin"] == b"new"


async def test_mode_owner_and_times_go_to_the_objects_metadata(world) -> None:
    kernel, mount, s3 = world
    await kernel.write("m.txt", b"x")
    await kernel.setattr("m.txt", mode=0o600)
    await kernel.setattr("m.txt", uid=1234, gid=5678)
    await kernel.setattr("m.txt", mtime_ns=1_600_000_000_123_456_789)
    st = await kernel.stat("m.txt")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 1234, 5678)
    assert st.st_mtime_ns == 1_600_000_000_123_456_789
    assert st.st_ctime_ns > st.st_mtime_ns  # a status change: now
    await in_s3(mount, s3)
    meta = s3.meta["p/m.txt"]
    assert (int(meta["mode"]) & 0o7777, meta["uid"], meta["gid"]) == (0o600, "1234", "5678")
    assert meta["mtime"].startswith("1600000000.123456789") or meta["mtime"] == str(
        1_600_000_000_123_456_789)


async def test_directory_rules(world) -> None:
    kernel, mount, s3 = world
    await kernel.mkdir("d")
    await fails(errno.EEXIST, kernel.mkdir("d"))
    await kernel.write("d/f", b"x")
    await fails(errno.ENOTEMPTY, kernel.rmdir("d"))
    await fails(errno.ENOTDIR, kernel.rmdir("d/f"))
    await fails(errno.EISDIR, kernel.unlink("d"))
    await fails(errno.EISDIR, kernel.open("d", os.O_WRONLY))
    await fails(errno.ENOENT, kernel.unlink("missing"))
    await fails(errno.ENOENT, kernel.open("missing"))
    await fails(errno.ENAMETOOLONG, kernel.open("n" * 256, os.O_WRONLY | os.O_CREAT))
    assert "d/" in await in_s3(mount, s3)
    await kernel.unlink("d/f")
    await kernel.rmdir("d")
    await fails(errno.ENOENT, kernel.resolve("d"))
    assert await in_s3(mount, s3) == {}


async def test_a_chmod_of_an_s3fs_directory_object_goes_onto_that_object(world) -> None:
    """s3fs marks a directory with a zero-byte "dir" object (application/x-directory). Its
    new mode goes onto that object, in place; a "dir/" marker beside it failed with EIO on
    stores with real folders (SeaweedFS: ExistingObjectIsFile)."""
    kernel, mount, s3 = world
    await s3.put("p/legacy", b"", {})
    await s3.copy("p/legacy", "p/legacy", 0, {}, content_type="application/x-directory")
    await kernel.setattr("legacy", mode=0o700)
    assert stat.S_IMODE((await kernel.stat("legacy")).st_mode) == 0o700
    assert set(await in_s3(mount, s3)) == {"legacy"}  # no "legacy/" beside it
    assert s3.content_types["p/legacy"] == "application/x-directory"
    assert stat.S_IMODE(int(s3.meta["p/legacy"]["mode"])) == 0o700
    await kernel.drop_caches()
    mount.fs.ns.invalidate_listing(ROOT_INODE)
    assert stat.S_IMODE((await kernel.stat("legacy")).st_mode) == 0o700


async def test_rename_rules(world) -> None:
    kernel, mount, s3 = world
    await kernel.mkdir("empty")
    await kernel.mkdir("full")
    await kernel.write("full/x", b"x")
    await kernel.mkdir("src")
    await kernel.write("src/a", b"a")
    await kernel.write("file", b"f")
    await fails(errno.ENOTEMPTY, kernel.rename("src", "full"))
    await fails(errno.EISDIR, kernel.rename("file", "empty"))
    await fails(errno.ENOTDIR, kernel.rename("src", "file"))
    await fails(errno.EINVAL, kernel.rename("src", "src/inside"))
    await kernel.rename("src", "empty")  # a directory onto an empty one replaces it
    assert await kernel.listdir("") == ["empty", "file", "full"]
    assert await kernel.read("empty/a") == b"a"
    held = await in_s3(mount, s3)
    assert held["empty/a"] == b"a" and not any(k.startswith("src") for k in held)


async def test_replace_over_a_file_and_rename_before_close(world) -> None:
    kernel, mount, s3 = world
    await kernel.write("model.safetensors", b"old")
    await kernel.write(".model.tmp", b"new weights")
    await kernel.rename(".model.tmp", "model.safetensors")
    assert await kernel.read("model.safetensors") == b"new weights"
    fh = await kernel.open("w.tmp", os.O_WRONLY | os.O_CREAT)
    await kernel.fs.write(fh, 0, b"pending")
    await kernel.rename("w.tmp", "w.final")  # never closed yet: nothing to move in S3
    await kernel.close(fh)
    assert await in_s3(mount, s3) == {"model.safetensors": b"new weights", "w.final": b"pending"}


async def test_an_unlinked_file_stays_readable_through_its_handle_and_never_reaches_s3(
        world) -> None:
    kernel, mount, s3 = world
    await kernel.write("g", b"kept")
    reader = await kernel.open("g")
    writer = await kernel.open("h", os.O_WRONLY | os.O_CREAT)
    await kernel.fs.write(writer, 0, b"never published")
    await kernel.unlink("g")
    await kernel.unlink("h")
    assert await kernel.read_fh(reader, 0, 100) == b"kept"
    await fails(errno.ENOENT, kernel.resolve("g"))
    await kernel.close(writer)
    await kernel.fs.release(reader)
    assert await in_s3(mount, s3) == {}


async def test_a_directory_rename_moves_everything_under_it(world) -> None:
    kernel, mount, s3 = world
    await kernel.mkdir("step.tmp")
    await kernel.mkdir("step.tmp/sub")
    await kernel.write("step.tmp/a.bin", b"a")
    await kernel.write("step.tmp/sub/b.bin", b"b")
    await kernel.rename("step.tmp", "step")
    assert await kernel.listdir("step") == ["a.bin", "sub"]
    assert await kernel.read("step/sub/b.bin") == b"b"
    held = await in_s3(mount, s3)
    assert (held["step/a.bin"], held["step/sub/b.bin"]) == (b"a", b"b")
    assert not [k for k in held if k.startswith("step.tmp")]
    await kernel.drop_caches()  # and after the kernel forgot every inode
    assert await kernel.read("step/a.bin") == b"a"


async def test_hard_links_and_xattrs_are_refused(world) -> None:
    kernel, _, _ = world
    await kernel.write("t", b"x")
    ino = await kernel.resolve("t")
    await fails(errno.EPERM, kernel.fs.link(ino, 1, b"hard", CTX))
    await fails(errno.ENOSYS, kernel.fs.getxattr(ino, b"user.a", CTX))


async def test_a_file_replaced_by_a_rename_stays_readable_through_its_handle(world) -> None:
    """os.replace(tmp, "latest.pt") while another process reads the old latest.pt: the
    reader keeps the version it opened, as on a local disk."""
    kernel, mount, s3 = world
    await kernel.write("latest.pt", b"old checkpoint")
    await in_s3(mount, s3)
    reader = await kernel.open("latest.pt")
    await kernel.write("latest.tmp", b"new checkpoint")
    await kernel.rename("latest.tmp", "latest.pt")
    assert await kernel.read_fh(reader, 0, 100) == b"old checkpoint"
    await kernel.fs.release(reader)
    assert await kernel.read("latest.pt") == b"new checkpoint"
    assert await in_s3(mount, s3) == {"latest.pt": b"new checkpoint"}


async def test_a_file_renamed_after_it_reached_s3_is_read_back_from_the_cache(world) -> None:
    """S3 copies the object to the new name (async mode: in the log's turn); the bytes the
    mount kept of it are the new object's too, and a read needs no GET."""
    kernel, mount, s3 = world
    data = os.urandom(3 << 20)
    await kernel.write("ck.pt", data)
    await in_s3(mount, s3)  # in S3 before the rename: the rename is a copy there
    await kernel.rename("ck.pt", "final.pt")
    assert await in_s3(mount, s3) == {"final.pt": data}
    s3.requests.clear()
    await kernel.drop_caches()
    assert await kernel.read("final.pt") == data[:1 << 20]
    assert [op for op, _ in s3.requests if op == "GET"] == []


async def test_a_file_replaced_by_a_copy_in_s3_stays_readable_through_its_handle(world) -> None:
    """As above, but the new file reached S3 before its rename: S3 copies it over the old
    one (async mode: in the log's turn), and the reader still has the version it opened."""
    kernel, mount, s3 = world
    old = os.urandom(3 << 20)
    await kernel.write("latest.pt", old)
    await in_s3(mount, s3)
    reader = await kernel.open("latest.pt")
    await kernel.write("latest.tmp", b"new checkpoint")
    await in_s3(mount, s3)
    await kernel.rename("latest.tmp", "latest.pt")
    assert await in_s3(mount, s3) == {"latest.pt": b"new checkpoint"}
    assert await kernel.read_fh(reader, 2 << 20, 1 << 20) == old[2 << 20:]
    await kernel.fs.release(reader)
    assert await kernel.read("latest.pt") == b"new checkpoint"

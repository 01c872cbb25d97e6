"""Checkpoint rotation after a rename-commit (issue 44): in the fast tier, the in-process mount
over the in-memory S3, with the ordered log stopped and let go at chosen points; at the end,
the same through real mounts.

Orbax and tmp-dir trainers save into `N.tmp/`, rename it to `N`, and later `rmtree` it. In
async mode the rename is an entry of the log; a file whose own put S3 applied before that
rename's turn had no object as far as the mount knew (its ETag was dropped as "renamed
since"), so its unlink appended no delete: the rename then moved the file back under the
new name, `rmdir` said ENOTEMPTY, and S3 kept a file the application had removed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pyfuse3
import pytest
import trio

from ckptfs.daemon import Mount
from conftest import Mounter, run_ckptfs, s3_keys
from fakes3 import Gate, MemoryS3
from inprocess import Kernel, mounted

ROTATIONCHECK = Path(__file__).parent / "rotationcheck.py"


@asynccontextmanager
async def moves_held(mount: Mount) -> AsyncIterator[trio.Event]:
    """Directory moves wait, in their turn, until the event is set (everything after them
    waits too, as the log orders); what comes before them reaches S3."""
    go = trio.Event()
    renames = mount.log.renames
    move_dir: Callable[..., Awaitable[dict[str, str]]] = renames.move_dir

    async def held(*args, **kwargs) -> dict[str, str]:
        await go.wait()
        return await move_dir(*args, **kwargs)
    renames.move_dir = held  # type: ignore[method-assign]
    try:
        yield go
    finally:
        go.set()
        renames.move_dir = move_dir  # type: ignore[method-assign]


async def rm_rf(kernel: Kernel, path: str) -> None:
    """shutil.rmtree: list, unlink the files, recurse into directories, rmdir."""
    for name in await kernel.listdir(path):
        child = f"{path}/{name}"
        attrs = await kernel.stat(child)
        if attrs.st_mode & 0o040000:
            await rm_rf(kernel, child)
        else:
            await kernel.unlink(child)
    await kernel.rmdir(path)


async def until(check: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not check():
            await trio.sleep(0.01)


def under(s3: MemoryS3, prefix: str) -> list[str]:
    return sorted(k for k in s3.objects if k.startswith(prefix))


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "with-subdirectory"])
async def test_rm_rf_after_a_directory_rename_whose_files_s3_already_has(
        tmp_path: Path, nested: bool) -> None:
    s3 = MemoryS3()
    async with mounted(tmp_path, s3, "async") as mount:
        kernel = Kernel(mount)
        await kernel.mkdir("1.tmp")
        if nested:
            await kernel.mkdir("1.tmp/sub")
        files = ["1.tmp/a", "1.tmp/sub/b"] if nested else ["1.tmp/a", "1.tmp/b"]
        async with moves_held(mount) as go:
            for name in files:
                await kernel.write(name, b"shard")
            await kernel.rename("1.tmp", "1")
            # The puts reach S3 before the rename's turn: S3 holds the files at the old names.
            await until(lambda: len(mount.log) == 1)  # only the rename is left
            await rm_rf(kernel, "1")
            assert await kernel.listdir("") == []
            go.set()
            await mount.changes.backlog.drain()
        assert under(s3, "p/1") == []
        assert await kernel.listdir("") == []
    async with mounted(tmp_path, s3, "async") as fresh:
        assert await Kernel(fresh).listdir("") == []



async def test_a_directory_being_moved_lists_and_reads_while_s3_deletes_its_old_keys(
        tmp_path: Path) -> None:
    """S3 moves a directory in two steps: every copy, then the deletes of the old keys. The
    mount sent its requests to the old keys until the entry was retired, so between the
    deletes and the retirement a listing found nothing there, and files the kernel had
    forgotten vanished from it (found by test_dirtree: a committed checkpoint listed empty)."""
    s3 = MemoryS3()
    async with mounted(tmp_path, s3, "async") as mount:
        kernel = Kernel(mount)
        await kernel.mkdir("1.tmp")
        for name in ("a", "b"):
            await kernel.write(f"1.tmp/{name}", name.encode() * 3)
        await mount.changes.backlog.drain()
        s3.faults.gate = gate = Gate()
        # The intent, the two copies, the new marker, the deletes of the objects: what
        # is left is the deletes of the emptied folder and of the intent.
        gate.let(5)
        await kernel.rename("1.tmp", "1")
        await until(lambda: gate.passes == 0 and not under(s3, "p/1.tmp/"))
        await kernel.drop_caches()
        assert await kernel.listdir("1") == ["a", "b"]
        assert await kernel.read("1/b") == b"bbb"
        gate.open()
        await mount.changes.backlog.drain()
        assert under(s3, "p/1") == ["p/1/", "p/1/a", "p/1/b"]
        await kernel.drop_caches()
        assert await kernel.listdir("1") == ["a", "b"]


async def test_a_temporary_directory_renamed_away_stays_gone_after_its_parent_is_renamed(
        tmp_path: Path) -> None:
    """`t` saved and committed as `b/b`, then `b` renamed to `a`, all before S3 applied
    the log: the mask that hides `b/t` while S3 still has it was kept under the name `b/t`,
    so the mount, now asking for `a/t` (in S3 still under `b/t/`), found the old temporary
    directory there again, and the next save's mkdir failed with EEXIST (found by
    test_dirtree)."""
    s3 = MemoryS3()
    s3.faults.gate = gate = Gate()
    gate.let(2)  # b's marker and b/t's; nothing after them
    async with mounted(tmp_path, s3, "async", metadata_ttl=0) as mount:
        kernel = Kernel(mount)
        await kernel.mkdir("b")
        await kernel.mkdir("b/t")
        await kernel.write("b/t/x", b"shard")
        await until(lambda: gate.passes == 0)
        await kernel.rename("b/t", "b/b")
        await kernel.rename("b", "a")
        await kernel.drop_caches()
        assert await kernel.listdir("a") == ["b"]
        await kernel.mkdir("a/t")  # the next save
        gate.open()
        await mount.changes.backlog.drain()
        assert under(s3, "p/") == ["p/a/", "p/a/b/", "p/a/b/x", "p/a/t/"]



async def test_a_second_temporary_directory_of_the_same_name_shows_only_its_own_files(
        tmp_path: Path) -> None:
    """Two saves through the same temporary name before S3 applied the first's rename: `t`
    committed as `a`, a new `t` committed as `b`. Until S3 moves them, the new names read
    from `t/`, where S3 still held the first save's files: `b/y` showed the first save's
    `y` (found by test_dirtree)."""
    s3 = MemoryS3()
    s3.faults.gate = gate = Gate()
    gate.let(3)  # t's marker and the first save's two files; nothing after them
    async with mounted(tmp_path, s3, "async", metadata_ttl=0) as mount:
        kernel = Kernel(mount)
        await kernel.mkdir("t")
        await kernel.write("t/x", b"first x")
        await kernel.write("t/y", b"first y")
        await kernel.rename("t", "a")
        await kernel.mkdir("t")
        await kernel.write("t/x", b"second x")
        await kernel.rename("t", "b")
        await until(lambda: gate.passes == 0)
        await kernel.drop_caches()
        assert await kernel.listdir("b") == ["x"]
        assert await kernel.read("b/x") == b"second x"
        with pytest.raises(pyfuse3.FUSEError):
            await kernel.stat("b/y")
        gate.open()
        await mount.changes.backlog.drain()
        assert {k: v for k, v in s3.objects.items() if not k.endswith("/")} == {
            "p/a/x": b"first x", "p/a/y": b"first y", "p/b/x": b"second x"}

# ----- through real mounts ---------------------------------------------------------------

@pytest.mark.parametrize("durability", ["close", "async"])
def test_rm_r_right_after_mv_of_a_nonempty_directory(mounter: Mounter, s3, prefix: str,
                                                     durability: str) -> None:
    """s3fs-fuse's test_mv_nonempty_directory, ten times: it failed every time in async mode
    with `rm: cannot remove 'testdir_rename': Directory not empty`."""
    mnt = mounter("--durability", durability)
    script = "; ".join(f"mkdir d{i} && touch d{i}/file && mv d{i} r{i} && rm -r r{i}"
                       for i in range(10))
    r = subprocess.run(["sh", "-ec", script], cwd=mnt.path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.listdir(mnt.path) == []
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert s3_keys(s3, prefix + "/") == []


@pytest.mark.parametrize("durability", ["close", "async"])
def test_rotation_while_the_kernel_drops_its_caches(mounter: Mounter, s3, prefix: str,
                                                    durability: str) -> None:
    """tests/rotationcheck.py for a few trials: save into N.tmp/, rename to N, rmtree, with
    the kernel's dentries and inodes dropped every 0.2 s; then S3 and a fresh mount agree
    (`--trials 200 --pause-max 2` by hand: see the closing note of issue 44)."""
    mnt = mounter("--durability", durability)
    r = subprocess.run([sys.executable, str(ROTATIONCHECK), str(mnt.path), "--trials", "12",
                        "--pause-max", "0.3", "--drop-caches", "0.2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert s3_keys(s3, prefix + "/") == [f"{prefix}/ckpts/"]
    mnt.unmount()
    assert os.listdir(mounter().path / "ckpts") == []

"""Checkpoint rotation after a rename-commit (issue 44), in the fast tier: the in-process mount
over the in-memory S3, with the ordered log stopped and let go at chosen points.

Orbax and tmp-dir trainers save into `N.tmp/`, rename it to `N`, and later `rmtree` it. In
async mode the rename is an entry of the log; a file whose own put S3 applied before that
rename's turn had no object as far as the mount knew (its ETag was dropped as "renamed
since"), so its unlink appended no delete: the rename then moved the file back under the
new name, `rmdir` said ENOTEMPTY, and S3 kept a file the application had removed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs.daemon import Mount
from fakes3 import MemoryS3
from inprocess import Kernel, mounted


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


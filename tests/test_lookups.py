"""Lookups checked against a model of the namespace while the kernel forgets inodes (issue 34).

The mount's `CheckpointFS` runs in process over the in-memory S3; a small stand-in for the
kernel does what the kernel does with inode references: every LOOKUP, CREATE, MKDIR and READDIR
entry adds one, and "drop the caches" sends FORGET for all of them. Random creates, overwrites,
unlinks, renames, mkdirs, listings and stats are checked one by one against a dict; the clock
jumps past the metadata TTL now and then, so both fresh and stale listings are exercised. At
the end the log is drained and a fresh mount over the same S3 must show the model.
The same workload through a real mount, with `drop_caches`, is in test_posix.py."""

from __future__ import annotations

import errno
import functools
import time
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ckptfs.config import Config
from ckptfs.daemon import Mount, build_mount
from ckptfs.inodes import ROOT_INODE
from ckptfs.listing import SYMLINK_MAX
from fakes3 import MemoryS3
import inprocess
from inprocess import CTX, Kernel

TTL = 1.0
DIRS = ["", "d", "d/e"]
NAMES = ["a", "b", "c"]
files = st.builds(lambda d, n: f"{d}/{n}".lstrip("/"), st.sampled_from(DIRS), st.sampled_from(NAMES))


@pytest.mark.parametrize("durability", ["close", "async"])
def test_every_lookup_agrees_with_the_model_while_the_kernel_forgets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    # The namespace's TTLs run on time.monotonic: a fake offset lets a rule age every answer.
    real_monotonic, offset = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset[0])
    runs = iter(range(10**6))
    serve = functools.partial(inprocess.serve, tmp_path, durability, metadata_ttl=TTL)

    class Lookups(RuleBasedStateMachine):
        nursery: trio.Nursery

        def __init__(self) -> None:
            super().__init__()
            self.s3 = MemoryS3()
            self.stop = trio.Event()
            self.mount = self.start()
            self.kernel = Kernel(self.mount)
            self.files: dict[str, bytes] = {}
            self.dirs: set[str] = {""}

        def start(self) -> Mount:
            return self.call(self.nursery.start, serve, self.s3, next(runs), self.stop)

        def call(self, fn, *args):
            return trio.from_thread.run(fn, *args)

        def exists(self, path: str) -> bool:
            return path in self.files or path in self.dirs

        def teardown(self) -> None:
            try:
                self.call(self.mount.changes.backlog.drain)
                fresh = self.start()  # another host's mount of the prefix, once S3 has it all
                self.call(check_tree, Kernel(fresh), self.files, self.dirs)
            finally:
                trio.from_thread.run_sync(self.stop.set)

        @rule(path=files, data=st.binary(max_size=64))
        def write(self, path: str, data: bytes) -> None:
            parent = path.rpartition("/")[0]
            if parent not in self.dirs or path in self.dirs:
                return
            self.call(self.kernel.write, path, data)
            self.files[path] = data

        @rule(path=st.sampled_from(DIRS[1:]))
        def mkdir(self, path: str) -> None:
            parent, _, name = path.rpartition("/")
            if parent not in self.dirs or self.exists(path):
                return
            attrs = self.call(self.mount.fs.mkdir, self.call(self.kernel.resolve, parent),
                              name.encode(), 0o755, CTX)
            self.kernel.took(attrs.st_ino)
            self.dirs.add(path)

        @rule(path=files)
        def unlink(self, path: str) -> None:
            try:
                self.call(self.kernel.unlink, path)
            except pyfuse3.FUSEError as exc:
                assert path not in self.files, f"unlink {path}: {exc!r}, the model has it"
                return
            assert path in self.files, f"unlink {path} succeeded; the model has no such file"
            del self.files[path]

        @rule(src=files, dst=files)
        def rename(self, src: str, dst: str) -> None:
            if src not in self.files or dst.rpartition("/")[0] not in self.dirs or dst in self.dirs:
                return
            self.call(self.kernel.rename, src, dst)
            self.files[dst] = self.files.pop(src)

        @rule(path=st.sampled_from(DIRS))
        def listdir(self, path: str) -> None:
            if path not in self.dirs:
                return
            want = sorted(p.rpartition("/")[2] for p in [*self.files, *self.dirs]
                          if p and p.rpartition("/")[0] == path)
            assert self.call(self.kernel.listdir, path) == want, path

        @rule(path=files)
        def stat(self, path: str) -> None:
            try:
                attrs = self.call(self.mount.fs.getattr, self.call(self.kernel.resolve, path), CTX)
            except pyfuse3.FUSEError as exc:
                assert not self.exists(path), f"stat {path}: {exc!r}, the model has it"
                assert exc.errno in (errno.ENOENT, errno.ENOTDIR)
                return
            assert path in self.files, f"stat {path} found something the model does not have"
            assert attrs.st_size == len(self.files[path]), path

        @rule(path=files)
        def read(self, path: str) -> None:
            if path in self.files:
                assert self.call(self.kernel.read, path) == self.files[path], path

        @rule()
        def drop_caches(self) -> None:
            self.call(self.kernel.drop_caches)

        @rule()
        def time_passes(self) -> None:
            offset[0] += TTL * 1.5

        @invariant()
        def forgotten_is_still_found(self) -> None:
            # The hard case, after every step: the kernel forgets everything, then looks up
            # each name the model holds.
            self.call(self.kernel.drop_caches)
            for path in sorted(self.files):
                self.call(self.kernel.resolve, path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            Lookups.nursery = nursery
            await trio.to_thread.run_sync(lambda: run_state_machine_as_test(Lookups, settings=settings(
                max_examples=25, stateful_step_count=40, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))))
    trio.run(main)


async def check_tree(kernel: Kernel, want_files: dict[str, bytes], want_dirs: set[str]) -> None:
    """Everything the model holds, and nothing else, read through a fresh mount."""
    seen_files: dict[str, bytes] = {}
    seen_dirs: set[str] = {""}
    todo = [""]
    while todo:
        path = todo.pop()
        for name in await kernel.listdir(path):
            child = f"{path}/{name}".lstrip("/")
            attrs = await kernel.fs.getattr(await kernel.resolve(child), CTX)
            if attrs.st_mode & 0o040000:
                seen_dirs.add(child)
                todo.append(child)
            else:
                seen_files[child] = await kernel.read(child)
    assert seen_files == want_files
    assert seen_dirs == want_dirs


async def _closed(mount: Mount, name: str, data: bytes) -> None:
    """`name` in the root written (created or overwritten) and closed through the mount."""
    kernel = Kernel(mount)
    await kernel.write(name, data)


@pytest.mark.parametrize("overwrite", [False, True])
async def test_a_listing_taken_while_the_mount_writes_a_file_does_not_undo_it(
        tmp_path: Path, overwrite: bool) -> None:
    # Close mode: the file is in S3 when close returns, and clean. A LIST sent before that
    # has the old state (no object, or the old version): merged in afterwards, it detached
    # the new file as "gone from S3", or took its old size and ETag back.
    s3 = MemoryS3()
    if overwrite:
        await s3.put("p/f", b"o" * (SYMLINK_MAX + 1), {})  # too big to HEAD in a listing
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability="close", upload_timeout=10,
                    metadata_ttl=TTL)
    async with trio.open_nursery() as nursery:
        mount = await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        root = mount.fs.table[ROOT_INODE]
        listing_sent, answer = trio.Event(), trio.Event()
        list_pages = s3.list_pages

        async def held_list(prefix: str, delimiter: str = "/"):
            pages = [page async for page in list_pages(prefix, delimiter)]  # S3's state now
            listing_sent.set()
            await answer.wait()
            for page in pages:
                yield page
        s3.list_pages = held_list  # type: ignore[method-assign]
        listed: list = []

        async def list_root() -> None:
            listed.extend(await mount.fs.ns.list_dir(root))
        nursery.start_soon(list_root)
        await listing_sent.wait()
        new = b"n" * (SYMLINK_MAX + 2)
        await _closed(mount, "f", new)
        answer.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [(i.name, i.size) for i in listed] == [("f", len(new))]
        assert await Kernel(mount).read("f") == new
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("durability", ["close", "async"])
@pytest.mark.parametrize("where", ["", "d/"])
async def test_a_forget_while_a_lookup_asks_s3_is_no_enoent(tmp_path: Path, durability: str,
                                                             where: str) -> None:
    # `echo 2 > drop_caches`, then a stat: the kernel's LOOKUP of the name can reach the mount
    # before the FORGET of its old inode. The lookup found the inode stale and re-checked it
    # with a LIST page; the FORGET dropped it meanwhile, and the re-check took "not in the
    # table any more" for "gone": ENOENT for a file S3 holds (issue 41: 7 misses in 160).
    s3 = MemoryS3()
    await s3.put(f"p/{where}f.bin", b"x" * 10, {})
    async with inprocess.mounted(tmp_path, s3, durability, metadata_ttl=0.05) as mount:
        kernel = Kernel(mount)
        directory = where.rstrip("/")
        assert f"f.bin" in await kernel.listdir(directory)  # listed: a stale entry is re-checked by LIST
        ino = await kernel.resolve(f"{where}f.bin")
        await trio.sleep(0.1)  # past the TTL
        parent = mount.fs.table.child(ROOT_INODE, directory) if directory else mount.fs.table[ROOT_INODE]
        listing, answer = trio.Event(), trio.Event()
        s3.faults.hold("LIST", answer)
        looked_up: list = []

        async def lookup() -> None:
            looked_up.append(await mount.fs.lookup(parent.ino, b"f.bin", CTX))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup)
            await trio.testing.wait_all_tasks_blocked()
            await mount.fs.forget([(ino, kernel.refs.pop(ino))])  # the FORGET of the old dentry
            answer.set()
        assert looked_up and looked_up[0].st_size == 10

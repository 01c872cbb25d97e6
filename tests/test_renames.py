"""Renames in S3 are all-or-nothing through a crash at any request (issue 32), over the
in-memory S3: a crash is every request failing from the Nth on, for every N, and then a
fresh mount's recovery (`Renames.complete_interrupted`) must show the rename not begun or
done, never half. The same through real mounts and SIGKILL is in test_crash.py."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ckptfs.config import Config
from ckptfs.daemon import build_mount
from ckptfs.inodes import ROOT_INODE
from ckptfs.journal import Journal, Record
from ckptfs.recovery import Recovery
from ckptfs.renames import INTENTS, Renames
from ckptfs.staging import StagingArea
from ckptfs.uploader import Uploader
from ckptfs.parts import PartPlan
from fakes3 import Crash, MemoryS3

FILES = {f"step.tmp/shard_{i}.pt": os.urandom(100 + i) for i in range(6)} | {
    "step.tmp/sub/extra.pt": b"nested", "step.tmp/": b"", "other.pt": b"not moved"}


async def _seed(s3: MemoryS3) -> None:
    for key, body in FILES.items():
        await s3.put("p/" + key, body, {"mode": "16877"} if key.endswith("/") else {})


def _files(s3: MemoryS3) -> dict[str, bytes]:
    return {k[2:]: v for k, v in s3.objects.items() if not k.endswith("/")}


@contextlib.asynccontextmanager
async def _async_mount(tmp_path: Path, s3: MemoryS3, **options: Any):
    """(mount, kernel): an in-process async-mode mount over `s3`, until the block ends."""
    from inprocess import Kernel
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability="async", upload_timeout=10,
                    **options)
    async with trio.open_nursery() as nursery:
        mount = await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        yield mount, Kernel(mount)
        nursery.cancel_scope.cancel()


def _whole(s3: MemoryS3) -> str:
    """'before' or 'after' if S3 shows the rename not begun or done; anything else is a bug."""
    files = _files(s3)
    before = {k: v for k, v in FILES.items() if not k.endswith("/")}
    after = {k.replace("step.tmp/", "step/", 1): v for k, v in before.items()}
    if files == before:
        return "before"
    if files == after and "p/step/" in s3.objects:
        return "after"
    return f"half: {sorted(files)}"


async def test_a_directory_rename_interrupted_at_any_request_is_completed_or_never_begun() -> None:
    outcomes = set()
    total = None
    n = 0
    while total is None or n <= total:
        s3 = MemoryS3()
        await _seed(s3)
        s3.requests.clear()
        s3.faults.crash_after(n)
        try:
            await Renames(s3, "p/").move_dir("p/step.tmp/", "p/step/", {"mode": "16877"})
            total = len(s3.requests)  # the uninterrupted rename's request count
        except (Crash, BaseExceptionGroup):
            pass
        s3.faults.crash_after(None)
        intents_left = [k for k in s3.objects if k.startswith("p/" + INTENTS)]
        await Renames(s3, "p/").complete_interrupted()  # the next mount, before it is ready
        state = _whole(s3)
        assert state in ("before", "after"), f"crash after {n} requests: {state}"
        assert not [k for k in s3.objects if k.startswith("p/" + INTENTS)]
        if intents_left:
            assert state == "after"  # once the intent is in S3 the rename has happened
        outcomes.add(state)
        n += 1
    assert outcomes == {"before", "after"} and total is not None and total > 10


async def test_a_file_rename_interrupted_at_any_request_leaves_one_name() -> None:
    for n in range(8):
        s3 = MemoryS3()
        etag = await s3.put("p/a.tmp", b"payload", {})
        s3.faults.crash_after(n)
        try:
            await Renames(s3, "p/").move_object("p/a.tmp", "p/a", 7, etag)
        except Crash:
            pass
        s3.faults.crash_after(None)
        await Renames(s3, "p/").complete_interrupted()
        assert sorted(s3.objects) in (["p/a.tmp"], ["p/a"]), (n, sorted(s3.objects))
        assert set(s3.objects.values()) == {b"payload"}


async def test_recovery_finishes_a_rename_first_and_a_close_mode_record_follows_it(tmp_path: Path) -> None:
    """Close mode, disk kept: a file of the directory whose upload had failed is journaled
    under its old name; the rename was cut short. Its bytes must land under the new name."""
    s3 = MemoryS3()
    await _seed(s3)
    renames = Renames(s3, "p/")
    await renames._begin("p/step.tmp/", "p/step/", await s3.list_keys("p/step.tmp/"), None, None)
    await s3.copy("p/step.tmp/shard_0.pt", "p/step/shard_0.pt", 100)  # one copy made, then the crash
    staging = StagingArea(str(tmp_path))
    journal = Journal(str(tmp_path))
    with open(os.path.join(staging.dir, "late"), "wb") as f:
        f.write(b"journaled bytes")
    journal.write(Record("late", "p/step.tmp/late.pt", True, 15))
    async with trio.open_nursery() as nursery:
        uploader = Uploader(s3, PartPlan(5 << 20), 4, journal=journal, upload_timeout=10,  # type: ignore[arg-type]
                            nursery=nursery)
        report = await Recovery(journal, staging.dir, str(tmp_path / "preserved"), s3,  # type: ignore[arg-type]
                                uploader).run("p/", 3600)
        nursery.cancel_scope.cancel()
    assert report.renames_completed == ["p/step.tmp/ -> p/step/"] and not report.failed
    assert s3.objects["p/step/late.pt"] == b"journaled bytes"
    assert not [k for k in s3.objects if k.startswith("p/step.tmp/")]
    assert _files(s3)["step/sub/extra.pt"] == b"nested"


@pytest.mark.parametrize("durability", ["close", "async"])
async def test_a_rename_waits_for_an_upload_in_the_directory_to_finish(
        tmp_path: Path, durability: str) -> None:
    """A close whose upload is in flight when the directory is renamed. Before, in close
    mode, the rename copied what S3 had and the upload then completed under the old name:
    the new directory lacked the file and the old one came back with it."""
    s3 = MemoryS3()
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability=durability, upload_timeout=10)
    async with trio.open_nursery() as nursery:
        mount = await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        fs, files, tree = mount.fs, mount.files, mount.fs.tree
        root = fs.table[ROOT_INODE]
        d = await tree.make_entry(root, "step.tmp", 0o40755, 0, 0, b"")
        node = files.create(d, "model.pt", 0o644, 0, 0)
        await files.write(node, 0, b"weights")
        go = trio.Event()
        s3.faults.hold("PUT", go)  # the close's PUT waits
        closed = trio.Event()

        async def close() -> None:
            await files.close(node, None)
            await files.release(node, writable=True)
            closed.set()
        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        renamed = trio.Event()

        async def rename() -> None:
            await tree.rename(root, d, root, "step", None, noreplace=False)
            renamed.set()
        nursery.start_soon(rename)
        await trio.testing.wait_all_tasks_blocked()
        go.set()
        with trio.fail_after(10):
            await closed.wait()
            await renamed.wait()
            await mount.changes.backlog.drain()
        assert _files(s3) == {"step/model.pt": b"weights"}
        assert fs.table.key_of(node) == "p/step/model.pt"
        nursery.cancel_scope.cancel()


def test_an_intent_is_json_a_person_can_read() -> None:
    async def main() -> dict:
        s3 = MemoryS3()
        await _seed(s3)
        key = await Renames(s3, "p/")._begin("p/step.tmp/", "p/step/", await s3.list_keys("p/step.tmp/"),
                                             {"mode": "16877"}, None)
        assert key.startswith("p/.ckptfs/renames/") and key.endswith(".json")
        return json.loads(s3.objects[key])
    intent = trio.run(main)
    assert intent["src"] == "p/step.tmp/" and intent["dst"] == "p/step/"
    assert sorted(k for k, _ in intent["keys"]) == sorted(
        ["", "shard_0.pt", "shard_1.pt", "shard_2.pt", "shard_3.pt", "shard_4.pt", "shard_5.pt",
         "sub/extra.pt"])


@pytest.mark.parametrize("durability", ["close", "async"])
async def test_the_reserved_name_is_never_listed_found_or_made(tmp_path: Path, durability: str) -> None:
    import errno

    import pyfuse3
    s3 = MemoryS3()
    await s3.put("p/.ckptfs/renames/x.json", b"{}", {})
    await s3.put("p/.ckptfs", b"", {})
    await s3.put("p/real.pt", b"r", {})
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability=durability, upload_timeout=10)
    async with trio.open_nursery() as nursery:
        mount = await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        root = mount.fs.table[ROOT_INODE]
        assert [i.name for i in await mount.fs.ns.list_dir(root)] == ["real.pt"]
        assert await mount.fs.ns.lookup(root, ".ckptfs") is None
        ctx = pyfuse3.RequestContext()
        for attempt in (lambda: mount.fs.mkdir(ROOT_INODE, b".ckptfs", 0o755, ctx),
                        lambda: mount.fs.create(ROOT_INODE, b".ckptfs", 0o644, os.O_WRONLY, ctx),
                        lambda: mount.fs.rename(ROOT_INODE, b"real.pt", ROOT_INODE, b".ckptfs", 0, ctx)):
            with pytest.raises(pyfuse3.FUSEError) as err:
                await attempt()
            assert err.value.errno == errno.EPERM
        nursery.cancel_scope.cancel()


async def test_a_copy_s3_refuses_undoes_the_rename_and_the_call_fails() -> None:
    from ckptfs.errors import CkptfsError
    s3 = MemoryS3()
    await _seed(s3)
    s3.faults.fail("COPY", "p/step/shard_3.pt", times=100, status=403)
    with pytest.raises(CkptfsError):
        await Renames(s3, "p/").move_dir("p/step.tmp/", "p/step/", {"mode": "16877"})
    assert _whole(s3) == "before"
    assert not [k for k in s3.objects if k.startswith(("p/step/", "p/" + INTENTS))]


async def test_an_async_directory_rename_returns_at_once_and_reads_the_objects_where_they_are(
        tmp_path: Path) -> None:
    """Async mode: a directory rename is an entry of the log. The call returns before S3 has
    moved anything; meanwhile the new names read, list and stat from where S3 still holds
    the objects, the old names are gone, and a second rename of the new name chains."""
    from inprocess import Kernel
    s3 = MemoryS3()
    config = Config(source="s3://bucket/p/", mountpoint=str(tmp_path / "mnt"),
                    cache_dir=str(tmp_path / "cache"), durability="async", upload_timeout=10)
    async with trio.open_nursery() as nursery:
        mount = await build_mount(config, s3, nursery)  # type: ignore[arg-type]
        kernel = Kernel(mount)
        ctx = __import__("pyfuse3").RequestContext()
        attrs = await mount.fs.mkdir(ROOT_INODE, b"step.tmp", 0o755, ctx)
        await kernel.write("step.tmp/applied.pt", b"in S3 already")
        await mount.changes.backlog.drain()
        go = trio.Event()
        s3.faults.hold("PUT", go)  # the log stops at the next put: the ones below wait
        await kernel.write("step.tmp/pending.pt", b"still in the log")
        with trio.fail_after(5):  # returns without waiting for S3
            await kernel.rename("step.tmp", "step")
            await kernel.rename("step", "final")
        assert not [k for k in s3.objects if k.startswith("p/step/") or k.startswith("p/final/")]
        await kernel.drop_caches()
        assert await kernel.listdir("") == ["final"]
        assert await kernel.listdir("final") == ["applied.pt", "pending.pt"]
        assert await kernel.read("final/applied.pt") == b"in S3 already"
        assert await kernel.read("final/pending.pt") == b"still in the log"
        go.set()
        with trio.fail_after(10):
            await mount.changes.backlog.drain()
        assert _files(s3) == {"final/applied.pt": b"in S3 already",
                              "final/pending.pt": b"still in the log"}
        assert not [k for k in s3.objects if k.startswith(("p/step", "p/" + INTENTS))]
        assert await kernel.read("final/applied.pt") == b"in S3 already"
        assert mount.fs.table.physical("p/final/x") == "p/final/x"
        del attrs
        nursery.cancel_scope.cancel()


async def test_a_put_renamed_onto_a_file_then_away_leaves_no_object_at_the_first_name(
        tmp_path: Path) -> None:
    """Async mode: a rename right after close moves the put to the new name (no copy in S3).
    Moved onto a file S3 has (or will have), the put replaces that object; renamed away again,
    S3 must lose that name too (found by test_lookups: the replaced object came back)."""
    s3 = MemoryS3()
    async with _async_mount(tmp_path, s3) as (mount, kernel):
        await kernel.write("a", b"first")
        await kernel.write("b", b"second")
        await kernel.rename("b", "a")  # os.replace(tmp, final)
        await kernel.rename("a", "b")
        with trio.fail_after(10):
            await mount.changes.backlog.drain()
        assert _files(s3) == {"b": b"second"}


async def test_a_listing_taken_while_a_directory_move_lands_keeps_what_moved(
        tmp_path: Path) -> None:
    """Async mode: S3 moves a renamed directory's objects in the log's turn, and the table
    learns of it once the entry is retired. A LIST of the old place that lands in between
    finds nothing there: the moved files must not be dropped as gone from S3 (found by
    test_stateful: 'e/c' vanished from the mount after 'mv d1 e')."""
    s3 = MemoryS3()
    async with _async_mount(tmp_path, s3, metadata_ttl=0) as (mount, kernel):
        ctx = __import__("pyfuse3").RequestContext()
        await mount.fs.mkdir(ROOT_INODE, b"d1", 0o755, ctx)
        await kernel.write("d1/c", b"moved")
        await mount.changes.backlog.drain()
        assert await kernel.listdir("d1") == ["c"]
        moved, retire = trio.Event(), trio.Event()
        records = mount.log.records
        remove_entry = records.remove_entry

        async def slow_retire(name: str) -> None:  # S3 has moved everything; the table not yet
            moved.set()
            await retire.wait()
            await remove_entry(name)
        records.remove_entry = slow_retire  # type: ignore[method-assign]
        await kernel.rename("d1", "e")
        with trio.fail_after(5):
            await moved.wait()
        assert _files(s3) == {"e/c": b"moved"}
        assert await kernel.listdir("e") == ["c"]  # it listed p/d1/, empty by now
        retire.set()
        await mount.changes.backlog.drain()
        assert await kernel.listdir("e") == ["c"]
        assert await kernel.read("e/c") == b"moved"


class FolderS3(MemoryS3):
    """A store with real folders, as SeaweedFS: deleting "dir/" deletes what is under it."""

    async def delete(self, key: str, deadline: Any = None) -> None:
        if key.endswith("/"):
            for k in [k for k in self.objects if k.startswith(key) and k != key]:
                await super().delete(k, deadline)
        await super().delete(key, deadline)


async def test_a_replayed_directory_move_onto_a_replaced_directory_keeps_what_it_moved() -> None:
    # The log replays a dirmove whose S3 work was done but whose record a crash left behind:
    # deleting the replaced (empty) directory's marker then would take the moved checkpoint
    # with it on a store with real folders.
    s3 = FolderS3()
    await _seed(s3)
    await s3.put("p/step/", b"", {})  # the empty directory the rename replaces
    renames = Renames(s3, "p/")
    for _ in range(2):  # the move, then its replay
        await renames.move_dir("p/step.tmp/", "p/step/", {"mode": "16877"}, (), ("p/step/",))
    assert _whole(s3) == "after"

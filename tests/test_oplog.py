"""The ordered log against an in-memory S3 that records the order of visible changes.

A fake is right here: these tests are about ordering and faults (a part that crawls, a
request that fails, a rename that retargets an upload), which a real server cannot be made
to show on cue. The end-to-end checks are in test_crash.py, against SeaweedFS.
"""

from __future__ import annotations

import os
from pathlib import Path

import trio
import trio.testing

from ckptfs.journal import Journal, Record
from ckptfs.oplog import OrderedLog
from ckptfs.parts import PartPlan
from ckptfs.renames import Renames
from ckptfs.staging import StagedFile, StagingArea
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload
from fakes3 import MemoryS3 as FakeS3

MiB = 1024 * 1024


def records(cache: Path) -> list[Record]:
    """The journal as it is now (Journal.scan is for mount time: it removes temp files)."""
    return [Record.decode(p.read_bytes()) for p in (cache / "journal").glob("*.json")]


def make(tmp_path: Path, s3: FakeS3, nursery: trio.Nursery) -> tuple[OrderedLog, StagingArea, Journal]:
    journal = Journal(str(tmp_path))
    uploader = Uploader(s3, PartPlan(5 * MiB), 4, stream_while_writing=False, journal=journal,  # type: ignore[arg-type]
                        upload_timeout=0.5, nursery=nursery)
    return (OrderedLog(uploader.records, uploader, Renames(s3, "p/"), nursery=nursery),  # type: ignore[arg-type]
            StagingArea(str(tmp_path)), journal)


async def put(log: OrderedLog, staging: StagingArea, key: str, data: bytes, fresh: bool = True):
    staged = staging.new_file()
    staged.pwrite(data, 0)
    staged.held = True
    return await log.append(Record(os.path.basename(staged.path), key, True, len(data),
                                   part_size=5 * MiB), key, staged=staged, fresh=fresh)


async def test_a_small_marker_waits_for_the_big_file_before_it(tmp_path: Path) -> None:
    s3 = FakeS3()
    parts = trio.Event()
    s3.faults.hold("UploadPart", parts)  # the big file's parts crawl
    async with trio.open_nursery() as nursery:
        log, staging, journal = make(tmp_path, s3, nursery)
        await put(log, staging, "ck/model.pt", os.urandom(11 * MiB))
        await put(log, staging, "ck/COMPLETE", b"done")
        await log.append(Record("", "old/model.pt", True, op="delete"), "old/model.pt",
                         masks=("old/model.pt",))
        assert sorted(r.seq for r in records(tmp_path)) == [1, 2, 3]
        await trio.sleep(0.3)
        assert s3.visible == []  # the marker was ready at once, and waits its turn
        assert log.masked("old/model.pt") and not log.masked("old/other.pt")
        parts.set()
        with trio.fail_after(10):
            await log.drain()
    assert s3.visible == [("complete", "ck/model.pt"), ("put", "ck/COMPLETE"),
                          ("delete", "old/model.pt")]
    assert journal.scan() == ([], []) and not log.masked("old/model.pt")


async def test_a_failing_entry_holds_everything_after_it(tmp_path: Path) -> None:
    s3 = FakeS3()
    s3.faults.fail("PUT", times=10**6)
    async with trio.open_nursery() as nursery:
        log, staging, journal = make(tmp_path, s3, nursery)
        await put(log, staging, "a", b"first")
        await log.append(Record("", "b", True, op="object", body=""), "b")
        with trio.fail_after(10):
            failed = await log.wait()
        assert [p for p, _ in failed] == ["a"] and "SlowDown" in failed[0][1]
        assert s3.visible == []
        s3.faults.heal("PUT")
        log.uploader.policy.hurry.now()
        with trio.fail_after(10):
            assert await log.wait() == []
    assert s3.visible == [("put", "a"), ("put", "b")]


async def test_a_rename_retargets_the_last_put_and_never_copies(tmp_path: Path) -> None:
    s3 = FakeS3()
    parts = trio.Event()
    s3.faults.hold("UploadPart", parts)
    moved = []
    async with trio.open_nursery() as nursery:
        log, staging, journal = make(tmp_path, s3, nursery)
        data = os.urandom(11 * MiB)
        entry = await put(log, staging, "ck.pt.tmp", data)
        await trio.sleep(0.2)  # its upload is created under the old key, parts in flight
        assert await log.retarget(entry, "ck.pt", "ck.pt", lambda: moved.append(True))
        (rec,) = records(tmp_path)
        assert rec.key == "ck.pt" and rec.orphan_key == "ck.pt.tmp" and rec.seq == entry.seq
        parts.set()
        with trio.fail_after(10):
            await log.drain()
    assert moved == [True]
    assert s3.visible == [("complete", "ck.pt")] and s3.objects["ck.pt"] == data
    assert s3.uploads == {}  # the upload under the old key was aborted


async def test_a_sync_ends_the_rename_grace_of_the_last_put(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("ckptfs.oplog.REWRITE_GRACE", 30.0)
    s3 = FakeS3()
    async with trio.open_nursery() as nursery:
        log, staging, _ = make(tmp_path, s3, nursery)
        await put(log, staging, "ck.pt", b"x")
        await trio.sleep(0.3)
        assert s3.visible == []  # it waits for a rename of it...
        with trio.fail_after(10):
            assert await log.wait() == []  # ...until a sync asks for it
    assert s3.visible == [("put", "ck.pt")]


async def test_no_retarget_once_another_entry_follows(tmp_path: Path) -> None:
    s3 = FakeS3()
    async with trio.open_nursery() as nursery:
        log, staging, _ = make(tmp_path, s3, nursery)
        entry = await put(log, staging, "x.tmp", b"x")
        await put(log, staging, "y", b"y")
        assert not await log.retarget(entry, "x", "x", lambda: None)
        not_fresh = await put(log, staging, "z", b"z", fresh=False)
        assert not await log.retarget(not_fresh, "w", "w", lambda: None)
        with trio.fail_after(10):
            await log.drain()
    assert s3.visible == [("put", "x.tmp"), ("put", "y"), ("put", "z")]


async def test_a_retarget_is_never_overwritten_by_the_old_uploads_record(tmp_path: Path) -> None:
    """The retargeted put's record names the new key; a journal write of its old upload that
    was already waiting for the record's lock must not put the old key back (a crash would
    then publish the temp name: seen as an extra latest.pt.tmp by the crash checker)."""
    s3 = FakeS3()
    up = FileUpload(journal_name="run-1", record=Record("run-1", "ck.pt.tmp", True, 5, seq=1))
    async with trio.open_nursery() as nursery:
        log, staging, journal = make(tmp_path, s3, nursery)
        async with up.record_lock:  # the retarget holds the lock...
            nursery.start_soon(log.uploader.records.save, up,
                               Record("run-1", "ck.pt.tmp", True, 5, seq=1, intent=1.0))
            await trio.testing.wait_all_tasks_blocked()  # ...while the old write waits for it
            up.journal_name = None
            journal.write(Record("run-1", "ck.pt", True, 5, seq=1, orphan_key="ck.pt.tmp"))
    (rec,) = journal.scan()[0]
    assert rec.key == "ck.pt"


async def test_a_put_that_waited_for_its_turn_gets_a_fresh_deadline(tmp_path: Path) -> None:
    """Its first transient fault after a long wait is retried within the attempt, not
    turned into a failed attempt because the deadline passed while it waited."""
    s3 = FakeS3()
    s3.faults.fail("PUT", "a", times=10**6)
    async with trio.open_nursery() as nursery:
        log, staging, _ = make(tmp_path, s3, nursery)  # --upload-timeout 0.5 s
        await put(log, staging, "a", b"a")
        b = await put(log, staging, "b", b"b")
        await trio.sleep(1.0)  # b waits behind a for longer than the upload timeout
        s3.faults.heal("PUT", "a")
        s3.faults.fail("PUT", "b", times=1)
        log.uploader.policy.hurry.now()
        with trio.fail_after(10):
            await log.drain()
    assert b.attempts == 0 and s3.visible == [("put", "a"), ("put", "b")]


def gate_creates(s3: FakeS3) -> tuple[trio.Event, trio.Event]:
    """Hold every CreateMultipartUpload until the first is set, every part until the second."""
    created, parts = trio.Event(), trio.Event()
    s3.faults.hold("CreateMultipartUpload", created)
    s3.faults.hold("UploadPart", parts)
    return created, parts


async def streaming(tmp_path: Path, s3: FakeS3, nursery: trio.Nursery, key: str,
                    data: bytes) -> tuple[OrderedLog, StagedFile, FileUpload]:
    """A log whose uploader streams, and a staged file whose write of `data` under `key`
    started streaming its parts (as async mode does while a file is written)."""
    journal = Journal(str(tmp_path))
    uploader = Uploader(s3, PartPlan(5 * MiB), 4, journal=journal,  # type: ignore[arg-type]
                        upload_timeout=10, nursery=nursery)
    log = OrderedLog(uploader.records, uploader, Renames(s3, "p/"), nursery=nursery)  # type: ignore[arg-type]
    staged = StagingArea(str(tmp_path)).new_file()
    staged.pwrite(data, 0)
    up = FileUpload(journal_name=os.path.basename(staged.path))
    uploader.note_write(up, staged.path, lambda: key, dict, 0, len(data))
    # Parts 1 and 2 stream; their create waits, its intent journaled first. (A fixed 0.1 s
    # sleep here failed once in a full run on this 2-core machine: no record yet.)
    with trio.fail_after(10):
        while not records(tmp_path):
            await trio.sleep(0.01)
    return log, staged, up


async def test_a_put_takes_over_the_upload_streamed_while_the_file_was_written(tmp_path: Path) -> None:
    """Async mode streams parts during the write; the put appended at close adopts that
    multipart upload: its record names the upload (recovery resumes it), and the intent of a
    create still in flight carries over. No part is sent twice."""
    s3 = FakeS3()
    created, parts = gate_creates(s3)
    data = os.urandom(11 * MiB)
    async with trio.open_nursery() as nursery:
        log, staged, up = await streaming(tmp_path, s3, nursery, "ck/model.pt", data)
        name = os.path.basename(staged.path)
        [rec] = records(tmp_path)
        assert not rec.closed and rec.intent and rec.seq == 0
        staged.held = True
        await log.append(Record(name, "ck/model.pt", True, len(data), part_size=5 * MiB),
                         "ck/model.pt", staged=staged, fresh=True, up=up)
        [rec] = records(tmp_path)
        assert rec.seq == 1 and rec.closed and rec.intent and rec.upload_id is None
        created.set()
        with trio.fail_after(10):
            while records(tmp_path)[0].upload_id is None:
                await trio.sleep(0.01)
        [rec] = records(tmp_path)
        assert rec.seq == 1 and rec.closed and rec.upload_id == up.upload_id
        parts.set()
        with trio.fail_after(10):
            await log.drain()
    assert s3.objects["ck/model.pt"] == data
    assert [op for op, _ in s3.requests].count("CreateMultipartUpload") == 1
    assert [op for op, _ in s3.requests].count("UploadPart") == 3
    assert records(tmp_path) == [] and s3.uploads == {}


async def test_a_create_of_the_old_name_returning_after_the_put_never_replaces_its_record(
        tmp_path: Path) -> None:
    """Renamed while written, with the create of the old name in flight at close: when it
    returns, the entry's record stays (naming that upload as an orphan), and it is aborted."""
    s3 = FakeS3()
    created, parts = gate_creates(s3)
    data = os.urandom(11 * MiB)
    async with trio.open_nursery() as nursery:
        log, staged, up = await streaming(tmp_path, s3, nursery, "ck/old.pt", data)
        staged.held = True
        await log.append(Record(os.path.basename(staged.path), "ck/new.pt", True, len(data),
                                part_size=5 * MiB), "ck/new.pt", staged=staged, up=up)
        created.set()
        with trio.fail_after(10):
            while records(tmp_path)[0].orphan_id is None:
                await trio.sleep(0.01)
        [rec] = records(tmp_path)
        assert (rec.seq, rec.closed, rec.key, rec.orphan_key) == (1, True, "ck/new.pt", "ck/old.pt")
        parts.set()
        with trio.fail_after(10):
            await log.drain()
        assert records(tmp_path) == []
    assert s3.objects["ck/new.pt"] == data and "ck/old.pt" not in s3.objects
    assert s3.uploads == {}  # the old name's upload was aborted

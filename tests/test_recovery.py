"""Mount-time recovery (recovery.py) of what an earlier daemon journaled, against the
in-memory S3 of fakes3.py with injected faults: closed uploads finished with the parts S3
already has, records whose bytes changed set aside, uploads never closed aborted, orphans
swept, the ordered log replayed past a record that cannot be delivered. Interrupted
renames are in test_renames.py; the same paths run end to end, with the daemon SIGKILLed,
in test_crash.py against SeaweedFS.
"""

from __future__ import annotations

import os
from pathlib import Path

import trio

from ckptfs.checksum import crc32
from ckptfs.journal import Journal, PartDone, Record
from ckptfs.parts import PartPlan
from ckptfs.recovery import Recovery
from ckptfs.staging import StagingArea
from ckptfs.uploader import Uploader
from fakes3 import MemoryS3

MiB = 1024 * 1024
PART = 5 * MiB


def _parts_sent(s3: MemoryS3) -> int:
    return sum(1 for op, _ in s3.requests if op == "UploadPart")


def _staged(staging: StagingArea, data: bytes) -> str:
    staged = staging.new_file()
    staged.pwrite(data, 0)
    staged.close()
    return os.path.basename(staged.path)


async def _recover(tmp_path: Path, s3: MemoryS3, stale_after: float = 86400,
                   timeout: float = 1.0):
    """What a mount does first: recovery of what the cache dir's journal holds."""
    journal, staging = Journal(str(tmp_path)), StagingArea(str(tmp_path))
    async with trio.open_nursery() as nursery:
        up = Uploader(s3, PartPlan(PART), 4, journal=journal, upload_timeout=timeout,  # type: ignore[arg-type]
                      nursery=nursery)
        return await Recovery(journal, staging.dir, str(tmp_path / "preserved"), s3,  # type: ignore[arg-type]
                              up).run("", stale_after)


async def test_recovery_finishes_an_upload_with_the_parts_s3_already_has(tmp_path: Path) -> None:
    s3, journal, staging = MemoryS3(), Journal(str(tmp_path)), StagingArea(str(tmp_path))
    data = os.urandom(12 * MiB)
    name = _staged(staging, data)
    upload_id = await s3.create_multipart("ck/model.pt", {})
    fd = os.open(os.path.join(staging.dir, name), os.O_RDONLY)
    parts = []
    for n, start in ((1, 0), (2, PART)):
        etag, crc = await s3.upload_part("ck/model.pt", upload_id, n, fd, start, PART)
        parts.append(PartDone(n, start, start + PART, etag, crc))
    os.close(fd)
    journal.write(Record(name, "ck/model.pt", True, len(data), {"mode": "33188"}, upload_id,
                         tuple(parts), part_size=PART))
    sent = _parts_sent(s3)
    report = await _recover(tmp_path, s3)
    assert report.delivered == ["ck/model.pt"] and not report.failed
    assert _parts_sent(s3) - sent == 1  # only the tail: the first two parts were reused
    assert s3.objects["ck/model.pt"] == data and not s3.uploads
    assert journal.scan() == ([], []) and os.listdir(staging.dir) == []


async def test_recovery_sets_aside_bytes_that_changed_after_they_were_journaled(tmp_path: Path) -> None:
    s3, journal, staging = MemoryS3(), Journal(str(tmp_path)), StagingArea(str(tmp_path))
    data = os.urandom(6 * MiB)
    name = _staged(staging, data)
    wrong = PartDone(1, 0, PART, "etag", crc32(data[:PART]) ^ 1)
    journal.write(Record(name, "k", True, len(data), {}, None, (wrong,), part_size=PART))
    report = await _recover(tmp_path, s3)
    assert [n for n, _ in report.set_aside] == [name] and "k" not in s3.objects
    assert os.path.exists(tmp_path / "preserved" / name)  # kept for the operator


async def test_recovery_aborts_the_upload_of_a_file_that_was_never_closed(tmp_path: Path) -> None:
    s3, journal = MemoryS3(), Journal(str(tmp_path))
    upload_id = await s3.create_multipart("k", {})
    journal.write(Record("run-1", "k", False, upload_id=upload_id))
    report = await _recover(tmp_path, s3)
    assert report.aborted == 1 and not s3.uploads and journal.scan() == ([], [])


async def test_recovery_retries_transient_faults_and_reports_a_refusal(tmp_path: Path) -> None:
    s3, journal, staging = MemoryS3(), Journal(str(tmp_path)), StagingArea(str(tmp_path))
    journal.write(Record(_staged(staging, b"a"), "a", True, 1))
    journal.write(Record(_staged(staging, b"b"), "b", True, 1))
    s3.faults.fail("PUT", key="a", times=2, status=503)
    s3.faults.fail("PUT", key="b", times=1, status=403)
    report = await _recover(tmp_path, s3)
    assert report.delivered == ["a"] and s3.objects == {"a": b"a"}
    assert [k for k, _ in report.failed] == ["b"] and "AccessDenied" in report.failed[0][1]
    assert [r.key for r in journal.scan()[0]] == ["b"]  # kept: the next mount tries again


async def test_recovery_aborts_stale_uploads_nobody_owns_and_keeps_the_rest(tmp_path: Path) -> None:
    s3, journal = MemoryS3(), Journal(str(tmp_path))
    stale = await s3.create_multipart("old", {})
    s3.initiated[stale] = 0.0  # 1970: long before any cutoff
    fresh = await s3.create_multipart("new", {})  # another host's upload in progress
    owned = await s3.create_multipart("mine", {})
    s3.initiated[owned] = 0.0
    journal.write(Record("run-1", "mine", False, upload_id=owned))
    report = await _recover(tmp_path, s3, stale_after=3600)
    assert report.orphans_aborted == 1 and set(s3.uploads) == {fresh}


async def test_recovery_goes_on_past_a_set_aside_put_after_another_record_failed(tmp_path: Path) -> None:
    s3 = MemoryS3()
    journal, staging = Journal(str(tmp_path)), StagingArea(str(tmp_path))
    s3.objects["gone"] = b"old"
    # A close-mode record S3 will not take, a log put whose staged file is lost, a log delete.
    staged = staging.new_file()
    staged.pwrite(b"x", 0)
    name = os.path.basename(staged.path)
    s3.faults.fail("PUT", "close-mode", times=10**6)
    journal.write(Record(name, "close-mode", True, 1))
    journal.write(Record("lost-1", "lost", True, 5, seq=1))
    journal.write(Record("op-000000000002", "gone", True, op="delete", seq=2))
    report = await _recover(tmp_path, s3, timeout=0.3)
    assert [k for k, _ in report.failed] == ["close-mode"]
    assert [k for k, _ in report.set_aside] == ["lost-1"]
    assert "gone" not in s3.objects and report.replayed == 1  # the delete was still applied

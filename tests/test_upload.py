"""The uploader (stream, resend, complete, verify), against the in-memory S3 of fakes3.py
with injected faults (mount-time recovery: test_recovery.py). A fake is right here: these
are the retry and fault paths a real server cannot be made to show on cue. The same paths
run end to end against SeaweedFS in test_faults.py, test_streaming.py and test_crash.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs.checksum import crc32
from ckptfs.errors import UploadError
from ckptfs.journal import Journal
from ckptfs.parts import PartPlan
from ckptfs.staging import StagingArea
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload
from fakes3 import MemoryS3

MiB = 1024 * 1024
PART = 5 * MiB


def _uploader(s3: MemoryS3, nursery: trio.Nursery, journal: Journal | None = None,
              stream: bool = True, timeout: float = 5.0) -> Uploader:
    return Uploader(s3, PartPlan(PART), 4, stream_while_writing=stream, journal=journal,  # type: ignore[arg-type]
                    upload_timeout=timeout, nursery=nursery)


def _parts_sent(s3: MemoryS3) -> int:
    return sum(1 for op, _ in s3.requests if op == "UploadPart")


async def _write(up: Uploader, fu: FileUpload, path: str, data: bytes, offset: int = 0,
                 chunk: int = MiB) -> None:
    """What the FUSE write handler does: pwrite, then tell the uploader (with the bytes)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for start in range(0, len(data), chunk):
            piece = data[start:start + chunk]
            os.pwrite(fd, piece, offset + start)
            up.note_write(fu, path, lambda: "ck/model.pt", lambda: {"mode": "33188"},
                          offset + start, offset + start + len(piece), piece)
            await trio.sleep(0)
    finally:
        os.close(fd)


async def _settle(fu: FileUpload) -> None:
    for event in list(fu.sending.values()):
        await event.wait()


# ----- the uploader -------------------------------------------------------------------

async def test_parts_streamed_during_the_write_are_not_sent_again(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(12 * MiB)
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        fu = FileUpload()
        await _write(up, fu, path, data)
        await _settle(fu)
        assert _parts_sent(s3) == 2  # parts 1 and 2 are complete; 3 is the tail
        result = await up.finish(fu, path, "ck/model.pt", len(data), {"mode": "33188"})
    assert _parts_sent(s3) == 3 and result.parts == 3
    assert s3.objects["ck/model.pt"] == data and s3.visible == [("complete", "ck/model.pt")]
    assert not s3.uploads and up.parts_sent == 3


async def test_a_part_rewritten_after_it_was_streamed_is_sent_again(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), bytearray(os.urandom(12 * MiB))
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        fu = FileUpload()
        await _write(up, fu, path, bytes(data))
        await _settle(fu)
        data[100:200] = b"x" * 100  # torch.save seeks back to patch a header
        await _write(up, fu, path, b"x" * 100, offset=100)
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    assert s3.objects["ck/model.pt"] == data
    assert _parts_sent(s3) == 4  # part 1 twice


def _given_crcs(s3: MemoryS3) -> dict[int, int | None]:
    """The CRC32 each part number was last sent with by the caller (None: read from the file)."""
    return dict(s3.part_crcs)


async def test_parts_written_in_order_are_sent_with_the_crc32_of_their_writes(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(12 * MiB)
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        fu = FileUpload()
        await _write(up, fu, path, data, chunk=MiB + 4097)  # writes that straddle parts
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    parts = [data[i:i + PART] for i in range(0, len(data), PART)]
    assert _given_crcs(s3) == {n + 1: crc32(p) for n, p in enumerate(parts)}  # the tail too
    assert s3.objects["ck/model.pt"] == data


async def test_a_file_of_one_part_goes_up_in_one_put_with_the_crc32_of_its_writes(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(3 * MiB + 5)
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        fu = FileUpload()
        await _write(up, fu, path, data)
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    assert _given_crcs(s3) == {0: crc32(data)}  # part 0: the single PUT
    assert s3.objects["ck/model.pt"] == data


async def test_a_part_written_out_of_order_or_cut_and_regrown_is_checksummed_from_the_file(
        tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), bytearray(os.urandom(15 * MiB))
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, stream=False)
        fu = FileUpload()
        await _write(up, fu, path, bytes(data[:PART]))  # part 1 in order...
        await _write(up, fu, path, b"x" * 100, offset=100)  # ...then its header patched
        data[100:200] = b"x" * 100
        await _write(up, fu, path, bytes(data[PART + MiB:2 * PART]), offset=PART + MiB)
        await _write(up, fu, path, bytes(data[PART:PART + MiB]), offset=PART)  # part 2 backwards
        await _write(up, fu, path, bytes(data[2 * PART:]), offset=2 * PART)  # part 3 in order,
        os.truncate(path, 2 * PART + MiB)  # cut and grown back: zeros the writes never saw
        up.note_truncate(fu, 2 * PART + MiB)
        os.truncate(path, len(data))
        up.note_truncate(fu, len(data))
        data[2 * PART + MiB:] = bytes(len(data) - 2 * PART - MiB)
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    assert _given_crcs(s3) == {1: None, 2: None, 3: None}
    assert s3.objects["ck/model.pt"] == data


async def test_a_refused_crc32_from_the_writes_is_read_from_the_file_on_the_retry(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(6 * MiB)
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, stream=False)
        fu = FileUpload()
        await _write(up, fu, path, data)
        length, crc, clock = fu.crcs[1]
        fu.crcs[1] = (length, crc ^ 1, clock)  # as if the writes had computed it wrong
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    # Refused once for the CRC32, then sent with the file's own (None: the client reads it).
    assert [c for n, c in s3.part_crcs if n == 1] == [crc ^ 1, None]
    assert [op for op, _ in s3.requests].count("UploadPart") == 3  # part 1 twice, part 2
    assert s3.objects["ck/model.pt"] == data


async def test_without_streaming_everything_goes_at_finish(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(11 * MiB)
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, stream=False)
        fu = FileUpload()
        await _write(up, fu, path, data)
        await trio.sleep(0.05)
        assert _parts_sent(s3) == 0  # async mode: nothing goes during the write
        await up.finish(fu, path, "ck/model.pt", len(data), {})
    assert s3.objects["ck/model.pt"] == data


@pytest.mark.parametrize("op", ["UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload",
                                "HEAD"])
async def test_transient_faults_of_any_request_are_retried(tmp_path: Path, op: str) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(11 * MiB)
    with open(path, "wb") as f:
        f.write(data)
    s3.faults.fail(op, times=3, status=503)
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        await up.finish(FileUpload(), path, "ck/model.pt", len(data), {})
    assert s3.objects["ck/model.pt"] == data
    assert s3.policy.retries == 3 and up.upload_failures == 0


async def test_a_part_damaged_on_the_way_is_sent_again_never_completed(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(6 * MiB)
    with open(path, "wb") as f:
        f.write(data)
    s3.faults.fail("UploadPart", times=1, status=400, code="BadDigest")  # the server's CRC check
    async with trio.open_nursery() as nursery:
        await _uploader(s3, nursery).finish(FileUpload(), path, "k", len(data), {})
    assert s3.objects["k"] == data and _parts_sent(s3) == 3


async def test_a_lost_answer_to_complete_is_settled_by_verification(tmp_path: Path) -> None:
    """The completion took effect and its answer was lost: the retry gets NoSuchUpload, and
    the object's size and CRC32 show it is the one just written."""
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(11 * MiB)
    with open(path, "wb") as f:
        f.write(data)
    s3.faults.lose_answer("CompleteMultipartUpload")
    async with trio.open_nursery() as nursery:
        await _uploader(s3, nursery).finish(FileUpload(), path, "k", len(data), {})
    assert s3.objects["k"] == data
    assert [op for op, _ in s3.requests].count("CompleteMultipartUpload") == 2


async def test_a_permanent_fault_fails_the_upload_and_leaves_no_open_upload(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), os.urandom(11 * MiB)
    with open(path, "wb") as f:
        f.write(data)
    s3.faults.fail("UploadPart", key="k", times=1, status=403)
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery)
        with pytest.raises(UploadError, match="AccessDenied"):
            await up.finish(FileUpload(), path, "k", len(data), {})
    assert "k" not in s3.objects and not s3.uploads and up.upload_failures == 1


async def test_an_outage_past_the_deadline_gives_up_with_the_reason(tmp_path: Path) -> None:
    s3 = MemoryS3()
    path = str(tmp_path / "staged")
    with open(path, "wb") as f:
        f.write(b"small")
    s3.faults.fail("PUT", times=10**6, status=503)
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, timeout=0.5)
        with pytest.raises(UploadError, match=r"PUT k: gave up after \d+ attempts"):
            await up.finish(FileUpload(), path, "k", 5, {})


async def test_a_closed_record_is_written_before_and_removed_after(tmp_path: Path) -> None:
    s3, journal = MemoryS3(), Journal(str(tmp_path))
    staging = StagingArea(str(tmp_path))
    staged = staging.new_file()
    data = os.urandom(7 * MiB)
    staged.pwrite(data, 0)
    fu = FileUpload(journal_name=os.path.basename(staged.path))
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, journal=journal)
        await up.records.closed(fu, "k", len(data), {"mode": "33188"})
        (rec,), _ = journal.scan()
        assert rec.closed and rec.key == "k" and rec.size == len(data)
        await up.finish(fu, staged.path, "k", len(data), {"mode": "33188"})
        (rec,), _ = journal.scan()
        assert rec.closed and rec.upload_id is not None  # the upload is named while it runs
        await up.records.forget(fu)
    assert journal.scan() == ([], []) and s3.objects["k"] == data


async def test_a_closed_record_lists_the_parts_already_in_s3(tmp_path: Path) -> None:
    """Recovery reuses them after a crash; a part rewritten after it went up is not listed."""
    s3, journal = MemoryS3(), Journal(str(tmp_path))
    staged = StagingArea(str(tmp_path)).new_file()
    fu = FileUpload(journal_name=os.path.basename(staged.path))
    async with trio.open_nursery() as nursery:
        up = _uploader(s3, nursery, journal=journal)
        await _write(up, fu, staged.path, os.urandom(16 * MiB))
        await _settle(fu)
        await _write(up, fu, staged.path, b"x", offset=2 * PART)  # part 3, after it went up
        await up.records.closed(fu, "ck/model.pt", 16 * MiB, {})
    (rec,), _ = journal.scan()
    assert [p.number for p in rec.parts] == [1, 2] and rec.upload_id == fu.upload_id

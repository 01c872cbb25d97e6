"""Journal records and the retry policy, without a mount (a fake S3 call injects the faults)."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.errors import S3Error, UploadError
from ckptfs.journal import BadRecord, Journal, PartDone, Record
from ckptfs.retry import RetryPolicy

MiB = 1024 * 1024


def test_a_record_survives_a_round_trip_and_a_torn_one_is_detected(tmp_path: Path) -> None:
    rec = Record("n-1", "p/step_1/model.pt", True, 12 * MiB, {"mode": "33188"}, "upload-1",
                 (PartDone(1, 0, 5 * MiB, '"e1"', 1234),), True, 5 * MiB)
    assert Record.decode(rec.encode()) == rec
    data = rec.encode()
    with pytest.raises(BadRecord):
        Record.decode(data[:-5])
    flipped = data.replace(b"step_1", b"step_2")
    with pytest.raises(BadRecord, match="checksum"):
        Record.decode(flipped)


def test_inconsistent_records_are_rejected() -> None:
    for bad in (Record("../x", "k", True, 1), Record("n", "", True, 1), Record("n", "k", True, -1),
                Record("n", "k", True, 10, parts=(PartDone(1, 0, 11, "e", 0),)),
                Record("n", "k", True, 10, part_size=1)):
        with pytest.raises(BadRecord):
            Record.decode(bad.encode())


def test_journal_write_replace_scan_and_remove(tmp_path: Path) -> None:
    j = Journal(str(tmp_path))
    j.write(Record("a", "k/a", False, upload_id="u"))
    j.write(Record("a", "k/a", True, 3))  # replaces, atomically
    j.write(Record("b", "k/b", True, 1))
    (tmp_path / "journal" / "c.json.tmp").write_bytes(b"half")  # a write that never renamed
    (tmp_path / "journal" / "d.json").write_bytes(b"{not json")
    records, bad = j.scan()
    assert [(r.name, r.closed) for r in records] == [("a", True), ("b", True)]
    assert bad == [("d", bad[0][1])] and "unreadable" in bad[0][1]
    assert not (tmp_path / "journal" / "c.json.tmp").exists()
    j.remove("a")
    j.remove("a")  # twice is fine
    assert [r.name for r in j.scan()[0]] == ["b"]
    assert oct(os.stat(tmp_path / "journal").st_mode & 0o777) == "0o700"


class FlakyCall:
    def __init__(self, failures: int, error: S3Error) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


class _Policy(RetryPolicy):
    """The retry policy with the deadline of an upload that started now."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    def deadline(self) -> float:
        return trio.current_time() + self.timeout

    async def retrying(self, what: str, deadline: float, call):  # type: ignore[no-untyped-def]
        return await self.call(what, deadline, call)


def test_threads_writing_one_record_at_once_never_fail(tmp_path: Path) -> None:
    # A streamed part's record update and a chmod's amend once raced on one temporary
    # name: the second rename failed with ENOENT, and the chmod with EIO.
    journal = Journal(str(tmp_path))

    def writer(i: int) -> None:
        for n in range(100):
            journal.write(Record("staged-1", "ck.pt", True, 10 * i + n % 10))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))
    (rec,), bad = journal.scan()
    assert bad == [] and rec.name == "staged-1"
    assert os.listdir(tmp_path / "journal") == ["staged-1.json"]


def test_transient_faults_are_retried_and_counted() -> None:
    async def main() -> None:
        up = _Policy(60)
        for error in (S3Error("x", "SlowDown", 503), S3Error("x", "InternalError", 500),
                      S3Error("x", "ConnectionClosedError", None, True), S3Error("x", "BadDigest", 400)):
            call = FlakyCall(3, error)
            assert await up.retrying("op", up.deadline(), call) == "ok"
            assert call.calls == 4
        assert up.retries == 12
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_permanent_faults_fail_at_once() -> None:
    async def main() -> None:
        up = _Policy(60)
        call = FlakyCall(1, S3Error("denied", "AccessDenied", 403))
        with pytest.raises(S3Error, match="denied"):
            await up.retrying("op", up.deadline(), call)
        assert call.calls == 1 and up.retries == 0
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_outage_longer_than_the_upload_timeout_gives_up_with_a_reason() -> None:
    async def main() -> None:
        up = _Policy(30)
        start = trio.current_time()
        call = FlakyCall(10**6, S3Error("down", "ServiceUnavailable", 503))
        with pytest.raises(UploadError, match=r"gave up after \d+ attempts in \d+s: down"):
            await up.retrying("PUT k", up.deadline(), call)
        elapsed = trio.current_time() - start
        assert 25 <= elapsed <= 30  # bounded by the timeout, backoff capped well below it
        assert call.calls > 6
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

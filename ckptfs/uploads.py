"""Upload state: what one staged file has in S3 so far, and its record in the journal.

`FileUpload` belongs to the file's inode (inodes.py) or to a log entry (oplog.py), and
only the uploader changes its parts; `UploadRecords` is the only writer of journal records
(journal.py) while the mount runs: an upload's, written when the file is closed, updated
when its multipart upload is created, removed once the object is verified; and the ordered
log's entries (`write_entry`, `remove_entry`). Recovery, which runs before the mount goes
live, reads the journal and removes or rewrites what it delivered.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ckptfs.journal import Journal, PartDone, Record
from ckptfs.parts import PartPlan, PartRange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadResult:
    etag: str
    parts: int


@dataclass(frozen=True)
class PartRecord:
    """A part that is in S3 under the open multipart upload, ready for CompleteMultipartUpload."""
    start: int
    end: int
    etag: str
    crc: int  # CRC32 of the part's bytes
    clock: int  # the file's write clock when the bytes were read


@dataclass(eq=False)
class FileUpload:
    """The upload state of one staged file: its open multipart upload and which parts are current."""
    key: str | None = None
    upload_id: str | None = None
    metadata: dict[str, str] | None = None
    parts: dict[int, PartRecord] = field(default_factory=dict)
    touched: dict[int, int] = field(default_factory=dict)  # part number -> write clock of last change
    # part number -> (bytes from the part's start, their CRC32) that sequential writes have
    # checksummed as they arrived, valid while touched[n] is the clock of the last of them
    crcs: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # n -> (length, crc, clock)
    clock: int = 0
    sending: dict[int, trio.Event] = field(default_factory=dict)
    create_lock: trio.Lock = field(default_factory=trio.Lock)
    journal_name: str | None = None  # the staged file's name: the journal record's name
    record: Record | None = None  # what the journal holds for this file now
    record_clock: int = -1  # `clock` when a closed record was written
    record_lock: trio.Lock = field(default_factory=trio.Lock)
    plan: PartPlan | None = None  # the part sizes of these bytes, if not the uploader's own
    # The file was written where the daemon could not see (FUSE passthrough): `touched`
    # misses those writes, so sent parts are checked against the file before completion.
    unseen_writes: bool = False

    def current(self, r: PartRange) -> bool:
        rec = self.parts.get(r.number)
        return (rec is not None and rec.start == r.start and rec.end == r.end
                and rec.clock >= self.touched.get(r.number, 0))


def without_times(metadata: dict[str, str]) -> dict[str, str]:
    """Metadata known when a multipart upload is created: mtime and ctime change with every
    write, and an object without them shows its LastModified (the completion time)."""
    return {k: v for k, v in metadata.items() if k not in ("mtime", "ctime")}


class UploadRecords:
    """Journal records of uploads: the one place that writes them."""

    def __init__(self, journal: Journal | None, plan: PartPlan) -> None:
        self.journal = journal
        self.plan = plan

    async def save(self, up: FileUpload, rec: Record | None) -> None:
        await self.update(up, lambda _: rec)

    async def update(self, up: FileUpload, make: Callable[[Record | None], Record | None]) -> None:
        """Replace the record with `make(the record now)`, computed under the record's lock:
        the ordered log may turn it into an entry's record (a put adopting this upload, or a
        retarget) while a write of it waits, and must never be overwritten by a stale one."""
        if self.journal is None or up.journal_name is None:
            return
        async with up.record_lock:
            if up.journal_name is None:
                return
            rec = make(up.record)
            if rec is None:
                if up.record is not None:
                    await trio.to_thread.run_sync(self.journal.remove, up.journal_name)
            else:
                await trio.to_thread.run_sync(self.journal.write, rec)
            up.record = rec

    async def closed(self, up: FileUpload, key: str, size: int, metadata: dict[str, str],
                             fsynced: bool = False) -> None:
        """Record that these bytes were closed and belong under `key`, before close() returns."""
        if up.journal_name is None:
            return
        rec = up.record
        if (rec is not None and rec.closed and up.record_clock == up.clock and rec.key == key
                and rec.size == size and (rec.fsynced or not fsynced)):
            return  # already journaled as they are
        clock = up.clock
        parts = tuple(PartDone(n, p.start, p.end, p.etag, p.crc) for n, p in sorted(up.parts.items())
                      if p.clock >= up.touched.get(n, 0) and p.end <= size)
        intent = up.record.intent if up.record is not None and up.record.key == key else 0.0
        await self.save(up, Record(up.journal_name, key, True, size, dict(metadata),
                                    up.upload_id if up.key == key else None, parts, fsynced,
                                    (up.plan or self.plan).base_size, intent=intent))
        up.record_clock = clock

    async def intent(self, up: FileUpload, key: str) -> None:
        """Before CreateMultipartUpload: a crash before its id is journaled must not leave an
        upload nobody owns. Recovery aborts uploads of `key` started since `intent` that no
        record names (and only those: never another key's, nor an older one)."""
        now = time.time()

        def make(rec: Record | None) -> Record:
            # The earliest intent covers every attempt (a retry creates another upload).
            since = rec.intent if rec is not None and rec.intent and rec.key == key else now
            if rec is not None and rec.closed and rec.key == key:
                return dataclasses.replace(rec, intent=since)
            if rec is not None and rec.seq:
                # A log entry's put of another key (renamed while written): it stays, and
                # names this key for recovery to abort what the create may make.
                return dataclasses.replace(rec, intent=rec.intent or now, orphan_key=key)
            return Record(up.journal_name or "", key, False, intent=since)
        try:
            await self.update(up, make)
        except OSError as exc:
            log.warning("could not journal the intent to upload %s (%s); going on", key, exc)

    async def created(self, up: FileUpload, key: str, upload_id: str) -> None:
        """The multipart upload exists: journal its id at once, so a crash leaves nothing
        unowned in S3."""
        def make(rec: Record | None) -> Record:
            if rec is not None and rec.closed and rec.key == key:
                return dataclasses.replace(rec, upload_id=upload_id, parts=())
            if rec is not None and rec.seq:
                # A log entry's put of another key: the upload is an orphan it names.
                return dataclasses.replace(rec, orphan_key=key, orphan_id=upload_id)
            return Record(up.journal_name or "", key, False, upload_id=upload_id)
        await self.update(up, make)

    async def changing(self, up: FileUpload) -> None:
        """The staged bytes are about to change: a closed record no longer describes them."""
        if up.record is None or not up.record.closed:
            return

        def make(rec: Record | None) -> Record | None:
            if rec is None or not rec.closed or rec.seq:
                return rec  # an entry of the ordered log describes bytes that never change
            if up.upload_id is not None and up.key is not None:
                return Record(rec.name, up.key, False, upload_id=up.upload_id)
            return None
        await self.update(up, make)

    async def forget(self, up: FileUpload) -> None:
        """The bytes are in S3 (or were unlinked): nothing is left to recover."""
        await self.save(up, None)

    async def write_entry(self, rec: Record) -> None:
        """An entry of the ordered log (oplog.py), with its place in the sequence; the caller
        holds the upload's record lock if the entry adopts an upload."""
        if self.journal is not None:
            await trio.to_thread.run_sync(self.journal.write, rec)

    async def remove_entry(self, name: str) -> None:
        """An entry the ordered log applied: its record goes (OSError if the disk refuses)."""
        if self.journal is not None:
            await trio.to_thread.run_sync(self.journal.remove, name)

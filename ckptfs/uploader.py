"""Make staged files durable in S3, streaming parts while the writer is still writing.

Once a write completes a part-sized range of a file larger than one part, that
part is uploaded in the background; `finish()` (close/fsync) then sends only
what is missing or was rewritten after it went up, and completes the upload.
Part bytes are streamed from the staging file in the worker thread that sends
them, so memory does not grow with the part size or the file size. One
CapacityLimiter bounds parts in flight across all files of the mount, FIFO, so
concurrent writers share it fairly. A failed upload aborts its multipart
upload; the staged file is never touched.

Every S3 request of an upload is retried with exponential backoff and full
jitter while the fault is transient (5xx, throttling, timeouts, resets,
checksum mismatches), until the upload's deadline (`--upload-timeout`) passes.

With a journal, every file whose bytes S3 does not hold yet has a record
(journal.py): written when the file is closed, updated when its multipart
upload is created, removed once the object is verified.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from ckptfs.checksum import b64_crc32, crc32, crc32_of_parts
from ckptfs.errors import NoSuchKey, S3Error, UploadError, raise_first_error
from ckptfs.journal import Journal, PartDone, Record
from ckptfs.parts import PartPlan, PartRange
from ckptfs.retry import RetryPolicy
from ckptfs.s3 import S3Client

log = logging.getLogger(__name__)

T = TypeVar("T")
_READ_CHUNK = 1 << 20
# Parts up to this size are sent from memory; larger ones stream from the staging file.
_IN_MEMORY_PART = 32 << 20
# Upper bounds (seconds) of the upload latency histogram's buckets.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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
    generation: int  # the file's write clock when the bytes were read


@dataclass(eq=False)
class FileUpload:
    """The upload state of one staged file: its open multipart upload and which parts are current."""
    key: str | None = None
    upload_id: str | None = None
    metadata: dict[str, str] | None = None
    parts: dict[int, PartRecord] = field(default_factory=dict)
    touched: dict[int, int] = field(default_factory=dict)  # part number -> write clock of last change
    clock: int = 0
    sending: dict[int, trio.Event] = field(default_factory=dict)
    create_lock: trio.Lock = field(default_factory=trio.Lock)
    journal_name: str | None = None  # the staged file's name: the journal record's name
    record: Record | None = None  # what the journal holds for this file now
    record_clock: int = -1  # `clock` when a closed record was written
    record_lock: trio.Lock = field(default_factory=trio.Lock)
    plan: PartPlan | None = None  # the part sizes of these bytes, if not the uploader's own

    def current(self, r: PartRange) -> bool:
        rec = self.parts.get(r.number)
        return (rec is not None and rec.start == r.start and rec.end == r.end
                and rec.generation >= self.touched.get(r.number, 0))


def without_mtime(metadata: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k != "mtime"}


class FileRange(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of a file, for a request body."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._length

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def read(self, size: int = -1) -> bytes:
        remaining = self._length - self._pos
        if size is None or size < 0 or size > remaining:
            size = remaining
        if size == 0:
            return b""
        data = os.pread(self._fd, size, self._start + self._pos)
        if len(data) != size:
            raise UploadError("the staged file is shorter than its recorded size")
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _crc_of_range(fd: int, start: int, length: int) -> int:
    crc = 0
    done = 0
    while done < length:
        chunk = os.pread(fd, min(_READ_CHUNK, length - done), start + done)
        if not chunk:
            raise UploadError("the staged file is shorter than its recorded size")
        crc = crc32(chunk, crc)
        done += len(chunk)
    return crc


class Uploader:
    def __init__(self, s3: S3Client, plan: PartPlan, concurrency: int,
                 stream_while_writing: bool = True, journal: Journal | None = None,
                 upload_timeout: float = 120.0, policy: RetryPolicy | None = None) -> None:
        self.s3 = s3
        self.plan = plan
        # Off in async mode: there close() waits for nothing in S3, and on a small host the
        # parts sent during the write slow the writer down (measured: bench/write_bench.py).
        self.stream_while_writing = stream_while_writing
        self.parts_limiter = trio.CapacityLimiter(concurrency)
        self.nursery: trio.Nursery | None = None  # set by the daemon; holds streamed part uploads
        self._active = 0
        self.idle = trio.Event()
        self.idle.set()
        self.parts_sent = 0
        self.bytes_uploaded = 0  # part and PUT bodies S3 accepted
        self.uploads_done = 0
        self.upload_failures = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last is +Inf
        self.latency_sum = 0.0
        self.journal = journal
        self.upload_timeout = upload_timeout
        self.policy = policy or RetryPolicy()

    # ----- the journal ---------------------------------------------------

    async def _save(self, up: FileUpload, rec: Record | None) -> None:
        if self.journal is None or up.journal_name is None:
            return
        async with up.record_lock:
            # Checked again under the lock: the ordered log may have taken the record over
            # (a retarget) while this write waited, and must not be overwritten by it.
            if up.journal_name is None:
                return
            if rec is None:
                if up.record is not None:
                    await trio.to_thread.run_sync(self.journal.remove, up.journal_name)
            else:
                await trio.to_thread.run_sync(self.journal.write, rec)
            up.record = rec

    async def journal_closed(self, up: FileUpload, key: str, size: int, metadata: dict[str, str],
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
                      if p.generation >= up.touched.get(n, 0) and p.end <= size)
        intent = up.record.intent if up.record is not None and up.record.key == key else 0.0
        await self._save(up, Record(up.journal_name, key, True, size, dict(metadata),
                                    up.upload_id if up.key == key else None, parts, fsynced,
                                    (up.plan or self.plan).base_size, intent=intent))
        up.record_clock = clock

    async def _journal_intent(self, up: FileUpload, key: str) -> None:
        """Before CreateMultipartUpload: a crash before its id is journaled must not leave an
        upload nobody owns. Recovery aborts uploads of `key` started since `intent` that no
        record names (and only those: never another key's, nor an older one)."""
        rec = up.record
        # The earliest intent covers every attempt (a retry creates another upload).
        since = rec.intent if rec is not None and rec.intent and rec.key == key else time.time()
        try:
            if rec is not None and rec.closed and rec.key == key:
                await self._save(up, dataclasses.replace(rec, intent=since))
            else:
                await self._save(up, Record(up.journal_name or "", key, False, intent=since))
        except OSError as exc:
            log.warning("could not journal the intent to upload %s (%s); going on", key, exc)

    async def journal_changing(self, up: FileUpload) -> None:
        """The staged bytes are about to change: a closed record no longer describes them."""
        rec = up.record
        if rec is None or not rec.closed:
            return
        if up.upload_id is not None and up.key is not None:
            await self._save(up, Record(rec.name, up.key, False, upload_id=up.upload_id))
        else:
            await self._save(up, None)

    async def forget_record(self, up: FileUpload) -> None:
        """The bytes are in S3 (or were unlinked): nothing is left to recover."""
        await self._save(up, None)

    # ----- retries ---------------------------------------------------------

    async def retrying(self, what: str, deadline: float, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, again after transient faults (the one policy of retry.py), until `deadline`."""
        return await self.policy.call(what, deadline, call)

    @property
    def retries(self) -> int:
        return self.policy.retries

    def deadline(self) -> float:
        return trio.current_time() + self.upload_timeout

    # ----- bookkeeping of work in flight, for drain ----------------------

    @property
    def active(self) -> int:
        """Uploads and streamed parts in flight."""
        return self._active

    def _begin(self) -> None:
        if self._active == 0:
            self.idle = trio.Event()
        self._active += 1

    def _end(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.idle.set()

    # ----- called by the filesystem --------------------------------------

    def note_write(self, up: FileUpload, path: str, key: Callable[[], str],
                   metadata: Callable[[], dict[str, str]], offset: int, end: int) -> None:
        """Record a write of [offset, end); start uploading every part this write completed."""
        if end <= offset:
            return
        up.clock += 1
        first, last = self.plan.part_at(offset), self.plan.part_at(end - 1)
        for n in range(first, last + 1):
            up.touched[n] = up.clock
        if end <= self.plan.base_size or self.nursery is None or not self.stream_while_writing:
            return  # a file of one part goes up with a single PUT at close
        if up.touched.get(1) is not None and 1 not in up.parts and 1 not in up.sending:
            first = 1  # the file just outgrew one part: part 1 may have been completed earlier
        for n in range(first, last + 1):
            r = self.plan.part(n)
            if r.end <= end and n not in up.sending:
                up.sending[n] = trio.Event()
                self._begin()
                self.nursery.start_soon(self._stream_part, up, path, key(), metadata(), r)

    def note_truncate(self, up: FileUpload, size: int) -> None:
        """Parts reaching past `size` changed (cut, or zero-filled when the file grows back)."""
        up.clock += 1
        for n, rec in up.parts.items():
            if rec.end > size:
                up.touched[n] = up.clock

    async def finish(self, up: FileUpload, path: str, key: str, size: int,
                     metadata: dict[str, str],
                     before_visible: Callable[[], Awaitable[None]] | None = None) -> UploadResult:
        """Upload what is missing and complete; returns once the object is complete and verified.

        `before_visible` is awaited right before the request that makes the object appear
        (the PUT, or CompleteMultipartUpload once every part is in): the ordered log holds
        it there until the object's turn. Parts go up before that, in parallel.
        """
        self._begin()
        deadline = self.deadline()
        started = trio.current_time()
        try:
            await self._wait_sending(up)
            if up.upload_id is not None and up.key != key:
                await self.abort(up)  # renamed while open: start over under the new name
            fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if size <= (up.plan or self.plan).base_size and up.upload_id is None:
                    if before_visible is not None:
                        await before_visible()
                        deadline = max(deadline, self.deadline())  # the wait is not the PUT's
                    result = await self._put(fd, key, size, metadata, deadline)
                else:
                    result = await self._complete(up, fd, key, size, metadata, deadline,
                                                  before_visible)
            finally:
                os.close(fd)
            self._observe(trio.current_time() - started)
            return result
        except S3Error as exc:
            self.upload_failures += 1
            await self.abort(up)
            if isinstance(exc, UploadError):
                raise
            raise UploadError(str(exc), exc.code) from None
        except BaseException:
            await self.abort(up)
            raise
        finally:
            self._end()

    def _observe(self, seconds: float) -> None:
        self.uploads_done += 1
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_counts[i] += 1
                return
        self.latency_counts[-1] += 1

    async def abort(self, up: FileUpload) -> None:
        """Forget the file's multipart upload and abort it in S3 (so it costs nothing)."""
        await self._wait_sending(up)
        upload_id, key = up.upload_id, up.key
        up.upload_id = up.key = up.metadata = None
        up.parts.clear()
        if upload_id is not None and key is not None:
            with trio.CancelScope(shield=True):
                try:
                    await self.s3.abort_multipart(key, upload_id)
                except NoSuchKey:
                    pass
                except S3Error as exc:
                    # A closed record keeps naming it; the next mount's orphan sweep finds the rest.
                    log.warning("could not abort the multipart upload of %s: %s", key, exc)
                    return
                rec = up.record
                if rec is not None and not rec.closed and rec.upload_id == upload_id:
                    await self._save(up, None)

    # ----- internals -----------------------------------------------------

    async def _wait_sending(self, up: FileUpload) -> None:
        for event in list(up.sending.values()):
            await event.wait()

    async def _put(self, fd: int, key: str, size: int, metadata: dict[str, str],
                   deadline: float) -> UploadResult:
        body = await trio.to_thread.run_sync(os.pread, fd, size, 0)
        if len(body) != size:
            raise UploadError(f"staged file for {key} is shorter than {size} bytes")
        crc = crc32(body)
        etag = await self.retrying(f"PUT {key}", deadline, lambda: self.s3.put(key, body, metadata))
        self.bytes_uploaded += size
        await self.retrying(f"verify {key}", deadline, lambda: self._verify(key, size, etag, crc))
        return UploadResult(etag, 1)

    async def _ensure_created(self, up: FileUpload, key: str, metadata: dict[str, str],
                              deadline: float) -> str:
        async with up.create_lock:
            if up.upload_id is None:
                # No mtime: it is not known while the file is still written, and an object
                # without one shows its LastModified (the completion time) instead.
                meta = without_mtime(metadata)
                await self._journal_intent(up, key)
                upload_id = await self.retrying(f"CreateMultipartUpload {key}", deadline,
                                                lambda: self.s3.create_multipart(key, meta))
                up.metadata, up.upload_id, up.key = meta, upload_id, key
                # Journal the upload at once, so a crash leaves nothing unowned in S3.
                rec = up.record
                try:
                    if rec is not None and rec.closed and rec.key == key:
                        await self._save(up, dataclasses.replace(rec, upload_id=upload_id, parts=()))
                    else:
                        await self._save(up, Record(up.journal_name or "", key, False,
                                                    upload_id=upload_id))
                except OSError as exc:
                    # Only a convenience: after a crash an upload nobody recorded is aborted
                    # as an orphan. A full cache disk must not stop the upload that frees it.
                    log.warning("could not journal the multipart upload of %s (%s); going on",
                                key, exc)
            return up.upload_id

    async def _send_part(self, up: FileUpload, fd: int, key: str, upload_id: str, r: PartRange,
                         deadline: float) -> None:
        generation = up.clock  # taken before the bytes are read: a later write makes it stale

        def send() -> tuple[str, int]:
            if r.size <= _IN_MEMORY_PART:
                # One read into memory, then checksum, signing and send all work on it: on
                # small machines the extra passes over the staging file cost more than the RAM.
                body = os.pread(fd, r.size, r.start)
                if len(body) != r.size:
                    raise UploadError("the staged file is shorter than its recorded size")
                crc = crc32(body)
                return self.s3.upload_part_sync(key, upload_id, r.number, body, crc), crc
            crc = _crc_of_range(fd, r.start, r.size)
            return self.s3.upload_part_sync(key, upload_id, r.number, FileRange(fd, r.start, r.size),
                                            crc), crc

        async with self.parts_limiter:
            # Retried like every request; this also covers a part the server rejected for a
            # checksum mismatch (corrupted on the way): it is sent again, never completed.
            etag, crc = await self.retrying(
                f"UploadPart {r.number} of {key}", deadline,
                lambda: trio.to_thread.run_sync(send, limiter=self.s3.limiter))
        self.bytes_uploaded += r.size
        if up.upload_id == upload_id:
            up.parts[r.number] = PartRecord(r.start, r.end, etag, crc, generation)
            self.parts_sent += 1

    async def _stream_part(self, up: FileUpload, path: str, key: str, metadata: dict[str, str],
                           r: PartRange) -> None:
        """Background upload of one completed part; failures are left for finish() to retry."""
        try:
            deadline = self.deadline()
            upload_id = await self._ensure_created(up, key, metadata, deadline)
            if up.key != key:
                return
            fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await self._send_part(up, fd, key, upload_id, r, deadline)
            finally:
                os.close(fd)
        except (S3Error, OSError) as exc:
            log.debug("streamed part %d of %s failed, finish() will resend it: %s", r.number, key, exc)
        finally:
            up.sending.pop(r.number).set()
            self._end()

    async def _complete(self, up: FileUpload, fd: int, key: str, size: int,
                        metadata: dict[str, str], deadline: float,
                        before_visible: Callable[[], Awaitable[None]] | None = None) -> UploadResult:
        upload_id = await self._ensure_created(up, key, metadata, deadline)
        ranges = (up.plan or self.plan).ranges(size)
        for _ in range(3):  # a part rewritten while it was sent is sent again
            missing = [r for r in ranges if not up.current(r)]
            if not missing:
                break
            with raise_first_error():
                async with trio.open_nursery() as nursery:
                    for r in missing:
                        nursery.start_soon(self._send_part, up, fd, key, upload_id, r, deadline)
        else:
            raise UploadError(f"parts of {key} kept changing while they were uploaded")
        records = [up.parts[r.number] for r in ranges]
        parts: list[dict[str, Any]] = [
            {"ETag": rec.etag, "PartNumber": r.number, "ChecksumCRC32": b64_crc32(rec.crc)}
            for rec, r in zip(records, ranges)]
        crc = crc32_of_parts([(rec.crc, r.size) for rec, r in zip(records, ranges)])
        if before_visible is not None:
            await before_visible()
            # The wait may be long (earlier entries of the log): a deadline that passed
            # meanwhile must not fail a completion that has not even been tried.
            deadline = max(deadline, self.deadline())

        async def complete() -> str:
            try:
                return await self.s3.complete_multipart(key, upload_id, parts, crc)
            except NoSuchKey:
                # NoSuchUpload: an earlier attempt completed it and its answer was lost (or
                # the upload is gone). Verification below tells the two apart.
                return ""
        etag = await self.retrying(f"CompleteMultipartUpload {key}", deadline, complete)
        up.upload_id = up.key = None
        up.parts.clear()
        if up.metadata != without_mtime(metadata):  # mode or owner changed while it was written
            etag = await self.retrying(f"COPY {key}", deadline,
                                       lambda: self.s3.copy(key, key, size, metadata))
        up.metadata = None
        await self.retrying(f"verify {key}", deadline, lambda: self._verify(key, size, etag, crc))
        return UploadResult(etag, len(parts))

    async def _verify(self, key: str, size: int, etag: str, crc: int) -> None:
        """Confirm the object under `key` is the one just written, whole, by size and CRC32."""
        try:
            info = await self.s3.head(key, checksum=True)
        except NoSuchKey:
            raise UploadError(f"{key} is missing right after its upload") from None
        if info.size != size:
            raise UploadError(f"{key} has {info.size} bytes in S3, expected {size}")
        if etag and info.etag != etag:
            raise UploadError(f"{key} changed during its upload (ETag {info.etag}, expected {etag})")
        if info.checksum_crc32 is None:
            log.debug("%s has no stored CRC32 to check; size checked only", key)
        elif info.checksum_crc32 != b64_crc32(crc):
            raise UploadError(f"{key} has CRC32 {info.checksum_crc32} in S3, expected {b64_crc32(crc)}")

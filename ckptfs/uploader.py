"""Make staged files durable in S3, streaming parts while the writer is still writing.

Once a write completes a part-sized range of a file larger than one part, that
part is uploaded in the background; `finish()` (close/fsync) then sends only
what is missing or was rewritten after it went up, and completes the upload.
Part bytes are streamed from the staging file in the worker thread that sends
them, so memory does not grow with the part size or the file size. One
CapacityLimiter bounds parts in flight across all files of the mount, FIFO, so
concurrent writers share it fairly. A failed upload aborts its multipart
upload; the staged file is never touched.

Every S3 request of an upload is retried (by bucket.Bucket, with the one policy
of retry.py) while the fault is transient, until the upload's deadline
(`--upload-timeout`) passes. Upload state and its journal records are in uploads.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ckptfs.bodies import crcs_of_ranges
from ckptfs.broadcast import Broadcast
from ckptfs.bucket import Bucket
from ckptfs.checksum import b64_crc32, crc32, crc32_of_parts
from ckptfs.errors import NoSuchKey, S3Error, UploadError, raise_first_error
from ckptfs.journal import Journal
from ckptfs.parts import PartPlan, PartRange
from ckptfs.retry import RetryPolicy
from ckptfs.uploads import FileUpload, PartRecord, UploadRecords, UploadResult, without_times

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the upload latency histogram's buckets.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Uploader:
    def __init__(self, s3: Bucket, plan: PartPlan, concurrency: int,
                 stream_while_writing: bool = True, journal: Journal | None = None,
                 upload_timeout: float = 120.0, policy: RetryPolicy | None = None, *,
                 nursery: trio.Nursery) -> None:
        self.s3 = s3
        self.plan = plan
        # In both modes: in async mode the ordered log's put takes the parts streamed so far
        # over at close (oplog.py), so S3 has the file as soon as in close mode.
        self.stream_while_writing = stream_while_writing
        self.parts_limiter = trio.CapacityLimiter(concurrency)
        self._nursery = nursery  # holds the parts streamed while files are written
        self._active = 0
        self._went_idle = Broadcast()  # fired when the last upload or part in flight ends
        self.parts_sent = 0
        self.bytes_uploaded = 0  # part and PUT bodies S3 accepted
        self.uploads_done = 0
        self.upload_failures = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last is +Inf
        self.latency_sum = 0.0
        self.parts_rechecked = 0  # sent parts checked against the file at completion
        self.parts_rechecked_changed = 0  # ... and sent again because their bytes changed
        self.records = UploadRecords(journal, plan)  # the journal records of uploads
        self.upload_timeout = upload_timeout
        self.policy = policy or s3.policy

    def stats(self) -> dict[str, Any]:
        return {"uploads_in_flight": self._active, "uploads_done": self.uploads_done,
                "upload_failures": self.upload_failures, "parts_sent": self.parts_sent,
                "retries": self.policy.retries, "bytes_uploaded": self.bytes_uploaded,
                "parts_rechecked": self.parts_rechecked,
                "parts_rechecked_changed": self.parts_rechecked_changed,
                "latency_counts": list(self.latency_counts), "latency_sum": self.latency_sum}

    # ----- deadlines and bookkeeping of work in flight, for drain ----------

    def deadline(self) -> float:
        return trio.current_time() + self.upload_timeout

    @property
    def active(self) -> int:
        """Uploads and streamed parts in flight."""
        return self._active

    def _begin(self) -> None:
        self._active += 1

    def _end(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._went_idle.fire()

    async def wait_idle(self) -> None:
        """Until no upload or streamed part is in flight."""
        while self._active:
            await self._went_idle.wait()

    # ----- called by the filesystem --------------------------------------

    def note_write(self, up: FileUpload, path: str, key: Callable[[], str],
                   metadata: Callable[[], dict[str, str]], offset: int, end: int,
                   data: bytes | None = None) -> None:
        """Record a write of [offset, end); start uploading every part this write completed.

        With the written `data`, a part written from its start in order gets its CRC32 here,
        from bytes still in the CPU's cache, and is sent without reading it back first."""
        if end <= offset:
            return
        up.clock += 1
        first, last = self.plan.part_at(offset), self.plan.part_at(end - 1)
        for n in range(first, last + 1):
            before = up.touched.get(n)
            up.touched[n] = up.clock
            if data is not None:
                self._checksum(up, n, before, offset, data)
            else:
                up.crcs.pop(n, None)
        if end <= self.plan.base_size or not self.stream_while_writing:
            return  # a file of one part goes up with a single PUT at close
        if up.touched.get(1) is not None and 1 not in up.parts and 1 not in up.sending:
            first = 1  # the file just outgrew one part: part 1 may have been completed earlier
        for n in range(first, last + 1):
            r = self.plan.part(n)
            if r.end <= end and n not in up.sending:
                up.sending[n] = trio.Event()
                self._begin()
                self._nursery.start_soon(self._stream_part, up, path, key(), metadata(), r)

    def _checksum(self, up: FileUpload, n: int, before: int | None, offset: int, data: bytes) -> None:
        """Carry part n's running CRC32 over the piece of `data` (written at `offset`) in it."""
        r = self.plan.part(n)
        lo, hi = max(offset, r.start), min(offset + len(data), r.end)
        piece = memoryview(data)[lo - offset:hi - offset]
        known = up.crcs.get(n)
        if lo == r.start:  # the part begins again
            up.crcs[n] = (hi - lo, crc32(piece), up.clock)
        elif known is not None and known[2] == before and r.start + known[0] == lo:
            up.crcs[n] = (hi - r.start, crc32(piece, known[1]), up.clock)
        else:  # a gap, or bytes written over: the part's CRC32 is read from the file
            up.crcs.pop(n, None)

    def known_crc(self, up: FileUpload, r: PartRange) -> int | None:
        """Part r's CRC32 if its writes computed it for exactly its current bytes."""
        known = up.crcs.get(r.number)
        if (known is None or known[0] != r.size or known[2] != up.touched.get(r.number)
                or self.plan.part(r.number).start != r.start):
            return None
        return known[1]

    def note_truncate(self, up: FileUpload, size: int) -> None:
        """Parts reaching past `size` changed (cut, or zero-filled when the file grows back)."""
        up.clock += 1
        for n, rec in up.parts.items():
            if rec.end > size:
                up.touched[n] = up.clock
        for n, (length, _, _) in list(up.crcs.items()):
            if self.plan.part(n).start + length > size:
                del up.crcs[n]

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
                    result = await self._put(fd, key, size, metadata, deadline,
                                             self.known_crc(up, PartRange(1, 0, size)),
                                             up.unseen_writes)
                else:
                    if up.unseen_writes and up.parts:
                        await self._recheck_sent(up, fd, size)
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
                if not await self.s3.abort_quietly(key, upload_id):
                    return  # a closed record keeps naming it; else the next mount's sweep
                rec = up.record
                if rec is not None and not rec.closed and rec.upload_id == upload_id:
                    await self.records.save(up, None)

    # ----- internals -----------------------------------------------------

    async def _wait_sending(self, up: FileUpload) -> None:
        for event in list(up.sending.values()):
            await event.wait()

    async def _put(self, fd: int, key: str, size: int, metadata: dict[str, str],
                   deadline: float, known_crc: int | None, reread: bool) -> UploadResult:
        etag, crc = await self.s3.put_file(key, fd, size, metadata, deadline, known_crc, reread)
        self.bytes_uploaded += size
        await self._verify(key, size, etag, crc, deadline)
        return UploadResult(etag, 1)

    async def _ensure_created(self, up: FileUpload, key: str, metadata: dict[str, str],
                              deadline: float) -> str:
        async with up.create_lock:
            if up.upload_id is None:
                # No mtime or ctime: not known while the file is still written.
                meta = without_times(metadata)
                await self.records.intent(up, key)
                upload_id = await self.s3.create_multipart(key, meta, deadline=deadline)
                up.metadata, up.upload_id, up.key = meta, upload_id, key
                try:
                    await self.records.created(up, key, upload_id)
                except OSError as exc:
                    # Only a convenience: after a crash an upload nobody recorded is aborted
                    # as an orphan. A full cache disk must not stop the upload that frees it.
                    log.warning("could not journal the multipart upload of %s (%s); going on",
                                key, exc)
            return up.upload_id

    async def _send_part(self, up: FileUpload, fd: int, key: str, upload_id: str, r: PartRange,
                         deadline: float) -> None:
        clock = up.clock  # taken before the bytes are read: a later write makes them stale
        async with self.parts_limiter:
            known = self.known_crc(up, r)  # once its turn comes: as close to the send as can be
            # A part the server rejected for a checksum mismatch (damaged on the way) is sent
            # again by bucket.Bucket, like every transient fault; it is never completed.
            try:
                etag, crc = await self.s3.upload_part(key, upload_id, r.number, fd, r.start,
                                                      r.size, deadline, crc=known,
                                                      reread=up.unseen_writes)
            except BaseException:
                if known is not None:  # whatever failed, the next attempt reads the file
                    up.crcs.pop(r.number, None)
                raise
        self.bytes_uploaded += r.size
        if up.upload_id == upload_id:
            up.parts[r.number] = PartRecord(r.start, r.end, etag, crc, clock)
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

    async def _recheck_sent(self, up: FileUpload, fd: int, size: int) -> None:
        """Writes the daemon did not see (passthrough): a part sent while the file was
        written is sent again if its bytes in the file no longer have the CRC32 it was sent
        with (a rewrite, a seek back, an mmap write, a truncate)."""
        await self._wait_sending(up)
        ranges = {r.number: r for r in (up.plan or self.plan).ranges(size)}
        sent = [(n, rec) for n, rec in up.parts.items()
                if (r := ranges.get(n)) is not None and (rec.start, rec.end) == (r.start, r.end)]
        crcs = await trio.to_thread.run_sync(
            crcs_of_ranges, fd, [(rec.start, rec.end - rec.start) for _, rec in sent])
        for (n, rec), crc in zip(sent, crcs):
            if crc != rec.crc:  # (not a tick of the write clock: that is the file's own)
                del up.parts[n]
                self.parts_rechecked_changed += 1
        self.parts_rechecked += len(sent)

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

        try:
            etag = await self.s3.complete_multipart(key, upload_id, parts, crc, deadline)
        except NoSuchKey:
            # NoSuchUpload: an earlier attempt completed it and its answer was lost (or the
            # upload is gone). Verification below tells the two apart.
            etag = ""
        up.upload_id = up.key = None
        up.parts.clear()
        if up.metadata != without_times(metadata):  # mode or owner changed while it was written
            etag = await self.s3.copy(key, key, size, metadata, deadline)
        up.metadata = None
        await self._verify(key, size, etag, crc, deadline)
        return UploadResult(etag, len(parts))

    async def _verify(self, key: str, size: int, etag: str, crc: int, deadline: float) -> None:
        """Confirm the object under `key` is the one just written, whole, by size and CRC32."""
        try:
            info = await self.s3.head(key, checksum=True, deadline=deadline)
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

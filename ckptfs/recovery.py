"""Mount-time recovery: deliver what an earlier daemon journaled, abort what nobody owns.

Runs before the mount goes live, so once `ckptfs mount` returns every file
whose close() succeeded under the earlier daemon is complete in S3.

For each closed record the staged file must exist with the recorded size, and
every part the record lists must still have its recorded CRC32; otherwise the
record is inconsistent and set aside (reported, never uploaded). A multipart
upload the record names is reconciled with ListParts: parts S3 holds whose
size and MD5 ETag match the staged bytes are kept, the rest are sent again.
Open records (streamed parts of a file that was never closed) have their
upload aborted; their staged file is preserved by the staging area.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

import trio

from ckptfs.bucket import Bucket
from ckptfs.checksum import b64_crc32, crc32
from ckptfs.errors import NoSuchKey, S3Error, UploadError
from ckptfs.journal import Journal, Record
from ckptfs.oplog import apply_op
from ckptfs.parts import PartPlan
from ckptfs.renames import INTENTS, Renames
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload, PartRecord, without_times

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_CLOCK_SKEW = 60.0  # seconds the S3 server's clock may be behind this host's


@dataclass
class RecoveryReport:
    delivered: list[str] = field(default_factory=list)  # keys completed from the journal
    already_in_s3: list[str] = field(default_factory=list)  # completed before the crash
    aborted: int = 0  # multipart uploads of files that were never closed
    set_aside: list[tuple[str, str]] = field(default_factory=list)  # (record or key, reason)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (key, reason): still journaled
    orphans_aborted: int = 0
    replayed: int = 0  # entries of the ordered log applied, in order
    renames_completed: list[str] = field(default_factory=list)  # "src -> dst" a crash interrupted
    intents_aborted: int = 0  # uploads created just before a crash, before their id was journaled
    last_seq: int = 0  # the highest sequence number found in the log

    def as_dict(self) -> dict:
        return {"delivered": len(self.delivered), "already_in_s3": len(self.already_in_s3),
                "aborted_unclosed": self.aborted, "orphans_aborted": self.orphans_aborted,
                "replayed": self.replayed, "intents_aborted": self.intents_aborted,
                "renames_completed": list(self.renames_completed),
                "set_aside": [list(x) for x in self.set_aside],
                "failed": [list(x) for x in self.failed]}


def _digest(fd: int, start: int, end: int) -> tuple[int, str]:
    """(CRC32, MD5 hex) of bytes [start, end) of fd."""
    crc, md5, pos = 0, hashlib.md5(usedforsecurity=False), start
    while pos < end:
        chunk = os.pread(fd, min(_CHUNK, end - pos), pos)
        if not chunk:
            raise OSError("staged file shorter than expected")
        crc = crc32(chunk, crc)
        md5.update(chunk)
        pos += len(chunk)
    return crc, md5.hexdigest()


class Recovery:
    def __init__(self, journal: Journal, staging_dir: str, preserved_dir: str, s3: Bucket,
                 uploader: Uploader) -> None:
        self.journal = journal
        self.staging_dir = staging_dir
        self.preserved_dir = preserved_dir
        self.s3 = s3
        self.uploader = uploader
        self.report = RecoveryReport()

    async def run(self, prefix: str, stale_after: float) -> RecoveryReport:
        records, bad = await trio.to_thread.run_sync(self.journal.scan)
        self.renames = Renames(self.s3, prefix)
        # Renames a crash interrupted, first: S3 shows each whole before anything else
        # lands (a later put of a renamed file's old name must not be moved with it).
        try:
            moved = await self.renames.complete_interrupted()
        except S3Error as exc:
            self.report.failed.append((prefix + INTENTS, f"an interrupted rename could not be "
                                                         f"completed: {exc}"))
            return self.report
        self.report.renames_completed = [f"{src} -> {dst}" for src, dst in moved]
        records = [await self._follow_renames(rec, moved) for rec in records]
        for name, reason in bad:
            log.error("journal record %s cannot be trusted (%s); it and its staged file are kept in %s",
                      name, reason, self.preserved_dir)
            self._set_aside(name, reason)
        owned = {rec.upload_id for rec in records if rec.upload_id}
        # Uploads created just before the crash, before a record could name them: first, so
        # nothing below can be mistaken for one.
        await self._abort_intents(records, owned)
        ordered = sorted((r for r in records if r.seq > 0), key=lambda r: r.seq)
        self.report.last_seq = max((r.seq for r in ordered), default=0)
        # Open records first: their aborts never race a delivery to the same key.
        for rec in sorted((r for r in records if r.seq == 0), key=lambda r: r.closed):
            if rec.closed:
                await self._deliver(rec)
            else:
                await self._abort(rec)
        await self._replay(ordered)
        await self._sweep_orphans(prefix, stale_after, owned)
        r = self.report
        if records or bad or r.orphans_aborted or r.intents_aborted:
            log.info("recovery: %d delivered, %d already in S3, %d log entries applied in order, "
                     "%d unclosed uploads aborted, %d set aside, %d failed, %d stale uploads "
                     "aborted, %d uploads of a crash at create aborted", len(r.delivered),
                     len(r.already_in_s3), r.replayed, r.aborted, len(r.set_aside), len(r.failed),
                     r.orphans_aborted, r.intents_aborted)
        return r

    async def _replay(self, ordered: list[Record]) -> None:
        """Apply the ordered log's entries one by one, in their order; stop at the first that
        fails (nothing after it may reach S3 before it does)."""
        for rec in ordered:
            if rec.op == "put":
                failed = len(self.report.failed)
                if not await self._deliver(rec):
                    if len(self.report.failed) > failed:
                        return
                    continue  # set aside: its bytes are gone, and nothing can bring them back
            else:
                try:
                    await apply_op(self.renames, rec, self.uploader.deadline())
                except S3Error as exc:
                    log.error("could not apply %s of %s from the log: %s", rec.op, rec.key, exc)
                    self.report.failed.append((rec.key, str(exc)))
                    return
                await trio.to_thread.run_sync(self.journal.remove, rec.name)
            self.report.replayed += 1
            if rec.orphan_key and rec.orphan_id:
                await self.s3.abort_quietly(rec.orphan_key, rec.orphan_id)

    async def _follow_renames(self, rec: Record, moved: list[tuple[str, str]]) -> Record:
        """A close-mode record (no place in a sequence) of a file under a rename just
        completed: its bytes belong under the new name (the crash came before the rename
        could rewrite the record). Async mode's records keep their keys: the log orders them
        after the rename, so a put of the old name is a new file there."""
        if rec.seq or not rec.closed:
            return rec
        for src, dst in moved:
            if rec.key == src or (src.endswith("/") and rec.key.startswith(src)):
                if rec.upload_id:  # its parts were sent under the old key
                    await self.s3.abort_quietly(rec.key, rec.upload_id)
                new = dataclasses.replace(rec, key=dst + rec.key[len(src):], upload_id=None,
                                          parts=())
                await trio.to_thread.run_sync(self.journal.write, new)
                log.info("journaled %s follows the rename to %s", rec.key, new.key)
                return new
        return rec

    async def _abort_intents(self, records: list[Record], owned: set[str]) -> None:
        """Abort uploads of a key that a record meant to create (`intent`) and that no record
        names: started at most a minute (clock skew) before the intent, on that very key."""
        since: dict[str, float] = {}
        for rec in records:
            if not rec.intent:
                continue
            for key in (rec.key, rec.orphan_key):
                if key:
                    since[key] = min(since.get(key, rec.intent), rec.intent)
        for key, intent in since.items():
            try:
                uploads = await self.s3.list_uploads(key)
            except S3Error as exc:
                log.warning("could not list the uploads of %s: %s", key, exc)
                continue
            for upload_key, upload_id, initiated in uploads:
                if upload_key != key or upload_id in owned or initiated < intent - _CLOCK_SKEW:
                    continue
                await self.s3.abort_quietly(key, upload_id)
                self.report.intents_aborted += 1
                log.info("aborted the upload of %s that a crash left before its id was journaled",
                         key)

    def _set_aside(self, name: str, reason: str) -> None:
        self.journal.set_aside(name, self.preserved_dir)
        staged = os.path.join(self.staging_dir, name)
        if os.path.exists(staged):
            os.makedirs(self.preserved_dir, mode=0o700, exist_ok=True)
            os.rename(staged, os.path.join(self.preserved_dir, name))
        self.report.set_aside.append((name, reason))

    async def _abort(self, rec: Record) -> None:
        if rec.upload_id:
            if not await self.s3.abort_quietly(rec.key, rec.upload_id):
                return  # the record keeps owning it; the next mount tries again
            self.report.aborted += 1
        await trio.to_thread.run_sync(self.journal.remove, rec.name)

    async def _deliver(self, rec: Record) -> bool:
        """True once the record's bytes are the object under its key; False if they were set
        aside (torn or missing) or could not be delivered (in `report.failed`)."""
        path = os.path.join(self.staging_dir, rec.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            log.error("journaled %s has lost its staged file %s; nothing to upload", rec.key, path)
            self._set_aside(rec.name, f"{rec.key}: staged file missing")
            return False
        try:
            size = os.fstat(fd).st_size
            if size != rec.size:
                reason = f"{rec.key}: staged file has {size} bytes, the journal says {rec.size}"
                log.error("%s; set aside, not uploaded", reason)
                self._set_aside(rec.name, reason)
                return False
            for part in rec.parts:
                crc, _ = await trio.to_thread.run_sync(_digest, fd, part.start, part.end)
                if crc != part.crc:
                    reason = f"{rec.key}: staged bytes {part.start}-{part.end} changed since journaled"
                    log.error("%s; set aside, not uploaded", reason)
                    self._set_aside(rec.name, reason)
                    return False
            plan = self.uploader.plan
            if rec.part_size and rec.part_size != plan.base_size:
                plan = PartPlan(rec.part_size)  # the earlier mount's part sizes
            up = FileUpload(journal_name=rec.name, record=rec, plan=plan)
            if rec.upload_id and not await self._reuse_parts(up, rec, fd):
                if await self._already_in_s3(rec, fd):
                    self.report.already_in_s3.append(rec.key)
                    await self._done(rec, path)
                    return True
        finally:
            os.close(fd)
        up.record_clock = up.clock  # the record describes these bytes
        try:
            await self.uploader.finish(up, path, rec.key, rec.size, rec.metadata)
        except UploadError as exc:
            log.error("could not deliver journaled %s: %s", rec.key, exc)
            self.report.failed.append((rec.key, str(exc)))
            return False
        log.info("recovered %s (%d bytes) from the journal", rec.key, rec.size)
        self.report.delivered.append(rec.key)
        await self._done(rec, path)
        return True

    async def _done(self, rec: Record, path: str) -> None:
        await trio.to_thread.run_sync(self.journal.remove, rec.name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    async def _reuse_parts(self, up: FileUpload, rec: Record, fd: int) -> bool:
        """Adopt the record's open multipart upload and the parts S3 holds correctly.

        False if that upload no longer exists (completed or aborted before the crash).
        """
        assert rec.upload_id is not None
        try:
            listed = await self.s3.list_parts(rec.key, rec.upload_id)
        except NoSuchKey:
            return False
        up.upload_id, up.key, up.metadata = rec.upload_id, rec.key, without_times(rec.metadata)
        plan = up.plan or self.uploader.plan
        for r in plan.ranges(rec.size):
            have = listed.get(r.number)
            if have is None or have[0] != r.size:
                continue
            crc, md5 = await trio.to_thread.run_sync(_digest, fd, r.start, r.end)
            if have[1].strip('"') == md5:
                up.parts[r.number] = PartRecord(r.start, r.end, have[1], crc, 0)
        log.info("resuming the upload of %s: %d of %d parts already in S3", rec.key, len(up.parts),
                 len(plan.ranges(rec.size)))
        return True

    async def _already_in_s3(self, rec: Record, fd: int) -> bool:
        """The object under the key is these very bytes (the crash came after completion)."""
        try:
            info = await self.s3.head(rec.key, checksum=True)
        except (NoSuchKey, S3Error):
            return False
        if info.size != rec.size or info.checksum_crc32 is None:
            return False
        crc, _ = await trio.to_thread.run_sync(_digest, fd, 0, rec.size)
        return info.checksum_crc32 == b64_crc32(crc)

    async def _sweep_orphans(self, prefix: str, stale_after: float, owned: set[str]) -> None:
        """Abort multipart uploads under the prefix that no record owns and that are old enough."""
        try:
            uploads = await self.s3.list_uploads(prefix)
        except S3Error as exc:
            log.warning("could not list open multipart uploads under %r: %s", prefix, exc)
            return
        cutoff = time.time() - stale_after
        for key, upload_id, initiated in uploads:
            if upload_id in owned or initiated > cutoff:
                continue
            if await self.s3.abort_quietly(key, upload_id):
                self.report.orphans_aborted += 1
                log.info("aborted stale multipart upload of %s (started %s)", key,
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(initiated)))

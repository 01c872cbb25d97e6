"""The ordered log (async mode): every change S3 must see, in the order the application made it.

S3 at any instant holds the mount as it was at some earlier instant: a prefix of its
history. Each change that alters what S3 shows (a closed file's object, a delete, a
directory marker, a rename's copy-and-delete, a directory's move, new metadata) becomes an Entry with a
sequence number. Its journal record (journal.py, `seq` > 0) is written and fsynced
before the call that made it returns, and appends are serialised, so the records on
disk are always a contiguous run of the sequence.

Every entry runs as its own task. A put's parts upload at once, in parallel with every
other file's; only the request that makes a change visible (PutObject,
CompleteMultipartUpload, DELETE, COPY) waits for its turn: all earlier entries applied.
An entry's record is removed before the next entry's turn comes, so after a crash the
records left are exactly the changes S3 may not have, in order (recovery.py replays them
before the mount reports ready). An entry that fails is retried with backoff; nothing
after it becomes visible before it does.

Until its entry is applied S3 still shows what a delete or a rename removed: those keys
(and, for rmdir, whole prefixes) are masked (masks.py), so lookups and listings never bring
them back.

Two rewrites keep the sequence while saving S3 work; each applies only to the last entry
and only before its visible request was sent, so S3 still steps from one state of the
history to a later one:
- a rename of a file whose put is that entry, and whose name had no object before the put
  (torch.save to `x.tmp`, then os.replace onto `x`): the put is retargeted to the new name;
- new metadata (chmod, utime) for the file of that entry: the entry carries it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ckptfs.backlog import Backlog
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.journal import PartDone, Record
from ckptfs.masks import Masks
from ckptfs.parts import PartPlan
from ckptfs.renames import Renames
from ckptfs.staging import StagedFile
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload, UploadRecords

log = logging.getLogger(__name__)

# How long the last put of a new name waits for a rename or chmod of it before its object
# appears (measured from its close; see _turn).
REWRITE_GRACE = 0.2


@dataclass(eq=False)
class Entry:
    rec: Record
    path: str  # the path in the mount, for messages and `ckptfs sync PATH`
    staged: StagedFile | None = None  # put: its bytes, held (never changed) until applied
    owner: Any = None  # what the caller needs back in on_done (the inode)
    # With the new ETag, if any (a directory move: the new ETags, by relative key).
    on_done: Callable[[Entry, Any], None] | None = None
    fresh: bool = False  # put: its name had no object before it (it may be retargeted)
    metadata: dict[str, str] | None = None  # put: the dict its upload reads (amendable)
    up: FileUpload | None = None
    attempts: int = 0
    error: str | None = None
    visible: bool = False  # its visible request was sent: it can no longer be rewritten
    scope: trio.CancelScope | None = None
    appended_at: float = 0.0  # trio time of the append
    awaited: bool = False  # `ckptfs sync` waits for it: its rename grace is over
    # A directory move: S3 holds every object under the new prefix too (the sources are
    # deleted next); called with the new ETags, by key relative to the directory.
    on_copied: Callable[[dict[str, str]], None] | None = None

    @property
    def seq(self) -> int:
        return self.rec.seq

    @property
    def size(self) -> int:
        return self.rec.size if self.rec.op == "put" else 0


async def apply_op(renames: Renames, rec: Record, deadline: float,
                   copied: Callable[[dict[str, str]], None] | None = None
                   ) -> str | dict[str, str] | None:
    """The S3 requests of an entry that is not a put; the new ETag, if the entry made one (a
    directory's move: {key relative to the directory: new ETag}; `copied` is told once the
    copies are all made, before the sources are deleted).

    Each is safe to repeat: recovery replays the entry whose record a crash left behind.
    """
    s3 = renames.s3
    if rec.op == "delete":
        await s3.delete(rec.key, deadline)
        return None
    if rec.op == "object":
        body = base64.b64decode(rec.body or "")
        return await s3.put(rec.key, body, rec.metadata, deadline)
    if rec.op == "meta":
        try:
            info = await s3.head(rec.key, deadline=deadline)
            return await s3.copy(rec.key, rec.key, info.size, rec.metadata, deadline,
                                 etag=info.etag, content_type=info.content_type)
        except NoSuchKey:
            log.warning("new metadata for %s: the object is gone from S3", rec.key)
            return None
    if rec.op == "copy":
        assert rec.src is not None
        src = rec.src
        try:
            # The size the object has now, in its turn (objects over 5 GiB copy in parts).
            info = await s3.head(src, deadline=deadline)
        except NoSuchKey:
            # Replayed after a crash between its copy and its delete: the copy is in place.
            log.info("rename of %s to %s: the source is gone, the copy was made before", src, rec.key)
            await s3.delete(src, deadline)
            return None
        return await renames.move_object(src, rec.key, info.size, info.etag, deadline)
    if rec.op == "dirmove":
        assert rec.src is not None
        extra = json.loads(rec.body or "{}")
        return await renames.move_dir(rec.src, rec.key, rec.metadata,
                                      tuple(extra.get("also_delete", ())),
                                      tuple(extra.get("replaced", ())), copied)
    raise ValueError(f"not an S3 change: {rec.op}")


def _with_upload(rec: Record, up: FileUpload) -> Record:
    """A put's record naming what its upload already has in S3: its multipart upload and the
    parts current for these bytes (recovery resumes it), or, if that upload is of another
    key (the file was renamed while written), that upload as an orphan to abort. The intent
    of a create still in flight carries over (recovery aborts what it may have made)."""
    old = up.record
    intent = old.intent if old is not None else 0.0
    orphan = old.key if old is not None and old.key != rec.key else None
    if up.upload_id is None or up.key is None:
        return dataclasses.replace(rec, intent=intent, orphan_key=orphan if intent else None)
    if up.key != rec.key:
        return dataclasses.replace(rec, intent=intent, orphan_key=up.key, orphan_id=up.upload_id)
    parts = tuple(PartDone(n, p.start, p.end, p.etag, p.crc) for n, p in sorted(up.parts.items())
                  if p.clock >= up.touched.get(n, 0) and p.end <= rec.size)
    return dataclasses.replace(rec, upload_id=up.upload_id, parts=parts, intent=intent)


class OrderedLog(Backlog[int, Entry]):
    """The entries not yet applied, by seq (in sequence order)."""

    def __init__(self, records: UploadRecords, uploader: Uploader, renames: Renames, *,
                 nursery: trio.Nursery) -> None:
        super().__init__()
        self.records = records  # the one writer of journal records
        self.uploader = uploader
        self.renames = renames
        self.s3 = renames.s3
        self._nursery = nursery  # runs the entries
        self._next_seq = 1
        self._append_lock = trio.Lock()
        self.masks = Masks()  # what S3 still shows but the mount removed, until applied

    # ----- appending -----------------------------------------------------

    def continue_after(self, seq: int) -> None:
        """Number new entries after `seq` (what recovery found), so names never repeat."""
        self._next_seq = max(self._next_seq, seq + 1)

    def op_name(self, seq: int) -> str:
        return f"op-{seq:012d}"

    async def append(self, rec: Record, path: str, *, staged: StagedFile | None = None,
                     owner: Any = None, on_done: Callable[[Entry, Any], None] | None = None,
                     masks: tuple[str, ...] = (), fresh: bool = False,
                     effect: Callable[[], None] | None = None,
                     up: FileUpload | None = None,
                     on_copied: Callable[[dict[str, str]], None] | None = None) -> Entry:
        """Journal a change as the next of the sequence, then apply `effect` to the mount.

        Returns once the record is on disk; S3 gets the change in its turn. `masks`: keys
        (a trailing "/" masks a whole prefix) that S3 keeps showing until then. `up`: a put's
        upload so far (the parts streamed while the file was written), which the entry takes
        over with its journal record; the caller must no longer use it.
        """
        async with self._append_lock:
            seq = self._next_seq
            if rec.op != "put":
                rec = dataclasses.replace(rec, name=self.op_name(seq))
            rec = dataclasses.replace(rec, seq=seq)
            if up is not None:
                async with up.record_lock:  # no write of the upload's own record in between
                    rec = _with_upload(rec, up)
                    await self._write(rec)
                    up.record, up.journal_name = rec, rec.name
            else:
                await self._write(rec)
            self._next_seq = seq + 1
            entry = Entry(rec, path, staged, owner, on_done, fresh,
                          dict(rec.metadata) if rec.op == "put" else None,
                          appended_at=trio.current_time(), up=up, on_copied=on_copied)
            self._items[seq] = entry
            if effect is not None:
                effect()  # (before its masks: a directory rename's carries the earlier ones)
            for key in masks:
                self.masks.add(key, seq)
            log.debug("log entry %d: %s %s", seq, rec.op, path)
            self._nursery.start_soon(self._run, entry)
            self._notify()
            return entry

    def last(self) -> Entry | None:
        return self._items[next(reversed(self._items))] if self._items else None

    def latest_put(self, owner: Any) -> Entry | None:
        """The newest pending put whose owner is `owner`."""
        for seq in reversed(self._items):
            e = self._items[seq]
            if e.owner is owner and e.rec.op == "put":
                return e
        return None

    def entries_of(self, owner: Any) -> list[Entry]:
        return [e for e in self._items.values() if e.owner is owner]

    async def retarget(self, entry: Entry, key: str, path: str, effect: Callable[[], None],
                       replaces: bool = False) -> bool:
        """Move the last entry, a put of a name that had no object, to `key` (a rename of it).
        `replaces`: S3 has (or will have) an object at `key`, which the put now replaces; a
        later rename of it is then a copy and a delete, never another retarget (that would
        leave the replaced object behind).

        False if it is no longer the last entry or its object is already being made visible.
        Parts already streamed under the old key are sent again under the new one: S3 never
        shows the temporary name, and a large file renamed after close is rare (DCP renames
        its small `.metadata`, which goes up in one PUT at its turn).
        """
        async with self._append_lock:
            if self.last() is not entry or entry.visible or not entry.fresh:
                return False
            old = entry.up
            current = old.record if old is not None and old.record is not None else entry.rec
            # The old key's intent stays: recovery aborts an upload of it whose id was never
            # journaled (a create in flight now).
            rec = dataclasses.replace(entry.rec, key=key, upload_id=None, parts=(),
                                      intent=current.intent, orphan_key=entry.rec.key,
                                      orphan_id=old.upload_id if old is not None else None)
            if old is not None:
                # Its upload task must never write the old key's record over this one.
                async with old.record_lock:
                    old.journal_name = None
                    await self._write(rec)
            else:
                await self._write(rec)
            entry.rec, entry.path, entry.up = rec, path, None
            entry.fresh = not replaces
            log.debug("log entry %d: the put moves to %s", entry.seq, path)
            if entry.scope is not None:
                entry.scope.cancel()  # it starts again under the new key
            if old is not None:
                # Its multipart upload (if the entry's task has not started, nobody else
                # would) goes; the record names it as an orphan until then.
                self._nursery.start_soon(self.uploader.abort, old)
            effect()
            return True

    async def amend_metadata(self, entry: Entry, metadata: dict[str, str]) -> bool:
        """Give the last entry, a put, new metadata (chmod, utime after close); False if it is
        no longer the last entry or is being made visible."""
        async with self._append_lock:
            if self.last() is not entry or entry.visible or entry.metadata is None:
                return False
            entry.rec = dataclasses.replace(entry.rec, metadata=dict(metadata))
            # The upload keeps its record current (its upload id): amend that one, under its
            # lock. Made here if the entry's task has not made it yet (or a retarget dropped
            # it): an unlocked write of the record could race the upload's own.
            up = self._upload_of(entry)
            async with up.record_lock:
                rec = dataclasses.replace(up.record or entry.rec, metadata=dict(metadata))
                await self._write(rec)
                up.record = rec
            # The upload reads this very dict: a PUT not yet sent carries the new values; a
            # multipart upload copies them on after completing, as for a chmod while writing.
            entry.metadata.clear()
            entry.metadata.update(metadata)
            return True

    async def _write(self, rec: Record) -> None:
        await self.records.write_entry(rec)

    def masked(self, key: str) -> bool:
        return self.masks.masked(key)

    # ----- applying --------------------------------------------------------

    async def _turn(self, entry: Entry) -> None:
        """Return when every earlier entry is applied; from then on `entry` is visible."""
        while next(iter(self._items)) != entry.seq:
            await self._changed.wait()
        if entry.fresh and entry.metadata is not None:
            # A put that is still the last change: wait out the grace from its append for a
            # rename (os.replace after torch.save to a temp name) or a chmod/utime (copy2)
            # that would rewrite it. Once visible, a rename would take two steps in S3.
            # Large files spend longer than this on their parts: it costs them nothing.
            # A `ckptfs sync` waiting for it ends the grace: it asked for S3 now.
            with trio.move_on_at(entry.appended_at + REWRITE_GRACE):
                while self.last() is entry and not entry.awaited:
                    await self._changed.wait()
        # A retarget that cancelled this entry lands here, before anything is sent.
        await trio.lowlevel.checkpoint()
        entry.visible = True

    async def _apply(self, entry: Entry) -> str | dict[str, str] | None:
        rec = entry.rec
        if rec.op != "put":
            await self._turn(entry)
            return await apply_op(self.renames, rec, self.uploader.deadline(), entry.on_copied)
        assert entry.staged is not None and entry.metadata is not None
        result = await self.uploader.finish(self._upload_of(entry), entry.staged.path, rec.key, rec.size,
                                            entry.metadata, before_visible=lambda: self._turn(entry))
        return result.etag

    def _upload_of(self, entry: Entry) -> FileUpload:
        """The put's upload (its record and lock), made once per key."""
        if entry.up is None:
            rec = entry.rec
            plan = None if rec.part_size in (0, self.uploader.plan.base_size) else PartPlan(rec.part_size)
            entry.up = FileUpload(journal_name=rec.name, record=rec, plan=plan)
        return entry.up

    async def _run(self, entry: Entry) -> None:
        attempt = 0
        while True:
            try:
                with trio.CancelScope() as scope:
                    entry.scope = scope
                    etag = await self._apply(entry)
            except Exception as exc:  # noqa: BLE001 - one entry's failure never ends the daemon
                # `visible` stays set: a request that failed may still have taken effect
                # (a lost answer), so the entry is never rewritten after that.
                if not isinstance(exc, S3Error):
                    log.exception("applying %s failed unexpectedly; retrying", entry.path)
                entry.error = str(exc) or type(exc).__name__
                entry.attempts += 1
                # While S3 is out, the outage's own line says it (health.py).
                log.log(logging.DEBUG if self.uploader.policy.health.down else logging.WARNING,
                        "%s of %s failed (attempt %d); everything after it waits: %s",
                        entry.rec.op, entry.path, entry.attempts, entry.error)
                self._notify()
                attempt = await self.uploader.policy.changes.sleep(attempt)
                continue
            finally:
                entry.scope = None
            if not scope.cancelled_caught:
                break
        await self._retire(entry, etag)

    async def _retire(self, entry: Entry, etag: str | dict[str, str] | None) -> None:
        """The change is in S3: drop its record (before the next entry's turn), then report it."""
        while True:
            try:
                await self.records.remove_entry(entry.rec.name)
                break
            except OSError as exc:
                log.error("cannot remove the journal record of %s (%s); retrying", entry.path, exc)
                await trio.sleep(1.0)
        del self._items[entry.seq]
        self.masks.release(entry.seq)
        entry.error = None
        if entry.on_done is not None:
            entry.on_done(entry, etag)
        self._notify()

    # ----- waiting -----------------------------------------------------------

    def _path(self, item: Entry) -> str:
        return item.path

    def _size(self, item: Entry) -> int:
        return item.size

    def pending_bytes(self) -> int:
        return sum(e.size for e in self._items.values())

    async def wait(self, path: str = "") -> list[tuple[str, str]]:
        """Wait until every change under `path` made so far is in S3, or one it waits for has
        failed an attempt since now. Returns (path, reason) for each failing change; [] means
        done. A change outside `path` that fails holds everything after it, so it is reported."""
        under = self._under(path)
        mine = [seq for seq, e in self._items.items() if under(e)]
        if not mine:
            return []
        last = max(mine)
        start = self._attempts(seq for seq in self._items if seq <= last)
        for seq in start:
            self._items[seq].awaited = True
        self._notify()
        while True:
            if last not in self._items:
                return []  # applied in order: everything before it is in S3 too
            failed = self._failed_since(start)
            if failed:
                return failed
            await self._changed.wait()

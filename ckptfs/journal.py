"""Crash-safe upload records: one small file per staged file that S3 does not hold yet.

A record sits in CACHE_DIR/journal/, named after its staged file in
CACHE_DIR/staging/. It is written whole (temp file, fsync, rename, fsync of the
directory), so after a crash it is either the old record, the new one or none;
its body carries a CRC32 of itself, so a record torn by a bad disk is detected
and reported instead of trusted.

States: `closed` records name a file whose close() succeeded and whose bytes
must reach `key` at the next mount if they are not there yet; open records
only own a multipart upload (streamed parts of a file still being written),
which recovery aborts. Records are deleted once the object is complete and
verified in S3.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from dataclasses import asdict, dataclass, field

from ckptfs.parts import MAX_PART_SIZE, MIN_PART_SIZE

log = logging.getLogger(__name__)

VERSION = 1
OPS = ("put", "object", "delete", "copy", "meta", "dirmove")


class BadRecord(Exception):
    """A record that cannot be trusted: unreadable, torn or inconsistent."""


@dataclass(frozen=True)
class PartDone:
    number: int
    start: int
    end: int
    etag: str
    crc: int


@dataclass(frozen=True)
class Record:
    name: str  # the staged file's name in the staging dir
    key: str  # the full S3 key the bytes belong under
    closed: bool  # close() succeeded: the bytes must be delivered
    size: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    upload_id: str | None = None  # the open multipart upload holding parts of these bytes
    parts: tuple[PartDone, ...] = ()
    fsynced: bool = False  # the staged bytes were fsynced after their last change
    part_size: int = 0  # the first part's size: parts already in S3 follow this plan
    # The ordered log (async mode): seq > 0 places the record in the sequence S3 must see.
    seq: int = 0
    # put (staged bytes), object (inline body), delete, copy (src -> key), meta, dirmove (every
    # object under the "dir/" prefix src moves under key; body: JSON of renames.move_dir's extras)
    op: str = "put"
    src: str | None = None  # copy: the key the object moves from (deleted after the copy)
    body: str | None = None  # object: the body, base64
    # A CreateMultipartUpload was about to be sent at this wall-clock time (before its id
    # was known): recovery aborts uploads of `key` started since then that nobody owns.
    intent: float = 0.0
    # An upload this record replaced (a put retargeted by a rename) that may still be open.
    orphan_key: str | None = None
    orphan_id: str | None = None

    def encode(self) -> bytes:
        body = asdict(self)
        body["parts"] = [asdict(p) for p in self.parts]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"v": VERSION, "crc32": zlib.crc32(text.encode()), "record": text}).encode()

    @staticmethod
    def decode(data: bytes) -> Record:
        try:
            outer = json.loads(data)
            text = outer["record"]
            if outer.get("v") != VERSION:
                raise BadRecord(f"unknown record version {outer.get('v')!r}")
            if zlib.crc32(text.encode()) != outer["crc32"]:
                raise BadRecord("record checksum mismatch (torn or corrupted)")
            body = json.loads(text)
            parts = tuple(PartDone(**p) for p in body.pop("parts"))
            rec = Record(**body, parts=parts)
        except BadRecord:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadRecord(f"unreadable record: {exc}") from None
        if (rec.size < 0 or not rec.key or not rec.name or os.path.basename(rec.name) != rec.name
                or rec.op not in OPS or rec.seq < 0 or (rec.op in ("copy", "dirmove") and not rec.src)
                or not (rec.part_size == 0 or MIN_PART_SIZE <= rec.part_size <= MAX_PART_SIZE)
                or any(not 0 <= p.start < p.end <= rec.size for p in rec.parts)):
            raise BadRecord("inconsistent record")
        return rec


class Journal:
    """The journal directory. Methods block (fsync): call them from a worker thread."""

    def __init__(self, cache_dir: str) -> None:
        self.dir = os.path.join(cache_dir, "journal")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.writes = 0

    def stats(self) -> dict[str, int]:
        return {"journal_writes": self.writes}

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name + ".json")

    def write(self, rec: Record) -> None:
        final = self._path(rec.name)
        # Its own temporary name: two threads writing one record must never rename each
        # other's file away (ENOENT). Which content wins is the callers' business (the
        # upload's record lock); scan() removes temporary files a crash left behind.
        tmp = f"{final}.{threading.get_native_id()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            data = rec.encode()
            if os.write(fd, data) != len(data):
                raise OSError("short write of a journal record")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        self._sync_dir()
        self.writes += 1

    def remove(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def scan(self) -> tuple[list[Record], list[tuple[str, str]]]:
        """Every record, and (record name, reason) for each one that cannot be trusted."""
        records, bad = [], []
        for entry in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, entry)
            if entry.endswith(".tmp"):
                os.unlink(path)  # a write that never reached its rename: the old record stands
                continue
            if not entry.endswith(".json"):
                continue
            name = entry[:-len(".json")]
            try:
                with open(path, "rb") as f:
                    rec = Record.decode(f.read())
                if rec.name != name:
                    raise BadRecord(f"record names staged file {rec.name!r}")
                records.append(rec)
            except BadRecord as exc:
                bad.append((name, str(exc)))
            except OSError as exc:
                bad.append((name, f"unreadable record: {exc.strerror}"))
        return records, bad

    def set_aside(self, name: str, dest: str) -> None:
        """Move a record that will not be used into `dest` (kept for the operator)."""
        os.makedirs(dest, mode=0o700, exist_ok=True)
        try:
            os.rename(self._path(name), os.path.join(dest, name + ".json"))
        except FileNotFoundError:
            pass

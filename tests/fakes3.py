"""An in-memory S3 for unit tests of retry, ordering and fault logic (never end to end).

Three parts, as in production:
- `MemoryStore` implements the primitives of ckptfs.s3types.S3 over dicts, one attempt each,
  with the semantics the components rely on: part CRC32s are checked like a server does,
  CompleteMultipartUpload of an unknown upload is NoSuchUpload, and `visible` lists every
  change a reader of the bucket could see, in order.
- `Faults` wraps any implementation of the primitives (the store, or the real client) and
  injects faults per attempt, so they go through the same retries as real ones:
  - `fail(op, key=..., times=..., status=...)`: the next `times` attempts of `op` (on `key`,
    if given) fail with that status (503: transient; 403: permanent); `heal(op, key)` ends it;
  - `lose_answer(op)`: the request takes effect, then its answer is lost (a reset);
  - `hold(op, until)`: every attempt of `op` waits for the trio.Event `until` first;
  - `crash_after(n)`: after n more attempts, every attempt raises `Crash` (the daemon died:
    nothing it sends later reaches S3); `crash_after(None)` lets them through again;
  - `outage(kind)`: every attempt fails as against a whole server gone: "hang" (no answer
    until the attempt's deadline, as a socket timeout ends it), "refuse" (connection refused
    at once) or "503" (SlowDown); `outage(None)` ends it.
  `requests` records (op, key) of every attempt.
- `MemoryS3` is what the components get: ckptfs.bucket.Bucket (retries and helpers) over
  `Faults` over a `MemoryStore`, with the store's state at hand for assertions.

Ops: HEAD, LIST, GET, PUT, CreateMultipartUpload, UploadPart, UploadPartCopy,
CompleteMultipartUpload, AbortMultipartUpload, ListParts, ListMultipartUploads, COPY, DELETE.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from ckptfs.bodies import scatter
from ckptfs.bucket import Bucket
from ckptfs.checksum import b64_crc32, crc32, crc32_of_parts
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.retry import RetryPolicy, remaining
from ckptfs.s3types import S3, ListPage, ObjectInfo

T = TypeVar("T")


class MemoryStore:
    """The primitives over dicts, one attempt each."""

    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(16)
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.meta: dict[str, dict[str, str]] = {}
        self.content_types: dict[str, str] = {}  # what HEAD answers; set by tests and copies
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}  # id -> (key, parts)
        self.initiated: dict[str, float] = {}
        self.visible: list[tuple[str, str]] = []
        self.part_crcs: list[tuple[int, int | None]] = []  # (part number, CRC32 sent), per attempt
        self._n = 0

    def _store(self, key: str, data: bytes, metadata: dict[str, str] | None, how: str,
               etag: str) -> str:
        self.objects[key] = bytes(data)
        self.etags[key] = etag
        self.meta[key] = dict(metadata or {})
        self.content_types.pop(key, None)  # a new object: no Content-Type unless one is given
        self.visible.append((how, key))
        return etag

    def _object(self, key: str, etag: str | None = None) -> bytes:
        if key not in self.objects:
            raise NoSuchKey(key)
        if etag and self.etags[key] != etag:
            raise S3Error(f"GET {key}: PreconditionFailed", "PreconditionFailed", 412)
        return self.objects[key]

    def _upload(self, upload_id: str) -> dict[int, bytes]:
        if upload_id not in self.uploads:
            raise NoSuchKey(f"NoSuchUpload {upload_id}")
        return self.uploads[upload_id][1]

    @staticmethod
    def _checked(what: str, data: bytes, crc: int | None) -> int:
        """As S3 refuses a body whose x-amz-checksum-crc32 is wrong."""
        if crc is not None and crc != crc32(data):
            raise S3Error(f"{what}: BadDigest", "BadDigest", 400)
        return crc32(data)

    async def head(self, key: str, checksum: bool = False) -> ObjectInfo:
        data = self._object(key)
        return ObjectInfo(key, len(data), self.etags[key], 0.0, dict(self.meta[key]),
                          b64_crc32(crc32(data)), self.content_types.get(key))

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000, start_after: str | None = None
                        ) -> tuple[ListPage, str | None]:
        # As S3: keys and common prefixes in one sorted run after `start_after` (or the
        # token: the last one the page before returned), at most `max_keys` of them.
        after = token or start_after or ""
        entries: dict[str, ObjectInfo | None] = {}  # a common prefix: None
        for key in sorted(self.objects):
            if not key.startswith(prefix) or key <= after:
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter)[0] + delimiter
                if common > after or token is None:  # (a token: the prefix was returned)
                    entries.setdefault(common, None)
            else:
                entries[key] = ObjectInfo(key, len(self.objects[key]), self.etags[key], 0.0)
        names = sorted(entries)
        page, more = names[:max_keys], len(names) > max_keys
        return (ListPage([n for n in page if entries[n] is None],
                         [info for n in page if (info := entries[n]) is not None]),
                page[-1] if more else None)

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        data = self._object(key, etag)[start:start + sum(len(o) for o in outs)]
        scatter(data, outs, filled)

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        data = self._object(key, etag)[start:start + sum(n for _, n, _ in targets)]
        for i, (fd, n, at) in enumerate(targets):
            os.pwrite(fd, data[:n], at)
            data = data[n:]
            if filled is not None:
                filled(i)
        return 0

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        self.part_crcs.append((0, crc))  # part 0: a single PUT
        body = os.pread(fd, size, 0)
        crc = self._checked(f"PUT {key}", body, crc)
        return self._store(key, body, metadata, "put", hashlib.md5(body).hexdigest()), crc

    async def create_multipart(self, key: str, metadata: dict[str, str],
                               checksum: bool = True) -> str:
        self._n += 1
        upload_id = f"u{self._n}"
        self.uploads[upload_id] = (key, {})
        self.initiated[upload_id] = time.time()
        self.meta[upload_id] = dict(metadata)
        return upload_id

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, crc: int | None = None,
                          reread: bool = False) -> tuple[str, int]:
        self.part_crcs.append((number, crc))

        def effect() -> tuple[str, int]:
            data = os.pread(fd, size, start)
            checked = self._checked(f"UploadPart {number} of {key}", data, crc)
            self._upload(upload_id)[number] = data
            return hashlib.md5(data).hexdigest(), checked
        return await trio.to_thread.run_sync(effect, limiter=self.limiter)

    async def copy_part(self, key: str, upload_id: str, number: int, src: str,
                        start: int, end: int) -> str:
        data = self._object(src)[start:end]
        self._upload(upload_id)[number] = data
        return hashlib.md5(data).hexdigest()

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None) -> str:
        have = self._upload(upload_id)
        chunks = [have[p["PartNumber"]] for p in parts]
        for p, chunk in zip(parts, chunks):
            if "ChecksumCRC32" in p and p["ChecksumCRC32"] != b64_crc32(crc32(chunk)):
                raise S3Error(f"Complete {key}: InvalidPart", "InvalidPart", 400)
        if crc is not None and crc != crc32_of_parts([(crc32(c), len(c)) for c in chunks]):
            raise S3Error(f"Complete {key}: BadDigest", "InvalidRequest", 400)
        del self.uploads[upload_id]
        data = b"".join(chunks)
        return self._store(key, data, self.meta.pop(upload_id, {}), "complete",
                           hashlib.md5(data).hexdigest() + f"-{len(parts)}")

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        if self.uploads.pop(upload_id, None) is None:
            raise NoSuchKey(upload_id)

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        return {n: (len(d), hashlib.md5(d).hexdigest()) for n, d in self._upload(upload_id).items()}

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return [(key, upload_id, self.initiated.get(upload_id, 0.0))
                for upload_id, (key, _) in self.uploads.items() if key.startswith(prefix)]

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   content_type: str | None = None) -> str:
        data = self._object(src)
        # As on AWS: replaced metadata replaces the Content-Type too (default: none).
        kind = self.content_types.get(src) if metadata is None else content_type
        # As on AWS: CopyObject makes a plain ETag.
        etag = self._store(dst, data, metadata if metadata is not None else self.meta[src],
                           "copy", hashlib.md5(data).hexdigest())
        if kind is None:
            self.content_types.pop(dst, None)
        else:
            self.content_types[dst] = kind
        return etag

    async def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.objects.pop(key, None)
            self.visible.append(("delete", key))


class Crash(BaseException):
    """The daemon died: this request and every later one never reach S3."""


@dataclass
class _Rule:
    op: str
    key: str | None
    times: int
    status: int = 0
    code: str = ""
    lose_answer: bool = False
    until: trio.Event | None = None  # a hold

    def matches(self, op: str, keys: list[str]) -> bool:
        return self.op == op and (self.key is None or self.key in keys)


class Gate:
    """While shut, the requests that change what S3 shows wait, but for those `let` lets
    through: a test applies the ordered log one request at a time, at points it chooses."""

    VISIBLE = frozenset({"PUT", "CompleteMultipartUpload", "COPY", "DELETE"})

    def __init__(self) -> None:
        self.shut = True
        self.passes = 0
        self._changed = trio.Event()

    def let(self, n: int) -> None:
        self.passes += n
        self._wake()

    def open(self) -> None:
        self.shut = False
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def enter(self) -> None:
        while self.shut and self.passes == 0:
            await self._changed.wait()
        if self.shut:
            self.passes -= 1


class Faults:
    """Any implementation of the primitives, with faults injected per attempt."""

    def __init__(self, inner: S3) -> None:
        self.inner = inner
        self.limiter = inner.limiter
        self.gate: Gate | None = None  # set by a test: visible requests wait there
        self.rules: list[_Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.left: int | None = None  # attempts until a crash
        self._outage: str | None = None
        self._healed = trio.Event()
        self.hung = 0  # attempts a "hang" outage held to their deadline

    def outage(self, kind: str | None) -> None:
        assert kind in (None, "hang", "refuse", "503")
        self._outage = kind
        if kind is None:
            self._healed.set()
        elif self._healed.is_set():
            self._healed = trio.Event()

    async def _outage_fault(self, op: str, key: str) -> None:
        if self._outage == "hang":
            self.hung += 1
            left = remaining()  # the attempt's deadline: the client's socket timeout
            with trio.move_on_after(left if left is not None else 60.0):
                await self._healed.wait()
            # (healed meanwhile or not, this request is never answered)
            raise S3Error(f"{op} {key}: Read timeout on endpoint URL", "ReadTimeoutError", None, True)
        if self._outage == "refuse":
            raise S3Error(f"{op} {key}: Could not connect to the endpoint URL",
                          "EndpointConnectionError", None, True)
        if self._outage == "503":
            raise S3Error(f"{op} {key}: SlowDown", "SlowDown", 503)

    def crash_after(self, attempts: int | None) -> None:
        self.left = attempts

    def fail(self, op: str, key: str | None = None, times: int = 1, status: int = 503,
             code: str = "") -> None:
        code = code or {503: "SlowDown", 500: "InternalError", 403: "AccessDenied",
                        400: "BadDigest"}.get(status, str(status))
        self.rules.append(_Rule(op, key, times, status, code))

    def lose_answer(self, op: str, key: str | None = None, times: int = 1) -> None:
        self.rules.append(_Rule(op, key, times, 0, "ConnectionResetError", True))

    def hold(self, op: str, until: trio.Event, key: str | None = None) -> None:
        self.rules.append(_Rule(op, key, 1, until=until))

    def heal(self, op: str, key: str | None = None) -> None:
        """End the failures of `op` (on `key`, if given) still to come."""
        self.rules = [r for r in self.rules if r.until is not None or r.op != op
                      or (key is not None and r.key != key)]

    def _take(self, op: str, keys: list[str], after: bool) -> _Rule | None:
        for rule in self.rules:
            if rule.until is None and rule.matches(op, keys) and rule.times > 0 \
                    and rule.lose_answer == after:
                rule.times -= 1
                return rule
        return None

    async def _attempt(self, op: str, key: str | list[str], call: Callable[[], Awaitable[T]]) -> T:
        keys = key if isinstance(key, list) else [key]
        if self.left is not None:
            if self.left <= 0:
                raise Crash(op)
            self.left -= 1
        self.requests.append((op, keys[0] if keys else ""))
        if self._outage is not None:
            await self._outage_fault(op, keys[0] if keys else "")
        for rule in self.rules:
            if rule.until is not None and rule.matches(op, keys):
                await rule.until.wait()
        if self.gate is not None and op in Gate.VISIBLE:
            await self.gate.enter()
        await trio.lowlevel.checkpoint()
        if (rule := self._take(op, keys, after=False)) is not None:
            raise S3Error(f"{op} {keys[0]}: {rule.code}", rule.code, rule.status)
        result = await call()
        if self._take(op, keys, after=True) is not None:
            raise S3Error(f"{op} {keys[0]}: connection reset", "ConnectionResetError", None, True)
        return result

    async def head(self, key: str, checksum: bool = False) -> ObjectInfo:
        return await self._attempt("HEAD", key, lambda: self.inner.head(key, checksum))

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000, start_after: str | None = None
                        ) -> tuple[ListPage, str | None]:
        return await self._attempt("LIST", prefix, lambda: self.inner.list_page(
            prefix, token, delimiter, max_keys, start_after))

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        await self._attempt("GET", key, lambda: self.inner.get_ranges_into(
            key, start, outs, etag, filled))

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        return await self._attempt("GET", key, lambda: self.inner.get_ranges_to_files(
            key, start, targets, etag, filled))

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        return await self._attempt("PUT", key, lambda: self.inner.put_file(
            key, fd, size, metadata, crc, reread))

    async def create_multipart(self, key: str, metadata: dict[str, str],
                               checksum: bool = True) -> str:
        return await self._attempt("CreateMultipartUpload", key,
                                   lambda: self.inner.create_multipart(key, metadata, checksum))

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, crc: int | None = None,
                          reread: bool = False) -> tuple[str, int]:
        return await self._attempt("UploadPart", key, lambda: self.inner.upload_part(
            key, upload_id, number, fd, start, size, crc, reread))

    async def copy_part(self, key: str, upload_id: str, number: int, src: str,
                        start: int, end: int) -> str:
        return await self._attempt("UploadPartCopy", key, lambda: self.inner.copy_part(
            key, upload_id, number, src, start, end))

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None) -> str:
        return await self._attempt("CompleteMultipartUpload", key,
                                   lambda: self.inner.complete_multipart(key, upload_id, parts, crc))

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._attempt("AbortMultipartUpload", key,
                            lambda: self.inner.abort_multipart(key, upload_id))

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        return await self._attempt("ListParts", key, lambda: self.inner.list_parts(key, upload_id))

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return await self._attempt("ListMultipartUploads", prefix,
                                   lambda: self.inner.list_uploads(prefix))

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   content_type: str | None = None) -> str:
        return await self._attempt("COPY", dst,
                                   lambda: self.inner.copy(src, dst, metadata, content_type))

    async def delete_many(self, keys: list[str]) -> None:
        await self._attempt("DELETE", keys, lambda: self.inner.delete_many(keys))


class MemoryS3(Bucket):
    """Bucket over Faults over a MemoryStore: the S3 of unit tests and in-process mounts."""

    def __init__(self, policy: RetryPolicy | None = None, timeout: float = 5.0) -> None:
        self.store = MemoryStore()
        self.faults = Faults(self.store)
        super().__init__(self.faults, policy, timeout)
        self.requests = self.faults.requests
        self.objects, self.etags, self.meta = self.store.objects, self.store.etags, self.store.meta
        self.content_types, self.uploads = self.store.content_types, self.store.uploads
        self.initiated = self.store.initiated
        self.visible, self.part_crcs = self.store.visible, self.store.part_crcs

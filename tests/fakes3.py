"""An in-memory S3 for unit tests of retry, ordering and fault logic (never end to end).

`MemoryS3` implements ckptfs.s3types.S3 over dicts, with the semantics the components rely
on: every request is retried by the one retry policy while its fault is transient, part
CRC32s are checked like a server does, CompleteMultipartUpload of an unknown upload is
NoSuchUpload, and `visible` lists every change a reader of the bucket could see, in order.

Faults are injected per attempt, so they go through the same retries as real ones:
- `faults.fail(op, key=..., times=..., status=...)`: the next `times` attempts of `op`
  (on `key`, if given) fail with that status (503: transient; 403: permanent);
- `faults.lose_answer(op)`: the request takes effect, then its answer is lost (a reset);
- `part_gate`: a threading.Event every UploadPart waits for (parts that crawl);
- `fail_puts` / `fail_for[key]`: PutObject of any key / of `key` answers 503 that many times.
`requests` records (op, key) of every attempt.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from ckptfs.bodies import scatter
from ckptfs.checksum import b64_crc32, crc32, crc32_of_parts
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.retry import RetryPolicy
from ckptfs.s3types import ListPage, ObjectInfo, is_marked, needs_mark

T = TypeVar("T")


@dataclass
class _Rule:
    op: str
    key: str | None
    times: int
    status: int
    code: str
    lose_answer: bool = False


class Faults:
    def __init__(self) -> None:
        self.rules: list[_Rule] = []

    def fail(self, op: str, key: str | None = None, times: int = 1, status: int = 503,
             code: str = "") -> None:
        code = code or {503: "SlowDown", 500: "InternalError", 403: "AccessDenied",
                        400: "BadDigest"}.get(status, str(status))
        self.rules.append(_Rule(op, key, times, status, code))

    def lose_answer(self, op: str, key: str | None = None, times: int = 1) -> None:
        self.rules.append(_Rule(op, key, times, 0, "ConnectionResetError", True))

    def _take(self, op: str, key: str, after: bool) -> _Rule | None:
        for rule in self.rules:
            if rule.op == op and rule.key in (None, key) and rule.times > 0 \
                    and rule.lose_answer == after:
                rule.times -= 1
                return rule
        return None

    def before(self, op: str, key: str) -> None:
        rule = self._take(op, key, after=False)
        if rule is not None:
            raise S3Error(f"{op} {key}: {rule.code}", rule.code, rule.status)

    def after(self, op: str, key: str) -> None:
        if self._take(op, key, after=True) is not None:
            raise S3Error(f"{op} {key}: connection reset", "ConnectionResetError", None, True)


class MemoryS3:
    def __init__(self, policy: RetryPolicy | None = None, timeout: float = 5.0) -> None:
        self.limiter = trio.CapacityLimiter(16)
        self.policy = policy or RetryPolicy()
        self.timeout = timeout
        self.faults = Faults()
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.meta: dict[str, dict[str, str]] = {}
        self.content_types: dict[str, str] = {}  # what HEAD answers; set by tests
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}  # id -> (key, parts)
        self.initiated: dict[str, float] = {}
        self.visible: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str]] = []
        self.part_gate = threading.Event()
        self.part_crcs: list[tuple[int, int | None]] = []  # (part number, CRC32 the caller gave)
        self.part_gate.set()
        self.fail_puts = 0
        self.fail_for: dict[str, int] = {}
        self._n = 0

    async def _request(self, op: str, key: str, deadline: float | None,
                       effect: Callable[[], T], thread: bool = False) -> T:
        def attempt_sync() -> T:
            self.requests.append((op, key))
            self.faults.before(op, key)
            result = effect()
            self.faults.after(op, key)
            return result

        async def attempt() -> T:
            if thread:
                return await trio.to_thread.run_sync(attempt_sync, limiter=self.limiter)
            await trio.lowlevel.checkpoint()
            return attempt_sync()
        if deadline is None:
            deadline = trio.current_time() + self.timeout
        return await self.policy.call(f"{op} {key}", deadline, attempt)

    def _store(self, key: str, data: bytes, metadata: dict[str, str] | None, how: str,
               etag: str) -> str:
        self.objects[key] = bytes(data)
        self.etags[key] = etag
        self.meta[key] = dict(metadata or {})
        self.visible.append((how, key))
        return etag

    # ----- reads and listings ---------------------------------------------------

    async def head(self, key: str, checksum: bool = False, deadline: float | None = None) -> ObjectInfo:
        def effect() -> ObjectInfo:
            if key not in self.objects:
                raise NoSuchKey(key)
            data = self.objects[key]
            return ObjectInfo(key, len(data), self.etags[key], 0.0, dict(self.meta[key]),
                              b64_crc32(crc32(data)), self.content_types.get(key))
        return await self._request("HEAD", key, deadline, effect)

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000, start_after: str | None = None
                        ) -> tuple[ListPage, str | None]:
        def effect() -> tuple[ListPage, str | None]:
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
        return await self._request("LIST", prefix, None, effect)

    async def list_pages(self, prefix: str, delimiter: str = "/") -> AsyncIterator[ListPage]:
        token: str | None = None
        while True:
            page, token = await self.list_page(prefix, token, delimiter)
            yield page
            if token is None:
                return

    async def list_keys(self, prefix: str) -> list[ObjectInfo]:
        return [o async for page in self.list_pages(prefix, "") for o in page.objects]

    async def has_children(self, prefix: str) -> bool:
        return any(k != prefix for k in self.objects if k.startswith(prefix))

    async def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes:
        def effect() -> bytes:
            if key not in self.objects:
                raise NoSuchKey(key)
            if etag and self.etags[key] != etag:
                raise S3Error(f"GET {key}: PreconditionFailed", "PreconditionFailed", 412)
            return self.objects[key][start:end]
        return await self._request("GET", key, None, effect)

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        scatter(await self.get_range(key, start, start + sum(len(o) for o in outs), etag),
                outs, filled)

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        data = await self.get_range(key, start, start + sum(n for _, n in targets), etag)
        for i, (fd, n) in enumerate(targets):
            os.pwrite(fd, data[:n], 0)
            data = data[n:]
            if filled is not None:
                filled(i)
        return 0

    async def download_to(self, key: str, fd: int, size: int, chunk: int,
                          etag: str | None = None) -> None:
        os.pwrite(fd, await self.get_range(key, 0, size, etag), 0)

    # ----- writes -----------------------------------------------------------------

    async def put(self, key: str, body: bytes, metadata: dict[str, str],
                  deadline: float | None = None) -> str:
        def effect() -> str:
            if self.fail_puts or self.fail_for.get(key):
                if self.fail_for.get(key):
                    self.fail_for[key] -= 1
                else:
                    self.fail_puts -= 1
                raise S3Error("503 SlowDown", "SlowDown", 503)
            # A symlink or special file goes up as one part (s3.S3Client.put): ETag "...-1".
            return self._store(key, body, metadata, "put",
                               hashlib.md5(body).hexdigest() + ("-1" if needs_mark(metadata) else ""))
        return await self._request("PUT", key, deadline, effect)

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       deadline: float | None = None, crc: int | None = None,
                       reread: bool = False) -> tuple[str, int]:
        self.part_crcs.append((0, crc))  # part 0: a single PUT
        body = os.pread(fd, size, 0)
        if crc is not None and crc != crc32(body):
            raise S3Error(f"PUT {key}: BadDigest", "BadDigest", 400)
        return await self.put(key, body, metadata, deadline), crc32(body)

    async def create_multipart(self, key: str, metadata: dict[str, str], checksum: bool = True,
                               deadline: float | None = None) -> str:
        def effect() -> str:
            self._n += 1
            upload_id = f"u{self._n}"
            self.uploads[upload_id] = (key, {})
            self.initiated[upload_id] = time.time()
            self.meta[upload_id] = dict(metadata)
            return upload_id
        return await self._request("CreateMultipartUpload", key, deadline, effect)

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, deadline: float | None = None,
                          crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        self.part_crcs.append((number, crc))
        known = [] if crc is None else [crc]

        def effect() -> tuple[str, int]:
            self.part_gate.wait(10)
            data = os.pread(fd, size, start)
            # As S3 refuses a wrong x-amz-checksum-crc32; as s3.S3Client, a retry sends the
            # CRC32 of the file's own bytes.
            if known and known.pop() != crc32(data):
                raise S3Error(f"UploadPart {number} of {key}: BadDigest", "BadDigest", 400)
            if upload_id not in self.uploads:
                raise NoSuchKey(f"NoSuchUpload {upload_id}")
            self.uploads[upload_id][1][number] = data
            return hashlib.md5(data).hexdigest(), crc32(data)
        return await self._request("UploadPart", key, deadline, effect, thread=True)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None, deadline: float | None = None) -> str:
        def effect() -> str:
            if upload_id not in self.uploads:
                raise NoSuchKey(f"NoSuchUpload {upload_id}")
            _, have = self.uploads[upload_id]
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
        return await self._request("CompleteMultipartUpload", key, deadline, effect)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        def effect() -> None:
            if self.uploads.pop(upload_id, None) is None:
                raise NoSuchKey(upload_id)
        await self._request("AbortMultipartUpload", key, None, effect)

    async def abort_quietly(self, key: str, upload_id: str) -> bool:
        try:
            await self.abort_multipart(key, upload_id)
        except NoSuchKey:
            pass
        except S3Error:
            return False
        return True

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        def effect() -> dict[int, tuple[int, str]]:
            if upload_id not in self.uploads:
                raise NoSuchKey(upload_id)
            return {n: (len(d), hashlib.md5(d).hexdigest())
                    for n, d in self.uploads[upload_id][1].items()}
        return await self._request("ListParts", key, None, effect)

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return [(key, upload_id, self.initiated.get(upload_id, 0.0))
                for upload_id, (key, _) in self.uploads.items() if key.startswith(prefix)]

    async def copy(self, src: str, dst: str, size: int, metadata: dict[str, str] | None = None,
                   deadline: float | None = None, etag: str | None = None) -> str:
        def effect() -> str:
            if src not in self.objects:
                raise NoSuchKey(src)
            data = self.objects[src]
            # As on AWS: CopyObject makes a plain ETag; a marked source is copied in one part.
            return self._store(dst, data, metadata if metadata is not None else self.meta[src],
                               "copy", hashlib.md5(data).hexdigest() + ("-1" if is_marked(etag, size) else ""))
        return await self._request("COPY", dst, deadline, effect)

    async def delete(self, key: str, deadline: float | None = None) -> None:
        def effect() -> None:
            self.objects.pop(key, None)
            self.visible.append(("delete", key))
        await self._request("DELETE", key, deadline, effect)

    async def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            await self.delete(key)


def hold(s3: MemoryS3, op: str, until: trio.Event) -> None:
    """Every call of the method `op` waits for `until` first: a request the test times."""
    method = getattr(s3, op)

    async def held(*args: Any, **kwargs: Any) -> Any:
        await until.wait()
        return await method(*args, **kwargs)
    setattr(s3, op, held)

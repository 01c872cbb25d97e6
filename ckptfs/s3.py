"""The only module that imports boto3: a small async S3 client (s3wire.py: what crosses
botocore, translated).

boto3 blocks, so every call runs in a worker thread under one CapacityLimiter
shared by the whole mount; the connection pool is sized to that limiter.
Errors leave this module as domain exceptions (NoSuchKey, S3Error), never as
botocore types.

Every request is retried here, by the one policy of retry.py, while its error is
transient (`S3Error.retryable`): whether a request is retried depends on the request
and the error, never on the caller. The caller may pass a `deadline` (trio time: an
upload's); otherwise a request is retried for `timeout` seconds (`--upload-timeout`).
botocore's own retries are off, so attempts never multiply.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import trio

from ckptfs.bodies import FileRange, crc_of_range, send_in_pieces
from ckptfs.buffers import BufferBudget
from ckptfs.checksum import b64_crc32, crc32
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.parts import GiB
from ckptfs.retry import RetryPolicy
from ckptfs.s3types import ListPage, ObjectInfo, is_marked, needs_mark
from ckptfs.s3wire import etag_of, mapped, read_body_into, read_body_to_files, timestamp

log = logging.getLogger(__name__)

T = TypeVar("T")

# CopyObject copies at most 5 GiB; larger objects go through UploadPartCopy.
COPY_LIMIT = 5 * GiB
COPY_PART_SIZE = 1 * GiB
_DELETE_BATCH = 1000


# Over plain HTTP botocore signs a SHA-256 of every body (over HTTPS it skips that for uploads
# with a checksum). Every object and part ckptfs sends carries its CRC32 in a signed header the
# server verifies, and CompleteMultipartUpload the whole object's, so that pass only costs CPU:
# about 1 CPU s per GiB in the daemon, on a host whose cores the S3 server or training also need.
_S3_CONFIG = {"payload_signing_enabled": False}


def make_boto_client(endpoint_url: str | None, region: str | None, profile: str | None,
                     pool: int, connect_timeout: float = 5, read_timeout: float = 60,
                     max_attempts: int = 1) -> Any:
    session = boto3.session.Session(profile_name=profile)
    config = botocore.config.Config(
        max_pool_connections=pool,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        # We send a CRC32 with every body ourselves; skip boto3's extra pass over every part.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3=_S3_CONFIG | ({"addressing_style": "path"} if endpoint_url else {}),
    )
    return session.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
                          config=config)


class S3Client:
    """Async facade over one bucket. Keys passed in are full keys."""

    def __init__(self, boto_client: Any, bucket: str, limiter: trio.CapacityLimiter,
                 policy: RetryPolicy | None = None, timeout: float = 120.0,
                 bodies: BufferBudget | None = None, sendfile: bool = False) -> None:
        self._c = boto_client
        self.bucket = bucket
        self.limiter = limiter
        self.policy = policy or RetryPolicy()
        self.timeout = timeout  # how long a request without a deadline of its own is retried
        self.bodies = bodies or BufferBudget(48 << 20)  # bodies read from staged files
        # The client sends FileRange bodies with sendfile (zerocopy.py): staged bytes never
        # need a buffer, only a pass for their CRC32. Otherwise (HTTPS) botocore sends them
        # a MiB at a time from a buffer per thread (bodies.send_in_pieces).
        self.sendfile = sendfile
        if not sendfile:
            send_in_pieces(boto_client)

    async def _retried(self, what: str, deadline: float | None,
                       attempt: Callable[[], Awaitable[T]]) -> T:
        if deadline is None:
            deadline = trio.current_time() + self.timeout
        return await self.policy.call(what, deadline, attempt)

    async def _call(self, op: str, key: str, fn: Callable[..., Any], deadline: float | None = None,
                    **kwargs: Any) -> Any:
        def run() -> Any:
            with mapped(op, key):
                return fn(Bucket=self.bucket, **kwargs)
        return await self._retried(f"{op} {key}", deadline,
                                   lambda: trio.to_thread.run_sync(run, limiter=self.limiter))

    async def head(self, key: str, checksum: bool = False, deadline: float | None = None) -> ObjectInfo:
        kwargs: dict[str, Any] = {"Key": key}
        if checksum:
            kwargs["ChecksumMode"] = "ENABLED"
        r = await self._call("HEAD", key, self._c.head_object, deadline, **kwargs)
        return ObjectInfo(key, r["ContentLength"], etag_of(r), timestamp(r.get("LastModified")),
                          dict(r.get("Metadata", {})), r.get("ChecksumCRC32"), r.get("ContentType"))

    async def list_page(self, prefix: str, token: str | None, delimiter: str = "/",
                        max_keys: int = 1000, start_after: str | None = None) -> tuple[ListPage, str | None]:
        kwargs: dict[str, Any] = {"Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        if start_after:
            kwargs["StartAfter"] = start_after
        r = await self._call("LIST", prefix, self._c.list_objects_v2, **kwargs)
        objects = [ObjectInfo(o["Key"], o["Size"], etag_of(o), timestamp(o.get("LastModified")))
                   for o in r.get("Contents", [])]
        prefixes = [p["Prefix"] for p in r.get("CommonPrefixes", [])]
        nxt = r.get("NextContinuationToken") if r.get("IsTruncated") else None
        return ListPage(prefixes, objects), nxt

    async def list_pages(self, prefix: str, delimiter: str = "/") -> AsyncIterator[ListPage]:
        token: str | None = None
        while True:
            page, token = await self.list_page(prefix, token, delimiter)
            yield page
            if not token:
                return

    async def list_keys(self, prefix: str) -> list[ObjectInfo]:
        """Every object under `prefix`, recursively."""
        out: list[ObjectInfo] = []
        async for page in self.list_pages(prefix, delimiter=""):
            out.extend(page.objects)
        return out

    async def has_children(self, prefix: str) -> bool:
        page, _ = await self.list_page(prefix, None, delimiter="/", max_keys=2)
        return any(o.key != prefix for o in page.objects) or bool(page.prefixes)

    async def get_range(self, key: str, start: int, end: int, etag: str | None = None) -> bytes:
        """Bytes [start, end) of `key`; with `etag`, fail if the object changed."""
        if end <= start:
            return b""
        buf = bytearray(end - start)
        await self.get_range_into(key, start, buf, end - start, etag)
        return bytes(buf)

    async def get_range_into(self, key: str, start: int, buf: Any, length: int,
                             etag: str | None = None) -> None:
        """Bytes [start, start + length) of `key` received straight into `buf` (a writable
        buffer): no bytes object per chunk, so no fresh pages to fault in and zero. With
        `etag`, fail if the object changed."""
        await self.get_ranges_into(key, start, [memoryview(buf)[:length]], etag)

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        """One ranged GET of the bytes from `start` that fill the buffers `outs` in order.
        `filled(i)` runs in the worker thread as soon as outs[i] is full (the rest may still
        fail). Fewer, larger GETs cost the client and the server less CPU per byte."""
        await self._get_ranges(key, start, [len(out) for out in outs], etag, filled,
                               lambda body, first, done: read_body_into(key, body, outs[first:], done))

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        """One ranged GET of the bytes from `start` written into the files `targets`
        ((fd, length): each file from its offset 0), in order; `filled(i)` as for
        get_ranges_into. Over plain HTTP the kernel splices the body from the socket into
        the files' page cache: no buffer in this process holds it. A file that cannot be
        written raises LocalWriteError (an OSError), which is never retried. Returns the bytes
        spliced."""
        spliced = [0]  # in the worker thread, attempt after attempt

        def receive(body: Any, first: int, done: Callable[[int], None]) -> None:
            spliced[0] += read_body_to_files(key, body, targets[first:], done)
        await self._get_ranges(key, start, [n for _, n in targets], etag, filled, receive)
        return spliced[0]

    async def _get_ranges(self, key: str, start: int, lengths: list[int], etag: str | None,
                          filled: Callable[[int], None] | None,
                          receive: Callable[[Any, int, Callable[[int], None]], None]) -> None:
        full = [0]  # targets filled so far, in order: a retry asks only for the rest

        def run() -> None:
            first = full[0]
            offset = start + sum(lengths[:first])
            length = sum(lengths[first:])
            kwargs: dict[str, Any] = {"Key": key, "Range": f"bytes={offset}-{offset + length - 1}"}
            if etag:
                kwargs["IfMatch"] = etag
            with mapped("GET", key):
                r = self._c.get_object(Bucket=self.bucket, **kwargs)
            if r.get("ContentLength", length) != length:
                r["Body"].close()
                raise S3Error(f"GET {key}: {r.get('ContentLength')} bytes for a range of {length}")

            def done(i: int) -> None:
                full[0] = first + i + 1
                if filled is not None:
                    filled(first + i)
            receive(r["Body"], first, done)
        await self._retried(f"GET {key}", None,
                            lambda: trio.to_thread.run_sync(run, limiter=self.limiter))

    async def download_to(self, key: str, fd: int, size: int, chunk: int, etag: str | None = None) -> None:
        """Fetch a whole object into `fd` with parallel ranged GETs, chunk bytes each."""
        async def one(start: int) -> None:
            buf = bytearray(min(chunk, size - start))
            await self.get_range_into(key, start, buf, len(buf), etag)
            await trio.to_thread.run_sync(os.pwrite, fd, buf, start)

        async with trio.open_nursery() as nursery:
            for start in range(0, size, chunk):
                nursery.start_soon(one, start)

    async def put(self, key: str, body: bytes, metadata: dict[str, str],
                  deadline: float | None = None) -> str:
        """PutObject with a CRC32 the server verifies and keeps as the object's checksum; a
        symlink or special file goes up marked (s3types.needs_mark)."""
        if needs_mark(metadata):
            return await self._put_one_part(key, body, metadata, deadline)
        r = await self._call("PUT", key, self._c.put_object, deadline, Key=key, Body=body,
                             Metadata=metadata, ChecksumCRC32=b64_crc32(crc32(body)))
        return etag_of(r)

    async def _put_one_part(self, key: str, body: bytes, metadata: dict[str, str],
                            deadline: float | None) -> str:
        """A multipart upload of one part, so that a LIST entry shows the object marked."""
        upload_id = await self.create_multipart(key, metadata, deadline=deadline)
        try:
            crc = crc32(body)
            r = await self._call("UploadPart 1", key, self._c.upload_part, deadline, Key=key,
                                 UploadId=upload_id, PartNumber=1, Body=body,
                                 ChecksumCRC32=b64_crc32(crc))
            return await self.complete_multipart(
                key, upload_id,
                [{"ETag": r["ETag"], "PartNumber": 1, "ChecksumCRC32": b64_crc32(crc)}], crc, deadline)
        except BaseException:
            with trio.CancelScope(shield=True):
                with contextlib.suppress(S3Error):
                    await self.abort_multipart(key, upload_id)
            raise

    async def create_multipart(self, key: str, metadata: dict[str, str], checksum: bool = True,
                               deadline: float | None = None) -> str:
        """With `checksum`, every part carries a CRC32 and the object gets a FULL_OBJECT CRC32."""
        kwargs: dict[str, Any] = {}
        if checksum:
            kwargs.update(ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT")
        r = await self._call("CreateMultipartUpload", key, self._c.create_multipart_upload,
                             deadline, Key=key, Metadata=metadata, **kwargs)
        return r["UploadId"]

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, deadline: float | None = None,
                          crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        """Upload bytes [start, start + size) of `fd` as part `number`, with their CRC32
        (which the server checks: a part damaged on the way is refused, and sent again).
        `crc`: their CRC32 as the writes computed it, if known; a retry reads it again from
        the file. `reread`: the bytes are in the page cache (the kernel wrote them: FUSE
        passthrough), so a pass for the CRC32 costs less than a buffer. Returns (ETag, CRC32)."""
        def send(body: Any, crc: int) -> str:
            with mapped(f"UploadPart {number}", key):
                r = self._c.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number, Body=body, ChecksumCRC32=b64_crc32(crc))
            return r["ETag"]
        return await self._send_range(f"UploadPart {number} of {key}", fd, start, size, deadline,
                                      send, crc, reread)

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       deadline: float | None = None, crc: int | None = None,
                       reread: bool = False) -> tuple[str, int]:
        """PutObject of the first `size` bytes of `fd`, with their CRC32 (`crc`, if the writes
        computed it, as for upload_part); (ETag, CRC32)."""
        def send(body: Any, crc: int) -> str:
            with mapped("PUT", key):
                r = self._c.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=metadata,
                                       ChecksumCRC32=b64_crc32(crc))
            return etag_of(r)
        return await self._send_range(f"PUT {key}", fd, 0, size, deadline, send, crc, reread)

    async def _send_range(self, what: str, fd: int, start: int, size: int,
                          deadline: float | None,
                          send: Callable[[Any, int], str],
                          known_crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        """Send bytes [start, start + size) of `fd` with `send(body, crc)` in a worker thread,
        retried. The body is a view of the file (sent with sendfile over plain HTTP, else a
        MiB at a time) where the client sends with sendfile, where `known_crc` gives its
        CRC32 (the writes computed it: no pass is needed for it on the first attempt; a
        server that refuses it gets the file's own CRC32 on the retry), and for a body
        larger than the whole memory budget, or `reread`; those take a first pass for their CRC32.
        Otherwise (HTTPS, a CRC32 not known) the bytes are read once into a buffer of the
        budget, then checksummed and sent from it."""
        known = [] if known_crc is None else [known_crc]
        def from_buffer(buf: bytearray) -> tuple[str, int]:
            if os.preadv(fd, [buf], start) != size:
                raise S3Error("the staged file is shorter than its recorded size", retryable=False)
            crc = crc32(buf)
            return send(buf, crc), crc

        def streamed() -> tuple[str, int]:
            crc = known.pop() if known else crc_of_range(fd, start, size)
            return send(FileRange(fd, start, size), crc), crc

        if self.sendfile or known or reread or not self.bodies.fits(size):
            return await self._retried(what, deadline, lambda: trio.to_thread.run_sync(
                streamed, limiter=self.limiter))
        async with self.bodies.borrow(size) as buf:
            return await self._retried(what, deadline, lambda: trio.to_thread.run_sync(
                from_buffer, buf, limiter=self.limiter))

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None, deadline: float | None = None) -> str:
        kwargs: dict[str, Any] = {}
        if crc is not None:
            kwargs.update(ChecksumCRC32=b64_crc32(crc), ChecksumType="FULL_OBJECT")
        r = await self._call("CompleteMultipartUpload", key, self._c.complete_multipart_upload,
                             deadline, Key=key, UploadId=upload_id,
                             MultipartUpload={"Parts": parts}, **kwargs)
        return etag_of(r)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._call("AbortMultipartUpload", key, self._c.abort_multipart_upload,
                         Key=key, UploadId=upload_id)

    async def abort_quietly(self, key: str, upload_id: str) -> bool:
        """Abort a multipart upload; True once it is gone (now, or already before). A refusal
        is logged, and the upload stays for the next mount's sweep."""
        try:
            await self.abort_multipart(key, upload_id)
        except NoSuchKey:
            pass
        except S3Error as exc:
            log.warning("could not abort the multipart upload of %s: %s", key, exc)
            return False
        return True

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """Part number -> (size, ETag) of every part S3 holds for the multipart upload."""
        out: dict[int, tuple[int, str]] = {}
        marker = 0
        while True:
            r = await self._call("ListParts", key, self._c.list_parts, Key=key, UploadId=upload_id,
                                 PartNumberMarker=marker)
            for p in r.get("Parts", []):
                out[int(p["PartNumber"])] = (int(p["Size"]), p.get("ETag", ""))
            if not r.get("IsTruncated"):
                return out
            marker = int(r.get("NextPartNumberMarker") or 0)
            if not marker:
                return out

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """(key, upload id, initiated as a Unix time) of every open multipart upload under `prefix`."""
        out: list[tuple[str, str, float]] = []
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            r = await self._call("ListMultipartUploads", prefix, self._c.list_multipart_uploads,
                                 **kwargs)
            for u in r.get("Uploads", []):
                out.append((u["Key"], u["UploadId"], timestamp(u.get("Initiated"))))
            if not r.get("IsTruncated"):
                return out
            kwargs.update(KeyMarker=r.get("NextKeyMarker", ""),
                          UploadIdMarker=r.get("NextUploadIdMarker", ""))

    async def copy(self, src: str, dst: str, size: int, metadata: dict[str, str] | None = None,
                   deadline: float | None = None, etag: str | None = None) -> str:
        """Server-side copy, returning the new ETag; `metadata` replaces the source's when given.
        A marked source (its `etag`, s3types.is_marked) is copied in one part: CopyObject
        would give the copy a plain ETag, and listings would take a symlink for a file."""
        if size <= COPY_LIMIT and not is_marked(etag, size):
            kwargs: dict[str, Any] = {"Key": dst, "CopySource": {"Bucket": self.bucket, "Key": src}}
            if metadata is not None:
                kwargs.update(MetadataDirective="REPLACE", Metadata=metadata)
            r = await self._call("COPY", dst, self._c.copy_object, deadline, **kwargs)
            return etag_of(r.get("CopyObjectResult", {}))
        if metadata is None:
            metadata = (await self.head(src)).metadata
        upload_id = await self.create_multipart(dst, metadata, checksum=False)
        try:
            parts: list[dict[str, Any]] = []

            async def one(number: int, start: int) -> None:
                end = min(start + COPY_PART_SIZE, size) - 1
                ranged = {"CopySourceRange": f"bytes={start}-{end}"} if size else {}  # (empty)
                r = await self._call("UploadPartCopy", dst, self._c.upload_part_copy, Key=dst,
                                     UploadId=upload_id, PartNumber=number,
                                     CopySource={"Bucket": self.bucket, "Key": src}, **ranged)
                parts.append({"ETag": r["CopyPartResult"]["ETag"], "PartNumber": number})

            async with trio.open_nursery() as nursery:
                for i, start in enumerate(range(0, size, COPY_PART_SIZE) or [0]):
                    nursery.start_soon(one, i + 1, start)
            parts.sort(key=lambda p: p["PartNumber"])
            return await self.complete_multipart(dst, upload_id, parts)
        except BaseException:
            with trio.CancelScope(shield=True):
                with contextlib.suppress(S3Error):
                    await self.abort_multipart(dst, upload_id)
            raise

    async def delete(self, key: str, deadline: float | None = None) -> None:
        await self._call("DELETE", key, self._c.delete_object, deadline, Key=key)

    async def delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i:i + _DELETE_BATCH]
            r = await self._call("DeleteObjects", batch[0], self._c.delete_objects,
                                 Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            if r.get("Errors"):
                first = r["Errors"][0]
                raise S3Error(f"DELETE {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}")



def preflight(endpoint_url: str | None, region: str | None, profile: str | None,
              bucket: str, prefix: str) -> None:
    """Check, before mounting, that the bucket is reachable with these credentials.

    Raises MountError with a one-line reason that never contains a secret.
    """
    from ckptfs.errors import MountError

    where = endpoint_url or "the default AWS endpoint"
    try:
        if boto3.session.Session(profile_name=profile).get_credentials() is None:
            raise botocore.exceptions.NoCredentialsError()
        client = make_boto_client(endpoint_url, region, profile, pool=1, connect_timeout=3,
                                  read_timeout=10, max_attempts=2)
        client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except botocore.exceptions.ProfileNotFound:
        raise MountError(f"AWS profile {profile!r} not found") from None
    except botocore.exceptions.NoCredentialsError:
        raise MountError("no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                         "--profile, or use an instance role)") from None
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
            botocore.exceptions.ReadTimeoutError):
        raise MountError(f"cannot reach the S3 endpoint {where}") from None
    except ValueError as exc:  # e.g. a malformed endpoint URL
        raise MountError(f"invalid S3 endpoint {endpoint_url!r}: {exc}") from None
    except botocore.exceptions.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            raise MountError(f"bucket {bucket!r} does not exist at {where}") from None
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                    "InvalidToken", "ExpiredToken") or status in (401, 403):
            raise MountError(f"access to s3://{bucket}/{prefix} denied ({code or status}): "
                             "check the credentials") from None
        raise MountError(f"S3 check of s3://{bucket}/{prefix} failed: {code or status}") from None
    except botocore.exceptions.BotoCoreError as exc:
        raise MountError(f"S3 check of s3://{bucket}/{prefix} failed: {exc}") from None

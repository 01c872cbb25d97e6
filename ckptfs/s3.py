"""The only module that imports boto3: the primitives of the S3 seam (s3types.S3) over one
bucket (s3wire.py: what crosses botocore, translated).

boto3 blocks, so every call runs in a worker thread under one CapacityLimiter
shared by the whole mount; the connection pool is sized to that limiter.
Errors leave this module as domain exceptions (NoSuchKey, S3Error with `retryable`), never
as botocore types. Each call is one attempt: bucket.Bucket retries them, and botocore's own
retries are off, so attempts never multiply.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import trio

from ckptfs.bodies import FileRange, crc_of_range, send_in_pieces
from ckptfs.buffers import BufferBudget
from ckptfs.checksum import b64_crc32, crc32
from ckptfs.errors import S3Error
from ckptfs.retry import remaining
from ckptfs.s3types import ListPage, ObjectInfo
from ckptfs.s3wire import etag_of, mapped, read_body_into, read_body_to_files, timestamp

log = logging.getLogger(__name__)

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
    client = session.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
                            config=config)
    client.meta.events.register("before-send.s3", functools.partial(_bounded, read_timeout))
    return client


def _bounded(read_timeout: float, request: Any, **_: Any) -> None:
    """The request's socket timeouts end at its attempt's deadline (retry.attempt_deadline):
    a hung server is given up on then, whatever the client's read timeout says. (botocore
    takes a read timeout from the request's context; its connect timeout stays its own, a
    few seconds.)"""
    context = getattr(request, "context", None)
    left = remaining()
    if isinstance(context, dict) and left is not None:
        context["read_timeout"] = min(read_timeout, left)


class S3Client:
    """The primitives over one bucket, one attempt each. Keys passed in are full keys."""

    def __init__(self, boto_client: Any, bucket: str, limiter: trio.CapacityLimiter,
                 bodies: BufferBudget | None = None, sendfile: bool = False) -> None:
        self._c = boto_client
        self.bucket = bucket
        self.limiter = limiter
        self.bodies = bodies or BufferBudget(48 << 20)  # bodies read from staged files
        # The client sends FileRange bodies with sendfile (zerocopy.py): staged bytes never
        # need a buffer, only a pass for their CRC32. Otherwise (HTTPS) botocore sends them
        # a MiB at a time from a buffer per thread (bodies.send_in_pieces).
        self.sendfile = sendfile
        if not sendfile:
            send_in_pieces(boto_client)

    async def _call(self, op: str, key: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        def run() -> Any:
            with mapped(op, key):
                return fn(Bucket=self.bucket, **kwargs)
        return await trio.to_thread.run_sync(run, limiter=self.limiter)

    async def head(self, key: str, checksum: bool = False) -> ObjectInfo:
        kwargs: dict[str, Any] = {"Key": key}
        if checksum:
            kwargs["ChecksumMode"] = "ENABLED"
        r = await self._call("HEAD", key, self._c.head_object, **kwargs)
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

    async def get_ranges_into(self, key: str, start: int, outs: list[memoryview],
                              etag: str | None = None,
                              filled: Callable[[int], None] | None = None) -> None:
        await self._get_ranges(key, start, sum(len(out) for out in outs), etag, filled,
                               lambda body, done: read_body_into(key, body, outs, done))

    async def get_ranges_to_files(self, key: str, start: int, targets: list[tuple[int, int, int]],
                                  etag: str | None = None,
                                  filled: Callable[[int], None] | None = None) -> int:
        """Over plain HTTP the kernel splices the body from the socket into the files' page
        cache: no buffer in this process holds it. A file that cannot be written raises
        LocalWriteError (an OSError), which is never retried."""
        spliced = [0]

        def receive(body: Any, done: Callable[[int], None]) -> None:
            spliced[0] = read_body_to_files(key, body, targets, done)
        await self._get_ranges(key, start, sum(n for _, n, _ in targets), etag, filled, receive)
        return spliced[0]

    async def _get_ranges(self, key: str, start: int, length: int, etag: str | None,
                          filled: Callable[[int], None] | None,
                          receive: Callable[[Any, Callable[[int], None]], None]) -> None:
        def run() -> None:
            kwargs: dict[str, Any] = {"Key": key, "Range": f"bytes={start}-{start + length - 1}"}
            if etag:
                kwargs["IfMatch"] = etag
            with mapped("GET", key):
                r = self._c.get_object(Bucket=self.bucket, **kwargs)
            if r.get("ContentLength", length) != length:
                r["Body"].close()
                raise S3Error(f"GET {key}: {r.get('ContentLength')} bytes for a range of {length}")
            receive(r["Body"], filled or (lambda i: None))
        await trio.to_thread.run_sync(run, limiter=self.limiter)

    async def create_multipart(self, key: str, metadata: dict[str, str],
                               checksum: bool = True) -> str:
        kwargs: dict[str, Any] = {}
        if checksum:
            kwargs.update(ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT")
        r = await self._call("CreateMultipartUpload", key, self._c.create_multipart_upload,
                             Key=key, Metadata=metadata, **kwargs)
        return r["UploadId"]

    async def upload_part(self, key: str, upload_id: str, number: int, fd: int, start: int,
                          size: int, crc: int | None = None,
                          reread: bool = False) -> tuple[str, int]:
        def send(body: Any, crc: int) -> str:
            with mapped(f"UploadPart {number}", key):
                r = self._c.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number, Body=body, ChecksumCRC32=b64_crc32(crc))
            return r["ETag"]
        return await self._send_range(fd, start, size, send, crc, reread)

    async def put_file(self, key: str, fd: int, size: int, metadata: dict[str, str],
                       crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        def send(body: Any, crc: int) -> str:
            with mapped("PUT", key):
                r = self._c.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=metadata,
                                       ChecksumCRC32=b64_crc32(crc))
            return etag_of(r)
        return await self._send_range(fd, 0, size, send, crc, reread)

    async def _send_range(self, fd: int, start: int, size: int, send: Callable[[Any, int], str],
                          known_crc: int | None = None, reread: bool = False) -> tuple[str, int]:
        """Send bytes [start, start + size) of `fd` with `send(body, crc)` in a worker thread.
        The body is a view of the file (sent with sendfile over plain HTTP, else a MiB at a
        time) where the client sends with sendfile, where `known_crc` gives its CRC32 (the
        writes computed it: no pass is needed for it), and for a body larger than the whole
        memory budget, or `reread`; those without a known CRC32 take a first pass for it.
        Otherwise (HTTPS, a CRC32 not known) the bytes are read once into a buffer of the
        budget, then checksummed and sent from it."""
        def from_buffer(buf: bytearray) -> tuple[str, int]:
            if os.preadv(fd, [buf], start) != size:
                raise S3Error("the staged file is shorter than its recorded size", retryable=False)
            crc = crc32(buf)
            return send(buf, crc), crc

        def streamed() -> tuple[str, int]:
            crc = crc_of_range(fd, start, size) if known_crc is None else known_crc
            return send(FileRange(fd, start, size), crc), crc

        if self.sendfile or known_crc is not None or reread or not self.bodies.fits(size):
            return await trio.to_thread.run_sync(streamed, limiter=self.limiter)
        async with self.bodies.borrow(size) as buf:
            return await trio.to_thread.run_sync(from_buffer, buf, limiter=self.limiter)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                                 crc: int | None = None) -> str:
        kwargs: dict[str, Any] = {}
        if crc is not None:
            kwargs.update(ChecksumCRC32=b64_crc32(crc), ChecksumType="FULL_OBJECT")
        r = await self._call("CompleteMultipartUpload", key, self._c.complete_multipart_upload,
                             Key=key, UploadId=upload_id,
                             MultipartUpload={"Parts": parts}, **kwargs)
        return etag_of(r)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._call("AbortMultipartUpload", key, self._c.abort_multipart_upload,
                         Key=key, UploadId=upload_id)

    async def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
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

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None,
                   content_type: str | None = None) -> str:
        kwargs: dict[str, Any] = {"Key": dst, "CopySource": {"Bucket": self.bucket, "Key": src}}
        if metadata is not None:
            kwargs.update(MetadataDirective="REPLACE", Metadata=metadata)
            if content_type is not None:
                kwargs["ContentType"] = content_type
        r = await self._call("COPY", dst, self._c.copy_object, **kwargs)
        return etag_of(r.get("CopyObjectResult", {}))

    async def copy_part(self, key: str, upload_id: str, number: int, src: str,
                        start: int, end: int) -> str:
        ranged = {"CopySourceRange": f"bytes={start}-{end - 1}"} if end > start else {}
        r = await self._call(f"UploadPartCopy {number}", key, self._c.upload_part_copy, Key=key,
                             UploadId=upload_id, PartNumber=number,
                             CopySource={"Bucket": self.bucket, "Key": src}, **ranged)
        return r["CopyPartResult"]["ETag"]

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

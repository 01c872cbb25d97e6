"""Parts and objects sent with sendfile over plain HTTP (zerocopy.py), against the real server.

Through the fault proxy where a fault is needed: the server checks every body's CRC32, so a
byte damaged on the way is refused and sent again; a reset connection is retried; a staged
file shorter than its record is never sent as if whole.
"""

from __future__ import annotations

import os
import tempfile
import zlib

import pytest
import trio

from conftest import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server
from faultproxy import FaultProxy

from ckptfs.checksum import b64_crc32
from ckptfs.errors import S3Error, UploadError
from ckptfs.retry import RetryPolicy
from ckptfs.s3 import S3Client, make_boto_client
from ckptfs.zerocopy import SendfileSender

MiB = 1024 * 1024


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


def client(endpoint: str, timeout: float = 20) -> tuple[S3Client, SendfileSender]:
    boto = make_boto_client(endpoint, None, None, pool=8)
    sender = SendfileSender(endpoint, timeout=10)
    sender.install(boto)
    return S3Client(boto, BUCKET, trio.CapacityLimiter(8), RetryPolicy(), timeout=timeout,
                    sendfile=True), sender


def staged(data: bytes):
    f = tempfile.TemporaryFile()
    f.write(data)
    f.flush()
    return f


def test_only_plain_http_endpoints_send_with_sendfile() -> None:
    assert SendfileSender.applies("http://127.0.0.1:8333")
    assert not SendfileSender.applies("https://s3.example.com")
    assert not SendfileSender.applies(None)


def test_parts_and_objects_go_up_whole_and_checked(s3_server: S3Server, s3, prefix: str,
                                                   credentials: None) -> None:
    c, sender = client(s3_server.endpoint)
    data = os.urandom(11 * MiB + 123)
    key, small = f"{prefix}/multi.bin", f"{prefix}/small.bin"

    async def main() -> None:
        with staged(data) as f:
            upload_id = await c.create_multipart(key, {"mode": "33188"})
            parts = []
            for n, start in enumerate(range(0, len(data), 5 * MiB), 1):
                size = min(5 * MiB, len(data) - start)
                etag, crc = await c.upload_part(key, upload_id, n, f.fileno(), start, size)
                assert crc == zlib.crc32(data[start:start + size])
                parts.append({"ETag": etag, "PartNumber": n, "ChecksumCRC32": b64_crc32(crc)})
            await c.complete_multipart(key, upload_id, parts, zlib.crc32(data))
            etag, crc = await c.put_file(small, f.fileno(), 1000, {"mode": "33188"})
            assert etag and crc == zlib.crc32(data[:1000])
            assert (await c.head(small)).metadata["mode"] == "33188"
    trio.run(main)
    assert sender.sent == 4  # three parts and one object, none through botocore's sender
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    assert s3.get_object(Bucket=BUCKET, Key=small)["Body"].read() == data[:1000]


def test_a_damaged_body_is_refused_and_a_reset_retried(s3_server: S3Server, s3, prefix: str,
                                                      credentials: None) -> None:
    data = os.urandom(3 * MiB)
    key = f"{prefix}/faults.bin"
    with FaultProxy(s3_server.endpoint) as proxy:
        c, sender = client(proxy.endpoint)
        proxy.corrupt_parts = 1  # one byte flipped in the first body: its CRC32 fails

        async def main() -> None:
            with staged(data) as f:
                await c.put_file(key, f.fileno(), len(data), {})
                proxy.rates["reset"] = 0.5
                proxy.fault_methods = {"PUT"}
                for _ in range(4):
                    await c.put_file(key, f.fileno(), len(data), {})
        trio.run(main)
        assert proxy.corrupted == 1 and proxy.injected["reset"] > 0
        assert c.policy.retries >= 1 + proxy.injected["reset"]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data


def test_a_staged_file_shorter_than_its_record_is_never_sent(s3_server: S3Server, s3,
                                                             prefix: str, credentials: None) -> None:
    c, sender = client(s3_server.endpoint, timeout=5)
    key = f"{prefix}/short.bin"

    async def main() -> None:
        with staged(os.urandom(MiB)) as f:
            with pytest.raises((S3Error, UploadError), match="shorter than its recorded size"):
                await c.put_file(key, f.fileno(), 2 * MiB, {})
    trio.run(main)
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=key)

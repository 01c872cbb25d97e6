"""Streaming multipart: parts go up while the file is written, rewrites are resent, checksums hold."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import subprocess
import sys
import time

import pytest

from conftest import BUCKET, Mounter, run_ckptfs, s3_bytes, s3_keys

MiB = 1024 * 1024


_libc = ctypes.CDLL(None, use_errno=True)
SYNC_FILE_RANGE_WRITE = 2


def hand_over(f) -> None:
    """Make the kernel pass this file's dirty pages to the daemon now, without fsync.

    With the writeback cache the kernel holds a few tens of MiB before it writes back on
    its own; a large checkpoint streams without this, a small test file needs the nudge.
    """
    f.flush()
    if _libc.sync_file_range(f.fileno(), ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "sync_file_range")


def open_uploads(s3, prefix: str) -> list[dict]:
    return s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def wait_for_parts(s3, prefix: str, key: str, count: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        for up in open_uploads(s3, prefix):
            if up["Key"] == key:
                parts = s3.list_parts(Bucket=BUCKET, Key=key, UploadId=up["UploadId"]).get("Parts", [])
                numbers = sorted(p["PartNumber"] for p in parts)
                if len(numbers) >= count:
                    return numbers
        assert time.monotonic() < deadline, f"fewer than {count} parts of {key} went up before close"
        time.sleep(0.1)


def test_parts_go_up_before_close(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB")
    data = os.urandom(23 * MiB)
    key = f"{prefix}/stream.bin"
    with open(mnt.path / "stream.bin", "wb") as f:
        f.write(data[:16 * MiB])
        hand_over(f)
        numbers = wait_for_parts(s3, prefix, key, 3)
        assert numbers[:3] == [1, 2, 3]
        assert key not in s3_keys(s3, prefix)  # nothing under the final key before close
        f.write(data[16 * MiB:])
    assert hashlib.sha256(s3_bytes(s3, key)).digest() == hashlib.sha256(data).digest()
    assert open_uploads(s3, prefix) == []
    head = s3.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32")  # the object's full CRC32 is recorded by S3


def test_async_mode_streams_parts_and_its_put_completes_that_upload(proxied, s3, prefix: str) -> None:
    """In async mode too, parts go up while the file is written; the ordered log's put takes
    that multipart upload over at close and sends only what is missing."""
    proxy, mounter = proxied
    mnt = mounter("--durability", "async", "--part-size", "5MiB")
    sent: list[tuple[str, str]] = []
    proxy.fail_when = lambda method, path: bool(sent.append((method, path)))  # fails nothing
    data = os.urandom(23 * MiB)
    key = f"{prefix}/stream.bin"
    with open(mnt.path / "stream.bin", "wb") as f:
        f.write(data[:16 * MiB])
        hand_over(f)
        assert wait_for_parts(s3, prefix, key, 3)[:3] == [1, 2, 3]
        f.write(data[16 * MiB:])
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert hashlib.sha256(s3_bytes(s3, key)).digest() == hashlib.sha256(data).digest()
    assert open_uploads(s3, prefix) == []
    parts = [path for method, path in sent if method == "PUT" and "partNumber=" in path]
    assert len(parts) == 5  # each part sent once
    assert len([path for method, path in sent if method == "POST" and "uploads" in path
                and "uploadId=" not in path]) == 1


def test_rewritten_part_is_uploaded_again(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB")
    data = bytearray(os.urandom(17 * MiB))
    key = f"{prefix}/rw.bin"
    with open(mnt.path / "rw.bin", "wb") as f:
        f.write(data[:12 * MiB])
        hand_over(f)
        wait_for_parts(s3, prefix, key, 2)
        f.seek(100)  # rewrite inside part 1, which is already in S3
        f.write(b"R" * 5000)
        data[100:5100] = b"R" * 5000
        f.seek(12 * MiB)
        f.write(data[12 * MiB:])
    assert s3_bytes(s3, key) == bytes(data)


def test_truncate_and_regrow_after_parts_went_up(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB")
    key = f"{prefix}/tr.bin"
    first = os.urandom(12 * MiB)
    with open(mnt.path / "tr.bin", "wb") as f:
        f.write(first)
        hand_over(f)
        wait_for_parts(s3, prefix, key, 2)
        f.truncate(3 * MiB)
        f.seek(11 * MiB)
        f.write(b"end")  # the gap reads as zeros
    assert s3_bytes(s3, key) == first[:3 * MiB] + b"\0" * (8 * MiB) + b"end"
    # a big file cut down to one small part
    with open(mnt.path / "tr.bin", "r+b") as f:
        f.truncate(10)
    assert s3_bytes(s3, key) == first[:10]
    assert open_uploads(s3, prefix) == []


def test_unlink_of_an_open_streaming_file_aborts_its_upload(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB")
    with open(mnt.path / "gone.bin", "wb") as f:
        f.write(os.urandom(11 * MiB))
        hand_over(f)
        wait_for_parts(s3, prefix, f"{prefix}/gone.bin", 1)
        os.unlink(mnt.path / "gone.bin")
        assert open_uploads(s3, prefix) == []
    assert s3_keys(s3, prefix) == []


def test_corrupted_part_is_rejected_and_sent_again(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter("--part-size", "5MiB", "--upload-timeout", "5")
    data = os.urandom(16 * MiB)
    proxy.corrupt_parts = 2
    (mnt.path / "c.bin").write_bytes(data)
    assert proxy.corrupted == 2
    assert s3_bytes(s3, f"{prefix}/c.bin") == data
    assert "BadDigest" in mnt.log and "retrying" in mnt.log
    # The bodies go without a SHA-256 signature: the CRC32 alone caught the corruption.
    assert proxy.put_sha256["UNSIGNED-PAYLOAD"] >= 4 and proxy.put_sha256["signed"] == 0
    # A small file is one PUT, checked the same way.
    proxy.corrupt_parts = 1
    (mnt.path / "small.bin").write_bytes(data[:1000])
    assert proxy.corrupted == 3
    assert s3_bytes(s3, f"{prefix}/small.bin") == data[:1000]
    # Corruption that does not stop: close fails and no corrupt object is ever completed;
    # the file keeps retrying in the background and is delivered once the path is clean.
    proxy.corrupt_parts = 10**6
    f = open(mnt.path / "never.bin", "wb")
    later = os.urandom(11 * MiB)
    f.write(later)
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.EIO
    assert f"{prefix}/never.bin" not in s3_keys(s3, prefix)
    proxy.corrupt_parts = 0
    r = run_ckptfs("sync", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert s3_bytes(s3, f"{prefix}/never.bin") == later
    assert open_uploads(s3, prefix) == []


WRITER = """
import hashlib, os, sys
path, seed = sys.argv[1], int(sys.argv[2])
data = hashlib.sha256(str(seed).encode()).digest() * (13 * 1024 * 1024 // 32)
with open(path, "wb") as f:
    for i in range(0, len(data), 1 << 20):
        f.write(data[i:i + (1 << 20)])
print(hashlib.sha256(data).hexdigest())
"""


def test_eight_concurrent_writers_share_the_upload_budget(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB", "--concurrency", "4")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(mnt.path / f"shard_{i}.pt"), str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(8)]
    digests = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for i, digest in enumerate(digests):
        assert hashlib.sha256(s3_bytes(s3, f"{prefix}/shard_{i}.pt")).hexdigest() == digest
        # reading a file back while others upload works too
        assert hashlib.sha256((mnt.path / f"shard_{i}.pt").read_bytes()).hexdigest() == digest
    assert open_uploads(s3, prefix) == []


def test_parts_larger_than_the_in_memory_limit_stream_from_the_staging_file(
        mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "40MiB")  # above the 32 MiB in-memory limit: FileRange bodies
    data = os.urandom(90 * MiB)
    (mnt.path / "large-parts.bin").write_bytes(data)
    key = f"{prefix}/large-parts.bin"
    assert hashlib.sha256(s3_bytes(s3, key)).digest() == hashlib.sha256(data).digest()
    head = s3.head_object(Bucket=BUCKET, Key=key, PartNumber=1)
    assert head["ContentLength"] == 40 * MiB


def test_parts_larger_than_the_upload_memory_stream_from_the_staged_file(mounter: Mounter, s3,
                                                                         prefix: str) -> None:
    """With --upload-memory below the part size, a part is not read into memory: it is sent
    from the staged file (after a first pass for its CRC32), and the object is whole."""
    mnt = mounter("--part-size", "8MiB", "--upload-memory", "5MiB")
    data = os.urandom(19 * MiB)
    (mnt.path / "big.bin").write_bytes(data)
    (mnt.path / "small.bin").write_bytes(data[:3 * MiB])  # one PUT, within the budget
    assert s3_bytes(s3, f"{prefix}/big.bin") == data
    assert s3_bytes(s3, f"{prefix}/small.bin") == data[:3 * MiB]
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/big.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32")  # the full-object CRC32 from the parts' CRC32s

"""FUSE passthrough through real mounts: the kernel writes and reads the staged file (or a
whole cached object) itself; what S3 gets is exactly what the file held at close, whatever
wrote it (random rewrites after parts were sent, mmap, truncate while open); and no open-mode
conflict of the kernel's ever reaches a user as EIO."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from conftest import BUCKET, Mount, Mounter, ckptfs_cmd, client_env, run_ckptfs, s3_bytes
from test_faults import journal_records, kill_daemon

MiB = 1024 * 1024


def status(mnt: Mount) -> dict:
    r = run_ckptfs("status", str(mnt.path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def settled(mnt: Mount, key: str, s3, want: bytes, durability: str) -> bytes:
    if durability == "async":
        r = run_ckptfs("sync", str(mnt.path))
        assert r.returncode == 0, r.stderr
    return s3_bytes(s3, key)


def wait_parts_sent(s3, key: str, at_least: int, timeout: float = 30) -> None:
    """Until S3 holds `at_least` parts of the open file's multipart upload. (Asked of S3, not
    of `ckptfs status`: a child process closes its copy of every descriptor at exec, and
    each such close is a FLUSH of the open file.)"""
    deadline = time.monotonic() + timeout
    while True:
        uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
        parts = sum(len(s3.list_parts(Bucket=BUCKET, Key=key, UploadId=u["UploadId"])
                        .get("Parts", [])) for u in uploads if u["Key"] == key)
        if parts >= at_least:
            return
        assert time.monotonic() < deadline, "no part streamed while the file was written"
        time.sleep(0.05)


@pytest.mark.parametrize("durability", ["close", "async"])
def test_what_the_kernel_wrote_is_published_exactly(mounter: Mounter, s3, prefix: str,
                                                     durability: str) -> None:
    mnt = mounter("--durability", durability, "--part-size", "5MiB", "--passthrough", "on")
    data = bytearray(os.urandom(23 * MiB + 11))
    # Parts stream from the staged file as it grows, then bytes in sent parts change.
    with open(mnt.path / "rewritten.bin", "wb") as f:
        f.write(data)
        f.flush()
        wait_parts_sent(s3, f"{prefix}/rewritten.bin", 3)
        for offset in (0, 5 * MiB - 1, 12 * MiB + 3, 23 * MiB):
            f.seek(offset)
            f.write(b"Z" * 9)
            data[offset:offset + 9] = b"Z" * 9
    assert settled(mnt, f"{prefix}/rewritten.bin", s3, data, durability) == data
    # mmap stores, after the file was closed once.
    with open(mnt.path / "rewritten.bin", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[7 * MiB:7 * MiB + 4] = b"mmap"
        data[7 * MiB:7 * MiB + 4] = b"mmap"
        m.flush()
    assert settled(mnt, f"{prefix}/rewritten.bin", s3, data, durability) == data
    # Truncated while open, below parts already sent.
    with open(mnt.path / "cut.bin", "wb") as f:
        f.write(data)
        f.flush()
        wait_parts_sent(s3, f"{prefix}/cut.bin", 3)
        f.truncate(6 * MiB + 1)
        assert os.fstat(f.fileno()).st_size == 6 * MiB + 1
    assert settled(mnt, f"{prefix}/cut.bin", s3, data[:6 * MiB + 1], durability) == data[:6 * MiB + 1]
    assert (mnt.path / "cut.bin").stat().st_size == 6 * MiB + 1
    st = status(mnt)
    assert st["passthrough"] is True and st["write_calls"] == 0  # no byte crossed the daemon
    assert st["passthrough_opens"] >= 3 and st["passthrough_fallbacks"] == 0
    assert st["parts_rechecked_changed"] >= 3  # the 3 sent parts rewritten (the cut one: SETATTR)


def test_a_reader_sees_what_the_writer_writes(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--passthrough", "on")
    data = os.urandom(9 * MiB)
    with open(mnt.path / "f.bin", "wb") as w:
        w.write(data[:4 * MiB])
        w.flush()
        with open(mnt.path / "f.bin", "rb") as r:
            assert r.read() == data[:4 * MiB]
            assert os.stat(mnt.path / "f.bin").st_size == 4 * MiB  # GETATTR asks the file
            w.write(data[4 * MiB:])
            w.flush()
            r.seek(0)
            assert r.read() == data
    assert s3_bytes(s3, f"{prefix}/f.bin") == data
    assert (mnt.path / "f.bin").read_bytes() == data
    st = status(mnt)
    assert st["passthrough_fallbacks"] == 0 and st["write_calls"] == 0


def test_a_file_read_from_s3_then_written_falls_back_without_eio(mounter: Mounter, s3,
                                                               prefix: str) -> None:
    """A cached open of the daemon's (the object is not local) makes the kernel refuse a
    passthrough open beside it: the writer gets the daemon's path instead."""
    old, new = os.urandom(3 * MiB), os.urandom(2 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/remote.bin", Body=old)
    mnt = mounter("--passthrough", "on")
    with open(mnt.path / "remote.bin", "rb") as reader:
        assert reader.read(MiB) == old[:MiB]
        with open(mnt.path / "remote.bin", "r+b") as writer:
            writer.write(new)
        assert status(mnt)["passthrough_fallbacks"] >= 1
    assert s3_bytes(s3, f"{prefix}/remote.bin") == new + old[len(new):]
    assert (mnt.path / "remote.bin").read_bytes() == new + old[len(new):]


@pytest.mark.parametrize("durability", ["close", "async"])
def test_a_writer_beside_a_reader_of_an_older_version_falls_back_without_eio(
        mounter: Mounter, s3, prefix: str, durability: str) -> None:
    """The reader's backing file is the closed version (held for the log, or the whole object
    in the read cache); the writer's bytes go elsewhere, and the kernel allows one backing
    file per inode: the writer is served by the daemon, uncached."""
    mnt = mounter("--durability", durability, "--passthrough", "on")
    first, second = os.urandom(6 * MiB), os.urandom(5 * MiB)
    (mnt.path / "f.bin").write_bytes(first)
    with open(mnt.path / "f.bin", "rb") as reader:
        assert reader.read(MiB) == first[:MiB]
        before = status(mnt)["passthrough_fallbacks"]
        with open(mnt.path / "f.bin", "wb") as writer:
            writer.write(second)
        reader.read()  # still readable: no EIO
    assert settled(mnt, f"{prefix}/f.bin", s3, second, durability) == second
    assert (mnt.path / "f.bin").read_bytes() == second
    st = status(mnt)
    assert st["passthrough_opens"] >= 2 and st["passthrough_fallbacks"] >= before


def test_a_cold_object_is_read_through_passthrough_right_after_its_first_read(
        mounter: Mounter, s3, prefix: str) -> None:
    """The cold read's chunks land in the object's own file of the cache, which is whole, and
    the inode's backing file for the next open, as soon as the last one is in: no wait for an
    assembly (issue 42: a second read right after a cold one was still the daemon's)."""
    data = os.urandom(20 * MiB + 3)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/remote.bin", Body=data)
    mnt = mounter("--passthrough", "on", "--cold-open", "stream")
    assert (mnt.path / "remote.bin").read_bytes() == data  # cold: the daemon, into the cache
    st = status(mnt)
    assert st["objects_received_whole"] == 1 and st["objects_assembled"] == 0
    assert st["opens_daemon"] == 1 and st["opens_passthrough_cached"] == 0
    assert (mnt.path / "remote.bin").read_bytes() == data
    st = status(mnt)
    assert st["opens_passthrough_cached"] == 1 and st["passthrough_fallbacks"] == 0
    assert st["bytes_read_daemon"] == len(data)


def test_a_cold_object_is_fetched_whole_at_its_first_open_then_read_by_the_kernel(
        mounter: Mounter, s3, prefix: str) -> None:
    """--cold-open whole (the default): the open waits while the whole object is fetched, at
    full parallelism, into its cache file, and passes through: the daemon never copies a
    byte of it to the reader."""
    data = os.urandom(40 * MiB + 3)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/remote.bin", Body=data)
    mnt = mounter("--passthrough", "on")
    assert (mnt.path / "remote.bin").read_bytes() == data
    st = status(mnt)
    assert st["whole_fetches"] == 1 and st["opens_passthrough_cached"] == 1
    assert st["bytes_read_daemon"] == 0 and st["fuse_requests"].get("read", 0) == 0
    assert st["bytes_downloaded"] == len(data) and st["objects_received_whole"] == 1


def test_off_uses_the_daemon_path(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--passthrough", "off")
    data = os.urandom(3 * MiB)
    (mnt.path / "f.bin").write_bytes(data)
    st = status(mnt)
    assert st["passthrough"] is False and st["passthrough_reason"] == "--passthrough off"
    assert st["write_calls"] > 0 and st["passthrough_opens"] == 0
    assert s3_bytes(s3, f"{prefix}/f.bin") == data
    r = run_ckptfs("status", str(mnt.path))
    assert "passthrough: off (--passthrough off)" in r.stdout.splitlines()


def test_on_without_cap_sys_admin_fails_the_mount_with_one_line(s3_server, tmp_path,
                                                                prefix: str) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                        *ckptfs_cmd("mount", f"s3://{BUCKET}/{prefix}", str(mnt),
                                    "--cache-dir", str(tmp_path / "cache"),
                                    "--passthrough", "on")],
                       capture_output=True, text=True, timeout=120,
                       env=client_env(s3_server.endpoint))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "ckptfs: --passthrough on: the daemon lacks CAP_SYS_ADMIN, which registering backing "
        "files needs"], r.stderr
    assert not os.path.ismount(mnt)


def test_each_fsync_of_a_file_the_kernel_writes_has_its_own_record(proxied, s3,
                                                                     prefix: str) -> None:
    """Async mode: an fsync appends a put that holds the staged file, and the kernel goes on
    writing that very file. The next put gets a copy of its own: each entry has its own staged
    file and journal record (they shared one, and the first applied took the others' away)."""
    proxy, mounter = proxied
    mnt = mounter("--durability", "async", "--part-size", "5MiB", "--passthrough", "on")
    proxy.fail_status = 503
    proxy.fail_methods = {"PUT", "POST"}  # nothing applies: every entry stays pending
    data = os.urandom(12 * MiB)
    with open(mnt.path / "f.bin", "wb") as f:
        for piece in range(3):
            f.write(data[piece * 4 * MiB:(piece + 1) * 4 * MiB])
            f.flush()
            os.fsync(f.fileno())
    puts = [r for r in journal_records(mnt.cache_dir) if r.op == "put"]
    assert sorted(r.size for r in puts) == [4 * MiB, 8 * MiB, 12 * MiB]
    assert len({r.name for r in puts}) == 3
    kill_daemon(mnt.path)  # the next mount applies them in order
    proxy.fail_methods = set()
    again = mounter("--durability", "async", path=mnt.path, cache_dir=mnt.cache_dir)
    assert s3_bytes(s3, f"{prefix}/f.bin") == data
    assert (again.path / "f.bin").read_bytes() == data
    assert list((mnt.cache_dir / "journal").iterdir()) == []


def test_a_truncate_after_fsync_does_not_wait_for_s3(proxied, s3, prefix: str) -> None:
    """Async mode: the fsync's put holds the staged file, which the kernel keeps writing for
    this handle; a truncate through it goes to that file at once (it used to wait for S3)."""
    proxy, mounter = proxied
    mnt = mounter("--durability", "async", "--part-size", "5MiB", "--passthrough", "on")
    proxy.fail_status = 503
    proxy.fail_methods = {"PUT", "POST"}  # the put stays pending
    code = r"""
import os, sys
with open(sys.argv[1], "wb") as f:
    f.write(b"a" * 3000000)
    f.flush()
    os.fsync(f.fileno())
    f.truncate(1000)
    f.write(b"b" * 10)
"""
    subprocess.run([sys.executable, "-c", code, str(mnt.path / "f.bin")], check=True, timeout=30)
    proxy.fail_methods = set()
    r = run_ckptfs("sync", str(mnt.path))
    assert r.returncode == 0, r.stderr
    want = b"a" * 1000 + b"\0" * (3000000 - 1000) + b"b" * 10
    assert s3_bytes(s3, f"{prefix}/f.bin") == want
    assert (mnt.path / "f.bin").read_bytes() == want

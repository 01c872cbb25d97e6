"""Restores through a real mount and SeaweedFS (issue 42), each three ways: the first open
of a cold object fetches it whole, then passes through (the default); the daemon streams it
from the first byte (`--cold-open stream`: its chunks land in the object's own cache file and
leave through pyfuse3's threads), then the next open passes through; and the daemon's path
alone (`--passthrough off`). Sizes are small; what matters is which bytes arrive."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import BUCKET, run_ckptfs
from test_faults import tmpfs  # noqa: F401  (a fixture)
from test_passthrough import status
from test_reads import drop_page_cache

MiB = 1024 * 1024

# (--passthrough, --cold-open)
restore_paths = pytest.mark.parametrize("passthrough,cold_open", [
    ("on", "whole"), ("on", "stream"), ("off", "whole")], ids=["whole", "stream", "daemon-path"])


@restore_paths
def test_a_reader_of_the_end_then_the_start_gets_every_byte(mounter, s3, prefix: str,
                                                            passthrough: str, cold_open: str) -> None:
    """torch.load's order: the zip's directory at the end, then the records from the start."""
    data = os.urandom(40 * MiB + 5)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ckpt.pt", Body=data)
    mnt = mounter("--passthrough", passthrough, "--cold-open", cold_open)
    whole = passthrough == "on" and cold_open == "whole"
    with open(mnt.path / "ckpt.pt", "rb", buffering=0) as f:
        assert os.pread(f.fileno(), 4096, len(data) - 4096) == data[-4096:]
        assert f.read() == data
    st = status(mnt)
    assert st["bytes_downloaded"] == len(data)  # each chunk fetched once
    if whole:  # the open waited for all of it: the kernel read it, not the daemon
        assert st["opens_passthrough_cached"] == 1 and st["whole_fetches"] == 1
        assert st["opens_daemon"] == 0 and st["bytes_read_daemon"] == 0
    else:
        assert st["opens_daemon"] == 1 and st["bytes_read_daemon"] >= len(data)
    assert (mnt.path / "ckpt.pt").read_bytes() == data  # the second read, right after
    st = status(mnt)
    if passthrough == "on":  # whole in the cache the moment its last chunk landed
        assert st["opens_passthrough_cached"] == (2 if whole else 1)
        assert st["objects_received_whole"] == 1 and st["objects_assembled"] == 0
    else:
        assert st["opens_daemon"] == 2 and st["opens_passthrough_cached"] == 0
    assert st["bytes_downloaded"] == len(data)


@restore_paths
def test_two_readers_of_one_object_one_while_it_arrives(proxied, s3, prefix: str,
                                                        passthrough: str, cold_open: str) -> None:
    proxy, mounter = proxied
    data = os.urandom(48 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/shared.pt", Body=data)
    mnt = mounter("--passthrough", passthrough, "--cold-open", cold_open)
    proxy.delay = 0.05  # every GET takes a while: the second reader comes mid-download
    got: dict[str, bytes] = {}

    def read(name: str, delay: float) -> None:
        time.sleep(delay)
        got[name] = (mnt.path / "shared.pt").read_bytes()
    threads = [threading.Thread(target=read, args=(n, d)) for n, d in (("first", 0), ("second", 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {"first": data, "second": data}
    assert status(mnt)["bytes_downloaded"] == len(data)  # one fetch of each chunk, shared


@restore_paths
def test_an_object_replaced_in_s3_while_it_downloads_is_never_mixed(
        proxied, s3, prefix: str, passthrough: str, cold_open: str) -> None:
    proxy, mounter = proxied
    old, new = os.urandom(64 * MiB), os.urandom(64 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=old)
    mnt = mounter("--metadata-ttl", "0.2", "--passthrough", passthrough, "--cold-open", cold_open)
    proxy.delay = 0.05
    fd = os.open(mnt.path / "v.pt", os.O_RDONLY)
    try:
        assert os.pread(fd, MiB, 0) == old[:MiB]
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=new)  # another host, mid-restore
        off, errors = MiB, 0
        while off < len(old):
            try:
                piece = os.pread(fd, 4 * MiB, off)
            except OSError as exc:  # the old version is gone from S3: an error, never new bytes
                assert exc.errno == errno.EIO, exc
                errors += 1
                off += 4 * MiB
                continue
            assert piece == old[off:off + len(piece)] and piece
            off += len(piece)
    finally:
        os.close(fd)
    time.sleep(0.5)
    drop_page_cache()
    assert (mnt.path / "v.pt").read_bytes() == new  # the next open: the new version, whole
    assert mnt.unmount() is None


@restore_paths
def test_a_cache_disk_that_fills_during_a_restore_still_serves_every_byte(
        mounter, s3, prefix: str, tmpfs: Path, passthrough: str, cold_open: str) -> None:  # noqa: F811
    """The cache's budget says yes, its disk says no (another tenant filled it): the chunks'
    files fail with ENOSPC, the reads go on through memory buffers."""
    data = os.urandom(48 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/big.pt", Body=data)
    mnt = mounter("--passthrough", passthrough, "--cold-open", cold_open, "--cache-size", "2GiB",
                  cache_dir=tmpfs / "cache")
    filler = tmpfs / "filler"
    with open(filler, "wb") as f:  # leaves the cache disk about 8 MiB
        free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
        f.write(b"\0" * max(0, free - 8 * MiB))
    try:
        assert (mnt.path / "big.pt").read_bytes() == data
        assert "cannot write chunks" in mnt.log
    finally:
        filler.unlink()
    assert (mnt.path / "big.pt").read_bytes() == data


@restore_paths
def test_a_reader_killed_mid_download_leaves_a_cache_the_next_reader_trusts(
        proxied, s3, prefix: str, passthrough: str, cold_open: str) -> None:
    """Killed in its read, or (whole) in its open, which waits for the fetch."""
    proxy, mounter = proxied
    data = os.urandom(64 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/k.pt", Body=data)
    mnt = mounter("--passthrough", passthrough, "--cold-open", cold_open)
    proxy.delay = 0.1
    reader = subprocess.Popen([sys.executable, "-c",
                               "import sys; open(sys.argv[1], 'rb').read()", str(mnt.path / "k.pt")])
    deadline = time.monotonic() + 30
    while status(mnt)["bytes_downloaded"] < 8 * MiB:
        assert time.monotonic() < deadline and reader.poll() is None
        time.sleep(0.05)
    reader.send_signal(signal.SIGKILL)
    reader.wait(30)
    proxy.delay = 0.0
    drop_page_cache()
    assert (mnt.path / "k.pt").read_bytes() == data
    drop_page_cache()
    assert (mnt.path / "k.pt").read_bytes() == data  # from the cache now
    mnt.unmount()
    again = mounter("--passthrough", passthrough, "--cold-open", cold_open, cache_dir=mnt.cache_dir)  # the cache survives
    assert (again.path / "k.pt").read_bytes() == data
    assert status(again)["bytes_downloaded"] == 0


def test_the_status_says_which_path_each_open_took(mounter, s3, prefix: str) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/r.pt", Body=b"r" * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/s.pt", Body=b"s" * MiB)
    mnt = mounter("--passthrough", "on", "--cold-open", "stream")
    (mnt.path / "w.pt").write_bytes(b"w" * MiB)  # a staged file
    assert (mnt.path / "r.pt").read_bytes() == b"r" * MiB  # cold: the daemon streams it
    assert (mnt.path / "r.pt").read_bytes() == b"r" * MiB  # whole now: passthrough
    r = run_ckptfs("status", str(mnt.path))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("opens:"))
    assert "1 passthrough of cached objects (1.0 MiB opened)" in line, line
    assert "1 passthrough of staged files" in line and "1 served by the daemon (1.0 MiB read)" in line

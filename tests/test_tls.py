"""Over HTTPS, as every mount on AWS runs: TLS is done in the daemon's user space, so the
kernel can neither send a part from the staged file (sendfile) nor splice a GET's body into
the disk cache. A part whose CRC32 its writes computed goes up from the staged file a MiB at
a time (bodies.send_in_pieces); any other is read once into a buffer of the --upload-memory
budget. GET bodies come down through a 1 MiB buffer per thread into the cache's chunk files
(s3.py, zerocopy.py)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import BUCKET, Mounter, both_paths, run_ckptfs, s3_bytes

MiB = 1 << 20


def _status(mnt) -> dict:
    r = run_ckptfs("status", "--json", str(mnt.path))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("durability", ["close", "async"])
@both_paths
def test_a_checkpoint_goes_up_and_comes_back_over_https(tls_mounter: Mounter, s3, prefix: str,
                                                         durability: str, passthrough: str) -> None:
    mnt = tls_mounter("--durability", durability, "--part-size", "5MiB",
                      "--passthrough", passthrough)
    assert mnt.endpoint.startswith("https://")
    model = os.urandom(23 * MiB + 123)  # five parts, the last one short
    (mnt.path / "step_1").mkdir()
    (mnt.path / "step_1" / "model.pt").write_bytes(model)
    (mnt.path / "step_1" / "done").write_bytes(b"ok")
    if durability == "async":
        r = run_ckptfs("sync", str(mnt.path))
        assert r.returncode == 0, r.stderr
    # Read over plain HTTP by another client: what the mount sent over TLS is what S3 holds.
    assert s3_bytes(s3, f"{prefix}/step_1/model.pt") == model
    assert s3_bytes(s3, f"{prefix}/step_1/done") == b"ok"
    status = _status(mnt)
    assert status["parts_sent"] >= 5 and status["upload_failures"] == 0, status
    # Written in order: every part's CRC32 came from its writes, and it went up from the
    # staged file without a buffer of the budget.
    assert status["upload_memory_bytes"] == 0, status

    # A header patched after the rest went out (as torch.save's zip writer does): on the
    # daemon's path that part's CRC32 is read from the file, once, into a buffer of the
    # budget, and it is sent from there. With passthrough every part is read twice from the
    # page cache instead (the kernel wrote it: the daemon never had the bytes), never into
    # a buffer.
    shuffled = bytearray(os.urandom(12 * MiB))
    with open(mnt.path / "step_1" / "optim.pt", "wb") as f:
        f.write(shuffled)
        f.flush()
        os.fsync(f.fileno())  # the writes reach the daemon in order, and are done
        patch = os.urandom(4096)
        f.seek(MiB)
        f.write(patch)
        shuffled[MiB:MiB + 4096] = patch
    if durability == "async":
        r = run_ckptfs("sync", str(mnt.path))
        assert r.returncode == 0, r.stderr
    assert s3_bytes(s3, f"{prefix}/step_1/optim.pt") == shuffled
    status = _status(mnt)
    if passthrough == "on":
        assert status["upload_memory_bytes"] == 0, status
    else:
        assert 0 < status["upload_memory_bytes"] <= status["upload_memory_limit"], status

    # A fresh mount reads it cold: every byte through the bounce buffer, none spliced.
    cold = tls_mounter()
    assert (cold.path / "step_1" / "model.pt").read_bytes() == model
    status = _status(cold)
    assert status["bytes_downloaded"] == len(model)
    assert status["bytes_spliced"] == 0
    assert status["retries"] == 0


@both_paths
def test_writes_over_https_stay_out_of_daemon_memory(tls_mounter: Mounter, s3,
                                                     prefix: str, passthrough: str) -> None:
    """Eight ranks write at once: their parts go up from the staged files a MiB at a time,
    and the daemon's peak memory grows by a buffer per thread and the TLS state, not by
    the --upload-memory budget (48 MiB) that parts used to be read into."""
    mnt = tls_mounter("--part-size", "5MiB", "--passthrough", passthrough)
    pid = _status(mnt)["pid"]
    before = _peak_rss(pid)
    shards = {f"rank_{i}.distcp": os.urandom(20 * MiB + i) for i in range(8)}

    def write(name: str) -> None:
        with open(mnt.path / name, "wb") as f:
            data = memoryview(shards[name])
            for off in range(0, len(data), MiB):
                f.write(data[off:off + MiB])
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, shards))
    grew = _peak_rss(pid) - before
    for name, data in shards.items():
        assert s3_bytes(s3, f"{prefix}/{name}") == data
    assert grew < 32 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"


def test_a_cold_read_over_https_stays_out_of_daemon_memory(tls_mounter: Mounter, s3,
                                                           prefix: str) -> None:
    """The bodies pass through a 1 MiB buffer per thread into the cache's files: the daemon's
    peak memory grows by a few buffers and the TLS state, not by a readahead window."""
    data = os.urandom(120 * MiB + 7)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/big.pt", Body=data)
    mnt = tls_mounter()
    pid = _status(mnt)["pid"]
    before = _peak_rss(pid)
    with open(mnt.path / "big.pt", "rb") as f:
        assert f.read() == data
    grew = _peak_rss(pid) - before
    assert grew < 48 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"
    status = _status(mnt)
    assert status["bytes_downloaded"] == len(data) and status["bytes_spliced"] == 0

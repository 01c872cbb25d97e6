"""An S3 outage through real FUSE mounts: the fault proxy (devtools/faultproxy.py) in front
of SeaweedFS hangs every request, refuses connections, or answers 503 to everything.

Async mode: a trainer's steps go on through the outage without one failed call; after it,
`ckptfs sync` succeeds and a fresh mount shows the trainer's tree. Close mode: a stat, a
read and a close fail with EIO within --upload-timeout plus a few seconds, and the failed
close is delivered once S3 is back. bench/outage_bench.py runs the loop for minutes and
times the steps; test_outage.py runs the same logic in process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import BUCKET, run_ckptfs, s3_bytes

TIMEOUT = 5  # --upload-timeout


def blob(step: int, what: str) -> bytes:
    return (f"{what}-{step}-".encode() * 8192)[:64 << 10]


def step(mnt: Path, n: int) -> None:
    d = mnt / f"step_{n}"
    os.makedirs(d, exist_ok=True)
    (d / "model.bin").write_bytes(blob(n, "model"))
    (d / "opt.bin").write_bytes(blob(n, "opt"))
    (mnt / "latest.tmp").write_bytes(str(n).encode())
    os.replace(mnt / "latest.tmp", mnt / "latest")
    if n >= 1:
        assert (mnt / f"step_{n - 1}" / "model.bin").read_bytes() == blob(n - 1, "model")
    if n >= 3:
        shutil.rmtree(mnt / f"step_{n - 3}")


def tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out.update({os.path.normpath(os.path.join(rel, d)) + "/": "" for d in dirnames})
        for f in filenames:
            data = (Path(dirpath) / f).read_bytes()
            out[os.path.normpath(os.path.join(rel, f))] = hashlib.sha256(data).hexdigest()
    return out


@pytest.mark.parametrize("kind", ["hang", "refuse", "503"])
def test_async_mode_trains_through_an_outage(proxied, mounter, tmp_path: Path, kind: str) -> None:
    proxy, via_proxy = proxied
    mnt = via_proxy("--durability", "async", "--upload-timeout", str(TIMEOUT))
    for n in range(3):
        step(mnt.path, n)
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    time.sleep(1.5)  # every answer the mount has is past its TTL
    proxy.outage(kind)
    try:
        n, until = 3, time.monotonic() + TIMEOUT + 5  # past the first requests' deadline,
        while time.monotonic() < until:  # and past the 3 s after which the outage is logged
            step(mnt.path, n)  # raises if any call fails
            n += 1
            time.sleep(0.5)
        st = json.loads(run_ckptfs("status", str(mnt.path), "--json").stdout)
        assert st["s3_down_since"] is not None and st["pending_files"] > 0, st
        assert "S3: NOT ANSWERING" in run_ckptfs("status", str(mnt.path)).stdout
    finally:
        proxy.outage(None)
    assert run_ckptfs("sync", str(mnt.path), timeout=120).returncode == 0
    mine = tree(mnt.path)
    assert sorted(k for k in mine if k.endswith("/")) == sorted(f"step_{i}/" for i in range(n - 3, n))
    mnt.unmount()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert tree(mounter(path=fresh, cache_dir=tmp_path / "fresh-cache").path) == mine
    assert "S3 has not answered since" in mnt.log and "S3 answers again" in mnt.log


def test_close_mode_fails_within_the_deadline_and_delivers_the_failed_close(proxied, s3,
                                                                           prefix: str) -> None:
    proxy, via_proxy = proxied
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/d/cold.bin", Body=b"c" * 100_000)
    mnt = via_proxy("--upload-timeout", str(TIMEOUT), "--passthrough", "off")
    (mnt.path / "before.bin").write_bytes(b"closed before the outage")
    cold = open(mnt.path / "d" / "cold.bin", "rb")  # noqa: SIM115 - read during the outage
    late = open(mnt.path / "late.bin", "wb")  # noqa: SIM115 - closed during the outage
    late.write(b"closed during the outage")
    time.sleep(1.5)  # past the TTL: a stat of d asks S3
    proxy.outage("hang")
    try:
        for what, call in (("stat", lambda: os.stat(mnt.path / "d")),
                           ("read", lambda: cold.read()), ("close", late.close)):
            started = time.monotonic()
            with pytest.raises(OSError) as caught:
                call()
            took = time.monotonic() - started
            assert caught.value.errno == 5, what  # EIO
            assert took < TIMEOUT + 5, (what, took)
    finally:
        proxy.outage(None)
        cold.close()
    assert run_ckptfs("sync", str(mnt.path), timeout=120).returncode == 0
    assert s3_bytes(s3, f"{prefix}/late.bin") == b"closed during the outage"
    assert s3_bytes(s3, f"{prefix}/before.bin") == b"closed before the outage"

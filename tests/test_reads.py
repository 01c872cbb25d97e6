"""Reads and metadata: listings cost LIST pages, missing names are remembered, the chunk cache
and prefetch serve cold and warm reads with a bounded number of GETs."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import BUCKET, s3_bytes

MiB = 1024 * 1024


def test_ls_l_of_a_big_directory_costs_its_list_pages_not_a_head_per_file(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    names = [f"shard_{i:05d}.pt" for i in range(2500)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/many/{n}", Body=b"x"), names))
    mnt = mounter()  # the default TTL (1 s)
    proxy.counts.clear()
    r = subprocess.run(["ls", "-l", str(mnt.path / "many")], capture_output=True, text=True, check=True)
    lines = r.stdout.splitlines()[1:]  # after "total N"
    assert len(lines) == 2500 and all(line.split()[4] == "1" for line in lines)
    assert proxy.counts["LIST"] <= 6, proxy.counts  # 3 pages of 1,000, plus the lookup of many/
    assert proxy.counts["HEAD"] <= 2, proxy.counts


def test_missing_names_are_remembered_for_the_ttl_and_own_creates_are_seen(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter("--metadata-ttl", "30")
    proxy.counts.clear()
    for _ in range(20):
        assert not (mnt.path / "absent.pt").exists()
    assert proxy.counts["HEAD"] == 1, proxy.counts
    (mnt.path / "absent.pt").write_bytes(b"now here")  # the mount's own create wins at once
    assert (mnt.path / "absent.pt").read_bytes() == b"now here"
    assert s3_bytes(s3, f"{prefix}/absent.pt") == b"now here"
    os.mkdir(mnt.path / "d")
    assert (mnt.path / "d").is_dir()


def test_a_short_ttl_sees_objects_other_writers_add(proxied, s3, prefix: str) -> None:
    import time
    proxy, mounter = proxied
    mnt = mounter("--metadata-ttl", "0.5")
    assert not (mnt.path / "later.pt").exists()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/later.pt", Body=b"from elsewhere")
    time.sleep(1.0)
    assert (mnt.path / "later.pt").read_bytes() == b"from elsewhere"


def test_metadata_ttl_is_checked(tmp_path: Path) -> None:
    from conftest import run_ckptfs
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--metadata-ttl", "-1")
    assert r.returncode == 2 and "--metadata-ttl must be between" in r.stderr

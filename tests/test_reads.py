"""Reads and metadata: listings cost LIST pages, missing names are remembered, the chunk cache
and prefetch serve cold and warm reads with a bounded number of GETs."""

from __future__ import annotations

import errno
import json
import os
import time
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import BUCKET, run_ckptfs, s3_bytes

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


def test_stat_of_each_listed_entry_after_the_ttl_costs_list_pages_not_a_head_each(proxied, s3, prefix: str) -> None:
    # `ls -l` of a big directory on a slow server: its stat calls come after the listing's TTL
    # ran out. Seen in the read bench: 10,000 HEADs (and as many LISTs) took 9-25 s.
    proxy, mounter = proxied
    names = [f"shard_{i:05d}.pt" for i in range(1500)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/many/{n}", Body=b"x"), names))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/many/sub/inner.pt", Body=b"y")
    mnt = mounter("--metadata-ttl", "0.5")
    many = mnt.path / "many"
    assert sorted(os.listdir(many)) == sorted(names + ["sub"])
    s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/many/shard_00007.pt")  # behind the mount's back
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/many/shard_00009.pt", Body=b"bigger")
    time.sleep(1)  # the listing and the kernel's entries are stale now
    proxy.counts.clear()
    sizes = {}
    for n in names + ["sub"]:
        try:
            st = os.lstat(many / n)
        except FileNotFoundError:
            continue
        sizes[n] = st.st_size
    assert "shard_00007.pt" not in sizes and sizes["shard_00009.pt"] == 6 and sizes["shard_00010.pt"] == 1
    assert os.path.isdir(many / "sub") and len(sizes) == 1500
    assert proxy.counts["HEAD"] <= 5, proxy.counts
    assert proxy.counts["LIST"] <= 10, proxy.counts  # a page per 1,000 names, a few more if slow


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


@pytest.mark.parametrize("durability", ["close", "async"])
def test_files_created_in_a_directory_made_here_need_no_lookup_in_s3(proxied, s3, prefix: str,
                                                                     durability: str) -> None:
    """S3 had nothing under a directory the mount just made: each new file in it is created
    without a HEAD and a LIST of its own (one S3 round trip per file on AWS)."""
    proxy, mounter = proxied
    mnt = mounter("--durability", durability, "--metadata-ttl", "30")  # the whole test in one TTL
    step = mnt.path / "step_10"
    step.mkdir()
    proxy.counts.clear()
    for i in range(20):
        (step / f"shard_{i}.pt").write_bytes(b"x" * i)
    # A lookup in S3 is a HEAD and a LIST at once; uploads (close mode, or async mode's
    # background puts) send HEADs of their own but never a LIST.
    assert proxy.counts["LIST"] == 0, proxy.counts
    if durability == "async":
        assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert s3_bytes(s3, f"{prefix}/step_10/shard_19.pt") == b"x" * 19
    assert sorted(os.listdir(step)) == sorted(f"shard_{i}.pt" for i in range(20))


def test_a_short_ttl_sees_objects_other_writers_add(proxied, s3, prefix: str) -> None:
    import time
    proxy, mounter = proxied
    mnt = mounter("--metadata-ttl", "0.5")
    assert not (mnt.path / "later.pt").exists()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/later.pt", Body=b"from elsewhere")
    time.sleep(1.0)
    assert (mnt.path / "later.pt").read_bytes() == b"from elsewhere"


def test_metadata_ttl_is_checked(tmp_path: Path) -> None:
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--metadata-ttl", "-1")
    assert r.returncode == 2 and "--metadata-ttl must be between" in r.stderr


def drop_page_cache() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def cache_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "cache").iterdir() if p.is_file()]


def test_a_file_written_here_is_read_back_after_a_remount_without_a_get(proxied, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter("--part-size", "5MiB")
    data = os.urandom(12 * MiB)
    (mnt.path / "model.pt").write_bytes(data)
    mnt.unmount()
    again = mounter(path=mnt.path, cache_dir=mnt.cache_dir)
    drop_page_cache()
    proxy.counts.clear()
    assert (again.path / "model.pt").read_bytes() == data
    assert proxy.counts["GET"] == 0, proxy.counts
    assert not (mnt.cache_dir / "preserved").exists()  # clean copies are cache, not leftovers


def test_cold_reads_fetch_each_chunk_once_and_warm_reads_none(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    data = os.urandom(40 * MiB + 123)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/cold.pt", Body=data)
    mnt = mounter()
    proxy.counts.clear()
    with open(mnt.path / "cold.pt", "rb") as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    assert got == data
    # Six 8 MiB chunks, each fetched once: two demand reads, then readahead runs in one GET.
    status = json.loads(run_ckptfs("status", "--json", str(mnt.path)).stdout)
    assert status["bytes_downloaded"] == len(data) and status["chunk_cache_misses"] == 6
    assert proxy.counts["GET"] <= 4, proxy.counts
    # Warm: a new mount on the same cache dir, the page cache dropped: no GET at all.
    mnt.unmount()
    again = mounter(path=mnt.path, cache_dir=mnt.cache_dir)
    drop_page_cache()
    proxy.counts.clear()
    assert (again.path / "cold.pt").read_bytes() == data
    assert proxy.counts["GET"] == 0, proxy.counts


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_cold_read_goes_into_the_disk_cache_and_not_through_daemon_memory(mounter, s3, prefix: str) -> None:
    data = os.urandom(200 * MiB + 5)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/big.pt", Body=data)
    mnt = mounter()
    pid = json.loads(run_ckptfs("status", "--json", str(mnt.path)).stdout)["pid"]
    before = _peak_rss(pid)
    with open(mnt.path / "big.pt", "rb") as f:
        assert f.read() == data
    grew = _peak_rss(pid) - before
    status = json.loads(run_ckptfs("status", "--json", str(mnt.path)).stdout)
    # Over plain HTTP the kernel spliced the bodies into the cache's files (all but what came
    # in with each GET's headers), and the reads were answered from there: the daemon's peak
    # memory grew by a few buffers, not by a readahead window of chunks (192 MiB before).
    assert grew < 48 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"
    assert status["bytes_downloaded"] == len(data)
    assert status["bytes_spliced"] > len(data) - status["chunk_cache_misses"] * 64 * 1024


def test_random_reads_fetch_what_they_touch(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    data = os.urandom(64 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/rand.pt", Body=data)
    mnt = mounter()
    proxy.counts.clear()
    with open(mnt.path / "rand.pt", "rb") as f:
        for offset in (60 * MiB, 1000, 33 * MiB + 5, 60 * MiB + 77):  # the tail first, like torch.load
            f.seek(offset)
            assert f.read(4096) == data[offset:offset + 4096]
    assert proxy.counts["GET"] <= 4, proxy.counts  # chunks 7, 0 and 4 (kernel readahead may add one)


def test_a_changed_object_is_fetched_again_and_its_old_cache_dropped(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    old, new = os.urandom(9 * MiB), os.urandom(9 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=old)
    mnt = mounter()
    assert (mnt.path / "v.pt").read_bytes() == old
    mnt.unmount()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=new)  # another host wrote it
    again = mounter(path=mnt.path, cache_dir=mnt.cache_dir)
    drop_page_cache()
    proxy.counts.clear()
    assert (again.path / "v.pt").read_bytes() == new
    assert proxy.counts["GET"] >= 1  # fetched again (whole: one GET; streamed: one a chunk)
    # The old version went (the new one's chunks reach the cache in the background).
    deadline = time.monotonic() + 30
    while sum(p.stat().st_size for p in cache_files(mnt.cache_dir)) != len(new):
        assert time.monotonic() < deadline, [p.stat().st_size for p in cache_files(mnt.cache_dir)]
        time.sleep(0.05)


def test_the_cache_stays_within_its_budget_and_never_evicts_unsent_files(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    for i in range(3):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/r{i}.pt", Body=bytes([i]) * (12 * MiB))
    mnt = mounter("--cache-size", "20MiB", "--durability", "async")
    proxy.fail_status = 503
    proxy.fail_methods = {"PUT", "POST"}
    pending = os.urandom(30 * MiB)
    (mnt.path / "pending.pt").write_bytes(pending)  # staged, not in S3: outside the budget
    for i in range(3):
        assert (mnt.path / f"r{i}.pt").read_bytes() == bytes([i]) * (12 * MiB)
    # Chunks are written to the cache after the reads are answered: count the cache once no
    # write is in flight (a temp file of one used to be counted against the budget).
    deadline = time.monotonic() + 30
    while any(p.name.endswith(".tmp") for p in cache_files(mnt.cache_dir)):
        assert time.monotonic() < deadline, "chunk writes to the cache never finished"
        time.sleep(0.05)
    assert sum(p.stat().st_size for p in cache_files(mnt.cache_dir)) <= 20 * MiB
    staged = [p for p in (mnt.cache_dir / "staging").iterdir() if p.stat().st_size == len(pending)]
    assert len(staged) == 1
    proxy.fail_methods = set()
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert s3_bytes(s3, f"{prefix}/pending.pt") == pending


def test_a_sequential_stream_survives_slightly_out_of_order_requests_and_resets_on_a_jump() -> None:
    from ckptfs.handles import ReadStream
    chunk = 8 * MiB
    stream = ReadStream()
    windows = []
    # 1 MiB requests, as the kernel sends them, with some of its readahead arriving early
    order = [0, 1, 2, 4, 3, 5, 6, 7, 9, 8] + list(range(10, 64))
    for i in order:
        stream.advance(i * MiB, (i + 1) * MiB, chunk, max_window=16)
        windows.append(stream.window)
    assert windows == sorted(windows) and windows[-1] >= 8  # it only ever grew
    # Seen from the kernel with a 16 MiB readahead: a later batch answered before an
    # earlier one, so the stream runs 8 MiB ahead and then comes back.
    for i in [64, 72, 73, 74, 75, 76, 77, 78, 65, 66, 67, 68, 69, 70, 71, 79, 80]:
        stream.advance(i * MiB, (i + 1) * MiB, chunk, max_window=16)
        windows.append(stream.window)
    assert windows == sorted(windows) and windows[-1] == 16
    stream.advance(900 * MiB, 901 * MiB, chunk, max_window=16)  # a seek far away
    assert stream.window == 0 and stream.sequential_reads == 0


def test_the_mount_reads_ahead_more_than_the_kernel_default(mounter) -> None:
    # The daemon mounts fusectl itself where the host has not (seen on a VM without systemd).
    mnt = mounter()
    st = os.stat(mnt.path)
    with open(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb") as f:
        assert int(f.read()) == 16384
    # ...and keeps enough requests in flight for it (the kernel's default is 12).
    conn = f"/sys/fs/fuse/connections/{os.minor(st.st_dev)}"
    deadline = time.monotonic() + 5
    while True:  # set one after the other, just after the readahead: allow them a moment
        found = []
        for name in ("max_background", "congestion_threshold"):
            with open(f"{conn}/{name}") as f:
                found.append(int(f.read()))
        if found == [48, 36] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert found == [48, 36]


@pytest.mark.parametrize("origin", ["remote", "written here"])
def test_an_open_file_keeps_its_version_when_another_host_overwrites_it(mounter, s3, prefix: str,
                                                                        origin: str) -> None:
    # A reader must never get bytes of two versions. A getattr (fstat) or a lookup (stat of
    # the path) past the TTL used to move the open inode to the new object: its later reads then
    # fetched the new version's bytes (or dropped the local copy of a file written here).
    old, new = os.urandom(64 * MiB), os.urandom(64 * MiB)
    mnt = mounter("--metadata-ttl", "0.2")
    path = mnt.path / "v.pt"
    if origin == "remote":
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=old)
    else:
        path.write_bytes(old)
    drop_page_cache()  # the reads below reach the daemon
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old[:4096]
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/v.pt", Body=new)  # another host
        time.sleep(0.5)
        os.fstat(fd)  # a getattr past the TTL
        time.sleep(0.5)
        os.stat(path)  # a lookup past the TTL
        try:
            tail = os.pread(fd, 4096, 60 * MiB)
        except OSError as exc:  # the old version is gone from S3: an error, not new bytes
            assert origin == "remote" and exc.errno == errno.EIO, exc
        else:
            assert tail == old[60 * MiB:60 * MiB + 4096]
    finally:
        os.close(fd)
    time.sleep(0.5)
    assert path.read_bytes() == new  # closed: the next open sees the new version


def test_an_open_file_whose_object_another_host_deletes_fails_its_uncached_reads(
        mounter, s3, prefix: str) -> None:
    data = os.urandom(64 * MiB)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/gone.pt", Body=data)
    mnt = mounter("--metadata-ttl", "0.2")
    path = mnt.path / "gone.pt"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == data[:4096]
        s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/gone.pt")  # another host
        time.sleep(0.5)
        assert not path.exists()
        try:
            tail = os.pread(fd, 4096, 60 * MiB)
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
        else:
            assert tail == data[60 * MiB:60 * MiB + 4096]  # never other bytes
        assert os.pread(fd, 4096, 0) == data[:4096]  # what was read stays readable
    finally:
        os.close(fd)
    assert os.listdir(mnt.path) == []  # the mount is fine

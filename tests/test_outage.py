"""An S3 outage, in the fast tier: the mount's handlers driven in this process
(tests/inprocess.py) over the in-memory S3 with every request failing (fakes3.Faults.outage):
hung to its deadline, refused, or answered 503.

- Async mode: a trainer's loop goes on through the outage, answered from what the mount
  knows; afterwards the log drains, and a fresh mount shows what the trainer's showed.
- Close mode: a lookup, a read and a close fail with EIO by their deadline, and a failed
  close keeps its bytes for the retry that delivers them.
- Health: one probe at a time during an outage, status shows it, one log line each way.

test_outage_mount.py runs the same through real FUSE mounts and the fault proxy in front of
SeaweedFS.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from ckptfs import daemon
from ckptfs import health as health_module
from fakes3 import MemoryS3
from inprocess import Kernel, mounted

TIMEOUT = 2.0  # --upload-timeout: a call that waited on the hung S3 would take this long
PATIENCE = 0.3  # how long a lookup waits for S3 before the mount's knowledge answers


@pytest.fixture(autouse=True)
def patience(monkeypatch) -> None:
    monkeypatch.setattr(daemon, "PATIENCE", PATIENCE)
MiB = 1 << 20


def blob(step: int, what: str, size: int = 64 << 10) -> bytes:
    return (f"{what}-{step}-".encode() * (size // 8 + 1))[:size]


async def train_step(kernel: Kernel, n: int) -> None:
    """One step of the trainer loop: a checkpoint directory, two files, the latest marker,
    the previous step read back, the step three back removed (as `rm -rf` does it)."""
    await kernel.mkdir(f"step_{n}")
    await kernel.write(f"step_{n}/model.bin", blob(n, "model"))
    await kernel.write(f"step_{n}/opt.bin", blob(n, "opt"))
    await kernel.write("latest.tmp", str(n).encode())
    await kernel.rename("latest.tmp", "latest")
    if n >= 1:
        assert await kernel.read(f"step_{n - 1}/model.bin") == blob(n - 1, "model")
    if n >= 3:
        old = f"step_{n - 3}"
        for name in await kernel.listdir(old):
            await kernel.unlink(f"{old}/{name}")
        await kernel.rmdir(old)


async def tree(kernel: Kernel, path: str = "") -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name in await kernel.listdir(path):
        rel = f"{path}/{name}" if path else name
        attrs = await kernel.stat(rel)
        if attrs.st_mode & 0o040000:
            out[rel + "/"] = None
            out.update(await tree(kernel, rel))
        else:
            out[rel] = await kernel.read(rel)
    return out


@pytest.mark.parametrize("kind", ["hang", "refuse", "503"])
async def test_async_mode_trains_through_an_outage(tmp_path: Path, kind: str) -> None:
    s3 = MemoryS3(timeout=TIMEOUT)
    async with mounted(tmp_path, s3, "async", metadata_ttl=0.05, upload_timeout=TIMEOUT) as mount:
        kernel = Kernel(mount)
        for n in range(4):
            await train_step(kernel, n)
        await mount.changes.backlog.drain()
        await trio.sleep(0.1)  # every answer the mount has is past its TTL now
        s3.faults.outage(kind)
        for n in range(4, 12):
            # A call that waited for S3 would wait for its deadline (TIMEOUT) and then fail.
            with trio.fail_after(TIMEOUT / 2):
                await train_step(kernel, n)
            await kernel.drop_caches()  # the kernel forgets; the mount's knowledge stays
            await trio.sleep(0.1)
            if n == 7:
                await trio.sleep(TIMEOUT)  # the first requests reach their deadline
        health = s3.policy.health
        assert health.down and mount.stats.refresh()["s3_down_since"] is not None
        assert mount.changes.backlog.pending()  # the steps wait for S3
        s3.faults.outage(None)
        with trio.fail_after(30):
            await mount.changes.backlog.drain()
        assert not health.down
        expected = await tree(kernel)
    assert sorted(expected) == ["latest", "step_10/", "step_10/model.bin", "step_10/opt.bin",
                                "step_11/", "step_11/model.bin", "step_11/opt.bin",
                                "step_9/", "step_9/model.bin", "step_9/opt.bin"]
    assert expected["latest"] == b"11"
    async with mounted(tmp_path / "fresh", s3, "async") as fresh:
        assert await tree(Kernel(fresh)) == expected


async def test_async_mode_asks_s3_about_a_name_it_never_knew(tmp_path: Path) -> None:
    """The mount knows no name under a directory it never listed: during an outage a lookup
    there waits for S3, and fails at its deadline instead of saying ENOENT."""
    s3 = MemoryS3(timeout=TIMEOUT)
    await s3.put("p/other/x.bin", b"x", {})
    async with mounted(tmp_path, s3, "async", metadata_ttl=0.05, upload_timeout=TIMEOUT) as mount:
        kernel = Kernel(mount)
        await kernel.stat("other")  # known; what is under it is not
        await trio.sleep(0.1)
        s3.faults.outage("refuse")
        with pytest.raises(pyfuse3.FUSEError) as caught:
            await kernel.stat("other/x.bin")
        assert caught.value.errno == errno.EIO
        assert (await kernel.stat("other")).st_mode & 0o040000  # known: answered


@pytest.mark.parametrize("kind", ["hang", "refuse"])
async def test_close_mode_fails_by_the_deadline_and_keeps_a_failed_close(tmp_path: Path,
                                                                        kind: str) -> None:
    s3 = MemoryS3(timeout=TIMEOUT)
    await s3.put("p/d/cold.bin", b"cold" * 1000, {})
    async with mounted(tmp_path, s3, "close", metadata_ttl=0.05, upload_timeout=TIMEOUT) as mount:
        kernel = Kernel(mount)
        await kernel.write("kept.bin", b"closed before")
        fh = await kernel.open("d/cold.bin")  # looked up and open before the outage
        fh2 = await kernel.open("new.bin", os.O_WRONLY | os.O_CREAT)
        await trio.sleep(0.1)  # past the TTL: a stat of d asks S3
        s3.faults.outage(kind)
        for call in (lambda: kernel.stat("d"), lambda: mount.fs.read(fh, 0, 4096)):
            started = trio.current_time()
            with pytest.raises(pyfuse3.FUSEError) as caught:
                await call()
            assert caught.value.errno == errno.EIO
            assert trio.current_time() - started < TIMEOUT + 2
        await mount.fs.write(fh2, 0, b"written during the outage")
        started = trio.current_time()
        with pytest.raises(pyfuse3.FUSEError) as caught:
            await mount.fs.flush(fh2)
        assert caught.value.errno == errno.EIO and trio.current_time() - started < TIMEOUT + 2
        await mount.fs.release(fh2)
        await mount.fs.release(fh)
        s3.faults.outage(None)
        with trio.fail_after(60):
            await mount.changes.backlog.drain()  # the failed close is retried, and delivered
    assert s3.objects["p/new.bin"] == b"written during the outage"
    assert s3.objects["p/kept.bin"] == b"closed before"


async def test_an_outage_is_probed_once_at_a_time_and_logged_once(tmp_path: Path, caplog,
                                                                   monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger="ckptfs.health")
    monkeypatch.setattr(health_module, "LOG_AFTER", 1.0)
    s3 = MemoryS3(timeout=TIMEOUT)
    async with mounted(tmp_path, s3, "async", metadata_ttl=0.05, upload_timeout=TIMEOUT) as mount:
        kernel = Kernel(mount)
        await kernel.mkdir("d")
        await mount.changes.backlog.drain()
        s3.faults.outage("503")
        for i in range(5):
            await kernel.write(f"d/f{i}", b"x")
        await trio.sleep(2)  # past health.LOG_AFTER, and several probes
        st = mount.stats.refresh()
        assert st["s3_down_since"] is not None and st["s3_down_reason"]
        assert "not answering" in mount.stats.line()
        sent = len(s3.requests)
        await trio.sleep(3)
        # Nothing but the probe goes out, one at a time, further apart each time.
        assert len(s3.requests) - sent <= 4, s3.requests[sent:]
        assert {op for op, _ in s3.requests[sent:]} <= {"LIST"}
        assert s3.policy.health.probes >= 3
        s3.faults.outage(None)
        with trio.fail_after(30):
            await mount.changes.backlog.drain()
        assert mount.stats.refresh()["s3_down_since"] is None
    lines = [r.getMessage() for r in caplog.records if r.name == "ckptfs.health"]
    assert len(lines) == 2, lines
    assert "has not answered since" in lines[0] and "answers again" in lines[1]
    assert sorted(k for k in s3.objects if k.startswith("p/d/f")) == [f"p/d/f{i}" for i in range(5)]

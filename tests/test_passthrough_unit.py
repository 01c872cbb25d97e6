"""Passthrough's pieces that need no mount: writes the daemon never saw, checked at completion;
the CRC32 of file ranges; whole objects assembled from cached chunks; the option."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from ckptfs.cache import ObjectCache, concatenate
from ckptfs.bodies import crcs_of_ranges
from ckptfs.checksum import crc32
from ckptfs.config import Config
from ckptfs.errors import ConfigError
from ckptfs.parts import PartPlan
from ckptfs.passthrough import stack_depth
from ckptfs.uploader import Uploader
from ckptfs.uploads import FileUpload
from fakes3 import MemoryS3

pytestmark = pytest.mark.unit

MiB = 1024 * 1024
PART = 5 * MiB


def _parts_sent(s3: MemoryS3) -> int:
    return sum(1 for op, _ in s3.requests if op == "UploadPart")


async def _sent_then_finish(tmp_path: Path, data: bytes, size: int, unseen: bool = True,
                            change=lambda path: None) -> tuple[MemoryS3, Uploader, object]:
    """A file grown by `data` behind the daemon's back, its parts sent; then `change(path)`,
    then the upload finished at `size` bytes. (s3, uploader, result)."""
    s3 = MemoryS3()
    path = str(tmp_path / "staged")
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = Uploader(s3, PartPlan(PART), 4, upload_timeout=5, nursery=nursery)  # type: ignore[arg-type]
        fu = FileUpload()
        await _grow(up, fu, path, data)
        fu.unseen_writes = unseen
        change(path)
        result = await up.finish(fu, path, "ck/model.pt", size, {})
    return s3, up, result


async def _grow(up: Uploader, fu: FileUpload, path: str, data: bytes) -> None:
    """What passthrough.refresh does: the file grew (the kernel wrote it); no bytes given."""
    with open(path, "r+b") as f:
        f.write(data)
    fu.unseen_writes = True
    up.note_write(fu, path, lambda: "ck/model.pt", lambda: {}, 0, len(data))
    for event in list(fu.sending.values()):
        await event.wait()


@pytest.mark.parametrize("where", ["start", "middle", "end of a part", "mmap"])
async def test_a_part_changed_behind_the_daemons_back_is_sent_again(tmp_path: Path, where: str) -> None:
    s3 = MemoryS3()
    path, data = str(tmp_path / "staged"), bytearray(os.urandom(17 * MiB))
    open(path, "wb").close()
    async with trio.open_nursery() as nursery:
        up = Uploader(s3, PartPlan(PART), 4, upload_timeout=5, nursery=nursery)  # type: ignore[arg-type]
        fu = FileUpload()
        await _grow(up, fu, path, bytes(data))
        assert _parts_sent(s3) == 3  # parts 1-3 are complete; 4 is the tail
        offset = {"start": 0, "middle": PART + 12345, "end of a part": 3 * PART - 1,
                  "mmap": 2 * PART + 7}[where]
        data[offset:offset + 1] = b"\xff" if data[offset] != 0xFF else b"\x00"
        with open(path, "r+b") as f:  # the kernel's write (or an mmap store): never seen here
            f.seek(offset)
            f.write(data[offset:offset + 1])
        result = await up.finish(fu, path, "ck/model.pt", len(data), {})
    assert s3.objects["ck/model.pt"] == data
    assert result.parts == 4 and up.parts_rechecked == 3 and up.parts_rechecked_changed == 1
    assert _parts_sent(s3) == 5  # the changed part again, and the tail


async def test_a_file_cut_below_sent_parts_publishes_what_it_holds(tmp_path: Path) -> None:
    data = os.urandom(17 * MiB)
    # ftruncate by the daemon (SETATTR) cuts part 3
    s3, _, _ = await _sent_then_finish(tmp_path, data, 2 * PART + 3,
                                       change=lambda path: os.truncate(path, 2 * PART + 3))
    assert s3.objects["ck/model.pt"] == data[:2 * PART + 3]


async def test_without_unseen_writes_sent_parts_are_trusted(tmp_path: Path) -> None:
    """The daemon's own write path needs no second read of the file."""
    data = os.urandom(12 * MiB)
    s3, up, _ = await _sent_then_finish(tmp_path, data, len(data), unseen=False)
    assert up.parts_rechecked == 0 and s3.objects["ck/model.pt"] == data


def test_crcs_of_ranges_match_zlib_and_mark_short_ranges(tmp_path: Path) -> None:
    data = os.urandom(9 * MiB + 5)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        ranges = [(0, 0), (0, 4 * MiB), (3, 5 * MiB + 2), (9 * MiB, 5), (9 * MiB, 6)]
        got = crcs_of_ranges(fd, ranges)
    finally:
        os.close(fd)
    assert got[:4] == [crc32(data[o:o + n]) for o, n in ranges[:4]]
    assert got[4] == -1  # past the end: never equal to a sent part's CRC32


def test_an_object_whose_chunks_are_all_cached_becomes_one_file(tmp_path: Path) -> None:
    cache = ObjectCache(str(tmp_path), 1 << 30)
    data, chunk = os.urandom(3 * MiB + 17), MiB
    for index in range(4):
        name, tmp = cache.chunk_tmp("k", "e1", index)
        Path(tmp).write_bytes(data[index * chunk:(index + 1) * chunk])
        assert cache.open_chunks("k", "e1", len(data), chunk) is None  # not all there yet
        cache.commit_chunk("k", "e1", name, tmp, len(data[index * chunk:(index + 1) * chunk]))
    fds = cache.open_chunks("k", "e1", len(data), chunk)
    assert fds is not None and len(fds) == 4
    name, tmp = cache.whole_tmp("k", "e1")
    try:
        concatenate(fds, tmp, len(data), chunk)
    finally:
        for fd in fds:
            os.close(fd)
    cache.commit_whole("k", "e1", name, tmp, len(data))
    whole = cache.whole_path("k", "e1", len(data))
    assert whole is not None and Path(whole).read_bytes() == data
    assert cache.total == len(data)  # the chunks went
    assert sorted(os.listdir(cache.dir)) == [os.path.basename(whole)]
    assert cache.whole_path("k", "e2", len(data)) is None


def test_the_passthrough_option_is_checked() -> None:
    assert Config("s3://bucket/p", "/mnt").validate().passthrough == "auto"
    for mode in ("on", "off"):
        assert Config("s3://bucket/p", "/mnt", passthrough=mode).validate().passthrough == mode
    with pytest.raises(ConfigError, match="--passthrough must be one of auto, on, off"):
        Config("s3://bucket/p", "/mnt", passthrough="yes").validate()


def test_stack_depth_is_zero_off_overlayfs(tmp_path: Path) -> None:
    assert stack_depth(str(tmp_path)) == (1 if _fstype(str(tmp_path)) == "overlay" else 0)


def _fstype(path: str) -> str:
    import subprocess
    return subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True,
                          text=True).stdout.strip()


def _passthrough(mode: str, tmp_path: Path):
    from types import SimpleNamespace

    from ckptfs.passthrough import Passthrough
    unused: Any = None  # the checks at mount need none of the other components
    return Passthrough(mode, str(tmp_path), uploader=unused, table=unused,
                       staging=SimpleNamespace(dir=str(tmp_path)), cache=unused, changes=unused,
                       space_wait=0, nursery=unused)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_passthrough_is_asked_for_only_where_it_can_be_had(tmp_path: Path, monkeypatch,
                                                            mode: str) -> None:
    import pyfuse3

    from ckptfs import passthrough
    monkeypatch.setattr(pyfuse3, "PASSTHROUGH_SUPPORTED", True, raising=False)
    monkeypatch.setattr(passthrough.platform, "release", lambda: "6.18.0-1-amd64")
    monkeypatch.setattr(passthrough, "_has_cap_sys_admin", lambda: True)
    assert _passthrough(mode, tmp_path).want() is True
    for broken, why in [
            (lambda: monkeypatch.setattr(passthrough, "_has_cap_sys_admin", lambda: False),
             "the daemon lacks CAP_SYS_ADMIN, which registering backing files needs"),
            (lambda: monkeypatch.setattr(passthrough.platform, "release", lambda: "6.8.0"),
             "kernel 6.8.0 has no FUSE passthrough (needs 6.9 or later)"),
            (lambda: monkeypatch.setattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False, raising=False),
             "pyfuse3 was built without passthrough: run scripts/install_fuse.sh")]:
        broken()
        pt = _passthrough(mode, tmp_path)
        if mode == "on":
            with pytest.raises(passthrough.PassthroughError, match=f"^--passthrough on: {re.escape(why)}$"):
                pt.want()
        else:
            assert pt.want() is False and pt.reason == why
    off = _passthrough("off", tmp_path)
    assert off.want() is False and off.reason == "--passthrough off"

"""POSIX behaviour through a real FUSE mount backed by the real S3 server."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import (BOTH_PATHS, BUCKET, Mount, Mounter, mounter_on_both_paths, run_ckptfs,
                      s3_bytes, s3_keys)

from ckptfs.listing import SMALL_HEADS

# Every test here runs on both paths of the bytes (conftest.BOTH_PATHS): what the kernel
# writes to the staged file itself, and what the daemon writes for it, must look the same.
mounter = pytest.fixture(params=BOTH_PATHS["params"], ids=BOTH_PATHS["ids"])(mounter_on_both_paths)


def test_write_close_uploads_and_reads_back(mnt: Mount, s3, prefix: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    (mnt.path / "a.bin").write_bytes(data)
    # close() has returned: the object is in S3 now, byte for byte.
    assert s3_bytes(s3, f"{prefix}/a.bin") == data
    assert (mnt.path / "a.bin").read_bytes() == data
    assert (mnt.path / "a.bin").stat().st_size == len(data)


def test_multipart_upload_of_a_file_larger_than_the_part_size(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--part-size", "5MiB", "--concurrency", "4")
    data = os.urandom(23 * 1024 * 1024 + 5)
    with open(mnt.path / "big.bin", "wb") as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/big.bin")
    assert head["ETag"].strip('"').endswith("-5")  # 4 full 5 MiB parts and a tail
    assert hashlib.sha256(s3_bytes(s3, f"{prefix}/big.bin")).digest() == hashlib.sha256(data).digest()


def test_objects_written_outside_appear_and_read_in_a_fresh_mount(mounter: Mounter, s3, prefix: str) -> None:
    payload = os.urandom(20 * 1024 * 1024 + 3)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ext/one.bin", Body=payload)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/top.txt", Body=b"top")
    mnt = mounter()
    assert sorted(os.listdir(mnt.path)) == ["ext", "top.txt"]
    assert os.listdir(mnt.path / "ext") == ["one.bin"]
    assert (mnt.path / "ext" / "one.bin").read_bytes() == payload
    with open(mnt.path / "ext" / "one.bin", "rb") as f:  # random reads
        f.seek(len(payload) - 100)
        assert f.read() == payload[-100:]
        f.seek(12345)
        assert f.read(1000) == payload[12345:13345]


def test_objects_written_while_mounted_show_up(mnt: Mount, s3, prefix: str) -> None:
    assert os.listdir(mnt.path) == []
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/late.txt", Body=b"late")
    import time
    time.sleep(1.5)  # beyond the metadata TTL
    assert os.listdir(mnt.path) == ["late.txt"]
    assert (mnt.path / "late.txt").read_bytes() == b"late"


def test_nothing_maps_outside_the_prefix(mounter: Mounter, s3, prefix: str) -> None:
    # SeaweedFS refuses keys with '.'/'..' components (tests/test_namespace.py covers
    # how such keys from other stores are left out); here: the prefix boundary.
    for key in ["ok.txt", "d/fine"]:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"x")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}-sibling/secret", Body=b"no")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}x", Body=b"no")
    mnt = mounter()
    assert sorted(os.listdir(mnt.path)) == ["d", "ok.txt"]
    assert (mnt.path / "d" / "fine").read_bytes() == b"x"
    with pytest.raises(FileNotFoundError):
        (mnt.path / ".." / f"{prefix}-sibling").stat()


def test_random_writes_seek_truncate_and_otrunc(mnt: Mount, s3, prefix: str) -> None:
    p = mnt.path / "r.bin"
    p.write_bytes(b"0123456789")
    with open(p, "r+b") as f:
        f.seek(3)
        f.write(b"abc")
        f.seek(20)
        f.write(b"Z")
    expected = b"012abc6789" + b"\0" * 10 + b"Z"
    assert p.read_bytes() == expected
    assert s3_bytes(s3, f"{prefix}/r.bin") == expected
    os.truncate(p, 4)
    assert s3_bytes(s3, f"{prefix}/r.bin") == b"012a"
    with open(p, "ab") as f:
        f.write(b"++")
    assert s3_bytes(s3, f"{prefix}/r.bin") == b"012a++"
    with open(p, "wb") as f:  # O_TRUNC
        f.write(b"new")
    assert s3_bytes(s3, f"{prefix}/r.bin") == b"new"
    with open(p, "wb"):
        pass
    assert s3_bytes(s3, f"{prefix}/r.bin") == b""
    assert p.stat().st_size == 0


def test_modify_existing_object_in_fresh_mount(mounter: Mounter, s3, prefix: str) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/old.bin", Body=b"A" * 100)
    mnt = mounter()
    with open(mnt.path / "old.bin", "r+b") as f:
        f.seek(50)
        f.write(b"B")
    assert s3_bytes(s3, f"{prefix}/old.bin") == b"A" * 50 + b"B" + b"A" * 49


def test_mode_owner_and_mtime_survive_a_remount(mounter: Mounter, prefix: str) -> None:
    mnt = mounter()
    p = mnt.path / "m.txt"
    p.write_text("x")
    os.chmod(p, 0o600)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_600_000_000_000_000_000, 1_600_000_000_123_456_789))
    ctime = p.stat().st_ctime_ns  # the utime's: now, well after the mtime it set
    (mnt.path / "dir").mkdir(mode=0o750)
    # Directory modes are kept in the marker's metadata, which SeaweedFS drops,
    # so across a remount only files are checked here.
    assert stat.S_IMODE((mnt.path / "dir").stat().st_mode) == 0o750
    mnt.unmount()
    again = mounter()
    st = (again.path / "m.txt").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert st.st_mtime_ns == 1_600_000_000_123_456_789
    assert st.st_ctime_ns == ctime
    assert (again.path / "m.txt").read_text() == "x"


def test_directories_and_errno(mnt: Mount, s3, prefix: str) -> None:
    d = mnt.path / "d"
    d.mkdir()
    assert f"{prefix}/d/" in s3_keys(s3, prefix)
    with pytest.raises(FileExistsError):
        d.mkdir()
    (d / "f").write_text("x")
    with pytest.raises(OSError) as e:
        os.rmdir(d)
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.listdir(d / "f")
    with pytest.raises(NotADirectoryError):
        (d / "f" / "g").write_text("x")
    with pytest.raises(IsADirectoryError):
        open(d, "w")
    with pytest.raises(IsADirectoryError):
        os.unlink(d)
    with pytest.raises(NotADirectoryError):
        os.rmdir(d / "f")
    with pytest.raises(FileNotFoundError):
        open(mnt.path / "missing")
    with pytest.raises(FileNotFoundError):
        os.unlink(mnt.path / "missing")
    with pytest.raises(OSError) as e:
        open(mnt.path / ("n" * 256), "w")
    assert e.value.errno == errno.ENAMETOOLONG
    deep = mnt.path
    with pytest.raises(OSError) as e:
        for i in range(6):
            deep = deep / ("p" * 200)
            deep.mkdir()
    assert e.value.errno == errno.ENAMETOOLONG
    os.unlink(d / "f")
    # An open file with no name left has no links (pjdfstest unlink/14). No stat before the
    # unlink: the kernel would answer the fstat from its cache, not ask the daemon.
    os.close(os.open(d / "g", os.O_WRONLY | os.O_CREAT, 0o644))
    fd = os.open(d / "g", os.O_RDONLY)
    try:
        os.unlink(d / "g")
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    os.rmdir(d)
    assert not d.exists()
    assert s3_keys(s3, f"{prefix}/d/") == []


def test_hard_links_fail_cleanly_and_symlinks_are_objects(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter()
    (mnt.path / "target.ckpt").write_bytes(b"weights")
    with pytest.raises(OSError) as e:
        os.link(mnt.path / "target.ckpt", mnt.path / "hard")
    assert e.value.errno in (errno.EPERM, errno.ENOTSUP)
    os.symlink("target.ckpt", mnt.path / "last.ckpt")
    assert os.readlink(mnt.path / "last.ckpt") == "target.ckpt"
    assert (mnt.path / "last.ckpt").read_bytes() == b"weights"
    assert s3_bytes(s3, f"{prefix}/last.ckpt") == b"target.ckpt"
    mnt.unmount()
    again = mounter()
    # Listed before any lookup: the listing itself must tell the symlink from a file.
    assert {e.name: e.is_symlink() for e in os.scandir(again.path)} == {
        "target.ckpt": False, "last.ckpt": True}
    assert os.path.islink(again.path / "last.ckpt")
    assert os.readlink(again.path / "last.ckpt") == "target.ckpt"


@pytest.mark.parametrize("durability", ["close", "async"])
def test_a_listing_among_many_tiny_files_tells_symlinks_and_fifos_even_after_renames(
        mounter: Mounter, s3, prefix: str, durability: str) -> None:
    """More small objects than a listing HEADs: the symlink and the fifo are told apart by
    their LIST entries alone (written marked), also after a rename of each and of their
    directory, which copy them in S3."""
    mnt = mounter("--durability", durability)
    d = mnt.path / "run"
    d.mkdir()
    for i in range(SMALL_HEADS + 2):
        (d / f"rank{i:03d}.json").write_text("{}")
    os.symlink("step_1000", d / "new")
    os.rename(d / "new", d / "latest")
    os.mkfifo(d / "p0", 0o600)
    os.rename(d / "p0", d / "progress.fifo")
    os.rename(d, mnt.path / "run2")
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    mnt.unmount()
    again = mounter()
    kinds = {e.name: (e.is_symlink(), e.is_file(follow_symlinks=False))
             for e in os.scandir(again.path / "run2")}
    assert kinds["latest"] == (True, False) and kinds["rank000.json"] == (False, True)
    assert stat.S_ISFIFO((again.path / "run2" / "progress.fifo").lstat().st_mode)
    assert os.readlink(again.path / "run2" / "latest") == "step_1000"


@pytest.mark.parametrize("durability", ["close", "async"])
def test_special_files_are_objects_that_keep_type_mode_and_rdev(mounter: Mounter, s3, prefix: str,
                                                                durability: str) -> None:
    mnt = mounter("--durability", durability)
    os.mkfifo(mnt.path / "progress.fifo", 0o640)
    os.mknod(mnt.path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(mnt.path / "disk", 0o640 | stat.S_IFBLK, os.makedev(8, 1))
    os.mknod(mnt.path / "empty.pt", 0o644 | stat.S_IFREG)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(mnt.path / "logger.sock"))
    # The kernel serves a fifo's data: a writer and a reader meet through it.
    reader = threading.Thread(target=lambda: got.append((mnt.path / "progress.fifo").read_bytes()))
    got: list[bytes] = []
    reader.start()
    (mnt.path / "progress.fifo").write_bytes(b"step 10")
    reader.join(10)
    assert got == [b"step 10"]
    os.chmod(mnt.path / "progress.fifo", 0o600)
    os.rename(mnt.path / "disk", mnt.path / "disk0")
    expected = {"progress.fifo": (stat.S_IFIFO, 0o600, 0), "null": (stat.S_IFCHR, 0o600, os.makedev(1, 3)),
                "disk0": (stat.S_IFBLK, 0o640, os.makedev(8, 1)), "logger.sock": (stat.S_IFSOCK, None, 0),
                "empty.pt": (stat.S_IFREG, 0o644, 0)}

    def kinds(root: Path) -> dict[str, tuple[int, int | None, int]]:
        out = {}
        for name in os.listdir(root):
            st = os.lstat(root / name)
            out[name] = (stat.S_IFMT(st.st_mode), None if name == "logger.sock" else stat.S_IMODE(st.st_mode),
                         st.st_rdev)
        return out
    assert kinds(mnt.path) == expected
    if durability == "async":
        assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/null")
    assert head["ContentLength"] == 0 and head["Metadata"]["rdev"] == str(os.makedev(1, 3))
    mnt.unmount()
    again = mounter()
    assert kinds(again.path) == expected  # listed first (ls -l)
    again.unmount()
    third = mounter()
    st = os.stat(third.path / "null")  # looked up by name first
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    with pytest.raises(OSError) as e:
        os.link(third.path / "null", third.path / "null2")
    assert e.value.errno == errno.EPERM
    for name in expected:
        os.unlink(third.path / name)
    assert s3_keys(s3, prefix) == []


def test_write_temp_then_replace_and_rename_onto_existing(mnt: Mount, s3, prefix: str) -> None:
    (mnt.path / "model.safetensors").write_bytes(b"old")
    tmp = mnt.path / ".model.safetensors.tmp"
    tmp.write_bytes(b"new weights")
    os.replace(tmp, mnt.path / "model.safetensors")
    assert (mnt.path / "model.safetensors").read_bytes() == b"new weights"
    assert s3_keys(s3, prefix) == [f"{prefix}/model.safetensors"]
    assert s3_bytes(s3, f"{prefix}/model.safetensors") == b"new weights"
    # A staged file renamed before it was ever closed: renaming costs nothing, close uploads.
    with open(mnt.path / "w.tmp", "wb") as f:
        f.write(b"pending")
        os.rename(mnt.path / "w.tmp", mnt.path / "w.final")
        assert f"{prefix}/w.tmp" not in s3_keys(s3, prefix)
    assert s3_bytes(s3, f"{prefix}/w.final") == b"pending"
    assert f"{prefix}/w.tmp" not in s3_keys(s3, prefix)


@pytest.mark.parametrize("durability", ["close", "async"])
def test_a_renamed_file_keeps_its_inode_number_past_the_metadata_ttl(
        mounter: Mounter, s3, prefix: str, durability: str) -> None:
    """pjdfstest's rename/00.t checks this (CI once failed on it): after a rename made by
    server-side copy, the next lookup of the new name (the TTL past) found the object's ETag
    spelled otherwise than the copy's answer, took the file for changed, and gave it a new
    inode number (a fifo, or a file with no local copy)."""
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/step_1.pt", Body=b"weights")
    mnt = mounter("--durability", durability, "--metadata-ttl", "0.2")
    os.mkfifo(mnt.path / "progress.fifo", 0o600)
    os.chmod(mnt.path / "progress.fifo", 0o644)
    before = {name: os.lstat(mnt.path / name).st_ino for name in ("progress.fifo", "step_1.pt")}
    for name in before:
        os.rename(mnt.path / name, mnt.path / f"{name}.moved")
    time.sleep(0.6)  # past the TTL: the kernel asks the mount again, and the mount asks S3
    after = {name: os.lstat(mnt.path / f"{name}.moved").st_ino for name in before}
    assert after == before
    assert (mnt.path / "step_1.pt.moved").read_bytes() == b"weights"


def test_a_checkpoint_saved_under_a_temporary_name_reads_back_locally_after_the_rename(
        mounter: Mounter, s3, prefix: str) -> None:
    """Save to a temporary name, then rename (how many trainers publish a checkpoint): the
    copy kept on this host follows the rename, and reading it back later fetches nothing
    from S3. It used to be fetched again once the TTL passed (the ETag spelling above)."""
    mnt = mounter("--metadata-ttl", "0.2")
    data = os.urandom(3 * 1024 * 1024)
    (mnt.path / "model.pt.tmp").write_bytes(data)
    os.rename(mnt.path / "model.pt.tmp", mnt.path / "model.pt")
    time.sleep(0.6)
    assert (mnt.path / "model.pt").read_bytes() == data
    st = json.loads(run_ckptfs("status", str(mnt.path), "--json").stdout)
    assert st["bytes_downloaded"] == 0
    assert s3_bytes(s3, f"{prefix}/model.pt") == data


def test_directory_rename_moves_everything(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter()
    src = mnt.path / "tmp-checkpoint-10"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a" * 1000)
    (src / "sub" / "b.bin").write_bytes(b"b")
    (src / "sub" / "deep" / "c.bin").write_bytes(b"c")
    os.rename(src, mnt.path / "checkpoint-10")
    assert not src.exists()
    assert sorted(os.listdir(mnt.path)) == ["checkpoint-10"]
    keys = s3_keys(s3, prefix)
    assert all("tmp-checkpoint" not in k for k in keys)
    assert s3_bytes(s3, f"{prefix}/checkpoint-10/sub/deep/c.bin") == b"c"
    (mnt.path / "checkpoint-10" / "a.bin").write_bytes(b"rewritten")
    mnt.unmount()
    again = mounter()
    root = again.path / "checkpoint-10"
    assert (root / "a.bin").read_bytes() == b"rewritten"
    assert (root / "sub" / "b.bin").read_bytes() == b"b"
    assert (root / "sub" / "deep" / "c.bin").read_bytes() == b"c"
    assert sorted(os.listdir(again.path)) == ["checkpoint-10"]


def test_shutil_copy2_move_and_rmtree(mnt: Mount, tmp_path, s3, prefix: str) -> None:
    local = tmp_path / "local.bin"
    local.write_bytes(os.urandom(2 * 1024 * 1024))
    os.utime(local, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    shutil.copy2(local, mnt.path / "copied.bin")
    assert (mnt.path / "copied.bin").read_bytes() == local.read_bytes()
    assert (mnt.path / "copied.bin").stat().st_mtime_ns == 1_700_000_000_000_000_000
    moved_src = tmp_path / "moved.bin"
    moved_src.write_bytes(b"move me")
    shutil.move(str(moved_src), str(mnt.path / "moved.bin"))
    assert not moved_src.exists()
    assert s3_bytes(s3, f"{prefix}/moved.bin") == b"move me"
    tree = tmp_path / "tree"
    (tree / "x" / "y").mkdir(parents=True)
    (tree / "x" / "y" / "z.txt").write_text("z")
    shutil.copytree(tree, mnt.path / "tree")
    shutil.move(str(mnt.path / "tree"), str(mnt.path / "tree2"))
    assert (mnt.path / "tree2" / "x" / "y" / "z.txt").read_text() == "z"
    shutil.rmtree(mnt.path / "tree2")
    assert not (mnt.path / "tree2").exists()
    assert [k for k in s3_keys(s3, prefix) if "tree" in k] == []


def test_read_only_mount_refuses_changes(mounter: Mounter, s3, prefix: str) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ro.txt", Body=b"ro")
    mnt = mounter("--read-only")
    assert (mnt.path / "ro.txt").read_bytes() == b"ro"
    for action in (lambda: open(mnt.path / "new", "w"), lambda: open(mnt.path / "ro.txt", "a"),
                   lambda: os.unlink(mnt.path / "ro.txt"), lambda: os.mkdir(mnt.path / "d"),
                   lambda: os.rename(mnt.path / "ro.txt", mnt.path / "x")):
        with pytest.raises(OSError) as e:
            action()
        assert e.value.errno == errno.EROFS


@pytest.fixture
def public_dir():
    path = Path(tempfile.mkdtemp(prefix="ckptfs-public-"))  # pytest's tmp dirs are 0700
    os.chmod(path, 0o755)
    yield path
    path.rmdir()


def test_permissions_are_enforced_for_other_users(public_dir: Path, mounter: Mounter) -> None:
    mnt = mounter("--allow-other", path=public_dir)
    (mnt.path / "private").mkdir(mode=0o700)
    (mnt.path / "readable.txt").write_text("hi")
    os.chmod(mnt.path / "readable.txt", 0o644)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    r = subprocess.run([*as_nobody, "cat", str(mnt.path / "readable.txt")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "hi", r.stderr
    r = subprocess.run([*as_nobody, "ls", str(mnt.path / "private")], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = subprocess.run([*as_nobody, "touch", str(mnt.path / "new")], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr


def test_statfs_and_xattrs(mnt: Mount) -> None:
    st = os.statvfs(mnt.path)
    assert st.f_bavail > 0 and st.f_namemax == 255
    (mnt.path / "x").write_text("x")
    assert os.listxattr(mnt.path / "x") == []
    with pytest.raises(OSError) as e:
        os.setxattr(mnt.path / "x", "user.k", b"v")
    assert e.value.errno == errno.ENOTSUP
    for call in (os.getxattr, os.removexattr):
        with pytest.raises(OSError) as e:
            call(mnt.path / "x", "user.k")
        assert e.value.errno == errno.ENOTSUP


def test_writes_send_the_daemon_no_xattr_lookup(mnt: Mount) -> None:
    """The kernel asks for a file's security.capability before each write() (to clear it),
    unless the file system said once that it has no xattrs (ENOSYS). Each lookup was a
    round trip through the FUSE thread that the writer waited for."""
    with open(mnt.path / "many-writes.bin", "wb", buffering=0) as f:
        for _ in range(200):
            f.write(b"x" * 4096)
    r = run_ckptfs("status", str(mnt.path), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    requests = st["fuse_requests"]
    # With passthrough no write reaches the daemon at all.
    assert requests.get("write", 0) == 0 if st["passthrough"] else requests["write"] >= 1
    assert requests.get("getxattr", 0) <= 1, requests


def test_cache_dir_and_staged_files_are_private(mnt: Mount) -> None:
    assert stat.S_IMODE(mnt.cache_dir.stat().st_mode) == 0o700
    with open(mnt.path / "open.bin", "wb") as f:
        f.write(b"x" * 10)
        f.flush()
        staged = list((mnt.cache_dir / "staging").iterdir())
        assert staged and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in staged)


def test_listing_pages_past_one_thousand_keys(mounter: Mounter, s3, prefix: str) -> None:
    from concurrent.futures import ThreadPoolExecutor
    names = [f"f{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/many/{n}", Body=b""), names))
    mnt = mounter()
    assert sorted(os.listdir(mnt.path / "many")) == names


def test_failed_upload_fails_close_with_eio_and_keeps_the_staged_bytes(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter()
    (mnt.path / "ok.bin").write_bytes(b"before the outage")
    data = os.urandom(1024 * 1024)
    proxy.fail_methods = {"PUT", "POST"}
    f = open(mnt.path / "lost.bin", "wb")
    f.write(data)
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.EIO
    assert proxy.failed > 0
    staged = [p for p in (mnt.cache_dir / "staging").iterdir() if p.read_bytes() == data]
    assert len(staged) == 1, "the staged copy must be kept"
    assert "upload of" in mnt.log and "staged copy kept" in mnt.log
    keys = s3_keys(s3, prefix)
    assert f"{prefix}/lost.bin" not in keys and f"{prefix}/ok.bin" in keys
    uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert uploads == []
    proxy.fail_methods = set()
    with open(mnt.path / "lost.bin", "r+b") as again:  # a later close delivers it
        assert again.read() == data
        os.fsync(again.fileno())
    assert s3_bytes(s3, f"{prefix}/lost.bin") == data


def test_rename_directory_onto_an_empty_directory_keeps_its_contents(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter()
    (mnt.path / "src" / "sub").mkdir(parents=True)
    (mnt.path / "src" / "a.bin").write_bytes(b"a")
    (mnt.path / "src" / "sub" / "b.bin").write_bytes(b"b")
    (mnt.path / "dst").mkdir()
    os.rename(mnt.path / "src", mnt.path / "dst")
    assert (mnt.path / "dst" / "a.bin").read_bytes() == b"a"
    assert s3_bytes(s3, f"{prefix}/dst/a.bin") == b"a"
    assert s3_bytes(s3, f"{prefix}/dst/sub/b.bin") == b"b"
    mnt.unmount()
    again = mounter()
    assert sorted(os.listdir(again.path)) == ["dst"]
    assert sorted(os.listdir(again.path / "dst")) == ["a.bin", "sub"]
    assert (again.path / "dst" / "sub" / "b.bin").read_bytes() == b"b"


def test_close_mode_failure_is_reported_by_sync_and_delivered_later(proxied, s3, prefix: str) -> None:
    from conftest import run_ckptfs

    proxy, mounter = proxied
    mnt = mounter()
    proxy.fail_methods = {"PUT", "POST"}
    f = open(mnt.path / "late.bin", "wb")
    f.write(b"delivered after the outage")
    with pytest.raises(OSError):
        f.close()
    r = run_ckptfs("sync", str(mnt.path))
    assert r.returncode == 1 and "upload of late.bin failed" in r.stderr, r.stderr
    proxy.fail_methods = set()
    r = run_ckptfs("sync", str(mnt.path))  # no further close needed: it keeps retrying
    assert r.returncode == 0, r.stderr
    assert s3_bytes(s3, f"{prefix}/late.bin") == b"delivered after the outage"


@pytest.mark.parametrize("durability", ["close", "async"])
def test_replacing_a_file_keeps_the_new_files_mode(mounter: Mounter, s3, prefix: str,
                                                   durability: str) -> None:
    """The kernel flushes the times of the inode a rename replaced after the rename: they
    used to be written onto the object now under that name, with the old file's mode."""
    mnt = mounter("--durability", durability)
    (mnt.path / "a.pt").write_bytes(b"old")
    os.chmod(mnt.path / "a.pt", 0o644)
    (mnt.path / "a.pt.tmp").write_bytes(b"new")
    os.chmod(mnt.path / "a.pt.tmp", 0o600)
    os.replace(mnt.path / "a.pt.tmp", mnt.path / "a.pt")
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    mnt.unmount()
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/a.pt")
    assert stat.S_IMODE(int(head["Metadata"]["mode"])) == 0o600
    fresh = mounter()
    assert stat.S_IMODE((fresh.path / "a.pt").stat().st_mode) == 0o600
    assert (fresh.path / "a.pt").read_bytes() == b"new"


@pytest.mark.parametrize("durability", ["close", "async"])
def test_an_unlinked_open_file_reports_what_was_written_through_its_descriptor(
        mounter: Mounter, s3, prefix: str, durability: str) -> None:
    """s3fs-fuse's unlink_open_file: create, unlink, write, fsync, read back, fstat, close.
    Through passthrough the daemon learns of writes from the staged file, and it stopped
    looking once the name was gone: fstat said 0 bytes (torch.load and zipfile seek to the
    end of a checkpoint that rotation deletes while an eval process loads it)."""
    mnt = mounter("--durability", durability)
    path = mnt.path / "f"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.unlink(path)
        assert os.write(fd, b"hello world") == 11
        os.fsync(fd)
        assert os.pread(fd, 11, 0) == b"hello world"
        assert os.fstat(fd).st_size == 11
        assert os.lseek(fd, 0, os.SEEK_END) == 11
    finally:
        os.close(fd)
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert s3_keys(s3, prefix) == []


@pytest.mark.parametrize("durability", ["close", "async"])
def test_cp_p_keeps_the_source_mtime(mounter: Mounter, tmp_path: Path, s3, prefix: str,
                                     durability: str) -> None:
    """s3fs-fuse's test_update_time_cp_p: `cp -p` (and `rsync -a`) set the mtime while the
    copy is still open for writing. Through passthrough the writes' own mtime, learned at
    close from the staged file, replaced it; "the latest checkpoint by mtime" then picks
    the wrong one."""
    mnt = mounter("--durability", durability)
    src = tmp_path / "src.txt"
    src.write_bytes(b"checkpoint index\n")
    os.utime(src, (1_000_000_000, 1_000_000_000))
    subprocess.run(["cp", "-p", str(src), str(mnt.path / "copy.txt")], check=True)
    st = os.stat(mnt.path / "copy.txt")
    assert st.st_mtime == 1_000_000_000
    assert st.st_ctime > 1_000_000_000  # the utime's own change: now
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    mnt.unmount()
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/copy.txt")
    assert head["Metadata"]["mtime"].startswith("1000000000")
    fresh = mounter()
    assert os.stat(fresh.path / "copy.txt").st_mtime == 1_000_000_000
    assert (fresh.path / "copy.txt").read_bytes() == b"checkpoint index\n"


def test_touch_a_of_a_directory_changes_its_ctime_as_of_a_file(mnt: Mount) -> None:
    # Found by s3fs-fuse's own suite: the kernel sends a file's ctime with an atime-only
    # SETATTR, never a directory's, so the directory's ctime stood still.
    for path in (mnt.path / "d", mnt.path / "f"):
        path.mkdir() if path.name == "d" else path.write_bytes(b"x")
        before = os.stat(path)
        time.sleep(0.05)
        subprocess.run(["touch", "-a", "-d", "2001-02-03 04:05:06", str(path)], check=True)
        after = os.stat(path)
        assert after.st_atime_ns != before.st_atime_ns, path
        assert after.st_ctime_ns > before.st_ctime_ns, path


@pytest.mark.parametrize("durability", ["close", "async"])
def test_directories_other_tools_mark_with_objects_of_their_own(mounter: Mounter, s3, prefix: str,
                                                                durability: str) -> None:
    # s3fs (and others) mark a directory with a zero-byte "dir" object of Content-Type
    # application/x-directory; Hadoop's connectors with "dir_$folder$". Both show as
    # directories, their marker objects never as files, and nothing is written back.
    put = lambda key, **kw: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"", **kw)  # noqa: E731
    put("s3fsdir", ContentType="application/x-directory", Metadata={"mode": "16832"})
    put("s3fsdir/inner.pt")
    put("s3fsempty", ContentType="application/x-directory")
    put("hadoop_$folder$")
    put("hadoop/part-0000")
    put("hadoopempty_$folder$")
    put("plain", ContentType="application/octet-stream")
    put("s3fschmod", ContentType="application/x-directory")
    keys_before = s3_keys(s3, prefix)
    mnt = mounter("--durability", durability)
    assert os.path.isdir(mnt.path / "s3fsempty")  # a lookup by name, before any listing
    assert stat.S_IMODE(os.stat(mnt.path / "s3fsdir").st_mode) == 0o700
    assert sorted(os.listdir(mnt.path)) == ["hadoop", "hadoopempty", "plain", "s3fschmod",
                                            "s3fsdir", "s3fsempty"]
    for name in ("hadoop", "hadoopempty", "s3fschmod", "s3fsdir", "s3fsempty"):
        assert (mnt.path / name).is_dir(), name
    assert os.listdir(mnt.path / "s3fsdir") == ["inner.pt"] and os.listdir(mnt.path / "hadoopempty") == []
    assert (mnt.path / "plain").is_file()
    assert s3_keys(s3, prefix) == keys_before
    # s3fs-fuse's test_external_no_slash_directory_object: a chmod of such a directory
    # (it failed with EIO: a "dir/" beside the "dir" object, which SeaweedFS refuses). Its
    # new mode goes onto s3fs's own object, which stays a directory object.
    os.chmod(mnt.path / "s3fschmod", 0o700)
    assert stat.S_IMODE(os.stat(mnt.path / "s3fschmod").st_mode) == 0o700
    os.rmdir(mnt.path / "s3fsempty")
    os.rmdir(mnt.path / "hadoopempty")
    os.rename(mnt.path / "s3fsdir", mnt.path / "moved")
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    keys = s3_keys(s3, prefix)
    assert not [k for k in keys if k.split("/", 1)[1].startswith(("s3fsdir", "s3fsempty",
                                                                   "hadoopempty"))], keys
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/s3fschmod")
    assert head["ContentType"] == "application/x-directory"
    assert stat.S_IMODE(int(head["Metadata"]["mode"])) == 0o700
    mnt.unmount()
    again = mounter()
    assert sorted(os.listdir(again.path)) == ["hadoop", "moved", "plain", "s3fschmod"]
    assert os.listdir(again.path / "moved") == ["inner.pt"]
    assert stat.S_IMODE(os.stat(again.path / "s3fschmod").st_mode) == 0o700

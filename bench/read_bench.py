"""Read-path benchmark: ckptfs against its peers on one local SeaweedFS, in one run.

    .venv/bin/python bench/read_bench.py [--gib 1] [--objects 10000] [--rounds 3] [--skip-peers]

Times, with the page cache dropped before each, every row once per round (rounds interleave
the methods, so a slow phase of this noisy machine hits all of them; the table gives the
median and the range): a cold sequential read of a GiB object
through ckptfs (fresh mount, empty cache) against boto3 download_file (tuned), s3fs-fuse
and rclone mount; a warm read (ckptfs's disk cache, after a remount) and the read-back of
a file written through ckptfs on this host, against a read from local disk; torch.load
of a checkpoint in a fresh mount against boto3 download then torch.load from local disk;
`ls -l` of a directory of N objects through ckptfs and s3fs. Needs root.

    .venv/bin/python bench/read_bench.py --restore [--tls] [--rounds 2] ...

runs the restore rows instead (bench/restore_bench.py, issue 42): the daemon's CPU per GiB
for all its threads and for the busiest one, for a cold read, 8 ranks at once, torch.load
and a safetensors load from a fresh mount, and a second read right after a cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench  # noqa: E402
from write_bench import (TUNED, Bench, Row, drop_caches, mount_s3fs, rclone_env,  # noqa: E402
                         unmount, wait_mount)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtools import devserver  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
READ = 4 * MiB


def read_all(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(READ):
            n += len(chunk)
    return n


def _span(values, fmt: str) -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


class ReadBench:
    def __init__(self, work: str, server: devserver.DevServer) -> None:
        self.work, self.server = work, server
        self.bucket = server.bucket
        self.s3 = server.client()
        self.env = devserver.client_env(server.endpoint, server.ca_bundle)
        self.samples: dict[tuple[str, str, int], list[float]] = {}
        self.notes: dict[tuple[str, str], list[str]] = {}
        self.daemon: dict[tuple[str, str], list[tuple[float, int]]] = {}  # (CPU s, peak RSS) per round
        self.client: dict[tuple[str, str], list[float]] = {}  # the client's CPU s per GiB
        self.ckptfs_args: list[str] = []
        self.passthrough_modes: list[str | None] = ["on", "off"]
        self._n = 0

    def path(self, name: str) -> str:
        self._n += 1
        return os.path.join(self.work, f"{name}-{self._n}")

    def timed(self, workload: str, method: str, size: int, fn, client_cpu: bool = False) -> float:
        """Time `fn` with the page cache dropped; with `client_cpu`, also note this process's
        CPU seconds per GiB (the raw client's cost, beside the daemon's)."""
        drop_caches()
        cpu0 = time.process_time()
        t = time.monotonic()
        fn()
        elapsed = time.monotonic() - t
        if client_cpu and size:
            self.client.setdefault((workload, method), []).append(
                (time.process_time() - cpu0) / (size / GiB))
        self.samples.setdefault((workload, method, size), []).append(elapsed)
        print(f"  {workload}: {method}: {elapsed:.2f}s", flush=True)
        return elapsed

    def note(self, workload: str, method: str, text: str) -> None:
        self.notes.setdefault((workload, method), []).append(text)

    def rows(self) -> list[Row]:
        rows = []
        for (workload, method, size), times in self.samples.items():
            note = f"median of {len(times)}: {min(times):.2f}-{max(times):.2f} s" if len(times) > 1 else ""
            extra = list(self.notes.get((workload, method), []))
            if (workload, method) in self.daemon:
                cpus, rsss = zip(*self.daemon[workload, method])
                per = [c / (size / GiB) for c in cpus] if size else []
                extra.append(f"daemon {_span(cpus, '.1f')} CPU s"
                             + (f" ({_span(per, '.2f')} s/GiB)" if per else "")
                             + f", peak RSS {_span([r / MiB for r in rsss], '.0f')} MiB")
            if (workload, method) in self.client:
                extra.append(f"client {_span(self.client[workload, method], '.2f')} CPU s/GiB")
            if extra:
                note = "; ".join([note] + extra) if note else "; ".join(extra)
            rows.append(Row(workload, method, statistics.median(times), size, note))
        return rows

    def cpu_ratio(self, workload: str, method: str, client_method: str, size: int) -> list[float]:
        """Per round: the daemon's CPU per GiB in `method` over the raw client's in
        `client_method` (issue 17: a cold read at most 0.8x download_file's)."""
        daemon = [cpu / (size / GiB) for cpu, _ in self.daemon.get((workload, method), [])]
        return [d / c for d, c in zip(daemon, self.client.get((workload, client_method), [])) if c]

    # ----- mounts ------------------------------------------------------------

    def mount_ckptfs(self, cache: str, prefix: str = "data", extra: list[str] = []) -> str:
        mnt = self.path("ck-mnt")
        os.mkdir(mnt)
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{self.bucket}/{prefix}", mnt,
                            "--cache-dir", cache, *extra, *self.ckptfs_args], env=self.env,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ckptfs mount failed: {r.stderr}")
        return mnt

    def unmount_ckptfs(self, mnt: str) -> None:
        subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=self.env, capture_output=True)
        unmount(mnt)

    def mount_s3fs(self) -> str:
        mnt = self.path("s3fs-mnt")
        mount_s3fs(self.server, "data", mnt, self.path("s3fs-passwd"), self.env)
        return mnt

    def mount_rclone(self) -> tuple[str, subprocess.Popen]:
        mnt = self.path("rclone-mnt")
        os.mkdir(mnt)
        proc = subprocess.Popen(["rclone", "mount", f"bench:{self.bucket}/data", mnt,
                                 "--cache-dir", self.path("rclone-cache")],
                                env=rclone_env(self.server, self.env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_mount(mnt, proc)
        return mnt, proc

    @staticmethod
    def daemon_cpu(mnt: str) -> float:
        from ckptfs.client import state_path
        return Bench._cpu(json.load(open(state_path(mnt)))["pid"])

    def note_daemon(self, workload: str, method: str, mnt: str, since: float = 0.0) -> None:
        """Record the CPU seconds (since `since`) and peak RSS of the daemon serving `mnt`."""
        from ckptfs.client import state_path
        pid = json.load(open(state_path(mnt)))["pid"]
        self.daemon.setdefault((workload, method), []).append((Bench._cpu(pid) - since,
                                                               Bench._peak_rss(pid)))


def main() -> int:
    if "--restore" in sys.argv[1:]:
        import restore_bench
        return restore_bench.main([a for a in sys.argv[1:] if a != "--restore"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the object read (GiB)")
    ap.add_argument("--objects", type=int, default=10000, help="objects in the ls -l directory (0: skip)")
    ap.add_argument("--rounds", type=int, default=3, help="times each row is measured (median reported)")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--tls", action="store_true",
                    help="S3 over HTTPS (TLS in user space, as on AWS); the peers are not run")
    ap.add_argument("--work", default="/var/tmp")
    ap.add_argument("--ckptfs-args", default="", help='more options for ckptfs mount, e.g. "--read-memory 64MiB"')
    ap.add_argument("--passthrough", choices=("both", "on", "off"), default="both",
                    help="the cold, warm and read-back rows with FUSE passthrough on, off, or both")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.skip_peers = args.skip_peers or args.tls
    if not args.skip_peers and any(shutil.which(t) is None for t in ("s3fs", "rclone")):
        print("bench: install the peers first: apt-get install s3fs rclone", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="ckptfs-rbench-", dir=args.work)
    server = write_bench.start_server(work, args.tls)  # drop_caches() waits for it to go idle
    b = ReadBench(work, server)
    b.ckptfs_args = shlex.split(args.ckptfs_args)
    b.passthrough_modes = ["on", "off"] if args.passthrough == "both" else [args.passthrough]
    size = int(args.gib * GiB)
    mounts: list[str] = []
    try:
        print("preparing objects", flush=True)
        src = os.path.join(work, "random.bin")
        with open(src, "wb") as f:
            for _ in range(size // (64 * MiB)):
                f.write(os.urandom(64 * MiB))
        b.s3.upload_file(src, b.bucket, "data/cold.bin", Config=TUNED)
        import torch
        ckpt = os.path.join(work, "ckpt.pt")
        torch.save({f"layer{i}": torch.randn(16 * MiB) for i in range(size // (64 * MiB))}, ckpt)
        ckpt_size = os.path.getsize(ckpt)
        b.s3.upload_file(ckpt, b.bucket, "data/ckpt.pt", Config=TUNED)
        os.unlink(ckpt)
        if args.objects:
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda i: b.s3.put_object(Bucket=b.bucket, Key=f"data/many/f{i:06d}.pt",
                                                        Body=b"x"), range(args.objects)))

        w = f"object-{args.gib:g}GiB"
        t = f"torch.load-{args.gib:g}GiB"
        ls = f"ls -l {args.objects} objects"
        for rnd in range(args.rounds):
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
            dl = os.path.join(work, "downloaded.bin")
            b.timed(w, "boto3 download_file (tuned)", size,
                    lambda: b.s3.download_file(b.bucket, "data/cold.bin", dl, Config=TUNED),
                    client_cpu=True)
            b.timed(w, "local disk read", size, lambda: read_all(dl))
            os.unlink(dl)
            # Passthrough on (the kernel reads local files itself) and off, alternating first.
            for passthrough in (b.passthrough_modes if rnd % 2 == 0 else b.passthrough_modes[::-1]):
                flag = ["--passthrough", passthrough] if passthrough else []
                off = " (passthrough off)" if passthrough == "off" else ""
                cache = b.path("ck-cache")
                mnt = b.mount_ckptfs(cache, extra=flag)
                mounts.append(mnt)
                cold = "ckptfs cold read (fresh mount, empty cache)" + off
                since = b.daemon_cpu(mnt)  # not its start-up (imports, the boto3 client): 0.3-0.4 s
                b.timed(w, cold, size, lambda: read_all(os.path.join(mnt, "cold.bin")))
                b.note_daemon(w, cold, mnt, since)
                b.unmount_ckptfs(mnt)
                mnt = b.mount_ckptfs(cache, extra=flag)  # same cache dir: warm
                mounts.append(mnt)
                warm = "ckptfs warm read (disk cache, after remount)" + off
                since = b.daemon_cpu(mnt)
                b.timed(w, warm, size, lambda: read_all(os.path.join(mnt, "cold.bin")))
                b.note_daemon(w, warm, mnt, since)
                shutil.copyfile(src, os.path.join(mnt, "written.bin"))  # close mode: in S3 on return
                back = "ckptfs read-back of a file written here" + off
                since = b.daemon_cpu(mnt)
                b.timed(w, back, size, lambda: read_all(os.path.join(mnt, "written.bin")))
                b.note_daemon(w, back, mnt, since)
                b.unmount_ckptfs(mnt)
                shutil.rmtree(cache, ignore_errors=True)
            if not args.skip_peers:
                s3fs = b.mount_s3fs()  # fresh every round, as ckptfs's: no stat cache carried over
                mounts.append(s3fs)
                b.timed(w, "s3fs-fuse cold read", size, lambda: read_all(os.path.join(s3fs, "cold.bin")))
                rcl, proc = b.mount_rclone()
                mounts.append(rcl)
                b.timed(w, "rclone mount cold read", size, lambda: read_all(os.path.join(rcl, "cold.bin")))
                unmount(rcl)
                proc.terminate()
                proc.wait(30)

            local_ckpt = os.path.join(work, "dl.pt")
            b.timed(t, "boto3 download, then torch.load from local disk", ckpt_size, lambda: (
                b.s3.download_file(b.bucket, "data/ckpt.pt", local_ckpt, Config=TUNED), torch.load(local_ckpt)))
            os.unlink(local_ckpt)
            cache = b.path("ck-cache")
            mnt = b.mount_ckptfs(cache)
            mounts.append(mnt)
            load = "ckptfs torch.load (fresh mount, empty cache)"
            since = b.daemon_cpu(mnt)
            b.timed(t, load, ckpt_size, lambda: torch.load(os.path.join(mnt, "ckpt.pt")))
            b.note_daemon(t, load, mnt, since)
            b.unmount_ckptfs(mnt)
            shutil.rmtree(cache, ignore_errors=True)

            if args.objects:
                cache = b.path("ck-cache")
                mnt = b.mount_ckptfs(cache)
                mounts.append(mnt)
                b.timed(ls, "ckptfs (fresh mount)", 0, lambda: subprocess.run(
                    ["ls", "-l", os.path.join(mnt, "many")], check=True, stdout=subprocess.DEVNULL))
                b.unmount_ckptfs(mnt)
                shutil.rmtree(cache, ignore_errors=True)
                if not args.skip_peers:
                    b.timed(ls, "s3fs-fuse", 0, lambda: subprocess.run(
                        ["ls", "-l", os.path.join(s3fs, "many")], check=True, stdout=subprocess.DEVNULL))
            if not args.skip_peers:
                unmount(s3fs)
        os.unlink(src)
        print()
        print(report(b.rows(), b.cpu_ratio(w, "ckptfs cold read (fresh mount, empty cache)",
                                             "boto3 download_file (tuned)", size)))
        return 0
    finally:
        for m in mounts:
            unmount(m)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(rows: list[Row], cold_cpu: list[float] | None = None) -> str:
    lines = [f"ckptfs read benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB, {write_bench.SERVER_NOTE}",
             "", "| workload | method | seconds | MiB/s | notes |", "|---|---|---:|---:|---|"]
    for r in rows:
        rate = f"{r.mib_s:.0f}" if r.size else ""
        lines.append(f"| {r.workload} | {r.method} | {r.seconds:.2f} | {rate} | {r.note} |")
    t = {r.method: r.seconds for r in rows}
    lines.append("")

    def ratio(text: str, num: str, den: str, target: str) -> None:
        if num in t and den in t and t[den]:
            lines.append(f"- {text} = {t[num] / t[den]:.2f} ({target})")
    ratio("cold read throughput / boto3 download_file", "boto3 download_file (tuned)",
          "ckptfs cold read (fresh mount, empty cache)", "target >= 0.9")
    ratio("cold read throughput / s3fs-fuse", "s3fs-fuse cold read",
          "ckptfs cold read (fresh mount, empty cache)", "target >= 1.0")
    ratio("warm read throughput / local disk", "local disk read",
          "ckptfs warm read (disk cache, after remount)", "target >= 0.8")
    for off in ("", " (passthrough off)"):  # issue 31: time against a local read
        ratio(f"warm read time / local disk{off}", "ckptfs warm read (disk cache, after remount)" + off,
              "local disk read", "target <= 1.15" if not off else "the daemon's path")
        ratio(f"read-back time / local disk{off}", "ckptfs read-back of a file written here" + off,
              "local disk read", "target <= 1.15" if not off else "the daemon's path")
    ratio("read-back throughput / local disk", "local disk read",
          "ckptfs read-back of a file written here", "target >= 0.8")
    ratio("torch.load time / (boto3 download + torch.load)", "ckptfs torch.load (fresh mount, empty cache)",
          "boto3 download, then torch.load from local disk", "target <= 1.2")
    ratio("ls -l time, ckptfs / s3fs", "ckptfs (fresh mount)", "s3fs-fuse", "lower is better")
    if cold_cpu:
        lines.append(f"- cold read daemon CPU per GiB / boto3 download_file's = "
                     f"{statistics.median(cold_cpu):.2f} (rounds {_span(cold_cpu, '.2f')}; target <= 0.8)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

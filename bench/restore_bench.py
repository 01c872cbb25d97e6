"""Restore benchmark (issue 42): cold reads through ckptfs against boto3 download_file, with
the daemon's CPU per GiB for all its threads and for the busiest one, in one run.

    .venv/bin/python bench/restore_bench.py [--tls] [--gib 1] [--ranks 8] [--rounds 2]
    .venv/bin/python bench/read_bench.py --restore [--tls] ...   (the same)

Every row starts with the page cache dropped and free memory pre-touched (write_bench's
drop_caches); every ckptfs row uses a fresh mount with an empty cache and default options
(plus --passthrough off for the "(passthrough off)" rows). Rows, each round:
- a cold read (cat) of a GiB object / boto3 download_file (64 MiB parts, 8 in flight);
- a second read of it right after, in the same mount (the page cache dropped first) / a
  local read of the downloaded file;
- `--ranks` processes each reading its own object of 1/ranks GiB at once / as many
  download_file processes;
- torch.load of a GiB checkpoint from a fresh mount / download_file, then torch.load of
  the local file.
The daemon's CPU comes from /proc/PID/task/*/stat: "busiest" is the thread that spent the
most in the row, "loop" the thread that runs the FUSE handlers (trio's, the main thread).
Needs root (drop_caches). Ratios are of medians over the rounds, measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from boto3.s3.transfer import TransferConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench  # noqa: E402
from write_bench import drop_caches  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtools import devserver  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DOWNLOAD = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                          max_concurrency=8)

_READER = """import sys
n = 0
with open(sys.argv[1], "rb", buffering=0) as f:
    while chunk := f.read(4 << 20):
        n += len(chunk)
"""

_DOWNLOADER = """import sys, boto3
from boto3.s3.transfer import TransferConfig
MiB = 1 << 20
cfg = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB, max_concurrency=8)
boto3.client("s3").download_file(sys.argv[1], sys.argv[2], sys.argv[3], Config=cfg)
"""


def threads(pid: int) -> dict[int, float]:
    """CPU seconds of every thread of `pid` now."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = write_bench.Bench._cpu(pid, int(tid))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


class Daemon:
    """CPU of a ckptfs daemon over one row: all threads, the busiest, the FUSE loop's."""

    def __init__(self, mnt: str) -> None:
        from ckptfs.client import state_path
        self.pid = json.load(open(state_path(mnt)))["pid"]
        self.before = threads(self.pid)

    def spent(self) -> tuple[float, float, float]:
        after = threads(self.pid)
        deltas = {t: c - self.before.get(t, 0.0) for t, c in after.items()}
        return sum(deltas.values()), max(deltas.values()), deltas.get(self.pid, 0.0)

    def stats(self, mnt: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "ckptfs", "status", "--json", mnt],
                           capture_output=True, text=True)
        return json.loads(r.stdout) if r.returncode == 0 else {}


class Restore:
    def __init__(self, work: str, server: devserver.DevServer, gib: float, ranks: int) -> None:
        self.work, self.server = work, server
        self.s3 = server.client()
        self.env = devserver.client_env(server.endpoint, server.ca_bundle)
        self.size = int(gib * GiB)
        self.ranks = ranks
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[tuple[float, float, float, int]]] = {}  # total, busiest, loop, rss
        self.client: dict[str, list[float]] = {}
        self.tree = ""  # another source tree's ckptfs (a worktree of an older commit)
        self.torch = True  # the torch.load and safetensors rows
        self._n = 0

    def path(self, name: str) -> str:
        self._n += 1
        return os.path.join(self.work, f"{name}-{self._n}")

    def put(self, key: str, size: int) -> str:
        src = self.path("src")
        with open(src, "wb") as f:
            for _ in range(max(1, size // (64 * MiB))):
                f.write(os.urandom(min(size, 64 * MiB)))
        self.s3.upload_file(src, self.server.bucket, key, Config=DOWNLOAD)
        return src

    def timed(self, row: str, fn, client: bool = False) -> float:
        drop_caches()
        cpu0 = os.times()
        t = time.monotonic()
        fn()
        elapsed = time.monotonic() - t
        if client:
            c = os.times()
            used = (c.user - cpu0.user) + (c.system - cpu0.system) + (
                c.children_user - cpu0.children_user) + (c.children_system - cpu0.children_system)
            self.client.setdefault(row, []).append(used)
        self.times.setdefault(row, []).append(elapsed)
        print(f"  {row}: {elapsed:.2f} s", flush=True)
        return elapsed

    def mount(self, extra: list[str]) -> str:
        mnt, cache = self.path("mnt"), self.path("cache")
        os.mkdir(mnt)
        env = dict(self.env, PYTHONPATH=self.tree) if self.tree else self.env
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{self.server.bucket}/data",
                            mnt, "--cache-dir", cache, *extra], env=env, capture_output=True,
                           text=True, cwd=self.tree or None)  # (-m puts the cwd first on sys.path)
        if r.returncode:
            log = os.path.join(cache, "ckptfs.log")
            tail = open(log).read()[-2000:] if os.path.exists(log) else ""
            raise RuntimeError(f"ckptfs mount failed: {r.stderr}{tail}")
        return mnt

    def unmount(self, mnt: str) -> None:
        subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=self.env,
                       capture_output=True)
        write_bench.unmount(mnt)

    def daemon_row(self, row: str, mnt: str, fn) -> None:
        d = Daemon(mnt)
        self.timed(row, fn)
        total, busiest, loop = d.spent()
        self.cpu.setdefault(row, []).append((total, busiest, loop, write_bench.Bench._peak_rss(d.pid)))
        print(f"    daemon {total:.2f} CPU s, busiest thread {busiest:.2f}, loop {loop:.2f}", flush=True)

    def round(self, modes: list[str]) -> None:
        b = self.server.bucket
        dl = self.path("dl")
        self.timed("cold: download_file", lambda: self.s3.download_file(b, "data/cold.bin", dl,
                                                                        Config=DOWNLOAD), client=True)
        self.timed("second: local read", lambda: cat(dl))
        os.unlink(dl)
        for mode in modes:
            tag = "" if mode == "on" else " (passthrough off)"
            mnt = self.mount(["--passthrough", mode])
            try:
                self.daemon_row("cold: ckptfs" + tag, mnt, lambda: cat(os.path.join(mnt, "cold.bin")))
                # Right after: what a restarted rank, or a second reader, pays (from the disk,
                # as the local read it is compared with).
                self.daemon_row("second: ckptfs" + tag, mnt,
                                lambda: cat(os.path.join(mnt, "cold.bin")))
            finally:
                self.unmount(mnt)
        outs = [self.path("dl") for _ in range(self.ranks)]
        self.timed(f"{self.ranks} ranks: download_file", lambda: parallel(
            [[sys.executable, "-c", _DOWNLOADER, b, f"data/rank{i}.bin", outs[i]]
             for i in range(self.ranks)], self.env), client=True)
        for o in outs:
            os.unlink(o)
        for mode in modes:
            tag = "" if mode == "on" else " (passthrough off)"
            mnt = self.mount(["--passthrough", mode])
            try:
                self.daemon_row(f"{self.ranks} ranks: ckptfs" + tag, mnt, lambda: parallel(
                    [[sys.executable, "-c", _READER, os.path.join(mnt, f"rank{i}.bin")]
                     for i in range(self.ranks)], self.env))
            finally:
                self.unmount(mnt)
        if not self.torch:
            return
        import torch
        from safetensors.torch import load_file
        for name, key, load in (("torch.load", "ckpt.pt", lambda p: torch.load(p, weights_only=True)),
                                ("safetensors", "ckpt.safetensors", load_file)):
            local = self.path("dl")
            self.timed(f"{name}: download_file + {name}", lambda: (
                self.s3.download_file(b, f"data/{key}", local, Config=DOWNLOAD), load(local)))
            os.unlink(local)
            mnt = self.mount([])
            try:
                self.daemon_row(f"{name}: ckptfs", mnt, lambda: load(os.path.join(mnt, key)))
            finally:
                self.unmount(mnt)

    def report(self, tls: bool) -> str:
        med = {row: statistics.median(v) for row, v in self.times.items()}
        lines = [f"restore bench, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
                 f"{write_bench.SERVER_NOTE}, {self.size / GiB:g} GiB, {len(next(iter(self.times.values())))} rounds",
                 "", "| row | median s | range | daemon CPU s/GiB | busiest thread s/GiB | loop s/GiB | peak RSS MiB |",
                 "|---|---:|---|---:|---:|---:|---:|"]
        for row, v in self.times.items():
            size = self.size
            cells = ["", "", "", ""]
            if row in self.cpu:
                tot, busy, loop, rss = zip(*self.cpu[row])
                cells = [span([t / (size / GiB) for t in tot]), span([x / (size / GiB) for x in busy]),
                         span([x / (size / GiB) for x in loop]), span([r / MiB for r in rss], ".0f")]
            if row in self.client:
                cells[0] = f"(client {span([c / (size / GiB) for c in self.client[row]])})"
            lines.append(f"| {row} | {med[row]:.2f} | {span(v)} | " + " | ".join(cells) + " |")
        lines.append("")

        def ratio(name: str, num: str, den: str, target: str) -> None:
            if num in med and den in med:
                lines.append(f"- {name}: {med[num] / med[den]:.2f} ({target})")
        for tag in ("", " (passthrough off)"):
            ratio("cold read / download_file" + tag, "cold: ckptfs" + tag, "cold: download_file",
                  "target <= 0.9")
            ratio(f"{self.ranks} ranks / {self.ranks} download_file" + tag,
                  f"{self.ranks} ranks: ckptfs" + tag, f"{self.ranks} ranks: download_file",
                  "target <= 0.9")
            ratio("second read / local read" + tag, "second: ckptfs" + tag, "second: local read",
                  "target <= 1.1")
        for name in ("torch.load", "safetensors"):
            ratio(f"{name} / (download_file + {name})", f"{name}: ckptfs",
                  f"{name}: download_file + {name}", "target <= 0.6")
        if "cold: ckptfs" in self.cpu and "cold: download_file" in self.client:
            d = statistics.median(c[0] for c in self.cpu["cold: ckptfs"])
            c = statistics.median(self.client["cold: download_file"])
            lines.append(f"- cold read daemon CPU / download_file's CPU: {d / c:.2f} "
                         f"({'target <= 0.6' if tls else 'target: daemon <= 0.35 s/GiB'})")
        return "\n".join(lines)


def span(values, fmt: str = ".2f") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def cat(path: str) -> None:
    subprocess.run([sys.executable, "-c", _READER, path], check=True)


def parallel(cmds: list[list[str]], env: dict) -> None:
    procs = [subprocess.Popen(c, env=env) for c in cmds]
    if any(p.wait() for p in procs):
        raise RuntimeError("a reader failed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tls", action="store_true", help="S3 over HTTPS (TLS in user space, as on AWS)")
    ap.add_argument("--passthrough", choices=("both", "on", "off"), default="both")
    ap.add_argument("--work", default="/var/tmp")
    ap.add_argument("--tree", default="", help="mount the ckptfs of this source tree instead "
                    "(e.g. a git worktree of an older commit), for before/after")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("restore_bench: needs root (drop_caches)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="ckptfs-restore-", dir=args.work)
    server = write_bench.start_server(work, args.tls)
    os.environ.update(devserver.client_env(server.endpoint, server.ca_bundle))
    r = Restore(work, server, args.gib, args.ranks)
    r.tree, r.torch = os.path.abspath(args.tree) if args.tree else "", not args.skip_torch
    modes = ["on", "off"] if args.passthrough == "both" else [args.passthrough]
    try:
        print("preparing objects", flush=True)
        os.unlink(r.put("data/cold.bin", r.size))
        for i in range(args.ranks):
            os.unlink(r.put(f"data/rank{i}.bin", r.size // args.ranks))
        if r.torch:
            import torch
            from safetensors.torch import save_file
            state = {f"layer{i}": torch.randn(16 * MiB) for i in range(max(1, r.size // (64 * MiB)))}
            for key, save in (("ckpt.pt", torch.save), ("ckpt.safetensors", save_file)):
                ckpt = r.path(key)
                save(state, ckpt)
                r.s3.upload_file(ckpt, server.bucket, f"data/{key}", Config=DOWNLOAD)
                os.unlink(ckpt)
            del state
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds}", flush=True)
            r.round(modes if n % 2 == 0 else modes[::-1])
        print()
        print(r.report(args.tls))
        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Directory-rename benchmark: a checkpoint commit by rename, this tree against another, in one run.

    .venv/bin/python bench/rename_bench.py --base /tmp/base [--files 24 --mib 8 --rounds 5]

`--base` is a checkout of another ckptfs (e.g. `git worktree add /tmp/base main`); its
daemon runs with PYTHONPATH pointing at it. Per round and tree, in alternating order: a
fresh mount in each durability mode, a directory of N files written and synced, then the
timed `os.rename(step.tmp, step)` (close mode: S3 has the new names when it returns; async
mode: the same, the log having settled before). Row `async-unsynced` renames right after
the writes, as a trainer commits: the rename waits for the log to upload them first. The
table gives the median and range of each, and the ratio this tree / base within each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench  # noqa: E402
from write_bench import drop_caches, unmount  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def one(server, work: str, tree: str, row: str, files: int, size: int) -> float:
    mode = row.split("-")[0]
    env = write_bench.devserver.client_env(server.endpoint) | {"PYTHONPATH": tree}
    mnt = os.path.join(work, f"mnt-{uuid.uuid4().hex[:8]}")
    os.mkdir(mnt)
    source = f"s3://{server.bucket}/r-{uuid.uuid4().hex[:8]}"
    subprocess.run([sys.executable, "-m", "ckptfs", "mount", source, mnt, "--cache-dir", mnt + "-cache",
                    "--endpoint-url", server.endpoint, "--durability", mode], env=env, check=True,
                   capture_output=True)
    try:
        src = os.path.join(mnt, "step.tmp")
        os.mkdir(src)
        data = os.urandom(size)
        for i in range(files):
            with open(os.path.join(src, f"shard_{i:02d}.pt"), "wb") as f:
                f.write(data)
        if row != "async-unsynced":
            subprocess.run([sys.executable, "-m", "ckptfs", "sync", mnt], env=env, check=True,
                           capture_output=True)
            drop_caches()
        started = time.perf_counter()
        os.rename(src, os.path.join(mnt, "step"))
        return time.perf_counter() - started
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=env, capture_output=True)
        unmount(mnt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a checkout of the ckptfs to compare against")
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default="/var/tmp")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.base, "ckptfs")):
        ap.error(f"--base {args.base}: no ckptfs package there")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    work = tempfile.mkdtemp(prefix="ckptfs-rename-bench-", dir=args.work)
    server = write_bench.start_server(work)
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    try:
        for rnd in range(args.rounds):
            for mode in ("close", "async", "async-unsynced"):
                order = [("this", REPO), ("base", args.base)]
                if rnd % 2:
                    order.reverse()
                got = {}
                for name, tree in order:
                    got[name] = one(server, work, tree, mode, args.files, args.mib * MiB)
                    times.setdefault((name, mode), []).append(got[name])
                    print(f"round {rnd + 1} {mode} {name}: {got[name]:.3f} s", flush=True)
                ratios.setdefault(mode, []).append(got["this"] / got["base"])
    finally:
        server.stop()
    print(f"\nrename of a directory of {args.files} x {args.mib} MiB, median (range) of {args.rounds} rounds")
    for (name, mode), ts in sorted(times.items()):
        print(f"  {mode:14s} {name:4s}  {statistics.median(ts):.3f} s  ({min(ts):.3f}-{max(ts):.3f})")
    for mode, rs in ratios.items():
        print(f"  {mode:14s} this/base  {statistics.median(rs):.2f}  ({min(rs):.2f}-{max(rs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

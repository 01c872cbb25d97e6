"""`ls -l` of a directory of N objects on a fresh mount, this tree against another, in one run.

    git worktree add /tmp/base <rev>
    .venv/bin/python bench/ls_bench.py --base /tmp/base [--objects 10000] [--rounds 5]
        [--modes close,async]

One SeaweedFS; N one-byte objects under `many/`. Per round, mode and tree (the trees
alternating which goes first): a fresh mount (the tree's `python -m ckptfs` on PYTHONPATH),
`ls -l MOUNT/many` timed, unmount. The table gives the median and range per tree and mode,
and the median of the per-round ratios this tree / base (read_bench.py's ls row, without
the rest of that bench).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench  # noqa: E402
from write_bench import unmount, warm_free_memory  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_ls(server, work: str, tree: str, mode: str, source: str) -> float:
    env = write_bench.devserver.client_env(server.endpoint) | {"PYTHONPATH": tree}
    mnt = os.path.join(work, f"mnt-{uuid.uuid4().hex[:8]}")
    os.mkdir(mnt)
    subprocess.run([sys.executable, "-m", "ckptfs", "mount", source, mnt, "--cache-dir",
                    mnt + "-cache", "--endpoint-url", server.endpoint, "--durability", mode],
                   env=env, check=True, capture_output=True)
    try:
        warm_free_memory()
        started = time.perf_counter()
        subprocess.run(["ls", "-l", os.path.join(mnt, "many")], check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - started
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=env, capture_output=True)
        unmount(mnt)
        shutil.rmtree(mnt + "-cache", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a checkout of the ckptfs to compare against")
    ap.add_argument("--objects", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="close,async")
    ap.add_argument("--work", default="/var/tmp")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.base, "ckptfs")):
        ap.error(f"--base {args.base}: no ckptfs package there")
    modes = args.modes.split(",")
    if not set(modes) <= {"close", "async"} or args.rounds < 1 or args.objects < 1:
        ap.error("--modes takes close and/or async; --rounds and --objects at least 1")
    work = tempfile.mkdtemp(prefix="ckptfs-ls-bench-", dir=args.work)
    server = write_bench.start_server(work)
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    try:
        s3 = server.client()
        prefix = f"ls-{uuid.uuid4().hex[:6]}"
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: s3.put_object(Bucket=server.bucket, Key=f"{prefix}/many/f{i:06d}.pt",
                                                  Body=b"x"), range(args.objects)))
        source = f"s3://{server.bucket}/{prefix}"
        for rnd in range(args.rounds):
            for mode in modes:
                order = [("this", REPO), ("base", args.base)]
                if rnd % 2:
                    order.reverse()
                got = {}
                for name, tree in order:
                    got[name] = timed_ls(server, work, tree, mode, source)
                    times.setdefault((name, mode), []).append(got[name])
                ratios.setdefault(mode, []).append(got["this"] / got["base"])
                print(f"round {rnd + 1} {mode}: this {got['this']:.2f}s base {got['base']:.2f}s",
                      flush=True)
        print(f"\nls -l of {args.objects} objects, fresh mount, {args.rounds} rounds")
        print(f"{'mode':6} {'this (median, range)':>26} {'base (median, range)':>26} {'this/base':>10}")
        for mode in modes:
            cells = []
            for name in ("this", "base"):
                t = times[(name, mode)]
                cells.append(f"{statistics.median(t):.2f}s ({min(t):.2f}-{max(t):.2f})")
            print(f"{mode:6} {cells[0]:>26} {cells[1]:>26} {statistics.median(ratios[mode]):>10.3f}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

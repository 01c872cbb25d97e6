"""Checkpoint rotation through a mount: save into `N.tmp/`, rename it to `N`, rmtree it.

    python tests/rotationcheck.py MOUNT [--trials 200] [--pause-max 2] [--drop-caches 0.2]

Each trial makes `ckpts/N.tmp/` with three 100 kB files and a subdirectory `sub/` of three
1 kB files, renames it to `ckpts/N` after a random pause of 0 to --pause-max seconds, and
runs shutil.rmtree on it after another such pause (Orbax's commit and rotation; issue 44
found it failing with ENOTEMPTY in async mode). A trial fails if a call fails; it is stale
if, after rmtree returned, `N` or `N.tmp` still exists or is listed. --drop-caches makes a
thread drop the kernel's dentries and inodes every that many seconds meanwhile (root).
Prints one JSON line; exits 1 if any trial failed or was stale.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time


def dropper(every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2")


def trial(ckpts: str, n: int, pause_max: float, rng: random.Random) -> str | None:
    """None if the trial went as it should, else what went wrong."""
    tmp, final = os.path.join(ckpts, f"{n}.tmp"), os.path.join(ckpts, str(n))
    try:
        os.makedirs(os.path.join(tmp, "sub"))
        for i in range(3):
            with open(os.path.join(tmp, f"shard_{i}.bin"), "wb") as f:
                f.write(os.urandom(100_000))
            with open(os.path.join(tmp, "sub", f"meta_{i}.json"), "wb") as f:
                f.write(os.urandom(1000))
        time.sleep(rng.uniform(0, pause_max))
        os.rename(tmp, final)
        time.sleep(rng.uniform(0, pause_max))
        shutil.rmtree(final)
    except OSError as exc:
        return f"failed: {exc}"
    left = [p for p in (tmp, final) if os.path.lexists(p)]
    listed = [p for p in (f"{n}.tmp", str(n)) if p in os.listdir(ckpts)]
    if left or listed:
        return f"stale: exists {left}, listed {listed}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mount")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--pause-max", type=float, default=2.0)
    ap.add_argument("--drop-caches", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    ckpts = os.path.join(args.mount, "ckpts")
    os.makedirs(ckpts, exist_ok=True)
    rng = random.Random(args.seed)
    stop = threading.Event()
    if args.drop_caches > 0:
        threading.Thread(target=dropper, args=(args.drop_caches, stop), daemon=True).start()
    problems: dict[int, str] = {}
    start = time.monotonic()
    try:
        for n in range(args.trials):
            problem = trial(ckpts, n, args.pause_max, rng)
            if problem is not None:
                problems[n] = problem
    finally:
        stop.set()
    failed = sum(p.startswith("failed") for p in problems.values())
    print(json.dumps({"trials": args.trials, "failed": failed, "stale": len(problems) - failed,
                      "problems": {str(k): v for k, v in list(problems.items())[:10]},
                      "seconds": round(time.monotonic() - start, 1)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

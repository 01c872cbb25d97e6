"""Does a mount answer ENOENT for files that exist once the kernel forgets inodes? (issue 34)

Two workloads through a real mount, both with the kernel's dentry and inode caches dropped
(`/proc/sys/vm/drop_caches`, as memory pressure does; needs root):

- `stat_after_drop`: a synced file is stat'ed right after a drop, in the mount's root and in
  a subdirectory, with its directory listed just before the drop or not.
- `random_workload`: creates, overwrites, renames, unlinks, listings, stats and reads over
  three directories, checked one by one against a model, while another thread drops the
  caches every 0.2 s. `compare_tree` then checks a fresh mount against the model.

tests/test_forget.py runs both small; the acceptance figures come from running this file:

    .venv/bin/python devtools/forget_check.py [--tries 100] [--ops 5000]
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

DIRS = ("", "a", "b")  # the mount's root and two subdirectories
CASES = ("root, listed", "root, not listed", "subdir, listed", "subdir, not listed")


def drop_caches() -> None:
    """What memory pressure does: the kernel forgets unused dentries and inodes (FORGET)."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def stat_after_drop(mnt: Path, tries: int, pause: float = 0.3) -> dict[str, int]:
    """ENOENTs out of `tries` per case for a file that exists. The files must be in S3 (or
    journaled) before: written by `prepare_stat_files`, then synced."""
    failures = dict.fromkeys(CASES, 0)
    for _ in range(tries):
        for case in CASES:
            directory = mnt / "sub" if case.startswith("subdir") else mnt
            if case.endswith(", listed"):
                os.listdir(directory)
            drop_caches()
            try:
                os.stat(directory / "file.pt")
            except FileNotFoundError:
                failures[case] += 1
            time.sleep(pause)
    return failures


def prepare_stat_files(mnt: Path) -> None:
    (mnt / "sub").mkdir()
    for directory in (mnt, mnt / "sub"):
        (directory / "file.pt").write_bytes(os.urandom(1000))


class Dropper:
    """Drops the kernel's caches every `interval` seconds while in use."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.stop = threading.Event()
        self.drops = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            drop_caches()
            self.drops += 1

    def __enter__(self) -> Dropper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _outcome(fn: Callable[[], object]) -> tuple[str, object]:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, exc.errno))


def random_workload(mnt: Path, ops: int, seed: int, names: int = 40) -> tuple[dict[str, bytes], list[str]]:
    """Random namespace operations on `mnt` checked against a model, with the caches dropped
    every 0.2 s. Returns the model and every wrong answer (empty if none)."""
    rng = random.Random(seed)
    model: dict[str, bytes] = {}
    wrong: list[str] = []
    for d in DIRS[1:]:
        (mnt / d).mkdir()

    def pick() -> str:
        return os.path.join(rng.choice(DIRS), f"f{rng.randrange(names)}")

    def check(what: str, got: tuple[str, object], want: tuple[str, object]) -> None:
        if got != want:
            wrong.append(f"{what}: got {got!r}, the model says {want!r}")

    def absent(path: str) -> tuple[str, object]:
        return ("err", "ENOENT")

    with Dropper():
        for i in range(ops):
            op = rng.choices(("write", "rename", "unlink", "listdir", "stat", "read"),
                             (4, 2, 1, 2, 4, 3))[0]
            path = pick()
            where = mnt / path
            if op == "write":
                data = rng.randbytes(rng.randrange(2000))
                check(f"#{i} write {path}", _outcome(lambda: where.write_bytes(data)), ("ok", len(data)))
                model[path] = data
            elif op == "rename":
                dst = pick()
                want = ("ok", None) if path in model else absent(path)
                check(f"#{i} rename {path} {dst}", _outcome(lambda: os.rename(where, mnt / dst)), want)
                if path in model and dst != path:
                    model[dst] = model.pop(path)
            elif op == "unlink":
                want = ("ok", None) if path in model else absent(path)
                check(f"#{i} unlink {path}", _outcome(lambda: os.unlink(where)), want)
                model.pop(path, None)
            elif op == "listdir":
                d = rng.choice(DIRS)
                want_names = sorted([p.rpartition("/")[2] for p in model if p.rpartition("/")[0] == d]
                                    + ([x for x in DIRS[1:]] if d == "" else []))
                check(f"#{i} listdir {d!r}", _outcome(lambda: sorted(os.listdir(mnt / d))),
                      ("ok", want_names))
            elif op == "stat":
                want = ("ok", len(model[path])) if path in model else absent(path)
                check(f"#{i} stat {path}", _outcome(lambda: os.stat(where).st_size), want)
            else:
                want = ("ok", model[path]) if path in model else absent(path)
                check(f"#{i} read {path}", _outcome(lambda: where.read_bytes()), want)
    return model, wrong


def compare_tree(mnt: Path, model: dict[str, bytes]) -> list[str]:
    """What a mount shows against the model: every difference, as a line."""
    seen: dict[str, bytes] = {}
    for d in DIRS:
        for entry in os.scandir(mnt / d):
            if entry.is_file(follow_symlinks=False):
                seen[os.path.join(d, entry.name)] = Path(entry.path).read_bytes()
            elif not (d == "" and entry.name in DIRS):
                seen[os.path.join(d, entry.name)] = b"<not a file>"
    return [f"{p}: mount has {len(seen[p]) if p in seen else None} bytes, model "
            f"{len(model[p]) if p in model else None}"
            for p in sorted(set(seen) | set(model)) if seen.get(p) != model.get(p)]


# ----- the acceptance run ------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=100, help="stats per case of the table")
    ap.add_argument("--ops", type=int, default=5000, help="operations of the random workload")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="close,async")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("forget_check: dropping the kernel's caches needs root", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from devtools import devserver

    failed = False
    with tempfile.TemporaryDirectory(prefix="forget-check-") as work:
        server = devserver.start(os.path.join(work, "s3"))
        env = devserver.client_env(server.endpoint)
        try:
            for mode in args.modes.split(","):
                failed |= _check_mode(Path(work), server, env, mode, args)
        finally:
            server.stop()
    return 1 if failed else 0


def _check_mode(work: Path, server, env: dict[str, str], mode: str, args: argparse.Namespace) -> bool:
    def mount(name: str, prefix: str) -> Path:
        mnt = work / f"{mode}-{name}"
        mnt.mkdir()
        subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{server.bucket}/{prefix}",
                        str(mnt), "--cache-dir", str(work / f"{mode}-{name}-cache"),
                        "--endpoint-url", server.endpoint, "--durability", mode],
                       env=env, check=True, capture_output=True)
        return mnt

    def ckptfs(*a: str) -> None:
        subprocess.run([sys.executable, "-m", "ckptfs", *a], env=env, check=True, capture_output=True)

    mnt = mount("table", f"{mode}-table")
    try:
        prepare_stat_files(mnt)
        ckptfs("sync", str(mnt))
        table = stat_after_drop(mnt, args.tries)
    finally:
        ckptfs("unmount", str(mnt))
    print(f"{mode} mode: ENOENT of an existing file after drop_caches, out of {args.tries} per case")
    for case, n in table.items():
        print(f"  {case:20s} {n}")
    mnt = mount("random", f"{mode}-random")
    try:
        started = time.monotonic()
        model, wrong = random_workload(mnt, args.ops, args.seed)
        took = time.monotonic() - started
        ckptfs("sync", str(mnt))
    finally:
        ckptfs("unmount", str(mnt))
    fresh = mount("fresh", f"{mode}-random")
    try:
        diff = compare_tree(fresh, model)
    finally:
        ckptfs("unmount", str(fresh))
    print(f"{mode} mode: random workload, {args.ops} operations in {took:.0f} s, caches dropped "
          f"every 0.2 s: {len(wrong)} wrong answers; a fresh mount after sync differs from the "
          f"model in {len(diff)} names")
    for line in (wrong + diff)[:20]:
        print("  " + line)
    return bool(sum(table.values()) or wrong or diff)


if __name__ == "__main__":
    sys.exit(main())

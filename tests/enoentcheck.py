"""Does a stat of an existing, synced file ever answer ENOENT after the kernel dropped its
dentries and inodes? (issue 41's residual false ENOENT)

    .venv/bin/python tests/enoentcheck.py MOUNT [MOUNT ...] [--tries 100] [--pause 0.3]

Needs root (it writes 2 to /proc/sys/vm/drop_caches before every try). In each mount it
writes `enoent-root.bin` and `enoent-dir/sub.bin`, runs `ckptfs sync`, then for each of four
cases (a file in the root or in a subdirectory; its directory listed right before the stat,
or not) stats the file `--tries` times, `--pause` seconds apart. Prints the ENOENT count
per case and exits 1 if any.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def drop() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mounts", nargs="+")
    ap.add_argument("--tries", type=int, default=100)
    ap.add_argument("--pause", type=float, default=0.3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (/proc/sys/vm/drop_caches)")
    for mnt in args.mounts:
        os.makedirs(os.path.join(mnt, "enoent-dir"), exist_ok=True)
        for rel in ("enoent-root.bin", "enoent-dir/sub.bin"):
            with open(os.path.join(mnt, rel), "wb") as f:
                f.write(b"x" * 4096)
        r = subprocess.run([sys.executable, "-m", "ckptfs", "sync", mnt], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"sync of {mnt} failed: {r.stderr.strip()}")
    misses = 0
    for mnt in args.mounts:
        for where, rel in (("root", "enoent-root.bin"), ("subdir", "enoent-dir/sub.bin")):
            for listed in (True, False):
                path = os.path.join(mnt, rel)
                n = 0
                for _ in range(args.tries):
                    drop()
                    try:
                        if listed:
                            os.listdir(os.path.dirname(path))
                        os.stat(path)
                    except FileNotFoundError:  # (of the directory's listing, or the file)
                        n += 1
                    time.sleep(args.pause)
                misses += n
                print(f"{mnt} {where:6} {'listed' if listed else 'unlisted':8} "
                      f"ENOENT {n}/{args.tries}", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())

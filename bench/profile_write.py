"""Where the daemon's CPU goes while it takes writes: py-spy over one workload.

    .venv/bin/python bench/profile_write.py [--durability close|async] [--writers 1] [--mib 1024]

Starts a local SeaweedFS, mounts ckptfs, records the daemon with py-spy (native frames, idle
threads left out) while `--writers` ranks write `--mib` MiB in all (and, in async mode, until
`ckptfs sync` returns), then prints the daemon's CPU seconds per GiB and the functions that
took the most samples, by self time and by total time. Needs root and py-spy
(`.venv/bin/pip install py-spy`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtools import devserver  # noqa: E402
from bench.write_bench import warm_free_memory  # noqa: E402

MiB = 1 << 20


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--durability", default="close", choices=["close", "async"])
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--mib", type=int, default=1024, help="MiB written in all")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--work", default="/var/tmp")
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    args = ap.parse_args()
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    work = tempfile.mkdtemp(prefix="ckptfs-prof-", dir=args.work)
    server = devserver.start(os.path.join(work, "s3"), bucket="prof")
    env = devserver.client_env(server.endpoint)
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    os.mkdir(mnt)
    per = args.mib * MiB // args.writers
    src = os.path.join(work, "src.bin")
    with open(src, "wb") as f:
        for _ in range(per // MiB):
            f.write(os.urandom(MiB))
    try:
        subprocess.run([sys.executable, "-m", "ckptfs", "mount", "s3://prof/p", mnt, "--cache-dir",
                        cache, "--durability", args.durability], env=env, check=True)
        from ckptfs.client import state_path
        pid = json.load(open(state_path(mnt)))["pid"]
        raw = os.path.join(work, "profile.txt")
        spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "250", "--nonblocking",
                                "--format", "raw", "--output", raw] + (["--gil"] if args.gil else []),
                               stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "spy.log"), "w"))
        time.sleep(1.0)
        warm_free_memory()  # the VM's reported free pages cost 1.5 CPU s/GiB to touch again
        cpu0, t = cpu_seconds(pid), time.monotonic()

        def one(i: int) -> None:
            with open(src, "rb") as fin, open(os.path.join(mnt, f"rank_{i}.bin"), "wb") as fout:
                while chunk := fin.read(4 * MiB):
                    fout.write(chunk)
        with concurrent.futures.ThreadPoolExecutor(args.writers) as pool:
            list(pool.map(one, range(args.writers)))
        closed = time.monotonic() - t
        if args.durability == "async":
            subprocess.run([sys.executable, "-m", "ckptfs", "sync", mnt], env=env, check=True)
        done = time.monotonic() - t
        cpu = cpu_seconds(pid) - cpu0
        spy.send_signal(2)
        spy.wait(60)
        gib = args.writers * per / (1 << 30)
        print(f"{args.durability}, {args.writers} writer(s), {gib:.2f} GiB: close {closed:.2f} s, "
              f"in S3 {done:.2f} s, daemon {cpu:.2f} CPU s ({cpu / gib:.2f} s/GiB)")
        if not os.path.exists(raw):
            print(open(os.path.join(work, "spy.log")).read()[-2000:])
            return 1
        report(raw, args.top)
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "unmount", mnt], env=env, capture_output=True)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(raw: str, top: int) -> None:
    """py-spy's raw format: one line per stack, frames separated by ';', then the count."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in open(raw):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        samples += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            total[frame] += n
    print(f"\n{samples} samples; by thread:")
    for name, n in threads.most_common(8):
        print(f"  {100 * n / samples:5.1f}%  {name}")
    print("\nself time:")
    for name, n in own.most_common(top):
        print(f"  {100 * n / samples:5.1f}%  {name}")
    print("\ntotal time:")
    for name, n in total.most_common(top):
        print(f"  {100 * n / samples:5.1f}%  {name}")


if __name__ == "__main__":
    sys.exit(main())

"""A trainer's loop through an S3 outage: does any call fail, how much slower is a step?

    .venv/bin/python bench/outage_bench.py [--outages hang,refuse,503] [--seconds 60]
        [--mode async] [--upload-timeout 30] [--endpoint URL]

One SeaweedFS (or `--endpoint`, a server already running), and in front of it the fault
proxy of devtools/faultproxy.py, which the mount talks to. Per outage kind, a fresh mount
and a trainer in its own process taking one step every `--interval` seconds:

- makedirs `step_N/`; model.bin and opt.bin (`--mib` MiB each) written;
- a `latest` marker replaced by `os.replace`;
- the previous step's model.bin read back and checked;
- `rm -rf` of the step three back.

After `--warmup` seconds the proxy fails every request for `--seconds` ("hang": requests
are read, never answered; "refuse": the port is closed; "503": SlowDown to everything),
then the loop runs `--cooldown` seconds more. Then `ckptfs sync` of the whole mount, and a
fresh mount straight to the server must show exactly the trainer's tree (names, sizes,
bytes). The table: step times before, the slowest during the outage and after, the calls
that failed, the sync, the comparison. Exit status 1 if a call failed or the trees differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from devtools import devserver  # noqa: E402
from devtools.faultproxy import FaultProxy  # noqa: E402
from write_bench import unmount  # noqa: E402

MiB = 1 << 20

TRAINER = r'''
import json, os, shutil, sys, time
mnt, interval, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])

def blob(n, what):
    return (f"{what}-{n}-".encode() * (size // 8 + 1))[:size]

def call(step, what, fn):
    try:
        fn()
    except OSError as exc:
        print(json.dumps({"step": step, "failed": what, "error": str(exc)}), flush=True)

def write(path, data):
    with open(path, "wb") as f:
        f.write(data)

def replace_latest(n):
    write(os.path.join(mnt, "latest.tmp"), str(n).encode())
    os.replace(os.path.join(mnt, "latest.tmp"), os.path.join(mnt, "latest"))

def read_back(n):
    with open(os.path.join(mnt, f"step_{n}", "model.bin"), "rb") as f:
        if f.read() != blob(n, "model"):
            raise OSError(0, f"step_{n}/model.bin read back wrong")

n = 0
next_at = time.monotonic()
while not os.path.exists(os.path.join(os.path.dirname(mnt), "stop-" + os.path.basename(mnt))):
    started, wall = time.monotonic(), time.time()
    d = os.path.join(mnt, f"step_{n}")
    call(n, "makedirs", lambda: os.makedirs(d, exist_ok=True))
    call(n, "write model", lambda: write(os.path.join(d, "model.bin"), blob(n, "model")))
    call(n, "write opt", lambda: write(os.path.join(d, "opt.bin"), blob(n, "opt")))
    call(n, "replace latest", lambda: replace_latest(n))
    if n >= 1:
        call(n, "read previous", lambda: read_back(n - 1))
    if n >= 3:
        call(n, "rm -rf", lambda: shutil.rmtree(os.path.join(mnt, f"step_{n - 3}")))
    print(json.dumps({"step": n, "at": wall, "seconds": time.monotonic() - started}), flush=True)
    n += 1
    next_at += interval
    time.sleep(max(0.0, next_at - time.monotonic()))
'''


def ckptfs(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def tree_of(root: str) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d)) + "/"] = "dir"
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.normpath(os.path.join(rel, f))] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


def run_one(kind: str, args: argparse.Namespace, endpoint: str, bucket: str, work: str) -> dict:
    env = devserver.client_env(endpoint)
    name = f"o-{kind}-{uuid.uuid4().hex[:6]}"
    mnt, cache = os.path.join(work, name), os.path.join(work, name + "-cache")
    os.makedirs(mnt)
    result: dict = {"outage": kind}
    with FaultProxy(endpoint) as proxy:
        r = ckptfs("mount", f"s3://{bucket}/{name}", mnt, "--cache-dir", cache, "--endpoint-url",
                   proxy.endpoint, "--durability", args.mode, "--upload-timeout",
                   str(args.upload_timeout), *args.mount_args.split(), env=env)
        if r.returncode:
            raise SystemExit(f"mount failed: {r.stderr.strip()}")
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, mnt, str(args.interval),
                                    str(args.mib * MiB)], stdout=subprocess.PIPE, text=True)
        lines: list[dict] = []
        reader = threading.Thread(target=lambda: lines.extend(json.loads(x) for x in trainer.stdout))
        reader.start()
        try:
            time.sleep(args.warmup)
            began = time.time()
            proxy.outage(kind)
            time.sleep(args.seconds)
            proxy.outage(None)
            ended = time.time()
            time.sleep(args.cooldown)
        finally:
            open(os.path.join(work, "stop-" + name), "w").close()
            trainer.wait(timeout=600)
            reader.join()
        steps = [x for x in lines if "seconds" in x]
        result["failed"] = [x for x in lines if "failed" in x]
        before = [x["seconds"] for x in steps if x["at"] + x["seconds"] < began]
        during = [x["seconds"] for x in steps if x["at"] < ended and x["at"] + x["seconds"] >= began]
        after = [x["seconds"] for x in steps if x["at"] >= ended]
        result.update(steps=len(steps), before=(min(before), max(before)), during=max(during or [0]),
                      after=max(after or [0]), during_steps=len(during))
        started = time.monotonic()
        s = ckptfs("sync", mnt, env=env, timeout=args.upload_timeout * 20)
        result["sync"] = ("ok" if s.returncode == 0 else f"FAILED: {s.stderr.strip()}")
        result["sync_seconds"] = time.monotonic() - started
        mine = tree_of(mnt)
        status = ckptfs("status", mnt, "--json", env=env)
        result["status"] = status.stdout.strip()[:400]
        ckptfs("unmount", mnt, env=env)
        unmount(mnt)
    fresh = mnt + "-fresh"
    os.makedirs(fresh)
    r = ckptfs("mount", f"s3://{bucket}/{name}", fresh, "--cache-dir", fresh + "-cache",
               "--endpoint-url", endpoint, env=env)
    try:
        theirs = tree_of(fresh)
    finally:
        ckptfs("unmount", fresh, env=env)
        unmount(fresh)
    result["identical"] = mine == theirs
    if mine != theirs:
        result["diff"] = sorted(set(mine.items()) ^ set(theirs.items()))[:10]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", default="hang,refuse,503")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--cooldown", type=float, default=20)
    ap.add_argument("--interval", type=float, default=3)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--mode", default="async", choices=("async", "close"))
    ap.add_argument("--upload-timeout", type=float, default=30)
    ap.add_argument("--mount-args", default="", help="more options for the trainer's mount")
    ap.add_argument("--endpoint", help="an S3 server already running (default: a new SeaweedFS)")
    ap.add_argument("--bucket", default=devserver.DEFAULT_BUCKET)
    ap.add_argument("--work", default="/var/tmp")
    args = ap.parse_args()
    kinds = args.outages.split(",")
    for kind in kinds:
        if kind not in ("hang", "refuse", "503"):
            ap.error(f"unknown outage {kind!r} (hang, refuse, 503)")
    work = tempfile.mkdtemp(prefix="ckptfs-outage-bench-", dir=args.work)
    server = None
    if args.endpoint is None:
        server = devserver.start(os.path.join(work, "server"))
    endpoint = args.endpoint or server.endpoint
    bad = False
    try:
        print(f"{'outage':8} {'steps':>5} {'before':>12} {'slowest during':>15} {'after':>7} "
              f"{'failed':>6}  sync  identical")
        for kind in kinds:
            r = run_one(kind, args, endpoint, args.bucket, work)
            bad |= bool(r["failed"]) or not r["identical"] or r["sync"] != "ok"
            print(f"{kind:8} {r['steps']:>5} {r['before'][0]:5.2f}-{r['before'][1]:5.2f}s "
                  f"{r['during']:14.2f}s {r['after']:6.2f}s {len(r['failed']):>6}  "
                  f"{r['sync']} ({r['sync_seconds']:.1f}s)  {r['identical']}", flush=True)
            for f in r["failed"][:10]:
                print("   failed:", f)
            if not r["identical"]:
                print("   diff:", r["diff"])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

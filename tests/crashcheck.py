"""Crash-consistency checker: a scripted trainer, a SIGKILLed daemon, and S3 judged alone.

The trainer does what checkpointing code does: per step a directory, shards, a COMPLETE
marker written last, `latest.pt` through a temp file and os.replace, an overwrite of one
`state.pt`, and keep-last-2 retention (unlink the files, rmdir). It writes its history to
a local file: a `begin` line before each operation and an `end` line after it returns.

`trial()` mounts in async mode, runs the trainer, SIGKILLs the daemon at a random moment,
and then judges what S3 holds (keys and SHA-256 of their bytes):
- disk lost (the cache dir is wiped): S3 must equal the state after some prefix of the
  history;
- disk intact (remount on the same cache dir, then `ckptfs sync`): S3 must equal the state
  after every operation that returned (plus, perhaps, the one in flight), and no multipart
  upload may be left open.

Run by hand for many kill points (a summary line at the end, one JSON line per violation):
    .venv/bin/python tests/crashcheck.py --points 200 --variant lost
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import BUCKET, Mounter, force_unmount, run_ckptfs  # noqa: E402

try:
    from ckptfs.client import state_path  # noqa: E402
except ImportError:  # an older ckptfs, to measure it with the same checker (PYTHONPATH=...)
    from ckptfs.daemon import state_path  # type: ignore[no-redef]  # noqa: E402
from devtools import devserver  # noqa: E402

MiB = 1024 * 1024
SHARD = 6 * MiB  # two parts of 5 MiB: the multipart path, parts ahead of their turn


# ----- the trainer (runs in its own process, against the mount) --------------

def trainer(root: str, history: str, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    hist = open(history, "a", buffering=1)

    def op(kind: str, *args: str, data: bytes | None = None) -> None:
        digest = hashlib.sha256(data).hexdigest() if data is not None else None
        hist.write(json.dumps(["begin", kind, list(args), digest]) + "\n")
        path = [os.path.join(root, a) for a in args]
        if kind == "put":
            with open(path[0], "wb") as f:
                f.write(data)
        elif kind == "delete":
            os.unlink(path[0])
        elif kind == "rename":
            os.replace(path[0], path[1])
        elif kind == "mkdir":
            os.mkdir(path[0])
        elif kind == "rmdir":
            os.rmdir(path[0])
        hist.write(json.dumps(["end"]) + "\n")

    for step in range(1, steps + 1):
        d = f"step_{step}"
        op("mkdir", d)
        for i in range(2):
            op("put", f"{d}/shard_{i}.pt", data=rng.randbytes(SHARD - rng.randrange(MiB)))
        op("put", f"{d}/COMPLETE", data=f"step {step}".encode())
        op("put", "latest.pt.tmp", data=rng.randbytes(rng.randrange(64 * 1024)))
        op("rename", "latest.pt.tmp", "latest.pt")
        op("put", "state.pt", data=rng.randbytes(rng.randrange(2 * MiB)))
        old = f"step_{step - 2}"
        if step > 2:
            for name in ("shard_0.pt", "shard_1.pt", "COMPLETE"):
                op("delete", f"{old}/{name}")
            op("rmdir", old)


# ----- the model ---------------------------------------------------------------

def states(history: str) -> tuple[list[dict[str, str]], int]:
    """Every state of the files (path -> SHA-256) along the history: after 0, 1, ... n
    operations, then after the one in flight if the trainer died in it; and n."""
    state: dict[str, str] = {}
    out = [dict(state)]
    done = 0
    pending = None
    for line in Path(history).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            break  # the trainer died mid-line
        if rec[0] == "begin":
            pending = rec
            continue
        assert pending is not None
        _, kind, args, digest = pending
        if kind == "put":
            state[args[0]] = digest
        elif kind == "delete":
            state.pop(args[0], None)
        elif kind == "rename":
            state[args[1]] = state.pop(args[0])
        out.append(dict(state))
        done += 1
        pending = None
    if pending is not None:  # began, never returned: it may or may not have happened
        _, kind, args, digest = pending
        nxt = dict(state)
        if kind == "put":
            nxt[args[0]] = digest
        elif kind == "delete":
            nxt.pop(args[0], None)
        elif kind == "rename" and args[0] in nxt:
            nxt[args[1]] = nxt.pop(args[0])
        out.append(nxt)
    return out, done


def s3_state(s3, prefix: str) -> dict[str, str]:
    """The files S3 shows under the prefix (name -> SHA-256), as every mount will see them:
    a rename a crash interrupted is taken as done (its intent says so; renames.py)."""
    out = {}
    intents = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/"):
                continue  # directory markers: the model is about files
            body = s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
            name = obj["Key"][len(prefix) + 1:]
            if name.startswith(".ckptfs/renames/"):
                intents.append((name, json.loads(body)))  # named by time: oldest first
            else:
                out[name] = hashlib.sha256(body).hexdigest()
    for _, intent in sorted(intents, key=lambda i: i[0]):
        src, dst = (k[len(prefix) + 1:] for k in (intent["src"], intent["dst"]))
        for name in [n for n in out if n == src or (src.endswith("/") and n.startswith(src))]:
            out[dst + name[len(src):]] = out.pop(name)
    return out


def describe(got: dict[str, str], want: dict[str, str]) -> str:
    extra = sorted(set(got) - set(want))
    missing = sorted(set(want) - set(got))
    differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    return f"extra {extra}, missing {missing}, other bytes {differ}"


# ----- one kill point ----------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    ops_done: int
    matched: int | None  # the prefix length S3 equals
    detail: str = ""


def daemon_pid(mountpoint: Path) -> int:
    with open(state_path(str(mountpoint))) as f:
        return int(json.load(f)["pid"])


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)


def wait_dead(pid: int) -> None:
    """Until the SIGKILLed `pid` is gone (or a zombie), at most 10 s."""
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)


def trial(server, s3, work: Path, variant: str, rng: random.Random, max_delay: float = 2.5,
          mount_args: tuple[str, ...] = ("--durability", "async", "--part-size", "5MiB")) -> Verdict:
    prefix = f"crash-{uuid.uuid4().hex[:10]}"
    tmp = Path(tempfile.mkdtemp(dir=work))
    mounter = Mounter(server, tmp, prefix)
    history = tmp / "history.jsonl"
    try:
        mnt = mounter(*mount_args)
        pid = daemon_pid(mnt.path)
        writer = subprocess.Popen([sys.executable, __file__, "trainer", str(mnt.path), str(history),
                                   str(rng.randrange(1 << 30)), "50"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, max_delay))
        _kill(pid)
        try:
            writer.wait(60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
        force_unmount(str(mnt.path))
        prefixes, done = states(str(history))
        if variant == "lost":
            shutil.rmtree(mnt.cache_dir)
            got = s3_state(s3, prefix)
            for i, want in enumerate(prefixes):
                if got == want:
                    return Verdict(True, done, i)
            nearest = min(range(len(prefixes)), key=lambda i: len(set(prefixes[i].items()) ^ set(got.items())))
            return Verdict(False, done, None, f"no prefix matches; nearest (after {nearest} of {done} "
                                              f"operations): {describe(got, prefixes[nearest])}")
        again = mounter(*mount_args, path=mnt.path, cache_dir=mnt.cache_dir)
        r = run_ckptfs("sync", str(again.path), endpoint=server.endpoint, timeout=300)
        if r.returncode != 0:
            return Verdict(False, done, None, f"sync after remount failed: {r.stderr.strip()}")
        got = s3_state(s3, prefix)
        uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix + "/").get("Uploads", [])
        mounter.close()
        if uploads:
            return Verdict(False, done, None, f"{len(uploads)} multipart uploads left open "
                                              f"after recovery: {[u['Key'] for u in uploads]}")
        # Everything that returned is there (and maybe the operation in flight), nothing later.
        for i in range(done, len(prefixes)):
            if got == prefixes[i]:
                return Verdict(True, done, i)
        return Verdict(False, done, None, f"after remount and sync: {describe(got, prefixes[done])}")
    finally:
        discard(mounter, tmp)


def discard(mounter: Mounter, tmp: Path) -> None:
    """A trial's mounts unmounted (forced if a daemon was killed) and its files removed."""
    try:
        mounter.close()
    except AssertionError:
        pass
    for m in mounter.mounts:
        force_unmount(str(m.path))
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--variant", choices=["lost", "intact", "both"], default="both")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-delay", type=float, default=2.5)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-crash-"))
    server = devserver.start(str(work / "weed"))
    s3 = server.client()
    variants = ["lost", "intact"] if args.variant == "both" else [args.variant]
    try:
        for variant in variants:
            bad = ops = 0
            started = time.monotonic()
            for n in range(args.points):
                v = trial(server, s3, work, variant, rng, args.max_delay)
                ops += v.ops_done
                if not v.ok:
                    bad += 1
                    print(json.dumps({"variant": variant, "point": n, "ops_done": v.ops_done,
                                      "detail": v.detail}), flush=True)
            print(f"{variant}: {args.points} kill points, {bad} violations, {ops} operations "
                  f"before the kills, seed {seed}, {time.monotonic() - started:.0f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

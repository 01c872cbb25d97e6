"""Kill-point checker for checkpoint commits by directory rename (issue 32).

A trial writes a checkpoint directory `step.tmp` through a real mount, syncs it, and renames
it to `step` (as Orbax and tmp-dir trainers commit). The daemon's S3 requests pass through a
loopback proxy that SIGKILLs the daemon just before the Nth request of the rename reaches S3
(and fails every later one), so each kill point is a distinct place between two requests;
N = 0 is a kill before the first. Then S3 is judged:

- alone, as any tool sees it: with no rename intent left, exactly one of `step.tmp` and
  `step` holds files, and it holds all of them; with an intent, every file is in S3 under one
  of the two names (the intent completes the rename at the next mount);
- through a fresh mount: on another host (the cache dir wiped, variant `lost`) or on this
  one (the same cache dir, variant `kept`), the mount shows `step.tmp` whole and no `step`,
  or `step` whole and no `step.tmp`, and no intent is left in S3.

Run by hand for many kill points (a summary line per variant, one JSON line per violation):
    .venv/bin/python tests/renamecheck.py --points 100 [--files 24 --mib 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import BUCKET, Mounter, force_unmount, run_ckptfs  # noqa: E402
from crashcheck import daemon_pid, discard, wait_dead  # noqa: E402
from devtools.faultproxy import FaultProxy  # noqa: E402

from devtools import devserver  # noqa: E402

MiB = 1 << 20
INTENTS = ".ckptfs/renames/"


@dataclass
class Verdict:
    ok: bool
    requests: int  # requests of the rename that reached S3 before the kill
    outcome: str  # "before", "after" or "intent" (S3 alone), or what was wrong
    detail: str = ""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def s3_files(s3, prefix: str) -> dict[str, str]:
    """key under the prefix -> SHA-256, for every object (markers and intents too)."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            body = s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) + 1:]] = _sha(body)
    return out


def judge_s3(got: dict[str, str], want: dict[str, str]) -> tuple[bool, str]:
    """S3 alone: `want` maps names in the directory to their digests."""
    src = {k[len("step.tmp/"):]: v for k, v in got.items() if k.startswith("step.tmp/") and not k.endswith("/")}
    dst = {k[len("step/"):]: v for k, v in got.items() if k.startswith("step/") and not k.endswith("/")}
    intents = [k for k in got if k.startswith(INTENTS)]
    if intents:
        complete = all(src.get(n) == d or dst.get(n) == d for n, d in want.items())
        return complete, "intent" if complete else f"an intent, but files lost: src {sorted(src)}, dst {sorted(dst)}"
    if src == want and not dst:
        return True, "before"
    if dst == want and not src:
        return True, "after"
    return False, f"no intent; src has {sorted(src)}, dst has {sorted(dst)}"


def judge_mount(root: Path, want: dict[str, str]) -> tuple[bool, str]:
    names = sorted(n for n in os.listdir(root))
    if names not in (["step.tmp"], ["step"]):
        return False, f"the mount's root shows {names}"
    d = root / names[0]
    seen = {}
    for dirpath, _, filenames in os.walk(d):
        for f in filenames:
            p = Path(dirpath, f)
            seen[str(p.relative_to(d))] = _sha(p.read_bytes())
    return (seen == want), (names[0] if seen == want else f"{names[0]} holds {sorted(seen)}")


def trial(server, s3, work: Path, mode: str, variant: str, kill_at: int | None,
          files: int, size: int, seed: int) -> Verdict:
    """One rename, the daemon killed before its request number `kill_at` (None: never)."""
    prefix = f"rename-{uuid.uuid4().hex[:10]}"
    tmp = Path(tempfile.mkdtemp(dir=work))
    rng = random.Random(seed)
    with FaultProxy(server.endpoint) as proxy:
        mounter = Mounter(dataclasses.replace(server, endpoint=proxy.endpoint), tmp, prefix)
        try:
            mnt = mounter("--durability", mode, "--part-size", "5MiB")
            src = mnt.path / "step.tmp"
            src.mkdir()
            (src / "sub").mkdir()
            want = {}
            for i in range(files):
                name = f"sub/shard_{i}.pt" if i % 8 == 7 else f"shard_{i}.pt"
                data = rng.randbytes(size)
                (src / name).write_bytes(data)
                want[name] = _sha(data)
            r = run_ckptfs("sync", str(mnt.path), endpoint=proxy.endpoint)
            assert r.returncode == 0, r.stderr
            pid = daemon_pid(mnt.path)
            seen = [0]
            killed = threading.Event()

            def at_request(method: str, path: str) -> bool:
                with proxy.lock:
                    if killed.is_set():
                        return True
                    if kill_at is not None and seen[0] >= kill_at:
                        os.kill(pid, signal.SIGKILL)
                        killed.set()
                        return True
                    seen[0] += 1
                    return False
            proxy.fail_when = at_request
            error: list[BaseException] = []

            def rename() -> None:
                try:
                    os.rename(src, mnt.path / "step")
                except OSError as exc:
                    error.append(exc)
                    return
                # Async mode: the rename returned once journaled; S3 moves the objects in
                # the log's turn, and sync waits for that (it fails once the daemon is killed).
                r = run_ckptfs("sync", str(mnt.path), endpoint=proxy.endpoint)
                if r.returncode != 0 and kill_at is None:
                    error.append(RuntimeError(r.stderr))
            t = threading.Thread(target=rename, daemon=True)
            t.start()
            t.join(120)
            proxy.fail_when = None
            requests = seen[0]
            if kill_at is None:
                assert not error, error
                mounter.close()
            else:
                wait_dead(pid)
                force_unmount(str(mnt.path))
            got = s3_files(s3, prefix)
            ok, outcome = judge_s3(got, want)
            if not ok:
                return Verdict(False, requests, outcome, "S3 alone")
            if variant == "lost":
                shutil.rmtree(mnt.cache_dir)
                again = mounter("--durability", mode)  # another host: a new cache dir
            else:
                again = mounter("--durability", mode, path=mnt.path, cache_dir=mnt.cache_dir)
            ok, shown = judge_mount(again.path, want)
            left = [k for k in s3_files(s3, prefix) if k.startswith(INTENTS)]
            mounter.close()
            if not ok:
                return Verdict(False, requests, outcome, f"through a fresh mount: {shown}")
            if left:
                return Verdict(False, requests, outcome, f"intents left after a mount: {left}")
            if outcome == "intent" and shown != "step":
                return Verdict(False, requests, outcome, "the intent was not completed")
            return Verdict(True, requests, outcome)
        finally:
            discard(mounter, tmp)


def kill_points(server, s3, work: Path, mode: str, variant: str, points: int, files: int,
                size: int, rng: random.Random) -> tuple[list[Verdict], int]:
    """`points` trials, killed before request 0, 1, ... of the rename (the uninterrupted
    count measured first; cycling through all of them, or spread evenly over them when
    there are fewer points than requests); (verdicts, requests of one rename)."""
    calibration = trial(server, s3, work, mode, variant, None, files, size, rng.randrange(1 << 30))
    assert calibration.ok, calibration
    total = calibration.requests
    if points > total:
        at = [n % (total + 1) for n in range(points)]
    else:
        at = [round(i * total / max(points - 1, 1)) for i in range(points)]
    verdicts = [trial(server, s3, work, mode, variant, n, files, size, rng.randrange(1 << 30))
                for n in at]
    return verdicts, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=100, help="kill points per variant")
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--mib", type=float, default=1.0, help="size of each file")
    ap.add_argument("--modes", default="close,async")
    ap.add_argument("--variants", default="lost,kept")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-renamecheck-"))
    server = devserver.start(str(work / "weed"))
    s3 = server.client()
    failed = False
    try:
        for mode in args.modes.split(","):
            for variant in args.variants.split(","):
                started = time.monotonic()
                verdicts, total = kill_points(server, s3, work, mode, variant, args.points,
                                              args.files, int(args.mib * MiB), rng)
                bad = [v for v in verdicts if not v.ok]
                for v in bad:
                    print(json.dumps(dataclasses.asdict(v)), flush=True)
                counts = {o: sum(v.outcome == o for v in verdicts if v.ok) for o in ("before", "intent", "after")}
                print(f"{mode} mode, disk {variant}: {len(verdicts)} kill points over the {total} "
                      f"requests of a rename of {args.files} files x {args.mib:g} MiB: {len(bad)} "
                      f"violations; S3 alone showed {counts}; {time.monotonic() - started:.0f} s",
                      flush=True)
                failed |= bool(bad)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

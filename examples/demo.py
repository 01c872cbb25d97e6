"""The README's demo: a local S3 server, a ckptfs mount, a training run that is interrupted and
then resumed in a fresh mount (empty cache) from what is in S3. Cleans up after itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from devtools import devserver  # noqa: E402  (the local S3 server; not part of ckptfs)

HERE = os.path.dirname(os.path.abspath(__file__))


def ckptfs(*args: str, env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "ckptfs", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"demo: ckptfs {args[0]} failed: {r.stderr.strip()}")


def main() -> int:
    work = tempfile.mkdtemp(prefix="ckptfs-demo-")
    server = None
    mounted: list[str] = []
    try:
        print("== starting a local S3 server (SeaweedFS) on loopback")
        server = devserver.start(os.path.join(work, "s3"), bucket="demo")
        env = devserver.client_env(server.endpoint)
        mnt = os.path.join(work, "checkpoints")
        os.mkdir(mnt)

        def mount(cache: str) -> None:
            ckptfs("mount", "s3://demo/run1", mnt, "--cache-dir", os.path.join(work, cache), env=env)
            mounted.append(mnt)
            print(f"== mounted s3://demo/run1 at {mnt} (cache {cache})")

        def unmount() -> None:
            ckptfs("unmount", mnt, env=env)
            mounted.remove(mnt)
            print(f"== unmounted {mnt}")

        mount("cache-a")
        print("== training; it will be killed right after the step-30 checkpoint is saved")
        train = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), mnt, "--steps", "50"],
                                 stdout=subprocess.PIPE, text=True)
        assert train.stdout is not None
        for line in train.stdout:
            print("   train:", line.rstrip())
            if line.startswith("step 30:"):
                train.send_signal(signal.SIGKILL)
                break
        train.wait()
        print(f"== trainer killed (exit {train.returncode}); checkpoints in S3:")
        s3 = server.client()
        for obj in s3.list_objects_v2(Bucket="demo", Prefix="run1/")["Contents"]:
            print(f"   s3://demo/{obj['Key']}  {obj['Size'] / 2**20:.1f} MiB")
        unmount()

        mount("cache-b")  # a new host: empty cache, everything comes from S3
        print("== resuming in a fresh mount")
        r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), mnt, "--steps", "50"],
                           capture_output=True, text=True)
        for line in r.stdout.splitlines():
            print("   train:", line)
        if r.returncode != 0 or "resumed from" not in r.stdout or "step 30" not in r.stdout:
            print(r.stderr, file=sys.stderr)
            raise SystemExit("demo: the resumed run did not pick up the step-30 checkpoint")
        unmount()
        print("== demo finished: the interrupted run resumed from its last checkpoint in S3")
        return 0
    finally:
        for path in mounted:
            subprocess.run([sys.executable, "-m", "ckptfs", "unmount", path], capture_output=True)
            subprocess.run(["fusermount3", "-uz", path], capture_output=True)
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

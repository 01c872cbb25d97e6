"""Directory trees checked against a model (issue 44): renames of directories (onto names
just removed, too), `rm -rf` right after them, listings, while the kernel forgets inodes
and S3 applies the ordered log a request at a time at random points.

The mount's CheckpointFS runs in process over the in-memory S3 (tests/inprocess.py). In
async mode a gate (fakes3.Gate) holds every request that changes what S3 shows until a
rule lets some through, so S3 lags the mount by a random part of the log, as it does when
the log runs behind the trainer. Every call's outcome (success, or which errno) and every
listing is checked against a model; at the end the log drains and a fresh mount over the
same S3 must show the model. Close mode runs the same rules with S3 current at each call.
test_rotation.py holds the cases this found or was written for; test_posix.py and the
bench's rotation check run the same through real mounts, with real drops of the caches.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

import inprocess
from ckptfs.daemon import Mount
from fakes3 import Gate, MemoryS3
from inprocess import Kernel
from test_lookups import check_tree

TRACE: list[str] = []  # the rules of the current example, for DIRTREE_TRACE=FILE


def traced(fn):
    """Record the rule and its outcome (hypothesis cannot shrink a failure that depends on
    timing; the trace of the first failing example replays by hand)."""
    @functools.wraps(fn)
    def wrapper(self, **kwargs):
        TRACE.append(f"{fn.__name__}({kwargs})")
        try:
            return fn(self, **kwargs)
        except BaseException as exc:
            TRACE.append(f"FAILED: {exc!r}")
            raise
    return wrapper
TTL = 1.0
# A small space of names, so that renames land on names just removed and rm -rf meets
# directories the log is still moving.
DIRS = ["a", "b", "a/a", "a/b", "b/a", "b/b"]
dirs = st.sampled_from(DIRS)
files = st.builds(lambda d, n: f"{d}/{n}".lstrip("/"), st.sampled_from(["", *DIRS]),
                  st.sampled_from(["x", "y"]))


@pytest.mark.parametrize("durability", ["close", "async"])
def test_directory_trees_agree_with_the_model_while_s3_lags_and_the_kernel_forgets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    real_monotonic, offset = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset[0])
    runs = iter(range(10**6))
    serve = functools.partial(inprocess.serve, tmp_path, durability, metadata_ttl=TTL)

    class Trees(RuleBasedStateMachine):
        nursery: trio.Nursery

        def __init__(self) -> None:
            super().__init__()
            self.s3 = MemoryS3()
            self.gate = Gate() if durability == "async" else None
            self.s3.faults.gate = self.gate
            self.stop = trio.Event()
            self.mount = self.start()
            self.kernel = Kernel(self.mount)
            self.files: dict[str, bytes] = {}
            self.dirs: set[str] = {""}

        def start(self) -> Mount:
            return self.call(self.nursery.start, serve, self.s3, next(runs), self.stop)

        def call(self, fn, *args):
            return trio.from_thread.run(fn, *args)

        def outcome(self, fn, *args) -> int:
            """0, or the errno the call failed with."""
            try:
                self.call(fn, *args)
            except pyfuse3.FUSEError as exc:
                return exc.errno
            return 0

        def children(self, path: str) -> list[str]:
            return sorted(p.rpartition("/")[2] for p in [*self.files, *self.dirs]
                          if p and p.rpartition("/")[0] == path)

        def teardown(self) -> None:
            if os.environ.get("DIRTREE_TRACE"):
                with open(os.environ["DIRTREE_TRACE"], "a") as f:
                    f.write("\n".join(["=== example", *TRACE, ""]))
            TRACE.clear()
            try:
                if self.gate is not None:
                    trio.from_thread.run_sync(self.gate.open)
                self.call(self.mount.changes.backlog.drain)
                fresh = self.start()  # another host's mount of the prefix, once S3 has it all
                self.call(check_tree, Kernel(fresh), self.files, self.dirs)
            finally:
                trio.from_thread.run_sync(self.stop.set)

        @rule(path=files, data=st.binary(max_size=16))
        @traced
        def write(self, path: str, data: bytes) -> None:
            if path.rpartition("/")[0] not in self.dirs or path in self.dirs:
                return
            self.call(self.kernel.write, path, data)
            self.files[path] = data

        @rule(path=dirs)
        @traced
        def mkdir(self, path: str) -> None:
            if path.rpartition("/")[0] not in self.dirs:
                return
            want = errno.EEXIST if path in self.dirs or path in self.files else 0
            assert self.outcome(self.kernel.mkdir, path) == want, path
            self.dirs.add(path)

        @rule(path=files)
        @traced
        def unlink(self, path: str) -> None:
            if path.rpartition("/")[0] not in self.dirs:
                return
            want = 0 if path in self.files else errno.EISDIR if path in self.dirs else errno.ENOENT
            got = self.outcome(self.kernel.unlink, path)
            assert got == want or (want == errno.EISDIR and got == errno.EPERM), (path, got)
            self.files.pop(path, None)

        @rule(path=dirs)
        @traced
        def rmdir(self, path: str) -> None:
            if path.rpartition("/")[0] not in self.dirs:
                return
            want = (errno.ENOENT if path not in self.dirs and path not in self.files
                    else errno.ENOTDIR if path in self.files
                    else errno.ENOTEMPTY if self.children(path) else 0)
            assert self.outcome(self.kernel.rmdir, path) == want, path
            if not want:
                self.dirs.discard(path)

        @rule(src=dirs, dst=dirs)
        @traced
        def rename_dir(self, src: str, dst: str) -> None:
            """`mv N.tmp N`: onto a missing name, or an empty directory (a rotation removed it)."""
            if src not in self.dirs or dst.rpartition("/")[0] not in self.dirs:
                return
            if dst == src or dst.startswith(src + "/"):
                return  # EINVAL, or nothing to do: not what this checks
            want = (errno.ENOTDIR if dst in self.files
                    else errno.ENOTEMPTY if dst in self.dirs and self.children(dst) else 0)
            assert self.outcome(self.kernel.rename, src, dst) == want, (src, dst)
            if want:
                return

            def moved(p: str) -> str:
                return dst + p[len(src):] if p == src or p.startswith(src + "/") else p
            self.dirs = {moved(d) for d in self.dirs}
            self.files = {moved(f): data for f, data in self.files.items()}

        @rule(dst=dirs, nested=st.booleans())
        @traced
        def save_and_commit(self, dst: str, nested: bool) -> None:
            """A checkpoint saved into a temporary directory and renamed onto its name, as
            Orbax and tmp-dir trainers commit one."""
            parent = dst.rpartition("/")[0]
            if parent not in self.dirs or dst in self.files:
                return
            if dst in self.dirs and self.children(dst):
                return  # ENOTEMPTY: rename_dir checks that
            tmp = f"{parent}/t".lstrip("/")
            shards = {f"{tmp}/x": b"shard x", f"{tmp}/{'a/' if nested else ''}y": b"shard y"}
            self.call(self.kernel.mkdir, tmp)
            if nested:
                self.call(self.kernel.mkdir, f"{tmp}/a")
            for path, data in shards.items():
                self.call(self.kernel.write, path, data)
            self.call(self.kernel.rename, tmp, dst)
            self.dirs.add(dst)
            if nested:
                self.dirs.add(f"{dst}/a")
            self.files.update({dst + path[len(tmp):]: data for path, data in shards.items()})

        @rule(src=files, dst=files)
        @traced
        def rename_file(self, src: str, dst: str) -> None:
            if src not in self.files or dst.rpartition("/")[0] not in self.dirs or dst in self.dirs:
                return
            self.call(self.kernel.rename, src, dst)
            self.files[dst] = self.files.pop(src)

        @rule(path=dirs)
        @traced
        def rm_rf(self, path: str) -> None:
            """shutil.rmtree: every listing on the way must be the model's."""
            if path not in self.dirs:
                return
            self.call(self._rm_rf, path)

        async def _rm_rf(self, path: str) -> None:
            names = await self.kernel.listdir(path)
            assert names == self.children(path), path
            for name in names:
                child = f"{path}/{name}"
                if child in self.dirs:
                    await self._rm_rf(child)
                else:
                    await self.kernel.unlink(child)
                    del self.files[child]
            await self.kernel.rmdir(path)
            self.dirs.discard(path)

        @rule(path=st.sampled_from(["", *DIRS]))
        @traced
        def listdir(self, path: str) -> None:
            if path in self.dirs:
                assert self.call(self.kernel.listdir, path) == self.children(path), path

        @rule(path=files)
        @traced
        def stat(self, path: str) -> None:
            try:
                attrs = self.call(self.kernel.stat, path)
            except pyfuse3.FUSEError as exc:
                assert path not in self.files and path not in self.dirs, (path, exc)
                return
            assert path in self.files, f"stat {path} found what the model does not have"
            assert attrs.st_size == len(self.files[path]), path

        @rule()
        @traced
        def drop_caches(self) -> None:
            self.call(self.kernel.drop_caches)

        @rule()
        @traced
        def time_passes(self) -> None:
            offset[0] += TTL * 1.5

        @rule(n=st.integers(1, 6))
        @traced
        def s3_applies(self, n: int) -> None:
            """S3 gets the next `n` visible requests of the log (async mode)."""
            if self.gate is None:
                return
            trio.from_thread.run_sync(self.gate.let, n)
            self.call(self._settle)

        async def _settle(self) -> None:
            """Until S3 and the log stand still: the requests let through answered, their
            entries retired (a retirement removes its journal record in a worker thread,
            which wait_all_tasks_blocked counts as blocked)."""
            before = None
            while True:
                await trio.testing.wait_all_tasks_blocked(0.002)
                await trio.sleep(0.01)
                now = (len(self.mount.changes.backlog), len(self.s3.requests))
                if now == before:
                    return
                before = now

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            Trees.nursery = nursery
            # The suite explores the same examples every run (a timing-dependent failure
            # must not come and go with the seed); DIRTREE_RANDOM=1 explores new ones.
            await trio.to_thread.run_sync(lambda: run_state_machine_as_test(Trees, settings=settings(
                max_examples=60, stateful_step_count=40, deadline=None, database=None,
                derandomize=not os.environ.get("DIRTREE_RANDOM"),
                suppress_health_check=list(HealthCheck))))
    trio.run(main)

"""A stateful property test: random operations on the mount and on a local directory must agree,
then again after a remount with an empty cache (everything read back from S3).

In async mode the daemon is also SIGKILLed at random points and remounted on the same cache
dir: everything closed before the crash must come back from the journal. And the host is
lost at random points (daemon SIGKILLed, cache dir wiped): a fresh mount must then show the
tree as it was after some prefix of the operations, and the test goes on from there."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

import pytest

from conftest import Mounter, S3Server
from test_faults import kill_daemon

pytestmark = pytest.mark.mount

DIRS = ["", "d1", "d1/d2", "e"]
NAMES = ["a", "b.pt", "c"]
# Root-level names come up most often so that most operations find their parent directory.
paths = st.builds(lambda d, n: f"{d}/{n}".lstrip("/"), st.sampled_from(["", "", "", "d1", "d1/d2", "e"]),
                  st.sampled_from(NAMES))
any_path = st.one_of(paths, paths, st.sampled_from(DIRS[1:]))
data = st.binary(max_size=3000)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("err", exc.errno)


def snapshot(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d)) + "/"] = None
        for f in filenames:
            out[os.path.normpath(os.path.join(rel, f))] = Path(dirpath, f).read_bytes()
    return out


@pytest.mark.parametrize("durability", ["close", "async"])
def test_mount_agrees_with_a_local_directory(s3_server: S3Server, tmp_path: Path, durability: str) -> None:
    class MountVsLocal(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.work = Path(tempfile.mkdtemp(dir=tmp_path))
            self.mounter = Mounter(s3_server, self.work, f"sm-{uuid.uuid4().hex[:10]}")
            self.mount = self.mounter("--durability", durability)
            self.mnt = self.mount.path
            self.ref = self.work / "ref"
            self.ref.mkdir()
            self.history: list[dict[str, bytes | None]] = [{}]  # the tree after each operation

        def both(self, fn, *rel: str):
            a = outcome(fn, *[self.mnt / r for r in rel])
            b = outcome(fn, *[self.ref / r for r in rel])
            assert a == b, (fn.__name__, rel, a, b)
            if durability == "async":  # every state the tree passes through, for host_lost
                now = snapshot(self.ref)
                if now != self.history[-1]:
                    self.history.append(now)

        @initialize()
        def start_with_a_file_and_a_directory(self) -> None:
            self.both(os.mkdir, "d1")
            self.both(lambda p: p.write_bytes(b"initial"), "a")

        @rule(path=paths, payload=data, append=st.booleans())
        def write(self, path: str, payload: bytes, append: bool) -> None:
            def w(p: Path) -> None:
                with open(p, "ab" if append else "wb") as f:
                    f.write(payload)
            self.both(w, path)

        @rule(path=paths, offset=st.integers(0, 4000), payload=st.binary(min_size=1, max_size=500))
        def overwrite(self, path: str, offset: int, payload: bytes) -> None:
            def w(p: Path) -> None:
                with open(p, "r+b") as f:
                    f.seek(offset)
                    f.write(payload)
            self.both(w, path)

        @rule(path=paths, size=st.integers(0, 5000))
        def truncate(self, path: str, size: int) -> None:
            self.both(lambda p: os.truncate(p, size), path)

        @rule(path=st.sampled_from(DIRS[1:]))
        def mkdir(self, path: str) -> None:
            self.both(os.mkdir, path)

        @rule(path=paths)
        def unlink(self, path: str) -> None:
            self.both(os.unlink, path)

        @rule(path=st.sampled_from(DIRS[1:]))
        def rmdir(self, path: str) -> None:
            self.both(os.rmdir, path)

        def rename_file(self, src: str, dst: str) -> None:
            """A rename: all or nothing in S3 as a fresh mount sees it, a file's or a
            directory's (renames.py; it used to leave a file under both names)."""
            self.both(os.rename, src, dst)

        @rule(src=any_path, dst=any_path)
        def rename(self, src: str, dst: str) -> None:
            self.rename_file(src, dst)

        @rule(path=paths)
        def read(self, path: str) -> None:
            self.both(lambda p: p.read_bytes(), path)

        @rule()
        def crash_and_remount(self) -> None:
            if durability != "async":
                return
            kill_daemon(self.mnt)
            self.mount = self.mounter("--durability", durability, path=self.mnt,
                                      cache_dir=self.mount.cache_dir)

        @rule(burst=st.lists(st.tuples(st.sampled_from(["write", "unlink", "rename"]), paths,
                                       paths, data, st.sampled_from([1, 1, 3000])), max_size=5))
        def host_lost(self, burst: list[tuple[str, str, str, bytes, int]]) -> None:
            """A burst of operations (no check between them, so S3 may lag behind), then the
            host is lost."""
            if durability != "async":
                return
            for kind, path, other, payload, times in burst:
                if kind == "write":  # some of a few MiB: their uploads take a while
                    self.both(lambda p: p.write_bytes(payload * times), path)
                elif kind == "unlink":
                    self.both(os.unlink, path)
                else:
                    self.rename_file(path, other)
            kill_daemon(self.mnt)
            shutil.rmtree(self.mount.cache_dir)
            self.mount = self.mounter("--durability", durability, path=self.mnt)  # empty cache
            got = snapshot(self.mnt)
            assert got in self.history, (got, self.history[-1])
            # Go on from the state S3 holds, as a trainer resuming from it would.
            last = len(self.history) - 1 - self.history[::-1].index(got)
            del self.history[last + 1:]
            shutil.rmtree(self.ref)
            self.ref.mkdir()
            for rel, body in sorted(got.items()):
                if body is None:
                    (self.ref / rel).mkdir(parents=True, exist_ok=True)
                else:
                    (self.ref / rel).parent.mkdir(parents=True, exist_ok=True)
                    (self.ref / rel).write_bytes(body)

        @invariant()
        def trees_agree(self) -> None:
            now = snapshot(self.ref)
            assert snapshot(self.mnt) == now
            if now != self.history[-1]:
                self.history.append(now)

        def teardown(self) -> None:
            try:
                self.mounter.close()
                fresh = self.mounter().path  # new, empty cache dir
                assert snapshot(fresh) == snapshot(self.ref)
            finally:
                self.mounter.close()
                shutil.rmtree(self.work, ignore_errors=True)

    run_state_machine_as_test(MountVsLocal, settings=settings(
        # Async examples crash and remount the daemon (about 2 s each): fewer of them.
        max_examples=int(os.environ.get("CKPTFS_STATEFUL_EXAMPLES", "12")) // (2 if durability == "async" else 1),
        stateful_step_count=40,
        deadline=None, suppress_health_check=list(HealthCheck)))

"""The async-mode upload queue: retries with backoff, and one file's failure never ends it."""

from __future__ import annotations

import errno
import stat

import trio

from ckptfs.errors import UploadError
from ckptfs.inodes import Inode, Write
from ckptfs.queue import UploadQueue
from ckptfs.retry import RetryPolicy


def _file(ino: int) -> Inode:
    return Inode(ino, 1, f"f{ino}", stat.S_IFREG | 0o644, 0, 0, write=Write.DIRTY)


async def test_an_unexpected_error_in_one_upload_is_retried_and_never_ends_the_queue() -> None:
    # A journal write that hit a full cache disk once escaped the queue as OSError and took the
    # whole daemon (and its mount) down with it.
    failures = {1: [OSError(errno.ENOSPC, "No space left on device"), UploadError("503")],
                2: []}
    attempts = {1: 0, 2: 0}

    async def commit(inode: Inode) -> None:
        attempts[inode.ino] += 1
        if failures[inode.ino]:
            raise failures[inode.ino].pop(0)
        inode.saved()

    policy = RetryPolicy()
    a, b = _file(1), _file(2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            queue = UploadQueue(commit, lambda inode: inode.name, policy.changes, nursery)
            queue.add(a)
            queue.add(b)
            failed = await queue.wait()  # b goes up; a fails an attempt, reported, and waits
            assert [(p, "No space left" in why) for p, why in failed] == [("f1", True)]
            while a.dirty:
                policy.hurry.now()  # skip the backoff
                await trio.sleep(0.01)
            await queue.drain()
    assert attempts == {1: 3, 2: 1} and not a.dirty and not b.dirty
    assert queue.uploaded == 2 and queue.pending() == []

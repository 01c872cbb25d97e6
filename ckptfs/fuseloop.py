"""pyfuse3's request loop, two trips through trio's scheduler per request lighter.

pyfuse3 takes each request in the same few steps (internal.pxi, `_session_loop`): take its
read lock (a trio.Lock), wait for /dev/fuse to be readable (trio's wait_readable), read one
request, run its handler. With trio's own primitives every request costs two yields to the
scheduler even while requests queue up: trio.Lock yields after taking a free lock, and
wait_readable always parks the task until the next epoll pass. With 8 writers, py-spy put
the lock at 12 % and the wait at 3 % of a bare pyfuse3 file system's FUSE thread; in a bare
loop they cost 43 us per request, 4.5 with the facade (design.md, "Requests, not bytes").

pyfuse3 looks these up on its module global `trio`, which it documents as replaceable (its
asyncio mode replaces it). `install()` puts a facade there that differs in two things only:
- the read lock is taken without a yield when it is free; a task that finds it held parks
  and is handed the lock on release, as with trio.Lock;
- when /dev/fuse already holds a request (one poll(2) with no timeout says so), the wait
  returns at once, up to BURST times in a row; then the task waits through trio again, so
  the scheduler still runs every other task (upload completions, timers, the control
  socket) at least once per BURST requests.
Every other name is trio's own, so a later pyfuse3 that uses more of trio still finds it.
"""

from __future__ import annotations

import select
from typing import Any

import pyfuse3
import trio

# Requests taken in a row without a trip through trio's scheduler. A 1 MiB write takes the
# FUSE thread well under a millisecond, so other tasks wait at most a few milliseconds.
BURST = 16


class ReadLock:
    """pyfuse3's read lock: free, it is taken without a yield; held, the task parks."""

    def __init__(self) -> None:
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if self._held:
            await self._lot.park()  # woken by __aexit__ holding the lock
        else:
            self._held = True

    async def __aexit__(self, *exc: Any) -> None:
        if self._lot:
            self._lot.unpark()  # hand the lock over: it stays held
        else:
            self._held = False


class _Readiness:
    def __init__(self) -> None:
        self._poll: Any = None
        self._fd = -1
        self._burst = 0

    def ready(self, fd: int) -> bool:
        if fd != self._fd:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)
            self._fd = fd
        return bool(self._poll.poll(0))

    async def wait_readable(self, fd: int) -> None:
        if self._burst < BURST and self.ready(fd):
            self._burst += 1
            return
        self._burst = 0
        await trio.lowlevel.wait_readable(fd)


class _Over:
    """`base` (a module) with some of its names replaced."""

    def __init__(self, base: Any, **names: Any) -> None:
        self._base = base
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:  # only for names not replaced
        return getattr(self._base, name)


def facade() -> Any:
    """trio as pyfuse3 sees it: every name trio's own but the read lock and the wait."""
    readiness = _Readiness()
    return _Over(trio, Lock=ReadLock,
                 lowlevel=_Over(trio.lowlevel, wait_readable=readiness.wait_readable))


def install() -> None:
    """Before pyfuse3.main(): pyfuse3's loop uses the facade."""
    pyfuse3.trio = facade()  # type: ignore[attr-defined]

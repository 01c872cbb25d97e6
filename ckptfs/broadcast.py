"""A re-armable event: every task waiting when it fires wakes, and the next wait is for the
next firing (trio.Event fires once).

The waits that use it check their condition and wait with no checkpoint in between, so
a firing can never fall between the two (trio runs one task at a time).
"""

from __future__ import annotations

import trio


class Broadcast:
    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        """Wake every task waiting now."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Until the next `fire()`."""
        await self._event.wait()

    async def wait_for(self, seconds: float) -> bool:
        """Until the next `fire()`, at most `seconds`; True if it fired."""
        event = self._event
        with trio.move_on_after(seconds):
            await event.wait()
        return event.is_set()

    async def wait_until(self, deadline: float) -> None:
        """Until the next `fire()` or the trio time `deadline`."""
        with trio.move_on_at(deadline):
            await self._event.wait()

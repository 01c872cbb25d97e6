"""Async mode's questions to S3: answered in time, or by what the mount knows.

A lookup, listing or stat past the TTL asks S3 (`Patience.__call__`). Its answer is used if
it comes within `patience` (a second). If it does not, or S3 fails for a transient reason,
the caller gets STALE and answers from the mount's knowledge; so it does at once while S3 is
out (health.py), or while an earlier question is unanswered past `patience` and nothing S3
was asked since has been answered either. The question goes on in the background, and its
answer, when it comes, updates the table as any answer does.
Close mode (no patience) waits for every answer.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from ckptfs.errors import S3Error
from ckptfs.health import Health

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stale:
    """S3 gave no answer in time: the caller answers from what the mount knows."""


STALE = Stale()


class Patience:
    def __init__(self, health: Health | None, patience: float | None,
                 nursery: trio.Nursery | None) -> None:
        self.health = health
        self.patience = patience if nursery is not None and health is not None else None
        self._nursery = nursery  # where questions go on once their caller stopped waiting
        self._asking: dict[int, float] = {}  # questions out: since when
        self._ids = itertools.count()
        self.stale_answers = 0  # answers from the mount's knowledge while S3 owed one

    def stats(self) -> dict[str, int]:
        return {"stale_answers": self.stale_answers, "s3_questions_out": len(self._asking)}

    def _stalled(self) -> bool:
        now = time.monotonic()
        assert self.health is not None and self.patience is not None
        # A question out for longer than the patience with no answer from S3 to anything
        # since it was sent: S3 is not answering, though no request has failed yet.
        answered = self.health.last_answer
        return self.health.down or any(now - t > self.patience and t > answered
                                       for t in self._asking.values())

    async def __call__(self, ask: Callable[[], Awaitable[T]]) -> T | Stale:
        """ask()'s answer, or STALE (see the module's docstring)."""
        if self.patience is None or self._nursery is None:
            return await ask()
        if self._stalled():
            self.stale_answers += 1
            return STALE
        outcome: list[tuple[bool, object]] = []
        done = trio.Event()
        ident = next(self._ids)
        gave_up = False

        async def run() -> None:
            self._asking[ident] = time.monotonic()
            try:
                outcome.append((True, await ask()))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, or logged below
                outcome.append((False, exc))
                if gave_up and not isinstance(exc, S3Error):
                    log.warning("a question to S3 that went on in the background failed: %r", exc)
            finally:
                del self._asking[ident]
                done.set()

        self._nursery.start_soon(run)
        with trio.move_on_after(self.patience):
            await done.wait()
        if not outcome:
            gave_up = True
            self.health.unanswered(self._asking.get(ident, time.monotonic()))
            self.stale_answers += 1
            return STALE
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[return-value]
        if isinstance(value, S3Error) and value.retryable:
            self.stale_answers += 1
            return STALE
        raise value  # type: ignore[misc]

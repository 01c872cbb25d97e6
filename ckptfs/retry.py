"""One retry policy: exponential backoff with jitter, a deadline, and hurry.

Whether a failure is worth another attempt is decided where botocore's errors are translated
(`S3Error.retryable`, in s3wire.py), by the request and the error, never by the caller. How long
to wait is decided here, for two kinds of retry:

- `RetryPolicy.call`: one request again (0.2 s doubling to a 5 s cap), until the deadline of
  the upload or change it belongs to (`--upload-timeout`);
- `RetryPolicy.changes`: a whole upload or ordered-log entry again after that deadline passed
  (0.5 s doubling to 30 s), forever: files are never given up on.

A spot notice calls `hurry()`: every wait ends at once and backoff starts over.

No attempt outlives its call's deadline: `attempt_deadline` carries it into the worker
thread (trio copies the context there), where s3.py makes it the request's socket timeout.
Every attempt's outcome goes to `health` (health.py); while S3 is out, attempts wait for its
probe instead of being sent.
"""

from __future__ import annotations

import contextvars
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from ckptfs.broadcast import Broadcast
from ckptfs.errors import NoSuchKey, S3Error, UploadError
from ckptfs.health import Health

log = logging.getLogger(__name__)

T = TypeVar("T")

# The attempt's deadline on time.monotonic()'s clock (worker threads have no trio clock).
attempt_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "attempt_deadline", default=None)


def remaining(cap: float | None = None) -> float | None:
    """Seconds left to the running attempt's deadline (at least a little), at most `cap`;
    `cap` if the attempt has no deadline."""
    deadline = attempt_deadline.get()
    if deadline is None:
        return cap
    left = max(0.05, deadline - time.monotonic())
    return left if cap is None else min(cap, left)


# Throttling is S3 asking for less: an outage for health.py's purposes (one probe, then the rest).
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "ServiceUnavailable"})


def _unanswered(exc: S3Error) -> bool:
    """The failure says S3 is not there, or not serving: no connection, a timeout, a 5xx,
    throttling. (A retryable 4xx, a body damaged on the way, was answered.)"""
    return (exc.status is None or exc.status >= 500 or exc.status == 429
            or exc.code in _THROTTLED)


class Hurry:
    """Fired by a spot notice: backoff sleeps in progress end when it is."""

    def __init__(self) -> None:
        self._fired = Broadcast()

    def now(self) -> None:
        self._fired.fire()

    async def sleep(self, seconds: float) -> bool:
        """Sleep `seconds`; True if hurry() cut it short."""
        return await self._fired.wait_for(seconds)


class Backoff:
    """Jitter with a floor: attempt n waits a random time in [base/4, min(cap, base * 2**n)]
    (full jitter could draw a wait of almost nothing, and send the retry at once)."""

    def __init__(self, base: float, cap: float, hurry: Hurry, health: Health | None = None) -> None:
        self.base, self.cap, self.hurry = base, cap, hurry
        self.health = health  # while S3 is out, wait for its probe instead

    def delay(self, attempt: int) -> float:
        return random.uniform(self.base / 4, min(self.cap, self.base * 2 ** attempt))

    async def sleep(self, attempt: int) -> int:
        """Wait before attempt `attempt + 1`; returns the attempt number to go on with
        (0 again if hurried). During an outage: until S3 answers the probe, then a random
        part of `base`, so the backlog does not meet a recovering S3 all at once."""
        if self.health is not None and self.health.down:
            await self.health.wait_answering(math.inf)
            await self.hurry.sleep(random.uniform(0, self.base))
            return 0
        return 0 if await self.hurry.sleep(self.delay(attempt)) else attempt + 1


class RetryPolicy:
    def __init__(self, hurry: Hurry | None = None) -> None:
        self.hurry = hurry or Hurry()
        self.health = Health(Backoff(0.5, 5.0, self.hurry))  # between probes
        self.requests = Backoff(0.2, 5.0, self.hurry)
        self.changes = Backoff(0.5, 30.0, self.hurry, self.health)
        self.retries = 0  # requests sent again, for status and metrics

    async def call(self, what: str, deadline: float, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, again after transient faults, until `deadline` (trio time); then
        UploadError naming `what` and the last fault."""
        attempt = 0
        started = trio.current_time()
        health = self.health
        budget = deadline - started
        while True:
            # During an outage a call waits for the probe no longer than its whole budget from
            # the outage's start: one that S3 has not answered for that long fails now (the
            # kernel sends LOOKUP again when one fails: it must not take twice the timeout).
            wait_until = min(deadline, trio.current_time() + max(0.0, budget - health.down_for()))
            if not await health.wait_answering(wait_until):
                raise UploadError(
                    f"{what}: gave up after {attempt} attempts in {trio.current_time() - started:.0f}s: "
                    f"S3 has not answered for {health.down_for():.0f}s ({health.why})", "", None, True)
            sent = time.monotonic()
            token = attempt_deadline.set(sent + deadline - trio.current_time())
            try:
                result = await call()
            except NoSuchKey:
                health.answered()
                raise
            except S3Error as exc:
                if not exc.retryable:
                    health.answered()  # refused, but answered
                    raise
                outage = _unanswered(exc)
                if outage:
                    health.trouble(str(exc), sent)
                else:
                    health.answered()  # (a body damaged on the way, say: S3 is there)
                delay = self.requests.delay(attempt)
                if trio.current_time() + delay >= deadline:
                    raise UploadError(
                        f"{what}: gave up after {attempt + 1} attempts in "
                        f"{trio.current_time() - started:.0f}s: {exc}", exc.code, exc.status, True
                    ) from None
                self.retries += 1
                attempt += 1
                # (Counted in status; an outage that lasts gets a line of its own: health.py.)
                log.log(logging.DEBUG if outage else logging.WARNING,
                        "%s failed (attempt %d), retrying in %.1fs: %s", what, attempt, delay, exc)
                if await self.hurry.sleep(delay):
                    attempt = 0
            else:
                health.answered()
                return result
            finally:
                attempt_deadline.reset(token)

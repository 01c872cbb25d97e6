"""One retry policy: exponential backoff with jitter, a deadline, and hurry.

Whether a failure is worth another attempt is decided where botocore's errors are translated
(`S3Error.retryable`, in s3wire.py), by the request and the error, never by the caller. How long
to wait is decided here, for two kinds of retry:

- `RetryPolicy.call`: one request again (0.2 s doubling to a 5 s cap), until the deadline of
  the upload or change it belongs to (`--upload-timeout`);
- `RetryPolicy.changes`: a whole upload or ordered-log entry again after that deadline passed
  (0.5 s doubling to 30 s), forever: files are never given up on.

A spot notice calls `hurry()`: every wait ends at once and backoff starts over.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from ckptfs.broadcast import Broadcast
from ckptfs.errors import S3Error, UploadError

log = logging.getLogger(__name__)

T = TypeVar("T")


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

    def __init__(self, base: float, cap: float, hurry: Hurry) -> None:
        self.base, self.cap, self.hurry = base, cap, hurry

    def delay(self, attempt: int) -> float:
        return random.uniform(self.base / 4, min(self.cap, self.base * 2 ** attempt))

    async def sleep(self, attempt: int) -> int:
        """Wait before attempt `attempt + 1`; returns the attempt number to go on with
        (0 again if hurried)."""
        return 0 if await self.hurry.sleep(self.delay(attempt)) else attempt + 1


class RetryPolicy:
    def __init__(self, hurry: Hurry | None = None) -> None:
        self.hurry = hurry or Hurry()
        self.requests = Backoff(0.2, 5.0, self.hurry)
        self.changes = Backoff(0.5, 30.0, self.hurry)
        self.retries = 0  # requests sent again, for status and metrics

    async def call(self, what: str, deadline: float, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, again after transient faults, until `deadline` (trio time); then
        UploadError naming `what` and the last fault."""
        attempt = 0
        started = trio.current_time()
        while True:
            try:
                return await call()
            except S3Error as exc:
                if not exc.retryable:
                    raise
                delay = self.requests.delay(attempt)
                if trio.current_time() + delay >= deadline:
                    raise UploadError(
                        f"{what}: gave up after {attempt + 1} attempts in "
                        f"{trio.current_time() - started:.0f}s: {exc}", exc.code, exc.status, True
                    ) from None
                self.retries += 1
                attempt += 1
                log.warning("%s failed (attempt %d), retrying in %.1fs: %s", what, attempt, delay, exc)
                if await self.hurry.sleep(delay):
                    attempt = 0

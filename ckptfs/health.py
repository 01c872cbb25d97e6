"""Whether S3 answers: an outage, from its first unanswered request to the next answer.

Every attempt's outcome comes here (retry.RetryPolicy.call). An answer of any kind, an
object or a 404 or a refusal, means S3 is there. A failure for S3's own reasons (no
connection, a timeout, a 5xx, SlowDown) starts an outage, unless S3 answered another
request after the failed one was sent (one request's SlowDown is not an outage).

During an outage nothing but one probe goes to S3 (`wait_answering`: requests wait for the
probe instead of being sent, each until its own deadline), so a recovering S3 is not met
by every retry of every upload and log entry at once. The probe, a LIST of one key of the
mount's prefix, goes out after a jittered backoff (0.5 s doubling to 5 s) until S3
answers it; then the waiting requests go.

An outage is logged once it has lasted `LOG_AFTER` seconds (a lone SlowDown among
thousands of answers is no outage worth a line), and its end then; status, systemd's
STATUS= and Prometheus show it from its first second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ckptfs.retry import Backoff

log = logging.getLogger(__name__)

LOG_AFTER = 3.0


class Health:
    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff  # between probes
        self.down_since: float | None = None  # wall time the outage started
        self._down_mono = 0.0
        self.why = ""  # the first failure of the outage
        self.outages = 0
        self.probes = 0
        self._answered = trio.Event()
        self._answered.set()
        self._logged = False
        self._probe: Callable[[], Awaitable[Any]] | None = None
        self._nursery: trio.Nursery | None = None
        self._pending: Callable[[], int] = lambda: 0
        self._unanswered: float | None = None  # (time.monotonic())
        self.last_answer = 0.0  # (time.monotonic())

    def start(self, nursery: trio.Nursery, probe: Callable[[], Awaitable[Any]],
              pending: Callable[[], int] = lambda: 0) -> None:
        """Probe S3 with `probe()` (one attempt) during outages, from tasks in `nursery`;
        `pending()` counts the changes S3 does not have yet, for the log lines."""
        self._nursery, self._probe, self._pending = nursery, probe, pending

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def down_for(self) -> float:
        return time.monotonic() - self._down_mono if self.down else 0.0

    def answered(self) -> None:
        self.last_answer = time.monotonic()
        self._unanswered = None
        if not self.down:
            return
        seconds = self.down_for()
        self.down_since = None
        self._answered.set()
        if self._logged:
            log.warning("S3 answers again after %.0fs without; %d changes pending go now",
                        seconds, self._pending())
        self._logged = False

    def unanswered(self, since: float) -> None:
        """A question (namespace.py) has had no answer since `since` (time.monotonic()) and
        its caller gave up waiting: status shows it from then, though requests still go
        until one fails (a slow answer is no outage)."""
        if self._unanswered is None or since < self._unanswered:
            self._unanswered = since

    def unanswered_for(self) -> float:
        since = self._down_mono if self.down else self._unanswered
        return time.monotonic() - since if since is not None else 0.0

    def trouble(self, why: str, since: float | None = None) -> None:
        """A request failed for S3's reasons (`since`: when it was sent, time.monotonic()).
        If S3 answered another request since then, this is one request's failure (a SlowDown
        among many answers), not an outage: nothing waits for a probe."""
        now = time.monotonic()
        if self.down or self.last_answer > (since if since is not None else now):
            return
        start = min(x for x in (now, since, self._unanswered) if x is not None)
        self.down_since = time.time() - (now - start)
        self._down_mono = start
        self.why = why
        self.outages += 1
        self._answered = trio.Event()
        if self._nursery is not None:
            self._nursery.start_soon(self._probing, self._answered)

    async def wait_answering(self, deadline: float) -> bool:
        """Wait until S3 answers the probe, or until `deadline` (trio time); True if it does.
        Without a prober (no `start`), never waits."""
        if not self.down or self._probe is None:
            return True
        with trio.move_on_at(deadline):
            await self._answered.wait()
        return not self.down

    async def _probing(self, answered: trio.Event) -> None:
        attempt = 0
        while not answered.is_set():
            attempt = await self.backoff.sleep(attempt)
            if answered.is_set():
                return
            if not self._logged and self.down_for() >= LOG_AFTER:
                self._logged = True
                log.warning("S3 has not answered since %s (%s); requests wait for it to answer "
                            "a probe (async mode: lookups answer from what the mount knows)",
                            time.strftime("%H:%M:%S", time.localtime(self.down_since)), self.why)
            self.probes += 1
            try:
                assert self._probe is not None
                await self._probe()
            except Exception as exc:  # noqa: BLE001 - any failure: still no answer
                log.debug("S3 probe failed: %s", exc)
                continue
            self.answered()

    def stats(self) -> dict[str, Any]:
        since = self.down_since
        if since is None and self._unanswered is not None:
            since = time.time() - self.unanswered_for()
        return {"s3_down_since": since, "s3_down_seconds": round(self.unanswered_for(), 1),
                "s3_down_reason": self.why if self.down else
                ("no answer yet" if since is not None else None),
                "s3_outages": self.outages, "s3_probes": self.probes}

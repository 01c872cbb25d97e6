"""The one retry policy: which faults are retried, for how long, and hurry."""

from __future__ import annotations

import trio
import trio.testing

from ckptfs.errors import S3Error, UploadError
from ckptfs.retry import Backoff, Hurry, RetryPolicy

import pytest


def test_full_jitter_stays_within_its_bounds() -> None:
    backoff = Backoff(0.2, 5.0, Hurry())
    for attempt in range(12):
        for _ in range(50):
            assert 0.05 <= backoff.delay(attempt) <= min(5.0, 0.2 * 2 ** attempt)


async def test_transient_faults_are_retried_until_the_deadline(autojump_clock) -> None:
    policy = RetryPolicy()
    calls = []

    async def flaky() -> str:
        calls.append(trio.current_time())
        if len(calls) < 4:
            raise S3Error("503 SlowDown", "SlowDown", 503)
        return "ok"
    assert await policy.call("PUT k", trio.current_time() + 60, flaky) == "ok"
    assert len(calls) == 4 and policy.retries == 3

    async def down() -> None:
        raise S3Error("connection reset")
    started = trio.current_time()
    with pytest.raises(UploadError, match="PUT k: gave up after .* connection reset"):
        await policy.call("PUT k", started + 30, down)
    assert 25 <= trio.current_time() - started <= 30


async def test_permanent_errors_fail_at_once() -> None:
    policy = RetryPolicy()

    async def denied() -> None:
        raise S3Error("403 AccessDenied", "AccessDenied", 403)
    with pytest.raises(S3Error, match="AccessDenied"):
        await policy.call("PUT k", trio.current_time() + 60, denied)
    assert policy.retries == 0


async def test_hurry_ends_every_wait_and_restarts_backoff(autojump_clock) -> None:
    policy = RetryPolicy()
    results = []

    async def wait(attempt: int) -> None:
        results.append(await policy.changes.sleep(attempt))
    async with trio.open_nursery() as nursery:
        for attempt in (5, 6, 7):
            nursery.start_soon(wait, attempt)
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        policy.hurry.now()
    assert results == [0, 0, 0] and trio.current_time() == started
    assert await policy.changes.sleep(0) == 1  # not hurried: the next attempt

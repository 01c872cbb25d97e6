"""The trio facade pyfuse3's request loop runs on (fuseloop.py): its read lock and its wait."""

from __future__ import annotations

import socket

import pyfuse3
import trio
import trio.testing

from ckptfs import fuseloop


async def test_the_read_lock_lets_one_task_in_at_a_time_in_arrival_order() -> None:
    lock = fuseloop.ReadLock()
    inside, order = [], []

    async def reader(i: int) -> None:
        async with lock:
            inside.append(i)
            assert len(inside) == 1
            order.append(i)
            await trio.sleep(0.01)  # holds the lock across a yield, as a reading task does
            inside.remove(i)
    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(reader, i)
            await trio.testing.wait_all_tasks_blocked()
    assert order == [0, 1, 2, 3, 4]


async def test_a_free_read_lock_is_taken_without_a_yield() -> None:
    lock = fuseloop.ReadLock()
    ran = []

    async def other() -> None:
        ran.append(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(10):
            async with lock:
                pass
        assert ran == []  # trio.Lock would have let `other` run
    assert ran == [1]


async def test_a_waiter_cancelled_while_parked_neither_gets_nor_keeps_the_lock() -> None:
    lock = fuseloop.ReadLock()
    got = []
    doomed = trio.CancelScope()

    async def waiter(name: str, scope: trio.CancelScope) -> None:
        with scope:
            async with lock:
                got.append(name)
    async with trio.open_nursery() as nursery:
        await lock.__aenter__()
        nursery.start_soon(waiter, "cancelled", doomed)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "second", trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        doomed.cancel()
        await trio.testing.wait_all_tasks_blocked()
        await lock.__aexit__(None, None, None)
    assert got == ["second"]
    async with lock:  # free again
        pass


async def test_a_readable_fd_is_taken_at_once_but_other_tasks_run_every_burst() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.send(b"x")  # a request is queued: `a` stays readable
        readiness = fuseloop._Readiness()
        runs = []

        async def other() -> None:
            while True:
                runs.append(1)
                await trio.lowlevel.checkpoint()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            while not runs:
                await trio.lowlevel.checkpoint()
            before = len(runs)
            for _ in range(fuseloop.BURST):
                await readiness.wait_readable(a.fileno())
            assert len(runs) == before  # no trip through the scheduler
            cycles = 5
            for _ in range(cycles):
                await readiness.wait_readable(a.fileno())  # the burst is spent: through trio
                for _ in range(fuseloop.BURST):
                    await readiness.wait_readable(a.fileno())
            # Each trip is one scheduler batch, where `other` runs once, before or after this
            # task (trio shuffles a batch): so at least once per trip but maybe the last.
            assert len(runs) - before >= cycles - 1
            nursery.cancel_scope.cancel()


async def test_with_nothing_to_read_the_wait_waits_for_the_fd() -> None:
    a, b = socket.socketpair()
    with a, b:
        readiness = fuseloop._Readiness()
        woke = []

        async def wait() -> None:
            await readiness.wait_readable(a.fileno())
            woke.append(trio.current_time())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            b.send(b"x")
        assert len(woke) == 1


def test_pyfuse3_finds_every_other_name_of_trio_it_uses() -> None:
    facade = fuseloop.facade()
    assert facade.Lock is fuseloop.ReadLock
    for name in ("open_nursery", "ClosedResourceError", "from_thread"):
        assert getattr(facade, name) is getattr(trio, name)
    for name in ("notify_closing", "current_task", "current_trio_token"):
        assert getattr(facade.lowlevel, name) is getattr(trio.lowlevel, name)
    assert facade.lowlevel.wait_readable is not trio.lowlevel.wait_readable
    saved = pyfuse3.trio  # type: ignore[attr-defined]
    try:
        fuseloop.install()
        assert pyfuse3.trio.Lock is fuseloop.ReadLock  # type: ignore[attr-defined]
    finally:
        pyfuse3.trio = saved  # type: ignore[attr-defined]

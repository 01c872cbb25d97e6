"""The memory budget of request bodies: bounded, and its buffers reused."""

from __future__ import annotations

import trio
import trio.testing

from ckptfs.buffers import BufferBudget

MiB = 1024 * 1024


async def test_bodies_wait_for_room_and_reuse_their_buffers() -> None:
    budget = BufferBudget(3 * 16 * MiB)
    held, most = [], [0]

    async def part(i: int) -> None:
        async with budget.borrow(16 * MiB) as buf:
            assert len(buf) == 16 * MiB
            held.append(id(buf))
            most[0] = max(most[0], budget.stats()["upload_memory_bytes"])
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(part, i)
    assert most[0] == 3 * 16 * MiB  # never more than the budget
    assert len(set(held)) == 3  # ten parts, three buffers


async def test_a_body_of_another_size_frees_a_spare_buffer_for_room() -> None:
    budget = BufferBudget(20 * MiB)
    async with budget.borrow(16 * MiB):
        pass
    with trio.fail_after(1):
        async with budget.borrow(7 * MiB) as small:  # the spare 16 MiB goes: 23 > 20
            assert len(small) == 7 * MiB
    assert budget.stats()["upload_memory_bytes"] == 7 * MiB
    assert not budget.fits(21 * MiB)  # a body larger than the budget streams from its file

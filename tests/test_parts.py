"""The part plan at S3's limits."""

from __future__ import annotations

import pytest

from ckptfs.parts import (GiB, MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, MiB, PartPlan, TiB)


@pytest.mark.parametrize("base", [MIN_PART_SIZE, 8 * MiB, 16 * MiB, 64 * MiB, 1 * GiB])
def test_any_file_up_to_5tib_fits_in_10000_parts(base: int) -> None:
    plan = PartPlan(base)
    assert plan.capacity == 5 * TiB
    parts = plan.ranges(5 * TiB)
    assert len(parts) <= MAX_PARTS
    assert parts[-1].end == 5 * TiB
    assert all(MIN_PART_SIZE <= p.size <= MAX_PART_SIZE for p in parts[:-1])
    assert 0 < parts[-1].size <= MAX_PART_SIZE
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    assert [p.number for p in parts] == list(range(1, len(parts) + 1))


def test_small_files_use_the_base_size() -> None:
    plan = PartPlan(16 * MiB)
    parts = plan.ranges(1 * GiB)
    assert len(parts) == 64 and {p.size for p in parts} == {16 * MiB}


def test_file_ending_exactly_on_a_part_boundary() -> None:
    plan = PartPlan(8 * MiB)
    parts = plan.ranges(24 * MiB)
    assert [p.size for p in parts] == [8 * MiB] * 3
    parts = plan.ranges(24 * MiB + 1)
    assert [p.size for p in parts] == [8 * MiB] * 3 + [1]
    # the growth boundary: part 800 is the last of the first size, 801 is twice as large
    edge = plan.part(800).end
    assert plan.part_at(edge - 1) == 800 and plan.part_at(edge) == 801
    assert plan.part(801).size == 16 * MiB
    assert plan.ranges(edge)[-1] == plan.part(800)


def test_zero_byte_file_is_one_empty_part() -> None:
    parts = PartPlan(8 * MiB).ranges(0)
    assert len(parts) == 1 and parts[0].size == 0


def test_limits_are_enforced() -> None:
    with pytest.raises(ValueError):
        PartPlan(MIN_PART_SIZE - 1)
    with pytest.raises(ValueError):
        PartPlan(MAX_PART_SIZE + 1)
    with pytest.raises(ValueError):
        PartPlan(8 * MiB).ranges(5 * TiB + 1)

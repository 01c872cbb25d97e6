"""Pure part arithmetic for S3 multipart uploads.

All S3 multipart limits live here. A part plan grows the part size along the
file so that an object of any size up to 5 TiB fits in 10,000 parts, without
knowing the final size in advance (the writer is still writing while early
parts upload).
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_OBJECT_SIZE = 5 * TiB

# The part size doubles every GROWTH_PARTS parts. 800 is the largest group
# size for which even the minimum part size reaches 5 TiB within MAX_PARTS.
GROWTH_PARTS = 800


@dataclass(frozen=True)
class PartRange:
    number: int  # 1-based, as S3 numbers parts
    start: int
    end: int  # exclusive

    @property
    def size(self) -> int:
        return self.end - self.start


class PartPlan:
    """Maps byte offsets to part numbers; the same plan for every file of a mount."""

    def __init__(self, base_size: int) -> None:
        if not MIN_PART_SIZE <= base_size <= MAX_PART_SIZE:
            raise ValueError(f"part size must be between 5 MiB and 5 GiB, got {base_size}")
        self.base_size = base_size
        # Precompute part start offsets: 10,001 integers, cheap and exact.
        starts = [0]
        for index in range(MAX_PARTS):
            starts.append(starts[-1] + self._size_of(index))
        self._starts = starts

    def _size_of(self, index: int) -> int:
        return min(self.base_size << (index // GROWTH_PARTS), MAX_PART_SIZE)

    @property
    def capacity(self) -> int:
        """The largest file this plan can upload."""
        return min(self._starts[-1], MAX_OBJECT_SIZE)

    def part(self, number: int) -> PartRange:
        """The full (untruncated) range of part `number`."""
        if not 1 <= number <= MAX_PARTS:
            raise ValueError(f"part number out of range: {number}")
        return PartRange(number, self._starts[number - 1], self._starts[number])

    def part_at(self, offset: int) -> int:
        """The number of the part holding byte `offset`."""
        if not 0 <= offset < self._starts[-1]:
            raise ValueError(f"offset out of range: {offset}")
        lo, hi = 0, MAX_PARTS
        while lo < hi:  # first index whose end is beyond offset
            mid = (lo + hi) // 2
            if self._starts[mid + 1] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo + 1

    def ranges(self, size: int) -> list[PartRange]:
        """The parts of a file of `size` bytes; the last one truncated. A 0-byte file has one empty part."""
        if size > self.capacity:
            raise ValueError(f"file of {size} bytes exceeds the S3 object limit")
        if size == 0:
            return [PartRange(1, 0, 0)]
        last = self.part_at(size - 1)
        out = [self.part(n) for n in range(1, last + 1)]
        tail = out[-1]
        out[-1] = PartRange(tail.number, tail.start, size)
        return out

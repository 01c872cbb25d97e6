"""CRC32 of data, and of whole objects from the CRC32s of their parts (S3 FULL_OBJECT).

`crc32` is ISA-L's (the isal package): the same CRC as zlib.crc32, about three times as
fast (7 GiB/s against 2.2 on this project's VM), which matters at a few GB/s of uploads.
`crc32_combine` is zlib's, with the shift operator for each part length cached, so
combining 10,000 equal parts costs 10,000 small matrix-vector products.
"""

from __future__ import annotations

import base64
import functools

from isal import isal_zlib

_POLY = 0xEDB88320
_IDENTITY = tuple(1 << n for n in range(32))


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(first: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_apply(then, column) for column in first)


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> tuple[int, ...]:
    """The operator that advances a CRC register over `length` zero bytes."""
    one_bit = (_POLY,) + tuple(1 << n for n in range(31))  # one zero bit
    op = one_bit
    for _ in range(3):
        op = _compose(op, op)  # eight bits: one zero byte
    result = _IDENTITY
    while length:
        if length & 1:
            result = _compose(result, op)
        length >>= 1
        if length:
            op = _compose(op, op)
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B)."""
    if len2 == 0:
        return crc1
    return _apply(_shift(len2), crc1) ^ crc2


def crc32_of_parts(parts: list[tuple[int, int]]) -> int:
    """CRC32 of the concatenation of parts given as (crc32, length)."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc


def b64_crc32(crc: int) -> str:
    """The base64 big-endian form S3 uses in x-amz-checksum-crc32."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def crc32(data: bytes | memoryview, crc: int = 0) -> int:
    """zlib.crc32, faster; releases the GIL on large buffers like zlib does."""
    return isal_zlib.crc32(data, crc)

from __future__ import annotations

import os
import zlib

from ckptfs.checksum import b64_crc32, crc32, crc32_combine, crc32_of_parts


def test_combine_matches_zlib_over_the_concatenation() -> None:
    for la, lb in [(0, 0), (1, 0), (0, 7), (13, 1000), (5 << 20, 12345), (1000, 5 << 20)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_many_equal_parts_and_a_tail() -> None:
    blobs = [os.urandom(4096) for _ in range(50)] + [os.urandom(17)]
    assert crc32_of_parts([(zlib.crc32(b), len(b)) for b in blobs]) == zlib.crc32(b"".join(blobs))


def test_s3_form() -> None:
    assert b64_crc32(zlib.crc32(b"hello")) == "NhCmhg=="


def test_crc32_is_zlibs_crc_on_bytes_views_and_continuations() -> None:
    data = os.urandom((3 << 20) + 5)
    view = memoryview(data)[7:]
    assert crc32(data) == zlib.crc32(data)
    assert crc32(view) == zlib.crc32(view)
    assert crc32(data[100:], crc32(data[:100])) == zlib.crc32(data)
    assert crc32(b"") == 0

"""ckptfs's own upload path, without FUSE: multipart uploads of local files, in parallel.

    python bench/uploader.py ENDPOINT BUCKET PREFIX FILE...

It builds its client, then waits for a line on stdin, so the caller can start it at the
moment it chooses. The N-th file goes up as one object, PREFIX/<N>, in parts of ckptfs's default size, all parts
of all files sharing ckptfs's default concurrency, through ckptfs.s3.S3Client as a mount
builds it (sendfile over plain HTTP, a CRC32 per part, the full-object checksum). The CPU
seconds it spent after that line go to stdout as one number.

write_bench.py runs it beside the bare pyfuse3 sink while the ranks write ("i. sink while
the same bytes upload"): what any write path that streams parts during the writes pays on
a host whose cores the writers, the FUSE thread, the uploads and the S3 server share. The
upload is much slower than the writes here, so this uploader, like ckptfs's, has parts
waiting to go for the whole of the writes.
"""

from __future__ import annotations

import os
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptfs.checksum import b64_crc32, crc32_of_parts  # noqa: E402
from ckptfs.config import Config  # noqa: E402
from ckptfs.retry import RetryPolicy  # noqa: E402
from ckptfs.s3 import S3Client, make_boto_client  # noqa: E402
from ckptfs.zerocopy import SendfileSender  # noqa: E402


async def upload(s3: S3Client, key: str, path: str, part_size: int, slots: trio.CapacityLimiter) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        upload_id = await s3.create_multipart(key, {})
        parts: list[dict] = []

        async def part(number: int, start: int) -> None:
            async with slots:
                etag, crc = await s3.upload_part(key, upload_id, number, fd, start,
                                                 min(part_size, size - start))
            parts.append({"PartNumber": number, "ETag": etag, "crc": crc,
                          "size": min(part_size, size - start)})

        async with trio.open_nursery() as nursery:
            for number, start in enumerate(range(0, size, part_size), 1):
                nursery.start_soon(part, number, start)
        parts.sort(key=lambda p: p["PartNumber"])
        whole = crc32_of_parts([(p["crc"], p["size"]) for p in parts])
        await s3.complete_multipart(key, upload_id, [
            {"ETag": p["ETag"], "PartNumber": p["PartNumber"], "ChecksumCRC32": b64_crc32(p["crc"])}
            for p in parts], whole)
    finally:
        os.close(fd)


async def main(endpoint: str, bucket: str, prefix: str, paths: list[str]) -> None:
    part_size, concurrency = Config.part_size, Config.concurrency  # the mount's defaults
    boto = make_boto_client(endpoint, None, None, pool=concurrency + 8)
    sendfile = SendfileSender.applies(endpoint)
    if sendfile:
        SendfileSender(endpoint, timeout=60).install(boto)
    s3 = S3Client(boto, bucket, trio.CapacityLimiter(concurrency + 8), RetryPolicy(), sendfile=sendfile)
    slots = trio.CapacityLimiter(concurrency)  # as the Uploader's one FIFO limiter of parts
    sys.stdin.readline()
    cpu0 = time.process_time()
    async with trio.open_nursery() as nursery:
        for n, path in enumerate(paths):
            nursery.start_soon(upload, s3, f"{prefix}/{n}", path, part_size, slots)
    print(f"{time.process_time() - cpu0:.3f}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])

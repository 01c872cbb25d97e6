"""ckptfs's own upload path, without FUSE: local files uploaded by ckptfs's Uploader, at once.

    python bench/uploader.py ENDPOINT BUCKET PREFIX FILE...

It builds its client and prints "ready", then waits for a line on stdin, so the caller can
start it at the moment it chooses. The N-th file goes up as PREFIX/<N> through
`Uploader.finish`, as a close does: parts of ckptfs's default size, all files sharing its
default part concurrency, the S3 client as a mount builds it (sendfile over plain HTTP, a
CRC32 per part, the full-object checksum). The CPU seconds it spent after that line go to
stdout as one number.

write_bench.py runs it beside the bare pyfuse3 sink while the ranks write (row k): what
any write path that streams parts during the writes pays on a host whose cores the
writers, the FUSE thread, the uploads and the S3 server share. The upload is much slower
than the writes here, so this uploader, like ckptfs's, has parts waiting to go for the
whole of the writes.
"""

from __future__ import annotations

import os
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptfs.bucket import Bucket  # noqa: E402
from ckptfs.config import Config  # noqa: E402
from ckptfs.parts import PartPlan  # noqa: E402
from ckptfs.retry import RetryPolicy  # noqa: E402
from ckptfs.s3 import S3Client, make_boto_client  # noqa: E402
from ckptfs.uploader import Uploader  # noqa: E402
from ckptfs.uploads import FileUpload  # noqa: E402
from ckptfs.zerocopy import SendfileSender  # noqa: E402


async def main(endpoint: str, bucket: str, prefix: str, paths: list[str]) -> None:
    config = Config(source=f"s3://{bucket}/", mountpoint="/", cache_dir="/")  # its defaults
    boto = make_boto_client(endpoint, None, None, pool=config.concurrency + 8)
    sendfile = SendfileSender.applies(endpoint)
    if sendfile:
        SendfileSender(endpoint, timeout=60).install(boto)
    s3 = Bucket(S3Client(boto, bucket, trio.CapacityLimiter(config.concurrency + 8),
                         sendfile=sendfile), RetryPolicy())
    async with trio.open_nursery() as nursery:
        uploader = Uploader(s3, PartPlan(config.part_size), config.concurrency, nursery=nursery)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        cpu0 = time.process_time()
        async with trio.open_nursery() as uploads:
            for n, path in enumerate(paths):
                uploads.start_soon(uploader.finish, FileUpload(), path, f"{prefix}/{n}",
                                   os.path.getsize(path), {})
        print(f"{time.process_time() - cpu0:.3f}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])

"""Upload files with awscrt's native S3 client (what Mountpoint and s3torchconnector use).

    python bench/crt_upload.py ENDPOINT BUCKET PREFIX FILE...

The N-th file goes up as PREFIX/<N>, all at once, each a PutObject sent from the file
itself (`send_filepath`: awscrt splits it into 16 MiB parts, signs them and computes their
CRC32 in its own threads, outside Python). Prints the seconds and the process's CPU seconds
for the uploads (the client's start-up excluded), one line each.

write_bench.py runs it with `--awscrt DIR`, a directory awscrt was installed into
(`pip install --target DIR awscrt`), as row "l": what a native client costs per GiB for
the upload alone. Not in ckptfs's own environment: with awscrt importable, botocore signs
with it, and boto3's upload_file (the baseline) then spent about twice the CPU per GiB
here (3.4-4.1 against 1.7-1.8 CPU s/GiB for one 1 GiB file).
On this VM (1 GiB, one file): 1.25-1.28 CPU s/GiB with the CRC32 trailer, as here (the
same guarantee as ckptfs's parts), 0.88 without a checksum, whatever the throughput target
(0.5-10 Gb/s).
"""

from __future__ import annotations

import os
import sys
import time
from urllib.parse import urlparse

from awscrt.auth import AwsCredentialsProvider
from awscrt.http import HttpHeaders, HttpRequest
from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
from awscrt.s3 import (S3ChecksumAlgorithm, S3ChecksumConfig, S3ChecksumLocation, S3Client,
                       S3RequestTlsMode, S3RequestType)

PART = 16 << 20


def main(endpoint: str, bucket: str, prefix: str, paths: list[str]) -> None:
    host = urlparse(endpoint).netloc
    loop = EventLoopGroup(os.cpu_count() or 1)
    bootstrap = ClientBootstrap(loop, DefaultHostResolver(loop))
    creds = AwsCredentialsProvider.new_static(os.environ["AWS_ACCESS_KEY_ID"],
                                              os.environ["AWS_SECRET_ACCESS_KEY"])
    client = S3Client(bootstrap=bootstrap, region="us-east-1", credential_provider=creds,
                      tls_mode=S3RequestTlsMode.DISABLED, part_size=PART,
                      throughput_target_gbps=10.0)
    crc = S3ChecksumConfig(algorithm=S3ChecksumAlgorithm.CRC32, location=S3ChecksumLocation.TRAILER)
    t, cpu = time.monotonic(), time.process_time()
    requests = []
    for n, path in enumerate(paths):
        headers = HttpHeaders([("Host", host), ("Content-Length", str(os.path.getsize(path))),
                               ("Content-Type", "application/octet-stream")])
        requests.append(client.make_request(
            type=S3RequestType.PUT_OBJECT, request=HttpRequest("PUT", f"/{bucket}/{prefix}/{n}", headers),
            send_filepath=path, checksum_config=crc))
    for r in requests:
        r.finished_future.result(600)
    print(f"{time.monotonic() - t:.3f}\n{time.process_time() - cpu:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])

"""Parts and objects sent with sendfile over plain HTTP (zerocopy.py), against the real server.

Through the fault proxy where a fault is needed: the server checks every body's CRC32, so a
byte damaged on the way is refused and sent again; a reset connection is retried; a staged
file shorter than its record is never sent as if whole.
"""

from __future__ import annotations

import http.client
import os
import socket
import tempfile
import threading
import time
import zlib

import pytest
import trio

from conftest import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server
from devtools.faultproxy import FaultProxy

from ckptfs.bucket import Bucket
from ckptfs.checksum import b64_crc32
from ckptfs.errors import LocalWriteError, S3Error, UploadError
from ckptfs.retry import RetryPolicy
from ckptfs.s3 import S3Client, make_boto_client
from ckptfs.zerocopy import SendfileSender, receive_into_files

MiB = 1024 * 1024


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


def client(endpoint: str, timeout: float = 20) -> tuple[Bucket, SendfileSender]:
    boto = make_boto_client(endpoint, None, None, pool=8)
    sender = SendfileSender(endpoint, timeout=10)
    sender.install(boto)
    return Bucket(S3Client(boto, BUCKET, trio.CapacityLimiter(8), sendfile=True), RetryPolicy(),
                  timeout=timeout), sender


def staged(data: bytes):
    f = tempfile.TemporaryFile()
    f.write(data)
    f.flush()
    return f


def test_only_plain_http_endpoints_send_with_sendfile() -> None:
    assert SendfileSender.applies("http://127.0.0.1:8333")
    assert not SendfileSender.applies("https://s3.example.com")
    assert not SendfileSender.applies(None)


def test_parts_and_objects_go_up_whole_and_checked(s3_server: S3Server, s3, prefix: str,
                                                   credentials: None) -> None:
    c, sender = client(s3_server.endpoint)
    data = os.urandom(11 * MiB + 123)
    key, small = f"{prefix}/multi.bin", f"{prefix}/small.bin"

    async def main() -> None:
        with staged(data) as f:
            upload_id = await c.create_multipart(key, {"mode": "33188"})
            parts = []
            for n, start in enumerate(range(0, len(data), 5 * MiB), 1):
                size = min(5 * MiB, len(data) - start)
                etag, crc = await c.upload_part(key, upload_id, n, f.fileno(), start, size)
                assert crc == zlib.crc32(data[start:start + size])
                parts.append({"ETag": etag, "PartNumber": n, "ChecksumCRC32": b64_crc32(crc)})
            await c.complete_multipart(key, upload_id, parts, zlib.crc32(data))
            etag, crc = await c.put_file(small, f.fileno(), 1000, {"mode": "33188"})
            assert etag and crc == zlib.crc32(data[:1000])
            assert (await c.head(small)).metadata["mode"] == "33188"
    trio.run(main)
    assert sender.sent == 4  # three parts and one object, none through botocore's sender
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    assert s3.get_object(Bucket=BUCKET, Key=small)["Body"].read() == data[:1000]


def test_a_connection_numbered_past_fd_setsize_is_reused(s3_server: S3Server, s3, prefix: str,
                                                         credentials: None) -> None:
    """A daemon with many files open (cached chunks, backing files) gets sockets numbered past
    select()'s 1024: checking an idle connection used to raise ValueError there."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is below 2048; this test needs more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open("/dev/null", os.O_RDONLY))
        c, sender = client(s3_server.endpoint)
        data = os.urandom(100000)

        async def main() -> None:
            with staged(data) as f:
                for n in range(3):  # the second and third check the first's idle connection
                    await c.put_file(f"{prefix}/high-{n}.bin", f.fileno(), len(data), {})
        trio.run(main)
        assert sender.sent == 3
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/high-2.bin")["Body"].read() == data


def test_a_damaged_body_is_refused_and_a_reset_retried(s3_server: S3Server, s3, prefix: str,
                                                      credentials: None) -> None:
    data = os.urandom(3 * MiB)
    key = f"{prefix}/faults.bin"
    with FaultProxy(s3_server.endpoint) as proxy:
        c, sender = client(proxy.endpoint)
        proxy.corrupt_parts = 1  # one byte flipped in the first body: its CRC32 fails

        async def main() -> None:
            with staged(data) as f:
                await c.put_file(key, f.fileno(), len(data), {})
                proxy.rates["reset"] = 0.5
                proxy.fault_methods = {"PUT"}
                for _ in range(4):
                    await c.put_file(key, f.fileno(), len(data), {})
        trio.run(main)
        assert proxy.corrupted == 1 and proxy.injected["reset"] > 0
        assert c.policy.retries >= 1 + proxy.injected["reset"]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data


def test_a_staged_file_shorter_than_its_record_is_never_sent(s3_server: S3Server, s3,
                                                             prefix: str, credentials: None) -> None:
    c, sender = client(s3_server.endpoint, timeout=5)
    key = f"{prefix}/short.bin"

    async def main() -> None:
        with staged(os.urandom(MiB)) as f:
            with pytest.raises((S3Error, UploadError), match="shorter than its recorded size"):
                await c.put_file(key, f.fileno(), 2 * MiB, {})
    trio.run(main)
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=key)


# ----- receiving: GET bodies spliced into files --------------------------------------

class _Server:
    """A one-connection HTTP/1.1 server whose answers the test writes: keep-alive, so a
    second request on the same connection shows the first body was read exactly."""

    def __init__(self, answers: list) -> None:
        self.answers = answers  # (headers, body, then: "close" | "stall" | None) per request
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            reader = conn.makefile("rb")
            for headers, body, then in self.answers:
                while reader.readline() not in (b"\r\n", b""):
                    pass  # the request: a GET without a body
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + headers + b"\r\n" + body)
                if then == "stall":
                    time.sleep(3)
                if then:
                    return

    def get(self, timeout: float = 5) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("GET", "/")
        return conn, conn.getresponse()

    def close(self) -> None:
        self.listener.close()


def _files(tmp_path, n: int) -> list[int]:
    return [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT | os.O_TRUNC) for i in range(n)]


def _length(n: int) -> bytes:
    return f"Content-Length: {n}\r\n".encode()


def test_a_body_is_spliced_into_its_files_and_the_connection_stays_usable(tmp_path) -> None:
    body, second = os.urandom(3 * MiB + 5), b"the next answer"
    server = _Server([(_length(len(body)), body, None), (_length(len(second)), second, None)])
    try:
        conn, response = server.get()
        fds = _files(tmp_path, 3)
        filled: list[int] = []
        spliced = receive_into_files(response, [(fds[0], MiB, 0), (fds[1], 2 * MiB, 0), (fds[2], 5, 0)],
                                     filled.append)
        assert filled == [0, 1, 2]
        # What arrived with the headers went through the response's buffer, the rest spliced.
        assert len(body) - 64 * 1024 < spliced < len(body)
        assert [os.pread(fd, 3 * MiB, 0) for fd in fds] == [body[:MiB], body[MiB:3 * MiB], body[-5:]]
        assert response.length == 0
        response.close()
        # The same connection carries the next request: no byte of the first body is left.
        conn.request("GET", "/")
        assert conn.getresponse().read() == second
        sock = conn.sock
        assert sock is not None and not os.get_blocking(sock.fileno()) and sock.gettimeout() == 5
        conn.close()
    finally:
        server.close()


def test_a_body_cut_short_or_stalled_is_a_fault_of_the_connection(tmp_path) -> None:
    body = os.urandom(2 * MiB)
    server = _Server([(_length(len(body)), body[:MiB], "close")])
    try:
        _, response = server.get()
        with pytest.raises(http.client.IncompleteRead):
            receive_into_files(response, [(fd, MiB, 0) for fd in _files(tmp_path, 2)])
    finally:
        server.close()
    server = _Server([(_length(len(body)), body[:MiB], "stall")])
    try:
        _, response = server.get(timeout=0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            receive_into_files(response, [(fd, MiB, 0) for fd in _files(tmp_path, 2)])
        assert time.monotonic() - started < 2.5  # the socket's timeout held in the splice
    finally:
        server.close()


def test_a_chunked_body_goes_through_a_buffer_and_a_bad_file_is_a_local_error(tmp_path) -> None:
    body = os.urandom(300 * 1024)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece)
                       for piece in (body[:100_000], body[100_000:])) + b"0\r\n\r\n"
    server = _Server([(b"Transfer-Encoding: chunked\r\n", chunked, None)])
    try:
        _, response = server.get()
        (fd,) = _files(tmp_path, 1)
        assert receive_into_files(response, [(fd, len(body), 0)]) == 0
        assert os.pread(fd, len(body) + 1, 0) == body
    finally:
        server.close()
    server = _Server([(_length(len(body)), body, None)])
    try:
        _, response = server.get()
        read_only = os.open(tmp_path / "f0", os.O_RDONLY)
        with pytest.raises(LocalWriteError):
            receive_into_files(response, [(read_only, len(body), 0)])
    finally:
        server.close()


def test_ranged_gets_land_in_files_from_the_real_server(s3_server: S3Server, s3, prefix: str,
                                                       credentials: None, tmp_path) -> None:
    data = os.urandom(20 * MiB + 123)
    key = f"{prefix}/ranged.bin"
    s3.put_object(Bucket=BUCKET, Key=key, Body=data)
    c, _ = client(s3_server.endpoint)

    async def main() -> None:
        for _ in range(3):  # the pooled connection is reused after each body
            fds = _files(tmp_path, 3)
            lengths = [8 * MiB, 8 * MiB, 4 * MiB + 23]
            got: list[int] = []
            spliced = await c.get_ranges_to_files(key, 100, [(fd, n, 0) for fd, n in zip(fds, lengths)], None, got.append)
            assert got == [0, 1, 2] and spliced > 20 * MiB - 64 * 1024
            assert b"".join(os.pread(fd, 8 * MiB, 0) for fd in fds) == data[100:]
            for fd in fds:
                os.close(fd)
        assert await c.get_range(key, 0, 10) == data[:10]
    trio.run(main)

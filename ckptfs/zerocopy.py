"""Request bodies sent from the staged file with sendfile(2), over plain HTTP.

botocore sends a body by reading it into Python and writing it to the socket: for a part,
a pread into a buffer and a copy into the kernel per byte, under urllib3's per-request
Python. Over plain HTTP (SeaweedFS, MinIO or Ceph inside a cluster) the kernel can send the
staged file's pages itself. botocore still builds, checksums the headers of and signs every
request; only its sending is taken over, through botocore's `before-send` hook, for the
requests whose body is a `FileRange` (UploadPart and PutObject of staged bytes). The answer
goes back to botocore as an `AWSResponse`, so errors are parsed as for any other request.

Each worker thread keeps one keep-alive connection. A fault on the way (reset, timeout, a
connection the server closed) is an `S3Error` marked retryable: the one retry policy of
retry.py sends the request again. Over HTTPS the bytes must pass through TLS in user space,
so nothing is installed and botocore sends as before.
"""

from __future__ import annotations

import http.client
import logging
import select
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from botocore.awsrequest import AWSResponse

from ckptfs.bodies import FileRange
from ckptfs.errors import S3Error

log = logging.getLogger(__name__)

# botocore asks for a 100-continue before large bodies; the header is never signed, and a
# refused request costs one part's send on loopback or in a cluster, which a retry repeats.
_SKIPPED = {"expect", "host"}


class _Answer:
    """The `raw` of an AWSResponse: botocore reads the body with stream()."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        return iter((self._data,))


class _Source:
    """What socket.sendfile needs of a file: its descriptor and a binary mode."""

    mode = "rb"

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def seek(self, offset: int) -> int:  # socket.sendfile repositions the file when done
        return offset


class SendfileSender:
    """Sends botocore requests whose body is a FileRange with sendfile(2)."""

    def __init__(self, endpoint_url: str, timeout: float) -> None:
        url = urlsplit(endpoint_url)
        self.host = url.hostname or "localhost"
        self.port = url.port or 80
        self.timeout = timeout
        self._local = threading.local()
        self.sent = 0  # requests sent this way

    @staticmethod
    def applies(endpoint_url: str | None) -> bool:
        return bool(endpoint_url) and urlsplit(endpoint_url).scheme == "http"

    def install(self, boto_client: Any) -> None:
        for op in ("UploadPart", "PutObject"):
            boto_client.meta.events.register(f"before-send.s3.{op}", self._before_send)

    def _before_send(self, request: Any, **_: Any) -> AWSResponse | None:
        body = request.body
        if not isinstance(body, FileRange):
            return None  # botocore sends it
        conn = self._connection()
        try:
            return self._send(conn, request, body)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()  # in an unknown state: never reused
            self._local.conn = None
            path = urlsplit(request.url).path
            raise S3Error(f"{request.method} {path}: {exc!r}", type(exc).__name__, None,
                          retryable=True) from None

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            # An idle keep-alive connection the server closed reads as ready (EOF): open a
            # new one instead of failing a request on it.
            readable, _, _ = select.select([conn.sock], [], [], 0)
            if readable:
                conn.close()
                conn = None
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _send(self, conn: http.client.HTTPConnection, request: Any, body: FileRange) -> AWSResponse:
        url = urlsplit(request.url)
        conn.putrequest(request.method, url.path + (f"?{url.query}" if url.query else ""),
                        skip_accept_encoding=True)
        for name, value in request.headers.items():
            if name.lower() not in _SKIPPED:
                conn.putheader(name, value)
        conn.endheaders()
        sock = conn.sock
        assert isinstance(sock, socket.socket)
        sent = sock.sendfile(_Source(body.fd), body.start, body.length) if body.length else 0
        if sent != body.length:
            raise S3Error("the staged file is shorter than its recorded size", retryable=False)
        answer = conn.getresponse()
        data = answer.read()
        if answer.will_close:
            conn.close()
            self._local.conn = None
        self.sent += 1
        return AWSResponse(request.url, answer.status, answer.getheaders(), _Answer(data))

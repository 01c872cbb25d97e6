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

import contextlib
import fcntl
import http.client
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from botocore.awsrequest import AWSResponse

from ckptfs.bodies import FileRange, thread_buffer
from ckptfs.errors import LocalWriteError, S3Error
from ckptfs.retry import remaining

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
            if _readable(conn.sock.fileno()):
                conn.close()
                conn = None
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
        # No longer than the attempt's deadline (retry.attempt_deadline): connecting, and each
        # send and receive.
        conn.timeout = remaining(self.timeout)
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
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


# ----- receiving: GET bodies spliced into files ---------------------------------------

_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032
_PIPE_SIZE = 1 << 20  # the default pipe-max-size: a MiB moves per pair of splices
_per_thread = threading.local()


def _pipe() -> tuple[int, int, int]:
    """This thread's pipe (read end, write end, capacity), kept for the thread's life."""
    pipe = getattr(_per_thread, "pipe", None)
    if pipe is None:
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            size = fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:
            size = fcntl.fcntl(w, _F_GETPIPE_SZ)
        pipe = _per_thread.pipe = (r, w, size)
    return pipe


def _drop_pipe() -> None:
    """A pipe that may still hold bytes of a failed body is never used again."""
    pipe = getattr(_per_thread, "pipe", None)
    _per_thread.pipe = None
    if pipe is not None:
        os.close(pipe[0])
        os.close(pipe[1])


def _plain_socket(response: http.client.HTTPResponse) -> socket.socket | None:
    """The socket under `response` if its body can be spliced from it: a plain TCP socket
    (TLS decrypts in user space) and a body of known length (not chunked)."""
    raw = getattr(getattr(response, "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    if (type(sock) is not socket.socket or response.chunked or response.length is None):
        return None
    return sock


@contextlib.contextmanager
def _blocking(sock: socket.socket) -> Iterator[None]:
    """The socket's descriptor in blocking mode, its timeout kept by SO_RCVTIMEO, for as
    long as the body is spliced. A socket with a timeout is non-blocking underneath, and a
    splice from it moves only what has arrived (often 64 KiB); blocking, one call fills the
    pipe. Python's own reads of it are unaffected (they poll before each read either way)."""
    fd = sock.fileno()
    timeout = sock.gettimeout()
    if timeout is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
    os.set_blocking(fd, True)
    try:
        yield
    finally:
        os.set_blocking(fd, timeout is None)
        if timeout is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset`; a failure is a LocalWriteError."""
    try:
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n
    except OSError as exc:
        raise LocalWriteError(exc.errno, exc.strerror) from None


def _splice_in(sock: socket.socket, fd: int, offset: int, length: int) -> None:
    """Move `length` bytes from the socket to `fd` at `offset` through this thread's pipe:
    the kernel copies them once, into the file's page cache; Python never sees them."""
    r, w, size = _pipe()
    src = sock.fileno()
    try:
        while length:
            try:
                got = os.splice(src, w, min(size, length), flags=os.SPLICE_F_MOVE)
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise TimeoutError("timed out reading the body") from None
            if not got:
                raise http.client.IncompleteRead(b"", length)
            length -= got
            while got:
                try:
                    put = os.splice(r, fd, got, offset_dst=offset, flags=os.SPLICE_F_MOVE)
                except OSError as exc:
                    raise LocalWriteError(exc.errno, exc.strerror) from None
                got -= put
                offset += put
    except BaseException:
        _drop_pipe()
        raise


def receive_into_files(response: http.client.HTTPResponse, targets: list[tuple[int, int, int]],
                       filled: Callable[[int], None] | None = None) -> int:
    """Write the rest of `response`'s body into the files `targets` ((fd, length, offset)
    each: `length` bytes go to the file at `offset`), in order, calling `filled(i)` once
    file i has all its bytes.

    Over plain HTTP the body is spliced from the socket (one copy, in the kernel, into the
    page cache); otherwise (TLS, a chunked body) it passes through one reused buffer per
    thread. Raises LocalWriteError if a file cannot be written; anything else is the
    connection's fault. The caller checks the length and puts the connection back.
    Returns how many bytes were spliced."""
    sock = _plain_socket(response)
    if sock is not None and sum(n for _, n, _ in targets) != response.length:
        sock = None  # not the body we asked for: let the caller's length check say so
    bounce = thread_buffer()
    # Bytes already in the response's buffer (read with the headers) go through it; then the
    # buffer is empty, and the socket is only ever read past them.
    head = len(response.fp.peek(1)) if sock is not None else 0
    spliced = 0
    for i, (fd, length, base) in enumerate(targets):
        offset = 0
        while offset < length:
            if sock is not None and not head:
                with _blocking(sock):
                    _splice_in(sock, fd, base + offset, length - offset)
                response.length -= length - offset  # read behind http.client's back
                spliced += length - offset
                break
            view = bounce[:min(len(bounce), length - offset, head or len(bounce))]
            got = response.readinto(view)
            if not got:
                raise http.client.IncompleteRead(b"", length - offset)
            write_all(fd, view[:got], base + offset)
            offset += got
            head = max(0, head - got)
        if filled is not None:
            filled(i)
    return spliced


def _readable(fd: int) -> bool:
    """Whether `fd` has data or EOF waiting, without blocking. poll(2), not select(2): a
    daemon with many files open (cached chunks, backing files) has sockets past FD_SETSIZE."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))

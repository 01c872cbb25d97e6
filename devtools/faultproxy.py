"""A loopback HTTP proxy in front of the S3 server that can be told to fail requests.

Faults: answer chosen methods (or requests a predicate picks) with an error
status; at set rates, answer 503 SlowDown or 500 InternalError, reset the
connection, or delay the answer; corrupt the bodies of some PUT
requests. And an outage (`outage()`): every request hangs (the connection is accepted and the
request read, never answered), or the port refuses connections, or every request is answered
503 SlowDown, until the outage ends.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FaultProxy:
    """Forwards to `upstream`; while `fail_methods` holds a method, answers it with `fail_status`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.fail_methods: set[str] = set()
        self.fail_status = 403
        self.failed = 0
        self.corrupt_parts = 0  # flip a byte in the body of this many PUTs (objects or parts)
        self.corrupted = 0
        self.fail_when: Callable[[str, str], bool] | None = None  # (method, path) -> fail it?
        # Random faults: the chance per request of each, and how long a slow answer waits.
        self.rates = {"503": 0.0, "500": 0.0, "reset": 0.0, "slow": 0.0}
        self.slow_seconds = 1.0
        self.fault_methods: set[str] | None = None  # random faults only for these; None: all
        self.injected = {"503": 0, "500": 0, "reset": 0, "slow": 0}
        self.delay = 0.0  # added to every request
        self.requests = 0
        self.copies = 0
        self.counts: collections.Counter[str] = collections.Counter()  # LIST, HEAD, GET, PUT, ...
        self.put_sha256: collections.Counter[str] = collections.Counter()  # x-amz-content-sha256 of PUTs with a body
        self.random = random.Random(1234)
        self.lock = threading.Lock()
        self._outage: str | None = None
        self._restored = threading.Event()
        self._conns: set[socket.socket] = set()
        self.hung = 0  # requests held by a "hang" outage
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy.lock:
                    proxy._conns.add(self.connection)

            def finish(self) -> None:
                with proxy.lock:
                    proxy._conns.discard(self.connection)
                super().finish()

            def _error(self, status: int, code: bytes) -> None:
                msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code +
                       b"</Code><Message>injected by the test proxy</Message></Error>")
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

            def _reset(self) -> None:
                # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer".
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

            def _random_fault(self) -> str | None:
                if proxy.fault_methods is not None and self.command not in proxy.fault_methods:
                    return None
                with proxy.lock:
                    proxy.requests += 1
                    roll = proxy.random.random()
                    for name, rate in proxy.rates.items():
                        if roll < rate:
                            proxy.injected[name] += 1
                            return name
                        roll -= rate
                return None

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                kind = "LIST" if self.command == "GET" and "list-type=" in self.path else self.command
                with proxy.lock:
                    proxy.counts[kind] += 1
                    if self.headers.get("x-amz-copy-source"):
                        proxy.copies += 1  # server-side copies (rename, metadata)
                outage = proxy._outage
                if outage == "hang":
                    with proxy.lock:
                        proxy.hung += 1
                    proxy._restored.wait()
                    self.close_connection = True  # never answered: the client gave up long ago
                    return
                if outage == "503":
                    proxy.failed += 1
                    self._error(503, b"SlowDown")
                    return
                if proxy.delay:
                    time.sleep(proxy.delay)
                if self.command in proxy.fail_methods or (
                        proxy.fail_when is not None and proxy.fail_when(self.command, self.path)):
                    proxy.failed += 1
                    code = b"AccessDenied" if proxy.fail_status == 403 else b"ServiceUnavailable"
                    self._error(proxy.fail_status, code)
                    return
                fault = self._random_fault()
                if fault == "503":
                    self._error(503, b"SlowDown")
                    return
                if fault == "500":
                    self._error(500, b"InternalError")
                    return
                if fault == "reset":
                    self._reset()
                    return
                if fault == "slow":
                    time.sleep(proxy.slow_seconds)
                if self.command == "PUT" and body:
                    with proxy.lock:
                        sha = self.headers.get("x-amz-content-sha256", "")
                        proxy.put_sha256["UNSIGNED-PAYLOAD" if sha == "UNSIGNED-PAYLOAD" else "signed"] += 1
                        corrupt = proxy.corrupt_parts > 0
                        if corrupt:
                            proxy.corrupt_parts -= 1
                            proxy.corrupted += 1
                    if corrupt:
                        body = bytes([body[0] ^ 0xFF]) + body[1:]
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items()})
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD answer carries the object's length, not its (empty) body's.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else len(data)
                self.send_header("Content-Length", str(length or 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # clients that die mid-request (a SIGKILLed daemon) are expected here

        self._server_class, self._handler = Server, Handler
        self.server: ThreadingHTTPServer | None = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        if self.server is None:  # the same port again, after a "refuse" outage
            self.server = self._server_class(("127.0.0.1", self.port), self._handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _stop_listening(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def outage(self, kind: str | None) -> None:
        """Fail every request from now on: "hang", "refuse" or "503"; None ends the outage.
        "refuse" stands for a server that died: the port is closed (connecting is refused)
        and the connections open to it are cut."""
        if kind not in (None, "hang", "refuse", "503"):
            raise ValueError(f"unknown outage {kind!r}")
        if kind == self._outage:
            return
        if self._outage == "refuse":
            self._listen()
        self._restored.clear()
        self._outage = kind
        if kind is None:
            self._restored.set()  # held requests end, unanswered
        elif kind == "refuse":
            self._stop_listening()
            with self.lock:
                conns = list(self._conns)
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> FaultProxy:
        self._listen()
        return self

    def __exit__(self, *exc: object) -> None:
        self._outage = None
        self._restored.set()
        self._stop_listening()

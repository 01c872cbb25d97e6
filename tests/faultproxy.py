"""A loopback HTTP proxy in front of the S3 server that can be told to fail requests."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FaultProxy:
    """Forwards to `upstream`; while `fail_methods` holds a method, answers it with `fail_status`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.fail_methods: set[str] = set()
        self.fail_status = 403
        self.failed = 0
        self.corrupt_parts = 0  # flip a byte in the body of this many UploadPart requests
        self.corrupted = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command in proxy.fail_methods:
                    proxy.failed += 1
                    msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                           b"<Message>injected by the test proxy</Message></Error>")
                    self.send_response(proxy.fail_status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if self.command == "PUT" and "partNumber=" in self.path and body:
                    with proxy.lock:
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

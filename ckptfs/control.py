"""The daemon's side of the control socket behind `ckptfs sync` and `status`: one JSON line
each way (the client side is in client.py, which the CLI imports without trio).

The socket lives in the runtime dir with mode 0600, so only the mount's owner can use it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import trio


log = logging.getLogger(__name__)


async def serve(path: str, handlers: dict[str, Any], task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on a unix socket at `path` until cancelled."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()

    async def one(stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\n" not in buf:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
            try:
                request = json.loads(buf.split(b"\n", 1)[0])
                handler = handlers[request["op"]]
                reply = await handler(request)
            except (ValueError, KeyError) as exc:
                reply = {"error": f"bad request: {exc}"}
            try:
                await stream.send_all(json.dumps(reply).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client gave up (`ckptfs sync --timeout`, Ctrl-C) before the answer

    try:
        await trio.serve_listeners(one, [listener])
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

"""systemd's notification protocol (sd_notify) without libsystemd: one datagram per message.

With `Type=notify`, systemd sets $NOTIFY_SOCKET; the daemon sends READY=1 once the mount is
live (after recovery), STATUS=... lines while it serves, and STOPPING=1 when it drains.
Outside systemd (no $NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # the abstract namespace
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        self._last_status: str | None = None

    def send(self, *fields: str) -> None:
        if self.address is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:  # systemd went away: nothing to tell
            log.debug("sd_notify to %s failed: %s", self.address, exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

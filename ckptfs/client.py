"""The CLI's side of a running mount: where its daemon is found, and its control socket.

`ckptfs sync`, `status` and `unmount` import only this (no trio, pyfuse3 or boto3), so they
start at once. Reading /proc/self/mountinfo never touches a mount itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from typing import Any

from ckptfs.errors import MountError


def runtime_dir() -> str:
    if os.geteuid() == 0:
        return "/run/ckptfs"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/ckptfs-{os.geteuid()}"
    return os.path.join(base, "ckptfs")


def state_path(mountpoint: str) -> str:
    """Where the daemon of `mountpoint` records its pid, for `ckptfs unmount`."""
    digest = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"{digest}.json")


def control_path(mountpoint: str) -> str:
    return state_path(mountpoint)[:-len(".json")] + ".sock"


def result_path(mountpoint: str) -> str:
    """Where a daemon leaves how its unmount went, for `ckptfs unmount` to report."""
    return state_path(mountpoint)[:-len(".json")] + ".result"


def _mountinfo(real_path: str) -> list[str] | None:
    """The /proc/self/mountinfo fields of the last mount stacked at `real_path`, or None.

    Reading this file never touches the mount itself, so it is safe while our own mount
    is not serving yet.
    """
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape_mountinfo(fields[4]) == real_path:
                found = fields
    return found


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_type(path: str) -> str | None:
    """The filesystem type mounted at `path` (the last one stacked there), or None."""
    fields = _mountinfo(os.path.realpath(path))
    if fields is None:
        return None
    sep = fields.index("-")
    return fields[sep + 1] if sep + 1 < len(fields) else ""


def is_mounted(path: str) -> bool:
    return mount_type(path) is not None


def request(path: str, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Send one request to the daemon and return its reply (blocking)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            raise MountError(f"cannot reach the ckptfs daemon ({exc.strerror})") from None
        s.sendall(json.dumps(message).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise MountError("the ckptfs daemon closed the control connection")
            buf += chunk
    reply = json.loads(buf.split(b"\n", 1)[0])
    if "error" in reply:
        raise MountError(reply["error"])
    return reply

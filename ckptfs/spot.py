"""Spot interruption notices from the EC2 instance metadata service (IMDSv2).

AWS posts `spot/instance-action` about two minutes before it reclaims a spot
instance. The watcher polls it with a session token; on a notice it calls
`on_notice` once and stops. The base URL is configurable so tests point it at
a fake on 127.0.0.1; nothing here talks to any other address on its own.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

_TOKEN_TTL = 21600
_TIMEOUT = 2.0


class ImdsClient:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._token: str | None = None
        self._token_expires = 0.0
        # Instance metadata is never reached through an HTTP proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=_TIMEOUT) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def _token_header(self) -> dict[str, str]:
        if self._token is None or time.monotonic() > self._token_expires:
            status, body = self._request("PUT", "/latest/api/token",
                                         {"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL)})
            if status != 200:
                raise OSError(f"IMDS token request answered {status}")
            self._token = body.decode().strip()
            self._token_expires = time.monotonic() + _TOKEN_TTL - 60
        return {"X-aws-ec2-metadata-token": self._token}

    def instance_action(self) -> dict[str, Any] | None:
        """The pending spot instance action, or None. Blocks; raises OSError if IMDS is unreachable."""
        status, body = self._request("GET", "/latest/meta-data/spot/instance-action",
                                     self._token_header())
        if status == 401:  # token expired early: fetch a new one next time
            self._token = None
            return None
        if status == 404:
            return None
        if status != 200:
            raise OSError(f"IMDS answered {status}")
        try:
            notice = json.loads(body)
        except ValueError:
            notice = {"action": body.decode(errors="replace").strip()}
        return notice if isinstance(notice, dict) else {"action": str(notice)}


async def watch(endpoint: str, interval: float, on_notice: Callable[[dict[str, Any]], None]) -> None:
    """Poll until a notice arrives; unreachable IMDS is logged once and polled again."""
    client = ImdsClient(endpoint)
    warned = False
    while True:
        try:
            notice = await trio.to_thread.run_sync(client.instance_action, abandon_on_cancel=True)
        except (OSError, urllib.error.URLError) as exc:
            if not warned:
                log.warning("spot termination watch: cannot reach %s (%s); still trying", endpoint, exc)
                warned = True
            notice = None
        if notice is not None:
            on_notice(notice)
            return
        await trio.sleep(interval)

"""Spot interruption notices from the EC2 instance metadata service (IMDSv2).

AWS posts `spot/instance-action` about two minutes before it reclaims a spot
instance. The watcher polls it with a session token; on a notice it calls
`on_notice` once and stops. The HTTP side (token request, headers, retries of
connection errors) is botocore's IMDS fetcher, the one its credential chain uses.
The base URL is configurable so tests point it at a fake on 127.0.0.1; nothing
here talks to any other address on its own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import botocore.exceptions
import botocore.httpsession
import botocore.utils
import trio

log = logging.getLogger(__name__)

_TOKEN_LIFETIME = 21600 - 60  # seconds a token is used; botocore asks for 6 hours
_TIMEOUT = 2.0
_PATH = "latest/meta-data/spot/instance-action"


class ImdsUnreachable(OSError):
    pass


class ImdsClient(botocore.utils.IMDSFetcher):
    def __init__(self, endpoint: str) -> None:
        # env={}: --spot-termination-watch asked for IMDS, whatever AWS_EC2_METADATA_DISABLED
        # says (it is meant for the credential chain).
        super().__init__(timeout=_TIMEOUT, num_attempts=2, base_url=endpoint, env={},
                         user_agent="ckptfs")
        # Instance metadata is never reached through an HTTP proxy.
        self._session = botocore.httpsession.URLLib3Session(timeout=_TIMEOUT, proxies={})
        self._token: str | None = None
        self._token_expires = 0.0

    def _token_now(self) -> str | None:
        if self._token is None or time.monotonic() > self._token_expires:
            # None where IMDSv2 is off (404/403/405): botocore then asks without one (v1).
            self._token = self._fetch_metadata_token()
            self._token_expires = time.monotonic() + _TOKEN_LIFETIME
        return self._token

    def instance_action(self) -> dict[str, Any] | None:
        """The pending spot instance action, or None. Blocks; raises ImdsUnreachable if IMDS
        does not answer, or answers something other than a notice, "none" or an expired token."""
        try:
            response = self._get_request(_PATH, lambda r: r.status_code not in (200, 401, 404),
                                         self._token_now())
        except (botocore.utils.BadIMDSRequestError, self._RETRIES_EXCEEDED_ERROR_CLS) as exc:
            raise ImdsUnreachable(f"no answer from {self.get_base_url()} "
                                  f"({type(exc).__name__})") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise ImdsUnreachable(str(exc)) from None
        if response.status_code == 401:  # the token expired early: a new one next time
            self._token = None
            return None
        if response.status_code == 404:
            return None
        try:
            notice = json.loads(response.content)
        except ValueError:
            notice = {"action": response.content.decode(errors="replace").strip()}
        return notice if isinstance(notice, dict) else {"action": str(notice)}


async def watch(endpoint: str, interval: float, on_notice: Callable[[dict[str, Any]], None]) -> None:
    """Poll until a notice arrives; unreachable IMDS is logged once and polled again."""
    client = ImdsClient(endpoint)
    warned = False
    while True:
        try:
            notice = await trio.to_thread.run_sync(client.instance_action, abandon_on_cancel=True)
        except ImdsUnreachable as exc:
            if not warned:
                log.warning("spot termination watch: cannot reach %s (%s); still trying", endpoint, exc)
                warned = True
            notice = None
        if notice is not None:
            on_notice(notice)
            return
        await trio.sleep(interval)

"""What crosses botocore, in ckptfs's terms: its failures as domain exceptions (NoSuchKey,
S3Error), one spelling of ETags and times, and GET bodies received straight into buffers
or files. Used by s3.py only; with it, the only modules that touch botocore's types.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
from collections.abc import Callable, Iterator
from typing import Any

import botocore.exceptions

from ckptfs import zerocopy
from ckptfs.bodies import scatter
from ckptfs.errors import LocalWriteError, NoSuchKey, S3Error


def etag_of(response: dict[str, Any]) -> str:
    """An object's ETag in one spelling, quoted as HEAD and LIST give it: SeaweedFS leaves the
    quotes off in CopyObjectResult, and a renamed file then looked changed on its next lookup
    (a new inode number, its local copy dropped)."""
    etag = response.get("ETag", "").strip('"')
    return f'"{etag}"' if etag else ""


def timestamp(value: Any) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return 0.0


@contextlib.contextmanager
def mapped(op: str, key: str) -> Iterator[None]:
    """Translate botocore failures into domain exceptions for one call."""
    try:
        yield
    except botocore.exceptions.ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket"):
            raise NoSuchKey(key) from None
        raise S3Error(f"{op} {key}: {code or status} {err.get('Message', '')}".strip(), code,
                      status) from None
    except botocore.exceptions.BotoCoreError as exc:
        # Connection refused or reset, timeouts, a truncated response: worth another try.
        # Configuration problems (no credentials, bad parameters) are not.
        retryable = not isinstance(exc, (botocore.exceptions.NoCredentialsError,
                                         botocore.exceptions.ParamValidationError))
        raise S3Error(f"{op} {key}: {exc}", type(exc).__name__, None, retryable) from None


def read_body_into(key: str, body: Any, outs: list[memoryview],
                    filled: Callable[[int], None] | None = None) -> None:
    """Fill the buffers `outs`, in order, from a botocore StreamingBody, calling `filled(i)`
    as soon as outs[i] is full. The http.client response under urllib3's reads straight into
    a buffer (urllib3's own readinto reads into a temporary bytes first); where that layer is
    not there, fall back to read()."""
    total = sum(len(out) for out in outs)
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is None or not hasattr(fp, "readinto") or not hasattr(raw, "release_conn"):
        with mapped("GET", key):
            data = body.read()
        if len(data) != total:
            raise S3Error(f"GET {key}: short body ({len(data)} of {total} bytes)", retryable=True)
        scatter(data, outs, filled)
        return
    got_all = 0
    try:
        for i, out in enumerate(outs):
            n = 0
            while n < len(out):
                got = fp.readinto(out[n:])
                if not got:
                    break
                n += got
            got_all += n
            if n != len(out):
                break
            if filled is not None:
                filled(i)
    except (OSError, http.client.HTTPException) as exc:
        body.close()  # the connection is in an unknown state: drop it, never pool it
        raise S3Error(f"GET {key}: {exc!r}", type(exc).__name__, None, True) from None
    if got_all != total:
        body.close()
        raise S3Error(f"GET {key}: short body ({got_all} of {total} bytes)", retryable=True)
    fp.close()  # at the end of its body: the socket stays open for the pool
    raw.release_conn()


def read_body_to_files(key: str, body: Any, targets: list[tuple[int, int, int]],
                        filled: Callable[[int], None]) -> int:
    """Write a botocore StreamingBody into the files `targets` (zerocopy.receive_into_files);
    where urllib3's layer is not there, read it whole and write it. Returns the bytes
    spliced."""
    total = sum(n for _, n, _ in targets)
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is None or not hasattr(raw, "release_conn"):
        with mapped("GET", key):
            data = body.read()
        if len(data) != total:
            raise S3Error(f"GET {key}: short body ({len(data)} of {total} bytes)", retryable=True)
        offset = 0
        for i, (fd, n, at) in enumerate(targets):
            zerocopy.write_all(fd, memoryview(data)[offset:offset + n], at)
            offset += n
            filled(i)
        return 0
    try:
        spliced = zerocopy.receive_into_files(fp, targets, filled)
    except LocalWriteError:
        body.close()  # mid-body: the connection is not reused
        raise
    except (OSError, http.client.HTTPException) as exc:
        body.close()  # the connection is in an unknown state: drop it, never pool it
        raise S3Error(f"GET {key}: {exc!r}", type(exc).__name__, None, True) from None
    if fp.length:
        body.close()
        raise S3Error(f"GET {key}: {fp.length} bytes of the body were not read", retryable=True)
    fp.close()  # at the end of its body: the socket stays open for the pool
    raw.release_conn()
    return spliced

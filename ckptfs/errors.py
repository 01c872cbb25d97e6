"""Domain exceptions. Only the FUSE request boundary (handles.guarded) turns them into errno
values."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator


class CkptfsError(Exception):
    """Base class for every error ckptfs raises on purpose."""

    errno = errno.EIO


class ConfigError(CkptfsError):
    """The user's configuration or command line is wrong (exit status 2)."""


class MountError(CkptfsError):
    """The mount cannot start: a one-line reason for the user (exit status 1)."""


class Refused(CkptfsError):
    """POSIX's answer to a request (ENOTEMPTY, EEXIST, ...): an errno, not a failure to log."""

    def __init__(self, code: int) -> None:
        super().__init__(errno.errorcode.get(code, str(code)))
        self.errno = code


class NoSuchKey(CkptfsError):
    errno = errno.ENOENT


# Error codes worth another attempt: throttling, server trouble, and bytes damaged on the way.
RETRYABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch",
    "XAmzContentSHA256Mismatch", "IncompleteBody", "OperationAborted",
})


class LocalWriteError(OSError):
    """Bytes received from S3 could not be written to a local file (a full cache disk):
    the server is not at fault, and asking it again would not help."""


class S3Error(CkptfsError):
    """An S3 request failed after boto3's retries.

    `retryable` says whether the same request may succeed later: connection
    failures, timeouts, 5xx, throttling and checksum mismatches are; access
    denied, a missing bucket or a malformed request are not.
    """

    def __init__(self, message: str, code: str = "", status: int | None = None,
                 retryable: bool | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        if retryable is None:
            retryable = (code in RETRYABLE_CODES or status is None and not code
                         or (status is not None and (status >= 500 or status in (408, 429))))
        self.retryable = retryable


class UploadError(S3Error):
    """A staged file could not be made durable in S3. Its staged bytes are kept."""

    def __init__(self, message: str, code: str = "", status: int | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message, code, status, retryable)


class NoSpace(CkptfsError):
    """The cache disk is full and uploads in flight cannot free enough of it."""

    errno = errno.ENOSPC


def first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


@contextlib.contextmanager
def raise_first_error() -> Iterator[None]:
    """Around a nursery: re-raise its first failure plainly, so callers can catch domain errors."""
    try:
        yield
    except ExceptionGroup as group:
        raise first_leaf(group) from None

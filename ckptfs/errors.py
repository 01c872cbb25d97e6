"""Domain exceptions. Only fs.py turns them into errno values."""

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


class NoSuchKey(CkptfsError):
    errno = errno.ENOENT


class S3Error(CkptfsError):
    """An S3 request failed after boto3's retries."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class UploadError(S3Error):
    """A staged file could not be made durable in S3. Its staged bytes are kept."""


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

"""Keys S3 still shows but the mount removed (async mode): deletes and renames waiting their
turn in the ordered log. Lookups and listings never bring them back from S3.

An S3 answer can predate a change that lands while it is in flight: a HEAD sent before the
delete was applied still finds the object, even though the change, and with it the mask, is
gone by the time the answer is read. So whoever asks S3 takes a view first (`Masks.view`):
a key unmasked while the view is open still counts as masked through that view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class _Unmasked:
    """Keys and prefixes unmasked since a view was taken."""

    def __init__(self) -> None:
        self.exact: set[str] = set()
        self.prefixes: set[str] = set()


def _under(key: str, prefixes: set[str] | dict[str, int]) -> bool:
    pos = key.find("/")
    while pos >= 0:
        if key[:pos + 1] in prefixes:
            return True
        pos = key.find("/", pos + 1)
    return False


class Masks:
    def __init__(self) -> None:
        self._exact: dict[str, int] = {}  # key -> the log entry that removed it
        self._prefixes: dict[str, int] = {}  # "dir/" removed with everything under it -> entry
        self._views: list[_Unmasked] = []  # views open now, each with what was unmasked since

    def add(self, key: str, seq: int) -> None:
        """Mask `key` (a trailing "/" masks a whole prefix) until entry `seq` is applied."""
        (self._prefixes if key.endswith("/") else self._exact)[key] = seq

    def follow(self, old_prefix: str, new_prefix: str) -> None:
        """The mount renamed the directory `old_prefix` to `new_prefix` (before that rename's
        own masks are added): what was removed under it is removed under the new name too,
        until the same entries are applied. Masks judge the mount's names, and until the
        rename's copies the mount reads what S3 holds under `old_prefix` through
        `new_prefix`. So `old_prefix/t/`, a temporary directory renamed away before its
        parent was renamed, stays gone under the parent's new name; and `old_prefix` itself,
        an earlier directory of that name renamed away (`t` committed as `a`, a new `t`
        committed as `b`), does not show its files under `b`."""
        for table in (self._exact, self._prefixes):
            moved = [(new_prefix + k[len(old_prefix):], s) for k, s in table.items()
                     if k.startswith(old_prefix)]
            for key, seq in moved:  # (a key masked twice shows again after the later entry)
                table[key] = max(seq, table.get(key, 0))

    def release(self, seq: int) -> None:
        """Entry `seq` is in S3: its keys show again, except through views open now."""
        for table, kind in ((self._exact, "exact"), (self._prefixes, "prefixes")):
            for key in [k for k, s in table.items() if s == seq]:
                del table[key]
                for view in self._views:
                    getattr(view, kind).add(key)

    def masked(self, key: str) -> bool:
        """S3 may still hold `key` (an object or a "dir/" prefix), but the mount removed it."""
        return key in self._exact or (bool(self._prefixes) and _under(key, self._prefixes))

    @contextlib.contextmanager
    def view(self) -> Iterator[Callable[[str], bool]]:
        """`masked` for answers S3 gives from now until the block ends."""
        since = _Unmasked()
        self._views.append(since)

        def masked(key: str) -> bool:
            return (self.masked(key) or key in since.exact
                    or (bool(since.prefixes) and _under(key, since.prefixes)))
        try:
            yield masked
        finally:
            self._views.remove(since)


@contextlib.contextmanager
def no_masks() -> Iterator[Callable[[str], bool]]:
    """The view of a mount whose changes reach S3 before the call returns (close mode)."""
    yield lambda key: False

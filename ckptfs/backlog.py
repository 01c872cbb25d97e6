"""What S3 does not have yet: the plumbing both modes' backlogs share.

Close mode's retry queue (queue.py: files whose close failed) and async mode's ordered log
(oplog.py: every change, in order) each keep their items here, by key. Each item counts its
attempts and keeps its last error; the waits behind `ckptfs sync` and the drain at unmount
wake whenever an item changes (`_notify`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from ckptfs.broadcast import Broadcast


class Item(Protocol):
    attempts: int
    error: str | None


K = TypeVar("K")
E = TypeVar("E", bound=Item)


class Backlog(Generic[K, E]):
    def __init__(self) -> None:
        self._items: dict[K, E] = {}
        self._changed = Broadcast()

    def _path(self, item: E) -> str:
        """The item's path in the mount."""
        raise NotImplementedError

    def _size(self, item: E) -> int:
        """The bytes S3 still has to get for it."""
        raise NotImplementedError

    def _notify(self) -> None:
        self._changed.fire()

    def __len__(self) -> int:
        return len(self._items)

    def pending(self) -> list[tuple[str, int, str | None]]:
        """(path, bytes, last error) of every change S3 does not have yet."""
        return [(self._path(e), self._size(e), e.error) for e in self._items.values()]

    def _under(self, path: str) -> Callable[[E], bool]:
        """Whether an item is `path` or below it ("": everything)."""
        prefix = path.rstrip("/") + "/"

        def under(item: E) -> bool:
            p = self._path(item)
            return not path or p == path or p.startswith(prefix)
        return under

    def _attempts(self, keys: Iterable[K]) -> dict[K, int]:
        """The attempts of each item now: `_failed_since` compares with them later."""
        return {k: self._items[k].attempts for k in keys}

    def _failed_since(self, start: dict[K, int]) -> list[tuple[str, str]]:
        """(path, reason) of each item of `start` still here that failed an attempt since."""
        return [(self._path(e), e.error or "upload failed") for k, n in start.items()
                if (e := self._items.get(k)) is not None and e.attempts > n]

    async def drain(self) -> None:
        """Return once nothing is pending (the caller bounds it with a deadline)."""
        while self._items:
            await self._changed.wait()

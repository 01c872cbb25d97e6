"""The on-disk read cache: local bytes of S3 objects, keyed by (key, ETag), LRU by bytes.

Entries live in CACHE_DIR/cache/ as plain files named `<hash(key)>-<hash(etag)>-<part>`:
`all` is a whole object (a written file whose upload finished is moved in here, so reading
it back costs no GET, or an object fetched whole), `partial` an object being fetched into
its own file (each chunk at its offset; which chunks are in is known in memory only, so a
partial file does not outlive its mount), a number is one chunk fetched from S3. Because
the ETag is in the name, an entry can only ever answer for the exact version it holds;
when a new version of a key is cached the entries of the old one are deleted. The index is rebuilt from the
directory at mount (oldest mtime evicted first), so the cache survives a remount.

Only clean bytes live here: staged files not yet in S3 stay in the staging dir and are
never evicted. The index is touched only on the trio thread; file reads and writes of
chunks run in worker threads.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections import OrderedDict

log = logging.getLogger(__name__)

_MAX_FDS = 256


@functools.lru_cache(maxsize=4096)  # every read asks for its chunk's name
def _h(text: str, n: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:n]


class ObjectCache:
    def __init__(self, cache_dir: str, budget: int) -> None:
        self.dir = os.path.join(cache_dir, "cache")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.budget = budget
        self.total = 0
        self._lru: OrderedDict[str, int] = OrderedDict()  # name -> bytes
        self._by_key: dict[str, set[str]] = {}  # key hash -> names
        self._fds: OrderedDict[str, int] = OrderedDict()  # open entries, LRU
        self._partial: dict[str, Partial] = {}  # objects being fetched into their own file
        self.objects_received = 0  # fetched whole into one file: no assembly needed
        self.evicted = 0
        self._load()

    # ----- naming ----------------------------------------------------------

    @staticmethod
    def _name(key: str, etag: str, part: str) -> str:
        return f"{_h(key, 32)}-{_h(etag, 16)}-{part}"

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def stats(self) -> dict[str, int]:
        return {"cache_bytes": self.total, "cache_budget": self.budget,
                "objects_received_whole": self.objects_received}

    def _load(self) -> None:
        found = []
        for name in os.listdir(self.dir):
            path = self._path(name)
            if name.endswith((".tmp", "-partial")):
                os.unlink(path)  # a chunk write that never finished, an object never whole
                continue
            if name.count("-") != 2:
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, name, st.st_size))
        for _, name, size in sorted(found):
            self._add(name, size)
        if found:
            log.info("read cache: %d entries, %.1f MiB kept from earlier mounts", len(found),
                     self.total / 2**20)
        self._evict()

    # ----- index -----------------------------------------------------------

    def _add(self, name: str, size: int) -> None:
        self._discard(name)
        self._lru[name] = size
        self.total += size
        self._by_key.setdefault(name.split("-", 1)[0], set()).add(name)

    def _discard(self, name: str) -> bool:
        size = self._lru.pop(name, None)
        if size is None:
            return False
        self.total -= size
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)
        partial = self._partial.pop(name, None)
        if partial is not None:
            partial.close()
        kh = name.split("-", 1)[0]
        names = self._by_key.get(kh)
        if names is not None:
            names.discard(name)
            if not names:
                del self._by_key[kh]
        return True

    def _remove(self, name: str) -> None:
        if self._discard(name):
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass

    def _evict(self, keep: str | None = None) -> None:
        while self.total > self.budget and self._lru:
            victim = next(iter(self._lru))
            if victim == keep:
                if len(self._lru) == 1:
                    return
                self._lru.move_to_end(victim)
                continue
            self._remove(victim)
            self.evicted += 1

    def _drop_other_versions(self, key: str, etag: str) -> None:
        kh, eh = _h(key, 32), _h(etag, 16)
        for name in list(self._by_key.get(kh, ())):
            if name.split("-")[1] != eh:
                self._remove(name)

    # ----- whole objects -----------------------------------------------------

    def local_fd(self, key: str, etag: str, index: int, chunk_size: int,
                 size: int) -> tuple[int, int] | None:
        """A read-only descriptor holding chunk `index` of the object, and the object offset
        where that file starts: the whole object if it is cached, else the chunk's own file.
        Descriptors stay open (LRU); an entry of the wrong size (torn) is dropped."""
        want = min(chunk_size, size - index * chunk_size)
        partial = self._partial.get(self._name(key, etag, "partial"))
        if partial is not None and index in partial.present:
            self._lru.move_to_end(partial.name)
            return partial.rfd, 0
        for part, base, expect in (("all", 0, size), (str(index), index * chunk_size, want)):
            name = self._name(key, etag, part)
            if name not in self._lru:
                continue
            self._lru.move_to_end(name)
            fd = self._fds.get(name)
            if fd is not None:
                self._fds.move_to_end(name)
                return fd, base
            try:
                fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self._discard(name)
                continue
            found = os.fstat(fd).st_size
            if found != expect:
                os.close(fd)
                log.warning("read cache: dropping %s: %d bytes where %d were expected", name,
                            found, expect)
                self._remove(name)
                continue
            self._fds[name] = fd
            while len(self._fds) > _MAX_FDS:
                os.close(self._fds.popitem(last=False)[1])
            return fd, base
        return None

    def whole_path(self, key: str, etag: str, size: int) -> str | None:
        """The path of the whole object's file, if the cache has all of it (for passthrough:
        an open descriptor keeps the bytes even if the entry is evicted meanwhile)."""
        name = self._name(key, etag, "all")
        if self._lru.get(name) != size:
            return None
        self._lru.move_to_end(name)
        return self._path(name)

    def adopt(self, key: str, etag: str, path: str, size: int) -> None:
        """Move a clean local file (an uploaded staged file) in as the whole object."""
        self._drop_other_versions(key, etag)
        name = self._name(key, etag, "all")
        self._discard(name)
        os.rename(path, self._path(name))
        self._add(name, size)
        for k in [n for n in self._by_key.get(_h(key, 32), ()) if not n.endswith("-all")]:
            self._remove(k)  # chunks of this version are redundant now
        self._evict(keep=name)

    def take(self, key: str, etag: str, dest: str) -> bool:
        """Move the whole object out of the cache to `dest` (it is about to be written)."""
        name = self._name(key, etag, "all")
        if name not in self._lru:
            return False
        self._discard(name)
        try:
            os.rename(self._path(name), dest)
        except FileNotFoundError:
            return False
        return True

    def rekey(self, old_key: str, old_etag: str, new_key: str, new_etag: str,
              keep: str | None = None) -> None:
        """A renamed object keeps its cached bytes under its new name; what was cached under
        that name goes, but the version `keep` (an ETag: a handle still reads it)."""
        old = self._name(old_key, old_etag, "all")
        size = self._lru.get(old)
        self.drop_key(new_key, keep)
        if size is None:
            self.drop_key(old_key)
            return
        self._discard(old)
        new = self._name(new_key, new_etag, "all")
        try:
            os.rename(self._path(old), self._path(new))
        except FileNotFoundError:
            return
        self._add(new, size)
        self.drop_key(old_key)

    def drop_key(self, key: str, keep: str | None = None) -> None:
        """Every cached version of `key`, but the one with ETag `keep`."""
        kept = _h(keep, 16) if keep is not None else None
        for name in list(self._by_key.get(_h(key, 32), ())):
            if name.split("-")[1] != kept:
                self._remove(name)

    def drop_version(self, key: str, etag: str) -> None:
        eh = _h(etag, 16)
        for name in list(self._by_key.get(_h(key, 32), ())):
            if name.split("-")[1] == eh:
                self._remove(name)

    def make_room(self, free: int) -> int:
        """Evict least recently used entries until the cache disk has `free` bytes free (or
        the cache is empty); returns the bytes freed. With passthrough the kernel writes the
        cache disk itself, so room for writers is made ahead of them (passthrough.py)."""
        freed = 0
        while self._lru and free_bytes(self.dir) < free:
            victim = next(iter(self._lru))
            freed += self._lru[victim]
            self._remove(victim)
            self.evicted += 1
        return freed

    def reclaim(self) -> int:
        """Delete everything (the cache disk is full); returns the bytes freed."""
        freed = self.total
        for name in list(self._lru):
            self._remove(name)
        return freed

    def open_chunks(self, key: str, etag: str, size: int, chunk_size: int) -> list[int] | None:
        """Read-only descriptors of every chunk of the object, in order, if all are cached
        (open descriptors keep the bytes even if an entry is evicted meanwhile)."""
        fds: list[int] = []
        for index in range((size + chunk_size - 1) // chunk_size):
            name = self._name(key, etag, str(index))
            want = min(chunk_size, size - index * chunk_size)
            try:
                if self._lru.get(name) != want:
                    raise FileNotFoundError(name)
                fds.append(os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                for fd in fds:
                    os.close(fd)
                return None
        return fds

    def whole_tmp(self, key: str, etag: str) -> tuple[str, str]:
        name = self._name(key, etag, "all")
        return name, self._path(name) + f".{os.getpid()}.tmp"

    def commit_whole(self, key: str, etag: str, name: str, tmp: str, size: int) -> None:
        """Publish a whole object assembled in its temp file; its chunks go."""
        if name in self._lru or size > self.budget:
            os.unlink(tmp)
            return
        self.adopt(key, etag, tmp, size)

    # ----- objects fetched into their own file ----------------------------------

    def receiving(self, key: str, etag: str, size: int) -> Partial | None:
        """The file the object's chunks are fetched into, each at its offset (made at the
        first call; each chunk's bytes count against the budget as it lands); None if the
        object should not be fetched whole (over half the budget) or the file cannot be made.
        The caller writes through a dup of `wfd` (eviction closes the partial's own)."""
        name = self._name(key, etag, "partial")
        partial = self._partial.get(name)
        if partial is not None:
            return partial
        if size > self.budget // 2 or self._name(key, etag, "all") in self._lru:
            return None
        self._drop_other_versions(key, etag)
        path = self._path(name)
        try:
            wfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("read cache: cannot make %s: %s", name, exc)
            return None
        try:
            rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(wfd)
            unlink_quietly(path)
            return None
        partial = self._partial[name] = Partial(name, path, size, wfd, rfd)
        self._add(name, 0)
        return partial

    def chunk_received(self, partial: Partial, index: int, chunks: int, length: int) -> bool:
        """Chunk `index` (`length` bytes) of a partial object is in its file; once all
        `chunks` are, the file becomes the whole object (a rename: no copy). True if it did."""
        if self._partial.get(partial.name) is not partial or index in partial.present:
            return False  # evicted or replaced meanwhile: the bytes went to an unlinked file
        partial.present.add(index)
        self._lru[partial.name] += length
        self._lru.move_to_end(partial.name)
        self.total += length
        self._evict(keep=partial.name)
        if len(partial.present) < chunks:
            return False
        whole = partial.name[:-len("partial")] + "all"
        del self._partial[partial.name]
        self._discard(partial.name)  # (its descriptors stay open: this reader keeps them)
        try:
            os.rename(partial.path, self._path(whole))
        except OSError as exc:
            log.debug("read cache: could not publish %s: %s", whole, exc)
            partial.close()
            return False
        os.close(partial.wfd)
        self._add(whole, partial.size)
        self._fds[whole] = partial.rfd
        while len(self._fds) > _MAX_FDS:
            os.close(self._fds.popitem(last=False)[1])
        kh = whole.split("-", 1)[0]
        for name in [n for n in self._by_key.get(kh, ()) if n.split("-")[2].isdigit()]:
            self._remove(name)  # chunks of this version cached before are redundant
        self.objects_received += 1
        return True

    # ----- chunks --------------------------------------------------------------

    def chunk_tmp(self, key: str, etag: str, index: int) -> tuple[str, str]:
        name = self._name(key, etag, str(index))
        return name, self._path(name) + f".{os.getpid()}.tmp"

    def commit_chunk(self, key: str, etag: str, name: str, tmp: str, size: int) -> None:
        """Publish a chunk written to its temp file (on the trio thread)."""
        if size > self.budget:
            os.unlink(tmp)
            return
        self._drop_other_versions(key, etag)
        if self._name(key, etag, "all") in self._lru:
            os.unlink(tmp)  # the whole object arrived meanwhile
            return
        os.rename(tmp, self._path(name))
        self._add(name, size)
        self._evict(keep=name)


class Partial:
    """An object being fetched into its own file of the cache."""

    def __init__(self, name: str, path: str, size: int, wfd: int, rfd: int) -> None:
        self.name, self.path, self.size = name, path, size
        self.wfd, self.rfd = wfd, rfd  # for fetches (dup'd by each), for readers
        self.present: set[int] = set()  # chunk indexes whose bytes are all in the file

    def close(self) -> None:
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass


def unlink_quietly(path: str) -> None:
    """Remove a cache file that may already be gone."""
    try:
        os.unlink(path)
    except OSError:
        pass


def concatenate(fds: list[int], dest: str, size: int, chunk_size: int) -> None:
    """Write the chunk files `fds` one after the other into a new file `dest`, in the kernel
    (copy_file_range); call from a worker thread."""
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for index, fd in enumerate(fds):
            want, done = min(chunk_size, size - index * chunk_size), 0
            while done < want:
                n = os.copy_file_range(fd, out, want - done, done, index * chunk_size + done)
                if n == 0:
                    raise OSError(f"chunk {index} of {dest} is short")
                done += n
    finally:
        os.close(out)


def free_bytes(path: str) -> int:
    """Bytes of the file system under `path` that an unprivileged writer may still use."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize

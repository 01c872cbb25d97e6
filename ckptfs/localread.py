"""Local files read without a copy (FileSlice, sent by pyfuse3's threads, else LocalView, a
mapping replied from) and chunk files written to the disk cache (store_file: O_DIRECT where
the file system allows it)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from ckptfs.parts import MiB

try:  # ckptfs's pyfuse3 (third_party/): a read's reply sent from a file by a worker thread
    from pyfuse3 import FileSlice
    SLICES_SUPPORTED = True
except ImportError:  # a stock pyfuse3: replies are bytes from the FUSE loop
    SLICES_SUPPORTED = False

    class FileSlice:  # type: ignore[no-redef]  # never made: ChunkReader.slices stays off
        def __init__(self, fd: int, offset: int, size: int) -> None:
            self.fd, self.offset, self.size = fd, offset, size

Reply = bytes | memoryview | FileSlice  # what a read handler returns to pyfuse3


def reply_size(data: Reply) -> int:
    return data.size if isinstance(data, FileSlice) else len(data)


def reply_bytes(data: Reply) -> bytes:
    """The bytes of a reply (a FileSlice is read now: its descriptor is open until the
    handler returns)."""
    if isinstance(data, FileSlice):
        return os.pread(data.fd, data.size, data.offset)
    return bytes(data)

ALIGN = 4096  # O_DIRECT wants offsets, lengths and addresses aligned to the logical block


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT if the file system supports it; say whether it did."""
    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags | os.O_CLOEXEC, 0o600), False


def store_file(tmp: str, buf: mmap.mmap, length: int) -> None:
    """Blocking: write the first `length` bytes of `buf` to the new file `tmp` (no fsync:
    the cache may lose entries, never hold wrong ones; the name is published after this)."""
    fd, direct = _open_direct(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(buf)
        stop = min(_aligned(length), len(buf)) if direct else length
        n = 0
        while n < stop:
            if direct and n % ALIGN:  # a short write left us unaligned: go on buffered
                os.close(fd)
                fd, direct = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC), False
                stop = length
            n += os.pwritev(fd, [view[n:stop]], n)
        if n != length:
            os.ftruncate(fd, length)  # drop the alignment padding
    finally:
        os.close(fd)


_MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in for reading, without touching it
_LOCAL_READAHEAD = 16 * MiB  # advised after a read that found its pages not in memory
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_LOW_BIT = bytes(b & 1 for b in range(256))


class LocalView:
    """A range of a local file, mapped to be replied from without a copy.

    The mapping is private and writable only so that ctypes can take its address for
    mincore(); nothing writes to it (a write would copy the page, never reach the file).
    pyfuse3 replies from the view before any other task runs, and every truncate of a staged
    or cached file happens on the FUSE loop too, so reply() clamping the range to the file's
    size makes the reply never touch a page past the end (which would raise SIGBUS). Only a
    process outside ckptfs truncating a file in the cache dir could still do that.
    """

    def __init__(self, fd: int, offset: int, end: int) -> None:
        self.offset, self.end = offset, end
        self.base = offset - offset % mmap.ALLOCATIONGRANULARITY
        self.map = mmap.mmap(fd, end - self.base, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=self.base)

    def resident(self) -> bool:
        """Whether every page of the range is in the page cache (mapping it cannot block)."""
        length = len(self.map)
        pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        anchor = ctypes.c_char.from_buffer(self.map)
        try:
            rc = _libc.mincore(ctypes.addressof(anchor), length, vec)
        finally:
            del anchor
        return rc == 0 and vec.raw[:pages].translate(_LOW_BIT) == b"\x01" * pages

    def load(self, fd: int) -> None:
        """Blocking: bring the range into memory, and advise readahead past it."""
        try:
            os.posix_fadvise(fd, self.end, _LOCAL_READAHEAD, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint
        try:
            self.map.madvise(_MADV_POPULATE_READ)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return  # EFAULT: the file shrank meanwhile; reply() clamps
            os.preadv(fd, [bytearray(len(self.map))], self.base)  # an old kernel: read it

    def reply(self) -> bytes | memoryview:
        end = min(self.end, self.map.size())  # size() asks the file, not the mapping
        if end <= self.offset:
            return b""
        return memoryview(self.map)[self.offset - self.base:end - self.base]

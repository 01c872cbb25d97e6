"""Object metadata: a file's attributes as x-amz-meta-* headers, and back.

The names are s3fs-fuse's (mode, uid, gid, mtime, ctime, rdev), so both tools read each
other's files. Times are "seconds.nanoseconds".
"""

from __future__ import annotations

from ckptfs.inodes import Inode


def object_metadata(inode: Inode) -> dict[str, str]:
    """The headers a PUT, a multipart upload or a copy of `inode`'s object carries. ctime
    rides along in every request that sends metadata anyway (a chmod's copy included);
    atime is never stored: it would cost a request per read."""
    return {
        "mode": str(inode.mode),
        "uid": str(inode.uid),
        "gid": str(inode.gid),
        "mtime": stamp(inode.mtime_ns),
        "ctime": stamp(inode.ctime_ns),
    } | ({"rdev": str(inode.rdev)} if inode.rdev else {})


def stamp(ns: int) -> str:
    return f"{ns // 10**9}.{ns % 10**9:09d}"


def parse_stamp(text: str | None, default_ns: int) -> int:
    """Nanoseconds from a stored time (s3fs writes whole seconds); `default_ns` if none."""
    if not text:
        return default_ns
    try:
        whole, _, frac = text.partition(".")
        return int(whole) * 10**9 + int((frac + "000000000")[:9])
    except ValueError:
        return default_ns

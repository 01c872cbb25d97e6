"""What an S3 object says of the inode it stands for: its kind, and its attributes from
a HEAD's metadata (mode, owner, times) or a LIST entry (size, ETag, time)."""

from __future__ import annotations

import stat

from ckptfs.inodes import SPECIAL_TYPES, Inode
from ckptfs.metadata import parse_stamp
from ckptfs.s3types import ObjectInfo


def kind_of(info: ObjectInfo) -> int:
    """The file type a HEADed object stands for: a symlink, a special file, or a plain file."""
    kind = stat.S_IFMT(int_or(info.metadata.get("mode"), 0))
    if kind == stat.S_IFLNK or (kind in SPECIAL_TYPES and info.size == 0):
        return kind
    return stat.S_IFREG


def kind_changed(child: Inode, info: ObjectInfo) -> bool:
    """A HEAD says the object is of another type than the table's inode (a symlink or special
    file where it has a plain one, or the other way round): the kernel needs a new inode."""
    return stat.S_IFMT(child.mode) != kind_of(info) and child.open_handles == 0


def apply_object(inode: Inode, info: ObjectInfo, with_metadata: bool, uid: int, gid: int) -> None:
    """Refresh a clean inode from an S3 object (HEAD with metadata, or a LIST entry)."""
    inode.listed(info.size, info.etag)
    mtime_default = int(info.last_modified * 10**9)
    if with_metadata:
        md = info.metadata
        kind = stat.S_IFMT(inode.mode)
        try:
            mode = int(md["mode"]) if "mode" in md else None
        except ValueError:
            mode = None
        if mode is not None and stat.S_IFMT(mode) not in (0, kind):
            mode = None
        inode.set_attributes(mode=mode, uid=int_or(md.get("uid"), uid),
                             gid=int_or(md.get("gid"), gid),
                             mtime_ns=parse_stamp(md.get("mtime"), mtime_default),
                             ctime_ns=parse_stamp(md.get("ctime"), inode.ctime_ns))
        inode.described()
    elif not inode.meta_known:
        inode.set_attributes(mtime_ns=mtime_default)
    inode.times_at_least_mtime()


def apply_dir_metadata(inode: Inode, md: dict[str, str], uid: int, gid: int) -> None:
    """A directory's attributes from its marker object's metadata."""
    inode.set_attributes(mode=int_or(md.get("mode"), 0o755), uid=int_or(md.get("uid"), uid),
                         gid=int_or(md.get("gid"), gid),
                         mtime_ns=parse_stamp(md.get("mtime"), inode.mtime_ns))
    inode.described()


def int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default

"""What a LIST (and the HEADs it needs) says of a directory, read from S3's answers.

namespace.py decides what the answers mean for the inode table; this module only reads
them: which names are valid, which objects stand for directories (another tool's
markers), which small objects need a HEAD to tell their type, and one page's entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ckptfs.bucket import Bucket
from ckptfs.errors import NoSuchKey
from ckptfs.inodes import Inode, InodeTable
from ckptfs.s3types import MARKED_MAX, ListPage, ObjectInfo, is_marked

NAME_MAX = 255
# A listing HEADs the objects it has not seen with metadata whose type may differ from a plain
# file's, which only their metadata tells: every small marked one (s3types: ckptfs writes
# symlinks and special files as one-part multipart uploads, so their LIST entries show it),
# and, for symlinks and special files an older ckptfs wrote unmarked, every small unmarked
# one while a directory has at most SMALL_HEADS of them. A directory of thousands of tiny
# files is listed with its LIST pages alone; only an unmarked symlink there shows as a file
# until looked up.
SYMLINK_MAX = MARKED_MAX
SMALL_HEADS = 64


def valid_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and len(name.encode(
        "utf-8", "surrogateescape")) <= NAME_MAX


# Directories other tools mark with an object of their own, not a "dir/" key: s3fs (and
# others) with a zero-byte "dir" of this Content-Type, Hadoop's S3 connectors with a
# zero-byte "dir_$folder$". Shown as directories; their objects are never shown as files.
DIRECTORY_TYPE = "application/x-directory"
FOLDER_SUFFIX = "_$folder$"


def is_directory_object(info: ObjectInfo) -> bool:
    """A zero-byte "dir" object that another tool wrote to stand for a directory."""
    return (info.size == 0 and not info.key.endswith("/") and info.content_type is not None
            and info.content_type.split(";")[0].strip().lower() == DIRECTORY_TYPE)


def keeps_metadata(marker_key: str) -> bool:
    """Whether another tool's marker object of a directory holds the directory's metadata:
    an s3fs "dir" object does (lookups read its mode there), and a chmod writes it there,
    in place: a "dir/" beside a "dir" object is refused by stores with real folders
    (SeaweedFS: ExistingObjectIsFile). A Hadoop "dir_$folder$" holds none."""
    return not marker_key.endswith(FOLDER_SUFFIX)


def folder_marker_of(name: str, info: ObjectInfo) -> str | None:
    """The directory a Hadoop "dir_$folder$" marker stands for, if `name` is one."""
    if info.size == 0 and name.endswith(FOLDER_SUFFIX) and len(name) > len(FOLDER_SUFFIX):
        return name[:-len(FOLDER_SUFFIX)]
    return None


def sort_key(key: str) -> bytes:
    """S3 lists keys in the order of their UTF-8 bytes."""
    return key.encode("utf-8", "surrogateescape")


@dataclass
class Listing:
    """A directory's entries as S3 lists them, the mount's masked names left out."""
    dirs: set[str] = field(default_factory=set)
    files: dict[str, ObjectInfo] = field(default_factory=dict)
    markers: dict[str, str] = field(default_factory=dict)  # dir name -> another tool's marker
    headed: dict[str, ObjectInfo] = field(default_factory=dict)  # small objects, HEADed


def page_entries(page: ListPage, physical: str, dir_key: str,
                 masked: Callable[[str], bool]) -> tuple[dict[str, ObjectInfo | None], bytes]:
    """One LIST page of `physical` (where S3 holds the directory the mount calls `dir_key`):
    name -> object (None: a directory), and the last key it covered (S3's byte order)."""
    seen: dict[str, ObjectInfo | None] = {}
    last = b""
    for prefix in page.prefixes:
        if not masked(dir_key + prefix[len(physical):]):
            seen[prefix[len(physical):-1]] = None
        last = max(last, sort_key(prefix))
    for obj in page.objects:
        rest = obj.key[len(physical):]
        if rest and not masked(dir_key + rest):
            folder = folder_marker_of(rest, obj)
            if folder is not None:
                seen[folder] = None  # a directory (another tool's marker of it)
            else:
                seen.setdefault(rest, obj)  # a directory wins, as in a listing
        last = max(last, sort_key(obj.key))
    return seen, last


async def read_listing(s3: Bucket, table: InodeTable, directory: Inode, dir_key: str, physical: str,
                       masked: Callable[[str], bool], skip: Callable[[str], bool],
                       warn: Callable[[str, str], None]) -> Listing:
    """Every entry of the directory S3 holds at `physical` (the mount calls it `dir_key`);
    `skip`: names never shown (the prefix's reserved one); `warn(key, why)` for left-out keys."""
    out = Listing()
    async for page in s3.list_pages(physical):
        for prefix in page.prefixes:
            name = prefix[len(physical):-1]
            if masked(dir_key + name + "/") or skip(name):
                continue
            if valid_name(name):
                out.dirs.add(name)
            else:
                warn(prefix, "not a valid file name")
        for obj in page.objects:
            name = obj.key[len(physical):]
            if name == "" or masked(dir_key + name) or skip(name):
                continue  # the directory's own marker, or removed here and not yet in S3
            folder = folder_marker_of(name, obj)
            if folder is not None and valid_name(folder):
                out.dirs.add(folder)
                out.markers[folder] = obj.key
            elif valid_name(name):
                out.files[name] = obj
            else:
                warn(obj.key, "not a valid file name")
    out.headed = await _head_small(s3, table, physical, directory, out.files)
    for name, info in out.headed.items():
        if is_directory_object(info):
            del out.files[name]
            out.dirs.add(name)
            out.markers.setdefault(name, info.key)
    return out


async def _head_small(s3: Bucket, table: InodeTable, dir_key: str, directory: Inode,
                      files: dict[str, ObjectInfo]) -> dict[str, ObjectInfo]:
    """HEAD the objects whose type a LIST entry cannot tell (see SMALL_HEADS)."""
    def known(name: str, info: ObjectInfo) -> bool:  # or owned by the mount: not asked
        c = table.child(directory.ino, name)
        return c is not None and (c.is_local or (c.meta_known and c.etag == info.etag))
    unknown = [(n, info) for n, info in files.items()
               if info.size <= SYMLINK_MAX and not known(n, info)]
    marked = [n for n, info in unknown if is_marked(info.etag, info.size)]
    plain = [n for n, info in unknown if not is_marked(info.etag, info.size)]
    names = marked + (plain if len(plain) <= SMALL_HEADS else [])
    headed: dict[str, ObjectInfo] = {}
    limit = trio.CapacityLimiter(16)

    async def head(name: str) -> None:
        async with limit:
            try:
                headed[name] = await s3.head(dir_key + name)
            except NoSuchKey:
                pass  # gone since the LIST: the listing's entry stands until the next look
    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(head, name)
    return headed

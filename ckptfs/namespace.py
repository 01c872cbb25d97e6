"""S3 names -> directory entries: lookups, listings, and object metadata.

A directory is a common prefix or a zero-byte `dir/` marker object. Keys that
cannot be a POSIX path (empty, `.` or `..` components, components over 255
bytes) are left out, each with one warning. Answers from S3 are trusted for
`metadata_ttl` seconds; the mount's own changes are always authoritative.

In async mode (`patience` set) the trainer never waits on S3 for what the mount knows: a
name it made, listed or looked up before, a directory whose listing it holds. Past the TTL,
S3 gets `patience` (a second) to answer; then the last known answer stands (patience.py). A
name the mount never knew still waits for S3.
"""

from __future__ import annotations

import contextlib
import logging
import stat
import time
from collections.abc import Awaitable, Callable

import cachetools
import trio

from ckptfs.bucket import Bucket
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.inodes import ROOT_INODE, SPECIAL_TYPES, Inode, InodeTable
from ckptfs.listing import (SYMLINK_MAX, Listing, is_directory_object, page_entries, read_listing,
                            sort_key)
from ckptfs.masks import Masks, no_masks
from ckptfs.objectattrs import apply_dir_metadata, apply_object, int_or, kind_changed, kind_of
from ckptfs.patience import STALE, Patience, Stale
from ckptfs.s3types import ListPage, ObjectInfo

log = logging.getLogger(__name__)

# The one name of the prefix's top that is ckptfs's own: rename intents live under it
# (renames.py). Listings never show it, lookups never find it, the mount never makes it.
RESERVED_NAME = ".ckptfs"
KEY_MAX = 1024


def is_reserved(parent: Inode, name: str) -> bool:
    return parent.ino == ROOT_INODE and name == RESERVED_NAME


class Namespace:
    def __init__(self, s3: Bucket, table: InodeTable, uid: int, gid: int, ttl: float,
                 masks: Masks | None = None, patience: float | None = None,
                 nursery: trio.Nursery | None = None) -> None:
        self.s3 = s3
        # Async mode: how long a question S3 owes an answer is waited for before the mount's
        # own knowledge answers (None: close mode, every question waits for S3).
        self.patience = patience
        self._asked = Patience(s3.policy.health if patience is not None else None, patience, nursery)
        # Keys (and "dir/" prefixes) S3 still shows but the mount removed: deletes and renames
        # waiting their turn in the ordered log. They never come back from S3.
        self._masks = masks
        self.table = table
        self.uid = uid
        self.gid = gid
        self.ttl = ttl
        self._listed: dict[int, float] = {}  # dir inode -> when its listing was taken
        # Entries of a freshly listed (or just made) directory that the kernel forgot since,
        # by name: the listing still answers for them, with the inode it saw.
        self._forgotten: dict[int, dict[str, Inode]] = {}
        table.on_drop = self.dropped
        self._rechecking: dict[int, trio.Event] = {}  # dir inode -> a recheck page in flight
        self._warned: set[str] = set()
        # Names S3 said do not exist, and when: `stat` of a missing checkpoint in a polling
        # loop, or a framework probing for optional files, costs no request while the answer
        # is fresh (and in async mode, a stale one stands while S3 does not answer).
        self._absent: cachetools.LRUCache[tuple[int, str], float] = cachetools.LRUCache(65536)

    def stats(self) -> dict[str, int]:
        return self._asked.stats()

    def _absent_at(self, dir_ino: int, name: str) -> float | None:
        return self._absent.get((dir_ino, name))

    def _known(self, parent: Inode, name: str) -> Inode | None | Stale:
        """What the mount knows of `name`, however old: its inode, None (absent from the
        directory's listing, or S3 said so), or STALE if it never knew."""
        child = self._child(parent, name)
        if child is not None:
            return child
        if parent.ino in self._listed or (parent.ino, name) in self._absent:
            return None
        return STALE

    def masks(self) -> contextlib.AbstractContextManager[Callable[[str], bool]]:
        """Take this before asking S3, and judge its answers through it (masks.py)."""
        return self._masks.view() if self._masks is not None else no_masks()

    def fresh(self, when: float) -> bool:
        return time.monotonic() - when < self.ttl

    def invalidate_listing(self, dir_ino: int) -> None:
        self._listed.pop(dir_ino, None)
        self._forgotten.pop(dir_ino, None)

    def _listed_now(self, dir_ino: int) -> None:
        self._listed[dir_ino] = time.monotonic()
        self._forgotten.pop(dir_ino, None)  # the table holds every name the listing saw

    def made_dir(self, directory: Inode) -> None:
        """The mount just made `directory` where S3 had nothing (its lookup said so): for the
        TTL, as after a listing, a name the table does not know is not in S3 either. A
        checkpoint's files are then created in it without a HEAD and a LIST each."""
        self._listed_now(directory.ino)

    def dropped(self, inode: Inode) -> None:
        """The table let go of a named inode (the kernel forgot it; it held nothing unsaved).
        A fresh listing of its directory vouches only for the names the table holds, so the
        inode is kept aside while its directory's listing is the latest word on it: a lookup
        of its name puts it back, instead of answering ENOENT for a file that exists (or, once
        the listing is stale, a HEAD and a LIST where one LIST page re-checks it)."""
        if inode.is_dir:  # what it vouched for was the table's, and that is gone too
            self.invalidate_listing(inode.ino)
        if inode.parent in self._listed:
            self._forgotten.setdefault(inode.parent, {})[inode.name] = inode

    def _child(self, parent: Inode, name: str) -> Inode | None:
        """The table's child called `name`, or the one the kernel forgot since the listing,
        put back under its name (the same inode and number)."""
        child = self.table.child(parent.ino, name)
        if child is not None:
            return child
        forgotten = self._forgotten.get(parent.ino, {}).pop(name, None)
        return None if forgotten is None else self.table.revive(forgotten)

    def forget_absent(self, dir_ino: int, name: str) -> None:
        """The mount itself just created `name`, or moved something there: what S3 or a
        listing said of the name before is history."""
        self._absent.pop((dir_ino, name), None)
        self._forgotten.get(dir_ino, {}).pop(name, None)

    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("left out of listings: %r (%s)", key, why)

    def apply_object(self, inode: Inode, info: ObjectInfo, with_metadata: bool) -> None:
        apply_object(inode, info, with_metadata, self.uid, self.gid)

    def _apply_dir_meta(self, inode: Inode, md: dict[str, str]) -> None:
        apply_dir_metadata(inode, md, self.uid, self.gid)

    async def reload(self, inode: Inode, key: str | None = None) -> None:
        """HEAD the file's object (at `key`; by default its own name) and take its attributes,
        unless the mount changed the file while S3 answered (a writer opened it, the log put
        a new version): that answer predates the mount's own state (as in `_lookup_in_s3`)."""
        was_local, etag_before = inode.is_local, inode.etag
        info = await self.s3.head(key or self.table.object_key(inode))
        if inode.etag != etag_before or (inode.is_local and not was_local):
            return
        self.apply_object(inode, info, True)

    async def symlink_target(self, inode: Inode) -> bytes:
        if inode.symlink_target is None:
            inode.link_target(await self.s3.get_range(self.table.object_key(inode), 0,
                                                       inode.size))
        return inode.symlink_target

    def _new_file(self, parent: Inode, name: str, info: ObjectInfo, with_metadata: bool) -> Inode:
        md = info.metadata
        kind = kind_of(info) if with_metadata else stat.S_IFREG
        mode = kind | (0o777 if kind == stat.S_IFLNK else 0o644)  # bits follow in apply_object
        inode = self.table.add(parent.ino, name, mode, self.uid, self.gid,
                               rdev=int_or(md.get("rdev"), 0) if kind in SPECIAL_TYPES else 0)
        self.apply_object(inode, info, with_metadata)
        return inode

    def _new_dir(self, parent: Inode, name: str) -> Inode:
        now = time.time_ns()
        inode = self.table.add(parent.ino, name, stat.S_IFDIR | 0o755, self.uid, self.gid,
                               mtime_ns=now, ctime_ns=now, atime_ns=now)
        inode.confirmed()
        return inode

    async def lookup(self, parent: Inode, name: str) -> Inode | None:
        """The child called `name`, asking S3 unless the table's answer is authoritative or fresh."""
        if is_reserved(parent, name):
            return None
        child = self._child(parent, name)
        if child is not None and (child.is_local or self.fresh(child.validated_at)):
            return child
        listed = self._listed.get(parent.ino)
        if listed is not None and self.fresh(listed):
            return child  # the listing answered for every name it saw
        absent = self._absent_at(parent.ino, name)
        if child is None and absent is not None and self.fresh(absent):
            return None
        if self.patience is None:
            return await self._lookup(parent, name)
        known = self._known(parent, name)
        if known is STALE:  # never known: S3 must say
            return await self._lookup(parent, name)
        answer = await self._asked(lambda: self._lookup(parent, name))
        if answer is STALE:
            known = self._known(parent, name)  # (the table may have changed meanwhile)
            return None if known is STALE else known  # type: ignore[return-value]
        return answer  # type: ignore[return-value]

    async def _lookup(self, parent: Inode, name: str) -> Inode | None:
        """Ask S3 about `name` (its own masks view: it may go on after the caller stopped
        waiting for it)."""
        child = self._child(parent, name)
        key = self.table.key_of(parent) + name
        with self.masks() as masked:
            if masked(key) and masked(key + "/"):
                if child is not None:
                    self.table.detach(child)
                return None
            if child is not None and not child.is_local and parent.ino in self._listed:
                # A stale entry of a directory that was listed: `ls -l` stats every entry after
                # its listing, by then past the TTL on a slow server. One LIST page from here
                # re-checks this name and refreshes the next thousand.
                found, current = await self._recheck_by_listing(parent, name, masked)
                if found:
                    return current
            return await self._lookup_in_s3(parent, name, child, key, masked)

    async def _lookup_in_s3(self, parent: Inode, name: str, child: Inode | None, key: str,
                            masked: Callable[[str], bool]) -> Inode | None:
        """HEAD the object and LIST the "name/" prefix at once: a file, a directory, or None."""
        etag_before = child.etag if child is not None else None
        # Masks judge the mount's names (`key`); S3 holds them under `physical` while a
        # directory rename waits in the log (InodeTable.physical).
        physical = self.table.physical(key)
        head, page = await self._head_and_list(physical)
        # The table may have changed while S3 answered: the kernel's FORGET may have dropped
        # `child` (answering with it would hand the kernel an inode number nobody knows), or
        # the mount itself may have created the name, or changed the file: then S3's answer
        # predates the mount's own state and must not overrule it.
        current = self.table.child(parent.ino, name)
        if current is not child:
            child = current
            if child is not None and child.is_local:
                return child
        elif child is not None and (child.is_local or child.etag != etag_before):
            return child
        if (page.objects or page.prefixes) and not masked(key + "/"):
            if child is not None and child.is_dir:
                child.confirmed()
                return child
            inode = self._new_dir(parent, name)
            if page.objects and page.objects[0].key == physical + "/":
                await self._load_dir_meta(inode, physical + "/")
            elif head is not None and is_directory_object(head) and not masked(key):
                inode.marked_by(physical)  # another tool's marker of a directory with children
                self._apply_dir_meta(inode, head.metadata)
            return inode
        info = head
        if info is not None and masked(key):
            info = None
        if info is not None and is_directory_object(info):
            if child is not None and child.is_dir:
                child.confirmed()
                return child
            inode = self._new_dir(parent, name)
            inode.marked_by(physical)
            self._apply_dir_meta(inode, info.metadata)
            return inode
        if info is None:
            if child is not None and masked(key):
                # The mount made this name again and S3 got it while the answer was on its
                # way: the answer predates it.
                return child
            if child is not None:
                self.table.detach(child)
            self._absent[(parent.ino, name)] = time.monotonic()
            return None
        if child is not None and not child.is_dir:
            return self._refresh_file(parent, child, info, with_metadata=True)
        return self._new_file(parent, name, info, with_metadata=True)

    async def _head_and_list(self, key: str) -> tuple[ObjectInfo | None, ListPage]:
        """At once: HEAD `key` (None: no such object) and the first entry under `key/`."""
        head: list[ObjectInfo | None] = [None]
        listing: list[ListPage] = []

        async def do_head() -> None:
            try:
                head[0] = await self.s3.head(key)
            except NoSuchKey:
                pass

        async def do_list() -> None:
            listing.append((await self.s3.list_page(key + "/", None, delimiter="/", max_keys=1))[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_head)
            nursery.start_soon(do_list)
        return head[0], listing[0]

    def _refresh_file(self, parent: Inode, child: Inode, info: ObjectInfo, with_metadata: bool) -> Inode:
        """`child` refreshed from S3; a new inode if the object changed behind the mount's back
        and nothing here holds the old version: with the writeback cache on, the kernel keeps
        its own size of an inode it knows and would go on showing the old one. An inode that
        is open keeps its version until closed: its readers must never get bytes of two
        versions (once the old one is gone from S3, their reads fail instead)."""
        if info.etag != child.etag and child.open_handles > 0:
            child.confirmed()
            return child
        if (child.etag is not None and info.etag != child.etag and child.open_handles == 0
                and child.staged is None and child.lookups > 0):
            return self._new_file(parent, child.name, info, with_metadata)
        self.apply_object(child, info, with_metadata)
        return child

    async def _recheck_by_listing(self, parent: Inode, name: str,
                                  masked: Callable[[str], bool]) -> tuple[bool, Inode | None]:
        """Re-check `name` with one LIST page starting just before it, refreshing the known
        entries the page covers. (True, inode or None if gone) if the page told; (False, None)
        if it could not (a name that changed kind, or more keys before it than a page holds)."""
        pending = self._rechecking.get(parent.ino)
        if pending is not None:  # another lookup's page may cover this name: wait for it
            await pending.wait()
            child = self._child(parent, name)
            if child is not None and (child.is_local or self.fresh(child.validated_at)):
                return True, child
        done = trio.Event()
        self._rechecking[parent.ino] = done
        before = self._child(parent, name)
        etag_before = before.etag if before is not None else None
        dir_key = self.table.key_of(parent)
        key = dir_key + name
        physical = self.table.physical(dir_key)  # where S3 holds the directory now
        try:
            page, more = await self.s3.list_page(physical, None, delimiter="/",
                                                 start_after=(physical + name)[:-1])
        finally:
            if self._rechecking.get(parent.ino) is done:
                del self._rechecking[parent.ino]
            done.set()
        now = time.monotonic()
        seen, last = page_entries(page, physical, dir_key, masked)  # (None: a directory)
        forgotten = self._forgotten.get(parent.ino, {})
        for other, info in seen.items():
            known = self.table.child(parent.ino, other) or forgotten.get(other)
            if known is None or known.is_local or other == name or known.is_dir != (info is None):
                continue
            if info is None:
                known.confirmed(now)
            elif info.etag == known.etag:  # changed ones get a new inode on their own lookup
                self.apply_object(known, info, with_metadata=False)
        child = self._child(parent, name)  # (dropped by a FORGET meanwhile is not gone)
        if child is None and before is not None and not before.unlinked:
            child = self.table.revive(before)
        if child is None and name in seen:  # (not known here: the full lookup makes its inode)
            return False, None
        if child is None or child.is_local or (child is before and child.etag != etag_before):
            return True, child  # (the mount changed it while S3 answered: the answer predates)
        if name in seen:
            info = seen[name]
            if child.is_dir != (info is None):
                return False, None  # changed kind: the full lookup sorts it out
            if info is None:
                child.confirmed(now)
                return True, child
            if info.etag != child.etag and (child.is_special or child.is_symlink
                                            or info.size <= SYMLINK_MAX):
                return False, None  # its kind is in its metadata: the full lookup HEADs it
            return True, self._refresh_file(parent, child, info, with_metadata=False)
        covered = more is None or sort_key(physical + name + "/") <= last
        if not covered or masked(key):
            return False, None
        self.table.detach(child)  # gone from S3
        self._absent[(parent.ino, name)] = time.monotonic()
        return True, None

    async def _load_dir_meta(self, inode: Inode, marker: str) -> None:
        try:
            info = await self.s3.head(marker)
        except NoSuchKey:
            return
        self._apply_dir_meta(inode, info.metadata)

    async def list_dir(self, directory: Inode) -> list[Inode]:
        """Every entry of `directory`: S3's listing merged with the mount's local changes (in
        async mode, while S3 does not answer, the mount's last listing and changes since)."""
        async def listing() -> list[Inode]:
            with self.masks() as masked:
                return await self._list_dir(directory, masked)
        if self.patience is None or directory.ino not in self._listed:
            return await listing()
        answer = await self._asked(listing)
        return self._known_entries(directory) if answer is STALE else answer  # type: ignore[return-value]

    def _known_entries(self, directory: Inode) -> list[Inode]:
        """The directory's entries as the mount knows them: the table's, and the ones the
        kernel forgot since its listing, put back."""
        forgotten = self._forgotten.get(directory.ino, {})
        for name in list(forgotten):
            inode = forgotten.pop(name)
            if self.table.child(directory.ino, name) is None:
                self.table.revive(inode)
        return sorted(self.table.children(directory.ino), key=lambda i: i.name)

    async def is_empty(self, directory: Inode, ask: Callable[[], Awaitable[bool]]) -> bool:
        """`ask()`, whether S3 holds nothing under the directory (tree.py); in async mode, while
        S3 does not answer, whether the mount's last listing and changes since leave nothing."""
        if self.patience is None or directory.ino not in self._listed:
            return await ask()
        answer = await self._asked(ask)
        if answer is STALE:
            return not self._known_entries(directory)
        return answer  # type: ignore[return-value]

    async def revalidate(self, inode: Inode) -> None:
        """`reload` for a stat past the TTL; in async mode, while S3 does not answer, the
        attributes the mount has stand."""
        await self._asked(lambda: self.reload(inode))

    async def learn(self, ino: int) -> None:
        """List the directory `ino` now (async mode, the root at mount time): its names are
        then known through an outage. A failure only leaves them unknown."""
        directory = self.table.get(ino)
        assert directory is not None
        try:
            await self.list_dir(directory)
            # Known, but not fresh: a lookup of a name it did not show asks S3 as before.
            self._listed[ino] = time.monotonic() - self.ttl - 1.0
        except S3Error as exc:
            log.warning("could not list %s: %s", self.table.path_of(directory) or "the root", exc)

    async def _list_dir(self, directory: Inode, masked: Callable[[str], bool]) -> list[Inode]:
        while True:
            dir_key = self.table.key_of(directory)
            physical = self.table.physical(dir_key)  # where S3 holds the directory now
            # An entry the mount made, changed or confirmed after this moment is newer than
            # anything the listing says (a close-mode close put it in S3 while the LIST was out).
            asked = time.monotonic()
            listed = await read_listing(self.s3, self.table, directory, dir_key, physical, masked,
                                        lambda name: is_reserved(directory, name), self._warn_once)
            key = self.table.key_of(directory)
            if (key, self.table.physical(key)) == (dir_key, physical):
                break
            # Renamed while it was listed, or S3 moved its objects meanwhile (an async
            # directory rename applied): the listing is of a place S3 no longer uses for it.
        return self._merge_listing(directory, dir_key, asked, masked, listed)

    def _moving(self, directory: Inode) -> bool:
        """The directory, or one above it, has changes S3 has not applied (async mode: a
        directory rename moves its objects in the log's turn). A LIST may then land between
        the move in S3 and the table learning of it, and say nothing of what moved: what it
        lacks is not gone from S3."""
        node = directory
        while True:
            if node.pending > 0:
                return True
            if node.ino == ROOT_INODE:
                return False
            parent = self.table.get(node.parent)
            if parent is None:
                return False
            node = parent

    def _merge_listing(self, directory: Inode, dir_key: str, asked: float,
                       masked: Callable[[str], bool], listed: Listing) -> list[Inode]:
        """The listing against the table: new entries made, stale ones refreshed or dropped."""
        dirs, files, markers, headed = listed.dirs, listed.files, listed.markers, listed.headed
        entries: list[Inode] = []
        seen: set[str] = set()
        for name in sorted(dirs | set(files)):
            child = self.table.child(directory.ino, name)
            if name in dirs and name in files:
                self._warn_once(dir_key + name, "both a file and a directory; showing the directory")
            if child is not None and (child.is_local or child.validated_at >= asked):
                pass
            elif name in dirs:
                if child is None or not child.is_dir:
                    child = self._new_dir(directory, name)
                    child.marked_by(markers.get(name))
                    if name in headed:
                        self._apply_dir_meta(child, headed[name].metadata)
                child.confirmed()
            else:
                info = headed.get(name, files[name])
                if child is None or child.is_dir or (name in headed and kind_changed(child, info)):
                    child = self._new_file(directory, name, info, with_metadata=name in headed)
                else:
                    child = self._refresh_file(directory, child, info, with_metadata=name in headed)
            entries.append(child)
            seen.add(name)
        moving = self._moving(directory)
        for child in self.table.children(directory.ino):
            if child.name in seen:
                continue
            if (child.is_local or child.validated_at >= asked or moving
                    or masked(self.table.key_of(child))):
                entries.append(child)  # or made again, and applied after the listing was taken
            else:
                self.table.detach(child)  # gone from S3
        self._listed_now(directory.ino)
        entries.sort(key=lambda i: i.name)
        return entries


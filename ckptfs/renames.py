"""Renames in S3, all-or-nothing through any crash: an intent object first, then the copies.

S3 has no rename: an object is copied to its new key and the old one deleted, one object
at a time. A crash in between left a file under both names, or a destination directory
that lacks files beside a whole source (issue 32: 15-20 of 24 files; Orbax and tmp-dir
trainers commit a checkpoint by exactly that rename). Every rename in S3 now goes:

1. PUT an intent, `<prefix>.ckptfs/renames/<time>-<id>.json`: the source and destination
   (a key, or a directory's "dir/" prefix) and the keys under the source with their ETags;
2. the copies (a directory's objects in parallel, and its marker);
3. the deletes of the sources, once every copy has returned;
4. DELETE the intent.

A crash before 1 leaves the source whole and no destination. From 1 on, S3 itself says
that the rename happened: every mount of the prefix completes it before it reports ready
(`Renames.complete_interrupted`, from recovery): it copies whatever is still under the
source and deletes it, then deletes the intent. That is safe to repeat, and right for a
crash at any point: a source object keeps its bytes until step 3, a copy replaces its
destination whole (S3 never shows half an object), and a source is deleted only after
every copy returned, so a source that is gone has its copy in place. A crash while
completing is completed by the next mount. Cost: two small requests per rename.

The intents live under the reserved name `.ckptfs` at the top of the prefix, which
listings never show and the mount refuses to make (namespace.is_reserved).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

import trio

from ckptfs.bucket import Bucket
from ckptfs.cache import ObjectCache
from ckptfs.errors import CkptfsError, NoSuchKey, raise_first_error
from ckptfs.inodes import Inode, InodeTable
from ckptfs.metadata import object_metadata
from ckptfs.namespace import RESERVED_NAME
from ckptfs.s3types import ObjectInfo
from ckptfs.uploads import UploadRecords

log = logging.getLogger(__name__)

INTENTS = RESERVED_NAME + "/renames/"
COPIES_AT_ONCE = 32


class Renames:
    """Moves objects in S3 under an intent (module docstring); completes interrupted ones."""

    def __init__(self, s3: Bucket, prefix: str) -> None:
        self.s3 = s3
        self.prefix = prefix

    async def _begin(self, src: str, dst: str, objects: list[ObjectInfo],
                     metadata: dict[str, str] | None, deadline: float | None,
                     also_delete: tuple[str, ...] = ()) -> str:
        key = f"{self.prefix}{INTENTS}{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"
        body = {"v": 1, "src": src, "dst": dst, "metadata": metadata,
                "keys": [[o.key[len(src):], o.etag] for o in objects],
                "also_delete": list(also_delete)}
        await self.s3.put(key, json.dumps(body).encode(), {}, deadline)
        return key

    async def move_object(self, src: str, dst: str, size: int, etag: str | None,
                          deadline: float | None = None) -> str:
        """Copy `src` to `dst` and delete `src`, under an intent; the copy's ETag."""
        intent = await self._begin(src, dst, [ObjectInfo(src, size, etag or "", 0.0)], None, deadline)
        new_etag = await self.s3.copy(src, dst, size, deadline=deadline, etag=etag)
        await self.s3.delete(src, deadline)
        await self.s3.delete(intent, deadline)
        return new_etag

    async def move_dir(self, src: str, dst: str, metadata: dict[str, str],
                       also_delete: tuple[str, ...] = (), replaced: tuple[str, ...] = (),
                       copied: Callable[[dict[str, str]], None] | None = None
                       ) -> dict[str, str]:
        """Every object under the "dir/" prefix `src` moved under `dst`, under an intent;
        {key relative to the directory: new ETag}. `metadata`: the new marker's, if the
        source has none (an implicit directory). `also_delete`: another tool's marker object
        of the source (listing.is_directory_object), deleted with the sources. `replaced`:
        the marker objects of the empty directory the rename replaces, deleted first (stores
        with real folders delete a folder recursively: never after the copies). `copied`:
        told the new ETags once every copy is made, before a source is deleted: from then on
        the destination is whole, and the sources go."""
        objects = await self.s3.list_keys(src)
        if not objects:
            # Nothing under the source: the move was made before (the log replays an entry
            # whose record a crash left behind) or the directory never reached S3. Nothing
            # of the destination may be deleted now: a store with real folders deletes a
            # folder's contents with its marker. It only gets its marker if it has none.
            try:
                await self.s3.head(dst)
            except NoSuchKey:
                await self.s3.put(dst, b"", metadata)
            return {}
        intent = await self._begin(src, dst, objects, metadata, None, also_delete)
        for key in replaced:
            await self.s3.delete(key)
        try:
            with raise_first_error():  # the copies' nursery: its first failure
                etags = await self._copy_all(src, dst, objects, metadata)
        except CkptfsError:
            await self._undo(intent, src, dst, objects)
            raise
        if copied is not None:
            copied(etags)
        await self._delete_all(src, [o.key for o in objects], also_delete)
        await self.s3.delete(intent)
        return etags

    async def _undo(self, intent: str, src: str, dst: str, objects: list[ObjectInfo]) -> None:
        """A copy failed (S3 refused it past every retry; the call fails with EIO): the
        rename never happened, for this mount and the next. If S3 refuses this too, the
        intent stays and the next mount completes the rename instead: either is whole."""
        try:
            await self.s3.delete_many([dst + o.key[len(src):] for o in objects] + [dst])
            await self.s3.delete(intent)
        except CkptfsError as exc:
            log.warning("could not undo the failed rename of %s to %s (%s); the next mount "
                        "completes it", src, dst, exc)

    async def _copy_all(self, src: str, dst: str, objects: list[ObjectInfo],
                        metadata: dict[str, str] | None) -> dict[str, str]:
        etags: dict[str, str] = {}
        limit = trio.CapacityLimiter(COPIES_AT_ONCE)

        async def copy_one(obj: ObjectInfo) -> None:
            rest = obj.key[len(src):]
            async with limit:
                if obj.key.endswith("/"):  # a directory marker: some stores cannot copy those
                    info = await self.s3.head(obj.key)
                    await self.s3.put(dst + rest, b"", info.metadata)
                else:
                    etags[rest] = await self.s3.copy(obj.key, dst + rest, obj.size, etag=obj.etag)

        async with trio.open_nursery() as nursery:
            for obj in objects:
                nursery.start_soon(copy_one, obj)
        if metadata is not None and src not in {o.key for o in objects}:
            await self.s3.put(dst, b"", metadata)  # keep even an empty implicit directory
        return etags

    async def _delete_all(self, src: str, keys: list[str], also_delete: tuple[str, ...] = ()) -> None:
        await self.s3.delete_many(keys + list(also_delete))
        # Stores with real folders (SeaweedFS) keep emptied folders; delete them deepest first.
        folders = {src}
        for key in keys:
            parts = key[len(src):].split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folders.add(src + "/".join(parts[:depth]) + "/")
        for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):
            try:
                await self.s3.delete(folder)
            except CkptfsError:
                pass

    async def complete_interrupted(self) -> list[tuple[str, str]]:
        """Complete every rename whose intent is in S3 (a crash interrupted it), oldest
        first; (source, destination) of each. Raises S3Error if S3 fails: the mount must not
        go live showing half of a rename."""
        done: list[tuple[str, str]] = []
        intents = sorted((o for o in await self.s3.list_keys(self.prefix + INTENTS)
                          if o.key.endswith(".json")), key=lambda o: o.key)
        for obj in intents:
            try:
                intent = json.loads(await self.s3.get_range(obj.key, 0, obj.size))
                src, dst, metadata = intent["src"], intent["dst"], intent.get("metadata")
                also_delete = tuple(intent.get("also_delete") or ())
                recorded = [src + rest for rest, _ in intent.get("keys") or ()]
            except (ValueError, KeyError, TypeError) as exc:
                log.error("rename intent %s cannot be read (%s); left in place", obj.key, exc)
                continue
            except NoSuchKey:
                continue  # another mount completed it meanwhile
            if src.endswith("/"):
                objects = await self.s3.list_keys(src)
                if objects:
                    with raise_first_error():
                        await self._copy_all(src, dst, objects, metadata)
                # What was listed when the rename began names the folders a store with real
                # folders may still keep after the objects in them were deleted.
                await self._delete_all(src, sorted({o.key for o in objects} | set(recorded)),
                                       also_delete)
            else:
                try:
                    info = await self.s3.head(src)
                    await self.s3.copy(src, dst, info.size, etag=info.etag)
                except NoSuchKey:
                    pass  # deleted after its copy
                await self.s3.delete(src)
            await self.s3.delete(obj.key)
            log.warning("completed the rename of %s to %s that a crash interrupted", src, dst)
            done.append((src, dst))
        return done


# ----- a rename made in S3 at once (close mode) --------------------------------------------

async def rename_in_s3(renames: Renames, table: InodeTable, cache: ObjectCache,
                       records: UploadRecords, src: Inode, new_parent: Inode, new_name: str,
                       dst: Inode | None, move: Callable[[], None]) -> None:
    """`src` (a file, or a directory with everything under it) takes `new_name` in S3, then
    in the table (`move`). The upload locks of every file under a directory are held
    throughout: an upload finishing meanwhile would land under the old name after the
    copies."""
    new_key = table.key_of(new_parent) + new_name
    async with locked(files_under(table, src)):
        if src.is_dir:
            also = (src.marker_key,) if src.marker_key is not None else ()
            replaced = () if dst is None else tuple(
                k for k in (table.key_of(dst), dst.marker_key) if k is not None)
            etags = await renames.move_dir(table.key_of(src), new_key + "/", object_metadata(src),
                                           also, replaced)
            src.marked_by(None)  # it has a "dir/" marker of its own now
            _refresh_etags(table, src, "", etags)
        else:
            await _rename_object(renames, table, cache, src, new_key, dst)
        if dst is not None:
            await records.forget(dst.upload)
        move()
        await _rejournal(table, records, src)


def files_under(table: InodeTable, node: Inode) -> list[Inode]:
    """`node` if a file; every file the table knows under it if a directory."""
    if not node.is_dir:
        return [node]
    out: list[Inode] = []
    for child in table.children(node.ino):
        out.extend(files_under(table, child))
    return out


class locked:
    """Hold the upload locks of `nodes`, taken in inode order (no two renames deadlock)."""

    def __init__(self, nodes: list[Inode]) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.ino)
        self.held: list[Inode] = []

    async def __aenter__(self) -> None:
        try:
            for node in self.nodes:
                await node.upload_lock.acquire()
                self.held.append(node)
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        for node in reversed(self.held):
            node.upload_lock.release()
        self.held.clear()


async def _rejournal(table: InodeTable, records: UploadRecords, node: Inode) -> None:
    """Closed files not yet in S3 under a renamed name: their records must name the new key."""
    if node.is_dir:
        for child in table.children(node.ino):
            await _rejournal(table, records, child)
        return
    rec = node.upload.record
    if rec is not None and rec.closed:
        await records.closed(node.upload, table.key_of(node), node.size,
                                      object_metadata(node), rec.fsynced)


async def _rename_object(renames: Renames, table: InodeTable, cache: ObjectCache, src: Inode,
                         new_key: str, dst: Inode | None) -> None:
    """The caller holds src's upload lock."""
    old_key = table.key_of(src)
    if src.etag is not None:
        old_etag = src.etag
        src.moved(await renames.move_object(old_key, new_key, src.size, old_etag))
        if not src.is_local:  # (a version of the name a handle still reads stays, for it)
            reading = dst.etag if dst is not None and dst.open_handles > 0 else None
            cache.rekey(old_key, old_etag, new_key, src.etag, keep=reading)
    elif dst is not None and dst.etag is not None:
        # The new name must not keep showing the replaced object until src's upload.
        await renames.s3.delete(new_key)


def _refresh_etags(table: InodeTable, directory: Inode, rel: str, etags: dict[str, str]) -> None:
    for child in table.children(directory.ino):
        path = rel + child.name
        if child.is_dir:
            _refresh_etags(table, child, path + "/", etags)
        elif path in etags and child.etag is not None:
            child.stored(etags[path])

"""Name mapping rules, against a fake S3 listing (keys SeaweedFS itself refuses to store)."""

from __future__ import annotations

import logging
import stat

import trio
import trio.testing

from ckptfs.errors import NoSuchKey
from ckptfs.inodes import ROOT_INODE, InodeTable
from ckptfs.masks import Masks
from ckptfs.listing import SMALL_HEADS, SYMLINK_MAX, valid_name
from ckptfs.namespace import Namespace
from ckptfs.s3types import ListPage, ObjectInfo, is_marked
from fakes3 import MemoryS3


class FakeListing:
    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(keys)
        self.list_calls = 0

    async def list_pages(self, prefix: str, delimiter: str = "/"):
        self.list_calls += 1
        prefixes, objects = [], []
        for key in self.keys:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if "/" in rest:
                p = prefix + rest.split("/", 1)[0] + "/"
                if p not in prefixes:
                    prefixes.append(p)
            else:
                objects.append(ObjectInfo(key, 1 << 20, '"e"', 0.0))  # too large to HEAD
        yield ListPage(prefixes, objects)


def test_valid_names() -> None:
    assert valid_name("model.pt")
    assert not valid_name("") and not valid_name(".") and not valid_name("..")
    assert not valid_name("a/b")
    assert valid_name("n" * 255) and not valid_name("n" * 256)
    assert not valid_name("é" * 128)  # 256 bytes in UTF-8


async def test_listing_leaves_out_keys_that_cannot_be_paths(caplog) -> None:
    keys = ["p/ok.txt", "p/a//b", "p/./dot", "p/../up", "p/" + "n" * 256, "p/d/", "p/d/fine",
            "p/both", "p/both/inner"]
    fake = FakeListing(keys)
    table = InodeTable("p/", 0, 0)
    ns = Namespace(fake, table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        entries = await ns.list_dir(table[ROOT_INODE])
        again = await ns.list_dir(table[ROOT_INODE])
    assert [(e.name, e.is_dir) for e in entries] == [("a", True), ("both", True), ("d", True),
                                                      ("ok.txt", False)]
    assert [e.ino for e in again] == [e.ino for e in entries]
    a = table.child(ROOT_INODE, "a")
    assert [e.name for e in await ns.list_dir(a)] == []  # 'p/a//b' has an empty component
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    # './', '../', the long name, the file shadowed by 'both/', and 'a//' (an empty name in 'a')
    assert len(warnings) == 5
    assert all(w.count("left out") == 1 for w in warnings)


class SlowHead:
    """HEAD and LIST that wait for the test: a lookup in flight while the kernel forgets."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.release = trio.Event()
        self.heads = 0

    async def head(self, key: str, checksum: bool = False) -> ObjectInfo:
        self.heads += 1
        await self.release.wait()
        if key != self.key:
            raise NoSuchKey(key)
        return ObjectInfo(key, 5, '"e2"', 0.0)

    async def list_page(self, prefix: str, token, delimiter: str = "/", max_keys: int = 1000):
        await self.release.wait()
        return ListPage([], []), None


async def test_a_lookup_in_flight_when_the_kernel_forgets_the_inode_returns_a_live_one() -> None:
    # Seen as ENOENT from open() right after drop_caches: the kernel's FORGET of a clean
    # file arrived while its LOOKUP waited for HEAD, and the lookup answered with the inode
    # the FORGET had just dropped from the table.
    fake = SlowHead("p/model.pt")
    table = InodeTable("p/", 0, 0)
    ns = Namespace(fake, table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    old = ns._new_file(root, "model.pt", ObjectInfo("p/model.pt", 5, '"e1"', 0.0), with_metadata=False)
    old.validated_at = -1e9  # stale: the next lookup asks S3
    old.lookups = 1
    found: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _append(found, ns.lookup(root, "model.pt")))
        await trio.testing.wait_all_tasks_blocked()
        table.forget(old.ino, 1)  # the kernel's FORGET, processed meanwhile
        fake.release.set()
    (inode,) = found
    assert inode is not None and table.get(inode.ino) is inode
    assert table.child(ROOT_INODE, "model.pt") is inode and inode.etag == '"e2"'


async def _append(out: list, coro) -> None:
    out.append(await coro)


async def test_a_listed_entry_the_kernel_forgot_meanwhile_is_put_back_not_lost() -> None:
    # READDIR keeps its entries between calls; a FORGET processed in between drops a clean
    # entry from the table, and the next READDIR must not answer with an unknown inode.
    table = InodeTable("p/", 0, 0)
    ns = Namespace(FakeListing(["p/a.pt", "p/b.pt"]), table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    entries = await ns.list_dir(table[ROOT_INODE])
    a, b = entries
    a.lookups = b.lookups = 1
    table.forget(a.ino, 1)
    assert table.get(a.ino) is None  # dropped: clean, unreferenced
    assert table.revive(a) is a and table.get(a.ino) is a and table.child(ROOT_INODE, "a.pt") is a
    table.forget(b.ino, 1)
    newer = table.add(ROOT_INODE, "b.pt", b.mode, 0, 0)  # the name was looked up again meanwhile
    assert table.revive(b) is newer
    table.detach(a)
    assert table.revive(a) is None  # unlinked: left out of the listing


async def test_a_special_file_whose_etag_changed_keeps_its_kind_on_a_listing_recheck() -> None:
    # The async chmod of a fifo (a copy onto itself) gave it a new ETag; a lookup after the
    # TTL rechecked it with a LIST page, and a LIST entry has no metadata: the fifo came
    # back as a plain 0644 file (seen once in CI). Its kind needs the HEAD of a full lookup.
    s3 = MemoryS3()
    await s3.put("p/fifo", b"", {"mode": str(stat.S_IFIFO | 0o640)})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=0.05)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    node = await ns.lookup(root, "fifo")
    assert node is not None and node.is_special
    node.lookups += 1  # the kernel holds it
    await ns.list_dir(root)  # the parent was listed: a stale lookup rechecks by listing
    await s3.copy("p/fifo", "p/fifo", 0, {"mode": str(stat.S_IFIFO | 0o600)})
    s3.etags["p/fifo"] = "a-new-etag"  # a server may give the copy an ETag of its own
    await trio.sleep(0.1)
    node = await ns.lookup(root, "fifo")
    assert node is not None and stat.S_ISFIFO(node.mode) and stat.S_IMODE(node.mode) == 0o600


class LateAnswers(MemoryS3):
    """HEADs and LISTs whose answers are taken at once and delivered when the test says:
    an answer still on its way while a change lands in S3."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = trio.Event()
        self.deliver = trio.Event()

    async def head(self, key, checksum=False, deadline=None):
        try:
            return await super().head(key, checksum, deadline)
        finally:
            self.asked.set()
            await self.deliver.wait()

    async def list_page(self, prefix, token, delimiter="/", max_keys=1000, start_after=None):
        answer = await super().list_page(prefix, token, delimiter, max_keys, start_after)
        self.asked.set()
        await self.deliver.wait()
        return answer


async def _delete_lands_while_s3_answers(s3: LateAnswers, masks: Masks, ask) -> object:
    """Mask p/gone (a delete waiting in the log), ask S3, then apply the delete while the
    answer, taken before it, is on its way."""
    masks.add("p/gone", seq=1)
    result: list[object] = []
    async with trio.open_nursery() as nursery:
        async def run() -> None:
            result.append(await ask())
        nursery.start_soon(run)
        await s3.asked.wait()
        del s3.objects["p/gone"]  # the delete reaches S3 ...
        masks.release(1)  # ... and its entry is retired
        s3.deliver.set()
    return result[0]


async def test_a_lookup_answered_before_a_delete_landed_never_brings_the_name_back() -> None:
    s3 = LateAnswers()
    await s3.put("p/gone", b"x", {})
    table = InodeTable("p/", 0, 0)
    masks = Masks()
    ns = Namespace(s3, table, 0, 0, ttl=0.0, masks=masks)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    assert await _delete_lands_while_s3_answers(s3, masks, lambda: ns.lookup(root, "gone")) is None
    assert table.child(ROOT_INODE, "gone") is None


async def test_a_listing_taken_before_a_delete_landed_never_shows_the_name() -> None:
    s3 = LateAnswers()
    await s3.put("p/gone", b"x", {})
    await s3.put("p/kept", b"y", {})
    table = InodeTable("p/", 0, 0)
    masks = Masks()
    ns = Namespace(s3, table, 0, 0, ttl=0.0, masks=masks)  # type: ignore[arg-type]
    entries = await _delete_lands_while_s3_answers(s3, masks, lambda: ns.list_dir(table[ROOT_INODE]))
    assert [e.name for e in entries] == ["kept"]  # type: ignore[attr-defined]


async def test_a_listing_never_heads_an_empty_object_the_mount_itself_owns() -> None:
    s3 = MemoryS3()
    await s3.put("p/mine", b"", {})
    await s3.put("p/theirs", b"", {"mode": str(stat.S_IFIFO | 0o600)})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    mine = table.add(ROOT_INODE, "mine", stat.S_IFREG | 0o644, 0, 0)
    mine.changed()  # written here, its upload still to come: the mount's state wins
    entries = {e.name: e for e in await ns.list_dir(table[ROOT_INODE])}
    assert entries["mine"] is mine and stat.S_ISFIFO(entries["theirs"].mode)
    assert [k for op, k in s3.requests if op == "HEAD"] == ["p/theirs"]


async def test_a_listing_shows_a_symlink_written_elsewhere_as_a_symlink() -> None:
    s3 = MemoryS3()
    await s3.put("p/latest", b"step_1000", {"mode": str(stat.S_IFLNK | 0o777)})
    await s3.put("p/model.pt", b"w" * 5000, {"mode": str(stat.S_IFREG | 0o600)})
    await s3.put("p/tiny.json", b"{}", {"mode": str(stat.S_IFREG | 0o640)})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    entries = {e.name: e for e in await ns.list_dir(table[ROOT_INODE])}
    assert entries["latest"].is_symlink and await ns.symlink_target(entries["latest"]) == b"step_1000"
    assert stat.S_ISREG(entries["tiny.json"].mode) and stat.S_IMODE(entries["tiny.json"].mode) == 0o640
    assert stat.S_ISREG(entries["model.pt"].mode)
    assert sorted(k for op, k in s3.requests if op == "HEAD") == ["p/latest", "p/tiny.json"]
    await ns.list_dir(table[ROOT_INODE])
    assert len([k for op, k in s3.requests if op == "HEAD"]) == 2  # known now: no HEAD again


async def test_a_listing_of_many_tiny_files_heads_only_the_marked_ones() -> None:
    """Among more than SMALL_HEADS tiny files, a listing HEADs only the objects ckptfs wrote
    marked (symlinks and special files, s3types.is_marked): the symlink shows as a symlink
    at once, and empty plain files (touch) cost no HEAD. Before: the symlink showed as a
    file, and every empty object was HEADed."""
    s3 = MemoryS3()
    for i in range(SMALL_HEADS + 1):
        await s3.put(f"p/s{i:03d}", b"x", {})
    await s3.put("p/touched", b"", {})
    await s3.put("p/fifo", b"", {"mode": str(stat.S_IFIFO | 0o600)})
    await s3.put("p/latest", b"step_1000", {"mode": str(stat.S_IFLNK | 0o777)})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=1.0)  # type: ignore[arg-type]
    entries = {e.name: e for e in await ns.list_dir(table[ROOT_INODE])}
    assert len(entries) == SMALL_HEADS + 4
    assert sorted(k for op, k in s3.requests if op == "HEAD") == ["p/fifo", "p/latest"]
    assert entries["latest"].is_symlink and stat.S_ISFIFO(entries["fifo"].mode)
    assert stat.S_ISREG(entries["touched"].mode) and stat.S_ISREG(entries["s000"].mode)


async def test_a_renamed_symlink_stays_marked() -> None:
    """A rename copies the object: a plain CopyObject would make its ETag plain, and the
    next listing of a big directory would take the symlink for a file."""
    s3 = MemoryS3()
    etag = await s3.put("p/a", b"target", {"mode": str(stat.S_IFLNK | 0o777)})
    assert is_marked(etag, 6)
    assert is_marked(await s3.copy("p/a", "p/b", 6, etag=etag), 6)
    assert not is_marked(await s3.copy("p/b", "p/c", 6), 6)  # what happened before


async def _forgotten_by_the_kernel(table: InodeTable, inode) -> None:
    """The kernel looked `inode` up once and has now forgotten it (drop_caches, memory
    pressure): a clean inode leaves the table."""
    inode.lookups += 1
    table.forget(inode.ino, 1)
    assert table.get(inode.ino) is None


async def test_a_listed_name_the_kernel_forgot_is_still_found_without_a_request() -> None:
    # Issue 34: `ls`, drop_caches, `stat` of a listed file answered ENOENT for up to the
    # TTL: the fresh listing answered for the name, and the table had dropped it.
    s3 = MemoryS3()
    await s3.put("p/model.pt", b"12345", {})
    await s3.put("p/step/shard.pt", b"123", {})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=60.0)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    listed = {i.name: i for i in await ns.list_dir(root)}
    step = listed["step"]
    (shard,) = await ns.list_dir(step)
    step.lookups += 1  # the kernel holds the directory (its child is in it)
    await _forgotten_by_the_kernel(table, listed["model.pt"])
    await _forgotten_by_the_kernel(table, shard)
    before = len(s3.requests)
    found = await ns.lookup(root, "model.pt")
    assert found is listed["model.pt"] and table.get(found.ino) is found and found.size == 5
    again = await ns.lookup(step, "shard.pt")
    assert again is shard and table.child(step.ino, "shard.pt") is shard
    assert await ns.lookup(root, "absent") is None
    assert s3.requests[before:] == []  # the listing answered: no HEAD, no LIST


async def test_a_forgotten_name_the_mount_made_again_and_removed_stays_removed() -> None:
    s3 = MemoryS3()
    await s3.put("p/a", b"old", {})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=60.0)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    (old,) = await ns.list_dir(root)
    await _forgotten_by_the_kernel(table, old)
    ns.forget_absent(ROOT_INODE, "a")  # the mount creates the name anew (files.create) ...
    new = table.add(ROOT_INODE, "a", old.mode, 0, 0)
    table.detach(new)  # ... and unlinks it
    assert await ns.lookup(root, "a") is None


async def test_a_file_made_in_a_new_directory_is_found_after_the_kernel_forgot_both() -> None:
    # A directory the mount just made counts as listed (made_dir): the same hole.
    s3 = MemoryS3()
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=60.0)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    assert await ns.lookup(root, "step") is None
    step = table.add(ROOT_INODE, "step", stat.S_IFDIR | 0o755, 0, 0)
    ns.made_dir(step)
    assert await ns.lookup(step, "model.pt") is None
    etag = await s3.put("p/step/model.pt", b"x" * 7, {})  # written and closed (close mode)
    model = table.add(step.ino, "model.pt", stat.S_IFREG | 0o644, 0, 0, etag=etag, size=7)
    await _forgotten_by_the_kernel(table, model)
    found = await ns.lookup(step, "model.pt")
    assert found is model and found.size == 7


async def test_a_forgotten_name_of_a_stale_listing_is_rechecked_with_one_list_page() -> None:
    # `ls -l` under memory pressure: the kernel forgets entries between the listing and the
    # stats, which come after the TTL. A name it forgot costs one LIST page (and refreshes
    # the names after it), as a stale one the table kept does, not a HEAD and a LIST each.
    s3 = MemoryS3()
    for i in range(5):
        await s3.put(f"p/f{i}", b"x" * (SYMLINK_MAX + 1), {})
    table = InodeTable("p/", 0, 0)
    ns = Namespace(s3, table, 0, 0, ttl=0.05)  # type: ignore[arg-type]
    root = table[ROOT_INODE]
    listed = await ns.list_dir(root)
    for inode in listed:
        await _forgotten_by_the_kernel(table, inode)
    await trio.sleep(0.1)
    before = len(s3.requests)
    for i in range(5):
        assert await ns.lookup(root, f"f{i}") is listed[i]
    assert [op for op, _ in s3.requests[before:]] == ["LIST"]

"""One contract for every implementation of ckptfs's S3 seam (s3.S3Client and the fake).

The tests call what the components call: bucket.Bucket (retries and helpers) over an
implementation of the primitives. The same tests run against the in-process fake the unit
tests use (tests/fakes3.MemoryS3: a MemoryStore behind the fault wrapper), against the real
client on SeaweedFS (the session's server: the mount tier's S3) and on
moto's S3 server (a second, independent implementation that follows AWS's rules). A
behaviour ckptfs relies on and one of them lacks fails here, not somewhere in a mount.

Where a server is known to differ from AWS, the test says so for that server by name
(`Store.name`), and asserts what it does instead: moto 5.2 keeps no CRC32 of a PutObject
and does not check a part's CRC32 (ckptfs then verifies the size only, as uploader.py's
`_verify` does where a server keeps no checksum).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import trio

from ckptfs.bucket import Bucket
from ckptfs.checksum import b64_crc32, crc32, crc32_of_parts
from ckptfs.errors import NoSuchKey, S3Error
from ckptfs.retry import RetryPolicy
from ckptfs.s3 import S3Client, make_boto_client
from ckptfs.s3types import S3, is_marked
from devtools.devserver import ACCESS_KEY, SECRET_KEY, DevServer, free_ports
from fakes3 import Faults, MemoryS3, MemoryStore

MiB = 1 << 20
MOTO_BUCKET = "ckptfs-contract"


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server in this process, on a free loopback port, with one bucket."""
    from moto.server import ThreadedMotoServer

    port = free_ports(1)[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto = make_boto_client(endpoint, "us-east-1", None, pool=2)
        boto.create_bucket(Bucket=MOTO_BUCKET)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


class Store(NamedTuple):
    s3: Any  # a bucket.Bucket over an implementation of s3types.S3
    prefix: str  # the test's own
    name: str  # "memory", "seaweedfs" or "moto"


# The fake runs in the fast tier; the two servers in the component tier.
@pytest.fixture(params=["memory", pytest.param("seaweedfs", marks=pytest.mark.component),
                        pytest.param("moto", marks=pytest.mark.component)])
def store(request: pytest.FixtureRequest, credentials: None) -> Store:
    prefix = f"contract-{uuid.uuid4().hex[:8]}/"
    if request.param == "memory":
        return Store(MemoryS3(), prefix, "memory")
    if request.param == "seaweedfs":
        server: DevServer = request.getfixturevalue("s3_server")
        endpoint, bucket = server.endpoint, server.bucket
    else:
        endpoint, bucket = request.getfixturevalue("moto_endpoint"), MOTO_BUCKET
    boto = make_boto_client(endpoint, "us-east-1", None, pool=8)
    return Store(Bucket(S3Client(boto, bucket, trio.CapacityLimiter(8)), RetryPolicy(), timeout=10),
                 prefix, request.param)


@pytest.fixture
def staged() -> Iterator[tuple[int, bytes]]:
    """A local file of 5 MiB + 1 KiB random bytes: (descriptor, its bytes)."""
    data = os.urandom(5 * MiB + 1024)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        yield f.fileno(), data


async def _keys(s3, prefix: str) -> list[str]:
    return sorted(o.key for o in await s3.list_keys(prefix))


async def test_put_head_and_ranges(store) -> None:
    s3, p, _ = store
    meta = {"mode": "33188", "uid": "0", "mtime": "1700000000000000000"}
    etag = await s3.put(p + "a.pt", b"0123456789", meta)
    info = await s3.head(p + "a.pt", checksum=True)
    assert (info.size, info.etag, info.metadata) == (10, etag, meta)
    kept = None if store.name == "moto" else b64_crc32(crc32(b"0123456789"))
    assert info.checksum_crc32 == kept
    assert await s3.get_range(p + "a.pt", 2, 5) == b"234"
    assert await s3.get_range(p + "a.pt", 0, 10, etag) == b"0123456789"


async def test_a_missing_key_is_nosuchkey(store) -> None:
    s3, p, _ = store
    with pytest.raises(NoSuchKey):
        await s3.head(p + "nothing")
    with pytest.raises(NoSuchKey):
        await s3.get_range(p + "nothing", 0, 1)


async def test_a_range_of_a_replaced_object_fails(store) -> None:
    s3, p, _ = store
    old = await s3.put(p + "x", b"old bytes", {})
    await s3.put(p + "x", b"new bytes", {})
    with pytest.raises(S3Error) as caught:
        await s3.get_range(p + "x", 0, 3, old)
    assert not isinstance(caught.value, NoSuchKey)
    assert caught.value.status == 412


async def test_listing_with_a_delimiter(store) -> None:
    s3, p, _ = store
    for key in ("a", "b/1", "b/2", "c/d/e", "f"):
        await s3.put(p + key, b"x", {})
    page, token = await s3.list_page(p, None)
    assert token is None
    assert [o.key for o in page.objects] == [p + "a", p + "f"]
    assert page.prefixes == [p + "b/", p + "c/"]
    assert await _keys(s3, p) == [p + k for k in ("a", "b/1", "b/2", "c/d/e", "f")]
    assert await s3.has_children(p + "b/")
    assert not await s3.has_children(p + "nothing/")


async def test_listing_in_pages_and_after_a_key(store) -> None:
    s3, p, _ = store
    names = [f"k{i}" for i in range(5)]
    for name in names:
        await s3.put(p + name, b"x", {})
    seen, token = [], None
    while True:
        page, token = await s3.list_page(p, token, max_keys=2)
        assert len(page.objects) <= 2
        seen += [o.key for o in page.objects]
        if token is None:
            break
    assert seen == [p + n for n in names]
    page, _ = await s3.list_page(p, None, start_after=p + "k2")
    assert [o.key for o in page.objects] == [p + "k3", p + "k4"]


async def test_multipart_round_trip_with_full_object_crc(store, staged) -> None:
    s3, p, _ = store
    fd, data = staged
    key = p + "big.bin"
    upload_id = await s3.create_multipart(key, {"mode": "33188"})
    first, rest = 5 * MiB, len(data) - 5 * MiB
    e1, c1 = await s3.upload_part(key, upload_id, 1, fd, 0, first)
    e2, c2 = await s3.upload_part(key, upload_id, 2, fd, first, rest)
    assert (c1, c2) == (crc32(data[:first]), crc32(data[first:]))
    assert {n: size for n, (size, _) in (await s3.list_parts(key, upload_id)).items()} == {
        1: first, 2: rest}
    assert key in [k for k, _, _ in await s3.list_uploads(p)]
    total = crc32_of_parts([(c1, first), (c2, rest)])
    parts = [{"ETag": e1, "PartNumber": 1, "ChecksumCRC32": b64_crc32(c1)},
             {"ETag": e2, "PartNumber": 2, "ChecksumCRC32": b64_crc32(c2)}]
    etag = await s3.complete_multipart(key, upload_id, parts, total)
    assert etag.strip('"').endswith("-2")  # (the spelling is each implementation's own)
    info = await s3.head(key, checksum=True)
    assert (info.size, info.etag, info.metadata["mode"]) == (len(data), etag, "33188")
    assert info.checksum_crc32 == b64_crc32(total)
    assert await s3.get_range(key, first - 3, first + 3) == data[first - 3:first + 3]
    assert await s3.list_uploads(p) == []


async def test_a_part_sent_with_a_wrong_crc_is_sent_again_with_the_files(store, staged) -> None:
    """The server refuses a part whose bytes do not have the CRC32 the writes computed (they
    were damaged on the way, or changed since): the retry sends the file's own CRC32."""
    s3, p, name = store
    fd, data = staged
    upload_id = await s3.create_multipart(p + "bad", {})
    with trio.fail_after(30):
        _, crc = await s3.upload_part(p + "bad", upload_id, 1, fd, 0, 1024,
                                      crc=crc32(data[:1024]) ^ 1)
    # moto takes any CRC32 it is given: there the part went up with the wrong one.
    assert crc == (crc32(data[:1024]) ^ 1 if name == "moto" else crc32(data[:1024]))
    assert await s3.abort_quietly(p + "bad", upload_id)


async def test_an_aborted_upload_is_gone(store) -> None:
    s3, p, _ = store
    upload_id = await s3.create_multipart(p + "gone", {})
    await s3.abort_multipart(p + "gone", upload_id)
    assert upload_id not in [u for _, u, _ in await s3.list_uploads(p)]
    assert await s3.abort_quietly(p + "gone", upload_id)  # already gone: nothing to do


async def test_copy_keeps_the_bytes_and_replaces_the_metadata(store) -> None:
    s3, p, _ = store
    etag = await s3.put(p + "src", b"checkpoint", {"mode": "33188"})
    new = await s3.copy(p + "src", p + "dst", 10, {"mode": "33216"}, etag=etag)
    info = await s3.head(p + "dst")
    assert (info.etag, info.metadata["mode"]) == (new, "33216")
    assert await s3.get_range(p + "dst", 0, 10) == b"checkpoint"
    await s3.copy(p + "src", p + "same", 10, etag=etag)
    assert (await s3.head(p + "same")).metadata["mode"] == "33188"


async def test_a_copy_onto_itself_replaces_the_metadata_and_sets_the_content_type(store) -> None:
    """How an s3fs directory object ("dir", application/x-directory) gets new metadata: a
    copy onto itself, which must keep it a directory object."""
    s3, p, _ = store
    etag = await s3.put(p + "empty", b"", {})
    await s3.copy(p + "empty", p + "dir", 0, {"mode": "16877"}, etag=etag,
                  content_type="application/x-directory")
    await s3.copy(p + "dir", p + "dir", 0, {"mode": "16832"}, content_type="application/x-directory")
    info = await s3.head(p + "dir")
    assert (info.metadata["mode"], info.content_type) == ("16832", "application/x-directory")
    await s3.copy(p + "dir", p + "plain", 0, {"mode": "33188"})  # replaced, and no type given
    assert (await s3.head(p + "plain")).content_type != "application/x-directory"


async def test_deletes(store) -> None:
    s3, p, _ = store
    for key in ("a", "b", "c"):
        await s3.put(p + key, b"x", {})
    await s3.delete(p + "a")
    await s3.delete(p + "never-was")  # S3 answers 204 for a missing key too
    await s3.delete_many([p + "b", p + "c", p + "never-was"])
    assert await _keys(s3, p) == []


async def test_download_to_assembles_ranges(store, staged) -> None:
    s3, p, _ = store
    _, data = staged
    etag = await s3.put(p + "dl", data, {})
    with tempfile.TemporaryFile() as out:
        await s3.download_to(p + "dl", out.fileno(), len(data), 2 * MiB, etag)
        assert os.pread(out.fileno(), len(data) + 1, 0) == data


async def test_a_marked_object_stays_marked_when_copied(store) -> None:
    """A symlink goes up as one part of a multipart upload; its copy too (UploadPartCopy),
    so that a listing still tells it from a file by its ETag."""
    s3, p, _ = store
    etag = await s3.put(p + "link", b"target/of/link", {"mode": str(0o120777)})
    assert is_marked(etag, 14)
    copied = await s3.copy(p + "link", p + "moved", 14, etag=etag)
    assert is_marked(copied, 14)
    info = await s3.head(p + "moved")
    assert info.metadata["mode"] == str(0o120777)
    assert await s3.get_range(p + "moved", 0, 14) == b"target/of/link"


def test_every_implementation_has_the_whole_seam() -> None:
    """The seam is narrow (at most 14 primitives), and every implementation and the fault
    wrapper have each of them."""
    methods = {n for n, v in vars(S3).items() if callable(v) and not n.startswith("_")}
    assert "upload_part" in methods and len(methods) <= 14, sorted(methods)
    for impl in (S3Client, MemoryStore, Faults):
        missing = sorted(n for n in methods if not callable(getattr(impl, n, None)))
        assert not missing, f"{impl.__name__} lacks {missing}"

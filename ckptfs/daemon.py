"""Daemon lifecycle: check inputs, build components, mount, serve, drain, unmount."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import errno
import functools
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio

from ckptfs import control, fuseloop
from ckptfs.asyncmode import AsyncModeChanges
from ckptfs.bucket import Bucket
from ckptfs.buffers import BufferBudget
from ckptfs.cache import ObjectCache
from ckptfs.changes import Changes, LocalCopies
from ckptfs.client import _mountinfo, control_path, is_mounted, mount_type, result_path, state_path
from ckptfs.closemode import CloseModeChanges
from ckptfs.config import Config
from ckptfs.errors import MountError, raise_first_error
from ckptfs.files import OpenFiles
from ckptfs.fs import CheckpointFS
from ckptfs.inodes import ROOT_INODE, InodeTable
from ckptfs.journal import Journal
from ckptfs.localread import SLICES_SUPPORTED
from ckptfs.metrics import Stats
from ckptfs.metrics import serve as serve_metrics
from ckptfs.namespace import Namespace
from ckptfs.notify import Notifier
from ckptfs.oplog import OrderedLog
from ckptfs.parts import PartPlan
from ckptfs.passthrough import Passthrough, PassthroughError
from ckptfs.prefetch import ChunkReader
from ckptfs.recovery import Recovery
from ckptfs.renames import Renames
from ckptfs.retry import RetryPolicy
from ckptfs.s3 import S3Client, make_boto_client, preflight
from ckptfs.spot import watch as watch_spot
from ckptfs.staging import StagingArea
from ckptfs.tree import Tree
from ckptfs.uploader import Uploader
from ckptfs.zerocopy import SendfileSender

log = logging.getLogger(__name__)

READY = "READY"
# How long an async-mode lookup waits for S3 before the mount's own knowledge answers.
PATIENCE = 1.0


def _clear_dead_mount(path: str) -> None:
    """A ckptfs mount whose daemon died (SIGKILL, OOM) answers ENOTCONN: detach it."""
    if mount_type(path) != "fuse.ckptfs":
        return
    try:
        os.listdir(path)  # stat alone may still be answered from the kernel's attribute cache
        return
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            return
    log.warning("%s is the mount of a ckptfs daemon that died; detaching it", path)
    subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)


def check_mountpoint(path: str) -> None:
    _clear_dead_mount(path)
    if not os.path.lexists(path):
        raise MountError(f"mount point {path} does not exist")
    if is_mounted(path):
        raise MountError(f"{path} is already a mount point")
    if not os.path.isdir(path):
        raise MountError(f"mount point {path} is not a directory")
    try:
        if os.listdir(path):
            raise MountError(f"mount point {path} is not empty")
    except PermissionError:
        raise MountError(f"mount point {path} is not accessible") from None


@contextlib.contextmanager
def locked_cache_dir(path: str) -> Iterator[int]:
    """Create the cache dir (0700), prove it writable, and hold its lock while mounted."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise MountError(f"cache dir {path} is not writable: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MountError(f"cache dir {path} is in use by another ckptfs mount") from None
    try:
        yield fd
    finally:
        os.close(fd)


# The kernel's readahead for the mount: its default of 128 KiB makes a sequential reader
# wait on each 1 MiB request in turn; 16 MiB keeps requests in flight ahead of it
# (measured: a cold 512 MiB read went from 5.1 s to 3.0 s; bench/read_bench.py).
READAHEAD_KB = 16384
# Requests the kernel keeps in flight for readahead: its default of 12 is less than the
# 16 MiB of readahead needs, and readers then did part of it synchronously (warm 1 GiB read
# of the disk cache: 1.7-2.1 s at 12, 1.3-1.6 s at 48; reader CPU 1.0 -> 0.5 s).
MAX_BACKGROUND = 48
FUSECTL = "/sys/fs/fuse/connections"
# The largest READ the kernel sends: a reply sent from a file (pyfuse3's FileSlice) is spliced
# through a pipe that must hold all of it, header and three pages of slack included (libfuse),
# and a pipe grows past /proc/sys/fs/pipe-max-size (1 MiB) only with CAP_SYS_RESOURCE, which
# containers drop. A 1 MiB READ then went through a malloc'd buffer instead: a second copy,
# and each reply thread's heap grew (peak RSS +40 MiB with 8 readers). 1008 KiB fits.
MAX_READ = (1 << 20) - 4 * 4096


async def _tune_connection(fs: CheckpointFS, real_mountpoint: str) -> None:
    """Raise the mount's readahead and the requests the kernel keeps in flight for it (root
    only, through sysfs and fusectl; others keep the defaults).

    The kernel caps readahead at what the FUSE INIT reply allows (its own 128 KiB offer), so
    this runs once that reply is out. real_mountpoint must be resolved before the mount:
    realpath() or stat() of the mount point now would ask this daemon and hang; the device
    comes from /proc/self/mountinfo for the same reason.
    """
    fields = _mountinfo(real_mountpoint)
    if fields is None:
        return
    device = fields[2]
    conn = f"{FUSECTL}/{device.split(':')[1]}"
    if os.geteuid() == 0 and _mountinfo(FUSECTL) is None:
        await trio.to_thread.run_sync(_mount_fusectl)
    settings = [(f"/sys/class/bdi/{device}/read_ahead_kb", READAHEAD_KB),
                (f"{conn}/max_background", MAX_BACKGROUND),
                (f"{conn}/congestion_threshold", MAX_BACKGROUND * 3 // 4)]
    await fs.initialized.wait()
    for path, value in settings:
        for _ in range(50):
            await trio.sleep(0.02)  # the INIT reply is written right after fs.init() returns
            try:
                with open(path, "w") as f:
                    f.write(str(value))
                with open(path) as f:
                    if int(f.read()) == value:
                        break
            except OSError as exc:
                log.debug("could not set %s to %d: %s", path, value, exc)
                break


def _mount_fusectl() -> None:
    """Mount the FUSE control filesystem, as systemd does at boot (sys-fs-fuse-connections.mount);
    containers and minimal hosts often lack it, and the mount's max_background is set there."""
    r = subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True, text=True)
    if r.returncode == 0:
        log.info("mounted the FUSE control filesystem at %s", FUSECTL)
    else:
        log.debug("could not mount fusectl at %s: %s", FUSECTL, r.stderr.strip())


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(config: Config, notify: Callable[[str], None]) -> int:
    """Mount and serve until unmounted or signalled. `notify` gets READY or an error line."""
    check_mountpoint(config.mountpoint)
    with locked_cache_dir(config.cache_dir):
        preflight(config.endpoint_url, config.region, config.profile, config.bucket, config.prefix)
        _raise_fd_limit()
        return trio.run(_serve, config, notify)


@dataclass
class Mount:
    """The components of one mount, built inside the daemon's nursery (see `_build`)."""
    fs: CheckpointFS
    files: OpenFiles
    changes: Changes
    uploader: Uploader
    reader: ChunkReader
    log: OrderedLog
    journal: Journal
    staging: StagingArea
    stats: Stats


async def _build(config: Config, nursery: trio.Nursery) -> Mount:
    limiter = trio.CapacityLimiter(config.concurrency + 8)
    boto = make_boto_client(config.endpoint_url, config.region, config.profile,
                            pool=config.concurrency + 8)
    # One retry policy for every request of the mount (and its spot-notice hurry).
    bodies = BufferBudget(config.upload_memory)
    sendfile = SendfileSender.applies(config.endpoint_url)
    if sendfile:  # plain HTTP: the kernel sends staged bytes itself
        SendfileSender(config.endpoint_url or "", timeout=60).install(boto)
    s3 = Bucket(S3Client(boto, config.bucket, limiter, bodies=bodies, sendfile=sendfile),
                RetryPolicy(), timeout=config.upload_timeout)
    return await build_mount(config, s3, nursery, (bodies,))


async def build_mount(config: Config, s3: Bucket, nursery: trio.Nursery,
                      counted: tuple[Any, ...] = ()) -> Mount:
    """The mount's components over `s3` (the S3 client's, or a fake's in unit tests), after the
    recovery of what an earlier daemon journaled. `counted`: more components for stats."""
    staging = StagingArea(config.cache_dir)
    journal = Journal(config.cache_dir)
    uploader = Uploader(s3, PartPlan(config.part_size), config.concurrency, journal=journal,
                        upload_timeout=config.upload_timeout, nursery=nursery)
    renames = Renames(s3, config.prefix)  # every rename in S3, under an intent (renames.py)
    records = uploader.records  # the one writer of journal records (uploads.py)
    oplog = OrderedLog(records, uploader, renames, nursery=nursery)
    # Before the mount goes live: what an earlier daemon journaled reaches S3 first, and the
    # ordered log's entries in their order.
    report = await Recovery(journal, staging.dir, staging.preserved_dir, s3, uploader).run(
        config.prefix, config.abort_stale_uploads_after)
    oplog.continue_after(report.last_seq)
    if report.failed:
        key, reason = report.failed[0]
        more = f" (and {len(report.failed) - 1} more)" if len(report.failed) > 1 else ""
        raise MountError(f"could not deliver journaled {key}{more}: {reason}; it stays in "
                         f"{journal.dir}, mount again to retry")
    staging.preserve_leftovers()
    cache = ObjectCache(config.cache_dir, config.cache_size)
    uid, gid = os.getuid(), os.getgid()
    table = InodeTable(config.prefix, uid, gid)
    local = LocalCopies(cache, table)
    changes: Changes
    if config.durability == "async":  # every change reaches S3 through the ordered log, in order
        changes = AsyncModeChanges(log=oplog, s3=s3, table=table, uploader=uploader, records=records,
                                cache=cache, staging=staging, local=local)
        masks = oplog.masks
    else:
        changes = CloseModeChanges(s3=s3, table=table, uploader=uploader, records=records, cache=cache,
                                staging=staging, local=local, nursery=nursery, renames=renames)
        masks = None
    # Async mode: lookups answer from what the mount knows when S3 does not within a second.
    ns = Namespace(s3, table, uid, gid, config.metadata_ttl, masks=masks,
                   patience=PATIENCE if config.durability == "async" else None, nursery=nursery)
    s3.policy.health.start(nursery, lambda: s3.probe(config.prefix),
                           pending=lambda: len(changes.backlog.pending()))
    if config.durability == "async":
        await ns.learn(ROOT_INODE)  # its names are then known through an outage
    reader = ChunkReader(s3, cache, memory_budget=config.read_memory, nursery=nursery, slices=SLICES_SUPPORTED)
    files = OpenFiles(s3=s3, table=table, ns=ns, staging=staging, cache=cache, uploader=uploader,
                      records=records, reader=reader, changes=changes, local=local)
    tree = Tree(s3=s3, table=table, ns=ns, uploader=uploader, records=records, changes=changes,
                local=local)
    passthrough = Passthrough(config.passthrough, config.cache_dir, uploader=uploader, table=table,
                              staging=staging, cache=cache, changes=changes,
                              space_wait=files.space_wait, nursery=nursery)
    fs = CheckpointFS(table=table, ns=ns, files=files, tree=tree, staging_dir=staging.dir,
                      read_only=config.read_only, metadata_ttl=config.metadata_ttl,
                      passthrough=passthrough, cold_open=config.cold_open)
    stats = Stats({"pid": os.getpid(), "mountpoint": config.mountpoint, "source": config.source,
                   "cache_dir": config.cache_dir, "durability": config.durability,
                   "recovery": report.as_dict()},
                  [uploader, *counted, reader, cache, files, changes, journal, fs, passthrough,
                   s3.policy.health, ns],
                  draining=lambda: fs.draining, pending=changes.backlog.pending)
    return Mount(fs, files, changes, uploader, reader, oplog, journal, staging, stats)


async def _serve(config: Config, notify: Callable[[str], None]) -> int:
    with raise_first_error():
        async with trio.open_nursery() as nursery:
            mount = await _build(config, nursery)
            await _mount_and_serve(config, mount, nursery, notify)
            nursery.cancel_scope.cancel()
    return _report_unmount(config, mount)


async def _mount_and_serve(config: Config, mount: Mount, nursery: trio.Nursery,
                           notify: Callable[[str], None]) -> None:
    fs, stats = mount.fs, mount.stats
    options = set(pyfuse3.default_options)
    options |= {f"fsname=ckptfs:{config.bucket}/{config.prefix}", "subtype=ckptfs"}
    if SLICES_SUPPORTED:  # ckptfs's pyfuse3, which repeats it at INIT (a stock one cannot)
        fs.max_read = MAX_READ
        options.add(f"max_read={MAX_READ}")
    if config.allow_other:
        options.add("allow_other")
    if config.read_only:
        options.add("ro")
    # Nothing may touch the mount point between init and main: the kernel would
    # ask this very process to answer, and it is not listening yet.
    state = state_path(config.mountpoint)
    control_sock = control_path(config.mountpoint)
    metrics_server = serve_metrics(config.metrics_addr, stats) if config.metrics_addr else None
    notifier = Notifier()
    real_mountpoint = os.path.realpath(config.mountpoint)
    try:
        fs.enable_passthrough = fs.passthrough is not None and fs.passthrough.want()
    except PassthroughError as exc:
        if metrics_server is not None:
            metrics_server.shutdown()
        raise MountError(str(exc)) from None
    try:
        pyfuse3.init(fs, config.mountpoint, options)
    except RuntimeError as exc:
        if metrics_server is not None:
            metrics_server.shutdown()
        raise MountError(f"cannot mount {config.mountpoint}: {exc}") from None
    try:
        os.makedirs(os.path.dirname(state), mode=0o700, exist_ok=True)
        with open(state, "w") as f:
            json.dump({"pid": os.getpid(), "cache_dir": config.cache_dir, "source": config.source}, f)
        log.info("mounted s3://%s/%s at %s (cache %s)", config.bucket, config.prefix,
                 config.mountpoint, config.cache_dir)
        async with trio.open_nursery() as services:
            await services.start(control.serve, control_sock, _control_handlers(mount))
            services.start_soon(_watch_signals, mount, config.drain_timeout, notifier)
            services.start_soon(_report_status, stats, notifier)
            services.start_soon(_tune_connection, fs, real_mountpoint)
            services.start_soon(_report_passthrough, mount, config.passthrough)
            if config.spot_termination_watch:
                services.start_soon(watch_spot, config.imds_endpoint, config.spot_poll_interval,
                                    functools.partial(_on_spot_notice, mount))
            notify(READY)
            notifier.ready(stats.line())
            fuseloop.install()
            await pyfuse3.main()
            await mount.reader.settle()
            await mount.files.shutdown()
            services.cancel_scope.cancel()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(state)
        pyfuse3.close(unmount=True)
        if metrics_server is not None:
            metrics_server.shutdown()


async def _report_passthrough(mount: Mount, mode: str) -> None:
    """One line once the kernel answered INIT: which path the bytes take, and why."""
    fs = mount.fs
    await fs.initialized.wait()
    pt = fs.passthrough
    if pt is None:
        return
    if pt.enabled:
        log.info("passthrough on: %s", pt.reason)
        if mount.reader.whole is not None:  # whole cached objects: later opens pass through
            mount.reader.whole.enabled = True
    elif mode == "on":
        log.error("--passthrough on: %s; unmounting", pt.reason)
        pyfuse3.terminate()
    else:
        log.info("passthrough off: %s; bytes go through the daemon, with the writeback cache",
                 pt.reason)


def _report_unmount(config: Config, mount: Mount) -> int:
    """Say what S3 does not have yet, in the result file `ckptfs unmount` reads, and the log."""
    table = mount.fs.table
    dirty = [i for i in table.all() if i.dirty and not i.unlinked]
    journaled = sum(1 for i in dirty if i.upload.record is not None and i.upload.record.closed)
    journaled += len(mount.log)  # every log entry is journaled
    pending = dirty + mount.log.pending()
    with contextlib.suppress(OSError):
        with open(result_path(config.mountpoint), "w") as f:
            json.dump({"pid": os.getpid(), "pending": len(pending), "journaled": journaled,
                       "journal": mount.journal.dir}, f)
    if pending:
        log.error("%d files are not in S3 (%d closed and journaled: the next mount delivers them; "
                  "the rest were never closed and are kept under %s)", len(pending), journaled,
                  mount.staging.dir)
        return 1
    log.info("unmounted %s (%d write requests, %d parts streamed)", config.mountpoint,
             mount.files.write_calls, mount.uploader.parts_sent)
    return 0


def _on_spot_notice(mount: Mount, notice: dict) -> None:
    """Two minutes left: uploads get the bandwidth, waiting ones retry now."""
    log.warning("spot interruption notice: %s at %s; pending uploads go first",
                notice.get("action", "?"), notice.get("time", "?"))
    mount.stats.spot_notice = notice
    mount.reader.readahead = False
    mount.uploader.policy.hurry.now()


def _control_handlers(mount: Mount) -> dict:
    async def sync(request: dict) -> dict:
        failed = await mount.changes.backlog.wait(str(request.get("path", "")))
        return {"failed": failed}

    async def status(request: dict) -> dict:
        return mount.stats.refresh()
    return {"sync": sync, "status": status}


async def _report_status(stats: Stats, notifier: Notifier) -> None:
    """Refresh the snapshot behind /metrics and systemd's STATUS= once a second."""
    while True:
        await trio.sleep(1.0)
        stats.refresh()
        notifier.status(stats.line())


async def _watch_signals(mount: Mount, drain_timeout: float, notifier: Notifier) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: refusing new writes, finishing uploads",
                     signal.Signals(signum).name)
            mount.fs.draining = True
            mount.stats.refresh()
            notifier.stopping(mount.stats.line())
            with trio.move_on_after(drain_timeout) as scope:
                await mount.changes.backlog.drain()
                await mount.uploader.wait_idle()
            if scope.cancelled_caught:
                log.error("drain timeout (%.0fs) reached with %d uploads pending",
                          drain_timeout, len(mount.changes.backlog.pending()))
            pyfuse3.terminate()
            return


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def child_main() -> int:
    """Entry of the background daemon: config JSON on stdin, readiness on fd CKPTFS_READY_FD."""
    ready_fd = int(os.environ.pop("CKPTFS_READY_FD"))
    config = Config(**json.loads(sys.stdin.read()))
    setup_logging(config.log_level)
    sent = [False]

    def notify(message: str) -> None:
        if not sent[0]:
            sent[0] = True
            os.write(ready_fd, (message + "\n").encode())
            os.close(ready_fd)

    try:
        return run(config, notify)
    except MountError as exc:
        log.error("%s", exc)
        notify(f"ERROR {exc}")
        return 1
    except Exception as exc:
        log.exception("daemon failed")
        notify(f"ERROR daemon failed: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(child_main())

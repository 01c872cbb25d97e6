"""Command line: `ckptfs mount|sync|status|unmount`. Errors are one line on stderr, never a traceback.

Exit status: 0 success, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ckptfs import client
from ckptfs.config import OPTION_KEYS, Config, coerce, load_config_file
from ckptfs.config import human_size as _human
from ckptfs.errors import CkptfsError, ConfigError, MountError

PROG = "ckptfs"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other usage error
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Mount an S3 prefix as a directory for training checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount s3://BUCKET[/PREFIX] at MOUNTPOINT")
    m.add_argument("source", nargs="?", help="s3://BUCKET[/PREFIX]")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("--cache-dir", help="local staging and cache directory (NVMe)")
    m.add_argument("--endpoint-url", help="S3 endpoint (default: AWS, or $AWS_ENDPOINT_URL)")
    m.add_argument("--region")
    m.add_argument("--profile", help="AWS profile name")
    m.add_argument("--part-size", help="multipart part size, e.g. 16MiB (it grows along huge files)")
    m.add_argument("--concurrency", help="parts or ranges in flight at once")
    m.add_argument("--cache-size", help="local copies of written files kept for reads, e.g. 8GiB")
    m.add_argument("--upload-memory", help="memory for request bodies read from staged files over "
                   "HTTPS (default 48MiB; a part waits for room)")
    m.add_argument("--read-memory", help="memory for read chunks fetched from S3 when they cannot go to the disk cache (default 48MiB)")
    m.add_argument("--foreground", action="store_const", const=True, help="stay attached (for systemd)")
    m.add_argument("--allow-other", action="store_const", const=True, help="let other users access the mount")
    m.add_argument("--read-only", action="store_const", const=True)
    m.add_argument("--durability", help="close (default: close() returns when the file is in S3) "
                   "or async (close() returns once staged; `ckptfs sync` waits for S3)")
    m.add_argument("--drain-timeout", help="seconds unmount waits for pending uploads (default 600)")
    m.add_argument("--upload-timeout", help="seconds an upload, or any other S3 request, keeps "
                   "retrying through S3 faults before the call fails with EIO (default 120)")
    m.add_argument("--abort-stale-uploads-after", help="at mount, abort multipart uploads under the "
                   "prefix that no journal owns and that are older than this (default 1d)")
    m.add_argument("--spot-termination-watch", action="store_const", const=True,
                   help="poll EC2 instance metadata for a spot interruption notice")
    m.add_argument("--imds-endpoint", help="instance metadata base URL (default http://169.254.169.254)")
    m.add_argument("--spot-poll-interval", help="seconds between spot notice polls (default 5)")
    m.add_argument("--metrics-addr", help="serve Prometheus metrics at http://HOST:PORT/metrics")
    m.add_argument("--metadata-ttl", help="seconds S3's answers about names and attributes are "
                   "trusted, and missing names remembered (default 1)")
    m.add_argument("--passthrough", help="auto (default: the kernel reads and writes local files "
                   "itself where it can: kernel 6.9+, CAP_SYS_ADMIN), on (or fail the mount), off")
    m.add_argument("--cold-open", help="with passthrough, the first open of an object not in the "
                   "read cache: whole (default: fetch it all at full speed, then the kernel reads "
                   "it itself) or stream (the daemon serves it from the first byte)")
    m.add_argument("--log-level", help="debug, info, warning or error")
    m.add_argument("--config", help="TOML file of these options (underscored names)")

    y = sub.add_parser("sync", help="wait until every closed file under PATH is in S3")
    y.add_argument("mountpoint")
    y.add_argument("path", nargs="?", default="", help="a file or directory in the mount (default: all)")
    y.add_argument("--timeout", type=float, help="give up (exit 1) after this many seconds")
    y.add_argument("--json", action="store_true",
                   help="print the status (as `status --json`) with the sync's outcome")

    st = sub.add_parser("status", help="show pending uploads, retries, recovery and spot notices")
    st.add_argument("mountpoint")
    st.add_argument("--json", action="store_true", help="print the status as one JSON object")

    u = sub.add_parser("unmount", help="finish uploads and unmount")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the daemon")
    return p


def _mount_config(args: argparse.Namespace) -> Config:
    values: dict[str, object] = {}
    if args.config:
        values.update(load_config_file(args.config))
    for key in OPTION_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            values[key] = coerce(key, value)
    if "source" not in values:
        raise ConfigError("mount needs a source s3://BUCKET[/PREFIX]")
    if "mountpoint" not in values:
        raise ConfigError("mount needs a mount point")
    return Config(**values).validate()  # type: ignore[arg-type]


def _mount(config: Config) -> int:
    from ckptfs import daemon

    if config.foreground:
        daemon.setup_logging(config.log_level)
        try:
            return daemon.run(config, notify=lambda message: None)
        except MountError as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 1
    return _spawn_daemon(config)


def _spawn_daemon(config: Config) -> int:
    """Start the daemon in the background; return once the mount is live, or say why not."""
    read_fd, write_fd = os.pipe()
    log_path = os.path.join(config.cache_dir, "ckptfs.log")
    try:
        os.makedirs(config.cache_dir, mode=0o700, exist_ok=True)
        log_file = open(log_path, "ab")
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        sys.stderr.write(f"{PROG}: cache dir {config.cache_dir} is not writable: {exc.strerror}\n")
        return 1
    env = dict(os.environ, CKPTFS_READY_FD=str(write_fd))
    with log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfs.daemon"], stdin=subprocess.PIPE, stdout=log_file,
            stderr=log_file, pass_fds=(write_fd,), env=env, start_new_session=True, cwd="/")
    os.close(write_fd)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(dataclasses.asdict(config)).encode())
    proc.stdin.close()
    with os.fdopen(read_fd, "rb") as ready:
        line = ready.readline().decode().strip()
    if line == "READY":
        return 0
    if line.startswith("ERROR "):
        sys.stderr.write(f"{PROG}: {line[len('ERROR '):]}\n")
    else:
        proc.wait()
        sys.stderr.write(f"{PROG}: the daemon exited with status {proc.returncode}; see {log_path}\n")
    return 1


def _sync(mountpoint: str, path: str, timeout: float | None, as_json: bool) -> int:
    """Wait for the daemon's answer in a thread; meanwhile, on a terminal, show what is left."""
    mountpoint = os.path.abspath(mountpoint)
    if not client.is_mounted(mountpoint):
        raise MountError(f"{mountpoint} is not mounted")
    if timeout is not None and timeout <= 0:
        raise ConfigError("--timeout must be a positive number of seconds")
    rel = _relative(mountpoint, path)
    ctl = client.control_path(mountpoint)
    answer: dict = {}

    def wait() -> None:
        try:
            answer["reply"] = client.request(ctl, {"op": "sync", "path": rel})
        except CkptfsError as exc:
            answer["error"] = exc
    started = time.monotonic()
    before = _pending_under(_status_of(ctl), rel)
    waiter = threading.Thread(target=wait, name="sync", daemon=True)
    waiter.start()
    show = sys.stdout.isatty() and not as_json
    while waiter.is_alive():
        left = None if timeout is None else started + timeout - time.monotonic()
        if left is not None and left <= 0:
            break
        waiter.join(0.5 if left is None else min(0.5, left))
        if show and waiter.is_alive():
            sys.stdout.write("\r\x1b[2K" + _progress_line(_status_of(ctl), rel, before))
            sys.stdout.flush()
    if show:
        sys.stdout.write("\r\x1b[2K")
    seconds = time.monotonic() - started
    failed = answer["reply"].get("failed", []) if "reply" in answer else []
    if as_json:
        st = _status_of(ctl)
        if st is None:
            raise MountError(f"the daemon of {mountpoint} does not answer status requests")
        st.update(synced="reply" in answer and not failed, failed_sync=failed, path=rel,
                  timed_out="reply" not in answer and "error" not in answer, seconds=round(seconds, 3))
        print(json.dumps(st, indent=2, sort_keys=True))
    if "error" in answer:
        raise answer["error"]
    where = f"{mountpoint}/{rel}" if rel else mountpoint
    if "reply" not in answer:
        files, size, _ = _pending_under(_status_of(ctl), rel)
        raise MountError(f"sync of {where} timed out after {timeout:g}s: {files} changes "
                         f"({_human(size)}) not in S3 yet; uploads go on")
    if failed:
        first_path, reason = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise MountError(f"upload of {first_path} failed: {reason}{more}")
    if not as_json:
        files, size, _ = before
        print(f"{PROG}: {where} is in S3 ({files} changes, {_human(size)}, were pending; {seconds:.1f}s)")
    return 0


def _relative(mountpoint: str, path: str) -> str:
    """PATH (absolute, ./relative, or relative to the mount) as a path inside the mount."""
    if not path:
        return ""
    full = os.path.abspath(path if os.path.isabs(path) or path.startswith(".") else
                           os.path.join(mountpoint, path))
    if full != mountpoint and not full.startswith(mountpoint + "/"):
        raise ConfigError(f"{path} is not inside {mountpoint}")
    return os.path.relpath(full, mountpoint).strip(".") if full != mountpoint else ""


def _status_of(ctl: str) -> dict | None:
    """The daemon's status, or None if it does not answer within a few seconds."""
    try:
        return client.request(ctl, {"op": "status"}, timeout=5)
    except (CkptfsError, OSError, ValueError):
        return None


def _pending_under(st: dict | None, rel: str) -> tuple[int, int, int]:
    """(files, bytes, retries so far) of the changes under `rel` S3 does not have yet."""
    if st is None:
        return 0, 0, 0
    mine = [p for p in st["pending"]
            if not rel or p["path"] == rel or p["path"].startswith(rel.rstrip("/") + "/")]
    return len(mine), sum(p["size"] for p in mine), st["retries"]


def _progress_line(st: dict | None, rel: str, before: tuple[int, int, int]) -> str:
    if st is None:
        return f"{PROG} sync: waiting (the daemon is busy)"
    files, size, retries = _pending_under(st, rel)
    rate = st["upload_throughput_bytes_per_second"]
    eta = f"{size / rate:.0f}s" if rate > 0 else "?"
    return (f"{PROG} sync: {files} changes ({_human(size)}) left, {_human(rate)}/s, ETA {eta}, "
            f"{retries - before[2]} retries")


def _status(mountpoint: str, as_json: bool) -> int:
    mountpoint = os.path.abspath(mountpoint)
    if not client.is_mounted(mountpoint):
        raise MountError(f"{mountpoint} is not mounted")
    try:
        st = client.request(client.control_path(mountpoint), {"op": "status"}, timeout=10)
    except OSError as exc:
        raise MountError(f"the daemon of {mountpoint} does not answer: {exc}") from None
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    pending = st["pending"]
    print(f"{st['mountpoint']}: {st['source']} (durability {st['durability']}, pid {st['pid']})"
          + (" [draining]" if st["draining"] else ""))
    print(f"pending uploads: {len(pending)} ({_human(st['pending_bytes'])}); "
          f"in flight: {st['uploads_in_flight']}; done: {st['uploads_done']}; "
          f"failing: {len(st['failed'])}; retries: {st['retries']}")
    print(f"uploaded: {_human(st['bytes_uploaded'])} "
          f"({_human(st['upload_throughput_bytes_per_second'])}/s over the last 10 s); "
          f"downloaded: {_human(st['bytes_downloaded'])}; read cache: "
          f"{_human(st['cache_bytes'])} of {_human(st['cache_budget'])}")
    if "passthrough" in st:
        print(f"passthrough: {'on' if st['passthrough'] else 'off'} ({st['passthrough_reason']})")
    if "opens_daemon" in st:
        print(f"opens: {st['opens_passthrough_cached']} passthrough of cached objects "
              f"({_human(st['bytes_opened_passthrough'])} opened), "
              f"{st['opens_passthrough_staged']} passthrough of staged files, "
              f"{st['opens_daemon']} served by the daemon ({_human(st['bytes_read_daemon'])} read)")
    print("S3: " + _s3_state(st))
    for p in pending[:20]:
        print(f"  {p['path']}  {_human(p['size'])}" + (f"  last error: {p['error']}" if p["error"] else ""))
    if len(pending) > 20:
        print(f"  ... and {len(pending) - 20} more")
    rec = st["recovery"]
    print(f"recovered at mount: {rec['delivered']} delivered, {rec['already_in_s3']} already in S3, "
          f"{rec['aborted_unclosed']} unclosed uploads aborted, {len(rec['set_aside'])} set aside, "
          f"{rec['orphans_aborted']} stale uploads aborted")
    for name, reason in rec["set_aside"]:
        print(f"  set aside {name}: {reason}")
    for moved in rec.get("renames_completed", []):
        print(f"  completed a rename a crash interrupted: {moved}")
    for torn in st.get("torn_writes", []):
        print(f"not published (writer killed by signal {torn['signal']}): {torn['path']}; "
              f"its bytes: {torn['preserved']}")
    notice = st.get("spot_notice")
    print("spot notice: " + (f"{notice.get('action', '?')} at {notice.get('time', '?')}" if notice
                             else "none"))
    return 0


def _s3_state(st: dict) -> str:
    if not st.get("s3_down_since"):
        return f"answering ({st.get('s3_outages', 0)} outages since the mount)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st["s3_down_since"]))
    return (f"NOT ANSWERING since {since} ({st['s3_down_seconds']:.0f}s: {st['s3_down_reason']}); "
            f"{st['pending_files']} changes pending ({_human(st['pending_bytes'])})")


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) has finished."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _unmount(mountpoint: str, timeout: float) -> int:
    mountpoint = os.path.abspath(mountpoint)
    if not client.is_mounted(mountpoint):
        raise MountError(f"{mountpoint} is not mounted")
    pid = None
    try:
        with open(client.state_path(mountpoint)) as f:
            pid = int(json.load(f)["pid"])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pid = None
    if pid is None:  # no daemon of ours answers: let the kernel go
        result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
        if result.returncode != 0:
            raise MountError(f"cannot unmount {mountpoint}: {result.stderr.strip()}")
        return 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            break
        time.sleep(0.05)
    else:
        raise MountError(f"the daemon of {mountpoint} (pid {pid}) did not finish within {timeout:.0f}s")
    if client.is_mounted(mountpoint):
        raise MountError(f"{mountpoint} is still mounted")
    try:
        with open(client.result_path(mountpoint)) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return 0
    if result.get("pid") == pid and result.get("pending"):
        raise MountError(
            f"unmounted, but {result['pending']} files are not in S3 "
            f"({result.get('journaled', 0)} journaled in {result.get('journal')}: "
            "the next mount on this cache dir delivers them)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mount":
            return _mount(_mount_config(args))
        if args.command == "unmount":
            return _unmount(args.mountpoint, args.timeout)
        if args.command == "sync":
            return _sync(args.mountpoint, args.path, args.timeout, args.json)
        if args.command == "status":
            return _status(args.mountpoint, args.json)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 2
    except CkptfsError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 2

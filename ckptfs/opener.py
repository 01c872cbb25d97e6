"""Who opened a file for writing, and whether that process is dying from a signal.

FLUSH carries no request context in pyfuse3, so the opener's ids are kept from open/create.
The kernel sends FLUSH from `exit_files()` while the dying task is still in /proc: its
`flags` (field 9 of /proc/PID/stat) have PF_EXITING and its `exit_code` (field 52) holds the
signal that killed it (9 for SIGKILL, 15 for SIGTERM); a normal exit shows PF_EXITING with
the signal bits 0, and an explicit close() shows no PF_EXITING at all.
"""

from __future__ import annotations

from dataclasses import dataclass

PF_EXITING = 0x4


@dataclass(frozen=True)
class Opener:
    tid: int  # the thread that opened (what FUSE reports as the request's pid)
    tid_start: int  # its start time (field 22): a reused pid is someone else
    tgid: int  # its process: the thread may end while the process writes on
    tgid_start: int


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name), or None if there is no such task."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def _tgid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def opener_of(pid: int) -> Opener | None:
    """The opener whose request came from `pid` (a thread id); None if it is already gone."""
    if pid <= 0:
        return None
    tid_fields = _stat(pid)
    if tid_fields is None:
        return None
    tgid = _tgid(pid)
    tgid_fields = tid_fields if tgid == pid else _stat(tgid)
    if tgid_fields is None:
        return None
    return Opener(pid, int(tid_fields[19]), tgid, int(tgid_fields[19]))


def killing_signal(opener: Opener) -> int:
    """The signal number if the opener's thread or process is exiting because of a signal,
    else 0 (alive, exited normally, or gone and its id now someone else's)."""
    signal = 0
    for pid, start in ((opener.tid, opener.tid_start), (opener.tgid, opener.tgid_start)):
        fields = _stat(pid)
        if fields is None or int(fields[19]) != start:
            continue
        if int(fields[6]) & PF_EXITING:
            signal = max(signal, int(fields[-1]) & 0x7F)
    return signal

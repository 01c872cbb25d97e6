"""An inode's state has one owner: only ckptfs/inodes.py assigns the fields of `Inode`.

Every other module says what happened (`node.uploaded(etag, clock)`, `node.wrote(end)`,
`node.confirmed()`, ...) and inodes.py decides what that does to the fields. The check reads
the package's source: an assignment, augmented assignment or tuple unpacking whose target
is an attribute named like a field of `Inode`, on anything but `self`, outside inodes.py.

Below, the write state (`inodes.Write`) and its precedence rule, transition by transition.
"""

from __future__ import annotations

import ast
import errno
import signal
import stat
from pathlib import Path

import ckptfs
from ckptfs.inodes import ROOT_INODE, Inode, Write

PACKAGE = Path(ckptfs.__file__).parent
OWNER = "inodes.py"


def inode_fields() -> set[str]:
    tree = ast.parse((PACKAGE / OWNER).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Inode":
            return {st.target.id for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    raise AssertionError("no class Inode in inodes.py")


def assigned_attributes(source: str) -> list[tuple[int, str, str]]:
    """(line, object, attribute) of every attribute assigned in `source`, but `self.x`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        stack = list(targets)
        while stack:
            target = stack.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                stack.extend(target.elts)
            elif isinstance(target, ast.Starred):
                stack.append(target.value)
            elif isinstance(target, ast.Attribute):
                owner = ast.unparse(target.value)
                if owner != "self":
                    found.append((node.lineno, owner, target.attr))
    return found


def test_only_inodes_py_assigns_inode_fields() -> None:
    fields = inode_fields()
    assert {"etag", "page_etag", "write", "write_cause", "validated_at", "staged", "size"} <= fields
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == OWNER:
            continue
        for line, owner, attr in assigned_attributes(path.read_text()):
            if attr in fields:
                offenders.append(f"{path.name}:{line}: {owner}.{attr} = ...")
    assert not offenders, ("assign these through a method of Inode (inodes.py):\n"
                           + "\n".join(offenders))


def test_the_check_sees_every_kind_of_assignment() -> None:
    source = ("node.etag = 'x'\n"
              "node.pending += 1\n"
              "node.staged, node.size = s, 3\n"
              "self.etag = None\n"
              "a.b.dirty: bool = True\n")
    assert assigned_attributes(source) == [(1, "node", "etag"), (2, "node", "pending"),
                                           (3, "node", "size"), (3, "node", "staged"),
                                           (5, "a.b", "dirty")]


# ----- the write state: one enum, and its precedence rule ---------------------------------

def _inode() -> Inode:
    return Inode(2, ROOT_INODE, "f", stat.S_IFREG | 0o644, 0, 0)


def test_writes_make_a_file_dirty_and_a_save_of_the_last_clean() -> None:
    node = _inode()
    assert node.write is Write.CLEAN and not node.dirty
    node.wrote(10)
    clock = node.clock
    assert node.write is Write.DIRTY and node.dirty
    node.wrote(20)
    assert not node.saved(clock)  # written since that upload began: still dirty
    assert node.write is Write.DIRTY
    assert node.saved(node.clock) and node.write is Write.CLEAN


def test_a_failed_write_stands_until_its_bytes_are_let_go() -> None:
    node = _inode()
    node.wrote(10)
    node.write_failed(errno.ENOSPC)
    node.torn_by(signal.SIGKILL)  # then its writer is killed: the failure stands
    node.wrote(30)
    node.write_failed(errno.EIO)  # a second failure keeps the first errno
    assert node.saved()  # an upload sent before lands: still never uploaded again
    node.own_close()
    assert (node.write, node.write_error, node.torn, node.dirty) == (
        Write.FAILED, errno.ENOSPC, 0, True)
    node.discarded()
    assert (node.write, node.write_error, node.dirty) == (Write.CLEAN, 0, False)


def test_a_torn_file_yields_to_a_failure_its_own_close_and_a_save() -> None:
    node = _inode()
    node.torn_by(signal.SIGKILL)  # nothing written: nothing to tear
    assert node.write is Write.CLEAN
    node.wrote(10)
    node.torn_by(signal.SIGKILL)
    node.wrote(20)  # another writer goes on: still torn
    assert (node.write, node.torn) == (Write.TORN, signal.SIGKILL)
    node.own_close()
    assert node.write is Write.DIRTY and node.torn == 0
    node.torn_by(signal.SIGTERM)
    node.write_failed(errno.EIO)
    assert (node.write, node.write_error, node.torn) == (Write.FAILED, errno.EIO, 0)
    other = _inode()
    other.wrote(1)
    other.torn_by(signal.SIGKILL)
    assert other.saved() and other.write is Write.CLEAN  # its bytes reached S3 before

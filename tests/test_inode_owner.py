"""An inode's state has one owner: only ckptfs/inodes.py assigns the fields of `Inode`.

Every other module says what happened (`node.uploaded(etag, clock)`, `node.wrote(end)`,
`node.confirmed()`, ...) and inodes.py decides what that does to the fields. The check reads
the package's source: an assignment, augmented assignment or tuple unpacking whose target
is an attribute named like a field of `Inode`, on anything but `self`, outside inodes.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptfs

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
    assert {"etag", "page_etag", "dirty", "validated_at", "staged", "size"} <= fields
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

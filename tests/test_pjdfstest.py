"""pjdfstest, the POSIX file system test suite, inside real ckptfs mounts: a tier of its own
(`./scripts/test.sh -m pjdfstest`). It is built from its vendored source (third_party/) and
runs the open, rename, truncate, ftruncate, unlink, mkdir and rmdir directories, as root,
with --allow-other (it switches users). The subtests that fail are on a checked-in list,
each with its reason; any other failure fails the test, and so does a listed one that passes."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, Mounter, both_paths

SOURCE = REPO / "third_party" / "pjdfstest"
EXPECTED = Path(__file__).with_name("pjdfstest_expected_failures.txt")
DIRECTORIES = ("open", "rename", "truncate", "ftruncate", "unlink", "mkdir", "rmdir")
MAX_FAILING = 0.05  # issue 18: at most 5 % of the subtests may fail
SCRIPT_TIMEOUT = 600


@dataclass
class Outcome:
    """One test script's TAP: how many subtests it planned, which failed and why."""
    planned: int = 0
    failed: dict[int, str] = field(default_factory=dict)


def parse_tap(text: str) -> Outcome:
    out = Outcome()
    seen: set[int] = set()
    for line in text.splitlines():
        if m := re.fullmatch(r"1\.\.(\d+)", line.strip()):
            out.planned = int(m.group(1))
        elif m := re.match(r"(not )?ok (\d+)(.*)", line):
            n = int(m.group(2))
            seen.add(n)
            if m.group(1) and "# TODO" not in m.group(3):  # TODO: a failure upstream expects
                out.failed[n] = line
    for n in range(1, out.planned + 1):
        if n not in seen:
            out.failed[n] = f"not ok {n} - never reported (the script stopped)"
    if out.planned == 0:
        out.failed[0] = f"no plan: {text[-500:]!r}"
    return out


def parse_ranges(text: str) -> set[int]:
    numbers: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def expected_failures() -> dict[str, set[int]]:
    expected: dict[str, set[int]] = {}
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            script, subtests, _why = line.split(None, 2)
            expected[script] = parse_ranges(subtests)
    return expected


def test_expected_failures_list_is_well_formed() -> None:
    expected = expected_failures()
    assert expected and all(expected.values())
    for script in expected:
        assert (SOURCE / "tests" / script).is_file(), script
    assert parse_ranges("1-3,7,9-10") == {1, 2, 3, 7, 9, 10}
    tap = parse_tap("1..4\nok 1\nnot ok 2 - tried x\nnot ok 3 # TODO upstream\n")
    assert tap.planned == 4 and sorted(tap.failed) == [2, 4]


@pytest.fixture(scope="module")
def pjdfstest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built suite: the pjdfstest program next to its tests/ directory."""
    build = tmp_path_factory.mktemp("pjdfstest") / "src"
    shutil.copytree(SOURCE, build)
    for cmd in (["autoreconf", "-i"], ["./configure", "-q"], ["make", "-s"]):
        r = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
        assert r.returncode == 0, f"building pjdfstest: {' '.join(cmd)} failed:\n{r.stderr[-3000:]}"
    return build


def run_script(script: Path, workdir: Path) -> Outcome:
    workdir.mkdir()
    try:
        r = subprocess.run(["sh", str(script)], cwd=workdir, capture_output=True, text=True,
                           timeout=SCRIPT_TIMEOUT)
        text = r.stdout
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return parse_tap(text)


@pytest.mark.pjdfstest
@pytest.mark.parametrize("durability", ["close", "async"])
@both_paths
def test_pjdfstest_fails_only_the_listed_subtests(mounter: Mounter, pjdfstest: Path,
                                                  durability: str, passthrough: str) -> None:
    mnt = mounter("--allow-other", "--durability", durability, "--passthrough", passthrough)
    scripts = sorted(p for d in DIRECTORIES for p in (pjdfstest / "tests" / d).glob("*.t"))
    names = [str(p.relative_to(pjdfstest / "tests")) for p in scripts]
    # Two at a time, each in a directory of its own: what they check stays their own.
    with ThreadPoolExecutor(2) as pool:
        outcomes = dict(zip(names, pool.map(
            lambda i: run_script(scripts[i], mnt.path / f"t{i:03d}"), range(len(scripts)))))
    expected = expected_failures()
    total = sum(o.planned for o in outcomes.values())
    failed = sum(len(o.failed) for o in outcomes.values())
    unexpected = [f"{name}: {line}" for name, o in outcomes.items()
                  for n, line in sorted(o.failed.items()) if n not in expected.get(name, ())]
    now_pass = [f"{name} {n}" for name, numbers in expected.items() for n in sorted(numbers)
                if n not in outcomes.get(name, Outcome()).failed]
    print(f"pjdfstest, --durability {durability} --passthrough {passthrough}: {failed} of "
          f"{total} subtests fail "
          f"({100 * failed / max(total, 1):.1f} %), {len(unexpected)} off the list")
    assert len(outcomes) == len(scripts) and total > 6000
    assert not unexpected, ("subtests off the list failed:\n" + "\n".join(
        f"{line[:300]}" for line in unexpected[:50]) + f"\n{mnt.log[-3000:]}")
    assert not now_pass, ("listed subtests now pass; take them off "
                          f"{EXPECTED.name}: {', '.join(now_pass)}")
    assert failed <= MAX_FAILING * total

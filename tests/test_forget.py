"""No ENOENT for a file that exists, whatever the kernel forgot (issue 34), through real mounts
with the kernel's caches dropped. The workloads are devtools/forget_check.py's, small here; run
that file for the acceptance figures (100 tries per case, 5,000 random operations)."""

from __future__ import annotations

import os

import pytest

from conftest import Mounter, run_ckptfs
from devtools.forget_check import compare_tree, prepare_stat_files, random_workload, stat_after_drop

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping the kernel's caches needs root")


def sync(mnt) -> None:
    r = run_ckptfs("sync", str(mnt.path), endpoint=mnt.endpoint)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("durability", ["close", "async"])
def test_a_synced_file_is_found_right_after_the_kernel_forgets_it(mounter: Mounter, durability: str) -> None:
    mnt = mounter("--durability", durability)
    prepare_stat_files(mnt.path)
    sync(mnt)
    # Before the fix: 16 of 20 in the root when listed just before (the listing's freshness
    # answered for a name the table had dropped at the FORGET).
    assert stat_after_drop(mnt.path, tries=8, pause=0.15) == dict.fromkeys(
        ("root, listed", "root, not listed", "subdir, listed", "subdir, not listed"), 0)


@pytest.mark.parametrize("durability", ["close", "async"])
def test_random_namespace_operations_under_memory_pressure_agree_with_a_model(
        mounter: Mounter, durability: str) -> None:
    mnt = mounter("--durability", durability)
    model, wrong = random_workload(mnt.path, ops=400, seed={"close": 1, "async": 2}[durability], names=12)
    assert wrong == []
    sync(mnt)
    fresh = mounter("--durability", durability)  # an empty cache: everything from S3
    assert compare_tree(fresh.path, model) == []

"""Unmodified framework code through the mount: torch.save/load, PyTorch DCP, safetensors, Orbax."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import BUCKET, Mounter, run_ckptfs, s3_keys

MiB = 1024 * 1024
ORBAXCHECK = Path(__file__).parent / "orbaxcheck.py"


def sha256_of_object(s3, key: str) -> str:
    h = hashlib.sha256()
    for chunk in s3.get_object(Bucket=BUCKET, Key=key)["Body"].iter_chunks(8 * MiB):
        h.update(chunk)
    return h.hexdigest()


def sha256_of_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def state_dict(total_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    per = 16 * MiB // 4  # float32 elements in a 16 MiB tensor
    sd = {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(total_mib // 16)}
    sd["step"] = torch.tensor(1000)
    return sd


def test_torch_save_256mib_is_in_s3_on_return_and_loads_in_a_fresh_mount(
        mounter: Mounter, s3, prefix: str, tmp_path) -> None:
    sd = state_dict(256)
    mnt = mounter()
    (mnt.path / "step_1000").mkdir()
    torch.save(sd, mnt.path / "step_1000" / "model.pt")
    # torch.save has returned: the object must be complete and identical right now.
    reference = tmp_path / "model.pt"
    torch.save(sd, reference)  # torch.save is deterministic for the same tensors
    assert reference.stat().st_size >= 256 * MiB
    assert sha256_of_object(s3, f"{prefix}/step_1000/model.pt") == sha256_of_file(reference)
    mnt.unmount()

    fresh = mounter()  # a new cache dir: nothing local, every byte comes from S3
    assert not any((fresh.cache_dir / "staging").iterdir())
    loaded = torch.load(fresh.path / "step_1000" / "model.pt")
    assert loaded.keys() == sd.keys()
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    loaded = torch.load(fresh.path / "step_1000" / "model.pt", mmap=True)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_torch_save_bytes_hash_matches_what_was_written(mounter: Mounter, s3, prefix: str) -> None:
    class Hashing:
        def __init__(self, f) -> None:
            self.f, self.h = f, hashlib.sha256()

        def write(self, b) -> int:
            self.h.update(b)
            return self.f.write(b)

        def flush(self) -> None:
            self.f.flush()

    mnt = mounter()
    with open(mnt.path / "h.pt", "wb") as f:
        w = Hashing(f)
        torch.save(state_dict(32), w)
    assert sha256_of_object(s3, f"{prefix}/h.pt") == w.h.hexdigest()


def test_dcp_save_and_load(mounter: Mounter, s3, prefix: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optim.step()
    sd = {"model": model.state_dict(), "step": 7}
    mnt = mounter()
    ckpt = mnt.path / "dcp" / "step_7"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns and runs single-process
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    keys = s3_keys(s3, f"{prefix}/dcp/step_7/")
    assert f"{prefix}/dcp/step_7/.metadata" in keys
    assert not any(k.endswith(".tmp") for k in keys)
    mnt.unmount()

    fresh = mounter()
    target = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    out = {"model": target.state_dict(), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(fresh.path / "dcp" / "step_7")))
    assert out["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(out["model"][k], v), k


def test_safetensors_save_and_load(mounter: Mounter, s3, prefix: str) -> None:
    from safetensors.torch import load_file, safe_open, save_file

    tensors = {"a": torch.randn(512, 512), "b": torch.arange(1000, dtype=torch.int64)}
    mnt = mounter()
    save_file(tensors, str(mnt.path / "model.safetensors"), metadata={"format": "pt"})
    assert f"{prefix}/model.safetensors" in s3_keys(s3, prefix)
    mnt.unmount()
    fresh = mounter()
    loaded = load_file(str(fresh.path / "model.safetensors"))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(str(fresh.path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("b"), tensors["b"])


@pytest.mark.parametrize("durability", ["close", "async"])
def test_orbax_checkpoint_manager_rotates_and_restores(mounter: Mounter, s3, prefix: str,
                                                       durability: str) -> None:
    """Orbax commits a step by renaming its temporary directory and deletes old steps with
    rmtree from a background thread (in async mode that failed with ENOTEMPTY: issue 44).
    Five saves with max_to_keep=2, the latest restored; then a restarted job on a fresh
    mount (an empty cache: every byte from S3) restores it again."""
    mnt = mounter("--durability", durability)
    ckpts = mnt.path / "ckpts"
    r = subprocess.run([sys.executable, str(ORBAXCHECK), str(ckpts), "save"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + mnt.log[-3000:]
    assert run_ckptfs("sync", str(mnt.path)).returncode == 0
    steps = {k.split("/")[2] for k in s3_keys(s3, prefix + "/ckpts/")}
    assert steps - {""} == {"3", "4"}  # ("": the directory's own marker object)
    mnt.unmount()
    fresh = mounter("--durability", durability)
    r = subprocess.run([sys.executable, str(ORBAXCHECK), str(fresh.path / "ckpts"), "restore"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

"""Orbax's CheckpointManager through a mount, as a trainer that rotates checkpoints uses it.

    python tests/orbaxcheck.py DIR save      # five saves, max_to_keep=2, restore the latest
    python tests/orbaxcheck.py DIR restore   # a new manager (a restarted job): restore the latest

Orbax commits each step by renaming `N.orbax-checkpoint-tmp-*` to `N` and deletes old steps
with rmtree from a background thread: the rotation that failed with ENOTEMPTY in async mode
(issue 44). Exits non-zero, with the reason on stderr, if anything differs.
"""

from __future__ import annotations

import os
import sys

import numpy as np

STEPS = 5
KEEP = 2


def state(step: int) -> dict:
    return {"w": np.arange(4096, dtype=np.float32) * step,
            "b": np.full((16, 16), step, dtype=np.int32), "step": step}


def main() -> int:
    directory, what = sys.argv[1], sys.argv[2]
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True)
    with ocp.CheckpointManager(directory, options=options) as manager:
        if what == "save":
            for step in range(STEPS):
                manager.save(step, args=ocp.args.StandardSave(state(step)))
            manager.wait_until_finished()
        want = list(range(STEPS - KEEP, STEPS))
        if manager.all_steps() != want:
            print(f"steps {manager.all_steps()}, want {want}", file=sys.stderr)
            return 1
        on_disk = sorted(os.listdir(directory))
        if on_disk != [str(s) for s in want]:
            print(f"the directory holds {on_disk}", file=sys.stderr)
            return 1
        latest = manager.latest_step()
        restored = manager.restore(latest, args=ocp.args.StandardRestore(state(0)))
    expected = state(STEPS - 1)
    if int(restored["step"]) != expected["step"] or not all(
            np.array_equal(restored[k], expected[k]) for k in ("w", "b")):
        print(f"restored step {restored['step']} differs from what was saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

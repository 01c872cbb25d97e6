"""ckptfs's write rows for two source trees in one run: before and after a change.

    git archive REV ckptfs | tar -x -C /tmp/before
    .venv/bin/python bench/compare_trees.py /tmp/before [--rounds 3] [--writers 8 --writer-mib 128]
        [--both-args "--passthrough off"]

Both trees' daemons run against one SeaweedFS (each mount's `python -m ckptfs` gets the
tree on PYTHONPATH), one 1 GiB file and N ranks at once, close and async mode, with the
two trees and the two modes alternating which goes first each round. The table gives
each row's time, daemon CPU seconds per GiB and peak RSS (write_bench.py's rows).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench as wb  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="a directory holding the other tree's ckptfs package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--writer-mib", type=int, default=128)
    ap.add_argument("--work", default="/var/tmp")
    ap.add_argument("--after-args", default="", help='options for the after tree\'s mounts only, '
                    'e.g. "--passthrough off" (the before tree may not know them)')
    ap.add_argument("--both-args", default="", help='options for both trees\' mounts, '
                    'e.g. "--passthrough off" (the daemon\'s own write path in both)')
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.before, "ckptfs", "__init__.py")):
        ap.error(f"no ckptfs package in {args.before} (git archive REV ckptfs | tar -x -C DIR)")
    trees = {"before": os.path.abspath(args.before), "after": HERE}
    wb._stop_on_sigterm()
    work = tempfile.mkdtemp(prefix="ckptfs-compare-", dir=args.work)
    # `python -m ckptfs` puts the current directory first on sys.path: from a checkout it
    # would run that checkout's CLI whatever PYTHONPATH says.
    os.chdir(work)
    server = wb.start_server(work)
    bench = wb.Bench(work, server)
    bench.passthrough_modes = [None]  # each tree's own default, unless --after-args says
    try:
        big = os.path.join(work, "random-1g.bin")
        with open(big, "wb") as f:
            for _ in range(16):
                f.write(os.urandom(64 * wb.MiB))
        rank = wb.random_file(os.path.join(work, "rank.bin"), args.writer_mib)
        for rnd in range(args.rounds):
            bench.round, start = rnd, len(bench.rows)
            for name in (["before", "after"] if rnd % 2 == 0 else ["after", "before"]):
                bench.env = dict(bench.env, PYTHONPATH=trees[name])
                bench.ckptfs_args = shlex.split(args.both_args) + (
                    shlex.split(args.after_args) if name == "after" else [])
                bench.ckptfs_both(f"file-1GiB {name}", bench.copy_writer(big), os.path.getsize(big))
                bench.ckptfs_both(f"writers-{args.writers}x{args.writer_mib}MiB {name}",
                                  bench.parallel_writer(rank, args.writers),
                                  args.writers * args.writer_mib * wb.MiB)
            for row in bench.rows[start:]:
                row.round = rnd
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
        print(wb.report(bench))
        return 0
    except RuntimeError as exc:
        print(f"compare_trees: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""An ordinary PyTorch training loop. Nothing in it knows about ckptfs or S3.

It saves {model, optimizer, step} with plain torch.save every --save-every steps
to CKPT_DIR/step_N/model.pt, and at start resumes from the latest checkpoint there.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch


def latest_checkpoint(ckpt_dir: str) -> str | None:
    steps = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        m = re.fullmatch(r"step_(\d+)", name)
        if m and os.path.exists(os.path.join(ckpt_dir, name, "model.pt")):
            steps.append(int(m.group(1)))
    return os.path.join(ckpt_dir, f"step_{max(steps)}", "model.pt") if steps else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt_dir")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU())])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = 0
    path = latest_checkpoint(args.ckpt_dir)
    if path:
        t = time.monotonic()
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        print(f"resumed from {path} at step {start} (load took {time.monotonic() - t:.2f}s)", flush=True)
    else:
        print("no checkpoint found: starting from step 0", flush=True)

    data = torch.randn(64, args.hidden)
    for step in range(start + 1, args.steps + 1):
        loss = (model(data) - data).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % args.save_every == 0:
            out = os.path.join(args.ckpt_dir, f"step_{step}")
            os.makedirs(out, exist_ok=True)
            t = time.monotonic()
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step},
                       os.path.join(out, "model.pt"))
            stall = time.monotonic() - t
            size = os.path.getsize(os.path.join(out, "model.pt"))
            print(f"step {step}: loss {loss.item():.4f}, saved {size / 2**20:.1f} MiB "
                  f"in {stall:.2f}s", flush=True)
    print(f"finished at step {args.steps}", flush=True)


if __name__ == "__main__":
    main()

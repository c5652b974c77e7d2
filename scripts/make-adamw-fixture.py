#!/usr/bin/env python3
"""Write the AdamW reference fixture the server's optimizer is checked against.

Runs torch.optim.AdamW for a few steps on two small tensors (a weight with
weight decay, a bias without: two parameter groups), with a linear warm-up then
cosine decay of the learning rate (torch.optim.lr_scheduler.LambdaLR) and
global-norm clipping (torch.nn.utils.clip_grad_norm_), and stores the initial
parameters, every step's gradient, torch's parameters after every step and the
rates in a JSON file.

Usage (any Python with torch):
    PYTHON scripts/make-adamw-fixture.py --out tests/fixtures/adamw-warmup-cosine.json
"""
import argparse
import json
import math

import torch

CONFIG = {
    "lr": 0.05,
    "beta1": 0.9,
    "beta2": 0.98,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "warmup_steps": 2,
    "warmup_start": 0.1,
    "total_steps": 6,
    "min_lr": 0.005,
    "clip_grad_norm": 2.0,
    "steps": 6,
}
TENSORS = [("layers.0.weight", 12), ("layers.0.bias", 4)]
NO_DECAY = ["bias"]


def factor(step):
    """The schedule of ps_shared::config::ScheduleSection::lr_at, over lr."""
    c = CONFIG
    if step < c["warmup_steps"]:
        s = c["warmup_start"]
        return s + (1.0 - s) * step / c["warmup_steps"]
    t = step - c["warmup_steps"]
    span = c["total_steps"] - c["warmup_steps"]
    lo = c["min_lr"]
    if t >= span:
        return lo / c["lr"]
    rate = lo + (c["lr"] - lo) * 0.5 * (1.0 + math.cos(math.pi * t / span))
    return rate / c["lr"]


def floats(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    params = [torch.nn.Parameter(torch.randn(n) * 0.5) for _, n in TENSORS]
    initial = [floats(p) for p in params]
    groups = [
        {
            "params": [p],
            "weight_decay": 0.0
            if any(pat in name for pat in NO_DECAY)
            else CONFIG["weight_decay"],
        }
        for (name, _), p in zip(TENSORS, params)
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=CONFIG["lr"],
        betas=(CONFIG["beta1"], CONFIG["beta2"]),
        eps=CONFIG["eps"],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    steps = []
    for step in range(CONFIG["steps"]):
        # Some steps' gradients are far above the clipping norm, some below.
        scale = 3.0 if step % 2 == 0 else 0.2
        grads = [torch.randn(n) * scale for _, n in TENSORS]
        lr = opt.param_groups[0]["lr"]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, CONFIG["clip_grad_norm"])
        opt.step()
        sched.step()
        steps.append(
            {
                "lr": lr,
                "grad": sum((floats(g) for g in grads), []),
                "norm": float(norm),
                "params": sum((floats(p) for p in params), []),
            }
        )
    fixture = {
        "source": f"torch {torch.__version__}, torch.optim.AdamW + LambdaLR + clip_grad_norm_",
        "config": CONFIG,
        "tensors": [{"name": n, "numel": k} for n, k in TENSORS],
        "no_decay": NO_DECAY,
        "initial": sum(initial, []),
        "steps": steps,
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

"""Torch reference for bench-compute: mean milliseconds of forward, backward
and flattening the gradients of an MLP, on a fixed random batch.

Prints one number (ms per step). Run by target/release/bench-compute --python.
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--hidden", default="1024,1024")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    widths = [a.features] + [int(h) for h in a.hidden.split(",") if h] + [a.classes]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    x = torch.randn(a.batch, a.features)
    y = torch.randint(0, a.classes, (a.batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        return float(loss), flat

    step()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    print(1e3 * (time.perf_counter() - t) / a.steps)


if __name__ == "__main__":
    main()

"""Torch side of bench-compute: the same networks, timed on a fixed random batch.

Run by target/release/bench-compute --python PYTHON, which starts one process per
thread count:

    python scripts/torch_compute.py --serve --threads N

and sends it commands on stdin, one per line:

    setup NET BATCH     -> "ok PARAMS FIRST_STEP_MS"
    run STEPS           -> "ok FWD_BWD_MS STEP_MS CPU_MS" (means over the steps;
                           CPU_MS: CPU time of all the process's threads per step)

A step is zero_grad, forward, cross-entropy, backward (FWD_BWD), then the
worker's error-feedback top-k on the flattened gradient with the default
compression settings: u = 0.9 u + g; v += u; the top 1% of |v| (torch.topk)
is taken out, and zeroed in v and u (STEP = all of it).

A new network is one builder in BUILDERS under the name bench-compute uses.
"""
import argparse
import os
import sys
import time

import torch

# The GPT preset's torch twin (the same module gpt_torch.rs's fixture comes from).
from torch_gpt import Gpt

# The ResNet presets' torch twin, shared with bench-peers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_peers"))
from models import ResNet  # noqa: E402

nn = torch.nn

DENSITY = 0.01
MOMENTUM_CORRECTION = 0.9


def resnet(widths, blocks, strides, width, classes):
    """CIFAR-style ResNet: 3x3 stem conv-bn-relu, stages of basic blocks,
    global average pool, linear (the worker's resnet presets; the network
    of bench-peers, named as the worker names its parameters)."""
    return ResNet([max(1, round(w * width)) for w in widths], blocks, strides, classes)


def mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def cnn(channels, side, conv, hidden, classes):
    """kind = "cnn": per conv width a 3x3 conv (padding 1, bias), ReLU and a
    2x2 max-pool; then fully connected layers with ReLU between them."""
    layers = []
    cin = channels
    for c in conv:
        layers += [nn.Conv2d(cin, c, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2)]
        cin = c
        side //= 2
    layers.append(nn.Flatten())
    layers.append(mlp([cin * side * side] + hidden + [classes]))
    return nn.Sequential(*layers)


# name: (builder, input shape of one sample)
BUILDERS = {
    "mlp": (lambda: mlp([256, 1024, 1024, 10]), (256,)),
    "cnn": (lambda: cnn(1, 28, [8, 16], [64], 10), (1, 28, 28)),
    "cnn16": (lambda: cnn(1, 16, [16, 32], [], 10), (1, 16, 16)),
    "resnet20": (lambda: resnet([16, 32, 64], 3, [1, 2, 2], 1.0, 10), (3, 32, 32)),
    "resnet18": (lambda: resnet([64, 128, 256, 512], 2, [1, 2, 2, 2], 0.5, 10), (3, 32, 32)),
    # The GPT preset's shape (bench-compute's `gpt`): vocab 256, context
    # 128, d_model 256, 4 layers, 4 heads; inputs are token windows.
    "gpt": (lambda: Gpt(256, 128, 256, 4, 4), None),
}


class Bench:
    def __init__(self, name, batch):
        build, shape = BUILDERS[name]
        torch.manual_seed(1)
        self.model = build()
        self.model.train()
        if shape is None:
            # A language model: `batch` windows of seq_len + 1 tokens.
            vocab, seq_len = self.model.wte.num_embeddings, self.model.wpe.num_embeddings
            tokens = torch.randint(0, vocab, (batch, seq_len + 1))
            self.forward_loss = lambda: self.model.loss(tokens)
        else:
            x = torch.randn(batch, *shape)
            y = torch.randint(0, 10, (batch,))
            loss_fn = nn.CrossEntropyLoss()
            self.forward_loss = lambda: loss_fn(self.model(x), y)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.k = max(1, round(DENSITY * self.params))
        self.u = torch.zeros(self.params)
        self.v = torch.zeros(self.params)

    def step(self):
        """Milliseconds of forward + backward, and of the compression after it."""
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        loss.backward()
        t1 = time.perf_counter()
        with torch.no_grad():
            g = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
            self.u.mul_(MOMENTUM_CORRECTION).add_(g)
            self.v.add_(self.u)
            idx = torch.topk(self.v.abs(), self.k, sorted=False).indices
            sent = self.v[idx]
            self.v[idx] = 0.0
            self.u[idx] = 0.0
        t2 = time.perf_counter()
        del sent, loss
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"ready torch {torch.__version__} threads {torch.get_num_threads()}", flush=True)
    bench = None
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["setup"] and len(words) >= 3:
            bench = Bench(words[1], int(words[2]))
            fb, c = bench.step()
            print(f"ok {bench.params} {fb + c}", flush=True)
        elif words[:1] == ["run"] and len(words) == 2 and bench is not None:
            steps = int(words[1])
            fb = total = 0.0
            cpu0 = time.process_time()
            for _ in range(steps):
                f, c = bench.step()
                fb += f
                total += f + c
            n = max(1, steps)
            cpu = 1e3 * (time.process_time() - cpu0)
            print(f"ok {fb / n} {total / n} {cpu / n}", flush=True)
        else:
            print(f"error: unknown command {line.strip()!r}", flush=True)


if __name__ == "__main__":
    main()

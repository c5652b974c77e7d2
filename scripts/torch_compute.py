"""Torch reference for bench-compute: mean milliseconds of forward, backward
and flattening the gradients of an MLP (or, with --model resnet20, of the
ResNet-20 preset on 3x32x32 images), on a fixed random batch.

Prints one number (ms per step). Run by target/release/bench-compute --python.
"""
import argparse
import time

import torch


class Block(torch.nn.Module):
    """Basic block: conv-bn-relu-conv-bn plus the input (or a 1x1 conv-bn
    projection of it when the shape changes), then relu."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        skip = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(h + skip)


def resnet20(width, classes):
    nn = torch.nn
    widths = [max(1, int(w * width + 0.5)) for w in (16, 32, 64)]
    layers = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for w, stride in zip(widths, (1, 2, 2)):
        for b in range(3):
            layers.append(Block(cin, w, stride if b == 0 else 1))
            cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp", choices=["mlp", "resnet20"])
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--hidden", default="1024,1024")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    if a.model == "resnet20":
        model = resnet20(a.width, a.classes)
        model.train()
        x = torch.randn(a.batch, 3, 32, 32)
    else:
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

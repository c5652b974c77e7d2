"""Torch reference for gpu-check --bench: the median milliseconds of one
forward + backward of the ResNet-20 or ResNet-18 preset (CIFAR-style, on
3x32x32 inputs, 10 classes, training mode), with the gradients flattened and
copied to the host as the Stratus worker does, on a fixed random batch.

Prints one number (ms per step). Run by gpu-check --python PYTHON.
"""
import argparse
import time

import torch


class Block(torch.nn.Module):
    """conv3x3(stride)-bn-relu-conv3x3-bn plus the input, or a 1x1
    conv(stride)-bn projection of it when the shape changes; then relu."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.project = None
        if stride != 1 or cin != cout:
            self.project = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        skip = x if self.project is None else self.project(x)
        return torch.relu(self.body(x) + skip)


def resnet(widths, blocks, strides, width, classes):
    nn = torch.nn
    widths = [max(1, int(w * width + 0.5)) for w in widths]
    layers = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for w, stride in zip(widths, strides):
        for b in range(blocks):
            layers.append(Block(cin, w, stride if b == 0 else 1))
            cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet20", choices=["resnet20", "resnet18"])
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(1)
    if a.model == "resnet20":
        model = resnet((16, 32, 64), 3, (1, 2, 2), a.width, 10)
    else:
        model = resnet((64, 128, 256, 512), 2, (1, 2, 2, 2), a.width, 10)
    model = model.to(dev).train()
    x = torch.randn(a.batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (a.batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()

    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    print(times[len(times) // 2])


if __name__ == "__main__":
    main()

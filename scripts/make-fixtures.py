"""Torch reference fixtures for the worker's tests (no Python needed to run
them: the fixtures are committed).

    <python with torch, numpy, safetensors> scripts/make-fixtures.py [--model NAME]

Writes worker/tests/fixtures/<NAME>.safetensors for each model in MODELS (or
only NAME). One file per model; every file holds:

  input            [batch, features] f32, NCHW samples flattened
  labels           [batch] f32 (class indices)
  loss             [1] f32, the mean cross-entropy of one training-mode step
  param.<tensor>   the initial value of every parameter, named as the
                   Stratus flat layout names it (ModelSection::layout)
  grad.<tensor>    torch's gradient of the loss for that parameter
  running_mean.<i>, running_var.<i>
                   batch-norm layer i's running statistics after the step
                   (only for models with batch norm)

A model's entry gives its Stratus [model] settings (as a comment for the
test that mirrors them) and a builder returning (module, [(stratus name,
torch parameter)], [batch-norm modules in Stratus order], input shape,
classes). To add a model (a GPT, an optimiser step), add a builder and
keep the key layout above; extra keys are fine.
"""
import argparse
import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_compute import Block as BasicBlock  # noqa: E402  (the same basic block)

nn = torch.nn


class Block(BasicBlock):
    """Stratus `residual` (the basic block of scripts/torch_compute.py),
    with its parameters under Stratus's names."""

    def named(self, prefix):
        out = [
            (f"{prefix}.conv1.weight", self.conv1.weight),
            (f"{prefix}.bn1.weight", self.bn1.weight),
            (f"{prefix}.bn1.bias", self.bn1.bias),
            (f"{prefix}.conv2.weight", self.conv2.weight),
            (f"{prefix}.bn2.weight", self.bn2.weight),
            (f"{prefix}.bn2.bias", self.bn2.bias),
        ]
        norms = [self.bn1, self.bn2]
        if self.shortcut is not None:
            out += [
                (f"{prefix}.shortcut.conv.weight", self.shortcut[0].weight),
                (f"{prefix}.shortcut.bn.weight", self.shortcut[1].weight),
                (f"{prefix}.shortcut.bn.bias", self.shortcut[1].bias),
            ]
            norms.append(self.shortcut[1])
        return out, norms


def layered_cnn():
    """Stratus: kind = "layers", input = 3 * 8 * 8, in_channels = 3,
    classes = 5, layers = conv2d(out 4, kernel 3, bias) - batch_norm - relu -
    residual(4) - max_pool(2) - residual(8, stride 2) - avg_pool(kernel 2,
    stride 1) - flatten - linear(6) - relu - linear(5)."""
    conv = nn.Conv2d(3, 4, 3, 1, 1, bias=True)
    bn = nn.BatchNorm2d(4)
    b3 = Block(4, 4, 1)
    b5 = Block(4, 8, 2)
    fc1 = nn.Linear(8 * 1 * 1, 6)
    fc2 = nn.Linear(6, 5)
    model = nn.Sequential(
        conv, bn, nn.ReLU(), b3, nn.MaxPool2d(2), b5, nn.AvgPool2d(2, 1),
        nn.Flatten(), fc1, nn.ReLU(), fc2,
    )
    named = [
        ("layers.0.weight", conv.weight),
        ("layers.0.bias", conv.bias),
        ("layers.1.weight", bn.weight),
        ("layers.1.bias", bn.bias),
    ]
    n3, norms3 = b3.named("layers.3")
    n5, norms5 = b5.named("layers.5")
    named += n3 + n5
    named += [
        ("layers.8.weight", fc1.weight),
        ("layers.8.bias", fc1.bias),
        ("layers.10.weight", fc2.weight),
        ("layers.10.bias", fc2.bias),
    ]
    return model, named, [bn] + norms3 + norms5, (3, 8, 8), 5


MODELS = {"layered_cnn": layered_cnn}


def make(name, out_dir, batch=4, seed=0):
    torch.manual_seed(seed)
    model, named, norms, shape, classes = MODELS[name]()
    # Batch-norm scales and shifts away from 1 / 0 so their gradients
    # (and the paths through them) are exercised.
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
    model = model.double().train()
    x = torch.randn(batch, *shape, dtype=torch.float64)
    y = torch.arange(batch) % classes
    params = {f"param.{n}": p.detach().float().numpy().copy() for n, p in named}
    # The reference runs in float64 from the float32 initial values.
    with torch.no_grad():
        for n, p in named:
            p.copy_(torch.from_numpy(params[f"param.{n}"]).double())
        x = x.float().double()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    out = dict(params)
    out["input"] = x.reshape(batch, -1).float().numpy()
    out["labels"] = y.float().numpy()
    out["loss"] = np.array([loss.item()], dtype=np.float32)
    for n, p in named:
        out[f"grad.{n}"] = p.grad.float().numpy()
    for i, m in enumerate(norms):
        out[f"running_mean.{i}"] = m.running_mean.float().numpy()
        out[f"running_var.{i}"] = m.running_var.float().numpy()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.safetensors")
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, path)
    print(f"{path}: loss {loss.item():.6f}, {len(named)} parameter tensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), help="only this fixture")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument(
        "--out", default=os.path.join(here, "..", "worker", "tests", "fixtures")
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in [args.model] if args.model else sorted(MODELS):
        make(name, os.path.normpath(args.out))


if __name__ == "__main__":
    main()

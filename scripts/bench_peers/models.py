"""The torch side's models for scripts/bench-peers.sh, named as Stratus names
them, so one safetensors file of initial weights starts both sides alike.

* `mlp`: built in ddp_train.py (uniform(+-1/sqrt(fan_in)) from the seed, as
  the Stratus worker's MLP; no shared file needed).
* `resnet20`: the worker's `model.kind = "resnet20"` preset on 3x32x32
  inputs given as 3072 channel-major features: a 3x3 stem conv (16, no
  bias) with batch norm and ReLU, three stages of three basic blocks (16,
  32, 64 channels; the first block of stages 2 and 3 has stride 2 and a 1x1
  conv + batch-norm projection), global average pool, linear. Parameter
  names and shapes are Stratus's (`stem.conv.weight`,
  `stage2.block0.shortcut.bn.bias`, `fc.weight`, ...); batch norm keeps
  torch's running statistics for evaluation (Stratus recomputes its own from
  recent training batches before each evaluation).
* `gpt`: the worker's `model.kind = "gpt"` preset, scripts/torch_gpt.py's
  `Gpt` (nanoGPT names, tied output head): its input is a window of
  seq_len + 1 byte tokens, its loss the mean next-token cross-entropy.
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_gpt import Gpt, adamw, window_loss  # noqa: E402,F401

# bench-peers's GPT: byte tokens, context 64, d_model 128, 4 layers, 4 heads.
GPT = {"vocab": 256, "d_model": 128, "n_layer": 4, "n_head": 4}

RESNET20 = {"widths": (16, 32, 64), "blocks": 3, "strides": (1, 2, 2)}


class ConvBn(nn.Module):
    def __init__(self, cin, cout, kernel, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.bn(self.conv(x))


class Block(nn.Module):
    """conv1-bn1-relu-conv2-bn2 plus the input or its projection, then relu."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = ConvBn(cin, cout, 1, stride) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        skip = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(h + skip)


class ResNet(nn.Module):
    def __init__(self, widths, blocks, strides, classes, channels=3, side=32):
        super().__init__()
        self.shape = (channels, side, side)
        self.stem = ConvBn(channels, widths[0], 3, 1)
        cin = widths[0]
        for s, (w, stride) in enumerate(zip(widths, strides), start=1):
            stage = nn.Module()
            for b in range(blocks):
                stage.add_module(f"block{b}", Block(cin, w, stride if b == 0 else 1))
                cin = w
            self.add_module(f"stage{s}", stage)
        self.stages = len(widths)
        self.blocks = blocks
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = torch.relu(self.stem(x.view(x.shape[0], *self.shape)))
        for s in range(1, self.stages + 1):
            stage = getattr(self, f"stage{s}")
            for b in range(self.blocks):
                h = getattr(stage, f"block{b}")(h)
        return self.fc(h.mean(dim=(2, 3)))


def resnet20(features, classes, seed):
    """ResNet-20 on `features` = 3 x side x side inputs, torch's default
    initialisation from `seed` (the values are then shared through a file)."""
    side = int(round((features / 3) ** 0.5))
    if 3 * side * side != features:
        raise SystemExit(f"resnet20 needs 3 x side x side features, not {features}")
    torch.manual_seed(seed)
    return ResNet(RESNET20["widths"], RESNET20["blocks"], RESNET20["strides"], classes, 3, side)


def gpt(seq_len, seed):
    """The GPT of bench-peers for windows of seq_len + 1 tokens, nanoGPT's
    initialisation from `seed` (the values are then shared through a file)."""
    torch.manual_seed(seed)
    return Gpt(GPT["vocab"], seq_len, GPT["d_model"], GPT["n_layer"], GPT["n_head"])


def build(name, features, classes, seed):
    """The model `name` ("resnet20" or "gpt") for a dataset of `features`
    (for the GPT: windows of seq_len + 1 tokens) and `classes`, from `seed`."""
    if name == "resnet20":
        return resnet20(features, classes, seed)
    if name == "gpt":
        return gpt(features - 1, seed)
    raise SystemExit(f"no shared-weights model {name!r} (resnet20 or gpt)")


def save_init(model, path):
    """Every parameter (not the batch-norm statistics) as f32 safetensors."""
    from safetensors.torch import save_file

    save_file({n: p.detach().contiguous().float() for n, p in model.named_parameters()}, path)


def load_init(model, path):
    """Load a file written by save_init: every parameter by name and shape."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise SystemExit(f"{path}: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise SystemExit(f"{path}: {name} is {tuple(tensors[name].shape)}, want {tuple(p.shape)}")
            p.copy_(tensors[name])

"""Writes tests/fixtures/gpt-tiny.safetensors: the torch reference for the GPT
preset's equality test (worker/tests/gpt_torch.rs, which needs no Python).

    python scripts/make-gpt-fixture.py  (run with a Python that has torch and safetensors)

A 2-layer GPT (vocab 32, seq_len 8, d_model 16, 2 heads, d_ff 64) with random
weights (biases and LayerNorm parameters too, so every gradient is exercised),
one batch of 3 windows, and torch's loss and gradients computed in float64:
  param.<name>  initial weights (f32)     grad.<name>  gradients (f32)
  tokens        the batch (f32 ids, 3 x 9) loss        the mean token loss (f32, [1])
The sizes are in the file's metadata.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import Gpt  # noqa: E402

SIZES = dict(vocab=32, seq_len=8, d_model=16, n_layer=2, n_head=2, d_ff=64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "tests/fixtures/gpt-tiny.safetensors"))
    a = ap.parse_args()
    torch.manual_seed(23)
    m = Gpt(**SIZES)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    params = {n: p.detach().float().clone() for n, p in m.named_parameters()}
    m = m.double()
    tokens = torch.randint(0, SIZES["vocab"], (3, SIZES["seq_len"] + 1))
    loss = m.loss(tokens)
    loss.backward()
    out = {"tokens": tokens.float(), "loss": loss.detach().float().reshape(1)}
    for n, p in m.named_parameters():
        out["param." + n] = params[n].contiguous()
        out["grad." + n] = p.grad.float().contiguous()
    save_file(out, a.out, metadata={k: str(v) for k, v in SIZES.items()})
    print(f"wrote {a.out}: loss {loss.item():.6f}, {len(params)} tensors")


if __name__ == "__main__":
    main()

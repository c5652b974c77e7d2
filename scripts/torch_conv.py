"""Torch reference for bench-conv: mean milliseconds of one 2-d convolution's
forward, input gradient and weight gradient, per shape, on fixed random data.

Usage: torch_conv.py --batch 32 --threads 1 --iters 20 --shapes 'C,O,H,K,S,P;...'
(square H x H inputs, NCHW, no bias). Prints one line per shape:
`index forward_ms input_grad_ms weight_grad_ms both_grads_ms` (the last
is one call for both gradients, as autograd makes it). Run by
target/release/bench-conv --python.
"""
import argparse
import time

import torch


def mean_ms(fn, iters):
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1000.0 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    conv_bwd = torch.ops.aten.convolution_backward
    with torch.no_grad():
        for i, spec in enumerate(args.shapes.split(";")):
            c, o, h, k, s, p = (int(v) for v in spec.split(","))
            x = torch.randn(args.batch, c, h, h)
            w = torch.randn(o, c, k, k)
            y = torch.nn.functional.conv2d(x, w, None, s, p)
            dy = torch.randn_like(y)

            def forward():
                torch.nn.functional.conv2d(x, w, None, s, p)

            def grad(mask):
                return lambda: conv_bwd(
                    dy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, mask
                )

            fwd = mean_ms(forward, args.iters)
            dx = mean_ms(grad([True, False, False]), args.iters)
            dw = mean_ms(grad([False, True, False]), args.iters)
            both = mean_ms(grad([True, True, False]), args.iters)
            print(f"{i} {fwd:.4f} {dx:.4f} {dw:.4f} {both:.4f}", flush=True)


if __name__ == "__main__":
    main()

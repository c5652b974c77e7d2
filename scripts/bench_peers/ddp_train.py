"""One rank of the PyTorch DDP side of scripts/bench-peers.sh.

Trains the benchmark's model (the MLP, ResNet-20 or the GPT of models.py)
with DistributedDataParallel over gloo (CPU), dense
or with the PowerSGD communication hook, on a Stratus dataset read from its
files (see stratus_dataset.py), and writes a JSON report shaped like the one of
`ps-worker train --report`:

    steps, train_s, compute_s, comm_s, data_wait_s,
    bytes_pushed_per_step, bytes_pulled_per_step, final_accuracy, stop_reason,
    evals: [{step, train_s, test_accuracy, test_loss, bytes_pushed, bytes_pulled}]

plus, per step, `step_train_s`: the training clock (evaluation left out) at
the end of each step, so the difference of two neighbours is a step's wall
time, and `startup_steps`: the steps before the steady state (1 for dense
DDP, whose first iteration builds its buckets; `--powersgd-start` for
PowerSGD, whose hook all-reduces densely until then).

What is measured, and how it lines up with Stratus:

* The model is built like the Stratus worker's MLP: weights uniform in
  +-1/sqrt(fan_in) from the run's seed, biases zero, ReLU between layers, mean
  softmax cross-entropy. DDP broadcasts rank 0's weights at the start.
* Optimizer: torch SGD with the given lr and momentum (dampening 0, no
  Nesterov), the same update rule the Stratus server applies to the averaged
  gradient; DDP also averages the gradients of the ranks. `--optimizer
  adamw` (the GPT's): torch AdamW, betas (0.9, 0.999), eps 1e-8,
  `--weight-decay` except on biases and LayerNorm parameters (names holding
  "bias" or "ln", Stratus's `optimizer.no_decay`), the learning rate
  warmed up linearly from 0 over `--warmup-steps` (Stratus's schedule with
  `warmup_start = 0`), then constant.
* GPT: the samples are windows of seq_len + 1 byte tokens (a `ps-data
  text` dataset); the loss is the mean next-token cross-entropy, the
  accuracy the share of next tokens predicted (Stratus's token accuracy).
  `--target-loss L` stops at the first evaluation whose test loss is at
  most L (Stratus's `training.target_loss`) instead of at an accuracy.
* Sample order: each epoch a permutation of the whole train split seeded by
  (seed, epoch), cut into equal parts by rank, whole batches only (the same
  scheme as Stratus's `reshuffle` partition, with numpy's generator).
* Evaluation on the whole test split every `--eval-every` steps and at the end
  of each epoch; its time (and the tiny all-reduce that makes both ranks agree
  to stop) is left out of `train_s`. The run stops after the evaluation that
  reaches `--target`, or at `--max-steps`.
* Compute vs communication: DDP all-reduces gradient buckets while the
  backward pass is still running, so the time of `backward()` mixes both. The
  script therefore first times the compute alone on a plain, non-distributed
  copy of the model (forward, backward and optimizer step, one thread, both
  ranks at once as in training): `compute_s = steps x that median`, and
  `comm_s = train_s - data_wait_s - compute_s` (never below 0), i.e. the part
  of a step that the collective and the hook (for PowerSGD: its low-rank
  matmuls and orthogonalization too) add over the compute. The raw in-DDP
  timings are kept as `ddp_forward_backward_s` and `ddp_optimizer_s`.
* Bytes: what the rank hands to all-reduce per step, scaled by 2(w-1)/w, the
  bytes a rank sends (and receives) in a ring all-reduce over w ranks. Dense
  counts every gradient; PowerSGD counts the tensors its hook all-reduces
  (vanilla all-reduce for the first `--powersgd-start` steps, then P, Q and the
  uncompressed vectors). The benchmark's wire figures come from the network
  interfaces, not from these.
"""
import argparse
import collections
import copy
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import stratus_dataset  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="dataset folder or file:// URL")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--mode", choices=["dense", "powersgd"], default="dense")
    ap.add_argument("--model", choices=["mlp", "resnet20", "gpt"], default="mlp")
    ap.add_argument("--hidden", default="1024,1024", help="mlp: hidden widths")
    ap.add_argument("--init", default="",
                    help="safetensors of the initial weights, by Stratus's names (resnet20, gpt: required)")
    ap.add_argument("--write-init", default="",
                    help="write the model's initial weights for --seed to this file and exit")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="adamw")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="adamw: linear learning-rate warm-up from 0 over this many steps")
    ap.add_argument("--seed", type=int, default=1, help="initial weights and sample order")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.97, help="test accuracy (0 = none)")
    ap.add_argument("--target-loss", type=float, default=0.0,
                    help="stop at a test loss at most this (0 = none)")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="start_powerSGD_iter: steps of plain all-reduce before PowerSGD "
                         "(2 is the least torch allows with error feedback and warm start)")
    ap.add_argument("--compute-ref-steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--report", default="")
    return ap.parse_args()


def build_model(features, hidden, classes, seed):
    """The Stratus MLP: uniform(+-1/sqrt(fan_in)) weights, zero biases."""
    widths = [features] + hidden + [classes]
    layers = []
    gen = torch.Generator().manual_seed(seed)
    for i in range(len(widths) - 1):
        lin = torch.nn.Linear(widths[i], widths[i + 1])
        bound = 1.0 / (widths[i] ** 0.5)
        with torch.no_grad():
            lin.weight.copy_(torch.rand(lin.weight.shape, generator=gen) * 2 * bound - bound)
            lin.bias.zero_()
        layers.append(lin)
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Sampler:
    """Per epoch: a seeded permutation of the train split, one equal part per rank."""

    def __init__(self, n, world, rank, seed, batch):
        self.n, self.world, self.rank, self.seed, self.batch = n, world, rank, seed, batch
        self.per_rank = n // world
        self.steps_per_epoch = self.per_rank // batch

    def batches(self, epoch):
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        part = perm[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
        for b in range(self.steps_per_epoch):
            yield part[b * self.batch:(b + 1) * self.batch]


# Training batches the batch-norm statistics are recomputed from before each
# evaluation: the Stratus worker's default `model.bn_calibration_batches`.
BN_CALIBRATION_BATCHES = 8

# The all-reduce as torch ships it, for collectives that are not training traffic.
UNCOUNTED_ALL_REDUCE = dist.all_reduce


class AllReduceBytes:
    """Counts the bytes handed to torch.distributed.all_reduce (PowerSGD's hook calls it)."""

    def __init__(self):
        self.total = 0
        self._inner = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size()
            return self._inner(tensor, *args, **kwargs)

        dist.all_reduce = counting

    def restore(self):
        dist.all_reduce = self._inner


def calibrate_bn(module, batches):
    """Batch-norm running statistics recomputed as the plain mean over
    `batches` (the last few training batches), as the Stratus worker does
    before each evaluation (`model.bn_calibration_batches`): both sides then
    evaluate on the statistics of the current weights, not on torch's slow
    running average of earlier ones."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    if not norms or not batches:
        return
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative mean over the batches below
    was_training = module.training
    module.train()
    with torch.no_grad():
        for xb in batches:
            module(xb)
    for m, mom in zip(norms, saved):
        m.momentum = mom
    module.train(was_training)


def batch_loss(module, xb, yb, text):
    """The training loss of a batch: next-token cross-entropy of token
    windows (text), else the labels' cross-entropy."""
    if text:
        return models.window_loss(module(xb), xb)
    return F.cross_entropy(module(xb), yb)


def evaluate(module, x, y, text, chunk=512):
    """Test accuracy and mean loss, in eval mode (batch norm on its running
    statistics), in chunks so a conv net's activations stay small. Text:
    the mean loss and accuracy over every next token of every window."""
    was_training = module.training
    module.eval()
    loss_sum, right, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            xb = x[i:i + chunk]
            logits = module(xb)
            if text:
                logits, target = logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1)
            else:
                target = y[i:i + chunk]
            loss_sum += F.cross_entropy(logits, target, reduction="sum").item()
            right += (logits.argmax(dim=1) == target).sum().item()
            count += len(target)
    module.train(was_training)
    return right / count, loss_sum / count


def make_optimizer(module, args):
    """SGD, or AdamW with weight decay off for biases and LayerNorm
    parameters."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=args.lr, momentum=args.momentum)
    return models.adamw(module, args.lr, args.weight_decay)


def lr_at(args, step):
    """The learning rate of 0-based step `step`: linear warm-up from 0."""
    if args.optimizer == "adamw" and step < args.warmup_steps:
        return args.lr * step / args.warmup_steps
    return args.lr


def compute_reference(model, x, y, args, sampler):
    """Median seconds of forward + backward + SGD step on a plain copy, no communication."""
    ref = copy.deepcopy(model)
    opt = make_optimizer(ref, args)
    text = args.model == "gpt"
    times = []
    def endless():
        epoch = 10_000 + args.rank  # an order of its own, not the training one
        while True:
            yield from sampler.batches(epoch)
            epoch += 1

    batches = endless()
    for i in range(args.compute_ref_steps + 2):
        idx = next(batches)
        xb, yb = x[idx], y[idx]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        batch_loss(ref, xb, yb, text).backward()
        opt.step()
        if i >= 2:  # the first two warm the allocator and kernels
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    hidden = [int(h) for h in args.hidden.split(",") if h]

    manifest = stratus_dataset.read_manifest(args.data)
    if args.write_init:
        features, classes = int(manifest["features"]), int(manifest["classes"])
        models.save_init(models.build(args.model, features, classes, args.seed), args.write_init)
        return
    if not args.report:
        raise SystemExit("--report is required")
    xtr, ytr = stratus_dataset.load_split(args.data, "train")
    xte, yte = stratus_dataset.load_split(args.data, "test")
    x, y = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xt, yt = torch.from_numpy(xte), torch.from_numpy(yte)
    features, classes = int(manifest["features"]), int(manifest["classes"])
    text = args.model == "gpt"
    if text:  # token windows: ids, not features
        if "text" not in manifest:
            raise SystemExit(f"--model gpt needs a text dataset (ps-data text), not {args.data}")
        x, xt = x.long(), xt.long()

    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    import datetime

    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    world = dist.get_world_size()

    if args.model != "mlp":
        model = models.build(args.model, features, classes, args.seed)
        if not args.init:
            raise SystemExit(f"--model {args.model} needs --init (the weights Stratus starts from)")
        models.load_init(model, args.init)
    else:
        model = build_model(features, hidden, classes, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    sampler = Sampler(len(ytr), world, args.rank, args.seed, args.batch)
    if sampler.steps_per_epoch == 0:
        raise SystemExit(f"{len(ytr)} samples over {world} ranks is less than one batch")

    dist.barrier()
    compute_ref = compute_reference(model, x, y, args, sampler)
    dist.barrier()

    if args.mode == "powersgd":
        # One gradient bucket (an explicit cap also sizes the first bucket;
        # the model is 5.3 MB). With several buckets in flight the hook's
        # chained all-reduces (uncompressed, then P, then Q) can be issued in
        # a different order on each rank under gloo, which ends in a
        # collective size mismatch.
        ddp = DDP(model, bucket_cap_mb=25)
    else:
        ddp = DDP(model)  # DDP's default buckets: dense DDP as users run it
    counter = None
    if args.mode == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start,
            use_error_feedback=True,
            warm_start=True,
            random_seed=args.seed,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        counter = AllReduceBytes()
    opt = make_optimizer(model, args)
    ring = 2.0 * (world - 1) / world

    def wire_app_bytes(steps_done):
        raw = counter.total if counter is not None else steps_done * num_params * 4
        return int(raw * ring)

    evals = []
    # The last training batches, for the batch-norm calibration.
    recent = collections.deque(maxlen=BN_CALIBRATION_BATCHES)
    step_train_s = []
    step = 0
    epoch = 0
    data_s = fb_s = opt_s = 0.0
    eval_spent = 0.0
    started = None
    stop_reason = None

    def train_s_now():
        return 0.0 if started is None else time.perf_counter() - started - eval_spent

    def do_eval():
        nonlocal eval_spent, stop_reason
        if evals and evals[-1]["step"] == step:
            return
        at = train_s_now()
        t0 = time.perf_counter()
        calibrate_bn(model, list(recent))
        acc, loss = evaluate(model, xt, yt, text, chunk=64 if text else 512)
        app = wire_app_bytes(step)
        evals.append({"step": step, "train_s": at, "test_accuracy": acc, "test_loss": loss,
                      "bytes_pushed": app, "bytes_pulled": app})
        # Both ranks hold the same parameters; stop only when both agree.
        by_acc = args.target > 0 and acc >= args.target
        by_loss = args.target_loss > 0 and loss <= args.target_loss
        flag = torch.tensor([1.0 if (by_acc or by_loss) else 0.0])
        UNCOUNTED_ALL_REDUCE(flag, op=dist.ReduceOp.MIN)
        if flag.item() > 0 and stop_reason is None:
            stop_reason = "target_accuracy" if by_acc else "target_loss"
        eval_spent += time.perf_counter() - t0

    while stop_reason is None:
        for idx in sampler.batches(epoch):
            t0 = time.perf_counter()
            if started is None:
                started = t0
            xb, yb = x[idx], y[idx]
            recent.append(xb)
            t1 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(args, step)
            opt.zero_grad(set_to_none=True)
            loss = batch_loss(ddp, xb, yb, text)
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            data_s += t1 - t0
            fb_s += t2 - t1
            opt_s += t3 - t2
            step += 1
            step_train_s.append(train_s_now())
            if args.eval_every > 0 and step % args.eval_every == 0:
                do_eval()
            if stop_reason is None and args.max_steps > 0 and step >= args.max_steps:
                stop_reason = "max_steps"
            if stop_reason is not None:
                break
        else:
            do_eval()  # end of epoch, as Stratus evaluates at every epoch end
            epoch += 1
    train_s = train_s_now()
    if counter is not None:
        counter.restore()

    compute_s = compute_ref * step
    comm_s = max(0.0, train_s - data_s - compute_s)
    app = wire_app_bytes(step)
    report = {
        "system": "ddp",
        "mode": args.mode,
        "rank": args.rank,
        "world": world,
        "num_params": num_params,
        "steps": step,
        "train_s": train_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "data_wait_s": data_s,
        "compute_ref_ms": 1e3 * compute_ref,
        "ddp_forward_backward_s": fb_s,
        "ddp_optimizer_s": opt_s,
        "bytes_pushed_per_step": app / max(step, 1),
        "bytes_pulled_per_step": app / max(step, 1),
        "final_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "stop_reason": stop_reason,
        "evals": evals,
        "step_train_s": step_train_s,
        "startup_steps": args.powersgd_start if args.mode == "powersgd" else 1,
        "settings": {
            "lr": args.lr, "momentum": args.momentum, "batch": args.batch, "seed": args.seed,
            "optimizer": args.optimizer, "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay if args.optimizer == "adamw" else None,
            "target_loss": args.target_loss or None,
            "model": args.model, "hidden": hidden if args.model == "mlp" else None,
            "threads": args.threads, "torch": torch.__version__,
            "powersgd_rank": args.powersgd_rank if args.mode == "powersgd" else None,
            "powersgd_start": args.powersgd_start if args.mode == "powersgd" else None,
        },
    }
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2)
    final_loss = evals[-1]["test_loss"] if evals else float("nan")
    print(f"ddp {args.mode} rank {args.rank} done: {step} steps, test accuracy "
          f"{100 * (report['final_accuracy'] or 0):.2f}%, test loss {final_loss:.4f}, "
          f"{1e3 * train_s / max(step, 1):.1f} ms/step "
          f"(compute {1e3 * compute_ref:.1f}), stop {stop_reason}")
    # Both ranks stop at the same step (same parameters, same evaluation);
    # leaving together keeps gloo from tearing down a pair mid-operation,
    # which has aborted a rank after its report was written.
    dist.barrier()
    # Past the barrier the run is over and its report written; gloo's
    # teardown at interpreter exit has still aborted a rank now and then
    # ("terminate called without an active exception"), which would mark a
    # finished run as failed, so leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

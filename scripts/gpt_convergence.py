"""GPT convergence against torch: the same model, initial weights, batches
and AdamW schedule trained by torch (1 process) and by a Stratus cluster
(1 ps-server: dense AdamW, top-k with lazy AdamW on the server, and top-k
of each worker's AdamW direction), then the validation losses compared. Run through scripts/bench-gpt-convergence.sh.

How both sides see the same batches in the same order:
- the corpus is one text file, so `ps-data text --tokenizer bytes` makes its
  token stream exactly the file's bytes; the stream is cut into windows of
  seq_len + 1 bytes and the last round(5%) of them are the test split (the
  script checks both counts against the manifest Stratus wrote);
- Stratus's per-epoch order is a seeded permutation made by its own
  generator (shared/src/sampler.rs: splitmix64-seeded xoshiro256** and a
  Fisher-Yates shuffle); `StratusOrder` below is the same code in Python,
  checked against the test vectors pinned in the Rust sampler's tests;
- global step g takes stream positions [g*W*B, (g+1)*W*B), rank r the r-th
  run of B; the servers apply the mean of the ranks' mean gradients, which
  is the gradient of the mean loss over the global batch torch trains on;
- both sides start from the same safetensors file (training.init_weights).
The per-step training losses of torch and the dense run are compared too:
the first steps agree to float rounding when the batches are the same.

Every number printed is computed from the runs; a miss prints MISS and the
script still exits 0.
"""

import argparse
import glob
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import Gpt, adamw  # noqa: E402

M64 = (1 << 64) - 1


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M64


class StreamRng:
    """shared/src/rng.rs: xoshiro256** seeded by splitmix64."""

    def __init__(self, seed):
        s = []
        sm = seed & M64
        for _ in range(4):
            s.append(splitmix64(sm))
            sm = (sm + 0x9E3779B97F4A7C15) & M64
        self.s = s

    def next_u64(self):
        s = self.s
        out = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return out

    def below(self, n):
        n = max(n, 1)
        threshold = ((-n) & M64) % n
        while True:
            m = self.next_u64() * n
            if (m & M64) >= threshold:
                return m >> 64


def epoch_seed(seed, epoch):
    return splitmix64(seed ^ splitmix64((epoch + 0x5851F42D4C957F2D) & M64))


def global_order(n, seed, epoch):
    """EpochSampler::global_order with partition = "reshuffle"."""
    perm = list(range(n))
    rng = StreamRng(epoch_seed(seed, epoch))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def check_order_vectors():
    # The test vectors of shared/src/sampler.rs (`the_orders_are_pinned`).
    assert global_order(10, 42, 0) == [3, 8, 6, 9, 2, 1, 5, 7, 4, 0], "epoch 0 order"
    assert global_order(10, 42, 1) == [7, 2, 6, 3, 0, 5, 8, 4, 1, 9], "epoch 1 order"


class Stream:
    """Positions of the sample stream, epoch after epoch."""

    def __init__(self, n, seed):
        self.n, self.seed, self.orders = n, seed, {}

    def at(self, pos):
        e = pos // self.n
        if e not in self.orders:
            self.orders[e] = global_order(self.n, self.seed, e)
        return self.orders[e][pos % self.n]


def lr_at(a, step):
    """ScheduleSection::lr_at for kind = "cosine", warmup_start = 0."""
    if step < a.warmup:
        return a.lr * step / a.warmup
    t, span = step - a.warmup, a.steps - a.warmup
    if t >= span:
        return a.min_lr
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * t / span))


def build_corpus(root, path, limit):
    """README, docs and the Rust sources of the repository, in a fixed
    order, as one UTF-8 text file of at most `limit` bytes (whole files)."""
    files = [os.path.join(root, "README.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    for crate in ["shared", "net", "dataset", "server", "worker", "tools", "tests", "examples"]:
        files += sorted(glob.glob(os.path.join(root, crate, "**", "*.rs"), recursive=True))
    out, used = bytearray(), 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if b"\0" in data:
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        if len(out) + len(data) > limit:
            break
        out += data
        used += 1
    with open(path, "wb") as fh:
        fh.write(bytes(out))
    return bytes(out), used


def windows_of(data, seq_len, test_fraction):
    w = seq_len + 1
    n = len(data) // w
    test = min(round(n * test_fraction), n - 1)
    t = torch.frombuffer(bytearray(data[: n * w]), dtype=torch.uint8).long().view(n, w)
    return t[: n - test], t[n - test :]


def evaluate(model, test, chunk=64):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(test), chunk):
            part = test[i : i + chunk]
            total += model.loss(part).item() * len(part)
    model.train()
    return total / len(test)


def torch_run(a, train, test, init, seed):
    torch.manual_seed(seed)
    m = Gpt(256, a.seq_len, a.d_model, a.n_layer, a.n_head)
    state = {k: v.clone() for k, v in init.items()}
    m.load_state_dict(state, strict=True)
    opt = adamw(m, a.lr, a.weight_decay)
    gb = a.workers * a.batch
    stream = Stream(len(train), a.data_seed)
    losses = []
    t0 = time.time()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        idx = [stream.at(step * gb + i) for i in range(gb)]
        opt.zero_grad(set_to_none=True)
        loss = m.loss(train[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    secs = time.time() - t0
    return evaluate(m, test), losses, secs


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --modes: the Stratus runs, each (compression, optimizer.moments).
MODES = {
    "dense": ("none", "server"),
    "topk": ("topk", "server"),
    "topk-worker": ("topk", "worker"),
}
LABELS = {
    "dense": "dense",
    "topk": "top-k lazy",
    "topk-worker": "top-k worker",
}


def stratus_config(a, path, data_dir, init_path, mode, run_dir):
    compression, moments = MODES[mode]
    topk = compression == "topk"
    threads = a.threads
    text = f"""# written by scripts/gpt_convergence.py ({mode})
[cluster]
servers = ["127.0.0.1:{free_port()}"]
shards_per_server = 1
workers = {a.workers}
token = "gpt-convergence"

[tls]
cert = "{run_dir}/certs/server.pem"
key = "{run_dir}/certs/server.key"
ca = "{run_dir}/certs/ca.pem"
ca_key = "{run_dir}/certs/ca.key"
worker_cert = "{run_dir}/certs/worker-{{rank}}.pem"
worker_key = "{run_dir}/certs/worker-{{rank}}.key"
generate_if_missing = true

[model]
kind = "gpt"

[model.gpt]
vocab = 256
seq_len = {a.seq_len}
d_model = {a.d_model}
n_layer = {a.n_layer}
n_head = {a.n_head}
d_ff = 0
dropout = 0.0

[data]
url = "file://{data_dir}"
batch_size = {a.batch}
seed = {a.data_seed}

[training]
epochs = 1000
init_weights = "{init_path}"
metrics_dir = "{run_dir}/metrics"
step_metrics_every = 1
eval_every = {a.steps}
max_steps = {a.steps}
eval_batch_size = 64
compute_threads = {threads}

[compression]
kind = "{'topk' if topk else 'none'}"
density = {a.density}
momentum_correction = 0.0
momentum_masking = false
error_feedback = true
warmup_steps = {a.topk_warmup_steps}
warmup_start_density = {a.topk_warmup_start if a.topk_warmup_steps > 0 else 0.25}

[optimizer]
kind = "adamw"
lr = {a.lr}
beta1 = 0.9
beta2 = 0.999
eps = 1e-8
weight_decay = {a.weight_decay}
no_decay = ["bias", "ln"]
moments = "{moments}"

[optimizer.schedule]
kind = "cosine"
warmup_steps = {a.warmup}
warmup_start = 0.0
total_steps = {a.steps}
min_lr = {a.min_lr}

[server]
exit_when_done = true
max_requests_per_sec = 0
"""
    with open(path, "w") as fh:
        fh.write(text)


def stratus_run(a, data_dir, init_path, mode, seed, out):
    run_dir = os.path.join(out, f"{mode}-seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cfg = os.path.join(run_dir, "cluster.toml")
    stratus_config(a, cfg, data_dir, init_path, mode, run_dir)
    server_bin = os.path.join(a.bin, "ps-server")
    worker_bin = os.path.join(a.bin, "ps-worker")
    subprocess.run([server_bin, "--config", cfg, "certs"], check=True, capture_output=True)
    procs = []
    t0 = time.time()
    try:
        with open(os.path.join(run_dir, "server.log"), "w") as log:
            procs.append(subprocess.Popen([server_bin, "--config", cfg], stdout=log, stderr=log))
        workers = []
        for r in range(a.workers):
            log = open(os.path.join(run_dir, f"worker-{r}.log"), "w")
            cmd = [worker_bin, "train", "--config", cfg, "--rank", str(r), "--no-progress",
                   "--report", os.path.join(run_dir, f"report-{r}.json")]
            p = subprocess.Popen(cmd, stdout=log, stderr=log)
            procs.append(p)
            workers.append(p)
        for p in workers:
            if p.wait(timeout=a.timeout) != 0:
                raise RuntimeError(f"{mode} seed {seed}: a worker exited {p.returncode}; see {run_dir}")
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait()
    secs = time.time() - t0
    with open(os.path.join(run_dir, "report-0.json")) as fh:
        report = json.load(fh)
    evals = [e for e in report["evals"] if e["step"] == a.steps]
    if not evals:
        raise RuntimeError(f"{mode} seed {seed}: no evaluation at step {a.steps} in {run_dir}/report-0.json")
    losses = {}
    with open(os.path.join(run_dir, "metrics", "worker-0.jsonl")) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("record") == "step":
                # Step records count from 1: record 1 is the loss of step 0.
                losses[rec["step"] - 1] = rec["loss"]
    return evals[0]["test_loss"], losses, secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--bin", default=os.path.join(root, "target", "release"))
    ap.add_argument("--out", default=os.path.join(root, "runs", "gpt-convergence"))
    ap.add_argument("--seeds", default="2,3", help="seeds of the initial weights (tune on 1 only)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16, help="per worker; torch's batch is workers x batch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--data-seed", type=int, default=7)
    ap.add_argument("--corpus-bytes", type=int, default=1_500_000)
    ap.add_argument("--corpus", default="",
                    help="train on this text file (e.g. an earlier run's corpus.txt) instead of the checkout's files")
    ap.add_argument("--threads", type=int, default=1,
                    help="compute threads of torch and of each Stratus worker")
    ap.add_argument("--modes", default="dense,topk,topk-worker",
                    help="Stratus runs, of: dense (server AdamW), topk (top-k pushes, lazy AdamW on the "
                         "server), topk-worker (top-k pushes of each worker's AdamW direction, "
                         "optimizer.moments = \"worker\")")
    ap.add_argument("--topk-warmup-steps", type=int, default=0,
                    help="top-k modes: compression.warmup_steps (exponential density warm-up; 0 = none)")
    ap.add_argument("--topk-warmup-start", type=float, default=0.25,
                    help="top-k modes: compression.warmup_start_density")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-torch", action="store_true",
                    help="skip the torch run (for tuning the Stratus modes against dense)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    check_order_vectors()

    os.makedirs(a.out, exist_ok=True)
    out = os.path.abspath(a.out)
    corpus = os.path.join(out, "corpus.txt")
    if a.corpus:
        # The corpus of an earlier run, so a later run trains on the same
        # bytes whatever the checkout holds now.
        with open(a.corpus, "rb") as fh:
            data = fh.read()
        if os.path.abspath(a.corpus) != corpus:
            with open(corpus, "wb") as fh:
                fh.write(data)
        used = None
    else:
        data, used = build_corpus(root, corpus, a.corpus_bytes)
    data_dir = os.path.join(out, "text")
    subprocess.run(
        [os.path.join(a.bin, "ps-data"), "text", "--in", corpus, "--tokenizer", "bytes",
         "--seq-len", str(a.seq_len), "--out", f"file://{data_dir}", "--overwrite"],
        check=True, capture_output=True,
    )
    train, test = windows_of(data, a.seq_len, 0.05)
    with open(os.path.join(data_dir, "manifest.json")) as fh:
        manifest = json.load(fh)
    got = (manifest["train"]["num_samples"], manifest["test"]["num_samples"])
    if got != (len(train), len(test)):
        raise RuntimeError(f"the manifest has {got} train/test windows, the script made {(len(train), len(test))}")

    sizes = Gpt(256, a.seq_len, a.d_model, a.n_layer, a.n_head)
    params = sum(p.numel() for p in sizes.parameters())
    source = f"{used} files of the repository" if isinstance(used, int) else f"{a.corpus}"
    print(f"corpus: {len(data)} bytes from {source}; "
          f"{len(train)} train / {len(test)} test windows of {a.seq_len + 1} tokens")
    print(f"model: GPT vocab 256, seq_len {a.seq_len}, d_model {a.d_model}, {a.n_layer} layers, "
          f"{a.n_head} heads: {params} parameters ({params / 1e6:.2f}M)")
    print(f"training: {a.steps} steps, {a.workers} worker(s) x batch {a.batch} (torch batch {a.workers * a.batch}), "
          f"AdamW lr {a.lr} wd {a.weight_decay}, warm-up {a.warmup}, cosine to {a.min_lr}; top-k density {a.density}")
    if a.topk_warmup_steps > 0:
        last = a.topk_warmup_steps
        print(f"top-k density warm-up: from {a.topk_warmup_start} down to {a.density} over steps 0..{last} "
              f"(exponential), then {a.density} for steps {last}..{a.steps} "
              f"({max(a.steps - last, 0) / a.steps:.0%} of the run)")
    print(f"runs: {'' if a.no_torch else 'torch, '}{', '.join(modes)}")

    rows = []
    for seed in [int(s) for s in a.seeds.split(",") if s]:
        torch.manual_seed(seed)
        init_model = Gpt(256, a.seq_len, a.d_model, a.n_layer, a.n_head)
        init = {n: p.detach().clone().contiguous() for n, p in init_model.named_parameters()}
        init_path = os.path.join(out, f"init-seed{seed}.safetensors")
        save_file(init, init_path)
        row = {"seed": seed}
        if a.no_torch:
            row["torch"], torch_losses = None, []
        else:
            row["torch"], torch_losses, row["torch_s"] = torch_run(a, train, test, init, seed)
            print(f"seed {seed}: torch val loss {row['torch']:.4f} ({row['torch_s']:.0f} s)", flush=True)
        for mode in modes:
            row[mode], losses, row[mode + "_s"] = stratus_run(a, data_dir, init_path, mode, seed, out)
            print(f"seed {seed}: stratus {mode} val loss {row[mode]:.4f} ({row[mode + '_s']:.0f} s)", flush=True)
            if mode == "dense" and losses and torch_losses:
                first = sorted(losses)[:3]
                diffs = [abs(losses[s] - torch_losses[s]) / torch_losses[s] for s in first if s < len(torch_losses)]
                print(f"seed {seed}: train loss at steps {first}: stratus "
                      f"{[round(losses[s], 5) for s in first]} torch {[round(torch_losses[s], 5) for s in first]} "
                      f"(largest relative difference {max(diffs):.1e})")
        rows.append(row)

    print()
    sparse = [m for m in modes if m != "dense"]
    head = ["seed", "torch", "dense", "dense/torch"]
    for m in sparse:
        head += [LABELS[m], f"{LABELS[m]}/dense"]
    print(f"steps {a.steps}, params {params}, PASS/MISS: dense/torch <= 1.02, top-k/dense <= 1.03")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def ratio(num, den, target):
        if num is None or den is None:
            return "n/a"
        r = num / den
        return f"{r:.4f} ({'PASS' if r <= target else 'MISS'})"

    def val(v):
        return "n/a" if v is None else f"{v:.4f}"

    for r in rows:
        cells = [str(r["seed"]), val(r["torch"]), val(r.get("dense")), ratio(r.get("dense"), r["torch"], 1.02)]
        for m in sparse:
            cells += [val(r.get(m)), ratio(r.get(m), r.get("dense"), 1.03)]
        print("| " + " | ".join(cells) + " |")
    if rows:
        mean = {k: statistics.mean(r[k] for r in rows) if rows[0][k] is not None else None
                for k in ["torch"] + modes}
        cells = ["mean", val(mean["torch"]), val(mean.get("dense")), ratio(mean.get("dense"), mean["torch"], 1.02)]
        for m in sparse:
            cells += [val(mean.get(m)), ratio(mean.get(m), mean.get("dense"), 1.03)]
        print("| " + " | ".join(cells) + " |")
        for m in sparse:
            if "dense" in modes:
                ratios = [r[m] / r["dense"] for r in rows]
                passed = sum(x <= 1.03 for x in ratios)
                print(f"{LABELS[m]}: within 3% of dense on {passed} of {len(rows)} seeds; "
                      f"worst {max(ratios):.4f}, mean of ratios {statistics.mean(ratios):.4f}")

if __name__ == "__main__":
    main()

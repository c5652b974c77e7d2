"""The GPT preset of Stratus (`model.kind = "gpt"`) written in torch.

Same tensor names and shapes as the Rust model (nanoGPT-like layout), so a
state dict moves between the two by name. Used by make-gpt-fixture.py (the
equality fixture) and as the torch side of the speed comparison:

    python scripts/torch_gpt.py --threads 1 --batch 8 --seq-len 64 \
        --d-model 128 --n-layer 4 --n-head 4 --vocab 256 --reps 20

prints the median forward+backward time in milliseconds.
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        hd = d // self.n_head
        q = q.view(b, t, self.n_head, hd).transpose(1, 2)
        k = k.view(b, t, self.n_head, hd).transpose(1, 2)
        v = v.view(b, t, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class Mlp(nn.Module):
    def __init__(self, d, d_ff, dropout):
        super().__init__()
        self.c_fc = nn.Linear(d, d_ff)
        self.c_proj = nn.Linear(d_ff, d)
        self.dropout = dropout

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x)))
        return F.dropout(y, self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, d, n_head, d_ff, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, d_ff, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab, seq_len, d_model, n_layer, n_head, d_ff=0, dropout=0.0):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.dropout = dropout
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, std)
            elif "ln_" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def logits(self, x_ids):
        """Next-token logits [batch, t, vocab] of token ids [batch, t]."""
        t = x_ids.shape[1]
        x = self.wte(x_ids) + self.wpe.weight[:t]
        x = F.dropout(x, self.dropout, self.training)
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()

    def forward(self, tokens):
        """Logits of windows of seq_len + 1 token ids (all but the last
        token as input), so DDP can wrap the model."""
        return self.logits(tokens[:, :-1])

    def loss(self, tokens):
        """Mean cross-entropy of windows of seq_len + 1 token ids."""
        return window_loss(self.logits(tokens[:, :-1]), tokens)


# Parameters without weight decay: names holding one of these, as Stratus's
# `optimizer.no_decay = ["bias", "ln"]` (biases and LayerNorm parameters).
NO_DECAY = ("bias", "ln")


def adamw(module, lr, weight_decay):
    """torch AdamW as the Stratus configs of the GPT runs set it: betas
    (0.9, 0.999), eps 1e-8, `weight_decay` except on NO_DECAY parameters."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if any(s in name for s in NO_DECAY) else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-8,
    )


def window_loss(logits, tokens):
    """Mean cross-entropy of `logits` (from tokens[:, :-1]) against the
    windows' targets tokens[:, 1:]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = Gpt(a.vocab, a.seq_len, a.d_model, a.n_layer, a.n_head)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1))
    times = []
    for i in range(a.reps + 2):
        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        m.loss(tokens).backward()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    print(f"torch_gpt_ms median={statistics.median(times):.3f} min={min(times):.3f} max={max(times):.3f}")


if __name__ == "__main__":
    main()

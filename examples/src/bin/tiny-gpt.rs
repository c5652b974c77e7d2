//! A GPT-style transformer written with candle-nn, trained on text by a
//! Stratus cluster.
//!
//! Token and position embeddings, [`N_LAYER`] pre-LayerNorm decoder blocks
//! (causal multi-head self-attention, a GELU MLP of 4 x [`D_MODEL`]) and an
//! output head tied to the token embedding, over windows of [`SEQ_LEN`]
//! byte tokens. It reads a text dataset (`ps-data text
//! --tokenizer bytes --seq-len 64`): each record is a window of
//! `SEQ_LEN + 1` tokens, the input its first `SEQ_LEN` and the targets its
//! last `SEQ_LEN`. The loss is the mean per-token cross-entropy; the
//! evaluation reports it (and the worker its perplexity) with next-token
//! accuracy. Everything else comes from Stratus.
//!
//! ```sh
//! target/release/tiny-gpt --print-layout      # the [model] section it needs
//! target/release/tiny-gpt --config configs/tiny-gpt.toml --rank 0
//! ```
//! (`scripts/local-cluster.sh --gpt` runs the whole cluster.)

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, Embedding, Init, Linear, VarBuilder, VarMap};
use ps_worker::api::{named_vars, Batch, CustomModel, Phase};

/// Byte tokens.
const VOCAB: usize = 256;
/// Tokens of context (the dataset's `--seq-len`).
const SEQ_LEN: usize = 64;
const D_MODEL: usize = 64;
const N_LAYER: usize = 2;
const N_HEAD: usize = 4;

/// LayerNorm through `ps_worker::gpt::layer_norm`, which has a backward
/// pass: candle-nn's `LayerNorm` module uses a fused op without one on
/// contiguous input, and autograd would silently stop there.
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(D_MODEL, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(D_MODEL, "bias", Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ps_worker::gpt::layer_norm(x, &self.weight, &self.bias)
    }
}

struct Block {
    ln1: Norm,
    qkv: Linear,
    proj: Linear,
    ln2: Norm,
    fc: Linear,
    out: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            ln1: Norm::new(vb.pp("ln1"))?,
            qkv: linear(D_MODEL, 3 * D_MODEL, vb.pp("attn.qkv"))?,
            proj: linear(D_MODEL, D_MODEL, vb.pp("attn.proj"))?,
            ln2: Norm::new(vb.pp("ln2"))?,
            fc: linear(D_MODEL, 4 * D_MODEL, vb.pp("mlp.fc"))?,
            out: linear(4 * D_MODEL, D_MODEL, vb.pp("mlp.out"))?,
        })
    }

    /// `x` is `[batch, seq, D_MODEL]`; `mask` is `[seq, seq]`, 0 on and
    /// below the diagonal and -inf above it.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let head = D_MODEL / N_HEAD;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        // [batch, seq, 3, heads, head] -> three [batch, heads, seq, head].
        let qkv = qkv
            .reshape((b, t, 3, N_HEAD, head))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let scores = (q.matmul(&k.t()?)? * (1.0 / (head as f64).sqrt()))?;
        // `softmax` (not the fused `softmax_last_dim`): it has a backward pass.
        let weights = candle_nn::ops::softmax(&scores.broadcast_add(mask)?, D::Minus1)?;
        let attn = weights
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, D_MODEL))?;
        let x = (x + self.proj.forward(&attn)?)?;
        let h = self.fc.forward(&self.ln2.forward(&x)?)?.gelu_erf()?;
        x + self.out.forward(&h)?
    }
}

/// An embedding table of `rows` vectors, normal with std 0.02 as in GPT-2
/// (candle-nn's `embedding` draws std 1, too large for a tied head).
fn table(rows: usize, vb: VarBuilder) -> candle_core::Result<Embedding> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    };
    let weight = vb.get_with_hints((rows, D_MODEL), "weight", init)?;
    Ok(Embedding::new(weight, D_MODEL))
}

struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    ln_f: Norm,
    mask: Tensor,
}

impl Gpt {
    fn new(vb: VarBuilder, device: &Device) -> candle_core::Result<Self> {
        let blocks = (0..N_LAYER)
            .map(|i| Block::new(vb.pp(format!("blocks.{i}"))))
            .collect::<candle_core::Result<_>>()?;
        let mask: Vec<f32> = (0..SEQ_LEN * SEQ_LEN)
            .map(|i| {
                if i % SEQ_LEN > i / SEQ_LEN {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Self {
            tokens: table(VOCAB, vb.pp("wte"))?,
            positions: table(SEQ_LEN, vb.pp("wpe"))?,
            blocks,
            ln_f: Norm::new(vb.pp("ln_f"))?,
            mask: Tensor::from_vec(mask, (SEQ_LEN, SEQ_LEN), device)?,
        })
    }

    /// Next-token logits `[batch * SEQ_LEN, VOCAB]` of input ids `[batch, SEQ_LEN]`.
    fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self
            .tokens
            .forward(ids)?
            .broadcast_add(&self.positions.forward(&pos)?)?;
        for block in &self.blocks {
            x = block.forward(&x, &self.mask)?;
        }
        let x = self.ln_f.forward(&x)?.reshape((b * t, D_MODEL))?;
        // The output head is the token embedding, transposed (tied).
        x.matmul(&self.tokens.embeddings().t()?)
    }
}

/// The inputs `[batch, SEQ_LEN]` and targets `[batch * SEQ_LEN]` of a
/// batch of token windows.
fn windows(batch: &Batch, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let w = SEQ_LEN + 1;
    if batch.dim != w {
        candle_core::bail!(
            "the dataset's windows hold {} tokens; this model needs seq_len + 1 = {w} (ps-data text --seq-len {SEQ_LEN})",
            batch.dim
        );
    }
    let mut inputs = Vec::with_capacity(batch.len() * SEQ_LEN);
    let mut targets = Vec::with_capacity(batch.len() * SEQ_LEN);
    for row in batch.features.chunks_exact(w) {
        inputs.extend(row[..SEQ_LEN].iter().map(|&t| t as u32));
        targets.extend(row[1..].iter().map(|&t| t as u32));
    }
    if let Some(bad) = inputs
        .iter()
        .chain(&targets)
        .find(|&&t| t as usize >= VOCAB)
    {
        candle_core::bail!("token id {bad} is beyond this model's vocabulary of {VOCAB}");
    }
    Ok((
        Tensor::from_vec(inputs, (batch.len(), SEQ_LEN), device)?,
        Tensor::from_vec(targets, batch.len() * SEQ_LEN, device)?,
    ))
}

fn build(device: &Device) -> candle_core::Result<CustomModel> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let gpt = std::sync::Arc::new(Gpt::new(vb, device)?);
    let (train, eval) = (gpt.clone(), gpt);
    let (train_device, eval_device) = (device.clone(), device.clone());
    Ok(CustomModel::new(
        named_vars(&varmap),
        move |batch: &Batch, _phase: Phase| {
            let (inputs, targets) = windows(batch, &train_device)?;
            candle_nn::loss::cross_entropy(&train.logits(&inputs)?, &targets)
        },
        move |batch: &Batch| {
            let (inputs, targets) = windows(batch, &eval_device)?;
            let logits = eval.logits(&inputs)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
            let correct = logits
                .argmax(D::Minus1)?
                .eq(&targets)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?;
            Ok((loss, correct / targets.dim(0)? as f32))
        },
    ))
}

fn main() {
    ps_worker::api::main(build)
}

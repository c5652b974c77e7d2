//! The GPT preset (`model.kind = "gpt"`): a decoder-only transformer on
//! windows of token ids.
//!
//! A batch holds `seq_len + 1` token ids per sample (as f32, exact below
//! 2^24): the first `seq_len` are the input, the last `seq_len` the targets.
//! The model is token + learned position embeddings, `n_layer`
//! pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP,
//! each added to the residual stream), a final LayerNorm and an output head
//! tied to the token embedding. The loss is the mean cross-entropy over every
//! target token.
//!
//! Tensor names and shapes follow nanoGPT's layout
//! ([`GptSection::layout`]), so the same weights load into a torch model.
//! Weights start like GPT-2's: normal with std 0.02, the two residual
//! projections of each block with std `0.02 / sqrt(2 n_layer)`, biases 0,
//! LayerNorm gains 1.
//!
//! On the CPU a training step without dropout, and every evaluation, runs
//! the hand-written forward and backward of [`crate::kernels::gpt`]
//! (about 1.8 times faster than the graph at one thread; the ignored test
//! `gpt_step_profile` prints both and the time of each phase). Otherwise (other
//! devices, dropout) everything runs on candle's autograd, except two fused CPU ops with
//! hand-written backward passes: layer norm (candle's fused one has no
//! backward, and the composite one takes about ten tensor passes each way)
//! and the causal softmax of the attention scores (candle's fused
//! `softmax_last_dim` has no backward either: autograd would silently stop
//! there).

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor, Var, D,
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

use ps_dataset::Batch;
use ps_shared::config::{GptSection, ModelKind, ModelSection};

use crate::kernels::gpt::{GptDims, GptExec};
use crate::model::{Model, ModelError};

/// LayerNorm's epsilon (torch's default).
pub const LN_EPS: f32 = 1e-5;

/// Tensors per decoder block in the flat layout.
const PER_BLOCK: usize = 12;

/// Initial values of every tensor, in layout order, from `rng`.
pub(crate) fn init_values(g: &GptSection, rng: &mut StdRng) -> Vec<Vec<f32>> {
    let std = 0.02f32;
    let proj_std = std / (2.0 * g.n_layer as f32).sqrt();
    g.layout()
        .iter()
        .map(|t| {
            let mut v = vec![0.0f32; t.numel()];
            if t.name.ends_with("ln_1.weight")
                || t.name.ends_with("ln_2.weight")
                || t.name == "ln_f.weight"
            {
                v.fill(1.0);
            } else if t.shape.len() == 2 {
                let s = if t.name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    std
                };
                let normal = Normal::new(0.0f32, s).expect("a positive std");
                for x in &mut v {
                    *x = normal.sample(rng);
                }
            }
            v
        })
        .collect()
}

/// Layer norm over the last dimension as one CPU pass each way:
/// `y = (x - mean) / sqrt(var + eps) * w + b`.
struct LayerNormOp;

/// A contiguous f32 CPU slice of a storage, or an error naming the op.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("layer norm wants contiguous f32 tensors"),
    }
}

/// Rows of `x` at a time in one parallel task.
const ROWS_PER_TASK: usize = 16;

fn row_stats(x: &[f32]) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = x.iter().sum::<f32>() / d;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + LN_EPS).sqrt())
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "stratus-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1)?;
        let w = f32_slice(s2, l2)?;
        let b = f32_slice(s3, l3)?;
        let d = w.len();
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(d * ROWS_PER_TASK)
            .zip(x.par_chunks(d * ROWS_PER_TASK))
            .for_each(|(ys, xs)| {
                for (y, x) in ys.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
                    let (mean, rstd) = row_stats(x);
                    for i in 0..d {
                        y[i] = (x[i] - mean) * rstd * w[i] + b[i];
                    }
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let d = w.dim(0)?;
        let (dx, dw, db) = {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let (Storage::Cpu(xs), Storage::Cpu(ws), Storage::Cpu(gs)) = (&*xs, &*ws, &*gs) else {
                candle_core::bail!("layer norm's backward runs on the CPU");
            };
            let (x, w, g) = (f32_slice(xs, xl)?, f32_slice(ws, wl)?, f32_slice(gs, gl)?);
            let mut dx = vec![0.0f32; x.len()];
            let (dw, db) = dx
                .par_chunks_mut(d * ROWS_PER_TASK)
                .zip(x.par_chunks(d * ROWS_PER_TASK))
                .zip(g.par_chunks(d * ROWS_PER_TASK))
                .fold(
                    || (vec![0.0f32; d], vec![0.0f32; d]),
                    |(mut dw, mut db), ((dxs, xs), gs)| {
                        let mut xhat = vec![0.0f32; d];
                        for ((dx, x), g) in dxs
                            .chunks_exact_mut(d)
                            .zip(xs.chunks_exact(d))
                            .zip(gs.chunks_exact(d))
                        {
                            let (mean, rstd) = row_stats(x);
                            let (mut sum_gw, mut sum_gwx) = (0.0f32, 0.0f32);
                            for i in 0..d {
                                xhat[i] = (x[i] - mean) * rstd;
                                let gw = g[i] * w[i];
                                sum_gw += gw;
                                sum_gwx += gw * xhat[i];
                                dw[i] += g[i] * xhat[i];
                                db[i] += g[i];
                            }
                            let (m1, m2) = (sum_gw / d as f32, sum_gwx / d as f32);
                            for i in 0..d {
                                dx[i] = rstd * (g[i] * w[i] - m1 - xhat[i] * m2);
                            }
                        }
                        (dw, db)
                    },
                )
                .reduce(
                    || (vec![0.0f32; d], vec![0.0f32; d]),
                    |(mut a, mut b), (c, e)| {
                        a.iter_mut().zip(&c).for_each(|(a, c)| *a += c);
                        b.iter_mut().zip(&e).for_each(|(b, e)| *b += e);
                        (a, b)
                    },
                );
            (dx, dw, db)
        };
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), dev)?),
            Some(Tensor::from_vec(dw, d, dev)?),
            Some(Tensor::from_vec(db, d, dev)?),
        ))
    }
}

/// Layer norm with a backward pass: the fused op on the CPU, candle's
/// composite ops elsewhere.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op3(w, b, LayerNormOp)
    } else {
        candle_nn::ops::layer_norm_slow(x, w, b, LN_EPS)
    }
}

/// Softmax over the last dimension of attention scores `(.., t, t)` with
/// the causal mask: row `i` keeps columns `0..=i`, the rest are 0. One pass
/// each way; the backward is `dx = y ⊙ (dy - Σ dy ⊙ y)`.
struct CausalSoftmaxOp;

impl CustomOp1 for CausalSoftmaxOp {
    fn name(&self) -> &'static str {
        "stratus-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l)?;
        let t = l.dims()[l.dims().len() - 1];
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(t * t)
            .zip(x.par_chunks(t * t))
            .for_each(|(ys, xs)| {
                for (i, (y, x)) in ys.chunks_exact_mut(t).zip(xs.chunks_exact(t)).enumerate() {
                    let (y, x) = (&mut y[..=i], &x[..=i]);
                    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for (y, &x) in y.iter_mut().zip(x) {
                        *y = (x - max).exp();
                        sum += *y;
                    }
                    let inv = 1.0 / sum;
                    y.iter_mut().for_each(|y| *y *= inv);
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let t = res.dim(D::Minus1)?;
        let dx = {
            let (ys, yl) = res.storage_and_layout();
            let (gs, gl) = grad.storage_and_layout();
            let (Storage::Cpu(ys), Storage::Cpu(gs)) = (&*ys, &*gs) else {
                candle_core::bail!("the causal softmax's backward runs on the CPU");
            };
            let (y, g) = (f32_slice(ys, yl)?, f32_slice(gs, gl)?);
            let mut dx = vec![0.0f32; y.len()];
            dx.par_chunks_mut(t * t)
                .zip(y.par_chunks(t * t))
                .zip(g.par_chunks(t * t))
                .for_each(|((dxs, ys), gs)| {
                    let rows = dxs.chunks_exact_mut(t).zip(ys.chunks_exact(t));
                    for (i, ((dx, y), g)) in rows.zip(gs.chunks_exact(t)).enumerate() {
                        let (dx, y, g) = (&mut dx[..=i], &y[..=i], &g[..=i]);
                        let dot: f32 = y.iter().zip(g).map(|(y, g)| y * g).sum();
                        for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                            *dx = y * (g - dot);
                        }
                    }
                });
            dx
        };
        Ok(Some(Tensor::from_vec(dx, res.shape(), res.device())?))
    }
}

/// The causal softmax of attention scores: the fused op on the CPU, the
/// additive mask and candle's differentiable softmax elsewhere.
fn causal_softmax(scores: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    if scores.device().is_cpu() && scores.dtype() == DType::F32 {
        scores.contiguous()?.apply_op1(CausalSoftmaxOp)
    } else {
        candle_nn::ops::softmax(&scores.broadcast_add(mask)?, D::Minus1)
    }
}

/// Where the dropout masks of one forward pass come from.
struct Dropout {
    p: f32,
    rng: StdRng,
}

impl Dropout {
    fn apply(&mut self, x: &Tensor) -> candle_core::Result<Tensor> {
        let scale = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if self.rng.random::<f32>() < self.p {
                    0.0
                } else {
                    scale
                }
            })
            .collect();
        x.mul(&Tensor::from_vec(mask, x.shape(), x.device())?)
    }
}

fn maybe_drop(x: Tensor, drop: &mut Option<Dropout>) -> candle_core::Result<Tensor> {
    match drop {
        Some(d) => d.apply(&x),
        None => Ok(x),
    }
}

/// `x · wᵀ + b` on a 2-D `x`.
fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(&w.t()?)?.broadcast_add(b)
}

/// The token ids of a batch: `(inputs, targets)`, each `batch × seq_len`
/// flat, after checking that every feature is a whole id below `vocab`.
pub(crate) fn token_ids(g: &GptSection, batch: &Batch) -> Result<(Vec<u32>, Vec<u32>), ModelError> {
    let window = g.seq_len + 1;
    if batch.dim != window {
        return Err(ModelError::BatchDim {
            expected: window,
            got: batch.dim,
        });
    }
    let n = batch.len();
    let mut inputs = Vec::with_capacity(n * g.seq_len);
    let mut targets = Vec::with_capacity(n * g.seq_len);
    for (sample, row) in batch.features.chunks_exact(window).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            if !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < g.vocab) {
                return Err(ModelError::Token {
                    sample,
                    position: j,
                    value: v,
                    vocab: g.vocab,
                });
            }
            let id = v as u32;
            if j < g.seq_len {
                inputs.push(id);
            }
            if j > 0 {
                targets.push(id);
            }
        }
    }
    Ok((inputs, targets))
}

/// The causal mask added to attention scores: 0 on and below the diagonal,
/// -inf above.
fn causal_mask(t: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// The logits (`batch · seq_len × vocab`) of the input ids, with dropout
/// from `drop` when training.
fn logits(
    g: &GptSection,
    vars: &[Var],
    inputs: &[u32],
    batch: usize,
    device: &Device,
    mut drop: Option<Dropout>,
) -> candle_core::Result<Tensor> {
    let (t, d, nh) = (g.seq_len, g.d_model, g.n_head);
    let hd = d / nh;
    let n = batch * t;
    let v = |i: usize| vars[i].as_tensor();
    let ids = Tensor::from_slice(inputs, n, device)?;
    let tok = v(0).index_select(&ids, 0)?.reshape((batch, t, d))?;
    let x = tok.broadcast_add(v(1))?.reshape((n, d))?;
    let mut x = maybe_drop(x, &mut drop)?;
    let mask = causal_mask(t, device)?;
    let scale = 1.0 / (hd as f64).sqrt();
    for l in 0..g.n_layer {
        let p = 2 + l * PER_BLOCK;
        // Attention.
        let h = layer_norm(&x, v(p), v(p + 1))?;
        let qkv = linear(&h, v(p + 2), v(p + 3))?
            .reshape((batch, t, 3, nh, hd))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let q = (qkv.get(0)? * scale)?;
        let k = qkv.get(1)?;
        let val = qkv.get(2)?;
        let att = causal_softmax(&q.matmul(&k.t()?)?, &mask)?;
        let att = maybe_drop(att, &mut drop)?;
        let y = att
            .matmul(&val)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((n, d))?;
        let y = maybe_drop(linear(&y, v(p + 4), v(p + 5))?, &mut drop)?;
        x = (x + y)?;
        // MLP.
        let h = layer_norm(&x, v(p + 6), v(p + 7))?;
        let h = linear(&h, v(p + 8), v(p + 9))?.gelu_erf()?;
        let y = maybe_drop(linear(&h, v(p + 10), v(p + 11))?, &mut drop)?;
        x = (x + y)?;
    }
    let last = 2 + g.n_layer * PER_BLOCK;
    let x = layer_norm(&x, v(last), v(last + 1))?;
    x.matmul(&v(0).t()?)
}

impl Model {
    fn gpt_section(&self) -> &GptSection {
        &self.spec().gpt
    }

    /// Forward + backward of the GPT: the mean token loss, the gradient in
    /// `out`. On the CPU without dropout the hand-written pass
    /// ([`crate::kernels::gpt`]) runs; otherwise candle's autograd, with
    /// dropout masks drawn from `(seed, step)`.
    pub(crate) fn gpt_backward(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
        finished: &mut dyn FnMut(&[usize], &[f32]),
    ) -> Result<f32, ModelError> {
        let g = self.gpt_section().clone();
        let (inputs, targets) = token_ids(&g, batch)?;
        if g.dropout == 0.0 {
            let n = batch.len();
            let done = self.with_gpt_exec(|exec, params, ranges| {
                exec.forward(params, &inputs, n);
                let (loss, _) = exec.loss(&targets, true);
                // A diverged step's gradient never leaves early.
                let live = loss.is_finite();
                exec.backward_with(params, &inputs, out, ranges, &mut |t, g| {
                    if live {
                        finished(t, g)
                    }
                });
                loss
            })?;
            if let Some(loss) = done {
                self.advance_step();
                return Ok(loss);
            }
        }
        self.gpt_autograd_backward(batch, out)
    }

    /// [`Model::gpt_backward`] through candle's autograd always.
    pub(crate) fn gpt_autograd_backward(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let g = self.gpt_section().clone();
        let (inputs, targets) = token_ids(&g, batch)?;
        let drop = (g.dropout > 0.0).then(|| Dropout {
            p: g.dropout as f32,
            rng: StdRng::seed_from_u64(self.dropout_seed()),
        });
        let device = self.device().clone();
        let logits = logits(&g, self.vars(), &inputs, batch.len(), &device, drop)?;
        let y = Tensor::from_slice(&targets, targets.len(), &device)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        self.write_grads(&loss, out)?;
        self.advance_step();
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Mean token loss and token accuracy (no dropout, no gradients).
    pub(crate) fn gpt_evaluate(&self, batch: &Batch) -> Result<(f32, f32), ModelError> {
        let g = self.gpt_section();
        let (inputs, targets) = token_ids(g, batch)?;
        let n = batch.len();
        let done = self.with_gpt_exec(|exec, params, _| {
            exec.forward(params, &inputs, n);
            exec.loss(&targets, false)
        })?;
        if let Some((loss, correct)) = done {
            return Ok((loss, correct as f32 / targets.len() as f32));
        }
        let device = self.device();
        let logits = logits(g, self.vars(), &inputs, batch.len(), device, None)?.detach();
        let y = Tensor::from_slice(&targets, targets.len(), device)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
        let correct = logits
            .argmax(D::Minus1)?
            .eq(&y)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok((loss, correct / targets.len() as f32))
    }
}

/// The hand-written CPU executor for `g`'s shape.
pub(crate) fn exec_for(g: &GptSection) -> GptExec {
    GptExec::new(GptDims {
        vocab: g.vocab,
        seq_len: g.seq_len,
        d_model: g.d_model,
        n_head: g.n_head,
        hidden: g.hidden(),
        n_layer: g.n_layer,
    })
}

/// A GPT model section of the given sizes (for benchmarks and tests).
pub fn gpt_spec(
    vocab: usize,
    seq_len: usize,
    d_model: usize,
    n_layer: usize,
    n_head: usize,
) -> ModelSection {
    ModelSection {
        kind: ModelKind::Gpt,
        input: seq_len + 1,
        classes: vocab,
        gpt: GptSection {
            vocab,
            seq_len,
            d_model,
            n_layer,
            n_head,
            d_ff: 0,
            dropout: 0.0,
        },
        ..ModelSection::default()
    }
}

/// A batch of `batch` random token windows for `g` drawn from `seed`.
pub fn random_batch(g: &GptSection, batch: usize, seed: u64) -> Batch {
    let mut rng = StdRng::seed_from_u64(seed);
    let window = g.seq_len + 1;
    let features = (0..batch * window)
        .map(|_| rng.random_range(0..g.vocab) as f32)
        .collect();
    Batch {
        features,
        labels: vec![0; batch],
        dim: window,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small GPT with every parameter random (gains and biases too), so
    /// no gradient is trivially 0 or 1.
    fn random_model(vocab: usize, t: usize, d: usize, layers: usize, heads: usize) -> Model {
        let mut spec = gpt_spec(vocab, t, d, layers, heads);
        spec.gpt.d_ff = 3 * d;
        let mut model = Model::new(&spec, Device::Cpu, 3).unwrap();
        let mut rng = StdRng::seed_from_u64(4);
        let flat: Vec<f32> = (0..model.num_params())
            .map(|_| rng.random_range(-0.5..0.5))
            .collect();
        model.set_flat(&flat).unwrap();
        model
    }

    #[test]
    fn hand_written_pass_equals_autograd() {
        for (batch, threads) in [(3, 1), (5, 2)] {
            let mut model = random_model(11, 6, 8, 2, 2);
            let data = random_batch(&model.spec().gpt, batch, 9);
            let n = model.num_params();
            let (mut fast, mut slow) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (l1, l2) = pool.install(|| {
                let l1 = model.gradient_into(&data, &mut fast).unwrap();
                let l2 = model.autograd_gradient_into(&data, &mut slow).unwrap();
                (l1, l2)
            });
            assert!((l1 - l2).abs() <= 1e-5 * l2.abs(), "loss {l1} vs {l2}");
            for (t, r) in model.tensors().iter().zip(model.spec().tensor_ranges()) {
                let scale = slow[r.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!(scale > 0.0, "{}: zero gradient", t.name);
                for (i, (a, b)) in fast[r.clone()].iter().zip(&slow[r.clone()]).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4 * scale,
                        "{}[{i}]: {a} vs autograd {b} (batch {batch}, {threads} threads)",
                        t.name
                    );
                }
            }
        }
    }

    #[test]
    fn hand_written_evaluation_equals_autograd() {
        let model = random_model(13, 7, 12, 2, 3);
        let data = random_batch(&model.spec().gpt, 4, 10);
        let (loss, acc) = model.evaluate(&data).unwrap();
        let g = model.spec().gpt.clone();
        let (inputs, targets) = token_ids(&g, &data).unwrap();
        let logits = logits(&g, model.vars(), &inputs, 4, &Device::Cpu, None).unwrap();
        let y = Tensor::from_slice(&targets, targets.len(), &Device::Cpu).unwrap();
        let want = candle_nn::loss::cross_entropy(&logits, &y)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let right = logits
            .argmax(D::Minus1)
            .unwrap()
            .eq(&y)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((loss - want).abs() <= 1e-5 * want, "loss {loss} vs {want}");
        assert_eq!(acc, right / targets.len() as f32);
    }

    /// Where the time of one training step goes, at the `bench-compute`
    /// `gpt` shape (vocabulary 256, context 128, d_model 256, 4 layers, 4
    /// heads, batch 16) and one thread: the hand-written pass per phase and
    /// candle's autograd beside it. `cargo test --release -p ps-worker
    /// --lib gpt_step_profile -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn gpt_step_profile() {
        let spec = gpt_spec(256, 128, 256, 4, 4);
        let mut model = Model::new(&spec, Device::Cpu, 1).unwrap();
        let data = random_batch(&spec.gpt, 16, 1);
        let mut grad = vec![0.0f32; model.num_params()];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let steps = 5;
        pool.install(|| {
            let time = |model: &mut Model, grad: &mut [f32], autograd: bool| {
                let t0 = std::time::Instant::now();
                for _ in 0..steps {
                    if autograd {
                        model.autograd_gradient_into(&data, grad).unwrap();
                    } else {
                        model.gradient_into(&data, grad).unwrap();
                    }
                }
                t0.elapsed().as_secs_f64() * 1e3 / steps as f64
            };
            time(&mut model, &mut grad, true);
            let autograd = time(&mut model, &mut grad, true);
            time(&mut model, &mut grad, false);
            model.with_gpt_exec(|e, _, _| e.profile(true)).unwrap();
            let ours = time(&mut model, &mut grad, false);
            let phases = model
                .with_gpt_exec(|e, _, _| e.phases().to_vec())
                .unwrap()
                .unwrap();
            let total: f64 = phases.iter().map(|(_, t)| t.as_secs_f64()).sum();
            println!("autograd {autograd:.1} ms per step; hand-written {ours:.1} ms");
            for (name, t) in phases {
                let ms = t.as_secs_f64() * 1e3 / steps as f64;
                let share = 100.0 * t.as_secs_f64() / total;
                println!("{name:<40} {ms:8.2} ms {share:5.1}%");
            }
        });
    }

    /// The model's tensors, by name, as candle tensors.
    fn named(model: &Model) -> std::collections::HashMap<String, Tensor> {
        let flat = model.flat_params().unwrap();
        model
            .tensors()
            .iter()
            .map(|t| {
                let v = flat[model.range_of(&t.name).unwrap()].to_vec();
                let tensor = Tensor::from_vec(v, t.shape.as_slice(), &Device::Cpu).unwrap();
                (t.name.clone(), tensor)
            })
            .collect()
    }

    fn safetensors_bytes(tensors: &std::collections::HashMap<String, Tensor>) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        candle_core::safetensors::save(tensors, &path).unwrap();
        std::fs::read(path).unwrap()
    }

    #[test]
    fn initial_weights_load_by_name_and_shape() {
        let source = random_model(11, 6, 8, 2, 2);
        let mut model = Model::new(&source.spec().clone(), Device::Cpu, 1).unwrap();
        assert_ne!(model.flat_params().unwrap(), source.flat_params().unwrap());
        let tensors = named(&source);
        model
            .load_safetensors(&safetensors_bytes(&tensors), "w.safetensors")
            .unwrap();
        assert_eq!(model.flat_params().unwrap(), source.flat_params().unwrap());

        // f64 tensors (torch's double) are converted.
        let doubled: std::collections::HashMap<_, _> = tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.to_dtype(DType::F64).unwrap()))
            .collect();
        let mut other = Model::new(&source.spec().clone(), Device::Cpu, 2).unwrap();
        other
            .load_safetensors(&safetensors_bytes(&doubled), "w.safetensors")
            .unwrap();
        assert_eq!(other.flat_params().unwrap(), source.flat_params().unwrap());
    }

    #[test]
    fn initial_weights_that_do_not_fit_are_refused_by_tensor() {
        let source = random_model(11, 6, 8, 2, 2);
        let before = source.flat_params().unwrap();
        let mut model = Model::new(&source.spec().clone(), Device::Cpu, 1).unwrap();
        let fresh = model.flat_params().unwrap();
        let err = |model: &mut Model, bytes: &[u8]| {
            model
                .load_safetensors(bytes, "init.safetensors")
                .unwrap_err()
                .to_string()
        };

        let mut missing = named(&source);
        missing.remove("h.1.mlp.c_fc.bias").unwrap();
        let e = err(&mut model, &safetensors_bytes(&missing));
        assert!(
            e.contains("init.safetensors") && e.contains("`h.1.mlp.c_fc.bias`"),
            "{e}"
        );

        let mut extra = named(&source);
        extra.insert(
            "lm_head.weight".into(),
            Tensor::zeros((11, 8), DType::F32, &Device::Cpu).unwrap(),
        );
        let e = err(&mut model, &safetensors_bytes(&extra));
        assert!(
            e.contains("`lm_head.weight`") && e.contains("not one of the model's"),
            "{e}"
        );

        let mut shape = named(&source);
        shape.insert(
            "wpe.weight".into(),
            Tensor::zeros((7, 8), DType::F32, &Device::Cpu).unwrap(),
        );
        let e = err(&mut model, &safetensors_bytes(&shape));
        assert!(
            e.contains("`wpe.weight`") && e.contains("[7, 8]") && e.contains("[6, 8]"),
            "{e}"
        );

        let e = err(&mut model, b"not a safetensors file at all");
        assert!(
            e.contains("init.safetensors") && e.contains("not a safetensors file"),
            "{e}"
        );

        // A refused file leaves the weights as they were.
        assert_eq!(model.flat_params().unwrap(), fresh);
        assert_eq!(source.flat_params().unwrap(), before);
    }

    #[test]
    fn chunked_evaluation_equals_one_pass() {
        let model = random_model(11, 6, 8, 2, 2);
        let data = random_batch(&model.spec().gpt, 10, 5);
        let (loss, acc) = model.evaluate(&data).unwrap();
        assert!(loss.is_finite() && loss > 0.0);
        for chunk in [1, 3, 4, 10, 0, 64] {
            let (l, a) = model.evaluate_chunked(&data, chunk).unwrap();
            assert!(
                (l - loss).abs() <= 1e-6 * loss,
                "chunk {chunk}: loss {l} vs {loss}"
            );
            assert!(
                (a - acc).abs() <= 1e-6,
                "chunk {chunk}: accuracy {a} vs {acc}"
            );
        }
        // Chunks that differ by one sample still weigh every sample once:
        // the mean of unequal chunks is not the mean of their means.
        let (l3, _) = model.evaluate_chunked(&data, 3).unwrap();
        let first = model.evaluate(&Batch {
            features: data.features[..9 * data.dim].to_vec(),
            labels: data.labels[..9].to_vec(),
            dim: data.dim,
        });
        let last = model.evaluate(&Batch {
            features: data.features[9 * data.dim..].to_vec(),
            labels: data.labels[9..].to_vec(),
            dim: data.dim,
        });
        let naive = (first.unwrap().0 + last.unwrap().0) / 2.0;
        assert!(
            (l3 - naive).abs() > 1e-6,
            "the test batch is too uniform to tell"
        );
    }
}

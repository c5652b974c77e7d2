//! The GPT preset's forward and backward pass on the CPU, by hand.
//!
//! A [`GptExec`] keeps, per decoder block, what the backward pass needs
//! (each layer norm's normalised input and `1/σ`, its output, the fused
//! q/k/v projection, the causal attention weights, the merged heads, the
//! MLP's GELU output and GELU's derivative) plus the backward's scratch, all
//! reused across steps (they grow for a larger batch). The residual stream
//! is one buffer updated in place. Parameters are read from slices in the
//! layout order of [`ps_shared::config::GptSection::layout`]; gradients are
//! written straight into the flat gradient at each tensor's range.
//!
//! The products are [`matmul`] / [`matmul_strided`] calls on row-major
//! buffers with strides (heads are read out of the fused q/k/v rows in
//! place, never copied); attention runs one sample per parallel task. The
//! arithmetic follows torch's `scripts/torch_gpt.py` model: pre-LayerNorm
//! blocks, exact (erf) GELU, a causal softmax scaled by `1/sqrt(head_dim)`,
//! an output head tied to the token embedding and the mean token
//! cross-entropy. Dropout is not handled here (the model runs those steps
//! through autograd).

use std::ops::Range;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::{matmul, matmul_strided, Mat};

/// LayerNorm's epsilon (torch's default).
const LN_EPS: f32 = 1e-5;

/// Tensors per decoder block in the flat layout.
const PER_BLOCK: usize = 12;

/// Rows of a row-wise pass in one parallel task.
const ROWS_PER_TASK: usize = 32;

/// The sizes of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptDims {
    pub vocab: usize,
    /// Tokens per input window.
    pub seq_len: usize,
    pub d_model: usize,
    pub n_head: usize,
    /// The MLP's hidden width.
    pub hidden: usize,
    pub n_layer: usize,
}

impl GptDims {
    /// Parameter tensors in the flat layout.
    pub fn tensors(&self) -> usize {
        2 + PER_BLOCK * self.n_layer + 2
    }
}

/// One block's saved activations.
#[derive(Default)]
struct Block {
    xhat1: Vec<f32>,
    rstd1: Vec<f32>,
    h1: Vec<f32>,
    qkv: Vec<f32>,
    /// Causal attention weights, `batch × heads × t × t`.
    att: Vec<f32>,
    /// Attention output with the heads merged back, `n × d`.
    y: Vec<f32>,
    xhat2: Vec<f32>,
    rstd2: Vec<f32>,
    h2: Vec<f32>,
    /// GELU of the MLP's first projection, `n × hidden`.
    g: Vec<f32>,
    /// GELU's derivative at the same points.
    gp: Vec<f32>,
}

/// Wall time per phase of the passes, summed while switched on (for
/// profiling: `GptExec::phases`).
#[derive(Default)]
struct Phases {
    on: bool,
    last: Option<Instant>,
    totals: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn start(&mut self) {
        if self.on {
            self.last = Some(Instant::now());
        }
    }

    /// The time since the last mark goes to `name`.
    fn mark(&mut self, name: &'static str) {
        let Some(last) = self.last else {
            return;
        };
        let now = Instant::now();
        match self.totals.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => *t += now - last,
            None => self.totals.push((name, now - last)),
        }
        self.last = Some(now);
    }
}

/// The forward/backward executor of one GPT shape.
pub struct GptExec {
    phases: Phases,
    dims: GptDims,
    /// Samples the buffers are sized for.
    batch: usize,
    /// The residual stream, `n × d`.
    x: Vec<f32>,
    blocks: Vec<Block>,
    xhatf: Vec<f32>,
    rstdf: Vec<f32>,
    hf: Vec<f32>,
    /// The logits, `n × vocab`; after [`GptExec::loss_and_grad`] their
    /// gradient.
    logits: Vec<f32>,
    dx: Vec<f32>,
    dh: Vec<f32>,
    dy: Vec<f32>,
    dqkv: Vec<f32>,
    dg: Vec<f32>,
    datt: Vec<f32>,
}

fn resize(v: &mut Vec<f32>, n: usize) {
    if v.len() != n {
        v.resize(n, 0.0);
    }
}

/// `y = x · wᵀ + b` with `x` `n × k` and `w` `m × k` (torch's Linear
/// layout), `y` `n × m`.
fn linear(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], k: usize) {
    let m = b.len();
    let n = x.len() / k;
    y.par_chunks_mut(m * ROWS_PER_TASK).for_each(|rows| {
        rows.chunks_exact_mut(m)
            .for_each(|row| row.copy_from_slice(b))
    });
    matmul(n, m, k, y, true, Mat::rows(x, k), Mat::transposed(w, k));
}

/// `y += x · wᵀ + b` (a residual branch added to the stream).
fn linear_add(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], k: usize) {
    let m = b.len();
    let n = x.len() / k;
    y.par_chunks_mut(m * ROWS_PER_TASK).for_each(|rows| {
        rows.chunks_exact_mut(m)
            .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b))
    });
    matmul(n, m, k, y, true, Mat::rows(x, k), Mat::transposed(w, k));
}

/// The backward of a linear layer whose output gradient is `dy` (`n × m`)
/// and input `x` (`n × k`): `dw = dyᵀ · x`, `db = Σ dy` (both written),
/// and `dx = dy · w` written when asked for.
fn linear_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [f32]>,
    k: usize,
) {
    let m = db.len();
    let n = dy.len() / m;
    column_sums(dy, db);
    matmul(m, k, n, dw, false, Mat::transposed(dy, m), Mat::rows(x, k));
    if let Some(dx) = dx {
        matmul(n, k, m, dx, false, Mat::rows(dy, m), Mat::rows(w, k));
    }
}

/// `out[j] = Σ_i rows[i][j]` over the rows of `rows` (width `out.len()`).
fn column_sums(rows: &[f32], out: &mut [f32]) {
    let m = out.len();
    let chunk = m * 64;
    let partial = rows
        .par_chunks(chunk)
        .fold(
            || vec![0.0f32; m],
            |mut acc, block| {
                for row in block.chunks_exact(m) {
                    acc.iter_mut().zip(row).for_each(|(a, r)| *a += r);
                }
                acc
            },
        )
        .reduce(
            || vec![0.0f32; m],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            },
        );
    out.copy_from_slice(&partial);
}

/// Layer norm of every row of `x` (width `w.len()`): the normalised rows
/// in `xhat`, `1/σ` per row in `rstd`, `xhat · w + b` in `y`.
fn layer_norm(x: &[f32], w: &[f32], b: &[f32], xhat: &mut [f32], rstd: &mut [f32], y: &mut [f32]) {
    let d = w.len();
    let c = d * ROWS_PER_TASK;
    xhat.par_chunks_mut(c)
        .zip(y.par_chunks_mut(c))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(c))
        .for_each(|(((xh, y), rs), x)| {
            let rows = xh.chunks_exact_mut(d).zip(y.chunks_exact_mut(d));
            for (((xh, y), r), x) in rows.zip(rs.iter_mut()).zip(x.chunks_exact(d)) {
                let mean = x.iter().sum::<f32>() / d as f32;
                let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
                let s = 1.0 / (var + LN_EPS).sqrt();
                *r = s;
                for i in 0..d {
                    let h = (x[i] - mean) * s;
                    xh[i] = h;
                    y[i] = h * w[i] + b[i];
                }
            }
        });
}

/// The backward of [`layer_norm`]: from the output gradient `dy`, the
/// input gradient added to `dx` and the gain and bias gradients written
/// into `dw`, `db`.
fn layer_norm_backward(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    w: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) {
    let d = w.len();
    let c = d * ROWS_PER_TASK;
    dx.par_chunks_mut(c)
        .zip(dy.par_chunks(c))
        .zip(xhat.par_chunks(c))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .for_each(|(((dx, dy), xh), rs)| {
            let rows = dx.chunks_exact_mut(d).zip(dy.chunks_exact(d));
            for (((dx, g), xh), &s) in rows.zip(xh.chunks_exact(d)).zip(rs) {
                let (mut sum_gw, mut sum_gwx) = (0.0f32, 0.0f32);
                for i in 0..d {
                    let gw = g[i] * w[i];
                    sum_gw += gw;
                    sum_gwx += gw * xh[i];
                }
                let (m1, m2) = (sum_gw / d as f32, sum_gwx / d as f32);
                for i in 0..d {
                    dx[i] += s * (g[i] * w[i] - m1 - xh[i] * m2);
                }
            }
        });
    column_sums(dy, db);
    let partial = dy
        .par_chunks(c * 2)
        .zip(xhat.par_chunks(c * 2))
        .fold(
            || vec![0.0f32; d],
            |mut acc, (g, xh)| {
                for (g, xh) in g.chunks_exact(d).zip(xh.chunks_exact(d)) {
                    for i in 0..d {
                        acc[i] += g[i] * xh[i];
                    }
                }
                acc
            },
        )
        .reduce(
            || vec![0.0f32; d],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            },
        );
    dw.copy_from_slice(&partial);
}

/// `e^x` for `x ≤ 0` (below -87 it returns `e^-87`, about 1.6e-38) in
/// plain arithmetic the compiler can vectorise: `x = n ln 2 + r` with
/// `|r| ≤ ln 2 / 2` (Cody and Waite's two-part ln 2), a degree-6
/// polynomial for `e^r` (Cephes' `expf` coefficients, within 2 ulp), and
/// `2^n` put straight into the exponent bits.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    er * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `(Φ(x), φ(x))`, the standard normal's distribution and density, from
/// one exponential (Abramowitz & Stegun 7.1.26 for erf: absolute error
/// below 1.5e-7, so below 7.5e-8 on Φ before f32 rounding).
#[inline(always)]
fn normal_cdf_pdf(x: f32) -> (f32, f32) {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_7,
        -1.453_152_1,
        1.061_405_4,
    ];
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    let z = x * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + P * z.abs());
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let e = exp_nonpositive(-z * z);
    // The tail 0.5 · erfc(|z|) computed directly, without cancellation.
    let tail = 0.5 * poly * e;
    let cdf = if x >= 0.0 { 1.0 - tail } else { tail };
    (cdf, e * FRAC_1_SQRT_2PI)
}

/// GELU in place (`x Φ(x)`), its derivative `Φ(x) + x φ(x)` into `gp`.
pub fn gelu_forward(x: &mut [f32], gp: &mut [f32]) {
    let c = 4096;
    x.par_chunks_mut(c)
        .zip(gp.par_chunks_mut(c))
        .for_each(|(x, gp)| {
            for (x, gp) in x.iter_mut().zip(gp) {
                let (cdf, pdf) = normal_cdf_pdf(*x);
                *gp = cdf + *x * pdf;
                *x *= cdf;
            }
        });
}

/// Softmax of `scale ·` each row of a `t × t` score block with the causal
/// mask: row `i` keeps columns `0..=i`, the rest become 0.
fn causal_softmax(s: &mut [f32], t: usize, scale: f32) {
    for (i, row) in s.chunks_exact_mut(t).enumerate() {
        let (keep, masked) = row.split_at_mut(i + 1);
        let max = keep.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in keep.iter_mut() {
            *v = ((*v - max) * scale).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        keep.iter_mut().for_each(|v| *v *= inv);
        masked.fill(0.0);
    }
}

/// The backward of [`causal_softmax`] in place: `dp` (the gradient of the
/// weights `p`) becomes the gradient of the unscaled scores,
/// `scale · p ⊙ (dp - Σ dp ⊙ p)` on each row's kept columns, 0 elsewhere.
fn causal_softmax_backward(dp: &mut [f32], p: &[f32], t: usize, scale: f32) {
    for (i, (dp, p)) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
        let (keep, masked) = dp.split_at_mut(i + 1);
        let p = &p[..=i];
        let dot: f32 = keep.iter().zip(p).map(|(g, p)| g * p).sum();
        for (g, &p) in keep.iter_mut().zip(p) {
            *g = scale * p * (*g - dot);
        }
        masked.fill(0.0);
    }
}

/// A head's `t × hd` slice of q, k or v inside one sample's fused rows
/// (`t × 3d`), starting at column `col`.
fn head(qkv: &[f32], col: usize, d: usize) -> Mat<'_> {
    Mat {
        data: &qkv[col..],
        rs: 3 * d,
        cs: 1,
    }
}

/// The transpose of [`head`] (`hd × t`).
fn head_t(qkv: &[f32], col: usize, d: usize) -> Mat<'_> {
    Mat {
        data: &qkv[col..],
        rs: 1,
        cs: 3 * d,
    }
}

const SERIAL: gemm::Parallelism = gemm::Parallelism::None;

impl GptExec {
    pub fn new(dims: GptDims) -> Self {
        Self {
            phases: Phases::default(),
            dims,
            batch: 0,
            x: Vec::new(),
            blocks: (0..dims.n_layer).map(|_| Block::default()).collect(),
            xhatf: Vec::new(),
            rstdf: Vec::new(),
            hf: Vec::new(),
            logits: Vec::new(),
            dx: Vec::new(),
            dh: Vec::new(),
            dy: Vec::new(),
            dqkv: Vec::new(),
            dg: Vec::new(),
            datt: Vec::new(),
        }
    }

    pub fn dims(&self) -> GptDims {
        self.dims
    }

    /// Starts summing the wall time of each phase (forward, loss and
    /// backward, per kind of op over every block) from 0, or stops.
    pub fn profile(&mut self, on: bool) {
        self.phases = Phases {
            on,
            ..Phases::default()
        };
    }

    /// The summed time of each phase since [`GptExec::profile`], in the
    /// order the phases first ran.
    pub fn phases(&self) -> &[(&'static str, Duration)] {
        &self.phases.totals
    }

    fn size_for(&mut self, batch: usize) {
        if batch == self.batch {
            return;
        }
        let GptDims {
            vocab,
            seq_len: t,
            d_model: d,
            n_head: nh,
            hidden: f,
            ..
        } = self.dims;
        let n = batch * t;
        for b in &mut self.blocks {
            resize(&mut b.xhat1, n * d);
            resize(&mut b.rstd1, n);
            resize(&mut b.h1, n * d);
            resize(&mut b.qkv, n * 3 * d);
            resize(&mut b.att, batch * nh * t * t);
            resize(&mut b.y, n * d);
            resize(&mut b.xhat2, n * d);
            resize(&mut b.rstd2, n);
            resize(&mut b.h2, n * d);
            resize(&mut b.g, n * f);
            resize(&mut b.gp, n * f);
        }
        for v in [&mut self.x, &mut self.xhatf, &mut self.hf, &mut self.dx] {
            resize(v, n * d);
        }
        resize(&mut self.dh, n * d);
        resize(&mut self.dy, n * d);
        resize(&mut self.rstdf, n);
        resize(&mut self.logits, n * vocab);
        resize(&mut self.dqkv, n * 3 * d);
        resize(&mut self.dg, n * f);
        resize(&mut self.datt, batch * nh * t * t);
        self.batch = batch;
    }

    /// The logits of the last forward pass (`batch · seq_len × vocab`).
    pub fn logits(&self) -> &[f32] {
        &self.logits[..self.batch * self.dims.seq_len * self.dims.vocab]
    }

    /// The forward pass of `ids` (`batch · seq_len` token ids below
    /// `vocab`, checked by the caller), keeping what the backward needs.
    ///
    /// # Panics
    /// When `params` does not hold the layout's tensors at their sizes (a
    /// bug in the caller).
    pub fn forward(&mut self, params: &[&[f32]], ids: &[u32], batch: usize) {
        assert_eq!(params.len(), self.dims.tensors(), "GPT parameter count");
        self.size_for(batch);
        self.phases.start();
        let GptDims {
            seq_len: t,
            d_model: d,
            n_head: nh,
            ..
        } = self.dims;
        let hd = d / nh;
        let scale = 1.0 / (hd as f32).sqrt();
        let (wte, wpe) = (params[0], params[1]);
        self.x
            .par_chunks_mut(d * ROWS_PER_TASK)
            .zip(ids.par_chunks(ROWS_PER_TASK))
            .enumerate()
            .for_each(|(c, (rows, ids))| {
                for (r, (row, &id)) in rows.chunks_exact_mut(d).zip(ids).enumerate() {
                    let pos = (c * ROWS_PER_TASK + r) % t;
                    let (e, p) = (&wte[id as usize * d..][..d], &wpe[pos * d..][..d]);
                    row.iter_mut()
                        .zip(e.iter().zip(p))
                        .for_each(|(x, (e, p))| *x = e + p);
                }
            });
        self.phases.mark("embedding");
        for (l, blk) in self.blocks.iter_mut().enumerate() {
            let p = &params[2 + l * PER_BLOCK..2 + (l + 1) * PER_BLOCK];
            layer_norm(
                &self.x,
                p[0],
                p[1],
                &mut blk.xhat1,
                &mut blk.rstd1,
                &mut blk.h1,
            );
            self.phases.mark("layer norm");
            linear(&blk.h1, p[2], p[3], &mut blk.qkv, d);
            self.phases.mark("q/k/v projection");
            blk.att
                .par_chunks_mut(nh * t * t)
                .zip(blk.y.par_chunks_mut(t * d))
                .zip(blk.qkv.par_chunks(t * 3 * d))
                .for_each(|((att, y), qkv)| {
                    for (h, a) in att.chunks_exact_mut(t * t).enumerate() {
                        let (q, k, v) = (h * hd, d + h * hd, 2 * d + h * hd);
                        let (qm, kt) = (head(qkv, q, d), head_t(qkv, k, d));
                        matmul_strided((t, t, hd), a, t, false, qm, kt, SERIAL);
                        causal_softmax(a, t, scale);
                        let (am, vm) = (Mat::rows(a, t), head(qkv, v, d));
                        matmul_strided((t, hd, t), &mut y[q..], d, false, am, vm, SERIAL);
                    }
                });
            self.phases.mark("attention (scores, softmax, weights · v)");
            linear_add(&blk.y, p[4], p[5], &mut self.x, d);
            self.phases.mark("attention output projection");
            layer_norm(
                &self.x,
                p[6],
                p[7],
                &mut blk.xhat2,
                &mut blk.rstd2,
                &mut blk.h2,
            );
            self.phases.mark("layer norm");
            linear(&blk.h2, p[8], p[9], &mut blk.g, d);
            self.phases.mark("MLP up projection");
            gelu_forward(&mut blk.g, &mut blk.gp);
            self.phases.mark("GELU");
            linear_add(&blk.g, p[10], p[11], &mut self.x, self.dims.hidden);
            self.phases.mark("MLP down projection");
        }
        let last = 2 + self.dims.n_layer * PER_BLOCK;
        layer_norm(
            &self.x,
            params[last],
            params[last + 1],
            &mut self.xhatf,
            &mut self.rstdf,
            &mut self.hf,
        );
        self.phases.mark("layer norm");
        let n = batch * t;
        let v = self.dims.vocab;
        let logits = &mut self.logits[..n * v];
        matmul(
            n,
            v,
            d,
            logits,
            false,
            Mat::rows(&self.hf, d),
            Mat::transposed(wte, d),
        );
        self.phases.mark("output head");
    }

    /// The mean cross-entropy of the last forward's logits against
    /// `targets` and the number of positions whose first largest logit is
    /// the target. With `grad` the logits are replaced by the loss's
    /// gradient (softmax minus the one-hot target, over the positions).
    pub fn loss(&mut self, targets: &[u32], grad: bool) -> (f32, usize) {
        let v = self.dims.vocab;
        let n = targets.len();
        let inv_n = 1.0 / n as f32;
        self.phases.start();
        let (sum, correct) = self.logits[..n * v]
            .par_chunks_mut(v * ROWS_PER_TASK)
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .map(|(rows, targets)| {
                let (mut loss, mut correct) = (0.0f64, 0usize);
                for (row, &y) in rows.chunks_exact_mut(v).zip(targets) {
                    let y = y as usize;
                    let (mut best, mut max) = (0, f32::NEG_INFINITY);
                    for (j, &z) in row.iter().enumerate() {
                        if z > max {
                            (best, max) = (j, z);
                        }
                    }
                    correct += usize::from(best == y);
                    let target = row[y];
                    if grad {
                        let mut sum = 0.0f32;
                        for z in row.iter_mut() {
                            *z = (*z - max).exp();
                            sum += *z;
                        }
                        loss += f64::from(max + sum.ln() - target);
                        let k = inv_n / sum;
                        row.iter_mut().for_each(|z| *z *= k);
                        row[y] -= inv_n;
                    } else {
                        let sum: f32 = row.iter().map(|z| (z - max).exp()).sum();
                        loss += f64::from(max + sum.ln() - target);
                    }
                }
                (loss, correct)
            })
            .reduce(|| (0.0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        self.phases.mark("cross-entropy");
        ((sum / n as f64) as f32, correct)
    }

    /// The backward pass after [`GptExec::forward`] and
    /// [`GptExec::loss`] with `grad`: every parameter's gradient written
    /// into `out` at its range in `ranges` (layout order).
    ///
    /// # Panics
    /// When `params` or `ranges` do not match the layout (a bug in the
    /// caller).
    pub fn backward(
        &mut self,
        params: &[&[f32]],
        ids: &[u32],
        out: &mut [f32],
        ranges: &[Range<usize>],
    ) {
        self.backward_with(params, ids, out, ranges, &mut |_, _| {});
    }

    /// [`GptExec::backward`], telling `done` which parameter tensors'
    /// gradients are final as soon as each layer is through (the tied
    /// token embedding last), so that they can leave before the pass ends.
    ///
    /// # Panics
    /// As [`GptExec::backward`].
    pub fn backward_with(
        &mut self,
        params: &[&[f32]],
        ids: &[u32],
        out: &mut [f32],
        ranges: &[Range<usize>],
        done: &mut dyn FnMut(&[usize], &[f32]),
    ) {
        assert_eq!(ranges.len(), self.dims.tensors(), "GPT gradient ranges");
        let GptDims {
            vocab: v,
            seq_len: t,
            d_model: d,
            n_head: nh,
            hidden: f,
            n_layer,
        } = self.dims;
        let n = self.batch * t;
        let hd = d / nh;
        let scale = 1.0 / (hd as f32).sqrt();
        let wte = params[0];
        self.phases.start();
        let dlogits = &self.logits[..n * v];
        // The tied head: the token embedding's gradient starts here.
        let dwte = &mut out[ranges[0].clone()];
        matmul(
            v,
            d,
            n,
            dwte,
            false,
            Mat::transposed(dlogits, v),
            Mat::rows(&self.hf, d),
        );
        matmul(
            n,
            d,
            v,
            &mut self.dh,
            false,
            Mat::rows(dlogits, v),
            Mat::rows(wte, d),
        );
        self.phases.mark("output head backward");
        self.dx.fill(0.0);
        let last = 2 + n_layer * PER_BLOCK;
        {
            let (dw, db) = pair(out, &ranges[last], &ranges[last + 1]);
            let w = params[last];
            layer_norm_backward(&self.dh, &self.xhatf, &self.rstdf, w, &mut self.dx, dw, db);
        }
        done(&[last, last + 1], out);
        self.phases.mark("layer norm backward");
        for (l, blk) in self.blocks.iter().enumerate().rev() {
            let base = 2 + l * PER_BLOCK;
            let p = &params[base..base + PER_BLOCK];
            let r = &ranges[base..base + PER_BLOCK];
            // MLP.
            let (dw, db) = pair(out, &r[10], &r[11]);
            linear_backward(&self.dx, &blk.g, p[10], dw, db, Some(&mut self.dg), f);
            done(&[base + 10, base + 11], out);
            self.phases.mark("MLP down projection backward");
            self.dg
                .par_chunks_mut(4096)
                .zip(blk.gp.par_chunks(4096))
                .for_each(|(g, gp)| g.iter_mut().zip(gp).for_each(|(g, gp)| *g *= gp));
            self.phases.mark("GELU backward");
            let (dw, db) = pair(out, &r[8], &r[9]);
            linear_backward(&self.dg, &blk.h2, p[8], dw, db, Some(&mut self.dh), d);
            done(&[base + 8, base + 9], out);
            self.phases.mark("MLP up projection backward");
            let (dw, db) = pair(out, &r[6], &r[7]);
            layer_norm_backward(&self.dh, &blk.xhat2, &blk.rstd2, p[6], &mut self.dx, dw, db);
            done(&[base + 6, base + 7], out);
            self.phases.mark("layer norm backward");
            // Attention.
            let (dw, db) = pair(out, &r[4], &r[5]);
            linear_backward(&self.dx, &blk.y, p[4], dw, db, Some(&mut self.dy), d);
            done(&[base + 4, base + 5], out);
            self.phases.mark("attention output projection backward");
            self.datt
                .par_chunks_mut(nh * t * t)
                .zip(self.dqkv.par_chunks_mut(t * 3 * d))
                .zip(self.dy.par_chunks(t * d))
                .zip(
                    blk.qkv
                        .par_chunks(t * 3 * d)
                        .zip(blk.att.par_chunks(nh * t * t)),
                )
                .for_each(|(((datt, dqkv), dy), (qkv, att))| {
                    let heads = datt.chunks_exact_mut(t * t).zip(att.chunks_exact(t * t));
                    for (h, (da, a)) in heads.enumerate() {
                        let (q, k, vc) = (h * hd, d + h * hd, 2 * d + h * hd);
                        let dyh = Mat {
                            data: &dy[q..],
                            rs: d,
                            cs: 1,
                        };
                        // d(weights) = dY · Vᵀ, dV = weightsᵀ · dY.
                        let vt = head_t(qkv, vc, d);
                        matmul_strided((t, t, hd), da, t, false, dyh, vt, SERIAL);
                        let at = Mat::transposed(a, t);
                        matmul_strided((t, hd, t), &mut dqkv[vc..], 3 * d, false, at, dyh, SERIAL);
                        causal_softmax_backward(da, a, t, scale);
                        // dQ = dS · K, dK = dSᵀ · Q.
                        let (ds, dst) = (Mat::rows(da, t), Mat::transposed(da, t));
                        let km = head(qkv, k, d);
                        matmul_strided((t, hd, t), &mut dqkv[q..], 3 * d, false, ds, km, SERIAL);
                        let qm = head(qkv, q, d);
                        matmul_strided((t, hd, t), &mut dqkv[k..], 3 * d, false, dst, qm, SERIAL);
                    }
                });
            self.phases.mark("attention backward");
            let (dw, db) = pair(out, &r[2], &r[3]);
            linear_backward(&self.dqkv, &blk.h1, p[2], dw, db, Some(&mut self.dh), d);
            done(&[base + 2, base + 3], out);
            self.phases.mark("q/k/v projection backward");
            let (dw, db) = pair(out, &r[0], &r[1]);
            layer_norm_backward(&self.dh, &blk.xhat1, &blk.rstd1, p[0], &mut self.dx, dw, db);
            done(&[base, base + 1], out);
            self.phases.mark("layer norm backward");
        }
        // Embeddings: token rows gather, positions repeat every t rows.
        let dwte = &mut out[ranges[0].clone()];
        for (row, &id) in self.dx.chunks_exact(d).zip(ids) {
            let dst = &mut dwte[id as usize * d..][..d];
            dst.iter_mut().zip(row).for_each(|(a, b)| *a += b);
        }
        let dwpe = &mut out[ranges[1].clone()];
        dwpe.fill(0.0);
        for sample in self.dx.chunks_exact(t * d) {
            dwpe.iter_mut().zip(sample).for_each(|(a, b)| *a += b);
        }
        done(&[0, 1], out);
        self.phases.mark("embedding backward");
    }
}

/// Two adjacent ranges of `out` (`a` just before `b`) as two slices.
fn pair<'a>(
    out: &'a mut [f32],
    a: &Range<usize>,
    b: &Range<usize>,
) -> (&'a mut [f32], &'a mut [f32]) {
    assert!(
        a.end == b.start,
        "gradient ranges {a:?} and {b:?} are not adjacent"
    );
    out[a.start..b.end].split_at_mut(a.len())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check_gradient, dot, random};
    use super::*;

    #[test]
    fn exp_nonpositive_matches_std_exp() {
        let mut worst = 0.0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "largest relative error {worst:e}");
    }

    #[test]
    fn normal_cdf_and_pdf_match_erf_closely() {
        for i in -800..=800 {
            let x = i as f32 / 100.0;
            let (cdf, pdf) = normal_cdf_pdf(x);
            let want = 0.5 * (1.0 + libm_erf(f64::from(x) / std::f64::consts::SQRT_2));
            let want_pdf =
                (-0.5 * f64::from(x).powi(2)).exp() / (2.0 * std::f64::consts::PI).sqrt();
            assert!(
                (f64::from(cdf) - want).abs() < 3e-7,
                "Φ({x}) = {cdf} vs {want}"
            );
            assert!(
                (f64::from(pdf) - want_pdf).abs() < 1e-7,
                "φ({x}) = {pdf} vs {want_pdf}"
            );
        }
    }

    /// erf in f64 by its Taylor series (|x| ≤ 3) or continued fraction.
    fn libm_erf(x: f64) -> f64 {
        if x.abs() > 3.0 {
            // erfc(x) ≈ e^{-x²} / (x √π) · (1 - 1/(2x²) + 3/(4x⁴) - 15/(8x⁶))
            let a = x.abs();
            let x2 = a * a;
            let erfc = (-x2).exp() / (a * std::f64::consts::PI.sqrt())
                * (1.0 - 0.5 / x2 + 0.75 / (x2 * x2) - 1.875 / (x2 * x2 * x2));
            return (1.0 - erfc).copysign(x);
        }
        let mut term = x;
        let mut sum = x;
        for k in 1..200 {
            term *= -x * x / k as f64;
            sum += term / (2 * k + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gelu_derivative_matches_finite_differences() {
        let x: Vec<f32> = random(64, 5).iter().map(|v| v * 4.0).collect();
        let r = random(64, 6);
        let mut y = x.clone();
        let mut gp = vec![0.0; x.len()];
        gelu_forward(&mut y, &mut gp);
        let analytic: Vec<f32> = gp.iter().zip(&r).map(|(g, r)| g * r).collect();
        check_gradient("gelu", &x, &analytic, 1e-2, |x| {
            let mut y = x.to_vec();
            let mut scratch = vec![0.0; x.len()];
            gelu_forward(&mut y, &mut scratch);
            dot(&y, &r)
        });
    }

    #[test]
    fn causal_softmax_backward_matches_finite_differences() {
        let t = 5;
        let s = random(t * t, 7);
        let r = random(t * t, 8);
        let scale = 0.7;
        let mut p = s.clone();
        causal_softmax(&mut p, t, scale);
        for (i, row) in p.chunks_exact(t).enumerate() {
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-6 && row[i + 1..].iter().all(|&v| v == 0.0));
        }
        let mut ds = r.clone();
        causal_softmax_backward(&mut ds, &p, t, scale);
        check_gradient("causal softmax", &s, &ds, 1e-2, |s| {
            let mut p = s.to_vec();
            causal_softmax(&mut p, t, scale);
            dot(&p, &r)
        });
    }

    #[test]
    fn layer_norm_backward_matches_finite_differences() {
        let (rows, d) = (3, 6);
        let x = random(rows * d, 9);
        let w = random(d, 10);
        let b = random(d, 11);
        let r = random(rows * d, 12);
        let run = |x: &[f32], w: &[f32], b: &[f32]| {
            let (mut xh, mut rs, mut y) =
                (vec![0.0; rows * d], vec![0.0; rows], vec![0.0; rows * d]);
            layer_norm(x, w, b, &mut xh, &mut rs, &mut y);
            (xh, rs, y)
        };
        let (xh, rs, _) = run(&x, &w, &b);
        let mut dx = vec![0.0; rows * d];
        let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
        layer_norm_backward(&r, &xh, &rs, &w, &mut dx, &mut dw, &mut db);
        check_gradient("layer norm dx", &x, &dx, 1e-2, |x| {
            dot(&run(x, &w, &b).2, &r)
        });
        check_gradient("layer norm dw", &w, &dw, 1e-2, |w| {
            dot(&run(&x, w, &b).2, &r)
        });
        check_gradient("layer norm db", &b, &db, 1e-2, |b| {
            dot(&run(&x, &w, b).2, &r)
        });
    }
}

//! Forward passes of the layered models (`kind = "layers"` and the ResNet
//! presets), differentiated by candle's autograd.
//!
//! A [`Net`] is built from the validated nodes of
//! [`ModelSection::nodes`](ps_shared::config::ModelSection::nodes); it holds
//! indices into the model's parameter list (taken in the order of
//! [`Node::params`]), never tensors, so parameters written in place are
//! always the ones used.
//!
//! Batch norm in [`Mode::Train`] normalises with the batch's mean and
//! (biased) variance and reports, per layer, the batch mean and the
//! unbiased variance (`n / (n - 1)` times the biased one, `n = batch × h ×
//! w`), which the model folds into its running statistics. In
//! [`Mode::Eval`] it normalises with the running statistics. Dropout is
//! active only in training; its mask is drawn from `(seed, step, layer)`,
//! so a step's forward pass is reproducible.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape as CShape, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

use ps_shared::config::layers::{LayerSpec, Node, Shape};

/// Added to the variance before the square root.
pub const BN_EPS: f64 = 1e-5;

/// Mean and variance of one batch-norm layer's channels (both `[c]`).
#[derive(Debug, Clone)]
pub struct BnStats {
    pub mean: Tensor,
    pub var: Tensor,
}

/// How a forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Batch statistics in batch norm; dropout masks from `(seed, step)`.
    Train { seed: u64, step: u64 },
    /// Running statistics in batch norm; no dropout.
    Eval,
}

#[derive(Debug, Clone, Copy)]
struct Conv {
    weight: usize,
    bias: Option<usize>,
    stride: usize,
    padding: usize,
}

#[derive(Debug, Clone, Copy)]
struct Norm {
    gamma: usize,
    beta: usize,
    /// Index of the layer's running statistics.
    slot: usize,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Conv(Conv),
    Norm(Norm),
    Relu,
    Pool {
        kernel: usize,
        stride: usize,
        max: bool,
    },
    GlobalAvgPool,
    Residual {
        conv1: Conv,
        bn1: Norm,
        conv2: Conv,
        bn2: Norm,
        shortcut: Option<(Conv, Norm)>,
    },
    Dropout {
        p: f32,
        slot: usize,
    },
    Flatten,
    Linear {
        weight: usize,
        bias: Option<usize>,
    },
}

/// Hands out parameter and batch-norm indices in layout order.
#[derive(Default)]
struct Counter {
    params: usize,
    norms: Vec<usize>,
    dropouts: usize,
}

impl Counter {
    fn next(&mut self) -> usize {
        self.params += 1;
        self.params - 1
    }

    fn conv(&mut self, stride: usize, padding: usize, bias: bool) -> Conv {
        let weight = self.next();
        Conv {
            weight,
            bias: bias.then(|| self.next()),
            stride,
            padding,
        }
    }

    fn norm(&mut self, channels: usize) -> Norm {
        let gamma = self.next();
        let beta = self.next();
        self.norms.push(channels);
        Norm {
            gamma,
            beta,
            slot: self.norms.len() - 1,
        }
    }
}

/// A layered model's forward pass over the model's parameter list.
#[derive(Debug, Clone)]
pub struct Net {
    ops: Vec<Op>,
    /// Channels of each batch-norm layer, in order.
    norms: Vec<usize>,
    input: Shape,
}

impl Net {
    /// The network of `nodes` (validated, non-empty).
    pub fn new(nodes: &[Node]) -> Self {
        let mut n = Counter::default();
        let mut ops = Vec::with_capacity(nodes.len());
        for node in nodes {
            let first = n.params;
            let op = match node.layer {
                LayerSpec::Conv2d {
                    kernel,
                    stride,
                    padding,
                    bias,
                    ..
                } => Op::Conv(n.conv(stride, padding.unwrap_or(kernel / 2), bias)),
                LayerSpec::BatchNorm => Op::Norm(n.norm(channels(node.input))),
                LayerSpec::Relu => Op::Relu,
                LayerSpec::MaxPool { kernel, stride } => Op::Pool {
                    kernel,
                    stride: stride.unwrap_or(kernel),
                    max: true,
                },
                LayerSpec::AvgPool { kernel, stride } => Op::Pool {
                    kernel,
                    stride: stride.unwrap_or(kernel),
                    max: false,
                },
                LayerSpec::GlobalAvgPool => Op::GlobalAvgPool,
                LayerSpec::Residual { out, stride } => {
                    let conv1 = n.conv(stride, 1, false);
                    let bn1 = n.norm(out);
                    let conv2 = n.conv(1, 1, false);
                    let bn2 = n.norm(out);
                    let shortcut = node
                        .projects()
                        .then(|| (n.conv(stride, 0, false), n.norm(out)));
                    Op::Residual {
                        conv1,
                        bn1,
                        conv2,
                        bn2,
                        shortcut,
                    }
                }
                LayerSpec::Dropout { p } => {
                    n.dropouts += 1;
                    Op::Dropout {
                        p,
                        slot: n.dropouts - 1,
                    }
                }
                LayerSpec::Flatten => Op::Flatten,
                LayerSpec::Linear { bias, .. } => {
                    let weight = n.next();
                    Op::Linear {
                        weight,
                        bias: bias.then(|| n.next()),
                    }
                }
            };
            assert_eq!(n.params - first, node.params().len(), "{}", node.name);
            ops.push(op);
        }
        Self {
            ops,
            norms: n.norms,
            input: nodes.first().map_or(Shape::Flat(0), |n| n.input),
        }
    }

    /// Channels of each batch-norm layer.
    pub fn norms(&self) -> &[usize] {
        &self.norms
    }

    /// Logits of a `[batch, features]` input. In training, `stats` receives
    /// each batch-norm layer's batch statistics, in order.
    pub fn forward(
        &self,
        vars: &[Var],
        running: &[BnStats],
        x: &Tensor,
        mode: Mode,
        stats: &mut Vec<BnStats>,
    ) -> Result<Tensor> {
        let mut h = match self.input {
            Shape::Image { c, h, w } => x.reshape((x.dim(0)?, c, h, w))?,
            Shape::Flat(_) => x.clone(),
        };
        let p = |i: usize| vars[i].as_tensor();
        let mut run = Runner {
            vars,
            running,
            mode,
            stats,
        };
        for op in &self.ops {
            h = match *op {
                Op::Conv(c) => run.conv(&h, c)?,
                Op::Norm(n) => run.norm(&h, n)?,
                Op::Relu => h.relu()?,
                Op::Pool {
                    kernel,
                    stride,
                    max,
                } => pool(&h, kernel, stride, max)?,
                Op::GlobalAvgPool => h.flatten_from(2)?.mean(2)?,
                Op::Residual {
                    conv1,
                    bn1,
                    conv2,
                    bn2,
                    shortcut,
                } => {
                    let a = run.conv(&h, conv1)?;
                    let a = run.norm(&a, bn1)?.relu()?;
                    let a = run.conv(&a, conv2)?;
                    let a = run.norm(&a, bn2)?;
                    let skip = match shortcut {
                        Some((c, n)) => {
                            let s = run.conv(&h, c)?;
                            run.norm(&s, n)?
                        }
                        None => h,
                    };
                    (a + skip)?.relu()?
                }
                Op::Dropout { p, slot } => run.dropout(&h, p, slot)?,
                Op::Flatten => h.flatten_from(1)?,
                Op::Linear { weight, bias } => {
                    let flat = if h.rank() > 2 { h.flatten_from(1)? } else { h };
                    let y = flat.matmul(&p(weight).t()?)?;
                    match bias {
                        Some(b) => y.broadcast_add(p(b))?,
                        None => y,
                    }
                }
            };
        }
        Ok(h)
    }
}

fn channels(shape: Shape) -> usize {
    match shape {
        Shape::Image { c, .. } => c,
        Shape::Flat(n) => n,
    }
}

/// What one forward pass reads and writes besides the activations.
struct Runner<'a> {
    vars: &'a [Var],
    running: &'a [BnStats],
    mode: Mode,
    stats: &'a mut Vec<BnStats>,
}

impl Runner<'_> {
    fn conv(&self, x: &Tensor, c: Conv) -> Result<Tensor> {
        let y = conv2d(x, self.vars[c.weight].as_tensor(), c.stride, c.padding)?;
        match c.bias {
            Some(b) => {
                let b = self.vars[b].as_tensor();
                y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)
            }
            None => Ok(y),
        }
    }

    fn norm(&mut self, x: &Tensor, n: Norm) -> Result<Tensor> {
        let (batch, c, h, w) = x.dims4()?;
        let gamma = self.vars[n.gamma].as_tensor().reshape((1, c, 1, 1))?;
        let beta = self.vars[n.beta].as_tensor().reshape((1, c, 1, 1))?;
        match self.mode {
            Mode::Train { .. } => {
                let mean = channel_mean(x)?;
                let centred = x.broadcast_sub(&mean)?;
                let var = channel_mean(&centred.sqr()?)?;
                let scale = (var.clone() + BN_EPS)?
                    .sqrt()?
                    .recip()?
                    .broadcast_mul(&gamma)?;
                let count = batch * h * w;
                let unbiased = if count > 1 {
                    count as f64 / (count - 1) as f64
                } else {
                    1.0
                };
                self.stats.push(BnStats {
                    mean: mean.detach().flatten_all()?,
                    var: (var.detach().flatten_all()? * unbiased)?,
                });
                centred.broadcast_mul(&scale)?.broadcast_add(&beta)
            }
            Mode::Eval => {
                let r = &self.running[n.slot];
                let scale = (r.var.reshape((1, c, 1, 1))? + BN_EPS)?
                    .sqrt()?
                    .recip()?
                    .broadcast_mul(&gamma)?;
                let shift = beta.broadcast_sub(&r.mean.reshape((1, c, 1, 1))?.mul(&scale)?)?;
                x.broadcast_mul(&scale)?.broadcast_add(&shift)
            }
        }
    }

    fn dropout(&self, x: &Tensor, p: f32, slot: usize) -> Result<Tensor> {
        let Mode::Train { seed, step } = self.mode else {
            return Ok(x.clone());
        };
        if p <= 0.0 {
            return Ok(x.clone());
        }
        let mask = dropout_mask(x.elem_count(), p, seed, step, slot);
        x.mul(&Tensor::from_vec(mask, x.shape(), x.device())?)
    }
}

/// A 2-d convolution as one matrix product: the input unfolded into
/// columns ([`Im2Col`], `(in · kernel²) × out-pixels` per sample) times the
/// weight as an `out × (in · kernel²)` matrix. Its backward pass is two
/// matrix products and one fold of the column gradient back onto the image
/// (candle's own CPU convolution backward runs a direct transposed
/// convolution, several times slower). Other devices use candle's
/// convolution.
pub fn conv2d(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 {
        return x.conv2d(weight, padding, stride, 1, 1);
    }
    let (b, c, h, w) = x.dims4()?;
    let (o, _, k, _) = weight.dims4()?;
    let unfold = Im2Col {
        c,
        h,
        w,
        k,
        stride,
        padding,
    };
    let (oh, ow) = unfold.out_dims();
    let cols = x.contiguous()?.apply_op1(unfold)?;
    weight
        .reshape((o, c * k * k))?
        .broadcast_matmul(&cols)?
        .reshape((b, o, oh, ow))
}

/// Unfolds `[b, c, h, w]` into `[b, c · k², oh · ow]`: row
/// `(ci · k + i) · k + j` holds input pixel
/// `(oy · stride + i - padding, ox · stride + j - padding)` of channel `ci`
/// at column `oy · ow + ox` (0 outside the image).
#[derive(Debug, Clone, Copy)]
struct Im2Col {
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    padding: usize,
}

impl Im2Col {
    fn out_dims(&self) -> (usize, usize) {
        let out = |side: usize| (side + 2 * self.padding - self.k) / self.stride + 1;
        (out(self.h), out(self.w))
    }

    /// Calls `f(input index, column index)` for every pair the unfolding
    /// copies, sample by sample (`b` samples).
    fn pairs(&self, b: usize, mut f: impl FnMut(usize, usize)) {
        let (oh, ow) = self.out_dims();
        let (k, s, p) = (self.k, self.stride, self.padding);
        let mut col = 0;
        for n in 0..b {
            for ci in 0..self.c {
                let plane = (n * self.c + ci) * self.h * self.w;
                for i in 0..k {
                    for j in 0..k {
                        for oy in 0..oh {
                            let y = (oy * s + i).wrapping_sub(p);
                            if y >= self.h {
                                col += ow;
                                continue;
                            }
                            for ox in 0..ow {
                                let x = (ox * s + j).wrapping_sub(p);
                                if x < self.w {
                                    f(plane + y * self.w + x, col);
                                }
                                col += 1;
                            }
                        }
                    }
                }
            }
        }
    }
}

fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((a, b))) => Ok(&data[a..b]),
        _ => candle_core::bail!("im2col needs a contiguous f32 tensor"),
    }
}

impl CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "stratus-im2col"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, CShape)> {
        let input = contiguous_f32(storage, layout)?;
        let b = layout.dims()[0];
        let (oh, ow) = self.out_dims();
        let rows = self.c * self.k * self.k;
        let mut cols = vec![0.0f32; b * rows * oh * ow];
        self.pairs(b, |from, to| cols[to] = input[from]);
        Ok((CpuStorage::F32(cols), (b, rows, oh * ow).into()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let fold = Col2Im(*self);
        Ok(Some(
            grad.contiguous()?
                .apply_op1_no_bwd(&fold)?
                .reshape(arg.shape())?,
        ))
    }
}

/// The gradient of [`Im2Col`]: each column entry added back onto its pixel.
struct Col2Im(Im2Col);

impl CustomOp1 for Col2Im {
    fn name(&self) -> &'static str {
        "stratus-col2im"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, CShape)> {
        let cols = contiguous_f32(storage, layout)?;
        let u = &self.0;
        let b = layout.dims()[0];
        let mut image = vec![0.0f32; b * u.c * u.h * u.w];
        u.pairs(b, |to, from| image[to] += cols[from]);
        Ok((CpuStorage::F32(image), (b, u.c, u.h, u.w).into()))
    }
}

/// Mean of each channel of an NCHW tensor, `[1, c, 1, 1]`: the image
/// dimensions first (contiguous, fast), then the batch.
fn channel_mean(x: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let per_image = x.reshape((b, c, h * w))?.sum_keepdim(2)?;
    per_image.sum_keepdim(0)?.reshape((1, c, 1, 1))? / (b * h * w) as f64
}

/// The dropout mask of layer `slot` at `step`: each entry is 0 with
/// probability `p`, else `1 / (1 - p)`.
pub fn dropout_mask(len: usize, p: f32, seed: u64, step: u64, slot: usize) -> Vec<f32> {
    let mut mask = vec![0.0; len];
    dropout_mask_into(&mut mask, p, seed, step, slot);
    mask
}

/// [`dropout_mask`] written into `mask` (its length is the mask's).
pub fn dropout_mask_into(mask: &mut [f32], p: f32, seed: u64, step: u64, slot: usize) {
    let mixed = seed
        ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (slot as u64 + 1).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    let mut rng = StdRng::seed_from_u64(mixed);
    let keep = 1.0 / (1.0 - p);
    for m in mask {
        *m = if rng.random::<f32>() < p { 0.0 } else { keep };
    }
}

/// Max or average over `kernel × kernel` windows moved by `stride` (no
/// padding). The windows are gathered into a last dimension of `kernel²`
/// values (a reshape when they tile the image, strided views otherwise);
/// a max takes the first maximum of each window by index, so its gradient
/// goes to exactly one input even when overlapping windows share their
/// maximum (a max reduction would give it to every tied value).
///
/// On other devices an average over windows that tile the image is
/// candle's `avg_pool2d` (one kernel each way); max pooling keeps the
/// gathering form there too, because candle's `max_pool2d` backward scales
/// the gradient by the window's share of maxima.
pub fn pool(x: &Tensor, kernel: usize, stride: usize, max: bool) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    if !max && !x.device().is_cpu() && kernel == stride && h % kernel == 0 && w % kernel == 0 {
        return x.avg_pool2d(kernel);
    }
    let (oh, ow) = ((h - kernel) / stride + 1, (w - kernel) / stride + 1);
    let windows = if kernel == stride && h % kernel == 0 && w % kernel == 0 {
        x.reshape((b, c, oh, kernel, ow, kernel))?
            .permute((0, 1, 2, 4, 3, 5))?
            .reshape((b, c, oh, ow, kernel * kernel))?
    } else {
        let mut views = Vec::with_capacity(kernel * kernel);
        for i in 0..kernel {
            let rows = strided(x, 2, i, stride, oh)?;
            for j in 0..kernel {
                views.push(strided(&rows, 3, j, stride, ow)?);
            }
        }
        Tensor::stack(&views, 4)?
    };
    if max {
        let at = windows.detach().argmax_keepdim(4)?;
        windows.gather(&at, 4)?.squeeze(4)
    } else {
        windows.mean(4)
    }
}

/// Entries `start, start + stride, …` (`count` of them) along `dim`.
fn strided(x: &Tensor, dim: usize, start: usize, stride: usize, count: usize) -> Result<Tensor> {
    if stride == 1 {
        return x.narrow(dim, start, count);
    }
    let avail = (x.dim(dim)? - start).min(stride * count);
    let t = x.narrow(dim, start, avail)?;
    let t = if avail < stride * count {
        t.pad_with_zeros(dim, 0, stride * count - avail)?
    } else {
        t
    };
    let mut dims = t.dims().to_vec();
    dims[dim] = count;
    dims.insert(dim + 1, stride);
    t.reshape(dims)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

//! The CPU executor of a layered network's forward and backward pass.
//!
//! A [`NetExec`] is planned once from the validated nodes: per layer its
//! NHWC activation buffer, what its backward pass needs (batch norm's mean
//! and `1/σ`, max-pool argmaxes, dropout masks) and the scratch of its
//! kernels, all kept across steps (they grow for a larger batch and are
//! reused for a smaller one). Parameters are read from slices indexed like
//! the model's parameter list ([`Node::params`] order); gradients are
//! written straight into the flat gradient at each tensor's range.
//!
//! Layouts: images are NHWC inside the executor. The model's input arrives
//! as NCHW samples and is transposed once; where an image becomes a flat
//! vector (`flatten`, or a `linear` layer on an image) the values are put
//! back in C, H, W order, so linear weights and dropout masks on flat
//! values mean what they mean under autograd. A dropout mask on an image
//! is drawn in NCHW order (as [`crate::layers::dropout_mask`]) and permuted.

use std::ops::Range;

use rayon::prelude::*;

use ps_shared::config::layers::{LayerSpec, Node, Shape};

use super::conv::{Conv2d, ConvError, ConvGeom};
use super::norm::{self, Epilogue, NormScratch};
use super::pool::{self, PoolGeom};
use super::{add_into, chunk_rows, matmul, Mat};
use crate::layers::{dropout_mask_into, Mode, BN_EPS};

/// A batch-norm layer's batch statistics from the last training forward:
/// the mean and the unbiased variance of each channel.
#[derive(Debug, Clone, Default)]
pub struct BatchStats {
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
}

/// Running statistics of one batch-norm layer, for evaluation mode.
pub struct Running<'a> {
    pub mean: &'a [f32],
    pub var: &'a [f32],
}

struct ConvLayer {
    weight: usize,
    bias: Option<usize>,
    conv: Conv2d,
}

impl ConvLayer {
    /// The parameter tensors this layer owns.
    fn tensors(&self, out: &mut Vec<usize>) {
        out.push(self.weight);
        out.extend(self.bias);
    }

    fn new(weight: usize, bias: Option<usize>, geom: ConvGeom) -> Self {
        Self {
            weight,
            bias,
            conv: Conv2d::new(geom),
        }
    }

    fn forward(&mut self, params: &[&[f32]], x: &[f32], y: &mut [f32]) -> Result<(), ConvError> {
        self.conv.forward(x, params[self.weight], y)?;
        if let Some(b) = self.bias {
            add_rows(y, params[b]);
        }
        Ok(())
    }

    /// Weight (and bias) gradients into `grads`; `dx` when asked for.
    fn backward(
        &mut self,
        params: &[&[f32]],
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
        grads: &mut [f32],
        ranges: &[Range<usize>],
    ) -> Result<(), ConvError> {
        self.conv
            .backward_weight(x, dy, &mut grads[ranges[self.weight].clone()])?;
        if let Some(b) = self.bias {
            sum_rows(dy, &mut grads[ranges[b].clone()]);
        }
        if let Some(dx) = dx {
            self.conv.backward_data(dy, params[self.weight], dx)?;
        }
        Ok(())
    }
}

struct NormLayer {
    gamma: usize,
    beta: usize,
    slot: usize,
    c: usize,
    mean: Vec<f32>,
    inv_std: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
}

impl NormLayer {
    /// The parameter tensors this layer owns.
    fn tensors(&self, out: &mut Vec<usize>) {
        out.extend([self.gamma, self.beta]);
    }

    fn new(gamma: usize, beta: usize, slot: usize, c: usize) -> Self {
        Self {
            gamma,
            beta,
            slot,
            c,
            mean: vec![0.0; c],
            inv_std: vec![0.0; c],
            dgamma: vec![0.0; c],
            dbeta: vec![0.0; c],
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        params: &[&[f32]],
        mode: &Ctx,
        x: &[f32],
        epi: Epilogue,
        y: &mut [f32],
        stats: &mut [BatchStats],
        scratch: &mut NormScratch,
    ) {
        let (gamma, beta) = (params[self.gamma], params[self.beta]);
        match mode.running {
            None => {
                let s = &mut stats[self.slot];
                norm::train_forward(
                    x,
                    self.c,
                    gamma,
                    beta,
                    BN_EPS,
                    epi,
                    y,
                    &mut self.mean,
                    &mut self.inv_std,
                    &mut s.var,
                    scratch,
                );
                s.mean.copy_from_slice(&self.mean);
            }
            Some(running) => {
                let r = &running[self.slot];
                norm::eval_forward(
                    x,
                    self.c,
                    gamma,
                    beta,
                    r.mean,
                    r.var,
                    BN_EPS,
                    epi,
                    y,
                    &mut self.inv_std,
                );
            }
        }
    }

    /// `dy` is masked in place by the fused ReLU's output `relu_out`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &mut self,
        params: &[&[f32]],
        x: &[f32],
        relu_out: Option<&[f32]>,
        dy: &mut [f32],
        dx: &mut [f32],
        grads: &mut [f32],
        ranges: &[Range<usize>],
        scratch: &mut NormScratch,
    ) {
        norm::train_backward(
            x,
            self.c,
            params[self.gamma],
            &self.mean,
            &self.inv_std,
            relu_out,
            dy,
            dx,
            &mut self.dgamma,
            &mut self.dbeta,
            scratch,
        );
        grads[ranges[self.gamma].clone()].copy_from_slice(&self.dgamma);
        grads[ranges[self.beta].clone()].copy_from_slice(&self.dbeta);
    }
}

/// A basic residual block with its internal activations and gradients.
struct Block {
    conv1: ConvLayer,
    bn1: NormLayer,
    conv2: ConvLayer,
    bn2: NormLayer,
    shortcut: Option<(ConvLayer, NormLayer)>,
    /// conv1's output, bn1-relu's output, conv2's output (all `mid`).
    a1: Vec<f32>,
    r1: Vec<f32>,
    a2: Vec<f32>,
    /// The shortcut's conv and bn outputs (`mid`, projections only).
    s: Vec<f32>,
    sb: Vec<f32>,
    /// Gradient scratch: two of `mid`, one of the input.
    g1: Vec<f32>,
    g2: Vec<f32>,
    gx: Vec<f32>,
    /// Per-sample sizes of the input and of the block's activations.
    in_len: usize,
    mid_len: usize,
}

enum Step {
    Conv(ConvLayer),
    Norm {
        norm: NormLayer,
        relu: bool,
    },
    Relu,
    MaxPool {
        geom: PoolGeom,
        arg: Vec<u32>,
    },
    AvgPool(PoolGeom),
    GlobalAvgPool {
        pixels: usize,
        c: usize,
    },
    Residual(Box<Block>),
    Dropout {
        p: f32,
        slot: usize,
        /// `(c, h · w)` of an image input.
        image: Option<(usize, usize)>,
        /// The mask in the layer's own layout, and the NCHW draw.
        mask: Vec<f32>,
        drawn: Vec<f32>,
        active: bool,
    },
    /// An NHWC image to C, H, W order.
    ToFlat {
        c: usize,
        pixels: usize,
    },
    Linear {
        weight: usize,
        bias: Option<usize>,
        inputs: usize,
        outputs: usize,
    },
}

impl Step {
    /// The parameter tensors whose gradients this step's backward writes.
    fn tensors(&self, out: &mut Vec<usize>) {
        match self {
            Step::Conv(c) => c.tensors(out),
            Step::Norm { norm, .. } => norm.tensors(out),
            Step::Residual(b) => b.tensors(out),
            Step::Linear { weight, bias, .. } => {
                out.push(*weight);
                out.extend(*bias);
            }
            Step::Relu
            | Step::MaxPool { .. }
            | Step::AvgPool(_)
            | Step::GlobalAvgPool { .. }
            | Step::Dropout { .. }
            | Step::ToFlat { .. } => {}
        }
    }
}

/// What the forward pass runs with: running statistics in evaluation
/// mode, the dropout seed and step in training mode.
struct Ctx<'a> {
    running: Option<&'a [Running<'a>]>,
    dropout: Option<(u64, u64)>,
}

/// A layered network's plan and buffers.
pub struct NetExec {
    steps: Vec<Step>,
    /// Per-sample size of each activation (`steps.len() + 1`).
    sizes: Vec<usize>,
    input: Shape,
    classes: usize,
    batch: usize,
    acts: Vec<Vec<f32>>,
    grads: [Vec<f32>; 2],
    stats: Vec<BatchStats>,
    scratch: NormScratch,
    /// Whether the last forward ran in training mode (backward needs it).
    trained: bool,
}

/// Why a network cannot run here or a call was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("the executor has no kernel for layer {0}")]
    Unsupported(String),
    #[error("input has {got} values, expected {expected} ({batch} samples)")]
    Input {
        expected: usize,
        got: usize,
        batch: usize,
    },
    #[error("parameter {index} has {got} values, expected {expected}")]
    Param {
        index: usize,
        expected: usize,
        got: usize,
    },
    #[error("backward needs a training-mode forward first")]
    NoForward,
    #[error("{0} running statistics given, the network has {1} batch-norm layers")]
    Running(usize, usize),
    #[error(transparent)]
    Conv(#[from] ConvError),
}

fn image(shape: Shape) -> (usize, usize, usize) {
    match shape {
        Shape::Image { c, h, w } => (c, h, w),
        Shape::Flat(n) => (n, 1, 1),
    }
}

/// Parameter and batch-norm numbering in [`Node::params`] order.
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

    fn conv(&mut self, bias: bool, geom: ConvGeom) -> ConvLayer {
        let w = self.next();
        ConvLayer::new(w, bias.then(|| self.next()), geom)
    }

    fn norm(&mut self, c: usize) -> NormLayer {
        let (g, b) = (self.next(), self.next());
        self.norms.push(c);
        NormLayer::new(g, b, self.norms.len() - 1, c)
    }
}

fn geom(input: Shape, out: usize, kernel: usize, stride: usize, padding: usize) -> ConvGeom {
    let (c, h, w) = image(input);
    ConvGeom {
        batch: 0,
        in_h: h,
        in_w: w,
        in_c: c,
        out_c: out,
        kernel,
        stride,
        padding,
    }
}

impl NetExec {
    /// The plan of `nodes` (validated, as [`ps_shared::config::layers::plan`] gives
    /// them), its output `classes` wide.
    pub fn new(nodes: &[Node]) -> Result<Self, ExecError> {
        let mut n = Counter::default();
        let mut steps = Vec::new();
        let input = nodes.first().map_or(Shape::Flat(0), |n| n.input);
        let mut sizes = vec![input.numel()];
        let mut skip_relu = false;
        for (i, node) in nodes.iter().enumerate() {
            let first = n.params;
            if skip_relu {
                skip_relu = false;
                if node.layer == LayerSpec::Relu {
                    continue;
                }
            }
            let out_len = node.output.numel();
            match node.layer {
                LayerSpec::Conv2d {
                    out,
                    kernel,
                    stride,
                    padding,
                    bias,
                } => {
                    let g = geom(
                        node.input,
                        out,
                        kernel,
                        stride,
                        padding.unwrap_or(kernel / 2),
                    );
                    steps.push(Step::Conv(n.conv(bias, g)));
                }
                LayerSpec::BatchNorm => {
                    let relu = nodes.get(i + 1).map(|n| &n.layer) == Some(&LayerSpec::Relu);
                    skip_relu = relu;
                    let norm = n.norm(image(node.input).0);
                    steps.push(Step::Norm { norm, relu });
                }
                LayerSpec::Relu => steps.push(Step::Relu),
                LayerSpec::MaxPool { kernel, stride } | LayerSpec::AvgPool { kernel, stride } => {
                    let (c, h, w) = image(node.input);
                    let g = PoolGeom {
                        in_h: h,
                        in_w: w,
                        c,
                        kernel,
                        stride: stride.unwrap_or(kernel),
                    };
                    steps.push(if matches!(node.layer, LayerSpec::MaxPool { .. }) {
                        Step::MaxPool {
                            geom: g,
                            arg: Vec::new(),
                        }
                    } else {
                        Step::AvgPool(g)
                    });
                }
                LayerSpec::GlobalAvgPool => {
                    let (c, h, w) = image(node.input);
                    steps.push(Step::GlobalAvgPool { pixels: h * w, c });
                }
                LayerSpec::Residual { out, stride } => {
                    let conv1 = n.conv(false, geom(node.input, out, 3, stride, 1));
                    let bn1 = n.norm(out);
                    let conv2 = n.conv(false, geom(node.output, out, 3, 1, 1));
                    let bn2 = n.norm(out);
                    let shortcut = node.projects().then(|| {
                        let c = n.conv(false, geom(node.input, out, 1, stride, 0));
                        (c, n.norm(out))
                    });
                    steps.push(Step::Residual(Box::new(Block {
                        conv1,
                        bn1,
                        conv2,
                        bn2,
                        shortcut,
                        a1: Vec::new(),
                        r1: Vec::new(),
                        a2: Vec::new(),
                        s: Vec::new(),
                        sb: Vec::new(),
                        g1: Vec::new(),
                        g2: Vec::new(),
                        gx: Vec::new(),
                        in_len: node.input.numel(),
                        mid_len: out_len,
                    })));
                }
                LayerSpec::Dropout { p } => {
                    n.dropouts += 1;
                    let image = match node.input {
                        Shape::Image { c, h, w } => Some((c, h * w)),
                        Shape::Flat(_) => None,
                    };
                    steps.push(Step::Dropout {
                        p,
                        slot: n.dropouts - 1,
                        image,
                        mask: Vec::new(),
                        drawn: Vec::new(),
                        active: false,
                    });
                }
                LayerSpec::Flatten => {
                    if let Shape::Image { c, h, w } = node.input {
                        steps.push(Step::ToFlat { c, pixels: h * w });
                    } else {
                        continue;
                    }
                }
                LayerSpec::Linear { out, bias } => {
                    if let Shape::Image { c, h, w } = node.input {
                        steps.push(Step::ToFlat { c, pixels: h * w });
                        sizes.push(node.input.numel());
                    }
                    let weight = n.next();
                    steps.push(Step::Linear {
                        weight,
                        bias: bias.then(|| n.next()),
                        inputs: node.input.numel(),
                        outputs: out,
                    });
                }
            }
            if n.params - first != node.params().len() {
                return Err(ExecError::Unsupported(node.name.clone()));
            }
            sizes.push(out_len);
        }
        let classes = *sizes.last().unwrap_or(&0);
        let stats = n
            .norms
            .iter()
            .map(|&c| BatchStats {
                mean: vec![0.0; c],
                var: vec![0.0; c],
            })
            .collect();
        Ok(Self {
            acts: vec![Vec::new(); sizes.len()],
            steps,
            sizes,
            input,
            classes,
            batch: 0,
            grads: [Vec::new(), Vec::new()],
            stats,
            scratch: NormScratch::default(),
            trained: false,
        })
    }

    /// Values the executor's buffers can hold (activations, gradients,
    /// saved values and the kernels' scratch): steady once warm.
    pub fn workspace_len(&self) -> usize {
        let mut n: usize = self.acts.iter().chain(&self.grads).map(Vec::capacity).sum();
        let conv = |c: &ConvLayer| c.conv.workspace_len();
        for step in &self.steps {
            n += match step {
                Step::Conv(c) => conv(c),
                Step::MaxPool { arg, .. } => arg.capacity(),
                Step::Dropout { mask, drawn, .. } => mask.capacity() + drawn.capacity(),
                Step::Residual(b) => {
                    let bufs = [&b.a1, &b.r1, &b.a2, &b.s, &b.sb, &b.g1, &b.g2, &b.gx];
                    bufs.iter().map(|v| v.capacity()).sum::<usize>()
                        + conv(&b.conv1)
                        + conv(&b.conv2)
                        + b.shortcut.as_ref().map_or(0, |(c, _)| conv(c))
                }
                _ => 0,
            };
        }
        n
    }

    /// Batch-norm layers, in order.
    pub fn norms(&self) -> usize {
        self.stats.len()
    }

    /// Each batch-norm layer's batch statistics from the last training
    /// forward.
    pub fn batch_stats(&self) -> &[BatchStats] {
        &self.stats
    }

    /// Sizes every buffer for `batch` samples (capacity is kept).
    fn set_batch(&mut self, batch: usize) {
        self.batch = batch;
        for (a, &s) in self.acts.iter_mut().zip(&self.sizes) {
            a.resize(batch * s, 0.0);
        }
        let largest = self.sizes.iter().max().copied().unwrap_or(0);
        for g in &mut self.grads {
            g.resize(batch * largest, 0.0);
        }
        for (step, &size) in self.steps.iter_mut().zip(&self.sizes) {
            match step {
                Step::Conv(c) => c.conv.set_batch(batch),
                Step::MaxPool { geom, arg } => arg.resize(batch * geom.out_len(), 0),
                Step::Dropout { mask, drawn, .. } => {
                    mask.resize(batch * size, 0.0);
                    drawn.resize(batch * size, 0.0);
                }
                Step::Residual(b) => {
                    let (mid, inl) = (batch * b.mid_len, batch * b.in_len);
                    for v in [&mut b.a1, &mut b.r1, &mut b.a2, &mut b.g1, &mut b.g2] {
                        v.resize(mid, 0.0);
                    }
                    b.gx.resize(inl, 0.0);
                    b.conv1.conv.set_batch(batch);
                    b.conv2.conv.set_batch(batch);
                    if let Some((c, _)) = &mut b.shortcut {
                        c.conv.set_batch(batch);
                        b.s.resize(mid, 0.0);
                        b.sb.resize(mid, 0.0);
                    }
                }
                _ => {}
            }
        }
    }

    fn check_params(&self, params: &[&[f32]]) -> Result<(), ExecError> {
        let mut expect = Vec::new();
        let conv = |c: &ConvLayer, out: &mut Vec<(usize, usize)>| {
            let g = c.conv.geom();
            out.push((c.weight, g.out_c * g.in_c * g.kernel * g.kernel));
            if let Some(b) = c.bias {
                out.push((b, g.out_c));
            }
        };
        let norm = |n: &NormLayer, out: &mut Vec<(usize, usize)>| {
            out.push((n.gamma, n.c));
            out.push((n.beta, n.c));
        };
        for step in &self.steps {
            match step {
                Step::Conv(c) => conv(c, &mut expect),
                Step::Norm { norm: n, .. } => norm(n, &mut expect),
                Step::Residual(b) => {
                    conv(&b.conv1, &mut expect);
                    norm(&b.bn1, &mut expect);
                    conv(&b.conv2, &mut expect);
                    norm(&b.bn2, &mut expect);
                    if let Some((c, n)) = &b.shortcut {
                        conv(c, &mut expect);
                        norm(n, &mut expect);
                    }
                }
                Step::Linear {
                    weight,
                    bias,
                    inputs,
                    outputs,
                } => {
                    expect.push((*weight, inputs * outputs));
                    if let Some(b) = bias {
                        expect.push((*b, *outputs));
                    }
                }
                _ => {}
            }
        }
        for (index, expected) in expect {
            let got = params.get(index).map_or(0, |p| p.len());
            if got != expected {
                return Err(ExecError::Param {
                    index,
                    expected,
                    got,
                });
            }
        }
        Ok(())
    }

    /// Logits (`[batch, classes]`) of `x` (`batch` samples of NCHW
    /// features). Training mode (`running` is `None`) records each batch
    /// norm's batch statistics and keeps what the backward pass needs;
    /// evaluation mode normalises with `running` and skips dropout.
    pub fn forward(
        &mut self,
        params: &[&[f32]],
        x: &[f32],
        batch: usize,
        mode: Mode,
        running: Option<&[Running]>,
    ) -> Result<&[f32], ExecError> {
        let expected = batch * self.sizes[0];
        if x.len() != expected {
            return Err(ExecError::Input {
                expected,
                got: x.len(),
                batch,
            });
        }
        self.check_params(params)?;
        let ctx = match (mode, running) {
            (Mode::Train { seed, step }, _) => Ctx {
                running: None,
                dropout: Some((seed, step)),
            },
            (Mode::Eval, Some(r)) if r.len() == self.stats.len() => Ctx {
                running: Some(r),
                dropout: None,
            },
            (Mode::Eval, r) => {
                return Err(ExecError::Running(
                    r.map_or(0, |r| r.len()),
                    self.stats.len(),
                ))
            }
        };
        self.set_batch(batch);
        match self.input {
            Shape::Image { c, h, w } => to_nhwc(c, h * w, x, &mut self.acts[0]),
            Shape::Flat(_) => self.acts[0].copy_from_slice(x),
        }
        let Self {
            steps,
            acts,
            stats,
            scratch,
            ..
        } = self;
        for (i, step) in steps.iter_mut().enumerate() {
            let (before, after) = acts.split_at_mut(i + 1);
            let (x, y) = (&before[i][..], &mut after[0][..]);
            forward_step(step, params, &ctx, x, y, stats, scratch)?;
        }
        self.trained = ctx.running.is_none();
        Ok(self.logits())
    }

    /// The logits of the last forward pass.
    pub fn logits(&self) -> &[f32] {
        &self.acts[self.acts.len() - 1]
    }

    /// Output width.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The gradient buffer for the logits (`[batch, classes]`), to fill
    /// before [`NetExec::backward`].
    pub fn logit_grad(&mut self) -> &mut [f32] {
        let n = self.batch * self.classes;
        &mut self.grads[0][..n]
    }

    /// The logits with their gradient buffer (for a loss that reads one and
    /// writes the other).
    pub fn logits_and_grad(&mut self) -> (&[f32], &mut [f32]) {
        let n = self.batch * self.classes;
        let last = self.acts.len() - 1;
        (&self.acts[last], &mut self.grads[0][..n])
    }

    /// Backward from the gradient in [`NetExec::logit_grad`] after a
    /// training-mode forward: every parameter's gradient is written into
    /// `grads` at `ranges[index]`.
    pub fn backward(
        &mut self,
        params: &[&[f32]],
        grads: &mut [f32],
        ranges: &[Range<usize>],
    ) -> Result<(), ExecError> {
        self.backward_with(params, grads, ranges, &mut |_, _| {})
    }

    /// [`NetExec::backward`], telling `done` after each layer which
    /// parameter tensors' gradients it finished (they are final in
    /// `grads` from then on), so that they can leave before the pass ends.
    pub fn backward_with(
        &mut self,
        params: &[&[f32]],
        grads: &mut [f32],
        ranges: &[Range<usize>],
        done: &mut dyn FnMut(&[usize], &[f32]),
    ) -> Result<(), ExecError> {
        if !self.trained {
            return Err(ExecError::NoForward);
        }
        self.check_params(params)?;
        let batch = self.batch;
        let Self {
            steps,
            acts,
            grads: g,
            sizes,
            scratch,
            ..
        } = self;
        let [ga, gb] = g;
        let (mut cur, mut next) = (ga, gb);
        for (i, step) in steps.iter_mut().enumerate().rev() {
            let dy = &mut cur[..batch * sizes[i + 1]];
            let dx = (i > 0).then(|| &mut next[..batch * sizes[i]]);
            backward_step(
                step,
                params,
                &acts[i],
                &acts[i + 1],
                dy,
                dx,
                grads,
                ranges,
                scratch,
            )?;
            let mut tensors = Vec::new();
            step.tensors(&mut tensors);
            if !tensors.is_empty() {
                done(&tensors, grads);
            }
            std::mem::swap(&mut cur, &mut next);
        }
        Ok(())
    }
}

fn forward_step(
    step: &mut Step,
    params: &[&[f32]],
    ctx: &Ctx,
    x: &[f32],
    y: &mut [f32],
    stats: &mut [BatchStats],
    scratch: &mut NormScratch,
) -> Result<(), ConvError> {
    match step {
        Step::Conv(c) => c.forward(params, x, y)?,
        Step::Norm { norm, relu } => {
            let epi = Epilogue {
                skip: None,
                relu: *relu,
            };
            norm.forward(params, ctx, x, epi, y, stats, scratch);
        }
        Step::Relu => {
            let chunk = chunk_rows(x.len()).max(4096);
            y.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk))
                .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, x)| *y = x.max(0.0)));
        }
        Step::MaxPool { geom, arg } => pool::max_forward(geom, x, y, arg),
        Step::AvgPool(geom) => pool::avg_forward(geom, x, y),
        Step::GlobalAvgPool { pixels, c } => pool::global_avg_forward(*pixels, *c, x, y),
        Step::Residual(b) => b.forward(params, ctx, x, y, stats, scratch)?,
        Step::Dropout {
            p,
            slot,
            image,
            mask,
            drawn,
            active,
        } => {
            *active = false;
            if let (Some((seed, s)), true) = (ctx.dropout, *p > 0.0) {
                *active = true;
                dropout_mask_into(drawn, *p, seed, s, *slot);
                match *image {
                    Some((c, pixels)) => to_nhwc(c, pixels, drawn, mask),
                    None => mask.copy_from_slice(drawn),
                }
                y.iter_mut()
                    .zip(x.iter().zip(mask.iter()))
                    .for_each(|(y, (x, m))| *y = x * m);
            } else {
                y.copy_from_slice(x);
            }
        }
        Step::ToFlat { c, pixels } => to_nchw(*c, *pixels, x, y),
        Step::Linear {
            weight,
            bias,
            inputs,
            outputs,
        } => {
            let (i, o) = (*inputs, *outputs);
            let n = x.len() / i.max(1);
            let w = params[*weight];
            matmul(n, o, i, y, false, Mat::rows(x, i), Mat::transposed(w, i));
            if let Some(b) = bias {
                add_rows(y, params[*b]);
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn backward_step(
    step: &mut Step,
    params: &[&[f32]],
    x: &[f32],
    y: &[f32],
    dy: &mut [f32],
    dx: Option<&mut [f32]>,
    grads: &mut [f32],
    ranges: &[Range<usize>],
    scratch: &mut NormScratch,
) -> Result<(), ConvError> {
    match step {
        Step::Conv(c) => c.backward(params, x, dy, dx, grads, ranges)?,
        Step::Norm { norm, relu } => {
            let mut own;
            let dx = match dx {
                Some(dx) => dx,
                None => {
                    // The batch norm still needs its dx pass for nothing;
                    // give it scratch (only when it is the first layer).
                    own = vec![0.0f32; x.len()];
                    &mut own[..]
                }
            };
            let out = relu.then_some(y);
            norm.backward(params, x, out, dy, dx, grads, ranges, scratch);
        }
        Step::Relu => {
            if let Some(dx) = dx {
                let chunk = chunk_rows(dx.len()).max(4096);
                dx.par_chunks_mut(chunk)
                    .zip(dy.par_chunks(chunk).zip(y.par_chunks(chunk)))
                    .for_each(|(dx, (dy, y))| {
                        for ((dx, &d), &y) in dx.iter_mut().zip(dy.iter()).zip(y) {
                            *dx = if y > 0.0 { d } else { 0.0 };
                        }
                    });
            }
        }
        Step::MaxPool { geom, arg } => {
            if let Some(dx) = dx {
                pool::max_backward(geom, dy, arg, dx);
            }
        }
        Step::AvgPool(geom) => {
            if let Some(dx) = dx {
                pool::avg_backward(geom, dy, dx);
            }
        }
        Step::GlobalAvgPool { pixels, c } => {
            if let Some(dx) = dx {
                pool::global_avg_backward(*pixels, *c, dy, dx);
            }
        }
        Step::Residual(b) => b.backward(params, x, y, dy, dx, grads, ranges, scratch)?,
        Step::Dropout { mask, active, .. } => {
            if let Some(dx) = dx {
                if *active {
                    dx.iter_mut()
                        .zip(dy.iter().zip(mask.iter()))
                        .for_each(|(dx, (d, m))| *dx = d * m);
                } else {
                    dx.copy_from_slice(dy);
                }
            }
        }
        Step::ToFlat { c, pixels } => {
            if let Some(dx) = dx {
                to_nhwc(*c, *pixels, dy, dx);
            }
        }
        Step::Linear {
            weight,
            bias,
            inputs,
            outputs,
        } => {
            let (i, o) = (*inputs, *outputs);
            let n = x.len() / i.max(1);
            matmul(
                o,
                i,
                n,
                &mut grads[ranges[*weight].clone()],
                false,
                Mat::transposed(dy, o),
                Mat::rows(x, i),
            );
            if let Some(b) = bias {
                sum_rows(dy, &mut grads[ranges[*b].clone()]);
            }
            if let Some(dx) = dx {
                let w = params[*weight];
                matmul(n, i, o, dx, false, Mat::rows(dy, o), Mat::rows(w, i));
            }
        }
    }
    Ok(())
}

impl Block {
    /// The parameter tensors of the block's layers.
    fn tensors(&self, out: &mut Vec<usize>) {
        self.conv1.tensors(out);
        self.bn1.tensors(out);
        self.conv2.tensors(out);
        self.bn2.tensors(out);
        if let Some((conv, bn)) = &self.shortcut {
            conv.tensors(out);
            bn.tensors(out);
        }
    }

    fn forward(
        &mut self,
        params: &[&[f32]],
        ctx: &Ctx,
        x: &[f32],
        y: &mut [f32],
        stats: &mut [BatchStats],
        scratch: &mut NormScratch,
    ) -> Result<(), ConvError> {
        let plain = Epilogue {
            skip: None,
            relu: false,
        };
        self.conv1.forward(params, x, &mut self.a1)?;
        let relu = Epilogue {
            skip: None,
            relu: true,
        };
        self.bn1
            .forward(params, ctx, &self.a1, relu, &mut self.r1, stats, scratch);
        self.conv2.forward(params, &self.r1, &mut self.a2)?;
        let skip = match &mut self.shortcut {
            Some((conv, bn)) => {
                conv.forward(params, x, &mut self.s)?;
                bn.forward(params, ctx, &self.s, plain, &mut self.sb, stats, scratch);
                &self.sb[..]
            }
            None => x,
        };
        let last = Epilogue {
            skip: Some(skip),
            relu: true,
        };
        self.bn2
            .forward(params, ctx, &self.a2, last, y, stats, scratch);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn backward(
        &mut self,
        params: &[&[f32]],
        x: &[f32],
        y: &[f32],
        dy: &mut [f32],
        mut dx: Option<&mut [f32]>,
        grads: &mut [f32],
        ranges: &[Range<usize>],
        scratch: &mut NormScratch,
    ) -> Result<(), ConvError> {
        // dy becomes the gradient of bn2's output + skip (ReLU mask).
        self.bn2.backward(
            params,
            &self.a2,
            Some(y),
            dy,
            &mut self.g2,
            grads,
            ranges,
            scratch,
        );
        self.conv2.backward(
            params,
            &self.r1,
            &self.g2,
            Some(&mut self.g1),
            grads,
            ranges,
        )?;
        self.bn1.backward(
            params,
            &self.a1,
            Some(&self.r1),
            &mut self.g1,
            &mut self.g2,
            grads,
            ranges,
            scratch,
        );
        self.conv1
            .backward(params, x, &self.g2, dx.as_deref_mut(), grads, ranges)?;
        match &mut self.shortcut {
            Some((conv, bn)) => {
                // g1 is free again: the shortcut bn's input gradient.
                bn.backward(
                    params,
                    &self.s,
                    None,
                    dy,
                    &mut self.g1,
                    grads,
                    ranges,
                    scratch,
                );
                let gx = dx.is_some().then_some(&mut self.gx[..]);
                conv.backward(params, x, &self.g1, gx, grads, ranges)?;
                if let Some(dx) = dx {
                    add_into(dx, &self.gx);
                }
            }
            None => {
                if let Some(dx) = dx {
                    add_into(dx, dy);
                }
            }
        }
        Ok(())
    }
}

/// `y[r, :] += b` for every row.
fn add_rows(y: &mut [f32], b: &[f32]) {
    let c = b.len();
    let chunk = chunk_rows(y.len() / c.max(1)) * c;
    y.par_chunks_mut(chunk.max(1)).for_each(|y| {
        for row in y.chunks_exact_mut(c) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    });
}

/// `out = Σ_r dy[r, :]` (out.len() columns).
fn sum_rows(dy: &[f32], out: &mut [f32]) {
    let c = out.len();
    let mut acc = vec![0.0f64; c];
    for row in dy.chunks_exact(c) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += f64::from(v);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a as f32;
    }
}

/// Samples of `c x pixels` (NCHW) to `pixels x c` (NHWC).
fn to_nhwc(c: usize, pixels: usize, x: &[f32], y: &mut [f32]) {
    let per = c * pixels;
    y.par_chunks_mut(per)
        .zip(x.par_chunks(per))
        .for_each(|(y, x)| {
            for ch in 0..c {
                for p in 0..pixels {
                    y[p * c + ch] = x[ch * pixels + p];
                }
            }
        });
}

/// Samples of `pixels x c` (NHWC) to `c x pixels` (NCHW).
fn to_nchw(c: usize, pixels: usize, x: &[f32], y: &mut [f32]) {
    let per = c * pixels;
    y.par_chunks_mut(per)
        .zip(x.par_chunks(per))
        .for_each(|(y, x)| {
            for p in 0..pixels {
                for ch in 0..c {
                    y[ch * pixels + p] = x[p * c + ch];
                }
            }
        });
}

//! 2-d convolution on the CPU: activations NHWC, weights OIHW, all `f32`
//! and contiguous.
//!
//! A [`Conv2d`] holds one layer's geometry and its scratch buffers, which are
//! reused from step to step (they only grow, when a larger batch arrives).
//! Each pass is a matrix product on the input unfolded into columns
//! ("im2col"): output pixel `m = (n · out_h + oy) · out_w + ox` is row `m`
//! of a `[rows, k · k · in_c]` matrix whose column `(ky · k + kx) · in_c + c`
//! holds input pixel `(oy · stride + ky - padding, ox · stride + kx -
//! padding)` of channel `c` (0 outside the image). In NHWC each such run of
//! `in_c` values is one contiguous copy, and a 1x1 stride-1 convolution
//! needs no copy at all.
//!
//! * forward: `y[rows, out_c] = cols · W'`, with `W'` the weight repacked
//!   as `[k · k · in_c, out_c]`;
//! * input gradient: `dcols = dy · W'ᵀ`, folded back onto the image (each
//!   column value added to the input pixel it was copied from);
//! * weight gradient: `dW' = colsᵀ · dy`, unpacked to OIHW.
//!
//! The rows are processed in chunks so that a chunk's columns stay in the
//! cache between the unfolding and the matrix product.
//!
//! ```
//! use ps_worker::kernels::conv::{Conv2d, ConvGeom};
//! let geom = ConvGeom { batch: 1, in_h: 3, in_w: 3, in_c: 1, out_c: 1,
//!                       kernel: 3, stride: 1, padding: 1 };
//! let mut conv = Conv2d::new(geom);
//! let x = [1.0; 9];
//! let weight = [1.0; 9];
//! let mut y = [0.0; 9];
//! conv.forward(&x, &weight, &mut y).unwrap();
//! // The centre sees all nine inputs, a corner four.
//! assert_eq!(y[4], 9.0);
//! assert_eq!(y[0], 4.0);
//! ```

use std::ops::Range;

use rayon::prelude::*;

use super::{matmul_strided as matmul, Mat};

/// Geometry of one 2-d convolution; activations are NHWC, f32, contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeom {
    pub batch: usize,
    pub in_h: usize,
    pub in_w: usize,
    pub in_c: usize,
    pub out_c: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

/// Why a convolution call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvError {
    #[error("convolution geometry {geom:?}: {reason}")]
    Geometry {
        geom: ConvGeom,
        reason: &'static str,
    },
    #[error("convolution {what}: {got} values, expected {expected} for geometry {geom:?}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
        geom: ConvGeom,
    },
}

fn out_side(side: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    match (side + 2 * padding).checked_sub(kernel) {
        Some(span) if stride > 0 && kernel > 0 => span / stride + 1,
        _ => 0,
    }
}

impl ConvGeom {
    /// Output height (0 for a geometry that [`ConvGeom::validate`] refuses).
    pub fn out_h(&self) -> usize {
        out_side(self.in_h, self.kernel, self.stride, self.padding)
    }

    /// Output width (0 for a geometry that [`ConvGeom::validate`] refuses).
    pub fn out_w(&self) -> usize {
        out_side(self.in_w, self.kernel, self.stride, self.padding)
    }

    /// Values in the input `x` (and its gradient): `batch · in_h · in_w · in_c`.
    pub fn input_len(&self) -> usize {
        self.batch * self.in_h * self.in_w * self.in_c
    }

    /// Values in the output `y` (and its gradient): `batch · out_h · out_w · out_c`.
    pub fn output_len(&self) -> usize {
        self.batch * self.out_h() * self.out_w() * self.out_c
    }

    /// Values in the weight (and its gradient): `out_c · in_c · kernel²`.
    pub fn weight_len(&self) -> usize {
        self.out_c * self.in_c * self.kernel * self.kernel
    }

    /// Output pixels over the batch: the rows of the unfolded input.
    fn rows(&self) -> usize {
        self.batch * self.out_h() * self.out_w()
    }

    /// Columns of the unfolded input: `kernel² · in_c`.
    fn depth(&self) -> usize {
        self.kernel * self.kernel * self.in_c
    }

    /// A 1x1 stride-1 unpadded convolution: the input already is the
    /// unfolded matrix.
    fn is_pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }

    /// Checks that the geometry describes a convolution with at least one
    /// output pixel and sizes that fit in memory.
    pub fn validate(&self) -> Result<(), ConvError> {
        let refuse = |reason| {
            Err(ConvError::Geometry {
                geom: *self,
                reason,
            })
        };
        if self.in_c == 0 || self.out_c == 0 {
            return refuse("in_c and out_c must be at least 1");
        }
        if self.kernel == 0 {
            return refuse("kernel must be at least 1");
        }
        if self.stride == 0 {
            return refuse("stride must be at least 1");
        }
        if self.padding >= self.kernel {
            return refuse("padding must be smaller than the kernel");
        }
        if self.in_h == 0 || self.in_w == 0 {
            return refuse("in_h and in_w must be at least 1");
        }
        // Every size below must be computable without overflow.
        let sizes = [
            [self.batch, self.in_h, self.in_w, self.in_c],
            [
                self.batch,
                self.in_h + 2 * self.padding,
                self.in_w,
                self.out_c,
            ],
            [self.out_c, self.in_c, self.kernel, self.kernel],
            [
                self.batch,
                self.in_h + 2 * self.padding,
                self.in_w + 2 * self.padding,
                self.kernel * self.kernel * self.in_c,
            ],
        ];
        let fits = sizes.iter().all(|dims| {
            dims.iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .is_some_and(|n| n <= isize::MAX as usize / 8)
        });
        if !fits {
            return refuse("sizes too large");
        }
        if self.out_h() == 0 || self.out_w() == 0 {
            return refuse("kernel larger than the padded input");
        }
        Ok(())
    }

    fn check_len(&self, what: &'static str, got: usize, expected: usize) -> Result<(), ConvError> {
        if got == expected {
            Ok(())
        } else {
            Err(ConvError::Length {
                what,
                expected,
                got,
                geom: *self,
            })
        }
    }
}

/// One convolution layer's plan and scratch buffers, reused across steps
/// (no allocation per step once warm; buffers grow if a larger batch
/// arrives).
#[derive(Debug)]
pub struct Conv2d {
    geom: ConvGeom,
    /// The weight as a `[kernel² · in_c, out_c]` matrix, or its gradient.
    packed: Vec<f32>,
    /// One per parallel task.
    scratch: Vec<Scratch>,
}

/// One task's buffers.
#[derive(Debug, Default)]
struct Scratch {
    /// A chunk of the unfolded input, or of its gradient.
    cols: Vec<f32>,
    /// The task's share of the packed weight gradient.
    acc: Vec<f32>,
}

/// Rows of the unfolded input processed at a time.
fn chunk_rows(geom: &ConvGeom) -> usize {
    // About 256 KiB of columns: the chunk stays in L2 between its
    // unfolding and the matrix product.
    ((256 * 1024 / 4) / geom.depth().max(1)).max(16)
}

/// How the batch is split: `(tasks, images per task)`. Each task takes a
/// run of whole images, so that the input gradients they fold do not
/// overlap.
fn split(batch: usize) -> (usize, usize) {
    let threads = rayon::current_num_threads().max(1);
    let per = batch.div_ceil(threads.min(batch).max(1)).max(1);
    (batch.div_ceil(per), per)
}

/// The product's own threads: only when the batch gives one task and the
/// pool has more than one thread.
fn parallelism(tasks: usize) -> gemm::Parallelism {
    match rayon::current_num_threads() {
        n if n > 1 && tasks <= 1 => gemm::Parallelism::Rayon(n),
        _ => gemm::Parallelism::None,
    }
}

/// Grows `buf` to at least `len` values (never shrinks it).
fn ensure(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
}

/// Calls `f(offset in x, offset in the row)` for each run of `in_c` input
/// values that row `m` of the unfolded input copies; runs outside the image
/// are skipped (they are zeros).
#[inline]
fn for_each_tap(g: &ConvGeom, m: usize, mut f: impl FnMut(usize, usize)) {
    let (oh, ow) = (g.out_h(), g.out_w());
    let (n, pix) = (m / (oh * ow), m % (oh * ow));
    let (oy, ox) = (pix / ow, pix % ow);
    let c = g.in_c;
    for ky in 0..g.kernel {
        let iy = (oy * g.stride + ky).wrapping_sub(g.padding);
        if iy >= g.in_h {
            continue;
        }
        for kx in 0..g.kernel {
            let ix = (ox * g.stride + kx).wrapping_sub(g.padding);
            if ix >= g.in_w {
                continue;
            }
            f(
                ((n * g.in_h + iy) * g.in_w + ix) * c,
                (ky * g.kernel + kx) * c,
            );
        }
    }
}

/// Unfolds rows `rows` of `x` into `out` (`rows.len() × depth`).
fn im2col(g: &ConvGeom, x: &[f32], rows: Range<usize>, out: &mut [f32]) {
    let (oh, ow) = (g.out_h(), g.out_w());
    let (k, c) = (g.kernel, g.in_c);
    // One kernel row's taps: consecutive pixels of one input row.
    let line = k * c;
    for (m, row) in rows.zip(out.chunks_exact_mut(g.depth())) {
        let (n, pix) = (m / (oh * ow), m % (oh * ow));
        let (oy, ox) = (pix / ow, pix % ow);
        let ix0 = (ox * g.stride).wrapping_sub(g.padding);
        let inside = ix0 < g.in_w && ix0 + k <= g.in_w;
        for (ky, dst) in row.chunks_exact_mut(line).enumerate() {
            let iy = (oy * g.stride + ky).wrapping_sub(g.padding);
            if iy >= g.in_h {
                dst.fill(0.0);
                continue;
            }
            let base = (n * g.in_h + iy) * g.in_w;
            if inside {
                let from = (base + ix0) * c;
                dst.copy_from_slice(&x[from..from + line]);
                continue;
            }
            for (kx, tap) in dst.chunks_exact_mut(c).enumerate() {
                let ix = ix0.wrapping_add(kx);
                if ix < g.in_w {
                    let from = (base + ix) * c;
                    tap.copy_from_slice(&x[from..from + c]);
                } else {
                    tap.fill(0.0);
                }
            }
        }
    }
}

/// Adds rows `rows` of the column gradient `cols` onto the input gradient.
fn col2im_add(g: &ConvGeom, cols: &[f32], rows: Range<usize>, dx: &mut [f32]) {
    let (depth, c) = (g.depth(), g.in_c);
    for (m, row) in rows.zip(cols.chunks_exact(depth)) {
        for_each_tap(g, m, |to, from| {
            for (d, s) in dx[to..to + c].iter_mut().zip(&row[from..from + c]) {
                *d += s;
            }
        });
    }
}

/// The forward pass on a packed weight, `scratch.len()` tasks of `per`
/// images each.
fn forward_tasks(
    g: &ConvGeom,
    x: &[f32],
    packed: &[f32],
    scratch: &mut [Scratch],
    per: usize,
    y: &mut [f32],
) {
    let g = *g;
    let (depth, o, pixels) = (g.depth(), g.out_c, g.out_h() * g.out_w());
    let w = Mat {
        data: packed,
        rs: o,
        cs: 1,
    };
    let tasks = scratch.len();
    let par = parallelism(tasks);
    let task = |(t, (y, s)): (usize, (&mut [f32], &mut Scratch))| {
        let first = t * per * pixels;
        let rows = y.len() / o;
        for start in (0..rows).step_by(chunk_rows(&g)) {
            let end = (start + chunk_rows(&g)).min(rows);
            let lhs = if g.is_pointwise() {
                &x[(first + start) * depth..(first + end) * depth]
            } else {
                let cols = &mut s.cols[..(end - start) * depth];
                im2col(&g, x, first + start..first + end, cols);
                cols
            };
            let lhs = Mat {
                data: lhs,
                rs: depth,
                cs: 1,
            };
            let y = &mut y[start * o..end * o];
            matmul((end - start, o, depth), y, o, false, lhs, w, par);
        }
    };
    if tasks > 1 {
        y.par_chunks_mut(per * pixels * o)
            .zip(scratch.par_iter_mut())
            .enumerate()
            .for_each(task);
    } else {
        y.chunks_mut(per * pixels * o)
            .zip(scratch.iter_mut())
            .enumerate()
            .for_each(task);
    }
}

impl Conv2d {
    /// A convolution of geometry `geom`; buffers are sized on first use.
    pub fn new(geom: ConvGeom) -> Self {
        Conv2d {
            geom,
            packed: Vec::new(),
            scratch: Vec::new(),
        }
    }

    pub fn geom(&self) -> ConvGeom {
        self.geom
    }

    /// Changes the batch size (the last batch of an epoch may be smaller).
    pub fn set_batch(&mut self, batch: usize) {
        self.geom.batch = batch;
    }

    /// Scratch values held (capacity of all buffers): stays the same from
    /// one call to the next at the same geometry.
    pub fn workspace_len(&self) -> usize {
        self.packed.capacity()
            + self
                .scratch
                .iter()
                .map(|s| s.cols.capacity() + s.acc.capacity())
                .sum::<usize>()
    }

    /// Sizes the task buffers for this batch: `(tasks, images per task)`.
    fn prepare(&mut self, g: &ConvGeom, acc: bool) -> (usize, usize) {
        let (tasks, per) = split(g.batch);
        if self.scratch.len() < tasks {
            self.scratch.resize_with(tasks, Scratch::default);
        }
        let cols = if g.is_pointwise() {
            0
        } else {
            chunk_rows(g) * g.depth()
        };
        for s in &mut self.scratch[..tasks] {
            ensure(&mut s.cols, cols);
            if acc {
                ensure(&mut s.acc, g.depth() * g.out_c);
            }
        }
        (tasks, per)
    }

    /// Repacks the OIHW weight as the `[kernel² · in_c, out_c]` matrix.
    fn pack_weight(&mut self, weight: &[f32]) {
        let g = self.geom;
        let (kk, c, o) = (g.kernel * g.kernel, g.in_c, g.out_c);
        ensure(&mut self.packed, kk * c * o);
        for (oi, filter) in weight.chunks_exact(c * kk).enumerate() {
            for (ci, taps) in filter.chunks_exact(kk).enumerate() {
                for (t, &w) in taps.iter().enumerate() {
                    self.packed[(t * c + ci) * o + oi] = w;
                }
            }
        }
    }

    /// Packs the OIHW weight for the stride-1 input gradient: tap
    /// `(k - 1 - ky, k - 1 - kx)` of output channel `o` is row
    /// `tap · out_c + o`, input channel `c` its column.
    fn pack_flipped(&mut self, weight: &[f32]) {
        let g = self.geom;
        let (kk, c, o) = (g.kernel * g.kernel, g.in_c, g.out_c);
        ensure(&mut self.packed, kk * c * o);
        for (oi, filter) in weight.chunks_exact(c * kk).enumerate() {
            for (ci, taps) in filter.chunks_exact(kk).enumerate() {
                for (t, &w) in taps.iter().enumerate() {
                    self.packed[((kk - 1 - t) * o + oi) * c + ci] = w;
                }
            }
        }
    }

    /// y = conv(x, weight).
    ///
    /// x: `[batch, in_h, in_w, in_c]`; weight: `[out_c, in_c, k, k]` (OIHW,
    /// the parameter's own layout); y: `[batch, out_h, out_w, out_c]`
    /// (overwritten).
    pub fn forward(&mut self, x: &[f32], weight: &[f32], y: &mut [f32]) -> Result<(), ConvError> {
        let g = self.geom;
        g.validate()?;
        g.check_len("input x", x.len(), g.input_len())?;
        g.check_len("weight", weight.len(), g.weight_len())?;
        g.check_len("output y", y.len(), g.output_len())?;
        if g.batch == 0 {
            return Ok(());
        }
        self.pack_weight(weight);
        let (tasks, per) = self.prepare(&g, false);
        forward_tasks(&g, x, &self.packed, &mut self.scratch[..tasks], per, y);
        Ok(())
    }

    /// dx = ∂(y · dy)/∂x for y = conv(x, weight). dy: `[batch, out_h,
    /// out_w, out_c]`; dx: `[batch, in_h, in_w, in_c]` (overwritten).
    pub fn backward_data(
        &mut self,
        dy: &[f32],
        weight: &[f32],
        dx: &mut [f32],
    ) -> Result<(), ConvError> {
        let g = self.geom;
        g.validate()?;
        g.check_len("output gradient dy", dy.len(), g.output_len())?;
        g.check_len("weight", weight.len(), g.weight_len())?;
        g.check_len("input gradient dx", dx.len(), g.input_len())?;
        if g.batch == 0 {
            return Ok(());
        }
        if g.stride == 1 && !g.is_pointwise() {
            // A stride-1 input gradient is the forward convolution of dy
            // with the flipped kernel, channels swapped, padded by
            // `kernel - 1 - padding`: the unfolding gathers, and nothing is
            // folded back.
            let flipped = ConvGeom {
                in_h: g.out_h(),
                in_w: g.out_w(),
                in_c: g.out_c,
                out_c: g.in_c,
                padding: g.kernel - 1 - g.padding,
                ..g
            };
            self.pack_flipped(weight);
            let (tasks, per) = self.prepare(&flipped, false);
            forward_tasks(
                &flipped,
                dy,
                &self.packed,
                &mut self.scratch[..tasks],
                per,
                dx,
            );
            return Ok(());
        }
        self.pack_weight(weight);
        let (tasks, per) = self.prepare(&g, false);
        let (depth, o, pixels) = (g.depth(), g.out_c, g.out_h() * g.out_w());
        let image = g.in_h * g.in_w * g.in_c;
        // W'ᵀ: [out_c, depth].
        let wt = Mat {
            data: &self.packed,
            rs: 1,
            cs: o,
        };
        let par = parallelism(tasks);
        let task = |(t, (dx, s)): (usize, (&mut [f32], &mut Scratch))| {
            let first = t * per * pixels;
            let rows = dx.len() / image * pixels;
            if g.is_pointwise() {
                let lhs = Mat {
                    data: &dy[first * o..(first + rows) * o],
                    rs: o,
                    cs: 1,
                };
                matmul((rows, depth, o), dx, depth, false, lhs, wt, par);
                return;
            }
            dx.fill(0.0);
            for start in (0..rows).step_by(chunk_rows(&g)) {
                let end = (start + chunk_rows(&g)).min(rows);
                let cols = &mut s.cols[..(end - start) * depth];
                let lhs = Mat {
                    data: &dy[(first + start) * o..(first + end) * o],
                    rs: o,
                    cs: 1,
                };
                matmul((end - start, depth, o), cols, depth, false, lhs, wt, par);
                // Rows are numbered from this task's first image.
                col2im_add(&g, cols, start..end, dx);
            }
        };
        let scratch = &mut self.scratch[..tasks];
        if tasks > 1 {
            dx.par_chunks_mut(per * image)
                .zip(scratch.par_iter_mut())
                .enumerate()
                .for_each(task);
        } else {
            dx.chunks_mut(per * image)
                .zip(scratch.iter_mut())
                .enumerate()
                .for_each(task);
        }
        Ok(())
    }

    /// dweight = ∂(y · dy)/∂weight for y = conv(x, weight). x: `[batch,
    /// in_h, in_w, in_c]`; dy: `[batch, out_h, out_w, out_c]`; dweight:
    /// `[out_c, in_c, k, k]` (OIHW, overwritten).
    pub fn backward_weight(
        &mut self,
        x: &[f32],
        dy: &[f32],
        dweight: &mut [f32],
    ) -> Result<(), ConvError> {
        let g = self.geom;
        g.validate()?;
        g.check_len("input x", x.len(), g.input_len())?;
        g.check_len("output gradient dy", dy.len(), g.output_len())?;
        g.check_len("weight gradient dweight", dweight.len(), g.weight_len())?;
        let (depth, o, pixels) = (g.depth(), g.out_c, g.out_h() * g.out_w());
        if g.batch == 0 {
            dweight.fill(0.0);
            return Ok(());
        }
        let (tasks, per) = self.prepare(&g, true);
        let par = parallelism(tasks);
        let task = |(t, s): (usize, &mut Scratch)| {
            let first = t * per * pixels;
            let rows = (per * pixels).min(g.rows() - first);
            let Scratch { cols, acc } = s;
            let acc = &mut acc[..depth * o];
            for start in (0..rows).step_by(chunk_rows(&g)) {
                let end = (start + chunk_rows(&g)).min(rows);
                let (a, b) = (first + start, first + end);
                let data = if g.is_pointwise() {
                    &x[a * depth..b * depth]
                } else {
                    let cols = &mut cols[..(end - start) * depth];
                    im2col(&g, x, a..b, cols);
                    cols
                };
                // colsᵀ: [depth, rows].
                let lhs = Mat {
                    data,
                    rs: 1,
                    cs: depth,
                };
                let rhs = Mat {
                    data: &dy[a * o..b * o],
                    rs: o,
                    cs: 1,
                };
                matmul((depth, o, end - start), acc, o, start > 0, lhs, rhs, par);
            }
        };
        let scratch = &mut self.scratch[..tasks];
        if tasks > 1 {
            scratch.par_iter_mut().enumerate().for_each(task);
        } else {
            scratch.iter_mut().enumerate().for_each(task);
        }
        // Sum the tasks' shares, then unpack [kernel² · in_c, out_c] to OIHW.
        let (first, rest) = scratch.split_at(1);
        let total = &first[0].acc[..depth * o];
        let (kk, c) = (g.kernel * g.kernel, g.in_c);
        for (oi, filter) in dweight.chunks_exact_mut(c * kk).enumerate() {
            for (ci, taps) in filter.chunks_exact_mut(kk).enumerate() {
                for (t, w) in taps.iter_mut().enumerate() {
                    let i = (t * c + ci) * o + oi;
                    *w = total[i] + rest.iter().map(|s| s.acc[i]).sum::<f32>();
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    fn random(len: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Each output of a direct-loop convolution in f64, with the sum of the
    /// magnitudes of its terms (the scale its rounding error is measured
    /// against).
    struct Reference {
        y: Vec<(f64, f64)>,
        dx: Vec<(f64, f64)>,
        dw: Vec<(f64, f64)>,
    }

    fn reference(g: &ConvGeom, x: &[f32], w: &[f32], dy: &[f32]) -> Reference {
        let (oh, ow, k) = (g.out_h(), g.out_w(), g.kernel);
        let mut y = vec![(0.0, 0.0); g.output_len()];
        let mut dx = vec![(0.0, 0.0); g.input_len()];
        let mut dw = vec![(0.0, 0.0); g.weight_len()];
        let add = |acc: &mut (f64, f64), a: f32, b: f32| {
            let t = a as f64 * b as f64;
            acc.0 += t;
            acc.1 += t.abs();
        };
        for n in 0..g.batch {
            for oy in 0..oh {
                for ox in 0..ow {
                    for o in 0..g.out_c {
                        let yi = ((n * oh + oy) * ow + ox) * g.out_c + o;
                        for c in 0..g.in_c {
                            for ky in 0..k {
                                for kx in 0..k {
                                    let iy = (oy * g.stride + ky) as isize - g.padding as isize;
                                    let ix = (ox * g.stride + kx) as isize - g.padding as isize;
                                    if iy < 0
                                        || ix < 0
                                        || iy >= g.in_h as isize
                                        || ix >= g.in_w as isize
                                    {
                                        continue;
                                    }
                                    let xi = ((n * g.in_h + iy as usize) * g.in_w + ix as usize)
                                        * g.in_c
                                        + c;
                                    let wi = ((o * g.in_c + c) * k + ky) * k + kx;
                                    add(&mut y[yi], x[xi], w[wi]);
                                    add(&mut dx[xi], dy[yi], w[wi]);
                                    add(&mut dw[wi], dy[yi], x[xi]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Reference { y, dx, dw }
    }

    /// Largest error relative to each element's scale (≤ 1e-5 passes).
    fn worst_error(got: &[f32], want: &[(f64, f64)]) -> f64 {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .map(|(&g, &(v, scale))| (g as f64 - v).abs() / scale.max(1e-3))
            .fold(0.0, f64::max)
    }

    fn check_against_reference(g: ConvGeom, seed: u64) -> Result<(), String> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let x = random(g.input_len(), &mut rng);
        let w = random(g.weight_len(), &mut rng);
        let dy = random(g.output_len(), &mut rng);
        let want = reference(&g, &x, &w, &dy);
        let mut conv = Conv2d::new(g);
        // Stale values in the outputs must be overwritten.
        let mut y = vec![7.0; g.output_len()];
        let mut dx = vec![7.0; g.input_len()];
        let mut dw = vec![7.0; g.weight_len()];
        conv.forward(&x, &w, &mut y).map_err(|e| e.to_string())?;
        conv.backward_data(&dy, &w, &mut dx)
            .map_err(|e| e.to_string())?;
        conv.backward_weight(&x, &dy, &mut dw)
            .map_err(|e| e.to_string())?;
        for (name, got, want) in [
            ("y", &y, &want.y),
            ("dx", &dx, &want.dx),
            ("dw", &dw, &want.dw),
        ] {
            let err = worst_error(got, want);
            if err > 1e-5 {
                return Err(format!("{g:?}: {name} relative error {err:e}"));
            }
        }
        Ok(())
    }

    fn geom(
        batch: usize,
        hw: (usize, usize),
        c: (usize, usize),
        k: usize,
        s: usize,
        p: usize,
    ) -> ConvGeom {
        ConvGeom {
            batch,
            in_h: hw.0,
            in_w: hw.1,
            in_c: c.0,
            out_c: c.1,
            kernel: k,
            stride: s,
            padding: p,
        }
    }

    #[test]
    fn matches_direct_loops_on_resnet_like_shapes() {
        let cases = [
            geom(2, (8, 8), (16, 16), 3, 1, 1),
            geom(2, (8, 8), (16, 32), 3, 2, 1),
            geom(2, (8, 8), (16, 32), 1, 2, 0),
            geom(2, (8, 8), (16, 32), 1, 1, 0),
            geom(1, (7, 5), (3, 4), 3, 1, 1),
            geom(1, (7, 5), (3, 4), 3, 2, 1),
            geom(1, (7, 5), (3, 4), 3, 2, 0),
            geom(3, (9, 9), (5, 2), 5, 2, 2),
            geom(1, (1, 1), (1, 1), 1, 1, 0),
            geom(1, (1, 1), (2, 3), 3, 1, 1),
            // Enough rows for several chunks.
            geom(4, (32, 32), (3, 16), 3, 1, 1),
        ];
        for (i, g) in cases.into_iter().enumerate() {
            check_against_reference(g, i as u64).unwrap();
        }
    }

    #[test]
    fn any_thread_count_gives_the_same_results() {
        // One task, one task per image, and a short last task.
        let cases = [
            geom(1, (9, 9), (4, 8), 3, 1, 1),
            geom(3, (9, 9), (4, 8), 3, 2, 1),
            geom(5, (8, 8), (16, 16), 1, 1, 0),
            geom(7, (6, 6), (3, 5), 1, 2, 0),
        ];
        for threads in [1, 2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (i, g) in cases.into_iter().enumerate() {
                pool.install(|| check_against_reference(g, i as u64))
                    .unwrap_or_else(|e| panic!("{threads} threads: {e}"));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn matches_direct_loops_on_random_shapes(
            batch in 1usize..3,
            h in 1usize..10,
            w in 1usize..10,
            c in 1usize..6,
            o in 1usize..6,
            k in prop::sample::select(vec![1usize, 3, 5]),
            stride in 1usize..3,
            pad_some in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let g = geom(batch, (h, w), (c, o), k, stride, if pad_some { k / 2 } else { 0 });
            prop_assume!(g.validate().is_ok());
            prop_assert!(check_against_reference(g, seed).is_ok(), "{:?}", check_against_reference(g, seed));
        }
    }

    /// sum(conv(x, w) ⊙ r).
    fn loss(conv: &mut Conv2d, x: &[f32], w: &[f32], r: &[f32]) -> f64 {
        let mut y = vec![0.0; r.len()];
        conv.forward(x, w, &mut y).unwrap();
        y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
    }

    #[test]
    fn gradients_match_central_differences() {
        for g in [
            geom(2, (5, 6), (3, 4), 3, 2, 1),
            geom(1, (4, 4), (2, 3), 3, 1, 1),
        ] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(27);
            let x = random(g.input_len(), &mut rng);
            let w = random(g.weight_len(), &mut rng);
            let r = random(g.output_len(), &mut rng);
            let mut conv = Conv2d::new(g);
            let mut dx = vec![0.0; x.len()];
            let mut dw = vec![0.0; w.len()];
            conv.backward_data(&r, &w, &mut dx).unwrap();
            conv.backward_weight(&x, &r, &mut dw).unwrap();
            let eps = 0.25;
            let diff = |plus: f64, minus: f64| (plus - minus) / (2.0 * eps as f64);
            for i in 0..x.len() {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += eps;
                xm[i] -= eps;
                let fd = diff(loss(&mut conv, &xp, &w, &r), loss(&mut conv, &xm, &w, &r));
                assert!(
                    (fd - dx[i] as f64).abs() < 1e-4,
                    "dx[{i}]: {} vs {fd}",
                    dx[i]
                );
            }
            for i in 0..w.len() {
                let (mut wp, mut wm) = (w.clone(), w.clone());
                wp[i] += eps;
                wm[i] -= eps;
                let fd = diff(loss(&mut conv, &x, &wp, &r), loss(&mut conv, &x, &wm, &r));
                assert!(
                    (fd - dw[i] as f64).abs() < 1e-4,
                    "dw[{i}]: {} vs {fd}",
                    dw[i]
                );
            }
        }
    }

    /// NHWC → NCHW.
    fn to_nchw(v: &[f32], n: usize, h: usize, w: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; v.len()];
        for b in 0..n {
            for y in 0..h {
                for x in 0..w {
                    for ci in 0..c {
                        out[((b * c + ci) * h + y) * w + x] = v[((b * h + y) * w + x) * c + ci];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn agrees_with_candle_conv2d_and_its_gradients() {
        use candle_core::{Device, Tensor, Var};
        // Strided cases use sides where the stride divides `side + 2 · padding
        // - kernel`: candle's own backward mis-sizes the input gradient
        // otherwise.
        for g in [
            geom(2, (6, 7), (3, 5), 3, 1, 1),
            geom(2, (7, 9), (4, 6), 3, 2, 1),
            geom(2, (7, 5), (4, 6), 1, 2, 0),
        ] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(5);
            let x = random(g.input_len(), &mut rng);
            let w = random(g.weight_len(), &mut rng);
            let r = random(g.output_len(), &mut rng);
            let (oh, ow) = (g.out_h(), g.out_w());
            let dev = Device::Cpu;
            let xt = Var::from_vec(
                to_nchw(&x, g.batch, g.in_h, g.in_w, g.in_c),
                (g.batch, g.in_c, g.in_h, g.in_w),
                &dev,
            )
            .unwrap();
            let wt = Var::from_vec(w.clone(), (g.out_c, g.in_c, g.kernel, g.kernel), &dev).unwrap();
            let rt = Tensor::from_vec(
                to_nchw(&r, g.batch, oh, ow, g.out_c),
                (g.batch, g.out_c, oh, ow),
                &dev,
            )
            .unwrap();
            let yt = xt
                .as_tensor()
                .conv2d(wt.as_tensor(), g.padding, g.stride, 1, 1)
                .unwrap();
            let grads = (&yt * &rt).unwrap().sum_all().unwrap().backward().unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();

            let mut conv = Conv2d::new(g);
            let mut y = vec![0.0; g.output_len()];
            let mut dx = vec![0.0; g.input_len()];
            let mut dw = vec![0.0; g.weight_len()];
            conv.forward(&x, &w, &mut y).unwrap();
            conv.backward_data(&r, &w, &mut dx).unwrap();
            conv.backward_weight(&x, &r, &mut dw).unwrap();
            let close = |a: &[f32], b: &[f32], what: &str| {
                assert_eq!(a.len(), b.len());
                for (i, (p, q)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
                        "{what}[{i}]: {p} vs {q} for {g:?}"
                    );
                }
            };
            close(&to_nchw(&y, g.batch, oh, ow, g.out_c), &flat(&yt), "y");
            close(
                &to_nchw(&dx, g.batch, g.in_h, g.in_w, g.in_c),
                &flat(grads.get(&xt).unwrap()),
                "dx",
            );
            close(&dw, &flat(grads.get(&wt).unwrap()), "dw");
        }
    }

    #[test]
    fn workspace_does_not_grow_once_warm() {
        let g = geom(8, (16, 16), (16, 16), 3, 1, 1);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let x = random(g.input_len(), &mut rng);
        let w = random(g.weight_len(), &mut rng);
        let dy = random(g.output_len(), &mut rng);
        let mut conv = Conv2d::new(g);
        let (mut y, mut dx, mut dw) = (vec![0.0; dy.len()], vec![0.0; x.len()], vec![0.0; w.len()]);
        let mut step = |conv: &mut Conv2d| {
            conv.forward(&x, &w, &mut y).unwrap();
            conv.backward_data(&dy, &w, &mut dx).unwrap();
            conv.backward_weight(&x, &dy, &mut dw).unwrap();
            conv.workspace_len()
        };
        let warm = step(&mut conv);
        assert!(warm > 0);
        assert_eq!(step(&mut conv), warm);
        // A smaller last batch reuses the same buffers.
        conv.set_batch(2);
        let small = geom(2, (16, 16), (16, 16), 3, 1, 1);
        let mut y2 = vec![0.0; small.output_len()];
        conv.forward(&x[..small.input_len()], &w, &mut y2).unwrap();
        assert_eq!(conv.workspace_len(), warm);
    }

    #[test]
    fn refuses_wrong_lengths_and_geometries() {
        let g = geom(2, (4, 4), (3, 5), 3, 1, 1);
        let mut conv = Conv2d::new(g);
        let x = vec![0.0; g.input_len()];
        let w = vec![0.0; g.weight_len()];
        let mut y = vec![0.0; g.output_len()];
        let err = conv.forward(&x[1..], &w, &mut y).unwrap_err();
        assert!(
            matches!(
                err,
                ConvError::Length {
                    what: "input x",
                    expected: 96,
                    got: 95,
                    ..
                }
            ),
            "{err}"
        );
        let err = conv.backward_weight(&x, &y.clone(), &mut y).unwrap_err();
        assert!(
            matches!(
                err,
                ConvError::Length {
                    what: "weight gradient dweight",
                    ..
                }
            ),
            "{err}"
        );
        let mut dx = vec![0.0; 3];
        let err = conv.backward_data(&y.clone(), &w, &mut dx).unwrap_err();
        assert!(err.to_string().contains("input gradient dx"), "{err}");
        for bad in [
            ConvGeom { stride: 0, ..g },
            ConvGeom { kernel: 0, ..g },
            ConvGeom { in_c: 0, ..g },
            ConvGeom { padding: 3, ..g },
            ConvGeom {
                in_h: 1,
                padding: 0,
                ..g
            },
            ConvGeom {
                batch: usize::MAX,
                ..g
            },
        ] {
            let mut conv = Conv2d::new(bad);
            assert!(
                matches!(
                    conv.forward(&x, &w, &mut y),
                    Err(ConvError::Geometry { .. })
                ),
                "{bad:?}"
            );
        }
    }
}

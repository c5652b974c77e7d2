//! 2-d convolution on NHWC f32 activations with OIHW weights, as an
//! im2col (rows = output pixels, columns = `(i, j, c)` of the window) times
//! the weight repacked to `[(i, j, c), out]`, so the product comes out NHWC.

use rayon::prelude::*;

use super::{matmul, Mat};

/// Geometry of one 2-D convolution; activations are NHWC, f32, contiguous.
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

impl ConvGeom {
    pub fn out_h(&self) -> usize {
        (self.in_h + 2 * self.padding - self.kernel) / self.stride + 1
    }

    pub fn out_w(&self) -> usize {
        (self.in_w + 2 * self.padding - self.kernel) / self.stride + 1
    }

    fn pixels(&self) -> usize {
        self.out_h() * self.out_w()
    }

    /// Columns of the unfolded input: `kernel² · in_c`.
    fn window(&self) -> usize {
        self.kernel * self.kernel * self.in_c
    }

    /// A 1x1, stride 1, unpadded convolution is a plain matrix product.
    fn pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }
}

/// One convolution layer's plan and scratch buffers, reused across steps.
pub struct Conv2d {
    geom: ConvGeom,
    /// The unfolded input, `[batch · pixels, window]`.
    col: Vec<f32>,
    /// The weight as `[window, out_c]`.
    packed: Vec<f32>,
}

impl Conv2d {
    pub fn new(geom: ConvGeom) -> Self {
        Self {
            geom,
            col: Vec::new(),
            packed: Vec::new(),
        }
    }

    pub fn geom(&self) -> ConvGeom {
        self.geom
    }

    /// The last batch of an epoch may be smaller.
    pub fn set_batch(&mut self, batch: usize) {
        self.geom.batch = batch;
    }

    fn check(&self, x: usize, w: usize, y: usize) {
        let g = &self.geom;
        assert_eq!(x, g.batch * g.in_h * g.in_w * g.in_c, "conv input length");
        assert_eq!(w, g.out_c * g.window(), "conv weight length");
        assert_eq!(y, g.batch * g.pixels() * g.out_c, "conv output length");
    }

    fn pack(&mut self, weight: &[f32]) {
        let g = self.geom;
        let (k, c, o) = (g.kernel, g.in_c, g.out_c);
        self.packed.resize(g.window() * o, 0.0);
        for oc in 0..o {
            for ic in 0..c {
                for i in 0..k {
                    for j in 0..k {
                        self.packed[((i * k + j) * c + ic) * o + oc] =
                            weight[((oc * c + ic) * k + i) * k + j];
                    }
                }
            }
        }
    }

    fn unfold(&mut self, x: &[f32]) {
        let g = self.geom;
        let per_sample = g.pixels() * g.window();
        self.col.resize(g.batch * per_sample, 0.0);
        let image = g.in_h * g.in_w * g.in_c;
        self.col
            .par_chunks_mut(per_sample)
            .zip(x.par_chunks(image))
            .for_each(|(col, x)| unfold_sample(&g, x, col));
    }

    /// `y = conv(x, weight)`: x `[batch, in_h, in_w, in_c]`, weight
    /// `[out_c, in_c, k, k]`, y `[batch, out_h, out_w, out_c]` (overwritten).
    pub fn forward(&mut self, x: &[f32], weight: &[f32], y: &mut [f32]) {
        self.check(x.len(), weight.len(), y.len());
        self.pack(weight);
        let g = self.geom;
        let rows = g.batch * g.pixels();
        let b = Mat::rows(&self.packed, g.out_c);
        if g.pointwise() {
            matmul(rows, g.out_c, g.in_c, y, false, Mat::rows(x, g.in_c), b);
            return;
        }
        self.unfold(x);
        let b = Mat::rows(&self.packed, g.out_c);
        let a = Mat::rows(&self.col, g.window());
        matmul(rows, g.out_c, g.window(), y, false, a, b);
    }

    /// `dx` (overwritten, `[batch, in_h, in_w, in_c]`) from `dy`.
    pub fn backward_data(&mut self, dy: &[f32], weight: &[f32], dx: &mut [f32]) {
        self.check(dx.len(), weight.len(), dy.len());
        self.pack(weight);
        let g = self.geom;
        let rows = g.batch * g.pixels();
        let bt = Mat::transposed(&self.packed, g.out_c);
        if g.pointwise() {
            matmul(rows, g.in_c, g.out_c, dx, false, Mat::rows(dy, g.out_c), bt);
            return;
        }
        self.col.resize(rows * g.window(), 0.0);
        matmul(
            rows,
            g.window(),
            g.out_c,
            &mut self.col,
            false,
            Mat::rows(dy, g.out_c),
            bt,
        );
        let per_sample = g.pixels() * g.window();
        let image = g.in_h * g.in_w * g.in_c;
        dx.par_chunks_mut(image)
            .zip(self.col.par_chunks(per_sample))
            .for_each(|(dx, col)| fold_sample(&g, col, dx));
    }

    /// `dweight` (overwritten, OIHW) from the input `x` and `dy`.
    pub fn backward_weight(&mut self, x: &[f32], dy: &[f32], dweight: &mut [f32]) {
        self.check(x.len(), dweight.len(), dy.len());
        let g = self.geom;
        let rows = g.batch * g.pixels();
        let window = g.window();
        self.packed.resize(window * g.out_c, 0.0);
        let a = if g.pointwise() {
            Mat::transposed(x, g.in_c)
        } else {
            self.unfold(x);
            Mat::transposed(&self.col, window)
        };
        matmul(
            window,
            g.out_c,
            rows,
            &mut self.packed,
            false,
            a,
            Mat::rows(dy, g.out_c),
        );
        let (k, c, o) = (g.kernel, g.in_c, g.out_c);
        for oc in 0..o {
            for ic in 0..c {
                for i in 0..k {
                    for j in 0..k {
                        dweight[((oc * c + ic) * k + i) * k + j] =
                            self.packed[((i * k + j) * c + ic) * o + oc];
                    }
                }
            }
        }
    }
}

/// One sample's unfolded rows: row `oy · ow + ox`, column `(i · k + j) ·
/// c + ci` holds pixel `(oy · s + i - p, ox · s + j - p)`, channel `ci` (0
/// outside the image).
fn unfold_sample(g: &ConvGeom, x: &[f32], col: &mut [f32]) {
    let (k, s, p, c) = (g.kernel, g.stride, g.padding, g.in_c);
    let (ow, window) = (g.out_w(), g.window());
    for (row, out) in col.chunks_exact_mut(window).enumerate() {
        let (oy, ox) = (row / ow, row % ow);
        for i in 0..k {
            let y = (oy * s + i).wrapping_sub(p);
            for j in 0..k {
                let dst = &mut out[(i * k + j) * c..(i * k + j + 1) * c];
                let xx = (ox * s + j).wrapping_sub(p);
                if y < g.in_h && xx < g.in_w {
                    let at = (y * g.in_w + xx) * c;
                    dst.copy_from_slice(&x[at..at + c]);
                } else {
                    dst.fill(0.0);
                }
            }
        }
    }
}

/// The adjoint of [`unfold_sample`]: each column entry added onto its pixel.
fn fold_sample(g: &ConvGeom, col: &[f32], dx: &mut [f32]) {
    dx.fill(0.0);
    let (k, s, p, c) = (g.kernel, g.stride, g.padding, g.in_c);
    let (ow, window) = (g.out_w(), g.window());
    for (row, src) in col.chunks_exact(window).enumerate() {
        let (oy, ox) = (row / ow, row % ow);
        for i in 0..k {
            let y = (oy * s + i).wrapping_sub(p);
            if y >= g.in_h {
                continue;
            }
            for j in 0..k {
                let xx = (ox * s + j).wrapping_sub(p);
                if xx < g.in_w {
                    let at = (y * g.in_w + xx) * c;
                    let from = &src[(i * k + j) * c..(i * k + j + 1) * c];
                    for (d, v) in dx[at..at + c].iter_mut().zip(from) {
                        *d += v;
                    }
                }
            }
        }
    }
}

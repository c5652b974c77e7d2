//! Pooling over NHWC activations: max and average over `k x k` windows
//! moved by `stride` (no padding), and the global average pool.

use rayon::prelude::*;

/// One pooling layer's geometry (per sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeom {
    pub in_h: usize,
    pub in_w: usize,
    pub c: usize,
    pub kernel: usize,
    pub stride: usize,
}

impl PoolGeom {
    pub fn out_h(&self) -> usize {
        (self.in_h - self.kernel) / self.stride + 1
    }

    pub fn out_w(&self) -> usize {
        (self.in_w - self.kernel) / self.stride + 1
    }

    pub fn in_len(&self) -> usize {
        self.in_h * self.in_w * self.c
    }

    pub fn out_len(&self) -> usize {
        self.out_h() * self.out_w() * self.c
    }
}

/// Max pooling: `y` and, per output entry, the index (within its sample)
/// of the input it came from: the first maximum of the window in row-major
/// window order, so a tie sends the gradient to exactly one input.
pub fn max_forward(g: &PoolGeom, x: &[f32], y: &mut [f32], arg: &mut [u32]) {
    let (il, ol) = (g.in_len(), g.out_len());
    y.par_chunks_mut(ol)
        .zip(arg.par_chunks_mut(ol))
        .zip(x.par_chunks(il))
        .for_each(|((y, arg), x)| {
            let (ow, c, k, s) = (g.out_w(), g.c, g.kernel, g.stride);
            for (p, (y, arg)) in y
                .chunks_exact_mut(c)
                .zip(arg.chunks_exact_mut(c))
                .enumerate()
            {
                let (oy, ox) = (p / ow, p % ow);
                y.fill(f32::NEG_INFINITY);
                for i in 0..k {
                    for j in 0..k {
                        let at = ((oy * s + i) * g.in_w + ox * s + j) * c;
                        for ch in 0..c {
                            let v = x[at + ch];
                            if v > y[ch] || (i == 0 && j == 0) {
                                y[ch] = v;
                                arg[ch] = (at + ch) as u32;
                            }
                        }
                    }
                }
            }
        });
}

/// Max pooling backward: `dx` (overwritten) gets each `dy` at its argmax.
pub fn max_backward(g: &PoolGeom, dy: &[f32], arg: &[u32], dx: &mut [f32]) {
    let (il, ol) = (g.in_len(), g.out_len());
    dx.par_chunks_mut(il)
        .zip(dy.par_chunks(ol))
        .zip(arg.par_chunks(ol))
        .for_each(|((dx, dy), arg)| {
            dx.fill(0.0);
            for (&d, &a) in dy.iter().zip(arg) {
                dx[a as usize] += d;
            }
        });
}

/// Average pooling (every window holds `kernel²` inputs).
pub fn avg_forward(g: &PoolGeom, x: &[f32], y: &mut [f32]) {
    let (il, ol) = (g.in_len(), g.out_len());
    let scale = 1.0 / (g.kernel * g.kernel) as f32;
    y.par_chunks_mut(ol)
        .zip(x.par_chunks(il))
        .for_each(|(y, x)| {
            let (ow, c, k, s) = (g.out_w(), g.c, g.kernel, g.stride);
            for (p, y) in y.chunks_exact_mut(c).enumerate() {
                let (oy, ox) = (p / ow, p % ow);
                y.fill(0.0);
                for i in 0..k {
                    for j in 0..k {
                        let at = ((oy * s + i) * g.in_w + ox * s + j) * c;
                        for (y, v) in y.iter_mut().zip(&x[at..at + c]) {
                            *y += v;
                        }
                    }
                }
                for y in y.iter_mut() {
                    *y *= scale;
                }
            }
        });
}

/// Average pooling backward: `dx` (overwritten).
pub fn avg_backward(g: &PoolGeom, dy: &[f32], dx: &mut [f32]) {
    let (il, ol) = (g.in_len(), g.out_len());
    let scale = 1.0 / (g.kernel * g.kernel) as f32;
    dx.par_chunks_mut(il)
        .zip(dy.par_chunks(ol))
        .for_each(|(dx, dy)| {
            let (ow, c, k, s) = (g.out_w(), g.c, g.kernel, g.stride);
            dx.fill(0.0);
            for (p, d) in dy.chunks_exact(c).enumerate() {
                let (oy, ox) = (p / ow, p % ow);
                for i in 0..k {
                    for j in 0..k {
                        let at = ((oy * s + i) * g.in_w + ox * s + j) * c;
                        for (dx, d) in dx[at..at + c].iter_mut().zip(d) {
                            *dx += d * scale;
                        }
                    }
                }
            }
        });
}

/// Mean over each sample's `pixels` rows of `c` channels: `y[n, c]`.
pub fn global_avg_forward(pixels: usize, c: usize, x: &[f32], y: &mut [f32]) {
    let scale = 1.0 / pixels as f32;
    y.par_chunks_mut(c)
        .zip(x.par_chunks(pixels * c))
        .for_each(|(y, x)| {
            y.fill(0.0);
            for row in x.chunks_exact(c) {
                for (y, v) in y.iter_mut().zip(row) {
                    *y += v;
                }
            }
            for y in y.iter_mut() {
                *y *= scale;
            }
        });
}

/// Global average pool backward: every pixel gets `dy / pixels`.
pub fn global_avg_backward(pixels: usize, c: usize, dy: &[f32], dx: &mut [f32]) {
    let scale = 1.0 / pixels as f32;
    dx.par_chunks_mut(pixels * c)
        .zip(dy.par_chunks(c))
        .for_each(|(dx, dy)| {
            for row in dx.chunks_exact_mut(c) {
                for (d, v) in row.iter_mut().zip(dy) {
                    *d = v * scale;
                }
            }
        });
}

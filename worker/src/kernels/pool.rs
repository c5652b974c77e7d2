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

#[cfg(test)]
mod tests {
    use super::super::testing::{check_gradient, dot, random};
    use super::*;

    /// Naive pooling on NHWC samples: window values gathered per output.
    fn reference(g: &PoolGeom, x: &[f32], max: bool) -> Vec<f32> {
        let batch = x.len() / g.in_len();
        let mut y = Vec::new();
        for n in 0..batch {
            for oy in 0..g.out_h() {
                for ox in 0..g.out_w() {
                    for ch in 0..g.c {
                        let mut vals = Vec::new();
                        for i in 0..g.kernel {
                            for j in 0..g.kernel {
                                let (h, w) = (oy * g.stride + i, ox * g.stride + j);
                                vals.push(x[n * g.in_len() + (h * g.in_w + w) * g.c + ch]);
                            }
                        }
                        y.push(if max {
                            vals.iter().copied().fold(f32::NEG_INFINITY, f32::max)
                        } else {
                            vals.iter().sum::<f32>() / vals.len() as f32
                        });
                    }
                }
            }
        }
        y
    }

    fn geoms() -> [PoolGeom; 3] {
        [
            // Overlapping strided windows, tiling windows, a ragged edge.
            PoolGeom {
                in_h: 5,
                in_w: 5,
                c: 2,
                kernel: 3,
                stride: 2,
            },
            PoolGeom {
                in_h: 4,
                in_w: 4,
                c: 3,
                kernel: 2,
                stride: 2,
            },
            PoolGeom {
                in_h: 5,
                in_w: 4,
                c: 1,
                kernel: 2,
                stride: 2,
            },
        ]
    }

    fn max_pool(g: &PoolGeom, x: &[f32]) -> (Vec<f32>, Vec<u32>) {
        let n = x.len() / g.in_len() * g.out_len();
        let (mut y, mut arg) = (vec![0.0; n], vec![0; n]);
        max_forward(g, x, &mut y, &mut arg);
        (y, arg)
    }

    fn avg_pool(g: &PoolGeom, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; x.len() / g.in_len() * g.out_len()];
        avg_forward(g, x, &mut y);
        y
    }

    #[test]
    fn pools_match_naive_windows_and_finite_differences() {
        for (s, g) in geoms().iter().enumerate() {
            let x = random(2 * g.in_len(), s as u64);
            let r = random(2 * g.out_len(), 10 + s as u64);
            let (y, arg) = max_pool(g, &x);
            assert_eq!(y, reference(g, &x, true));
            let mut dx = vec![0.0; x.len()];
            max_backward(g, &r, &arg, &mut dx);
            check_gradient("max dx", &x, &dx, 1e-3, |p| dot(&max_pool(g, p).0, &r));
            let y = avg_pool(g, &x);
            for (a, b) in y.iter().zip(reference(g, &x, false)) {
                assert!((a - b).abs() < 1e-6);
            }
            avg_backward(g, &r, &mut dx);
            check_gradient("avg dx", &x, &dx, 1e-3, |p| dot(&avg_pool(g, p), &r));
        }
    }

    #[test]
    fn a_tied_max_sends_its_gradient_to_the_first_input() {
        let g = PoolGeom {
            in_h: 2,
            in_w: 2,
            c: 1,
            kernel: 2,
            stride: 2,
        };
        let (y, arg) = max_pool(&g, &[0.0, 1.0, 1.0, 0.5]);
        assert_eq!((y, arg), (vec![1.0], vec![1]));
        let mut dx = vec![9.0; 4];
        max_backward(&g, &[2.0], &[1], &mut dx);
        assert_eq!(dx, [0.0, 2.0, 0.0, 0.0]);
    }

    #[test]
    fn global_average_pool_and_its_gradient() {
        let (pixels, c) = (6, 3);
        let x = random(2 * pixels * c, 20);
        let r = random(2 * c, 21);
        let gap = |x: &[f32]| {
            let mut y = vec![0.0; 2 * c];
            global_avg_forward(pixels, c, x, &mut y);
            y
        };
        let y = gap(&x);
        for n in 0..2 {
            for ch in 0..c {
                let want: f32 = (0..pixels)
                    .map(|p| x[(n * pixels + p) * c + ch])
                    .sum::<f32>()
                    / 6.0;
                assert!((y[n * c + ch] - want).abs() < 1e-6);
            }
        }
        let mut dx = vec![0.0; x.len()];
        global_avg_backward(pixels, c, &r, &mut dx);
        check_gradient("gap dx", &x, &dx, 1e-3, |p| dot(&gap(p), &r));
    }
}

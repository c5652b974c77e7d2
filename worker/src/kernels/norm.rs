//! Batch norm over the channels of NHWC activations (`rows x c`, `rows =
//! batch · h · w`), fused with what follows it in the networks: an
//! optional residual add and an optional ReLU.
//!
//! Training mode normalises with the batch mean and biased variance and
//! reports the unbiased variance (`n / (n - 1)` times the biased one) for
//! the running statistics, as [`crate::layers`] documents. The backward
//! pass recomputes `x̂ = (x - μ) / σ` from the saved input, mean and `1/σ`
//! rather than storing it.

use rayon::prelude::*;

use super::chunk_rows;

/// What follows the normalisation: `y = relu?(γ x̂ + β + skip?)`.
#[derive(Clone, Copy)]
pub struct Epilogue<'a> {
    pub skip: Option<&'a [f32]>,
    pub relu: bool,
}

/// Per-channel sums over rows, in f64, split over the pool:
/// `f(row, out)` adds one row's contributions into `out` (`width` wide).
fn channel_sums(
    rows: usize,
    width: usize,
    partial: &mut Vec<f64>,
    f: impl Fn(usize, &mut [f64]) + Sync,
) -> Vec<f64> {
    let chunk = chunk_rows(rows);
    let parts = rows.div_ceil(chunk).max(1);
    partial.clear();
    partial.resize(parts * width, 0.0);
    partial
        .par_chunks_mut(width)
        .enumerate()
        .for_each(|(p, out)| {
            for r in p * chunk..((p + 1) * chunk).min(rows) {
                f(r, out);
            }
        });
    let mut total = vec![0.0f64; width];
    for part in partial.chunks_exact(width) {
        for (t, v) in total.iter_mut().zip(part) {
            *t += v;
        }
    }
    total
}

/// Scratch reused across calls (per-thread partial sums).
#[derive(Default)]
pub struct NormScratch {
    partial: Vec<f64>,
}

/// Training-mode forward: writes `y`, the batch `mean` and `inv_std`
/// (`1 / sqrt(var + eps)`, biased variance) and the unbiased `var` for the
/// running statistics.
#[allow(clippy::too_many_arguments)]
pub fn train_forward(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    beta: &[f32],
    eps: f64,
    epi: Epilogue,
    y: &mut [f32],
    mean: &mut [f32],
    inv_std: &mut [f32],
    var: &mut [f32],
    scratch: &mut NormScratch,
) {
    let rows = x.len() / c;
    let sums = channel_sums(rows, 2 * c, &mut scratch.partial, |r, out| {
        let (s, q) = out.split_at_mut(c);
        for ((s, q), &v) in s.iter_mut().zip(q).zip(&x[r * c..(r + 1) * c]) {
            let v = f64::from(v);
            *s += v;
            *q += v * v;
        }
    });
    let n = rows as f64;
    let unbiased = if rows > 1 { n / (n - 1.0) } else { 1.0 };
    for ch in 0..c {
        let mu = sums[ch] / n;
        let biased = (sums[c + ch] / n - mu * mu).max(0.0);
        mean[ch] = mu as f32;
        inv_std[ch] = (1.0 / (biased + eps).sqrt()) as f32;
        var[ch] = (biased * unbiased) as f32;
    }
    normalise(x, c, gamma, beta, mean, inv_std, epi, y);
}

/// Evaluation-mode forward with the running statistics.
#[allow(clippy::too_many_arguments)]
pub fn eval_forward(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    beta: &[f32],
    running_mean: &[f32],
    running_var: &[f32],
    eps: f64,
    epi: Epilogue,
    y: &mut [f32],
    inv_std: &mut [f32],
) {
    for ch in 0..c {
        inv_std[ch] = (1.0 / (f64::from(running_var[ch]) + eps).sqrt()) as f32;
    }
    normalise(x, c, gamma, beta, running_mean, inv_std, epi, y);
}

/// `y = relu?(γ (x - μ) / σ + β + skip?)`, in parallel over rows.
#[allow(clippy::too_many_arguments)]
fn normalise(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    inv_std: &[f32],
    epi: Epilogue,
    y: &mut [f32],
) {
    // y = x · scale + shift per channel.
    let mut affine = vec![0.0f32; 2 * c];
    for ch in 0..c {
        let scale = gamma[ch] * inv_std[ch];
        affine[ch] = scale;
        affine[c + ch] = beta[ch] - mean[ch] * scale;
    }
    let (scale, shift) = affine.split_at(c);
    let chunk = chunk_rows(x.len() / c) * c;
    y.par_chunks_mut(chunk).enumerate().for_each(|(p, y)| {
        let at = p * chunk;
        let x = &x[at..at + y.len()];
        let skip = epi.skip.map(|s| &s[at..at + y.len()]);
        for (r, (y, x)) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)).enumerate() {
            for ((y, &x), (&a, &b)) in y.iter_mut().zip(x).zip(scale.iter().zip(shift)) {
                *y = x * a + b;
            }
            if let Some(s) = skip {
                for (y, s) in y.iter_mut().zip(&s[r * c..(r + 1) * c]) {
                    *y += s;
                }
            }
            if epi.relu {
                for y in y.iter_mut() {
                    *y = y.max(0.0);
                }
            }
        }
    });
}

/// Training-mode backward. `dy` is the gradient of the layer's output
/// (after the fused ReLU when `relu_out` is given: the output, whose
/// non-positive entries pass no gradient); it is masked in place, so it
/// holds the gradient of the pre-activation sum afterwards (what a fused
/// residual add passes to its shortcut). Writes `dx`, `dgamma`, `dbeta`.
#[allow(clippy::too_many_arguments)]
pub fn train_backward(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    mean: &[f32],
    inv_std: &[f32],
    relu_out: Option<&[f32]>,
    dy: &mut [f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    scratch: &mut NormScratch,
) {
    let rows = x.len() / c;
    if let Some(out) = relu_out {
        let chunk = chunk_rows(rows) * c;
        dy.par_chunks_mut(chunk)
            .zip(out.par_chunks(chunk))
            .for_each(|(d, o)| {
                for (d, &o) in d.iter_mut().zip(o) {
                    if o <= 0.0 {
                        *d = 0.0;
                    }
                }
            });
    }
    let dz: &[f32] = dy;
    let sums = channel_sums(rows, 2 * c, &mut scratch.partial, |r, out| {
        let (sb, sg) = out.split_at_mut(c);
        let (x, d) = (&x[r * c..(r + 1) * c], &dz[r * c..(r + 1) * c]);
        for ch in 0..c {
            let xhat = (x[ch] - mean[ch]) * inv_std[ch];
            sb[ch] += f64::from(d[ch]);
            sg[ch] += f64::from(d[ch] * xhat);
        }
    });
    let n = rows as f32;
    // dx = γ/σ · (dz - dβ/n - x̂ dγ/n)
    let mut coef = vec![0.0f32; 3 * c];
    for ch in 0..c {
        dbeta[ch] = sums[ch] as f32;
        dgamma[ch] = sums[c + ch] as f32;
        coef[ch] = gamma[ch] * inv_std[ch];
        coef[c + ch] = dbeta[ch] / n;
        coef[2 * c + ch] = dgamma[ch] / n;
    }
    let chunk = chunk_rows(rows) * c;
    dx.par_chunks_mut(chunk).enumerate().for_each(|(p, dx)| {
        let at = p * chunk;
        let x = &x[at..at + dx.len()];
        let d = &dz[at..at + dx.len()];
        for ((dx, x), d) in dx
            .chunks_exact_mut(c)
            .zip(x.chunks_exact(c))
            .zip(d.chunks_exact(c))
        {
            for ch in 0..c {
                let xhat = (x[ch] - mean[ch]) * inv_std[ch];
                dx[ch] = coef[ch] * (d[ch] - coef[c + ch] - xhat * coef[2 * c + ch]);
            }
        }
    });
}

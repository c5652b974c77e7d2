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
    // One pass: the ReLU mask applied to dy in place, and per chunk of rows
    // the sums of dz and dz · x̂.
    let chunk = chunk_rows(rows);
    let parts = rows.div_ceil(chunk).max(1);
    let partial = &mut scratch.partial;
    partial.clear();
    partial.resize(parts * 2 * c, 0.0);
    partial
        .par_chunks_mut(2 * c)
        .zip(dy.par_chunks_mut(chunk * c))
        .enumerate()
        .for_each(|(p, (out, d))| {
            let (sb, sg) = out.split_at_mut(c);
            for (r, d) in d.chunks_exact_mut(c).enumerate() {
                let at = (p * chunk + r) * c;
                if let Some(o) = relu_out {
                    for (d, &o) in d.iter_mut().zip(&o[at..at + c]) {
                        if o <= 0.0 {
                            *d = 0.0;
                        }
                    }
                }
                let x = &x[at..at + c];
                for ch in 0..c {
                    let xhat = (x[ch] - mean[ch]) * inv_std[ch];
                    sb[ch] += f64::from(d[ch]);
                    sg[ch] += f64::from(d[ch] * xhat);
                }
            }
        });
    let mut sums = vec![0.0f64; 2 * c];
    for part in partial.chunks_exact(2 * c) {
        for (t, v) in sums.iter_mut().zip(part) {
            *t += v;
        }
    }
    let dz: &[f32] = dy;
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

#[cfg(test)]
mod tests {
    use super::super::testing::{check_gradient, dot, random};
    use super::*;

    const C: usize = 3;

    /// Naive batch norm with its epilogue, in f64.
    fn reference(x: &[f32], gamma: &[f32], beta: &[f32], epi: Epilogue) -> Vec<f32> {
        let rows = x.len() / C;
        let mut y = vec![0.0f32; x.len()];
        for ch in 0..C {
            let vals: Vec<f64> = (0..rows).map(|r| f64::from(x[r * C + ch])).collect();
            let mu = vals.iter().sum::<f64>() / rows as f64;
            let var = vals.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / rows as f64;
            for r in 0..rows {
                let mut v = (vals[r] - mu) / (var + 1e-5).sqrt() * f64::from(gamma[ch])
                    + f64::from(beta[ch]);
                if let Some(s) = epi.skip {
                    v += f64::from(s[r * C + ch]);
                }
                if epi.relu {
                    v = v.max(0.0);
                }
                y[r * C + ch] = v as f32;
            }
        }
        y
    }

    fn run(x: &[f32], gamma: &[f32], beta: &[f32], epi: Epilogue) -> (Vec<f32>, [Vec<f32>; 3]) {
        let mut y = vec![0.0; x.len()];
        let (mut mean, mut inv, mut var) = (vec![0.0; C], vec![0.0; C], vec![0.0; C]);
        let mut s = NormScratch::default();
        train_forward(
            x, C, gamma, beta, 1e-5, epi, &mut y, &mut mean, &mut inv, &mut var, &mut s,
        );
        (y, [mean, inv, var])
    }

    #[test]
    fn training_forward_matches_a_naive_batch_norm() {
        let x = random(7 * C, 1);
        let skip = random(7 * C, 2);
        let (gamma, beta) = (random(C, 3), random(C, 4));
        for epi in [
            Epilogue {
                skip: None,
                relu: false,
            },
            Epilogue {
                skip: Some(&skip),
                relu: true,
            },
        ] {
            let (y, [mean, _, var]) = run(&x, &gamma, &beta, epi);
            let want = reference(&x, &gamma, &beta, epi);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{y:?} vs {want:?}");
            }
            // The unbiased variance, for the running statistics.
            for ch in 0..C {
                let vals: Vec<f32> = (0..7).map(|r| x[r * C + ch]).collect();
                let mu = vals.iter().sum::<f32>() / 7.0;
                let v = vals.iter().map(|v| (v - mu).powi(2)).sum::<f32>() / 6.0;
                assert!((mean[ch] - mu).abs() < 1e-6 && (var[ch] - v).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn eval_forward_uses_the_running_statistics() {
        let x = random(4 * C, 5);
        let (gamma, beta) = (random(C, 6), random(C, 7));
        let (rm, rv) = (vec![0.1, -0.2, 0.3], vec![0.5, 1.5, 2.0]);
        let mut y = vec![0.0; x.len()];
        let mut inv = vec![0.0; C];
        let epi = Epilogue {
            skip: None,
            relu: false,
        };
        eval_forward(&x, C, &gamma, &beta, &rm, &rv, 1e-5, epi, &mut y, &mut inv);
        for (i, (&y, &x)) in y.iter().zip(&x).enumerate() {
            let ch = i % C;
            let want = (x - rm[ch]) / (rv[ch] + 1e-5).sqrt() * gamma[ch] + beta[ch];
            assert!((y - want).abs() < 1e-5);
        }
    }

    #[test]
    fn backward_matches_finite_differences_with_and_without_relu_and_skip() {
        let rows = 6;
        let x = random(rows * C, 8);
        let skip = random(rows * C, 9);
        let r = random(rows * C, 10);
        let (gamma, beta) = (random(C, 11), random(C, 12));
        for (with_skip, relu) in [(false, false), (false, true), (true, true)] {
            let epi = Epilogue {
                skip: with_skip.then_some(&skip[..]),
                relu,
            };
            let (y, [mean, inv, _]) = run(&x, &gamma, &beta, epi);
            let mut dy = r.clone();
            let mut dx = vec![0.0; x.len()];
            let (mut dg, mut db) = (vec![0.0; C], vec![0.0; C]);
            let mut s = NormScratch::default();
            train_backward(
                &x,
                C,
                &gamma,
                &mean,
                &inv,
                relu.then_some(&y[..]),
                &mut dy,
                &mut dx,
                &mut dg,
                &mut db,
                &mut s,
            );
            let loss = |x: &[f32], g: &[f32], b: &[f32]| dot(&run(x, g, b, epi).0, &r);
            check_gradient("dx", &x, &dx, 1e-3, |p| loss(p, &gamma, &beta));
            check_gradient("dgamma", &gamma, &dg, 1e-3, |p| loss(&x, p, &beta));
            check_gradient("dbeta", &beta, &db, 1e-3, |p| loss(&x, &gamma, p));
            if with_skip {
                // dy now holds the gradient of the sum, which is the skip's.
                check_gradient("dskip", &skip, &dy, 1e-3, |s| {
                    let epi = Epilogue {
                        skip: Some(s),
                        relu,
                    };
                    dot(&run(&x, &gamma, &beta, epi).0, &r)
                });
            }
        }
    }
}

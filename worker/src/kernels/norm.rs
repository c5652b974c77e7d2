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

/// Rows summed in f32 before the block's sums are added into the f64
/// totals: short enough that the f32 sums keep their precision, long enough
/// that the inner loops run over contiguous rows at SIMD width.
const BLOCK_ROWS: usize = 32;

/// Per-channel sums over rows, split over the pool: `f(rows, acc)` adds a
/// block of at most [`BLOCK_ROWS`] rows into the f32 accumulator `acc`
/// (`width` wide), which is then added into that part's f64 totals.
fn channel_sums(
    rows: usize,
    width: usize,
    partial: &mut Vec<f64>,
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Vec<f64> {
    let chunk = chunk_rows(rows);
    let parts = rows.div_ceil(chunk).max(1);
    partial.clear();
    partial.resize(parts * width, 0.0);
    partial
        .par_chunks_mut(width)
        .enumerate()
        .for_each(|(p, out)| block_sums(p * chunk..((p + 1) * chunk).min(rows), out, &f));
    part_totals(partial, width)
}

/// One part's sums over `rows`: `f(block, acc)` adds a block of at most
/// [`BLOCK_ROWS`] rows into the zeroed f32 `acc`, which is then added into
/// `out` in f64.
fn block_sums(
    rows: std::ops::Range<usize>,
    out: &mut [f64],
    mut f: impl FnMut(std::ops::Range<usize>, &mut [f32]),
) {
    let mut acc = vec![0.0f32; out.len()];
    let mut r = rows.start;
    while r < rows.end {
        let to = (r + BLOCK_ROWS).min(rows.end);
        acc.fill(0.0);
        f(r..to, &mut acc);
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o += f64::from(a);
        }
        r = to;
    }
}

/// The parts' sums (`width` each, one after another) added up.
fn part_totals(partial: &[f64], width: usize) -> Vec<f64> {
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
///
/// The statistics come from one pass over sums shifted by the first row
/// (`Σ (x - x₀)` and `Σ (x - x₀)²`), so a channel whose mean is large
/// against its spread loses no precision to `E[x²] - μ²`.
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
    let shift = &x[..c.min(x.len())];
    let sums = channel_sums(rows, 2 * c, &mut scratch.partial, |block, acc| {
        let (s, q) = acc.split_at_mut(c);
        for x in x[block.start * c..block.end * c].chunks_exact(c) {
            for (((s, q), &v), &k) in s.iter_mut().zip(q.iter_mut()).zip(x).zip(shift) {
                let v = v - k;
                *s += v;
                *q += v * v;
            }
        }
    });
    let n = rows as f64;
    let unbiased = if rows > 1 { n / (n - 1.0) } else { 1.0 };
    for ch in 0..c {
        let d = sums[ch] / n;
        let biased = (sums[c + ch] / n - d * d).max(0.0);
        mean[ch] = (f64::from(shift[ch]) + d) as f32;
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
        if epi.relu {
            affine_rows::<true>(x, skip, scale, shift, y);
        } else {
            affine_rows::<false>(x, skip, scale, shift, y);
        }
    });
}

/// `y = relu?(x · scale + shift + skip?)` row by row, one pass with the
/// epilogue fused; each variant is a loop the compiler vectorises.
fn affine_rows<const RELU: bool>(
    x: &[f32],
    skip: Option<&[f32]>,
    scale: &[f32],
    shift: &[f32],
    y: &mut [f32],
) {
    let c = scale.len();
    let relu = |v: f32| if RELU { v.max(0.0) } else { v };
    match skip {
        Some(s) => {
            let rows = y.chunks_exact_mut(c).zip(x.chunks_exact(c));
            for ((y, x), s) in rows.zip(s.chunks_exact(c)) {
                let affine = scale.iter().zip(shift);
                for (((y, &x), &s), (&a, &b)) in y.iter_mut().zip(x).zip(s).zip(affine) {
                    *y = relu(x * a + b + s);
                }
            }
        }
        None => {
            for (y, x) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
                let affine = scale.iter().zip(shift);
                for ((y, &x), (&a, &b)) in y.iter_mut().zip(x).zip(affine) {
                    *y = relu(x * a + b);
                }
            }
        }
    }
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
    let mean = &mean[..c];
    // One pass: the ReLU mask applied to dy in place, and per channel the
    // sums of dz and dz · (x - μ) (dγ is the second times 1/σ), in f32 over
    // blocks of rows and f64 across blocks.
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
            let at = p * chunk * c;
            let x = &x[at..at + d.len()];
            let o = relu_out.map(|o| &o[at..at + d.len()]);
            block_sums(0..d.len() / c, out, |block, acc| {
                let span = block.start * c..block.end * c;
                let d = &mut d[span.clone()];
                if let Some(o) = o {
                    for (d, &o) in d.iter_mut().zip(&o[span.clone()]) {
                        *d = if o > 0.0 { *d } else { 0.0 };
                    }
                }
                let (sb, sg) = acc.split_at_mut(c);
                for (d, x) in d.chunks_exact(c).zip(x[span].chunks_exact(c)) {
                    let sums = sb.iter_mut().zip(sg.iter_mut());
                    for (((sb, sg), (&d, &x)), &m) in sums.zip(d.iter().zip(x)).zip(mean) {
                        *sb += d;
                        *sg += d * (x - m);
                    }
                }
            });
        });
    let sums = part_totals(partial, 2 * c);
    let dz: &[f32] = dy;
    let n = rows as f64;
    // dx = γ/σ · (dz - dβ/n - x̂ dγ/n) = a dz + b (x - μ) + e per channel.
    let mut coef = vec![0.0f32; 3 * c];
    for ch in 0..c {
        let inv = f64::from(inv_std[ch]);
        let db = sums[ch];
        let dg = sums[c + ch] * inv;
        dbeta[ch] = db as f32;
        dgamma[ch] = dg as f32;
        let a = f64::from(gamma[ch]) * inv;
        coef[ch] = a as f32;
        coef[c + ch] = (-a * inv * dg / n) as f32;
        coef[2 * c + ch] = (-a * db / n) as f32;
    }
    let (a, rest) = coef.split_at(c);
    let (b, e) = rest.split_at(c);
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
            let per = a.iter().zip(b).zip(e.iter().zip(mean));
            for (((dx, &x), &d), ((&a, &b), (&e, &m))) in dx.iter_mut().zip(x).zip(d).zip(per) {
                *dx = a * d + b * (x - m) + e;
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

    /// Many rows (several f32 blocks and pool parts) on channels whose mean
    /// is far from zero against their spread: the statistics and both
    /// gradients match an f64 batch norm. Plain f32 `E[x²] - μ²` sums would
    /// lose the variance here entirely.
    #[test]
    fn statistics_and_gradients_keep_their_precision_over_many_rows() {
        let rows = 1000;
        let noise = random(rows * C, 13);
        let x: Vec<f32> = noise
            .iter()
            .enumerate()
            .map(|(i, v)| 10.0 * (i % C) as f32 + 0.01 * v)
            .collect();
        let (gamma, beta) = (random(C, 14), random(C, 15));
        let epi = Epilogue {
            skip: None,
            relu: false,
        };
        let (y, [mean, inv, var]) = run(&x, &gamma, &beta, epi);
        let n = rows as f64;
        let mut want_xhat = vec![0.0f64; x.len()];
        let mut want_inv = [0.0f64; C];
        for ch in 0..C {
            let vals: Vec<f64> = (0..rows).map(|r| f64::from(x[r * C + ch])).collect();
            let mu = vals.iter().sum::<f64>() / n;
            let biased = vals.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / n;
            assert!((f64::from(mean[ch]) - mu).abs() < 1e-3, "mean {ch}");
            let unbiased = biased * n / (n - 1.0);
            assert!(
                (f64::from(var[ch]) / unbiased - 1.0).abs() < 1e-3,
                "var {ch}"
            );
            want_inv[ch] = 1.0 / (biased + 1e-5).sqrt();
            assert!(
                (f64::from(inv[ch]) / want_inv[ch] - 1.0).abs() < 1e-3,
                "inv {ch}"
            );
            for r in 0..rows {
                want_xhat[r * C + ch] = (vals[r] - mu) * want_inv[ch];
            }
        }
        for (i, &y) in y.iter().enumerate() {
            let ch = i % C;
            let want = want_xhat[i] * f64::from(gamma[ch]) + f64::from(beta[ch]);
            assert!((f64::from(y) - want).abs() < 1e-2, "y[{i}] {y} vs {want}");
        }
        let mut dy = random(rows * C, 16);
        let dz: Vec<f64> = dy.iter().map(|&v| f64::from(v)).collect();
        let mut dx = vec![0.0; x.len()];
        let (mut dg, mut db) = (vec![0.0; C], vec![0.0; C]);
        let mut s = NormScratch::default();
        train_backward(
            &x, C, &gamma, &mean, &inv, None, &mut dy, &mut dx, &mut dg, &mut db, &mut s,
        );
        for ch in 0..C {
            let sb: f64 = (0..rows).map(|r| dz[r * C + ch]).sum();
            let sg: f64 = (0..rows)
                .map(|r| dz[r * C + ch] * want_xhat[r * C + ch])
                .sum();
            assert!((f64::from(db[ch]) - sb).abs() < 1e-3, "dbeta {ch}");
            assert!((f64::from(dg[ch]) - sg).abs() < 1e-2, "dgamma {ch}");
            let a = f64::from(gamma[ch]) * want_inv[ch];
            for r in 0..rows {
                let i = r * C + ch;
                let want = a * (dz[i] - sb / n - want_xhat[i] * sg / n);
                let got = f64::from(dx[i]);
                assert!((got - want).abs() <= 1e-3 * want.abs().max(1.0), "dx[{i}]");
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

//! Hand-written CPU kernels for the layered models: NHWC activations, f32,
//! buffers owned by the caller and reused across steps.
//!
//! * [`conv`]: 2-d convolution forward and its two gradients.
//! * [`norm`]: batch norm (training and evaluation) fused with the ReLU and
//!   residual add that follow it, and its backward pass.
//! * [`pool`]: max / average pooling and the global average pool.
//! * [`net`]: the executor that runs a whole layered network's training
//!   forward and backward pass with these kernels.
//! * [`gpt`]: the GPT preset's forward and backward pass.

pub mod conv;
pub mod gpt;
pub mod net;
pub mod norm;
pub mod pool;

use rayon::prelude::*;

/// Whether a `rows x cols` matrix with strides `rs`, `cs` lies inside a
/// slice of `len` values.
fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// A strided matrix view: `data[r * rs + c * cs]` is entry `(r, c)`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Mat {
            data,
            rs: 1,
            cs: cols,
        }
    }
}

/// `c = a · b` (or `c += a · b` when `accumulate`), with `a` `m x k`, `b`
/// `k x n` and `c` row-major `m x n` (row stride `n`). Runs on the current
/// rayon pool's threads.
///
/// # Panics
/// When a matrix does not fit its slice (a bug in the caller's sizes).
pub fn matmul(m: usize, n: usize, k: usize, c: &mut [f32], accumulate: bool, a: Mat, b: Mat) {
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && m * n * k >= 1 << 15 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    matmul_strided((m, n, k), c, n, accumulate, a, b, parallelism);
}

/// `dst[m x n] (=|+=) lhs[m x k] · rhs[k x n]`, `dst` row-major with row
/// stride `dst_rs`, split as `par` says.
///
/// # Panics
/// When a matrix does not fit its slice (a bug in the caller's sizes).
pub fn matmul_strided(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    par: gemm::Parallelism,
) {
    assert!(
        fits(dst.len(), m, n, dst_rs, 1) && fits(lhs.data.len(), m, k, lhs.rs, lhs.cs),
        "matmul: {m}x{k} · {k}x{n} does not fit its buffers"
    );
    assert!(
        fits(rhs.data.len(), k, n, rhs.rs, rhs.cs),
        "matmul: rhs too small"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                dst[row * dst_rs..row * dst_rs + n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: every index the product touches was checked to lie inside its
    // slice above; `dst` is borrowed mutably and cannot alias `lhs` or `rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Rows per parallel chunk when `rows` rows are split over the pool.
pub fn chunk_rows(rows: usize) -> usize {
    rows.div_ceil(rayon::current_num_threads().max(1)).max(1)
}

/// `dst[i] += src[i]`, in parallel.
pub fn add_into(dst: &mut [f32], src: &[f32]) {
    let chunk = chunk_rows(dst.len()).max(4096);
    dst.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
}

#[cfg(test)]
pub(crate) mod testing {
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// `n` values uniform in [-1, 1) from `seed`.
    pub fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// Checks `analytic` against central differences of `loss` at every
    /// entry of `x` (step `eps`); `what` names the gradient in failures.
    pub fn check_gradient(
        what: &str,
        x: &[f32],
        analytic: &[f32],
        eps: f32,
        loss: impl Fn(&[f32]) -> f64,
    ) {
        assert_eq!(x.len(), analytic.len(), "{what}: lengths");
        let mut largest = 0.0f32;
        let mut p = x.to_vec();
        for i in 0..x.len() {
            p[i] = x[i] + eps;
            let up = loss(&p);
            p[i] = x[i] - eps;
            let down = loss(&p);
            p[i] = x[i];
            let fd = ((up - down) / (2.0 * f64::from(eps))) as f32;
            let g = analytic[i];
            largest = largest.max(g.abs());
            assert!(
                (fd - g).abs() <= 2e-3 + 2e-2 * g.abs(),
                "{what}[{i}]: finite difference {fd} vs {g}"
            );
        }
        assert!(
            largest > 1e-3,
            "{what}: all gradients ~0, the check proves nothing"
        );
    }

    /// `Σ y ⊙ r` in f64.
    pub fn dot(y: &[f32], r: &[f32]) -> f64 {
        y.iter()
            .zip(r)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::random;
    use super::*;

    #[test]
    fn matmul_with_strides_matches_a_naive_product() {
        let (m, n, k) = (5, 7, 3);
        let a = random(m * k, 1);
        let b = random(k * n, 2);
        // a given transposed (k x m storage), b row-major.
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let mut c = random(m * n, 3);
        let before = c.clone();
        matmul(
            m,
            n,
            k,
            &mut c,
            true,
            Mat::transposed(&at, m),
            Mat::rows(&b, n),
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
                let got = c[i * n + j] - before[i * n + j];
                assert!((got - want).abs() < 1e-5, "({i}, {j}): {got} vs {want}");
            }
        }
    }
}

//! Fused, parallel optimizer update of one parameter shard.
//!
//! Each server shard owns a contiguous slice of the flat parameters, the matching
//! aggregated gradient and a momentum buffer. [`fused_update`] applies SGD with
//! optional momentum (plain or Nesterov), weight decay and LARS layer-wise learning
//! rates in one streaming pass over the three arrays, parallel over chunks with
//! rayon and without full-size temporaries. LARS needs per-tensor norms first; they
//! come from one parallel reduction pass. [`reference_update`] computes the same
//! result with separate passes and temporaries, for tests and benchmarks. Both take
//! the hyper-parameters as the config's `[optimizer]` section,
//! [`OptimizerSection`]; LARS is on when its `lars_eta` is above zero.
//!
//! Per element, with `g' = grad_scale * grad + weight_decay * p`:
//!
//! ```text
//! momentum > 0:  m = momentum * m + g';  step = nesterov ? g' + momentum * m : m
//! otherwise:     step = g'
//! p -= lr_eff * step,  lr_eff = lr * trust(segment)  (trust = 1 without LARS)
//! ```
//!
//! ```
//! use ps_server::optimizer::fused_update;
//! use ps_shared::config::OptimizerSection;
//!
//! let rule = OptimizerSection {
//!     lr: 0.5,
//!     momentum: 0.0,
//!     nesterov: false,
//!     weight_decay: 0.0,
//!     lars_eta: 0.0,
//! };
//! let mut params = vec![1.0, 2.0];
//! fused_update(&mut params, &[2.0, -2.0], &mut [], &[0..2], &rule, 1.0).unwrap();
//! assert_eq!(params, vec![0.0, 3.0]);
//! ```

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ps_shared::config::OptimizerSection;
use rayon::prelude::*;

/// Elements per parallel work item.
const UPDATE_CHUNK: usize = 1 << 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UpdateError {
    #[error("gradient has {grad} entries but the shard holds {params} parameters")]
    GradLength { params: usize, grad: usize },
    #[error("momentum buffer has {momentum} entries but the shard holds {params} parameters")]
    MomentumLength { params: usize, momentum: usize },
    #[error(
        "segment {segment} is {start}..{end}, expected it to start at {expected}: \
         segments must be ascending, contiguous and not reversed"
    )]
    SegmentNotContiguous {
        segment: usize,
        start: usize,
        end: usize,
        expected: usize,
    },
    #[error("segments cover 0..{covered} but the shard holds {params} parameters")]
    SegmentsDoNotCover { covered: usize, params: usize },
}

/// Whether [`fused_update`] can run on these inputs: the checks it makes
/// before it writes anything. When they fail, the update writes nothing
/// (parameters and momentum stay as they were).
pub fn check_update(
    params: &[f32],
    grad: &[f32],
    momentum_buf: &[f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, momentum_buf, segments, rule)
}

/// Checks lengths (and, with LARS, that `segments` tile `0..params.len()`).
fn check_inputs(
    params: &[f32],
    grad: &[f32],
    momentum_buf: &[f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
) -> Result<(), UpdateError> {
    if grad.len() != params.len() {
        return Err(UpdateError::GradLength {
            params: params.len(),
            grad: grad.len(),
        });
    }
    if rule.uses_momentum() && momentum_buf.len() != params.len() {
        return Err(UpdateError::MomentumLength {
            params: params.len(),
            momentum: momentum_buf.len(),
        });
    }
    if rule.lars().is_some() {
        let mut expected = 0;
        for (segment, range) in segments.iter().enumerate() {
            if range.start != expected || range.end < range.start {
                return Err(UpdateError::SegmentNotContiguous {
                    segment,
                    start: range.start,
                    end: range.end,
                    expected,
                });
            }
            expected = range.end;
        }
        if expected != params.len() {
            return Err(UpdateError::SegmentsDoNotCover {
                covered: expected,
                params: params.len(),
            });
        }
    }
    Ok(())
}

/// LARS trust ratio from squared norms; 1 when either norm is zero.
fn trust_ratio(eta: f32, param_sq: f64, grad_sq: f64) -> f32 {
    if param_sq == 0.0 || grad_sq == 0.0 {
        1.0
    } else {
        (f64::from(eta) * param_sq.sqrt() / grad_sq.sqrt()) as f32
    }
}

/// CPU time the calling thread has used so far (zero where the clock is
/// not available).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// Runs `work`, adding the CPU time it takes on the current thread to
/// `spent` (nanoseconds) when there is a `spent`.
#[inline]
fn charged<R>(spent: Option<&AtomicU64>, work: impl FnOnce() -> R) -> R {
    let Some(spent) = spent else {
        return work();
    };
    let t0 = thread_cpu_time();
    let result = work();
    let used = thread_cpu_time().saturating_sub(t0);
    spent.fetch_add(
        u64::try_from(used.as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
    result
}

/// One fused pass over the shard, parallel over chunks, no full-size temporaries.
/// With LARS, a parallel reduction pass computes per-segment norms first. Without
/// LARS `segments` is not used. `momentum_buf` may be empty when momentum is off.
pub fn fused_update(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    fused_update_charged(params, grad, momentum_buf, segments, rule, grad_scale, None)
}

/// [`fused_update`], returning the CPU time of its parallel work: each work
/// item is timed with the clock of the thread that runs it (a rayon pool
/// thread), and the times are summed. A caller outside the pool only waits
/// for that work, so its own thread CPU time leaves it out.
pub fn fused_update_timed(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<Duration, UpdateError> {
    let spent = AtomicU64::new(0);
    fused_update_charged(
        params,
        grad,
        momentum_buf,
        segments,
        rule,
        grad_scale,
        Some(&spent),
    )?;
    Ok(Duration::from_nanos(spent.into_inner()))
}

fn fused_update_charged(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
    grad_scale: f32,
    spent: Option<&AtomicU64>,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, momentum_buf, segments, rule)?;
    let whole = 0..params.len();
    let segments: &[Range<usize>] = if rule.lars().is_some() {
        segments
    } else {
        std::slice::from_ref(&whole)
    };
    // Work items: (segment, range) pieces of at most UPDATE_CHUNK elements, in order.
    let pieces: Vec<(usize, Range<usize>)> = segments
        .iter()
        .enumerate()
        .flat_map(|(segment, range)| {
            range
                .clone()
                .step_by(UPDATE_CHUNK)
                .map(move |start| (segment, start..(start + UPDATE_CHUNK).min(range.end)))
        })
        .collect();

    let segment_lrs: Vec<f32> = match rule.lars() {
        None => vec![rule.lr],
        Some(eta) => {
            let params_view: &[f32] = params;
            let partial: Vec<(usize, f64, f64)> = pieces
                .par_iter()
                .map(|(segment, range)| {
                    let (param_sq, grad_sq) = charged(spent, || {
                        piece_norms(
                            &params_view[range.clone()],
                            &grad[range.clone()],
                            rule,
                            grad_scale,
                        )
                    });
                    (*segment, param_sq, grad_sq)
                })
                .collect();
            let mut sums = vec![(0.0f64, 0.0f64); segments.len()];
            for (segment, param_sq, grad_sq) in partial {
                sums[segment].0 += param_sq;
                sums[segment].1 += grad_sq;
            }
            sums.iter()
                .map(|&(param_sq, grad_sq)| rule.lr * trust_ratio(eta, param_sq, grad_sq))
                .collect()
        }
    };

    // Cut the mutable arrays into the disjoint pieces, then update them in parallel.
    let mut work = Vec::with_capacity(pieces.len());
    let mut params_rest: &mut [f32] = params;
    let mut momentum_rest: &mut [f32] = if rule.uses_momentum() {
        momentum_buf
    } else {
        &mut []
    };
    let mut grad_rest = grad;
    for (segment, range) in &pieces {
        let len = range.len();
        let (params_piece, params_tail) = std::mem::take(&mut params_rest).split_at_mut(len);
        params_rest = params_tail;
        let momentum_len = len.min(momentum_rest.len());
        let (momentum_piece, momentum_tail) =
            std::mem::take(&mut momentum_rest).split_at_mut(momentum_len);
        momentum_rest = momentum_tail;
        let (grad_piece, grad_tail) = grad_rest.split_at(len);
        grad_rest = grad_tail;
        work.push((
            params_piece,
            grad_piece,
            momentum_piece,
            segment_lrs[*segment],
        ));
    }
    work.into_par_iter()
        .for_each(|(params, grad, momentum, lr)| {
            charged(spent, || {
                update_piece(params, grad, momentum, lr, rule, grad_scale)
            })
        });
    Ok(())
}

/// Squared norms of `p` and of `g' = grad_scale * g + weight_decay * p`.
///
/// Blocks of 1024 entries are summed in eight f32 lanes (one loop per norm, so
/// that each vectorises) and the lane sums are added up in f64.
fn piece_norms(
    params: &[f32],
    grad: &[f32],
    rule: &OptimizerSection,
    grad_scale: f32,
) -> (f64, f64) {
    const LANES: usize = 8;
    const BLOCK: usize = 1024;
    let weight_decay = rule.weight_decay;
    let mut param_sq = 0.0f64;
    let mut grad_sq = 0.0f64;
    for (p_block, g_block) in params.chunks(BLOCK).zip(grad.chunks(BLOCK)) {
        let mut p_lanes = [0.0f32; LANES];
        for p_lane_group in p_block.chunks_exact(LANES) {
            for (lane, &p) in p_lanes.iter_mut().zip(p_lane_group) {
                *lane += p * p;
            }
        }
        let mut g_lanes = [0.0f32; LANES];
        for (p_lane_group, g_lane_group) in
            p_block.chunks_exact(LANES).zip(g_block.chunks_exact(LANES))
        {
            for ((lane, &p), &g) in g_lanes.iter_mut().zip(p_lane_group).zip(g_lane_group) {
                let shaped = grad_scale * g + weight_decay * p;
                *lane += shaped * shaped;
            }
        }
        let tail_start = p_block.len() - p_block.len() % LANES;
        for (&p, &g) in p_block[tail_start..].iter().zip(&g_block[tail_start..]) {
            let shaped = grad_scale * g + weight_decay * p;
            p_lanes[0] += p * p;
            g_lanes[0] += shaped * shaped;
        }
        param_sq += p_lanes.iter().map(|&v| f64::from(v)).sum::<f64>();
        grad_sq += g_lanes.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    (param_sq, grad_sq)
}

#[inline(always)]
fn update_piece(
    params: &mut [f32],
    grad: &[f32],
    momentum: &mut [f32],
    lr: f32,
    rule: &OptimizerSection,
    grad_scale: f32,
) {
    let weight_decay = rule.weight_decay;
    let mu = rule.momentum;
    if rule.uses_momentum() {
        let triples = params.iter_mut().zip(grad).zip(momentum.iter_mut());
        if rule.nesterov {
            for ((p, &g), m) in triples {
                let shaped = grad_scale * g + weight_decay * *p;
                let velocity = mu * *m + shaped;
                *m = velocity;
                *p -= lr * (shaped + mu * velocity);
            }
        } else {
            for ((p, &g), m) in triples {
                let shaped = grad_scale * g + weight_decay * *p;
                let velocity = mu * *m + shaped;
                *m = velocity;
                *p -= lr * velocity;
            }
        }
    } else {
        for (p, &g) in params.iter_mut().zip(grad) {
            let shaped = grad_scale * g + weight_decay * *p;
            *p -= lr * shaped;
        }
    }
}

/// Same result as [`fused_update`] from separate, sequential passes with
/// full-size temporaries (shaped gradient, per-element learning rate, step).
pub fn reference_update(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, momentum_buf, segments, rule)?;
    let shaped: Vec<f32> = grad
        .iter()
        .zip(params.iter())
        .map(|(&g, &p)| grad_scale * g + rule.weight_decay * p)
        .collect();

    let mut lrs = vec![rule.lr; params.len()];
    if let Some(eta) = rule.lars() {
        for range in segments {
            let param_sq: f64 = params[range.clone()]
                .iter()
                .map(|&p| f64::from(p * p))
                .sum();
            let grad_sq: f64 = shaped[range.clone()]
                .iter()
                .map(|&g| f64::from(g * g))
                .sum();
            let lr = rule.lr * trust_ratio(eta, param_sq, grad_sq);
            lrs[range.clone()].fill(lr);
        }
    }

    let step: Vec<f32> = if rule.uses_momentum() {
        for (m, &g) in momentum_buf.iter_mut().zip(&shaped) {
            *m = rule.momentum * *m + g;
        }
        if rule.nesterov {
            shaped
                .iter()
                .zip(momentum_buf.iter())
                .map(|(&g, &m)| g + rule.momentum * m)
                .collect()
        } else {
            momentum_buf.to_vec()
        }
    } else {
        shaped
    };

    for ((p, &s), &lr) in params.iter_mut().zip(&step).zip(&lrs) {
        *p -= lr * s;
    }
    Ok(())
}

#[cfg(test)]
// One-range segment lists are the common case here, not a mistaken range array.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A rule with lr 0.1; `lars` is the trust coefficient, `None` = off.
    fn rule(
        momentum: f32,
        nesterov: bool,
        weight_decay: f32,
        lars: Option<f32>,
    ) -> OptimizerSection {
        OptimizerSection {
            lr: 0.1,
            momentum,
            nesterov,
            weight_decay,
            lars_eta: lars.unwrap_or(0.0),
        }
    }

    #[test]
    fn timed_update_matches_and_counts_the_pool_work() {
        let n = 4 * UPDATE_CHUNK + 17;
        let grad: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let segments = [0..n / 3, n / 3..n];
        for r in [
            rule(0.9, true, 1e-4, None),
            rule(0.0, false, 0.0, Some(1e-3)),
        ] {
            let mut p_plain = vec![0.5f32; n];
            let mut m_plain = vec![0.0f32; n];
            fused_update(&mut p_plain, &grad, &mut m_plain, &segments, &r, 0.5).unwrap();
            let mut p_timed = vec![0.5f32; n];
            let mut m_timed = vec![0.0f32; n];
            let cpu =
                fused_update_timed(&mut p_timed, &grad, &mut m_timed, &segments, &r, 0.5).unwrap();
            assert_eq!(p_plain, p_timed);
            assert_eq!(m_plain, m_timed);
            assert!(cpu > Duration::ZERO, "no CPU time counted for {n} elements");
        }
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(&x, &y)| (x - y).abs() <= 1e-5 * (1.0 + x.abs().max(y.abs())))
    }

    /// Segment boundaries from sorted cut points.
    fn segments_from_cuts(len: usize, mut cuts: Vec<usize>) -> Vec<Range<usize>> {
        cuts.retain(|&c| c < len);
        cuts.sort_unstable();
        let mut out = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([len]) {
            out.push(start..cut);
            start = cut;
        }
        out
    }

    #[test]
    fn plain_sgd_example() {
        let mut params = vec![1.0, 2.0];
        let plain = rule(0.0, false, 0.0, None);
        fused_update(&mut params, &[2.0, -2.0], &mut [], &[0..2], &plain, 0.5).unwrap();
        assert_eq!(params, vec![0.9, 2.1]);
    }

    #[test]
    fn momentum_and_nesterov_by_hand() {
        let mut params = vec![1.0f32];
        let mut momentum = vec![1.0f32];
        // g' = 1 + 0.5*1 = 1.5; m = 0.9 + 1.5 = 2.4; p = 1 - 0.1*2.4
        fused_update(
            &mut params,
            &[1.0],
            &mut momentum,
            &[0..1],
            &rule(0.9, false, 0.5, None),
            1.0,
        )
        .unwrap();
        assert!((momentum[0] - 2.4).abs() < 1e-6);
        assert!((params[0] - 0.76).abs() < 1e-6);
        let mut params = vec![1.0f32];
        let mut momentum = vec![1.0f32];
        // step = 1.5 + 0.9*2.4 = 3.66
        fused_update(
            &mut params,
            &[1.0],
            &mut momentum,
            &[0..1],
            &rule(0.9, true, 0.5, None),
            1.0,
        )
        .unwrap();
        assert!((params[0] - (1.0 - 0.366)).abs() < 1e-6);
    }

    #[test]
    fn lars_trust_per_segment_and_zero_norm_guard() {
        // Segment 0: ||p|| = 5, ||g|| = 2 -> trust = 0.01*5/2 = 0.025.
        // Segment 1: p = 0 -> trust 1.
        let mut params = vec![3.0, 4.0, 0.0];
        let grad = [2.0, 0.0, 1.0];
        let lars = rule(0.0, false, 0.0, Some(0.01));
        fused_update(&mut params, &grad, &mut [], &[0..2, 2..3], &lars, 1.0).unwrap();
        assert!((params[0] - (3.0 - 0.1 * 0.025 * 2.0)).abs() < 1e-6);
        assert_eq!(params[1], 4.0);
        assert!((params[2] + 0.1).abs() < 1e-6);
    }

    #[test]
    fn length_and_segment_errors() {
        let sgd = rule(0.9, false, 0.0, None);
        let mut params = vec![0.0; 4];
        assert_eq!(
            fused_update(&mut params, &[0.0; 3], &mut [0.0; 4], &[0..4], &sgd, 1.0),
            Err(UpdateError::GradLength { params: 4, grad: 3 })
        );
        assert_eq!(
            reference_update(&mut params, &[0.0; 4], &mut [], &[0..4], &sgd, 1.0),
            Err(UpdateError::MomentumLength {
                params: 4,
                momentum: 0
            })
        );
        let lars = rule(0.0, false, 0.0, Some(0.001));
        assert!(matches!(
            fused_update(&mut params, &[0.0; 4], &mut [], &[0..2, 3..4], &lars, 1.0),
            Err(UpdateError::SegmentNotContiguous { segment: 1, .. })
        ));
        assert_eq!(
            fused_update(&mut params, &[0.0; 4], &mut [], &[0..3], &lars, 1.0),
            Err(UpdateError::SegmentsDoNotCover {
                covered: 3,
                params: 4
            })
        );
        // Without momentum an empty buffer is fine; without LARS segments are unused.
        let plain = rule(0.0, false, 0.0, None);
        assert!(fused_update(&mut params, &[0.0; 4], &mut [], &[], &plain, 1.0).is_ok());
    }

    #[test]
    fn a_failed_update_writes_nothing() {
        let lars = rule(0.9, false, 0.0, Some(0.001));
        let mut params = vec![1.0, 2.0, 3.0, 4.0];
        let mut momentum = vec![0.5; 4];
        let grad = [1.0; 4];
        let bad = [0..2, 2..3];
        let checked = check_update(&params, &grad, &momentum, &bad, &lars);
        let applied = fused_update_timed(&mut params, &grad, &mut momentum, &bad, &lars, 1.0);
        assert_eq!(checked, applied.map(|_| ()));
        assert!(checked.is_err());
        assert_eq!((params, momentum), (vec![1.0, 2.0, 3.0, 4.0], vec![0.5; 4]));
    }

    #[test]
    fn large_shard_matches_reference_across_chunks() {
        let len = 3 * UPDATE_CHUNK + 123;
        let params: Vec<f32> = (0..len)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let grad: Vec<f32> = (0..len)
            .map(|i| ((i * 104_729) % 997) as f32 * 1e-3 - 0.4)
            .collect();
        let momentum: Vec<f32> = (0..len).map(|i| (i % 13) as f32 * 1e-2).collect();
        let segments = vec![0..1000, 1000..UPDATE_CHUNK + 5, UPDATE_CHUNK + 5..len];
        for r in [
            rule(0.9, false, 1e-4, None),
            rule(0.9, true, 1e-4, None),
            rule(0.9, false, 1e-4, Some(0.001)),
        ] {
            let (mut p_fused, mut m_fused) = (params.clone(), momentum.clone());
            let (mut p_ref, mut m_ref) = (params.clone(), momentum.clone());
            fused_update(&mut p_fused, &grad, &mut m_fused, &segments, &r, 0.25).unwrap();
            reference_update(&mut p_ref, &grad, &mut m_ref, &segments, &r, 0.25).unwrap();
            assert!(close(&p_fused, &p_ref));
            assert!(close(&m_fused, &m_ref));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn fused_equals_reference(
            data in prop::collection::vec((-2.0f32..2.0, -2.0f32..2.0, -1.0f32..1.0), 0..200),
            cuts in prop::collection::vec(0usize..200, 0..6),
            momentum in prop_oneof![Just(0.0f32), 0.1f32..0.99],
            nesterov in any::<bool>(),
            weight_decay in prop_oneof![Just(0.0f32), 0.0f32..0.01],
            lars in prop_oneof![Just(None), (0.0001f32..0.1).prop_map(Some)],
            grad_scale in 0.01f32..2.0,
        ) {
            let params: Vec<f32> = data.iter().map(|d| d.0).collect();
            let grad: Vec<f32> = data.iter().map(|d| d.1).collect();
            let momentum_init: Vec<f32> = data.iter().map(|d| d.2).collect();
            let segments = segments_from_cuts(params.len(), cuts);
            let r = OptimizerSection { lr: 0.05, ..rule(momentum, nesterov, weight_decay, lars) };
            let (mut p_fused, mut m_fused) = (params.clone(), momentum_init.clone());
            let (mut p_ref, mut m_ref) = (params.clone(), momentum_init.clone());
            fused_update(&mut p_fused, &grad, &mut m_fused, &segments, &r, grad_scale).unwrap();
            reference_update(&mut p_ref, &grad, &mut m_ref, &segments, &r, grad_scale).unwrap();
            prop_assert!(close(&p_fused, &p_ref), "params {:?} vs {:?}", p_fused, p_ref);
            prop_assert!(close(&m_fused, &m_ref));
        }
    }
}

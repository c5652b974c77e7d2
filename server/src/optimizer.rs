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
//! Adam and AdamW (`kind = "adam" | "adamw"`, as torch defines them) keep two
//! moments per parameter in the state buffer (first moments, then second
//! moments). At global step `t` (1-based), with `g = grad_scale * grad`
//! (plus `weight_decay * p` for Adam):
//!
//! ```text
//! AdamW only:  p -= lr * weight_decay * p
//! m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g^2
//! p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! The learning rate is the schedule's for the step ([`UpdatePlan::step`]);
//! `weight_decay` is 0 on the segments the plan marks as not decayed
//! (`optimizer.no_decay`). With `clip_grad_norm` > 0 a reduction pass first
//! takes the L2 norm of `grad_scale * grad` over the whole shard and scales
//! the gradient by `min(1, clip / (norm + 1e-6))`, like torch's
//! `clip_grad_norm_`. With several shards no shard sees the whole gradient:
//! the shard core clips instead, with the factor of the norm the workers
//! sum from every shard's [`scaled_sum_sq`], and runs the update with
//! clipping off (see `core`'s norm round).
//!
//! Sparse updates ([`lazy_update`]) follow torch's `SparseAdam`: only the
//! pushed entries' moments and parameters change, with the bias correction
//! of the global step; the others keep their moments until they are pushed.
//!
//! ```
//! use ps_server::optimizer::fused_update;
//! use ps_shared::config::OptimizerSection;
//!
//! let rule = OptimizerSection {
//!     lr: 0.5,
//!     ..OptimizerSection::default()
//! };
//! let mut params = vec![1.0, 2.0];
//! fused_update(&mut params, &[2.0, -2.0], &mut [], &[0..2], &rule, 1.0).unwrap();
//! assert_eq!(params, vec![0.0, 3.0]);
//! ```

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ps_shared::adam::AdamStep;
use ps_shared::config::{OptimizerKind, OptimizerSection};
use rayon::prelude::*;

/// How one update applies beyond the rule: the tensor segments of the shard,
/// which of them are decayed, and the global step (0-based) that picks the
/// scheduled learning rate and Adam's bias correction.
#[derive(Debug, Clone, Copy)]
pub struct UpdatePlan<'a> {
    /// Tensor boundaries (local, ascending, tiling the shard); used for LARS
    /// and for `decay`.
    pub segments: &'a [Range<usize>],
    /// Per segment: whether weight decay applies. Empty: every segment.
    pub decay: &'a [bool],
    /// The update being applied, 0-based (the shard's version before it).
    pub step: u64,
}

impl<'a> UpdatePlan<'a> {
    /// Every segment decayed, step 0.
    pub fn new(segments: &'a [Range<usize>]) -> Self {
        Self {
            segments,
            decay: &[],
            step: 0,
        }
    }

    fn decays(&self, segment: usize) -> bool {
        self.decay.get(segment).copied().unwrap_or(true)
    }

    fn needs_segments(&self, rule: &OptimizerSection) -> bool {
        rule.lars().is_some() || (!self.decay.is_empty() && rule.weight_decay > 0.0)
    }
}

/// Elements per parallel work item.
const UPDATE_CHUNK: usize = 1 << 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UpdateError {
    #[error("gradient has {grad} entries but the shard holds {params} parameters")]
    GradLength { params: usize, grad: usize },
    #[error(
        "optimizer state has {momentum} entries but the shard holds {params} parameters \
         ({per_param} per parameter expected)"
    )]
    MomentumLength {
        params: usize,
        momentum: usize,
        per_param: usize,
    },
    #[error("{decay} decay flags for {segments} segments")]
    DecayFlags { decay: usize, segments: usize },
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
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, momentum_buf, plan, rule)
}

/// Checks lengths (and, with LARS, that `segments` tile `0..params.len()`).
fn check_inputs(
    params: &[f32],
    grad: &[f32],
    momentum_buf: &[f32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
) -> Result<(), UpdateError> {
    let segments = plan.segments;
    if grad.len() != params.len() {
        return Err(UpdateError::GradLength {
            params: params.len(),
            grad: grad.len(),
        });
    }
    let per_param = rule.state_per_param();
    if per_param > 0 && momentum_buf.len() != per_param * params.len() {
        return Err(UpdateError::MomentumLength {
            params: params.len(),
            momentum: momentum_buf.len(),
            per_param,
        });
    }
    if !plan.decay.is_empty() && plan.decay.len() != segments.len() {
        return Err(UpdateError::DecayFlags {
            decay: plan.decay.len(),
            segments: segments.len(),
        });
    }
    if plan.needs_segments(rule) {
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
/// Every segment is decayed and the schedule's rate is that of step 0; see
/// [`fused_update_planned`] for the rest.
pub fn fused_update(
    params: &mut [f32],
    grad: &[f32],
    momentum_buf: &mut [f32],
    segments: &[Range<usize>],
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    let plan = UpdatePlan::new(segments);
    fused_update_charged(params, grad, momentum_buf, &plan, rule, grad_scale, None)
}

/// [`fused_update`] with the segments' decay flags and the global step.
/// `state` holds `rule.state_per_param()` floats per parameter.
pub fn fused_update_planned(
    params: &mut [f32],
    grad: &[f32],
    state: &mut [f32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    fused_update_charged(params, grad, state, plan, rule, grad_scale, None)
}

/// [`fused_update_planned`], returning the CPU time of its parallel work: each
/// work item is timed with the clock of the thread that runs it (a rayon pool
/// thread), and the times are summed. A caller outside the pool only waits
/// for that work, so its own thread CPU time leaves it out.
pub fn fused_update_timed(
    params: &mut [f32],
    grad: &[f32],
    state: &mut [f32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<Duration, UpdateError> {
    let spent = AtomicU64::new(0);
    fused_update_charged(params, grad, state, plan, rule, grad_scale, Some(&spent))?;
    Ok(Duration::from_nanos(spent.into_inner()))
}

/// One Adam entry on the server: updates `p`, `m` and `v` from the scaled
/// gradient `g` with the constants `k` of the update.
#[inline(always)]
fn adam_entry(k: &AdamStep, p: &mut f32, m: &mut f32, v: &mut f32, g: f32, lr: f32, wd: f32) {
    let g = if k.decoupled {
        *p *= 1.0 - lr * wd;
        g
    } else {
        g + wd * *p
    };
    let denom = k.moments(m, v, g);
    *p -= lr * k.inv_bc1 * *m / denom;
}

/// Squared L2 norm in eight f32 lanes per block of 1024, the blocks added in f64.
fn squared_norm(values: &[f32]) -> f64 {
    const LANES: usize = 8;
    const BLOCK: usize = 1024;
    let mut total = 0.0f64;
    for block in values.chunks(BLOCK) {
        let mut lanes = [0.0f32; LANES];
        let groups = block.chunks_exact(LANES);
        let rest = groups.remainder();
        for group in groups {
            for (lane, &x) in lanes.iter_mut().zip(group) {
                *lane += x * x;
            }
        }
        for &x in rest {
            lanes[0] += x * x;
        }
        total += lanes.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    total
}

/// The squared L2 norm of `grad_scale * grad`, as the one-pass clipping of
/// [`fused_update`] takes it (pieces of the same size, added in order, in
/// f64): a shard's share of the global norm when the norm is summed across
/// shards.
pub fn scaled_sum_sq(grad: &[f32], grad_scale: f32) -> f64 {
    let partial: Vec<f64> = grad.par_chunks(UPDATE_CHUNK).map(squared_norm).collect();
    partial.iter().sum::<f64>() * f64::from(grad_scale) * f64::from(grad_scale)
}

/// The clipping factor `min(1, clip / (norm + 1e-6))` of a gradient whose
/// squared norm is `squared` (1 when clipping is off).
pub fn clip_factor(clip: f32, squared: f64) -> f64 {
    if clip <= 0.0 {
        return 1.0;
    }
    (f64::from(clip) / (squared.sqrt() + 1e-6)).min(1.0)
}

fn fused_update_charged(
    params: &mut [f32],
    grad: &[f32],
    state: &mut [f32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
    grad_scale: f32,
    spent: Option<&AtomicU64>,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, state, plan, rule)?;
    let whole = 0..params.len();
    let by_segment = plan.needs_segments(rule);
    let segments: &[Range<usize>] = if by_segment {
        plan.segments
    } else {
        std::slice::from_ref(&whole)
    };
    let decay_of = |segment: usize| {
        if by_segment && !plan.decays(segment) {
            0.0
        } else {
            rule.weight_decay
        }
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

    // Global-norm clipping of the mean gradient: one reduction pass, its
    // pieces added in order.
    let grad_scale = if rule.clip_grad_norm > 0.0 {
        let partial: Vec<f64> = grad
            .par_chunks(UPDATE_CHUNK)
            .map(|chunk| charged(spent, || squared_norm(chunk)))
            .collect();
        let squared = partial.iter().sum::<f64>() * f64::from(grad_scale) * f64::from(grad_scale);
        (f64::from(grad_scale) * clip_factor(rule.clip_grad_norm, squared)) as f32
    } else {
        grad_scale
    };

    let lr = rule.lr_at(plan.step);
    let segment_lrs: Vec<f32> = match rule.lars() {
        None => vec![lr; segments.len()],
        Some(eta) => {
            let params_view: &[f32] = params;
            let partial: Vec<(usize, f64, f64)> = pieces
                .par_iter()
                .map(|(segment, range)| {
                    let (param_sq, grad_sq) = charged(spent, || {
                        piece_norms(
                            &params_view[range.clone()],
                            &grad[range.clone()],
                            decay_of(*segment),
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
                .map(|&(param_sq, grad_sq)| lr * trust_ratio(eta, param_sq, grad_sq))
                .collect()
        }
    };

    // Cut the mutable arrays into the disjoint pieces, then update them in parallel.
    let adam = rule
        .kind
        .is_adam()
        .then(|| AdamStep::new(rule, plan.step.saturating_add(1)));
    let n = params.len();
    let (mut first_rest, mut second_rest): (&mut [f32], &mut [f32]) = match rule.state_per_param() {
        0 => (&mut [], &mut []),
        1 => (state, &mut []),
        _ => state.split_at_mut(n),
    };
    let mut work = Vec::with_capacity(pieces.len());
    let mut params_rest: &mut [f32] = params;
    let mut grad_rest = grad;
    for (segment, range) in &pieces {
        let len = range.len();
        let (params_piece, params_tail) = std::mem::take(&mut params_rest).split_at_mut(len);
        params_rest = params_tail;
        let first_len = len.min(first_rest.len());
        let (first_piece, first_tail) = std::mem::take(&mut first_rest).split_at_mut(first_len);
        first_rest = first_tail;
        let second_len = len.min(second_rest.len());
        let (second_piece, second_tail) = std::mem::take(&mut second_rest).split_at_mut(second_len);
        second_rest = second_tail;
        let (grad_piece, grad_tail) = grad_rest.split_at(len);
        grad_rest = grad_tail;
        work.push((
            params_piece,
            grad_piece,
            first_piece,
            second_piece,
            segment_lrs[*segment],
            decay_of(*segment),
        ));
    }
    work.into_par_iter()
        .for_each(|(params, grad, first, second, lr, wd)| {
            charged(spent, || match &adam {
                Some(adam) => {
                    let entries = params.iter_mut().zip(grad).zip(first).zip(second);
                    for (((p, &g), m), v) in entries {
                        adam_entry(adam, p, m, v, grad_scale * g, lr, wd);
                    }
                }
                None => update_piece(params, grad, first, lr, wd, rule, grad_scale),
            })
        });
    Ok(())
}

/// A sparse update: only the entries `indices` (ascending, each below
/// `params.len()`) move, from `grad[i] * grad_scale`. Plain SGD (the only
/// SGD rule a sparse update is used for, see `moves_untouched`), or the lazy
/// Adam/AdamW rule: the moments and parameters of those entries are updated
/// with the bias correction of the global step `plan.step + 1`, the others
/// keep theirs (torch's `SparseAdam`; decay, coupled or decoupled, applies
/// only to the pushed entries too).
pub fn lazy_update(
    params: &mut [f32],
    grad: &[f32],
    state: &mut [f32],
    indices: &[u32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, state, plan, rule)?;
    let lr = rule.lr_at(plan.step);
    let n = params.len();
    if !rule.kind.is_adam() {
        for &i in indices {
            let i = i as usize;
            params[i] -= lr * grad_scale * grad[i];
        }
        return Ok(());
    }
    let adam = AdamStep::new(rule, plan.step.saturating_add(1));
    let (first, second) = state.split_at_mut(n);
    let mut segment = 0usize;
    for &i in indices {
        let i = i as usize;
        let wd = if plan.decay.is_empty() || rule.weight_decay == 0.0 {
            rule.weight_decay
        } else {
            while segment + 1 < plan.segments.len() && plan.segments[segment].end <= i {
                segment += 1;
            }
            if plan.decays(segment) {
                rule.weight_decay
            } else {
                0.0
            }
        };
        adam_entry(
            &adam,
            &mut params[i],
            &mut first[i],
            &mut second[i],
            grad_scale * grad[i],
            lr,
            wd,
        );
    }
    Ok(())
}

/// Squared norms of `p` and of `g' = grad_scale * g + weight_decay * p`.
///
/// Blocks of 1024 entries are summed in eight f32 lanes (one loop per norm, so
/// that each vectorises) and the lane sums are added up in f64.
fn piece_norms(params: &[f32], grad: &[f32], weight_decay: f32, grad_scale: f32) -> (f64, f64) {
    const LANES: usize = 8;
    const BLOCK: usize = 1024;
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
    weight_decay: f32,
    rule: &OptimizerSection,
    grad_scale: f32,
) {
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
    reference_update_planned(
        params,
        grad,
        momentum_buf,
        &UpdatePlan::new(segments),
        rule,
        grad_scale,
    )
}

/// Same result as [`fused_update_planned`] from separate, sequential passes
/// with full-size temporaries and the formulas written out plainly.
pub fn reference_update_planned(
    params: &mut [f32],
    grad: &[f32],
    state: &mut [f32],
    plan: &UpdatePlan<'_>,
    rule: &OptimizerSection,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    check_inputs(params, grad, state, plan, rule)?;
    let n = params.len();
    // Per-element weight decay from the segments' flags.
    let mut wds = vec![rule.weight_decay; n];
    if plan.needs_segments(rule) {
        for (segment, range) in plan.segments.iter().enumerate() {
            if !plan.decays(segment) {
                wds[range.clone()].fill(0.0);
            }
        }
    }
    // Clipping: the mean gradient's norm, sequentially in f64.
    let mut grad_scale = f64::from(grad_scale);
    if rule.clip_grad_norm > 0.0 {
        let squared: f64 = grad
            .iter()
            .map(|&g| (grad_scale * f64::from(g)).powi(2))
            .sum();
        grad_scale *= clip_factor(rule.clip_grad_norm, squared);
    }
    let grad_scale = grad_scale as f32;
    let base_lr = rule.schedule.lr_at(rule.lr, plan.step);

    if rule.kind.is_adam() {
        let t = (plan.step + 1) as i32;
        let bc1 = 1.0 - f64::from(rule.beta1).powi(t);
        let bc2 = 1.0 - f64::from(rule.beta2).powi(t);
        let decoupled = rule.kind == OptimizerKind::Adamw;
        if decoupled {
            for (p, &wd) in params.iter_mut().zip(&wds) {
                *p *= 1.0 - base_lr * wd;
            }
        }
        let g: Vec<f32> = (0..n)
            .map(|i| {
                let l2 = if decoupled { 0.0 } else { wds[i] * params[i] };
                grad_scale * grad[i] + l2
            })
            .collect();
        let (m, v) = state.split_at_mut(n);
        for i in 0..n {
            m[i] = rule.beta1 * m[i] + (1.0 - rule.beta1) * g[i];
            v[i] = rule.beta2 * v[i] + (1.0 - rule.beta2) * g[i] * g[i];
        }
        for i in 0..n {
            let m_hat = f64::from(m[i]) / bc1;
            let v_hat = f64::from(v[i]) / bc2;
            params[i] -= (f64::from(base_lr) * m_hat / (v_hat.sqrt() + f64::from(rule.eps))) as f32;
        }
        return Ok(());
    }

    let shaped: Vec<f32> = grad
        .iter()
        .zip(params.iter())
        .zip(&wds)
        .map(|((&g, &p), &wd)| grad_scale * g + wd * p)
        .collect();

    let mut lrs = vec![base_lr; n];
    if let Some(eta) = rule.lars() {
        for range in plan.segments {
            let param_sq: f64 = params[range.clone()]
                .iter()
                .map(|&p| f64::from(p * p))
                .sum();
            let grad_sq: f64 = shaped[range.clone()]
                .iter()
                .map(|&g| f64::from(g * g))
                .sum();
            let lr = base_lr * trust_ratio(eta, param_sq, grad_sq);
            lrs[range.clone()].fill(lr);
        }
    }

    let step: Vec<f32> = if rule.uses_momentum() {
        for (m, &g) in state.iter_mut().zip(&shaped) {
            *m = rule.momentum * *m + g;
        }
        if rule.nesterov {
            shaped
                .iter()
                .zip(state.iter())
                .map(|(&g, &m)| g + rule.momentum * m)
                .collect()
        } else {
            state.to_vec()
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
            ..OptimizerSection::default()
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
            let cpu = fused_update_timed(
                &mut p_timed,
                &grad,
                &mut m_timed,
                &UpdatePlan::new(&segments),
                &r,
                0.5,
            )
            .unwrap();
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
                momentum: 0,
                per_param: 1
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
        let checked = check_update(&params, &grad, &momentum, &UpdatePlan::new(&bad), &lars);
        let applied = fused_update_timed(
            &mut params,
            &grad,
            &mut momentum,
            &UpdatePlan::new(&bad),
            &lars,
            1.0,
        );
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

    fn adam(kind: OptimizerKind, weight_decay: f32) -> OptimizerSection {
        OptimizerSection {
            lr: 0.01,
            kind,
            weight_decay,
            ..OptimizerSection::default()
        }
    }

    #[test]
    fn adam_step_one_is_bias_corrected_to_lr_times_sign() {
        // At step 1 from zero moments: m_hat = g, v_hat = g^2, so the step is
        // lr * g / (|g| + eps) whatever beta1 and beta2 are.
        for kind in [OptimizerKind::Adam, OptimizerKind::Adamw] {
            let r = OptimizerSection {
                beta1: 0.8,
                beta2: 0.95,
                ..adam(kind, 0.0)
            };
            let mut params = vec![1.0f32, -2.0, 0.5];
            let mut state = vec![0.0f32; 6];
            let plan = UpdatePlan::new(&[]);
            fused_update_planned(&mut params, &[3.0, -0.25, 0.0], &mut state, &plan, &r, 1.0)
                .unwrap();
            assert!((params[0] - 0.99).abs() < 1e-6, "{params:?}");
            assert!((params[1] + 1.99).abs() < 1e-6, "{params:?}");
            assert_eq!(params[2], 0.5);
            assert!((state[0] - 0.2 * 3.0).abs() < 1e-6);
            assert!((state[3] - 0.05 * 9.0).abs() < 1e-5);
        }
    }

    #[test]
    fn adamw_decay_is_decoupled_and_adam_decay_is_l2() {
        let plan = UpdatePlan::new(&[]);
        // Zero gradient: AdamW only shrinks p by lr * wd; Adam sees g = wd * p
        // and steps by lr at step 1.
        let mut p = vec![2.0f32];
        let mut state = vec![0.0f32; 2];
        fused_update_planned(
            &mut p,
            &[0.0],
            &mut state,
            &plan,
            &adam(OptimizerKind::Adamw, 0.5),
            1.0,
        )
        .unwrap();
        assert!((p[0] - 2.0 * (1.0 - 0.01 * 0.5)).abs() < 1e-6, "{p:?}");
        assert_eq!(state, vec![0.0, 0.0]);
        let mut p = vec![2.0f32];
        let mut state = vec![0.0f32; 2];
        fused_update_planned(
            &mut p,
            &[0.0],
            &mut state,
            &plan,
            &adam(OptimizerKind::Adam, 0.5),
            1.0,
        )
        .unwrap();
        assert!((p[0] - (2.0 - 0.01)).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn no_decay_segments_are_not_decayed() {
        let segments = [0..2, 2..3];
        let plan = UpdatePlan {
            segments: &segments,
            decay: &[true, false],
            step: 0,
        };
        for r in [adam(OptimizerKind::Adamw, 0.5), rule(0.0, false, 0.5, None)] {
            let mut p = vec![2.0f32; 3];
            let mut state = vec![0.0f32; r.state_per_param() * 3];
            fused_update_planned(&mut p, &[0.0; 3], &mut state, &plan, &r, 1.0).unwrap();
            assert!(p[0] < 2.0 && p[1] < 2.0, "{p:?}");
            assert_eq!(p[2], 2.0, "{p:?}");
        }
        let bad = UpdatePlan {
            decay: &[true],
            ..plan
        };
        let mut p = vec![2.0f32; 3];
        assert_eq!(
            fused_update_planned(
                &mut p,
                &[0.0; 3],
                &mut [0.0; 6],
                &bad,
                &adam(OptimizerKind::Adamw, 0.5),
                1.0
            ),
            Err(UpdateError::DecayFlags {
                decay: 1,
                segments: 2
            })
        );
    }

    #[test]
    fn lazy_adam_moves_only_pushed_entries_like_the_dense_rule_there() {
        let n = 10;
        let segments = [0..4, 4..10];
        let plan = UpdatePlan {
            segments: &segments,
            decay: &[false, true],
            step: 6,
        };
        let r = adam(OptimizerKind::Adamw, 0.1);
        let params: Vec<f32> = (0..n).map(|i| i as f32 * 0.3 - 1.0).collect();
        let state: Vec<f32> = (0..2 * n).map(|i| (i % 5) as f32 * 0.01).collect();
        let grad: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { i as f32 - 4.0 } else { 0.0 })
            .collect();
        let indices = [0u32, 3, 6, 9];
        let (mut p_lazy, mut s_lazy) = (params.clone(), state.clone());
        lazy_update(&mut p_lazy, &grad, &mut s_lazy, &indices, &plan, &r, 0.5).unwrap();
        let (mut p_dense, mut s_dense) = (params.clone(), state.clone());
        reference_update_planned(&mut p_dense, &grad, &mut s_dense, &plan, &r, 0.5).unwrap();
        for i in 0..n {
            if indices.contains(&(i as u32)) {
                assert!((p_lazy[i] - p_dense[i]).abs() < 1e-6, "entry {i}");
                assert!((s_lazy[i] - s_dense[i]).abs() < 1e-6);
                assert!((s_lazy[n + i] - s_dense[n + i]).abs() < 1e-6);
            } else {
                // Not pushed: parameter and both moments untouched (the dense
                // rule would have decayed the moments and moved p).
                assert_eq!(p_lazy[i], params[i], "entry {i}");
                assert_eq!((s_lazy[i], s_lazy[n + i]), (state[i], state[n + i]));
            }
        }
        assert_ne!(p_dense[1], params[1], "the dense rule moves entry 1");
    }

    #[test]
    fn clipping_scales_the_mean_gradient_to_the_threshold() {
        let plan = UpdatePlan::new(&[]);
        let sgd = |clip: f32| OptimizerSection {
            lr: 1.0,
            clip_grad_norm: clip,
            ..OptimizerSection::default()
        };
        // Mean gradient (3, 4) * 0.5 has norm 2.5: clipped to 1 it is (0.6, 0.8)/1.
        let mut p = vec![0.0f32; 2];
        fused_update_planned(&mut p, &[3.0, 4.0], &mut [], &plan, &sgd(1.0), 0.5).unwrap();
        assert!(
            (p[0] + 0.6).abs() < 1e-5 && (p[1] + 0.8).abs() < 1e-5,
            "{p:?}"
        );
        // Below the threshold: unchanged.
        let mut p = vec![0.0f32; 2];
        fused_update_planned(&mut p, &[3.0, 4.0], &mut [], &plan, &sgd(10.0), 0.5).unwrap();
        assert!(
            (p[0] + 1.5).abs() < 1e-6 && (p[1] + 2.0).abs() < 1e-6,
            "{p:?}"
        );
        // Zero gradient: no NaN, nothing moves.
        let mut p = vec![1.0f32; 2];
        fused_update_planned(&mut p, &[0.0, 0.0], &mut [], &plan, &sgd(1.0), 0.5).unwrap();
        assert_eq!(p, vec![1.0, 1.0]);
        // Across chunks the norm is the whole shard's.
        let n = 2 * UPDATE_CHUNK + 3;
        let grad = vec![1.0f32; n];
        let mut p = vec![0.0f32; n];
        fused_update_planned(&mut p, &grad, &mut [], &plan, &sgd(1.0), 1.0).unwrap();
        let norm: f64 = p.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }

    #[test]
    fn the_schedule_picks_the_rate_of_the_step() {
        use ps_shared::config::{ScheduleKind, ScheduleSection};
        let r = OptimizerSection {
            lr: 1.0,
            schedule: ScheduleSection {
                kind: ScheduleKind::Step,
                step_size: 2,
                gamma: 0.5,
                ..ScheduleSection::default()
            },
            ..OptimizerSection::default()
        };
        let segments = [0..1];
        for (step, expected) in [(0u64, -1.0f32), (1, -1.0), (2, -0.5), (5, -0.25)] {
            let mut p = vec![0.0f32];
            let plan = UpdatePlan {
                step,
                ..UpdatePlan::new(&segments)
            };
            fused_update_planned(&mut p, &[1.0], &mut [], &plan, &r, 1.0).unwrap();
            assert_eq!(p[0], expected, "step {step}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn fused_adam_equals_reference(
            data in prop::collection::vec((-2.0f32..2.0, -2.0f32..2.0, -0.5f32..0.5, 0.0f32..1.0), 0..200),
            cuts in prop::collection::vec(0usize..200, 0..6),
            decoupled in any::<bool>(),
            weight_decay in prop_oneof![Just(0.0f32), 0.0f32..0.1],
            flags in prop::collection::vec(any::<bool>(), 7),
            step in 0u64..50,
            clip in prop_oneof![Just(0.0f32), 0.1f32..5.0],
            grad_scale in 0.01f32..2.0,
        ) {
            let n = data.len();
            let params: Vec<f32> = data.iter().map(|d| d.0).collect();
            let grad: Vec<f32> = data.iter().map(|d| d.1).collect();
            let state: Vec<f32> = data.iter().map(|d| d.2).chain(data.iter().map(|d| d.3)).collect();
            let segments = segments_from_cuts(n, cuts);
            let decay = &flags[..segments.len()];
            let kind = if decoupled { OptimizerKind::Adamw } else { OptimizerKind::Adam };
            let r = OptimizerSection { clip_grad_norm: clip, ..adam(kind, weight_decay) };
            let plan = UpdatePlan { segments: &segments, decay, step };
            let (mut p_fused, mut s_fused) = (params.clone(), state.clone());
            let (mut p_ref, mut s_ref) = (params.clone(), state.clone());
            fused_update_planned(&mut p_fused, &grad, &mut s_fused, &plan, &r, grad_scale).unwrap();
            reference_update_planned(&mut p_ref, &grad, &mut s_ref, &plan, &r, grad_scale).unwrap();
            prop_assert!(close(&p_fused, &p_ref), "params {:?} vs {:?}", p_fused, p_ref);
            prop_assert!(close(&s_fused, &s_ref));
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

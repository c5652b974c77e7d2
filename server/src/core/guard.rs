//! The push guard: every push is checked whole (length, order, finiteness,
//! norm bounds and the anomaly median) before it touches state.

use std::collections::VecDeque;
use std::sync::Arc;

use ps_net::protocol::{ErrorCode, Response, WireGrad, WireValues};
use ps_shared::config::GradNormPolicy;
use rayon::prelude::*;

use super::{refusal, ShardCore};

/// Pushes whose norms the anomaly check's median is taken over.
pub const NORM_WINDOW: usize = 64;

/// Values per parallel piece of a push's norm.
pub(super) const NORM_CHUNK: usize = 1 << 16;

/// The L2 norm of a push's values (f64 sums, so squares of large finite
/// values do not overflow). Large pushes are summed in parallel pieces whose
/// sums are added in order, so the result does not depend on the pool.
pub fn push_norm(values: &WireValues) -> f64 {
    /// Eight independent sums, so the loop vectorises (one sum in order
    /// would wait on each addition); the same order every time.
    fn piece(v: &[f32]) -> f64 {
        let mut lanes = [0.0f64; 8];
        let chunks = v.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (lane, x) in lanes.iter_mut().zip(c) {
                let x = f64::from(*x);
                *lane += x * x;
            }
        }
        let mut total: f64 = lanes.iter().sum();
        for x in rest {
            total += f64::from(*x) * f64::from(*x);
        }
        total
    }
    fn squares(v: &[f32]) -> f64 {
        if v.len() <= NORM_CHUNK {
            return piece(v);
        }
        let pieces: Vec<f64> = v.par_chunks(NORM_CHUNK).map(piece).collect();
        pieces.iter().sum()
    }
    match values {
        WireValues::F32(v) => squares(v).sqrt(),
        WireValues::F16(v) => squares(&ps_shared::sparse::values_from_f16(v)).sqrt(),
    }
}

/// The norms of the last [`NORM_WINDOW`] pushes a shard took unscaled, for
/// the anomaly check's median.
#[derive(Debug, Clone, Default)]
pub struct NormWindow {
    norms: VecDeque<f64>,
    taken: u64,
}

impl NormWindow {
    pub fn push(&mut self, norm: f64) {
        if self.norms.len() == NORM_WINDOW {
            self.norms.pop_front();
        }
        self.norms.push_back(norm);
        self.taken += 1;
    }

    /// The lower median of the window once `warmup` norms were taken;
    /// `None` before, or when it is 0 (no scale to compare with).
    pub fn median(&self, warmup: u64) -> Option<f64> {
        if self.taken < warmup || self.norms.is_empty() {
            return None;
        }
        let mut norms = [0.0f64; NORM_WINDOW];
        let norms = &mut norms[..self.norms.len()];
        for (slot, n) in norms.iter_mut().zip(&self.norms) {
            *slot = *n;
        }
        let mid = (norms.len() - 1) / 2;
        let (_, median, _) = norms.select_nth_unstable_by(mid, f64::total_cmp);
        (*median > 0.0).then_some(*median)
    }
}

/// The largest sum of push norms one update may hold: far from `f32::MAX`,
/// so the aggregated gradient and the update from it stay finite.
const AGG_LIMIT: f64 = f32::MAX as f64 / 16.0;

/// Which bound a push crossed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormBound {
    MaxGradNorm,
    Ceiling,
    Anomaly,
}

impl ShardCore {
    /// Check a push completely before it touches any state; a clipped
    /// gradient comes back scaled.
    pub(super) fn check_push(&mut self, grad: WireGrad) -> Result<WireGrad, Arc<Response>> {
        let finite = |v: &WireValues| match v {
            WireValues::F32(v) => v.iter().all(|x| x.is_finite()),
            WireValues::F16(v) => v.iter().all(|b| (b & 0x7c00) != 0x7c00),
        };
        let values = match &grad {
            WireGrad::Dense(values) => {
                if values.len() != self.len() {
                    return Err(refusal(
                        ErrorCode::WrongLength,
                        format!(
                            "dense push of {} values for a shard of {}",
                            values.len(),
                            self.len()
                        ),
                    ));
                }
                values
            }
            WireGrad::Sparse { indices, values } => {
                if indices.len() != values.len() {
                    return Err(refusal(
                        ErrorCode::WrongLength,
                        format!("{} indices but {} values", indices.len(), values.len()),
                    ));
                }
                let mut prev: Option<u32> = None;
                for &i in indices {
                    if i as usize >= self.len() || prev.is_some_and(|p| p >= i) {
                        return Err(refusal(
                            ErrorCode::OutOfRange,
                            format!(
                                "index {i} is out of range or out of order (shard length {})",
                                self.len()
                            ),
                        ));
                    }
                    prev = Some(i);
                }
                values
            }
        };
        if !finite(values) {
            return Err(refusal(ErrorCode::NonFinite, "gradient has NaN or inf"));
        }
        let norm = push_norm(values);
        // The tightest bound the push crosses: (norm to scale to, which).
        let mut crossed: Option<(f64, NormBound)> = None;
        let mut cross = |limit: f64, scale_to: f64, which: NormBound| {
            if limit > 0.0 && norm > limit && crossed.is_none_or(|(t, _)| scale_to < t) {
                crossed = Some((scale_to, which));
            }
        };
        let bound = f64::from(self.settings.max_grad_norm);
        cross(bound, bound, NormBound::MaxGradNorm);
        let ceiling = f64::from(self.settings.grad_norm_ceiling);
        cross(ceiling, ceiling, NormBound::Ceiling);
        let median = self.recent_median();
        if let Some(median) = median {
            let factor = f64::from(self.settings.grad_anomaly_factor);
            cross(factor * median, median, NormBound::Anomaly);
        }
        let Some((scale_to, which)) = crossed else {
            self.take_norm(norm)?;
            self.recent_norms.push(norm);
            return Ok(grad);
        };
        let why = match which {
            NormBound::MaxGradNorm => format!("server.max_grad_norm = {bound}"),
            NormBound::Ceiling => format!("server.grad_norm_ceiling = {ceiling}"),
            NormBound::Anomaly => format!(
                "{} x the median norm {:.3e} of shard {}'s recent pushes (server.grad_anomaly_factor)",
                self.settings.grad_anomaly_factor,
                median.unwrap_or(0.0),
                self.id()
            ),
        };
        if which == NormBound::Anomaly {
            self.stats.anomalies += 1;
        }
        match self.settings.norm_policy {
            GradNormPolicy::Refuse => Err(refusal(
                ErrorCode::GradientTooLarge,
                format!("gradient norm {norm:.3e} exceeds {why}"),
            )),
            GradNormPolicy::Clip => {
                self.take_norm(scale_to)?;
                if which != NormBound::Anomaly {
                    self.stats.clipped += 1;
                }
                let scale = (scale_to / norm) as f32;
                let clip = |v: WireValues| {
                    WireValues::F32(v.into_f32().into_iter().map(|x| x * scale).collect())
                };
                Ok(match grad {
                    WireGrad::Dense(v) => WireGrad::Dense(clip(v)),
                    WireGrad::Sparse { indices, values } => WireGrad::Sparse {
                        indices,
                        values: clip(values),
                    },
                })
            }
        }
    }

    /// The lower median of the recent pushes' norms, once the warm-up is
    /// over and the check is on; `None` when it is 0 (no scale to compare
    /// with).
    fn recent_median(&self) -> Option<f64> {
        if self.settings.grad_anomaly_factor <= 0.0 {
            return None;
        }
        self.recent_norms
            .median(u64::from(self.settings.grad_anomaly_warmup))
    }

    /// Note the norm of a push about to be taken; refused when the sum of
    /// this update's pushes could leave the finite range.
    fn take_norm(&mut self, norm: f64) -> Result<(), Arc<Response>> {
        if self.agg_peak + norm > AGG_LIMIT {
            return Err(refusal(
                ErrorCode::GradientTooLarge,
                format!(
                    "gradient norm {norm:.3e}: the sum of this update's pushes to shard {} would \
                     overflow (set server.grad_norm_ceiling to bound pushes)",
                    self.id()
                ),
            ));
        }
        self.checked_norm = norm;
        Ok(())
    }
}

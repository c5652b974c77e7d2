//! Adam's per-step constants and moment update: one piece for the servers'
//! fused update and for the workers that keep their own moments
//! (`optimizer.moments = "worker"`), so both follow torch's arithmetic the
//! same way.

use crate::config::{OptimizerKind, OptimizerSection};

/// The constants of one Adam step.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `1 / (1 - beta1^t)`.
    pub inv_bc1: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// AdamW: weight decay is decoupled from the gradient.
    pub decoupled: bool,
}

impl AdamStep {
    /// The constants of step `t`, counted from 1 (the bias correction is
    /// `1 - beta^t`).
    pub fn new(rule: &OptimizerSection, t: u64) -> Self {
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - f64::from(rule.beta1).powi(t);
        let bc2 = 1.0 - f64::from(rule.beta2).powi(t);
        Self {
            beta1: rule.beta1,
            beta2: rule.beta2,
            eps: rule.eps,
            inv_bc1: (1.0 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            decoupled: rule.kind == OptimizerKind::Adamw,
        }
    }

    /// Moves the moments `m` and `v` by the gradient `g` and returns the
    /// step's denominator `sqrt(v_hat) + eps` (as `sqrt(v) / sqrt(1 -
    /// beta2^t) + eps`); the step is `inv_bc1 * m / denominator`.
    #[inline(always)]
    pub fn moments(&self, m: &mut f32, v: &mut f32, g: f32) -> f32 {
        *m = self.beta1 * *m + (1.0 - self.beta1) * g;
        *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
        v.sqrt() / self.bc2_sqrt + self.eps
    }
}

//! Adam's moments kept on the worker (`optimizer.moments = "worker"`).
//!
//! The worker turns each gradient into the step it would take with Adam or
//! AdamW of its own, and pushes that instead of the gradient:
//!
//! ```text
//! g' = g + wd p                       (Adam: L2 decay in the gradient)
//! m  = beta1 m + (1 - beta1) g'
//! v  = beta2 v + (1 - beta2) g'^2
//! d  = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! d += wd p                           (AdamW: decoupled decay)
//! push = (lr(step) / lr) d
//! ```
//!
//! `t` counts the directions this worker has made (from 1), `step` is the
//! global step the gradient is for, `wd` is 0 on tensors matching
//! `optimizer.no_decay`. The compressor then sparsifies the push with its
//! error feedback, and the servers add the mean of the workers' pushes at
//! the base rate `lr` (`OptimizerSection::server_rule`), so one worker with
//! dense pushes takes exactly torch's AdamW step:
//! `p -= lr(step) (d_adam + wd p)`.
//!
//! The moments live only in this process: a restarted worker starts them
//! (and `t`) from zero.

use std::ops::Range;

use rayon::prelude::*;

use ps_shared::adam::AdamStep;
use ps_shared::config::OptimizerSection;

use crate::model::ModelError;

/// Entries per parallel task.
const CHUNK: usize = 1 << 14;

/// One worker's Adam/AdamW moments over the whole model.
#[derive(Debug, Clone)]
pub struct WorkerMoments {
    rule: OptimizerSection,
    m: Vec<f32>,
    v: Vec<f32>,
    /// The flat ranges of the model's tensors with their weight decay
    /// (0 for the `no_decay` group), in order, covering the model.
    segments: Vec<(Range<usize>, f32)>,
    /// Directions made so far.
    t: u64,
}

impl WorkerMoments {
    /// Zero moments for the tensors `(name, flat range)` that make up the
    /// model in order, under the Adam or AdamW `rule`.
    pub fn new<'a>(
        rule: &OptimizerSection,
        tensors: impl IntoIterator<Item = (&'a str, Range<usize>)>,
    ) -> Self {
        let segments: Vec<(Range<usize>, f32)> = tensors
            .into_iter()
            .map(|(name, range)| {
                let wd = if rule.decays(name) {
                    rule.weight_decay
                } else {
                    0.0
                };
                (range, wd)
            })
            .collect();
        let n = segments.iter().map(|(r, _)| r.end).max().unwrap_or(0);
        Self {
            rule: rule.clone(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            segments,
            t: 0,
        }
    }

    /// Parameters covered.
    pub fn len(&self) -> usize {
        self.m.len()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// Directions made so far (the next one is bias-corrected with `t + 1`).
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// The first and second moments.
    pub fn moments(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Replaces the gradient `grad` of global step `step` with the
    /// scheduled Adam direction at the parameters `params` (module docs),
    /// updating the moments. Both slices must have the model's length.
    pub fn direction(
        &mut self,
        grad: &mut [f32],
        params: &[f32],
        step: u64,
    ) -> Result<(), ModelError> {
        for got in [grad.len(), params.len()] {
            if got != self.m.len() {
                return Err(ModelError::Length {
                    expected: self.m.len(),
                    got,
                });
            }
        }
        let k = self.begin(step);
        self.apply(&k, 0..grad.len(), grad, params);
        Ok(())
    }

    /// Starts the direction of global step `step` made range by range as
    /// the backward pass finishes each ([`Self::direction_in`]): one call
    /// per step, then every range once.
    pub fn begin(&mut self, step: u64) -> Direction {
        self.t += 1;
        Direction {
            adam: AdamStep::new(&self.rule, self.t),
            factor: self.rule.schedule_factor(step),
        }
    }

    /// [`Self::direction`] of the flat `range` alone: `grad` and `params`
    /// are that range's entries. Over ranges that cover the model it makes
    /// the same direction, bit for bit.
    pub fn direction_in(
        &mut self,
        k: &Direction,
        range: Range<usize>,
        grad: &mut [f32],
        params: &[f32],
    ) -> Result<(), ModelError> {
        if range.end > self.m.len() || range.start > range.end {
            return Err(ModelError::Length {
                expected: self.m.len(),
                got: range.end,
            });
        }
        for got in [grad.len(), params.len()] {
            if got != range.len() {
                return Err(ModelError::Length {
                    expected: range.len(),
                    got,
                });
            }
        }
        self.apply(k, range, grad, params);
        Ok(())
    }

    /// The direction over `range` (`grad` and `params` hold its entries),
    /// segment by segment.
    fn apply(&mut self, k: &Direction, range: Range<usize>, grad: &mut [f32], params: &[f32]) {
        for (segment, wd) in &self.segments {
            let (lo, hi) = (segment.start.max(range.start), segment.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let wd = *wd;
            let local = lo - range.start..hi - range.start;
            grad[local.clone()]
                .par_chunks_mut(CHUNK)
                .zip(params[local].par_chunks(CHUNK))
                .zip(self.m[lo..hi].par_chunks_mut(CHUNK))
                .zip(self.v[lo..hi].par_chunks_mut(CHUNK))
                .for_each(|(((g, p), m), v)| {
                    for (((g, &p), m), v) in g.iter_mut().zip(p).zip(m).zip(v) {
                        *g = k.entry(*g, p, m, v, wd);
                    }
                });
        }
    }
}

/// The constants of one direction: Adam's step and the schedule factor.
#[derive(Debug, Clone, Copy)]
pub struct Direction {
    adam: AdamStep,
    /// `lr(step) / lr`.
    factor: f32,
}

impl Direction {
    /// One entry: the moments from the gradient `g` at the parameter `p`,
    /// and the scheduled direction.
    #[inline(always)]
    fn entry(&self, g: f32, p: f32, m: &mut f32, v: &mut f32, wd: f32) -> f32 {
        let k = &self.adam;
        let g = if k.decoupled { g } else { g + wd * p };
        let denom = k.moments(m, v, g);
        let mut d = k.inv_bc1 * *m / denom;
        if k.decoupled {
            d += wd * p;
        }
        self.factor * d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::config::OptimizerKind;
    use ps_shared::config::{ScheduleKind, ScheduleSection};
    use serde_json::Value;

    const FIXTURE: &str = include_str!("../../tests/fixtures/adamw-warmup-cosine.json");

    fn f32s(v: &Value) -> Vec<f32> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|x| x.as_f64().expect("a number") as f32)
            .collect()
    }

    fn adam(kind: OptimizerKind, weight_decay: f32) -> OptimizerSection {
        OptimizerSection {
            lr: 0.1,
            kind,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay,
            no_decay: vec!["bias".into()],
            ..OptimizerSection::default()
        }
    }

    /// Two tensors: `w` (decayed) of 2 entries, `bias` (not) of 1.
    fn two_tensors(rule: &OptimizerSection) -> WorkerMoments {
        WorkerMoments::new(rule, [("w", 0..2), ("bias", 2..3)])
    }

    #[test]
    fn directions_by_hand() {
        // AdamW, constant rate: step 1 is sign(g) + wd p where decayed.
        let rule = adam(OptimizerKind::Adamw, 0.5);
        let mut w = two_tensors(&rule);
        let params = [2.0, -1.0, 4.0];
        let mut g = [0.3, -0.02, 5.0];
        w.direction(&mut g, &params, 0).unwrap();
        let expected = [1.0 + 0.5 * 2.0, -1.0 - 0.5, 1.0];
        for (a, b) in g.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{g:?} vs {expected:?}");
        }
        // Step 2 by hand for entry 0: g = 0.1 after 0.3.
        let mut g2 = [0.1, 0.0, 0.0];
        w.direction(&mut g2, &params, 1).unwrap();
        let m = 0.9 * (0.1 * 0.3) + 0.1 * 0.1;
        let v = 0.99 * (0.01 * 0.09) + 0.01 * 0.01;
        let (bc1, bc2) = (1.0 - 0.9f64 * 0.9, 1.0 - 0.99f64 * 0.99);
        let d = (m / bc1) / ((v / bc2).sqrt() + 1e-8) + 0.5 * 2.0;
        assert!((f64::from(g2[0]) - d).abs() < 1e-5, "{} vs {d}", g2[0]);
        assert_eq!(w.steps(), 2);

        // Adam: the decay goes into the gradient (and the moments), so
        // step 1 is sign(g + wd p) where decayed.
        let rule = adam(OptimizerKind::Adam, 0.5);
        let mut w = two_tensors(&rule);
        let mut g = [0.3, 0.2, -5.0];
        w.direction(&mut g, &params, 0).unwrap();
        for (a, b) in g.iter().zip([1.0, -1.0, -1.0]) {
            assert!((a - b).abs() < 1e-6, "{g:?}");
        }
        assert!((w.moments().0[1] - 0.1 * (0.2 - 0.5)).abs() < 1e-7);

        // The schedule scales the direction by lr(step) / lr: half-way
        // through a warm-up of 4 steps from 0.
        let rule = OptimizerSection {
            schedule: ScheduleSection {
                warmup_steps: 4,
                ..ScheduleSection::default()
            },
            ..adam(OptimizerKind::Adamw, 0.0)
        };
        let mut w = two_tensors(&rule);
        let mut g = [1.0, -1.0, 2.0];
        w.direction(&mut g, &params, 2).unwrap();
        assert_eq!(g.map(|x| (x * 1e4).round() / 1e4), [0.5, -0.5, 0.5]);

        // Lengths are checked, nothing is moved on a mismatch.
        let mut short = [1.0];
        assert!(w.direction(&mut short, &params, 3).is_err());
        assert_eq!(w.steps(), 1);
    }

    /// The fixture's 6 steps of torch's AdamW (warm-up + cosine, clipping,
    /// a no-decay group): clipping the gradient as torch did, taking the
    /// worker's direction and adding it at the base rate (what the servers
    /// do with one worker's dense pushes) gives torch's parameters.
    #[test]
    fn worker_adamw_steps_equal_torch() {
        let fixture: Value = serde_json::from_str(FIXTURE).expect("fixture parses");
        let c = &fixture["config"];
        let num = |key: &str| c[key].as_f64().unwrap_or_else(|| panic!("config.{key}"));
        let rule = OptimizerSection {
            lr: num("lr") as f32,
            kind: OptimizerKind::Adamw,
            beta1: num("beta1") as f32,
            beta2: num("beta2") as f32,
            eps: num("eps") as f32,
            weight_decay: num("weight_decay") as f32,
            no_decay: vec!["bias".into()],
            schedule: ScheduleSection {
                kind: ScheduleKind::Cosine,
                warmup_steps: num("warmup_steps") as u64,
                warmup_start: num("warmup_start") as f32,
                total_steps: num("total_steps") as u64,
                min_lr: num("min_lr") as f32,
                ..ScheduleSection::default()
            },
            ..OptimizerSection::default()
        };
        let clip = num("clip_grad_norm");
        let mut tensors = Vec::new();
        for t in fixture["tensors"].as_array().unwrap() {
            let start = tensors
                .last()
                .map_or(0, |(_, r): &(String, Range<usize>)| r.end);
            let n = t["numel"].as_u64().unwrap() as usize;
            tensors.push((t["name"].as_str().unwrap().to_string(), start..start + n));
        }
        let mut w = WorkerMoments::new(&rule, tensors.iter().map(|(n, r)| (n.as_str(), r.clone())));
        let mut params = f32s(&fixture["initial"]);
        assert_eq!(w.len(), params.len());
        let steps = fixture["steps"].as_array().unwrap();
        assert!(steps.len() >= 5);
        let mut worst = 0.0f64;
        for (k, s) in steps.iter().enumerate() {
            let mut grad = f32s(&s["grad"]);
            let norm = grad
                .iter()
                .map(|&g| f64::from(g).powi(2))
                .sum::<f64>()
                .sqrt();
            let scale = (clip / (norm + 1e-6)).min(1.0) as f32;
            grad.iter_mut().for_each(|g| *g *= scale);
            w.direction(&mut grad, &params, k as u64).unwrap();
            for (p, d) in params.iter_mut().zip(&grad) {
                *p -= rule.lr * d;
            }
            let expected = f32s(&s["params"]);
            for (i, (&ours, &theirs)) in params.iter().zip(&expected).enumerate() {
                let rel = f64::from((ours - theirs).abs()) / f64::from(theirs.abs()).max(1e-3);
                worst = worst.max(rel);
                assert!(
                    rel <= 1e-5,
                    "step {k}, entry {i}: {ours} vs torch {theirs} (relative {rel:e})"
                );
            }
        }
        println!("largest relative difference to torch: {worst:e}");
    }

    /// Many entries (several parallel chunks, tensor boundaries inside a
    /// chunk's reach) equal the entry-by-entry rule.
    #[test]
    fn chunks_equal_the_serial_rule() {
        let rule = adam(OptimizerKind::Adamw, 0.1);
        let n = 3 * CHUNK + 17;
        let cut = CHUNK + 5;
        let mut w = WorkerMoments::new(&rule, [("w", 0..cut), ("bias", cut..n)]);
        let params: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut grad: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
        let serial: Vec<f32> = grad
            .iter()
            .zip(&params)
            .enumerate()
            .map(|(i, (&g, &p))| {
                let wd = if i < cut { 0.1 } else { 0.0 };
                let d = if g == 0.0 { 0.0 } else { g.signum() };
                d + wd * p
            })
            .collect();
        w.direction(&mut grad, &params, 0).unwrap();
        for (i, (a, b)) in grad.iter().zip(&serial).enumerate() {
            assert!((a - b).abs() < 1e-5, "entry {i}: {a} vs {b}");
        }
    }

    /// Ranges that cut through tensors, made last to first as a backward
    /// pass finishes them, give the whole direction bit for bit, step
    /// after step; a range or slice of the wrong size is refused.
    #[test]
    fn a_direction_made_range_by_range_is_the_whole_one() {
        let rule = adam(OptimizerKind::Adamw, 0.1);
        let n = 2 * CHUNK + 33;
        let tensors = [("w", 0..CHUNK + 9), ("bias", CHUNK + 9..n)];
        let mut whole = WorkerMoments::new(&rule, tensors.clone());
        let mut ranged = WorkerMoments::new(&rule, tensors);
        let params: Vec<f32> = (0..n).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect();
        let ranges = [0..CHUNK / 2, CHUNK / 2..CHUNK + 20, CHUNK + 20..n];
        for step in 0..3u64 {
            let grad: Vec<f32> = (0..n)
                .map(|i| (((i as u64 * 7 + step * 3) % 17) as f32 - 8.0) * 0.01)
                .collect();
            let mut want = grad.clone();
            whole.direction(&mut want, &params, step).unwrap();
            let k = ranged.begin(step);
            let mut got = grad.clone();
            for range in ranges.iter().rev() {
                let range = range.clone();
                let (g, p) = (&mut got[range.clone()], &params[range.clone()]);
                ranged.direction_in(&k, range, g, p).unwrap();
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "step {step}");
            assert_eq!(bits(ranged.moments().1), bits(whole.moments().1));
        }
        assert_eq!(ranged.steps(), whole.steps());
        let k = ranged.begin(3);
        assert!(ranged
            .direction_in(&k, 0..4, &mut [0.0; 3], &[0.0; 4])
            .is_err());
        assert!(ranged
            .direction_in(&k, n - 2..n + 2, &mut [0.0; 4], &[0.0; 4])
            .is_err());
    }
}

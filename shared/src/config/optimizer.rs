//! `[optimizer]` and `[optimizer.schedule]`: the server-side update rule
//! (SGD with momentum, weight decay and LARS, Adam, AdamW) and the learning
//! rate by global step.

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// Server-side optimizer, applied once per step to the aggregated gradient;
/// the server's update kernels (`ps_server::optimizer`) take it as it is, or
/// with `moments = "worker"` its [`OptimizerSection::server_rule`] (the
/// workers then apply Adam, `ps_worker::moments`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// Base learning rate (the schedule scales it by global step).
    pub lr: f32,
    /// Momentum coefficient; momentum is used only when it is above zero.
    pub momentum: f32,
    /// Nesterov momentum (needs `momentum` > 0).
    pub nesterov: bool,
    /// SGD and Adam: L2 decay added to the gradient (`g + wd * p`); AdamW:
    /// decoupled decay (`p -= lr * wd * p` before the Adam step).
    pub weight_decay: f32,
    /// LARS trust coefficient eta, e.g. 0.001 (0 disables LARS): per tensor
    /// `lr_eff = lr * eta * ||p|| / ||g'||`, with 1 as the trust when a norm
    /// is 0.
    pub lars_eta: f32,
    /// Update rule: SGD (with the fields above), Adam or AdamW.
    pub kind: OptimizerKind,
    /// Adam/AdamW: first-moment decay.
    pub beta1: f32,
    /// Adam/AdamW: second-moment decay.
    pub beta2: f32,
    /// Adam/AdamW: added to the bias-corrected root of the second moment.
    pub eps: f32,
    /// Tensors whose name contains one of these substrings get no weight
    /// decay (e.g. `["bias", "bn", "ln"]`).
    pub no_decay: Vec<String>,
    /// Global-norm clipping of the aggregated (mean) gradient, dense
    /// updates only: the gradient is scaled by `min(1, c / (norm + 1e-6))`
    /// before the update (0 = off). With several shards the norm is summed
    /// from every shard's share through the workers (BSP only; one more
    /// round trip per step).
    pub clip_grad_norm: f32,
    /// Learning-rate schedule by global step.
    pub schedule: ScheduleSection,
    /// Adam/AdamW: where the two moments live. `server` (the default): the
    /// servers apply Adam to the aggregated gradient (lazily on top-k
    /// pushes). `worker`: each worker keeps both moments of the whole model,
    /// pushes its scheduled Adam direction (with AdamW's decoupled decay)
    /// through its compressor, and the servers add the mean of the pushes
    /// at the base rate ([`OptimizerSection::server_rule`]).
    pub moments: Moments,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            lr: 0.05,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            lars_eta: 0.0,
            kind: OptimizerKind::Sgd,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            no_decay: Vec::new(),
            clip_grad_norm: 0.0,
            schedule: ScheduleSection::default(),
            moments: Moments::Server,
        }
    }
}

/// `optimizer.moments`: where Adam's moments are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Moments {
    /// On the servers, applied to the aggregated gradient.
    #[default]
    Server,
    /// On each worker, which pushes its Adam direction.
    Worker,
}

/// `optimizer.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    #[default]
    Sgd,
    /// Adam with L2 weight decay added to the gradient (torch's `Adam`).
    Adam,
    /// Adam with decoupled weight decay (torch's `AdamW`).
    Adamw,
}

impl OptimizerKind {
    pub fn is_adam(self) -> bool {
        matches!(self, Self::Adam | Self::Adamw)
    }
}

/// `optimizer.schedule.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    #[default]
    Constant,
    /// Cosine decay from `lr` to `min_lr` over `total_steps` (after warm-up).
    Cosine,
    /// Multiply by `gamma` every `step_size` steps, or at each milestone.
    Step,
}

/// `[optimizer.schedule]`: the learning rate of global step `t` (0-based,
/// the update being applied) is `lr * factor(t)`, [`ScheduleSection::factor`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleSection {
    pub kind: ScheduleKind,
    /// Steps of linear warm-up, from `warmup_start * lr` to `lr` (0 = none).
    pub warmup_steps: u64,
    /// Factor of the first warm-up step, in [0, 1].
    pub warmup_start: f32,
    /// Cosine: the step at which the rate reaches `min_lr` (and stays).
    pub total_steps: u64,
    /// Cosine: the final rate (absolute, <= `optimizer.lr`).
    pub min_lr: f32,
    /// Step: the decay factor.
    pub gamma: f32,
    /// Step: decay every this many steps after warm-up (0 = use `milestones`).
    pub step_size: u64,
    /// Step: the global steps at which the rate is multiplied by `gamma`.
    pub milestones: Vec<u64>,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        Self {
            kind: ScheduleKind::Constant,
            warmup_steps: 0,
            warmup_start: 0.0,
            total_steps: 0,
            min_lr: 0.0,
            gamma: 0.1,
            step_size: 0,
            milestones: Vec::new(),
        }
    }
}

impl ScheduleSection {
    /// The rate of global step `step` given the base rate `lr`.
    ///
    /// Warm-up: `lr * (s + (1 - s) * step / warmup_steps)` for
    /// `step < warmup_steps` (`s` = `warmup_start`). After it, with
    /// `t = step - warmup_steps`:
    /// - cosine: `min_lr + (lr - min_lr) * (1 + cos(pi * t / T)) / 2`,
    ///   `T = total_steps - warmup_steps`, `min_lr` once `t >= T`;
    /// - step: `lr * gamma^(t / step_size)`, or `lr * gamma^(milestones <= step)`;
    /// - constant: `lr`.
    pub fn lr_at(&self, lr: f32, step: u64) -> f32 {
        let lr64 = f64::from(lr);
        if step < self.warmup_steps {
            let s = f64::from(self.warmup_start);
            let frac = step as f64 / self.warmup_steps as f64;
            return (lr64 * (s + (1.0 - s) * frac)) as f32;
        }
        let t = step - self.warmup_steps;
        let rate = match self.kind {
            ScheduleKind::Constant => lr64,
            ScheduleKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps);
                let min = f64::from(self.min_lr);
                if span == 0 || t >= span {
                    min
                } else {
                    let progress = t as f64 / span as f64;
                    min + (lr64 - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
                }
            }
            ScheduleKind::Step => {
                let decays = t.checked_div(self.step_size).unwrap_or_else(|| {
                    self.milestones.iter().filter(|&&m| m <= step).count() as u64
                });
                lr64 * f64::from(self.gamma).powi(decays.min(i32::MAX as u64) as i32)
            }
        };
        rate as f32
    }

    /// The fields of the schedule's kind consistent (with `lr`, the
    /// optimizer's base rate, bounding `min_lr`), and no field of another
    /// kind set.
    pub fn validate(&self, lr: f32) -> Result<(), ConfigError> {
        check_range(
            "optimizer.schedule.warmup_start",
            self.warmup_start,
            0.0..=1.0,
        )?;
        match self.kind {
            ScheduleKind::Constant => {}
            ScheduleKind::Cosine => {
                if self.total_steps <= self.warmup_steps {
                    return Err(invalid(
                        "optimizer.schedule.total_steps",
                        format!(
                            "must be above optimizer.schedule.warmup_steps ({}) for kind = \"cosine\", got {}",
                            self.warmup_steps, self.total_steps
                        ),
                    ));
                }
                check_range("optimizer.schedule.min_lr", self.min_lr, 0.0..=lr)?;
            }
            ScheduleKind::Step => {
                check_range("optimizer.schedule.gamma", self.gamma, 0.0..=1.0)?;
                if self.step_size == 0 && self.milestones.is_empty() {
                    return Err(invalid(
                        "optimizer.schedule.step_size",
                        "kind = \"step\" needs step_size > 0 or a list of milestones",
                    ));
                }
                if self.step_size > 0 && !self.milestones.is_empty() {
                    return Err(invalid(
                        "optimizer.schedule.milestones",
                        "give either step_size or milestones, not both",
                    ));
                }
                if self.milestones.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(invalid(
                        "optimizer.schedule.milestones",
                        "must be strictly ascending",
                    ));
                }
            }
        }
        let defaults = ScheduleSection::default();
        let misplaced: &[(&str, bool, ScheduleKind)] = &[
            (
                "total_steps",
                self.total_steps != defaults.total_steps,
                ScheduleKind::Cosine,
            ),
            (
                "min_lr",
                self.min_lr != defaults.min_lr,
                ScheduleKind::Cosine,
            ),
            ("gamma", self.gamma != defaults.gamma, ScheduleKind::Step),
            (
                "step_size",
                self.step_size != defaults.step_size,
                ScheduleKind::Step,
            ),
            (
                "milestones",
                !self.milestones.is_empty(),
                ScheduleKind::Step,
            ),
        ];
        for &(field, set, kind) in misplaced {
            if set && self.kind != kind {
                return Err(invalid(
                    format!("optimizer.schedule.{field}"),
                    format!(
                        "applies only to kind = \"{}\", not \"{}\"",
                        kind_name(kind),
                        kind_name(self.kind)
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn kind_name(kind: ScheduleKind) -> &'static str {
    match kind {
        ScheduleKind::Constant => "constant",
        ScheduleKind::Cosine => "cosine",
        ScheduleKind::Step => "step",
    }
}

impl OptimizerSection {
    /// Rates and factors in range, no field of another kind set, and the
    /// schedule. Whether `clip_grad_norm` can be exact depends on the
    /// compression and the shards ([`super::ClusterConfig::validate`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid("optimizer.lr", "must be a positive finite number"));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(invalid("optimizer.momentum", "must be in [0, 1)"));
        }
        if self.nesterov && self.momentum == 0.0 {
            return Err(invalid(
                "optimizer.nesterov",
                "needs optimizer.momentum > 0",
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid("optimizer.weight_decay", "must be >= 0"));
        }
        if !(self.lars_eta.is_finite() && self.lars_eta >= 0.0) {
            return Err(invalid("optimizer.lars_eta", "must be >= 0"));
        }
        if self.kind.is_adam() {
            for (field, set) in [
                ("optimizer.momentum", self.momentum != 0.0),
                ("optimizer.nesterov", self.nesterov),
                ("optimizer.lars_eta", self.lars_eta != 0.0),
            ] {
                if set {
                    return Err(invalid(
                        field,
                        "applies only to kind = \"sgd\" (Adam and AdamW keep their own moments)",
                    ));
                }
            }
            check_range("optimizer.beta1", self.beta1, 0.0..=0.999_999)?;
            check_range("optimizer.beta2", self.beta2, 0.0..=0.999_999)?;
            check_range("optimizer.eps", self.eps, 1e-30..=1.0)?;
        } else {
            let defaults = OptimizerSection::default();
            for (field, set) in [
                ("optimizer.beta1", self.beta1 != defaults.beta1),
                ("optimizer.beta2", self.beta2 != defaults.beta2),
                ("optimizer.eps", self.eps != defaults.eps),
            ] {
                if set {
                    return Err(invalid(
                        field,
                        "applies only to kind = \"adam\" or \"adamw\"",
                    ));
                }
            }
        }
        if let Some(p) = self.no_decay.iter().find(|p| p.is_empty()) {
            return Err(invalid(
                "optimizer.no_decay",
                format!("{p:?}: an empty pattern would match every tensor"),
            ));
        }
        check_range("optimizer.clip_grad_norm", self.clip_grad_norm, 0.0..=1e9)?;
        if self.moments == Moments::Worker {
            if !self.kind.is_adam() {
                return Err(invalid(
                    "optimizer.moments",
                    "\"worker\" applies only to kind = \"adam\" or \"adamw\" (SGD keeps no moments)",
                ));
            }
            if self.clip_grad_norm > 0.0 {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    "cannot be used with optimizer.moments = \"worker\": the servers receive Adam directions, not gradients",
                ));
            }
        }
        self.schedule.validate(self.lr)
    }

    /// The rule the servers apply. With `moments = "server"` this section
    /// itself; with `moments = "worker"` the pushes are already scheduled
    /// Adam directions (decay included), so the servers apply plain SGD at
    /// the base rate: `p -= lr * mean(pushes)`, no momentum, decay or
    /// schedule, which keeps sparse replies sparse.
    pub fn server_rule(&self) -> OptimizerSection {
        match self.moments {
            Moments::Server => self.clone(),
            Moments::Worker => OptimizerSection {
                lr: self.lr,
                ..OptimizerSection::default()
            },
        }
    }

    /// Whether the workers keep Adam's moments (`moments = "worker"`).
    #[inline]
    pub fn worker_moments(&self) -> bool {
        self.kind.is_adam() && self.moments == Moments::Worker
    }

    /// The factor of global step `step`'s rate over the base rate,
    /// `lr_at(step) / lr` (what a worker with its own moments scales its
    /// direction by).
    pub fn schedule_factor(&self, step: u64) -> f32 {
        (f64::from(self.lr_at(step)) / f64::from(self.lr)) as f32
    }

    /// Whether the update keeps a momentum buffer (`momentum` > 0, SGD).
    #[inline]
    pub fn uses_momentum(&self) -> bool {
        self.kind == OptimizerKind::Sgd && self.momentum > 0.0
    }

    /// The LARS trust coefficient when LARS is on (`lars_eta` > 0, SGD).
    #[inline]
    pub fn lars(&self) -> Option<f32> {
        (self.kind == OptimizerKind::Sgd && self.lars_eta > 0.0).then_some(self.lars_eta)
    }

    /// Floats of optimizer state per parameter: 1 with momentum, 2 for
    /// Adam/AdamW (first moments, then second moments), else 0.
    pub fn state_per_param(&self) -> usize {
        if self.kind.is_adam() {
            2
        } else {
            usize::from(self.uses_momentum())
        }
    }

    /// The learning rate of global step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        self.schedule.lr_at(self.lr, step)
    }

    /// Whether the tensor named `name` is decayed (no `no_decay` pattern in it).
    pub fn decays(&self, name: &str) -> bool {
        !self.no_decay.iter().any(|p| name.contains(p.as_str()))
    }

    /// Whether an update may move a parameter whose aggregated gradient is
    /// zero (then replies cannot be built from the pushed indices alone).
    /// LARS is counted as such too, conservatively. Adam and AdamW are lazy
    /// on sparse updates (only pushed entries move, see the server's
    /// optimizer), so they do not.
    pub fn moves_untouched(&self) -> bool {
        self.kind == OptimizerKind::Sgd
            && (self.uses_momentum() || self.weight_decay > 0.0 || self.lars().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClusterConfig;

    #[test]
    fn schedules_at_known_steps() {
        let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1e-3);
        // Warm-up from 0.1 * lr over 4 steps, cosine to 0.01 at step 12.
        let cosine = ScheduleSection {
            kind: ScheduleKind::Cosine,
            warmup_steps: 4,
            warmup_start: 0.1,
            total_steps: 12,
            min_lr: 0.01,
            ..ScheduleSection::default()
        };
        for (step, expected) in [
            (0u64, 0.01),
            (1, 0.0325),
            (3, 0.0775),
            (4, 0.1),
            // Half way: min + (lr - min) / 2.
            (8, 0.055),
            // A quarter: min + (lr - min) * (1 + cos(pi/4)) / 2.
            (
                6,
                0.01 + 0.09 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2),
            ),
            (12, 0.01),
            (1000, 0.01),
        ] {
            let got = cosine.lr_at(0.1, step);
            assert!(
                close(got, expected),
                "cosine step {step}: {got} vs {expected}"
            );
        }
        let every = ScheduleSection {
            kind: ScheduleKind::Step,
            step_size: 10,
            gamma: 0.5,
            ..ScheduleSection::default()
        };
        for (step, expected) in [(0u64, 1.0), (9, 1.0), (10, 0.5), (25, 0.25)] {
            assert!(close(every.lr_at(1.0, step), expected), "step {step}");
        }
        let milestones = ScheduleSection {
            kind: ScheduleKind::Step,
            milestones: vec![3, 7],
            gamma: 0.1,
            warmup_steps: 2,
            ..ScheduleSection::default()
        };
        for (step, expected) in [(0u64, 0.0), (1, 0.5), (2, 1.0), (3, 0.1), (7, 0.01)] {
            assert!(
                close(milestones.lr_at(1.0, step), expected),
                "milestone step {step}"
            );
        }
        let constant = ScheduleSection::default();
        assert_eq!(constant.lr_at(0.3, 12345), 0.3);
    }

    #[test]
    fn optimizer_fields_that_do_not_apply_are_named() {
        for (text, field) in [
            ("[optimizer]
kind = \"adamw\"
momentum = 0.9
", "optimizer.momentum"),
            ("[optimizer]
kind = \"adam\"
lars_eta = 0.001
", "optimizer.lars_eta"),
            ("[optimizer]
beta1 = 0.8
", "optimizer.beta1"),
            ("[optimizer]
kind = \"adamw\"
beta2 = 1.0
", "optimizer.beta2"),
            ("[optimizer]
kind = \"adamw\"
eps = 0.0
", "optimizer.eps"),
            ("[optimizer]
no_decay = [\"\"]
", "optimizer.no_decay"),
            ("[optimizer]
clip_grad_norm = -1.0
", "optimizer.clip_grad_norm"),
            (
                "[cluster]\nshards_per_server = 1\n[compression]\nkind = \"topk\"\n[optimizer]\nclip_grad_norm = 1.0\n",
                "clips dense updates only",
            ),
            // Several shards: exact only over a BSP barrier, without late
            // pushes.
            (
                "[compression]\nkind = \"none\"\n[server]\nmode = \"asp\"\n[optimizer]\nclip_grad_norm = 1.0\n",
                "needs server.mode = \"bsp\"",
            ),
            (
                "[compression]\nkind = \"none\"\n[server]\nmode = \"ssp\"\nstaleness = 1\n[optimizer]\nclip_grad_norm = 1.0\n",
                "needs server.mode = \"bsp\"",
            ),
            (
                "[cluster]\nworkers = 3\n[compression]\nkind = \"none\"\n[server]\nbackup_workers = 1\n[optimizer]\nclip_grad_norm = 1.0\n",
                "server.backup_workers = 1",
            ),
            (
                "[optimizer.schedule]\nkind = \"cosine\"\nwarmup_steps = 10\ntotal_steps = 5\n",
                "optimizer.schedule.total_steps",
            ),
            (
                "[optimizer.schedule]\nkind = \"cosine\"\ntotal_steps = 5\nmin_lr = 1.0\n",
                "optimizer.schedule.min_lr",
            ),
            ("[optimizer.schedule]\nkind = \"step\"\n", "optimizer.schedule.step_size"),
            (
                "[optimizer.schedule]\nkind = \"step\"\nmilestones = [5, 2]\n",
                "optimizer.schedule.milestones",
            ),
            ("[optimizer.schedule]\ngamma = 0.5\n", "optimizer.schedule.gamma"),
            ("[optimizer.schedule]\nwarmup_start = 2.0\n", "optimizer.schedule.warmup_start"),
        ] {
            let e = ClusterConfig::from_toml_str(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text}: {e}");
        }
        let ok = ClusterConfig::from_toml_str(
            "[cluster]\nshards_per_server = 1\n[compression]\nkind = \"none\"\n\
             [optimizer]\nkind = \"adamw\"\nlr = 0.001\n\
             weight_decay = 0.01\nno_decay = [\"bias\"]\nclip_grad_norm = 1.0\n\
             [optimizer.schedule]\nkind = \"cosine\"\nwarmup_steps = 10\ntotal_steps = 100\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
        // Several shards (2 servers x 2) in BSP, dense: the norm is summed
        // across the shards.
        let ok = ClusterConfig::from_toml_str(
            "[cluster]\nservers = [\"127.0.0.1:7400\", \"127.0.0.1:7401\"]\nshards_per_server = 2\n\
             [compression]\nkind = \"none\"\n[optimizer]\nclip_grad_norm = 1.0\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
        // One shard applies each push with its own (global) norm in any mode.
        let ok = ClusterConfig::from_toml_str(
            "[cluster]\nshards_per_server = 1\n[compression]\nkind = \"none\"\n\
             [server]\nmode = \"asp\"\n[optimizer]\nclip_grad_norm = 1.0\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn worker_moments_are_refused_where_they_make_no_sense() {
        let adamw_topk = "[cluster]\nshards_per_server = 1\n\
                          [compression]\nkind = \"topk\"\nmomentum_correction = 0.0\n";
        for (text, field) in [
            // SGD keeps no moments.
            (
                format!("{adamw_topk}[optimizer]\nmoments = \"worker\"\n"),
                "optimizer.moments",
            ),
            // The default compression has DGC momentum correction on.
            (
                "[optimizer]\nkind = \"adamw\"\nmoments = \"worker\"\n".to_string(),
                "compression.momentum_correction",
            ),
            (
                "[cluster]\nworkers = 4\nworkers_per_node = 2\n\
                 [compression]\nmomentum_correction = 0.0\n\
                 [optimizer]\nkind = \"adam\"\nmoments = \"worker\"\n"
                    .to_string(),
                "cluster.workers_per_node",
            ),
            (
                "[cluster]\nshards_per_server = 1\n[compression]\nkind = \"none\"\n\
                 [optimizer]\nkind = \"adamw\"\nmoments = \"worker\"\nclip_grad_norm = 1.0\n"
                    .to_string(),
                "optimizer.clip_grad_norm",
            ),
            (
                format!("{adamw_topk}[optimizer]\nkind = \"adamw\"\nmoments = \"gpu\"\n"),
                "moments",
            ),
        ] {
            let e = ClusterConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{text}: {e}");
        }
        for compression in ["topk", "none"] {
            let cfg = ClusterConfig::from_toml_str(&format!(
                "[compression]\nkind = \"{compression}\"\nmomentum_correction = 0.0\n\
                 [optimizer]\nkind = \"adamw\"\nlr = 0.01\nweight_decay = 0.1\n\
                 moments = \"worker\"\nno_decay = [\"bias\"]\n\
                 [optimizer.schedule]\nkind = \"cosine\"\nwarmup_steps = 2\ntotal_steps = 10\n"
            ))
            .unwrap_or_else(|e| panic!("{compression}: {e}"));
            assert!(cfg.optimizer.worker_moments());
            // The servers add the pushes at the base rate: no moments, no
            // decay, no schedule, and untouched entries stay where they are.
            let rule = cfg.optimizer.server_rule();
            assert_eq!(rule.kind, OptimizerKind::Sgd);
            assert_eq!(rule.lr, 0.01);
            assert_eq!(rule.weight_decay, 0.0);
            assert_eq!(rule.state_per_param(), 0);
            assert_eq!(rule.lr_at(0), 0.01);
            assert!(!rule.moves_untouched());
            assert_eq!(cfg.optimizer.schedule_factor(0), 0.0);
            assert_eq!(cfg.optimizer.schedule_factor(1), 0.5);
            assert_eq!(cfg.optimizer.schedule_factor(2), 1.0);
        }
        // The default keeps the servers' rule as it is.
        let cfg =
            ClusterConfig::from_toml_str("[optimizer]\nkind = \"adamw\"\nweight_decay = 0.1\n")
                .unwrap();
        assert_eq!(cfg.optimizer.moments, Moments::Server);
        assert!(!cfg.optimizer.worker_moments());
        assert_eq!(cfg.optimizer.server_rule(), cfg.optimizer);
    }
}

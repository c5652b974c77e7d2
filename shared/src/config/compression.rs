//! `[compression]`: how workers compress their gradients before a push.
//! The top-k [`Compressor`] of [`crate::sparse`] takes this section as it
//! is.

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};
use crate::sparse::{Compressor, TopKMethod};

/// Gradient compression kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CompressionKind {
    /// Dense gradients (the baseline).
    None,
    /// Top-k sparsification with error feedback.
    Topk,
}

/// What one top-k selection covers (`compression.scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TopkScope {
    /// One selection over the whole flat gradient: the k largest entries
    /// wherever they lie (a shard may get many, another none).
    #[default]
    Model,
    /// One selection per server shard, `density` of its entries each: every
    /// shard gets its share of the push, and a shard's selection needs only
    /// its own range, so a compressed push can leave while the backward pass
    /// still runs (`training.overlap_backward`).
    Shard,
}

/// Worker-side gradient compression: the settings of the top-k
/// [`Compressor`] (error feedback and DGC-style momentum correction, masking,
/// local clipping and density warm-up), which takes this section as it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompressionSection {
    /// `topk`, or `none` for dense gradients (then no compressor is built
    /// and the other settings are not used).
    pub kind: CompressionKind,
    /// Final fraction of entries sent per step, in (0, 1]; 1 sends everything.
    pub density: f64,
    /// `exact` (introselect) or `approx` (sampled threshold).
    pub method: TopKMethod,
    /// Keep the unsent residual and add it to later gradients.
    pub error_feedback: bool,
    /// DGC momentum correction factor m in [0, 1) (0 disables):
    /// `u = m*u + g; v += u`. Use with server momentum 0.
    pub momentum_correction: f32,
    /// DGC momentum factor masking: zero `u` at the sent indices.
    pub momentum_masking: bool,
    /// Steps of exponential density warm-up from `warmup_start_density`
    /// down to `density` (0 disables).
    pub warmup_steps: u64,
    pub warmup_start_density: f64,
    /// DGC local gradient clipping: largest L2 norm of one step's gradient on
    /// a worker before it is accumulated (0 disables).
    pub clip_norm: f32,
    /// Send values as f16 on the wire (the transport's business; the
    /// compressor does not read it).
    pub f16_values: bool,
    /// Pull replies carry each update's change as f16 (half the bytes of a
    /// dense pull). The servers round every change on write and carry the
    /// rounding error into the entry's next change, so every worker's copy
    /// equals the server's bit for bit. Applies with any `kind`; a worker
    /// more than one version behind still gets f32 values.
    pub f16_replies: bool,
    /// Global top-k on the servers: each sparse update applies only the k
    /// largest entries of the workers' mean gradient (k = the largest push
    /// of that update) and keeps the rest in a server-side residual, saved
    /// in checkpoints. A pull then carries at most k changed entries instead
    /// of the union of every worker's top-k (up to workers × k). The
    /// servers read it; it has no effect on dense updates (`kind = "none"`,
    /// or an optimizer with momentum, weight decay or LARS). `auto` (the
    /// default) turns it on where it converged as well as the union when
    /// measured: at most [`GLOBAL_TOPK_AUTO_MAX`] clients in the barrier
    /// (as many steps to the target, half the bytes pulled); with more, the
    /// union applies more of the gradient per step and needs fewer steps
    /// (5-16% at 8 and 32 workers), so `auto` keeps it off. `true` or
    /// `false` force it.
    pub global_topk: GlobalTopk,
    /// `model` (one top-k over the whole gradient) or `shard` (one per
    /// server shard, which `training.overlap_backward` needs to stream a
    /// compressed push). Local clipping (`clip_norm`) needs the whole
    /// gradient's norm, so a clipped push leaves whole either way.
    pub scope: TopkScope,
}

/// Barrier sizes up to which `compression.global_topk = "auto"` applies
/// the global top-k.
pub const GLOBAL_TOPK_AUTO_MAX: u32 = 2;

/// `compression.global_topk`: `true`, `false` or `"auto"` in a config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GlobalTopk {
    /// On with at most [`GLOBAL_TOPK_AUTO_MAX`] clients in the barrier.
    #[default]
    Auto,
    On,
    Off,
}

impl From<bool> for GlobalTopk {
    fn from(on: bool) -> Self {
        if on {
            GlobalTopk::On
        } else {
            GlobalTopk::Off
        }
    }
}

impl Serialize for GlobalTopk {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            GlobalTopk::Auto => s.serialize_str("auto"),
            GlobalTopk::On => s.serialize_bool(true),
            GlobalTopk::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for GlobalTopk {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Flag(bool),
            Word(String),
        }
        match Raw::deserialize(d) {
            Ok(Raw::Flag(on)) => Ok(on.into()),
            Ok(Raw::Word(w)) if w == "auto" => Ok(GlobalTopk::Auto),
            _ => Err(serde::de::Error::custom(
                "compression.global_topk must be true, false or \"auto\"",
            )),
        }
    }
}

impl Default for CompressionSection {
    fn default() -> Self {
        Self {
            kind: CompressionKind::Topk,
            density: 0.01,
            method: TopKMethod::Exact,
            error_feedback: true,
            momentum_correction: 0.9,
            momentum_masking: true,
            warmup_steps: 0,
            warmup_start_density: 0.25,
            clip_norm: 0.0,
            f16_values: false,
            f16_replies: false,
            global_topk: GlobalTopk::Auto,
            scope: TopkScope::Model,
        }
    }
}

impl CompressionSection {
    /// Whether the servers apply a global top-k of each sparse update, for
    /// a barrier of `clients` (workers, or node aggregators): never for
    /// dense pushes; `auto` by the barrier's size.
    pub fn global_topk_for(&self, clients: u32) -> bool {
        self.kind == CompressionKind::Topk
            && match self.global_topk {
                GlobalTopk::On => true,
                GlobalTopk::Off => false,
                GlobalTopk::Auto => clients <= GLOBAL_TOPK_AUTO_MAX,
            }
    }

    /// Step counts (the fractions are checked by [`Self::validate`]).
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("compression.warmup_steps", self.warmup_steps, 0..=1 << 40)
    }

    /// Step counts in range, the density in (0, 1] whatever `kind` says,
    /// and with `kind = "topk"` the compressor's settings
    /// ([`Self::check_topk`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        if !(self.density > 0.0 && self.density <= 1.0) {
            return Err(invalid("compression.density", "must be in (0, 1]"));
        }
        // With kind = "none" no compressor is built, so only the density
        // (checked above) is held to its range.
        if self.kind == CompressionKind::Topk {
            self.check_topk().map_err(|m| invalid("compression", m))?;
        }
        Ok(())
    }

    /// The compressor for `num_params` parameters split over `shards`
    /// balanced server shards, or `None` with `kind = "none"` (dense
    /// gradients need none). With `scope = "shard"` it selects per shard.
    pub fn compressor(&self, num_params: usize, shards: usize) -> Option<Compressor> {
        match self.kind {
            CompressionKind::None => None,
            CompressionKind::Topk => {
                let compressor = Compressor::new(num_params, self.clone());
                Some(match self.scope {
                    TopkScope::Model => compressor,
                    // A layout with more shards than parameters has no
                    // shards to select in; the connection refuses it.
                    TopkScope::Shard => {
                        match crate::shard::ShardMap::balanced(num_params, shards) {
                            Ok(map) => compressor.per_block(map.ranges().to_vec()),
                            Err(_) => compressor,
                        }
                    }
                })
            }
        }
    }

    /// Whether a top-k push can leave shard by shard as the backward pass
    /// finishes each range: one selection per shard, and no local clipping
    /// (whose scale needs the whole gradient).
    pub fn streams(&self) -> bool {
        self.kind == CompressionKind::None
            || (self.scope == TopkScope::Shard && self.clip_norm == 0.0)
    }

    /// The top-k settings' ranges, whatever `kind` says: density in (0, 1],
    /// momentum correction in [0, 1), clip norm finite and >= 0, and with
    /// warm-up on a start density in [density, 1].
    fn check_topk(&self) -> Result<(), String> {
        if !(self.density > 0.0 && self.density <= 1.0) {
            return Err(format!(
                "compressor density must be in (0, 1], got {}",
                self.density
            ));
        }
        if !(self.momentum_correction >= 0.0 && self.momentum_correction < 1.0) {
            return Err(format!(
                "compressor momentum_correction must be in [0, 1), got {}",
                self.momentum_correction
            ));
        }
        if !(self.clip_norm >= 0.0 && self.clip_norm.is_finite()) {
            return Err(format!(
                "compressor clip_norm must be a finite number >= 0, got {}",
                self.clip_norm
            ));
        }
        if self.warmup_steps > 0
            && !(self.warmup_start_density >= self.density && self.warmup_start_density <= 1.0)
        {
            return Err(format!(
                "compressor warmup_start_density must be in [density, 1] = [{}, 1], got {}",
                self.density, self.warmup_start_density
            ));
        }
        Ok(())
    }

    /// Density used at `step` (0-based): during warm-up
    /// `start * (density / start)^(step / warmup_steps)`, afterwards `density`.
    /// Never increases with `step`; out-of-range settings are clamped.
    pub fn density_at(&self, step: u64) -> f64 {
        let density = if self.density.is_nan() {
            1.0
        } else {
            self.density.clamp(f64::MIN_POSITIVE, 1.0)
        };
        if self.warmup_steps == 0 || step >= self.warmup_steps {
            return density;
        }
        let start = if self.warmup_start_density.is_nan() {
            density
        } else {
            self.warmup_start_density.clamp(density, 1.0)
        };
        let progress = step as f64 / self.warmup_steps as f64;
        (start * (density / start).powf(progress)).clamp(density, start)
    }
}

#[cfg(test)]
impl CompressionSection {
    /// Top-k settings at `density` with DGC momentum correction off (the
    /// section's default has it at 0.9); the rest as the section's default.
    /// For this crate's tests (config and sparse kernels).
    pub(crate) fn topk_for_tests(density: f64) -> Self {
        Self {
            density,
            momentum_correction: 0.0,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClusterConfig;

    fn topk_config(density: f64) -> CompressionSection {
        CompressionSection::topk_for_tests(density)
    }

    #[test]
    fn config_validation_messages() {
        let bad_density = topk_config(0.0);
        assert!(bad_density
            .validate()
            .unwrap_err()
            .to_string()
            .contains("compression.density"));
        let bad_correction = CompressionSection {
            momentum_correction: 1.0,
            ..topk_config(0.01)
        };
        assert!(bad_correction
            .validate()
            .unwrap_err()
            .to_string()
            .contains("momentum_correction"));
        let bad_start = CompressionSection {
            warmup_steps: 10,
            warmup_start_density: 0.25,
            ..topk_config(0.5)
        };
        assert!(bad_start
            .validate()
            .unwrap_err()
            .to_string()
            .contains("warmup_start_density"));
        assert!(topk_config(0.01).validate().is_ok());
        assert!(CompressionSection::default().validate().is_ok());
    }

    #[test]
    fn global_topk_is_true_false_or_auto_and_auto_follows_the_barrier() {
        let parse = |v: &str| {
            ClusterConfig::from_toml_str(&format!("[compression]\nglobal_topk = {v}\n"))
                .map(|c| c.compression.global_topk)
        };
        assert_eq!(parse("true").unwrap(), GlobalTopk::On);
        assert_eq!(parse("false").unwrap(), GlobalTopk::Off);
        assert_eq!(parse("\"auto\"").unwrap(), GlobalTopk::Auto);
        let err = parse("\"always\"").unwrap_err().to_string();
        assert!(err.contains("compression.global_topk"), "{err}");
        let auto = CompressionSection::default();
        assert_eq!(auto.global_topk, GlobalTopk::Auto);
        assert!(auto.global_topk_for(1) && auto.global_topk_for(2));
        assert!(!auto.global_topk_for(3) && !auto.global_topk_for(32));
        let forced = CompressionSection {
            global_topk: GlobalTopk::On,
            ..CompressionSection::default()
        };
        assert!(forced.global_topk_for(64));
        let dense = CompressionSection {
            kind: CompressionKind::None,
            global_topk: GlobalTopk::On,
            ..CompressionSection::default()
        };
        assert!(!dense.global_topk_for(2), "dense pushes have no top-k");
        // Written back as it is read.
        let text = toml::to_string(&auto).unwrap();
        assert!(text.contains("global_topk = \"auto\""), "{text}");
        let text = toml::to_string(&forced).unwrap();
        assert!(text.contains("global_topk = true"), "{text}");
    }

    #[test]
    fn compression_kind_none_builds_no_compressor() {
        let topk = ClusterConfig::from_toml_str(
            "[compression]\nkind = \"topk\"\nmomentum_correction = 1.5\n",
        )
        .unwrap_err();
        assert!(topk.to_string().contains("momentum_correction"), "{topk}");
        // The top-k settings are not used without a compressor.
        let cfg = ClusterConfig::from_toml_str(
            "[compression]\nkind = \"none\"\nmomentum_correction = 1.5\n",
        )
        .unwrap();
        assert!(cfg.compression.compressor(8, 2).is_none());
        let cfg = ClusterConfig::from_toml_str("[compression]\nkind = \"topk\"\n").unwrap();
        let compressor = cfg
            .compression
            .compressor(8, 2)
            .expect("a top-k compressor");
        assert_eq!(compressor.config(), &cfg.compression);
        assert_eq!(compressor.residual().len(), 8);
        assert!(compressor.blocks().is_empty(), "scope model: one selection");
    }

    #[test]
    fn scope_shard_selects_per_server_shard_and_streams_without_clipping() {
        let parse = |v: &str| {
            ClusterConfig::from_toml_str(&format!("[compression]\nscope = {v}\n"))
                .map(|c| c.compression)
        };
        assert_eq!(parse("\"model\"").unwrap().scope, TopkScope::Model);
        let shard = parse("\"shard\"").unwrap();
        assert_eq!(shard.scope, TopkScope::Shard);
        let err = parse("\"layer\"").unwrap_err().to_string();
        assert!(err.contains("scope"), "{err}");
        // The blocks are the balanced shards of the cluster's layout.
        let compressor = shard.compressor(10, 3).expect("a top-k compressor");
        assert_eq!(compressor.blocks(), &[0..4, 4..7, 7..10]);
        // More shards than parameters: no layout to follow (the connection
        // refuses it), one selection.
        assert!(shard.compressor(2, 3).unwrap().blocks().is_empty());
        assert!(shard.streams());
        assert!(!CompressionSection::default().streams(), "scope model");
        let clipped = CompressionSection {
            clip_norm: 1.0,
            ..shard.clone()
        };
        assert!(
            !clipped.streams(),
            "clipping needs the whole gradient's norm"
        );
        let dense = CompressionSection {
            kind: CompressionKind::None,
            ..CompressionSection::default()
        };
        assert!(dense.streams());
        let text = toml::to_string(&shard).unwrap();
        assert!(text.contains("scope = \"shard\""), "{text}");
    }
}

//! Cluster configuration: one TOML file read by both `ps-server` and `ps-worker`.
//!
//! Every field has a default, so a file only names what it changes; unknown
//! fields are rejected (a typo must not silently fall back to a default), and
//! [`ClusterConfig::validate`] checks every value with a message that names the
//! field. The embedded default is `configs/local.toml`.
//!
//! This module holds the whole file ([`ClusterConfig`]), its loading and the
//! rules that need more than one section; each section lives in its own
//! module with its own `validate`, and its types are re-exported here:
//! `[cluster]` and `[tls]` (`cluster`), `[model]` (`model`, with the layer
//! lists and ResNet presets in [`layers`]), `[data]` (`data`), `[training]`
//! (`training`), `[compression]` (`compression`), `[optimizer]`
//! (`optimizer`), `[server]` (`server`), `[loader]` and `[cost]` (`loader`),
//! and `[peers]` (`peers`).
//!
//! ```
//! use ps_shared::config::ClusterConfig;
//! let cfg = ClusterConfig::from_toml_str("[training]\nepochs = 3\n").unwrap();
//! assert_eq!(cfg.training.epochs, 3);
//! assert!(ClusterConfig::from_toml_str("[optimizer]\nlr = -1.0\n").is_err());
//! ```

use std::borrow::Cow;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod cluster;
mod compression;
mod data;
pub mod layers;
mod loader;
mod model;
mod optimizer;
mod peers;
mod server;
mod training;

pub use cluster::{ClusterSection, TlsSection};
pub use compression::{
    CompressionKind, CompressionSection, GlobalTopk, TopkScope, GLOBAL_TOPK_AUTO_MAX,
};
pub use data::{AugmentSection, Balance, DataSection, OnBadSample};
pub use loader::{CacheSize, CostModel, CostSection, LoaderSection};
pub use model::{GptSection, ModelKind, ModelSection, TensorDecl, TensorSpec};
pub use optimizer::{Moments, OptimizerKind, OptimizerSection, ScheduleKind, ScheduleSection};
pub use peers::{PeersSection, MAX_PEER_SAMPLES};
pub use server::{GradNormPolicy, ServerSection, SyncMode};
pub use training::TrainingSection;

/// The configuration shipped with the binaries (`configs/local.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../../configs/local.toml");

/// Environment variable that overrides `cluster.token`.
pub const TOKEN_ENV: &str = "STRATUS_TOKEN";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {origin} is not valid TOML for Stratus: {message}")]
    Parse { origin: String, message: String },
    #[error(
        "config {origin}: section [{section}] is no longer part of the cluster config: {message}"
    )]
    Retired {
        origin: String,
        section: &'static str,
        message: &'static str,
    },
    /// No config named, or two (`--config` and `--dev`).
    #[error("{0}")]
    Source(String),
    /// A `STRATUS__SECTION__FIELD` variable that does not fit the config.
    #[error("config override {var}: {message}")]
    Override { var: String, message: String },
    #[error("invalid config value {field}: {message}")]
    Invalid {
        field: Cow<'static, str>,
        message: String,
    },
    /// A time, size or count outside the range the field allows.
    #[error("invalid config value {field} = {value} is out of range {range}")]
    OutOfRange {
        field: Cow<'static, str>,
        value: String,
        range: String,
    },
}

fn invalid(field: impl Into<Cow<'static, str>>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// A field value whose range can be checked and shown in a message.
pub trait RangeValue: PartialOrd + Copy {
    /// The value as a message shows it (`1e19`, `0.1`, `86400`).
    fn show(self) -> String;
}

impl RangeValue for f64 {
    fn show(self) -> String {
        // Debug keeps the exponent of very large and small values.
        let text = format!("{self:?}");
        match text.strip_suffix(".0") {
            Some(whole) => whole.to_string(),
            None => text,
        }
    }
}

impl RangeValue for f32 {
    fn show(self) -> String {
        f64::from(self).show()
    }
}

macro_rules! range_value_int {
    ($($t:ty),*) => {$(
        impl RangeValue for $t {
            fn show(self) -> String {
                self.to_string()
            }
        }
    )*};
}
range_value_int!(u32, u64, usize);

/// `value` must lie in `range` (NaN never does); the error names the field,
/// the value and the range: "server.request_timeout_secs = 1e19 is out of
/// range 0.1..=86400".
pub fn check_range<T: RangeValue>(
    field: impl Into<Cow<'static, str>>,
    value: T,
    range: RangeInclusive<T>,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        return Ok(());
    }
    Err(ConfigError::OutOfRange {
        field: field.into(),
        value: value.show(),
        range: format!("{}..={}", range.start().show(), range.end().show()),
    })
}

/// Longest duration [`secs`] returns: ten years.
pub const MAX_DURATION_SECS: f64 = 10.0 * 365.0 * 86_400.0;

/// Seconds as a [`Duration`], without the panics of
/// `Duration::from_secs_f64`: NaN and negative values give zero, values
/// beyond [`MAX_DURATION_SECS`] (or infinite) are capped there. Validated
/// configs never reach either end; code that builds a config by hand
/// cannot crash a timer with it.
///
/// ```
/// use ps_shared::config::secs;
/// assert_eq!(secs(1.5).as_millis(), 1500);
/// assert_eq!(secs(f64::NAN), std::time::Duration::ZERO);
/// assert_eq!(secs(-3.0), std::time::Duration::ZERO);
/// assert!(secs(1e19) <= std::time::Duration::from_secs(400_000_000));
/// ```
pub fn secs(v: f64) -> Duration {
    if v.is_nan() || v <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(v.min(MAX_DURATION_SECS)).unwrap_or(Duration::ZERO)
}

/// The whole cluster's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    pub cluster: ClusterSection,
    pub tls: TlsSection,
    pub model: ModelSection,
    pub data: DataSection,
    pub training: TrainingSection,
    pub compression: CompressionSection,
    pub optimizer: OptimizerSection,
    pub server: ServerSection,
    pub loader: LoaderSection,
    pub cost: CostSection,
    pub peers: PeersSection,
}

/// Sections that left the cluster config, and where they went.
const RETIRED_SECTIONS: [(&str, &str); 2] = [
    (
        "link",
        "the simulated link moved to a simulation file: put [link] there and pass it with `ps-worker train --simulate FILE` (see configs/simulate-slow-bucket.toml)",
    ),
    (
        "bucket_sim",
        "the simulated bucket moved to the [bucket] section of a simulation file (no `enabled`: the section's presence turns it on), passed with `ps-worker train --simulate FILE` (see configs/simulate-slow-bucket.toml); the prices get_cost_per_1000 and egress_cost_per_gb moved to the [cost] section of the cluster config",
    ),
];

impl ClusterConfig {
    /// The embedded default (`configs/local.toml`).
    pub fn embedded_default() -> Result<Self, ConfigError> {
        Self::parse(DEFAULT_CONFIG, "configs/local.toml (embedded)")
    }

    /// Parse and validate TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, "text")
    }

    /// Read, parse and validate a TOML file; `STRATUS_TOKEN` overrides the token.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_with(text, origin, &[], |_, _| Ok(()))
    }

    /// Parse `text`, let `edit` apply `overrides` to the TOML document
    /// (see [`crate::overrides`]), then deserialise and validate.
    pub(crate) fn parse_with(
        text: &str,
        origin: &str,
        overrides: &[crate::overrides::Override],
        edit: impl FnOnce(&mut toml::Table, &[crate::overrides::Override]) -> Result<(), ConfigError>,
    ) -> Result<Self, ConfigError> {
        let parsed: Result<ClusterConfig, toml::de::Error> = if overrides.is_empty() {
            toml::from_str(text)
        } else {
            let mut doc: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
                origin: origin.to_string(),
                message: e.to_string(),
            })?;
            edit(&mut doc, overrides)?;
            toml::Value::Table(doc).try_into()
        };
        let with = if overrides.is_empty() {
            origin.to_string()
        } else {
            let vars: Vec<&str> = overrides.iter().map(|o| o.var.as_str()).collect();
            format!("{origin} with {}", vars.join(", "))
        };
        let origin = with.as_str();
        let mut cfg: ClusterConfig = parsed.map_err(|e| {
            // An old file's `[link]` or `[bucket_sim]` says where it went
            // rather than "unknown field".
            let table = toml::from_str::<toml::Table>(text).unwrap_or_default();
            match RETIRED_SECTIONS
                .iter()
                .find(|(name, _)| table.contains_key(*name))
            {
                Some(&(section, message)) => ConfigError::Retired {
                    origin: origin.to_string(),
                    section,
                    message,
                },
                None => ConfigError::Parse {
                    origin: origin.to_string(),
                    message: e.to_string(),
                },
            }
        })?;
        if let Ok(token) = std::env::var(TOKEN_ENV) {
            if !token.is_empty() {
                cfg.cluster.token = token;
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every value; the error names the field and the rule. Each
    /// section checks its own fields (ranges first: its rules compute with
    /// them), then come the rules that need more than one section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.cluster.validate()?;
        self.tls.validate()?;
        self.model.validate()?;
        self.data.validate()?;
        self.training.validate()?;
        self.compression.validate()?;
        self.optimizer.validate()?;
        self.server.validate()?;
        self.loader.validate()?;
        self.cost.validate()?;
        self.peers.validate()?;
        self.check_across_sections()
    }

    /// The rules between sections: who may join against the sync mode,
    /// shards against parameters, overlap against the sync mode, global
    /// clipping against compression and shards, frames against the model
    /// and connections against the workers.
    fn check_across_sections(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        let s = &self.server;
        if c.max_ranks() > c.workers && s.mode == SyncMode::Bsp {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "workers can join beyond cluster.workers = {} only in asp or ssp jobs; a bsp barrier has a fixed size (set server.mode = \"asp\" or \"ssp\", or max_workers = 0)",
                    c.workers
                ),
            ));
        }
        if self.peers.enabled && c.max_ranks() > c.workers {
            return Err(invalid(
                "peers.enabled",
                format!(
                    "the peer cache tier gives each of the cluster.workers = {} ranks its own samples; ranks beyond them (cluster.max_workers) would share a rank's part: set max_workers = 0 or peers.enabled = false",
                    c.workers
                ),
            ));
        }
        if s.backup_workers > 0 && s.backup_workers as usize >= self.nodes() {
            return Err(invalid(
                "server.backup_workers",
                format!(
                    "must be below the barrier's size ({} = cluster.workers / cluster.workers_per_node): a step needs at least one push",
                    self.nodes()
                ),
            ));
        }
        let shards = c.servers.len() * c.shards_per_server;
        let num_params = self.model.num_params();
        if shards > num_params {
            return Err(invalid(
                "cluster.shards_per_server",
                format!("{shards} shards for a model of only {num_params} parameters"),
            ));
        }
        if self.training.overlap
            && (s.mode == SyncMode::Bsp || (s.mode == SyncMode::Ssp && s.staleness == 0))
        {
            return Err(invalid(
                "training.overlap",
                "needs server.mode = \"asp\", or \"ssp\" with staleness >= 1 (a one-step-stale gradient breaks bsp)",
            ));
        }
        if self.optimizer.clip_grad_norm > 0.0 {
            if self.compression.kind == CompressionKind::Topk {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    "clips dense updates only; it cannot be used with compression.kind = \"topk\" \
                     (the pushed update is sparse: the norm of the mean gradient is not known)",
                ));
            }
            if shards > 1 && s.mode != SyncMode::Bsp {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    format!(
                        "with {shards} shards needs server.mode = \"bsp\": the shards' norms are summed \
                         over one step's complete barrier, and asp/ssp apply each push on arrival"
                    ),
                ));
            }
            if shards > 1 && s.backup_workers > 0 {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    format!(
                        "with {shards} shards cannot be used with server.backup_workers = {}: a late push \
                         folded into a later update would change a step's gradient after its norm was summed",
                        s.backup_workers
                    ),
                ));
            }
        }
        if self.optimizer.worker_moments() {
            if c.workers_per_node > 1 {
                return Err(invalid(
                    "cluster.workers_per_node",
                    format!(
                        "must be 1 with optimizer.moments = \"worker\" (got {}): a node pushes the mean of its ranks' gradients, and the ranks keep no Adam moments",
                        c.workers_per_node
                    ),
                ));
            }
            if self.compression.kind == CompressionKind::Topk
                && self.compression.momentum_correction > 0.0
            {
                return Err(invalid(
                    "compression.momentum_correction",
                    format!(
                        "must be 0 with optimizer.moments = \"worker\" (got {}): Adam's first moment is the momentum already",
                        self.compression.momentum_correction
                    ),
                ));
            }
        }
        self.check_balance()?;
        let dense_frame = 64 + 4 * num_params.div_ceil(shards);
        if s.max_frame_bytes < dense_frame {
            return Err(invalid(
                "server.max_frame_bytes",
                format!(
                    "{} is smaller than one dense shard ({dense_frame} bytes)",
                    s.max_frame_bytes
                ),
            ));
        }
        if s.max_connections < c.max_ranks() {
            return Err(invalid(
                "server.max_connections",
                format!(
                    "{} is fewer than the {} workers the cluster admits (cluster.workers, cluster.max_workers)",
                    s.max_connections,
                    c.max_ranks()
                ),
            ));
        }
        Ok(())
    }

    /// The configuration as TOML with the token redacted (for `show-config`).
    pub fn to_redacted_toml(&self) -> Result<String, ConfigError> {
        let mut shown = self.clone();
        shown.cluster.token = "<redacted>".into();
        toml::to_string_pretty(&shown).map_err(|e| ConfigError::Parse {
            origin: "effective config".into(),
            message: e.to_string(),
        })
    }

    /// Total number of parameter shards.
    /// Whether workers compute the next gradient while a step's exchange is
    /// in flight (`training.overlap`, allowed in asp and ssp).
    pub fn overlaps_compute(&self) -> bool {
        self.training.overlap && self.server.mode != SyncMode::Bsp
    }

    /// Threads of a worker process's compute pool on a machine with `cpus`
    /// CPUs when `training.compute_threads` is 0 and `RAYON_NUM_THREADS`
    /// is not set: with every server on loopback the whole cluster shares
    /// this machine, so its worker processes (one per node) split the CPUs;
    /// otherwise the worker takes them all.
    pub fn compute_threads(&self, cpus: usize) -> usize {
        if self.training.compute_threads > 0 {
            return self.training.compute_threads;
        }
        let local = |addr: &String| {
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        };
        let cpus = cpus.max(1);
        if !self.cluster.servers.is_empty() && self.cluster.servers.iter().all(local) {
            (cpus / self.nodes().max(1)).max(1)
        } else {
            cpus
        }
    }

    /// `data.balance = "throughput"` needs every worker in every step's
    /// barrier, one push per worker, and gradients the servers average:
    /// bsp without backup workers, fixed ranks, no nodes, server moments,
    /// and a sample order that does not depend on the split.
    fn check_balance(&self) -> Result<(), ConfigError> {
        if self.data.balance != data::Balance::Throughput {
            return Ok(());
        }
        let s = &self.server;
        let why = |field: &'static str, what: String| {
            Err(invalid(
                field,
                format!("{what} cannot be used with data.balance = \"throughput\""),
            ))
        };
        if s.mode != SyncMode::Bsp {
            return why(
                "server.mode",
                format!(
                    "{:?} (a split is applied by every worker at the same step of a bsp barrier)",
                    s.mode
                )
                .to_lowercase(),
            );
        }
        if s.backup_workers > 0 {
            return why(
                "server.backup_workers",
                format!(
                    "{} (a straggler's skipped batches would leave samples untrained; balancing replaces backup workers)",
                    s.backup_workers
                ),
            );
        }
        if self.cluster.workers_per_node > 1 {
            return why(
                "cluster.workers_per_node",
                format!(
                    "{} (a node pushes the plain mean of its ranks' gradients)",
                    self.cluster.workers_per_node
                ),
            );
        }
        if self.optimizer.worker_moments() {
            return why(
                "optimizer.moments",
                "\"worker\" (each worker's Adam direction cannot be weighted by its batch size)"
                    .into(),
            );
        }
        if self.data.partition == crate::sampler::Partition::Stable {
            return why(
                "data.partition",
                "\"stable\" (its order interleaves equal runs per rank)".into(),
            );
        }
        if self.peers.enabled {
            return why(
                "peers.enabled",
                "true (a sample's owner is its first reader, and a split decided later changes who that is: ranks would ask owners that never read the sample)".into(),
            );
        }
        if self.cluster.workers as u64 * self.data.batch_size as u64 > u32::MAX as u64 {
            return why(
                "data.batch_size",
                "a global batch above 2^32 samples".into(),
            );
        }
        Ok(())
    }

    /// Number of nodes: `cluster.workers / cluster.workers_per_node`.
    pub fn nodes(&self) -> usize {
        self.cluster.workers / self.cluster.workers_per_node.max(1)
    }

    /// The node that runs worker `rank`.
    pub fn node_of(&self, rank: u32) -> u32 {
        rank / self.cluster.workers_per_node.max(1) as u32
    }

    /// The ranks the servers see as their clients: every rank when each
    /// worker pushes on its own, otherwise the first rank of each node
    /// (which pushes for the whole node).
    pub fn server_clients(&self) -> Vec<u32> {
        (0..self.cluster.workers as u32)
            .step_by(self.cluster.workers_per_node.max(1))
            .collect()
    }

    pub fn total_shards(&self) -> usize {
        self.cluster.servers.len() * self.cluster.shards_per_server
    }

    /// Global shard ids owned by server process `index`.
    pub fn shards_of_server(&self, index: usize) -> std::ops::Range<usize> {
        let n = self.cluster.shards_per_server;
        index * n..(index + 1) * n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_workers_admits_joiners_in_asp_and_ssp_only() {
        for mode in ["asp", "ssp"] {
            let text =
                format!("[cluster]\nworkers = 2\nmax_workers = 5\n[server]\nmode = \"{mode}\"\n");
            let cfg = ClusterConfig::from_toml_str(&text).unwrap();
            assert_eq!(cfg.cluster.max_ranks(), 5);
        }
        let err = ClusterConfig::from_toml_str(
            "[cluster]\nworkers = 2\nmax_workers = 5\n[server]\nmode = \"bsp\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("cluster.max_workers") && err.contains("bsp"),
            "{err}"
        );
        let cfg = ClusterConfig::embedded_default().unwrap();
        assert_eq!(cfg.cluster.max_ranks(), cfg.cluster.workers);
    }

    #[test]
    fn compute_threads_split_the_cpus_of_a_one_machine_cluster() {
        let mut cfg = ClusterConfig::embedded_default().unwrap();
        cfg.cluster.workers = 2;
        cfg.cluster.servers = vec!["127.0.0.1:7400".into(), "localhost:7401".into()];
        assert_eq!(cfg.compute_threads(8), 4);
        assert_eq!(cfg.compute_threads(2), 1);
        assert_eq!(cfg.compute_threads(1), 1);
        cfg.cluster.servers = vec!["[::1]:7400".into()];
        assert_eq!(cfg.compute_threads(8), 4);
        // Four ranks in two node processes: two processes share the CPUs.
        cfg.cluster.workers = 4;
        cfg.cluster.workers_per_node = 2;
        assert_eq!(cfg.compute_threads(8), 4);
        // One server elsewhere: the workers are not known to share a machine.
        cfg.cluster.servers.push("10.0.0.7:7400".into());
        assert_eq!(cfg.compute_threads(8), 8);
        // An explicit count wins, and is range-checked.
        cfg.training.compute_threads = 3;
        assert_eq!(cfg.compute_threads(8), 3);
        let err = ClusterConfig::from_toml_str("[training]\ncompute_threads = 5000\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("training.compute_threads"), "{err}");
    }

    #[test]
    fn backup_workers_below_the_barrier_are_valid_in_bsp() {
        let cfg =
            ClusterConfig::from_toml_str("[cluster]\nworkers = 3\n[server]\nbackup_workers = 2\n")
                .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.server.backup_workers, 2);
        assert_eq!(ClusterConfig::default().server.backup_workers, 0);
    }

    #[test]
    fn embedded_default_is_valid() {
        let cfg = ClusterConfig::embedded_default().unwrap();
        assert_eq!(cfg.total_shards(), 2);
        assert_eq!(cfg.cluster.workers, 2);
    }

    #[test]
    fn nodes_and_their_server_clients_follow_workers_per_node() {
        let mut cfg = ClusterConfig::embedded_default().unwrap();
        cfg.cluster.workers = 6;
        assert_eq!(cfg.nodes(), 6);
        assert_eq!(cfg.server_clients(), vec![0, 1, 2, 3, 4, 5]);
        cfg.cluster.workers_per_node = 3;
        cfg.validate().unwrap();
        assert_eq!(cfg.nodes(), 2);
        assert_eq!(cfg.server_clients(), vec![0, 3]);
        assert_eq!((cfg.node_of(2), cfg.node_of(3), cfg.node_of(5)), (0, 1, 1));
    }

    #[test]
    fn old_simulator_sections_say_where_they_moved() {
        for (text, section, hints) in [
            (
                "[link]\nbandwidth_mbit = 100.0\n",
                "[link]",
                &["--simulate FILE"][..],
            ),
            (
                "[training]\nepochs = 2\n[bucket_sim]\nenabled = false\nget_cost_per_1000 = 0.0004\n",
                "[bucket_sim]",
                &["--simulate FILE", "[bucket]", "[cost]", "get_cost_per_1000"][..],
            ),
        ] {
            let e = ClusterConfig::from_toml_str(text).unwrap_err();
            assert!(matches!(e, ConfigError::Retired { .. }), "{e:?}");
            let e = e.to_string();
            assert!(e.contains(section), "{e}");
            for hint in hints {
                assert!(e.contains(hint), "{hint} missing from {e}");
            }
        }
        // A config without them loads, with the default prices.
        let cfg = ClusterConfig::from_toml_str("[training]\nepochs = 2\n").unwrap();
        assert_eq!(cfg.cost, CostSection::default());
        assert_eq!(cfg.cost.get_cost_per_1000, 0.0004);
        assert_eq!(cfg.cost.egress_cost_per_gb, 0.09);
    }

    #[test]
    fn shipped_configs_have_no_simulator_sections() {
        for text in [
            DEFAULT_CONFIG,
            include_str!("../../../configs/mnist.toml"),
            include_str!("../../../configs/mnist-adamw.toml"),
            include_str!("../../../configs/mnist-cnn.toml"),
            include_str!("../../../configs/compose.toml"),
            include_str!("../../../configs/resnet20.toml"),
        ] {
            ClusterConfig::from_toml_str(text).unwrap();
        }
    }

    /// The error `text` (a config) gives, as a string; panics when it loads.
    pub(super) fn refused(text: &str) -> String {
        match ClusterConfig::from_toml_str(text) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn size_fields_out_of_range_are_refused_by_name() {
        for (text, field) in [
            (
                "[server]\nmax_frame_bytes = 1099511627776\n",
                "server.max_frame_bytes",
            ),
            ("[data]\nbatch_size = 0\n", "data.batch_size"),
            ("[data]\nbatch_size = 4194304\n", "data.batch_size"),
            (
                "[data]\nprefetch_batches = 1000000\n",
                "data.prefetch_batches",
            ),
            ("[model]\nhidden = [128, 1073741824]\n", "model.hidden[1]"),
            ("[model]\ninput = 1099511627776\n", "model.input"),
            (
                "[loader]\nmax_request_kb = 1099511627776\n",
                "loader.max_request_kb",
            ),
            (
                "[loader]\nmax_inflight_mb = 1e300\n",
                "loader.max_inflight_mb",
            ),
            (
                "[loader]\nlookahead_samples = 1099511627776\n",
                "loader.lookahead_samples",
            ),
        ] {
            let e = refused(text);
            assert!(
                e.contains(&format!("{field} = ")) && e.contains("is out of range"),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn count_fields_out_of_range_are_refused_by_name() {
        for (text, field) in [
            ("[training]\nepochs = 0\n", "training.epochs"),
            ("[training]\nepochs = 1000000000\n", "training.epochs"),
            ("[cluster]\nworkers = 5000\n", "cluster.workers"),
            (
                "[server]\ncheckpoint_max_failures = 5000\n",
                "server.checkpoint_max_failures",
            ),
            (
                "[server]\nmax_connections = 1000000\n",
                "server.max_connections",
            ),
            ("[server]\nio_threads = 0\n", "server.io_threads"),
            (
                "[compression]\nwarmup_steps = 18446744073709551615\n",
                "compression.warmup_steps",
            ),
        ] {
            let e = refused(text);
            assert!(
                e.contains(&format!("{field} = ")) && e.contains("is out of range"),
                "{text}: {e}"
            );
        }
        let cfg = ClusterConfig::embedded_default().unwrap();
        assert_eq!(cfg.server.checkpoint_max_failures, 3);
    }

    #[test]
    fn every_shipped_config_is_in_range() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for dir in [
            "configs",
            "deploy/kubernetes/base",
            "deploy/kubernetes/overlays/scale",
        ] {
            for entry in std::fs::read_dir(root.join(dir)).expect(dir) {
                let path = entry.expect("a directory entry").path();
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // Simulation files are not cluster configs.
                if name.ends_with(".toml") && !name.starts_with("simulate") {
                    files.push(path);
                }
            }
        }
        assert!(files.len() >= 7, "{files:?}");
        for path in &files {
            ClusterConfig::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }

    #[test]
    fn seconds_convert_without_panicking() {
        assert_eq!(secs(0.25), Duration::from_millis(250));
        for v in [f64::NAN, -1.0, -0.0, 0.0, f64::NEG_INFINITY] {
            assert_eq!(secs(v), Duration::ZERO, "{v}");
        }
        let cap = Duration::from_secs_f64(MAX_DURATION_SECS);
        for v in [1e19, 1e300, f64::INFINITY, f64::MAX] {
            assert_eq!(secs(v), cap, "{v}");
        }
        // A capped deadline can still be added to the clock.
        assert!(std::time::Instant::now().checked_add(cap).is_some());
    }

    #[test]
    fn unknown_field_is_rejected() {
        let e = ClusterConfig::from_toml_str("[optimizer]\nlearning_rate = 0.1\n").unwrap_err();
        assert!(e.to_string().contains("learning_rate"), "{e}");
    }

    #[test]
    fn bad_values_name_their_field() {
        for (text, field) in [
            ("[optimizer]\nlr = 0.0\n", "optimizer.lr"),
            ("[optimizer]\nmomentum = 1.5\n", "optimizer.momentum"),
            ("[cluster]\nservers = []\n", "cluster.servers"),
            ("[cluster]\nservers = [\"nohost\"]\n", "cluster.servers"),
            ("[cluster]\nworkers = 0\n", "cluster.workers"),
            (
                "[cluster]\nworkers = 4\nmax_workers = 2\n[server]\nmode = \"asp\"\n",
                "cluster.max_workers",
            ),
            // Joining beyond the starting count is refused for bsp.
            ("[cluster]\nmax_workers = 4\n", "cluster.max_workers"),
            (
                "[cluster]\nworkers = 4\nmax_workers = 6\nworkers_per_node = 2\n[server]\nmode = \"asp\"\n",
                "cluster.max_workers",
            ),
            (
                "[cluster]\nworkers = 4\nworkers_per_node = 3\n",
                "cluster.workers_per_node",
            ),
            (
                "[cluster]\nworkers_per_node = 0\n",
                "cluster.workers_per_node",
            ),
            // Backup workers: bsp only, and below the barrier's size.
            (
                "[cluster]\nworkers = 3\n[server]\nmode = \"asp\"\nbackup_workers = 1\n",
                "server.backup_workers",
            ),
            (
                "[cluster]\nworkers = 3\n[server]\nbackup_workers = 3\n",
                "server.backup_workers",
            ),
            (
                "[cluster]\nworkers = 4\nworkers_per_node = 2\n[server]\nbackup_workers = 2\n",
                "server.backup_workers",
            ),
            ("[cluster]\ntoken = \"short\"\n", "cluster.token"),
            // Throughput balancing: bsp, every worker in every step.
            ("[data]\nbalance_every = 0\n", "data.balance_every"),
            (
                "[cluster]\nworkers = 3\n[data]\nbalance = \"throughput\"\n[server]\nbackup_workers = 1\n",
                "server.backup_workers",
            ),
            (
                "[data]\nbalance = \"throughput\"\n[server]\nmode = \"asp\"\n",
                "server.mode",
            ),
            (
                "[data]\nbalance = \"throughput\"\npartition = \"stable\"\n",
                "data.partition",
            ),
            (
                "[cluster]\nworkers = 4\nworkers_per_node = 2\n[data]\nbalance = \"throughput\"\n",
                "cluster.workers_per_node",
            ),
            (
                "[data]\nbalance = \"throughput\"\n[optimizer]\nkind = \"adam\"\nmoments = \"worker\"\n",
                "optimizer.moments",
            ),
            (
                "[data]\nbalance = \"throughput\"\n[peers]\nenabled = true\n",
                "peers.enabled",
            ),
            (
                "[cluster]\nmax_workers = 4\n[server]\nmode = \"asp\"\n[peers]\nenabled = true\n",
                "peers.enabled",
            ),
            ("[data]\nbatch_size = 0\n", "data.batch_size"),
            ("[data]\ndecode_threads = 0\n", "data.decode_threads"),
            (
                "[data.augment]\nmean = [0.5, 0.5]\nstd = [1.0]\n",
                "data.augment.std",
            ),
            ("[data.augment]\nstd = [0.0]\n", "data.augment.std"),
            ("[compression]\ndensity = 0.0\n", "compression.density"),
            ("[training]\ndevice = \"tpu\"\n", "training.device"),
            (
                "[training]\ntarget_accuracy = 97.0\n",
                "training.target_accuracy",
            ),
            ("[training]\ntarget_loss = -1.0\n", "training.target_loss"),
            ("[training]\ntarget_loss = nan\n", "training.target_loss"),
            ("[model]\nhidden = [0]\n", "model"),
            (
                "[model]\nkind = \"cnn\"\ninput = 63\nconv = [4]\n",
                "model.input",
            ),
            ("[model]\nkind = \"cnn\"\ninput = 64\n", "model.conv"),
            (
                "[model]\nkind = \"cnn\"\ninput = 36\nconv = [4, 4]\n",
                "model.conv",
            ),
        ] {
            let e = ClusterConfig::from_toml_str(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?} gave {e}");
        }
    }
}

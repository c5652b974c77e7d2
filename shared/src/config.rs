//! Cluster configuration: one TOML file read by both `ps-server` and `ps-worker`.
//!
//! Every field has a default, so a file only names what it changes; unknown
//! fields are rejected (a typo must not silently fall back to a default), and
//! [`ClusterConfig::validate`] checks every value with a message that names the
//! field. The embedded default is `configs/local.toml`.
//!
//! ```
//! use ps_shared::config::ClusterConfig;
//! let cfg = ClusterConfig::from_toml_str("[training]\nepochs = 3\n").unwrap();
//! assert_eq!(cfg.training.epochs, 3);
//! assert!(ClusterConfig::from_toml_str("[optimizer]\nlr = -1.0\n").is_err());
//! ```

use std::borrow::Cow;
use std::hash::Hasher;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::dataplane::{CostSection, LoaderSection};
use crate::layers::{plan, resnet, LayerSpec, Node, Shape};
use crate::sampler::Partition;
use crate::sparse::Compressor;
pub use crate::sparse::{CompressionKind, CompressionSection};

/// The configuration shipped with the binaries (`configs/local.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/local.toml");

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

/// Who is in the cluster and how the parameter space is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// One `host:port` per ps-server process, in order; server `i` owns the
    /// `shards_per_server` shards that follow those of servers `0..i`.
    pub servers: Vec<String>,
    /// Parameter shards (one actor each) per server process.
    pub shards_per_server: usize,
    /// Number of workers; ranks are `0..workers`. BSP waits for all of them.
    /// The sample order is split across this many workers; a run resumed
    /// from a checkpoint may use another count (see docs/failures.md,
    /// "Changing the worker count").
    pub workers: usize,
    /// Largest number of workers an `asp` or `ssp` job admits while it runs:
    /// ranks `workers..max_workers` may join beyond the starting count. 0
    /// (the default) means `workers`: nobody joins beyond it. A `bsp`
    /// barrier has a fixed size, so there it must be 0 or `workers`.
    pub max_workers: usize,
    /// Worker ranks per node (one per GPU). Above 1, the ranks of a node
    /// (node `n` holds ranks `n * workers_per_node ..`) hand their
    /// gradients to a node aggregator that sums them, compresses the sum
    /// and pushes once per node; the servers see each node as its first
    /// rank. 1 = every worker pushes on its own. Must divide `workers`.
    pub workers_per_node: usize,
    /// Shared secret workers present when they connect (overridden by `STRATUS_TOKEN`).
    pub token: String,
}

impl ClusterSection {
    /// How many ranks may be in the job at once: `max_workers`, or
    /// `workers` when it is 0.
    pub fn max_ranks(&self) -> usize {
        if self.max_workers == 0 {
            self.workers
        } else {
            self.max_workers.max(self.workers)
        }
    }
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            servers: vec!["127.0.0.1:7400".into()],
            shards_per_server: 2,
            workers: 2,
            max_workers: 0,
            workers_per_node: 1,
            token: "stratus-dev-token".into(),
        }
    }
}

impl ClusterSection {
    /// Ranges of the counts not checked against other fields.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("cluster.servers (count)", self.servers.len(), 1..=4096)?;
        check_range(
            "cluster.shards_per_server",
            self.shards_per_server,
            1..=1024,
        )?;
        check_range("cluster.workers", self.workers, 1..=4096)?;
        check_range("cluster.workers_per_node", self.workers_per_node, 1..=1024)
    }
}

/// TLS material. QUIC always runs TLS 1.3 with mutual authentication: the
/// servers and every worker rank hold certificates issued by one cluster CA,
/// and a worker's rank is the one in its certificate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// Server certificate chain (PEM), issued by the cluster CA.
    pub cert: PathBuf,
    /// Server private key (PEM).
    pub key: PathBuf,
    /// The cluster CA certificate (PEM): servers and workers trust only it.
    pub ca: PathBuf,
    /// The cluster CA key (PEM); only `ps-server certs` (or a first start
    /// with `generate_if_missing`) reads it, to issue certificates.
    pub ca_key: PathBuf,
    /// Worker certificate (PEM); `{rank}` is replaced by the worker's rank.
    pub worker_cert: String,
    /// Worker private key (PEM); `{rank}` is replaced by the worker's rank.
    pub worker_key: String,
    /// Name the workers expect in the server certificate.
    pub server_name: String,
    /// Create the CA and any missing server or worker certificate on a
    /// server's start (development clusters). Files already there are kept
    /// as they are; a missing certificate needs `ca_key` when `ca` exists.
    pub generate_if_missing: bool,
}

impl Default for TlsSection {
    fn default() -> Self {
        Self {
            cert: "certs/server.pem".into(),
            key: "certs/server.key".into(),
            ca: "certs/ca.pem".into(),
            ca_key: "certs/ca.key".into(),
            worker_cert: "certs/worker-{rank}.pem".into(),
            worker_key: "certs/worker-{rank}.key".into(),
            server_name: "localhost".into(),
            generate_if_missing: true,
        }
    }
}

impl TlsSection {
    /// Certificate and key paths of worker `rank`.
    pub fn worker_paths(&self, rank: u32) -> (PathBuf, PathBuf) {
        let fill = |t: &str| PathBuf::from(t.replace("{rank}", &rank.to_string()));
        (fill(&self.worker_cert), fill(&self.worker_key))
    }
}

/// Model architecture kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Fully connected layers with ReLU.
    Mlp,
    /// 3x3 convolutions (ReLU, 2x2 max-pool each) on square images, then fully connected layers.
    Cnn,
    /// The layers listed in `model.layers` (see [`crate::layers`]).
    Layers,
    /// CIFAR-style ResNet-20: 3x3 conv 16, three stages of three basic
    /// blocks (16/32/64 channels, strides 1/2/2), global average pool, linear.
    Resnet20,
    /// ResNet-18 with a CIFAR-style stem (one 3x3 conv, stride 1, no
    /// max-pool): four stages of two basic blocks (64/128/256/512 channels,
    /// strides 1/2/2/2), global average pool, linear.
    Resnet18,
    /// A GPT-style decoder-only transformer on token windows (sizes in
    /// `[model.gpt]`).
    Gpt,
    /// A model the worker program brings through the library API
    /// (`ps_worker::api`): its tensors are listed in `model.tensors`, in
    /// flat-space order, so the servers can lay out the shards without
    /// knowing the network.
    Custom,
}

/// One tensor of a `kind = "custom"` model (`[[model.tensors]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorDecl {
    pub name: String,
    pub shape: Vec<usize>,
}

/// The model both sides agree on: it fixes the flat parameter space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    pub kind: ModelKind,
    /// Input features; must match the dataset.
    pub input: usize,
    /// Hidden layer widths.
    pub hidden: Vec<usize>,
    /// Output classes; must match the dataset.
    pub classes: usize,
    /// CNN: image channels; the image is square, `input = in_channels * side^2`.
    pub in_channels: usize,
    /// CNN: output channels of each 3x3 convolution (each halves the side).
    pub conv: Vec<usize>,
    /// `kind = "layers"`: the layers, in order (`[[model.layers]]` tables).
    pub layers: Vec<LayerSpec>,
    /// ResNet presets: channel multiplier of every stage (0.25 turns
    /// ResNet-20's 16/32/64 into 4/8/16).
    pub width: f64,
    /// Models with batch norm: the last training batches a worker runs
    /// forward to recompute the running statistics before each evaluation.
    pub bn_calibration_batches: usize,
    /// `kind = "custom"`: the model's tensors in flat-space order (the
    /// library's `CustomModel::config_tensors` prints this list).
    pub tensors: Vec<TensorDecl>,
    /// `kind = "gpt"`: the transformer's sizes.
    pub gpt: GptSection,
}

/// Sizes of the GPT preset (`[model.gpt]`). Its tensors follow a
/// nanoGPT-like naming (`wte.weight`, `h.0.attn.c_attn.weight`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptSection {
    /// Tokens in the vocabulary (must match the text dataset's).
    pub vocab: usize,
    /// Context length: tokens per input window (the dataset's windows hold
    /// `seq_len + 1` tokens).
    pub seq_len: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Decoder blocks.
    pub n_layer: usize,
    /// Attention heads; must divide `d_model`.
    pub n_head: usize,
    /// Hidden width of each block's MLP; 0 means `4 * d_model`.
    pub d_ff: usize,
    /// Dropout probability on the embeddings, attention weights and
    /// residual branches (0 turns it off).
    pub dropout: f64,
}

impl Default for GptSection {
    fn default() -> Self {
        Self {
            vocab: 256,
            seq_len: 64,
            d_model: 64,
            n_layer: 2,
            n_head: 4,
            d_ff: 0,
            dropout: 0.0,
        }
    }
}

impl GptSection {
    /// The MLP's hidden width (`d_ff`, or `4 * d_model` when 0).
    pub fn hidden(&self) -> usize {
        if self.d_ff == 0 {
            4 * self.d_model
        } else {
            self.d_ff
        }
    }

    /// Sizes in range, heads dividing the width, token ids exact in f32.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_range("model.gpt.vocab", self.vocab, 2..=1 << 24)?;
        check_range("model.gpt.seq_len", self.seq_len, 1..=1 << 16)?;
        check_range("model.gpt.d_model", self.d_model, 1..=1 << 16)?;
        check_range("model.gpt.n_layer", self.n_layer, 1..=1024)?;
        check_range("model.gpt.n_head", self.n_head, 1..=1024)?;
        check_range("model.gpt.d_ff", self.d_ff, 0..=1 << 18)?;
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(invalid(
                "model.gpt.n_head",
                format!(
                    "must divide model.gpt.d_model = {} (got {})",
                    self.d_model, self.n_head
                ),
            ));
        }
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            return Err(invalid("model.gpt.dropout", "must be in [0, 1)"));
        }
        Ok(())
    }

    /// The tensors in flat-space order.
    pub fn layout(&self) -> Vec<TensorSpec> {
        let d = self.d_model;
        let f = self.hidden();
        let t = |name: String, shape: Vec<usize>| TensorSpec { name, shape };
        let mut out = vec![
            t("wte.weight".into(), vec![self.vocab, d]),
            t("wpe.weight".into(), vec![self.seq_len, d]),
        ];
        for i in 0..self.n_layer {
            let p = format!("h.{i}");
            out.extend([
                t(format!("{p}.ln_1.weight"), vec![d]),
                t(format!("{p}.ln_1.bias"), vec![d]),
                t(format!("{p}.attn.c_attn.weight"), vec![3 * d, d]),
                t(format!("{p}.attn.c_attn.bias"), vec![3 * d]),
                t(format!("{p}.attn.c_proj.weight"), vec![d, d]),
                t(format!("{p}.attn.c_proj.bias"), vec![d]),
                t(format!("{p}.ln_2.weight"), vec![d]),
                t(format!("{p}.ln_2.bias"), vec![d]),
                t(format!("{p}.mlp.c_fc.weight"), vec![f, d]),
                t(format!("{p}.mlp.c_fc.bias"), vec![f]),
                t(format!("{p}.mlp.c_proj.weight"), vec![d, f]),
                t(format!("{p}.mlp.c_proj.bias"), vec![d]),
            ]);
        }
        out.push(t("ln_f.weight".into(), vec![d]));
        out.push(t("ln_f.bias".into(), vec![d]));
        out
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            kind: ModelKind::Mlp,
            input: 64,
            hidden: vec![128],
            classes: 10,
            in_channels: 1,
            conv: Vec::new(),
            layers: Vec::new(),
            width: 1.0,
            bn_calibration_batches: 8,
            tensors: Vec::new(),
            gpt: GptSection::default(),
        }
    }
}

impl ModelSection {
    /// Sizes of the model: widths and counts, each bounded so that no
    /// product of two of them overflows or asks for more memory than a
    /// host has.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("model.input", self.input, 1..=1 << 26)?;
        check_range("model.classes", self.classes, 2..=1 << 20)?;
        check_range("model.in_channels", self.in_channels, 1..=4096)?;
        for (i, &w) in self.hidden.iter().enumerate() {
            check_range(format!("model.hidden[{i}]"), w, 1..=1 << 20)?;
        }
        for (i, &w) in self.conv.iter().enumerate() {
            check_range(format!("model.conv[{i}]"), w, 1..=1 << 16)?;
        }
        check_range(
            "model.bn_calibration_batches",
            self.bn_calibration_batches,
            1..=100_000,
        )
    }
}

/// One named tensor of the model, in flat-space order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The tensors of a custom model: at least one, each with a unique,
/// printable name and a shape of 1 to 8 non-zero dimensions, and not more
/// than 2^32 - 1 values in all (the flat index space is u32).
fn check_tensor_decls(tensors: &[TensorDecl]) -> Result<(), ConfigError> {
    if tensors.is_empty() {
        return Err(invalid(
            "model.tensors",
            "a custom model lists its tensors ([[model.tensors]] with name and shape)",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total: u64 = 0;
    for (i, t) in tensors.iter().enumerate() {
        let field = format!("model.tensors[{i}]");
        let printable = |c: char| c.is_ascii_graphic();
        if t.name.is_empty() || t.name.len() > 256 || !t.name.chars().all(printable) {
            return Err(invalid(
                format!("{field}.name"),
                format!(
                    "`{}` must be 1 to 256 printable ASCII characters without spaces",
                    t.name
                ),
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(invalid(
                format!("{field}.name"),
                format!("`{}` is listed twice", t.name),
            ));
        }
        if t.shape.is_empty() || t.shape.len() > 8 || t.shape.contains(&0) {
            return Err(invalid(
                format!("{field}.shape"),
                format!(
                    "{:?} (tensor `{}`) needs 1 to 8 dimensions, each >= 1",
                    t.shape, t.name
                ),
            ));
        }
        let numel = t
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        total = numel
            .and_then(|n| total.checked_add(n))
            .filter(|&n| n < u64::from(u32::MAX))
            .ok_or_else(|| {
                invalid(
                    format!("{field}.shape"),
                    "the model's tensors hold 2^32 or more values; the flat index space is 32-bit",
                )
            })?;
    }
    Ok(())
}

impl ModelSection {
    /// The model's tensors in the fixed order of the flat parameter space.
    pub fn layout(&self) -> Vec<TensorSpec> {
        if self.kind == ModelKind::Custom {
            return self
                .tensors
                .iter()
                .map(|t| TensorSpec {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                })
                .collect();
        }
        if self.kind == ModelKind::Gpt {
            return self.gpt.layout();
        }
        if self.is_layered() {
            return self
                .nodes()
                .unwrap_or_default()
                .iter()
                .flat_map(Node::params)
                .map(|p| TensorSpec {
                    name: p.name,
                    shape: p.shape,
                })
                .collect();
        }
        let mut out = Vec::new();
        let mut flat_in = self.input;
        if self.kind == ModelKind::Cnn {
            let mut channels = self.in_channels;
            for (i, &c) in self.conv.iter().enumerate() {
                out.push(TensorSpec {
                    name: format!("conv{i}.weight"),
                    shape: vec![c, channels, 3, 3],
                });
                out.push(TensorSpec {
                    name: format!("conv{i}.bias"),
                    shape: vec![c],
                });
                channels = c;
            }
            let side = self.image_side().unwrap_or(0) >> self.conv.len();
            flat_in = channels * side * side;
        }
        let mut dims = vec![flat_in];
        dims.extend(&self.hidden);
        dims.push(self.classes);
        for (i, pair) in dims.windows(2).enumerate() {
            out.push(TensorSpec {
                name: format!("fc{i}.weight"),
                shape: vec![pair[1], pair[0]],
            });
            out.push(TensorSpec {
                name: format!("fc{i}.bias"),
                shape: vec![pair[1]],
            });
        }
        out
    }

    /// Whether the model is a list of layers (`layers` or a ResNet preset).
    pub fn is_layered(&self) -> bool {
        matches!(
            self.kind,
            ModelKind::Layers | ModelKind::Resnet20 | ModelKind::Resnet18
        )
    }

    /// The named layers of a layered model (presets expanded); empty for
    /// the MLP and the CNN.
    pub fn named_layers(&self) -> Vec<(String, LayerSpec)> {
        let classes = self.classes;
        match self.kind {
            ModelKind::Mlp | ModelKind::Cnn | ModelKind::Custom | ModelKind::Gpt => Vec::new(),
            ModelKind::Layers => self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| (format!("layers.{i}"), l.clone()))
                .collect(),
            ModelKind::Resnet20 => resnet(&[16, 32, 64], 3, &[1, 2, 2], self.width, classes),
            ModelKind::Resnet18 => {
                resnet(&[64, 128, 256, 512], 2, &[1, 2, 2, 2], self.width, classes)
            }
        }
    }

    /// The validated layers of a layered model with their shapes: the input
    /// is `[in_channels, side, side]` and the last layer gives `classes`.
    pub fn nodes(&self) -> Result<Vec<Node>, ConfigError> {
        let Some(side) = self.image_side() else {
            return Err(invalid(
                "model.input",
                format!(
                    "a {} model needs input = in_channels * side^2; {} is not {} x a square",
                    self.kind_name(),
                    self.input,
                    self.in_channels
                ),
            ));
        };
        let layers = self.named_layers();
        let listed = self.kind == ModelKind::Layers;
        if layers.is_empty() {
            return Err(invalid("model.layers", "list at least one layer"));
        }
        let input = Shape::Image {
            c: self.in_channels,
            h: side,
            w: side,
        };
        let field = |i: usize| {
            if listed {
                format!("model.layers[{i}]")
            } else {
                format!("model.kind ({} layer {i})", self.kind_name())
            }
        };
        let nodes = plan(&layers, input, field).map_err(|(f, m)| invalid(f, m))?;
        let last = nodes.last().map_or(input, |n| n.output);
        if last != Shape::Flat(self.classes) {
            let at = nodes.len() - 1;
            let f = match nodes[at].layer {
                LayerSpec::Linear { .. } if listed => format!("model.layers[{at}].out"),
                _ => "model.layers".to_string(),
            };
            return Err(invalid(
                f,
                format!(
                    "the last layer gives {last}; it must give classes = {} outputs",
                    self.classes
                ),
            ));
        }
        Ok(nodes)
    }

    fn kind_name(&self) -> String {
        format!("{:?}", self.kind).to_lowercase()
    }

    /// Whether the model has batch-norm layers (and so running statistics).
    pub fn has_batch_norm(&self) -> bool {
        self.is_layered()
            && self
                .nodes()
                .is_ok_and(|n| n.iter().any(|n| n.batch_norms() > 0))
    }

    /// CNN: the side of the square input image, if `input` is one.
    pub fn image_side(&self) -> Option<usize> {
        if self.in_channels == 0 || !self.input.is_multiple_of(self.in_channels) {
            return None;
        }
        let area = self.input / self.in_channels;
        let side = (area as f64).sqrt().round() as usize;
        (side * side == area).then_some(side)
    }

    /// Size P of the flat parameter space.
    pub fn num_params(&self) -> usize {
        self.layout().iter().map(TensorSpec::numel).sum()
    }

    /// Global ranges of each tensor in the flat space.
    pub fn tensor_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut start = 0;
        self.layout()
            .iter()
            .map(|t| {
                let r = start..start + t.numel();
                start = r.end;
                r
            })
            .collect()
    }

    /// A fingerprint of the layout, exchanged at connect time so a worker and
    /// a server built from different model configs refuse each other.
    pub fn layout_hash(&self) -> u64 {
        // FNV-1a over the tensor names and shapes: stable across builds.
        let mut h = fnv::FnvHasher::default();
        for t in self.layout() {
            h.write(t.name.as_bytes());
            for d in &t.shape {
                h.write(&(*d as u64).to_le_bytes());
            }
        }
        h.finish()
    }
}

/// Where the training data lives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Bucket URL of the dataset: `file://dir` (relative to the working directory
    /// or absolute), `memory://`, `s3://`, `gs://` or `az://bucket/prefix` (credentials from the AWS_*, GOOGLE_* or AZURE_* variables).
    pub url: String,
    /// Samples per step on each worker.
    pub batch_size: usize,
    /// Seed of the per-epoch sample order.
    pub seed: u64,
    /// Batches the loader keeps fetched ahead of the trainer.
    pub prefetch_batches: usize,
    /// `reshuffle` (a new random split across ranks every epoch) or `stable`
    /// (each rank keeps its part and shuffles within it: caches stay useful).
    pub partition: Partition,
    /// Image datasets: threads that decode and augment images (per worker).
    pub decode_threads: usize,
    /// Image datasets: `stop` the run at a sample that cannot be decoded, or
    /// `skip` it (the loader counts and logs it).
    pub on_bad_sample: OnBadSample,
    /// Image datasets: augmentation of training images.
    pub augment: AugmentSection,
}

impl DataSection {
    /// Batch and prefetch sizes.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("data.batch_size", self.batch_size, 1..=1 << 20)?;
        check_range("data.prefetch_batches", self.prefetch_batches, 1..=65_536)?;
        check_range("data.decode_threads", self.decode_threads, 1..=256)
    }
}

/// What the loader does with a sample it cannot decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadSample {
    #[default]
    Stop,
    Skip,
}

/// Augmentation of training images; evaluation only normalises. Each
/// sample's crop and flip are drawn from `(data.seed, epoch, sample)`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AugmentSection {
    /// Random crop of the image's size after zero padding of this many pixels.
    pub pad: usize,
    /// Random left-right flip.
    pub hflip: bool,
    /// Per-channel mean to subtract (values in 0..1); empty: none.
    pub mean: Vec<f32>,
    /// Per-channel standard deviation to divide by; empty: none.
    pub std: Vec<f32>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            url: "file://data/synthetic".into(),
            batch_size: 64,
            seed: 42,
            prefetch_batches: 4,
            partition: Partition::Reshuffle,
            decode_threads: 2,
            on_bad_sample: OnBadSample::Stop,
            augment: AugmentSection::default(),
        }
    }
}

/// Training loop settings (worker side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    pub epochs: u64,
    /// `cpu`, or `cuda` / `cuda:N` when built with the `cuda` feature.
    pub device: String,
    /// Seed of the initial weights (the first worker's initial weights win).
    pub init_seed: u64,
    /// Directory for per-epoch metrics (`worker-<rank>.jsonl` and `.csv`);
    /// empty disables.
    pub metrics_dir: String,
    /// Evaluate on the test split every this many steps (0 = only at the end
    /// of each epoch). Evaluation time is not counted as training time.
    pub eval_every: u64,
    /// Also write a per-step record (loss, learning rate, data, compute,
    /// compress and exchange seconds, bytes) to `worker-<rank>.jsonl`
    /// every this many steps (0 = per-epoch records only).
    pub step_metrics_every: u64,
    /// Stop (saying goodbye) after the evaluation that reaches this test
    /// accuracy, in [0, 1] (0 = train every epoch).
    pub target_accuracy: f32,
    /// Stop after this many steps of the run (0 = no cap).
    pub max_steps: u64,
    /// asp/ssp only: compute the next step's gradient while this step's
    /// push and pull are in flight (the gradient is one step stale).
    pub overlap: bool,
    /// Threads of a worker process's compute pool (forward, backward,
    /// compression). 0 = automatic: `RAYON_NUM_THREADS` when set, else the
    /// CPUs divided among the worker processes when every server is on
    /// loopback (the whole cluster on one machine), else every CPU.
    pub compute_threads: usize,
}

impl Default for TrainingSection {
    fn default() -> Self {
        Self {
            epochs: 5,
            device: "cpu".into(),
            init_seed: 1,
            metrics_dir: "runs".into(),
            eval_every: 0,
            step_metrics_every: 10,
            target_accuracy: 0.0,
            max_steps: 0,
            overlap: false,
            compute_threads: 0,
        }
    }
}

impl TrainingSection {
    /// Step and epoch counts.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("training.epochs", self.epochs, 1..=1_000_000)?;
        check_range("training.eval_every", self.eval_every, 0..=1 << 40)?;
        check_range(
            "training.step_metrics_every",
            self.step_metrics_every,
            0..=1 << 40,
        )?;
        check_range("training.max_steps", self.max_steps, 0..=1 << 48)?;
        check_range("training.compute_threads", self.compute_threads, 0..=1024)
    }
}

impl CompressionSection {
    /// Step counts (the fractions are checked by [`Self::validate`]).
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("compression.warmup_steps", self.warmup_steps, 0..=1 << 40)
    }
}

impl CompressionSection {
    /// The compressor for `num_params` parameters, or `None` with
    /// `kind = "none"` (dense gradients need none).
    pub fn compressor(&self, num_params: usize) -> Option<Compressor> {
        match self.kind {
            CompressionKind::None => None,
            CompressionKind::Topk => Some(Compressor::new(num_params, self.clone())),
        }
    }

    /// The top-k settings' ranges, whatever `kind` says: density in (0, 1],
    /// momentum correction in [0, 1), clip norm finite and >= 0, and with
    /// warm-up on a start density in [density, 1].
    pub fn validate(&self) -> Result<(), String> {
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

/// Server-side optimizer, applied once per step to the aggregated gradient;
/// the server's update kernels (`ps_server::optimizer`) take it as it is.
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
    /// before the update (0 = off).
    pub clip_grad_norm: f32,
    /// Learning-rate schedule by global step.
    pub schedule: ScheduleSection,
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
        }
    }
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

    fn check(&self, lr: f32) -> Result<(), ConfigError> {
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

/// Synchronisation modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// Bulk synchronous: every live worker's push for step t before the update.
    Bsp,
    /// Asynchronous: each push is applied on arrival; pulls never wait.
    Asp,
    /// Stale synchronous: applied on arrival, workers at most `server.staleness` steps apart.
    Ssp,
}

/// What the server does with a push whose norm exceeds `server.max_grad_norm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradNormPolicy {
    /// Scale the push down to the bound.
    Clip,
    /// Refuse the push with a typed error.
    Refuse,
}

/// Server-process settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub mode: SyncMode,
    /// SSP bound: how many steps the fastest worker may run ahead of the slowest.
    pub staleness: u64,
    /// A worker silent for this long (no request, no heartbeat) is dropped from
    /// the barrier; it may rejoin later.
    pub worker_timeout_secs: f64,
    /// How often workers send a heartbeat.
    pub heartbeat_secs: f64,
    /// Requests per second one connection may make (token bucket, burst = 1 s); 0 = unlimited.
    pub max_requests_per_sec: u32,
    /// Object-store URL for shard checkpoints (`file://dir`, `s3://...`); empty disables.
    pub checkpoint_url: String,
    /// Checkpoint every N updates of a shard (0 disables).
    pub checkpoint_every: u64,
    /// Checkpoint writes of one shard that may fail in a row (each is
    /// logged, counted and retried at the next checkpoint); one more stops
    /// the server with an error. A failed final checkpoint always does.
    pub checkpoint_max_failures: u32,
    /// Stop the server once every worker has said goodbye.
    pub exit_when_done: bool,
    /// Largest frame accepted on the wire, in bytes.
    pub max_frame_bytes: usize,
    /// Seconds a worker keeps trying to reach a server (at start, and after
    /// losing it) before it gives up with an error.
    pub connect_timeout_secs: u64,
    /// Seconds a new connection has to finish TLS and send its Hello.
    pub hello_timeout_secs: f64,
    /// Deadline of every request: a reply that cannot be given within it
    /// (e.g. a barrier waiting for a stuck worker) is answered with Timeout.
    pub request_timeout_secs: f64,
    /// QUIC idle timeout: a peer silent this long (keep-alives included) is
    /// dead. Keep-alives go out every `heartbeat_secs`.
    pub idle_timeout_secs: f64,
    /// Connections a server accepts at once, and unauthenticated ones among them.
    pub max_connections: usize,
    pub max_unauthenticated: usize,
    /// Unauthenticated connections from one source address; past it, that
    /// source's oldest one is closed to make room.
    pub max_unauthenticated_per_source: usize,
    /// A server with no worker after this many seconds exits with an error;
    /// a rank that has not joined by then leaves the barrier.
    pub join_timeout_secs: f64,
    /// A server whose workers have all been gone (without finishing) this
    /// long exits with an error.
    pub all_gone_grace_secs: f64,
    /// A starting shard waits this long after the first worker's offer for
    /// the other workers' copies (it decides at once when all have offered).
    pub recovery_window_secs: f64,
    /// Largest L2 norm of one worker's push to one shard (0 = no bound).
    pub max_grad_norm: f32,
    /// `clip` (scale down to the bound) or `refuse`.
    pub grad_norm_policy: GradNormPolicy,
    /// Largest L2 norm of one push to one shard the server ever applies,
    /// whatever `max_grad_norm` says (0 = none). A push above it is scaled
    /// down to it, or refused under `grad_norm_policy = "refuse"`. It also
    /// keeps the sum of one step's pushes finite.
    pub grad_norm_ceiling: f32,
    /// A push whose norm is more than this many times the median norm of
    /// the shard's recent pushes is scaled down to that median, or refused
    /// under `grad_norm_policy = "refuse"` (0 = off).
    pub grad_anomaly_factor: f32,
    /// Pushes a shard takes before the anomaly check starts (only the
    /// ceiling applies to them).
    pub grad_anomaly_warmup: u32,
    /// Recovery: how many periodic checkpoint writes may have failed or
    /// still been under way when a server was lost. A workers' copy more
    /// than `checkpoint_every × (1 + this)` versions past the newest
    /// checkpoint is refused.
    pub recovery_checkpoint_slack: u64,
    /// Threads that run QUIC I/O and decoding.
    pub io_threads: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            mode: SyncMode::Bsp,
            staleness: 2,
            worker_timeout_secs: 10.0,
            heartbeat_secs: 1.0,
            max_requests_per_sec: 2000,
            checkpoint_url: String::new(),
            checkpoint_every: 0,
            checkpoint_max_failures: 3,
            exit_when_done: true,
            max_frame_bytes: 256 << 20,
            connect_timeout_secs: 30,
            hello_timeout_secs: 5.0,
            request_timeout_secs: 120.0,
            idle_timeout_secs: 5.0,
            max_connections: 256,
            max_unauthenticated: 32,
            max_unauthenticated_per_source: 8,
            join_timeout_secs: 300.0,
            all_gone_grace_secs: 60.0,
            recovery_window_secs: 10.0,
            max_grad_norm: 0.0,
            grad_norm_policy: GradNormPolicy::Clip,
            grad_norm_ceiling: 1.0e6,
            grad_anomaly_factor: 100.0,
            grad_anomaly_warmup: 3,
            recovery_checkpoint_slack: 4,
            io_threads: 2,
        }
    }
}

impl ServerSection {
    /// Time fields in seconds and their ranges: below the low end a timer
    /// spins (a heartbeat of 1e-10 s hangs the run), above the high end a
    /// deadline overflows the clock (a request timeout of 1e19 s panics the
    /// shards).
    const SECONDS: [(&'static str, RangeInclusive<f64>); 8] = [
        ("server.heartbeat_secs", 0.01..=600.0),
        ("server.worker_timeout_secs", 0.02..=86_400.0),
        ("server.idle_timeout_secs", 0.02..=86_400.0),
        ("server.hello_timeout_secs", 0.1..=3_600.0),
        ("server.request_timeout_secs", 0.1..=86_400.0),
        ("server.join_timeout_secs", 0.1..=604_800.0),
        ("server.all_gone_grace_secs", 0.1..=604_800.0),
        ("server.recovery_window_secs", 0.1..=3_600.0),
    ];

    fn seconds(&self) -> [f64; 8] {
        [
            self.heartbeat_secs,
            self.worker_timeout_secs,
            self.idle_timeout_secs,
            self.hello_timeout_secs,
            self.request_timeout_secs,
            self.join_timeout_secs,
            self.all_gone_grace_secs,
            self.recovery_window_secs,
        ]
    }

    /// Every time, size and count field against its range.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        for ((field, range), value) in Self::SECONDS.into_iter().zip(self.seconds()) {
            check_range(field, value, range)?;
        }
        check_range(
            "server.connect_timeout_secs",
            self.connect_timeout_secs,
            1..=86_400,
        )?;
        check_range(
            "server.max_frame_bytes",
            self.max_frame_bytes,
            4096..=1 << 31,
        )?;
        check_range(
            "server.max_requests_per_sec",
            self.max_requests_per_sec,
            0..=1_000_000,
        )?;
        check_range("server.max_connections", self.max_connections, 1..=65_536)?;
        check_range(
            "server.max_unauthenticated",
            self.max_unauthenticated,
            1..=65_536,
        )?;
        check_range("server.staleness", self.staleness, 0..=1_000_000)?;
        check_range(
            "server.checkpoint_every",
            self.checkpoint_every,
            0..=1 << 40,
        )?;
        check_range(
            "server.checkpoint_max_failures",
            self.checkpoint_max_failures,
            0..=1000,
        )?;
        check_range("server.max_grad_norm", self.max_grad_norm, 0.0..=f32::MAX)?;
        check_range("server.io_threads", self.io_threads, 1..=256)
    }

    /// Recovery: how many versions past the newest checkpoint (or past 0
    /// without one) the cluster can have reached, when periodic checkpoints
    /// are on: `checkpoint_every × (1 + recovery_checkpoint_slack)`. 0 when
    /// they are off: then nothing bounds a copy's version.
    pub fn recovery_max_ahead(&self) -> u64 {
        if self.checkpoint_every == 0 || self.checkpoint_url.trim().is_empty() {
            return 0;
        }
        self.checkpoint_every
            .saturating_mul(self.recovery_checkpoint_slack.saturating_add(1))
    }
}

/// The loader's sizes that [`LoaderSection::validate`] bounds only from
/// below.
fn check_loader_ranges(l: &LoaderSection) -> Result<(), ConfigError> {
    check_range("loader.lookahead_batches", l.lookahead_batches, 0..=1 << 20)?;
    check_range("loader.lookahead_samples", l.lookahead_samples, 0..=1 << 26)?;
    check_range(
        "loader.max_inflight_mb",
        l.max_inflight_mb,
        0.001..=1_048_576.0,
    )?;
    check_range("loader.max_request_kb", l.max_request_kb, 1..=1 << 20)?;
    check_range("loader.outage_budget_s", l.outage_budget_s, 0.0..=86_400.0)
}

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

    /// Check every value; the error names the field and the rule.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Ranges first: the rules below compute with these values.
        self.check_ranges()?;
        let c = &self.cluster;
        if c.servers.is_empty() {
            return Err(invalid(
                "cluster.servers",
                "list at least one server host:port",
            ));
        }
        for s in &c.servers {
            validate_host_port(s)?;
        }
        if c.shards_per_server == 0 || c.shards_per_server > 1024 {
            return Err(invalid("cluster.shards_per_server", "must be in 1..=1024"));
        }
        if c.workers == 0 || c.workers > 4096 {
            return Err(invalid("cluster.workers", "must be in 1..=4096"));
        }
        if c.max_workers != 0 && (c.max_workers < c.workers || c.max_workers > 4096) {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "must be 0 (= cluster.workers) or in cluster.workers..=4096 ({}..=4096)",
                    c.workers
                ),
            ));
        }
        if c.max_ranks() > c.workers && self.server.mode == SyncMode::Bsp {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "workers can join beyond cluster.workers = {} only in asp or ssp jobs; a bsp barrier has a fixed size (set server.mode = \"asp\" or \"ssp\", or max_workers = 0)",
                    c.workers
                ),
            ));
        }
        if c.workers_per_node == 0 || !c.workers.is_multiple_of(c.workers_per_node) {
            return Err(invalid(
                "cluster.workers_per_node",
                format!(
                    "must be >= 1 and divide cluster.workers = {} (got {})",
                    c.workers, c.workers_per_node
                ),
            ));
        }
        if c.max_ranks() > c.workers && c.workers_per_node > 1 {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "workers join beyond cluster.workers one at a time, so it needs cluster.workers_per_node = 1 (got {})",
                    c.workers_per_node
                ),
            ));
        }
        if c.token.len() < 8 {
            return Err(invalid(
                "cluster.token",
                "must be at least 8 characters (or set STRATUS_TOKEN)",
            ));
        }
        if self.tls.server_name.is_empty() {
            return Err(invalid("tls.server_name", "must not be empty"));
        }
        let m = &self.model;
        if m.input == 0 || m.classes < 2 || m.hidden.contains(&0) {
            return Err(invalid(
                "model",
                "input must be >= 1, classes >= 2 and every hidden width >= 1",
            ));
        }
        if m.kind == ModelKind::Cnn {
            let Some(side) = m.image_side() else {
                return Err(invalid(
                    "model.input",
                    format!(
                        "a cnn needs input = in_channels * side^2; {} is not {} x a square",
                        m.input, m.in_channels
                    ),
                ));
            };
            if m.conv.is_empty() || m.conv.contains(&0) {
                return Err(invalid(
                    "model.conv",
                    "a cnn needs at least one conv width, all >= 1",
                ));
            }
            if side >> m.conv.len() == 0 || side % (1 << m.conv.len()) != 0 {
                return Err(invalid(
                    "model.conv",
                    format!(
                        "{} conv layers halve the {side}x{side} image {} times; the side must stay a whole number",
                        m.conv.len(),
                        m.conv.len()
                    ),
                ));
            }
        }
        if !m.layers.is_empty() && m.kind != ModelKind::Layers {
            return Err(invalid("model.layers", "only for kind = \"layers\""));
        }
        if !(m.width.is_finite() && m.width > 0.0 && m.width <= 64.0) {
            return Err(invalid("model.width", "must be in (0, 64]"));
        }
        if m.bn_calibration_batches == 0 {
            return Err(invalid("model.bn_calibration_batches", "must be >= 1"));
        }
        if m.is_layered() {
            m.nodes()?;
        }
        if !m.tensors.is_empty() && m.kind != ModelKind::Custom {
            return Err(invalid("model.tensors", "only for kind = \"custom\""));
        }
        if m.kind == ModelKind::Custom {
            check_tensor_decls(&m.tensors)?;
        }
        if m.kind == ModelKind::Gpt {
            m.gpt.validate()?;
        } else if m.gpt != GptSection::default() {
            return Err(invalid("model.gpt", "only for kind = \"gpt\""));
        }
        let shards = c.servers.len() * c.shards_per_server;
        if shards > m.num_params() {
            return Err(invalid(
                "cluster.shards_per_server",
                format!(
                    "{shards} shards for a model of only {} parameters",
                    m.num_params()
                ),
            ));
        }
        let d = &self.data;
        if d.url.trim().is_empty() {
            return Err(invalid("data.url", "must name a bucket URL"));
        }
        if d.batch_size == 0 {
            return Err(invalid("data.batch_size", "must be >= 1"));
        }
        if d.prefetch_batches == 0 {
            return Err(invalid("data.prefetch_batches", "must be >= 1"));
        }
        if self.data.decode_threads == 0 || self.data.decode_threads > 256 {
            return Err(invalid("data.decode_threads", "must be in 1..=256"));
        }
        let aug = &self.data.augment;
        if !aug.mean.is_empty() && !aug.std.is_empty() && aug.mean.len() != aug.std.len() {
            return Err(invalid(
                "data.augment.std",
                "must have as many values as data.augment.mean (one per channel)",
            ));
        }
        if aug.std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(invalid(
                "data.augment.std",
                "values must be finite and above 0",
            ));
        }
        if aug.mean.iter().any(|m| !m.is_finite()) {
            return Err(invalid("data.augment.mean", "values must be finite"));
        }
        let t = &self.training;
        if t.epochs == 0 {
            return Err(invalid("training.epochs", "must be >= 1"));
        }
        if !(t.device == "cpu" || t.device == "cuda" || t.device.starts_with("cuda:")) {
            return Err(invalid(
                "training.device",
                format!("`{}`: use cpu, cuda or cuda:N", t.device),
            ));
        }
        if t.overlap
            && (self.server.mode == SyncMode::Bsp
                || (self.server.mode == SyncMode::Ssp && self.server.staleness == 0))
        {
            return Err(invalid(
                "training.overlap",
                "needs server.mode = \"asp\", or \"ssp\" with staleness >= 1 (a one-step-stale gradient breaks bsp)",
            ));
        }
        if !(0.0..=1.0).contains(&t.target_accuracy) {
            return Err(invalid(
                "training.target_accuracy",
                format!("must be in [0, 1], got {}", t.target_accuracy),
            ));
        }
        let z = &self.compression;
        if !(z.density > 0.0 && z.density <= 1.0) {
            return Err(invalid("compression.density", "must be in (0, 1]"));
        }
        // With kind = "none" no compressor is built, so only the density
        // (checked above) is held to its range.
        if z.kind == CompressionKind::Topk {
            z.validate().map_err(|m| invalid("compression", m))?;
        }
        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return Err(invalid("optimizer.lr", "must be a positive finite number"));
        }
        if !(0.0..1.0).contains(&o.momentum) {
            return Err(invalid("optimizer.momentum", "must be in [0, 1)"));
        }
        if o.nesterov && o.momentum == 0.0 {
            return Err(invalid(
                "optimizer.nesterov",
                "needs optimizer.momentum > 0",
            ));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(invalid("optimizer.weight_decay", "must be >= 0"));
        }
        if !(o.lars_eta.is_finite() && o.lars_eta >= 0.0) {
            return Err(invalid("optimizer.lars_eta", "must be >= 0"));
        }
        if o.kind.is_adam() {
            for (field, set) in [
                ("optimizer.momentum", o.momentum != 0.0),
                ("optimizer.nesterov", o.nesterov),
                ("optimizer.lars_eta", o.lars_eta != 0.0),
            ] {
                if set {
                    return Err(invalid(
                        field,
                        "applies only to kind = \"sgd\" (Adam and AdamW keep their own moments)",
                    ));
                }
            }
            check_range("optimizer.beta1", o.beta1, 0.0..=0.999_999)?;
            check_range("optimizer.beta2", o.beta2, 0.0..=0.999_999)?;
            check_range("optimizer.eps", o.eps, 1e-30..=1.0)?;
        } else {
            let defaults = OptimizerSection::default();
            for (field, set) in [
                ("optimizer.beta1", o.beta1 != defaults.beta1),
                ("optimizer.beta2", o.beta2 != defaults.beta2),
                ("optimizer.eps", o.eps != defaults.eps),
            ] {
                if set {
                    return Err(invalid(
                        field,
                        "applies only to kind = \"adam\" or \"adamw\"",
                    ));
                }
            }
        }
        if let Some(p) = o.no_decay.iter().find(|p| p.is_empty()) {
            return Err(invalid(
                "optimizer.no_decay",
                format!("{p:?}: an empty pattern would match every tensor"),
            ));
        }
        check_range("optimizer.clip_grad_norm", o.clip_grad_norm, 0.0..=1e9)?;
        if o.clip_grad_norm > 0.0 {
            if self.compression.kind == CompressionKind::Topk {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    "clips dense updates only; it cannot be used with compression.kind = \"topk\"",
                ));
            }
            if shards != 1 {
                return Err(invalid(
                    "optimizer.clip_grad_norm",
                    format!(
                        "needs the whole model in one shard (one server, cluster.shards_per_server = 1), \
                         this config has {shards} shards: each shard sees only its part of the \
                         gradient, so a global norm cannot be exact"
                    ),
                ));
            }
        }
        o.schedule.check(o.lr)?;
        let s = &self.server;
        if s.max_frame_bytes < 4096 {
            return Err(invalid("server.max_frame_bytes", "must be >= 4096"));
        }
        let dense_frame = 64 + 4 * m.num_params().div_ceil(shards);
        if s.max_frame_bytes < dense_frame {
            return Err(invalid(
                "server.max_frame_bytes",
                format!(
                    "{} is smaller than one dense shard ({dense_frame} bytes)",
                    s.max_frame_bytes
                ),
            ));
        }
        if !(s.heartbeat_secs.is_finite() && s.heartbeat_secs > 0.0) {
            return Err(invalid("server.heartbeat_secs", "must be > 0"));
        }
        if !(s.worker_timeout_secs.is_finite() && s.worker_timeout_secs >= 2.0 * s.heartbeat_secs) {
            return Err(invalid(
                "server.worker_timeout_secs",
                "must be at least twice server.heartbeat_secs",
            ));
        }
        if s.mode == SyncMode::Ssp && s.staleness > 1_000_000 {
            return Err(invalid("server.staleness", "must be <= 1000000"));
        }
        if s.checkpoint_every > 0 && s.checkpoint_url.trim().is_empty() {
            return Err(invalid(
                "server.checkpoint_url",
                "needed when server.checkpoint_every > 0",
            ));
        }
        if s.connect_timeout_secs == 0 {
            return Err(invalid("server.connect_timeout_secs", "must be >= 1"));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        for (field, v) in [
            ("server.hello_timeout_secs", s.hello_timeout_secs),
            ("server.request_timeout_secs", s.request_timeout_secs),
            ("server.join_timeout_secs", s.join_timeout_secs),
            ("server.all_gone_grace_secs", s.all_gone_grace_secs),
            ("server.recovery_window_secs", s.recovery_window_secs),
        ] {
            if !positive(v) {
                return Err(invalid(field, "must be a positive number of seconds"));
            }
        }
        if !(s.idle_timeout_secs.is_finite() && s.idle_timeout_secs >= 2.0 * s.heartbeat_secs) {
            return Err(invalid(
                "server.idle_timeout_secs",
                "must be at least twice server.heartbeat_secs (keep-alives go out every heartbeat)",
            ));
        }
        if s.max_connections == 0 || s.max_unauthenticated == 0 {
            return Err(invalid(
                "server.max_connections",
                "max_connections and max_unauthenticated must be >= 1",
            ));
        }
        if s.max_unauthenticated_per_source == 0 {
            return Err(invalid(
                "server.max_unauthenticated_per_source",
                "must be >= 1 (above server.max_unauthenticated it changes nothing)",
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
        if !(s.max_grad_norm.is_finite() && s.max_grad_norm >= 0.0) {
            return Err(invalid(
                "server.max_grad_norm",
                "must be >= 0 (0 = no bound)",
            ));
        }
        if !(s.grad_norm_ceiling.is_finite() && s.grad_norm_ceiling >= 0.0) {
            return Err(invalid(
                "server.grad_norm_ceiling",
                "must be a finite number >= 0 (0 = no ceiling)",
            ));
        }
        if !(s.grad_anomaly_factor == 0.0
            || (s.grad_anomaly_factor.is_finite() && s.grad_anomaly_factor >= 2.0))
        {
            return Err(invalid(
                "server.grad_anomaly_factor",
                "must be 0 (off) or a finite number >= 2",
            ));
        }
        if s.grad_anomaly_warmup == 0 || s.grad_anomaly_warmup > 1_000_000 {
            return Err(invalid(
                "server.grad_anomaly_warmup",
                "must be in 1..=1000000",
            ));
        }
        if s.recovery_checkpoint_slack > 1_000_000 {
            return Err(invalid(
                "server.recovery_checkpoint_slack",
                "must be <= 1000000",
            ));
        }
        if s.io_threads == 0 || s.io_threads > 256 {
            return Err(invalid("server.io_threads", "must be in 1..=256"));
        }
        if !self.tls.worker_cert.contains("{rank}") || !self.tls.worker_key.contains("{rank}") {
            return Err(invalid(
                "tls.worker_cert",
                "tls.worker_cert and tls.worker_key must contain {rank}",
            ));
        }
        self.loader.validate().map_err(|m| invalid("loader", m))?;
        self.cost.validate().map_err(|m| invalid("cost", m))?;
        Ok(())
    }

    /// Every time, size and count field against its range (see the
    /// `RANGES` tables next to each section).
    fn check_ranges(&self) -> Result<(), ConfigError> {
        self.cluster.check_ranges()?;
        self.model.check_ranges()?;
        self.data.check_ranges()?;
        self.training.check_ranges()?;
        self.compression.check_ranges()?;
        self.server.check_ranges()?;
        check_loader_ranges(&self.loader)
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

fn validate_host_port(s: &str) -> Result<(), ConfigError> {
    if s.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(invalid(
            "cluster.servers",
            format!("`{s}` is not host:port (e.g. 10.0.0.5:7400 or ps-0:7400)"),
        )),
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
            include_str!("../../configs/mnist.toml"),
            include_str!("../../configs/mnist-adamw.toml"),
            include_str!("../../configs/mnist-cnn.toml"),
            include_str!("../../configs/compose.toml"),
            include_str!("../../configs/resnet20.toml"),
        ] {
            ClusterConfig::from_toml_str(text).unwrap();
        }
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
        assert!(cfg.compression.compressor(8).is_none());
        let cfg = ClusterConfig::from_toml_str("[compression]\nkind = \"topk\"\n").unwrap();
        let compressor = cfg.compression.compressor(8).expect("a top-k compressor");
        assert_eq!(compressor.config(), &cfg.compression);
        assert_eq!(compressor.residual().len(), 8);
    }

    /// The error `text` (a config) gives, as a string; panics when it loads.
    fn refused(text: &str) -> String {
        match ClusterConfig::from_toml_str(text) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn time_fields_out_of_range_are_refused_by_name() {
        assert_eq!(
            refused("[server]\nrequest_timeout_secs = 1e19\n"),
            "invalid config value server.request_timeout_secs = 1e19 is out of range 0.1..=86400"
        );
        assert_eq!(
            refused("[server]\nheartbeat_secs = 1e-10\n"),
            "invalid config value server.heartbeat_secs = 1e-10 is out of range 0.01..=600"
        );
        // Every seconds field, with values beyond either end, NaN and the
        // infinities.
        for (field, range) in ServerSection::SECONDS {
            let name = field.strip_prefix("server.").expect("a server field");
            for value in [
                "1e19",
                "-1.0",
                "0.0",
                "nan",
                "inf",
                "-inf",
                &format!("{}", range.end() * 2.0),
                &format!("{}", range.start() / 2.0),
            ] {
                let e = refused(&format!("[server]\n{name} = {value}\n"));
                assert!(
                    e.contains(&format!("{field} = ")) && e.contains("is out of range"),
                    "{field} = {value}: {e}"
                );
            }
            // Both ends are allowed (with the heartbeat low enough for the
            // timeouts that must be twice it).
            for value in [range.start(), range.end()] {
                let text = format!("[server]\nheartbeat_secs = 0.01\n{name} = {value:?}\n");
                if let Err(e) = ClusterConfig::from_toml_str(&text) {
                    assert!(!e.to_string().contains("out of range"), "{text}: {e}");
                }
            }
        }
        assert!(refused("[server]\nconnect_timeout_secs = 0\n")
            .contains("server.connect_timeout_secs = 0 is out of range 1..=86400"));
        assert!(refused("[loader]\noutage_budget_s = 1e12\n").contains("loader.outage_budget_s"));
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
            // Two shards by default: a global norm cannot be exact.
            ("[optimizer]
clip_grad_norm = 1.0
", "optimizer.clip_grad_norm"),
            (
                "[cluster]\nshards_per_server = 1\n[compression]\nkind = \"topk\"\n[optimizer]\nclip_grad_norm = 1.0\n",
                "clips dense updates only",
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
            ("[cluster]\ntoken = \"short\"\n", "cluster.token"),
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

    #[test]
    fn layout_counts_params() {
        let m = ModelSection {
            kind: ModelKind::Mlp,
            input: 4,
            hidden: vec![3],
            classes: 2,
            ..ModelSection::default()
        };
        assert_eq!(m.num_params(), 4 * 3 + 3 + 3 * 2 + 2);
        assert_eq!(m.tensor_ranges().last().unwrap().end, m.num_params());
        let mut other = m.clone();
        other.hidden = vec![5];
        assert_ne!(m.layout_hash(), other.layout_hash());
    }

    #[test]
    fn cnn_layout() {
        let m = ModelSection {
            kind: ModelKind::Cnn,
            input: 784,
            hidden: vec![32],
            classes: 10,
            in_channels: 1,
            conv: vec![8, 16],
            ..ModelSection::default()
        };
        let shapes: Vec<Vec<usize>> = m.layout().into_iter().map(|t| t.shape).collect();
        assert_eq!(
            shapes,
            vec![
                vec![8, 1, 3, 3],
                vec![8],
                vec![16, 8, 3, 3],
                vec![16],
                vec![32, 16 * 7 * 7],
                vec![32],
                vec![10, 32],
                vec![10],
            ]
        );
    }

    const SMALL_NET: &str = r#"
[model]
kind = "layers"
input = 48
in_channels = 3
classes = 3
[[model.layers]]
type = "conv2d"
out = 4
bias = false
[[model.layers]]
type = "batch_norm"
[[model.layers]]
type = "relu"
[[model.layers]]
type = "max_pool"
kernel = 2
[[model.layers]]
type = "residual"
out = 6
stride = 2
[[model.layers]]
type = "dropout"
p = 0.25
[[model.layers]]
type = "linear"
out = 3
"#;

    #[test]
    fn layer_list_parses_and_infers_shapes() {
        let cfg = ClusterConfig::from_toml_str(SMALL_NET).unwrap();
        let m = &cfg.model;
        let nodes = m.nodes().unwrap();
        assert_eq!(nodes[3].output, Shape::Image { c: 4, h: 2, w: 2 });
        assert_eq!(nodes[4].output, Shape::Image { c: 6, h: 1, w: 1 });
        let names: Vec<String> = m.layout().into_iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            [
                "layers.0.weight",
                "layers.1.weight",
                "layers.1.bias",
                "layers.4.conv1.weight",
                "layers.4.bn1.weight",
                "layers.4.bn1.bias",
                "layers.4.conv2.weight",
                "layers.4.bn2.weight",
                "layers.4.bn2.bias",
                "layers.4.shortcut.conv.weight",
                "layers.4.shortcut.bn.weight",
                "layers.4.shortcut.bn.bias",
                "layers.6.weight",
                "layers.6.bias",
            ]
        );
        // The linear layer's input is the flattened [6, 1, 1] image.
        assert_eq!(m.layout()[12].shape, vec![3, 6]);
        assert!(m.has_batch_norm());
        // What show-config prints reads back as the same model.
        let again = ClusterConfig::from_toml_str(&cfg.to_redacted_toml().unwrap()).unwrap();
        assert_eq!(again.model, cfg.model);
        assert_eq!(again.model.layout_hash(), m.layout_hash());
    }

    #[test]
    fn resnet20_example_config_is_valid() {
        let cfg =
            ClusterConfig::from_toml_str(include_str!("../../configs/resnet20.toml")).unwrap();
        assert_eq!(cfg.model.kind, ModelKind::Resnet20);
        assert_eq!(cfg.model.num_params(), 272_474);
    }

    #[test]
    fn resnet_presets_have_the_textbook_sizes() {
        let r20 = ModelSection {
            kind: ModelKind::Resnet20,
            input: 3 * 32 * 32,
            in_channels: 3,
            classes: 10,
            ..ModelSection::default()
        };
        // 3x3 convs without bias, BN γ and β, 1x1 projection shortcuts
        // (with BN) where the width doubles.
        assert_eq!(r20.num_params(), 272_474);
        let layout = r20.layout();
        let names: std::collections::HashSet<&str> =
            layout.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), layout.len(), "names must be unique");
        for n in [
            "stem.conv.weight",
            "stage1.block0.conv1.weight",
            "stage1.block2.bn2.bias",
            "stage2.block0.shortcut.conv.weight",
            "stage3.block0.shortcut.bn.weight",
            "fc.weight",
            "fc.bias",
        ] {
            assert!(names.contains(n), "{n} missing");
        }
        assert!(!names.contains("stage1.block0.shortcut.conv.weight"));
        assert!(r20.has_batch_norm());
        let r18 = ModelSection {
            kind: ModelKind::Resnet18,
            ..r20.clone()
        };
        assert_eq!(r18.num_params(), 11_173_962);
        let narrow = ModelSection {
            width: 0.25,
            ..r20.clone()
        };
        let fc = narrow.layout().into_iter().find(|t| t.name == "fc.weight");
        assert_eq!(fc.unwrap().shape, vec![10, 16]);
        assert_ne!(narrow.layout_hash(), r20.layout_hash());
        // The MLP and CNN layouts do not depend on the new keys.
        let mlp = ModelSection::default();
        let wide = ModelSection {
            width: 2.0,
            bn_calibration_batches: 3,
            ..ModelSection::default()
        };
        assert_eq!(mlp.layout_hash(), wide.layout_hash());
        assert!(!mlp.has_batch_norm());
    }

    #[test]
    fn bad_layers_name_their_field() {
        let net = |layers: &str| {
            format!(
                "[model]\nkind = \"layers\"\ninput = 64\nin_channels = 1\nclasses = 3\n{layers}"
            )
        };
        let conv = |extra: &str| format!("[[model.layers]]\ntype = \"conv2d\"\n{extra}\n");
        let linear3 = "[[model.layers]]\ntype = \"linear\"\nout = 3\n";
        for (text, field) in [
            (net(""), "model.layers"),
            (
                net(&format!("{}{linear3}", conv("out = 0"))),
                "model.layers[0].out",
            ),
            (
                net(&format!("{}{linear3}", conv("out = 2\nstride = 0"))),
                "model.layers[0].stride",
            ),
            (
                net(&format!("{}{linear3}", conv("out = 2\nkernel = 0"))),
                "model.layers[0].kernel",
            ),
            (
                net(&format!(
                    "{}{}{linear3}",
                    conv("out = 2\nstride = 4"),
                    conv("out = 2\nkernel = 5\npadding = 0")
                )),
                "model.layers[1].kernel",
            ),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"flatten\"\n{}{linear3}",
                    conv("out = 2")
                )),
                "model.layers[1].type",
            ),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"max_pool\"\nkernel = 9\n{linear3}"
                )),
                "model.layers[0].kernel",
            ),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"avg_pool\"\nkernel = 2\nstride = 0\n{linear3}"
                )),
                "model.layers[0].stride",
            ),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"dropout\"\np = 1.0\n{linear3}"
                )),
                "model.layers[0].p",
            ),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"residual\"\nout = 0\n{linear3}"
                )),
                "model.layers[0].out",
            ),
            (
                net("[[model.layers]]\ntype = \"linear\"\nout = 4\n"),
                "model.layers[0].out",
            ),
            (net(&conv("out = 3")), "model.layers"),
            (
                net(&format!(
                    "[[model.layers]]\ntype = \"flatten\"\n[[model.layers]]\ntype = \"batch_norm\"\n{linear3}"
                )),
                "model.layers[1].type",
            ),
            (
                "[model]\nkind = \"resnet20\"\ninput = 60\nin_channels = 3\n".to_string(),
                "model.input",
            ),
            (
                "[model]\nkind = \"resnet20\"\ninput = 48\nin_channels = 3\nwidth = 0.0\n".to_string(),
                "model.width",
            ),
            (
                "[model]\nkind = \"resnet20\"\ninput = 48\nin_channels = 3\nbn_calibration_batches = 0\n".to_string(),
                "model.bn_calibration_batches",
            ),
            (
                format!("[model]\n{linear3}"),
                "model.layers",
            ),
        ] {
            let e = ClusterConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?} gave {e}");
        }
        // A misspelt layer key is a parse error that names it.
        let e = ClusterConfig::from_toml_str(&net(&format!(
            "{}{linear3}",
            conv("out = 2\nkernal = 3")
        )))
        .unwrap_err()
        .to_string();
        assert!(e.contains("kernal"), "{e}");
    }

    #[test]
    fn custom_models_take_their_layout_from_model_tensors() {
        let custom = |tensors: &str| {
            format!("[model]\nkind = \"custom\"\ninput = 64\nclasses = 10\ntensors = [{tensors}]\n")
        };
        let cfg = ClusterConfig::from_toml_str(&custom(
            "{ name = \"w\", shape = [10, 64] }, { name = \"b\", shape = [10] }",
        ))
        .unwrap();
        assert_eq!(cfg.model.num_params(), 650);
        assert_eq!(cfg.model.tensor_ranges(), vec![0..640, 640..650]);
        let names: Vec<String> = cfg.model.layout().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["w", "b"]);
        // The hash follows the names and shapes.
        let renamed = ClusterConfig::from_toml_str(&custom(
            "{ name = \"w2\", shape = [10, 64] }, { name = \"b\", shape = [10] }",
        ))
        .unwrap();
        assert_ne!(cfg.model.layout_hash(), renamed.model.layout_hash());
        for (text, field) in [
            (custom(""), "model.tensors"),
            (
                custom("{ name = \"\", shape = [3] }"),
                "model.tensors[0].name",
            ),
            (
                custom("{ name = \"a\", shape = [3] }, { name = \"a\", shape = [2] }"),
                "model.tensors[1].name",
            ),
            (
                custom("{ name = \"a\", shape = [3, 0] }"),
                "model.tensors[0].shape",
            ),
            (
                custom("{ name = \"a\", shape = [] }"),
                "model.tensors[0].shape",
            ),
            (
                custom("{ name = \"a\", shape = [65536, 65536] }"),
                "model.tensors[0].shape",
            ),
            (
                "[model]\ntensors = [{ name = \"a\", shape = [3] }]\n".to_string(),
                "model.tensors",
            ),
        ] {
            let e = ClusterConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?} gave {e}");
        }
    }

    #[test]
    fn gradient_guards_and_the_recovery_bound_are_checked_by_name() {
        let cfg = ClusterConfig::embedded_default().unwrap();
        assert!(cfg.server.grad_norm_ceiling > 0.0 && cfg.server.grad_anomaly_factor > 0.0);
        for (field, value) in [
            ("grad_norm_ceiling", "-1.0"),
            ("grad_anomaly_factor", "1.5"),
            ("grad_anomaly_factor", "nan"),
            ("grad_anomaly_warmup", "0"),
            ("recovery_checkpoint_slack", "2000000"),
        ] {
            let err = ClusterConfig::from_toml_str(&format!("[server]\n{field} = {value}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("server.{field}")), "{field}: {err}");
        }
        let off = ClusterConfig::from_toml_str("[server]\ngrad_anomaly_factor = 0.0\n").unwrap();
        assert_eq!(off.server.grad_anomaly_factor, 0.0);
        let mut s = ServerSection::default();
        assert_eq!(
            s.recovery_max_ahead(),
            0,
            "no periodic checkpoints: no bound"
        );
        s.checkpoint_every = 100;
        s.checkpoint_url = "file:///tmp/ck".into();
        assert_eq!(s.recovery_max_ahead(), 500);
    }
}

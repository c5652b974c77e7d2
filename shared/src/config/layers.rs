//! Models described as a list of layers (`[model] kind = "layers"`) and the
//! ResNet presets (`kind = "resnet20"` / `"resnet18"`), which expand to the
//! same list.
//!
//! The input is an image `[in_channels, side, side]` with
//! `input = in_channels * side^2` (the same rule as the CNN). Shapes are
//! inferred through the list: a `linear` layer takes whatever the layer
//! before it gives (an image is flattened), and the last layer must give
//! `classes` outputs.
//!
//! ```toml
//! [model]
//! kind = "layers"
//! input = 3072          # 3 x 32 x 32
//! in_channels = 3
//! classes = 10
//! [[model.layers]]
//! type = "conv2d"
//! out = 16
//! kernel = 3            # padding defaults to kernel / 2
//! bias = false
//! [[model.layers]]
//! type = "batch_norm"
//! [[model.layers]]
//! type = "relu"
//! [[model.layers]]
//! type = "residual"     # conv-bn-relu-conv-bn + shortcut, then relu
//! out = 32
//! stride = 2
//! [[model.layers]]
//! type = "global_avg_pool"
//! [[model.layers]]
//! type = "linear"
//! out = 10
//! ```
//!
//! Every parameter tensor gets a unique name: `layers.<i>.weight` for layer
//! `i` of a list, `stage<s>.block<b>.conv1.weight`, `…bn1.weight` (γ),
//! `…bn1.bias` (β), `…shortcut.conv.weight` for the presets. Batch-norm
//! running statistics are not parameters.

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// One layer of a `kind = "layers"` model (`type = "…"` in TOML).
///
/// A layer takes only the keys of its type, whether the type has fields or
/// not: `{ type = "relu", foo = 1 }` is refused like a misspelt conv2d key.
/// (The derived code is reached through [`LayerSpec::from_table`], which
/// checks the keys first: serde lets a variant without fields ignore them.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    remote = "Self",
    tag = "type",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum LayerSpec {
    /// 2-d convolution over an image.
    Conv2d {
        /// Output channels.
        out: usize,
        #[serde(default = "three")]
        kernel: usize,
        #[serde(default = "one")]
        stride: usize,
        /// Zero padding on each side; `kernel / 2` when left out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding: Option<usize>,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// Batch norm over the channels of an image (γ and β are parameters).
    BatchNorm,
    Relu,
    MaxPool {
        kernel: usize,
        /// `kernel` when left out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
    },
    AvgPool {
        kernel: usize,
        /// `kernel` when left out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
    },
    /// Mean over each channel's image: `[c, h, w]` becomes `[c]`.
    GlobalAvgPool,
    /// Basic ResNet block: 3x3 conv (stride) - bn - relu - 3x3 conv - bn,
    /// plus the input (or a 1x1 conv (stride) - bn projection of it when
    /// the shape changes), then relu. Convolutions have no bias.
    Residual {
        out: usize,
        #[serde(default = "one")]
        stride: usize,
    },
    /// Zeroes each value with probability `p` in training (scaling the
    /// rest by `1 / (1 - p)`); the identity in evaluation.
    Dropout {
        p: f32,
    },
    Flatten,
    /// Fully connected; the input features come from the layer before.
    Linear {
        out: usize,
        #[serde(default = "yes")]
        bias: bool,
    },
}

/// The keys each layer type takes besides `type`.
const KEYS: [(&str, &[&str]); 10] = [
    ("conv2d", &["out", "kernel", "stride", "padding", "bias"]),
    ("batch_norm", &[]),
    ("relu", &[]),
    ("max_pool", &["kernel", "stride"]),
    ("avg_pool", &["kernel", "stride"]),
    ("global_avg_pool", &[]),
    ("residual", &["out", "stride"]),
    ("dropout", &["p"]),
    ("flatten", &[]),
    ("linear", &["out", "bias"]),
];

impl LayerSpec {
    /// A layer from its table: a key its type does not take is refused by
    /// name, then the values are read. The error is the message alone.
    fn from_table(table: toml::Table) -> Result<Self, String> {
        let kind = table.get("type").and_then(toml::Value::as_str);
        if let Some(&(kind, keys)) = KEYS.iter().find(|(name, _)| Some(*name) == kind) {
            let unknown = table
                .keys()
                .find(|k| k.as_str() != "type" && !keys.contains(&k.as_str()));
            if let Some(key) = unknown {
                let takes = if keys.is_empty() {
                    "only `type`".to_string()
                } else {
                    let names: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
                    format!("`type`, {}", names.join(", "))
                };
                return Err(format!(
                    "unknown key `{key}` (a {kind} layer takes {takes})"
                ));
            }
        }
        LayerSpec::deserialize(toml::Value::Table(table)).map_err(|e| e.message().to_string())
    }
}

impl Serialize for LayerSpec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        LayerSpec::serialize(self, serializer)
    }
}

impl<'de> Deserialize<'de> for LayerSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let table = toml::Table::deserialize(deserializer)?;
        LayerSpec::from_table(table).map_err(de::Error::custom)
    }
}

/// Reads `model.layers`: each layer as [`LayerSpec`] reads it, with its
/// place in the list (`model.layers[2]`, counted from 0 like the messages of
/// [`plan`]) in front of any error.
pub(super) fn deserialize_list<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<LayerSpec>, D::Error> {
    struct List;
    impl<'de> Visitor<'de> for List {
        type Value = Vec<LayerSpec>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of layers ([[model.layers]] tables)")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut layers = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
            while let Some(layer) = seq.next_element_seed(Listed(layers.len()))? {
                layers.push(layer);
            }
            Ok(layers)
        }
    }

    /// Layer `.0` of the list.
    struct Listed(usize);
    impl<'de> DeserializeSeed<'de> for Listed {
        type Value = LayerSpec;

        fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<LayerSpec, D::Error> {
            let table = toml::Table::deserialize(deserializer)?;
            LayerSpec::from_table(table)
                .map_err(|m| de::Error::custom(format!("model.layers[{}]: {m}", self.0)))
        }
    }

    deserializer.deserialize_seq(List)
}

fn one() -> usize {
    1
}

fn three() -> usize {
    3
}

fn yes() -> bool {
    true
}

/// The shape of one sample between layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Image { c: usize, h: usize, w: usize },
    Flat(usize),
}

impl Shape {
    pub fn numel(&self) -> usize {
        match *self {
            Shape::Image { c, h, w } => c * h * w,
            Shape::Flat(n) => n,
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Image { c, h, w } => write!(f, "[{c}, {h}, {w}]"),
            Shape::Flat(n) => write!(f, "[{n}]"),
        }
    }
}

/// How a parameter tensor starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Kaiming (He) uniform over the fan-in (`shape[1..]`).
    Kaiming,
    Zeros,
    Ones,
}

/// A layer with its name and the shapes around it, after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Prefix of its tensors' names (`layers.3`, `stage2.block0`).
    pub name: String,
    pub layer: LayerSpec,
    pub input: Shape,
    pub output: Shape,
}

/// One parameter tensor of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

fn param(name: String, shape: Vec<usize>, init: Init) -> ParamSpec {
    ParamSpec { name, shape, init }
}

fn conv_params(out: &mut Vec<ParamSpec>, name: &str, o: usize, i: usize, k: usize, bias: bool) {
    out.push(param(
        format!("{name}.weight"),
        vec![o, i, k, k],
        Init::Kaiming,
    ));
    if bias {
        out.push(param(format!("{name}.bias"), vec![o], Init::Zeros));
    }
}

fn bn_params(out: &mut Vec<ParamSpec>, name: &str, c: usize) {
    out.push(param(format!("{name}.weight"), vec![c], Init::Ones));
    out.push(param(format!("{name}.bias"), vec![c], Init::Zeros));
}

impl Node {
    fn channels_in(&self) -> usize {
        match self.input {
            Shape::Image { c, .. } => c,
            Shape::Flat(n) => n,
        }
    }

    /// Whether a residual block needs a projection shortcut.
    pub fn projects(&self) -> bool {
        match self.layer {
            LayerSpec::Residual { out, stride } => stride != 1 || out != self.channels_in(),
            _ => false,
        }
    }

    /// The node's parameter tensors, in flat-space order. For a residual
    /// block: conv1, bn1 (γ, β), conv2, bn2, then the shortcut's conv and bn.
    pub fn params(&self) -> Vec<ParamSpec> {
        let mut out = Vec::new();
        let n = &self.name;
        let cin = self.channels_in();
        match self.layer {
            LayerSpec::Conv2d {
                out: o,
                kernel,
                bias,
                ..
            } => conv_params(&mut out, n, o, cin, kernel, bias),
            LayerSpec::BatchNorm => bn_params(&mut out, n, cin),
            LayerSpec::Residual { out: o, .. } => {
                conv_params(&mut out, &format!("{n}.conv1"), o, cin, 3, false);
                bn_params(&mut out, &format!("{n}.bn1"), o);
                conv_params(&mut out, &format!("{n}.conv2"), o, o, 3, false);
                bn_params(&mut out, &format!("{n}.bn2"), o);
                if self.projects() {
                    conv_params(&mut out, &format!("{n}.shortcut.conv"), o, cin, 1, false);
                    bn_params(&mut out, &format!("{n}.shortcut.bn"), o);
                }
            }
            LayerSpec::Linear { out: o, bias } => {
                let fan_in = self.input.numel();
                out.push(param(format!("{n}.weight"), vec![o, fan_in], Init::Kaiming));
                if bias {
                    out.push(param(format!("{n}.bias"), vec![o], Init::Zeros));
                }
            }
            _ => {}
        }
        out
    }

    /// Batch-norm layers in the node, in the order of their parameters.
    pub fn batch_norms(&self) -> usize {
        match self.layer {
            LayerSpec::BatchNorm => 1,
            LayerSpec::Residual { .. } => 2 + usize::from(self.projects()),
            _ => 0,
        }
    }
}

/// A shape error: the field (relative to `model.`) and the message.
pub type PlanError = (String, String);

/// Output side of a window of `kernel` moved by `stride` over `side + 2 pad`.
fn window_out(side: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = side + 2 * pad;
    (padded >= kernel && stride > 0).then(|| (padded - kernel) / stride + 1)
}

/// Infer the shapes through `layers` (named by `names`), from `input`.
pub fn plan(
    layers: &[(String, LayerSpec)],
    input: Shape,
    field: impl Fn(usize) -> String,
) -> Result<Vec<Node>, PlanError> {
    let mut nodes = Vec::with_capacity(layers.len());
    let mut shape = input;
    for (i, (name, layer)) in layers.iter().enumerate() {
        let at = |key: &str| format!("{}.{key}", field(i));
        let image = |what: &str| match shape {
            Shape::Image { c, h, w } => Ok((c, h, w)),
            Shape::Flat(_) => Err((
                at("type"),
                format!("{what} needs an image input, the layer before gives {shape}"),
            )),
        };
        let output = match *layer {
            LayerSpec::Conv2d {
                out,
                kernel,
                stride,
                padding,
                ..
            } => {
                let (_, h, w) = image("conv2d")?;
                if out == 0 {
                    return Err((at("out"), "must be >= 1".into()));
                }
                if kernel == 0 {
                    return Err((at("kernel"), "must be >= 1".into()));
                }
                if stride == 0 {
                    return Err((at("stride"), "must be >= 1".into()));
                }
                let pad = padding.unwrap_or(kernel / 2);
                match (
                    window_out(h, kernel, stride, pad),
                    window_out(w, kernel, stride, pad),
                ) {
                    (Some(h), Some(w)) => Shape::Image { c: out, h, w },
                    _ => {
                        return Err((
                            at("kernel"),
                            format!("a {kernel}x{kernel} kernel with padding {pad} does not fit the {shape} input"),
                        ))
                    }
                }
            }
            LayerSpec::BatchNorm | LayerSpec::Relu | LayerSpec::Dropout { .. } => {
                if matches!(layer, LayerSpec::BatchNorm) {
                    image("batch_norm")?;
                }
                if let LayerSpec::Dropout { p } = *layer {
                    if !(0.0..1.0).contains(&p) {
                        return Err((at("p"), format!("must be in [0, 1), got {p}")));
                    }
                }
                shape
            }
            LayerSpec::MaxPool { kernel, stride } | LayerSpec::AvgPool { kernel, stride } => {
                let (c, h, w) = image("a pool")?;
                let stride = stride.unwrap_or(kernel);
                if kernel == 0 {
                    return Err((at("kernel"), "must be >= 1".into()));
                }
                if stride == 0 {
                    return Err((at("stride"), "must be >= 1".into()));
                }
                match (
                    window_out(h, kernel, stride, 0),
                    window_out(w, kernel, stride, 0),
                ) {
                    (Some(h), Some(w)) => Shape::Image { c, h, w },
                    _ => {
                        return Err((
                            at("kernel"),
                            format!("a {kernel}x{kernel} window does not fit the {shape} input"),
                        ))
                    }
                }
            }
            LayerSpec::GlobalAvgPool => Shape::Flat(image("global_avg_pool")?.0),
            LayerSpec::Residual { out, stride } => {
                let (_, h, w) = image("residual")?;
                if out == 0 {
                    return Err((at("out"), "must be >= 1".into()));
                }
                if stride == 0 {
                    return Err((at("stride"), "must be >= 1".into()));
                }
                // 3x3 with padding 1 never empties an image.
                Shape::Image {
                    c: out,
                    h: (h - 1) / stride + 1,
                    w: (w - 1) / stride + 1,
                }
            }
            LayerSpec::Flatten => Shape::Flat(shape.numel()),
            LayerSpec::Linear { out, .. } => {
                if out == 0 {
                    return Err((at("out"), "must be >= 1".into()));
                }
                Shape::Flat(out)
            }
        };
        nodes.push(Node {
            name: name.clone(),
            layer: layer.clone(),
            input: shape,
            output,
        });
        shape = output;
    }
    Ok(nodes)
}

/// Channels of a preset stage: `base * width`, at least 1.
fn scaled(base: usize, width: f64) -> usize {
    ((base as f64 * width).round() as usize).max(1)
}

/// A CIFAR-style ResNet: a 3x3 stem conv (stride 1, no max-pool), stages of
/// basic blocks (the first block of a stage carries its stride), global
/// average pool, linear.
pub fn resnet(
    widths: &[usize],
    blocks: usize,
    strides: &[usize],
    width: f64,
    classes: usize,
) -> Vec<(String, LayerSpec)> {
    let mut out = vec![
        (
            "stem.conv".to_string(),
            LayerSpec::Conv2d {
                out: scaled(widths[0], width),
                kernel: 3,
                stride: 1,
                padding: Some(1),
                bias: false,
            },
        ),
        ("stem.bn".to_string(), LayerSpec::BatchNorm),
        ("stem.relu".to_string(), LayerSpec::Relu),
    ];
    for (s, (&w, &stride)) in widths.iter().zip(strides).enumerate() {
        for b in 0..blocks {
            out.push((
                format!("stage{}.block{b}", s + 1),
                LayerSpec::Residual {
                    out: scaled(w, width),
                    stride: if b == 0 { stride } else { 1 },
                },
            ));
        }
    }
    out.push(("pool".to_string(), LayerSpec::GlobalAvgPool));
    out.push((
        "fc".to_string(),
        LayerSpec::Linear {
            out: classes,
            bias: true,
        },
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClusterConfig, ModelKind, ModelSection};

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
            ClusterConfig::from_toml_str(include_str!("../../../configs/resnet20.toml")).unwrap();
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
    fn every_layer_type_refuses_unknown_keys() {
        let net = |layer: &str| {
            format!(
                "[model]\nkind = \"layers\"\ninput = 64\nin_channels = 1\nclasses = 3\n\
                 [[model.layers]]\ntype = \"relu\"\n{layer}\
                 [[model.layers]]\ntype = \"linear\"\nout = 3\n"
            )
        };
        for (layer, message) in [
            (
                "[[model.layers]]\ntype = \"relu\"\nfoo = 1\n",
                "model.layers[1]: unknown key `foo` (a relu layer takes only `type`)",
            ),
            (
                "[[model.layers]]\ntype = \"batch_norm\"\nmomentum = 0.1\n",
                "model.layers[1]: unknown key `momentum` (a batch_norm layer takes only `type`)",
            ),
            (
                "[[model.layers]]\ntype = \"global_avg_pool\"\nkernel = 2\n",
                "model.layers[1]: unknown key `kernel` (a global_avg_pool layer takes only `type`)",
            ),
            (
                "[[model.layers]]\ntype = \"flatten\"\nstart_dim = 1\n",
                "model.layers[1]: unknown key `start_dim` (a flatten layer takes only `type`)",
            ),
            (
                "[[model.layers]]\ntype = \"dropout\"\np = 0.5\nq = 0.5\n",
                "model.layers[1]: unknown key `q` (a dropout layer takes `type`, `p`)",
            ),
            (
                "[[model.layers]]\ntype = \"conv2d\"\nout = 2\nkernal = 3\n",
                "model.layers[1]: unknown key `kernal` (a conv2d layer takes `type`, `out`, \
                 `kernel`, `stride`, `padding`, `bias`)",
            ),
        ] {
            let e = ClusterConfig::from_toml_str(&net(layer))
                .unwrap_err()
                .to_string();
            assert!(e.contains(message), "{layer:?} gave {e}");
        }
        // An inline list is read the same way, and its layers are counted
        // from 0 as well.
        let e = ClusterConfig::from_toml_str(
            "[model]\nkind = \"layers\"\ninput = 64\nin_channels = 1\nclasses = 3\n\
             layers = [{ type = \"flatten\" }, { type = \"relu\", foo = 1 }, \
             { type = \"linear\", out = 3 }]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("model.layers[1]: unknown key `foo`"), "{e}");
        // A layer read on its own names the key too.
        let table: toml::Table = toml::from_str("type = \"relu\"\nfoo = 1\n").unwrap();
        let e = toml::Value::Table(table)
            .try_into::<LayerSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown key `foo`"), "{e}");
        // The same layers without the stray keys load.
        ClusterConfig::from_toml_str(&net("[[model.layers]]\ntype = \"flatten\"\n")).unwrap();
    }

    #[test]
    fn the_key_table_matches_the_layer_types() {
        // Every variant with every optional key set: what it writes is what
        // the table lets it read back.
        let all = [
            LayerSpec::Conv2d {
                out: 4,
                kernel: 3,
                stride: 1,
                padding: Some(1),
                bias: false,
            },
            LayerSpec::BatchNorm,
            LayerSpec::Relu,
            LayerSpec::MaxPool {
                kernel: 2,
                stride: Some(2),
            },
            LayerSpec::AvgPool {
                kernel: 2,
                stride: Some(1),
            },
            LayerSpec::GlobalAvgPool,
            LayerSpec::Residual { out: 8, stride: 2 },
            LayerSpec::Dropout { p: 0.25 },
            LayerSpec::Flatten,
            LayerSpec::Linear {
                out: 3,
                bias: false,
            },
        ];
        // A new variant must be added above (and to `KEYS`).
        for layer in &all {
            match layer {
                LayerSpec::Conv2d { .. }
                | LayerSpec::BatchNorm
                | LayerSpec::Relu
                | LayerSpec::MaxPool { .. }
                | LayerSpec::AvgPool { .. }
                | LayerSpec::GlobalAvgPool
                | LayerSpec::Residual { .. }
                | LayerSpec::Dropout { .. }
                | LayerSpec::Flatten
                | LayerSpec::Linear { .. } => {}
            }
        }
        assert_eq!(all.len(), KEYS.len());
        for layer in all {
            let toml::Value::Table(table) = toml::Value::try_from(&layer).unwrap() else {
                panic!("{layer:?} is not written as a table");
            };
            let kind = table["type"].as_str().unwrap().to_string();
            let (_, keys) = KEYS.iter().find(|(k, _)| *k == kind).unwrap();
            let mut written: Vec<&str> = table
                .keys()
                .map(String::as_str)
                .filter(|k| *k != "type")
                .collect();
            written.sort_unstable();
            let mut listed = keys.to_vec();
            listed.sort_unstable();
            assert_eq!(written, listed, "{kind}");
            assert_eq!(LayerSpec::from_table(table), Ok(layer), "{kind}");
        }
    }
}

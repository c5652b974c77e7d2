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

use serde::{Deserialize, Serialize};

/// One layer of a `kind = "layers"` model (`type = "…"` in TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
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

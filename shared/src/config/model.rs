//! `[model]`: the network both sides agree on, which fixes the flat
//! parameter space. The MLP and CNN are described by their widths, a
//! `kind = "layers"` model by its list of layers (see [`super::layers`], which
//! also expands the ResNet presets), the GPT preset by `[model.gpt]`, and a
//! `kind = "custom"` model by its `[[model.tensors]]`.

use std::hash::Hasher;

use serde::{Deserialize, Serialize};

use super::layers::{plan, resnet, LayerSpec, Node, Shape};
use super::{check_range, invalid, ConfigError};

/// Model architecture kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Fully connected layers with ReLU.
    Mlp,
    /// 3x3 convolutions (ReLU, 2x2 max-pool each) on square images, then fully connected layers.
    Cnn,
    /// The layers listed in `model.layers` (see [`super::layers`]).
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
    #[serde(deserialize_with = "super::layers::deserialize_list")]
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

    /// Sizes in range, and the fields of the model's kind consistent: a CNN
    /// whose convolutions halve a square image to a whole side, layers whose
    /// shapes chain to `classes` outputs, a GPT's sizes, a custom model's
    /// tensors; fields of another kind left out.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Ranges first: the rules below compute with these values.
        self.check_ranges()?;
        if self.input == 0 || self.classes < 2 || self.hidden.contains(&0) {
            return Err(invalid(
                "model",
                "input must be >= 1, classes >= 2 and every hidden width >= 1",
            ));
        }
        if self.kind == ModelKind::Cnn {
            let Some(side) = self.image_side() else {
                return Err(invalid(
                    "model.input",
                    format!(
                        "a cnn needs input = in_channels * side^2; {} is not {} x a square",
                        self.input, self.in_channels
                    ),
                ));
            };
            if self.conv.is_empty() || self.conv.contains(&0) {
                return Err(invalid(
                    "model.conv",
                    "a cnn needs at least one conv width, all >= 1",
                ));
            }
            if side >> self.conv.len() == 0 || side % (1 << self.conv.len()) != 0 {
                return Err(invalid(
                    "model.conv",
                    format!(
                        "{} conv layers halve the {side}x{side} image {} times; the side must stay a whole number",
                        self.conv.len(),
                        self.conv.len()
                    ),
                ));
            }
        }
        if !self.layers.is_empty() && self.kind != ModelKind::Layers {
            return Err(invalid("model.layers", "only for kind = \"layers\""));
        }
        if !(self.width.is_finite() && self.width > 0.0 && self.width <= 64.0) {
            return Err(invalid("model.width", "must be in (0, 64]"));
        }
        if self.bn_calibration_batches == 0 {
            return Err(invalid("model.bn_calibration_batches", "must be >= 1"));
        }
        if self.is_layered() {
            self.nodes()?;
        }
        if !self.tensors.is_empty() && self.kind != ModelKind::Custom {
            return Err(invalid("model.tensors", "only for kind = \"custom\""));
        }
        if self.kind == ModelKind::Custom {
            check_tensor_decls(&self.tensors)?;
        }
        if self.kind == ModelKind::Gpt {
            self.gpt.validate()?;
        } else if self.gpt != GptSection::default() {
            return Err(invalid("model.gpt", "only for kind = \"gpt\""));
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClusterConfig;

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
}

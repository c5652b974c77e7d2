//! The candle model a worker trains, seen through the flat parameter space.
//!
//! The model's tensors are created in the order of
//! [`ModelSection::layout`](ps_shared::config::ModelSection::layout), so the
//! flat vector of all parameters (and of all gradients) has the same index space
//! on every worker and on the servers.
//!
//! ```
//! use ps_shared::config::ModelSection;
//! use ps_dataset::Batch;
//! use ps_worker::model::Model;
//! let spec = ModelSection { input: 4, hidden: vec![8], classes: 3, ..ModelSection::default() };
//! let mut model = Model::new(&spec, candle_core::Device::Cpu, 7).unwrap();
//! let batch = Batch { features: vec![0.5; 8], labels: vec![0, 2], dim: 4 };
//! let (loss, grad) = model.gradient(&batch).unwrap();
//! assert!(loss.is_finite());
//! assert_eq!(grad.len(), spec.num_params());
//! ```
//!
//! The MLP's backward pass is written out by hand on candle tensors rather
//! than taken from autograd: each weight gradient is one matmul
//! `dZᵀ · A` that comes out contiguous in the weight's own `out × in`
//! layout, so nothing is transposed, accumulated into a zeroed buffer or
//! copied twice. Gradients go straight into a flat buffer the caller keeps
//! across steps, and pulled parameters are written in place into the
//! tensors' storage (only the entries that changed, for sparse pulls). On
//! the CPU the CNN and the layered models run the hand-written executor of
//! [`crate::kernels`] (NHWC buffers planned once and reused); other devices,
//! and the tests that hold the executor to it, use candle's autograd.
//!
//! # Layered models and batch norm
//!
//! `kind = "layers"` and the ResNet presets are planned from the same
//! layer list twice: the CPU executor of [`crate::kernels::net`], and the
//! [`Net`] of [`crate::layers`] under autograd (other devices, and the
//! reference the executor is tested against). Weights of convolutions and linear
//! layers start Kaiming-uniform (`±sqrt(6 / fan_in)`), biases and batch-norm
//! β at 0, γ at 1.
//!
//! Batch norm's γ and β are parameters like any other: they live in the
//! flat space and their gradients go to the servers. Its running mean and
//! variance are not: they never leave the worker. In training a batch-norm
//! layer normalises with the batch's own statistics and folds them into the
//! running ones with momentum [`BN_MOMENTUM`] (`running = 0.9 running + 0.1
//! batch`, the variance unbiased). Those running statistics go stale,
//! because every pull changes the parameters under them, so before each
//! evaluation the worker recomputes them exactly ("precise BN",
//! [`Model::calibrate_bn`]): forward in training mode over the last
//! `model.bn_calibration_batches` training batches under the current
//! parameters, and running mean / variance = the mean over those batches of
//! each batch's mean / unbiased variance. [`Model::evaluate`] then uses
//! the running statistics, so a sample's prediction does not depend on the
//! batch it is evaluated in.
//!
//! Dropout is active only in [`Model::gradient_into`]; the mask of each
//! step is drawn from `(init seed, step)` where the step counts this
//! model's gradient computations from [`Model::set_step`] (the run loop
//! sets the step it joins the run at).

use std::ops::Range;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Module, Storage, Tensor, Var, D};
use candle_nn::Linear;
use rand::{rngs::StdRng, Rng, SeedableRng};

use ps_dataset::Batch;
use ps_shared::config::layers::{plan, Init, LayerSpec, Node, Shape};
use ps_shared::config::{ConfigError, ModelKind, ModelSection, TensorSpec};

use crate::api::Program;
use crate::kernels::gpt::GptExec;
use crate::kernels::net::{BatchStats, ExecError, NetExec, Running};
use crate::layers::{BnStats, Mode, Net};

/// Weight of the current batch in the running batch-norm statistics.
pub const BN_MOMENTUM: f64 = 0.1;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("flat vector has {got} entries, the model has {expected}")]
    Length { expected: usize, got: usize },
    #[error("batch has feature dimension {got}, the model expects {expected}")]
    BatchDim { expected: usize, got: usize },
    #[error("no gradient for tensor {0}")]
    MissingGrad(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("only a layered model runs in training mode")]
    NotLayered,
    #[error("unknown device `{0}`: use cpu, cuda or cuda:N")]
    Device(String),
    #[error("token {value} at position {position} of sample {sample} is not an id below the vocabulary size {vocab}")]
    Token {
        sample: usize,
        position: usize,
        value: f32,
        vocab: usize,
    },
    #[error("label {label} of sample {sample} is out of range for {classes} classes")]
    Label {
        sample: usize,
        label: u32,
        classes: usize,
    },
    /// The model's tensors differ from the layout `[model]` gives the
    /// servers (a custom model and its `model.tensors`).
    #[error("the model does not match [model]: {0}")]
    Layout(String),
    /// Initial weights (`training.init_weights`) that do not fit the model:
    /// a tensor missing, extra, of another shape, or a file that does not
    /// parse; the message names the file and the tensor.
    #[error("initial weights {source_name}: {message}")]
    InitWeights {
        source_name: String,
        message: String,
    },
    /// `kind = "custom"` asked of the built-in models.
    #[error("model.kind = \"custom\" is a model a program brings through ps_worker::api; `ps-worker train` builds only the built-in kinds")]
    CustomKind,
    /// A custom model's loss or evaluation closure failed.
    #[error("the model's {what} failed: {source}")]
    Program {
        what: &'static str,
        source: candle_core::Error,
    },
    #[error("layer executor: {0}")]
    Exec(#[from] ExecError),
    #[error("parameter tensor {0} is not a contiguous f32 CPU tensor")]
    NotHostF32(String),
}

/// Pick a candle device from a config string.
pub fn device_from_str(name: &str) -> Result<Device, ModelError> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::new_cuda(0)?),
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(ordinal) => Ok(Device::new_cuda(ordinal)?),
            None => Err(ModelError::Device(other.to_string())),
        },
    }
}

/// 2x2 max pooling written as a reshape and two max reductions, whose
/// gradient goes to the maximum (candle's `max_pool2d` backward scales it by
/// the window's share of maxima instead).
fn max_pool_2x2(x: &Tensor) -> Result<Tensor, ModelError> {
    let (b, c, h, w) = x.dims4()?;
    Ok(x.reshape((b, c, h / 2, 2, w / 2, 2))?.max(5)?.max(3)?)
}

/// Copy a tensor's f32 values into `out` (same number of elements): straight
/// from the storage when it is a contiguous CPU tensor.
fn copy_to_slice(t: &Tensor, out: &mut [f32]) -> Result<(), ModelError> {
    if t.elem_count() != out.len() {
        return Err(ModelError::Length {
            expected: out.len(),
            got: t.elem_count(),
        });
    }
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            out.copy_from_slice(&data[a..b]);
            return Ok(());
        }
    }
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    out.copy_from_slice(&values);
    Ok(())
}

/// What to write into one tensor, with indices relative to its first element.
enum Write<'a> {
    /// `values` from element `at` on (added to the elements when `add`).
    Range {
        at: usize,
        values: &'a [f32],
        add: bool,
    },
    /// `values[i]` at element `offset + indices[i] - start`, where `start` is
    /// the tensor's first flat index (added to the element when `add`).
    Scatter {
        offset: usize,
        start: usize,
        indices: &'a [u32],
        values: &'a [f32],
        add: bool,
    },
}

impl Write<'_> {
    fn apply(&self, data: &mut [f32]) {
        match self {
            Write::Range { at, values, add } => {
                let dst = &mut data[*at..*at + values.len()];
                if *add {
                    for (d, &v) in dst.iter_mut().zip(*values) {
                        *d += v;
                    }
                } else {
                    dst.copy_from_slice(values);
                }
            }
            Write::Scatter {
                offset,
                start,
                indices,
                values,
                add,
            } => {
                for (&i, &v) in indices.iter().zip(*values) {
                    let d = &mut data[offset + i as usize - start];
                    if *add {
                        *d += v;
                    } else {
                        *d = v;
                    }
                }
            }
        }
    }
}

impl InplaceOp1 for Write<'_> {
    fn name(&self) -> &'static str {
        "stratus-write-params"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(data), Some((a, b))) => {
                self.apply(&mut data[a..b]);
                Ok(())
            }
            _ => candle_core::bail!("parameters must be contiguous f32 tensors"),
        }
    }
}

/// Loss and logit gradient of the mean softmax cross-entropy, on the host
/// (a batch of logits is small): `(mean loss, (softmax - onehot) / batch)`.
fn softmax_cross_entropy(logits: &Tensor, labels: &[u32]) -> Result<(f32, Vec<f32>), ModelError> {
    let (_, classes) = logits.dims2()?;
    let mut grad = logits.flatten_all()?.to_vec1::<f32>()?;
    let loss = softmax_cross_entropy_in_place(&mut grad, classes, labels)?;
    Ok((loss, grad))
}

/// [`softmax_cross_entropy`] on host logits (`[batch, classes]`, turned
/// into their gradient in place).
fn softmax_cross_entropy_in_place(
    grad: &mut [f32],
    classes: usize,
    labels: &[u32],
) -> Result<f32, ModelError> {
    let batch = labels.len();
    let mut loss = 0.0f64;
    let scale = 1.0 / batch as f32;
    for (sample, (row, &label)) in grad.chunks_exact_mut(classes).zip(labels).enumerate() {
        let label = label as usize;
        if label >= classes {
            return Err(ModelError::Label {
                sample,
                label: label as u32,
                classes,
            });
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        loss += f64::from(sum.ln() - (row[label].ln()));
        for v in row.iter_mut() {
            *v *= scale / sum;
        }
        row[label] -= scale;
    }
    Ok((loss / batch as f64) as f32)
}

/// Every parameter as a host slice (no copy), for the layer executor.
fn with_param_slices<R>(
    vars: &[Var],
    tensors: &[TensorSpec],
    f: impl FnOnce(&[&[f32]]) -> R,
) -> Result<R, ModelError> {
    let guards: Vec<_> = vars
        .iter()
        .map(|v| v.as_tensor().storage_and_layout())
        .collect();
    let mut slices = Vec::with_capacity(guards.len());
    for ((storage, layout), t) in guards.iter().zip(tensors) {
        match (&**storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(data)), Some((a, b))) => slices.push(&data[a..b]),
            _ => return Err(ModelError::NotHostF32(t.name.clone())),
        }
    }
    Ok(f(&slices))
}

/// The executor's plan for a CPU model: the layered models' nodes, or the
/// CNN written as the same layers (conv-relu-maxpool blocks, flatten, the
/// fully connected layers) with the same parameter order. `None` where
/// the executor does not apply.
fn plan_exec(spec: &ModelSection, nodes: &[Node]) -> Option<NetExec> {
    if spec.is_layered() {
        return NetExec::new(nodes).ok();
    }
    if spec.kind != ModelKind::Cnn {
        return None;
    }
    let side = spec.image_side()?;
    let mut layers = Vec::new();
    let mut at = side;
    for &c in &spec.conv {
        // The autograd CNN pools by a reshape: only even sides.
        if at % 2 != 0 {
            return None;
        }
        at /= 2;
        layers.push(LayerSpec::Conv2d {
            out: c,
            kernel: 3,
            stride: 1,
            padding: Some(1),
            bias: true,
        });
        layers.push(LayerSpec::Relu);
        layers.push(LayerSpec::MaxPool {
            kernel: 2,
            stride: None,
        });
    }
    layers.push(LayerSpec::Flatten);
    for &h in &spec.hidden {
        layers.push(LayerSpec::Linear { out: h, bias: true });
        layers.push(LayerSpec::Relu);
    }
    layers.push(LayerSpec::Linear {
        out: spec.classes,
        bias: true,
    });
    let named: Vec<(String, LayerSpec)> = layers
        .into_iter()
        .enumerate()
        .map(|(i, l)| (format!("cnn.{i}"), l))
        .collect();
    let input = Shape::Image {
        c: spec.in_channels,
        h: side,
        w: side,
    };
    let nodes = plan(&named, input, |i| format!("cnn[{i}]")).ok()?;
    let exec = NetExec::new(&nodes).ok()?;
    let count: usize = nodes.iter().map(|n| n.params().len()).sum();
    (count == spec.layout().len()).then_some(exec)
}

/// An MLP, a small CNN or a layered model whose parameters map onto one
/// flat f32 index space.
pub struct Model {
    spec: ModelSection,
    device: Device,
    tensors: Vec<TensorSpec>,
    ranges: Vec<Range<usize>>,
    vars: Vec<Var>,
    /// Layered models: the forward pass.
    net: Option<Net>,
    /// Running statistics of each batch-norm layer (not parameters).
    running: Vec<BnStats>,
    /// Seed of the dropout masks.
    seed: u64,
    /// Gradient computations so far (the dropout masks' step).
    step: u64,
    /// A model a program brought through [`crate::api`]: its loss and
    /// evaluation closures (behind a lock: [`Model::evaluate`] takes
    /// `&self`, the closures may keep state).
    custom: Option<Mutex<Program>>,
    /// CPU layered models and the CNN: the hand-written forward/backward
    /// (behind a lock so evaluation, which borrows the model shared, can
    /// use its buffers too).
    exec: Option<Mutex<NetExec>>,
    /// The CPU GPT: its hand-written forward/backward (behind a lock for
    /// the same reason).
    gpt_exec: Option<Mutex<GptExec>>,
}

impl Model {
    /// Build with Kaiming-uniform weights and zero biases from `seed`.
    pub fn new(spec: &ModelSection, device: Device, seed: u64) -> Result<Self, ModelError> {
        if spec.kind == ModelKind::Custom {
            return Err(ModelError::CustomKind);
        }
        let tensors = spec.layout();
        let ranges = spec.tensor_ranges();
        let nodes = if spec.is_layered() {
            spec.nodes()?
        } else {
            Vec::new()
        };
        // The MLP and CNN keep their uniform ±sqrt(1 / fan_in) weights.
        let inits: Vec<(Init, f32)> = if nodes.is_empty() {
            let legacy = |t: &TensorSpec| match t.shape.len() {
                1 => (Init::Zeros, 0.0),
                _ => (Init::Kaiming, 1.0),
            };
            tensors.iter().map(legacy).collect()
        } else {
            let params = nodes.iter().flat_map(|n| n.params());
            params.map(|p| (p.init, 6.0)).collect()
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let mut vars = Vec::with_capacity(tensors.len());
        if spec.kind == ModelKind::Gpt {
            let values = crate::gpt::init_values(&spec.gpt, &mut rng);
            for (t, v) in tensors.iter().zip(values) {
                let init = Tensor::from_vec(v, t.shape.as_slice(), &device)?;
                vars.push(Var::from_tensor(&init)?);
            }
        }
        for (t, &(kind, gain)) in tensors.iter().zip(&inits).skip(vars.len()) {
            let mut init = vec![0.0f32; t.numel()];
            match kind {
                Init::Kaiming => {
                    let fan_in: usize = t.shape[1..].iter().product();
                    let bound = (gain / fan_in as f32).sqrt();
                    for v in &mut init {
                        *v = rng.random_range(-bound..bound);
                    }
                }
                Init::Ones => init.fill(1.0),
                Init::Zeros => {}
            }
            let init = Tensor::from_vec(init, t.shape.as_slice(), &device)?;
            vars.push(Var::from_tensor(&init)?);
        }
        let net = (!nodes.is_empty()).then(|| Net::new(&nodes));
        let gpt_exec = (spec.kind == ModelKind::Gpt && device.is_cpu())
            .then(|| Mutex::new(crate::gpt::exec_for(&spec.gpt)));
        let exec = if device.is_cpu() {
            plan_exec(spec, &nodes).map(Mutex::new)
        } else {
            None
        };
        let mut running = Vec::new();
        for &c in net.iter().flat_map(|n| n.norms()) {
            running.push(BnStats {
                mean: Tensor::zeros(c, DType::F32, &device)?,
                var: Tensor::ones(c, DType::F32, &device)?,
            });
        }
        Ok(Self {
            spec: spec.clone(),
            device,
            tensors,
            ranges,
            vars,
            net,
            running,
            seed,
            step: 0,
            custom: None,
            exec,
            gpt_exec,
        })
    }

    /// A model made of the caller's own `Var`s (in flat-space order) and
    /// closures: see [`crate::api::CustomModel`]. Every tensor must be a
    /// contiguous f32 tensor on `device`.
    pub(crate) fn from_program(
        device: Device,
        named: Vec<(String, Var)>,
        program: Program,
    ) -> Result<Self, ModelError> {
        let mut tensors = Vec::with_capacity(named.len());
        let mut vars = Vec::with_capacity(named.len());
        for (name, var) in named {
            let t = var.as_tensor();
            if t.dtype() != DType::F32 || !t.is_contiguous() || !t.device().same_device(&device) {
                return Err(ModelError::Layout(format!(
                    "tensor `{name}` must be a contiguous f32 tensor on the run's device ({:?}); it is {:?} on {:?}",
                    device,
                    t.dtype(),
                    t.device()
                )));
            }
            tensors.push(TensorSpec {
                name,
                shape: t.dims().to_vec(),
            });
            vars.push(var);
        }
        let mut start = 0;
        let ranges = tensors
            .iter()
            .map(|t| {
                let r = start..start + t.numel();
                start = r.end;
                r
            })
            .collect();
        let spec = ModelSection {
            kind: ModelKind::Custom,
            tensors: tensors
                .iter()
                .map(|t| ps_shared::config::TensorDecl {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                })
                .collect(),
            ..ModelSection::default()
        };
        Ok(Self {
            spec,
            device,
            tensors,
            ranges,
            vars,
            net: None,
            running: Vec::new(),
            seed: 0,
            step: 0,
            custom: Some(Mutex::new(program)),
            exec: None,
            gpt_exec: None,
        })
    }

    /// The model's tensors (names and shapes) in flat-space order.
    pub fn layout(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Refuses a model whose tensors are not `spec`'s layout (the one the
    /// servers shard), naming the first tensor that differs.
    pub fn check_layout(&self, spec: &ModelSection) -> Result<(), ModelError> {
        let want = spec.layout();
        let ours = &self.tensors;
        let show = |t: &TensorSpec| format!("`{}` {:?}", t.name, t.shape);
        for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
            if a != b {
                return Err(ModelError::Layout(format!(
                    "tensor {i} is {} in the model and {} in the config (model.tensors[{i}])",
                    show(a),
                    show(b)
                )));
            }
        }
        match ours.len().cmp(&want.len()) {
            std::cmp::Ordering::Equal => Ok(()),
            std::cmp::Ordering::Greater => Err(ModelError::Layout(format!(
                "the model has {} tensors, the config lists {}; the first one missing from the config is {}",
                ours.len(),
                want.len(),
                show(&ours[want.len()])
            ))),
            std::cmp::Ordering::Less => Err(ModelError::Layout(format!(
                "the model has {} tensors, the config lists {}; the model lacks {}",
                ours.len(),
                want.len(),
                show(&want[ours.len()])
            ))),
        }
    }

    /// Whether the model has batch-norm layers (whose running statistics
    /// [`Model::calibrate_bn`] recomputes).
    pub fn has_batch_norm(&self) -> bool {
        !self.running.is_empty()
    }

    /// Sets the step the next dropout mask is drawn for (a worker that
    /// rejoins a run at `step` continues the same stream of masks).
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Recomputes the batch-norm running statistics under the current
    /// parameters ("precise BN"): forward in training mode over `batches`,
    /// then each layer's running mean and variance are the means over the
    /// batches of the batch mean and unbiased batch variance. Nothing
    /// happens for a model without batch norm or with no non-empty batch.
    pub fn calibrate_bn<B: AsRef<Batch>>(&mut self, batches: &[B]) -> Result<(), ModelError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let mut sums: Option<Vec<BnStats>> = None;
        let mut count = 0usize;
        let mode = Mode::Train {
            seed: self.seed,
            step: self.step,
        };
        for batch in batches.iter().map(AsRef::as_ref) {
            if batch.is_empty() || self.running.is_empty() {
                continue;
            }
            let stats = match &self.exec {
                Some(exec) => {
                    self.check_dim(batch)?;
                    let mut exec = exec.lock().unwrap_or_else(|e| e.into_inner());
                    with_param_slices(&self.vars, &self.tensors, |params| {
                        exec.forward(params, &batch.features, batch.len(), mode, None)
                            .map(|_| ())
                    })??;
                    exec.batch_stats()
                        .iter()
                        .map(|s| {
                            Ok(BnStats {
                                mean: Tensor::from_slice(&s.mean, s.mean.len(), &self.device)?,
                                var: Tensor::from_slice(&s.var, s.var.len(), &self.device)?,
                            })
                        })
                        .collect::<Result<Vec<_>, candle_core::Error>>()?
                }
                None => {
                    let x = self.input_of(batch)?;
                    let mut stats = Vec::with_capacity(self.running.len());
                    net.forward(&self.vars, &self.running, &x, mode, &mut stats)?;
                    stats
                }
            };
            sums = Some(match sums {
                None => stats,
                Some(sums) => sums
                    .into_iter()
                    .zip(stats)
                    .map(|(a, b)| {
                        Ok(BnStats {
                            mean: (a.mean + b.mean)?,
                            var: (a.var + b.var)?,
                        })
                    })
                    .collect::<Result<_, candle_core::Error>>()?,
            });
            count += 1;
        }
        if let Some(sums) = sums {
            let k = count as f64;
            for (r, s) in self.running.iter_mut().zip(sums) {
                r.mean = (s.mean / k)?;
                r.var = (s.var / k)?;
            }
        }
        Ok(())
    }

    /// Each batch-norm layer's running mean and variance, in layer order.
    pub fn bn_running(&self) -> Result<Vec<BatchStats>, ModelError> {
        self.running
            .iter()
            .map(|r| {
                Ok(BatchStats {
                    mean: r.mean.to_vec1()?,
                    var: r.var.to_vec1()?,
                })
            })
            .collect()
    }

    pub fn num_params(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// The model section this model was built from.
    pub fn spec(&self) -> &ModelSection {
        &self.spec
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The seed of this step's dropout masks.
    pub(crate) fn dropout_seed(&self) -> u64 {
        self.seed
            ^ self
                .step
                .wrapping_add(1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// Runs `f` on the CPU GPT's executor with every parameter as a host
    /// slice and the flat gradient's ranges; `None` without an executor.
    pub(crate) fn with_gpt_exec<R>(
        &self,
        f: impl FnOnce(&mut GptExec, &[&[f32]], &[Range<usize>]) -> R,
    ) -> Result<Option<R>, ModelError> {
        let Some(exec) = &self.gpt_exec else {
            return Ok(None);
        };
        let mut exec = exec.lock().unwrap_or_else(|e| e.into_inner());
        with_param_slices(&self.vars, &self.tensors, |params| {
            Some(f(&mut exec, params, &self.ranges))
        })
    }

    pub(crate) fn advance_step(&mut self) {
        self.step += 1;
    }

    /// The named tensors in flat-space order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The flat range of the tensor called `name`.
    pub fn range_of(&self, name: &str) -> Option<Range<usize>> {
        let i = self.tensors.iter().position(|t| t.name == name)?;
        Some(self.ranges[i].clone())
    }

    /// The current parameters, flat (a copy).
    pub fn flat_params(&self) -> Result<Vec<f32>, ModelError> {
        let mut flat = vec![0.0f32; self.num_params()];
        self.flat_params_into(&mut flat)?;
        Ok(flat)
    }

    /// The current parameters, flat, written into `out` (of the model's
    /// length).
    pub fn flat_params_into(&self, out: &mut [f32]) -> Result<(), ModelError> {
        if out.len() != self.num_params() {
            return Err(ModelError::Length {
                expected: self.num_params(),
                got: out.len(),
            });
        }
        for (var, r) in self.vars.iter().zip(&self.ranges) {
            copy_to_slice(var.as_tensor(), &mut out[r.clone()])?;
        }
        Ok(())
    }

    /// Replaces every parameter with the tensor of the same name in the
    /// safetensors file `bytes` (read from `source`, which errors name).
    /// The file must hold exactly the model's tensors, each of the model's
    /// shape; any float dtype is converted to f32.
    pub fn load_safetensors(&mut self, bytes: &[u8], source: &str) -> Result<(), ModelError> {
        let err = |message: String| ModelError::InitWeights {
            source_name: source.to_string(),
            message,
        };
        let tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
            .map_err(|e| err(format!("not a safetensors file: {e}")))?;
        let mut flat = vec![0.0f32; self.num_params()];
        for (t, range) in self.tensors.iter().zip(&self.ranges) {
            let Some(v) = tensors.get(&t.name) else {
                return Err(err(format!(
                    "has no tensor `{}` (shape {:?}) of the model",
                    t.name, t.shape
                )));
            };
            if v.dims() != t.shape.as_slice() {
                return Err(err(format!(
                    "tensor `{}` has shape {:?}, the model's is {:?}",
                    t.name,
                    v.dims(),
                    t.shape
                )));
            }
            let values = v
                .to_dtype(DType::F32)
                .and_then(|v| v.flatten_all()?.to_vec1::<f32>())
                .map_err(|e| err(format!("tensor `{}`: {e}", t.name)))?;
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                return Err(err(format!(
                    "tensor `{}` holds {} at entry {i}",
                    t.name, values[i]
                )));
            }
            flat[range.clone()].copy_from_slice(&values);
        }
        let mut extra: Vec<&String> = tensors
            .keys()
            .filter(|k| !self.tensors.iter().any(|t| &t.name == *k))
            .collect();
        if !extra.is_empty() {
            extra.sort();
            return Err(err(format!(
                "tensor `{}` is not one of the model's ({} extra in all)",
                extra[0],
                extra.len()
            )));
        }
        self.set_flat(&flat)
    }

    /// Replace every parameter.
    pub fn set_flat(&mut self, values: &[f32]) -> Result<(), ModelError> {
        if values.len() != self.num_params() {
            return Err(ModelError::Length {
                expected: self.num_params(),
                got: values.len(),
            });
        }
        self.write_range(0, values)
    }

    /// Write one tensor in place (CPU) or by replacing its storage's values
    /// (other devices).
    fn write_tensor(&self, tensor: usize, write: &Write<'_>) -> Result<(), ModelError> {
        let var = &self.vars[tensor];
        if self.device.is_cpu() {
            var.as_tensor().inplace_op1(write)?;
            return Ok(());
        }
        let mut host = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        write.apply(&mut host);
        let shape = self.tensors[tensor].shape.as_slice();
        var.set(&Tensor::from_vec(host, shape, &self.device)?)?;
        Ok(())
    }

    /// Overwrite a contiguous range of the flat parameters starting at `offset`.
    pub fn write_range(&mut self, offset: usize, values: &[f32]) -> Result<(), ModelError> {
        self.range_op(offset, values, false)
    }

    /// Add `values` to a contiguous range of the flat parameters starting
    /// at `offset` (an f16 reply's change).
    pub fn add_range(&mut self, offset: usize, values: &[f32]) -> Result<(), ModelError> {
        self.range_op(offset, values, true)
    }

    fn range_op(&mut self, offset: usize, values: &[f32], add: bool) -> Result<(), ModelError> {
        let end = offset
            .checked_add(values.len())
            .filter(|&e| e <= self.num_params())
            .ok_or(ModelError::Length {
                expected: self.num_params(),
                got: offset.saturating_add(values.len()),
            })?;
        for (t, r) in self.ranges.iter().enumerate() {
            let (lo, hi) = (r.start.max(offset), r.end.min(end));
            if lo < hi {
                let write = Write::Range {
                    at: lo - r.start,
                    values: &values[lo - offset..hi - offset],
                    add,
                };
                self.write_tensor(t, &write)?;
            }
        }
        Ok(())
    }

    /// Overwrite scattered entries `offset + indices[i]` (in place: the cost
    /// grows with the entries, not with the model).
    pub fn write_sparse(
        &mut self,
        offset: usize,
        indices: &[u32],
        values: &[f32],
    ) -> Result<(), ModelError> {
        self.sparse_op(offset, indices, values, false)
    }

    /// Add `values[i]` to the entries `offset + indices[i]` (an f16 sparse
    /// reply's change).
    pub fn add_sparse(
        &mut self,
        offset: usize,
        indices: &[u32],
        values: &[f32],
    ) -> Result<(), ModelError> {
        self.sparse_op(offset, indices, values, true)
    }

    fn sparse_op(
        &mut self,
        offset: usize,
        indices: &[u32],
        values: &[f32],
        add: bool,
    ) -> Result<(), ModelError> {
        if indices.len() != values.len() {
            return Err(ModelError::Length {
                expected: indices.len(),
                got: values.len(),
            });
        }
        let len = self.num_params();
        if let Some(bad) = indices.iter().find(|&&i| offset + i as usize >= len) {
            return Err(ModelError::Length {
                expected: len,
                got: offset + *bad as usize + 1,
            });
        }
        // Runs of consecutive entries in one tensor (one run per tensor when
        // the indices are sorted, as the servers send them).
        let mut start = 0;
        while start < indices.len() {
            let global = offset + indices[start] as usize;
            let t = self.ranges.partition_point(|r| r.end <= global);
            let r = &self.ranges[t];
            let mut end = start + 1;
            while end < indices.len() && r.contains(&(offset + indices[end] as usize)) {
                end += 1;
            }
            let write = Write::Scatter {
                offset,
                start: r.start,
                indices: &indices[start..end],
                values: &values[start..end],
                add,
            };
            self.write_tensor(t, &write)?;
            start = end;
        }
        Ok(())
    }

    /// Logits in evaluation mode (running statistics, no dropout).
    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        if let Some(net) = &self.net {
            return Ok(net.forward(&self.vars, &self.running, x, Mode::Eval, &mut Vec::new())?);
        }
        let mut h = x.clone();
        let mut first_linear = 0;
        if self.spec.kind == ModelKind::Cnn {
            let side = self.spec.image_side().unwrap_or(0);
            h = h.reshape((h.dim(0)?, self.spec.in_channels, side, side))?;
            for l in 0..self.spec.conv.len() {
                let w = self.vars[2 * l].as_tensor();
                let b = self.vars[2 * l + 1].as_tensor();
                h = h.conv2d(w, 1, 1, 1, 1)?;
                h = h.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?;
                h = max_pool_2x2(&h.relu()?)?;
            }
            h = h.flatten_from(1)?;
            first_linear = self.spec.conv.len();
        }
        let layers = self.vars.len() / 2;
        for l in first_linear..layers {
            let lin = Linear::new(
                self.vars[2 * l].as_tensor().clone(),
                Some(self.vars[2 * l + 1].as_tensor().clone()),
            );
            h = lin.forward(&h)?;
            if l + 1 < layers {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    fn check_dim(&self, batch: &Batch) -> Result<(), ModelError> {
        if batch.dim != self.spec.input || batch.features.len() != batch.len() * batch.dim {
            return Err(ModelError::BatchDim {
                expected: self.spec.input,
                got: batch.dim,
            });
        }
        Ok(())
    }

    fn input_of(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.check_dim(batch)?;
        Ok(Tensor::from_slice(
            &batch.features,
            (batch.len(), batch.dim),
            &self.device,
        )?)
    }

    fn check_labels(&self, batch: &Batch) -> Result<(), ModelError> {
        let classes = self.spec.classes;
        match batch.labels.iter().position(|&l| l as usize >= classes) {
            Some(sample) => Err(ModelError::Label {
                sample,
                label: batch.labels[sample],
                classes,
            }),
            None => Ok(()),
        }
    }

    /// Forward + backward on a batch: the mean cross-entropy loss and the flat gradient.
    pub fn gradient(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>), ModelError> {
        let mut flat = vec![0.0f32; self.num_params()];
        let loss = self.gradient_into(batch, &mut flat)?;
        Ok((loss, flat))
    }

    /// Forward + backward on a batch, writing the flat gradient into `out`
    /// (every entry is overwritten); returns the mean cross-entropy loss.
    pub fn gradient_into(&mut self, batch: &Batch, out: &mut [f32]) -> Result<f32, ModelError> {
        self.gradient_with(batch, out, &mut |_, _| {})
    }

    /// [`Model::gradient_into`], handing the gradient over while the
    /// backward pass still runs: `ready(from, out)` says that `out[from..]`
    /// is final, each time that suffix grows (the passes finish the layers
    /// last to first, and the flat layout keeps them first to last), and
    /// last with `from = 0`. A step whose loss is not finite calls it never.
    /// Models without a hand-written pass (candle's autograd, a program's
    /// own model) call it once, at the end.
    pub fn gradient_streamed(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
        ready: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<f32, ModelError> {
        let mut frontier = Frontier::new(&self.ranges);
        let loss = self.gradient_with(batch, out, &mut |tensors, grads| {
            if let Some(from) = frontier.finish(tensors) {
                ready(from, grads)
            }
        })?;
        if loss.is_finite() && frontier.next > 0 {
            ready(0, out);
        }
        Ok(loss)
    }

    /// Forward + backward, telling `finished` which parameter tensors'
    /// gradients are final as the hand-written passes finish each layer
    /// (never on a step whose loss is not finite).
    fn gradient_with(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
        finished: &mut dyn FnMut(&[usize], &[f32]),
    ) -> Result<f32, ModelError> {
        if self.custom.is_some() {
            return self.program_backward(batch, out);
        }
        if self.exec.is_some() {
            self.check_batch(batch, out)?;
            return self.exec_backward(batch, out, finished);
        }
        if self.spec.kind == ModelKind::Gpt {
            self.check_out(out)?;
            return self.gpt_backward(batch, out, finished);
        }
        let x = self.checked_input(batch, out)?;
        match self.spec.kind {
            ModelKind::Mlp => self.mlp_backward(&x, &batch.labels, out, finished),
            _ if self.net.is_some() => self.train_backward(&x, &batch.labels, out),
            _ => self.autograd_backward(&x, &batch.labels, out),
        }
    }

    /// Forward + backward through candle's autograd, for either model kind
    /// (the MLP's hand-written pass is checked against it).
    pub fn autograd_gradient_into(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        if self.spec.kind == ModelKind::Gpt {
            self.check_out(out)?;
            return self.gpt_autograd_backward(batch, out);
        }
        let x = self.checked_input(batch, out)?;
        if self.net.is_some() {
            return self.train_backward(&x, &batch.labels, out);
        }
        self.autograd_backward(&x, &batch.labels, out)
    }

    /// The batch's input tensor, once `out` fits the flat gradient and every
    /// label is a class.
    fn checked_input(&self, batch: &Batch, out: &[f32]) -> Result<Tensor, ModelError> {
        self.check_batch(batch, out)?;
        self.input_of(batch)
    }

    /// `out` fits the flat gradient, every label is a class and the
    /// features have the model's input width.
    fn check_batch(&self, batch: &Batch, out: &[f32]) -> Result<(), ModelError> {
        self.check_out(out)?;
        self.check_labels(batch)?;
        self.check_dim(batch)
    }

    /// `out` has one entry per parameter.
    fn check_out(&self, out: &[f32]) -> Result<(), ModelError> {
        if out.len() != self.num_params() {
            return Err(ModelError::Length {
                expected: self.num_params(),
                got: out.len(),
            });
        }
        Ok(())
    }

    /// The MLP's backward pass by hand, in a feature-major layout: each
    /// activation is kept as `Aᵀ` (`features × batch`), which is the layout
    /// the matmul library runs fastest in for these shapes (2-3x faster
    /// forward than `A · Wᵀ`). For layer `l` with `Zᵀ_l = W_l Aᵀ_l + b_l`:
    /// `dW_l = dZᵀ_l · A_l` (contiguous, `out × in`, the weight's layout),
    /// `db_l = Σ_columns dZᵀ_l`, and `dZᵀ_{l-1} = (W_lᵀ dZᵀ_l) ⊙ [Aᵀ_l > 0]`
    /// (the ReLU's mask).
    fn mlp_backward(
        &self,
        x: &Tensor,
        labels: &[u32],
        out: &mut [f32],
        finished: &mut dyn FnMut(&[usize], &[f32]),
    ) -> Result<f32, ModelError> {
        let layers = self.vars.len() / 2;
        let mut inputs = Vec::with_capacity(layers);
        let mut at = x.t()?.contiguous()?;
        for l in 0..layers {
            let w = self.vars[2 * l].as_tensor();
            let b = self.vars[2 * l + 1].as_tensor();
            let zt = w.matmul(&at)?.broadcast_add(&b.reshape((b.dim(0)?, 1))?)?;
            inputs.push(at);
            at = if l + 1 < layers { zt.relu()? } else { zt };
        }
        // `at` holds the logits, classes × batch; the loss works per sample.
        let logits = at.t()?.contiguous()?;
        let (loss, dlogits) = softmax_cross_entropy(&logits, labels)?;
        let mut dzt = Tensor::from_vec(dlogits, logits.shape(), &self.device)?
            .t()?
            .contiguous()?;
        for l in (0..layers).rev() {
            let at = &inputs[l];
            let dw = dzt.matmul(&at.t()?)?;
            copy_to_slice(&dw, &mut out[self.ranges[2 * l].clone()])?;
            let db = dzt.sum(1)?;
            copy_to_slice(&db, &mut out[self.ranges[2 * l + 1].clone()])?;
            if loss.is_finite() {
                finished(&[2 * l, 2 * l + 1], out);
            }
            if l > 0 {
                let w = self.vars[2 * l].as_tensor();
                let mask = at.gt(0f32)?.to_dtype(DType::F32)?;
                dzt = w.t()?.matmul(&dzt)?.mul(&mask)?;
            }
        }
        Ok(loss)
    }

    /// A training step through the layer executor: forward in training mode,
    /// backward by hand into `out`, then the batch statistics folded into
    /// the running ones (as [`Model::train_backward`] does) and the dropout
    /// step advanced.
    fn exec_backward(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
        finished: &mut dyn FnMut(&[usize], &[f32]),
    ) -> Result<f32, ModelError> {
        let exec = self.exec.as_mut().ok_or(ModelError::NotLayered)?;
        let exec = exec.get_mut().unwrap_or_else(|e| e.into_inner());
        let mode = Mode::Train {
            seed: self.seed,
            step: self.step,
        };
        let ranges = &self.ranges;
        let loss = with_param_slices(&self.vars, &self.tensors, |params| {
            exec.forward(params, &batch.features, batch.len(), mode, None)?;
            let classes = exec.classes();
            let (logits, grad) = exec.logits_and_grad();
            grad.copy_from_slice(logits);
            let loss = softmax_cross_entropy_in_place(grad, classes, &batch.labels)?;
            let live = loss.is_finite();
            exec.backward_with(params, out, ranges, &mut |t, g| {
                if live {
                    finished(t, g)
                }
            })?;
            Ok::<_, ModelError>(loss)
        })??;
        self.step += 1;
        for (r, s) in self.running.iter_mut().zip(exec.batch_stats()) {
            let mean = Tensor::from_slice(&s.mean, s.mean.len(), &self.device)?;
            let var = Tensor::from_slice(&s.var, s.var.len(), &self.device)?;
            r.mean = ((&r.mean * (1.0 - BN_MOMENTUM))? + (mean * BN_MOMENTUM)?)?;
            r.var = ((&r.var * (1.0 - BN_MOMENTUM))? + (var * BN_MOMENTUM)?)?;
        }
        Ok(loss)
    }

    /// Eval-mode logits through the layer executor (`None` without one).
    fn exec_eval(&self, batch: &Batch) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(exec) = &self.exec else {
            return Ok(None);
        };
        let mut exec = exec.lock().unwrap_or_else(|e| e.into_inner());
        let host: Vec<(Vec<f32>, Vec<f32>)> = self
            .running
            .iter()
            .map(|r| Ok((r.mean.to_vec1::<f32>()?, r.var.to_vec1::<f32>()?)))
            .collect::<Result<_, candle_core::Error>>()?;
        let running: Vec<Running> = host
            .iter()
            .map(|(mean, var)| Running { mean, var })
            .collect();
        let logits = with_param_slices(&self.vars, &self.tensors, |params| {
            exec.forward(
                params,
                &batch.features,
                batch.len(),
                Mode::Eval,
                Some(&running),
            )
            .map(<[f32]>::to_vec)
        })??;
        Ok(Some(logits))
    }

    /// A layered model's training step: forward in training mode, backward
    /// through autograd, the batch statistics folded into the running ones
    /// and the dropout step advanced.
    fn train_backward(
        &mut self,
        x: &Tensor,
        labels: &[u32],
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let (logits, stats) = self.train_logits(x, self.step)?;
        let loss = self.loss_backward(&logits, labels, out)?;
        self.step += 1;
        for (r, s) in self.running.iter_mut().zip(stats) {
            r.mean = ((&r.mean * (1.0 - BN_MOMENTUM))? + (s.mean * BN_MOMENTUM)?)?;
            r.var = ((&r.var * (1.0 - BN_MOMENTUM))? + (s.var * BN_MOMENTUM)?)?;
        }
        Ok(loss)
    }

    /// A layered model's logits in training mode at dropout step `step`,
    /// with each batch-norm layer's batch statistics.
    fn train_logits(&self, x: &Tensor, step: u64) -> Result<(Tensor, Vec<BnStats>), ModelError> {
        let net = self.net.as_ref().ok_or(ModelError::NotLayered)?;
        let mode = Mode::Train {
            seed: self.seed,
            step,
        };
        let mut stats = Vec::with_capacity(self.running.len());
        let logits = net.forward(&self.vars, &self.running, x, mode, &mut stats)?;
        Ok((logits, stats))
    }

    /// The MLP or CNN through candle's autograd.
    fn autograd_backward(
        &self,
        x: &Tensor,
        labels: &[u32],
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let logits = self.forward(x)?;
        self.loss_backward(&logits, labels, out)
    }

    /// Mean cross-entropy of `logits`, its gradient written into `out`.
    fn loss_backward(
        &self,
        logits: &Tensor,
        labels: &[u32],
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let y = Tensor::from_slice(labels, labels.len(), &self.device)?;
        let loss = candle_nn::loss::cross_entropy(logits, &y)?;
        self.write_grads(&loss, out)?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Backward from `loss`, every parameter's gradient written into `out`.
    pub(crate) fn write_grads(&self, loss: &Tensor, out: &mut [f32]) -> Result<(), ModelError> {
        let grads = loss.backward()?;
        for ((var, t), r) in self.vars.iter().zip(&self.tensors).zip(&self.ranges) {
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| ModelError::MissingGrad(t.name.clone()))?;
            copy_to_slice(g, &mut out[r.clone()])?;
        }
        Ok(())
    }

    /// A custom model's step: its loss closure in training mode, then
    /// autograd; a tensor the loss does not depend on gets a zero gradient.
    fn program_backward(&mut self, batch: &Batch, out: &mut [f32]) -> Result<f32, ModelError> {
        if out.len() != self.num_params() {
            return Err(ModelError::Length {
                expected: self.num_params(),
                got: out.len(),
            });
        }
        let Some(program) = &self.custom else {
            return Err(ModelError::CustomKind);
        };
        let phase = crate::api::Phase::Train { step: self.step };
        let loss = {
            let mut p = program.lock().unwrap_or_else(|e| e.into_inner());
            p.loss(batch, phase).map_err(|source| ModelError::Program {
                what: "loss",
                source,
            })?
        };
        let loss = loss.flatten_all()?;
        if loss.elem_count() != 1 {
            return Err(ModelError::Program {
                what: "loss",
                source: candle_core::Error::Msg(format!(
                    "it must return one value (a scalar tensor), not shape {:?}",
                    loss.dims()
                )),
            });
        }
        let grads = loss.backward()?;
        for (var, r) in self.vars.iter().zip(&self.ranges) {
            match grads.get(var.as_tensor()) {
                Some(g) => copy_to_slice(g, &mut out[r.clone()])?,
                None => out[r.clone()].fill(0.0),
            }
        }
        self.step += 1;
        Ok(loss.to_dtype(DType::F32)?.to_vec1::<f32>()?[0])
    }

    /// [`Model::evaluate`] on `batch` in chunks of at most `chunk` samples
    /// (0 = one pass), so a large test split never becomes one huge batch
    /// of activations. Every sample weighs the same in the mean loss and
    /// accuracy (for text each sample has `seq_len` target tokens), so the
    /// chunks' results, weighted by their sample counts and summed in f64,
    /// give the one-pass result up to float rounding.
    pub fn evaluate_chunked(&self, batch: &Batch, chunk: usize) -> Result<(f32, f32), ModelError> {
        let n = batch.len();
        if chunk == 0 || n <= chunk {
            return self.evaluate(batch);
        }
        let (mut loss, mut correct) = (0.0f64, 0.0f64);
        let mut start = 0;
        while start < n {
            let end = (start + chunk).min(n);
            let part = Batch {
                features: batch.features[start * batch.dim..end * batch.dim].to_vec(),
                labels: batch.labels[start..end].to_vec(),
                dim: batch.dim,
            };
            let (l, a) = self.evaluate(&part)?;
            let w = (end - start) as f64;
            loss += f64::from(l) * w;
            correct += f64::from(a) * w;
            start = end;
        }
        Ok(((loss / n as f64) as f32, (correct / n as f64) as f32))
    }

    /// Mean loss and accuracy on a batch (no gradients).
    pub fn evaluate(&self, batch: &Batch) -> Result<(f32, f32), ModelError> {
        if batch.is_empty() {
            return Ok((0.0, 0.0));
        }
        if let Some(program) = &self.custom {
            let mut p = program.lock().unwrap_or_else(|e| e.into_inner());
            return p.evaluate(batch).map_err(|source| ModelError::Program {
                what: "evaluation",
                source,
            });
        }
        if self.spec.kind == ModelKind::Gpt {
            return self.gpt_evaluate(batch);
        }
        self.check_labels(batch)?;
        self.check_dim(batch)?;
        if let Some(mut logits) = self.exec_eval(batch)? {
            let classes = self.spec.classes;
            let mut correct = 0usize;
            for (row, &label) in logits.chunks_exact(classes).zip(&batch.labels) {
                // The first largest logit, as an argmax picks it.
                let best = row
                    .iter()
                    .enumerate()
                    .fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
                correct += usize::from(best == label as usize);
            }
            let loss = softmax_cross_entropy_in_place(&mut logits, classes, &batch.labels)?;
            return Ok((loss, correct as f32 / batch.len() as f32));
        }
        let x = self.input_of(batch)?;
        let y = Tensor::from_slice(&batch.labels, batch.len(), &self.device)?;
        let logits = self.forward(&x)?.detach();
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
        let correct = logits
            .argmax(D::Minus1)?
            .eq(&y)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok((loss, correct / batch.len() as f32))
    }

    /// The logits of a batch, flat (`batch × classes`, on the host): in
    /// evaluation mode, or with `train` in training mode (batch statistics,
    /// the current step's dropout masks; nothing is updated). Used to
    /// compare devices.
    pub fn logits(&self, batch: &Batch, train: bool) -> Result<Vec<f32>, ModelError> {
        let x = self.input_of(batch)?;
        let logits = match (&self.net, train) {
            (Some(_), true) => self.train_logits(&x, self.step)?.0,
            _ => self.forward(&x)?,
        };
        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// Which suffix of the flat gradient is final during a backward pass.
/// The hand-written passes finish the layers last to first, and the flat
/// layout keeps the tensors first to last: once tensors `next..` are all
/// final, so is the gradient from `ranges[next].start` on. A layout whose
/// ranges do not follow the tensors in order has no such suffix: nothing
/// is final before the pass ends.
struct Frontier {
    /// Where each tensor's gradient starts.
    starts: Vec<usize>,
    done: Vec<bool>,
    /// Tensors `next..` are final.
    next: usize,
    ordered: bool,
}

impl Frontier {
    fn new(ranges: &[Range<usize>]) -> Self {
        let ordered = ranges.first().is_none_or(|r| r.start == 0)
            && ranges.windows(2).all(|w| w[0].end == w[1].start);
        Frontier {
            starts: ranges.iter().map(|r| r.start).collect(),
            done: vec![false; ranges.len()],
            next: ranges.len(),
            ordered,
        }
    }

    /// Marks `tensors` final; the new start of the final suffix when it
    /// grew.
    fn finish(&mut self, tensors: &[usize]) -> Option<usize> {
        if !self.ordered {
            return None;
        }
        for &t in tensors {
            if let Some(d) = self.done.get_mut(t) {
                *d = true;
            }
        }
        let before = self.next;
        while self.next > 0 && self.done[self.next - 1] {
            self.next -= 1;
        }
        (self.next < before).then(|| self.starts[self.next])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSection {
        ModelSection {
            input: 3,
            hidden: vec![5],
            classes: 2,
            ..ModelSection::default()
        }
    }

    /// `(loss(p + eps e_i) - loss(p - eps e_i)) / 2 eps` around `base`,
    /// with the evaluation loss on `batch`.
    fn central_difference(m: &mut Model, base: &[f32], batch: &Batch, i: usize, eps: f32) -> f32 {
        central_difference_of(m, base, i, eps, |m| m.evaluate(batch).unwrap().0)
    }

    /// `(loss(p + eps e_i) - loss(p - eps e_i)) / 2 eps` around `base`.
    fn central_difference_of(
        m: &mut Model,
        base: &[f32],
        i: usize,
        eps: f32,
        loss: impl Fn(&Model) -> f32,
    ) -> f32 {
        let mut at = |delta: f32| {
            let mut p = base.to_vec();
            p[i] += delta;
            m.set_flat(&p).unwrap();
            loss(m)
        };
        (at(eps) - at(-eps)) / (2.0 * eps)
    }

    #[test]
    fn same_seed_same_weights() {
        let a = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let b = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let c = Model::new(&spec(), Device::Cpu, 4).unwrap();
        assert_eq!(a.flat_params().unwrap(), b.flat_params().unwrap());
        assert_ne!(a.flat_params().unwrap(), c.flat_params().unwrap());
    }

    #[test]
    fn gradient_matches_finite_difference() {
        let mut m = Model::new(&spec(), Device::Cpu, 1).unwrap();
        let batch = Batch {
            features: vec![0.3, -1.0, 0.8, 1.5, 0.2, -0.4],
            labels: vec![1, 0],
            dim: 3,
        };
        let (loss, grad) = m.gradient(&batch).unwrap();
        let base = m.flat_params().unwrap();
        for i in [0usize, 7, 16, base.len() - 1] {
            let mut p = base.clone();
            p[i] += 1e-2;
            m.set_flat(&p).unwrap();
            let (l2, _) = m.evaluate(&batch).unwrap();
            let fd = (l2 - loss) / 1e-2;
            assert!(
                (fd - grad[i]).abs() < 2e-2,
                "param {i}: fd {fd} vs {}",
                grad[i]
            );
        }
    }

    #[test]
    fn cnn_gradient_matches_finite_difference() {
        let spec = ModelSection {
            kind: ModelKind::Cnn,
            input: 16,
            hidden: vec![6],
            classes: 3,
            in_channels: 1,
            conv: vec![2],
            ..ModelSection::default()
        };
        let mut m = Model::new(&spec, Device::Cpu, 5).unwrap();
        let features: Vec<f32> = (0..32).map(|i| ((i * 7) % 11) as f32 / 5.0 - 1.0).collect();
        let batch = Batch {
            features,
            labels: vec![2, 0],
            dim: 16,
        };
        let (loss, grad) = m.gradient(&batch).unwrap();
        assert_eq!(grad.len(), spec.num_params());
        let base = m.flat_params().unwrap();
        let _ = loss;
        for i in [0usize, 5, 18, 20, base.len() - 1] {
            // Central differences with a small step: ReLU and max-pool kinks
            // make one-sided differences with a large step unreliable.
            let fd = central_difference(&mut m, &base, &batch, i, 2e-3);
            assert!(
                (fd - grad[i]).abs() < 1e-2,
                "param {i}: fd {fd} vs {}",
                grad[i]
            );
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut m = Model::new(&spec(), Device::Cpu, 1).unwrap();
        assert!(m.set_flat(&[0.0; 3]).is_err());
        assert!(m.write_range(30, &[0.0; 10]).is_err());
        assert!(m.write_sparse(0, &[1000], &[1.0]).is_err());
        let bad = Batch {
            features: vec![0.0; 4],
            labels: vec![0],
            dim: 4,
        };
        assert!(m.gradient(&bad).is_err());
    }

    fn deep_spec() -> ModelSection {
        ModelSection {
            input: 5,
            hidden: vec![7, 6],
            classes: 4,
            ..ModelSection::default()
        }
    }

    fn deep_batch() -> Batch {
        let features: Vec<f32> = (0..15).map(|i| ((i * 5) % 9) as f32 / 4.0 - 1.0).collect();
        Batch {
            features,
            labels: vec![3, 0, 2],
            dim: 5,
        }
    }

    /// `gradient_streamed` hands over a growing suffix of the gradient
    /// while the pass runs (at least `early` times before its end), every
    /// piece already final, then the whole gradient of `gradient_into`.
    fn check_streamed(model: &mut Model, batch: &Batch, early: usize) {
        let (loss, whole) = model.gradient(batch).unwrap();
        let mut out = vec![f32::NAN; model.num_params()];
        let mut seen: Vec<(usize, Vec<f32>)> = Vec::new();
        let streamed_loss = model
            .gradient_streamed(batch, &mut out, &mut |from, g| {
                seen.push((from, g[from..].to_vec()))
            })
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(loss.to_bits(), streamed_loss.to_bits());
        assert_eq!(bits(&out), bits(&whole));
        let froms: Vec<usize> = seen.iter().map(|(from, _)| *from).collect();
        assert!(froms.windows(2).all(|w| w[0] > w[1]), "{froms:?}");
        assert_eq!(froms.last(), Some(&0), "{froms:?}");
        assert!(froms.len() > early, "{froms:?}");
        for (from, part) in &seen {
            assert_eq!(bits(part), bits(&whole[*from..]), "suffix from {from}");
        }
    }

    #[test]
    fn the_gradient_streams_out_layer_by_layer_as_backward_finishes_it() {
        // The hand-written MLP pass: one hand-over per layer.
        let mut mlp = Model::new(&deep_spec(), Device::Cpu, 9).unwrap();
        check_streamed(&mut mlp, &deep_batch(), 2);
        // The layer executor (a narrow ResNet-20): per conv / norm layer.
        let spec = ModelSection {
            kind: ModelKind::Resnet20,
            input: 3 * 8 * 8,
            in_channels: 3,
            classes: 5,
            width: 0.25,
            ..ModelSection::default()
        };
        let mut resnet = Model::new(&spec, Device::Cpu, 2).unwrap();
        check_streamed(&mut resnet, &image_batch(4, spec.input, 5, 0), 10);
        // The GPT's pass: per linear and norm of each block.
        let spec = crate::gpt::gpt_spec(11, 6, 8, 2, 2);
        let mut gpt = Model::new(&spec, Device::Cpu, 3).unwrap();
        let batch = crate::gpt::random_batch(&spec.gpt, 3, 9);
        check_streamed(&mut gpt, &batch, 10);
    }

    #[test]
    fn a_diverged_step_streams_nothing() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 9).unwrap();
        let flat = vec![f32::NAN; m.num_params()];
        m.set_flat(&flat).unwrap();
        let mut out = vec![0.0; m.num_params()];
        let mut calls = 0;
        let loss = m
            .gradient_streamed(&deep_batch(), &mut out, &mut |_, _| calls += 1)
            .unwrap();
        assert!(!loss.is_finite());
        assert_eq!(calls, 0);
    }

    #[test]
    fn a_layout_out_of_tensor_order_is_final_only_at_the_end() {
        let ranges = [0..4, 8..10, 4..8];
        let mut f = Frontier::new(&ranges);
        assert_eq!(f.finish(&[2]), None);
        assert_eq!(f.finish(&[0, 1]), None);
        let ranges = [0..4, 4..8, 8..10];
        let mut f = Frontier::new(&ranges);
        assert_eq!(f.finish(&[1]), None, "tensor 2 is not final yet");
        assert_eq!(f.finish(&[2]), Some(4));
        assert_eq!(f.finish(&[2]), None, "no growth");
        assert_eq!(f.finish(&[0, 7]), Some(0));
    }

    #[test]
    fn hand_written_mlp_backward_matches_autograd() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 9).unwrap();
        let batch = deep_batch();
        let (loss, grad) = m.gradient(&batch).unwrap();
        let mut auto = vec![0.0f32; m.num_params()];
        let x = m.input_of(&batch).unwrap();
        let auto_loss = m.autograd_backward(&x, &batch.labels, &mut auto).unwrap();
        assert!((loss - auto_loss).abs() < 1e-5, "{loss} vs {auto_loss}");
        for (i, (a, b)) in grad.iter().zip(&auto).enumerate() {
            assert!((a - b).abs() < 1e-5, "entry {i}: {a} vs {b}");
        }
    }

    #[test]
    fn every_layer_matches_finite_differences() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 4).unwrap();
        let batch = deep_batch();
        let (_, grad) = m.gradient(&batch).unwrap();
        let base = m.flat_params().unwrap();
        let ranges = deep_spec().tensor_ranges();
        // The first, a middle and the last entry of every weight and bias.
        for r in &ranges {
            for i in [r.start, (r.start + r.end) / 2, r.end - 1] {
                let fd = central_difference(&mut m, &base, &batch, i, 1e-3);
                assert!(
                    (fd - grad[i]).abs() < 5e-3,
                    "param {i} in {r:?}: fd {fd} vs {}",
                    grad[i]
                );
            }
        }
    }

    #[test]
    fn gradient_into_overwrites_a_reused_buffer() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 2).unwrap();
        let batch = deep_batch();
        let (_, fresh) = m.gradient(&batch).unwrap();
        let mut reused = vec![123.0f32; m.num_params()];
        m.gradient_into(&batch, &mut reused).unwrap();
        assert_eq!(fresh, reused);
    }

    #[test]
    fn writes_land_in_place_across_tensor_boundaries() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 3).unwrap();
        let mut expected = m.flat_params().unwrap();
        let ranges = deep_spec().tensor_ranges();
        // A shard starting inside the first weight, spanning several tensors.
        let offset = 10;
        let indices: Vec<u32> = vec![0, 5, (ranges[1].start - offset) as u32, 40, 41, 60];
        let values: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        for (&i, &v) in indices.iter().zip(&values) {
            expected[offset + i as usize] = v;
        }
        m.write_sparse(offset, &indices, &values).unwrap();
        assert_eq!(m.flat_params().unwrap(), expected);
        // Unsorted indices work too.
        m.write_sparse(offset, &[60, 0], &[-6.0, -1.0]).unwrap();
        expected[offset + 60] = -6.0;
        expected[offset] = -1.0;
        assert_eq!(m.flat_params().unwrap(), expected);
        let dense: Vec<f32> = (0..30).map(|i| i as f32).collect();
        m.write_range(ranges[1].start - 3, &dense).unwrap();
        expected[ranges[1].start - 3..ranges[1].start + 27].copy_from_slice(&dense);
        assert_eq!(m.flat_params().unwrap(), expected);
    }

    #[test]
    fn out_of_range_labels_are_errors_that_name_the_sample() {
        let mut m = Model::new(&deep_spec(), Device::Cpu, 1).unwrap();
        let mut batch = deep_batch();
        batch.labels[1] = 4;
        let e = m.gradient(&batch).unwrap_err().to_string();
        assert!(e.contains("label 4 of sample 1"), "{e}");
        assert!(m.evaluate(&batch).is_err());
    }

    use ps_shared::config::layers::LayerSpec;

    fn layered(
        in_channels: usize,
        side: usize,
        classes: usize,
        layers: Vec<LayerSpec>,
    ) -> ModelSection {
        let spec = ModelSection {
            kind: ModelKind::Layers,
            input: in_channels * side * side,
            in_channels,
            classes,
            layers,
            ..ModelSection::default()
        };
        spec.nodes().unwrap();
        spec
    }

    /// `samples` images of `dim` values, spread over [-1.5, 1.5], with
    /// labels cycling through `classes`.
    fn image_batch(samples: usize, dim: usize, classes: usize, salt: usize) -> Batch {
        let features = (0..samples * dim)
            .map(|i| (((i + salt) * 37 + 11) % 101) as f32 / 33.0 - 1.5)
            .collect();
        Batch {
            features,
            labels: (0..samples).map(|i| (i % classes) as u32).collect(),
            dim,
        }
    }

    /// The training-mode loss at dropout step `step`, without updating
    /// any statistics.
    fn train_loss(m: &Model, batch: &Batch, step: u64) -> f32 {
        let x = m.input_of(batch).unwrap();
        let (logits, _) = m.train_logits(&x, step).unwrap();
        let y = Tensor::from_slice(&batch.labels, batch.len(), &m.device).unwrap();
        candle_nn::loss::cross_entropy(&logits, &y)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The gradient of the training loss at step 0 against central
    /// differences at the first, middle and last entry of every tensor.
    fn check_layers(in_channels: usize, side: usize, layers: Vec<LayerSpec>, samples: usize) {
        let classes = 3;
        let spec = layered(in_channels, side, classes, layers);
        let mut m = Model::new(&spec, Device::Cpu, 11).unwrap();
        let batch = image_batch(samples, spec.input, classes, 0);
        let (_, grad) = m.gradient(&batch).unwrap();
        let base = m.flat_params().unwrap();
        let mut largest = 0.0f32;
        for (t, r) in spec.layout().iter().zip(spec.tensor_ranges()) {
            for i in [r.start, (r.start + r.end) / 2, r.end - 1] {
                let fd =
                    central_difference_of(&mut m, &base, i, 1e-3, |m| train_loss(m, &batch, 0));
                largest = largest.max(grad[i].abs());
                assert!(
                    (fd - grad[i]).abs() < 3e-3 + 0.03 * grad[i].abs(),
                    "{} entry {}: fd {fd} vs {}",
                    t.name,
                    i - r.start,
                    grad[i]
                );
            }
        }
        assert!(
            largest > 1e-3,
            "gradients are all ~0: the check proves nothing"
        );
    }

    fn conv(out: usize, kernel: usize, stride: usize, padding: usize, bias: bool) -> LayerSpec {
        LayerSpec::Conv2d {
            out,
            kernel,
            stride,
            padding: Some(padding),
            bias,
        }
    }

    fn linear(out: usize) -> LayerSpec {
        LayerSpec::Linear { out, bias: true }
    }

    #[test]
    fn conv_with_stride_and_padding_matches_finite_differences() {
        check_layers(
            2,
            5,
            vec![
                conv(3, 3, 2, 1, true),
                LayerSpec::Relu,
                conv(2, 2, 1, 0, true),
                linear(3),
            ],
            2,
        );
    }

    #[test]
    fn batch_norm_in_training_matches_finite_differences() {
        check_layers(
            2,
            4,
            vec![
                conv(3, 3, 1, 1, false),
                LayerSpec::BatchNorm,
                LayerSpec::Relu,
                LayerSpec::Flatten,
                linear(3),
            ],
            3,
        );
    }

    #[test]
    fn pools_match_finite_differences() {
        for max in [true, false] {
            let pool = |kernel, stride| match max {
                true => LayerSpec::MaxPool { kernel, stride },
                false => LayerSpec::AvgPool { kernel, stride },
            };
            // Overlapping strided windows, then windows that tile the image.
            check_layers(
                1,
                7,
                vec![
                    conv(2, 3, 1, 1, true),
                    pool(3, Some(2)),
                    pool(3, None),
                    linear(3),
                ],
                2,
            );
            check_layers(
                1,
                4,
                vec![conv(2, 3, 1, 1, true), pool(2, None), linear(3)],
                2,
            );
        }
    }

    #[test]
    fn matrix_convolution_matches_candles() {
        let x = Tensor::from_vec(
            image_batch(2, 3 * 7 * 7, 2, 5).features,
            (2, 3, 7, 7),
            &Device::Cpu,
        )
        .unwrap();
        for (k, stride, padding) in [(3, 1, 1), (3, 2, 1), (1, 2, 0), (2, 1, 0), (3, 3, 2)] {
            let w = Tensor::from_vec(
                image_batch(4, 3 * k * k, 2, k + stride).features,
                (4, 3, k, k),
                &Device::Cpu,
            )
            .unwrap();
            let ours = crate::layers::conv2d(&x, &w, stride, padding).unwrap();
            let theirs = x.conv2d(&w, padding, stride, 1, 1).unwrap();
            assert_eq!(ours.dims(), theirs.dims());
            let diff = (ours - theirs)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                diff < 1e-4,
                "k {k} stride {stride} padding {padding}: {diff}"
            );
        }
    }

    #[test]
    fn strided_pools_pick_the_right_windows() {
        let x = Tensor::arange(0f32, 25.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 1, 5, 5))
            .unwrap();
        let max = crate::layers::pool(&x, 3, 2, true).unwrap();
        assert_eq!(
            max.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [12.0, 14.0, 22.0, 24.0]
        );
        let avg = crate::layers::pool(&x, 2, 3, false).unwrap();
        assert_eq!(
            avg.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [3.0, 6.0, 18.0, 21.0]
        );
    }

    #[test]
    fn global_avg_pool_and_linear_match_finite_differences() {
        check_layers(
            2,
            3,
            vec![conv(4, 3, 1, 1, true), LayerSpec::GlobalAvgPool, linear(3)],
            2,
        );
        check_layers(
            1,
            3,
            vec![
                LayerSpec::Flatten,
                linear(5),
                LayerSpec::Relu,
                LayerSpec::Linear {
                    out: 3,
                    bias: false,
                },
            ],
            3,
        );
    }

    #[test]
    fn residual_blocks_match_finite_differences() {
        // Identity shortcut, then a projection (stride 2 and more channels).
        check_layers(
            1,
            4,
            vec![
                conv(3, 3, 1, 1, false),
                LayerSpec::Residual { out: 3, stride: 1 },
                LayerSpec::Residual { out: 4, stride: 2 },
                LayerSpec::GlobalAvgPool,
                linear(3),
            ],
            3,
        );
    }

    #[test]
    fn dropout_with_a_fixed_mask_matches_finite_differences() {
        let layers = vec![
            LayerSpec::Flatten,
            linear(8),
            LayerSpec::Relu,
            LayerSpec::Dropout { p: 0.5 },
            linear(3),
        ];
        check_layers(1, 3, layers.clone(), 3);
        // The mask is reproducible, differs between steps and is off in
        // evaluation.
        let spec = layered(1, 3, 3, layers);
        let m = Model::new(&spec, Device::Cpu, 2).unwrap();
        let batch = image_batch(3, 9, 3, 1);
        assert_eq!(train_loss(&m, &batch, 4), train_loss(&m, &batch, 4));
        assert_ne!(train_loss(&m, &batch, 4), train_loss(&m, &batch, 5));
        assert_ne!(train_loss(&m, &batch, 4), m.evaluate(&batch).unwrap().0);
        let mask = crate::layers::dropout_mask(1000, 0.5, 2, 4, 0);
        let dropped = mask.iter().filter(|&&v| v == 0.0).count();
        assert!((400..600).contains(&dropped), "{dropped}");
        assert!(mask.iter().all(|&v| v == 0.0 || v == 2.0));
    }

    fn bn_net() -> ModelSection {
        layered(
            2,
            4,
            3,
            vec![
                conv(3, 3, 1, 1, false),
                LayerSpec::BatchNorm,
                LayerSpec::Relu,
                LayerSpec::Residual { out: 4, stride: 2 },
                LayerSpec::GlobalAvgPool,
                linear(3),
            ],
        )
    }

    fn logits(m: &Model, batch: &Batch) -> Vec<f32> {
        let x = m.input_of(batch).unwrap();
        m.forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn evaluation_uses_running_statistics_not_the_batch() {
        let spec = bn_net();
        let mut m = Model::new(&spec, Device::Cpu, 3).unwrap();
        let big = image_batch(6, spec.input, 3, 0);
        for salt in 0..3 {
            m.gradient(&image_batch(5, spec.input, 3, salt)).unwrap();
        }
        let one = Batch {
            features: big.features[..spec.input].to_vec(),
            labels: vec![big.labels[0]],
            dim: spec.input,
        };
        let alone = logits(&m, &one);
        let inside = logits(&m, &big);
        for (a, b) in alone.iter().zip(&inside[..3]) {
            assert!((a - b).abs() < 1e-5, "{alone:?} vs {inside:?}");
        }
        // Training mode would normalise the sample by the batch instead.
        let x = m.input_of(&big).unwrap();
        let (train, _) = m.train_logits(&x, 0).unwrap();
        let train: Vec<f32> = train.flatten_all().unwrap().to_vec1().unwrap();
        assert!(train.iter().zip(&inside).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn a_step_folds_batch_statistics_in_with_momentum() {
        let spec = layered(
            2,
            2,
            3,
            vec![LayerSpec::BatchNorm, LayerSpec::Flatten, linear(3)],
        );
        let mut m = Model::new(&spec, Device::Cpu, 1).unwrap();
        let batch = image_batch(3, 8, 3, 0);
        m.gradient(&batch).unwrap();
        let (mean, var) = by_hand(&[&batch], 2, 4);
        let got_mean: Vec<f32> = m.running[0].mean.to_vec1().unwrap();
        let got_var: Vec<f32> = m.running[0].var.to_vec1().unwrap();
        for c in 0..2 {
            let want_mean = 0.1 * mean[c];
            let want_var = 0.9 + 0.1 * var[c];
            assert!((got_mean[c] - want_mean).abs() < 1e-5, "{got_mean:?}");
            assert!((got_var[c] - want_var).abs() < 1e-5, "{got_var:?}");
        }
    }

    /// Per channel: the mean over `batches` of each batch's mean and
    /// unbiased variance of NCHW images with `channels` x `area` values.
    fn by_hand(batches: &[&Batch], channels: usize, area: usize) -> (Vec<f32>, Vec<f32>) {
        let mut mean = vec![0.0f64; channels];
        let mut var = vec![0.0f64; channels];
        for b in batches {
            for c in 0..channels {
                let values: Vec<f64> = b
                    .features
                    .chunks(b.dim)
                    .flat_map(|s| &s[c * area..(c + 1) * area])
                    .map(|&v| f64::from(v))
                    .collect();
                let n = values.len() as f64;
                let mu = values.iter().sum::<f64>() / n;
                let v = values.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (n - 1.0);
                mean[c] += mu / batches.len() as f64;
                var[c] += v / batches.len() as f64;
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
        (f(mean), f(var))
    }

    #[test]
    fn calibration_sets_running_statistics_to_the_batches_average() {
        let spec = layered(
            2,
            2,
            3,
            vec![
                LayerSpec::BatchNorm,
                conv(2, 1, 1, 0, false),
                LayerSpec::BatchNorm,
                LayerSpec::Flatten,
                linear(3),
            ],
        );
        let mut m = Model::new(&spec, Device::Cpu, 1).unwrap();
        let batches: Vec<std::sync::Arc<Batch>> = (0..3)
            .map(|salt| std::sync::Arc::new(image_batch(2 + salt, 8, 3, salt * 7)))
            .collect();
        m.gradient(&batches[0]).unwrap();
        m.calibrate_bn(&batches).unwrap();
        let refs: Vec<&Batch> = batches.iter().map(|b| b.as_ref()).collect();
        let (mean, var) = by_hand(&refs, 2, 4);
        let got_mean: Vec<f32> = m.running[0].mean.to_vec1().unwrap();
        let got_var: Vec<f32> = m.running[0].var.to_vec1().unwrap();
        for c in 0..2 {
            assert!(
                (got_mean[c] - mean[c]).abs() < 1e-5,
                "{got_mean:?} vs {mean:?}"
            );
            assert!((got_var[c] - var[c]).abs() < 1e-4, "{got_var:?} vs {var:?}");
        }
        // The second layer sees the first one's output in training mode:
        // its batch statistics, averaged the same way.
        let mut means = vec![0.0f32; 2];
        for b in &batches {
            let x = m.input_of(b).unwrap();
            let (_, stats) = m.train_logits(&x, 0).unwrap();
            let mu: Vec<f32> = stats[1].mean.to_vec1().unwrap();
            for c in 0..2 {
                means[c] += mu[c] / 3.0;
            }
        }
        let got: Vec<f32> = m.running[1].mean.to_vec1().unwrap();
        for c in 0..2 {
            assert!((got[c] - means[c]).abs() < 1e-5, "{got:?} vs {means:?}");
        }
    }

    #[test]
    fn calibration_restores_corrupted_running_statistics() {
        let spec = bn_net();
        let mut m = Model::new(&spec, Device::Cpu, 5).unwrap();
        let batches: Vec<std::sync::Arc<Batch>> = (0..4)
            .map(|salt| std::sync::Arc::new(image_batch(4, spec.input, 3, salt)))
            .collect();
        for b in &batches {
            m.gradient(b).unwrap();
        }
        let test = image_batch(5, spec.input, 3, 99);
        m.calibrate_bn(&batches).unwrap();
        let before = logits(&m, &test);
        for r in &mut m.running {
            r.mean = (r.mean.ones_like().unwrap() * 3.0).unwrap();
            r.var = (r.var.ones_like().unwrap() * 0.01).unwrap();
        }
        let corrupted = logits(&m, &test);
        assert!(before
            .iter()
            .zip(&corrupted)
            .any(|(a, b)| (a - b).abs() > 1e-2));
        m.calibrate_bn(&batches).unwrap();
        let after = logits(&m, &test);
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() < 1e-5, "{before:?} vs {after:?}");
        }
    }

    /// Per tensor range, `|a - b|` within 1e-4 of `b`'s largest magnitude
    /// there (or 1e-5 of the largest over all tensors, for a tensor whose
    /// gradient is zero up to rounding, such as a conv bias before a batch
    /// norm).
    fn assert_close(what: &str, a: &[f32], b: &[f32], ranges: &[Range<usize>], names: &[String]) {
        let global = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (r, name) in ranges.iter().zip(names) {
            let scale = b[r.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = a[r.clone()]
                .iter()
                .zip(&b[r.clone()])
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 1e-4 * scale + 1e-5 * global,
                "{what} {name}: differs by {diff} at scale {scale}"
            );
        }
    }

    /// Two training steps through the executor and through autograd from
    /// the same weights: the losses, every gradient and the running
    /// statistics agree; then so do the evaluation-mode logits.
    fn check_exec_matches_autograd(spec: &ModelSection, samples: usize) {
        let mut ours = Model::new(spec, Device::Cpu, 7).unwrap();
        let mut auto = Model::new(spec, Device::Cpu, 7).unwrap();
        assert!(ours.exec.is_some(), "no executor for {:?}", spec.kind);
        let n = ours.num_params();
        let (mut g1, mut g2) = (vec![0.0f32; n], vec![0.0f32; n]);
        let names: Vec<String> = spec.layout().into_iter().map(|t| t.name).collect();
        for step in 0..2 {
            let batch = image_batch(samples, spec.input, spec.classes, step * 5);
            let l1 = ours.gradient_into(&batch, &mut g1).unwrap();
            let l2 = auto.autograd_gradient_into(&batch, &mut g2).unwrap();
            assert!((l1 - l2).abs() <= 1e-4 * l2.abs(), "loss {l1} vs {l2}");
            assert!(g2.iter().any(|&g| g.abs() > 1e-3), "gradients all ~0");
            assert_close("gradient", &g1, &g2, &ours.ranges, &names);
        }
        for (i, (a, b)) in ours.running.iter().zip(&auto.running).enumerate() {
            for (x, y) in [(&a.mean, &b.mean), (&a.var, &b.var)] {
                let (x, y): (Vec<f32>, Vec<f32>) = (x.to_vec1().unwrap(), y.to_vec1().unwrap());
                for (x, y) in x.iter().zip(&y) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "bn {i}: {x} vs {y}"
                    );
                }
            }
        }
        let batch = image_batch(samples + 1, spec.input, spec.classes, 3);
        let exec = ours.exec_eval(&batch).unwrap().unwrap();
        let reference = logits(&auto, &batch);
        let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in exec.iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-4 * scale, "{exec:?} vs {reference:?}");
        }
        let (e1, e2) = (
            ours.evaluate(&batch).unwrap(),
            auto.evaluate(&batch).unwrap(),
        );
        assert!((e1.0 - e2.0).abs() <= 1e-4 * e2.0.abs() && e1.1 == e2.1);
    }

    #[test]
    fn executor_matches_autograd_on_every_layer_kind() {
        let spec = layered(
            2,
            10,
            3,
            vec![
                conv(4, 3, 1, 1, true),
                LayerSpec::BatchNorm,
                LayerSpec::Relu,
                LayerSpec::Residual { out: 4, stride: 1 },
                LayerSpec::MaxPool {
                    kernel: 3,
                    stride: Some(2),
                },
                LayerSpec::AvgPool {
                    kernel: 2,
                    stride: Some(1),
                },
                LayerSpec::Residual { out: 6, stride: 2 },
                conv(5, 3, 1, 1, false),
                LayerSpec::BatchNorm,
                LayerSpec::Dropout { p: 0.3 },
                LayerSpec::Relu,
                LayerSpec::Flatten,
                linear(8),
                LayerSpec::Relu,
                LayerSpec::Dropout { p: 0.5 },
                linear(3),
            ],
        );
        check_exec_matches_autograd(&spec, 4);
        // A linear layer straight on an image, a global pool, a batch norm
        // as the first layer.
        let spec = layered(
            2,
            6,
            3,
            vec![
                LayerSpec::BatchNorm,
                conv(3, 3, 2, 1, true),
                LayerSpec::Relu,
                linear(3),
            ],
        );
        check_exec_matches_autograd(&spec, 3);
        let spec = layered(
            3,
            5,
            4,
            vec![conv(4, 3, 1, 0, true), LayerSpec::GlobalAvgPool, linear(4)],
        );
        check_exec_matches_autograd(&spec, 2);
    }

    #[test]
    fn executor_matches_autograd_on_a_narrow_resnet20() {
        let spec = ModelSection {
            kind: ModelKind::Resnet20,
            input: 3 * 8 * 8,
            in_channels: 3,
            classes: 5,
            width: 0.25,
            ..ModelSection::default()
        };
        check_exec_matches_autograd(&spec, 4);
    }

    #[test]
    fn executor_buffers_stay_put_once_warm() {
        let spec = ModelSection {
            kind: ModelKind::Resnet20,
            input: 3 * 8 * 8,
            in_channels: 3,
            classes: 5,
            width: 0.25,
            ..ModelSection::default()
        };
        let mut m = Model::new(&spec, Device::Cpu, 1).unwrap();
        let workspace = |m: &Model| m.exec.as_ref().unwrap().lock().unwrap().workspace_len();
        let big = image_batch(6, spec.input, 5, 0);
        m.gradient(&big).unwrap();
        let warm = workspace(&m);
        assert!(warm > 0);
        m.gradient(&big).unwrap();
        m.evaluate(&big).unwrap();
        assert_eq!(workspace(&m), warm);
        // A smaller last batch reuses the buffers; a larger one grows them.
        let (loss, _) = m.gradient(&image_batch(2, spec.input, 5, 1)).unwrap();
        assert!(loss.is_finite());
        assert_eq!(workspace(&m), warm);
        m.gradient(&image_batch(9, spec.input, 5, 2)).unwrap();
        assert!(workspace(&m) > warm);
    }

    #[test]
    fn executor_matches_autograd_on_the_cnn() {
        let spec = ModelSection {
            kind: ModelKind::Cnn,
            input: 8 * 8,
            in_channels: 1,
            conv: vec![4, 6],
            hidden: vec![7],
            classes: 3,
            ..ModelSection::default()
        };
        check_exec_matches_autograd(&spec, 3);
    }

    #[test]
    fn a_narrow_resnet20_learns_a_fixed_batch() {
        let spec = ModelSection {
            kind: ModelKind::Resnet20,
            input: 16 * 16,
            in_channels: 1,
            classes: 4,
            width: 0.25,
            ..ModelSection::default()
        };
        let mut m = Model::new(&spec, Device::Cpu, 1).unwrap();
        // Class k is a bright k-th quadrant on a noisy image.
        let mut features = Vec::new();
        let labels: Vec<u32> = (0..16).map(|i| i % 4).collect();
        for (s, &label) in labels.iter().enumerate() {
            for p in 0..256 {
                let (r, c) = (p / 16, p % 16);
                let quadrant = (r / 8) * 2 + c / 8;
                let noise = (((s * 256 + p) * 73 + 5) % 97) as f32 / 97.0 - 0.5;
                features.push(noise + if quadrant == label as usize { 1.0 } else { 0.0 });
            }
        }
        let batch = Batch {
            features,
            labels,
            dim: 256,
        };
        let mut params = m.flat_params().unwrap();
        let mut grad = vec![0.0f32; params.len()];
        let first = m.gradient_into(&batch, &mut grad).unwrap();
        let mut last = first;
        for _ in 0..30 {
            for (p, g) in params.iter_mut().zip(&grad) {
                *p -= 0.1 * g;
            }
            m.set_flat(&params).unwrap();
            last = m.gradient_into(&batch, &mut grad).unwrap();
        }
        assert!(last < 0.5 * first, "loss {first} -> {last}");
    }
}

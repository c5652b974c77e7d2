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
//! tensors' storage (only the entries that changed, for sparse pulls). The
//! CNN keeps candle's autograd.

use std::ops::Range;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Module, Storage, Tensor, Var, D};
use candle_nn::Linear;
use rand::{rngs::StdRng, Rng, SeedableRng};

use ps_dataset::Batch;
use ps_shared::config::{ModelKind, ModelSection, TensorSpec};

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
    #[error("unknown device `{0}`: use cpu, cuda or cuda:N")]
    Device(String),
    #[error("label {label} of sample {sample} is out of range for {classes} classes")]
    Label {
        sample: usize,
        label: u32,
        classes: usize,
    },
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
    /// `values` from element `at` on.
    Range { at: usize, values: &'a [f32] },
    /// `values[i]` at element `offset + indices[i] - start`, where `start` is
    /// the tensor's first flat index.
    Scatter {
        offset: usize,
        start: usize,
        indices: &'a [u32],
        values: &'a [f32],
    },
}

impl Write<'_> {
    fn apply(&self, data: &mut [f32]) {
        match self {
            Write::Range { at, values } => data[*at..*at + values.len()].copy_from_slice(values),
            Write::Scatter {
                offset,
                start,
                indices,
                values,
            } => {
                for (&i, &v) in indices.iter().zip(*values) {
                    data[offset + i as usize - start] = v;
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
    let (batch, classes) = logits.dims2()?;
    let mut grad = logits.flatten_all()?.to_vec1::<f32>()?;
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
    Ok(((loss / batch as f64) as f32, grad))
}

/// An MLP or a small CNN whose parameters map onto one flat f32 index space.
pub struct Model {
    spec: ModelSection,
    device: Device,
    tensors: Vec<TensorSpec>,
    ranges: Vec<Range<usize>>,
    vars: Vec<Var>,
}

impl Model {
    /// Build with Kaiming-uniform weights and zero biases from `seed`.
    pub fn new(spec: &ModelSection, device: Device, seed: u64) -> Result<Self, ModelError> {
        let tensors = spec.layout();
        let ranges = spec.tensor_ranges();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut vars = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let mut init = vec![0.0f32; t.numel()];
            if t.shape.len() >= 2 {
                let fan_in: usize = t.shape[1..].iter().product();
                let bound = (1.0 / fan_in as f32).sqrt();
                for v in &mut init {
                    *v = rng.random_range(-bound..bound);
                }
            }
            let init = Tensor::from_vec(init, t.shape.as_slice(), &device)?;
            vars.push(Var::from_tensor(&init)?);
        }
        Ok(Self {
            spec: spec.clone(),
            device,
            tensors,
            ranges,
            vars,
        })
    }

    pub fn num_params(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// The current parameters, flat (a copy).
    pub fn flat_params(&self) -> Result<Vec<f32>, ModelError> {
        let mut flat = vec![0.0f32; self.num_params()];
        for (var, r) in self.vars.iter().zip(&self.ranges) {
            copy_to_slice(var.as_tensor(), &mut flat[r.clone()])?;
        }
        Ok(flat)
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
            };
            self.write_tensor(t, &write)?;
            start = end;
        }
        Ok(())
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
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

    fn input_of(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        if batch.dim != self.spec.input {
            return Err(ModelError::BatchDim {
                expected: self.spec.input,
                got: batch.dim,
            });
        }
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
        let x = self.checked_input(batch, out)?;
        match self.spec.kind {
            ModelKind::Mlp => self.mlp_backward(&x, &batch.labels, out),
            ModelKind::Cnn => self.autograd_backward(&x, &batch.labels, out),
        }
    }

    /// Forward + backward through candle's autograd, for either model kind
    /// (the MLP's hand-written pass is checked against it).
    pub fn autograd_gradient_into(
        &mut self,
        batch: &Batch,
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let x = self.checked_input(batch, out)?;
        self.autograd_backward(&x, &batch.labels, out)
    }

    /// The batch's input tensor, once `out` fits the flat gradient and every
    /// label is a class.
    fn checked_input(&self, batch: &Batch, out: &[f32]) -> Result<Tensor, ModelError> {
        if out.len() != self.num_params() {
            return Err(ModelError::Length {
                expected: self.num_params(),
                got: out.len(),
            });
        }
        self.check_labels(batch)?;
        self.input_of(batch)
    }

    /// The MLP's backward pass by hand, in a feature-major layout: each
    /// activation is kept as `Aᵀ` (`features × batch`), which is the layout
    /// the matmul library runs fastest in for these shapes (2-3x faster
    /// forward than `A · Wᵀ`). For layer `l` with `Zᵀ_l = W_l Aᵀ_l + b_l`:
    /// `dW_l = dZᵀ_l · A_l` (contiguous, `out × in`, the weight's layout),
    /// `db_l = Σ_columns dZᵀ_l`, and `dZᵀ_{l-1} = (W_lᵀ dZᵀ_l) ⊙ [Aᵀ_l > 0]`
    /// (the ReLU's mask).
    fn mlp_backward(&self, x: &Tensor, labels: &[u32], out: &mut [f32]) -> Result<f32, ModelError> {
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
            if l > 0 {
                let w = self.vars[2 * l].as_tensor();
                let mask = at.gt(0f32)?.to_dtype(DType::F32)?;
                dzt = w.t()?.matmul(&dzt)?.mul(&mask)?;
            }
        }
        Ok(loss)
    }

    /// Any model through candle's autograd.
    fn autograd_backward(
        &self,
        x: &Tensor,
        labels: &[u32],
        out: &mut [f32],
    ) -> Result<f32, ModelError> {
        let y = Tensor::from_slice(labels, labels.len(), &self.device)?;
        let logits = self.forward(x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        let grads = loss.backward()?;
        for ((var, t), r) in self.vars.iter().zip(&self.tensors).zip(&self.ranges) {
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| ModelError::MissingGrad(t.name.clone()))?;
            copy_to_slice(g, &mut out[r.clone()])?;
        }
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Mean loss and accuracy on a batch (no gradients).
    pub fn evaluate(&self, batch: &Batch) -> Result<(f32, f32), ModelError> {
        if batch.is_empty() {
            return Ok((0.0, 0.0));
        }
        self.check_labels(batch)?;
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

    /// `(loss(p + eps e_i) - loss(p - eps e_i)) / 2 eps` around `base`.
    fn central_difference(m: &mut Model, base: &[f32], batch: &Batch, i: usize, eps: f32) -> f32 {
        let mut at = |delta: f32| {
            let mut p = base.to_vec();
            p[i] += delta;
            m.set_flat(&p).unwrap();
            m.evaluate(batch).unwrap().0
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
}

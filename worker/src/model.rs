//! The candle model a worker trains, seen through the flat parameter space.
//!
//! The model's tensors are created in the order of
//! [`ModelSection::layout`](ps_shared::config::ModelSection::layout), so the
//! flat vector of all parameters (and of all gradients) has the same index space
//! on every worker and on the servers.
//!
//! ```
//! use ps_shared::config::ModelSection;
//! use ps_shared::dataset::Batch;
//! use ps_worker::model::Model;
//! let spec = ModelSection { input: 4, hidden: vec![8], classes: 3, ..ModelSection::default() };
//! let mut model = Model::new(&spec, candle_core::Device::Cpu, 7).unwrap();
//! let batch = Batch { features: vec![0.5; 8], labels: vec![0, 2], dim: 4 };
//! let (loss, grad) = model.gradient(&batch).unwrap();
//! assert!(loss.is_finite());
//! assert_eq!(grad.len(), spec.num_params());
//! ```

use std::ops::Range;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::Linear;
use rand::{rngs::StdRng, Rng, SeedableRng};

use ps_shared::config::{ModelKind, ModelSection, TensorSpec};
use ps_shared::dataset::Batch;

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

/// An MLP or a small CNN whose parameters mirror a flat f32 vector.
pub struct Model {
    spec: ModelSection,
    device: Device,
    tensors: Vec<TensorSpec>,
    ranges: Vec<Range<usize>>,
    vars: Vec<Var>,
    flat: Vec<f32>,
}

impl Model {
    /// Build with Kaiming-uniform weights and zero biases from `seed`.
    pub fn new(spec: &ModelSection, device: Device, seed: u64) -> Result<Self, ModelError> {
        let tensors = spec.layout();
        let ranges = spec.tensor_ranges();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut flat = vec![0.0f32; spec.num_params()];
        for (t, r) in tensors.iter().zip(&ranges) {
            if t.shape.len() >= 2 {
                let fan_in: usize = t.shape[1..].iter().product();
                let bound = (1.0 / fan_in as f32).sqrt();
                for v in &mut flat[r.clone()] {
                    *v = rng.random_range(-bound..bound);
                }
            }
        }
        let mut vars = Vec::with_capacity(tensors.len());
        for (t, r) in tensors.iter().zip(&ranges) {
            let init = Tensor::from_slice(&flat[r.clone()], t.shape.as_slice(), &device)?;
            vars.push(Var::from_tensor(&init)?);
        }
        Ok(Self {
            spec: spec.clone(),
            device,
            tensors,
            ranges,
            vars,
            flat,
        })
    }

    pub fn num_params(&self) -> usize {
        self.flat.len()
    }

    /// The current parameters, flat.
    pub fn flat_params(&self) -> &[f32] {
        &self.flat
    }

    /// Replace every parameter.
    pub fn set_flat(&mut self, values: &[f32]) -> Result<(), ModelError> {
        if values.len() != self.flat.len() {
            return Err(ModelError::Length {
                expected: self.flat.len(),
                got: values.len(),
            });
        }
        self.flat.copy_from_slice(values);
        self.sync_all()
    }

    /// Overwrite a contiguous range of the flat parameters starting at `offset`.
    pub fn write_range(&mut self, offset: usize, values: &[f32]) -> Result<(), ModelError> {
        let end = offset
            .checked_add(values.len())
            .filter(|&e| e <= self.flat.len())
            .ok_or(ModelError::Length {
                expected: self.flat.len(),
                got: offset.saturating_add(values.len()),
            })?;
        self.flat[offset..end].copy_from_slice(values);
        Ok(())
    }

    /// Overwrite scattered entries `offset + indices[i]`.
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
        let len = self.flat.len();
        for (&i, &v) in indices.iter().zip(values) {
            let slot = self
                .flat
                .get_mut(offset + i as usize)
                .ok_or(ModelError::Length {
                    expected: len,
                    got: offset + i as usize + 1,
                })?;
            *slot = v;
        }
        Ok(())
    }

    /// Copy the flat parameters into the model's tensors (after writes).
    pub fn sync_all(&mut self) -> Result<(), ModelError> {
        for ((var, t), r) in self.vars.iter().zip(&self.tensors).zip(&self.ranges) {
            let src = Tensor::from_slice(&self.flat[r.clone()], t.shape.as_slice(), &self.device)?;
            var.set(&src)?;
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

    fn tensors_of(&self, batch: &Batch) -> Result<(Tensor, Tensor), ModelError> {
        if batch.dim != self.spec.input {
            return Err(ModelError::BatchDim {
                expected: self.spec.input,
                got: batch.dim,
            });
        }
        let x = Tensor::from_slice(&batch.features, (batch.len(), batch.dim), &self.device)?;
        let y = Tensor::from_slice(&batch.labels, batch.len(), &self.device)?;
        Ok((x, y))
    }

    /// Forward + backward on a batch: the mean cross-entropy loss and the flat gradient.
    pub fn gradient(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>), ModelError> {
        let (x, y) = self.tensors_of(batch)?;
        let logits = self.forward(&x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        let grads = loss.backward()?;
        let mut flat = vec![0.0f32; self.flat.len()];
        for ((var, t), r) in self.vars.iter().zip(&self.tensors).zip(&self.ranges) {
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| ModelError::MissingGrad(t.name.clone()))?;
            let g = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            flat[r.clone()].copy_from_slice(&g);
        }
        Ok((loss.to_scalar::<f32>()?, flat))
    }

    /// Mean loss and accuracy on a batch (no gradients).
    pub fn evaluate(&self, batch: &Batch) -> Result<(f32, f32), ModelError> {
        if batch.is_empty() {
            return Ok((0.0, 0.0));
        }
        let (x, y) = self.tensors_of(batch)?;
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

    #[test]
    fn same_seed_same_weights() {
        let a = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let b = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let c = Model::new(&spec(), Device::Cpu, 4).unwrap();
        assert_eq!(a.flat_params(), b.flat_params());
        assert_ne!(a.flat_params(), c.flat_params());
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
        let base = m.flat_params().to_vec();
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
        let base = m.flat_params().to_vec();
        let _ = loss;
        for i in [0usize, 5, 18, 20, base.len() - 1] {
            // Central differences with a small step: ReLU and max-pool kinks
            // make one-sided differences with a large step unreliable.
            let eps = 2e-3;
            let mut at = |delta: f32| {
                let mut p = base.clone();
                p[i] += delta;
                m.set_flat(&p).unwrap();
                m.evaluate(&batch).unwrap().0
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
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
}

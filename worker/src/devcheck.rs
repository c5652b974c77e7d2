//! Device checks: the same model, weights and batch on two candle devices
//! (CUDA against the CPU, in `gpu-check`), compared by relative error.
//!
//! Each [`Case`] is a small model around one layer kind (or a whole preset).
//! [`run_case`] runs it on one device: training-mode logits, a gradient step,
//! evaluation-mode logits and loss (running batch-norm statistics), a dense
//! and a sparse pull written into the parameters (the model's write paths on
//! that device), and a second gradient on the written parameters.
//! [`compare`] turns two such runs into a [`Row`]: the largest relative error
//! of the forward values, of the gradients and of the parameters after the
//! writes. Dropout masks and initial weights are drawn on the host, so both
//! devices see the same ones.

use candle_core::Device;

use ps_dataset::{synthetic, Batch, SyntheticSpec};
use ps_shared::config::layers::LayerSpec;
use ps_shared::config::{ModelKind, ModelSection};

use crate::model::{Model, ModelError};

/// Largest relative error of a row that passes.
pub const TOLERANCE: f64 = 1e-3;

/// One model to compare across devices.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub spec: ModelSection,
    /// Samples in the batch.
    pub batch: usize,
}

/// What one model computed on one device.
#[derive(Debug, Clone, PartialEq)]
pub struct Outputs {
    /// Forward values: training-mode logits, the two training losses,
    /// evaluation-mode logits after the first step and the evaluation loss.
    pub forward: Vec<Vec<f32>>,
    /// The two flat gradients.
    pub gradients: Vec<Vec<f32>>,
    /// The flat parameters after the dense and sparse writes.
    pub params: Vec<f32>,
}

/// One line of the comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub name: String,
    pub forward: f64,
    pub gradient: f64,
    pub writes: f64,
}

impl Row {
    /// Whether every error is at most `tolerance`.
    pub fn pass(&self, tolerance: f64) -> bool {
        [self.forward, self.gradient, self.writes]
            .iter()
            .all(|&e| e <= tolerance)
    }
}

/// `‖a - b‖ / ‖b‖` (`‖a‖` when `b` is zero); infinite when the lengths
/// differ or `a` holds a value that is not finite.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += f64::from(x - y).powi(2);
        norm += f64::from(y).powi(2);
    }
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// The largest [`rel_err`] over pairs; infinite when the counts differ.
fn worst(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_err(x, y))
        .fold(0.0, f64::max)
}

/// The row of `got` (the checked device) against `want` (the reference).
pub fn compare(name: &str, got: &Outputs, want: &Outputs) -> Row {
    Row {
        name: name.to_string(),
        forward: worst(&got.forward, &want.forward),
        gradient: worst(&got.gradients, &want.gradients),
        writes: rel_err(&got.params, &want.params),
    }
}

/// A layered model on `3 × 8 × 8` images with 5 classes.
fn layered(name: &'static str, layers: Vec<LayerSpec>) -> Case {
    Case {
        name,
        spec: ModelSection {
            kind: ModelKind::Layers,
            input: 3 * 8 * 8,
            in_channels: 3,
            classes: 5,
            layers,
            ..ModelSection::default()
        },
        batch: 8,
    }
}

fn conv(out: usize, kernel: usize, stride: usize, bias: bool) -> LayerSpec {
    LayerSpec::Conv2d {
        out,
        kernel,
        stride,
        padding: None,
        bias,
    }
}

/// Flatten, then a linear layer onto the 5 classes.
fn head(mut layers: Vec<LayerSpec>) -> Vec<LayerSpec> {
    layers.push(LayerSpec::Flatten);
    layers.push(LayerSpec::Linear { out: 5, bias: true });
    layers
}

/// Every layer kind, the MLP and the CNN; with `full` also ResNet-20 and a
/// narrow ResNet-18 on 3x32x32 images.
pub fn cases(full: bool) -> Vec<Case> {
    let c = || conv(4, 3, 1, false);
    let mut cases = vec![
        layered("conv 1x1 (bias)", head(vec![conv(4, 1, 1, true)])),
        layered("conv 3x3", head(vec![conv(4, 3, 1, false)])),
        layered("conv 3x3 stride 2 (bias)", head(vec![conv(4, 3, 2, true)])),
        layered(
            "batch norm (train, eval)",
            head(vec![c(), LayerSpec::BatchNorm]),
        ),
        layered("relu", head(vec![c(), LayerSpec::Relu])),
        layered(
            "max pool 2x2",
            head(vec![
                c(),
                LayerSpec::MaxPool {
                    kernel: 2,
                    stride: None,
                },
            ]),
        ),
        layered(
            "max pool 3x3 stride 2",
            head(vec![
                c(),
                LayerSpec::MaxPool {
                    kernel: 3,
                    stride: Some(2),
                },
            ]),
        ),
        layered(
            "avg pool 2x2",
            head(vec![
                c(),
                LayerSpec::AvgPool {
                    kernel: 2,
                    stride: None,
                },
            ]),
        ),
        layered(
            "avg pool 3x3 stride 2",
            head(vec![
                c(),
                LayerSpec::AvgPool {
                    kernel: 3,
                    stride: Some(2),
                },
            ]),
        ),
        layered(
            "global avg pool",
            vec![
                c(),
                LayerSpec::GlobalAvgPool,
                LayerSpec::Linear { out: 5, bias: true },
            ],
        ),
        layered(
            "residual",
            head(vec![
                conv(8, 3, 1, false),
                LayerSpec::BatchNorm,
                LayerSpec::Relu,
                LayerSpec::Residual { out: 8, stride: 1 },
            ]),
        ),
        layered(
            "residual stride 2 (projection)",
            head(vec![c(), LayerSpec::Residual { out: 8, stride: 2 }]),
        ),
        layered(
            "linear",
            vec![
                LayerSpec::Flatten,
                LayerSpec::Linear {
                    out: 16,
                    bias: true,
                },
                LayerSpec::Relu,
                LayerSpec::Linear { out: 5, bias: true },
            ],
        ),
        layered(
            "dropout",
            vec![
                LayerSpec::Flatten,
                LayerSpec::Linear {
                    out: 16,
                    bias: true,
                },
                LayerSpec::Dropout { p: 0.5 },
                LayerSpec::Linear { out: 5, bias: true },
            ],
        ),
        Case {
            name: "MLP",
            spec: ModelSection {
                input: 64,
                hidden: vec![32, 32],
                classes: 5,
                ..ModelSection::default()
            },
            batch: 16,
        },
        Case {
            name: "CNN",
            spec: ModelSection {
                kind: ModelKind::Cnn,
                input: 3 * 8 * 8,
                in_channels: 3,
                conv: vec![4, 8],
                hidden: vec![16],
                classes: 5,
                ..ModelSection::default()
            },
            batch: 8,
        },
    ];
    if full {
        let preset = |kind, width| ModelSection {
            kind,
            input: 3 * 32 * 32,
            in_channels: 3,
            classes: 10,
            width,
            ..ModelSection::default()
        };
        cases.push(Case {
            name: "ResNet-20",
            spec: preset(ModelKind::Resnet20, 1.0),
            batch: 16,
        });
        cases.push(Case {
            name: "ResNet-18 width 0.25",
            spec: preset(ModelKind::Resnet18, 0.25),
            batch: 8,
        });
    }
    cases
}

/// A fixed synthetic batch for `spec`.
pub fn batch_for(spec: &ModelSection, samples: usize) -> Batch {
    let (train, _) = synthetic(&SyntheticSpec {
        train: samples,
        test: 0,
        features: spec.input,
        classes: spec.classes,
        seed: 11,
        ..SyntheticSpec::default()
    });
    Batch::from_samples(&train, spec.input)
}

/// Runs `case` on `device` with initial weights from `seed`.
pub fn run_case(case: &Case, device: &Device, seed: u64) -> Result<Outputs, ModelError> {
    let batch = batch_for(&case.spec, case.batch);
    let mut model = Model::new(&case.spec, device.clone(), seed)?;
    let train_logits = model.logits(&batch, true)?;
    let (loss0, grad0) = model.gradient(&batch)?;
    let eval_logits = model.logits(&batch, false)?;
    let (eval_loss, _) = model.evaluate(&batch)?;
    // A dense pull (an SGD step), then a sparse one (every 7th entry).
    let mut params = model.flat_params()?;
    for (p, g) in params.iter_mut().zip(&grad0) {
        *p -= 0.1 * g;
    }
    model.write_range(0, &params)?;
    let indices: Vec<u32> = (0..params.len() as u32).step_by(7).collect();
    let values: Vec<f32> = indices.iter().map(|&i| 0.5 * params[i as usize]).collect();
    model.write_sparse(0, &indices, &values)?;
    let (loss1, grad1) = model.gradient(&batch)?;
    Ok(Outputs {
        forward: vec![
            train_logits,
            vec![loss0, loss1],
            eval_logits,
            vec![eval_loss],
        ],
        gradients: vec![grad0, grad1],
        params: model.flat_params()?,
    })
}

/// Every case of `cases` on `device` against `reference`, same seed.
pub fn check(
    cases: &[Case],
    device: &Device,
    reference: &Device,
    seed: u64,
) -> Result<Vec<Row>, ModelError> {
    cases
        .iter()
        .map(|case| {
            let got = run_case(case, device, seed)?;
            let want = run_case(case, reference, seed)?;
            Ok(compare(case.name, &got, &want))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_measures_the_difference_and_refuses_mismatches() {
        assert_eq!(rel_err(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        assert!((rel_err(&[3.0, 4.5], &[3.0, 4.0]) - 0.1).abs() < 1e-12);
        assert_eq!(rel_err(&[0.5], &[0.0]), 0.5);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
        let a = vec![vec![1.0f32]];
        assert_eq!(worst(&a, &[]), f64::INFINITY);
    }

    #[test]
    fn every_case_agrees_with_itself_on_the_cpu() {
        let rows = check(&cases(false), &Device::Cpu, &Device::Cpu, 3).unwrap();
        assert_eq!(rows.len(), cases(false).len());
        for row in &rows {
            assert!(row.pass(TOLERANCE), "{row:?}");
            assert_eq!((row.forward, row.gradient, row.writes), (0.0, 0.0, 0.0));
        }
    }

    #[test]
    fn a_different_model_is_a_miss() {
        for case in cases(false) {
            let a = run_case(&case, &Device::Cpu, 1).unwrap();
            let b = run_case(&case, &Device::Cpu, 2).unwrap();
            let row = compare(case.name, &a, &b);
            assert!(row.gradient > TOLERANCE, "{row:?}");
            assert!(row.writes > TOLERANCE, "{row:?}");
            assert!(!row.pass(TOLERANCE), "{row:?}");
        }
    }

    #[test]
    fn the_writes_reach_the_parameters() {
        let case = &cases(false)[0];
        let out = run_case(case, &Device::Cpu, 5).unwrap();
        let model = Model::new(&case.spec, Device::Cpu, 5).unwrap();
        let init = model.flat_params().unwrap();
        // Entry 0 is in the sparse pull: half the stepped value.
        let stepped = init[0] - 0.1 * out.gradients[0][0];
        assert!((out.params[0] - 0.5 * stepped).abs() < 1e-6);
        // Entry 1 is not: the stepped value.
        assert!((out.params[1] - (init[1] - 0.1 * out.gradients[0][1])).abs() < 1e-6);
    }
}

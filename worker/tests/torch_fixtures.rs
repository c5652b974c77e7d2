//! The worker's gradients against torch's on the same network, weights and
//! batch. The fixtures (worker/tests/fixtures/<model>.safetensors) are made
//! by `scripts/make-fixtures.py`, which documents their keys; this test
//! needs no Python.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use ps_dataset::Batch;
use ps_shared::config::layers::LayerSpec;
use ps_shared::config::{ModelKind, ModelSection};
use ps_worker::model::Model;

fn fixture(name: &str) -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn values(f: &HashMap<String, Tensor>, key: &str) -> Vec<f32> {
    f.get(key)
        .unwrap_or_else(|| panic!("fixture has no {key}"))
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Every entry of `got` within `rel` of `want`'s largest magnitude, or of
/// `floor` when that is larger (a gradient that is zero up to rounding, such
/// as a conv bias before a batch norm, is compared at the model's scale).
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, floor: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(floor);
    assert!(scale > 0.0, "{what}: all zero, the check proves nothing");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= rel * scale,
            "{what}[{i}]: {a} vs torch {b} (scale {scale})"
        );
    }
}

/// Sets the fixture's weights, takes one training step and checks the
/// loss, every gradient and the batch-norm running statistics.
fn check(name: &str, spec: &ModelSection) {
    let f = fixture(name);
    let mut model = Model::new(spec, Device::Cpu, 0).unwrap();
    let layout = spec.layout();
    let mut flat = Vec::with_capacity(model.num_params());
    for t in &layout {
        flat.extend(values(&f, &format!("param.{}", t.name)));
    }
    model.set_flat(&flat).unwrap();
    let labels = values(&f, "labels").iter().map(|&l| l as u32).collect();
    let batch = Batch {
        features: values(&f, "input"),
        labels,
        dim: spec.input,
    };
    let (loss, grad) = model.gradient(&batch).unwrap();
    let want = values(&f, "loss")[0];
    assert!(
        (loss - want).abs() <= 1e-4 * want.abs(),
        "loss {loss} vs torch {want}"
    );
    let wants: Vec<Vec<f32>> = layout
        .iter()
        .map(|t| values(&f, &format!("grad.{}", t.name)))
        .collect();
    let largest = wants.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
    for ((t, r), want) in layout.iter().zip(spec.tensor_ranges()).zip(&wants) {
        assert_close(&t.name, &grad[r], want, 1e-4, 0.1 * largest);
    }
    for (i, stats) in model.bn_running().unwrap().iter().enumerate() {
        let (mean, var) = (&stats.mean, &stats.var);
        assert_close(
            &format!("running mean {i}"),
            mean,
            &values(&f, &format!("running_mean.{i}")),
            1e-5,
            0.0,
        );
        assert_close(
            &format!("running var {i}"),
            var,
            &values(&f, &format!("running_var.{i}")),
            1e-5,
            0.0,
        );
    }
}

#[test]
fn a_layered_cnn_matches_torch() {
    let conv = |out, bias| LayerSpec::Conv2d {
        out,
        kernel: 3,
        stride: 1,
        padding: None,
        bias,
    };
    let spec = ModelSection {
        kind: ModelKind::Layers,
        input: 3 * 8 * 8,
        in_channels: 3,
        classes: 5,
        layers: vec![
            conv(4, true),
            LayerSpec::BatchNorm,
            LayerSpec::Relu,
            LayerSpec::Residual { out: 4, stride: 1 },
            LayerSpec::MaxPool {
                kernel: 2,
                stride: None,
            },
            LayerSpec::Residual { out: 8, stride: 2 },
            LayerSpec::AvgPool {
                kernel: 2,
                stride: Some(1),
            },
            LayerSpec::Flatten,
            LayerSpec::Linear { out: 6, bias: true },
            LayerSpec::Relu,
            LayerSpec::Linear { out: 5, bias: true },
        ],
        ..ModelSection::default()
    };
    check("layered_cnn", &spec);
}

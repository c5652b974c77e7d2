//! The GPT preset equals torch's same model: loss and every gradient on one
//! batch, from the same initial weights (the reference was computed once by
//! scripts/make-gpt-fixture.py and lives in tests/fixtures).

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use ps_dataset::Batch;
use ps_shared::config::GptSection;
use ps_worker::gpt::gpt_spec;
use ps_worker::model::Model;

fn fixture() -> (HashMap<String, Tensor>, HashMap<String, String>) {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gpt-tiny.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).expect("the fixture loads");
    let bytes = std::fs::read(&path).expect("the fixture reads");
    // The sizes are in the header's metadata: 8 bytes of header length, then JSON.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = header["__metadata__"]
        .as_object()
        .expect("the fixture has metadata")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    (tensors, meta)
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn gpt_loss_and_gradients_equal_torch() {
    let (tensors, meta) = fixture();
    let size = |k: &str| meta[k].parse::<usize>().unwrap();
    let mut spec = gpt_spec(
        size("vocab"),
        size("seq_len"),
        size("d_model"),
        size("n_layer"),
        size("n_head"),
    );
    spec.gpt = GptSection {
        d_ff: size("d_ff"),
        ..spec.gpt
    };
    let mut model = Model::new(&spec, Device::Cpu, 0).unwrap();
    let mut flat = vec![0.0f32; model.num_params()];
    let mut names = 0;
    for t in model.tensors().to_vec() {
        let p = &tensors[&format!("param.{}", t.name)];
        assert_eq!(p.dims(), t.shape.as_slice(), "shape of {}", t.name);
        flat[model.range_of(&t.name).unwrap()].copy_from_slice(&values(p));
        names += 1;
    }
    assert_eq!(
        names * 2 + 2,
        tensors.len(),
        "every fixture tensor is a parameter of the model"
    );
    model.set_flat(&flat).unwrap();
    let tokens = &tensors["tokens"];
    let batch = Batch {
        features: values(tokens),
        labels: vec![0; tokens.dim(0).unwrap()],
        dim: tokens.dim(1).unwrap(),
    };
    let (loss, grad) = model.gradient(&batch).unwrap();
    let want = values(&tensors["loss"])[0];
    assert!(
        ((loss - want) / want).abs() < 1e-5,
        "loss {loss} vs torch {want}"
    );
    let mut worst = 0.0f32;
    let mut wrong = 0;
    for t in model.tensors() {
        let want = values(&tensors[&format!("grad.{}", t.name)]);
        let got = &grad[model.range_of(&t.name).unwrap()];
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "torch's gradient of {} is zero", t.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let rel = (g - w).abs() / scale;
            worst = worst.max(rel);
            if rel >= 1e-4 {
                eprintln!(
                    "{}[{i}]: {g} vs torch {w} (relative to the tensor's max {scale})",
                    t.name
                );
                wrong += 1;
            }
        }
    }
    assert_eq!(
        wrong, 0,
        "gradient entries off by 1e-4 or more of their tensor's largest"
    );
    println!("loss {loss} (torch {want}); worst gradient error {worst:e} relative to each tensor's largest entry");
    let (eval_loss, _) = model.evaluate(&batch).unwrap();
    assert!(
        ((eval_loss - want) / want).abs() < 1e-5,
        "evaluation loss {eval_loss} vs torch {want}"
    );
}

/// Forward + backward time of a GPT (the size of scripts/torch_gpt.py's
/// defaults): `RAYON_NUM_THREADS=1 cargo test --release -p ps-worker --test
/// gpt_torch -- --ignored --nocapture`. Prints the median of 20 runs.
#[test]
#[ignore]
fn gpt_forward_backward_speed() {
    let (batch, seq_len, d, layers, heads, vocab) = (8, 64, 128, 4, 4, 256);
    let spec = gpt_spec(vocab, seq_len, d, layers, heads);
    let mut model = Model::new(&spec, Device::Cpu, 1).unwrap();
    let data = ps_worker::gpt::random_batch(&spec.gpt, batch, 2);
    let mut grad = vec![0.0f32; model.num_params()];
    let mut times = Vec::new();
    for i in 0..22 {
        let t0 = std::time::Instant::now();
        let loss = model.gradient_into(&data, &mut grad).unwrap();
        assert!(loss.is_finite());
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "stratus_gpt_ms median={:.3} min={:.3} max={:.3} params={}",
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        model.num_params()
    );
}

//! A model written with candle-nn and brought through `ps_worker::api`,
//! trained by a whole cluster in one process; and the refusals of a model
//! that does not match the config's `model.tensors`.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, VarBuilder, VarMap};
use ps_dataset::SyntheticSpec;
use ps_net::cli::{exit_code, ExitCode};
use ps_shared::config::{ClusterConfig, CompressionKind, ModelKind, TensorDecl};
use ps_tests::{run_cluster_with_model, synthetic_bucket_blocking, test_config, TestPki};
use ps_worker::api::{factory, named_vars, CustomModel, Phase};
use ps_worker::run::{classify_exit, run_worker, run_worker_with, ModelFactory, WorkerError};
use ps_worker::simulate::Simulation;

/// Chance is 10%; the built-in MLP of the same shape passes 90% on this set
/// (tests/cluster.rs).
const ACCURACY_BAR: f32 = 0.90;

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

/// A 64-128-10 MLP with dropout in training, written as a candle user would.
fn mlp(device: &Device) -> candle_core::Result<CustomModel> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let hidden = linear(64, 128, vb.pp("hidden"))?;
    let out = linear(128, 10, vb.pp("out"))?;
    Ok(CustomModel::classifier(
        named_vars(&varmap),
        move |x: &Tensor, phase| {
            let h = hidden.forward(x)?.relu()?;
            let h = match phase {
                Phase::Train { .. } => candle_nn::ops::dropout(&h, 0.1)?,
                Phase::Eval => h,
            };
            out.forward(&h)
        },
    ))
}

/// `cfg` with `[model]` describing `model`'s tensors.
fn custom_config(mut cfg: ClusterConfig, model: &CustomModel) -> ClusterConfig {
    cfg.model.kind = ModelKind::Custom;
    cfg.model.hidden = Vec::new();
    cfg.model.tensors = model
        .layout()
        .into_iter()
        .map(|t| TensorDecl {
            name: t.name,
            shape: t.shape,
        })
        .collect();
    cfg.validate().expect("a valid custom-model config");
    cfg
}

#[test]
fn a_custom_candle_model_trains_on_the_cluster() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let layout = mlp(&Device::Cpu).expect("build the model");
    let cfg = custom_config(test_config(CompressionKind::Topk, 0.01, 6), &layout);
    assert_eq!(cfg.model.num_params(), 64 * 128 + 128 + 128 * 10 + 10);
    let (reports, _) = run_cluster_with_model(
        cfg,
        &Simulation::default(),
        store,
        prefix,
        Some(factory(mlp)),
    )
    .expect("cluster run");
    assert_eq!(reports.len(), 2);
    for r in &reports {
        println!(
            "custom MLP: worker {} steps {} accuracy {:.2}%",
            r.rank,
            r.steps,
            100.0 * r.final_accuracy
        );
        assert!(r.steps > 0);
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "worker {}: {}",
            r.rank,
            r.final_accuracy
        );
    }
    // Both workers evaluate the same pulled parameters.
    assert!((reports[0].final_accuracy - reports[1].final_accuracy).abs() < 1e-6);
}

/// Runs rank 0 alone against no server: a worker refused before it
/// connects returns at once.
fn run_alone(cfg: &ClusterConfig, model: Option<ModelFactory>) -> WorkerError {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let pki = TestPki::new(cfg.cluster.workers as u32);
    let system = actix::System::new();
    let outcome = system.block_on(async {
        let opts = pki.options(0);
        match model {
            Some(m) => run_worker_with(cfg, opts, store, prefix, Some(m)).await,
            None => run_worker(cfg, opts, store, prefix).await,
        }
    });
    outcome.expect_err("the worker must be refused")
}

#[test]
fn a_model_that_differs_from_model_tensors_is_refused_naming_the_tensor() {
    let layout = mlp(&Device::Cpu).expect("build the model");
    let mut cfg = custom_config(test_config(CompressionKind::Topk, 0.01, 1), &layout);
    // Nobody listens here: the refusal comes before any connection.
    cfg.cluster.servers = vec!["127.0.0.1:9".into()];
    let at = cfg
        .model
        .tensors
        .iter()
        .position(|t| t.name == "out.weight")
        .expect("out.weight is a tensor");
    cfg.model.tensors[at].shape = vec![10, 64];
    let e = run_alone(&cfg, Some(factory(mlp)));
    let text = e.to_string();
    assert!(text.contains("`out.weight` [10, 128]"), "{text}");
    assert!(text.contains(&format!("model.tensors[{at}]")), "{text}");
    assert_eq!(exit_code(&e, classify_exit), ExitCode::Config);

    // One tensor too few in the config: the first one missing is named.
    let mut short = custom_config(test_config(CompressionKind::Topk, 0.01, 1), &layout);
    short.cluster.servers = vec!["127.0.0.1:9".into()];
    let last = short.model.tensors.pop().expect("a tensor");
    let e = run_alone(&short, Some(factory(mlp)));
    assert!(e.to_string().contains(&format!("`{}`", last.name)), "{e}");
}

#[test]
fn ps_worker_train_cannot_build_a_custom_model() {
    let layout = mlp(&Device::Cpu).expect("build the model");
    let mut cfg = custom_config(test_config(CompressionKind::Topk, 0.01, 1), &layout);
    cfg.cluster.servers = vec!["127.0.0.1:9".into()];
    let e = run_alone(&cfg, None);
    assert!(e.to_string().contains("ps_worker::api"), "{e}");
    assert_eq!(exit_code(&e, classify_exit), ExitCode::Config);
}

//! Train your own candle model on a Stratus cluster.
//!
//! A program that has written a model with candle hands Stratus the
//! model's `Var`s and a closure; Stratus runs everything else: the loader
//! with its known-order prefetch and caches, error-feedback compression,
//! the exchange with the servers, evaluation, checkpoints on the servers,
//! metrics and the exit codes of `ps-worker train`. After each step the
//! pulled parameters are written back into the same `Var`s (in place on
//! the CPU), so the program's own modules always see the current weights.
//!
//! ```no_run
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, VarBuilder, VarMap};
//! use ps_worker::api::{named_vars, CustomModel};
//!
//! fn build(device: &Device) -> candle_core::Result<CustomModel> {
//!     let varmap = VarMap::new();
//!     let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
//!     let hidden = linear(64, 128, vb.pp("fc1"))?;
//!     let out = linear(128, 10, vb.pp("fc2"))?;
//!     Ok(CustomModel::classifier(named_vars(&varmap), move |x: &Tensor, _phase| {
//!         out.forward(&hidden.forward(x)?.relu()?)
//!     }))
//! }
//!
//! // `--config job.toml --rank N`, like `ps-worker train`.
//! ps_worker::api::main(build)
//! ```
//!
//! The servers shard the flat parameter space before any worker connects,
//! so the config names the model's tensors: `model.kind = "custom"` with one
//! `[[model.tensors]]` entry (name, shape) per tensor, in the order of
//! [`named_vars`] (sorted by name). [`CustomModel::config_tensors`] prints
//! that list, and `--print-layout` makes [`main`] print it and exit. A worker
//! whose model differs from the list is refused before it connects, with the
//! first tensor that differs named; `model.input` and `model.classes` still
//! describe the dataset (features per sample, classes).
//!
//! The first worker's initial weights become everyone's (the servers take
//! the first offer), so the program need not seed its initialisation.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::VarMap;
use clap::Parser;

/// A batch as the loss and evaluation closures of [`CustomModel::new`] get it.
pub use ps_dataset::Batch;
use ps_net::cli::{LogArgs, MetricsArgs, EXIT_CODES_HELP};
use ps_shared::config::TensorSpec;

use crate::launch::TrainArgs;
use crate::model::{Model, ModelError};
use crate::run::ModelFactory;

/// Why the model is being run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A training step: the run's `step` (counts on across a rejoin, so a
    /// dropout mask seeded from it continues the run's sequence).
    Train { step: u64 },
    /// An evaluation on the test split: no dropout, running statistics.
    Eval,
}

impl Phase {
    pub fn is_train(&self) -> bool {
        matches!(self, Phase::Train { .. })
    }
}

type ForwardFn = Box<dyn FnMut(&Tensor, Phase) -> candle_core::Result<Tensor> + Send>;
type LossFn = Box<dyn FnMut(&Batch, Phase) -> candle_core::Result<Tensor> + Send>;
type EvalFn = Box<dyn FnMut(&Batch) -> candle_core::Result<(f32, f32)> + Send>;

/// What a custom model computes: logits of a classifier (loss and
/// accuracy follow), or a loss and an evaluation of the program's own.
pub(crate) enum Program {
    Classifier { device: Device, forward: ForwardFn },
    Loss { loss: LossFn, eval: EvalFn },
}

impl Program {
    /// The mean loss of `batch` (a scalar tensor to differentiate).
    pub(crate) fn loss(&mut self, batch: &Batch, phase: Phase) -> candle_core::Result<Tensor> {
        match self {
            Program::Classifier { device, forward } => {
                let logits = forward(&batch_input(batch, device)?, phase)?;
                cross_entropy(&logits, batch, device)
            }
            Program::Loss { loss, .. } => loss(batch, phase),
        }
    }

    /// Mean loss and accuracy of `batch`.
    pub(crate) fn evaluate(&mut self, batch: &Batch) -> candle_core::Result<(f32, f32)> {
        match self {
            Program::Classifier { device, forward } => {
                let logits = forward(&batch_input(batch, device)?, Phase::Eval)?.detach();
                let loss = cross_entropy(&logits, batch, device)?.to_scalar::<f32>()?;
                let labels = batch_labels(batch, device)?;
                let correct = logits
                    .argmax(D::Minus1)?
                    .eq(&labels)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                Ok((loss, correct / batch.len() as f32))
            }
            Program::Loss { eval, .. } => eval(batch),
        }
    }
}

/// Mean softmax cross-entropy of `[batch, classes]` logits against the
/// batch's labels, which must each be a class.
fn cross_entropy(logits: &Tensor, batch: &Batch, device: &Device) -> candle_core::Result<Tensor> {
    let (rows, classes) = logits.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "a classifier returns [batch, classes] logits, not shape {:?}",
            logits.dims()
        ))
    })?;
    if rows != batch.len() {
        candle_core::bail!(
            "the classifier returned {rows} rows of logits for a batch of {}",
            batch.len()
        );
    }
    if let Some(i) = batch.labels.iter().position(|&l| l as usize >= classes) {
        candle_core::bail!(
            "label {} of sample {i} is out of range for {classes} classes",
            batch.labels[i]
        );
    }
    candle_nn::loss::cross_entropy(logits, &batch_labels(batch, device)?)
}

/// The batch's features as a `[batch, features]` f32 tensor on `device`.
pub fn batch_input(batch: &Batch, device: &Device) -> candle_core::Result<Tensor> {
    Tensor::from_slice(&batch.features, (batch.len(), batch.dim), device)
}

/// The batch's labels as a `[batch]` u32 tensor on `device`.
pub fn batch_labels(batch: &Batch, device: &Device) -> candle_core::Result<Tensor> {
    Tensor::from_slice(&batch.labels, batch.len(), device)
}

/// The `Var`s of a `VarMap` with their names, sorted by name: the order of
/// the flat parameter space (a `VarMap` has no order of its own).
pub fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut named: Vec<(String, Var)> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// A model a program brings: its parameters and what to compute with them.
pub struct CustomModel {
    named: Vec<(String, Var)>,
    program: Program,
}

impl CustomModel {
    /// A classifier: `forward` maps a `[batch, model.input]` tensor to
    /// `[batch, classes]` logits; the loss is the mean softmax
    /// cross-entropy against the labels, the evaluation reports it with the
    /// accuracy. `named` lists the parameters in flat-space order (see
    /// [`named_vars`]).
    pub fn classifier(
        named: Vec<(String, Var)>,
        forward: impl FnMut(&Tensor, Phase) -> candle_core::Result<Tensor> + Send + 'static,
    ) -> Self {
        let device = named
            .first()
            .map_or(Device::Cpu, |(_, v)| v.as_tensor().device().clone());
        Self {
            named,
            program: Program::Classifier {
                device,
                forward: Box::new(forward),
            },
        }
    }

    /// Any model: `loss` returns the batch's mean loss as a scalar tensor
    /// (differentiated by candle's autograd), `eval` returns the mean loss
    /// and accuracy of a test batch (report NaN as the accuracy of a model
    /// that has none).
    pub fn new(
        named: Vec<(String, Var)>,
        loss: impl FnMut(&Batch, Phase) -> candle_core::Result<Tensor> + Send + 'static,
        eval: impl FnMut(&Batch) -> candle_core::Result<(f32, f32)> + Send + 'static,
    ) -> Self {
        Self {
            named,
            program: Program::Loss {
                loss: Box::new(loss),
                eval: Box::new(eval),
            },
        }
    }

    /// The model's tensors in flat-space order.
    pub fn layout(&self) -> Vec<TensorSpec> {
        self.named
            .iter()
            .map(|(name, v)| TensorSpec {
                name: name.clone(),
                shape: v.as_tensor().dims().to_vec(),
            })
            .collect()
    }

    /// The `[model]` lines the config needs for this model: `kind =
    /// "custom"` and its tensors.
    pub fn config_tensors(&self) -> String {
        let mut out = String::from("[model]\nkind = \"custom\"\ntensors = [\n");
        for t in self.layout() {
            let dims: Vec<String> = t.shape.iter().map(usize::to_string).collect();
            out.push_str(&format!(
                "    {{ name = \"{}\", shape = [{}] }},\n",
                t.name,
                dims.join(", ")
            ));
        }
        out.push_str("]\n");
        out
    }

    /// The worker's [`Model`] over these `Var`s (each a contiguous f32
    /// tensor on `device`).
    pub fn into_model(self, device: &Device) -> Result<Model, ModelError> {
        Model::from_program(device.clone(), self.named, self.program)
    }
}

/// A [`ModelFactory`] for [`crate::run::run_worker_with`] from a function
/// that builds the program's model on the run's device.
pub fn factory(
    build: impl Fn(&Device) -> candle_core::Result<CustomModel> + Send + Sync + 'static,
) -> ModelFactory {
    Arc::new(move |device: &Device| {
        let custom = build(device).map_err(|source| ModelError::Program {
            what: "construction",
            source,
        })?;
        custom.into_model(device)
    })
}

/// The command line of a program built on this module: `ps-worker
/// train`'s flags.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "A Stratus worker that trains the model this program brings (the flags of `ps-worker train`)",
    long_about = None,
    after_help = EXIT_CODES_HELP
)]
pub struct Cli {
    /// Cluster config (TOML) with `model.kind = "custom"` listing the
    /// model's tensors (see --print-layout).
    #[arg(
        long,
        short,
        env = "STRATUS_CONFIG",
        required_unless_present = "print_layout"
    )]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub logging: LogArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Print the `[model]` section this model needs (kind and tensors) and exit.
    #[arg(long)]
    pub print_layout: bool,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Runs one worker process (or node) of the config's cluster with the model
/// `build` makes, exactly as `ps-worker train` runs a built-in model, and
/// exits with its exit code.
pub fn main(
    build: impl Fn(&Device) -> candle_core::Result<CustomModel> + Send + Sync + 'static,
) -> ! {
    let cli = Cli::parse();
    cli.logging.init("warn");
    let program = std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "worker".into());
    let outcome = run_cli(cli, build);
    crate::launch::exit(&program, outcome)
}

fn run_cli(
    cli: Cli,
    build: impl Fn(&Device) -> candle_core::Result<CustomModel> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    if cli.print_layout {
        let model = build(&Device::Cpu)?;
        ps_net::cli::write_stdout(format_args!("{}", model.config_tensors()));
        return Ok(());
    }
    let Some(path) = &cli.config else {
        anyhow::bail!(ps_net::cli::UsageError("--config is required".into()));
    };
    let overrides = ps_shared::overrides::Override::from_env()?;
    let cfg =
        ps_shared::overrides::load(ps_shared::overrides::ConfigSource::File(path), &overrides)?;
    cli.metrics.start()?;
    crate::launch::train(cfg, cli.train, Some(factory(build)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;
    use ps_shared::config::{ModelKind, ModelSection};

    fn spec() -> ModelSection {
        ModelSection {
            input: 5,
            hidden: vec![7],
            classes: 3,
            ..ModelSection::default()
        }
    }

    /// The built-in MLP of `spec()` written as a custom classifier over
    /// `Var`s in the built-in layout's order (fc0.weight, fc0.bias, ...).
    fn custom_mlp(builtin: &Model) -> (CustomModel, Vec<Var>) {
        let flat = builtin.flat_params().unwrap();
        let mut named = Vec::new();
        let mut at = 0;
        for t in builtin.layout() {
            let n = t.numel();
            let init = Tensor::from_slice(&flat[at..at + n], t.shape.as_slice(), &Device::Cpu);
            named.push((t.name.clone(), Var::from_tensor(&init.unwrap()).unwrap()));
            at += n;
        }
        let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let layer = |w: usize| {
            candle_nn::Linear::new(
                vars[w].as_tensor().clone(),
                Some(vars[w + 1].as_tensor().clone()),
            )
        };
        let (l0, l1) = (layer(0), layer(2));
        let model = CustomModel::classifier(named, move |x: &Tensor, _| {
            l1.forward(&l0.forward(x)?.relu()?)
        });
        (model, vars)
    }

    fn batch() -> Batch {
        let features = (0..20).map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0).collect();
        Batch {
            features,
            labels: vec![0, 2, 1, 2],
            dim: 5,
        }
    }

    #[test]
    fn a_custom_classifier_computes_what_the_builtin_mlp_computes() {
        let mut builtin = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let (custom, _) = custom_mlp(&builtin);
        let mut custom = custom.into_model(&Device::Cpu).unwrap();
        custom.check_layout(&spec()).unwrap();
        let n = builtin.num_params();
        let (mut g1, mut g2) = (vec![0.0; n], vec![0.0; n]);
        let l1 = builtin.gradient_into(&batch(), &mut g1).unwrap();
        let l2 = custom.gradient_into(&batch(), &mut g2).unwrap();
        assert!((l1 - l2).abs() < 1e-5, "{l1} vs {l2}");
        for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                "entry {i}: {a} vs {b}"
            );
        }
        let (e1, e2) = (
            builtin.evaluate(&batch()).unwrap(),
            custom.evaluate(&batch()).unwrap(),
        );
        assert!(
            (e1.0 - e2.0).abs() < 1e-5 && e1.1 == e2.1,
            "{e1:?} vs {e2:?}"
        );
    }

    #[test]
    fn pulled_parameters_reach_the_programs_own_vars() {
        let builtin = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let (custom, vars) = custom_mlp(&builtin);
        let mut model = custom.into_model(&Device::Cpu).unwrap();
        let n = model.num_params();
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 1e-3).collect();
        model.set_flat(&values).unwrap();
        let first = vars[0]
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(first, values[..first.len()]);
        // A sparse pull: entry 3 of the second tensor (fc0.bias).
        let bias_at = first.len() as u32 + 3;
        model.write_sparse(0, &[bias_at], &[42.0]).unwrap();
        let bias = vars[1].as_tensor().to_vec1::<f32>().unwrap();
        assert_eq!(bias[3], 42.0);
        assert_eq!(model.flat_params().unwrap()[bias_at as usize], 42.0);
    }

    #[test]
    fn layouts_are_compared_by_name_and_shape() {
        let builtin = Model::new(&spec(), Device::Cpu, 3).unwrap();
        let (custom, _) = custom_mlp(&builtin);
        let text = custom.config_tensors();
        assert!(
            text.contains("{ name = \"fc0.weight\", shape = [7, 5] }"),
            "{text}"
        );
        let model = custom.into_model(&Device::Cpu).unwrap();
        let mut other = spec();
        other.hidden = vec![8];
        let e = model.check_layout(&other).unwrap_err().to_string();
        assert!(e.contains("`fc0.weight` [7, 5] in the model"), "{e}");
        assert!(e.contains("`fc0.weight` [8, 5] in the config"), "{e}");
    }

    #[test]
    fn a_loss_that_is_not_a_scalar_is_an_error_naming_it() {
        let v = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let w = v.as_tensor().clone();
        let custom = CustomModel::new(
            vec![("w".into(), v)],
            move |_: &Batch, _| w.affine(2.0, 0.0),
            |_: &Batch| Ok((0.0, f32::NAN)),
        );
        let mut model = custom.into_model(&Device::Cpu).unwrap();
        let e = model.gradient_into(&batch(), &mut [0.0; 4]).unwrap_err();
        assert!(e.to_string().contains("one value"), "{e}");
    }

    #[test]
    fn the_builtin_models_do_not_build_a_custom_kind() {
        let spec = ModelSection {
            kind: ModelKind::Custom,
            ..ModelSection::default()
        };
        let e = Model::new(&spec, Device::Cpu, 1).err().unwrap();
        assert!(matches!(e, ModelError::CustomKind));
    }
}

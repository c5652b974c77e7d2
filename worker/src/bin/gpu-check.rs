//! `gpu-check`: the worker's models on one device against another (CUDA
//! against the CPU on a GPU machine; `--device cpu` runs the same
//! comparison CPU against CPU anywhere), and with `--bench` the ResNet step
//! times on the device, beside torch on the same device when `--python`
//! names an interpreter with torch.
//!
//! It prints markdown table rows (`| check | value | bar | result |`), one
//! per layer kind or model, each PASS or MISS; the exit status is 0 when
//! everything ran, whatever the rows say, and 1 when something could not
//! run (no such device, a model error).
//!
//! ```sh
//! gpu-check --device cuda                       # layers, CUDA vs CPU
//! gpu-check --device cuda --bench --python python3
//! gpu-check --device cpu --quick                # the comparison, CPU vs CPU
//! ```

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;

use ps_shared::config::{ModelKind, ModelSection};
use ps_worker::devcheck::{self, TOLERANCE};
use ps_worker::model::{device_from_str, Model};

/// Largest ResNet-20 step time on the GPU as a multiple of torch's.
const RESNET20_TARGET: f64 = 1.5;

#[derive(Parser, Debug)]
#[command(name = "gpu-check", long_about = None)]
struct Args {
    /// The device checked: cuda, cuda:N or cpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// The device it is compared against.
    #[arg(long, default_value = "cpu")]
    reference: String,
    /// Largest relative error that passes.
    #[arg(long, default_value_t = TOLERANCE)]
    tolerance: f64,
    /// Only the single-layer cases, the MLP and the CNN (no ResNets).
    #[arg(long)]
    quick: bool,
    /// Skip the comparison (only the timings).
    #[arg(long)]
    no_compare: bool,
    /// Also time ResNet-20 and ResNet-18 forward + backward on the device.
    #[arg(long)]
    bench: bool,
    /// Batch sizes of the timings, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [32usize, 128])]
    batches: Vec<usize>,
    /// Timed steps per model and batch (after 3 untimed ones).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Python with torch: time the same networks in torch on the same device.
    #[arg(long)]
    python: Option<PathBuf>,
    /// The torch timing script (default: scripts/gpu_torch.py beside the
    /// binary's repository, or next to the binary).
    #[arg(long)]
    torch_script: Option<PathBuf>,
}

fn row(check: &str, value: &str, bar: &str, result: &str) {
    println!("| {check} | {value} | {bar} | {result} |");
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Median milliseconds of one forward + backward (gradients copied to the
/// host, as the worker does) over `steps` steps, after 3 untimed ones.
fn step_ms(
    model: &mut Model,
    spec: &ModelSection,
    batch: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let batch = devcheck::batch_for(spec, batch);
    let mut grad = vec![0.0f32; model.num_params()];
    for _ in 0..3 {
        model.gradient_into(&batch, &mut grad)?;
    }
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        model.gradient_into(&batch, &mut grad)?;
        times.push(1e3 * t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

fn torch_script(args: &Args) -> Option<PathBuf> {
    if let Some(s) = &args.torch_script {
        return Some(s.clone());
    }
    let beside_repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu_torch.py");
    let beside_binary = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("gpu_torch.py")));
    [Some(beside_repo), beside_binary]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

fn torch_ms(
    python: &PathBuf,
    script: &PathBuf,
    model: &str,
    width: f64,
    batch: usize,
    steps: usize,
    device: &str,
) -> anyhow::Result<f64> {
    let out = Command::new(python)
        .arg(script)
        .args(["--model", model])
        .args(["--width", &width.to_string()])
        .args(["--batch", &batch.to_string()])
        .args(["--steps", &steps.to_string()])
        .args(["--device", device])
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse::<f64>().with_context(|| {
        format!(
            "{} printed `{}`, not milliseconds",
            script.display(),
            text.trim()
        )
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = device_from_str(&args.device)
        .with_context(|| format!("cannot open device `{}`", args.device))?;
    let reference = device_from_str(&args.reference)
        .with_context(|| format!("cannot open reference device `{}`", args.reference))?;
    println!("| check | value | bar | result |");
    println!("|---|---|---|---|");
    let tol = format!("<= {:.0e}", args.tolerance);
    if !args.no_compare {
        for case in devcheck::cases(!args.quick) {
            let rows = devcheck::check(std::slice::from_ref(&case), &device, &reference, 1)
                .with_context(|| format!("case `{}`", case.name))?;
            for r in rows {
                row(
                    &format!("{} vs {}: {}", args.device, args.reference, r.name),
                    &format!(
                        "fwd {:.1e}, grad {:.1e}, writes {:.1e}",
                        r.forward, r.gradient, r.writes
                    ),
                    &tol,
                    verdict(r.pass(args.tolerance)),
                );
            }
        }
    }
    if args.bench {
        let script = torch_script(&args);
        if args.python.is_some() && script.is_none() {
            eprintln!("gpu-check: gpu_torch.py not found; give --torch-script");
        }
        for (name, kind, key) in [
            ("ResNet-20", ModelKind::Resnet20, "resnet20"),
            ("ResNet-18", ModelKind::Resnet18, "resnet18"),
        ] {
            let spec = ModelSection {
                kind,
                input: 3 * 32 * 32,
                in_channels: 3,
                classes: 10,
                ..ModelSection::default()
            };
            let mut model = Model::new(&spec, device.clone(), 1)?;
            for &batch in &args.batches {
                let ours = step_ms(&mut model, &spec, batch, args.steps)
                    .with_context(|| format!("timing {name} at batch {batch}"))?;
                let label = format!("{name} fwd+bwd, batch {batch}, {}", args.device);
                let torch = match (&args.python, &script) {
                    (Some(py), Some(s)) => {
                        match torch_ms(py, s, key, 1.0, batch, args.steps, &args.device) {
                            Ok(ms) => Some(ms),
                            Err(e) => {
                                eprintln!("gpu-check: torch timing failed: {e:#}");
                                None
                            }
                        }
                    }
                    _ => None,
                };
                match torch {
                    Some(t) => {
                        let ratio = ours / t.max(f64::MIN_POSITIVE);
                        let (bar, result) = if kind == ModelKind::Resnet20 {
                            (
                                format!("<= {RESNET20_TARGET}x torch"),
                                verdict(ratio <= RESNET20_TARGET),
                            )
                        } else {
                            ("reported".to_string(), "-")
                        };
                        row(
                            &label,
                            &format!("{ours:.2} ms, torch {t:.2} ms, {ratio:.2}x"),
                            &bar,
                            result,
                        );
                    }
                    None => row(&label, &format!("{ours:.2} ms (no torch)"), "-", "-"),
                }
            }
        }
    }
    Ok(())
}

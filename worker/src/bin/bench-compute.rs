//! `bench-compute`: one worker's compute per step beside torch, on the same
//! networks, batches and thread counts, measured in one run.
//!
//! For every network, batch and thread count it times, interleaved over
//! rounds on one synthetic batch:
//!
//! * forward + backward: [`Model::gradient_into`], the worker's path, which
//!   writes the flat gradient into a buffer reused across steps; torch:
//!   `zero_grad`, forward, cross-entropy, `backward`;
//! * the whole worker step: that plus the trainer's error-feedback top-k
//!   compression with the default `[compression]` settings (density 1%,
//!   exact top-k, momentum correction 0.9 with masking); torch: the same
//!   plus flattening the gradients and the same error feedback
//!   (`u = 0.9 u + g; v += u`, `torch.topk` of `|v|`, the sent entries
//!   zeroed in `v` and `u`).
//!
//! Each thread count runs in processes of its own: a child of this binary
//! with `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS` set to it and the work
//! inside a rayon pool of exactly that size (candle's matmul splits over the
//! current rayon pool into `RAYON_NUM_THREADS` parts, its element-wise ops
//! over a pool of `CANDLE_NUM_THREADS - 1` threads plus the caller), and a
//! torch process (`scripts/torch_compute.py --serve`) with
//! `torch.set_num_threads`. The parent sends both the same commands and
//! alternates which side goes first in each round.
//!
//! It prints the medians with min-max, the median of the per-round ratios
//! candle/torch, and each network's target as PASS/MISS. It never fails on
//! a time; it fails when the two sides' parameter counts differ.
//!
//! ```sh
//! target/release/bench-compute --python venv/bin/python
//! target/release/bench-compute --model resnet20 --batch 32 --threads 1 --python venv/bin/python
//! target/release/bench-compute --model mlp --only-worker --rounds 3
//! target/release/bench-compute --model gpt --batch 16 --rounds 3 --python venv/bin/python
//! ```
//!
//! The `gpt` row's batch is windows of random tokens (cross-entropy over
//! every position); its torch side is `scripts/torch_gpt.py`'s model.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};

use ps_dataset::{synthetic, Batch, SyntheticSpec};
use ps_shared::config::{CompressionSection, ModelKind, ModelSection};
use ps_shared::sparse::Compressor;
use ps_worker::model::Model;

/// The networks of the table. A new row is one variant here (with its
/// arms below) and one builder in `scripts/torch_compute.py` under the
/// same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Net {
    /// MLP 256-1024-1024-10 (the default `kind = "mlp"` benchmark shape).
    Mlp,
    /// configs/mnist-cnn.toml: 1x28x28, conv 8, conv 16 (3x3, ReLU,
    /// 2x2 max-pool each), linear 784-64, linear 64-10.
    Cnn,
    /// The small CNN of issue 27's cluster trial: 1x16x16, conv 16,
    /// conv 32 (3x3, ReLU, 2x2 max-pool each), linear 512-10.
    Cnn16,
    /// ResNet-20, width 1, 3x32x32, 10 classes.
    Resnet20,
    /// ResNet-18 (CIFAR stem) at width 0.5, 3x32x32, 10 classes.
    Resnet18,
    /// The GPT preset: vocabulary 256, context 128, d_model 256, 4 layers,
    /// 4 heads (3.2M parameters); a batch is that many windows of random
    /// tokens (run it with e.g. `--batch 16`).
    Gpt,
}

impl Net {
    const ALL: [Net; 6] = [
        Net::Mlp,
        Net::Cnn,
        Net::Cnn16,
        Net::Resnet20,
        Net::Resnet18,
        Net::Gpt,
    ];

    /// Name on the command line and in the torch script.
    fn name(self) -> &'static str {
        match self {
            Net::Mlp => "mlp",
            Net::Cnn => "cnn",
            Net::Cnn16 => "cnn16",
            Net::Resnet20 => "resnet20",
            Net::Resnet18 => "resnet18",
            Net::Gpt => "gpt",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Net::Mlp => "MLP 256-1024-1024-10",
            Net::Cnn => "CNN mnist-cnn.toml",
            Net::Cnn16 => "CNN 16x16 c16-c32",
            Net::Resnet20 => "ResNet-20 w1",
            Net::Resnet18 => "ResNet-18 w0.5",
            Net::Gpt => "GPT d256 L4 H4 T128",
        }
    }

    /// Largest candle/torch forward + backward ratio aimed for (issue 27).
    fn target(self) -> f64 {
        match self {
            Net::Mlp => 1.0,
            Net::Cnn | Net::Cnn16 => 1.2,
            Net::Resnet20 | Net::Gpt => 1.3,
            Net::Resnet18 => 1.5,
        }
    }

    fn spec(self) -> ModelSection {
        let image = |kind, width| ModelSection {
            kind,
            input: 3 * 32 * 32,
            in_channels: 3,
            classes: 10,
            width,
            hidden: vec![],
            ..ModelSection::default()
        };
        match self {
            Net::Mlp => ModelSection {
                kind: ModelKind::Mlp,
                input: 256,
                hidden: vec![1024, 1024],
                classes: 10,
                ..ModelSection::default()
            },
            Net::Cnn => ModelSection {
                kind: ModelKind::Cnn,
                input: 28 * 28,
                in_channels: 1,
                conv: vec![8, 16],
                hidden: vec![64],
                classes: 10,
                ..ModelSection::default()
            },
            Net::Cnn16 => ModelSection {
                kind: ModelKind::Cnn,
                input: 16 * 16,
                in_channels: 1,
                conv: vec![16, 32],
                hidden: vec![],
                classes: 10,
                ..ModelSection::default()
            },
            Net::Resnet20 => image(ModelKind::Resnet20, 1.0),
            Net::Resnet18 => image(ModelKind::Resnet18, 0.5),
            Net::Gpt => ps_worker::gpt::gpt_spec(256, 128, 256, 4, 4),
        }
    }

    fn from_name(name: &str) -> anyhow::Result<Net> {
        Net::ALL
            .into_iter()
            .find(|n| n.name() == name)
            .with_context(|| format!("unknown network `{name}`"))
    }
}

#[derive(Parser, Debug)]
#[command(name = "bench-compute", long_about = None)]
struct Args {
    /// Networks to time (comma separated); default all.
    #[arg(long, value_enum, value_delimiter = ',')]
    model: Vec<Net>,
    /// Batch sizes (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = [32usize, 128])]
    batch: Vec<usize>,
    /// Thread counts (comma separated); each runs in processes of its own.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2])]
    threads: Vec<usize>,
    /// Rounds per row; each round times both sides once.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Timed steps per round; by default as many as fill --round-ms (at
    /// least 1, at most 50), from an untimed first step.
    #[arg(long)]
    steps: Option<usize>,
    /// Aimed-for length of one side's round, in milliseconds.
    #[arg(long, default_value_t = 400.0)]
    round_ms: f64,
    /// Python with torch: time torch beside candle.
    #[arg(long)]
    python: Option<PathBuf>,
    /// Time only the worker (no torch), e.g. for profiling it.
    #[arg(long)]
    only_worker: bool,
    /// Internal: serve timing commands on stdin with this many threads.
    #[arg(long, hide = true)]
    serve: Option<usize>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// One network and batch, set up in the serving child.
struct Bench {
    model: Model,
    batch: Batch,
    grad: Vec<f32>,
    compressor: Compressor,
}

impl Bench {
    fn new(net: Net, batch: usize) -> anyhow::Result<Bench> {
        let spec = net.spec();
        let batch = if spec.kind == ModelKind::Gpt {
            ps_worker::gpt::random_batch(&spec.gpt, batch, 1)
        } else {
            let (train, _) = synthetic(&SyntheticSpec {
                train: batch,
                test: 0,
                features: spec.input,
                classes: spec.classes,
                ..SyntheticSpec::default()
            });
            Batch::from_samples(&train, spec.input)
        };
        let model = Model::new(&spec, candle_core::Device::Cpu, 1)
            .with_context(|| format!("building {}", net.label()))?;
        let p = model.num_params();
        let compressor = CompressionSection::default()
            .compressor(p, 1)
            .context("the default compression builds a compressor")?;
        Ok(Bench {
            model,
            batch,
            grad: vec![0.0; p],
            compressor,
        })
    }

    /// Milliseconds of one forward + backward and of the compression after it.
    fn step(&mut self, compress: bool) -> anyhow::Result<(f64, f64)> {
        let t0 = Instant::now();
        self.model.gradient_into(&self.batch, &mut self.grad)?;
        let t1 = Instant::now();
        if compress {
            std::hint::black_box(self.compressor.compress(&self.grad)?);
        }
        let t2 = Instant::now();
        Ok((1e3 * (t1 - t0).as_secs_f64(), 1e3 * (t2 - t1).as_secs_f64()))
    }
}

/// CPU nanoseconds all of this process's threads have run so far (the
/// kernel's per-thread schedstat; 0 where it cannot be read).
fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The child's side: a rayon pool of `threads`, commands on stdin.
///
/// * `setup NET BATCH [nocompress]` → `ok PARAMS FIRST_STEP_MS`
/// * `run STEPS` → `ok FWD_BWD_MS STEP_MS CPU_MS` (means over the steps;
///   CPU_MS is the CPU time of all the child's threads per step)
fn serve(threads: usize) -> anyhow::Result<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building the rayon pool")?;
    pool.install(|| {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        writeln!(
            out,
            "ready rayon {} matmul {} elementwise {}",
            rayon::current_num_threads(),
            candle_core::utils::get_num_threads(),
            candle_core::utils::barrier_pool().n_workers() + 1
        )?;
        out.flush()?;
        let mut bench: Option<(Bench, bool)> = None;
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            let words: Vec<&str> = line.split_whitespace().collect();
            let reply = match words.as_slice() {
                ["setup", net, batch, rest @ ..] => {
                    let compress = !rest.contains(&"nocompress");
                    let mut b = Bench::new(Net::from_name(net)?, batch.parse()?)?;
                    let (fb, c) = b.step(compress)?;
                    let p = b.grad.len();
                    bench = Some((b, compress));
                    format!("ok {p} {}", fb + c)
                }
                ["run", steps] => {
                    let (b, compress) = bench.as_mut().context("run before setup")?;
                    let steps: usize = steps.parse()?;
                    let (mut fb, mut all) = (0.0, 0.0);
                    let cpu0 = process_cpu_ns();
                    for _ in 0..steps {
                        let (f, c) = b.step(*compress)?;
                        fb += f;
                        all += f + c;
                    }
                    let n = steps.max(1) as f64;
                    let cpu = 1e-6 * process_cpu_ns().saturating_sub(cpu0) as f64;
                    format!("ok {} {} {}", fb / n, all / n, cpu / n)
                }
                _ => bail!("bench-compute --serve: unknown command `{line}`"),
            };
            writeln!(out, "{reply}")?;
            out.flush()?;
        }
        Ok(())
    })
}

/// A serving process (this binary's child, or the torch script).
struct Server {
    name: &'static str,
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    /// Its first line.
    greeting: String,
}

impl Server {
    fn start(name: &'static str, mut cmd: Command) -> anyhow::Result<Server> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start the {name} side ({cmd:?})"))?;
        let input = child.stdin.take().context("child stdin")?;
        let output = BufReader::new(child.stdout.take().context("child stdout")?);
        let mut s = Server {
            name,
            child,
            input,
            output,
            greeting: String::new(),
        };
        s.greeting = s.read_line()?;
        Ok(s)
    }

    fn read_line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.output.read_line(&mut line)? == 0 {
            bail!("the {} side exited early (see its error above)", self.name);
        }
        Ok(line.trim().to_string())
    }

    /// Sends a command; the numbers of its `ok` reply.
    fn ask(&mut self, command: &str) -> anyhow::Result<Vec<f64>> {
        writeln!(self.input, "{command}")?;
        self.input.flush()?;
        let line = self.read_line()?;
        let Some(rest) = line.strip_prefix("ok") else {
            bail!("the {} side answered `{line}` to `{command}`", self.name);
        };
        rest.split_whitespace()
            .map(|w| {
                w.parse::<f64>()
                    .with_context(|| format!("the {} side answered `{line}`", self.name))
            })
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of the table.
struct Row {
    net: Net,
    batch: usize,
    threads: usize,
    params: usize,
    steps: (usize, usize),
    /// Per round: forward + backward and whole step, candle then torch.
    candle: Vec<(f64, f64)>,
    /// Per round: candle's CPU time per whole step, all threads.
    candle_cpu: Vec<f64>,
    /// The same for torch.
    torch_cpu: Vec<f64>,
    torch: Vec<(f64, f64)>,
}

fn steps_for(args: &Args, first_ms: f64) -> usize {
    args.steps
        .unwrap_or_else(|| {
            (args.round_ms / first_ms.max(1e-3))
                .round()
                .clamp(1.0, 50.0) as usize
        })
        .max(1)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

fn measure(args: &Args, nets: &[Net], threads: usize) -> anyhow::Result<Vec<Row>> {
    // This very binary, even if the file was replaced since it started.
    let exe = match PathBuf::from("/proc/self/exe") {
        p if p.exists() => p,
        _ => std::env::current_exe().context("locating bench-compute")?,
    };
    let mut cmd = Command::new(exe);
    cmd.args(["--serve", &threads.to_string()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", threads.to_string());
    let mut candle = Server::start("candle", cmd)?;
    println!("{threads} thread(s): candle child: {}", candle.greeting);
    let mut torch = match (&args.python, args.only_worker) {
        (Some(python), false) => {
            let script =
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch_compute.py");
            let mut cmd = Command::new(python);
            cmd.arg(&script)
                .args(["--serve", "--threads", &threads.to_string()]);
            let t = Server::start("torch", cmd)?;
            println!("{threads} thread(s): torch child: {}", t.greeting);
            Some(t)
        }
        _ => None,
    };
    let mut rows = vec![];
    for &net in nets {
        for &batch in &args.batch {
            let setup = format!("setup {} {batch}", net.name());
            let c = candle.ask(&setup)?;
            let params = c.first().copied().unwrap_or(0.0) as usize;
            let steps_c = steps_for(args, c.get(1).copied().unwrap_or(1.0));
            let mut steps_t = 0;
            if let Some(t) = torch.as_mut() {
                let reply = t.ask(&setup)?;
                let tp = reply.first().copied().unwrap_or(0.0) as usize;
                if tp != params {
                    bail!(
                        "{}: candle has {params} parameters, torch {tp}: not the same network",
                        net.label()
                    );
                }
                steps_t = steps_for(args, reply.get(1).copied().unwrap_or(1.0));
            }
            let mut row = Row {
                net,
                batch,
                threads,
                params,
                steps: (steps_c, steps_t),
                candle: vec![],
                candle_cpu: vec![],
                torch_cpu: vec![],
                torch: vec![],
            };
            let pair = |v: Vec<f64>| {
                (
                    v.first().copied().unwrap_or(f64::NAN),
                    v.get(1).copied().unwrap_or(f64::NAN),
                )
            };
            for round in 0..args.rounds {
                // Alternate who goes first, so neither side always runs on
                // caches (or a machine) the other has just warmed or loaded.
                let torch_first = round % 2 == 1;
                if torch_first {
                    if let Some(t) = torch.as_mut() {
                        let v = t.ask(&format!("run {steps_t}"))?;
                        row.torch_cpu.push(v.get(2).copied().unwrap_or(f64::NAN));
                        row.torch.push(pair(v));
                    }
                }
                let c = candle.ask(&format!("run {steps_c}"))?;
                row.candle_cpu.push(c.get(2).copied().unwrap_or(f64::NAN));
                row.candle.push(pair(c));
                if !torch_first {
                    if let Some(t) = torch.as_mut() {
                        let v = t.ask(&format!("run {steps_t}"))?;
                        row.torch_cpu.push(v.get(2).copied().unwrap_or(f64::NAN));
                        row.torch.push(pair(v));
                    }
                }
            }
            eprintln!(
                "bench-compute: {} batch {batch}, {threads} thread(s) done",
                net.label()
            );
            print_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// `median [min-max]` of one column.
fn cell(v: &[f64]) -> String {
    let (lo, hi) = min_max(v);
    format!("{:.2} [{:.2}-{:.2}]", median(v), lo, hi)
}

/// Median of the per-round ratios a/b.
fn ratio(a: &[f64], b: &[f64]) -> f64 {
    let r: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| x / y.max(f64::MIN_POSITIVE))
        .collect();
    median(&r)
}

fn print_header() {
    println!();
    println!(
        "{:<22} {:>5} {:>3} | {:>24} {:>24} {:>6} {:>6} {:>4} | {:>24} {:>24} {:>6} | {:>10} {:>9} {:>9}",
        "network",
        "batch",
        "thr",
        "candle fwd+bwd ms",
        "torch fwd+bwd ms",
        "ratio",
        "target",
        "",
        "candle step ms",
        "torch step ms",
        "ratio",
        "candle cpu",
        "torch cpu",
        "cpu ratio"
    );
}

/// Prints one line of the table as soon as it is measured.
fn print_row(r: &Row) {
    let col = |v: &[(f64, f64)], second: bool| -> Vec<f64> {
        v.iter().map(|p| if second { p.1 } else { p.0 }).collect()
    };
    let (cf, cs) = (col(&r.candle, false), col(&r.candle, true));
    let (tf, ts) = (col(&r.torch, false), col(&r.torch, true));
    let (torch_cpu, cpu_ratio) = if r.torch_cpu.is_empty() {
        ("-".to_string(), "-".to_string())
    } else {
        (
            format!("{:.2}", median(&r.torch_cpu)),
            format!("{:.2}x", ratio(&r.candle_cpu, &r.torch_cpu)),
        )
    };
    let (torch_f, torch_s, fwd_ratio, verdict, step_ratio) = if r.torch.is_empty() {
        ("-".into(), "-".into(), "-".into(), "", "-".into())
    } else {
        let fr = ratio(&cf, &tf);
        (
            cell(&tf),
            cell(&ts),
            format!("{fr:.2}x"),
            if fr <= r.net.target() { "PASS" } else { "MISS" },
            format!("{:.2}x", ratio(&cs, &ts)),
        )
    };
    println!(
        "{:<22} {:>5} {:>3} | {:>24} {:>24} {:>6} {:>6} {:>4} | {:>24} {:>24} {:>6} | {:>10.2} {:>9} {:>9}",
        r.net.label(),
        r.batch,
        r.threads,
        cell(&cf),
        torch_f,
        fwd_ratio,
        format!("<={:.1}x", r.net.target()),
        verdict,
        cell(&cs),
        torch_s,
        step_ratio,
        median(&r.candle_cpu),
        torch_cpu,
        cpu_ratio
    );
    let _ = std::io::stdout().flush();
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(threads) = args.serve {
        return serve(threads.max(1));
    }
    if args.rounds == 0 || args.batch.contains(&0) || args.threads.contains(&0) {
        bail!("--rounds, --batch and --threads must be at least 1");
    }
    let nets = if args.model.is_empty() {
        Net::ALL.to_vec()
    } else {
        args.model.clone()
    };
    let c = CompressionSection::default();
    println!(
        "CPU: {} ({} logical CPUs); thread counts {:?}; {} round(s) per row",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.threads,
        args.rounds
    );
    println!(
        "whole step = forward + backward + error-feedback top-k (density {}, {:?}, momentum correction {}, masking {})",
        c.density, c.method, c.momentum_correction, c.momentum_masking
    );
    print_header();
    let mut rows = vec![];
    for &threads in &args.threads {
        rows.extend(measure(&args, &nets, threads)?);
    }
    println!();
    for r in rows
        .iter()
        .filter(|r| r.batch == rows[0].batch && r.threads == rows[0].threads)
    {
        println!(
            "{}: {} parameters (candle = torch where torch ran); steps per round {} candle, {} torch",
            r.net.label(),
            r.params,
            r.steps.0,
            r.steps.1
        );
    }
    println!(
        "cells: median [min-max] ms per step over rounds; ratio: median of the per-round candle/torch ratios; target applies to forward + backward; candle cpu / torch cpu: median CPU ms per whole step, all threads of the process; cpu ratio: median per-round ratio of those (less sensitive to a busy machine than wall times)"
    );
    Ok(())
}

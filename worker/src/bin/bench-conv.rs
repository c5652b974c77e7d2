//! `bench-conv`: the convolution kernels ([`ps_worker::kernels::conv`]) at
//! the ResNet-20 shapes, against torch's `conv2d` and its two gradients in
//! the same run.
//!
//! Per shape it times the forward, the input gradient and the weight
//! gradient (median of `--rounds` rounds, each the mean of `--iters` calls),
//! and with `--python` the same three in torch (`scripts/torch_conv.py`,
//! NCHW, `torch.set_num_threads` set to this process's rayon thread count),
//! rounds of both sides interleaved. The summary weighs each shape by how
//! many times ResNet-20 uses it (the stem's input gradient is not needed
//! in training and is left out) and prints the ratio ours/torch, both
//! against torch's separate gradients and against its single call for
//! both gradients (what its autograd makes). It never fails on a time.
//!
//! ```sh
//! RAYON_NUM_THREADS=1 target/release/bench-conv --batch 32 --python /path/to/python
//! ```

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use rand::{Rng, SeedableRng};

use ps_worker::kernels::conv::{Conv2d, ConvGeom};

#[derive(Parser, Debug)]
#[command(name = "bench-conv", long_about = None)]
struct Args {
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Calls averaged per timing.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Timings per side; the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Python with torch: also time torch on the same shapes.
    #[arg(long)]
    python: Option<PathBuf>,
}

/// One ResNet-20 convolution shape: square `side` input.
struct Shape {
    in_c: usize,
    out_c: usize,
    side: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    /// Layers of ResNet-20 with this shape.
    count: usize,
    /// The input gradient is needed (not for the stem, whose input is data).
    needs_dx: bool,
}

const fn shape(c: usize, o: usize, side: usize, k: usize, s: usize, count: usize) -> Shape {
    Shape {
        in_c: c,
        out_c: o,
        side,
        kernel: k,
        stride: s,
        padding: k / 2,
        count,
        needs_dx: true,
    }
}

const SHAPES: [Shape; 8] = [
    Shape {
        needs_dx: false,
        ..shape(3, 16, 32, 3, 1, 1)
    },
    shape(16, 16, 32, 3, 1, 6),
    shape(16, 32, 32, 3, 2, 1),
    shape(16, 32, 32, 1, 2, 1),
    shape(32, 32, 16, 3, 1, 5),
    shape(32, 64, 16, 3, 2, 1),
    shape(32, 64, 16, 1, 2, 1),
    shape(64, 64, 8, 3, 1, 5),
];

impl Shape {
    fn geom(&self, batch: usize) -> ConvGeom {
        ConvGeom {
            batch,
            in_h: self.side,
            in_w: self.side,
            in_c: self.in_c,
            out_c: self.out_c,
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
        }
    }

    fn label(&self) -> String {
        format!(
            "{}->{} {}px k{} s{}",
            self.in_c, self.out_c, self.side, self.kernel, self.stride
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Mean ms of `iters` calls of `f`, after one warm-up call.
fn mean_ms(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_secs_f64() * 1e3 / iters as f64
}

/// Forward, input gradient, weight gradient (and for torch, both
/// gradients in one call): ms per call.
type Times = [f64; 4];

struct Ours {
    conv: Conv2d,
    x: Vec<f32>,
    w: Vec<f32>,
    y: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<f32>,
}

impl Ours {
    fn new(g: ConvGeom, rng: &mut rand::rngs::StdRng) -> Self {
        let mut random = |n: usize| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Ours {
            conv: Conv2d::new(g),
            x: random(g.input_len()),
            w: random(g.weight_len()),
            y: random(g.output_len()),
            dx: vec![0.0; g.input_len()],
            dw: vec![0.0; g.weight_len()],
        }
    }

    fn time(&mut self, iters: usize) -> anyhow::Result<Times> {
        let Ours {
            conv,
            x,
            w,
            y,
            dx,
            dw,
        } = self;
        let mut failed = None;
        let mut run = |r: Result<(), _>| {
            if let Err(e) = r {
                failed = Some(e);
            }
        };
        let fwd = mean_ms(iters, || run(conv.forward(x, w, y)));
        // y stands in for the output gradient.
        let bwd_data = mean_ms(iters, || run(conv.backward_data(y, w, dx)));
        let bwd_weight = mean_ms(iters, || run(conv.backward_weight(x, y, dw)));
        match failed {
            Some(e) => Err(e.into()),
            None => Ok([fwd, bwd_data, bwd_weight, bwd_data + bwd_weight]),
        }
    }
}

fn torch_times(python: &PathBuf, args: &Args, threads: usize) -> anyhow::Result<Vec<Times>> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch_conv.py");
    let shapes: Vec<String> = SHAPES
        .iter()
        .map(|s| {
            format!(
                "{},{},{},{},{},{}",
                s.in_c, s.out_c, s.side, s.kernel, s.stride, s.padding
            )
        })
        .collect();
    let out = Command::new(python)
        .arg(&script)
        .args(["--batch", &args.batch.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--iters", &args.iters.to_string()])
        .args(["--shapes", &shapes.join(";")])
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "torch_conv.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut times = Vec::new();
    for line in text.lines() {
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|t| t.parse::<f64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("torch_conv.py printed `{line}`"))?;
        match v[..] {
            [a, b, c, d] => times.push([a, b, c, d]),
            _ => bail!("torch_conv.py printed `{line}`, not four times"),
        }
    }
    if times.len() != SHAPES.len() {
        bail!(
            "torch_conv.py printed {} shapes, expected {}",
            times.len(),
            SHAPES.len()
        );
    }
    Ok(times)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.rounds == 0 || args.iters == 0 || args.batch == 0 {
        bail!("--rounds, --iters and --batch must be at least 1");
    }
    let threads = rayon::current_num_threads();
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let mut ours: Vec<Ours> = SHAPES
        .iter()
        .map(|s| Ours::new(s.geom(args.batch), &mut rng))
        .collect();
    // rounds × shapes.
    let mut our_rounds: Vec<Vec<Times>> = Vec::new();
    let mut torch_rounds: Vec<Vec<Times>> = Vec::new();
    for _ in 0..args.rounds {
        our_rounds.push(
            ours.iter_mut()
                .map(|o| o.time(args.iters))
                .collect::<anyhow::Result<_>>()?,
        );
        if let Some(python) = &args.python {
            torch_rounds.push(torch_times(python, &args, threads)?);
        }
    }
    let med = |rounds: &[Vec<Times>], shape: usize, pass: usize| {
        median(rounds.iter().map(|r| r[shape][pass]).collect())
    };
    println!(
        "bench-conv: batch {}, {} thread(s), median of {} rounds x {} calls (ms per call)",
        args.batch, threads, args.rounds, args.iters
    );
    println!(
        "{:<22} {:>3}  {:>8} {:>8} {:>6}  {:>8} {:>8} {:>6}  {:>8} {:>8} {:>6}",
        "shape", "n", "fwd", "torch", "ratio", "dx", "torch", "ratio", "dw", "torch", "ratio"
    );
    let (mut our_sum, mut torch_sum) = ([0.0; 3], [0.0; 3]);
    for (i, s) in SHAPES.iter().enumerate() {
        let mut line = format!("{:<22} {:>3}", s.label(), s.count);
        for pass in 0..3 {
            let a = med(&our_rounds, i, pass);
            let weight = if pass == 1 && !s.needs_dx {
                0.0
            } else {
                s.count as f64
            };
            our_sum[pass] += weight * a;
            if torch_rounds.is_empty() {
                line += &format!("  {a:>8.3} {:>8} {:>6}", "-", "-");
            } else {
                let b = med(&torch_rounds, i, pass);
                torch_sum[pass] += weight * b;
                line += &format!("  {a:>8.3} {b:>8.3} {:>5.2}x", a / b);
            }
        }
        println!("{line}");
    }
    let ours_total: f64 = our_sum.iter().sum();
    println!(
        "ResNet-20 conv sum (fwd {:.2} + dx {:.2} + dw {:.2}): {:.2} ms",
        our_sum[0], our_sum[1], our_sum[2], ours_total
    );
    if !torch_rounds.is_empty() {
        let torch_total: f64 = torch_sum.iter().sum();
        // Torch's autograd asks for both gradients in one call (only the
        // weight's for the stem).
        let autograd: f64 = SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let bwd = if s.needs_dx { 3 } else { 2 };
                s.count as f64 * (med(&torch_rounds, i, 0) + med(&torch_rounds, i, bwd))
            })
            .sum();
        println!(
            "torch conv sum    (fwd {:.2} + dx {:.2} + dw {:.2}): {:.2} ms; ratio {:.2}x (fwd {:.2}x, dx {:.2}x, dw {:.2}x)",
            torch_sum[0],
            torch_sum[1],
            torch_sum[2],
            torch_total,
            ours_total / torch_total,
            our_sum[0] / torch_sum[0],
            our_sum[1] / torch_sum[1],
            our_sum[2] / torch_sum[2],
        );
        println!(
            "torch conv sum, both gradients per call: {autograd:.2} ms; ratio {:.2}x",
            ours_total / autograd
        );
    }
    Ok(())
}

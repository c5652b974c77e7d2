//! Benchmark of the hot kernels against memory-bandwidth baselines.
//!
//! Times, on one random Gaussian gradient: a plain read pass (parallel and
//! single-thread), approximate, exact and full-sort top-k, and the fused optimizer
//! update (SGD + momentum + weight decay, Nesterov, LARS) against the unfused
//! reference and a read pass over params + grads + momentum, and the shard's
//! push guard (the norm of a dense push and the median of the recent norms)
//! against the fused update, per entry. Prints a table and
//! the ratios measured in this run with their targets (PASS/MISS); timings are
//! reported, never asserted.
//!
//! ```text
//! cargo run --release -p ps-server --bin bench-kernels -- --elements 25000000 --density 0.001
//! ```

use std::hint::black_box;
use std::ops::Range;
use std::time::{Duration, Instant};

use clap::Parser;
use ps_net::protocol::WireValues;
use ps_server::core::{push_norm, NormWindow, NORM_WINDOW};
use ps_server::optimizer::{fused_update, reference_update};
use ps_shared::config::OptimizerSection;
use ps_shared::hash::splitmix64_next;
use ps_shared::sparse::{k_for_density, topk_approx, topk_by_full_sort, topk_exact};
use rayon::prelude::*;

const CHUNK: usize = 1 << 16;
/// Rounds that also time the (slow) full-sort reference.
const SORT_ROUNDS: usize = 3;

/// Timed runs per round of the fast kernels (the slow references run once).
const FAST_ATTEMPTS: usize = 3;

#[derive(Debug, Parser)]
#[command(about = "Benchmark top-k and fused-update kernels against read passes")]
struct Args {
    /// Number of f32 elements in the gradient and parameter arrays.
    #[arg(long, default_value_t = 25_000_000)]
    elements: usize,
    /// Top-k density (k = density * elements).
    #[arg(long, default_value_t = 0.001)]
    density: f64,
    /// Rounds; each times every kernel (fast ones three times), interleaved.
    /// Minimum and median are reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

/// Timings of one kernel, one per round.
struct Samples {
    name: &'static str,
    durations: Vec<Duration>,
}

impl Samples {
    fn new(name: &'static str) -> Self {
        Samples {
            name,
            durations: Vec::new(),
        }
    }

    fn sorted(&self) -> Vec<Duration> {
        let mut sorted = self.durations.clone();
        sorted.sort_unstable();
        sorted
    }

    fn min(&self) -> Duration {
        self.sorted().first().copied().unwrap_or_default()
    }

    fn median(&self) -> Duration {
        let sorted = self.sorted();
        sorted.get(sorted.len() / 2).copied().unwrap_or_default()
    }
}

/// Runs `kernel` once, records its time and returns its result.
fn timed<R>(samples: &mut Samples, kernel: impl FnOnce() -> R) -> R {
    let start = Instant::now();
    let result = black_box(kernel());
    samples.durations.push(start.elapsed());
    result
}

/// Standard normal values (Box-Muller), generated in parallel chunks.
fn gaussian(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; len];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(chunk_index, chunk)| {
            let mut state = seed ^ (chunk_index as u64).wrapping_mul(0xa076_1d64_78bd_642f);
            for pair in chunk.chunks_mut(2) {
                let u1 = ((splitmix64_next(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix64_next(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                let radius = (-2.0 * u1.ln()).sqrt();
                let angle = std::f64::consts::TAU * u2;
                pair[0] = (radius * angle.cos()) as f32 * scale;
                if let Some(second) = pair.get_mut(1) {
                    *second = (radius * angle.sin()) as f32 * scale;
                }
            }
        });
    out
}

/// Wrapping sum of the bit patterns: touches every element, vectorises, and is
/// bound by memory bandwidth rather than by floating-point latency.
fn sum_bits(values: &[f32]) -> u32 {
    values
        .iter()
        .fold(0u32, |acc, v| acc.wrapping_add(v.to_bits()))
}

fn read_parallel(values: &[f32]) -> u32 {
    values
        .par_chunks(CHUNK)
        .map(sum_bits)
        .reduce(|| 0, u32::wrapping_add)
}

fn read_three_parallel(a: &[f32], b: &[f32], c: &[f32]) -> u32 {
    a.par_chunks(CHUNK)
        .zip(b.par_chunks(CHUNK))
        .zip(c.par_chunks(CHUNK))
        .map(|((a, b), c)| {
            sum_bits(a)
                .wrapping_add(sum_bits(b))
                .wrapping_add(sum_bits(c))
        })
        .reduce(|| 0, u32::wrapping_add)
}

/// Tensor-like segment boundaries: a repeating pattern of weight and bias sizes.
fn tensor_segments(len: usize) -> Vec<Range<usize>> {
    let pattern = [1 << 20, 512, 3 << 18, 256, 1 << 16, 64];
    let mut segments = Vec::new();
    let mut start = 0;
    for size in pattern.iter().cycle() {
        if start >= len {
            break;
        }
        let end = (start + size).min(len);
        segments.push(start..end);
        start = end;
    }
    segments
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn ratio(numerator: Duration, denominator: Duration) -> f64 {
    numerator.as_secs_f64() / denominator.as_secs_f64().max(1e-12)
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.elements > 0, "--elements must be positive");
    anyhow::ensure!(
        args.elements <= u32::MAX as usize,
        "--elements must fit u32 indices"
    );
    anyhow::ensure!(
        args.density > 0.0 && args.density <= 1.0,
        "--density must be in (0, 1]"
    );
    let len = args.elements;
    let k = k_for_density(len, args.density);
    let repeats = args.repeats.max(1);
    println!(
        "bench-kernels: {len} elements ({:.1} MB per array), density {}, k {k}, {repeats} repeats, {} threads",
        len as f64 * 4.0 / 1e6,
        args.density,
        rayon::current_num_threads()
    );

    let grad = gaussian(len, 1, 1.0);
    let mut params = gaussian(len, 2, 0.05);
    let mut momentum = vec![0.0f32; len];
    let segments = tensor_segments(len);
    // Warm the pages and caches once.
    black_box(read_three_parallel(&grad, &params, &momentum));

    let sgd = OptimizerSection {
        lr: 1e-4,
        momentum: 0.9,
        nesterov: false,
        weight_decay: 1e-4,
        ..OptimizerSection::default()
    };
    let nesterov = OptimizerSection {
        nesterov: true,
        ..sgd.clone()
    };
    let lars = OptimizerSection {
        lars_eta: 0.001,
        ..sgd.clone()
    };
    let full_range = 0..len;
    let whole = std::slice::from_ref(&full_range);

    let mut read = Samples::new("read pass (parallel)");
    let mut read_single = Samples::new("read pass (1 thread)");
    let mut approx = Samples::new("top-k approx");
    let mut exact = Samples::new("top-k exact");
    let mut sort = Samples::new("top-k full sort");
    let mut read3 = Samples::new("read params+grad+momentum");
    let mut fused = Samples::new("fused SGD+momentum+WD");
    let mut fused_nesterov = Samples::new("fused Nesterov+WD");
    let mut fused_lars = Samples::new("fused LARS+momentum+WD");
    let mut unfused = Samples::new("unfused reference SGD+mom+WD");
    let mut unfused_lars = Samples::new("unfused reference LARS");
    let mut guard = Samples::new("push guard (norm + median)");
    // The shard's push guard: the norm of one dense push and the median of
    // a full window of recent norms.
    let wire = WireValues::F32(grad.clone());
    let mut window = NormWindow::default();
    for i in 0..NORM_WINDOW {
        window.push(1.0 + i as f64);
    }

    // Kernels are interleaved round by round, so that load from other processes
    // affects the kernels and their baselines alike.
    let mut approx_counts = Vec::with_capacity(repeats);
    for round in 0..repeats {
        for attempt in 0..FAST_ATTEMPTS {
            let seed = (round * FAST_ATTEMPTS + attempt) as u64;
            timed(&mut read, || read_parallel(&grad));
            timed(&mut read_single, || sum_bits(&grad));
            let selected = timed(&mut approx, || topk_approx(&grad, k, seed));
            approx_counts.push(selected.len());
            timed(&mut exact, || topk_exact(&grad, k));
            timed(&mut read3, || {
                read_three_parallel(&params, &grad, &momentum)
            });
            timed(&mut guard, || (push_norm(&wire), window.median(1)));
            let fused_updates = [
                (&mut fused, &sgd, whole),
                (&mut fused_nesterov, &nesterov, whole),
                (&mut fused_lars, &lars, &segments[..]),
            ];
            for (samples, rule, segments) in fused_updates {
                timed(samples, || {
                    fused_update(&mut params, &grad, &mut momentum, segments, rule, 1.0)
                })?;
            }
        }
        if round < SORT_ROUNDS {
            timed(&mut sort, || topk_by_full_sort(&grad, k));
        }
        for (samples, rule, segments) in [
            (&mut unfused, &sgd, whole),
            (&mut unfused_lars, &lars, &segments[..]),
        ] {
            timed(samples, || {
                reference_update(&mut params, &grad, &mut momentum, segments, rule, 1.0)
            })?;
        }
    }
    let approx_count = approx_counts
        .iter()
        .copied()
        .max_by_key(|count| count.abs_diff(k))
        .unwrap_or(0);
    let timings = [
        &read,
        &read_single,
        &approx,
        &exact,
        &sort,
        &read3,
        &fused,
        &fused_nesterov,
        &fused_lars,
        &unfused,
        &unfused_lars,
        &guard,
    ];

    println!();
    println!("{:<32} {:>10} {:>10}", "kernel", "min ms", "median ms");
    for timing in &timings {
        println!(
            "{:<32} {:>10.2} {:>10.2}",
            timing.name,
            ms(timing.min()),
            ms(timing.median())
        );
    }
    let bytes = len as f64 * 4.0;
    println!(
        "read bandwidth: {:.1} GB/s parallel, {:.1} GB/s single thread, {:.1} GB/s over three arrays",
        bytes / read.min().as_secs_f64() / 1e9,
        bytes / read_single.min().as_secs_f64() / 1e9,
        3.0 * bytes / read3.min().as_secs_f64() / 1e9
    );

    println!();
    println!("ratios (min times, this run):");
    let approx_ratio = ratio(approx.min(), read.min());
    let exact_ratio = ratio(exact.min(), read.min());
    let fused_ratio = ratio(fused.min(), read3.min());
    let count_error = approx_count.abs_diff(k) as f64 / k as f64;
    println!(
        "  approx / read          {:>7.2}  target <= 2.0   {}",
        approx_ratio,
        verdict(approx_ratio <= 2.0)
    );
    println!(
        "  exact / read           {:>7.2}  target <= 6     {}",
        exact_ratio,
        verdict(exact_ratio <= 6.0)
    );
    println!(
        "  fused / read3          {:>7.2}  target <= 1.5   {}",
        fused_ratio,
        verdict(fused_ratio <= 1.5)
    );
    println!(
        "  approx count vs k      {approx_count} vs {k} (worst round) ({:+.2}%)  target within 10%   {}",
        (approx_count as f64 - k as f64) / k as f64 * 100.0,
        verdict(count_error <= 0.10)
    );
    println!(
        "  exact vs sort speedup  {:>7.1}x",
        ratio(sort.min(), exact.min())
    );
    println!(
        "  fused vs unfused       {:>7.1}x (LARS {:.1}x)",
        ratio(unfused.min(), fused.min()),
        ratio(unfused_lars.min(), fused_lars.min())
    );
    println!(
        "  guard / fused          {:>7.3}  ({:.3} ns per entry for the guard, {:.3} for the fused update; one dense push per update)",
        ratio(guard.min(), fused.min()),
        guard.min().as_secs_f64() * 1e9 / len as f64,
        fused.min().as_secs_f64() * 1e9 / len as f64
    );
    println!(
        "  nesterov / read3       {:>7.2}, LARS / read3 {:.2}, single-thread read / parallel read {:.2}",
        ratio(fused_nesterov.min(), read3.min()),
        ratio(fused_lars.min(), read3.min()),
        ratio(read_single.min(), read.min())
    );
    Ok(())
}

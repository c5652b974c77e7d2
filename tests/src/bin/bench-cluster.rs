//! `bench-cluster`: per-step time of dense vs top-k parameter-server training
//! over a simulated worker-server link, measured in one run.
//!
//! Three in-process clusters (1 server process, 2 shards, 2 workers) train the
//! same MLP of over a million parameters on the same synthetic set behind the
//! same simulated link (a `Simulation`'s `[link]`, 100 Mbit/s each way by
//! default):
//!
//! * dense: `compression.kind = none`, server momentum 0.9 (dense pulls);
//! * top-k 1% and top-k 0.1%: server momentum 0, DGC momentum correction 0.9
//!   on the workers, error feedback (sparse pushes and sparse pulls).
//!
//! For each it reports the mean step time split into data wait, compute
//! (forward, backward, compression, applying the pulled parameters) and
//! communication (push, barrier, pull), the bytes pushed and pulled per step,
//! the floor the link alone puts on a step, and the share of the step spent
//! waiting on communication. The first epoch is warm-up and is left out when
//! there is more than one. It prints the targets (top-k 0.1% at least 5x faster
//! per step than dense; communication under 20% of a top-k 0.1% step) as
//! PASS/MISS and never fails on a time: the exit status only says whether
//! every run completed.
//!
//! ```sh
//! cargo run --release -p ps-tests --bin bench-cluster -- --help
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use serde::Serialize;

use ps_dataset::{synthetic, Batch, SyntheticSpec};
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_shared::link::LinkSection;
use ps_shared::sparse::{k_for_density, Compressor};
use ps_tests::{fit_frames_to_model, run_cluster_detailed, synthetic_bucket, test_config};
use ps_worker::model::{device_from_str, Model};
use ps_worker::run::WorkerReport;
use ps_worker::simulate::Simulation;

/// Speed-up of top-k 0.1% over dense that the benchmark aims for.
const TARGET_SPEEDUP: f64 = 5.0;
/// Largest share of a top-k 0.1% step that may be spent on communication.
const TARGET_COMM_SHARE: f64 = 0.20;

/// Dense vs top-k parameter-server training over a simulated link.
#[derive(Parser, Debug)]
#[command(name = "bench-cluster", long_about = None)]
struct Args {
    /// Simulated worker-server bandwidth in Mbit/s, each direction (0 = unlimited).
    #[arg(long, default_value_t = 100.0)]
    bandwidth_mbit: f64,
    /// Simulated one-way latency per message in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    latency_ms: f64,
    /// Input features of the synthetic set (and the model).
    #[arg(long, default_value_t = 256)]
    features: usize,
    /// Hidden layer widths, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 1024])]
    hidden: Vec<usize>,
    /// Samples per step per worker.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Steps per epoch per worker.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Epochs per run; the first is warm-up and left out when there are more.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Shards (actors) of the one server process.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the single-worker compute profile printed after the table.
    #[arg(long)]
    no_profile: bool,
}

/// One configuration to run.
struct Case {
    name: &'static str,
    kind: CompressionKind,
    density: f64,
    /// `ssp` (staleness 1) instead of `bsp`, and whether the worker
    /// computes the next gradient while the exchange is in flight.
    ssp_overlap: Option<bool>,
}

const CASES: [Case; 5] = [
    Case {
        name: "dense",
        kind: CompressionKind::None,
        density: 1.0,
        ssp_overlap: None,
    },
    Case {
        name: "top-k 1%",
        kind: CompressionKind::Topk,
        density: 0.01,
        ssp_overlap: None,
    },
    Case {
        name: "top-k 0.1%",
        kind: CompressionKind::Topk,
        density: 0.001,
        ssp_overlap: None,
    },
    Case {
        name: "0.1% ssp",
        kind: CompressionKind::Topk,
        density: 0.001,
        ssp_overlap: Some(false),
    },
    Case {
        name: "0.1% ssp+ov",
        kind: CompressionKind::Topk,
        density: 0.001,
        ssp_overlap: Some(true),
    },
];

/// Uncontended single-thread cost of the worker's compute pieces, in ms.
#[derive(Debug, Clone, Serialize)]
struct Profile {
    forward_backward_ms: f64,
    /// (density, ms) of one `Compressor::compress` call.
    compress_ms: Vec<(f64, f64)>,
    apply_dense_ms: f64,
    apply_sparse_ms: f64,
}

/// What one run measured, averaged over the workers and the measured epochs.
#[derive(Debug, Clone, Serialize)]
struct RunResult {
    name: String,
    density: f64,
    server_momentum: f32,
    steps: u64,
    step_ms: f64,
    data_wait_ms: f64,
    compute_ms: f64,
    comm_ms: f64,
    comm_share: f64,
    pushed_bytes_per_step: f64,
    pulled_bytes_per_step: f64,
    /// Time the link alone needs per step when the pull follows the push:
    /// pushed plus pulled bytes at the link rate.
    link_floor_ms: f64,
    test_accuracy: f32,
    wall_s: f64,
    /// Request/reply round trips per worker per step per shard.
    round_trips_per_step_per_shard: f64,
    /// Server CPU time per applied update: the shard threads (aggregation,
    /// replies, sparse updates) plus the dense updates' work on the rayon
    /// pool threads.
    server_cpu_ms_per_update: f64,
    /// The rayon pool's part of `server_cpu_ms_per_update`.
    server_pool_cpu_ms_per_update: f64,
    /// Share of updates that touched only the pushed entries.
    sparse_update_share: f64,
}

#[derive(Debug, Serialize)]
struct BenchOutput {
    num_params: usize,
    workers: usize,
    shards: usize,
    bandwidth_mbit: f64,
    latency_ms: f64,
    batch: usize,
    measured_epochs: u64,
    runs: Vec<RunResult>,
    speedup_topk_0_1_vs_dense: f64,
    speedup_pass: bool,
    comm_share_topk_0_1: f64,
    comm_share_pass: bool,
    profile: Option<Profile>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench-cluster: error: {e:#}");
        std::process::exit(1);
    }
}

fn base_config(args: &Args, case: &Case) -> anyhow::Result<ClusterConfig> {
    let mut cfg = test_config(case.kind, case.density, args.epochs);
    cfg.cluster.shards_per_server = args.shards;
    cfg.model.input = args.features;
    cfg.model.hidden = args.hidden.clone();
    cfg.data.batch_size = args.batch;
    match case.kind {
        CompressionKind::None => cfg.optimizer.momentum = 0.9,
        CompressionKind::Topk => {
            cfg.optimizer.momentum = 0.0;
            cfg.compression.momentum_correction = 0.9;
            cfg.compression.error_feedback = true;
        }
    }
    if let Some(overlap) = case.ssp_overlap {
        cfg.server.mode = ps_shared::config::SyncMode::Ssp;
        cfg.server.staleness = 1;
        cfg.training.overlap = overlap;
    }
    fit_frames_to_model(&mut cfg);
    cfg.validate().context("benchmark configuration")?;
    Ok(cfg)
}

fn measure(
    args: &Args,
    case: &Case,
    reports: &[WorkerReport],
    shards: &[ps_server::actor::ShardStatus],
    wall_s: f64,
) -> anyhow::Result<RunResult> {
    let skip = usize::from(args.epochs > 1);
    let mut steps = 0u64;
    let (mut wait, mut compute, mut comm) = (0.0, 0.0, 0.0);
    let (mut pushed, mut pulled) = (0u64, 0u64);
    for r in reports {
        for e in r.epochs.iter().skip(skip) {
            steps += e.steps;
            wait += e.data_wait_s;
            compute += e.compute_s;
            comm += e.comm_s;
            pushed += e.bytes_pushed;
            pulled += e.bytes_pulled;
        }
    }
    if steps == 0 {
        bail!("{}: no measured steps", case.name);
    }
    let n = steps as f64;
    let step_s = (wait + compute + comm) / n;
    let pushed_per_step = pushed as f64 / n;
    let pulled_per_step = pulled as f64 / n;
    let link_floor_s = if args.bandwidth_mbit > 0.0 {
        (pushed_per_step + pulled_per_step) / (args.bandwidth_mbit * 1e6 / 8.0)
    } else {
        0.0
    };
    let accuracy = reports.iter().map(|r| r.final_accuracy).sum::<f32>() / reports.len() as f32;
    Ok(RunResult {
        name: case.name.to_string(),
        density: case.density,
        server_momentum: if case.kind == CompressionKind::None {
            0.9
        } else {
            0.0
        },
        steps: steps / reports.len() as u64,
        step_ms: 1e3 * step_s,
        data_wait_ms: 1e3 * wait / n,
        compute_ms: 1e3 * compute / n,
        comm_ms: 1e3 * comm / n,
        comm_share: if step_s > 0.0 { comm / n / step_s } else { 0.0 },
        pushed_bytes_per_step: pushed_per_step,
        pulled_bytes_per_step: pulled_per_step,
        link_floor_ms: 1e3 * link_floor_s,
        test_accuracy: accuracy,
        wall_s,
        round_trips_per_step_per_shard: reports.iter().map(|r| r.round_trips_per_step).sum::<f64>()
            / reports.len() as f64
            / args.shards as f64,
        server_cpu_ms_per_update: {
            let updates: u64 = shards.iter().map(|s| s.stats.updates).sum();
            let cpu: f64 = shards.iter().map(|s| s.cpu.as_secs_f64()).sum();
            1e3 * cpu / updates.max(1) as f64
        },
        server_pool_cpu_ms_per_update: {
            let updates: u64 = shards.iter().map(|s| s.stats.updates).sum();
            let pool: f64 = shards
                .iter()
                .map(|s| s.stats.update_pool_cpu.as_secs_f64())
                .sum();
            1e3 * pool / updates.max(1) as f64
        },
        sparse_update_share: {
            let updates: u64 = shards.iter().map(|s| s.stats.updates).sum();
            let sparse: u64 = shards.iter().map(|s| s.stats.sparse_updates).sum();
            sparse as f64 / updates.max(1) as f64
        },
    })
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.batch == 0 || args.epochs == 0 || args.shards == 0 {
        bail!("--steps, --batch, --epochs and --shards must be >= 1");
    }
    let workers = 2usize;
    let spec = SyntheticSpec {
        train: workers * args.batch * args.steps,
        test: 512,
        features: args.features,
        ..SyntheticSpec::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .context("tokio runtime")?;
    let (store, prefix) = rt.block_on(synthetic_bucket(&spec));
    let probe = base_config(&args, &CASES[0])?;
    let num_params = probe.model.num_params();
    let mut dims = vec![args.features.to_string()];
    dims.extend(args.hidden.iter().map(usize::to_string));
    dims.push(probe.model.classes.to_string());
    let link = if args.bandwidth_mbit > 0.0 {
        format!("{} Mbit/s each way", args.bandwidth_mbit)
    } else {
        "unlimited".to_string()
    };
    println!(
        "bench-cluster: {workers} workers, 1 server process x {} shards, MLP {} ({num_params} parameters), batch {}, link {link}, latency {} ms",
        args.shards,
        dims.join("-"),
        args.batch,
        args.latency_ms
    );
    let measured = if args.epochs > 1 {
        format!(
            "epochs 2..{} of {} (epoch 1 is warm-up), {} steps per epoch per worker",
            args.epochs, args.epochs, args.steps
        )
    } else {
        format!("1 epoch of {} steps per worker", args.steps)
    };
    println!("measured: {measured}");

    // The simulated link every worker's requests go through.
    let sim = Simulation {
        link: LinkSection {
            bandwidth_mbit: args.bandwidth_mbit,
            latency_ms: args.latency_ms,
        },
        ..Simulation::default()
    };
    sim.validate()
        .map_err(anyhow::Error::msg)
        .context("--bandwidth-mbit / --latency-ms")?;
    let mut results = Vec::new();
    for case in &CASES {
        let cfg = base_config(&args, case)?;
        let started = Instant::now();
        let (reports, shards) = run_cluster_detailed(cfg, &sim, store.clone(), prefix.clone())
            .with_context(|| format!("{} run", case.name))?;
        let wall = started.elapsed().as_secs_f64();
        let r = measure(&args, case, &reports, &shards, wall)?;
        println!(
            "  {:<11} done in {:.1} s: {:.1} ms/step, test accuracy {:.1}%",
            r.name,
            r.wall_s,
            r.step_ms,
            100.0 * r.test_accuracy
        );
        results.push(r);
    }

    println!();
    println!(
        "{:<11} {:>9} {:>10} {:>8} {:>9} {:>7} {:>13} {:>13} {:>12} {:>9}",
        "run",
        "step ms",
        "compute ms",
        "data ms",
        "comm ms",
        "comm %",
        "pushed KB/st",
        "pulled KB/st",
        "link ms",
        "accuracy"
    );
    for r in &results {
        println!(
            "{:<11} {:>9.2} {:>10.2} {:>8.2} {:>9.2} {:>6.1}% {:>13.1} {:>13.1} {:>12.2} {:>8.1}%",
            r.name,
            r.step_ms,
            r.compute_ms,
            r.data_wait_ms,
            r.comm_ms,
            100.0 * r.comm_share,
            r.pushed_bytes_per_step / 1e3,
            r.pulled_bytes_per_step / 1e3,
            r.link_floor_ms,
            100.0 * r.test_accuracy
        );
    }
    println!();
    println!(
        "{:<11} {:>22} {:>24} {:>18} {:>14}",
        "run",
        "round trips/step/shard",
        "server CPU ms/update",
        "of it rayon pool",
        "sparse updates"
    );
    for r in &results {
        println!(
            "{:<11} {:>22.3} {:>24.3} {:>18.3} {:>13.0}%",
            r.name,
            r.round_trips_per_step_per_shard,
            r.server_cpu_ms_per_update,
            r.server_pool_cpu_ms_per_update,
            100.0 * r.sparse_update_share
        );
    }
    let dense = &results[0];
    let sparse = &results[2];
    let speedup = dense.step_ms / sparse.step_ms.max(1e-9);
    let speedup_pass = speedup >= TARGET_SPEEDUP;
    let share_pass = sparse.comm_share < TARGET_COMM_SHARE;
    let verdict = |pass: bool| if pass { "PASS" } else { "MISS" };
    println!();
    println!(
        "target: top-k 0.1% step >= {TARGET_SPEEDUP:.0}x faster than dense: {speedup:.1}x  {}",
        verdict(speedup_pass)
    );
    println!(
        "target: top-k 0.1% communication < {:.0}% of step time: {:.1}%  {}",
        100.0 * TARGET_COMM_SHARE,
        100.0 * sparse.comm_share,
        verdict(share_pass)
    );
    let (plain, overlapped) = (&results[3], &results[4]);
    println!(
        "overlap (ssp, staleness 1): top-k 0.1% step {:.2} ms without, {:.2} ms with: {:.0}% less",
        plain.step_ms,
        overlapped.step_ms,
        100.0 * (1.0 - overlapped.step_ms / plain.step_ms.max(1e-9))
    );

    let profile = if args.no_profile {
        None
    } else {
        let p = profile(&args, &probe)?;
        println!();
        println!(
            "where a step's compute goes (one worker alone, uncontended, mean of {PROFILE_REPS}):"
        );
        println!(
            "  forward+backward {:.2} ms | apply dense pull {:.2} ms | apply sparse pull {:.2} ms",
            p.forward_backward_ms, p.apply_dense_ms, p.apply_sparse_ms
        );
        for (density, ms) in &p.compress_ms {
            println!(
                "  top-k {}% compression (error feedback, momentum correction) {ms:.2} ms",
                100.0 * density
            );
        }
        println!("  (in the cluster runs both workers and the server share this machine's cores)");
        Some(p)
    };

    if let Some(path) = &args.json {
        let out = BenchOutput {
            num_params,
            workers,
            shards: args.shards,
            bandwidth_mbit: args.bandwidth_mbit,
            latency_ms: args.latency_ms,
            batch: args.batch,
            measured_epochs: args.epochs - u64::from(args.epochs > 1),
            speedup_topk_0_1_vs_dense: speedup,
            speedup_pass,
            comm_share_topk_0_1: sparse.comm_share,
            comm_share_pass: share_pass,
            runs: results,
            profile,
        };
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}

/// Repetitions of each profiled piece (after one warm-up call).
const PROFILE_REPS: u32 = 5;

/// Time the pieces of a worker's compute one at a time, on this thread.
fn profile(args: &Args, cfg: &ClusterConfig) -> anyhow::Result<Profile> {
    let spec = SyntheticSpec {
        train: args.batch,
        test: 0,
        features: args.features,
        ..SyntheticSpec::default()
    };
    let (train, _) = synthetic(&spec);
    let batch = Batch::from_samples(&train, args.features);
    let device = device_from_str(&cfg.training.device)?;
    let mut model = Model::new(&cfg.model, device, cfg.training.init_seed)?;
    let p = model.num_params();
    let mean_ms = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        f()?;
        let t = Instant::now();
        for _ in 0..PROFILE_REPS {
            f()?;
        }
        Ok(1e3 * t.elapsed().as_secs_f64() / f64::from(PROFILE_REPS))
    };
    let mut grad = vec![0.0f32; p];
    let forward_backward_ms = mean_ms(&mut || {
        model.gradient_into(&batch, &mut grad)?;
        Ok(())
    })?;
    let mut compress_ms = Vec::new();
    for case in CASES
        .iter()
        .filter(|c| c.kind == CompressionKind::Topk && c.ssp_overlap.is_none())
    {
        let mut c = base_config(args, case)?.compression;
        c.density = case.density;
        let mut compressor = Compressor::new(p, c);
        let ms = mean_ms(&mut || {
            compressor.compress(&grad)?;
            Ok(())
        })?;
        compress_ms.push((case.density, ms));
    }
    let params = model.flat_params()?;
    let apply_dense_ms = mean_ms(&mut || {
        model.write_range(0, &params)?;
        Ok(())
    })?;
    // A sparse pull of the smallest density: the union of two workers' top-k.
    let k = 2 * k_for_density(p, CASES[2].density);
    let stride = (p / k.max(1)).max(1);
    let indices: Vec<u32> = (0..k).map(|i| ((i * stride) % p) as u32).collect();
    let values: Vec<f32> = indices.iter().map(|&i| params[i as usize]).collect();
    let apply_sparse_ms = mean_ms(&mut || {
        model.write_sparse(0, &indices, &values)?;
        Ok(())
    })?;
    Ok(Profile {
        forward_backward_ms,
        compress_ms,
        apply_dense_ms,
        apply_sparse_ms,
    })
}

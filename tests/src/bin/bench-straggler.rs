//! `bench-straggler`: backup workers against one slow worker, measured in
//! one run.
//!
//! Four in-process clusters of 3 workers (1 server process, 1 shard) train
//! the same model on the same synthetic set. Every worker's step computes for
//! `--delay-ms` per full batch more than measured, in proportion to the
//! step's samples (a `Simulation`'s `[compute] sample_ms`), standing for a
//! model whose compute dominates the step:
//!
//! * `fast`: no slow worker, `server.backup_workers = 0` (the reference);
//! * `slow, backup 0`: rank 2 computes `--slowdown` times as long (3x by
//!   default), and every step waits for it;
//! * `slow, backup 1`: the same straggler, with one backup worker: a step is
//!   applied after 2 of the 3 pushes and a late push joins the next update;
//!   the batches of the steps made without the straggler are trained in
//!   make-up steps after the last regular one;
//! * `slow, balanced`: the same straggler with `data.balance = "throughput"`
//!   (backup 0): the global batch is re-split every `--balance-every` steps
//!   in proportion to the workers' measured throughput, so the straggler
//!   takes a smaller batch and every sample is still trained once.
//!
//! For each it prints the mean BSP step time of the fast ranks (0 and 1:
//! training wall time over the cluster steps they made, make-up steps
//! included), its ratio to the `fast` run's, the ratio of the whole
//! training time, the final test accuracy, the late pushes the server
//! folded, the make-up steps, the batches (and samples) the straggler
//! trained, and how many stream positions of the run were trained exactly
//! once (from every batch the workers report, so a skipped or repeated
//! sample shows). The targets (a step
//! at most 1.2x the fast run's, and an accuracy within 0.5 point of it) are
//! printed as PASS/MISS for backup 1 and for the balanced run; the exit
//! status only says whether every run completed.
//!
//! ```sh
//! cargo run --release -p ps-tests --bin bench-straggler -- --help
//! ```

use anyhow::{bail, Context};
use clap::Parser;

use ps_dataset::SyntheticSpec;
use ps_shared::config::{Balance, ClusterConfig, CompressionKind};
use ps_tests::{run_cluster_traced, synthetic_bucket, test_config};
use ps_worker::run::WorkerReport;
use ps_worker::simulate::{SimComputeSection, Simulation};

/// Largest ratio of the backup-1 (and balanced) step time to the fast run's.
const TARGET_STEP_RATIO: f64 = 1.2;
/// Largest accuracy gap to the fast run, in percentage points.
const TARGET_ACCURACY_POINTS: f64 = 0.5;

/// Backup workers against one slow worker of three.
#[derive(Parser, Debug)]
#[command(name = "bench-straggler", long_about = None)]
struct Args {
    /// Compute time added to every worker's step of a full batch, in
    /// milliseconds (in proportion to the step's samples).
    #[arg(long, default_value_t = 30.0)]
    delay_ms: f64,
    /// `data.balance_every` of the balanced run.
    #[arg(long, default_value_t = 10)]
    balance_every: u64,
    /// How many times slower rank 2 computes.
    #[arg(long, default_value_t = 3.0)]
    slowdown: f64,
    /// Epochs of each run.
    #[arg(long, default_value_t = 4)]
    epochs: u64,
    /// Training samples of the synthetic set.
    #[arg(long, default_value_t = 12288)]
    train: usize,
    /// Test samples of the synthetic set.
    #[arg(long, default_value_t = 8192)]
    test: usize,
}

struct Run {
    name: &'static str,
    step_s: f64,
    train_s: f64,
    makeup_steps: u64,
    /// Stream positions trained exactly once, and those trained more.
    once: u64,
    repeated: u64,
    accuracy: f32,
    late_pushes: u64,
    fenced: u64,
    updates: u64,
    straggler_trained: u64,
    fast_trained: u64,
    straggler_samples: u64,
    fast_samples: u64,
}

fn trained(r: &WorkerReport) -> u64 {
    r.epochs.iter().map(|e| e.steps).sum()
}

fn config(args: &Args, backup: u32, balanced: bool) -> anyhow::Result<ClusterConfig> {
    let mut cfg = test_config(CompressionKind::None, 1.0, args.epochs);
    cfg.cluster.workers = 3;
    cfg.cluster.shards_per_server = 1;
    cfg.server.backup_workers = backup;
    if balanced {
        cfg.data.balance = Balance::Throughput;
        cfg.data.balance_every = args.balance_every;
    }
    cfg.validate().context("bench config")?;
    Ok(cfg)
}

fn run(
    args: &Args,
    spec: &SyntheticSpec,
    name: &'static str,
    slow: bool,
    backup: u32,
    balanced: bool,
) -> anyhow::Result<Run> {
    let (store, prefix) = tokio::runtime::Builder::new_current_thread()
        .build()?
        .block_on(synthetic_bucket(spec));
    let cfg = config(args, backup, balanced)?;
    let positions = cfg.training.epochs * spec.train as u64;
    let sample_ms = args.delay_ms / cfg.data.batch_size as f64;
    let slowdown = args.slowdown;
    let sim = move |rank: u32| Simulation {
        compute: SimComputeSection {
            sample_ms,
            slowdown: if slow && rank == 2 { slowdown } else { 1.0 },
            ..SimComputeSection::default()
        },
        ..Simulation::default()
    };
    let (reports, shards, batches) =
        run_cluster_traced(cfg, &sim, store, prefix).with_context(|| format!("run {name}"))?;
    let samples = |rank: u32| -> u64 {
        batches
            .iter()
            .filter(|b| b.rank == rank)
            .map(|b| b.samples.len() as u64)
            .sum()
    };
    let fast = &reports[..2];
    let step_s = fast
        .iter()
        .map(|r| r.train_s / r.steps.saturating_sub(r.start_step).max(1) as f64)
        .sum::<f64>()
        / fast.len() as f64;
    let train_s = fast.iter().map(|r| r.train_s).sum::<f64>() / fast.len() as f64;
    let mut times: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
    for b in &batches {
        for i in 0..b.samples.len() as u64 {
            *times.entry(b.first + i).or_default() += 1;
        }
    }
    let once = times.values().filter(|&&n| n == 1).count() as u64;
    let repeated = times.values().filter(|&&n| n > 1).count() as u64;
    debug_assert!(once + repeated <= positions);
    let stats = shards.iter().map(|s| s.stats).fold((0, 0, 0), |a, s| {
        (a.0 + s.late_pushes, a.1 + s.fenced, a.2 + s.updates)
    });
    Ok(Run {
        name,
        step_s,
        train_s,
        makeup_steps: reports[0].makeup_steps,
        once,
        repeated,
        accuracy: reports[0].final_accuracy,
        late_pushes: stats.0,
        fenced: stats.1,
        updates: stats.2,
        straggler_trained: trained(&reports[2]),
        fast_trained: fast.iter().map(trained).sum::<u64>() / 2,
        straggler_samples: samples(2),
        fast_samples: (samples(0) + samples(1)) / 2,
    })
}

fn pass(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(args.slowdown >= 1.0 && args.delay_ms >= 0.0 && args.epochs >= 1) {
        bail!("--slowdown must be >= 1, --delay-ms >= 0 and --epochs >= 1");
    }
    let spec = SyntheticSpec {
        train: args.train,
        test: args.test,
        ..SyntheticSpec::default()
    };
    println!(
        "bench-straggler: 3 workers, 1 server, 1 shard; synthetic {} train / {} test, {} epochs; \
         every step computes +{} ms per full batch (in proportion to its samples), rank 2 {}x as long in the slow runs; the balanced run re-splits every {} steps",
        args.train, args.test, args.epochs, args.delay_ms, args.slowdown, args.balance_every
    );
    let runs = [
        run(&args, &spec, "fast, backup 0", false, 0, false)?,
        run(&args, &spec, "slow, backup 0", true, 0, false)?,
        run(&args, &spec, "slow, backup 1", true, 1, false)?,
        run(&args, &spec, "slow, balanced", true, 0, true)?,
    ];
    let base = &runs[0];
    let positions = args.epochs * args.train as u64;
    println!(
        "{:<16} {:>10} {:>8} {:>9} {:>9} {:>8} {:>7} {:>8} {:>8} {:>16} {:>20} {:>22}",
        "run",
        "step (ms)",
        "x fast",
        "run x fast",
        "accuracy",
        "updates",
        "late",
        "fenced",
        "make-up",
        "rank 2 trained",
        "rank 2 samples",
        "positions trained once"
    );
    for r in &runs {
        println!(
            "{:<16} {:>10.1} {:>8.2} {:>9.2} {:>8.2}% {:>8} {:>7} {:>8} {:>8} {:>9} of {:>4} {:>9} of {:>8} {:>10} of {:>8}{}",
            r.name,
            1e3 * r.step_s,
            r.step_s / base.step_s,
            r.train_s / base.train_s,
            100.0 * r.accuracy,
            r.updates,
            r.late_pushes,
            r.fenced,
            r.makeup_steps,
            r.straggler_trained,
            r.fast_trained,
            r.straggler_samples,
            r.fast_samples,
            r.once,
            positions,
            if r.repeated > 0 {
                format!(" ({} repeated)", r.repeated)
            } else {
                String::new()
            }
        );
    }
    for (which, r) in [("backup 1", &runs[2]), ("balanced", &runs[3])] {
        let ratio = r.step_s / base.step_s;
        let gap = 100.0 * (f64::from(r.accuracy) - f64::from(base.accuracy));
        println!(
            "target: {which} step time <= {TARGET_STEP_RATIO}x the fast run's: {ratio:.2}x {}",
            pass(ratio <= TARGET_STEP_RATIO)
        );
        println!(
            "target: {which} accuracy within {TARGET_ACCURACY_POINTS} point of the fast run's: {gap:+.2} points {}",
            pass(gap.abs() <= TARGET_ACCURACY_POINTS)
        );
        println!(
            "target: {which} trains every sample of every epoch exactly once: {} of {positions} positions {}",
            r.once,
            pass(r.once == positions && r.repeated == 0)
        );
    }
    // With the straggler at 1/slowdown of a fast worker's speed, the best
    // a split can do is the cluster's total throughput over the global
    // batch: workers / (fast workers + 1 / slowdown) times the fast step.
    let ideal = 3.0 / (2.0 + 1.0 / args.slowdown);
    println!(
        "(without backups the straggler sets the pace: {:.2}x; a perfect split of the work would take {ideal:.2}x the fast run's time; backup 1's whole run took {:.2}x, with {} make-up steps)",
        runs[1].step_s / base.step_s,
        runs[2].train_s / base.train_s,
        runs[2].makeup_steps
    );
    Ok(())
}

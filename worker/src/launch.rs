//! Starting a worker process: the `ps-worker train` arguments, the ranks
//! they select, certificates, the data bucket, signals, the final report.
//!
//! The `ps-worker` binary and programs that bring their own model through
//! [`crate::api`] run the same code, so both get the same flags, the same
//! stop on SIGTERM and the same exit codes.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{bail, Context};
use clap::Args;

use crate::simulate::Simulation;
use ps_net::cli::{describe_error, exit_code, stop_signal, ExitCode, UsageError};
use ps_net::pki::CertPair;
use ps_net::transport::read_pem;
use ps_shared::config::ClusterConfig;

use crate::comm::WorkerTls;
use crate::run::{
    classify_exit, run_node_with, run_worker_with, ModelFactory, WorkerError, WorkerOptions,
};

/// How long a worker may take to finish its step and say goodbye after
/// SIGTERM or Ctrl-C before the process exits anyway: inside Kubernetes'
/// default 30 s grace period.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(25);

/// The stop signal received, if any (its name decides the exit code).
static SIGNAL: OnceLock<&'static str> = OnceLock::new();

/// The name of the stop signal this process received (SIGTERM, SIGINT), if any.
pub fn stop_signal_received() -> Option<&'static str> {
    SIGNAL.get().copied()
}

/// Ends the process: 0 after `outcome` succeeded, else the error (printed
/// after `program: error:`) decides the exit code. A run that a signal
/// stopped ends with the signal's code, whatever error the stop left
/// behind; a bad config stays a bad config.
pub fn exit(program: &str, outcome: anyhow::Result<()>) -> ! {
    let Err(e) = outcome else {
        std::process::exit(0)
    };
    eprintln!("{program}: error: {}", describe_error(e.as_ref()));
    let code = match (exit_code(e.as_ref(), classify_exit), stop_signal_received()) {
        (ExitCode::Config, _) | (_, None) => exit_code(e.as_ref(), classify_exit),
        (_, Some(name)) => ExitCode::for_signal(name),
    };
    std::process::exit(code.code())
}

/// The arguments of `ps-worker train` (and of programs built on
/// [`crate::api`]).
#[derive(Args, Debug, Clone, Default)]
pub struct TrainArgs {
    /// This worker's rank in 0..cluster.workers (cluster.workers_per_node = 1).
    #[arg(long, default_value_t = 0, env = "STRATUS_RANK")]
    pub rank: u32,
    /// Run node N: its cluster.workers_per_node ranks N*workers_per_node ..
    /// (N+1)*workers_per_node, each with its own model replica and data
    /// shard, pushing once per node through a node aggregator. Needs each
    /// rank's certificate; the first rank's authenticates the node.
    #[arg(long, env = "STRATUS_NODE", conflicts_with = "rank")]
    pub node: Option<u32>,
    /// Bucket URL of the dataset (overrides data.url).
    #[arg(long)]
    pub data: Option<String>,
    /// Print one line per epoch instead of a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Write the final report as JSON to this file (with --node: a list,
    /// one report per rank).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Compute device (overrides training.device): cpu, cuda or cuda:N;
    /// cuda needs a build with `--features cuda`.
    #[arg(long, env = "STRATUS_DEVICE")]
    pub device: Option<String>,
    /// Simulate a slow link and/or bucket (tests, benchmarks): a TOML file
    /// with a [link] section (bandwidth_mbit, latency_ms) and/or a [bucket]
    /// section (first_byte_ms, per_connection_mb_per_s,
    /// aggregate_gbit_per_s, transient_error_rate, seed); see
    /// configs/simulate-slow-bucket.toml. With --node the link is the
    /// node's one connection per server.
    #[arg(long, value_name = "FILE")]
    pub simulate: Option<PathBuf>,
}

impl TrainArgs {
    /// The ranks this process runs: `--node N`'s ranks, or `--rank`.
    pub fn ranks(&self, cfg: &ClusterConfig) -> anyhow::Result<Vec<u32>> {
        let wpn = cfg.cluster.workers_per_node as u32;
        let rank = self.rank;
        Ok(match self.node {
            Some(n) if (n as usize) < cfg.nodes() => (n * wpn..(n + 1) * wpn).collect(),
            Some(n) => bail!(UsageError(format!(
                "--node {n}: the cluster has {} nodes (cluster.workers = {} / cluster.workers_per_node = {wpn})",
                cfg.nodes(),
                cfg.cluster.workers
            ))),
            None if wpn > 1 => bail!(UsageError(format!(
                "cluster.workers_per_node = {wpn}: start each node with --node N (N in 0..{}), which runs its {wpn} ranks together",
                cfg.nodes()
            ))),
            None if rank as usize >= cfg.cluster.max_ranks() => bail!(UsageError(format!(
                "--rank {rank}: the cluster admits ranks 0..{} (cluster.workers = {}, cluster.max_workers = {})",
                cfg.cluster.max_ranks(),
                cfg.cluster.workers,
                cfg.cluster.max_workers
            ))),
            None => vec![rank],
        })
    }
}

/// Train the ranks `args` select until the run ends, a signal stops it or
/// an error does; `model` builds each rank's model (`None`: from
/// `[model]`). Prints one summary line per rank and writes `--report`.
pub fn train(
    mut cfg: ClusterConfig,
    args: TrainArgs,
    model: Option<ModelFactory>,
) -> anyhow::Result<()> {
    let simulation = match &args.simulate {
        Some(path) => Simulation::load(path)?,
        None => Simulation::default(),
    };
    if let Some(url) = &args.data {
        cfg.data.url = url.clone();
    }
    if let Some(device) = &args.device {
        cfg.training.device = device.clone();
        cfg.validate().context("--device")?;
    }
    let ranks = args.ranks(&cfg)?;
    train_ranks(
        cfg,
        args.node,
        ranks,
        !args.no_progress,
        args.report,
        simulation,
        model,
    )
}

fn train_ranks(
    cfg: ClusterConfig,
    node: Option<u32>,
    ranks: Vec<u32>,
    progress: bool,
    report_path: Option<PathBuf>,
    simulation: Simulation,
    model: Option<ModelFactory>,
) -> anyhow::Result<()> {
    let threads = init_compute_threads(&cfg);
    tracing::info!("compute pool: {threads} thread(s)");
    let ca_pem = read_pem(&cfg.tls.ca).with_context(|| {
        "the worker needs the cluster CA certificate (tls.ca); `ps-server certs` writes one"
    })?;
    let (store, prefix) = ps_shared::bucket::open_data_bucket(&cfg.data.url)
        .with_context(|| format!("opening data.url = {}", cfg.data.url))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut options = Vec::new();
    for &rank in &ranks {
        let (cert, key) = cfg.tls.worker_paths(rank);
        let identity = CertPair::read(&cert, &key).with_context(|| {
            format!(
                "the worker needs its rank-{rank} certificate ({} and {}, from tls.worker_cert / tls.worker_key); `ps-server certs` writes one per rank",
                cert.display(),
                key.display()
            )
        })?;
        options.push(WorkerOptions {
            rank,
            tls: WorkerTls {
                ca_pem: ca_pem.clone(),
                identity,
            },
            // One progress bar per process: a node prints epoch lines.
            progress: progress && node.is_none(),
            epoch_lines: true,
            crash_after_steps: None,
            pause_after_steps: None,
            stop: Some(stop_rx.clone()),
            steps_done: None,
            trained: None,
            simulation: simulation.clone(),
        });
    }
    let system = actix::System::new();
    // Errors leave the runtime as values: nothing inside it may end the
    // process or drop a runtime.
    let outcomes = system.block_on(async {
        // A CA that is not PEM or a key that does not match its certificate
        // is a config error now, not a server "unreachable" for
        // server.connect_timeout_secs.
        check_tls(&cfg, &options)?;
        let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
        // SIGTERM or Ctrl-C: finish the current step (or cut a wait for the
        // bucket or a server short), say goodbye, stop.
        actix::spawn(async move {
            let name = stop_signal().await;
            let _ = SIGNAL.set(name);
            eprintln!("ps-worker: {name}: finishing the current step and saying goodbye");
            let _ = stop_tx.send(true);
            let _ = stopped_tx.send(name);
        });
        let runs = async {
            match node {
                Some(n) => run_node_with(&cfg, n, options, store, prefix, model).await,
                None => {
                    let opts = options.remove(0);
                    vec![run_worker_with(&cfg, opts, store, prefix, model).await]
                }
            }
        };
        // The run ends by itself, or within STOP_GRACE of a signal.
        let deadline = async {
            match stopped_rx.await {
                Ok(name) => {
                    tokio::time::sleep(STOP_GRACE).await;
                    name
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            outcomes = runs => anyhow::Ok(outcomes),
            name = deadline => bail!(
                "{name}: the worker did not stop within {} s; exiting without a goodbye",
                STOP_GRACE.as_secs()
            ),
        }
    });
    let outcomes = outcomes?;
    let mut reports = Vec::new();
    for outcome in outcomes {
        reports.push(outcome.map_err(|e| match e {
            WorkerError::Dataset(_) | WorkerError::Mismatch(_) => {
                anyhow::Error::new(e).context(format!("data.url = {}", cfg.data.url))
            }
            other => other.into(),
        })?);
    }
    for report in &reports {
        let rank = report.rank;
        if report.steps_short_of_workers > 0 {
            println!(
                "worker {rank}: WARNING: {} of {} steps ran with fewer than {} workers in the barrier (as few as {})",
                report.steps_short_of_workers,
                report.steps - report.start_step,
                cfg.cluster.workers,
                report.min_live_workers
            );
        }
        println!(
            "worker {rank} done: {} steps, test accuracy {}, pushed {:.1} KB/step, pulled {:.1} KB/step, data wait {:.2}s, compute {:.2}s, comm {:.2}s",
            report.steps,
            crate::run::accuracy_text(report.final_accuracy, 2),
            report.bytes_pushed_per_step / 1e3,
            report.bytes_pulled_per_step / 1e3,
            report.data_wait_s,
            report.compute_s,
            report.comm_s
        );
    }
    if let (Some(n), Some(first)) = (node, reports.first()) {
        println!(
            "node {n} done: its link carried {:.1} MB up and {:.1} MB down for {} ranks",
            first.link_sent_bytes as f64 / 1e6,
            first.link_received_bytes as f64 / 1e6,
            reports.len()
        );
    }
    if let Some(path) = report_path {
        // One rank: its report; a node: the list of its ranks' reports.
        let json = match (node, reports.as_slice()) {
            (None, [one]) => serde_json::to_string_pretty(one)?,
            _ => serde_json::to_string_pretty(&reports)?,
        };
        std::fs::write(&path, json)
            .with_context(|| format!("writing report {}", path.display()))?;
    }
    Ok(())
}

/// Sizes this process's compute: the global rayon pool (the trainer's
/// steps, candle's matmul, the compressor's passes) and candle's own split of
/// matmuls and element-wise ops, which it reads from `RAYON_NUM_THREADS` and
/// `CANDLE_NUM_THREADS`. Left to themselves each would take every CPU, so
/// two workers and a server on one machine would run several times more
/// compute threads than CPUs, spinning at candle's barriers while the threads
/// they wait for sit in the run queue. Called before the run computes
/// anything.
fn init_compute_threads(cfg: &ClusterConfig) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let from_env = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0);
    let threads = match from_env {
        Some(n) if cfg.training.compute_threads == 0 => n,
        _ => cfg.compute_threads(cpus),
    };
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    // Already built only if something computed before (a program that
    // brings its own model may have): its pool is then kept.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    threads
}

/// Build each rank's TLS client setup once before connecting: a CA that is
/// not PEM or a key that does not match its certificate is refused here,
/// naming the files.
fn check_tls(cfg: &ClusterConfig, options: &[WorkerOptions]) -> anyhow::Result<()> {
    let limits = ps_net::transport::EndpointLimits {
        idle_timeout: ps_shared::config::secs(cfg.server.idle_timeout_secs),
        keep_alive: ps_shared::config::secs(cfg.server.heartbeat_secs),
        max_bidi_streams: 16,
    };
    for o in options {
        let (cert, key) = cfg.tls.worker_paths(o.rank);
        ps_net::transport::client_endpoint(&o.tls.ca_pem, &o.tls.identity, false, &limits)
            .with_context(|| {
                format!(
                    "rank {}: TLS files {} (tls.ca), {} and {} (tls.worker_cert, tls.worker_key)",
                    o.rank,
                    cfg.tls.ca.display(),
                    cert.display(),
                    key.display()
                )
            })?;
    }
    Ok(())
}

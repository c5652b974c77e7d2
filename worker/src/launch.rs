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
    /// Without it: STRATUS_RANK, then RANK, then JOB_COMPLETION_INDEX, then 0.
    #[arg(long)]
    pub rank: Option<u32>,
    /// Run node N: its cluster.workers_per_node ranks N*workers_per_node ..
    /// (N+1)*workers_per_node, each with its own model replica and data
    /// shard, pushing once per node through a node aggregator. Needs each
    /// rank's certificate; the first rank's authenticates the node.
    /// Without it (cluster.workers_per_node > 1): RANK, then
    /// JOB_COMPLETION_INDEX, name the node.
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
    /// Simulate a slow link, bucket and/or worker (tests, benchmarks): a
    /// TOML file with a [link] section (bandwidth_mbit, latency_ms), a
    /// [bucket] section (first_byte_ms, per_connection_mb_per_s,
    /// aggregate_gbit_per_s, transient_error_rate, seed) and/or a [compute]
    /// section (slowdown, delay_ms); see configs/simulate-slow-bucket.toml.
    /// With --node the link is the node's one connection per server.
    #[arg(long, value_name = "FILE")]
    pub simulate: Option<PathBuf>,
}

/// The launch variables a process reads besides its flags, in the order
/// they are consulted for its index (see `docs/launch.md`).
pub const INDEX_VARS: [&str; 3] = ["STRATUS_RANK", "RANK", "JOB_COMPLETION_INDEX"];

/// What the launch variables say about this process: the ranks it runs
/// and, with `LOCAL_RANK`, the CUDA device a bare `cuda` means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The ranks this process runs (one, or a node's).
    pub ranks: Vec<u32>,
    /// The node this process runs as a whole (`--node`, or RANK with
    /// cluster.workers_per_node > 1), if any.
    pub node: Option<u32>,
    /// `LOCAL_RANK`, when set: the process's index on its machine.
    pub local_rank: Option<u32>,
}

/// A launch variable's value as a number; empty counts as unset.
fn env_number(env: &dyn Fn(&str) -> Option<String>, name: &str) -> anyhow::Result<Option<u32>> {
    match env(name).filter(|v| !v.trim().is_empty()) {
        None => Ok(None),
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n) => Ok(Some(n)),
            Err(_) => bail!(UsageError(format!(
                "{name} = `{v}` is not a non-negative integer"
            ))),
        },
    }
}

impl TrainArgs {
    /// The ranks this process runs, from the flags and this process's
    /// environment (see [`TrainArgs::launch`]).
    pub fn ranks(&self, cfg: &ClusterConfig) -> anyhow::Result<Vec<u32>> {
        Ok(self.launch(cfg, &|name| std::env::var(name).ok())?.ranks)
    }

    /// Resolve the launch: with cluster.workers_per_node = 1 the rank is
    /// `--rank`, else STRATUS_RANK, RANK, JOB_COMPLETION_INDEX, else 0; with
    /// workers_per_node > 1 the node is `--node` (or STRATUS_NODE), else
    /// RANK, JOB_COMPLETION_INDEX. `WORLD_SIZE`, when set, must equal the
    /// number of processes (cluster.workers, or the number of nodes).
    /// `env` reads a variable (tests pass their own).
    pub fn launch(
        &self,
        cfg: &ClusterConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Launch> {
        let wpn = cfg.cluster.workers_per_node as u32;
        let nodes = cfg.nodes();
        let workers_from = if env("STRATUS__CLUSTER__WORKERS").is_some() {
            "the override STRATUS__CLUSTER__WORKERS"
        } else {
            "the config"
        };
        if let Some(world) = env_number(env, "WORLD_SIZE")? {
            let (expected, what) = if wpn > 1 {
                (
                    nodes,
                    format!(
                        "the cluster's {nodes} nodes (cluster.workers = {} from {workers_from} / cluster.workers_per_node = {wpn}; one process per node)",
                        cfg.cluster.workers
                    ),
                )
            } else {
                (
                    cfg.cluster.workers,
                    format!(
                        "cluster.workers = {} (from {workers_from})",
                        cfg.cluster.workers
                    ),
                )
            };
            if world as usize != expected {
                bail!(UsageError(format!(
                    "WORLD_SIZE = {world} (from the environment) disagrees with {what}"
                )));
            }
        }
        let local_rank = env_number(env, "LOCAL_RANK")?;
        // The first source that is set, and its name for messages.
        let mut index: Option<(u32, &str)> = None;
        for name in INDEX_VARS {
            if index.is_none() {
                if let Some(n) = env_number(env, name)? {
                    index = Some((n, name));
                }
            }
        }
        let mut node_run = None;
        let ranks = if wpn > 1 {
            if let Some(rank) = self.rank {
                bail!(UsageError(format!(
                    "--rank {rank}: cluster.workers_per_node = {wpn}: start each node with --node N (N in 0..{nodes}), which runs its {wpn} ranks together"
                )));
            }
            let node = match (self.node, index) {
                (Some(n), _) => Some((n, "--node")),
                (None, Some((_, "STRATUS_RANK"))) => bail!(UsageError(format!(
                    "STRATUS_RANK: cluster.workers_per_node = {wpn}: start each node with --node N or STRATUS_NODE (N in 0..{nodes}), which runs its {wpn} ranks together"
                ))),
                (None, other) => other,
            };
            match node {
                Some((n, _)) if (n as usize) < nodes => {
                    node_run = Some(n);
                    (n * wpn..(n + 1) * wpn).collect()
                }
                Some((n, from)) => bail!(UsageError(format!(
                    "{from} {n}: the cluster has {nodes} nodes (cluster.workers = {} / cluster.workers_per_node = {wpn})",
                    cfg.cluster.workers
                ))),
                None => bail!(UsageError(format!(
                    "cluster.workers_per_node = {wpn}: start each node with --node N (or STRATUS_NODE, RANK), N in 0..{nodes}, which runs its {wpn} ranks together"
                ))),
            }
        } else if let Some(n) = self.node {
            if n as usize >= nodes {
                bail!(UsageError(format!(
                    "--node {n}: the cluster has {nodes} nodes (cluster.workers = {} / cluster.workers_per_node = {wpn})",
                    cfg.cluster.workers
                )));
            }
            node_run = Some(n);
            vec![n]
        } else {
            let (rank, from) = match (self.rank, index) {
                (Some(r), _) => (r, "--rank".to_string()),
                (None, Some((r, name))) => (r, format!("{name} =")),
                (None, None) => (0, "rank".to_string()),
            };
            if rank as usize >= cfg.cluster.max_ranks() {
                bail!(UsageError(format!(
                    "{from} {rank}: the cluster admits ranks 0..{} (cluster.workers = {}, cluster.max_workers = {})",
                    cfg.cluster.max_ranks(),
                    cfg.cluster.workers,
                    cfg.cluster.max_workers
                )));
            }
            vec![rank]
        };
        Ok(Launch {
            ranks,
            node: node_run,
            local_rank,
        })
    }
}

/// The device a rank uses: a bare `cuda` with `LOCAL_RANK` set is
/// `cuda:LOCAL_RANK` (one process per GPU, as launchers start them); any
/// other device is kept.
pub fn device_for(device: &str, local_rank: Option<u32>) -> String {
    match local_rank {
        Some(n) if device.trim() == "cuda" => format!("cuda:{n}"),
        _ => device.to_string(),
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
    let launch = args.launch(&cfg, &|name| std::env::var(name).ok())?;
    let device = device_for(&cfg.training.device, launch.local_rank);
    if device != cfg.training.device {
        tracing::info!(
            "LOCAL_RANK: training.device {} is {device}",
            cfg.training.device
        );
        cfg.training.device = device;
        cfg.validate().context("LOCAL_RANK")?;
    }
    train_ranks(
        cfg,
        launch.node,
        launch.ranks,
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
            ps_net::progressln!(
                "worker {rank}: WARNING: {} of {} steps ran with fewer than {} workers in the barrier (as few as {})",
                report.steps_short_of_workers,
                report.steps - report.start_step,
                cfg.cluster.workers,
                report.min_live_workers
            );
        }
        ps_net::progressln!(
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
        ps_net::progressln!(
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
        max_bidi_streams: 16,
        ..ps_net::transport::EndpointLimits::of_cluster(cfg)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(workers: usize, per_node: usize) -> ClusterConfig {
        let mut cfg = ClusterConfig::embedded_default().unwrap();
        cfg.cluster.workers = workers;
        cfg.cluster.max_workers = workers;
        cfg.cluster.workers_per_node = per_node;
        cfg
    }

    fn launch(
        args: &TrainArgs,
        cfg: &ClusterConfig,
        vars: &[(&str, &str)],
    ) -> anyhow::Result<Launch> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        args.launch(cfg, &move |name| {
            vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn the_rank_follows_the_documented_precedence() {
        let c = cfg(4, 1);
        let none = TrainArgs::default();
        let flag = TrainArgs {
            rank: Some(1),
            ..TrainArgs::default()
        };
        let all = [
            ("STRATUS_RANK", "2"),
            ("RANK", "3"),
            ("JOB_COMPLETION_INDEX", "0"),
        ];
        assert_eq!(launch(&flag, &c, &all).unwrap().ranks, [1]);
        assert_eq!(launch(&none, &c, &all).unwrap().ranks, [2]);
        assert_eq!(launch(&none, &c, &all[1..]).unwrap().ranks, [3]);
        assert_eq!(launch(&none, &c, &all[2..]).unwrap().ranks, [0]);
        assert_eq!(
            launch(&none, &c, &[("JOB_COMPLETION_INDEX", "3")])
                .unwrap()
                .ranks,
            [3]
        );
        assert_eq!(launch(&none, &c, &[]).unwrap().ranks, [0]);
        // An empty variable counts as unset.
        assert_eq!(
            launch(&none, &c, &[("STRATUS_RANK", ""), ("RANK", "2")])
                .unwrap()
                .ranks,
            [2]
        );
        let err = launch(&none, &c, &[("RANK", "9")]).unwrap_err().to_string();
        assert!(
            err.contains("RANK = 9") && err.contains("ranks 0..4"),
            "{err}"
        );
        let err = launch(&none, &c, &[("RANK", "one")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK = `one`"), "{err}");
    }

    #[test]
    fn world_size_must_match_the_cluster() {
        let c = cfg(2, 1);
        let none = TrainArgs::default();
        assert!(launch(&none, &c, &[("WORLD_SIZE", "2"), ("RANK", "1")]).is_ok());
        let err = launch(&none, &c, &[("WORLD_SIZE", "3")]).unwrap_err();
        assert_eq!(
            ps_net::cli::exit_code(err.as_ref(), |_| None),
            ExitCode::Config
        );
        let err = err.to_string();
        assert!(
            err.contains("WORLD_SIZE = 3 (from the environment)")
                && err.contains("cluster.workers = 2 (from the config)"),
            "{err}"
        );
        let err = launch(
            &none,
            &c,
            &[("WORLD_SIZE", "3"), ("STRATUS__CLUSTER__WORKERS", "2")],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("the override STRATUS__CLUSTER__WORKERS"),
            "{err}"
        );
        // With nodes, one process per node: WORLD_SIZE counts nodes.
        let n = cfg(4, 2);
        assert!(launch(&none, &n, &[("WORLD_SIZE", "2"), ("RANK", "1")]).is_ok());
        assert!(launch(&none, &n, &[("WORLD_SIZE", "4"), ("RANK", "1")]).is_err());
    }

    #[test]
    fn rank_names_the_node_when_nodes_run_several_ranks() {
        let n = cfg(4, 2);
        let none = TrainArgs::default();
        let l = launch(&none, &n, &[("RANK", "1")]).unwrap();
        assert_eq!((l.ranks, l.node), (vec![2, 3], Some(1)));
        let node = TrainArgs {
            node: Some(0),
            ..TrainArgs::default()
        };
        let l = launch(&node, &n, &[("RANK", "1")]).unwrap();
        assert_eq!((l.ranks, l.node), (vec![0, 1], Some(0)));
        let err = launch(&none, &n, &[("STRATUS_RANK", "1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("STRATUS_NODE"), "{err}");
        let err = launch(&none, &n, &[]).unwrap_err().to_string();
        assert!(err.contains("--node N"), "{err}");
        let err = launch(&none, &n, &[("RANK", "2")]).unwrap_err().to_string();
        assert!(err.contains("RANK = 2") || err.contains("RANK 2"), "{err}");
    }

    #[test]
    fn local_rank_picks_the_cuda_device() {
        let c = cfg(2, 1);
        let l = launch(&TrainArgs::default(), &c, &[("LOCAL_RANK", "1")]).unwrap();
        assert_eq!(l.local_rank, Some(1));
        assert_eq!(device_for("cuda", l.local_rank), "cuda:1");
        assert_eq!(device_for("cuda:0", l.local_rank), "cuda:0");
        assert_eq!(device_for("cpu", l.local_rank), "cpu");
        assert_eq!(device_for("cuda", None), "cuda");
        assert!(launch(&TrainArgs::default(), &c, &[("LOCAL_RANK", "-1")]).is_err());
    }
}

//! A real `ps-server` process killed with SIGKILL in the middle of a
//! training run and started again on the same port.
//!
//! The server runs as a child process with a config file, certificates that
//! `ps-server certs` wrote, and file:// checkpoints every few updates; two
//! workers train in this process. Once worker 0 has done a number of steps
//! and every shard has published a checkpoint, the process is killed with
//! SIGKILL (no goodbye, no final checkpoint, connections left to time out)
//! and the same binary is started again. The workers must reconnect, the
//! new process must rebuild every shard from the workers' copies (the newest
//! version on which they agree, newer than its checkpoint), and the run must
//! finish with every planned update applied exactly once. Nothing waits on a
//! sleep: the test waits on the workers' step counters, the child's log
//! lines and its exit.
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use ps_dataset::SyntheticSpec;
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_tests::{
    config_file_with_certs, free_udp_port, server_binary, server_run_command, synthetic_bucket,
    test_config, tls_files_under, worker_options, worker_tls_from_files,
};
use ps_worker::run::{run_worker, WorkerError, WorkerOptions, WorkerReport};

const ACCURACY_BAR: f32 = 0.90;
/// Upper bound on every wait, so a bug cannot hang the suite.
const RUN_LIMIT: Duration = Duration::from_secs(300);
const EPOCHS: u64 = 6;
const STEPS_PER_EPOCH: u64 = 4096 / 2 / 64;
/// Worker 0's step count at which the server is killed.
const KILL_AT: u64 = 50;
const CHECKPOINT_EVERY: u64 = 20;
const SIGKILL: i32 = 9;

/// A `ps-server` child process whose log lines (stderr) the test reads.
struct ServerProcess {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    /// Every line read so far.
    log: Vec<String>,
}

impl ServerProcess {
    fn start(bin: &Path, config: &Path, token: &str) -> Self {
        let mut child = server_run_command(bin, config, token)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            log: Vec::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait until the lines logged so far satisfy `done`; fails when the
    /// process ends first.
    /// Start the server and wait until it listens.
    async fn listening(bin: &Path, config: &Path, token: &str) -> Self {
        let mut server = Self::start(bin, config, token);
        server
            .wait_for("listening", |log| {
                lines_with(log, "ps-server listening").next().is_some()
            })
            .await;
        server
    }

    async fn wait_for(&mut self, what: &str, done: impl Fn(&[String]) -> bool) {
        while !done(&self.log) {
            match tokio::time::timeout(RUN_LIMIT, self.lines.recv()).await {
                Ok(Some(line)) => self.log.push(line),
                Ok(None) => panic!("ps-server ended before {what}:\n{}", self.log.join("\n")),
                Err(_) => panic!("ps-server did not get to {what}:\n{}", self.log.join("\n")),
            }
        }
    }

    /// Kill the process with SIGKILL and reap it.
    fn kill(mut self) -> (ExitStatus, Vec<String>) {
        self.child.kill().expect("SIGKILL ps-server");
        let status = self.child.wait().expect("reap ps-server");
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        (status, self.log)
    }

    /// Wait for the process to exit by itself; returns its status and log.
    async fn exit(mut self) -> (ExitStatus, Vec<String>) {
        // Its stderr closes when it exits.
        while let Ok(Some(line)) = tokio::time::timeout(RUN_LIMIT, self.lines.recv()).await {
            self.log.push(line);
        }
        let mut child = self.child;
        let status =
            tokio::time::timeout(RUN_LIMIT, tokio::task::spawn_blocking(move || child.wait()))
                .await
                .expect("ps-server exits")
                .expect("wait task")
                .expect("reap ps-server");
        (status, self.log)
    }
}

fn lines_with<'a>(log: &'a [String], needle: &'a str) -> impl Iterator<Item = &'a String> {
    log.iter().filter(move |l| l.contains(needle))
}

/// `key: value` inside a `Debug`-formatted struct on a log line.
fn debug_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let tag = format!(" {key}: ");
    let start = line.find(&tag)? + tag.len();
    let rest = &line[start..];
    let end = rest.find([',', ' ', '}']).unwrap_or(rest.len());
    Some(&rest[..end])
}

/// `key=value` of a log line's fields.
fn log_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let tag = format!(" {key}=");
    let start = line.find(&tag)? + tag.len();
    let rest = &line[start..];
    Some(rest.split_whitespace().next().unwrap_or(""))
}

fn number(text: Option<&str>) -> Option<u64> {
    text?.parse().ok()
}

/// What a shard of the restarted process logged when it decided where it
/// starts ("shard starts ... report=RecoveryReport { .. }").
#[derive(Debug)]
struct Recovered {
    shard: u64,
    source: String,
    version: u64,
    offers: u64,
    conflicting: u64,
    updates_lost: u64,
    checkpoint_version: Option<u64>,
}

fn recoveries(log: &[String]) -> Vec<Recovered> {
    let mut out: Vec<Recovered> = lines_with(log, "shard starts")
        .map(|l| Recovered {
            shard: number(debug_field(l, "shard")).expect("shard"),
            source: debug_field(l, "source").expect("source").to_string(),
            version: number(debug_field(l, "version")).expect("version"),
            offers: number(debug_field(l, "offers")).expect("offers"),
            conflicting: number(debug_field(l, "conflicting")).expect("conflicting"),
            updates_lost: number(debug_field(l, "updates_lost")).expect("updates_lost"),
            checkpoint_version: debug_field(l, "checkpoint_version")
                .and_then(|v| v.strip_prefix("Some("))
                .and_then(|v| v.strip_suffix(')'))
                .and_then(|v| v.parse().ok()),
        })
        .collect();
    out.sort_by_key(|r| r.shard);
    out
}

/// The shards that published a checkpoint, with the newest version each.
fn published(log: &[String]) -> std::collections::BTreeMap<u64, u64> {
    let mut newest = std::collections::BTreeMap::new();
    for line in lines_with(log, "checkpoint published") {
        if let (Some(shard), Some(version)) = (
            number(log_field(line, "shard")),
            number(log_field(line, "version")),
        ) {
            let v = newest.entry(shard).or_insert(0);
            *v = version.max(*v);
        }
    }
    newest
}

/// The dataset of every run.
fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

/// The cluster config: one server on `port` of loopback, certificates and
/// checkpoints under `dir`.
fn config(dir: &Path, port: u16) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, EPOCHS);
    cfg.cluster.servers = vec![format!("127.0.0.1:{port}")];
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.idle_timeout_secs = 2.0;
    cfg.server.worker_timeout_secs = 5.0;
    cfg.server.connect_timeout_secs = 30;
    cfg.server.recovery_window_secs = 5.0;
    let checkpoints = dir.join("checkpoints");
    std::fs::create_dir_all(&checkpoints).expect("checkpoint directory");
    cfg.server.checkpoint_url = format!("file://{}", checkpoints.display());
    cfg.server.checkpoint_every = CHECKPOINT_EVERY;
    tls_files_under(&mut cfg, &dir.join("certs"));
    cfg.validate().expect("valid config");
    cfg
}

/// Options for worker `rank`, with the TLS files `ps-server certs` wrote.
fn options(cfg: &ClusterConfig, rank: u32) -> WorkerOptions {
    worker_options(rank, worker_tls_from_files(cfg, rank))
}

#[test]
fn a_killed_server_process_restarts_and_no_update_is_lost() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Both server processes bind the same port.
    let (bin, cfg, config_path, token) = prepared(dir.path(), |_| {});

    let planned = EPOCHS * STEPS_PER_EPOCH;
    let system = actix::System::new();
    system.block_on(async move {
        let (store, prefix) = synthetic_bucket(&spec()).await;
        let mut first = ServerProcess::listening(&bin, &config_path, &token).await;
        let first_pid = first.pid();
        let (steps_tx, mut steps) = watch::channel(0);
        let o0 = WorkerOptions {
            steps_done: Some(steps_tx),
            ..options(&cfg, 0)
        };
        let workers = futures::future::join(
            run_worker(&cfg, o0, store.clone(), prefix.clone()),
            run_worker(&cfg, options(&cfg, 1), store.clone(), prefix.clone()),
        );
        let mut injected = 0u32;
        let chaos = async {
            // Copy the value out: a held watch::Ref would block the worker.
            let reached = tokio::time::timeout(RUN_LIMIT, steps.wait_for(|s| *s >= KILL_AT))
                .await
                .map(|r| r.map(|v| *v));
            assert!(
                matches!(reached, Ok(Ok(_))),
                "worker 0 never reached step {KILL_AT}"
            );
            // Every shard has a checkpoint on disk before the kill.
            first
                .wait_for("a checkpoint of every shard", |log| {
                    published(log).len() == cfg.total_shards()
                })
                .await;
            let step_at_kill = *steps.borrow();
            let (status, log) = first.kill();
            injected += 1;
            let second = ServerProcess::start(&bin, &config_path, &token);
            (step_at_kill, status, published(&log), second)
        };
        let ((a, b), (step_at_kill, killed, saved, second)) =
            tokio::time::timeout(RUN_LIMIT, futures::future::join(workers, chaos))
                .await
                .expect("the run finished in time");
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        // Both workers said goodbye, so the new process exits by itself.
        let (exited, log) = second.exit().await;

        assert_eq!(killed.signal(), Some(SIGKILL), "{killed:?}");
        assert!(exited.success(), "restarted ps-server: {exited:?}\n{}", log.join("\n"));
        let recovered = recoveries(&log);
        assert_eq!(recovered.len(), cfg.total_shards(), "{}", log.join("\n"));
        for r in &recovered {
            assert_eq!(r.source, "Workers", "{r:?}");
            assert_eq!((r.updates_lost, r.conflicting), (0, 0), "{r:?}");
            assert!(r.version >= step_at_kill, "{r:?} (killed at step {step_at_kill})");
            let found = r.checkpoint_version.expect("the checkpoint was found");
            assert!(found <= r.version && found >= CHECKPOINT_EVERY, "{r:?}");
            // At least the newest checkpoint the killed process said it
            // published (a write may have ended just before the kill).
            let said = saved.get(&r.shard).copied().unwrap_or(0);
            assert!(found >= said, "{r:?} vs published {saved:?}");
        }
        assert_eq!((a.steps, b.steps), (planned, planned));
        let final_version = a.final_version.min(b.final_version);
        let lost = planned - final_version;
        assert_eq!(lost, 0, "every planned step was applied once");
        assert_eq!((a.final_version, b.final_version), (planned, planned));
        assert!(a.recoveries > 0 && b.recoveries > 0, "both workers reconnected");
        for r in [&a, &b] {
            assert!(r.final_accuracy > ACCURACY_BAR, "accuracy {}", r.final_accuracy);
        }
        println!(
            "process: ps-server pid {first_pid} killed with SIGKILL (signal {}) at worker step {step_at_kill} and started again on {}: faults injected {injected}, shards recovered from the workers' copies at versions {:?} from {} offers (checkpoints found at {:?}), updates lost {lost}, final version {final_version} of {planned} planned, reconnects {}+{}, accuracy {:.2}% / {:.2}%",
            killed.signal().unwrap_or(0),
            cfg.cluster.servers[0],
            recovered.iter().map(|r| r.version).collect::<Vec<_>>(),
            recovered.iter().map(|r| r.offers).sum::<u64>(),
            recovered.iter().map(|r| r.checkpoint_version).collect::<Vec<_>>(),
            a.recoveries,
            b.recoveries,
            100.0 * a.final_accuracy,
            100.0 * b.final_accuracy
        );
    });
}

/// A config under `dir` on a free loopback port (see [`config`]), changed
/// by `edit`, written to `dir/cluster.toml` with the certificates that
/// `ps-server certs` writes. Returns the binary, the config, its path and
/// the token.
fn prepared(
    dir: &Path,
    edit: impl FnOnce(&mut ClusterConfig),
) -> (PathBuf, ClusterConfig, PathBuf, String) {
    let mut cfg = config(dir, free_udp_port());
    edit(&mut cfg);
    cfg.validate().expect("valid config");
    let config_path = config_file_with_certs(&cfg, dir);
    let token = cfg.cluster.token.clone();
    (server_binary(), cfg, config_path, token)
}

/// Both workers of `cfg` run with their default options over `store`,
/// within [`RUN_LIMIT`] (`what` names the wait).
async fn both_workers(
    cfg: &ClusterConfig,
    store: &std::sync::Arc<dyn object_store::ObjectStore>,
    prefix: &object_store::path::Path,
    what: &str,
) -> (
    Result<WorkerReport, WorkerError>,
    Result<WorkerReport, WorkerError>,
) {
    tokio::time::timeout(
        RUN_LIMIT,
        futures::future::join(
            run_worker(cfg, options(cfg, 0), store.clone(), prefix.clone()),
            run_worker(cfg, options(cfg, 1), store.clone(), prefix.clone()),
        ),
    )
    .await
    .expect(what)
}

/// The run's checkpoint store (`server.checkpoint_url`).
fn checkpoint_store(
    cfg: &ClusterConfig,
) -> (
    std::sync::Arc<dyn object_store::ObjectStore>,
    object_store::path::Path,
) {
    ps_shared::bucket::open_bucket(&cfg.server.checkpoint_url).expect("checkpoint store")
}

#[test]
fn a_completed_run_ends_with_a_final_checkpoint() {
    // Periodic checkpoints at 20 and 40; the run ends at 50.
    const STEPS: u64 = 50;
    let dir = tempfile::tempdir().expect("temp dir");
    let (bin, cfg, config_path, token) = prepared(dir.path(), |cfg| {
        cfg.training.max_steps = STEPS;
    });
    assert_ne!(STEPS % cfg.server.checkpoint_every, 0);
    let system = actix::System::new();
    system.block_on(async move {
        let (store, prefix) = synthetic_bucket(&spec()).await;
        let server = ServerProcess::listening(&bin, &config_path, &token).await;
        let (a, b) = both_workers(&cfg, &store, &prefix, "the run finished in time").await;
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        assert_eq!((a.steps, b.steps), (STEPS, STEPS));
        let (exited, log) = server.exit().await;
        assert!(exited.success(), "ps-server: {exited:?}\n{}", log.join("\n"));
        assert!(
            lines_with(&log, "run complete: final checkpoints written")
                .next()
                .is_some(),
            "{}",
            log.join("\n")
        );
        // What a rerun would resume from: the end, not step 40.
        let (ckpts, ckpt_prefix) = checkpoint_store(&cfg);
        let mut versions = Vec::new();
        for shard in 0..cfg.total_shards() as u32 {
            let latest = ps_server::checkpoint::load_latest(&ckpts, &ckpt_prefix, shard)
                .await
                .expect("readable checkpoint")
                .expect("a checkpoint of every shard");
            versions.push(latest.version);
        }
        assert_eq!(versions, vec![STEPS; cfg.total_shards()]);
        println!(
            "process: a run of {STEPS} steps with checkpoint_every = {} ended with checkpoints at versions {versions:?}",
            cfg.server.checkpoint_every
        );
    });
}

#[test]
fn checkpoints_that_cannot_be_written_fail_the_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (bin, cfg, config_path, token) = prepared(dir.path(), |cfg| {
        cfg.server.checkpoint_every = 5;
        cfg.server.checkpoint_max_failures = 1;
        // A run far longer than it takes the writes to fail.
        cfg.training.epochs = 40;
        // The workers give up on the stopped server soon.
        cfg.server.connect_timeout_secs = 2;
    });
    let system = actix::System::new();
    system.block_on(async move {
        let (store, prefix) = synthetic_bucket(&spec()).await;
        let server = ServerProcess::listening(&bin, &config_path, &token).await;
        // The checkpoint directory becomes a plain file: every write under
        // it fails (also for root, which permissions would not stop).
        let checkpoints = dir.path().join("checkpoints");
        std::fs::remove_dir_all(&checkpoints).expect("remove the checkpoint dir");
        std::fs::write(&checkpoints, b"not a directory").expect("a file in its place");
        let (a, b) = both_workers(&cfg, &store, &prefix, "the workers ended in time").await;
        let (exited, log) = server.exit().await;
        let text = log.join("\n");
        assert_eq!(exited.code(), Some(1), "ps-server: {exited:?}\n{text}");
        let failed = lines_with(&log, "checkpoint failed").count();
        assert!(failed >= 2, "{text}");
        assert!(
            text.contains("checkpoint writes in a row failed, more than server.checkpoint_max_failures = 1"),
            "{text}"
        );
        // The run did not end as a success anywhere.
        assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
        println!(
            "process: checkpoints under a file: {failed} failed writes logged, ps-server exit code {:?}, workers: {} / {}",
            exited.code(),
            a.err().map(|e| e.to_string()).unwrap_or_default(),
            b.err().map(|e| e.to_string()).unwrap_or_default()
        );
    });
}

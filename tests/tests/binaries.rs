//! The real `ps-server`, `ps-worker` and `ps-data` binaries run as
//! processes, for what only a process shows:
//!
//! - the exit codes of a run that diverges (5) and of a job stopped by a
//!   bad sample under `data.on_bad_sample = "stop"` (6, on every worker
//!   process and on the server), each with its cause on stderr;
//! - `--metrics-addr 127.0.0.1:0`: each process logs the address it bound,
//!   and `GET /metrics` there answers with the documented `stratus_` series;
//! - output into a pipe whose reader is gone ends the command quietly with
//!   exit code 0, without a panic message.
//!
//! Nothing waits on a sleep: the tests wait on the children's log lines,
//! their stdout and their exits, each wait bounded by [`LIMIT`].
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ps_dataset::{synthetic, write_dataset_with, Layout, SyntheticSpec, WriteOptions};
use ps_shared::config::{ClusterConfig, CompressionKind, OnBadSample, TOKEN_ENV};
use ps_shared::sampler::EpochSampler;
use ps_tests::{
    config_file_with_certs, free_udp_port, profile_binary, server_binary, test_config,
    tls_files_under,
};

/// Upper bound on every wait, so a bug cannot hang the suite; not a
/// measure of speed.
const LIMIT: Duration = Duration::from_secs(300);

/// A child process whose stderr (and, when asked, stdout) lines the test
/// reads as they come.
struct Proc {
    name: String,
    child: Child,
    err: mpsc::Receiver<String>,
    out: Option<mpsc::Receiver<String>>,
    /// Every stderr line read so far.
    log: Vec<String>,
}

/// Forwards the lines of `from` to a channel, from a thread of its own.
fn lines_of(from: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Proc {
    fn start(name: &str, mut cmd: Command, read_stdout: bool) -> Self {
        cmd.stdin(Stdio::null()).stderr(Stdio::piped());
        cmd.stdout(if read_stdout {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let err = lines_of(child.stderr.take().expect("piped stderr"));
        let out = child.stdout.take().map(lines_of);
        Self {
            name: name.to_string(),
            child,
            err,
            out,
            log: Vec::new(),
        }
    }

    /// Reads stderr until a line contains `needle`; returns that line.
    fn wait_for(&mut self, needle: &str) -> String {
        loop {
            match self.err.recv_timeout(LIMIT) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "{} logged no `{needle}` ({e}):\n{}",
                    self.name,
                    self.log.join("\n")
                ),
            }
        }
    }

    /// The next line on stdout.
    fn next_stdout_line(&mut self) -> String {
        let out = self.out.as_ref().expect("stdout is read");
        out.recv_timeout(LIMIT)
            .unwrap_or_else(|e| panic!("{} printed nothing ({e})", self.name))
    }

    /// The address of the metrics endpoint, from the line the process logs
    /// when it binds it ("metrics on http://HOST:PORT/metrics").
    fn metrics_addr(&mut self) -> SocketAddr {
        let line = self.wait_for("metrics on http://");
        let start = line.find("http://").expect("a URL") + "http://".len();
        let rest = &line[start..];
        let end = rest.find("/metrics").expect("the /metrics path");
        rest[..end]
            .parse()
            .unwrap_or_else(|e| panic!("no address in `{line}`: {e}"))
    }

    fn signal(&self, name: &str) {
        // A process that already ended by itself is not an error here.
        let _ = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }

    /// Waits for the process to exit by itself (its stderr closes then);
    /// returns the status and every stderr line. No process may panic.
    fn exit(mut self) -> (ExitStatus, String) {
        loop {
            match self.err.recv_timeout(LIMIT) {
                Ok(line) => self.log.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    panic!("{} did not exit:\n{}", self.name, self.log.join("\n"));
                }
            }
        }
        let mut child = self.child;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        let status = rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("{} closed stderr but did not exit", self.name))
            .expect("reap the child");
        let log = self.log.join("\n");
        assert!(!log.contains("panicked"), "{}: {log}", self.name);
        (status, log)
    }
}

/// A cluster of one server on a free loopback port with `workers` workers,
/// written to `dir/cluster.toml` (token redacted: it travels in the
/// environment) with the certificates `ps-server certs` writes under
/// `dir/certs`, after `edit`.
struct Cluster {
    cfg: ClusterConfig,
    config: PathBuf,
    token: String,
}

impl Cluster {
    fn new(dir: &Path, workers: usize, edit: impl FnOnce(&mut ClusterConfig)) -> Self {
        let mut cfg = test_config(CompressionKind::Topk, 0.05, 3);
        cfg.cluster.workers = workers;
        cfg.cluster.servers = vec![format!("127.0.0.1:{}", free_udp_port())];
        cfg.server.heartbeat_secs = 0.25;
        cfg.server.connect_timeout_secs = 30;
        tls_files_under(&mut cfg, &dir.join("certs"));
        edit(&mut cfg);
        cfg.validate().expect("valid config");
        let config = config_file_with_certs(&cfg, dir);
        let token = cfg.cluster.token.clone();
        Self { cfg, config, token }
    }

    /// `bin --config <config>` with the token in the environment.
    fn command(&self, bin: &Path) -> Command {
        let mut cmd = Command::new(bin);
        cmd.env_remove("STRATUS_CONFIG")
            .env_remove("STRATUS_METRICS_ADDR")
            .env(TOKEN_ENV, &self.token)
            .env("NO_COLOR", "1")
            .arg("--config")
            .arg(&self.config);
        cmd
    }

    /// `ps-server run`, logging at info, started and listening.
    fn server(&self, args: &[&str]) -> Proc {
        let mut cmd = self.command(&server_binary());
        cmd.env("STRATUS_LOG", "info").args(args).arg("run");
        let mut server = Proc::start("ps-server", cmd, false);
        server.wait_for("ps-server listening");
        server
    }

    /// `ps-worker train --rank RANK`.
    fn worker(&self, rank: u32, args: &[&str], read_stdout: bool) -> Proc {
        let mut cmd = self.command(&profile_binary("ps-worker"));
        cmd.env("STRATUS_LOG", "info").args(args).args([
            "train",
            "--no-progress",
            "--rank",
            &rank.to_string(),
        ]);
        Proc::start(&format!("ps-worker rank {rank}"), cmd, read_stdout)
    }
}

/// Writes the synthetic set of `spec` to `dir/data` in `layout`; returns
/// its URL.
fn write_data(dir: &Path, spec: &SyntheticSpec, layout: Layout) -> String {
    let url = format!("file://{}", dir.join("data").display());
    std::fs::create_dir_all(dir.join("data")).expect("data dir");
    let (train, test) = synthetic(spec);
    let (store, prefix) = ps_dataset::open_bucket(&url).expect("the data folder");
    let options = WriteOptions {
        layout,
        records_per_shard: if layout == Layout::PerSample { 1 } else { 1024 },
    };
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    rt.block_on(write_dataset_with(
        store.as_ref(),
        &prefix,
        "synthetic",
        spec.features,
        spec.classes,
        &train,
        &test,
        &options,
    ))
    .expect("the dataset written");
    url
}

fn small_spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 2048,
        test: 256,
        ..SyntheticSpec::default()
    }
}

#[test]
fn a_diverging_run_exits_5_naming_the_loss() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = write_data(dir.path(), &small_spec(), Layout::Shards);
    // A learning rate this large sends the weights past what f32 holds
    // within a few steps: the loss becomes infinite or NaN, which the
    // worker checks after every forward pass.
    let cluster = Cluster::new(dir.path(), 1, |cfg| {
        cfg.data.url = url;
        cfg.optimizer.lr = 1e30;
    });
    let server = cluster.server(&[]);
    let worker = cluster.worker(0, &[], false);
    let (status, log) = worker.exit();
    assert_eq!(status.code(), Some(5), "{log}");
    assert!(log.contains("training diverged: loss is"), "{log}");
    let message = log
        .lines()
        .find(|l| l.contains("training diverged"))
        .unwrap_or_default()
        .to_string();
    // The server is not part of the claim: stop it.
    server.signal("TERM");
    let (server_status, server_log) = server.exit();
    println!(
        "diverged: ps-worker exit code {:?} ({message}); ps-server then stopped with SIGTERM: {:?}",
        status.code(),
        server_status.code()
    );
    assert!(server_status.code().is_some(), "{server_log}");
}

#[test]
fn a_bad_sample_under_stop_exits_6_on_every_process() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = SyntheticSpec {
        train: 4096,
        test: 512,
        ..SyntheticSpec::default()
    };
    let url = write_data(dir.path(), &spec, Layout::PerSample);
    let cluster = Cluster::new(dir.path(), 2, |cfg| {
        cfg.data.url = url;
        cfg.data.on_bad_sample = OnBadSample::Stop;
    });
    let cfg = &cluster.cfg;
    // One object per sample: delete the first one rank 1 trains at step 10
    // of epoch 0, which no other rank reads in that epoch.
    let world = cfg.cluster.workers;
    let plan = |rank| {
        EpochSampler::new(spec.train, world, rank, cfg.data.seed)
            .unwrap()
            .with_partition(cfg.data.partition)
            .plan(cfg.data.batch_size, cfg.training.epochs)
    };
    let sample = plan(1).batches_from(10)[0].samples[0];
    for rank in 0..world {
        let reads = plan(rank)
            .batches_from(0)
            .iter()
            .filter(|b| b.epoch == 0 && b.samples.contains(&sample))
            .count();
        assert_eq!(reads, usize::from(rank == 1), "rank {rank} in epoch 0");
    }
    let object = format!("{sample:08}.bin");
    let path = dir.path().join("data").join("train").join(&object);
    std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));

    let server = cluster.server(&[]);
    let workers: Vec<Proc> = (0..world as u32)
        .map(|rank| cluster.worker(rank, &[], false))
        .collect();
    let mut codes = Vec::new();
    for (rank, worker) in workers.into_iter().enumerate() {
        let (status, log) = worker.exit();
        assert_eq!(status.code(), Some(6), "rank {rank}:\n{log}");
        let line = log
            .lines()
            .find(|l| l.starts_with("ps-worker: error:"))
            .unwrap_or_else(|| panic!("rank {rank} said no error:\n{log}"));
        assert!(line.contains(&object), "rank {rank}: {line}");
        println!("rank {rank} exited {:?}: {line}", status.code());
        codes.push(status.code());
    }
    let (status, log) = server.exit();
    assert_eq!(status.code(), Some(6), "ps-server:\n{log}");
    let line = log
        .lines()
        .find(|l| l.starts_with("ps-server: "))
        .unwrap_or_else(|| panic!("ps-server said nothing at its end:\n{log}"));
    assert!(line.contains(&object), "{line}");
    println!(
        "job stopped by the missing {object}: workers exited {codes:?}, ps-server exited {:?}: {line}",
        status.code()
    );
}

/// The body of `GET /metrics` at `addr`, over plain TCP.
fn scrape(addr: SocketAddr) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    conn.set_read_timeout(Some(LIMIT)).expect("a read bound");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("send the request");
    let mut reply = String::new();
    conn.read_to_string(&mut reply).expect("read the reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    body.to_string()
}

/// The value of the first sample of `name` whose labels contain `label`.
fn sample(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            n == name && labels.contains(label)
        })
        .and_then(|(_, v)| v.parse().ok())
}

#[test]
fn metrics_addr_serves_the_documented_series_from_both_binaries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = write_data(dir.path(), &small_spec(), Layout::Shards);
    let cluster = Cluster::new(dir.path(), 1, |cfg| {
        cfg.data.url = url;
        cfg.training.epochs = 1000;
    });
    let mut server = {
        let mut cmd = cluster.command(&server_binary());
        cmd.env("STRATUS_LOG", "info")
            .args(["--metrics-addr", "127.0.0.1:0", "run"]);
        Proc::start("ps-server", cmd, false)
    };
    let server_addr = server.metrics_addr();
    server.wait_for("ps-server listening");
    let mut worker = cluster.worker(0, &["--metrics-addr", "127.0.0.1:0"], true);
    let worker_addr = worker.metrics_addr();
    assert_ne!(server_addr.port(), 0);
    assert_ne!(worker_addr.port(), 0);
    // The first epoch line on stdout: the worker has trained a whole epoch.
    let epoch = worker.next_stdout_line();
    let from_worker = scrape(worker_addr);
    let from_server = scrape(server_addr);
    let version = env!("CARGO_PKG_VERSION");
    for text in [&from_worker, &from_server] {
        assert_eq!(
            sample(
                text,
                "stratus_build_info",
                &format!("version=\"{version}\"")
            ),
            Some(1.0),
            "{text}"
        );
    }
    let steps = sample(&from_worker, "stratus_worker_steps_total", "rank=\"0\"")
        .unwrap_or_else(|| panic!("no worker steps in\n{from_worker}"));
    let per_epoch = (small_spec().train / cluster.cfg.data.batch_size) as f64;
    assert!(steps >= per_epoch, "{steps} steps after `{epoch}`");
    for name in [
        "stratus_worker_samples_total",
        "stratus_worker_loss",
        "stratus_worker_pushed_bytes_total",
    ] {
        assert!(
            sample(&from_worker, name, "").is_some(),
            "no {name} in\n{from_worker}"
        );
    }
    let updates = sample(&from_server, "stratus_server_updates_total", "shard=\"0\"")
        .unwrap_or_else(|| panic!("no server updates in\n{from_server}"));
    assert!(updates >= per_epoch, "{updates} updates after `{epoch}`");
    for name in [
        "stratus_server_pushes_total",
        "stratus_server_shard_version",
        "stratus_server_requests_total",
    ] {
        assert!(
            sample(&from_server, name, "").is_some(),
            "no {name} in\n{from_server}"
        );
    }
    // The series move while the run goes on: a second scrape, after the
    // second epoch line, reads more than the first did, and at least two
    // epochs' worth of steps, samples, updates, pushes and shard versions.
    // (The run goes on between an epoch line and its scrape, so the first
    // scrape may already count steps of the second epoch.)
    let epoch2 = worker.next_stdout_line();
    let again_worker = scrape(worker_addr);
    let again_server = scrape(server_addr);
    let two_epochs_samples = 2.0 * (per_epoch as usize * cluster.cfg.data.batch_size) as f64;
    let two_epochs = 2.0 * per_epoch;
    for (text, before, name, label, at_least) in [
        (
            &again_worker,
            &from_worker,
            "stratus_worker_steps_total",
            "rank=\"0\"",
            two_epochs,
        ),
        (
            &again_worker,
            &from_worker,
            "stratus_worker_samples_total",
            "",
            two_epochs_samples,
        ),
        (
            &again_worker,
            &from_worker,
            "stratus_worker_pushed_bytes_total",
            "",
            1.0,
        ),
        (
            &again_server,
            &from_server,
            "stratus_server_updates_total",
            "shard=\"0\"",
            two_epochs,
        ),
        (
            &again_server,
            &from_server,
            "stratus_server_pushes_total",
            "",
            two_epochs,
        ),
        (
            &again_server,
            &from_server,
            "stratus_server_shard_version",
            "shard=\"0\"",
            two_epochs,
        ),
    ] {
        let first = sample(before, name, label).unwrap_or_else(|| panic!("no {name}"));
        let second = sample(text, name, label).unwrap_or_else(|| panic!("no {name} in\n{text}"));
        assert!(
            second > first && second >= at_least,
            "{name}{{{label}}} went from {first} to {second} between `{epoch}` and `{epoch2}` (more, and at least {at_least}, expected)"
        );
    }
    let steps2 = sample(&again_worker, "stratus_worker_steps_total", "rank=\"0\"").unwrap_or(0.0);
    let updates2 =
        sample(&again_server, "stratus_server_updates_total", "shard=\"0\"").unwrap_or(0.0);
    // 1000 epochs cannot end by themselves here: SIGTERM stops the worker
    // after its current step, and its exit code says so.
    worker.signal("TERM");
    let (worker_status, worker_log) = worker.exit();
    assert_eq!(worker_status.code(), Some(143), "{worker_log}");
    // The worker said goodbye on its way out, and with every worker gone
    // that way the server may end by itself (0) before its own SIGTERM
    // arrives (143); either way it says why.
    server.signal("TERM");
    let (server_status, server_log) = server.exit();
    match server_status.code() {
        Some(143) => assert!(server_log.contains("stopped by SIGTERM"), "{server_log}"),
        Some(0) => assert!(server_log.contains("1 stopped"), "{server_log}"),
        other => panic!("ps-server exited {other:?}:\n{server_log}"),
    }
    println!(
        "--metrics-addr 127.0.0.1:0: ps-server bound {server_addr}, ps-worker bound {worker_addr}; scraped after `{epoch}`: {steps} worker steps, {updates} shard-0 updates; after `{epoch2}`: {steps2} and {updates2}; SIGTERM: the worker exited {:?}, the server {:?}",
        worker_status.code(),
        server_status.code()
    );
}

/// Runs `cmd` with its stdout on a pipe whose reader is already closed, so
/// the first write fails with a broken pipe; returns the output (stderr).
fn into_closed_pipe(mut cmd: Command) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    cmd.stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("start the binary");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    rx.recv_timeout(LIMIT)
        .expect("the binary exits")
        .expect("its output")
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = format!("file://{}", dir.path().join("synthetic").display());
    let worker = profile_binary("ps-worker");
    let server = server_binary();
    let ps_data = profile_binary("ps-data");
    let runs: Vec<(String, Command)> = vec![
        ("ps-worker --dev show-config".into(), {
            let mut c = Command::new(&worker);
            c.args(["--dev", "show-config"]);
            c
        }),
        ("ps-server --dev show-config".into(), {
            let mut c = Command::new(&server);
            c.args(["--dev", "show-config"]);
            c
        }),
        ("ps-worker --help".into(), {
            let mut c = Command::new(&worker);
            c.arg("--help");
            c
        }),
        ("ps-server --help".into(), {
            let mut c = Command::new(&server);
            c.arg("--help");
            c
        }),
        ("ps-data --help".into(), {
            let mut c = Command::new(&ps_data);
            c.arg("--help");
            c
        }),
        (format!("ps-data synthetic --out {data}"), {
            let mut c = Command::new(&ps_data);
            c.args([
                "synthetic",
                "--out",
                &data,
                "--train",
                "256",
                "--test",
                "64",
            ]);
            c
        }),
    ];
    for (what, mut cmd) in runs {
        cmd.env_remove("STRATUS_CONFIG")
            .env_remove("STRATUS_LOG")
            .env("NO_COLOR", "1");
        let out = into_closed_pipe(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{what}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "{what}: {stderr}");
        println!(
            "{what} | (closed pipe): exit code {:?}, stderr {:?}",
            out.status.code(),
            stderr
        );
    }
    // The dataset was written although its summary went nowhere.
    assert!(dir.path().join("synthetic").join("manifest.json").exists());
}

//! How `ps-worker train` ends, run as a process: each documented exit code
//! that a process can reach without a cluster (a bad config, bad TLS files,
//! an unreachable server, a bucket outage past its budget, SIGTERM during
//! an outage), with the real cause on stderr and never a panic.
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ps_net::pki::{ensure_cluster_pki, Existing, PkiPaths};
use ps_shared::config::ClusterConfig;

const BIN: &str = env!("CARGO_BIN_EXE_ps-worker");
/// Upper bound on one run of the binary: a safety net so a bug cannot hang
/// the suite, not a measure of speed.
const RUN_BOUND: Duration = Duration::from_secs(120);

/// A cluster config with certificates under `dir` (written here) and one
/// server at `server`; `edit` changes it before it is written.
fn write_config(dir: &Path, server: &str, edit: impl FnOnce(&mut ClusterConfig)) -> PathBuf {
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    let paths = PkiPaths::under(&certs);
    ensure_cluster_pki(&paths, &["localhost".into()], 2, Existing::Replace).expect("certs");
    let mut cfg = ClusterConfig::embedded_default().expect("embedded config");
    cfg.cluster.servers = vec![server.to_string()];
    cfg.tls.ca = paths.ca_cert.clone();
    cfg.tls.ca_key = paths.ca_key.clone();
    cfg.tls.cert = paths.server_cert.clone();
    cfg.tls.key = paths.server_key.clone();
    cfg.tls.worker_cert = paths.worker_cert.clone();
    cfg.tls.worker_key = paths.worker_key.clone();
    cfg.training.metrics_dir = String::new();
    cfg.data.url = "memory://".into();
    edit(&mut cfg);
    cfg.validate().expect("valid config");
    let path = dir.join("cluster.toml");
    let mut text = cfg.to_redacted_toml().expect("toml");
    text = text.replace("<redacted>", "exits-test-token");
    std::fs::write(&path, text).expect("write config");
    path
}

fn ps_worker(config: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("STRATUS_CONFIG")
        .env_remove("STRATUS_TOKEN")
        .env("STRATUS_LOG", "warn")
        .env("NO_COLOR", "1")
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Run to the end (bounded) and return the output.
fn run(mut cmd: Command) -> Output {
    let child = cmd.spawn().expect("start ps-worker");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(RUN_BOUND) {
        Ok(output) => output.expect("ps-worker ran"),
        Err(_) => panic!("ps-worker (pid {pid}) did not exit within {RUN_BOUND:?}"),
    }
}

/// The exit code and stderr; no run may panic.
fn ended(output: &Output) -> (i32, String) {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (output.status.code().unwrap_or(-1), stderr)
}

/// A loopback UDP port with nothing listening on it.
fn closed_port() -> String {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a free port");
    socket.local_addr().expect("its address").to_string()
}

/// A small synthetic dataset (512 train + 128 test samples) under `dir`.
fn write_dataset(dir: &Path) -> String {
    let url = format!("file://{}", dir.join("data").display());
    let spec = ps_dataset::SyntheticSpec {
        train: 512,
        test: 128,
        ..ps_dataset::SyntheticSpec::default()
    };
    let (train, test) = ps_dataset::synthetic(&spec);
    let (store, prefix) = ps_dataset::open_bucket(&url).expect("the dataset folder");
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    rt.block_on(ps_dataset::write_dataset(
        store.as_ref(),
        &prefix,
        "synthetic",
        spec.features,
        spec.classes,
        &train,
        &test,
        1024,
    ))
    .expect("the dataset written");
    url
}

#[test]
fn the_help_lists_the_exit_codes() {
    let out = run({
        let mut cmd = Command::new(BIN);
        cmd.arg("--help").stdout(Stdio::piped());
        cmd
    });
    let help = String::from_utf8_lossy(&out.stdout);
    for line in [
        "Exit codes:",
        "2    invalid config",
        "4    the data bucket",
        "143  stopped by SIGTERM",
    ] {
        assert!(help.contains(line), "{line} missing from:\n{help}");
    }
}

#[test]
fn a_time_field_out_of_range_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &closed_port(), |_| {});
    let text = std::fs::read_to_string(&config).unwrap();
    let bad = text.replace("heartbeat_secs = 1.0", "heartbeat_secs = 1e-10");
    assert_ne!(bad, text, "the config names heartbeat_secs");
    std::fs::write(&config, bad).unwrap();
    let (code, stderr) = ended(&run(ps_worker(&config)));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("server.heartbeat_secs = 1e-10 is out of range 0.01..=600"),
        "{stderr}"
    );
}

#[test]
fn bad_tls_files_exit_2_with_the_real_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &closed_port(), |_| {});
    let certs = dir.path().join("certs");
    // A key that belongs to another certificate.
    std::fs::copy(certs.join("worker-1.key"), certs.join("worker-0.key")).unwrap();
    let (code, stderr) = ended(&run(ps_worker(&config)));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("TLS") && stderr.contains("worker-0.key"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("could not reach"),
        "refused before dialling: {stderr}"
    );
    // A CA that is not PEM.
    let config = write_config(dir.path(), &closed_port(), |_| {});
    std::fs::write(certs.join("ca.pem"), "not a certificate\n").unwrap();
    let (code, stderr) = ended(&run(ps_worker(&config)));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("ca.pem"), "{stderr}");
}

#[test]
fn an_unreachable_server_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let url = write_dataset(dir.path());
    let config = write_config(dir.path(), &closed_port(), |cfg| {
        cfg.server.connect_timeout_secs = 1;
        cfg.data.url = url;
    });
    let (code, stderr) = ended(&run(ps_worker(&config)));
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("could not reach server"), "{stderr}");
}

/// A worker whose bucket is an S3 endpoint that refuses every connection.
fn outage_worker(config: &Path) -> Command {
    let mut cmd = ps_worker(config);
    cmd.env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "id")
        .env("AWS_SECRET_ACCESS_KEY", "secret")
        .env("AWS_ENDPOINT", "http://127.0.0.1:9")
        .env("AWS_ALLOW_HTTP", "true");
    cmd
}

#[test]
fn a_bucket_outage_past_its_budget_exits_4() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &closed_port(), |cfg| {
        cfg.data.url = "s3://stratus-exits/ds".into();
        cfg.loader.outage_budget_s = 0.5;
    });
    let (code, stderr) = ended(&run(outage_worker(&config)));
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains("the bucket stayed unreachable"), "{stderr}");
}

/// Kill `child` with SIGTERM.
fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
}

/// Start `cmd`, wait for a stderr line containing `ready` (the event that
/// says the worker is in the wait under test), send SIGTERM, and return
/// the exit status and every stderr line.
fn sigterm_once(mut cmd: Command, ready: &str) -> (std::process::ExitStatus, String) {
    let mut child = cmd.spawn().expect("start ps-worker");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    loop {
        match lines.recv_timeout(RUN_BOUND) {
            Ok(line) => {
                let seen = line.contains(ready);
                log.push(line);
                if seen {
                    break;
                }
            }
            Err(e) => {
                let _ = child.kill();
                panic!("no `{ready}` logged ({e}):\n{}", log.join("\n"));
            }
        }
    }
    sigterm(&child);
    while let Ok(line) = lines.recv_timeout(RUN_BOUND) {
        log.push(line);
    }
    let (tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = done
        .recv_timeout(RUN_BOUND)
        .expect("ps-worker exits after SIGTERM")
        .expect("reap ps-worker");
    let log = log.join("\n");
    assert!(!log.contains("panicked"), "{log}");
    (status, log)
}

#[test]
fn sigterm_during_a_bucket_outage_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &closed_port(), |cfg| {
        cfg.data.url = "s3://stratus-exits/ds".into();
        // Far beyond the test's bound: only the signal can end the wait.
        cfg.loader.outage_budget_s = 3600.0;
    });
    // The event: the worker logs the outage it waits out.
    let (status, log) = sigterm_once(outage_worker(&config), "bucket unreachable");
    assert_eq!(status.code(), Some(143), "{log}");
    assert!(
        log.contains("stopped by a signal at step 0 while waiting for the dataset manifest"),
        "{log}"
    );
}

#[test]
fn sigterm_while_a_server_is_redialled_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let url = write_dataset(dir.path());
    let config = write_config(dir.path(), &closed_port(), |cfg| {
        // Far beyond the test's bound: only the signal can end the wait.
        cfg.server.connect_timeout_secs = 3600;
        cfg.data.url = url;
    });
    let mut cmd = ps_worker(&config);
    cmd.env("STRATUS_LOG", "warn,ps_worker::comm=debug");
    // The event: the worker logs a failed dial it will retry.
    let (status, log) = sigterm_once(cmd, "connect failed, retrying");
    assert_eq!(status.code(), Some(143), "{log}");
    assert!(
        log.contains("stopped by a signal at step 0 while waiting for the servers (joining)"),
        "{log}"
    );
}

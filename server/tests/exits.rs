//! How `ps-server` ends, run as a process: start-up errors (a port in use,
//! a CA that is not PEM, a key that does not match its certificate, a
//! value out of its range) exit 2 with the real message and no panic, and
//! SIGTERM exits 143 after the shards stopped.
#![cfg(unix)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc;

use ps_shared::config::ClusterConfig;

use common::{certs_under, command, run_bounded, RUN_BOUND};

const TOKEN: &str = "exits-test-token";

/// A one-worker config on `addr` whose certificates `ps-server certs`
/// writes into `dir`; a start does not create missing ones.
fn write_config(dir: &Path, addr: &str) -> PathBuf {
    let mut cfg = ClusterConfig::embedded_default().expect("embedded config");
    cfg.cluster.servers = vec![addr.to_string()];
    cfg.cluster.workers = 1;
    certs_under(&mut cfg, dir);
    cfg.tls.generate_if_missing = false;
    cfg.validate().expect("valid config");
    let path = dir.join("cluster.toml");
    std::fs::write(&path, cfg.to_redacted_toml().expect("toml")).expect("write config");
    let certs_made = ps_server(&path, &["certs"]);
    assert!(certs_made.status.success(), "{certs_made:?}");
    path
}

/// Run the binary with `args` and wait for it to exit (bounded).
fn ps_server(config: &Path, args: &[&str]) -> Output {
    run_bounded(command(config, args, TOKEN), &format!("{args:?}"))
}

/// The exit code and stderr of a run that must not panic.
fn ended(output: &Output) -> (i32, String) {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("Cannot drop a runtime"), "{stderr}");
    (output.status.code().unwrap_or(-1), stderr)
}

fn free_addr() -> String {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a free port");
    socket.local_addr().expect("its address").to_string()
}

#[test]
fn a_port_in_use_exits_2_with_the_bind_error() {
    let dir = tempfile::tempdir().unwrap();
    let busy = std::net::UdpSocket::bind("127.0.0.1:0").expect("a port to hold");
    let addr = busy.local_addr().unwrap().to_string();
    let config = write_config(dir.path(), &addr);
    let (code, stderr) = ended(&ps_server(&config, &["run"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains(&format!("cannot bind {addr}")), "{stderr}");
    drop(busy);
}

#[test]
fn bad_tls_files_exit_2_with_the_real_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &free_addr());
    let certs = dir.path().join("certs");
    std::fs::write(certs.join("ca.pem"), "not a certificate\n").unwrap();
    let (code, stderr) = ended(&ps_server(&config, &["run"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("TLS setup failed") && stderr.contains("ca.pem"),
        "{stderr}"
    );

    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &free_addr());
    let certs = dir.path().join("certs");
    std::fs::copy(certs.join("worker-0.key"), certs.join("server.key")).unwrap();
    let (code, stderr) = ended(&ps_server(&config, &["run"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("TLS setup failed") && stderr.contains("server.key"),
        "{stderr}"
    );
}

#[test]
fn a_time_field_out_of_range_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &free_addr());
    let text = std::fs::read_to_string(&config).unwrap();
    let bad = text.replace(
        "request_timeout_secs = 120.0",
        "request_timeout_secs = 1e19",
    );
    assert_ne!(bad, text, "the config names request_timeout_secs");
    std::fs::write(&config, bad).unwrap();
    let (code, stderr) = ended(&ps_server(&config, &["run"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("server.request_timeout_secs = 1e19 is out of range 0.1..=86400"),
        "{stderr}"
    );
    let help = ps_server(&config, &["--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("Exit codes:") && help.contains("143  stopped by SIGTERM"),
        "{help}"
    );
}

#[test]
fn sigterm_exits_143_after_stopping_the_shards() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &free_addr());
    let mut child = command(&config, &["run"], TOKEN)
        .spawn()
        .expect("start ps-server");
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
                let listening = line.contains("ps-server listening");
                log.push(line);
                if listening {
                    break;
                }
            }
            Err(e) => {
                let _ = child.kill();
                panic!("ps-server never listened ({e}):\n{}", log.join("\n"));
            }
        }
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(kill.success());
    while let Ok(line) = lines.recv_timeout(RUN_BOUND) {
        log.push(line);
    }
    let (tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = done
        .recv_timeout(RUN_BOUND)
        .expect("ps-server exits after SIGTERM")
        .expect("reap ps-server");
    let log = log.join("\n");
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(status.code(), Some(143), "{log}");
    assert!(log.contains("ps-server: stopped by SIGTERM"), "{log}");
}

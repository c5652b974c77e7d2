//! What the `ps-server` process tests share: the binary, a bounded run, and
//! a config whose certificates live in a test's own directory.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ps_shared::config::{ClusterConfig, TOKEN_ENV};

pub const BIN: &str = env!("CARGO_BIN_EXE_ps-server");
/// Upper bound on one run of the binary: a safety net so a bug cannot hang
/// the suite, not a measure of speed.
pub const RUN_BOUND: Duration = Duration::from_secs(120);

/// The binary on `config` with `args`, the token in the environment (as in
/// a real deployment), logs at info without colour, output captured.
pub fn command(config: &Path, args: &[&str], token: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("--config")
        .arg(config)
        .args(args)
        .env(TOKEN_ENV, token)
        .env("STRATUS_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Run `cmd` and wait for it to exit (bounded by [`RUN_BOUND`]).
pub fn run_bounded(mut cmd: Command, what: &str) -> Output {
    let child = cmd.spawn().expect("start ps-server");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(RUN_BOUND) {
        Ok(output) => output.expect("ps-server ran"),
        Err(_) => panic!("ps-server {what} (pid {pid}) did not exit within {RUN_BOUND:?}"),
    }
}

/// Point every certificate and key of `cfg` into `dir/certs`.
pub fn certs_under(cfg: &mut ClusterConfig, dir: &Path) {
    let certs = dir.join("certs");
    let file = |name: &str| certs.join(name);
    cfg.tls.ca = file("ca.pem");
    cfg.tls.ca_key = file("ca.key");
    cfg.tls.cert = file("server.pem");
    cfg.tls.key = file("server.key");
    cfg.tls.worker_cert = file("worker-{rank}.pem").display().to_string();
    cfg.tls.worker_key = file("worker-{rank}.key").display().to_string();
}

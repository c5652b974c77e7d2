//! The `ps-server` binary's certificate handling, run as a process:
//! `ps-server certs --name` writes the cluster's certificates, and a server
//! start with `tls.generate_if_missing` keeps them as they are (the extra
//! name included) and creates only what is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use ps_shared::config::ClusterConfig;

use common::{certs_under, command, run_bounded};

/// A one-worker config whose certificates live in `dir`, for a server that
/// gives up at once when no worker joins.
fn write_config(dir: &Path) -> PathBuf {
    let mut cfg = ClusterConfig::embedded_default().expect("embedded config");
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a free port");
    cfg.cluster.servers = vec![socket.local_addr().unwrap().to_string()];
    drop(socket);
    cfg.cluster.workers = 1;
    cfg.server.join_timeout_secs = 0.5;
    certs_under(&mut cfg, dir);
    cfg.tls.generate_if_missing = true;
    cfg.validate().expect("valid config");
    let path = dir.join("cluster.toml");
    // The token reaches the process through the environment, as in a real
    // deployment.
    std::fs::write(&path, cfg.to_redacted_toml().expect("toml")).expect("write config");
    path
}

/// Run the binary with `args` and wait for it to exit (bounded).
fn ps_server(config: &Path, args: &[&str]) -> Output {
    run_bounded(
        command(config, args, "cli-test-token"),
        &format!("{args:?}"),
    )
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_start_keeps_the_certificates_and_their_extra_names() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());
    let certs = dir.path().join("certs");

    let issued = ps_server(&config, &["certs", "--name", "ps-0.example"]);
    assert!(issued.status.success(), "{}", text(&issued.stderr));
    let wrote = text(&issued.stdout)
        .lines()
        .filter(|l| l.starts_with("wrote "))
        .count();
    assert_eq!(wrote, 6, "{}", text(&issued.stdout));
    let files = [
        "ca.pem",
        "ca.key",
        "server.pem",
        "server.key",
        "worker-0.pem",
        "worker-0.key",
    ];
    let before: Vec<String> = files.iter().map(|f| read(&certs.join(f))).collect();

    // A start: nothing is generated, nothing changes; no worker comes, so
    // the server ends with the join timeout.
    let start = ps_server(&config, &["run"]);
    let log = text(&start.stderr);
    assert_eq!(start.status.code(), Some(1), "{log}");
    assert!(log.contains("no worker joined"), "{log}");
    assert!(!log.contains("generated"), "{log}");
    let after: Vec<String> = files.iter().map(|f| read(&certs.join(f))).collect();
    assert_eq!(before, after, "a start changed the certificates");
    // `certs` again, without the --name: the certificate with the extra
    // name is still good.
    let again = ps_server(&config, &["certs"]);
    assert!(again.status.success(), "{}", text(&again.stderr));
    let kept = text(&again.stdout)
        .lines()
        .filter(|l| l.starts_with("kept "))
        .count();
    assert_eq!(kept, 6, "{}", text(&again.stdout));

    // A lost worker key: a start issues that pair only.
    std::fs::remove_file(certs.join("worker-0.key")).unwrap();
    let start = ps_server(&config, &["run"]);
    let log = text(&start.stderr);
    assert_eq!(start.status.code(), Some(1), "{log}");
    let generated: Vec<&str> = log.lines().filter(|l| l.contains("generated")).collect();
    assert_eq!(generated.len(), 2, "{log}");
    assert!(generated.iter().all(|l| l.contains("worker-0.")), "{log}");
    for (name, old) in files.iter().zip(&before) {
        if !name.starts_with("worker-0") {
            assert_eq!(&read(&certs.join(name)), old, "{name} changed");
        }
    }
    println!(
        "cli: certs wrote {wrote} files; a start kept all of them (extra name included), `certs` kept {kept}; after a lost key a start generated {} files",
        generated.len()
    );
}

//! How `ps-server` finds its config, run as a process: none without
//! --config or --dev (exit 2), `--dev` named on stderr, `STRATUS__...`
//! overrides visible in `show-config`.
#![cfg(unix)]

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ps-server");

fn ps_server(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("STRATUS_CONFIG").env_remove("STRATUS_TOKEN");
    for (name, _) in std::env::vars() {
        if name.starts_with("STRATUS__") {
            cmd.env_remove(name);
        }
    }
    cmd.env("STRATUS_LOG", "info")
        .env("NO_COLOR", "1")
        .args(args)
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // show-config ends before any network access.
    cmd.output().expect("run ps-server")
}

#[test]
fn without_config_or_dev_it_exits_2() {
    let out = ps_server(&["show-config"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--config FILE") && stderr.contains("--dev"),
        "{stderr}"
    );
}

#[test]
fn dev_with_an_override_shows_the_effect() {
    let out = ps_server(
        &["--dev", "show-config"],
        &[("STRATUS__SERVER__HEARTBEAT_SECS", "2.5")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("embedded development config"), "{stderr}");
    assert!(
        stderr.contains("STRATUS__SERVER__HEARTBEAT_SECS"),
        "{stderr}"
    );
    assert!(stdout.contains("heartbeat_secs = 2.5"), "{stdout}");
}

//! How `ps-worker` finds its config and rank, run as a process: no config
//! without --config or --dev, `STRATUS__...` overrides visible in
//! `show-config`, a misspelt override and a WORLD_SIZE that disagrees with
//! the config refused with exit code 2.
#![cfg(unix)]

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ps-worker");

/// The binary with a clean launch environment and `vars` set.
fn ps_worker(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    for name in [
        "STRATUS_CONFIG",
        "STRATUS_TOKEN",
        "STRATUS_RANK",
        "STRATUS_NODE",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "JOB_COMPLETION_INDEX",
    ] {
        cmd.env_remove(name);
    }
    for (name, _) in std::env::vars() {
        if name.starts_with("STRATUS__") {
            cmd.env_remove(name);
        }
    }
    cmd.env("STRATUS_LOG", "warn")
        .env("NO_COLOR", "1")
        .args(args)
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // These commands end before any network or data access.
    cmd.output().expect("run ps-worker")
}

fn ended(out: &Output) -> (i32, String, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

#[test]
fn without_config_or_dev_it_exits_2_saying_what_to_pass() {
    for args in [&["show-config"][..], &["train"], &[]] {
        let (code, _, stderr) = ended(&ps_worker(args, &[]));
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains("--config FILE") && stderr.contains("--dev"),
            "{stderr}"
        );
    }
    let (code, _, stderr) = ended(&ps_worker(
        &["--dev", "--config", "x.toml", "show-config"],
        &[],
    ));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("both --dev and --config x.toml"),
        "{stderr}"
    );
}

#[test]
fn dev_is_named_and_overrides_show_in_show_config() {
    let (code, stdout, stderr) = ended(&ps_worker(
        &["--dev", "show-config"],
        &[
            ("STRATUS__OPTIMIZER__LR", "0.0625"),
            ("STRATUS__TRAINING__EPOCHS", "7"),
        ],
    ));
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("embedded development config"), "{stderr}");
    assert!(stdout.contains("lr = 0.0625"), "{stdout}");
    assert!(stdout.contains("epochs = 7\n"), "{stdout}");
}

#[test]
fn a_misspelt_override_exits_2_naming_the_variable() {
    let (code, _, stderr) = ended(&ps_worker(
        &["--dev", "show-config"],
        &[("STRATUS__OPTIMIZER__LEARNING_RATE", "0.1")],
    ));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("STRATUS__OPTIMIZER__LEARNING_RATE")
            && stderr.contains("`optimizer` has no field `learning_rate`"),
        "{stderr}"
    );
}

#[test]
fn a_world_size_that_disagrees_exits_2_naming_both() {
    let (code, _, stderr) = ended(&ps_worker(
        &["--dev", "train"],
        &[("WORLD_SIZE", "7"), ("RANK", "0")],
    ));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("WORLD_SIZE = 7 (from the environment)")
            && stderr.contains("cluster.workers = 2 (from the config)"),
        "{stderr}"
    );
}

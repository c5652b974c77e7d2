//! `ps-data synthetic`, `mnist` and `images` refuse to write over an
//! existing dataset unless given `--overwrite`, as `import` and `text` do,
//! and the dataset already there is left as it was.

use std::path::Path;
use std::process::Command;

fn ps_data(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ps-data"))
        .args(args)
        .output()
        .expect("run ps-data");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs `args` then `args --overwrite` on the dataset `first` wrote to
/// `dir`: the first is refused with the manifest unchanged, the second
/// replaces it.
fn refused_then_overwritten(dir: &Path, args: &[&str]) {
    let manifest = dir.join("manifest.json");
    let before = std::fs::read(&manifest).expect("the first dataset's manifest");
    let (ok, text) = ps_data(args);
    assert!(!ok, "writing over a dataset succeeded: {text}");
    assert!(text.contains("already holds a dataset"), "{text}");
    assert!(text.contains("--overwrite"), "{text}");
    assert_eq!(
        std::fs::read(&manifest).unwrap(),
        before,
        "manifest changed"
    );
    let mut again = args.to_vec();
    again.push("--overwrite");
    let (ok, text) = ps_data(&again);
    assert!(ok, "{text}");
    assert!(manifest.exists());
}

#[test]
fn synthetic_needs_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("syn");
    let url = format!("file://{}", dir.display());
    let first = ["synthetic", "--train", "64", "--test", "16", "--out", &url];
    let (ok, text) = ps_data(&first);
    assert!(ok, "{text}");
    // A different seed: a write that went through would change the manifest.
    let second = [
        "synthetic",
        "--train",
        "32",
        "--test",
        "8",
        "--seed",
        "9",
        "--out",
        &url,
    ];
    refused_then_overwritten(&dir, &second);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["train"]["num_samples"], 32, "{manifest}");
}

#[test]
fn mnist_needs_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("digits.csv");
    let mut text = String::from("label");
    for i in 0..784 {
        text.push_str(&format!(",p{i}"));
    }
    text.push('\n');
    for row in 0..6 {
        text.push_str(&(row % 10).to_string());
        for i in 0..784 {
            text.push_str(&format!(",{}", (row * 31 + i) % 256));
        }
        text.push('\n');
    }
    std::fs::write(&csv, text).unwrap();
    let dir = tmp.path().join("mnist");
    let url = format!("file://{}", dir.display());
    let csv = csv.to_str().unwrap();
    let args = ["mnist", "--csv", csv, "--test", "2", "--out", &url];
    let (ok, out) = ps_data(&args);
    assert!(ok, "{out}");
    refused_then_overwritten(&dir, &args);
}

#[test]
fn images_needs_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shapes");
    let url = format!("file://{}", dir.display());
    let args = [
        "images",
        "--synthetic",
        "20",
        "--test",
        "4",
        "--size",
        "8",
        "--out",
        &url,
    ];
    let (ok, out) = ps_data(&args);
    assert!(ok, "{out}");
    refused_then_overwritten(&dir, &args);
}

//! Runs the real `ps-data import` on small CSV files.

use std::process::Command;

fn ps_data() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ps-data"));
    cmd.env_remove("STRATUS_CONFIG").env_remove("STRATUS_LOG");
    cmd
}

/// 60 rows, 64 features, label column `target` in the middle, 3 classes.
fn digits_csv() -> String {
    let mut header: Vec<String> = (0..64).map(|j| format!("pixel{j}")).collect();
    header.insert(10, "target".into());
    let mut out = header.join(",") + "\n";
    for i in 0..60 {
        let mut row: Vec<String> = (0..64).map(|j| ((i + j) % 17).to_string()).collect();
        row.insert(10, (i % 3).to_string());
        out += &(row.join(",") + "\n");
    }
    out
}

#[test]
fn import_csv_with_a_header() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("digits.csv");
    std::fs::write(&csv, digits_csv()).unwrap();
    let out = dir.path().join("bucket/digits");
    let result = ps_data()
        .args([
            "import",
            "--label-column",
            "target",
            "--test-fraction",
            "0.2",
        ])
        .args([
            "--seed",
            "5",
            "--normalize",
            "scale:16",
            "--records-per-shard",
            "16",
        ])
        .arg("--train")
        .arg(&csv)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        stdout.contains("48 train + 12 test samples, 64 features, 3 classes"),
        "{stdout}"
    );
    assert!(stdout.contains(&out.display().to_string()), "{stdout}");

    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["format"], 1);
    assert_eq!(manifest["layout"], "shards");
    assert_eq!(manifest["name"], "digits");
    assert_eq!(manifest["features"], 64);
    assert_eq!(manifest["classes"], 3);
    assert_eq!(manifest["record_bytes"], 4 + 4 * 64);
    assert_eq!(manifest["train"]["num_samples"], 48);
    assert_eq!(manifest["test"]["num_samples"], 12);
    assert_eq!(manifest["train"]["shards"].as_array().unwrap().len(), 3);
    assert_eq!(manifest["train"]["shards"][2]["first"], 32);
    assert_eq!(manifest["normalization"]["kind"], "scale");
    assert_eq!(manifest["normalization"]["divisor"], 16.0);
    let shard = std::fs::read(out.join("train/shard-00000.bin")).unwrap();
    assert_eq!(shard.len(), 16 * 260);
    // Every record: a label below 3, then pixels (0..=16) / 16.
    for record in shard.chunks(260) {
        assert!(u32::from_le_bytes(record[..4].try_into().unwrap()) < 3);
        for v in record[4..].chunks(4) {
            let v = f32::from_le_bytes(v.try_into().unwrap()) * 16.0;
            assert!(v.fract() == 0.0 && (0.0..=16.0).contains(&v), "{v}");
        }
    }

    // Importing again over it needs --overwrite; the old dataset stays.
    let again = |extra: &[&str]| {
        ps_data()
            .args(["import", "--label-column", "target"])
            .args(extra)
            .arg("--train")
            .arg(&csv)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap()
    };
    let refused = again(&[]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--overwrite"));
    assert!(out.join("manifest.json").exists());
    let replaced = again(&["--overwrite"]);
    assert!(replaced.status.success());
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["train"]["num_samples"], 60);
    assert!(manifest.get("normalization").is_none());
}

#[test]
fn a_bad_row_fails_before_writing_and_leaves_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("bad.csv");
    std::fs::write(&csv, "label,a,b\n0,1,2\n1,NaN,3\n").unwrap();
    let out = dir.path().join("never");
    let result = ps_data()
        .args(["import", "--train"])
        .arg(&csv)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success());
    assert!(stderr.contains("bad.csv:3:"), "{stderr}");
    assert!(stderr.contains("column 2 (`a`)"), "{stderr}");
    assert!(!out.exists(), "{stderr}");
}

#[test]
fn help_lists_the_import_options() {
    let result = ps_data().args(["import", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&result.stdout);
    for option in [
        "--train",
        "--test-fraction",
        "--label-column-index",
        "--normalize",
        "--x-key",
        "stratified",
    ] {
        assert!(help.contains(option), "{option} missing from:\n{help}");
    }
}

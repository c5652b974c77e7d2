//! The Grafana dashboard under deploy/grafana queries only series that
//! docs/observability.md documents, so a renamed metric cannot leave a
//! panel silently empty.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// Every `stratus_...` name in `text`, with a histogram's `_sum`, `_count`
/// and `_bucket` suffixes taken off.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("stratus_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = &tail[..end];
        for suffix in ["_bucket", "_count", "_sum"] {
            if let Some(base) = name.strip_suffix(suffix) {
                name = base;
            }
        }
        names.insert(name.to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn every_dashboard_query_names_a_documented_series() {
    let path = repo().join("deploy/grafana/stratus.json");
    let text = std::fs::read_to_string(&path).expect("deploy/grafana/stratus.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    let mut queried = BTreeSet::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets of every panel");
        assert!(
            !targets.is_empty(),
            "panel {} queries nothing",
            panel["title"]
        );
        for t in targets {
            let expr = t["expr"].as_str().expect("an expr");
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{expr} queries no stratus series");
            queried.extend(names);
        }
    }
    let docs = std::fs::read_to_string(repo().join("docs/observability.md")).expect("docs");
    let documented = metric_names(&docs);
    let missing: Vec<&String> = queried.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "queried but not documented: {missing:?}"
    );
    println!(
        "dashboard: {} panels query {} documented series",
        panels.len(),
        queried.len()
    );
}

#[test]
fn histogram_suffixes_are_taken_off() {
    let names = metric_names("rate(stratus_worker_step_seconds_sum[1m]) / stratus_x_count");
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        vec!["stratus_worker_step_seconds", "stratus_x"]
    );
}

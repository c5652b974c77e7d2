//! Prometheus metrics scraped over HTTP during a real in-process cluster run
//! (one server with two shards, two workers over QUIC on loopback).
//!
//! The process's registry is served on a loopback port (port 0, the bound
//! address returned), as `--metrics-addr` does in the binaries. The test
//! waits on worker 0's step counter (no sleeps): it scrapes `/metrics` a
//! first time after a few steps and again five steps later, and checks that
//! the series moved in between: worker steps, bytes pushed and pulled, the
//! step-time histogram, the servers' pushes and updates. After the run the
//! worker's JSONL holds a per-step record every `training.step_metrics_every`
//! steps.

use std::net::SocketAddr;
use std::time::Duration;

use futures::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use ps_dataset::SyntheticSpec;
use ps_shared::config::CompressionKind;
use ps_tests::{rank_runs, start_loopback_server, synthetic_bucket_blocking, test_config, TestPki};
use ps_worker::run::WorkerOptions;

/// Upper bound on every wait, so a bug cannot hang the suite.
const LIMIT: Duration = Duration::from_secs(300);

/// The body of `GET /metrics` at `addr`.
async fn scrape(addr: SocketAddr) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the metrics endpoint");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("send the request");
    let mut reply = String::new();
    tokio::time::timeout(LIMIT, conn.read_to_string(&mut reply))
        .await
        .expect("the endpoint answers")
        .expect("read the reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_string()
}

/// The sum of the samples of `name` whose labels contain every one of
/// `labels` (`rank="0"`, ...); `None` when there is no such sample.
fn value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, l)) => (n, l),
            None => (series, ""),
        };
        if series_name == name && labels.iter().all(|l| series_labels.contains(l)) {
            let v: f64 = v.parse().unwrap_or_else(|_| panic!("bad value in {line}"));
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

fn must(text: &str, name: &str, labels: &[&str]) -> f64 {
    value(text, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
}

/// Waits until worker 0 has done `n` steps; returns its count then.
async fn wait_for(done: &mut watch::Receiver<u64>, n: u64) -> u64 {
    tokio::time::timeout(LIMIT, done.wait_for(|s| *s >= n))
        .await
        .expect("worker 0 reaches the step in time")
        .map(|s| *s)
        .expect("worker 0 runs until the step")
}

#[test]
fn scraped_series_move_during_a_run() {
    let addr = ps_shared::telemetry::start_exporter("127.0.0.1:0".parse().unwrap())
        .expect("metrics endpoint on loopback");
    let spec = SyntheticSpec {
        train: 4096,
        test: 256,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = synthetic_bucket_blocking(&spec);
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let mut cfg = test_config(CompressionKind::Topk, 0.05, 3);
    cfg.training.metrics_dir = runs.display().to_string();
    cfg.training.step_metrics_every = 5;
    cfg.validate().expect("valid config");
    let pki = TestPki::new(2);
    let system = actix::System::new();
    let (first, second, steps) = system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        let (tx, mut done) = watch::channel(0u64);
        let runs = rank_runs(
            &cfg,
            |rank| WorkerOptions {
                steps_done: (rank == 0).then(|| tx.clone()),
                ..pki.options(rank)
            },
            &store,
            &prefix,
        );
        drop(tx);
        let probe = async {
            wait_for(&mut done, 3).await;
            let first = scrape(addr).await;
            let at = must(&first, "stratus_worker_steps_total", &["rank=\"0\""]) as u64;
            wait_for(&mut done, at + 5).await;
            let second = scrape(addr).await;
            (first, second)
        };
        let (reports, (first, second)) = futures::join!(join_all(runs), probe);
        let mut steps = 0;
        for report in reports.into_iter().flatten() {
            let report = report.expect("worker run");
            if report.rank == 0 {
                steps = report.steps;
            }
        }
        tokio::time::timeout(LIMIT, server.wait())
            .await
            .expect("server stops")
            .expect("server run");
        (first, second, steps)
    });

    let rank0 = ["rank=\"0\""];
    let moved = |name: &str, labels: &[&str]| {
        let (a, b) = (must(&first, name, labels), must(&second, name, labels));
        assert!(b > a, "{name} {labels:?} did not move: {a} then {b}");
        (a, b)
    };
    let (a, b) = moved("stratus_worker_steps_total", &rank0);
    assert!(a >= 3.0 && b >= a + 5.0, "steps {a} then {b}");
    moved("stratus_worker_samples_total", &rank0);
    moved("stratus_worker_pushed_bytes_total", &rank0);
    moved("stratus_worker_pulled_bytes_total", &rank0);
    moved(
        "stratus_worker_step_seconds_count",
        &["rank=\"0\"", "phase=\"exchange\""],
    );
    moved("stratus_server_pushes_total", &[]);
    moved("stratus_server_updates_total", &[]);
    moved("stratus_server_entries_applied_total", &[]);
    moved("stratus_server_request_seconds_count", &["kind=\"step\""]);
    // Both shards count pushes; both workers' step counters are there.
    for shard in ["shard=\"0\"", "shard=\"1\""] {
        assert!(must(&second, "stratus_server_pushes_total", &[shard]) > 0.0);
    }
    assert!(must(&second, "stratus_worker_steps_total", &["rank=\"1\""]) > 0.0);
    // The data plane and the gauges.
    assert!(must(&first, "stratus_worker_bucket_gets_total", &rank0) >= 1.0);
    assert!(must(&first, "stratus_worker_bucket_bytes_total", &rank0) > 0.0);
    let misses = must(&second, "stratus_worker_cache_misses_total", &rank0);
    let hits = must(&second, "stratus_worker_cache_hits_total", &rank0);
    assert!(misses + hits > 0.0, "no sample counted by a tier");
    assert_eq!(
        must(&second, "stratus_worker_disk_errors_total", &rank0),
        0.0
    );
    assert!(must(&second, "stratus_worker_loss", &rank0).is_finite());
    assert!(must(&second, "stratus_worker_learning_rate", &rank0) > 0.0);
    assert!(must(&second, "stratus_server_members_live", &[]) >= 1.0);
    assert!(must(&second, "stratus_server_connections_opened_total", &[]) >= 2.0);
    assert_eq!(must(&second, "stratus_build_info", &[]), 1.0);
    assert!(second.contains("# TYPE stratus_worker_step_seconds histogram"));
    assert!(second.contains("# HELP stratus_server_pushes_total "));

    // The JSONL: a per-step record every 5 steps, next to the epochs.
    let jsonl = std::fs::read_to_string(runs.join("worker-0.jsonl")).expect("worker-0.jsonl");
    let step_records: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .filter(|v| v["record"] == "step")
        .collect();
    assert!(steps >= 10, "{steps} steps");
    assert_eq!(step_records.len() as u64, steps / 5, "{jsonl}");
    for (i, r) in step_records.iter().enumerate() {
        assert_eq!(r["step"], 5 * (i as u64 + 1), "{r}");
        assert!(r["loss"].as_f64().is_some_and(f64::is_finite), "{r}");
        assert!(r["bytes_pushed"].as_u64().is_some_and(|b| b > 0), "{r}");
        assert!(r["exchange_s"].as_f64().is_some_and(|s| s > 0.0), "{r}");
        // Top-k 5%: the push carried about 5% of the entries.
        assert!(
            r["density"].as_f64().is_some_and(|d| d > 0.0 && d < 0.1),
            "{r}"
        );
    }
    // The training clock grows from record to record.
    let clock: Vec<f64> = step_records
        .iter()
        .map(|r| r["train_s"].as_f64().expect("train_s"))
        .collect();
    assert!(clock[0] > 0.0, "{jsonl}");
    assert!(clock.windows(2).all(|w| w[1] > w[0]), "{jsonl}");
    let epochs = jsonl
        .lines()
        .filter(|l| !l.contains("\"record\":\"step\""))
        .count();
    assert_eq!(epochs, 3, "{jsonl}");
}

//! Training over a simulated worker-server link (a simulation's `[link]`): the same in-process
//! cluster (1 server process with 2 shards, 2 workers) at 1 Gbit/s and at
//! 100 Mbit/s, dense and top-k.
//!
//! The checks are about what the link model guarantees, never about how fast
//! this machine is: training still reaches the accuracy bar, the bytes on the
//! wire match what the gradient sizes predict (and do not depend on the link),
//! the slower link charges more link time than the faster one, and each step
//! is charged at least what the link's rate and latency imply. Every time
//! figure checked is the link model's own accounting (computed from bytes,
//! rate and latency), never a measured wall-clock time, so a slow or busy
//! machine cannot make these tests fail or pass.

use std::sync::Mutex;

use ps_dataset::SyntheticSpec;
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_shared::link::LinkSection;
use ps_shared::sparse::k_for_density;
use ps_tests::{run_cluster_simulated, synthetic_bucket_blocking, test_config};
use ps_worker::run::WorkerReport;
use ps_worker::simulate::Simulation;

/// Test accuracy every run must exceed (chance is 10%).
const ACCURACY_BAR: f32 = 0.90;
/// Hidden width: about 19k parameters, so a dense step moves ~77 KB each way,
/// several times the link's burst allowance.
const HIDDEN: usize = 256;
/// Encoding overhead allowed per push frame (request header and rkyv framing).
const FRAME_OVERHEAD: f64 = 256.0;
/// Burst of the simulated link at 100 Mbit/s (see `ps_shared::link::LinkLimiter`):
/// the larger of 1 ms of traffic and 16 KiB.
const BURST_100MBIT: f64 = 16.0 * 1024.0;

/// The runs measure communication time, so they must not overlap: the test
/// harness runs tests on parallel threads.
static SERIAL: Mutex<()> = Mutex::new(());

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

/// The cluster config and the simulated link of one run.
fn config(
    kind: CompressionKind,
    density: f64,
    epochs: u64,
    mbit: f64,
    latency_ms: f64,
) -> (ClusterConfig, Simulation) {
    let mut cfg = test_config(kind, density, epochs);
    cfg.model.hidden = vec![HIDDEN];
    cfg.validate().expect("valid bandwidth test config");
    let sim = Simulation {
        link: LinkSection {
            bandwidth_mbit: mbit,
            latency_ms,
        },
        ..Simulation::default()
    };
    sim.validate().expect("valid simulated link");
    (cfg, sim)
}

fn train((cfg, sim): (ClusterConfig, Simulation)) -> Vec<WorkerReport> {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    run_cluster_simulated(cfg, &sim, store, prefix).expect("cluster run")
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Communication seconds per step, averaged over the workers.
/// Link time the link model charged per step, averaged over the workers.
fn link_per_step(reports: &[WorkerReport]) -> f64 {
    reports
        .iter()
        .map(|r| r.link_simulated_s / r.steps.max(1) as f64)
        .sum::<f64>()
        / reports.len().max(1) as f64
}

fn summarize(name: &str, reports: &[WorkerReport]) {
    for r in reports {
        println!(
            "{name}: worker {} steps {} accuracy {:.2}% pushed {:.0} B/step pulled {:.0} B/step comm {:.2} ms/step compute {:.2} ms/step (P = {})",
            r.rank,
            r.steps,
            100.0 * r.final_accuracy,
            r.bytes_pushed_per_step,
            r.bytes_pulled_per_step,
            1e3 * r.comm_s / r.steps.max(1) as f64,
            1e3 * r.compute_s / r.steps.max(1) as f64,
            r.num_params
        );
    }
}

fn check_learned(name: &str, reports: &[WorkerReport]) {
    assert_eq!(reports.len(), 2, "{name}");
    assert!(reports[0].steps > 0, "{name}");
    assert_eq!(
        reports[0].steps, reports[1].steps,
        "{name}: BSP step counts"
    );
    for r in reports {
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "{name}: worker {} reached only {:.3}",
            r.rank,
            r.final_accuracy
        );
    }
}

#[test]
fn dense_training_pays_for_a_slower_link() {
    let _serial = serial();
    let epochs = 4;
    let fast = train(config(CompressionKind::None, 1.0, epochs, 1000.0, 0.0));
    let slow = train(config(CompressionKind::None, 1.0, epochs, 100.0, 0.0));
    summarize("dense 1 Gbit/s", &fast);
    summarize("dense 100 Mbit/s", &slow);
    check_learned("dense 1 Gbit/s", &fast);
    check_learned("dense 100 Mbit/s", &slow);

    let p = fast[0].num_params as f64;
    let shards = 2.0;
    for (name, reports) in [("1 Gbit/s", &fast), ("100 Mbit/s", &slow)] {
        for r in reports.iter() {
            // A dense push carries every f32 of the gradient plus framing.
            assert!(
                r.bytes_pushed_per_step >= 4.0 * p
                    && r.bytes_pushed_per_step <= 4.0 * p + shards * FRAME_OVERHEAD,
                "{name} worker {}: pushed {} B/step for P = {p}",
                r.rank,
                r.bytes_pushed_per_step
            );
            // Server momentum moves every entry, so every pull is the dense shard.
            assert!(
                (r.bytes_pulled_per_step - 4.0 * p).abs() < 1.0,
                "{name} worker {}: pulled {} B/step for P = {p}",
                r.rank,
                r.bytes_pulled_per_step
            );
        }
    }
    // The link changes the timing, never what is sent.
    assert_eq!(fast[0].steps, slow[0].steps);
    assert_eq!(fast[0].bytes_pushed_per_step, slow[0].bytes_pushed_per_step);
    assert_eq!(fast[0].bytes_pulled_per_step, slow[0].bytes_pulled_per_step);

    let (t_fast, t_slow) = (link_per_step(&fast), link_per_step(&slow));
    println!(
        "dense link time charged per step: {:.2} ms at 1 Gbit/s, {:.2} ms at 100 Mbit/s (x{:.2})",
        1e3 * t_fast,
        1e3 * t_slow,
        t_slow / t_fast
    );
    assert!(
        t_slow > 5.0 * t_fast,
        "100 Mbit/s charged {t_slow:.4} s/step, 1 Gbit/s {t_fast:.4} s/step"
    );
    // Floor imposed by the token bucket: each direction's bytes beyond the
    // burst pass at 12.5 MB/s, and a step waits for at least one direction.
    let rate = 100e6 / 8.0;
    let bytes = slow[0]
        .bytes_pushed_per_step
        .max(slow[0].bytes_pulled_per_step);
    let floor = (bytes - BURST_100MBIT) / rate;
    for r in &slow {
        let per_step = r.link_simulated_s / r.steps as f64;
        assert!(
            per_step >= floor,
            "worker {}: {per_step:.5} s/step charged is below the link floor {floor:.5} s",
            r.rank
        );
    }
}

#[test]
fn topk_over_a_slow_link_with_latency_learns_and_sends_little() {
    let _serial = serial();
    let density = 0.01;
    let latency_ms = 1.0;
    let reports = train(config(CompressionKind::Topk, density, 6, 100.0, latency_ms));
    summarize("top-k 1% 100 Mbit/s 1 ms", &reports);
    check_learned("top-k 1% 100 Mbit/s 1 ms", &reports);

    let p = reports[0].num_params;
    let k = k_for_density(p, density) as f64;
    for r in &reports {
        // k values of 4 bytes and k delta-encoded indices, split over the
        // shards: at 1% the gaps (about 100) take 1 or 2 varint bytes, below
        // the 4 of plain u32 indices.
        assert!(
            r.bytes_pushed_per_step >= 5.0 * k
                && r.bytes_pushed_per_step <= 6.0 * k + 2.0 * FRAME_OVERHEAD,
            "worker {}: pushed {} B/step for k = {k}",
            r.rank,
            r.bytes_pushed_per_step
        );
        // Pulls carry the entries either worker moved: the union of two top-k sets.
        assert!(
            r.bytes_pulled_per_step >= 5.0 * k && r.bytes_pulled_per_step <= 12.0 * k,
            "worker {}: pulled {} B/step for k = {k}",
            r.rank,
            r.bytes_pulled_per_step
        );
        assert!(r.bytes_pushed_per_step < 0.05 * 4.0 * p as f64);
        // Every step sends one Step request to each of the 2 shards and
        // receives its reply, each message charged the one-way latency.
        let per_step = r.link_simulated_s / r.steps as f64;
        let floor = 4.0 * latency_ms / 1e3;
        assert!(
            per_step >= floor,
            "worker {}: {per_step:.5} s/step is below the latency floor {floor:.5} s",
            r.rank
        );
    }
}

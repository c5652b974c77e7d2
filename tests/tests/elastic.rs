//! Elastic worker counts, with whole clusters in one process:
//!
//! * a BSP run checkpointed mid-epoch with 4 workers resumes with 2, and one
//!   with 2 resumes with 3: every sample of every epoch is trained exactly
//!   once over both runs, in the epoch's global order;
//! * a worker joins a running ASP job beyond the starting count when
//!   `cluster.max_workers` admits it, trains, and the servers apply its
//!   pushes; without the setting the servers refuse it, naming the setting.
//!
//! Each test ends in a summary line computed from what happened. Nothing
//! waits on a sleep: tests wait on a worker's step counter.

use std::sync::Arc;
use std::time::Duration;

use object_store::{path::Path, ObjectStore};
use tokio::sync::{mpsc, watch};

use ps_dataset::SyntheticSpec;
use ps_shared::config::{ClusterConfig, CompressionKind, SyncMode};
use ps_shared::sampler::EpochSampler;
use ps_tests::{
    assert_each_position_once, log_from_env, rank_runs, start_loopback_server,
    synthetic_bucket_blocking, test_config, TestPki,
};
use ps_worker::run::{run_worker, StopReason, TrainedBatch, WorkerReport};

const RUN_LIMIT: Duration = Duration::from_secs(300);
/// Not a multiple of any global batch used here, so steps straddle epoch
/// ends and the runs end with a short step.
const SAMPLES: usize = 1000;
const BATCH: usize = 16;

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: SAMPLES,
        test: 256,
        ..SyntheticSpec::default()
    }
}

fn config(workers: usize, epochs: u64) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.05, epochs);
    cfg.cluster.workers = workers;
    cfg.data.batch_size = BATCH;
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.connect_timeout_secs = 30;
    cfg.server.recovery_window_secs = 5.0;
    cfg.validate().expect("valid config");
    cfg
}

/// Runs every rank of `cfg` against a fresh server on loopback (restored
/// from `cfg.server.checkpoint_url` when it holds checkpoints); returns the
/// reports, every batch trained, and the server's final checkpoint versions.
async fn run_phase(
    cfg: &ClusterConfig,
    pki: &TestPki,
    store: &Arc<dyn ObjectStore>,
    prefix: &Path,
) -> (Vec<WorkerReport>, Vec<TrainedBatch>, Vec<u64>) {
    let mut cfg = cfg.clone();
    // Keep the server up after the workers leave, to stop it cleanly with
    // a final checkpoint.
    cfg.server.exit_when_done = false;
    let server = start_loopback_server(&cfg, pki).await;
    cfg.cluster.servers = vec![server.local_addr().to_string()];
    let (tx, mut rx) = mpsc::unbounded_channel();
    let runs = rank_runs(
        &cfg,
        |rank| ps_worker::run::WorkerOptions {
            trained: Some(tx.clone()),
            ..pki.options(rank)
        },
        store,
        prefix,
    );
    drop(tx);
    let reports = tokio::time::timeout(RUN_LIMIT, futures::future::join_all(runs))
        .await
        .expect("the workers finish in time");
    let reports: Vec<WorkerReport> = reports
        .into_iter()
        .flatten()
        .map(|r| r.expect("worker run"))
        .collect();
    let saved = server.shutdown().await;
    let mut trained = Vec::new();
    while let Some(b) = rx.recv().await {
        trained.push(b);
    }
    let versions = saved.iter().map(|(_, v)| v.unwrap_or(0)).collect();
    (reports, trained, versions)
}

/// Every stream position of `0..epochs × SAMPLES` was trained exactly
/// once, with the sample the epoch's global order has there.
fn assert_exactly_once(cfg: &ClusterConfig, trained: &[TrainedBatch]) {
    assert_each_position_once(trained, SAMPLES, cfg.training.epochs, cfg.data.seed, BATCH);
}

/// Trains `cut` steps with `before` workers, stops the server cleanly
/// (final checkpoint), resumes from the checkpoint with `after` workers to
/// the end, and checks every sample of both epochs was trained once.
fn resize(before: usize, after: usize, cut: u64) {
    resize_nodes((before, 1), (after, 1), cut);
}

/// [`resize`] with `(workers, workers_per_node)` on each side.
fn resize_nodes(before: (usize, usize), after: (usize, usize), cut: u64) {
    let ((before, before_wpn), (after, after_wpn)) = (before, after);
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(before.max(after) as u32);
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let epochs = 2;
    let mut first = config(before, epochs);
    first.cluster.workers_per_node = before_wpn;
    first.server.checkpoint_url = format!("file://{}", dir.path().display());
    first.training.max_steps = cut;
    let mut second = config(after, epochs);
    second.cluster.workers_per_node = after_wpn;
    second.server.checkpoint_url = first.server.checkpoint_url.clone();
    let system = actix::System::new();
    system.block_on(async move {
        let (reports, mut trained, saved) = run_phase(&first, &pki, &store, &prefix).await;
        assert!(reports.iter().all(|r| r.stop_reason == StopReason::MaxSteps));
        assert!(
            saved.iter().all(|v| *v == cut),
            "final checkpoints at {saved:?}"
        );
        let consumed = cut * (before * BATCH) as u64;
        assert!(
            !consumed.is_multiple_of(SAMPLES as u64),
            "the cut is mid-epoch"
        );
        let (resumed, more, _) = run_phase(&second, &pki, &store, &prefix).await;
        assert!(resumed.iter().all(|r| r.start_step == cut));
        // The first step after the resume starts where the old run stopped.
        let first_after = more.iter().map(|b| b.first).min().unwrap();
        assert_eq!(first_after, consumed);
        let steps_after = resumed.iter().map(|r| r.steps).max().unwrap() - cut;
        let short = resumed.iter().filter(|r| r.steps < cut + steps_after).count();
        trained.extend(more);
        assert_exactly_once(&second, &trained);
        let accuracy = resumed[0].final_accuracy;
        println!(
            "elastic: {before} workers ({before_wpn} per node) -> {after} ({after_wpn} per node), checkpoint at step {cut} (epoch {} + {} samples): {} samples trained over {epochs} epochs, each exactly once; {steps_after} steps after the resume ({short} worker(s) without a batch in the short last step), accuracy {:.2}%",
            consumed / SAMPLES as u64,
            consumed % SAMPLES as u64,
            trained.iter().map(|b| b.samples.len()).sum::<usize>(),
            100.0 * accuracy
        );
    });
}

#[test]
fn a_run_checkpointed_with_4_workers_resumes_with_2() {
    // 10 steps of 64: 640 samples of epoch 0.
    resize(4, 2, 10);
}

#[test]
fn a_run_checkpointed_with_2_workers_resumes_with_3() {
    // 41 steps of 32: epoch 1 and 312 samples.
    resize(2, 3, 41);
}

#[test]
fn a_run_of_2_nodes_of_2_resumes_as_3_nodes_of_2() {
    // 10 steps of 64: 640 samples of epoch 0; the nodes' ranks take their
    // parts of each global step like flat workers.
    resize_nodes((4, 2), (6, 2), 10);
}

#[test]
fn a_worker_joins_an_asp_job_beyond_the_start_count() {
    join_beyond_the_start_count(SyncMode::Asp);
}

#[test]
fn a_worker_joins_an_ssp_job_beyond_the_start_count() {
    join_beyond_the_start_count(SyncMode::Ssp);
}

fn join_beyond_the_start_count(mode: SyncMode) {
    log_from_env();
    let pki = TestPki::new(3);
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let mut cfg = config(2, 3);
    cfg.server.mode = mode;
    cfg.cluster.max_workers = 3;
    cfg.validate().expect("joining is allowed in asp and ssp");
    let mut closed = cfg.clone();
    closed.cluster.max_workers = 0;
    let system = actix::System::new();
    system.block_on(async move {
        // Without cluster.max_workers the servers refuse rank 2. (The
        // joiner's own config admits it, so the refusal is the server's.)
        let server = start_loopback_server(&closed, &pki).await;
        let mut joiner = cfg.clone();
        joiner.cluster.servers = vec![server.local_addr().to_string()];
        joiner.server.connect_timeout_secs = 2;
        let refused =
            match run_worker(&joiner, pki.options(2), store.clone(), prefix.clone()).await {
                Ok(_) => panic!("rank 2 was admitted"),
                Err(e) => e,
            };
        let message = refused.to_string();
        assert!(
            message.contains("rank 2") && message.contains("cluster.max_workers"),
            "{message}"
        );
        server.abort().await;

        // With it, rank 2 joins once the others are under way.
        let server = start_loopback_server(&cfg, &pki).await;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        let (steps0_tx, mut steps0) = watch::channel(0);
        let (steps1_tx, mut steps1) = watch::channel(0);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let opts = |rank: u32, steps: watch::Sender<u64>| ps_worker::run::WorkerOptions {
            trained: Some(tx.clone()),
            steps_done: Some(steps),
            ..pki.options(rank)
        };
        let w0 = run_worker(&cfg, opts(0, steps0_tx), store.clone(), prefix.clone());
        let w1 = run_worker(&cfg, opts(1, steps1_tx), store.clone(), prefix.clone());
        let late_opts = ps_worker::run::WorkerOptions {
            trained: Some(tx.clone()),
            ..pki.options(2)
        };
        let late = async {
            // Both starting workers are past step 5 when rank 2 joins. The
            // watches' read guards must not outlive the check: the workers
            // take the write lock after every step, on this same thread.
            for (rank, steps) in [(0, &mut steps0), (1, &mut steps1)] {
                let reached = tokio::time::timeout(RUN_LIMIT, steps.wait_for(|s| *s >= 5))
                    .await
                    .map(|r| r.map(|step| *step));
                assert!(matches!(reached, Ok(Ok(_))), "worker {rank} never reached step 5");
            }
            run_worker(&cfg, late_opts, store.clone(), prefix.clone()).await
        };
        drop(tx);
        let (a, b, c) = tokio::time::timeout(RUN_LIMIT, futures::future::join3(w0, w1, late))
            .await
            .expect("the run finishes in time");
        let reports = [a.expect("worker 0"), b.expect("worker 1"), c.expect("worker 2")];
        let status = server.status().await;
        tokio::time::timeout(Duration::from_secs(30), server.wait())
            .await
            .expect("the server stops once every worker, the joiner too, finished")
            .expect("clean end");
        let joiner = &reports[2];
        assert!(
            joiner.start_step >= 5,
            "the joiner starts with the others, not at step {}",
            joiner.start_step
        );
        let joiner_steps = joiner.steps - joiner.start_step;
        assert!(joiner_steps > 0, "the joiner trained");
        let mut trained = Vec::new();
        while let Some(b) = rx.recv().await {
            trained.push(b);
        }
        assert_eq!(
            trained.iter().filter(|b| b.rank == 2).count() as u64,
            joiner_steps
        );
        // The joiner takes rank 0's part of each step it trains.
        let plan = EpochSampler::new(SAMPLES, 2, 0, cfg.data.seed)
            .unwrap()
            .plan(BATCH, 3);
        for b in trained.iter().filter(|b| b.rank == 2) {
            assert_eq!(&b.samples[..], &plan.batch(b.step).samples[..]);
        }
        // ASP and SSP apply every push: each shard's updates are all the
        // steps trained, the joiner's included.
        let total: u64 = reports.iter().map(|r| r.steps - r.start_step).sum();
        for s in &status {
            assert_eq!(s.stats.updates, total, "shard {}", s.shard);
            assert_eq!(s.stats.pushes, total, "shard {}", s.shard);
        }
        println!(
            "elastic: {mode:?} job started with 2 workers, rank 2 joined at step {} and trained {joiner_steps} steps; the servers applied {} updates per shard = {} + {} + {joiner_steps} steps; without cluster.max_workers: {message}",
            joiner.start_step,
            total,
            reports[0].steps,
            reports[1].steps,
        );
    });
}

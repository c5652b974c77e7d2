//! Global-norm clipping (`optimizer.clip_grad_norm`) across shards: the
//! same model, seed and data trained with the whole model in one shard and
//! split over 2 servers x 2 shards ends with the same parameters, and the
//! clipping did happen.

use ps_dataset::SyntheticSpec;
use ps_server::actor::ShardStatus;
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_tests::{run_cluster_detailed, synthetic_bucket_blocking, test_config};
use ps_worker::simulate::Simulation;

const STEPS: u64 = 40;
/// Far below the mean gradient's norm on this set: most updates clip.
const CLIP: f32 = 0.05;

fn config(servers: usize, shards_per_server: usize) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::None, 1.0, 3);
    cfg.cluster.servers = vec!["127.0.0.1:0".into(); servers];
    cfg.cluster.shards_per_server = shards_per_server;
    cfg.training.max_steps = STEPS;
    cfg.training.eval_every = 0;
    cfg.optimizer.clip_grad_norm = CLIP;
    cfg.validate().expect("a valid config");
    cfg
}

/// The small synthetic set every run here trains on.
fn small_set() -> SyntheticSpec {
    SyntheticSpec {
        train: 2048,
        test: 256,
        ..SyntheticSpec::default()
    }
}

/// The final parameters (the shards' in order) and every shard's status;
/// every worker ran the planned steps.
fn train(servers: usize, shards_per_server: usize) -> (Vec<f32>, Vec<ShardStatus>) {
    let (steps, params, shards) = train_config(config(servers, shards_per_server));
    assert!(steps.iter().all(|&s| s == STEPS), "{steps:?}");
    (params, shards)
}

/// The steps of every worker, the final parameters (the shards' in order)
/// and every shard's status.
fn train_config(cfg: ClusterConfig) -> (Vec<u64>, Vec<f32>, Vec<ShardStatus>) {
    let (store, prefix) = synthetic_bucket_blocking(&small_set());
    let (reports, mut shards) =
        run_cluster_detailed(cfg, &Simulation::default(), store, prefix).expect("cluster run");
    shards.sort_by_key(|s| s.shard);
    let params = shards.iter().flat_map(|s| s.params.clone()).collect();
    (reports.iter().map(|r| r.steps).collect(), params, shards)
}

/// The largest absolute and relative differences of `b` from `a`.
fn differences(a: &[f32], b: &[f32]) -> (f32, f32) {
    let mut max_abs = 0.0f32;
    let mut max_rel = 0.0f32;
    for (a, b) in a.iter().zip(b) {
        let d = (a - b).abs();
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(d / a.abs().max(1e-3));
    }
    (max_abs, max_rel)
}

/// A clipped 2-shard run (so every step has a norm round) with liveness
/// timeouts short enough for the failure tests.
fn fault_config() -> ClusterConfig {
    let mut cfg = config(1, 2);
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.idle_timeout_secs = 2.0;
    cfg.server.worker_timeout_secs = 5.0;
    cfg
}

#[test]
fn clipping_over_four_shards_on_two_servers_equals_one_shard() {
    let (whole, one) = train(1, 1);
    let (split, four) = train(2, 2);
    assert_eq!(one.len(), 1);
    assert_eq!(four.len(), 4);
    assert_eq!(whole.len(), split.len());
    let (max_abs, max_rel) = differences(&whole, &split);
    let moved = whole.iter().map(|p| p.abs()).fold(0.0f32, f32::max);
    println!(
        "clip_grad_norm = {CLIP}, {STEPS} steps: {} parameters, {} of {STEPS} updates clipped; \
         1 shard vs 2 servers x 2 shards: max |diff| {max_abs:.3e}, max relative {max_rel:.3e} (largest |p| {moved:.3})",
        whole.len(),
        four[0].stats.norm_clipped,
    );
    for s in &four {
        assert_eq!(s.version, STEPS, "shard {}", s.shard);
        // One norm round per step, and clipping happened.
        assert_eq!(s.stats.norm_rounds, STEPS, "shard {}", s.shard);
        assert!(
            s.stats.norm_clipped > 0,
            "shard {}: no update clipped",
            s.shard
        );
    }
    // Every shard scales by the same global factor: they clipped alike.
    assert!(four
        .iter()
        .all(|s| s.stats.norm_clipped == four[0].stats.norm_clipped));
    // One shard clips in one pass, with no round.
    assert_eq!(one[0].stats.norm_rounds, 0);
    assert!(max_rel <= 1e-5, "max relative difference {max_rel:e}");
}

#[test]
fn clipping_over_two_shards_with_two_workers_per_node_equals_one_shard() {
    // The node aggregator pushes once for its ranks: the norm is the one of
    // the mean over every rank all the same.
    let node = |shards| {
        let mut cfg = config(1, shards);
        cfg.cluster.workers = 4;
        cfg.cluster.workers_per_node = 2;
        cfg.validate().expect("a valid config");
        cfg
    };
    let (_, whole, _) = train_config(node(1));
    let (_, split, status) = train_config(node(2));
    let (_, max_rel) = differences(&whole, &split);
    println!("workers_per_node = 2, 1 shard vs 2 shards: max relative difference {max_rel:.3e}");
    assert!(status.iter().all(|s| s.stats.norm_clipped > 0));
    assert!(max_rel <= 1e-5, "max relative difference {max_rel:e}");
}

/// A server killed in the middle of a clipped run (2 shards, so every step
/// has a norm round) restarts empty, rebuilds its shards from the workers'
/// copies, and every planned step is applied once: the push and the norm
/// exchange of the step under way are taken again, nothing hangs.
#[test]
fn a_server_killed_during_a_clipped_run_recovers_and_applies_every_step() {
    use ps_tests::{start_loopback_server, TestPki};
    use ps_worker::run::{run_worker, WorkerOptions};
    use tokio::sync::watch;

    const KILL_AT: u64 = 12;
    let mut cfg = fault_config();
    cfg.server.connect_timeout_secs = 30;
    cfg.server.recovery_window_secs = 5.0;
    cfg.validate().expect("a valid config");
    let (store, prefix) = synthetic_bucket_blocking(&small_set());
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let first = start_loopback_server(&cfg, &pki).await;
        let addr = first.local_addr();
        let mut cfg = cfg;
        cfg.cluster.servers = vec![addr.to_string()];
        let (tx, mut steps) = watch::channel(0);
        let watched = WorkerOptions {
            steps_done: Some(tx),
            ..pki.options(0)
        };
        let workers = futures::future::join(
            run_worker(&cfg, watched, store.clone(), prefix.clone()),
            run_worker(&cfg, pki.options(1), store.clone(), prefix.clone()),
        );
        let chaos = async {
            let reached = steps.wait_for(|s| *s >= KILL_AT).await;
            assert!(reached.is_ok(), "worker 0 never reached step {KILL_AT}");
            let held: Vec<u64> = first.status().await.iter().map(|s| s.version).collect();
            first.abort().await;
            let second = ps_server::net::start(&cfg, 0, addr, &pki.server)
                .await
                .expect("restart on the same address");
            (held, second)
        };
        let limit = std::time::Duration::from_secs(300);
        let ((a, b), (held, second)) =
            tokio::time::timeout(limit, futures::future::join(workers, chaos))
                .await
                .expect("run finished in time");
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        let status = second.status().await;
        second.wait().await.expect("server ends cleanly");
        assert_eq!((a.steps, b.steps), (STEPS, STEPS));
        assert!(a.recoveries > 0 && b.recoveries > 0, "both workers reconnected");
        for s in &status {
            assert_eq!(s.version, STEPS, "shard {}: every step applied once", s.shard);
            let r = s.recovery.as_ref().expect("a recovery report");
            assert_eq!(r.updates_lost, 0, "shard {}", s.shard);
            // The second server ran the rounds of the steps after the
            // version it recovered at.
            assert_eq!(s.stats.norm_rounds, STEPS - r.version, "shard {}", s.shard);
            assert!(s.stats.norm_clipped > 0, "shard {}", s.shard);
        }
        println!(
            "clipped run through a server kill: killed holding versions {held:?}, recovered at {:?}, final versions {:?}",
            status
                .iter()
                .map(|s| s.recovery.as_ref().map(|r| r.version))
                .collect::<Vec<_>>(),
            status.iter().map(|s| s.version).collect::<Vec<_>>()
        );
    });
}

/// A worker that crashes in a clipped 2-shard run leaves the barrier; the
/// survivor's pushes complete it, its totals apply every later step, and
/// no norm round is left waiting.
#[test]
fn a_worker_that_crashes_during_a_clipped_run_stalls_nothing() {
    use ps_tests::{start_loopback_server, TestPki};
    use ps_worker::run::{run_worker, WorkerError, WorkerOptions};

    const CRASH_AT: u64 = 10;
    let cfg = fault_config();
    cfg.validate().expect("a valid config");
    let (store, prefix) = synthetic_bucket_blocking(&small_set());
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let mut cfg = cfg;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        let crashing = WorkerOptions {
            crash_after_steps: Some(CRASH_AT),
            ..pki.options(1)
        };
        let limit = std::time::Duration::from_secs(300);
        let (a, b) = tokio::time::timeout(
            limit,
            futures::future::join(
                run_worker(&cfg, pki.options(0), store.clone(), prefix.clone()),
                run_worker(&cfg, crashing, store.clone(), prefix.clone()),
            ),
        )
        .await
        .expect("run finished in time");
        let a = a.expect("the survivor");
        assert!(matches!(b, Err(WorkerError::Crashed(CRASH_AT))), "{b:?}");
        let status = server.status().await;
        // The crashed rank never said goodbye: the server would wait for it.
        server.abort().await;
        assert_eq!(a.steps, STEPS);
        assert!(a.steps_short_of_workers > 0);
        for s in &status {
            assert_eq!(s.version, STEPS, "shard {}", s.shard);
            assert_eq!(s.stats.norm_rounds, STEPS, "shard {}", s.shard);
        }
        println!(
            "clipped run with a crash at step {CRASH_AT}: survivor ran {} steps ({} short of workers), final versions {:?}",
            a.steps,
            a.steps_short_of_workers,
            status.iter().map(|s| s.version).collect::<Vec<_>>()
        );
    });
}

//! Node-local aggregation (`cluster.workers_per_node`): 2 nodes × 2 workers
//! against the flat setup of 4 workers, same seeds, same data, in process.
//!
//! What is checked, and why it must hold:
//! * **Bytes per node link fall by the workers per node.** In the flat setup
//!   the two workers of a node each have their own link (each offers its copy
//!   at the start, pushes every step and pulls every reply); with a node
//!   aggregator the node offers, pushes and pulls once. The bytes are read
//!   from the simulated link's counters (`ps_shared::link`), summed over a
//!   node's workers in the flat run. The push side falls by 2 within 10 %
//!   (frames carry a fixed header, and a top-k push has the same k either
//!   way); the pull side falls by at least that, since the servers apply the
//!   top-k of 2 nodes per step instead of 4 workers, so each reply's delta is
//!   no larger.
//! * **Dense training is the same computation.** Without compression the
//!   node pushes the mean of its two gradients and the servers average the
//!   nodes: the mean over 4 workers, as in the flat run. Only the order of
//!   float additions differs, so accuracy agrees within 1 percentage point.
//! * **Top-k accuracy stays comparable.** With top-k the node compresses its
//!   sum (one residual per node), which sends the same k per push but half
//!   the pushes: the update of a step holds fewer entries than the flat
//!   run's. Error feedback keeps what is not sent, so the final accuracy
//!   stays within 3 percentage points of the flat run (both far above
//!   chance, 10 %).
//! * Every rank of a node ends with the same model (the fan-out gives them
//!   the same parameters), so all four ranks report the same accuracy.

use ps_dataset::SyntheticSpec;
use ps_shared::config::{ClusterConfig, CompressionKind, SyncMode};
use ps_tests::{run_cluster, run_cluster_detailed, synthetic_bucket_blocking, test_config};
use ps_worker::run::WorkerReport;

const WORKERS: usize = 4;
const PER_NODE: usize = 2;
/// Accuracy every run must exceed (chance is 10 %).
const ACCURACY_BAR: f32 = 0.85;

fn config(kind: CompressionKind, density: f64, epochs: u64, per_node: usize) -> ClusterConfig {
    let mut cfg = test_config(kind, density, epochs);
    cfg.cluster.workers = WORKERS;
    cfg.cluster.workers_per_node = per_node;
    cfg.model.hidden = vec![128];
    cfg.validate().expect("valid node test config");
    cfg
}

fn bucket() -> (
    std::sync::Arc<dyn object_store::ObjectStore>,
    object_store::path::Path,
) {
    let spec = SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    };
    synthetic_bucket_blocking(&spec)
}

fn train(cfg: ClusterConfig) -> Vec<WorkerReport> {
    let (store, prefix) = bucket();
    run_cluster(cfg, store, prefix).expect("cluster run")
}

/// Bytes (sent, received) over each node's link: the sum of its workers'
/// own links in a flat run, the node's one link otherwise (which every rank
/// of the node reports).
fn per_node_link(reports: &[WorkerReport], per_node: usize) -> Vec<(u64, u64)> {
    assert_eq!(reports.len(), WORKERS);
    reports
        .chunks(PER_NODE)
        .map(|node| {
            if per_node == 1 {
                node.iter().fold((0, 0), |(s, r), w| {
                    (s + w.link_sent_bytes, r + w.link_received_bytes)
                })
            } else {
                for w in node {
                    assert_eq!(
                        (w.link_sent_bytes, w.link_received_bytes),
                        (node[0].link_sent_bytes, node[0].link_received_bytes),
                        "the ranks of a node report the node's one link"
                    );
                }
                (node[0].link_sent_bytes, node[0].link_received_bytes)
            }
        })
        .collect()
}

fn check_learned(name: &str, reports: &[WorkerReport]) {
    assert_eq!(reports.len(), WORKERS, "{name}");
    for r in reports {
        assert!(r.steps > 0, "{name}: worker {} trained nothing", r.rank);
        assert_eq!(r.steps, reports[0].steps, "{name}: BSP step counts");
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "{name}: worker {} reached only {:.3}",
            r.rank,
            r.final_accuracy
        );
        assert_eq!(
            r.steps_short_of_workers, 0,
            "{name}: worker {} trained without all workers",
            r.rank
        );
    }
}

/// Runs flat and 2 × 2, checks accuracy within `bound` and the link bytes;
/// returns (flat accuracy, node accuracy).
fn compare(kind: CompressionKind, density: f64, epochs: u64, bound: f32) -> (f32, f32) {
    let flat = train(config(kind, density, epochs, 1));
    let node = train(config(kind, density, epochs, PER_NODE));
    check_learned("flat", &flat);
    check_learned("2 nodes x 2", &node);
    let acc = |r: &[WorkerReport]| r[0].final_accuracy;
    for r in &node {
        assert_eq!(
            r.final_accuracy, node[0].final_accuracy,
            "rank {} holds a different model than rank 0",
            r.rank
        );
    }
    let (a_flat, a_node) = (acc(&flat), acc(&node));
    println!(
        "{kind:?} density {density}: accuracy flat {:.2}%, 2 nodes x 2 {:.2}% (bound {:.1} points); {} steps",
        100.0 * a_flat,
        100.0 * a_node,
        100.0 * bound,
        node[0].steps
    );
    assert!(
        (a_flat - a_node).abs() <= bound,
        "accuracy flat {a_flat:.4} vs nodes {a_node:.4} differs by more than {bound}"
    );
    let (flat_links, node_links) = (per_node_link(&flat, 1), per_node_link(&node, PER_NODE));
    for (n, (f, g)) in flat_links.iter().zip(&node_links).enumerate() {
        let up = f.0 as f64 / g.0.max(1) as f64;
        let down = f.1 as f64 / g.1.max(1) as f64;
        println!(
            "{kind:?} node {n} link: sent {} B flat vs {} B aggregated (x{up:.3} less), received {} B vs {} B (x{down:.3} less)",
            f.0, g.0, f.1, g.1
        );
        let w = PER_NODE as f64;
        assert!(
            (0.9 * w..=1.1 * w).contains(&up),
            "node {n}: sent bytes fell by x{up:.3}, expected x{w} within 10%"
        );
        assert!(
            down >= 0.9 * w,
            "node {n}: received bytes fell by only x{down:.3}, expected at least x{w} (10% tolerance)"
        );
    }
    (a_flat, a_node)
}

#[test]
fn dense_nodes_train_like_flat_workers_with_half_the_link_bytes() {
    compare(CompressionKind::None, 1.0, 4, 0.01);
}

#[test]
fn topk_nodes_compress_the_node_mean_and_halve_each_node_link() {
    compare(CompressionKind::Topk, 0.01, 6, 0.03);
}

/// Nodes in an asynchronous job: each node pushes on its own schedule, the
/// servers apply every node push on arrival, and the ranks of a node still
/// move together (one exchange per node step).
fn nodes_train_in(mode: SyncMode) {
    let mut cfg = config(CompressionKind::Topk, 0.01, 6, PER_NODE);
    cfg.server.mode = mode;
    cfg.server.staleness = 1;
    cfg.validate().expect("valid config");
    let (store, prefix) = bucket();
    let (reports, shards) =
        run_cluster_detailed(cfg, &Default::default(), store, prefix).expect("cluster run");
    assert_eq!(reports.len(), WORKERS);
    for node in reports.chunks(PER_NODE) {
        for r in node {
            assert_eq!(
                (r.steps, r.final_accuracy),
                (node[0].steps, node[0].final_accuracy),
                "{mode:?}: rank {} and rank {} of one node differ",
                r.rank,
                node[0].rank
            );
            assert!(
                r.final_accuracy > ACCURACY_BAR,
                "{mode:?}: worker {} reached only {:.3}",
                r.rank,
                r.final_accuracy
            );
        }
    }
    // One push per node step reaches every shard, and each is applied.
    let node_steps: u64 = reports.chunks(PER_NODE).map(|n| n[0].steps).sum();
    for s in &shards {
        assert_eq!(s.stats.pushes, node_steps, "{mode:?}: shard {}", s.shard);
        assert_eq!(s.stats.updates, node_steps, "{mode:?}: shard {}", s.shard);
    }
    println!(
        "{mode:?}, 2 nodes x 2, top-k 1%: node steps {:?}, {} node pushes applied per shard, accuracy {:.2}% / {:.2}%",
        reports.chunks(PER_NODE).map(|n| n[0].steps).collect::<Vec<_>>(),
        node_steps,
        100.0 * reports[0].final_accuracy,
        100.0 * reports[PER_NODE].final_accuracy
    );
}

#[test]
fn nodes_train_in_an_asp_job() {
    nodes_train_in(SyncMode::Asp);
}

#[test]
fn nodes_train_in_an_ssp_job() {
    nodes_train_in(SyncMode::Ssp);
}

#[test]
fn a_rank_cannot_run_alone_when_nodes_are_configured() {
    let cfg = config(CompressionKind::Topk, 0.01, 1, PER_NODE);
    let pki = ps_tests::TestPki::new(WORKERS as u32);
    let system = actix::System::new();
    let err = system.block_on(async {
        let store: std::sync::Arc<dyn object_store::ObjectStore> =
            std::sync::Arc::new(object_store::memory::InMemory::new());
        ps_worker::run::run_worker(&cfg, pki.options(1), store, "none".into())
            .await
            .expect_err("rank 1 alone must be refused")
    });
    let message = err.to_string();
    assert!(
        message.contains("cluster.workers_per_node") && message.contains("--node 0"),
        "{message}"
    );
    // A node given the wrong ranks is refused by name too.
    let outcomes = actix::System::new().block_on(async {
        let store: std::sync::Arc<dyn object_store::ObjectStore> =
            std::sync::Arc::new(object_store::memory::InMemory::new());
        ps_worker::run::run_node(
            &cfg,
            1,
            vec![pki.options(0), pki.options(1)],
            store,
            "none".into(),
        )
        .await
    });
    assert_eq!(outcomes.len(), 1);
    let message = outcomes[0].as_ref().unwrap_err().to_string();
    assert!(message.contains("[2, 3]"), "{message}");
}

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

/// The final parameters (the shards' in order) and every shard's status.
fn train(servers: usize, shards_per_server: usize) -> (Vec<f32>, Vec<ShardStatus>) {
    let spec = SyntheticSpec {
        train: 2048,
        test: 256,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = synthetic_bucket_blocking(&spec);
    let cfg = config(servers, shards_per_server);
    let (reports, mut shards) =
        run_cluster_detailed(cfg, &Simulation::default(), store, prefix).expect("cluster run");
    assert!(reports.iter().all(|r| r.steps == STEPS), "{reports:?}");
    shards.sort_by_key(|s| s.shard);
    let params = shards.iter().flat_map(|s| s.params.clone()).collect();
    (params, shards)
}

#[test]
fn clipping_over_four_shards_on_two_servers_equals_one_shard() {
    let (whole, one) = train(1, 1);
    let (split, four) = train(2, 2);
    assert_eq!(one.len(), 1);
    assert_eq!(four.len(), 4);
    assert_eq!(whole.len(), split.len());
    let mut max_abs = 0.0f32;
    let mut max_rel = 0.0f32;
    for (a, b) in whole.iter().zip(&split) {
        let d = (a - b).abs();
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(d / a.abs().max(1e-3));
    }
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
    let spec = SyntheticSpec {
        train: 2048,
        test: 256,
        ..SyntheticSpec::default()
    };
    let mut out = Vec::new();
    for shards in [1, 2] {
        let (store, prefix) = synthetic_bucket_blocking(&spec);
        let (_, mut status) =
            run_cluster_detailed(node(shards), &Simulation::default(), store, prefix)
                .expect("cluster run");
        status.sort_by_key(|s| s.shard);
        out.push(status);
    }
    let params =
        |s: &[ShardStatus]| -> Vec<f32> { s.iter().flat_map(|s| s.params.clone()).collect() };
    let (whole, split) = (params(&out[0]), params(&out[1]));
    let max_rel = whole
        .iter()
        .zip(&split)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    println!("workers_per_node = 2, 1 shard vs 2 shards: max relative difference {max_rel:.3e}");
    assert!(out[1].iter().all(|s| s.stats.norm_clipped > 0));
    assert!(max_rel <= 1e-5, "max relative difference {max_rel:e}");
}

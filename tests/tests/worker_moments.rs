//! `optimizer.moments = "worker"`: each worker keeps Adam's moments, pushes
//! its scheduled AdamW direction through top-k with error feedback, and the
//! servers add the mean at the base rate. A whole cluster in one process on
//! the synthetic set.

use ps_dataset::SyntheticSpec;
use ps_shared::config::{ClusterConfig, CompressionKind, Moments, OptimizerKind, ScheduleKind};
use ps_tests::{run_cluster, synthetic_bucket_blocking, test_config};
use ps_worker::run::WorkerReport;

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

/// AdamW at `lr` with warm-up and cosine decay, decay off for biases.
fn adamw(
    kind: CompressionKind,
    density: f64,
    moments: Moments,
    workers: usize,
    epochs: u64,
    lr: f32,
) -> ClusterConfig {
    let mut cfg = test_config(kind, density, epochs);
    cfg.cluster.workers = workers;
    cfg.compression.momentum_correction = 0.0;
    cfg.compression.momentum_masking = false;
    cfg.optimizer.momentum = 0.0;
    cfg.optimizer.kind = OptimizerKind::Adamw;
    cfg.optimizer.lr = lr;
    cfg.optimizer.weight_decay = 0.01;
    cfg.optimizer.no_decay = vec!["bias".into()];
    cfg.optimizer.schedule.kind = ScheduleKind::Cosine;
    cfg.optimizer.schedule.warmup_steps = 10;
    cfg.optimizer.schedule.total_steps = 300;
    cfg.optimizer.schedule.min_lr = 0.1 * lr;
    cfg.optimizer.moments = moments;
    cfg.validate().expect("valid config");
    cfg
}

fn train(cfg: ClusterConfig) -> Vec<WorkerReport> {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    run_cluster(cfg, store, prefix).expect("cluster run")
}

#[test]
fn worker_moments_with_topk_learn_and_pulls_stay_sparse() {
    let reports = train(adamw(
        CompressionKind::Topk,
        0.01,
        Moments::Worker,
        2,
        6,
        0.005,
    ));
    assert_eq!(reports.len(), 2);
    let p = reports[0].num_params as f64;
    for r in &reports {
        let first = r.epochs.first().expect("an epoch");
        let last = r.epochs.last().expect("an epoch");
        println!(
            "worker {}: {} steps, train loss {:.4} -> {:.4}, test loss {:.4}, accuracy {:.3}, \
             pushed {:.0} B/step, pulled {:.0} B/step (P = {p})",
            r.rank,
            r.steps,
            first.train_loss,
            last.train_loss,
            last.test_loss,
            r.final_accuracy,
            r.bytes_pushed_per_step,
            r.bytes_pulled_per_step
        );
        assert!(r.steps > 150, "{} steps", r.steps);
        // Chance on the synthetic set's 10 classes is a loss of ln 10.
        assert!(
            last.train_loss < 0.5 * first.train_loss && last.test_loss < 0.5 * 10f32.ln(),
            "worker {}: train loss {} -> {}, test loss {}",
            r.rank,
            first.train_loss,
            last.train_loss,
            last.test_loss
        );
        assert!(r.final_accuracy > 0.9, "accuracy {}", r.final_accuracy);
        // The pushes are 1% of the entries (index + value), and so are the
        // pulls: at most the union of the two workers' entries, far below
        // a dense pull of 4 bytes per parameter.
        assert!(
            (last.density - 0.01).abs() < 0.002,
            "density {}",
            last.density
        );
        assert!(
            r.bytes_pulled_per_step < 0.1 * 4.0 * p,
            "pulled {} bytes per step of a dense {}",
            r.bytes_pulled_per_step,
            4.0 * p
        );
    }
    // Both workers hold the servers' parameters after every pull.
    assert!((reports[0].final_accuracy - reports[1].final_accuracy).abs() < 1e-6);
}

/// With one worker and dense pushes, the worker's direction added at the
/// base rate is the servers' AdamW step: both runs end at the same test
/// loss (up to float rounding), and well away from plain SGD at the same
/// rate, which is what the servers would do with the raw gradients.
#[test]
fn one_dense_worker_with_its_own_moments_equals_server_adamw() {
    let loss = |reports: &[WorkerReport]| reports[0].epochs.last().unwrap().test_loss;
    let server = train(adamw(
        CompressionKind::None,
        1.0,
        Moments::Server,
        1,
        3,
        0.002,
    ));
    let worker = train(adamw(
        CompressionKind::None,
        1.0,
        Moments::Worker,
        1,
        3,
        0.002,
    ));
    // What the servers apply with worker moments, given raw gradients.
    let mut sgd = adamw(CompressionKind::None, 1.0, Moments::Server, 1, 3, 0.002);
    sgd.optimizer = adamw(CompressionKind::None, 1.0, Moments::Worker, 1, 3, 0.002)
        .optimizer
        .server_rule();
    let sgd = train(sgd);
    let (s, w, g) = (loss(&server), loss(&worker), loss(&sgd));
    println!("test loss: server AdamW {s:.6}, worker AdamW {w:.6}, plain SGD {g:.6}");
    assert_eq!(server[0].steps, worker[0].steps);
    assert!((s - w).abs() <= 1e-3 * s, "server {s} vs worker {w}");
    assert!((g - s).abs() > 0.05 * s, "SGD {g} vs AdamW {s}");
}

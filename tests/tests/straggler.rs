//! Backup workers (`server.backup_workers`) with a simulated slow worker: a
//! cluster of 3 workers, one of them 3x slower, trains with backup 1 to the
//! accuracy of the fast cluster, every push is counted exactly once, and
//! every sample of every epoch is trained exactly once (the batches the
//! cluster made without the straggler in make-up steps after the last
//! regular step).

use ps_shared::config::ClusterConfig;
use ps_tests::{assert_each_position_once, train_synthetic_traced};
use ps_worker::simulate::{SimComputeSection, Simulation};

/// Test accuracy the run must exceed (chance is 10%), as in `cluster.rs`.
const ACCURACY_BAR: f32 = 0.90;
const SAMPLES: usize = 4096;
const EPOCHS: u64 = 4;

/// Rank 2 is the straggler: every rank's step computes for 20 ms more than
/// measured, rank 2's three times as long.
fn slow_rank_2(rank: u32) -> Simulation {
    Simulation {
        compute: SimComputeSection {
            delay_ms: 20.0,
            slowdown: if rank == 2 { 3.0 } else { 1.0 },
            ..SimComputeSection::default()
        },
        ..Simulation::default()
    }
}

/// Trains the synthetic set 4 epochs on 3 workers, rank 2 the straggler,
/// with one backup worker and `shards` shards; checks what holds whatever
/// the timing and returns the reports and the shards' status.
fn train_with_a_straggler(
    shards: usize,
) -> (
    Vec<ps_worker::run::WorkerReport>,
    Vec<ps_server::actor::ShardStatus>,
) {
    let backup = |cfg: &mut ClusterConfig| cfg.server.backup_workers = 1;
    let (cfg, (reports, status, batches)) =
        train_synthetic_traced(SAMPLES, EPOCHS, 3, shards, backup, &slow_rank_2);
    for r in &reports {
        println!(
            "{shards} shard(s): worker {}: steps {} trained {} (make-up: {} steps, {} samples) accuracy {:.2}%",
            r.rank,
            r.steps,
            trained(r),
            r.makeup_steps,
            r.makeup_samples,
            100.0 * r.final_accuracy
        );
    }
    assert_eq!(status.len(), shards);
    let all: u64 = reports.iter().map(trained).sum();
    for shard in &status {
        println!("shard {}: {:?}", shard.shard, shard.stats);
        // Every batch a worker trained was pushed to every shard and
        // counted there exactly once: on time, or folded late into the
        // next update; none was refused.
        assert_eq!(shard.stats.pushes, all, "shard {}", shard.shard);
        assert_eq!(shard.stats.fenced, 0, "shard {}", shard.shard);
        assert_eq!(shard.stats.refused, 0, "shard {}", shard.shard);
        // The straggler was late at least once (it is 3x slower).
        assert!(shard.stats.late_pushes > 0, "{:?}", shard.stats);
    }
    // Every stream position of every epoch was trained exactly once: the
    // steps the cluster made without the straggler were made up.
    assert_each_position_once(
        &batches,
        SAMPLES,
        EPOCHS,
        cfg.data.seed,
        cfg.data.batch_size,
    );
    // Every rank took part in the same make-up steps, the straggler with
    // the smallest share of their samples.
    let makeup = reports[0].makeup_steps;
    assert!(makeup > 0, "the straggler skipped steps: some were made up");
    assert!(reports.iter().all(|r| r.makeup_steps == makeup));
    assert!(reports[2].makeup_samples < reports[0].makeup_samples.min(reports[1].makeup_samples));
    for r in &reports {
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "worker {} reached only {:.3}",
            r.rank,
            r.final_accuracy
        );
    }
    (reports, status)
}

fn trained(r: &ps_worker::run::WorkerReport) -> u64 {
    r.epochs.iter().map(|e| e.steps).sum()
}

#[test]
fn a_slow_worker_with_one_backup_trains_and_every_push_counts_once() {
    let (reports, status) = train_with_a_straggler(1);
    // One shard: the last update went to someone, so the shard's version
    // is the last step a worker was told to continue at.
    assert_eq!(
        status[0].version,
        reports.iter().map(|r| r.steps).max().unwrap_or(0)
    );
}

#[test]
fn with_two_shards_each_counts_or_folds_every_push() {
    // A push may be on time on one shard and late on the other: the worker
    // sends both the same step, and neither drops its part.
    train_with_a_straggler(2);
}

//! Throughput balancing (`data.balance = "throughput"`) with a simulated
//! slow worker: 3 workers, rank 2 computing 3x as long per sample, train
//! the synthetic set on 2 shards. Every sample of every epoch is trained
//! exactly once across the ranks, every step's batches add up to the
//! global batch, and the slow rank ends with a smaller batch than the fast
//! ones.

use std::collections::BTreeMap;

use ps_shared::config::{Balance, ClusterConfig};
use ps_tests::{assert_each_position_once, train_synthetic_traced, Traced};
use ps_worker::simulate::{SimComputeSection, Simulation};

/// Test accuracy the run must exceed (chance is 10%), as in `straggler.rs`.
const ACCURACY_BAR: f32 = 0.90;
const SAMPLES: usize = 4096;
const BATCH: usize = 32;
const EPOCHS: u64 = 3;

/// Every rank's step computes 0.5 ms per sample more than measured; rank
/// 2's three times as long until global step `until` (0: the whole run).
fn slow_rank_2_until(rank: u32, until: u64) -> Simulation {
    Simulation {
        compute: SimComputeSection {
            sample_ms: 0.5,
            slowdown: if rank == 2 { 3.0 } else { 1.0 },
            slow_until_step: until,
            ..SimComputeSection::default()
        },
        ..Simulation::default()
    }
}

/// Rank 2 slow for the whole run.
fn slow_rank_2(rank: u32) -> Simulation {
    slow_rank_2_until(rank, 0)
}

/// The synthetic set trained by 3 workers with throughput balancing
/// (re-split every 5 steps) on `shards` shards, under `sim`.
fn balanced_run(shards: usize, sim: &dyn Fn(u32) -> Simulation) -> (ClusterConfig, Traced) {
    let balance = |cfg: &mut ClusterConfig| {
        cfg.data.batch_size = BATCH;
        cfg.data.balance = Balance::Throughput;
        cfg.data.balance_every = 5;
    };
    train_synthetic_traced(SAMPLES, EPOCHS, 3, shards, balance, sim)
}

#[test]
fn a_slow_worker_gets_a_smaller_batch_and_every_sample_is_trained_once() {
    let (cfg, (reports, status, trained)) = balanced_run(2, &slow_rank_2);
    for r in &reports {
        println!(
            "worker {}: steps {} accuracy {:.2}%",
            r.rank,
            r.steps,
            100.0 * r.final_accuracy
        );
    }
    for shard in &status {
        assert_eq!(shard.stats.fenced, 0, "shard {}", shard.shard);
        assert_eq!(shard.stats.refused, 0, "shard {}", shard.shard);
    }

    // Every stream position trained once, with the sample of the epoch's
    // global order at that place.
    assert_each_position_once(&trained, SAMPLES, EPOCHS, cfg.data.seed, BATCH);

    // Each step's batches, by rank.
    let mut steps: BTreeMap<u64, [usize; 3]> = BTreeMap::new();
    for b in &trained {
        steps.entry(b.step).or_default()[b.rank as usize] = b.samples.len();
    }
    let last = *steps.keys().next_back().expect("steps");
    let global_batch = 3 * BATCH;
    for (step, sizes) in &steps {
        if *step < last {
            assert_eq!(
                sizes.iter().sum::<usize>(),
                global_batch,
                "step {step}: {sizes:?}"
            );
            assert!(sizes.iter().all(|&s| s >= 1), "step {step}: {sizes:?}");
        }
    }
    let first = steps[&0];
    assert_eq!(first, [BATCH; 3], "the run starts with equal batches");
    let end = steps[&(last - 1)];
    println!(
        "batches at step 0: {first:?}, at step {}: {end:?}",
        last - 1
    );
    assert!(
        end[2] < end[0] && end[2] < end[1],
        "the slow rank should end with the smallest batch: {end:?}"
    );
    for r in &reports {
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "worker {} reached only {:.3}",
            r.rank,
            r.final_accuracy
        );
    }
}

/// A straggler that comes back: rank 2 computes 3x as long per sample until
/// step 30, then at the others' pace. The split gives it a smaller batch
/// while it is slow and an equal share again once it is not, and every
/// stream position is still trained exactly once.
#[test]
fn a_straggler_that_comes_back_gets_its_share_back() {
    const BACK_AT: u64 = 30;
    let (cfg, (_, _, trained)) = balanced_run(1, &|rank| slow_rank_2_until(rank, BACK_AT));
    assert_each_position_once(&trained, SAMPLES, EPOCHS, cfg.data.seed, BATCH);
    let mut steps: BTreeMap<u64, [usize; 3]> = BTreeMap::new();
    for b in &trained {
        steps.entry(b.step).or_default()[b.rank as usize] = b.samples.len();
    }
    let last = *steps.keys().next_back().expect("steps");
    let slowest = steps
        .range(..BACK_AT + 10)
        .map(|(_, s)| s[2])
        .min()
        .expect("early steps");
    let end = steps[&(last - 1)];
    println!(
        "rank 2's smallest batch while slow: {slowest}; batches at step {}: {end:?}",
        last - 1
    );
    assert!(
        slowest < BATCH * 3 / 4,
        "the straggler kept {slowest} of {BATCH}"
    );
    assert!(
        end[2] >= BATCH * 9 / 10,
        "after coming back the rank should have its share again: {end:?}"
    );
}

//! Per-epoch sample order for data-parallel training.
//!
//! Every worker of a synchronous job builds an [`EpochSampler`] with the same
//! `num_samples`, `world` and `seed` and its own `rank`. For each epoch all
//! workers derive the same seeded permutation of `0..num_samples`, cut it into
//! `world` equal parts and take part `rank`, so the parts are disjoint and every
//! worker runs the same number of steps. The `num_samples % world` samples left
//! over are dropped for that epoch only; because the permutation changes every
//! epoch, a different few are dropped each time.
//!
//! A run restarted mid-epoch resumes from a [`ResumePoint`] (epoch, step,
//! seed): [`EpochSampler::start_at`] checks it and [`EpochSampler::batches_from`]
//! gives exactly the batches the uninterrupted run would have taken from there.
//!
//! ```
//! use ps_shared::sampler::EpochSampler;
//!
//! let sampler = EpochSampler::new(10, 3, 1, 42).unwrap();
//! assert_eq!(sampler.per_rank(), 3);
//! let order = sampler.epoch_order(0);
//! assert_eq!(order.len(), 3);
//! let batches = sampler.batches(0, 2);
//! assert_eq!(batches.len(), sampler.steps_per_epoch(2));
//! assert_eq!(batches[0], order[..2].to_vec());
//!
//! // Resume at batch 1 of epoch 4 after a restart.
//! let point = sampler.resume_point(4, 1);
//! let (epoch, step) = sampler.start_at(&point, 1).unwrap();
//! assert_eq!(sampler.batches_from(epoch, step, 1), sampler.batches(4, 1)[1..].to_vec());
//! ```

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::hash::splitmix64;

/// Why an [`EpochSampler`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    /// `world` was zero.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// `rank` was not below `world`.
    #[error("rank {rank} is out of range for a world of {world} workers")]
    RankOutOfRange { rank: usize, world: usize },
    /// Fewer samples than workers: some worker would get nothing.
    #[error(
        "{num_samples} samples cannot be split across {world} workers (need at least one each)"
    )]
    TooFewSamples { num_samples: usize, world: usize },
    /// A resume point from a run with another seed.
    #[error("the resume point was taken with seed {found} but this run uses seed {expected}")]
    SeedMismatch { expected: u64, found: u64 },
    /// A resume step past the end of its epoch.
    #[error("resume step {step} is past the {steps} steps of an epoch")]
    StepOutOfRange { step: usize, steps: usize },
}

/// Where a run stands in its sample order: the next batch to train on is
/// batch `step` of `epoch` of the job seeded with `seed`. Saved with a
/// checkpoint and handed back to the loader after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResumePoint {
    pub epoch: u64,
    pub step: usize,
    pub seed: u64,
}

impl ResumePoint {
    /// The very beginning of a run seeded with `seed`.
    pub fn start(seed: u64) -> Self {
        Self {
            epoch: 0,
            step: 0,
            seed,
        }
    }
}

/// How the samples are split across ranks from one epoch to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Partition {
    /// Reshuffle the whole set every epoch, then split it (each rank sees a
    /// different random part each epoch).
    #[default]
    Reshuffle,
    /// Split the set once (seeded); each epoch shuffles only within the
    /// rank's own part, so a worker's cache stays useful across epochs.
    Stable,
}

/// Seeded per-epoch permutation of `[0, num_samples)` split across `world`
/// workers by rank.
///
/// Every rank gets the same number of samples per epoch
/// (`num_samples / world`, the remainder dropped that epoch) so synchronous
/// training has equal step counts. The order is a pure function of
/// `(seed, epoch, num_samples, world, rank)`; different epochs give different
/// orders, and the ranks' parts of one epoch are disjoint.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochSampler {
    num_samples: usize,
    world: usize,
    rank: usize,
    seed: u64,
    partition: Partition,
}

impl EpochSampler {
    /// Checks `world >= 1`, `rank < world` and `num_samples >= world`.
    pub fn new(
        num_samples: usize,
        world: usize,
        rank: usize,
        seed: u64,
    ) -> Result<Self, SamplerError> {
        if world == 0 {
            return Err(SamplerError::EmptyWorld);
        }
        if rank >= world {
            return Err(SamplerError::RankOutOfRange { rank, world });
        }
        if num_samples < world {
            return Err(SamplerError::TooFewSamples { num_samples, world });
        }
        Ok(Self {
            num_samples,
            world,
            rank,
            seed,
            partition: Partition::Reshuffle,
        })
    }

    /// The same sampler with another partitioning across ranks.
    pub fn with_partition(mut self, partition: Partition) -> Self {
        self.partition = partition;
        self
    }

    pub fn partition(&self) -> Partition {
        self.partition
    }

    /// Size of the whole index space.
    pub fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// Number of workers the samples are split across.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This worker's part.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The seed shared by all workers of the job.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Samples this rank visits per epoch: `num_samples / world`.
    pub fn per_rank(&self) -> usize {
        self.num_samples / self.world
    }

    /// This rank's sample indices for `epoch`, in visiting order.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        // Reshuffle: a new permutation of the whole set each epoch. Stable:
        // one permutation for the whole run, reshuffled within each part.
        let split_seed = match self.partition {
            Partition::Reshuffle => epoch_seed(self.seed, epoch),
            Partition::Stable => epoch_seed(self.seed, u64::MAX),
        };
        let mut perm: Vec<usize> = (0..self.num_samples).collect();
        perm.shuffle(&mut StdRng::seed_from_u64(split_seed));
        let per_rank = self.per_rank();
        let start = self.rank * per_rank;
        perm.truncate(start + per_rank);
        perm.drain(..start);
        if self.partition == Partition::Stable {
            let within = epoch_seed(
                self.seed ^ (self.rank as u64).wrapping_mul(0x9e37_79b9),
                epoch,
            );
            perm.shuffle(&mut StdRng::seed_from_u64(within));
        }
        perm
    }

    /// This rank's order for `epoch` cut into batches of `batch_size`; the
    /// last partial batch is dropped so every rank takes the same steps.
    /// A `batch_size` of zero gives no batches.
    pub fn batches(&self, epoch: u64, batch_size: usize) -> Vec<Vec<usize>> {
        if batch_size == 0 {
            return Vec::new();
        }
        self.epoch_order(epoch)
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect()
    }

    /// Full batches per epoch for `batch_size` (zero for a `batch_size` of zero).
    pub fn steps_per_epoch(&self, batch_size: usize) -> usize {
        self.per_rank().checked_div(batch_size).unwrap_or(0)
    }

    /// The resume point of batch `step` of `epoch` under this sampler's seed.
    pub fn resume_point(&self, epoch: u64, step: usize) -> ResumePoint {
        ResumePoint {
            epoch,
            step,
            seed: self.seed,
        }
    }

    /// Checks a resume point against this sampler (same seed, step within
    /// the epoch for `batch_size`) and returns the `(epoch, step)` to start
    /// at; a step equal to the steps of an epoch means the start of the next.
    pub fn start_at(
        &self,
        point: &ResumePoint,
        batch_size: usize,
    ) -> Result<(u64, usize), SamplerError> {
        if point.seed != self.seed {
            return Err(SamplerError::SeedMismatch {
                expected: self.seed,
                found: point.seed,
            });
        }
        let steps = self.steps_per_epoch(batch_size);
        match point.step.cmp(&steps) {
            std::cmp::Ordering::Less => Ok((point.epoch, point.step)),
            std::cmp::Ordering::Equal => Ok((point.epoch.saturating_add(1), 0)),
            std::cmp::Ordering::Greater => Err(SamplerError::StepOutOfRange {
                step: point.step,
                steps,
            }),
        }
    }

    /// The batches of `epoch` from batch `step` on (empty past the end).
    pub fn batches_from(&self, epoch: u64, step: usize, batch_size: usize) -> Vec<Vec<usize>> {
        let mut all = self.batches(epoch, batch_size);
        all.drain(..step.min(all.len()));
        all
    }
}

/// The RNG seed of one epoch: both inputs pass through SplitMix64 so nearby
/// seeds and epochs give unrelated permutations.
fn epoch_seed(seed: u64, epoch: u64) -> u64 {
    splitmix64(seed ^ splitmix64(epoch.wrapping_add(0x5851_f42d_4c95_7f2d)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn all_ranks(n: usize, world: usize, seed: u64) -> Vec<EpochSampler> {
        (0..world)
            .map(|r| EpochSampler::new(n, world, r, seed).unwrap())
            .collect()
    }

    #[test]
    fn rejects_bad_arguments() {
        assert_eq!(
            EpochSampler::new(10, 0, 0, 1),
            Err(SamplerError::EmptyWorld)
        );
        assert_eq!(
            EpochSampler::new(10, 2, 2, 1),
            Err(SamplerError::RankOutOfRange { rank: 2, world: 2 })
        );
        assert_eq!(
            EpochSampler::new(3, 4, 0, 1),
            Err(SamplerError::TooFewSamples {
                num_samples: 3,
                world: 4
            })
        );
        assert!(EpochSampler::new(4, 4, 3, 1).is_ok());
    }

    #[test]
    fn deterministic_for_same_inputs() {
        let a = EpochSampler::new(1000, 3, 1, 9).unwrap();
        let b = EpochSampler::new(1000, 3, 1, 9).unwrap();
        assert_eq!(a.epoch_order(5), b.epoch_order(5));
        assert_eq!(a.batches(5, 32), b.batches(5, 32));
        let other_seed = EpochSampler::new(1000, 3, 1, 10).unwrap();
        assert_ne!(a.epoch_order(5), other_seed.epoch_order(5));
    }

    #[test]
    fn ranks_partition_the_epoch_with_equal_counts() {
        for &(n, world) in &[(10usize, 3usize), (1000, 4), (7, 7), (101, 1), (64, 8)] {
            let ranks = all_ranks(n, world, 3);
            for epoch in 0..3 {
                let mut seen = HashSet::new();
                for s in &ranks {
                    let order = s.epoch_order(epoch);
                    assert_eq!(order.len(), n / world);
                    assert_eq!(order.len(), s.per_rank());
                    for i in order {
                        assert!(i < n);
                        assert!(seen.insert(i), "index {i} given to two ranks");
                    }
                }
                assert_eq!(seen.len(), (n / world) * world);
            }
        }
    }

    #[test]
    fn single_rank_covers_everything() {
        let s = EpochSampler::new(257, 1, 0, 0).unwrap();
        let mut order = s.epoch_order(4);
        order.sort_unstable();
        assert_eq!(order, (0..257).collect::<Vec<_>>());
    }

    #[test]
    fn epochs_differ() {
        let s = EpochSampler::new(500, 2, 0, 7).unwrap();
        let orders: Vec<_> = (0..5).map(|e| s.epoch_order(e)).collect();
        for i in 0..orders.len() {
            for j in i + 1..orders.len() {
                assert_ne!(orders[i], orders[j], "epochs {i} and {j} share an order");
            }
        }
        // The dropped remainder also moves between epochs.
        let s = EpochSampler::new(11, 2, 0, 7).unwrap();
        let dropped = |epoch| {
            let used: HashSet<usize> = all_ranks(11, 2, 7)
                .iter()
                .flat_map(|r| r.epoch_order(epoch))
                .collect();
            (0..11).find(|i| !used.contains(i))
        };
        let first = dropped(0);
        assert!((1..20).any(|e| dropped(e) != first));
        assert_eq!(s.per_rank(), 5);
    }

    #[test]
    fn batches_drop_partial_tail() {
        let s = EpochSampler::new(103, 2, 1, 11).unwrap();
        assert_eq!(s.per_rank(), 51);
        let order = s.epoch_order(2);
        let batches = s.batches(2, 10);
        assert_eq!(batches.len(), 5);
        assert_eq!(s.steps_per_epoch(10), 5);
        assert!(batches.iter().all(|b| b.len() == 10));
        let flat: Vec<usize> = batches.concat();
        assert_eq!(flat, order[..50].to_vec());
        assert_eq!(s.steps_per_epoch(51), 1);
        assert_eq!(s.steps_per_epoch(52), 0);
        assert!(s.batches(2, 52).is_empty());
        assert_eq!(s.steps_per_epoch(0), 0);
        assert!(s.batches(2, 0).is_empty());
    }

    #[test]
    fn resume_continues_the_same_order() {
        let s = EpochSampler::new(1000, 2, 1, 77).unwrap();
        let uninterrupted: Vec<Vec<usize>> = (0..3).flat_map(|e| s.batches(e, 32)).collect();
        let steps = s.steps_per_epoch(32);
        for (epoch, step) in [(0u64, 0usize), (0, 5), (1, 0), (1, 14), (2, steps - 1)] {
            // A fresh sampler, as after a restart.
            let again = EpochSampler::new(1000, 2, 1, 77).unwrap();
            let (e, st) = again.start_at(&s.resume_point(epoch, step), 32).unwrap();
            let mut resumed = again.batches_from(e, st, 32);
            resumed.extend((e + 1..3).flat_map(|x| again.batches(x, 32)));
            let skip = epoch as usize * steps + step;
            assert_eq!(resumed, uninterrupted[skip..].to_vec(), "({epoch}, {step})");
        }
        // The end of an epoch is the start of the next.
        assert_eq!(s.start_at(&s.resume_point(1, steps), 32), Ok((2, 0)));
        assert_eq!(
            s.start_at(&s.resume_point(1, steps + 1), 32),
            Err(SamplerError::StepOutOfRange {
                step: steps + 1,
                steps
            })
        );
        let other = ResumePoint {
            seed: 78,
            ..ResumePoint::start(78)
        };
        assert_eq!(
            s.start_at(&other, 32),
            Err(SamplerError::SeedMismatch {
                expected: 77,
                found: 78
            })
        );
        assert!(s.batches_from(0, steps + 3, 32).is_empty());
        let json = serde_json::to_string(&s.resume_point(2, 3)).unwrap();
        let back: ResumePoint = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s.resume_point(2, 3));
    }

    #[test]
    fn all_ranks_take_equal_steps() {
        let ranks = all_ranks(1001, 3, 5);
        let steps: Vec<usize> = ranks.iter().map(|r| r.batches(0, 16).len()).collect();
        assert!(steps.iter().all(|&s| s == steps[0]));
        assert_eq!(steps[0], ranks[0].steps_per_epoch(16));
    }

    #[test]
    fn stable_partition_keeps_each_rank_on_its_part() {
        let world = 3;
        let samplers: Vec<EpochSampler> = (0..world)
            .map(|r| {
                EpochSampler::new(100, world, r, 5)
                    .unwrap()
                    .with_partition(Partition::Stable)
            })
            .collect();
        let sorted = |mut v: Vec<usize>| {
            v.sort_unstable();
            v
        };
        let mut seen = std::collections::HashSet::new();
        for s in &samplers {
            let first = s.epoch_order(0);
            // Same part every epoch, in a different order.
            for epoch in 1..4 {
                let order = s.epoch_order(epoch);
                assert_eq!(sorted(order.clone()), sorted(first.clone()));
                assert_ne!(order, first, "epoch {epoch} reuses the order");
            }
            for i in first {
                assert!(seen.insert(i), "sample {i} in two parts");
            }
        }
        assert_eq!(seen.len(), 99);
        // Reshuffling moves samples between ranks.
        let r = EpochSampler::new(100, world, 0, 5).unwrap();
        assert_ne!(sorted(r.epoch_order(0)), sorted(r.epoch_order(1)));
    }
}

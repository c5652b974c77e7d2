//! Per-epoch sample order for data-parallel training, independent of the
//! worker count.
//!
//! Every epoch has one **global order**: a seeded permutation of
//! `0..num_samples` that depends only on the seed and the epoch (with
//! [`Partition::Reshuffle`]), never on how many workers read it. The epochs'
//! orders, one after the other, form the run's **sample stream**: position
//! `p` of the stream is sample `global_order(p / num_samples)[p % num_samples]`.
//! The permutations come from the project's own generator ([`crate::rng`]),
//! so no dependency upgrade can change a run's order; a test pins it.
//!
//! Global step `g` consumes the next `world × batch` samples of the stream,
//! and rank `r` takes the `r`-th run of `batch` of them. With a **split
//! schedule** ([`Split`], `data.balance = "throughput"`) the global batch of
//! a step is cut into runs of other sizes `b_0, …, b_{world-1}` (each at
//! least 1, summing to `world × batch`): rank `r` takes `b_r` samples at
//! offset `b_0 + … + b_{r-1}` of the step's run. A split is a pure function
//! of the step shared by every rank, so the stream is still covered exactly
//! once whatever the sizes. Steps are not cut at
//! epoch ends: when the samples left in an epoch do not fill a global batch,
//! the step takes them and continues with the first samples of the next
//! epoch's order (a batch belongs to the epoch of its first sample). So every
//! sample of every epoch is trained exactly once, whatever the worker count.
//! Only the run's very last global step may be short: ranks take what is left
//! in rank order (a partial batch, then nothing), and a rank with nothing left
//! finishes one step before the others.
//!
//! A run is resumed from a [`ResumePoint`]: the global step it was at, and how
//! many samples of that epoch's global order had been consumed then (not a
//! step index). From there the steps go on with the world size of the
//! resumed run, so a run checkpointed with N workers resumes with M workers
//! at exactly the same place of the stream ([`EpochSampler::plan_from`]).
//!
//! ```
//! use ps_shared::sampler::{EpochSampler, ResumePoint};
//!
//! // 10 samples, 3 workers, batches of 2: a global step takes 6 samples.
//! let rank1 = EpochSampler::new(10, 3, 1, 42).unwrap();
//! let plan = rank1.plan(2, 2);
//! let order0 = rank1.global_order(0, 2);
//! assert_eq!(plan.batch(0).samples, order0[2..4].to_vec());
//! // Step 1 starts at sample 6 of epoch 0; rank 1 takes positions 8 and 9.
//! assert_eq!(plan.batch(1).samples, order0[8..10].to_vec());
//!
//! // The same stream read by 2 workers after a resume at step 1 (6 samples
//! // of epoch 0 consumed): rank 0 now takes positions 6 and 7.
//! let point = plan.resume_point(1);
//! assert_eq!((point.epoch, point.consumed), (0, 6));
//! let two = EpochSampler::new(10, 2, 0, 42).unwrap();
//! let resumed = two.plan_from(2, 2, point).unwrap();
//! assert_eq!(resumed.batch(1).samples, order0[6..8].to_vec());
//! ```

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::hash::splitmix64;
use crate::rng::{shuffle, StreamRng};

/// Why an [`EpochSampler`] or a [`RankPlan`] could not be built.
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
    /// A resume point that consumed more samples than its epoch has.
    #[error("the resume point consumed {consumed} samples of an epoch of {num_samples}")]
    ConsumedOutOfRange { consumed: u64, num_samples: usize },
    /// A batch size of zero.
    #[error("batch size must be at least 1")]
    EmptyBatch,
    /// A step before the resume point the plan starts from.
    #[error("step {step} is before step {origin}, where this run's sample order resumed")]
    StepBeforeResume { step: u64, origin: u64 },
    /// A split of the global batch that does not fit the world or the
    /// global batch, or comes before a split already in the schedule.
    #[error("invalid batch split from step {from}: {reason}")]
    BadSplit { from: u64, reason: String },
}

/// How the global batch is cut across the ranks from global step `from`
/// on (until the next split of the schedule): rank `r` takes `sizes[r]`
/// samples, after the `sizes[..r]` of the ranks before it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Split {
    pub from: u64,
    pub sizes: Vec<u64>,
}

impl Split {
    /// The equal split of today's plans: `world` runs of `batch`.
    pub fn equal(from: u64, world: usize, batch: u64) -> Self {
        Self {
            from,
            sizes: vec![batch; world],
        }
    }

    /// Checks the split against a world and a global batch: one size per
    /// rank, each at least 1, summing to the global batch.
    pub fn check(&self, world: usize, global_batch: u64) -> Result<(), SamplerError> {
        let bad = |reason: String| SamplerError::BadSplit {
            from: self.from,
            reason,
        };
        if self.sizes.len() != world {
            return Err(bad(format!(
                "{} sizes for a world of {world} workers",
                self.sizes.len()
            )));
        }
        if self.sizes.contains(&0) {
            return Err(bad("every rank needs at least one sample".into()));
        }
        let sum = self
            .sizes
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .unwrap_or(u64::MAX);
        if sum != global_batch {
            return Err(bad(format!(
                "the sizes sum to {sum}, the global batch is {global_batch}"
            )));
        }
        Ok(())
    }
}

/// Cuts a global batch of `global` samples across ranks in proportion to
/// `weights` (their throughputs): each rank gets at least 1, the sizes sum
/// to `global` exactly (largest remainders round up, ties to the lower
/// rank). Weights that are not finite and positive count as the smallest
/// positive one given (or 1 when there is none). `global` must be at least
/// the number of ranks.
pub fn proportional_split(weights: &[f64], global: u64) -> Vec<u64> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = weights
        .iter()
        .copied()
        .filter(|w| w.is_finite() && *w > 0.0)
        .fold(f64::INFINITY, f64::min);
    let floor = if floor.is_finite() { floor } else { 1.0 };
    let w: Vec<f64> = weights
        .iter()
        .map(|&w| if w.is_finite() && w > 0.0 { w } else { floor })
        .collect();
    // One sample each first; the rest in proportion.
    let spare = global.saturating_sub(n as u64);
    let total: f64 = w.iter().sum();
    let exact: Vec<f64> = w.iter().map(|x| spare as f64 * x / total).collect();
    let mut sizes: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
    let given: u64 = sizes.iter().sum();
    let mut left = spare.saturating_sub(given);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let (ra, rb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        sizes[i] += 1;
        left -= 1;
    }
    // Float rounding may have given one too many somewhere.
    let mut over = sizes.iter().sum::<u64>().saturating_sub(spare);
    for s in sizes.iter_mut().rev() {
        let take = over.min(*s);
        *s -= take;
        over -= take;
    }
    sizes.iter_mut().for_each(|s| *s += 1);
    sizes
}

/// Where a run stands in its sample stream: global step `step` starts after
/// `consumed` samples of epoch `epoch`'s global order, in the job seeded with
/// `seed`. Kept (as a stream position) with the servers' checkpoints and
/// handed to the workers when they join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResumePoint {
    pub step: u64,
    pub epoch: u64,
    pub consumed: u64,
    pub seed: u64,
}

impl ResumePoint {
    /// The very beginning of a run seeded with `seed`.
    pub fn start(seed: u64) -> Self {
        Self {
            step: 0,
            epoch: 0,
            consumed: 0,
            seed,
        }
    }

    /// Global step `step` starts at position `samples` of the stream of a
    /// set of `num_samples` (at least 1).
    pub fn at_stream(step: u64, samples: u64, num_samples: usize, seed: u64) -> Self {
        let n = num_samples.max(1) as u64;
        Self {
            step,
            epoch: samples / n,
            consumed: samples % n,
            seed,
        }
    }

    /// Position in the stream: samples consumed since the start of the run.
    pub fn stream_position(&self, num_samples: usize) -> u64 {
        self.epoch
            .saturating_mul(num_samples as u64)
            .saturating_add(self.consumed)
    }
}

/// How an epoch's global order is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Partition {
    /// A new permutation of the whole set every epoch, independent of the
    /// worker count (each rank sees a different random part each epoch).
    /// The worker count may change when a run resumes.
    #[default]
    Reshuffle,
    /// The set is split once (seeded) into one part per rank, and each
    /// epoch shuffles only within the parts; the global order interleaves
    /// them batch by batch, so a rank keeps reading its own part and its
    /// cache stays useful across epochs. The order depends on the worker
    /// count and the batch size, so neither may change on resume. A rank
    /// stays on its part exactly when `num_samples` is a multiple of
    /// `world × batch` (otherwise steps straddle epoch ends and the parts
    /// drift between ranks).
    Stable,
}

/// Seeded per-epoch global orders of `[0, num_samples)`, and the part of
/// them that rank `rank` of `world` takes.
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

    /// The same sampler with another way of drawing the orders.
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

    /// Number of workers a global step is split across.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This worker's run within each global step.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The seed shared by all workers of the job.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The global order of `epoch`: a permutation of `0..num_samples`. With
    /// [`Partition::Reshuffle`] it depends on the seed and the epoch only;
    /// `batch` matters only for [`Partition::Stable`].
    pub fn global_order(&self, epoch: u64, batch: usize) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.num_samples).collect();
        match self.partition {
            Partition::Reshuffle => {
                shuffle(
                    &mut perm,
                    &mut StreamRng::seed_from_u64(epoch_seed(self.seed, epoch)),
                );
                perm
            }
            Partition::Stable => {
                shuffle(
                    &mut perm,
                    &mut StreamRng::seed_from_u64(epoch_seed(self.seed, u64::MAX)),
                );
                let per = self.num_samples / self.world;
                let parts: Vec<Vec<usize>> = (0..self.world)
                    .map(|r| {
                        let mut part = perm[r * per..(r + 1) * per].to_vec();
                        let within =
                            epoch_seed(self.seed ^ (r as u64).wrapping_mul(0x9e37_79b9), epoch);
                        shuffle(&mut part, &mut StreamRng::seed_from_u64(within));
                        part
                    })
                    .collect();
                let mut rest = perm[self.world * per..].to_vec();
                shuffle(
                    &mut rest,
                    &mut StreamRng::seed_from_u64(epoch_seed(self.seed, epoch)),
                );
                let b = batch.max(1);
                let full = per / b;
                let mut order = Vec::with_capacity(self.num_samples);
                for j in 0..full {
                    for part in &parts {
                        order.extend_from_slice(&part[j * b..(j + 1) * b]);
                    }
                }
                for part in &parts {
                    order.extend_from_slice(&part[full * b..]);
                }
                order.extend(rest);
                order
            }
        }
    }

    /// This rank's plan for a run of `epochs` epochs in batches of `batch`,
    /// from the beginning. A `batch` of zero is taken as 1.
    pub fn plan(&self, batch: usize, epochs: u64) -> RankPlan {
        RankPlan {
            sampler: self.clone(),
            batch: batch.max(1) as u64,
            epochs,
            origin: ResumePoint::start(self.seed),
            origin_pos: 0,
            splits: Vec::new(),
        }
    }

    /// This rank's plan for a run resumed at `point`: global step
    /// `point.step` starts there, and each step from then on consumes
    /// `world × batch` samples. Checks the seed and the point.
    pub fn plan_from(
        &self,
        batch: usize,
        epochs: u64,
        point: ResumePoint,
    ) -> Result<RankPlan, SamplerError> {
        if batch == 0 {
            return Err(SamplerError::EmptyBatch);
        }
        if point.seed != self.seed {
            return Err(SamplerError::SeedMismatch {
                expected: self.seed,
                found: point.seed,
            });
        }
        if point.consumed >= self.num_samples as u64 {
            return Err(SamplerError::ConsumedOutOfRange {
                consumed: point.consumed,
                num_samples: self.num_samples,
            });
        }
        Ok(RankPlan {
            sampler: self.clone(),
            batch: batch as u64,
            epochs,
            origin_pos: point.stream_position(self.num_samples),
            origin: point,
            splits: Vec::new(),
        })
    }
}

/// One rank's batch of one global step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBatch {
    pub step: u64,
    /// The epoch of its first sample.
    pub epoch: u64,
    /// Stream position of its first sample (sample `i` is at `first + i`).
    pub first: u64,
    pub samples: Vec<usize>,
}

impl PlannedBatch {
    /// Each sample with its stream position: `(first + i, samples[i])`.
    pub fn positions(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        (self.first..).zip(self.samples.iter().copied())
    }
}

/// Which samples one rank takes at each global step of a run (see the
/// module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct RankPlan {
    sampler: EpochSampler,
    batch: u64,
    epochs: u64,
    origin: ResumePoint,
    origin_pos: u64,
    /// The split schedule, ascending by `from`; before its first entry
    /// (and without one) the split is equal.
    splits: Vec<Split>,
}

impl RankPlan {
    pub fn sampler(&self) -> &EpochSampler {
        &self.sampler
    }

    /// The same run's plan for another rank of the world (same origin,
    /// splits and orders): which samples `rank` takes at each step.
    pub fn for_rank(&self, rank: usize) -> Result<RankPlan, SamplerError> {
        let world = self.sampler.world;
        if rank >= world {
            return Err(SamplerError::RankOutOfRange { rank, world });
        }
        let mut plan = self.clone();
        plan.sampler.rank = rank;
        Ok(plan)
    }

    pub fn batch_size(&self) -> usize {
        self.batch as usize
    }

    pub fn epochs(&self) -> u64 {
        self.epochs
    }

    /// The global step this plan starts at.
    pub fn origin_step(&self) -> u64 {
        self.origin.step
    }

    /// Samples every global step consumes: `world × batch`.
    pub fn global_batch(&self) -> u64 {
        self.batch * self.sampler.world as u64
    }

    /// Length of the run's stream: `epochs × num_samples`.
    pub fn stream_len(&self) -> u64 {
        self.epochs.saturating_mul(self.sampler.num_samples as u64)
    }

    /// The epoch of stream position `pos`.
    pub fn epoch_of(&self, pos: u64) -> u64 {
        pos / self.sampler.num_samples as u64
    }

    /// Where global step `step` starts in the stream (steps before the
    /// origin are not part of this plan: the origin is returned).
    pub fn step_start(&self, step: u64) -> u64 {
        let k = step.saturating_sub(self.origin.step);
        self.origin_pos
            .saturating_add(k.saturating_mul(self.global_batch()))
    }

    /// The resume point of global step `step` (the stream end is clamped to
    /// the start of the epoch after the last).
    pub fn resume_point(&self, step: u64) -> ResumePoint {
        let pos = self.step_start(step).min(self.stream_len());
        ResumePoint::at_stream(step, pos, self.sampler.num_samples, self.sampler.seed)
    }

    /// Adds a split to the schedule, from `split.from` on. Splits come in
    /// ascending order of `from`; the same split again is a no-op.
    pub fn push_split(&mut self, split: Split) -> Result<(), SamplerError> {
        split.check(self.sampler.world, self.global_batch())?;
        match self.splits.last() {
            Some(last) if *last == split => return Ok(()),
            Some(last) if last.from >= split.from => {
                return Err(SamplerError::BadSplit {
                    from: split.from,
                    reason: format!("the schedule already has a split from step {}", last.from),
                })
            }
            _ => {}
        }
        self.splits.push(split);
        Ok(())
    }

    /// This plan with every split of `splits` added ([`RankPlan::push_split`]).
    pub fn with_splits(mut self, splits: &[Split]) -> Result<Self, SamplerError> {
        for s in splits {
            self.push_split(s.clone())?;
        }
        Ok(self)
    }

    /// The split schedule (empty: equal throughout).
    pub fn splits(&self) -> &[Split] {
        &self.splits
    }

    /// The sizes of every rank's run at `step`, `None` when equal.
    fn sizes_at(&self, step: u64) -> Option<&[u64]> {
        let i = self.splits.partition_point(|s| s.from <= step);
        i.checked_sub(1).map(|i| self.splits[i].sizes.as_slice())
    }

    /// How many samples rank `rank` takes at `step` when the stream does
    /// not run out (`batch` with the equal split).
    pub fn size_of(&self, step: u64, rank: usize) -> u64 {
        match self.sizes_at(step) {
            Some(sizes) => sizes.get(rank).copied().unwrap_or(0),
            None => self.batch,
        }
    }

    /// This rank's planned batch size at `step` ([`RankPlan::size_of`]).
    pub fn own_size(&self, step: u64) -> u64 {
        self.size_of(step, self.sampler.rank)
    }

    /// Where this rank's run starts within the global batch of `step`.
    fn offset_at(&self, step: u64) -> u64 {
        let r = self.sampler.rank;
        match self.sizes_at(step) {
            Some(sizes) => sizes[..r.min(sizes.len())].iter().sum(),
            None => r as u64 * self.batch,
        }
    }

    /// The stream positions this rank takes at `step` (empty once the run's
    /// stream is used up, and before the origin).
    pub fn range(&self, step: u64) -> Range<u64> {
        if step < self.origin.step {
            return 0..0;
        }
        let end = self.stream_len();
        let lo = self
            .step_start(step)
            .saturating_add(self.offset_at(step))
            .min(end);
        let hi = lo.saturating_add(self.own_size(step)).min(end);
        lo..hi
    }

    /// The rank that takes stream position `pos` in this plan's steps
    /// (`None` before the origin and past the stream's end). With a split
    /// schedule, by the splits known to this plan.
    pub fn rank_at(&self, pos: u64) -> Option<usize> {
        if pos < self.origin_pos || pos >= self.stream_len() {
            return None;
        }
        let step = self.step_of(pos);
        let within = pos - self.step_start(step);
        match self.sizes_at(step) {
            Some(sizes) => {
                let mut end = 0;
                sizes.iter().position(|&b| {
                    end += b;
                    within < end
                })
            }
            None => Some((within / self.batch) as usize),
        }
    }

    /// Stream position where this plan's first step starts.
    pub fn origin_pos(&self) -> u64 {
        self.origin_pos
    }

    /// The first global step no rank has samples for: the run's steps are
    /// `origin_step()..global_end_step()` (only the last may be short).
    pub fn global_end_step(&self) -> u64 {
        let end = self.stream_len();
        if self.origin_pos >= end {
            return self.origin.step;
        }
        self.origin.step + (end - self.origin_pos).div_ceil(self.global_batch())
    }

    /// The first global step at which this rank has nothing left (its
    /// steps are `origin_step()..end_step()`). With a split schedule, it
    /// depends on the split of the run's last step.
    pub fn end_step(&self) -> u64 {
        let last = self.global_end_step();
        if last == self.origin.step {
            return last;
        }
        if self.range(last - 1).is_empty() {
            last - 1
        } else {
            last
        }
    }

    /// The global step whose run of the stream holds position `pos` (the
    /// origin for earlier positions).
    fn step_of(&self, pos: u64) -> u64 {
        self.origin.step + pos.saturating_sub(self.origin_pos) / self.global_batch()
    }

    /// The steps at which this rank takes samples of stream range `lo..hi`.
    pub fn steps_touching(&self, lo: u64, hi: u64) -> Range<u64> {
        let hi = hi.min(self.stream_len());
        if !self.splits.is_empty() {
            if lo >= hi || hi <= self.origin_pos {
                return self.origin.step..self.origin.step;
            }
            let touches = |s: u64| {
                let r = self.range(s);
                r.start < hi && r.end > lo && !r.is_empty()
            };
            let (mut first, mut last) = (self.step_of(lo), self.step_of(hi - 1) + 1);
            while first < last && !touches(first) {
                first += 1;
            }
            while last > first && !touches(last - 1) {
                last -= 1;
            }
            return first..last;
        }
        let base = self.origin_pos + self.sampler.rank as u64 * self.batch;
        let g = self.global_batch();
        if hi <= base || lo >= hi {
            return self.origin.step..self.origin.step;
        }
        // Run k covers [base + k g, base + k g + batch).
        let first = if lo < base + self.batch {
            0
        } else {
            (lo - self.batch - base) / g + 1
        };
        let last = (hi - base).div_ceil(g);
        self.origin.step + first..self.origin.step + last.max(first)
    }

    /// The batch of `step` (empty past the end), computing the global
    /// orders it needs.
    pub fn batch(&self, step: u64) -> PlannedBatch {
        self.batch_with(step, &mut None)
    }

    /// [`RankPlan::batch`], reusing the last global order computed.
    fn batch_with(&self, step: u64, cache: &mut Option<(u64, Vec<usize>)>) -> PlannedBatch {
        let n = self.sampler.num_samples as u64;
        let range = self.range(step);
        let mut samples = Vec::with_capacity((range.end - range.start) as usize);
        for pos in range.clone() {
            let epoch = pos / n;
            if cache.as_ref().is_none_or(|(e, _)| *e != epoch) {
                *cache = Some((epoch, self.sampler.global_order(epoch, self.batch as usize)));
            }
            if let Some((_, o)) = cache.as_ref() {
                samples.push(o[(pos % n) as usize]);
            }
        }
        PlannedBatch {
            step,
            epoch: range.start / n,
            first: range.start,
            samples,
        }
    }

    /// Every batch from `step` to the end of the run.
    pub fn batches_from(&self, step: u64) -> Vec<PlannedBatch> {
        let mut cache = None;
        (step.max(self.origin.step)..self.end_step())
            .map(|s| self.batch_with(s, &mut cache))
            .collect()
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
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn plans(n: usize, world: usize, batch: usize, epochs: u64, seed: u64) -> Vec<RankPlan> {
        (0..world)
            .map(|r| {
                EpochSampler::new(n, world, r, seed)
                    .unwrap()
                    .plan(batch, epochs)
            })
            .collect()
    }

    /// Every (stream position, sample) a run with `world` workers trains
    /// between global steps `from..to`, resumed at `point` (or from the start).
    fn trained(
        n: usize,
        world: usize,
        batch: usize,
        epochs: u64,
        point: Option<ResumePoint>,
        to: Option<u64>,
    ) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        for r in 0..world {
            let s = EpochSampler::new(n, world, r, 5).unwrap();
            let plan = match point {
                Some(p) => s.plan_from(batch, epochs, p).unwrap(),
                None => s.plan(batch, epochs),
            };
            let end = to.unwrap_or(u64::MAX).min(plan.end_step());
            for step in plan.origin_step()..end {
                let b = plan.batch(step);
                assert_eq!(b.epoch, plan.epoch_of(b.first));
                out.extend(b.positions());
            }
        }
        out
    }

    /// Each stream position of `0..epochs × n` trained once, with the
    /// sample of that position in the epoch's global order.
    fn assert_exactly_once(n: usize, epochs: u64, seen: &[(u64, usize)]) {
        let s = EpochSampler::new(n, 1, 0, 5).unwrap();
        let mut at: HashMap<u64, usize> = HashMap::new();
        for &(pos, sample) in seen {
            assert!(
                at.insert(pos, sample).is_none(),
                "position {pos} trained twice"
            );
        }
        assert_eq!(at.len() as u64, epochs * n as u64, "positions missing");
        for epoch in 0..epochs {
            let order = s.global_order(epoch, 1);
            for (i, &sample) in order.iter().enumerate() {
                assert_eq!(at[&(epoch * n as u64 + i as u64)], sample);
            }
        }
    }

    #[test]
    fn the_orders_are_pinned() {
        // Test vectors: a change here changes every run's sample order (and
        // a checkpoint's resume point would then name other samples).
        let s = EpochSampler::new(10, 2, 0, 42).unwrap();
        assert_eq!(s.global_order(0, 2), PINNED_EPOCH0);
        assert_eq!(s.global_order(1, 2), PINNED_EPOCH1);
        let stable = EpochSampler::new(10, 2, 0, 42)
            .unwrap()
            .with_partition(Partition::Stable);
        assert_eq!(stable.global_order(0, 2), PINNED_STABLE0);
    }

    const PINNED_EPOCH0: [usize; 10] = [3, 8, 6, 9, 2, 1, 5, 7, 4, 0];
    const PINNED_EPOCH1: [usize; 10] = [7, 2, 6, 3, 0, 5, 8, 4, 1, 9];
    const PINNED_STABLE0: [usize; 10] = [3, 9, 4, 6, 5, 7, 0, 2, 8, 1];

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
        let s = EpochSampler::new(10, 2, 1, 1).unwrap();
        assert_eq!(
            s.plan_from(0, 1, ResumePoint::start(1)),
            Err(SamplerError::EmptyBatch)
        );
        assert_eq!(
            s.plan_from(2, 1, ResumePoint::start(2)),
            Err(SamplerError::SeedMismatch {
                expected: 1,
                found: 2
            })
        );
        let past = ResumePoint {
            consumed: 10,
            ..ResumePoint::start(1)
        };
        assert_eq!(
            s.plan_from(2, 1, past),
            Err(SamplerError::ConsumedOutOfRange {
                consumed: 10,
                num_samples: 10
            })
        );
    }

    #[test]
    fn the_global_order_is_a_permutation_independent_of_world() {
        for n in [1usize, 7, 100, 1001] {
            let one = EpochSampler::new(n, 1, 0, 9).unwrap();
            for epoch in 0..3 {
                let order = one.global_order(epoch, 8);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>());
                for world in [2usize, 3, 7] {
                    if world > n {
                        continue;
                    }
                    for rank in [0, world - 1] {
                        let s = EpochSampler::new(n, world, rank, 9).unwrap();
                        assert_eq!(s.global_order(epoch, 8), order, "n {n} world {world}");
                        assert_eq!(s.global_order(epoch, 3), order, "batch must not matter");
                    }
                }
            }
        }
        let s = EpochSampler::new(500, 2, 0, 7).unwrap();
        let orders: Vec<_> = (0..5).map(|e| s.global_order(e, 4)).collect();
        for i in 0..orders.len() {
            for j in i + 1..orders.len() {
                assert_ne!(orders[i], orders[j], "epochs {i} and {j} share an order");
            }
        }
        let other_seed = EpochSampler::new(500, 2, 0, 8).unwrap();
        assert_ne!(other_seed.global_order(0, 4), orders[0]);
    }

    #[test]
    fn ranks_take_consecutive_runs_of_each_global_step() {
        // 10 samples, 3 workers, batches of 2, 2 epochs: steps take 6
        // samples; step 1 straddles into epoch 1.
        let p = plans(10, 3, 2, 2, 3);
        let s = p[0].sampler().clone();
        let (e0, e1) = (s.global_order(0, 2), s.global_order(1, 2));
        assert_eq!(p[0].batch(0).samples, e0[0..2].to_vec());
        assert_eq!(p[2].batch(0).samples, e0[4..6].to_vec());
        assert_eq!(p[1].batch(1).samples, e0[8..10].to_vec());
        let straddle = p[2].batch(1);
        assert_eq!((straddle.epoch, straddle.first), (1, 10));
        assert_eq!(straddle.samples, e1[0..2].to_vec());
        // 20 samples in steps of 6: the last step (3) has 2 samples, for rank 0.
        assert_eq!(p[0].end_step(), 4);
        assert_eq!((p[1].end_step(), p[2].end_step()), (3, 3));
        assert_eq!(p[0].batch(3).samples, e1[8..10].to_vec());
        assert!(p[1].batch(3).samples.is_empty());
        assert_exactly_once(10, 2, &trained(10, 3, 2, 2, None, None));
        // A short last batch: 11 samples, one epoch, batches of 4 over 2.
        let p = plans(11, 2, 4, 1, 3);
        assert_eq!(p[0].batch(1).samples.len(), 3);
        assert_eq!((p[0].end_step(), p[1].end_step()), (2, 1));
    }

    #[test]
    fn a_resume_with_another_world_continues_the_same_stream() {
        // 4 workers for 3 steps, then 2 workers, then 3.
        let (n, batch, epochs) = (103usize, 5usize, 3u64);
        let first = plans(n, 4, batch, epochs, 5);
        let point = first[0].resume_point(3);
        assert_eq!((point.step, point.epoch, point.consumed), (3, 0, 60));
        let mut seen = trained(n, 4, batch, epochs, None, Some(3));
        let two = EpochSampler::new(n, 2, 0, 5)
            .unwrap()
            .plan_from(batch, epochs, point)
            .unwrap();
        // The next global step starts where the 4 workers stopped.
        assert_eq!(two.range(3), 60..65);
        assert_eq!(
            two.range(2),
            0..0,
            "steps before the resume are not planned"
        );
        let next = two.resume_point(10);
        assert_eq!((next.step, next.epoch, next.consumed), (10, 1, 130 - 103));
        seen.extend(trained(n, 2, batch, epochs, Some(point), Some(10)));
        seen.extend(trained(n, 3, batch, epochs, Some(next), None));
        assert_exactly_once(n, epochs, &seen);
        // The same point serialises.
        let json = serde_json::to_string(&next).unwrap();
        assert_eq!(serde_json::from_str::<ResumePoint>(&json).unwrap(), next);
        assert_eq!(next.stream_position(n), 130);
    }

    #[test]
    fn steps_touching_an_epoch_are_exactly_those_with_its_samples() {
        for (n, world, batch) in [(10usize, 3usize, 2usize), (97, 2, 8), (64, 4, 4), (5, 1, 7)] {
            for rank in 0..world {
                let plan = EpochSampler::new(n, world, rank, 1).unwrap().plan(batch, 3);
                for epoch in 0..3u64 {
                    let (lo, hi) = (epoch * n as u64, (epoch + 1) * n as u64);
                    let want: Vec<u64> = (0..plan.end_step())
                        .filter(|&s| {
                            let r = plan.range(s);
                            r.start < hi && r.end > lo
                        })
                        .collect();
                    let got: Vec<u64> = plan.steps_touching(lo, hi).collect();
                    assert_eq!(got, want, "n {n} world {world} batch {batch} rank {rank}");
                }
            }
        }
    }

    #[test]
    fn stable_partition_keeps_each_rank_on_its_part() {
        let world = 3;
        let batch = 4;
        // 96 = 8 global batches of 12: aligned, so parts never drift.
        let plans: Vec<RankPlan> = (0..world)
            .map(|r| {
                EpochSampler::new(96, world, r, 5)
                    .unwrap()
                    .with_partition(Partition::Stable)
                    .plan(batch, 4)
            })
            .collect();
        let sorted = |mut v: Vec<usize>| {
            v.sort_unstable();
            v
        };
        let epoch_samples = |p: &RankPlan, e: u64| -> Vec<usize> {
            (e * 8..(e + 1) * 8)
                .flat_map(|s| p.batch(s).samples)
                .collect()
        };
        let mut seen = std::collections::HashSet::new();
        for p in &plans {
            let first = epoch_samples(p, 0);
            for epoch in 1..4 {
                let order = epoch_samples(p, epoch);
                assert_eq!(sorted(order.clone()), sorted(first.clone()));
                assert_ne!(order, first, "epoch {epoch} reuses the order");
            }
            for i in first {
                assert!(seen.insert(i), "sample {i} in two parts");
            }
        }
        assert_eq!(seen.len(), 96);
        // Stable orders are still permutations, also with a remainder.
        let s = EpochSampler::new(101, 3, 0, 5)
            .unwrap()
            .with_partition(Partition::Stable);
        assert_eq!(sorted(s.global_order(2, 4)), (0..101).collect::<Vec<_>>());
    }

    /// Every (stream position, sample) the ranks of a run with `world`
    /// workers and split schedule `splits` train, from the start.
    fn trained_split(
        n: usize,
        world: usize,
        batch: usize,
        epochs: u64,
        splits: &[Split],
    ) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        for r in 0..world {
            let plan = EpochSampler::new(n, world, r, 5)
                .unwrap()
                .plan(batch, epochs)
                .with_splits(splits)
                .unwrap();
            for b in plan.batches_from(0) {
                assert_eq!(b.epoch, plan.epoch_of(b.first));
                assert!(b.samples.len() as u64 <= plan.own_size(b.step));
                out.extend(b.positions());
            }
        }
        out
    }

    #[test]
    fn an_equal_split_is_todays_plan() {
        for (n, world, batch) in [(10usize, 3usize, 2usize), (97, 2, 8), (103, 4, 5)] {
            for r in 0..world {
                let plain = EpochSampler::new(n, world, r, 1).unwrap().plan(batch, 3);
                let equal = plain
                    .clone()
                    .with_splits(&[Split::equal(2, world, batch as u64)])
                    .unwrap();
                assert_eq!(plain.end_step(), equal.end_step());
                for s in 0..plain.end_step() + 2 {
                    assert_eq!(plain.range(s), equal.range(s));
                    assert_eq!(plain.batch(s), equal.batch(s));
                }
                for e in 0..3u64 {
                    let (lo, hi) = (e * n as u64, (e + 1) * n as u64);
                    assert_eq!(plain.steps_touching(lo, hi), equal.steps_touching(lo, hi));
                }
            }
        }
    }

    #[test]
    fn a_split_moves_the_runs_within_each_global_step() {
        // 3 workers, batches of 4: 12 samples a step; from step 2 on rank 2
        // takes 2, rank 0 takes 6.
        let split = Split {
            from: 2,
            sizes: vec![6, 4, 2],
        };
        let plan = |r| {
            EpochSampler::new(100, 3, r, 1)
                .unwrap()
                .plan(4, 1)
                .with_splits(std::slice::from_ref(&split))
                .unwrap()
        };
        let (p0, p1, p2) = (plan(0), plan(1), plan(2));
        assert_eq!((p0.range(1), p2.range(1)), (12..16, 20..24));
        assert_eq!(
            (p0.range(2), p1.range(2), p2.range(2)),
            (24..30, 30..34, 34..36)
        );
        assert_eq!(p2.own_size(5), 2);
        assert_eq!(
            [24, 29, 30, 34, 35, 16].map(|pos| p0.rank_at(pos)),
            [Some(0), Some(0), Some(1), Some(2), Some(2), Some(1)]
        );
        // 100 samples: step 8 starts at 96 and holds 4, all rank 0's.
        assert_eq!(p0.global_end_step(), 9);
        assert_eq!((p0.end_step(), p1.end_step(), p2.end_step()), (9, 8, 8));
        assert_eq!(p0.range(8), 96..100);
        assert_exactly_once(100, 1, &trained_split(100, 3, 4, 1, &[split]));
    }

    #[test]
    fn bad_splits_are_refused() {
        let mut plan = EpochSampler::new(100, 2, 0, 1).unwrap().plan(4, 1);
        let bad = |from, sizes: Vec<u64>| Split { from, sizes };
        assert!(matches!(
            plan.push_split(bad(1, vec![8])),
            Err(SamplerError::BadSplit { from: 1, .. })
        ));
        assert!(plan.push_split(bad(1, vec![8, 0])).is_err());
        assert!(plan.push_split(bad(1, vec![5, 4])).is_err());
        plan.push_split(bad(3, vec![5, 3])).unwrap();
        // The same split again is nothing new; an earlier one is refused.
        plan.push_split(bad(3, vec![5, 3])).unwrap();
        assert!(plan.push_split(bad(2, vec![4, 4])).is_err());
        assert!(plan.push_split(bad(3, vec![4, 4])).is_err());
        assert_eq!(plan.splits().len(), 1);
    }

    #[test]
    fn proportional_splits_are_exact_and_keep_everyone() {
        assert_eq!(proportional_split(&[1.0, 1.0, 1.0], 12), vec![4, 4, 4]);
        assert_eq!(proportional_split(&[3.0, 3.0, 1.0], 96), vec![41, 41, 14]);
        // A very slow rank keeps one sample.
        assert_eq!(proportional_split(&[1e9, 1.0], 10), vec![9, 1]);
        // Unknown or broken rates count as the slowest known one.
        assert_eq!(
            proportional_split(&[2.0, f64::NAN, 0.0], 8),
            proportional_split(&[2.0, 2.0, 2.0], 8)
        );
        assert_eq!(proportional_split(&[f64::NAN, f64::NAN], 5), vec![3, 2]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any split schedule (sizes and switch steps drawn at random)
        /// covers every stream position exactly once across the ranks.
        #[test]
        fn any_split_schedule_trains_every_sample_exactly_once(
            n in 1usize..120,
            world in 1usize..5,
            batch in 1usize..9,
            epochs in 1u64..4,
            switches in proptest::collection::vec((0u64..30, proptest::collection::vec(0.01f64..10.0, 4)), 0..5),
        ) {
            prop_assume!(world <= n);
            let global = (world * batch) as u64;
            let mut splits: Vec<Split> = Vec::new();
            let mut from = 0;
            for (gap, weights) in switches {
                from += gap + u64::from(!splits.is_empty());
                let sizes = proportional_split(&weights[..world], global);
                prop_assert_eq!(sizes.iter().sum::<u64>(), global);
                prop_assert!(sizes.iter().all(|&s| s >= 1));
                splits.push(Split { from, sizes });
            }
            assert_exactly_once(n, epochs, &trained_split(n, world, batch, epochs, &splits));
            for r in 0..world {
                let plan = EpochSampler::new(n, world, r, 5).unwrap().plan(batch, epochs).with_splits(&splits).unwrap();
                for epoch in 0..epochs {
                    let (lo, hi) = (epoch * n as u64, (epoch + 1) * n as u64);
                    let want: Vec<u64> = (0..plan.end_step())
                        .filter(|&s| {
                            let r = plan.range(s);
                            r.start < hi && r.end > lo
                        })
                        .collect();
                    let got: Vec<u64> = plan.steps_touching(lo, hi).collect();
                    prop_assert_eq!(got, want);
                }
            }
        }

        #[test]
        fn proportional_split_sums_to_the_global_batch(
            weights in proptest::collection::vec(0.0f64..1e6, 1..9),
            extra in 0u64..500,
        ) {
            let global = weights.len() as u64 + extra;
            let sizes = proportional_split(&weights, global);
            prop_assert_eq!(sizes.len(), weights.len());
            prop_assert_eq!(sizes.iter().sum::<u64>(), global);
            prop_assert!(sizes.iter().all(|&s| s >= 1));
        }


        /// Checkpointed with N workers at any step, resumed with M: every
        /// sample of every epoch is trained exactly once.
        #[test]
        fn any_resize_trains_every_sample_exactly_once(
            n in 1usize..80,
            from in 1usize..6,
            to in 1usize..6,
            batch in 1usize..9,
            epochs in 1u64..4,
            cut in 0u64..40,
        ) {
            prop_assume!(from <= n && to <= n);
            let before = EpochSampler::new(n, from, 0, 5).unwrap().plan(batch, epochs);
            let cut = cut.min(before.end_step());
            let point = before.resume_point(cut);
            prop_assert!(point.consumed < n as u64);
            let mut seen = trained(n, from, batch, epochs, None, Some(cut));
            seen.extend(trained(n, to, batch, epochs, Some(point), None));
            assert_exactly_once(n, epochs, &seen);
        }
    }
}

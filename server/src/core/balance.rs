//! Throughput balancing (`data.balance = "throughput"`): shard 0 decides how
//! the global batch is cut across the workers from the throughput they
//! report with their pushes, and announces each split in its replies.
//!
//! Every `every` updates (at versions `every, 2·every, …`) the balancer
//! smooths each rank's latest report (an exponential average, so one noisy
//! step does not move the split), cuts the global batch in proportion to the
//! smoothed rates ([`proportional_split`]: each rank at least 1, the sum
//! exact) and keeps the split in effect when the new one would move fewer
//! than [`MIN_MOVE`] of the global batch (no thrashing on noise). A new split
//! decided at version `d` takes effect at global step `d + lead`: a worker
//! that holds version `v` knows every split up to step
//! `(v / every + 1) · every + lead` (exclusive), and its loader plans no
//! further (see `ps_worker::balance`).
//!
//! ```
//! use ps_server::core::Balancer;
//!
//! // 3 workers, global batch 96, a split every 10 steps, effective 10 later.
//! let mut b = Balancer::new(3, 96, 10, 10);
//! for rank in 0..3 {
//!     b.report(rank, if rank == 2 { 100.0 } else { 300.0 });
//! }
//! assert!(b.after_update(5).is_none()); // not a decision step
//! let split = b.after_update(10).unwrap();
//! assert_eq!((split.from, split.sizes.clone()), (20, vec![41, 41, 14]));
//! assert_eq!(b.announced(), &[split][..]);
//! ```

use ps_shared::sampler::{proportional_split, Split};

/// Smallest change worth a new split: the sizes must move by at least this
/// fraction of the global batch in total (or by at least 1 sample when the
/// global batch is small).
pub const MIN_MOVE: f64 = 0.02;

/// Weight of the newest report in the smoothed rate.
const SMOOTHING: f64 = 0.5;

/// The split decisions of shard 0.
#[derive(Debug, Clone)]
pub struct Balancer {
    global: u64,
    every: u64,
    lead: u64,
    /// Each rank's latest report (samples per second), `None` before one.
    latest: Vec<Option<f64>>,
    /// Each rank's smoothed rate at the last decision.
    smoothed: Vec<Option<f64>>,
    /// The splits decided, at most the last two (the one in effect and the
    /// one announced for later).
    decided: Vec<Split>,
}

impl Balancer {
    /// A balancer for `world` ranks and a global batch of `global` samples
    /// (at least `world`), deciding every `every` updates (at least 1) a
    /// split that takes effect `lead` steps later.
    pub fn new(world: usize, global: u64, every: u64, lead: u64) -> Self {
        Self {
            global,
            every: every.max(1),
            lead: lead.max(1),
            latest: vec![None; world],
            smoothed: vec![None; world],
            decided: Vec::new(),
        }
    }

    /// Rank `rank` measured `rate` samples per second (0 or anything not
    /// finite and positive: not measured, ignored).
    pub fn report(&mut self, rank: u32, rate: f32) {
        let rate = f64::from(rate);
        if let Some(slot) = self.latest.get_mut(rank as usize) {
            if rate.is_finite() && rate > 0.0 {
                *slot = Some(rate);
            }
        }
    }

    /// The sizes in effect after the last decision (equal before one).
    fn current(&self) -> Vec<u64> {
        match self.decided.last() {
            Some(s) => s.sizes.clone(),
            None => {
                let n = self.latest.len() as u64;
                let mut sizes = vec![self.global / n.max(1); self.latest.len()];
                // The equal split of the sampler: `global` is world × batch.
                let rest = self.global - sizes.iter().sum::<u64>();
                if let Some(first) = sizes.first_mut() {
                    *first += rest;
                }
                sizes
            }
        }
    }

    /// The update to `version` was applied: on a decision step, the new
    /// split (also added to [`Balancer::announced`]) when it differs enough
    /// from the one in effect.
    pub fn after_update(&mut self, version: u64) -> Option<Split> {
        if version == 0 || !version.is_multiple_of(self.every) {
            return None;
        }
        for (s, l) in self.smoothed.iter_mut().zip(&self.latest) {
            if let Some(l) = *l {
                *s = Some(match *s {
                    Some(prev) => SMOOTHING * l + (1.0 - SMOOTHING) * prev,
                    None => l,
                });
            }
        }
        // A rank without a report yet: no decision (its speed is unknown).
        let rates: Option<Vec<f64>> = self.smoothed.iter().copied().collect();
        let rates = rates?;
        let sizes = proportional_split(&rates, self.global);
        let current = self.current();
        let moved: u64 = sizes
            .iter()
            .zip(&current)
            .map(|(a, b)| a.abs_diff(*b))
            .sum();
        let min_move = ((self.global as f64 * MIN_MOVE).ceil() as u64).max(1);
        if moved < min_move {
            return None;
        }
        let split = Split {
            from: version + self.lead,
            sizes,
        };
        self.decided.push(split.clone());
        if self.decided.len() > 2 {
            self.decided.remove(0);
        }
        Some(split)
    }

    /// The splits to announce in every reply: the last two decided.
    pub fn announced(&self) -> &[Split] {
        &self.decided
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_throughput_keeps_the_equal_split() {
        let mut b = Balancer::new(4, 128, 5, 5);
        for step in 1..=50u64 {
            for r in 0..4 {
                // Noise below one percent around the same speed.
                b.report(r, 1000.0 + ((step * 7 + r as u64 * 13) % 8) as f32);
            }
            assert_eq!(b.after_update(step), None, "step {step}");
        }
        assert!(b.announced().is_empty());
    }

    #[test]
    fn a_slow_rank_gets_a_smaller_batch_and_noise_does_not_thrash() {
        let mut b = Balancer::new(3, 96, 10, 10);
        // Nothing is decided until every rank reported.
        b.report(0, 300.0);
        b.report(1, 300.0);
        assert_eq!(b.after_update(10), None);
        b.report(2, 100.0);
        let first = b.after_update(20).unwrap();
        assert_eq!(first.from, 30);
        assert_eq!(first.sizes, vec![41, 41, 14]);
        assert_eq!(first.sizes.iter().sum::<u64>(), 96);
        // The same speeds with a little noise: no new split.
        for (i, v) in [30u64, 40, 50, 60].into_iter().enumerate() {
            b.report(0, 300.0 + i as f32);
            b.report(1, 298.0);
            b.report(2, 101.0 - i as f32);
            assert_eq!(b.after_update(v), None);
        }
        // The slow rank becomes as fast as the others: the split follows,
        // smoothed (half way at first).
        b.report(2, 300.0);
        let next = b.after_update(70).unwrap();
        assert_eq!(next.from, 80);
        assert!(next.sizes[2] > 14 && next.sizes[2] < 32, "{:?}", next.sizes);
        assert_eq!(b.announced(), &[first, next.clone()][..]);
        let last = b.after_update(80).unwrap();
        assert!(last.sizes[2] > next.sizes[2]);
        assert_eq!(b.announced().len(), 2);
        assert_eq!(b.announced()[1], last);
    }

    #[test]
    fn bad_reports_are_ignored() {
        let mut b = Balancer::new(2, 10, 1, 1);
        b.report(0, f32::NAN);
        b.report(1, 5.0);
        b.report(7, 5.0); // no such rank
        assert_eq!(b.after_update(1), None);
        b.report(0, 0.0);
        assert_eq!(b.after_update(2), None);
        b.report(0, 20.0);
        assert_eq!(b.after_update(3).unwrap().sizes, vec![7, 3]);
    }
}

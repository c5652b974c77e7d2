//! Policy: the schedule (this rank's sample stream and every sample's next
//! use) and the prefetch window's bounds.

use std::collections::BTreeMap;

use ps_shared::sampler::RankPlan;
use tokio::sync::watch;

use crate::balance::SplitNews;
use crate::loader::LoaderError;

/// Next-use value of a sample that may be used in a later epoch but not in
/// the next one; plus the key, so such samples still order deterministically.
pub const FAR_FUTURE: u64 = 1 << 62;

const NOT_IN_EPOCH: u64 = u64::MAX;

struct EpochUses {
    /// Stream position of this rank's use of each sample in the epoch, or
    /// [`NOT_IN_EPOCH`].
    position_of: Vec<u64>,
}

/// This worker's part of the sample stream with what the cache needs to
/// know: the stream position of every use (see [`RankPlan`]) and each
/// sample's next use. Holds the uses of at most a few epochs.
///
/// With throughput balancing the plan's split schedule grows while the run
/// goes on ([`SplitNews`]): a step is planned only below the schedule's
/// horizon ([`Schedule::ready`]), where its split is final, so a batch is
/// never planned with a split that changes later and every stream position
/// is still taken by exactly one rank. Next uses further ahead are computed
/// with the splits known so far (the cache's priorities only: they are
/// computed again when a split arrives).
pub struct Schedule {
    plan: RankPlan,
    /// Global orders of the epochs batches are being planned from.
    orders: BTreeMap<u64, Vec<usize>>,
    uses: BTreeMap<u64, EpochUses>,
    /// Where each sample sits in an epoch's global order (inverse
    /// permutations), for the cluster's next uses.
    places: BTreeMap<u64, Vec<u32>>,
    /// The split schedule as it is learned (throughput balancing).
    news: Option<watch::Receiver<SplitNews>>,
    /// Below this step the split is final.
    known_until: u64,
}

impl Schedule {
    pub fn new(plan: RankPlan) -> Result<Self, LoaderError> {
        Ok(Self {
            plan,
            orders: BTreeMap::new(),
            uses: BTreeMap::new(),
            places: BTreeMap::new(),
            news: None,
            known_until: u64::MAX,
        })
    }

    /// A schedule whose split schedule follows `news`.
    pub fn balanced(plan: RankPlan, news: watch::Receiver<SplitNews>) -> Result<Self, LoaderError> {
        let mut schedule = Self::new(plan)?;
        schedule.known_until = 0;
        schedule.news = Some(news);
        schedule.sync()?;
        Ok(schedule)
    }

    pub fn plan(&self) -> &RankPlan {
        &self.plan
    }

    /// Takes in the splits learned since the last call.
    fn sync(&mut self) -> Result<(), LoaderError> {
        let Some(news) = self.news.as_mut() else {
            return Ok(());
        };
        let news = news.borrow_and_update().clone();
        let mut added = false;
        for split in news.splits {
            if self
                .plan
                .splits()
                .last()
                .is_none_or(|l| l.from < split.from)
            {
                self.plan.push_split(split)?;
                added = true;
            }
        }
        if added {
            // Next uses were computed with the old splits.
            self.uses.clear();
        }
        self.known_until = self.known_until.max(news.known_until);
        Ok(())
    }

    /// Whether the split of `step` is final, so its batch may be planned.
    pub fn ready(&mut self, step: u64) -> Result<bool, LoaderError> {
        if step >= self.known_until {
            self.sync()?;
        }
        Ok(step < self.known_until)
    }

    /// Resolves when more of the split schedule is known (never without
    /// balancing).
    pub async fn changed(&mut self) {
        match self.news.as_mut() {
            Some(news) => {
                if news.changed().await.is_err() {
                    // The sender is gone: nothing more will be learned.
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    }

    /// Whether the schedule can still grow.
    pub fn balanced_run(&self) -> bool {
        self.news.is_some()
    }

    /// The first global step at which this rank has no batch (with a split
    /// schedule still growing: the run's end, a rank may finish one step
    /// earlier, see [`Schedule::batch`]).
    pub fn end_step(&self) -> u64 {
        if self.news.is_some() {
            self.plan.global_end_step()
        } else {
            self.plan.end_step()
        }
    }

    fn order(&mut self, epoch: u64) -> &[usize] {
        let plan = &self.plan;
        self.orders
            .entry(epoch)
            .or_insert_with(|| plan.sampler().global_order(epoch, plan.batch_size()))
    }

    fn uses(&mut self, epoch: u64) -> &EpochUses {
        if !self.uses.contains_key(&epoch) {
            let n = self.plan.sampler().num_samples();
            let (lo, hi) = (epoch * n as u64, (epoch + 1) * n as u64);
            let mut position_of = vec![NOT_IN_EPOCH; n];
            let steps = self.plan.steps_touching(lo, hi);
            let ranges: Vec<_> = steps.map(|s| self.plan.range(s)).collect();
            let order = self.order(epoch).to_vec();
            for r in ranges {
                for pos in r.start.max(lo)..r.end.min(hi) {
                    if let Some(&sample) = order.get((pos - lo) as usize) {
                        position_of[sample] = pos;
                    }
                }
            }
            self.uses.insert(epoch, EpochUses { position_of });
        }
        &self.uses[&epoch]
    }

    /// The batch of global `step`: its first stream position and samples.
    /// Orders of epochs before the batch's first sample are let go.
    pub fn batch(&mut self, step: u64) -> (u64, Vec<usize>) {
        let range = self.plan.range(step);
        let n = self.plan.sampler().num_samples() as u64;
        let first_epoch = range.start / n;
        self.uses = self.uses.split_off(&first_epoch);
        self.orders = self.orders.split_off(&first_epoch);
        self.places = self.places.split_off(&first_epoch);
        let mut samples = Vec::with_capacity((range.end - range.start) as usize);
        for pos in range.clone() {
            let order = self.order(pos / n);
            samples.push(order[(pos % n) as usize]);
        }
        (range.start, samples)
    }

    /// The first use of `sample` in epoch `epoch` or later: its stream
    /// position in `epoch`, [`FAR_FUTURE`] (plus the sample) when this rank
    /// does not use it in `epoch` but a later epoch of the run exists,
    /// `None` when the run ends before.
    pub fn next_use_from(&mut self, epoch: u64, sample: usize) -> Option<u64> {
        let epochs = self.plan.epochs();
        if epoch >= epochs {
            return None;
        }
        let pos = self
            .uses(epoch)
            .position_of
            .get(sample)
            .copied()
            .unwrap_or(NOT_IN_EPOCH);
        if pos != NOT_IN_EPOCH {
            Some(pos)
        } else if epoch + 1 < epochs {
            Some(FAR_FUTURE + sample as u64)
        } else {
            None
        }
    }

    /// The first use of `sample` at global step `step` or later, for a run
    /// that starts there.
    pub fn next_use_at(&mut self, step: u64, sample: usize) -> Option<u64> {
        let from = self.plan.range(step).start;
        let epoch = self.plan.epoch_of(from);
        match self.next_use_from(epoch, sample) {
            Some(pos) if pos >= from => Some(pos),
            Some(_) => self.next_use_from(epoch.saturating_add(1), sample),
            None => None,
        }
    }

    /// The first stream position at or after `from` where any rank uses
    /// `sample` (every sample is used once per epoch), `None` past the run's
    /// end: the next use that matters to the sample's owner in the peer tier.
    pub fn cluster_next_use(&mut self, sample: usize, from: u64) -> Option<u64> {
        let n = self.plan.sampler().num_samples() as u64;
        let epoch = from / n;
        for e in [epoch, epoch.saturating_add(1)] {
            if e >= self.plan.epochs() {
                return None;
            }
            if !self.places.contains_key(&e) {
                let mut place = vec![0u32; n as usize];
                for (i, &s) in self.order(e).iter().enumerate() {
                    place[s] = i as u32;
                }
                self.places.insert(e, place);
            }
            let pos = e * n + u64::from(*self.places[&e].get(sample)?);
            if pos >= from {
                return Some(pos);
            }
        }
        None
    }

    /// The next use of `sample` after its use at stream position `pos`.
    pub fn next_use_after(&mut self, pos: u64, sample: usize) -> Option<u64> {
        let epoch = self.plan.epoch_of(pos);
        self.next_use_from(epoch.saturating_add(1), sample)
    }
}

/// The prefetch window's bounds: how many samples, and how many bytes of
/// them, may be planned but not yet taken by the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchWindow {
    pub lookahead_samples: usize,
    pub max_bytes: u64,
    pub record_bytes: u64,
}

impl PrefetchWindow {
    /// Whether a batch of `batch` samples may be planned with `ahead`
    /// samples already in the window. An empty window always takes one batch.
    pub fn admits(&self, ahead: usize, batch: usize) -> bool {
        if ahead == 0 {
            return true;
        }
        let samples = ahead.saturating_add(batch);
        samples <= self.lookahead_samples
            && (samples as u64).saturating_mul(self.record_bytes) <= self.max_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ps_shared::sampler::EpochSampler;

    #[test]
    fn window_admits_one_batch_then_respects_bounds() {
        let w = PrefetchWindow {
            lookahead_samples: 100,
            max_bytes: 1000,
            record_bytes: 20,
        };
        assert!(w.admits(0, 1000)); // an empty window takes any batch
        assert!(w.admits(10, 40)); // 50 samples, 1000 bytes
        assert!(!w.admits(11, 40)); // 1020 bytes
        let w = PrefetchWindow {
            lookahead_samples: 64,
            max_bytes: u64::MAX,
            record_bytes: 1,
        };
        assert!(w.admits(32, 32));
        assert!(!w.admits(33, 32));
    }

    #[test]
    fn schedule_positions_and_next_uses() {
        // One worker, batches of 3 over 10 samples: step 3 straddles into
        // epoch 1.
        let sampler = EpochSampler::new(10, 1, 0, 3).unwrap();
        let mut s = Schedule::new(sampler.plan(3, 3)).unwrap();
        assert_eq!(s.end_step(), 10);
        let (e0, e1, e2) = (
            sampler.global_order(0, 3),
            sampler.global_order(1, 3),
            sampler.global_order(2, 3),
        );
        assert_eq!(s.batch(3), (9, vec![e0[9], e1[0], e1[1]]));
        // A sample's next use after epoch 0 is its stream position in epoch 1.
        let x = e1[4];
        assert_eq!(s.next_use_after(4, x), Some(10 + 4));
        // After the last epoch nothing is needed again.
        assert_eq!(s.next_use_after(25, x), None);
        assert_eq!(s.next_use_from(2, e2[0]), Some(20));
        // The last step is short, and past the end there is no batch.
        assert_eq!(s.batch(9), (27, e2[7..10].to_vec()));
        assert_eq!(s.batch(10).1, Vec::<usize>::new());

        // Rank 1 of 2 takes stream positions 10, 11, 15, 16 and 17 of epoch 1:
        // the rest of epoch 1 is not its own, so only "later".
        let rank1 = EpochSampler::new(10, 2, 1, 3).unwrap();
        let mut s = Schedule::new(rank1.plan(3, 3)).unwrap();
        assert_eq!(s.next_use_from(1, e1[6]), Some(16));
        assert_eq!(s.next_use_from(1, e1[2]), Some(FAR_FUTURE + e1[2] as u64));
        assert_eq!(s.next_use_from(2, e2[0]), None);
        assert_eq!(s.next_use_from(2, e2[2]), Some(22));
    }
}

//! Make-up steps of backup workers (`server.backup_workers`): which
//! samples this rank trains after the last regular step.
//!
//! With backups, a straggler's late push is folded into a later update and
//! the straggler continues at the cluster's step: the batches of the steps
//! the cluster made without it are never trained in their step. When a
//! rank's sample stream is done it tells the servers which of its batches
//! those are, and the servers answer every rank with the same round (see
//! `ps_server::core`'s make-up round): every rank's batches never applied,
//! and the batches each rank trained. From that, every rank computes the
//! same make-up steps ([`deal`]):
//!
//! * the **pool** is the samples of those batches, in order of step then
//!   rank (each sample with its stream position);
//! * each make-up step takes the next `batch × P` samples of the pool (`P`
//!   the ranks in the round), the global batch of a regular step;
//! * a step's samples are cut across the ranks in proportion to the batches
//!   each trained ([`proportional_split`]: the rank's measured share of the
//!   work, so a 3x slower rank gets about a third of a fast rank's share and
//!   no make-up step waits long for it), and each gradient is weighted by
//!   its share (`samples / batch`), as throughput balancing does;
//! * a last step smaller than `P` samples is merged into the one before it,
//!   so every rank has a sample in every step (with a pool smaller than `P`
//!   some ranks have none: they push their gradient of one sample of the
//!   step weighted 0, which adds nothing).
//!
//! So every sample of the run is trained exactly once per epoch: in its
//! step, or in a make-up step after the last one.
//!
//! ```
//! use ps_net::protocol::WireOrphan;
//! use ps_shared::sampler::EpochSampler;
//! use ps_worker::makeup::deal;
//!
//! // 3 ranks, batch 4, 48 samples, 1 epoch: 4 steps.
//! let plan = EpochSampler::new(48, 3, 0, 7).unwrap().plan(4, 1);
//! // Rank 2 missed steps 1 and 2; it trained 2 batches, the others 4.
//! let orphans = [WireOrphan { step: 1, rank: 2 }, WireOrphan { step: 2, rank: 2 }];
//! let steps = deal(&plan, &orphans, &[4, 4, 2], 4).unwrap();
//! // 8 samples, fewer than a global batch of 12: one make-up step, cut 3/3/2.
//! assert_eq!(steps.len(), 1);
//! let sizes: Vec<usize> = steps[0].pieces.iter().map(|p| p.len()).collect();
//! assert_eq!(sizes, vec![3, 3, 2]);
//! ```

use ps_net::protocol::WireOrphan;
use ps_shared::sampler::{proportional_split, RankPlan, SamplerError};

/// A sample to make up: its stream position and its index in the dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owed {
    pub pos: u64,
    pub sample: usize,
}

/// One make-up step: each rank's samples (empty for a rank outside the
/// round, or with none left in a tiny last step).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MakeUpStep {
    /// By rank.
    pub pieces: Vec<Vec<Owed>>,
}

impl MakeUpStep {
    /// `rank`'s samples in this step.
    pub fn piece(&self, rank: usize) -> &[Owed] {
        self.pieces.get(rank).map_or(&[], Vec::as_slice)
    }

    /// The first sample of the step, trained at weight 0 by a rank whose
    /// piece is empty (it must still push: the step waits for every rank).
    pub fn any(&self) -> Option<Owed> {
        self.pieces.iter().flatten().next().copied()
    }
}

/// Runs of consecutive stream positions of `piece`: one trained batch
/// record each (`first` position, samples).
pub fn runs(piece: &[Owed]) -> Vec<(u64, Vec<usize>)> {
    let mut out: Vec<(u64, Vec<usize>)> = Vec::new();
    for o in piece {
        match out.last_mut() {
            Some((first, samples)) if *first + samples.len() as u64 == o.pos => {
                samples.push(o.sample)
            }
            _ => out.push((o.pos, vec![o.sample])),
        }
    }
    out
}

/// The make-up steps of a round: `orphans` (ascending by step then rank),
/// `trained[r]` the batches rank `r` trained (0: not in the round), `batch`
/// the per-rank batch size of a regular step. `plan` is any rank's plan of
/// the run. Every rank computes the same steps from the same round.
pub fn deal(
    plan: &RankPlan,
    orphans: &[WireOrphan],
    trained: &[u64],
    batch: usize,
) -> Result<Vec<MakeUpStep>, SamplerError> {
    let world = plan.sampler().world();
    let mut pool: Vec<Owed> = Vec::new();
    let mut plans: Vec<Option<RankPlan>> = vec![None; world];
    for o in orphans {
        let r = o.rank as usize;
        if r >= world {
            return Err(SamplerError::RankOutOfRange { rank: r, world });
        }
        if plans[r].is_none() {
            plans[r] = Some(plan.for_rank(r)?);
        }
        if let Some(p) = &plans[r] {
            let b = p.batch(o.step);
            pool.extend(b.positions().map(|(pos, sample)| Owed { pos, sample }));
        }
    }
    let members: Vec<usize> = (0..world)
        .filter(|&r| trained.get(r).is_some_and(|&t| t > 0))
        .collect();
    if pool.is_empty() || members.is_empty() {
        return Ok(Vec::new());
    }
    let weights: Vec<f64> = members.iter().map(|&r| trained[r] as f64).collect();
    let global = batch.max(1) * members.len();
    let mut chunks: Vec<&[Owed]> = pool.chunks(global).collect();
    if chunks.len() > 1 && chunks.last().is_some_and(|c| c.len() < members.len()) {
        let extra = chunks.pop().map_or(0, <[Owed]>::len);
        let last = chunks.len() - 1;
        let start = last * global;
        chunks[last] = &pool[start..start + global + extra];
    }
    Ok(chunks
        .into_iter()
        .map(|chunk| {
            let sizes: Vec<u64> = if chunk.len() >= members.len() {
                proportional_split(&weights, chunk.len() as u64)
            } else {
                (0..members.len())
                    .map(|i| u64::from(i < chunk.len()))
                    .collect()
            };
            let mut pieces = vec![Vec::new(); world];
            let mut at = 0usize;
            for (&r, &n) in members.iter().zip(&sizes) {
                let n = n as usize;
                pieces[r] = chunk[at..at + n].to_vec();
                at += n;
            }
            MakeUpStep { pieces }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::sampler::EpochSampler;
    use std::collections::BTreeSet;

    fn orphan(step: u64, rank: u32) -> WireOrphan {
        WireOrphan { step, rank }
    }

    #[test]
    fn every_orphaned_sample_is_dealt_once_in_proportion() {
        // 3 ranks, batch 8, 240 samples, 2 epochs: 10 steps per epoch.
        let plan = EpochSampler::new(240, 3, 1, 11).unwrap().plan(8, 2);
        // Rank 2 missed two of every three steps.
        let orphans: Vec<_> = (0..20u64)
            .filter(|s| s % 3 != 0)
            .map(|s| orphan(s, 2))
            .collect();
        let steps = deal(&plan, &orphans, &[20, 20, 7], 8).unwrap();
        let dealt: Vec<Owed> = steps
            .iter()
            .flat_map(|s| s.pieces.iter().flatten().copied())
            .collect();
        // Exactly the missed batches' positions, each once.
        let want: BTreeSet<u64> = orphans
            .iter()
            .flat_map(|o| {
                let b = plan.for_rank(2).unwrap().batch(o.step);
                (b.first..b.first + b.samples.len() as u64).collect::<Vec<_>>()
            })
            .collect();
        let got: BTreeSet<u64> = dealt.iter().map(|o| o.pos).collect();
        assert_eq!(got, want);
        assert_eq!(dealt.len(), want.len());
        // 13 batches of 8 = 104 samples: four steps of 24, the last 8
        // samples (at least 3) a step of their own.
        assert_eq!(steps.len(), 5);
        for s in &steps[..4] {
            let sizes: Vec<usize> = s.pieces.iter().map(Vec::len).collect();
            assert_eq!(sizes.iter().sum::<usize>(), 24);
            // The slow rank (7 of 47 batches) gets the smallest share.
            assert!(sizes[2] < sizes[0] && sizes[2] < sizes[1], "{sizes:?}");
            assert!(sizes[2] >= 1);
        }
        // Each sample is the one the plan puts at its position.
        for o in &dealt {
            let epoch = o.pos / 240;
            let order = plan.sampler().global_order(epoch, 8);
            assert_eq!(order[(o.pos % 240) as usize], o.sample);
        }
    }

    #[test]
    fn a_short_last_step_is_merged_and_ranks_outside_the_round_get_nothing() {
        let plan = EpochSampler::new(64, 4, 0, 3).unwrap().plan(4, 1);
        // 3 orphaned batches of 4 = 12 samples; ranks 0-2 in the round
        // (rank 3 left): global batch 12, one step.
        let orphans = [orphan(0, 3), orphan(1, 3), orphan(2, 1)];
        let steps = deal(&plan, &orphans, &[4, 1, 4, 0], 4).unwrap();
        assert_eq!(steps.len(), 1);
        assert!(steps[0].piece(3).is_empty());
        assert_eq!(steps[0].pieces.iter().map(Vec::len).sum::<usize>(), 12);
        // 13 samples on 3 ranks of batch 4: a step of 12 and one of 1,
        // merged (every rank keeps a sample in every step).
        let plan = EpochSampler::new(39, 3, 0, 3).unwrap().plan(13, 1);
        let steps = deal(&plan, &[orphan(0, 1)], &[1, 1, 1], 4).unwrap();
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].pieces.iter().map(Vec::len).sum::<usize>(), 13);
        // Fewer samples than ranks: some ranks have none (they push at
        // weight 0).
        let plan = EpochSampler::new(6, 3, 0, 3).unwrap().plan(1, 1);
        let steps = deal(&plan, &[orphan(0, 2)], &[1, 1, 1], 1).unwrap();
        assert_eq!(steps.len(), 1);
        let sizes: Vec<usize> = steps[0].pieces.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![1, 0, 0]);
        assert!(steps[0].any().is_some());
    }

    #[test]
    fn nothing_to_make_up_is_no_step_and_bad_ranks_are_refused() {
        let plan = EpochSampler::new(64, 2, 0, 3).unwrap().plan(4, 1);
        assert!(deal(&plan, &[], &[3, 3], 4).unwrap().is_empty());
        assert!(deal(&plan, &[orphan(1, 5)], &[3, 3], 4).is_err());
    }

    #[test]
    fn runs_split_a_piece_at_gaps() {
        let owed = |pos, sample| Owed { pos, sample };
        let piece = [
            owed(10, 1),
            owed(11, 2),
            owed(20, 3),
            owed(21, 4),
            owed(5, 9),
        ];
        assert_eq!(
            runs(&piece),
            vec![(10, vec![1, 2]), (20, vec![3, 4]), (5, vec![9])]
        );
    }
}

//! Checkpoints: snapshots of the shard, taken every `checkpoint_every`
//! updates and at shutdown.

use ps_shared::sparse::SparseGrad;

use crate::checkpoint::ShardCheckpoint;

use super::{Action, ShardCore};

impl ShardCore {
    /// Everything needed to resume this shard's optimizer and parameters.
    pub fn snapshot(&self) -> ShardCheckpoint {
        ShardCheckpoint {
            shard: self.id(),
            lo: self.setup.lo as u64,
            hi: self.setup.hi as u64,
            layout_hash: self.settings.layout_hash,
            version: self.version,
            params: self.params.clone(),
            momentum: self.momentum.clone(),
            residual: self.residual_sparse(),
            clocks: self.clocks.iter().map(|(w, c)| (*w, *c)).collect(),
            data: self.settings.data,
        }
    }

    /// The residual's non-zero entries, for a checkpoint.
    fn residual_sparse(&self) -> SparseGrad {
        let mut indices: Vec<u32> = self
            .residual_idx
            .iter()
            .copied()
            .filter(|&i| self.residual[i as usize] != 0.0)
            .collect();
        indices.sort_unstable();
        let values = indices.iter().map(|&i| self.residual[i as usize]).collect();
        SparseGrad { indices, values }
    }

    /// The checkpoint of the state the shard stops in, unless one is saved.
    pub(super) fn final_checkpoint(&mut self, out: &mut Vec<Action>) {
        if self.is_serving() && self.version > self.last_saved {
            out.push(Action::Checkpoint(self.snapshot()));
            self.saving = true;
        }
    }

    pub(super) fn maybe_checkpoint(&mut self, out: &mut Vec<Action>) {
        let every = self.settings.checkpoint_every;
        if every == 0 || self.saving || self.version < self.last_saved + every {
            return;
        }
        self.saving = true;
        out.push(Action::Checkpoint(self.snapshot()));
    }
}

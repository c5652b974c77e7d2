//! Updates: steps, aggregation, the BSP barrier and applying an update
//! (dense, sparse or global top-k).

use std::time::Instant;

use ps_net::protocol::{ErrorCode, WireGrad};
use ps_shared::config::SyncMode;
use ps_shared::sparse::topk_exact;

use crate::optimizer::{check_update, fused_update_timed, lazy_update};

use super::{Action, ConnId, ReplyId, ShardCore, Wait, MAX_FOLD_LAG};

/// Changed-index sets kept for sparse replies (one per recent version).
const CHANGE_HISTORY: usize = 64;

impl ShardCore {
    /// The step `rank` pushes next.
    pub(super) fn next_step(&self, rank: u32) -> u64 {
        match self.setup.mode {
            SyncMode::Bsp => self.version,
            SyncMode::Asp | SyncMode::Ssp => self.clocks.get(&rank).copied().unwrap_or(0),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        step: u64,
        have_version: Option<u64>,
        grad: WireGrad,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if !self.admit(reply, conn, rank, out) {
            return;
        }
        let grad = match self.check_push(grad) {
            Ok(g) => g,
            Err(response) => {
                self.stats.refused += 1;
                out.push(Action::Reply {
                    to: reply,
                    response,
                });
                return;
            }
        };
        let expected = self.next_step(rank);
        if step > expected {
            let message = format!(
                "push for step {step}, shard {} expects step {expected} from worker {rank}",
                self.id()
            );
            return self.refuse(reply, ErrorCode::WrongStep, message, out);
        }
        if step < expected {
            if self.foldable(rank, step, expected) {
                // Backup workers: the step was applied without this rank
                // (it was late). Its gradient joins the update under way,
                // counted once; the reply waits for that update.
                self.accumulate(grad);
                self.folded.insert(rank);
                self.stats.late_pushes += 1;
                self.counted.insert(rank, step);
                self.park(
                    reply,
                    conn,
                    rank,
                    have_version,
                    Wait::Applied { step: expected },
                    now,
                    out,
                );
                // The other live ranks may all have left already.
                if self.maybe_apply_bsp(out) {
                    self.maybe_checkpoint(out);
                }
                self.release(out);
                return;
            }
            if self.counted.get(&rank) != Some(&step) {
                // Applied without this rank: it was declared dead for that
                // step (or never pushed it). Its gradient is stale; it must
                // take the cluster's parameters and step (an offer) instead.
                self.stats.fenced += 1;
                let message = format!(
                    "push for step {step}, but shard {} applied it without worker {rank} and expects step {expected}: offer your copy and continue at step {expected}",
                    self.id()
                );
                return self.refuse(reply, ErrorCode::Fenced, message, out);
            }
            // Already applied with this push (a retry after a lost reply):
            // answer with the current parameters, or with the norm share
            // and the total it was applied with (the worker may still need
            // the share for the other shards' totals).
            self.stats.duplicate_pushes += 1;
            let response = self
                .share_reply(step)
                .unwrap_or_else(|| self.params_reply(rank, have_version));
            out.push(Action::Reply {
                to: reply,
                response,
            });
            return;
        }
        match self.setup.mode {
            SyncMode::Bsp => {
                let shared = self.shares_norm();
                if let Some(share) = shared.then(|| self.share_reply(step)).flatten() {
                    // The barrier is complete and its shares went out: a
                    // retry gets the same share. A push not counted by then
                    // (its rank rejoined after the barrier completed) can no
                    // longer change the step: it is dropped, as a fenced
                    // push's is, and the worker takes part in the total.
                    if self.pushed.contains(&rank) {
                        self.stats.duplicate_pushes += 1;
                    } else {
                        self.stats.fenced += 1;
                    }
                    out.push(Action::Reply {
                        to: reply,
                        response: share,
                    });
                    return;
                }
                if self.pushed.contains(&rank) {
                    // A retry of a push already counted: wait for the same reply.
                    self.stats.duplicate_pushes += 1;
                } else {
                    self.accumulate(grad);
                    self.pushed.insert(rank);
                    self.counted.insert(rank, step);
                }
                // With a shared norm the reply is the step's norm share, and
                // a complete barrier starts the norm round instead of the
                // update (which waits for a total: `maybe_apply_bsp` says
                // nothing was applied).
                let wait = if shared {
                    Wait::Share { step }
                } else {
                    Wait::Applied { step }
                };
                self.park(reply, conn, rank, have_version, wait, now, out);
                if self.maybe_apply_bsp(out) {
                    self.maybe_checkpoint(out);
                }
                self.release(out);
            }
            SyncMode::Asp | SyncMode::Ssp => {
                self.accumulate(grad);
                let scale = 1.0 / self.live.len().max(1) as f32;
                if let Err(message) = self.apply(scale, out) {
                    return self.refuse(reply, ErrorCode::Internal, message, out);
                }
                self.counted.insert(rank, step);
                *self.clocks.entry(rank).or_insert(0) += 1;
                self.maybe_checkpoint(out);
                self.park(
                    reply,
                    conn,
                    rank,
                    have_version,
                    Wait::Staleness { next: step + 1 },
                    now,
                    out,
                );
                self.release(out);
            }
        }
    }

    /// Backup workers: whether a push for `step`, older than the `expected`
    /// one, is a late push to fold into the update under way: BSP with
    /// backups, this rank's push for that step not counted yet (nor a
    /// later one), and at most [`MAX_FOLD_LAG`] steps old.
    fn foldable(&self, rank: u32, step: u64, expected: u64) -> bool {
        self.setup.mode == SyncMode::Bsp
            && self.setup.backup > 0
            && expected - step <= MAX_FOLD_LAG
            && self.counted.get(&rank).is_none_or(|&c| c < step)
    }

    fn accumulate(&mut self, grad: WireGrad) {
        self.stats.pushes += 1;
        self.agg_peak += std::mem::take(&mut self.checked_norm);
        match grad {
            WireGrad::Dense(values) => {
                for (a, g) in self.agg.iter_mut().zip(values.into_f32()) {
                    *a += g;
                }
                self.all_touched = true;
            }
            WireGrad::Sparse { indices, values } => {
                self.push_max = self.push_max.max(indices.len());
                for (&i, g) in indices.iter().zip(values.into_f32()) {
                    let i = i as usize;
                    self.agg[i] += g;
                    if !self.marked[i] {
                        self.marked[i] = true;
                        self.touched.push(i as u32);
                    }
                }
            }
        }
    }

    /// BSP: apply once every live rank pushed.
    pub(super) fn maybe_apply_bsp(&mut self, out: &mut Vec<Action>) -> bool {
        if self.setup.mode != SyncMode::Bsp {
            return false;
        }
        let complete = if self.setup.backup == 0 {
            !self.pushed.is_empty() && self.live.keys().all(|w| self.pushed.contains(w))
        } else {
            // All but `backup` live ranks still training (at least one)
            // pushed this step, or every one of them has a push in this
            // update (the others left, or wait for the make-up round: a
            // late push is not left waiting for pushes that will never
            // come).
            let training: Vec<u32> = self
                .live
                .keys()
                .copied()
                .filter(|w| !self.makeup.waiting(*w))
                .collect();
            let on_time = training.iter().filter(|w| self.pushed.contains(w)).count();
            let need = training
                .len()
                .saturating_sub(self.setup.backup as usize)
                .max(1);
            (!self.pushed.is_empty() && on_time >= need)
                || (!self.folded.is_empty()
                    && training
                        .iter()
                        .all(|w| self.pushed.contains(w) || self.folded.contains(w)))
        };
        if !complete {
            return false;
        }
        // The mean over every push in the update, folded late ones included.
        let scale = 1.0 / (self.pushed.len() + self.folded.len()) as f32;
        if self.shares_norm() {
            // Global-norm clipping across shards: the shares go out first;
            // a worker's total applies the update (`norm_total`).
            self.start_norm_round(scale);
            return false;
        }
        if let Err(message) = self.apply(scale, out) {
            // The pushes of this step are refused; the version stays.
            let step = self.version;
            self.refuse_parked(
                |p| matches!(p.wait, Wait::Applied { step: s } if s == step),
                ErrorCode::Internal,
                message,
                out,
            );
            return false;
        }
        true
    }

    /// Whether a request of `rank` on `conn` may touch the step: the shard
    /// serves and the rank is in its barrier on that connection. Else the
    /// request is refused and `false` returned.
    pub(super) fn admit(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        out: &mut Vec<Action>,
    ) -> bool {
        if self.recovery.is_some() {
            let message = format!("shard {} is starting: offer your copy first", self.id());
            self.refuse(reply, ErrorCode::NotInitialized, message, out);
            return false;
        }
        if self.live.get(&rank) != Some(&Some(conn)) {
            let message = format!(
                "worker {rank} is not in shard {}'s barrier on this connection",
                self.id()
            );
            self.refuse(reply, ErrorCode::UnknownWorker, message, out);
            return false;
        }
        true
    }

    /// Drop the update under way: its pushes, and nothing else.
    fn discard_update(&mut self) {
        self.agg.fill(0.0);
        self.marked.fill(false);
        self.touched.clear();
        self.all_touched = false;
        self.push_max = 0;
        self.pushed.clear();
        self.folded.clear();
        self.agg_peak = 0.0;
    }

    /// Apply the update under way, all or nothing: on `Err` (the update
    /// cannot run on this shard) no parameter, momentum or residual entry
    /// changed, the pushes are dropped and the version stays.
    pub(super) fn apply(&mut self, scale: f32, out: &mut Vec<Action>) -> Result<(), String> {
        let sparse = !self.all_touched && !self.moves_untouched;
        let plan = self.setup.plan(self.version);
        {
            if let Err(e) = check_update(
                &self.params,
                &self.agg,
                &self.momentum,
                &plan,
                &self.setup.rule,
            ) {
                self.stats.failed_updates += 1;
                self.discard_update();
                let message = format!(
                    "shard {} cannot apply update {}: {e}; its pushes are refused and the version stays at {}",
                    self.id(),
                    self.version + 1,
                    self.version
                );
                tracing::error!(shard = self.id(), "{message}");
                return Err(message);
            }
        }
        let entries;
        if sparse {
            // Plain SGD on the pushed entries only: O(k), not O(P).
            // Plain SGD, or lazy Adam/AdamW (only pushed entries and their
            // moments move).
            let changed = if self.setup.global_topk {
                self.select_global_topk(scale)
            } else {
                self.touched.sort_unstable();
                let plan = self.setup.plan(self.version);
                // Checked above: the lengths fit.
                let _ = lazy_update(
                    &mut self.params,
                    &self.agg,
                    &mut self.momentum,
                    &self.touched,
                    &plan,
                    &self.setup.rule,
                    scale,
                );
                for &i in &self.touched {
                    let i = i as usize;
                    self.agg[i] = 0.0;
                    self.marked[i] = false;
                }
                std::mem::take(&mut self.touched)
            };
            entries = changed.len();
            self.stats.sparse_updates += 1;
            self.changes.push_back(Some(changed));
        } else {
            // A residual left by earlier sparse updates joins this dense one.
            for &i in &self.residual_idx {
                let i = i as usize;
                self.agg[i] += self.residual[i] / scale;
                self.residual[i] = 0.0;
            }
            self.residual_idx.clear();
            // Checked above: the update runs (an `Err` here would have
            // written nothing).
            let plan = self.setup.plan(self.version);
            if let Ok(cpu) = fused_update_timed(
                &mut self.params,
                &self.agg,
                &mut self.momentum,
                &plan,
                &self.setup.rule,
                scale,
            ) {
                self.stats.update_pool_cpu += cpu;
            }
            self.agg.fill(0.0);
            self.marked.fill(false);
            self.touched.clear();
            entries = self.len();
            self.changes.push_back(None);
        }
        if let Some(r) = self.rounding.as_mut() {
            let changed = self.changes.back().and_then(Option::as_deref);
            if r.round(&mut self.params, changed, self.version + 1) {
                self.stats.rounded_updates += 1;
            }
        }
        self.push_max = 0;
        if self.changes.len() > CHANGE_HISTORY {
            self.changes.pop_front();
        }
        self.all_touched = false;
        self.pushed.clear();
        self.folded.clear();
        self.agg_peak = 0.0;
        self.version += 1;
        self.stats.updates += 1;
        if let Some(split) = self
            .balance
            .as_mut()
            .and_then(|b| b.after_update(self.version))
        {
            tracing::info!(
                from = split.from,
                sizes = ?split.sizes,
                "throughput balancing: new split of the global batch"
            );
        }
        out.push(Action::Applied {
            version: self.version,
            entries,
        });
        Ok(())
    }

    /// Global top-k: adds the mean of this update's pushes to the residual,
    /// applies the `push_max` largest entries of it (plain SGD) and keeps the
    /// rest. Returns the applied entries, ascending. O(candidates), with a
    /// sort of this update's pushed entries only: the residual's entries are
    /// kept ascending, so the two merge in one pass. (Sorting the union each
    /// update cost O(R log R) for a residual of R entries, which grows
    /// towards the shard's size over a long run.)
    fn select_global_topk(&mut self, scale: f32) -> Vec<u32> {
        let mut fresh = std::mem::take(&mut self.touched);
        fresh.sort_unstable();
        let mut kept = std::mem::take(&mut self.residual_idx);
        // Left strictly ascending by this function and by a restore.
        debug_assert!(kept.is_sorted_by(|a, b| a < b));
        let candidates = merge_ascending(&kept, &fresh);
        fresh.clear();
        self.touched = fresh;
        kept.clear();
        self.residual_idx = kept;
        for &i in &candidates {
            let i = i as usize;
            self.residual[i] += scale * self.agg[i];
            self.agg[i] = 0.0;
            self.marked[i] = false;
        }
        let k = self.push_max.max(1);
        let chosen = if candidates.len() <= k {
            candidates
        } else {
            let values: Vec<f32> = candidates
                .iter()
                .map(|&i| self.residual[i as usize])
                .collect();
            // Positions into `candidates`, ascending.
            let top = topk_exact(&values, k).indices;
            let mut chosen = Vec::with_capacity(top.len());
            let mut next = top.iter().peekable();
            for (pos, &i) in candidates.iter().enumerate() {
                if next.peek().is_some_and(|&&p| p as usize == pos) {
                    next.next();
                    chosen.push(i);
                } else {
                    self.residual_idx.push(i);
                }
            }
            chosen
        };
        let plan = self.setup.plan(self.version);
        // The residual is in mean units already; the lengths were checked.
        let _ = lazy_update(
            &mut self.params,
            &self.residual,
            &mut self.momentum,
            &chosen,
            &plan,
            &self.setup.rule,
            1.0,
        );
        for &i in &chosen {
            self.residual[i as usize] = 0.0;
        }
        chosen
    }
}

/// The union of two strictly ascending index lists, ascending, each index
/// once.
fn merge_ascending(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

#[cfg(test)]
mod tests {
    use super::merge_ascending;

    #[test]
    fn merging_keeps_every_index_once_in_order() {
        assert_eq!(merge_ascending(&[], &[]), Vec::<u32>::new());
        assert_eq!(merge_ascending(&[1, 4], &[]), vec![1, 4]);
        assert_eq!(merge_ascending(&[], &[2, 3]), vec![2, 3]);
        assert_eq!(
            merge_ascending(&[0, 2, 5, 9, 10], &[1, 2, 3, 10, 11, 20]),
            vec![0, 1, 2, 3, 5, 9, 10, 11, 20]
        );
        // Against a sort of the union, over lists with many overlaps.
        let a: Vec<u32> = (0..2000).filter(|i| i % 3 == 0).collect();
        let b: Vec<u32> = (0..2000).filter(|i| i % 5 == 0 || i % 7 == 1).collect();
        let mut union: Vec<u32> = a.iter().chain(&b).copied().collect();
        union.sort_unstable();
        union.dedup();
        assert_eq!(merge_ascending(&a, &b), union);
    }
}

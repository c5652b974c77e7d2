//! Recovery: collecting the workers' offers and deciding where a starting
//! shard takes its parameters from.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use ps_net::protocol::ErrorCode;
use ps_shared::config::SyncMode;

use crate::checkpoint::ShardCheckpoint;

use super::{checksum, Action, ConnId, ReplyId, ShardCore, Wait};

/// Where a starting shard took its parameters from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoverySource {
    /// Every copy was at version 0 and there was no checkpoint: a new run.
    Fresh,
    /// The workers' copies.
    Workers,
    /// The checkpoint (it was newer than every copy offered).
    Checkpoint,
}

/// What a starting shard decided, for logs, status and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct RecoveryReport {
    pub shard: u32,
    pub source: RecoverySource,
    /// The version the shard resumes at.
    pub version: u64,
    /// Offers received, and how many agreed with the chosen copy.
    pub offers: usize,
    pub agreeing: usize,
    /// Offers at the chosen version that disagreed with the chosen copy.
    pub conflicting: usize,
    /// The newest version the checkpoint or a copy not rejected held
    /// (rejected copies cannot be checked, so they count for nothing).
    pub newest_known: u64,
    /// Updates that no surviving copy holds: `newest_known - version`.
    pub updates_lost: u64,
    /// Version of the checkpoint the optimizer state came from, if any.
    pub checkpoint_version: Option<u64>,
    /// Whether the checkpoint at the chosen version differs from the copies.
    pub checkpoint_mismatch: bool,
    /// Updates whose optimizer state (momentum) was lost: `version -
    /// checkpoint_version` when momentum is used, else 0.
    pub momentum_updates_lost: u64,
    /// Offers the shard could not check and did not adopt: copies newer
    /// than the version it starts at, or at that version with other
    /// content (each is logged with its rank).
    pub rejected: usize,
    /// Agreeing copies needed to adopt the workers' state: a strict
    /// majority of the barrier's ranks.
    pub quorum: usize,
}

pub(super) struct OfferRec {
    rank: u32,
    version: u64,
    next_step: u64,
    checksum: u64,
    values: Vec<f32>,
}

/// Collecting offers before the shard serves.
pub(super) struct Recovery {
    pub(super) offers: Vec<OfferRec>,
    pub(super) first_offer: Option<Instant>,
    pub(super) checkpoint: Option<ShardCheckpoint>,
}

impl ShardCore {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn offer(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        version: u64,
        next_step: u64,
        values: Vec<f32>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if values.len() != self.len() {
            let message = format!(
                "offer for shard {} has {} values, the shard has {}",
                self.id(),
                values.len(),
                self.len()
            );
            return self.refuse(reply, ErrorCode::WrongLength, message, out);
        }
        if values.iter().any(|v| !v.is_finite()) {
            return self.refuse(
                reply,
                ErrorCode::NonFinite,
                "offered values must be finite",
                out,
            );
        }
        let sum = checksum(&values);
        let Some(rec) = self.recovery.as_mut() else {
            // Serving: the offer only asks for the current parameters (none
            // when the worker already holds exactly them).
            let have =
                (version == self.version && sum == checksum(&self.params)).then_some(version);
            out.push(Action::Reply {
                to: reply,
                response: self.params_reply(rank, have),
            });
            return;
        };
        rec.first_offer.get_or_insert(now);
        rec.offers.retain(|o| o.rank != rank);
        rec.offers.push(OfferRec {
            rank,
            version,
            next_step,
            checksum: sum,
            values,
        });
        self.park(reply, conn, rank, None, Wait::Serving, now, out);
        if let Some(p) = self.parked.last_mut().filter(|p| p.reply == reply) {
            p.offered = Some((version, sum));
        }
        self.maybe_decide(now, out);
    }

    /// Decide where the shard starts once every expected rank offered, or the
    /// recovery window since the first offer has passed. When nothing can be
    /// checked (see [`ShardCore::choose_start`]) the waiting offers are
    /// refused with the reason, and the shard goes on collecting offers.
    pub(super) fn maybe_decide(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(rec) = &self.recovery else { return };
        let offered: BTreeSet<u32> = rec.offers.iter().map(|o| o.rank).collect();
        let everyone = !self.live.is_empty() && self.live.keys().all(|r| offered.contains(r));
        let window_over = rec
            .first_offer
            .is_some_and(|t| now >= t + self.settings.recovery_window);
        if rec.offers.is_empty() || !(everyone || window_over) {
            return;
        }
        let start = match self.choose_start(rec) {
            Ok(start) => start,
            Err(message) => {
                if !self.parked.iter().any(|p| matches!(p.wait, Wait::Serving)) {
                    // Told already; nobody waits.
                    return;
                }
                tracing::error!(shard = self.id(), "{message}");
                if let Some(rec) = self.recovery.as_mut() {
                    // A new window opens with the next offer.
                    rec.first_offer = None;
                }
                self.refuse_parked(
                    |p| matches!(p.wait, Wait::Serving),
                    ErrorCode::NotInitialized,
                    message,
                    out,
                );
                return;
            }
        };
        let Some(rec) = self.recovery.take() else {
            return;
        };
        let report = self.decide(rec, start);
        if let Some(r) = self.rounding.as_mut() {
            r.sync(&self.params);
        }
        tracing::info!(shard = self.id(), ?report, "shard starts");
        self.recovered = Some(report.clone());
        out.push(Action::Recovered(report));
        self.release(out);
    }

    /// Agreeing copies needed to adopt the workers' state: a strict
    /// majority of the ranks that form the barrier (`ShardSetup::workers`,
    /// whether or not they offered).
    fn quorum(&self) -> usize {
        self.setup.workers as usize / 2 + 1
    }

    /// The newest version a copy may claim: the checkpoint's (0 without
    /// one) plus `recovery_max_ahead`; `u64::MAX` when that is 0.
    fn version_bound(&self, checkpoint: Option<u64>) -> u64 {
        match self.settings.recovery_max_ahead {
            0 => u64::MAX,
            ahead => checkpoint.unwrap_or(0).saturating_add(ahead),
        }
    }

    /// Which offered copy the shard can check, in this order:
    /// 1. a strict majority of the barrier's ranks agree on its version
    ///    and content, and the version is within the bound;
    /// 2. BSP only, one reply lost: every honest copy is at the shard's
    ///    last version `v` or at `v - 1` (a worker whose reply was lost), so
    ///    the newest version (within the bound) whose copies all agree is
    ///    taken when another rank holds that version or the one before;
    /// 3. otherwise `Ok(None)`: the checkpoint, when there is one;
    /// 4. with no checkpoint, a fresh run (every copy at version 0): the
    ///    largest group of equal copies (ties: the lowest rank);
    /// 5. else nothing: `Err` with the reason.
    fn choose_start(&self, rec: &Recovery) -> Result<Option<(u64, u64)>, String> {
        let checkpoint = rec.checkpoint.as_ref().map(|c| c.version);
        let bound = self.version_bound(checkpoint);
        let quorum = self.quorum();
        let mut groups: BTreeMap<(u64, u64), Vec<u32>> = BTreeMap::new();
        for o in &rec.offers {
            groups
                .entry((o.version, o.checksum))
                .or_default()
                .push(o.rank);
        }
        let majority = groups
            .iter()
            .filter(|((v, _), ranks)| *v <= bound && ranks.len() >= quorum)
            .max_by_key(|((v, _), ranks)| (*v, ranks.len()));
        if let Some((&at, _)) = majority {
            return Ok(Some(at));
        }
        if self.setup.mode == SyncMode::Bsp {
            let mut versions: Vec<u64> = groups.keys().map(|(v, _)| *v).collect();
            versions.dedup();
            for &v in versions.iter().rev().filter(|v| **v <= bound) {
                let at: Vec<(&(u64, u64), &Vec<u32>)> =
                    groups.range((v, 0)..=(v, u64::MAX)).collect();
                let [(&key, ranks)] = at[..] else { continue };
                let neighbour =
                    ranks.len() >= 2 || (v > 0 && rec.offers.iter().any(|o| o.version == v - 1));
                if neighbour {
                    return Ok(Some(key));
                }
            }
        }
        if checkpoint.is_some() {
            return Ok(None);
        }
        if rec.offers.iter().all(|o| o.version == 0) {
            let fresh = groups
                .iter()
                .max_by_key(|(_, ranks)| {
                    let lowest = ranks.iter().min().copied().unwrap_or(u32::MAX);
                    (ranks.len(), std::cmp::Reverse(lowest))
                })
                .map(|(&at, _)| at);
            if let Some(at) = fresh {
                return Ok(Some(at));
            }
        }
        let offers: Vec<String> = rec
            .offers
            .iter()
            .map(|o| format!("rank {} at version {}", o.rank, o.version))
            .collect();
        let bound = match bound {
            u64::MAX => String::new(),
            b => format!(" at a version <= {b} (the newest the cluster can have reached)"),
        };
        Err(format!(
            "shard {} cannot start: no strict majority ({quorum} of {} ranks) agrees on one copy{bound}, \
             the copies do not fit one lost reply, and there is no checkpoint to fall back to \
             (offers: {}); waiting for more offers",
            self.id(),
            self.setup.workers,
            offers.join(", ")
        ))
    }

    /// Start from the chosen copy (`None`: from the checkpoint); the
    /// checkpoint wins when it is newer, and supplies the optimizer state.
    fn decide(&mut self, rec: Recovery, copy: Option<(u64, u64)>) -> RecoveryReport {
        let Recovery {
            mut offers,
            checkpoint,
            ..
        } = rec;
        let offers_n = offers.len();
        let from_checkpoint = match (&checkpoint, copy) {
            (Some(c), Some((v, _))) => c.version > v,
            (Some(_), None) => true,
            (None, _) => false,
        };
        let (version, sum) = match (&checkpoint, copy) {
            (Some(c), _) if from_checkpoint => (c.version, checksum(&c.params)),
            (_, Some(at)) => at,
            // `choose_start` names the checkpoint only when there is one.
            (_, None) => (0, checksum(&vec![0.0; self.len()])),
        };
        let agreeing = offers
            .iter()
            .filter(|o| (o.version, o.checksum) == (version, sum))
            .count();
        let conflicting = offers
            .iter()
            .filter(|o| o.version == version && o.checksum != sum)
            .count();
        let mut rejected = 0;
        let mut newest_known = 0;
        for o in &offers {
            if o.version > version || (o.version == version && o.checksum != sum) {
                rejected += 1;
                tracing::warn!(
                    shard = self.id(),
                    rank = o.rank,
                    version = o.version,
                    starts_at = version,
                    "offer of rank {} at version {} not adopted: fewer than {} of {} ranks \
                     agree with it, or it is beyond the newest version the cluster can have \
                     reached",
                    o.rank,
                    o.version,
                    self.quorum(),
                    self.setup.workers
                );
            } else {
                newest_known = newest_known.max(o.version);
            }
            let c = self.clocks.entry(o.rank).or_insert(0);
            *c = (*c).max(o.next_step);
        }
        let mut report = RecoveryReport {
            shard: self.id(),
            source: RecoverySource::Workers,
            version,
            offers: offers_n,
            agreeing,
            conflicting,
            newest_known,
            updates_lost: 0,
            checkpoint_version: None,
            checkpoint_mismatch: false,
            momentum_updates_lost: 0,
            rejected,
            quorum: self.quorum(),
        };
        if !from_checkpoint {
            self.params = match offers
                .iter()
                .position(|o| (o.version, o.checksum) == (version, sum))
            {
                Some(i) => offers.swap_remove(i).values,
                None => vec![0.0; self.len()],
            };
            self.version = version;
        }
        if let Some(ckpt) = checkpoint {
            report.checkpoint_version = Some(ckpt.version);
            report.newest_known = report.newest_known.max(ckpt.version);
            for (w, c) in &ckpt.clocks {
                let clock = self.clocks.entry(*w).or_insert(0);
                *clock = (*clock).max(*c);
            }
            if from_checkpoint {
                report.source = RecoverySource::Checkpoint;
                self.params = ckpt.params;
                self.version = ckpt.version;
            } else if ckpt.version == version && checksum(&ckpt.params) != sum {
                report.checkpoint_mismatch = true;
                tracing::warn!(
                    shard = self.id(),
                    version,
                    "the checkpoint differs from the workers' agreeing copies; keeping the copies"
                );
            }
            let state_fits = ckpt.momentum.len() == self.momentum.len();
            if state_fits {
                self.momentum = ckpt.momentum;
            } else {
                tracing::warn!(
                    shard = self.id(),
                    checkpoint = ckpt.momentum.len(),
                    expected = self.momentum.len(),
                    "the checkpoint's optimizer state does not fit optimizer.kind/momentum of \
                     this run; the optimizer state starts from zero"
                );
            }
            if !self.residual.is_empty() && ckpt.residual.validate(self.len()).is_ok() {
                for (&i, &v) in ckpt.residual.indices.iter().zip(&ckpt.residual.values) {
                    self.residual[i as usize] = v;
                    self.residual_idx.push(i);
                }
                // The global top-k merges each update's pushes into the
                // residual's entries as a strictly ascending list.
                if !self.residual_idx.is_sorted_by(|a, b| a < b) {
                    self.residual_idx.sort_unstable();
                    self.residual_idx.dedup();
                }
            } else if !ckpt.residual.indices.is_empty() {
                tracing::warn!(
                    shard = self.id(),
                    entries = ckpt.residual.indices.len(),
                    "the checkpoint holds a global top-k residual that this shard does not keep \
                     (compression.global_topk is off or the shard's size changed); dropping it"
                );
            }
            if !self.momentum.is_empty() {
                report.momentum_updates_lost = if state_fits {
                    self.version - ckpt.version.min(self.version)
                } else {
                    self.version
                };
            }
        } else {
            if !self.momentum.is_empty() {
                report.momentum_updates_lost = self.version;
            }
            if self.version == 0 {
                report.source = RecoverySource::Fresh;
            }
        }
        report.updates_lost = report.newest_known.saturating_sub(self.version);
        self.last_saved = report.checkpoint_version.unwrap_or(0).min(self.version);
        if self.setup.mode == SyncMode::Bsp {
            for c in self.clocks.values_mut() {
                *c = self.version;
            }
        } else {
            // After a resize every rank starts at the new split's first step.
            for c in self.clocks.values_mut() {
                *c = (*c).max(self.settings.data.step);
            }
        }
        report
    }
}

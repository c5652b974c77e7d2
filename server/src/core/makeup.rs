//! Make-up steps of backup workers (`server.backup_workers`): the batches a
//! straggler never had applied are trained after the last regular step.
//!
//! With backups a step is applied once all but `b` live ranks pushed it; a
//! late push is folded into the next update, and the late rank continues at
//! the cluster's step, so the batches of the steps the cluster made without
//! it are never trained in their step (nor is a push refused as fenced).
//! Each worker knows which of its batches those are. When its sample stream
//! is done it asks every shard for the make-up round
//! ([`ps_net::protocol::Request::MakeUp`]) with that list and the number of
//! batches it trained. A shard answers every asker at once when every live
//! rank has asked (a rank that leaves no longer counts), with the union of
//! the lists and every rank's count ([`ps_net::protocol::Response::MakeUp`]),
//! and from then on waits for every live rank in each step (no backups):
//! the make-up steps are few, and each rank's share of them is in
//! proportion to what it trained, so no rank is late by much, and a late
//! rank would skip make-up batches that nobody would make up.
//!
//! While ranks wait for the round they no longer push: a barrier counts
//! only the ranks still training, so the last late push of a straggler is
//! applied at once instead of waiting for pushes that will not come.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use ps_net::protocol::{ErrorCode, Response, WireOrphan};
use ps_shared::config::SyncMode;

use super::{Action, ConnId, ReplyId, ShardCore, Wait};

/// The make-up round of a shard.
#[derive(Debug, Default)]
pub(super) struct MakeUpRound {
    /// Ranks that asked, with their skipped steps and trained batches.
    asked: BTreeMap<u32, (Vec<u64>, u64)>,
    /// Skipped steps of ranks that asked and left before the round was
    /// decided: still made up, by the others.
    left: Vec<WireOrphan>,
    /// The answer, once every live rank asked (then every later ask gets it).
    decided: Option<Arc<Response>>,
}

impl MakeUpRound {
    /// Whether `rank` has asked and waits for the round (it pushes no more
    /// regular steps).
    pub(super) fn waiting(&self, rank: u32) -> bool {
        self.decided.is_none() && self.asked.contains_key(&rank)
    }

    pub(super) fn decided(&self) -> Option<&Arc<Response>> {
        self.decided.as_ref()
    }

    /// `rank` left the barrier: its batches are made up by the others.
    pub(super) fn leave(&mut self, rank: u32) {
        if self.decided.is_some() {
            return;
        }
        if let Some((steps, _)) = self.asked.remove(&rank) {
            self.left
                .extend(steps.into_iter().map(|step| WireOrphan { step, rank }));
        }
    }
}

impl ShardCore {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn make_up(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        skipped: Vec<u64>,
        trained: u64,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if !self.admit(reply, conn, rank, out) {
            return;
        }
        if self.setup.mode != SyncMode::Bsp || (self.setup.backup == 0 && !self.made_up()) {
            let message = format!(
                "shard {} has no make-up round: it runs without backup workers (server.backup_workers = 0 or server.mode other than \"bsp\")",
                self.id()
            );
            return self.refuse(reply, ErrorCode::WrongStep, message, out);
        }
        if let Some(bad) = skipped.windows(2).find(|w| w[0] >= w[1]) {
            let message = format!(
                "make-up request of worker {rank}: skipped steps must be ascending and distinct ({} then {})",
                bad[0], bad[1]
            );
            return self.refuse(reply, ErrorCode::OutOfRange, message, out);
        }
        if let Some(&last) = skipped.last() {
            if last >= self.version {
                let message = format!(
                    "make-up request of worker {rank}: skipped step {last} is not below the shard's version {}",
                    self.version
                );
                return self.refuse(reply, ErrorCode::OutOfRange, message, out);
            }
        }
        if let Some(response) = self.makeup.decided() {
            out.push(Action::Reply {
                to: reply,
                response: response.clone(),
            });
            return;
        }
        self.makeup.asked.insert(rank, (skipped, trained));
        self.park(reply, conn, rank, None, Wait::MakeUp, now, out);
        // A late push of a rank still training may complete its update now
        // that this rank no longer counts in the barrier.
        if self.maybe_apply_bsp(out) {
            self.maybe_checkpoint(out);
        }
        self.maybe_decide_make_up();
        self.release(out);
    }

    /// Whether the make-up round was decided (the shard then runs without
    /// backups).
    fn made_up(&self) -> bool {
        self.makeup.decided().is_some()
    }

    /// Decide the round once every live rank asked and no update is under
    /// way (the caller applies a barrier the askers completed first, and
    /// releases the parked asks after).
    pub(super) fn maybe_decide_make_up(&mut self) {
        if self.makeup.asked.is_empty() || self.made_up() {
            return;
        }
        let all_asked = self.live.keys().all(|r| self.makeup.asked.contains_key(r));
        if all_asked && self.pushed.is_empty() && self.folded.is_empty() {
            let mut orphans: Vec<WireOrphan> = self
                .makeup
                .asked
                .iter()
                .flat_map(|(&rank, (steps, _))| {
                    steps.iter().map(move |&step| WireOrphan { step, rank })
                })
                .chain(self.makeup.left.iter().copied())
                .collect();
            orphans.sort_unstable();
            let ranks = self
                .setup
                .workers
                .max(self.makeup.asked.keys().max().map_or(0, |r| r + 1));
            let mut trained = vec![0; ranks as usize];
            for (&rank, &(_, t)) in &self.makeup.asked {
                trained[rank as usize] = t;
            }
            self.makeup.decided = Some(Arc::new(Response::MakeUp {
                shard: self.id(),
                next_step: self.version,
                orphans,
                trained,
            }));
            // The make-up steps wait for every live rank.
            self.setup.backup = 0;
        }
    }
}

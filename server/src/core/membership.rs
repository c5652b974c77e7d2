//! Membership: ranks joining and leaving the barrier, deadlines, and the
//! replies parked per connection.

use std::time::Instant;

use ps_net::protocol::ErrorCode;
use ps_shared::config::SyncMode;

use super::{Action, ConnId, Parked, ReplyId, ShardCore, Wait};

impl ShardCore {
    /// Ranks that may be in the barrier.
    fn max_ranks(&self) -> u32 {
        match self.setup.mode {
            SyncMode::Bsp => self.setup.workers,
            _ => self.settings.max_ranks.max(self.setup.workers),
        }
    }

    pub(super) fn join(&mut self, rank: u32, conn: ConnId, out: &mut Vec<Action>) {
        if rank >= self.max_ranks() {
            return;
        }
        let floor = self.min_live_clock();
        let was_live = self.live.insert(rank, Some(conn)).is_some();
        if !was_live && self.setup.mode != SyncMode::Bsp {
            // A newcomer starts with the slowest live rank, and never
            // before the data split's first step.
            let clock = self.clocks.entry(rank).or_insert(0);
            *clock = (*clock)
                .max(floor.unwrap_or(0))
                .max(self.settings.data.step);
        }
        // A new member can only tighten the SSP bound; nothing to release.
        let _ = out;
    }

    pub(super) fn leave(
        &mut self,
        rank: u32,
        conn: Option<ConnId>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        match (self.live.get(&rank), conn) {
            // A stale connection of a rank that is back on another one.
            (Some(Some(current)), Some(c)) if *current != c => return,
            (None, _) => return,
            _ => {}
        }
        self.live.remove(&rank);
        if let Some(c) = conn {
            self.forget_parked_on(c, out);
        }
        if self.recovery.is_some() {
            self.maybe_decide(now, out);
            return;
        }
        // Leaving can complete a barrier or the make-up round, or relax the
        // SSP bound.
        self.makeup.leave(rank);
        if self.maybe_apply_bsp(out) {
            self.maybe_checkpoint(out);
        }
        self.maybe_decide_make_up();
        self.release(out);
    }

    pub(super) fn tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        if self.parked.iter().any(|p| p.deadline <= now) {
            let message = format!(
                "shard {} could not answer within {:?} (waiting for other workers)",
                self.id(),
                self.settings.request_timeout
            );
            self.stats.timeouts +=
                self.refuse_parked(|p| p.deadline <= now, ErrorCode::Timeout, message, out);
        }
        if self.recovery.is_some() {
            self.maybe_decide(now, out);
        }
    }

    /// Drop the replies parked for a closed connection.
    pub(super) fn forget_parked_on(&mut self, conn: ConnId, out: &mut Vec<Action>) {
        self.parked.retain(|p| {
            if p.conn == conn {
                out.push(Action::Forget { to: p.reply });
                false
            } else {
                true
            }
        });
    }

    fn parked_on(&self, conn: ConnId) -> usize {
        self.parked.iter().filter(|p| p.conn == conn).count()
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn park(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        have_version: Option<u64>,
        wait: Wait,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if self.parked_on(conn) >= self.settings.max_parked_per_conn {
            let message = format!(
                "more than {} requests waiting on shard {} from one connection",
                self.settings.max_parked_per_conn,
                self.id()
            );
            return self.refuse(reply, ErrorCode::TooManyPending, message, out);
        }
        self.parked.push(Parked {
            reply,
            conn,
            rank,
            have_version,
            wait,
            offered: None,
            deadline: now + self.settings.request_timeout,
        });
    }

    pub(super) fn min_live_clock(&self) -> Option<u64> {
        self.live
            .keys()
            .filter_map(|w| self.clocks.get(w))
            .min()
            .copied()
    }
}

//! Replies: what a worker gets back (a sparse delta or the whole shard) and
//! releasing the parked replies whose condition holds.

use std::sync::Arc;

use ps_net::protocol::{ErrorCode, ParamUpdate, Response, WireSplit};
use ps_shared::config::SyncMode;

use super::{checksum, refusal, Action, Parked, ReplyId, ShardCore, Wait};

impl ShardCore {
    /// Entries changed between `have` and now, if remembered and few.
    fn changed_since(&self, have: u64) -> Option<Vec<u32>> {
        let behind = usize::try_from(self.version.checked_sub(have)?).ok()?;
        if behind > self.changes.len() {
            return None;
        }
        let mut union = Vec::new();
        for c in self.changes.iter().skip(self.changes.len() - behind) {
            union.extend_from_slice(c.as_deref()?);
            if union.len() * 2 >= self.len() {
                return None;
            }
        }
        union.sort_unstable();
        union.dedup();
        Some(union)
    }

    /// The parameters for `rank`: a sparse delta from `have` when known and
    /// cheaper, else the whole shard.
    pub(super) fn params_reply(&self, rank: u32, have: Option<u64>) -> Arc<Response> {
        self.reply_with(rank, self.param_update(have))
    }

    /// What a worker holding version `have` needs: a sparse delta when known
    /// and cheaper, else the whole shard.
    fn param_update(&self, have: Option<u64>) -> ParamUpdate {
        if let Some(delta) = self
            .rounding
            .as_ref()
            .filter(|_| have.is_some_and(|h| h + 1 == self.version))
            .and_then(|r| r.delta_to(self.version))
        {
            return delta;
        }
        match have.and_then(|h| self.changed_since(h)) {
            Some(changed) => ParamUpdate::Sparse {
                values: changed.iter().map(|&i| self.params[i as usize]).collect(),
                indices: changed,
            },
            None => ParamUpdate::Dense(self.params.clone()),
        }
    }

    fn reply_with(&self, rank: u32, update: ParamUpdate) -> Arc<Response> {
        Arc::new(Response::Params {
            shard: self.id(),
            version: self.version,
            next_step: self.next_step(rank),
            live_workers: self.connected_workers() as u32,
            update,
            splits: self
                .announced_splits()
                .iter()
                .map(|s| WireSplit {
                    from: s.from,
                    sizes: s.sizes.clone(),
                })
                .collect(),
        })
    }

    fn ready(&self, p: &Parked) -> bool {
        match p.wait {
            Wait::Serving => self.is_serving(),
            Wait::Applied { step } => self.version > step,
            Wait::Staleness { next } => match self.setup.mode {
                SyncMode::Ssp => {
                    let slowest = self.min_live_clock().unwrap_or(u64::MAX);
                    next <= slowest.saturating_add(self.setup.staleness)
                }
                _ => true,
            },
            Wait::Share { step } => {
                self.version > step || self.norm_round.is_some_and(|r| r.step == step)
            }
            Wait::MakeUp => self.makeup.decided().is_some(),
        }
    }

    /// Answer every parked reply whose condition now holds.
    pub(super) fn release(&mut self, out: &mut Vec<Action>) {
        if self.parked.is_empty() {
            return;
        }
        let parked = std::mem::take(&mut self.parked);
        let held = parked
            .iter()
            .any(|p| p.offered.is_some())
            .then(|| (self.version, checksum(&self.params)));
        // Replies released together mostly start from the same version (in
        // BSP all of them) and expect the same next step: each distinct
        // reply is built once and shared, so a step costs one union of the
        // changes and one encoding, not one per worker.
        type Key = (Option<u64>, u64);
        let mut built: Vec<(Key, Arc<Response>)> = Vec::new();
        for p in parked {
            if let (Wait::Share { step }, true) = (p.wait, self.ready(&p)) {
                // The barrier's share (every such reply gets the same one),
                // or the parameters when the step is applied and its round
                // forgotten.
                let response = self
                    .share_reply(step)
                    .unwrap_or_else(|| self.params_reply(p.rank, p.have_version));
                out.push(Action::Reply {
                    to: p.reply,
                    response,
                });
                continue;
            }
            if let (Wait::MakeUp, Some(response)) = (p.wait, self.makeup.decided()) {
                out.push(Action::Reply {
                    to: p.reply,
                    response: response.clone(),
                });
                continue;
            }
            if self.ready(&p) {
                let have = match p.wait {
                    // An offer of exactly what the shard starts from needs
                    // nothing back.
                    Wait::Serving => p.offered.filter(|&o| Some(o) == held).map(|(v, _)| v),
                    _ => p.have_version,
                };
                let key = (have, self.next_step(p.rank));
                let response = match built.iter().find(|(k, _)| *k == key) {
                    Some((_, r)) => r.clone(),
                    None => {
                        let r = self.params_reply(p.rank, have);
                        built.push((key, r.clone()));
                        r
                    }
                };
                out.push(Action::Reply {
                    to: p.reply,
                    response,
                });
            } else {
                self.parked.push(p);
            }
        }
    }

    /// Answers request `reply` with an error and counts it as refused.
    pub(super) fn refuse(
        &mut self,
        reply: ReplyId,
        code: ErrorCode,
        message: impl Into<String>,
        out: &mut Vec<Action>,
    ) {
        self.stats.refused += 1;
        out.push(Action::Reply {
            to: reply,
            response: refusal(code, message),
        });
    }

    /// Refuse every parked reply that `pick` selects with `code` and
    /// `message`; the others stay parked, in their order. Returns how many
    /// were refused.
    pub(super) fn refuse_parked(
        &mut self,
        pick: impl Fn(&Parked) -> bool,
        code: ErrorCode,
        message: impl Into<String>,
        out: &mut Vec<Action>,
    ) -> u64 {
        let response = refusal(code, message);
        let before = self.parked.len();
        self.parked.retain(|p| {
            if pick(p) {
                out.push(Action::Reply {
                    to: p.reply,
                    response: response.clone(),
                });
                false
            } else {
                true
            }
        });
        (before - self.parked.len()) as u64
    }
}

//! Global-norm clipping across shards: the norm round between a complete
//! BSP barrier and its update.
//!
//! A shard sees only its slice of the gradient, so with
//! `optimizer.clip_grad_norm` and several shards the norm of the whole mean
//! gradient is summed by the workers: when the barrier of step `t` is
//! complete the shard answers every push with its share (the squared norm of
//! its part of the mean, [`Response::NormShare`]); each worker sends the sum
//! of every shard's share back ([`super::Event::NormTotal`]); the first total
//! for `t` applies the update, scaled by `min(1, c / (norm + 1e-6))`, and the
//! parameters go out as usual. Every worker sums the same shares in the same
//! order, so their totals agree; later ones are answered with the
//! parameters and change nothing.

use std::sync::Arc;
use std::time::Instant;

use ps_net::protocol::{ErrorCode, Response};

use crate::optimizer::{clip_factor, scaled_sum_sq};

use super::{Action, ConnId, NormApplied, NormRound, ReplyId, ShardCore, Wait};

impl ShardCore {
    /// Whether updates wait for the workers' total norm (BSP, clipping,
    /// several shards).
    pub(super) fn shares_norm(&self) -> bool {
        self.norm_clip > 0.0
    }

    /// The barrier of the step under way is complete: take this shard's
    /// share of the mean's norm and hold the update until a total comes.
    pub(super) fn start_norm_round(&mut self, scale: f32) {
        if self.norm_round.is_some() {
            return;
        }
        // No global top-k residual here: the config refuses clipping with
        // top-k compression.
        let sum_sq = scaled_sum_sq(&self.agg, scale);
        self.norm_round = Some(NormRound {
            step: self.version,
            scale,
            sum_sq,
        });
    }

    /// This shard's share for `step`, if known: the round under way (no
    /// total yet), or the last one applied (with its total).
    pub(super) fn share_reply(&self, step: u64) -> Option<Arc<Response>> {
        let (sum_sq, total_sum_sq) = match (self.norm_round, self.norm_applied) {
            (Some(r), _) if r.step == step => (r.sum_sq, None),
            (_, Some(a)) if a.step == step => (a.sum_sq, Some(a.total)),
            _ => return None,
        };
        Some(Arc::new(Response::NormShare {
            shard: self.id(),
            step,
            sum_sq,
            total_sum_sq,
        }))
    }

    /// A worker's total norm for `step`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_total(
        &mut self,
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        step: u64,
        have_version: Option<u64>,
        total: Option<f64>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if !self.admit(reply, conn, rank, out) {
            return;
        }
        if !self.shares_norm() {
            let message = format!(
                "shard {} takes no norm totals (optimizer.clip_grad_norm is off, or one shard holds the whole model)",
                self.id()
            );
            return self.refuse(reply, ErrorCode::BadFrame, message, out);
        }
        if let Some(t) = total {
            if !(t.is_finite() && t >= 0.0) {
                let message =
                    format!("norm total {t} for step {step} is not a finite sum of squares");
                return self.refuse(reply, ErrorCode::NonFinite, message, out);
            }
        }
        if step < self.version {
            // Another worker's total came first: this one changes nothing.
            self.stats.duplicate_totals += 1;
            if let (Some(a), Some(t)) = (self.norm_applied, total) {
                if a.step == step && (a.total - t).abs() > 1e-9 * a.total.max(t) {
                    tracing::warn!(
                        shard = self.id(),
                        step,
                        applied = a.total,
                        got = t,
                        "workers sent different norm totals for one step; the first one was applied"
                    );
                }
            }
            out.push(Action::Reply {
                to: reply,
                response: self.params_reply(rank, have_version),
            });
            return;
        }
        let round = match self.norm_round {
            Some(r) if r.step == step => r,
            _ => {
                let message = format!(
                    "norm total for step {step}, but shard {} has sent no share for it (it is at step {}, barrier {})",
                    self.id(),
                    self.version,
                    if self.norm_round.is_some() { "complete" } else { "open" }
                );
                return self.refuse(reply, ErrorCode::WrongStep, message, out);
            }
        };
        self.park(
            reply,
            conn,
            rank,
            have_version,
            Wait::Applied { step },
            now,
            out,
        );
        let Some(total) = total else {
            // Waits for another worker's total.
            return;
        };
        let factor = clip_factor(self.norm_clip, total);
        let scale = (f64::from(round.scale) * factor) as f32;
        self.norm_round = None;
        match self.apply(scale, out) {
            Ok(()) => {
                self.stats.norm_rounds += 1;
                if factor < 1.0 {
                    self.stats.norm_clipped += 1;
                }
                self.norm_applied = Some(NormApplied {
                    step,
                    sum_sq: round.sum_sq,
                    total,
                });
                self.maybe_checkpoint(out);
            }
            Err(message) => {
                // The pushes of this step are refused; the version stays.
                self.refuse_parked(
                    |p| matches!(p.wait, Wait::Applied { step: s } | Wait::Share { step: s } if s == step),
                    ErrorCode::Internal,
                    message,
                    out,
                );
            }
        }
        self.release(out);
    }
}

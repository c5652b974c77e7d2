//! The sans-IO shard core: every policy of one parameter shard, with no
//! sockets, no actors and no clocks of its own.
//!
//! A [`ShardCore`] owns `params[lo..hi)`, the optimizer state, the step
//! barrier, the replies it has parked, the staleness rules and the recovery of
//! a restarted shard. It is driven by [`Event`]s (a request arrived, a worker
//! joined or left, a connection closed, a timer fired) and answers with
//! [`Action`]s (reply to a request, write a checkpoint, report an update or a
//! recovery). The caller passes the time with every event, so every rule that
//! depends on time (deadlines, the recovery window) is tested
//! deterministically.
//!
//! **One round trip per step.** A worker's `Step` carries its gradient for
//! step `t` and the version it holds; the reply carries the parameters for
//! step `t + 1` (a sparse delta when that is cheaper). The reply is sent when
//! the barrier completes (BSP), at once (ASP), or once the staleness bound
//! allows it (SSP). A `Step` is idempotent: a retry of a push that was already
//! counted waits for the same reply, and a push for a step that is already
//! applied is answered with the current parameters.
//!
//! **Recovery.** Every shard starts by collecting `Offer`s: each worker offers
//! its copy of the shard with the version it holds. In BSP every worker holds
//! the parameters after each step, so a restarted server that lost everything
//! rebuilds each shard from the workers' copies. No single worker can steer
//! it: a copy is adopted when a strict majority of the barrier's ranks agree
//! on its version and content and the version is one the cluster can have
//! reached since the checkpoint (or it fits one lost reply in BSP); else the
//! checkpoint, else nothing (see [`ShardCore`]'s `choose_start`). The
//! checkpoint supplies the optimizer state. A fresh run is the same case with
//! every copy at version 0.
//!
//! **Global-norm clipping across shards.** With `optimizer.clip_grad_norm`
//! and several shards ([`ShardSetup::shared_norm`]) no shard sees the whole
//! gradient, so a BSP step takes two round trips. When the barrier of step
//! `t` is complete the shard answers each push with a
//! [`Response::NormShare`]: the squared norm of its part of the mean
//! gradient. Each worker sums the shares of every shard and sends the total
//! back ([`Event::NormTotal`]); the first total for `t` applies the update
//! scaled by `min(1, c / (norm + 1e-6))` and releases the replies, later
//! ones are answered with the parameters. Any live worker's total will do,
//! so a worker that leaves between the two phases stalls nothing.
//!
//! **Pushes.** Each push is checked whole before it touches state, its norm
//! against `max_grad_norm`, a ceiling and the median of recent pushes; an
//! update is applied all or nothing.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ps_server::core::{Action, CoreSettings, Event, ShardCore, ShardSetup};
//! use ps_shared::config::{OptimizerSection, SyncMode};
//! use ps_net::protocol::{Response, WireGrad, WireValues};
//!
//! let rule = OptimizerSection { lr: 0.5, ..OptimizerSection::default() };
//! let setup = ShardSetup { shard: 0, lo: 0, hi: 4, segments: std::iter::once(0..4).collect(), rule, workers: 1, mode: SyncMode::Bsp, staleness: 0, global_topk: false, decay: Vec::new(), backup: 0, f16_replies: false, shared_norm: false };
//! let mut core = ShardCore::new(setup, CoreSettings::default(), None);
//! let now = Instant::now();
//! core.handle(Event::Joined { rank: 0, conn: 7 }, now);
//! // The only worker offers its initial copy: the shard starts from it.
//! let acts = core.handle(Event::Offer { reply: 1, conn: 7, rank: 0, version: 0, next_step: 0, values: vec![1.0; 4] }, now);
//! assert!(matches!(acts[..], [.., Action::Reply { to: 1, .. }]));
//! // One push completes the barrier; the reply carries version 1.
//! let grad = WireGrad::Sparse { indices: vec![2], values: WireValues::F32(vec![2.0]) };
//! let acts = core.handle(Event::Step { reply: 2, conn: 7, rank: 0, step: 0, have_version: Some(0), rate: 0.0, grad }, now);
//! assert!(acts.iter().any(|a| matches!(a, Action::Reply { to: 2, response } if matches!(**response, Response::Params { version: 1, .. }))));
//! assert_eq!(core.params(), &[1.0, 1.0, 0.0, 1.0]);
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::Hasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ps_net::protocol::{ErrorCode, Response, WireGrad};
use ps_shared::config::{GradNormPolicy, OptimizerSection, SyncMode};

use crate::checkpoint::{DataSplit, ShardCheckpoint};

mod balance;
mod checkpoints;
mod guard;
mod makeup;
mod membership;
mod norm;
mod recovery;
mod replies;
mod rounding;
#[cfg(test)]
mod tests;
mod update;

pub use balance::Balancer;
pub use guard::{push_norm, NormWindow, NORM_WINDOW};
use recovery::Recovery;
pub use recovery::{RecoveryReport, RecoverySource};

/// Identifies one worker connection (assigned by the network layer).
pub type ConnId = u64;

/// Identifies one request waiting for its reply (assigned by the caller).
pub type ReplyId = u64;

/// Everything needed to build a shard.
#[derive(Debug, Clone)]
pub struct ShardSetup {
    pub shard: u32,
    pub lo: usize,
    pub hi: usize,
    /// Tensor boundaries inside the shard (local ranges), for LARS.
    pub segments: Vec<std::ops::Range<usize>>,
    /// The update rule (`[optimizer]`).
    pub rule: OptimizerSection,
    /// Clients `0..workers` form the barrier: the worker ranks, or the
    /// nodes when `cluster.workers_per_node` > 1 (each node pushes once for
    /// its ranks).
    pub workers: u32,
    /// How pushes from different workers are combined (`server.mode`): BSP
    /// applies one update per step from every live worker's push, ASP and
    /// SSP apply every push on arrival.
    pub mode: SyncMode,
    /// SSP only (`server.staleness`): no worker may run more than this many
    /// steps ahead of the slowest live worker. Ignored in BSP and ASP.
    pub staleness: u64,
    /// `compression.global_topk`: a sparse update applies only the `k`
    /// largest entries of the aggregated gradient plus the shard's residual,
    /// `k` being the largest push of that update; the rest stays in the
    /// residual (server-side error feedback). Replies then carry at most `k`
    /// changed entries, not the union of every push. No effect on dense
    /// updates (dense pushes, or an optimizer that moves every entry).
    pub global_topk: bool,
    /// Per segment: whether weight decay applies (`optimizer.no_decay`);
    /// empty = every segment.
    pub decay: Vec<bool>,
    /// BSP only (`server.backup_workers`): the update of a step is applied
    /// once all but this many live ranks pushed it. A push for a step
    /// applied without it (a late push) is folded into the update under way
    /// when it is at most [`MAX_FOLD_LAG`] steps old; an older one is fenced.
    /// 0 = every live rank, and no push is ever folded.
    pub backup: u32,
    /// `compression.f16_replies`: every update's change is rounded to f16
    /// on write (the rest carried into the entry's next change), and a
    /// worker one version behind gets the change as f16 bits.
    pub f16_replies: bool,
    /// BSP with `optimizer.clip_grad_norm` > 0 and more than one shard in
    /// the cluster: the clipping norm is the whole mean gradient's, summed
    /// from every shard's share by the workers (see [`ShardCore`]'s norm
    /// round). `false` with one shard: the shard's own norm is the global
    /// one and the update clips in one pass.
    pub shared_norm: bool,
}

impl ShardSetup {
    /// How update `step` (0-based: the version before it) applies to this
    /// shard: its segments and their decay.
    pub(crate) fn plan(&self, step: u64) -> crate::optimizer::UpdatePlan<'_> {
        crate::optimizer::UpdatePlan {
            segments: &self.segments,
            decay: &self.decay,
            step,
        }
    }
}

/// Backup workers: the oldest late push folded into the update under way,
/// in steps behind the shard's version. An older push is refused as
/// `Fenced` (its gradient is too stale; the worker takes the cluster's
/// parameters and step).
pub const MAX_FOLD_LAG: u64 = 8;

/// Policy knobs of a shard core.
#[derive(Debug, Clone)]
pub struct CoreSettings {
    /// How long a parked reply may wait before it is answered with `Timeout`.
    pub request_timeout: Duration,
    /// How long a starting shard waits for further offers after the first
    /// one before it decides (it decides at once when every rank offered).
    pub recovery_window: Duration,
    /// Parked replies one connection may hold on this shard.
    pub max_parked_per_conn: usize,
    /// Largest L2 norm of one push (0 = no bound).
    pub max_grad_norm: f32,
    /// What to do with a push above `max_grad_norm`, the ceiling or the
    /// anomaly bound: scale it down, or refuse it with `GradientTooLarge`.
    pub norm_policy: GradNormPolicy,
    /// Largest L2 norm of one push ever applied (0 = none), whatever
    /// `max_grad_norm` says (`server.grad_norm_ceiling`).
    pub grad_norm_ceiling: f32,
    /// A push whose norm is above this many times the median norm of the
    /// shard's recent pushes is scaled down to that median, or refused
    /// (`server.grad_anomaly_factor`; 0 = off).
    pub grad_anomaly_factor: f32,
    /// Pushes taken before the anomaly check starts
    /// (`server.grad_anomaly_warmup`).
    pub grad_anomaly_warmup: u32,
    /// Recovery: a workers' copy more than this many versions past the
    /// checkpoint (past 0 without one) is refused; 0 = no bound (periodic
    /// checkpoints are off). See [`ServerSection::recovery_max_ahead`].
    ///
    /// [`ServerSection::recovery_max_ahead`]: ps_shared::config::ServerSection::recovery_max_ahead
    pub recovery_max_ahead: u64,
    /// Checkpoint every this many updates (0 = only when asked).
    pub checkpoint_every: u64,
    /// Layout fingerprint stored in checkpoints.
    pub layout_hash: u64,
    /// Where the sample stream stands, stored in checkpoints. In ASP and
    /// SSP no rank starts before `data.step` (a resize starts the new split
    /// there).
    pub data: DataSplit,
    /// Ranks `0..max_ranks` may join (ASP/SSP beyond `ShardSetup::workers`,
    /// see `cluster.max_workers`); 0 means `ShardSetup::workers`.
    pub max_ranks: u32,
}

impl Default for CoreSettings {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(120),
            recovery_window: Duration::from_secs(10),
            max_parked_per_conn: 4,
            max_grad_norm: 0.0,
            norm_policy: GradNormPolicy::Clip,
            grad_norm_ceiling: 1.0e6,
            grad_anomaly_factor: 100.0,
            grad_anomaly_warmup: 3,
            recovery_max_ahead: 0,
            checkpoint_every: 0,
            layout_hash: 0,
            data: DataSplit::default(),
            max_ranks: 0,
        }
    }
}

/// An input to the core.
#[derive(Debug)]
pub enum Event {
    /// Membership admitted `rank` on connection `conn`.
    Joined { rank: u32, conn: ConnId },
    /// `rank` left the barrier (goodbye, dead connection, silence, or it
    /// never joined); `conn` is the connection it left on, if any.
    Left { rank: u32, conn: Option<ConnId> },
    /// A connection closed: its parked replies are dropped.
    ConnClosed { conn: ConnId },
    /// A worker's copy of the shard (at join, or to a recovering shard).
    Offer {
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        version: u64,
        next_step: u64,
        values: Vec<f32>,
    },
    /// The push of `step` plus the version the worker holds and its
    /// measured samples per second (0: not measured).
    Step {
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        step: u64,
        have_version: Option<u64>,
        rate: f32,
        grad: WireGrad,
    },
    /// Backup workers: `rank`'s sample stream is done; it asks for the
    /// make-up round with its skipped steps and trained batches.
    MakeUp {
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        skipped: Vec<u64>,
        trained: u64,
    },
    /// Global-norm clipping across shards: the squared norm of the whole
    /// mean gradient of `step` (`None`: the worker could not sum the
    /// shares and waits for another worker's total).
    NormTotal {
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        step: u64,
        have_version: Option<u64>,
        total: Option<f64>,
    },
    /// A timer fired: expire deadlines, close the recovery window.
    Tick,
    /// A checkpoint write finished.
    CheckpointDone { version: u64, ok: bool },
    /// The server is stopping: answer every parked reply and take a final
    /// checkpoint.
    Shutdown,
}

/// An output of the core.
#[derive(Debug)]
pub enum Action {
    /// Answer the request `to`. Requests answered alike in one batch (the
    /// replies of a BSP step to workers that held the same version) share
    /// one `Arc`, so the response is built, and encoded by the caller, once
    /// per batch instead of once per worker.
    Reply {
        to: ReplyId,
        response: Arc<Response>,
    },
    /// Write this snapshot (at most one write is outstanding).
    Checkpoint(ShardCheckpoint),
    /// An update was applied, touching `entries` parameters (all of them
    /// when the update was dense).
    Applied { version: u64, entries: usize },
    /// The shard decided where it starts from.
    Recovered(RecoveryReport),
    /// The request's connection closed while its reply was parked: release
    /// the reply slot without answering (nobody is left to read it).
    Forget { to: ReplyId },
}

#[derive(Debug, Clone, Copy)]
enum Wait {
    /// Until the shard is serving (an offer's reply).
    Serving,
    /// Until the shard's version exceeds `step` (BSP step reply).
    Applied { step: u64 },
    /// Until the staleness bound lets `rank` start `next` (SSP).
    Staleness { next: u64 },
    /// Until the barrier of `step` is complete and its norm share is known
    /// (global-norm clipping across shards): the reply is the share.
    Share { step: u64 },
    /// Until the make-up round is decided (backup workers).
    MakeUp,
}

/// Global-norm clipping across shards: the barrier of `step` is complete,
/// its shares went out and the update waits for a worker's total.
#[derive(Debug, Clone, Copy)]
struct NormRound {
    step: u64,
    /// The mean's factor (1 / pushes).
    scale: f32,
    /// This shard's share: the squared norm of its part of the mean.
    sum_sq: f64,
}

/// The last norm round applied: a retry of its push gets the same share,
/// with the total, back.
#[derive(Debug, Clone, Copy)]
struct NormApplied {
    step: u64,
    sum_sq: f64,
    total: f64,
}

struct Parked {
    reply: ReplyId,
    conn: ConnId,
    rank: u32,
    have_version: Option<u64>,
    wait: Wait,
    deadline: Instant,
    /// An offer's version and checksum: when the shard starts from exactly
    /// these values, the reply carries none of them back.
    offered: Option<(u64, u64)>,
}

/// Counters for status and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    pub updates: u64,
    pub sparse_updates: u64,
    pub pushes: u64,
    pub refused: u64,
    /// Pushes scaled down to `max_grad_norm` or to the ceiling.
    pub clipped: u64,
    /// Pushes far above the recent median norm (scaled down, or refused
    /// under the refuse policy).
    pub anomalies: u64,
    /// Updates that could not be applied (their pushes were refused; the
    /// version did not advance).
    pub failed_updates: u64,
    pub timeouts: u64,
    pub duplicate_pushes: u64,
    /// Pushes refused as `Fenced`: for a step applied without their rank;
    /// with a norm round, also pushes that came after their step's shares
    /// went out (answered with the share, their gradient dropped).
    pub fenced: u64,
    /// Backup workers: late pushes (for a step applied without them) folded
    /// into the next update. Each is also counted in `pushes`.
    pub late_pushes: u64,
    /// `f16_replies`: updates whose change was rounded to f16 (the others
    /// had a change beyond f16's range and were written exactly).
    pub rounded_updates: u64,
    /// Global-norm clipping across shards: updates applied with a total
    /// norm from the workers (one per step), and how many of them the
    /// total scaled down (norm above `optimizer.clip_grad_norm`).
    pub norm_rounds: u64,
    pub norm_clipped: u64,
    /// Totals for a step that was already applied (another worker's total
    /// came first): answered with the parameters, not applied again.
    pub duplicate_totals: u64,
    /// CPU time of the dense updates' parallel work, summed over the rayon
    /// pool threads that ran it (the thread that feeds the core only waits
    /// for that work, so its own CPU time leaves it out).
    pub update_pool_cpu: Duration,
}

/// Bytes a shard holds in its long-lived buffers, from their capacities.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardMemory {
    /// The parameters.
    pub params: usize,
    /// Optimizer state: the momentum buffer (empty without momentum) and
    /// the global top-k residual (empty without `global_topk`).
    pub optimizer: usize,
    /// The aggregation buffer, its touched marks and the touched list.
    pub aggregation: usize,
    /// The changed-index sets kept for sparse replies, and with
    /// `f16_replies` the workers' copy, the rounding carry and the last
    /// change.
    pub history: usize,
}

impl ShardMemory {
    pub fn total(&self) -> usize {
        self.params + self.optimizer + self.aggregation + self.history
    }
}

/// One shard's parameters, optimizer state, barrier and parked replies.
pub struct ShardCore {
    setup: ShardSetup,
    settings: CoreSettings,
    recovery: Option<Recovery>,
    params: Vec<f32>,
    momentum: Vec<f32>,
    agg: Vec<f32>,
    marked: Vec<bool>,
    touched: Vec<u32>,
    all_touched: bool,
    /// Most entries one push of the update under way carried.
    push_max: usize,
    /// Global top-k: the aggregated gradient not applied yet (mean units),
    /// and the entries where it may be non-zero. Empty without it.
    residual: Vec<f32>,
    residual_idx: Vec<u32>,
    version: u64,
    /// Ranks in the barrier, with the connection they are on (`None`: expected
    /// but not connected yet).
    live: BTreeMap<u32, Option<ConnId>>,
    pushed: BTreeSet<u32>,
    /// Ranks whose late push is folded into the update under way (backup
    /// workers).
    folded: BTreeSet<u32>,
    /// Next step per rank (ASP/SSP); kept for ranks that left.
    clocks: BTreeMap<u32, u64>,
    /// The last step whose push from each rank was counted: a push for an
    /// older step is a retry only when it is this one; any other was
    /// applied without the rank (it was declared dead) and is fenced.
    counted: BTreeMap<u32, u64>,
    changes: VecDeque<Option<Vec<u32>>>,
    moves_untouched: bool,
    parked: Vec<Parked>,
    saving: bool,
    last_saved: u64,
    stats: CoreStats,
    recovered: Option<RecoveryReport>,
    /// After `Shutdown` nothing changes any more: the final checkpoint
    /// stays the last state.
    stopping: bool,
    /// The final checkpoint waits for the write under way at `Shutdown`.
    final_due: bool,
    /// Norms of the recent pushes taken unscaled (the anomaly check).
    recent_norms: NormWindow,
    /// The norm of the push `check_push` passed last (after any scaling),
    /// and the sum of those norms in the update under way: no entry of the
    /// aggregation buffer can exceed it.
    checked_norm: f64,
    agg_peak: f64,
    /// `ShardSetup::f16_replies`: the copy workers hold, the rounding carry
    /// and the last change.
    rounding: Option<rounding::Rounding>,
    /// Global-norm clipping across shards: `optimizer.clip_grad_norm` (the
    /// rule the updates run with has clipping off: the factor comes from
    /// the workers' total), 0 otherwise.
    norm_clip: f32,
    norm_round: Option<NormRound>,
    norm_applied: Option<NormApplied>,
    /// Throughput balancing (shard 0 with `data.balance = "throughput"`):
    /// the split decisions, announced in every `Params` reply.
    balance: Option<Balancer>,
    /// Backup workers: the make-up round after the last regular step.
    makeup: makeup::MakeUpRound,
}

fn refusal(code: ErrorCode, message: impl Into<String>) -> Arc<Response> {
    Arc::new(Response::error(code, message))
}

/// FNV-1a over the bit patterns: equal copies have equal sums.
fn checksum(values: &[f32]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for v in values {
        h.write(&v.to_bits().to_le_bytes());
    }
    h.finish()
}

impl ShardCore {
    /// A shard that starts by collecting offers; `checkpoint` is the latest
    /// checkpoint of this shard, if one was found (checked by the caller to be
    /// of this shard and layout).
    pub fn new(
        mut setup: ShardSetup,
        settings: CoreSettings,
        checkpoint: Option<ShardCheckpoint>,
    ) -> Self {
        let len = setup.hi - setup.lo;
        let shared_norm = setup.shared_norm && setup.mode == SyncMode::Bsp;
        let norm_clip = if shared_norm {
            // This shard's norm is not the global one: the update scales by
            // the factor of the workers' total instead of clipping itself.
            std::mem::take(&mut setup.rule.clip_grad_norm)
        } else {
            0.0
        };
        let moves_untouched = setup.rule.moves_untouched();
        let state_len = setup.rule.state_per_param() * len;
        Self {
            params: Vec::new(),
            momentum: vec![0.0; state_len],
            agg: vec![0.0; len],
            marked: vec![false; len],
            touched: Vec::new(),
            all_touched: false,
            push_max: 0,
            residual: if setup.global_topk {
                vec![0.0; len]
            } else {
                Vec::new()
            },
            residual_idx: Vec::new(),
            version: 0,
            live: (0..setup.workers).map(|r| (r, None)).collect(),
            pushed: BTreeSet::new(),
            folded: BTreeSet::new(),
            clocks: (0..setup.workers).map(|w| (w, 0)).collect(),
            counted: BTreeMap::new(),
            changes: VecDeque::new(),
            moves_untouched,
            parked: Vec::new(),
            saving: false,
            last_saved: 0,
            stats: CoreStats::default(),
            recovered: None,
            stopping: false,
            final_due: false,
            recent_norms: NormWindow::default(),
            checked_norm: 0.0,
            agg_peak: 0.0,
            rounding: setup.f16_replies.then(rounding::Rounding::default),
            norm_clip,
            norm_round: None,
            norm_applied: None,
            balance: None,
            makeup: makeup::MakeUpRound::default(),
            recovery: Some(Recovery {
                offers: Vec::new(),
                first_offer: None,
                checkpoint,
            }),
            setup,
            settings,
        }
    }

    /// This shard decides the splits of the global batch (shard 0 with
    /// `data.balance = "throughput"`, BSP): see [`Balancer`].
    pub fn with_balancer(mut self, balancer: Balancer) -> Self {
        self.balance = Some(balancer);
        self
    }

    /// The splits this shard announces (empty without a balancer).
    pub fn announced_splits(&self) -> &[ps_shared::sampler::Split] {
        self.balance.as_ref().map_or(&[], Balancer::announced)
    }

    pub fn id(&self) -> u32 {
        self.setup.shard
    }

    pub fn len(&self) -> usize {
        self.setup.hi - self.setup.lo
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parameters (empty until the shard serves).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Updates applied so far.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether the shard decided its starting point and serves requests.
    pub fn is_serving(&self) -> bool {
        self.recovery.is_none()
    }

    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// The bytes held by the parameter, optimizer, aggregation and history
    /// buffers (capacities, so what is allocated rather than what is used).
    pub fn memory(&self) -> ShardMemory {
        use std::mem::size_of;
        ShardMemory {
            params: self.params.capacity() * size_of::<f32>(),
            optimizer: (self.momentum.capacity() + self.residual.capacity()) * size_of::<f32>()
                + self.residual_idx.capacity() * size_of::<u32>(),
            aggregation: self.agg.capacity() * size_of::<f32>()
                + self.marked.capacity() * size_of::<bool>()
                + self.touched.capacity() * size_of::<u32>(),
            history: self
                .changes
                .iter()
                .flatten()
                .map(|c| c.capacity() * size_of::<u32>())
                .sum::<usize>()
                + self.rounding.as_ref().map_or(0, rounding::Rounding::bytes),
        }
    }

    pub fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.recovered.as_ref()
    }

    /// Ranks currently in the barrier and connected.
    pub fn connected_workers(&self) -> usize {
        self.live.values().filter(|c| c.is_some()).count()
    }

    /// Replies waiting.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Whether a checkpoint write is under way or due (the caller reports
    /// its end with `CheckpointDone`).
    pub fn checkpoint_outstanding(&self) -> bool {
        self.saving || self.final_due
    }

    /// Feed one event; returns what the caller must do.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if self.stopping {
            if let Event::Offer { reply, .. }
            | Event::Step { reply, .. }
            | Event::MakeUp { reply, .. }
            | Event::NormTotal { reply, .. } = event
            {
                out.push(Action::Reply {
                    to: reply,
                    response: refusal(ErrorCode::ShuttingDown, "server is shutting down"),
                });
                return out;
            }
        }
        match event {
            Event::Joined { rank, conn } => self.join(rank, conn, &mut out),
            Event::Left { rank, conn } => self.leave(rank, conn, now, &mut out),
            Event::ConnClosed { conn } => self.forget_parked_on(conn, &mut out),
            Event::Offer {
                reply,
                conn,
                rank,
                version,
                next_step,
                values,
            } => self.offer(reply, conn, rank, version, next_step, values, now, &mut out),
            Event::Step {
                reply,
                conn,
                rank,
                step,
                have_version,
                rate,
                grad,
            } => {
                if let Some(b) = self.balance.as_mut() {
                    b.report(rank, rate);
                }
                self.step(reply, conn, rank, step, have_version, grad, now, &mut out)
            }
            Event::MakeUp {
                reply,
                conn,
                rank,
                skipped,
                trained,
            } => self.make_up(reply, conn, rank, skipped, trained, now, &mut out),
            Event::NormTotal {
                reply,
                conn,
                rank,
                step,
                have_version,
                total,
            } => self.norm_total(reply, conn, rank, step, have_version, total, now, &mut out),
            Event::Tick => self.tick(now, &mut out),
            Event::CheckpointDone { version, ok } => {
                self.saving = false;
                if ok {
                    self.last_saved = self.last_saved.max(version);
                }
                if std::mem::take(&mut self.final_due) {
                    self.final_checkpoint(&mut out);
                }
            }
            Event::Shutdown => {
                self.stopping = true;
                self.refuse_parked(
                    |_| true,
                    ErrorCode::ShuttingDown,
                    "server is shutting down",
                    &mut out,
                );
                if self.saving {
                    // One write at a time: the final one follows it.
                    self.final_due = true;
                } else {
                    self.final_checkpoint(&mut out);
                }
            }
        }
        out
    }
}

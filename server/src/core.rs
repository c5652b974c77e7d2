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
//! let setup = ShardSetup { shard: 0, lo: 0, hi: 4, segments: std::iter::once(0..4).collect(), rule, workers: 1, mode: SyncMode::Bsp, staleness: 0, global_topk: false, decay: Vec::new() };
//! let mut core = ShardCore::new(setup, CoreSettings::default(), None);
//! let now = Instant::now();
//! core.handle(Event::Joined { rank: 0, conn: 7 }, now);
//! // The only worker offers its initial copy: the shard starts from it.
//! let acts = core.handle(Event::Offer { reply: 1, conn: 7, rank: 0, version: 0, next_step: 0, values: vec![1.0; 4] }, now);
//! assert!(matches!(acts[..], [.., Action::Reply { to: 1, .. }]));
//! // One push completes the barrier; the reply carries version 1.
//! let grad = WireGrad::Sparse { indices: vec![2], values: WireValues::F32(vec![2.0]) };
//! let acts = core.handle(Event::Step { reply: 2, conn: 7, rank: 0, step: 0, have_version: Some(0), grad }, now);
//! assert!(acts.iter().any(|a| matches!(a, Action::Reply { to: 2, response } if matches!(**response, Response::Params { version: 1, .. }))));
//! assert_eq!(core.params(), &[1.0, 1.0, 0.0, 1.0]);
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::Hasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ps_net::protocol::{ErrorCode, ParamUpdate, Response, WireGrad, WireValues};
use ps_shared::config::{GradNormPolicy, OptimizerSection, SyncMode};

use ps_shared::sparse::{topk_exact, SparseGrad};
use rayon::prelude::*;

use crate::checkpoint::{DataSplit, ShardCheckpoint};
use crate::optimizer::{check_update, fused_update_timed, lazy_update, UpdatePlan};

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
}

/// Changed-index sets kept for sparse replies (one per recent version).
const CHANGE_HISTORY: usize = 64;

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
    /// The push of `step` plus the version the worker holds.
    Step {
        reply: ReplyId,
        conn: ConnId,
        rank: u32,
        step: u64,
        have_version: Option<u64>,
        grad: WireGrad,
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

struct OfferRec {
    rank: u32,
    version: u64,
    next_step: u64,
    checksum: u64,
    values: Vec<f32>,
}

/// Collecting offers before the shard serves.
struct Recovery {
    offers: Vec<OfferRec>,
    first_offer: Option<Instant>,
    checkpoint: Option<ShardCheckpoint>,
}

#[derive(Debug, Clone, Copy)]
enum Wait {
    /// Until the shard is serving (an offer's reply).
    Serving,
    /// Until the shard's version exceeds `step` (BSP step reply).
    Applied { step: u64 },
    /// Until the staleness bound lets `rank` start `next` (SSP).
    Staleness { next: u64 },
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
    /// Pushes refused as `Fenced`: for a step applied without their rank.
    pub fenced: u64,
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
    /// The changed-index sets kept for sparse replies.
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
}

/// Pushes whose norms the anomaly check's median is taken over.
pub const NORM_WINDOW: usize = 64;

/// Values per parallel piece of a push's norm.
const NORM_CHUNK: usize = 1 << 16;

/// The L2 norm of a push's values (f64 sums, so squares of large finite
/// values do not overflow). Large pushes are summed in parallel pieces whose
/// sums are added in order, so the result does not depend on the pool.
pub fn push_norm(values: &WireValues) -> f64 {
    /// Eight independent sums, so the loop vectorises (one sum in order
    /// would wait on each addition); the same order every time.
    fn piece(v: &[f32]) -> f64 {
        let mut lanes = [0.0f64; 8];
        let chunks = v.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (lane, x) in lanes.iter_mut().zip(c) {
                let x = f64::from(*x);
                *lane += x * x;
            }
        }
        let mut total: f64 = lanes.iter().sum();
        for x in rest {
            total += f64::from(*x) * f64::from(*x);
        }
        total
    }
    fn squares(v: &[f32]) -> f64 {
        if v.len() <= NORM_CHUNK {
            return piece(v);
        }
        let pieces: Vec<f64> = v.par_chunks(NORM_CHUNK).map(piece).collect();
        pieces.iter().sum()
    }
    match values {
        WireValues::F32(v) => squares(v).sqrt(),
        WireValues::F16(v) => squares(&ps_shared::sparse::values_from_f16(v)).sqrt(),
    }
}

/// The norms of the last [`NORM_WINDOW`] pushes a shard took unscaled, for
/// the anomaly check's median.
#[derive(Debug, Clone, Default)]
pub struct NormWindow {
    norms: VecDeque<f64>,
    taken: u64,
}

impl NormWindow {
    pub fn push(&mut self, norm: f64) {
        if self.norms.len() == NORM_WINDOW {
            self.norms.pop_front();
        }
        self.norms.push_back(norm);
        self.taken += 1;
    }

    /// The lower median of the window once `warmup` norms were taken;
    /// `None` before, or when it is 0 (no scale to compare with).
    pub fn median(&self, warmup: u64) -> Option<f64> {
        if self.taken < warmup || self.norms.is_empty() {
            return None;
        }
        let mut norms = [0.0f64; NORM_WINDOW];
        let norms = &mut norms[..self.norms.len()];
        for (slot, n) in norms.iter_mut().zip(&self.norms) {
            *slot = *n;
        }
        let mid = (norms.len() - 1) / 2;
        let (_, median, _) = norms.select_nth_unstable_by(mid, f64::total_cmp);
        (*median > 0.0).then_some(*median)
    }
}

/// The largest sum of push norms one update may hold: far from `f32::MAX`,
/// so the aggregated gradient and the update from it stay finite.
const AGG_LIMIT: f64 = f32::MAX as f64 / 16.0;

/// Which bound a push crossed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormBound {
    MaxGradNorm,
    Ceiling,
    Anomaly,
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
        setup: ShardSetup,
        settings: CoreSettings,
        checkpoint: Option<ShardCheckpoint>,
    ) -> Self {
        let len = setup.hi - setup.lo;
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
            recovery: Some(Recovery {
                offers: Vec::new(),
                first_offer: None,
                checkpoint,
            }),
            setup,
            settings,
        }
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
                .sum(),
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

    /// Feed one event; returns what the caller must do.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if self.stopping {
            if let Event::Offer { reply, .. } | Event::Step { reply, .. } = event {
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
                grad,
            } => self.step(reply, conn, rank, step, have_version, grad, now, &mut out),
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
                for p in std::mem::take(&mut self.parked) {
                    out.push(Action::Reply {
                        to: p.reply,
                        response: refusal(ErrorCode::ShuttingDown, "server is shutting down"),
                    });
                }
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

    /// Ranks that may be in the barrier.
    fn max_ranks(&self) -> u32 {
        match self.setup.mode {
            SyncMode::Bsp => self.setup.workers,
            _ => self.settings.max_ranks.max(self.setup.workers),
        }
    }

    fn join(&mut self, rank: u32, conn: ConnId, out: &mut Vec<Action>) {
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

    fn leave(&mut self, rank: u32, conn: Option<ConnId>, now: Instant, out: &mut Vec<Action>) {
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
        // Leaving can complete a barrier or relax the SSP bound.
        if self.maybe_apply_bsp(out) {
            self.maybe_checkpoint(out);
        }
        self.release(out);
    }

    fn tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        let mut kept = Vec::with_capacity(self.parked.len());
        for p in std::mem::take(&mut self.parked) {
            if p.deadline <= now {
                self.stats.timeouts += 1;
                out.push(Action::Reply {
                    to: p.reply,
                    response: refusal(
                        ErrorCode::Timeout,
                        format!(
                            "shard {} could not answer within {:?} (waiting for other workers)",
                            self.id(),
                            self.settings.request_timeout
                        ),
                    ),
                });
            } else {
                kept.push(p);
            }
        }
        self.parked = kept;
        if self.recovery.is_some() {
            self.maybe_decide(now, out);
        }
    }

    /// Drop the replies parked for a closed connection.
    fn forget_parked_on(&mut self, conn: ConnId, out: &mut Vec<Action>) {
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
    fn park(
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
            self.stats.refused += 1;
            out.push(Action::Reply {
                to: reply,
                response: refusal(
                    ErrorCode::TooManyPending,
                    format!(
                        "more than {} requests waiting on shard {} from one connection",
                        self.settings.max_parked_per_conn,
                        self.id()
                    ),
                ),
            });
            return;
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

    #[allow(clippy::too_many_arguments)]
    fn offer(
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
            self.stats.refused += 1;
            out.push(Action::Reply {
                to: reply,
                response: refusal(
                    ErrorCode::WrongLength,
                    format!(
                        "offer for shard {} has {} values, the shard has {}",
                        self.id(),
                        values.len(),
                        self.len()
                    ),
                ),
            });
            return;
        }
        if values.iter().any(|v| !v.is_finite()) {
            self.stats.refused += 1;
            out.push(Action::Reply {
                to: reply,
                response: refusal(ErrorCode::NonFinite, "offered values must be finite"),
            });
            return;
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
    fn maybe_decide(&mut self, now: Instant, out: &mut Vec<Action>) {
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
                let mut kept = Vec::with_capacity(self.parked.len());
                for p in std::mem::take(&mut self.parked) {
                    if matches!(p.wait, Wait::Serving) {
                        out.push(Action::Reply {
                            to: p.reply,
                            response: refusal(ErrorCode::NotInitialized, message.clone()),
                        });
                    } else {
                        kept.push(p);
                    }
                }
                self.parked = kept;
                return;
            }
        };
        let Some(rec) = self.recovery.take() else {
            return;
        };
        let report = self.decide(rec, start);
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

    /// Check a push completely before it touches any state; a clipped
    /// gradient comes back scaled.
    fn check_push(&mut self, grad: WireGrad) -> Result<WireGrad, Arc<Response>> {
        let finite = |v: &WireValues| match v {
            WireValues::F32(v) => v.iter().all(|x| x.is_finite()),
            WireValues::F16(v) => v.iter().all(|b| (b & 0x7c00) != 0x7c00),
        };
        let values = match &grad {
            WireGrad::Dense(values) => {
                if values.len() != self.len() {
                    return Err(refusal(
                        ErrorCode::WrongLength,
                        format!(
                            "dense push of {} values for a shard of {}",
                            values.len(),
                            self.len()
                        ),
                    ));
                }
                values
            }
            WireGrad::Sparse { indices, values } => {
                if indices.len() != values.len() {
                    return Err(refusal(
                        ErrorCode::WrongLength,
                        format!("{} indices but {} values", indices.len(), values.len()),
                    ));
                }
                let mut prev: Option<u32> = None;
                for &i in indices {
                    if i as usize >= self.len() || prev.is_some_and(|p| p >= i) {
                        return Err(refusal(
                            ErrorCode::OutOfRange,
                            format!(
                                "index {i} is out of range or out of order (shard length {})",
                                self.len()
                            ),
                        ));
                    }
                    prev = Some(i);
                }
                values
            }
        };
        if !finite(values) {
            return Err(refusal(ErrorCode::NonFinite, "gradient has NaN or inf"));
        }
        let norm = push_norm(values);
        // The tightest bound the push crosses: (norm to scale to, which).
        let mut crossed: Option<(f64, NormBound)> = None;
        let mut cross = |limit: f64, scale_to: f64, which: NormBound| {
            if limit > 0.0 && norm > limit && crossed.is_none_or(|(t, _)| scale_to < t) {
                crossed = Some((scale_to, which));
            }
        };
        let bound = f64::from(self.settings.max_grad_norm);
        cross(bound, bound, NormBound::MaxGradNorm);
        let ceiling = f64::from(self.settings.grad_norm_ceiling);
        cross(ceiling, ceiling, NormBound::Ceiling);
        let median = self.recent_median();
        if let Some(median) = median {
            let factor = f64::from(self.settings.grad_anomaly_factor);
            cross(factor * median, median, NormBound::Anomaly);
        }
        let Some((scale_to, which)) = crossed else {
            self.take_norm(norm)?;
            self.recent_norms.push(norm);
            return Ok(grad);
        };
        let why = match which {
            NormBound::MaxGradNorm => format!("server.max_grad_norm = {bound}"),
            NormBound::Ceiling => format!("server.grad_norm_ceiling = {ceiling}"),
            NormBound::Anomaly => format!(
                "{} x the median norm {:.3e} of shard {}'s recent pushes (server.grad_anomaly_factor)",
                self.settings.grad_anomaly_factor,
                median.unwrap_or(0.0),
                self.id()
            ),
        };
        if which == NormBound::Anomaly {
            self.stats.anomalies += 1;
        }
        match self.settings.norm_policy {
            GradNormPolicy::Refuse => Err(refusal(
                ErrorCode::GradientTooLarge,
                format!("gradient norm {norm:.3e} exceeds {why}"),
            )),
            GradNormPolicy::Clip => {
                self.take_norm(scale_to)?;
                if which != NormBound::Anomaly {
                    self.stats.clipped += 1;
                }
                let scale = (scale_to / norm) as f32;
                let clip = |v: WireValues| {
                    WireValues::F32(v.into_f32().into_iter().map(|x| x * scale).collect())
                };
                Ok(match grad {
                    WireGrad::Dense(v) => WireGrad::Dense(clip(v)),
                    WireGrad::Sparse { indices, values } => WireGrad::Sparse {
                        indices,
                        values: clip(values),
                    },
                })
            }
        }
    }

    /// The lower median of the recent pushes' norms, once the warm-up is
    /// over and the check is on; `None` when it is 0 (no scale to compare
    /// with).
    fn recent_median(&self) -> Option<f64> {
        if self.settings.grad_anomaly_factor <= 0.0 {
            return None;
        }
        self.recent_norms
            .median(u64::from(self.settings.grad_anomaly_warmup))
    }

    /// Note the norm of a push about to be taken; refused when the sum of
    /// this update's pushes could leave the finite range.
    fn take_norm(&mut self, norm: f64) -> Result<(), Arc<Response>> {
        if self.agg_peak + norm > AGG_LIMIT {
            return Err(refusal(
                ErrorCode::GradientTooLarge,
                format!(
                    "gradient norm {norm:.3e}: the sum of this update's pushes to shard {} would \
                     overflow (set server.grad_norm_ceiling to bound pushes)",
                    self.id()
                ),
            ));
        }
        self.checked_norm = norm;
        Ok(())
    }

    /// The step `rank` pushes next.
    fn next_step(&self, rank: u32) -> u64 {
        match self.setup.mode {
            SyncMode::Bsp => self.version,
            SyncMode::Asp | SyncMode::Ssp => self.clocks.get(&rank).copied().unwrap_or(0),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
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
        let refuse = |out: &mut Vec<Action>, code, message: String| {
            out.push(Action::Reply {
                to: reply,
                response: refusal(code, message),
            })
        };
        if self.recovery.is_some() {
            self.stats.refused += 1;
            return refuse(
                out,
                ErrorCode::NotInitialized,
                format!("shard {} is starting: offer your copy first", self.id()),
            );
        }
        if self.live.get(&rank) != Some(&Some(conn)) {
            self.stats.refused += 1;
            return refuse(
                out,
                ErrorCode::UnknownWorker,
                format!(
                    "worker {rank} is not in shard {}'s barrier on this connection",
                    self.id()
                ),
            );
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
            self.stats.refused += 1;
            return refuse(
                out,
                ErrorCode::WrongStep,
                format!(
                    "push for step {step}, shard {} expects step {expected} from worker {rank}",
                    self.id()
                ),
            );
        }
        if step < expected {
            if self.counted.get(&rank) != Some(&step) {
                // Applied without this rank: it was declared dead for that
                // step (or never pushed it). Its gradient is stale; it must
                // take the cluster's parameters and step (an offer) instead.
                self.stats.refused += 1;
                self.stats.fenced += 1;
                return refuse(
                    out,
                    ErrorCode::Fenced,
                    format!(
                        "push for step {step}, but shard {} applied it without worker {rank} and expects step {expected}: offer your copy and continue at step {expected}",
                        self.id()
                    ),
                );
            }
            // Already applied with this push (a retry after a lost reply):
            // answer with the current parameters.
            self.stats.duplicate_pushes += 1;
            out.push(Action::Reply {
                to: reply,
                response: self.params_reply(rank, have_version),
            });
            return;
        }
        match self.setup.mode {
            SyncMode::Bsp => {
                if self.pushed.contains(&rank) {
                    // A retry of a push already counted: wait for the same reply.
                    self.stats.duplicate_pushes += 1;
                } else {
                    self.accumulate(grad);
                    self.pushed.insert(rank);
                    self.counted.insert(rank, step);
                }
                self.park(
                    reply,
                    conn,
                    rank,
                    have_version,
                    Wait::Applied { step },
                    now,
                    out,
                );
                if self.maybe_apply_bsp(out) {
                    self.maybe_checkpoint(out);
                }
                self.release(out);
            }
            SyncMode::Asp | SyncMode::Ssp => {
                self.accumulate(grad);
                let scale = 1.0 / self.live.len().max(1) as f32;
                if let Err(message) = self.apply(scale, out) {
                    self.stats.refused += 1;
                    return refuse(out, ErrorCode::Internal, message);
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

    fn min_live_clock(&self) -> Option<u64> {
        self.live
            .keys()
            .filter_map(|w| self.clocks.get(w))
            .min()
            .copied()
    }

    /// BSP: apply once every live rank pushed.
    fn maybe_apply_bsp(&mut self, out: &mut Vec<Action>) -> bool {
        if self.setup.mode != SyncMode::Bsp
            || self.pushed.is_empty()
            || !self.live.keys().all(|w| self.pushed.contains(w))
        {
            return false;
        }
        let scale = 1.0 / self.pushed.len() as f32;
        if let Err(message) = self.apply(scale, out) {
            // The pushes of this step are refused; the version stays.
            let step = self.version;
            let mut kept = Vec::with_capacity(self.parked.len());
            for p in std::mem::take(&mut self.parked) {
                if matches!(p.wait, Wait::Applied { step: s } if s == step) {
                    out.push(Action::Reply {
                        to: p.reply,
                        response: refusal(ErrorCode::Internal, message.clone()),
                    });
                } else {
                    kept.push(p);
                }
            }
            self.parked = kept;
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
        self.agg_peak = 0.0;
    }

    /// Apply the update under way, all or nothing: on `Err` (the update
    /// cannot run on this shard) no parameter, momentum or residual entry
    /// changed, the pushes are dropped and the version stays.
    fn apply(&mut self, scale: f32, out: &mut Vec<Action>) -> Result<(), String> {
        let sparse = !self.all_touched && !self.moves_untouched;
        let plan = UpdatePlan {
            segments: &self.setup.segments,
            decay: &self.setup.decay,
            step: self.version,
        };
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
                let plan = UpdatePlan {
                    segments: &self.setup.segments,
                    decay: &self.setup.decay,
                    step: self.version,
                };
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
            let plan = UpdatePlan {
                segments: &self.setup.segments,
                decay: &self.setup.decay,
                step: self.version,
            };
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
        self.push_max = 0;
        if self.changes.len() > CHANGE_HISTORY {
            self.changes.pop_front();
        }
        self.all_touched = false;
        self.pushed.clear();
        self.agg_peak = 0.0;
        self.version += 1;
        self.stats.updates += 1;
        out.push(Action::Applied {
            version: self.version,
            entries,
        });
        Ok(())
    }

    /// Global top-k: adds the mean of this update's pushes to the residual,
    /// applies the `push_max` largest entries of it (plain SGD) and keeps the
    /// rest. Returns the applied entries, ascending. O(candidates): the
    /// pushed entries and the residual's.
    fn select_global_topk(&mut self, scale: f32) -> Vec<u32> {
        for &i in &self.residual_idx {
            if !self.marked[i as usize] {
                self.marked[i as usize] = true;
                self.touched.push(i);
            }
        }
        self.residual_idx.clear();
        let mut candidates = std::mem::take(&mut self.touched);
        candidates.sort_unstable();
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
        let plan = UpdatePlan {
            segments: &self.setup.segments,
            decay: &self.setup.decay,
            step: self.version,
        };
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
    fn final_checkpoint(&mut self, out: &mut Vec<Action>) {
        if self.is_serving() && self.version > self.last_saved {
            out.push(Action::Checkpoint(self.snapshot()));
            self.saving = true;
        }
    }

    fn maybe_checkpoint(&mut self, out: &mut Vec<Action>) {
        let every = self.settings.checkpoint_every;
        if every == 0 || self.saving || self.version < self.last_saved + every {
            return;
        }
        self.saving = true;
        out.push(Action::Checkpoint(self.snapshot()));
    }

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
    fn params_reply(&self, rank: u32, have: Option<u64>) -> Arc<Response> {
        self.reply_with(rank, self.param_update(have))
    }

    /// What a worker holding version `have` needs: a sparse delta when known
    /// and cheaper, else the whole shard.
    fn param_update(&self, have: Option<u64>) -> ParamUpdate {
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
        }
    }

    /// Answer every parked reply whose condition now holds.
    fn release(&mut self, out: &mut Vec<Action>) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard of 8 parameters at 10..18, staleness 0 (SSP tests use `ssp`).
    fn setup(workers: u32, momentum: f32, mode: SyncMode) -> ShardSetup {
        ShardSetup {
            shard: 0,
            lo: 10,
            hi: 18,
            segments: std::iter::once(0..8).collect(),
            rule: OptimizerSection {
                lr: 1.0,
                momentum,
                ..OptimizerSection::default()
            },
            workers,
            mode,
            staleness: 0,
            global_topk: false,
            decay: Vec::new(),
        }
    }

    /// An SSP shard of `workers` ranks with the given staleness bound.
    fn ssp(workers: u32, staleness: u64) -> ShardSetup {
        ShardSetup {
            staleness,
            ..setup(workers, 0.0, SyncMode::Ssp)
        }
    }

    fn sparse(indices: Vec<u32>, values: Vec<f32>) -> WireGrad {
        WireGrad::Sparse {
            indices,
            values: WireValues::F32(values),
        }
    }

    /// A serving core whose ranks `0..workers` joined on connections `100 + rank`.
    /// A core whose `workers` ranks joined (rank r on connection 100 + r),
    /// still waiting for offers.
    fn joined(workers: u32, settings: CoreSettings, t0: Instant) -> ShardCore {
        joined_with(setup(workers, 0.0, SyncMode::Bsp), settings, t0)
    }

    fn joined_with(setup: ShardSetup, settings: CoreSettings, t0: Instant) -> ShardCore {
        let workers = setup.workers;
        let mut c = ShardCore::new(setup, settings, None);
        for r in 0..workers {
            c.handle(
                Event::Joined {
                    rank: r,
                    conn: 100 + u64::from(r),
                },
                t0,
            );
        }
        c
    }

    fn serving(workers: u32, momentum: f32, mode: SyncMode) -> (ShardCore, Instant) {
        serving_with(setup(workers, momentum, mode))
    }

    /// A serving core built from `setup`, every rank's offer at version 0.
    fn serving_with(setup: ShardSetup) -> (ShardCore, Instant) {
        let t0 = Instant::now();
        let workers = setup.workers;
        let mut c = joined_with(setup, CoreSettings::default(), t0);
        for r in 0..workers {
            c.handle(offer(r, 0, vec![0.0; 8]), t0);
        }
        assert!(c.is_serving());
        (c, t0)
    }

    fn offer(rank: u32, version: u64, values: Vec<f32>) -> Event {
        Event::Offer {
            reply: 9000 + u64::from(rank),
            conn: 100 + u64::from(rank),
            rank,
            version,
            next_step: version,
            values,
        }
    }

    fn step(reply: ReplyId, rank: u32, step: u64, grad: WireGrad) -> Event {
        Event::Step {
            reply,
            conn: 100 + u64::from(rank),
            rank,
            step,
            have_version: Some(step),
            grad,
        }
    }

    fn replies(actions: &[Action]) -> Vec<(ReplyId, &Response)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Reply { to, response } => Some((*to, &**response)),
                _ => None,
            })
            .collect()
    }

    fn code(r: &Response) -> Option<ErrorCode> {
        match r {
            Response::Error { code, .. } => Some(*code),
            _ => None,
        }
    }

    #[test]
    fn offers_of_what_the_shard_starts_from_get_no_values_back() {
        let t0 = Instant::now();
        let mut c = joined(3, CoreSettings::default(), t0);
        // Ranks 0 and 1 start from the same initial weights, rank 2 from others.
        let init: Vec<f32> = (0..8).map(|i| i as f32 / 8.0).collect();
        let mut acts = c.handle(offer(0, 0, init.clone()), t0);
        acts.extend(c.handle(offer(1, 0, init.clone()), t0));
        acts.extend(c.handle(offer(2, 0, vec![0.5; 8]), t0));
        assert!(c.is_serving());
        let r = replies(&acts);
        assert_eq!(r.len(), 3);
        let kept = c.params().to_vec();
        for (to, resp) in r {
            let Response::Params { update, .. } = resp else {
                panic!("{resp:?}")
            };
            let offered = if to == 9002 {
                vec![0.5; 8]
            } else {
                init.clone()
            };
            let same = offered == kept;
            match update {
                ParamUpdate::Sparse { indices, .. } if same => assert!(indices.is_empty()),
                ParamUpdate::Dense(values) if !same => assert_eq!(values, &kept),
                other => panic!("reply {to}: {other:?}"),
            }
        }
        // Serving: a rejoining worker holding the current values gets none back.
        let acts = c.handle(offer(1, 0, kept.clone()), t0);
        assert!(matches!(
            replies(&acts)[..],
            [(_, Response::Params { update: ParamUpdate::Sparse { ref indices, .. }, .. })] if indices.is_empty()
        ));
        let acts = c.handle(offer(1, 0, vec![9.0; 8]), t0);
        assert!(matches!(
            replies(&acts)[..],
            [(
                _,
                Response::Params {
                    update: ParamUpdate::Dense(_),
                    ..
                }
            )]
        ));
    }

    #[test]
    fn bsp_step_is_one_round_trip_and_idempotent() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
        assert!(replies(&c.handle(step(1, 0, 0, sparse(vec![1], vec![2.0])), t0)).is_empty());
        // A retry of the same push (lost reply, reconnect) is not counted twice.
        assert!(replies(&c.handle(step(2, 0, 0, sparse(vec![1], vec![2.0])), t0)).is_empty());
        assert_eq!(c.stats().duplicate_pushes, 1);
        let acts = c.handle(step(3, 1, 0, sparse(vec![1, 3], vec![4.0, 2.0])), t0);
        let r = replies(&acts);
        assert_eq!(
            r.len(),
            3,
            "both parked replies of rank 0 and rank 1's reply"
        );
        assert_eq!(c.version(), 1);
        assert_eq!(c.params()[1], -3.0, "average of 2 and 4");
        assert_eq!(c.params()[3], -1.0);
        // The step's replies are one shared response (built once, and
        // encoded once by the actor), not one copy per worker.
        let shared: Vec<&Arc<Response>> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Reply { response, .. } => Some(response),
                _ => None,
            })
            .collect();
        assert!(shared.iter().all(|r| Arc::ptr_eq(r, shared[0])));
        for (_, resp) in r {
            match resp {
                Response::Params {
                    version: 1,
                    next_step: 1,
                    update: ParamUpdate::Sparse { indices, values },
                    live_workers: 2,
                    ..
                } => {
                    assert_eq!(indices, &vec![1, 3]);
                    assert_eq!(values, &vec![-3.0, -1.0]);
                }
                other => panic!("{other:?}"),
            }
        }
        // A push for a step already applied is answered at once, not applied.
        let acts = c.handle(step(4, 0, 0, sparse(vec![1], vec![100.0])), t0);
        assert!(matches!(
            replies(&acts)[..],
            [(4, Response::Params { version: 1, .. })]
        ));
        assert_eq!(c.params()[1], -3.0);
        // A push from the future is refused.
        let acts = c.handle(step(5, 0, 3, sparse(vec![1], vec![1.0])), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::WrongStep));
    }

    #[test]
    fn sparse_momentum_free_updates_touch_only_pushed_entries() {
        let (mut c, t0) = serving(1, 0.0, SyncMode::Bsp);
        let acts = c.handle(step(1, 0, 0, sparse(vec![2, 5], vec![1.0, 1.0])), t0);
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Applied {
                version: 1,
                entries: 2
            }
        )));
        assert_eq!(c.stats().sparse_updates, 1);
        let (mut c, t0) = serving(1, 0.9, SyncMode::Bsp);
        let acts = c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
        assert!(
            acts.iter()
                .any(|a| matches!(a, Action::Applied { entries: 8, .. })),
            "momentum moves every entry"
        );
        assert!(matches!(
            replies(&acts)[0].1,
            Response::Params {
                update: ParamUpdate::Dense(_),
                ..
            }
        ));
    }

    /// Global top-k: two pushes of 2 entries each apply the 2 largest of
    /// their mean plus the residual; the rest waits in the residual, is
    /// applied when it grows, survives a checkpoint, and joins a dense update.
    #[test]
    fn global_topk_applies_k_entries_and_keeps_the_rest() {
        let (mut c, t0) = serving_with(ShardSetup {
            global_topk: true,
            ..setup(2, 0.0, SyncMode::Bsp)
        });
        c.handle(step(1, 0, 0, sparse(vec![0, 1], vec![4.0, 2.0])), t0);
        let acts = c.handle(step(2, 1, 0, sparse(vec![1, 3], vec![2.0, -1.0])), t0);
        // Mean: [2, 2, 0, -0.5]; k = 2 applies entries 0 and 1 (lr 1).
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Applied {
                version: 1,
                entries: 2
            }
        )));
        for (_, r) in replies(&acts) {
            match r {
                Response::Params {
                    update: ParamUpdate::Sparse { indices, values },
                    ..
                } => {
                    assert_eq!(indices, &vec![0, 1]);
                    assert_eq!(values, &vec![-2.0, -2.0]);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(c.params(), &[-2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            c.snapshot().residual,
            SparseGrad {
                indices: vec![3],
                values: vec![-0.5]
            }
        );
        // Next update: entry 3's residual (-0.5) plus its new mean (-1)
        // beats entry 5's 1.0 with k = 1.
        c.handle(step(3, 0, 1, sparse(vec![3], vec![-2.0])), t0);
        let acts = c.handle(step(4, 1, 1, sparse(vec![5], vec![2.0])), t0);
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Applied { entries: 1, .. })));
        assert_eq!(c.params()[3], 1.5);
        assert_eq!(c.params()[5], 0.0);
        // The residual is restored from a checkpoint at the same version.
        let ckpt = c.snapshot();
        assert_eq!(ckpt.residual.indices, vec![5]);
        let mut again = ShardCore::new(
            ShardSetup {
                global_topk: true,
                ..setup(2, 0.0, SyncMode::Bsp)
            },
            CoreSettings::default(),
            Some(ckpt.clone()),
        );
        for r in 0..2 {
            again.handle(
                Event::Joined {
                    rank: r,
                    conn: 100 + u64::from(r),
                },
                t0,
            );
            again.handle(offer(r, 2, c.params().to_vec()), t0);
        }
        assert_eq!(again.snapshot().residual, ckpt.residual);
        assert_eq!(again.params(), c.params());
        // A dense update applies what the residual held.
        let dense = |v: f32| WireGrad::Dense(WireValues::F32(vec![v; 8]));
        again.handle(step(5, 0, 2, dense(0.0)), t0);
        again.handle(step(6, 1, 2, dense(0.0)), t0);
        assert_eq!(again.params()[5], -1.0);
        assert!(again.snapshot().residual.is_empty());
    }

    #[test]
    fn adamw_sparse_updates_stay_sparse_and_moments_survive_a_checkpoint() {
        use ps_shared::config::OptimizerKind;
        let adamw = || ShardSetup {
            rule: OptimizerSection {
                lr: 0.1,
                kind: OptimizerKind::Adamw,
                weight_decay: 0.01,
                ..OptimizerSection::default()
            },
            ..setup(1, 0.0, SyncMode::Bsp)
        };
        let (mut c, t0) = serving_with(adamw());
        assert_eq!(c.snapshot().momentum.len(), 16, "two moments per parameter");
        // A sparse push moves only its entry, and the reply is sparse.
        let acts = c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Applied { entries: 1, .. })));
        match replies(&acts)[0].1 {
            Response::Params {
                update: ParamUpdate::Sparse { indices, values },
                ..
            } => {
                assert_eq!(indices, &vec![2]);
                // Step 1: lr * sign(g).
                assert!((values[0] + 0.1).abs() < 1e-6, "{values:?}");
            }
            other => panic!("{other:?}"),
        }
        let m = c.snapshot().momentum;
        for i in 0..8 {
            assert_eq!(m[i] != 0.0, i == 2, "first moment {i}: {}", m[i]);
            assert_eq!(m[8 + i] != 0.0, i == 2, "second moment {i}");
        }
        let dense = |v: f32| WireGrad::Dense(WireValues::F32(vec![v; 8]));
        c.handle(step(2, 0, 1, dense(0.5)), t0);
        // Restart from the checkpoint: parameters and moments come back, and
        // the next update is the same bit for bit as on the old core.
        let saved = c.snapshot();
        let mut again = ShardCore::new(adamw(), CoreSettings::default(), Some(saved.clone()));
        again.handle(Event::Joined { rank: 0, conn: 100 }, t0);
        again.handle(offer(0, 2, c.params().to_vec()), t0);
        assert!(again.is_serving());
        assert_eq!(again.snapshot().momentum, saved.momentum);
        assert_eq!(again.recovery_report().unwrap().momentum_updates_lost, 0);
        c.handle(step(3, 0, 2, dense(-0.25)), t0);
        again.handle(step(3, 0, 2, dense(-0.25)), t0);
        assert_eq!(again.params(), c.params());
        assert_eq!(again.snapshot().momentum, c.snapshot().momentum);
        // A checkpoint of another optimizer (SGD momentum: one float per
        // parameter) does not fit: the state starts from zero and the
        // report counts every update's state as lost.
        let sgd = ckpt(2, saved.params.clone(), vec![0.5; 8]);
        let mut other = ShardCore::new(adamw(), CoreSettings::default(), Some(sgd));
        other.handle(Event::Joined { rank: 0, conn: 100 }, t0);
        other.handle(offer(0, 2, saved.params.clone()), t0);
        assert_eq!(other.snapshot().momentum, vec![0.0; 16]);
        assert_eq!(other.recovery_report().unwrap().momentum_updates_lost, 2);
    }

    #[test]
    fn bad_pushes_are_refused_without_side_effects() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
        c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
        let before = (c.params().to_vec(), c.version(), c.parked());
        let cases = [
            (sparse(vec![8], vec![1.0]), ErrorCode::OutOfRange),
            (sparse(vec![3, 3], vec![1.0, 1.0]), ErrorCode::OutOfRange),
            (sparse(vec![1, 2], vec![1.0]), ErrorCode::WrongLength),
            (sparse(vec![1], vec![f32::NAN]), ErrorCode::NonFinite),
            (sparse(vec![1], vec![f32::INFINITY]), ErrorCode::NonFinite),
            (
                WireGrad::Dense(WireValues::F32(vec![0.0; 3])),
                ErrorCode::WrongLength,
            ),
        ];
        for (i, (grad, want)) in cases.into_iter().enumerate() {
            let acts = c.handle(step(10 + i as u64, 1, 0, grad), t0);
            assert_eq!(code(replies(&acts)[0].1), Some(want));
        }
        // A rank on a connection that is not its barrier connection.
        let acts = c.handle(
            Event::Step {
                reply: 20,
                conn: 555,
                rank: 1,
                step: 0,
                have_version: None,
                grad: sparse(vec![1], vec![1.0]),
            },
            t0,
        );
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::UnknownWorker));
        assert_eq!((c.params().to_vec(), c.version(), c.parked()), before);
        let acts = c.handle(step(30, 1, 0, sparse(vec![2], vec![3.0])), t0);
        assert_eq!(replies(&acts).len(), 2);
        assert_eq!(c.params()[2], -2.0);
    }

    #[test]
    fn parked_replies_are_bounded_expire_and_die_with_their_connection() {
        let t0 = Instant::now();
        let settings = CoreSettings {
            request_timeout: Duration::from_secs(5),
            max_parked_per_conn: 2,
            ..CoreSettings::default()
        };
        let mut c = ShardCore::new(setup(2, 0.0, SyncMode::Bsp), settings, None);
        c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
        c.handle(Event::Joined { rank: 1, conn: 101 }, t0);
        c.handle(offer(0, 0, vec![0.0; 8]), t0);
        c.handle(offer(1, 0, vec![0.0; 8]), t0);
        c.handle(step(1, 0, 0, sparse(vec![1], vec![1.0])), t0);
        c.handle(step(2, 0, 0, sparse(vec![1], vec![1.0])), t0);
        let acts = c.handle(step(3, 0, 0, sparse(vec![1], vec![1.0])), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::TooManyPending));
        assert_eq!(c.parked(), 2);
        assert!(replies(&c.handle(Event::Tick, t0 + Duration::from_secs(4))).is_empty());
        let acts = c.handle(Event::Tick, t0 + Duration::from_secs(5));
        let r = replies(&acts);
        assert_eq!(r.len(), 2);
        assert!(r
            .iter()
            .all(|(_, resp)| code(resp) == Some(ErrorCode::Timeout)));
        assert_eq!(c.stats().timeouts, 2);
        // A closed connection takes its parked replies with it, and says
        // which reply slots to release.
        c.handle(step(4, 0, 0, sparse(vec![1], vec![1.0])), t0);
        assert_eq!(c.parked(), 1);
        let acts = c.handle(Event::ConnClosed { conn: 100 }, t0);
        assert_eq!(c.parked(), 0);
        assert!(matches!(acts[..], [Action::Forget { to: 4 }]), "{acts:?}");
        // So does a rank that leaves on its connection.
        c.handle(step(5, 0, 0, sparse(vec![1], vec![1.0])), t0);
        let acts = c.handle(
            Event::Left {
                rank: 0,
                conn: Some(100),
            },
            t0,
        );
        assert!(
            acts.iter().any(|a| matches!(a, Action::Forget { to: 5 })),
            "{acts:?}"
        );
        assert_eq!(c.parked(), 0);
    }

    #[test]
    fn leaving_releases_the_barrier_and_stale_connections_are_ignored() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
        c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
        // Rank 1 reconnected on 201 before its old connection 101 was seen to die.
        c.handle(Event::Joined { rank: 1, conn: 201 }, t0);
        c.handle(
            Event::Left {
                rank: 1,
                conn: Some(101),
            },
            t0,
        );
        assert_eq!(
            c.version(),
            0,
            "the stale connection's departure changes nothing"
        );
        let acts = c.handle(
            Event::Left {
                rank: 1,
                conn: Some(201),
            },
            t0,
        );
        assert_eq!(c.version(), 1);
        assert!(matches!(
            replies(&acts)[..],
            [(
                1,
                Response::Params {
                    live_workers: 1,
                    ..
                }
            )]
        ));
        assert_eq!(c.params()[0], -1.0);
    }

    #[test]
    fn a_worker_that_crashed_after_pushing_rejoins_with_the_same_step() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
        c.handle(step(1, 1, 0, sparse(vec![0], vec![2.0])), t0);
        // Rank 1 dies after its push; its replacement joins on a new connection.
        c.handle(Event::ConnClosed { conn: 101 }, t0);
        c.handle(
            Event::Left {
                rank: 1,
                conn: Some(101),
            },
            t0,
        );
        // Rank 0 alone completes step 0 (with rank 1's push in it).
        let acts = c.handle(step(2, 0, 0, sparse(vec![0], vec![4.0])), t0);
        assert_eq!(replies(&acts).len(), 1);
        assert_eq!(c.params()[0], -3.0);
        c.handle(Event::Joined { rank: 1, conn: 301 }, t0);
        let acts = c.handle(
            Event::Offer {
                reply: 3,
                conn: 301,
                rank: 1,
                version: 0,
                next_step: 0,
                values: vec![9.0; 8],
            },
            t0,
        );
        match replies(&acts)[..] {
            [(
                3,
                Response::Params {
                    version: 1,
                    next_step: 1,
                    update: ParamUpdate::Dense(v),
                    ..
                },
            )] => assert_eq!(v[0], -3.0),
            ref other => panic!("{other:?}"),
        }
        // Its retry of step 0 is answered, not refused; step 1 waits for both.
        let acts = c.handle(
            Event::Step {
                reply: 4,
                conn: 301,
                rank: 1,
                step: 0,
                have_version: Some(1),
                grad: sparse(vec![0], vec![1.0]),
            },
            t0,
        );
        assert!(matches!(
            replies(&acts)[..],
            [(4, Response::Params { version: 1, .. })]
        ));
        assert!(replies(&c.handle(
            Event::Step {
                reply: 5,
                conn: 301,
                rank: 1,
                step: 1,
                have_version: Some(1),
                grad: sparse(vec![0], vec![1.0])
            },
            t0
        ))
        .is_empty());
        assert_eq!(
            replies(&c.handle(step(6, 0, 1, sparse(vec![0], vec![1.0])), t0)).len(),
            2
        );
    }

    #[test]
    fn a_rank_declared_dead_is_fenced_and_rejoins_at_the_clusters_step() {
        for mode in [SyncMode::Bsp, SyncMode::Asp] {
            let (mut c, t0) = serving(2, 0.0, mode);
            // Rank 1 falls silent before pushing step 0 and is dropped.
            c.handle(
                Event::Left {
                    rank: 1,
                    conn: Some(101),
                },
                t0,
            );
            // Rank 0 goes on alone: steps 0 and 1.
            c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
            c.handle(step(2, 0, 1, sparse(vec![0], vec![1.0])), t0);
            assert_eq!(c.version(), 2, "{mode:?}");
            // Rank 1 comes back on a new connection with its stale step 0.
            c.handle(Event::Joined { rank: 1, conn: 201 }, t0);
            let stale = |reply, step| Event::Step {
                reply,
                conn: 201,
                rank: 1,
                step,
                have_version: Some(0),
                grad: sparse(vec![0], vec![50.0]),
            };
            let acts = c.handle(stale(3, 0), t0);
            assert_eq!(
                code(replies(&acts)[0].1),
                Some(ErrorCode::Fenced),
                "{mode:?}"
            );
            let acts = c.handle(stale(4, 1), t0);
            assert_eq!(
                code(replies(&acts)[0].1),
                Some(ErrorCode::Fenced),
                "{mode:?}"
            );
            assert_eq!(c.stats().fenced, 2);
            assert_eq!(c.version(), 2, "a stale push changes nothing");
            assert_eq!(c.params()[0], -2.0);
            // Its offer gives it the cluster's parameters and step.
            let acts = c.handle(
                Event::Offer {
                    reply: 5,
                    conn: 201,
                    rank: 1,
                    version: 0,
                    next_step: 0,
                    values: vec![0.0; 8],
                },
                t0,
            );
            assert!(
                matches!(
                    replies(&acts)[..],
                    [(
                        5,
                        Response::Params {
                            version: 2,
                            next_step: 2,
                            ..
                        }
                    )]
                ),
                "{mode:?}: {acts:?}"
            );
            if mode == SyncMode::Bsp {
                // Step 2 needs both ranks again.
                let mut pushed = stale(6, 2);
                if let Event::Step { have_version, .. } = &mut pushed {
                    *have_version = Some(2);
                }
                assert!(replies(&c.handle(pushed, t0)).is_empty());
                let acts = c.handle(step(7, 0, 2, sparse(vec![0], vec![1.0])), t0);
                assert_eq!(replies(&acts).len(), 2);
                assert_eq!(c.version(), 3);
                // A retry of a push that was counted is still answered.
                let mut retry = stale(8, 2);
                if let Event::Step { have_version, .. } = &mut retry {
                    *have_version = Some(2);
                }
                let acts = c.handle(retry, t0);
                assert!(matches!(
                    replies(&acts)[..],
                    [(8, Response::Params { version: 3, .. })]
                ));
            }
        }
    }

    #[test]
    fn a_fresh_shard_waits_for_every_copy_or_the_window() {
        let t0 = Instant::now();
        let mut c = ShardCore::new(setup(2, 0.0, SyncMode::Bsp), CoreSettings::default(), None);
        c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
        assert!(replies(&c.handle(offer(0, 0, vec![1.0; 8]), t0)).is_empty());
        // A step before the shard serves is refused with a hint.
        let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::NotInitialized));
        assert!(c
            .handle(Event::Tick, t0 + Duration::from_secs(9))
            .is_empty());
        let acts = c.handle(Event::Tick, t0 + Duration::from_secs(10));
        let report = acts.iter().find_map(|a| match a {
            Action::Recovered(r) => Some(r.clone()),
            _ => None,
        });
        let report = report.expect("decided after the window");
        assert_eq!(
            (report.source, report.version, report.offers),
            (RecoverySource::Fresh, 0, 1)
        );
        assert!(matches!(
            replies(&acts)[..],
            [(9000, Response::Params { version: 0, .. })]
        ));
        assert_eq!(c.params(), &[1.0; 8]);
    }

    fn ckpt(version: u64, params: Vec<f32>, momentum: Vec<f32>) -> ShardCheckpoint {
        ShardCheckpoint {
            shard: 0,
            lo: 10,
            hi: 18,
            layout_hash: 0,
            version,
            params,
            momentum,
            residual: SparseGrad::default(),
            clocks: vec![],
            data: DataSplit::default(),
        }
    }

    /// A restarted shard of `workers` ranks given `offers` (rank, version,
    /// value of every entry); what it decided once every rank offered or the
    /// window passed (`None`: it could start from nothing), and the replies
    /// its offers got.
    fn recover(
        mode: SyncMode,
        workers: u32,
        settings: CoreSettings,
        ck: Option<ShardCheckpoint>,
        offers: &[(u32, u64, f32)],
        momentum: f32,
    ) -> (ShardCore, Option<RecoveryReport>, Vec<Response>) {
        let t0 = Instant::now();
        let mut c = ShardCore::new(setup(workers, momentum, mode), settings, ck);
        for &(rank, _, _) in offers {
            c.handle(
                Event::Joined {
                    rank,
                    conn: 100 + u64::from(rank),
                },
                t0,
            );
        }
        let mut acts = Vec::new();
        for &(rank, version, value) in offers {
            acts.extend(c.handle(offer(rank, version, vec![value; 8]), t0));
        }
        acts.extend(c.handle(Event::Tick, t0 + Duration::from_secs(60)));
        let report = acts.iter().find_map(|a| match a {
            Action::Recovered(r) => Some(r.clone()),
            _ => None,
        });
        let answers = replies(&acts).into_iter().map(|(_, r)| r.clone()).collect();
        (c, report, answers)
    }

    #[test]
    fn recovery_takes_the_newest_consistent_copy_and_checks_the_checkpoint() {
        let run = |ck: Option<ShardCheckpoint>, offers: Vec<(u32, u64, f32)>, momentum: f32| {
            let (c, report, _) = recover(
                SyncMode::Bsp,
                3,
                CoreSettings::default(),
                ck,
                &offers,
                momentum,
            );
            (c, report.expect("decided"))
        };
        // The server died after replying to two of three workers: version 8 wins, 0 lost.
        let (c, r) = run(None, vec![(0, 8, 8.0), (1, 8, 8.0), (2, 7, 7.0)], 0.0);
        assert_eq!(
            (
                r.source,
                r.version,
                r.agreeing,
                r.updates_lost,
                r.rejected,
                r.quorum
            ),
            (RecoverySource::Workers, 8, 2, 0, 0, 2)
        );
        assert_eq!(c.params(), &[8.0; 8]);
        assert_eq!(c.version(), 8);
        // Copies at the newest version disagree and no majority agrees
        // anywhere: the checkpoint, the only state the shard can check.
        let (c, r) = run(
            Some(ckpt(8, vec![8.0; 8], vec![])),
            vec![(0, 9, 1.0), (1, 9, 2.0), (2, 8, 8.0)],
            0.0,
        );
        assert_eq!(
            (r.source, r.version, r.rejected),
            (RecoverySource::Checkpoint, 8, 2)
        );
        assert_eq!(c.params(), &[8.0; 8]);
        // A checkpoint newer than every copy wins; momentum comes from it.
        let (c, r) = run(
            Some(ckpt(12, vec![12.0; 8], vec![0.5; 8])),
            vec![(0, 10, 10.0), (1, 10, 10.0), (2, 10, 10.0)],
            0.9,
        );
        assert_eq!(
            (r.source, r.version, r.momentum_updates_lost),
            (RecoverySource::Checkpoint, 12, 0)
        );
        assert_eq!(c.params(), &[12.0; 8]);
        // Copies newer than the checkpoint win; the momentum is that old.
        let (c, r) = run(
            Some(ckpt(10, vec![10.0; 8], vec![0.5; 8])),
            vec![(0, 14, 14.0), (1, 14, 14.0), (2, 14, 14.0)],
            0.9,
        );
        assert_eq!(
            (
                r.source,
                r.version,
                r.checkpoint_version,
                r.momentum_updates_lost,
                r.updates_lost
            ),
            (RecoverySource::Workers, 14, Some(10), 4, 0)
        );
        assert_eq!(c.snapshot().momentum, vec![0.5; 8]);
        // A checkpoint at the chosen version that differs is reported.
        let (_, r) = run(
            Some(ckpt(14, vec![1.0; 8], vec![])),
            vec![(0, 14, 14.0), (1, 14, 14.0), (2, 14, 14.0)],
            0.0,
        );
        assert!(r.checkpoint_mismatch);
    }

    #[test]
    fn a_forged_offer_from_one_rank_is_not_adopted() {
        const FORGED: u64 = 1_000_000;
        // Two honest ranks agree: the majority wins, the forgery is counted.
        let (c, r, _) = recover(
            SyncMode::Bsp,
            3,
            CoreSettings::default(),
            None,
            &[(0, 50, 5.0), (1, 50, 5.0), (2, FORGED, 7.0)],
            0.0,
        );
        let r = r.expect("decided");
        assert_eq!(
            (r.source, r.version, r.agreeing, r.rejected, r.updates_lost),
            (RecoverySource::Workers, 50, 2, 1, 0)
        );
        assert_eq!((c.version(), c.params()), (50, &[5.0; 8][..]));
        // One honest rank against one forger, with a checkpoint: the shard
        // cannot tell them apart and starts from the checkpoint.
        let bounded = CoreSettings {
            recovery_max_ahead: 50,
            ..CoreSettings::default()
        };
        for settings in [CoreSettings::default(), bounded.clone()] {
            let (c, r, _) = recover(
                SyncMode::Bsp,
                2,
                settings,
                Some(ckpt(48, vec![4.8; 8], vec![])),
                &[(0, 50, 5.0), (1, FORGED, 7.0)],
                0.0,
            );
            let r = r.expect("decided");
            assert_eq!(
                (r.source, r.version, r.rejected),
                (RecoverySource::Checkpoint, 48, 2)
            );
            assert_eq!(c.params(), &[4.8; 8]);
        }
        // Without a checkpoint it starts from nothing: the offers are
        // refused with the reason, and the shard keeps waiting.
        let (c, r, answers) = recover(
            SyncMode::Bsp,
            2,
            CoreSettings::default(),
            None,
            &[(0, 50, 5.0), (1, FORGED, 7.0)],
            0.0,
        );
        assert!(r.is_none() && !c.is_serving());
        assert_eq!(answers.len(), 2);
        for a in &answers {
            match a {
                Response::Error {
                    code: ErrorCode::NotInitialized,
                    message,
                } => assert!(
                    message.contains("no strict majority")
                        && message.contains("rank 1 at version 1000000"),
                    "{message}"
                ),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_copy_beyond_what_the_cluster_can_have_reached_is_refused() {
        let bounded = CoreSettings {
            recovery_max_ahead: 50,
            ..CoreSettings::default()
        };
        // Every rank agrees on version 1,000,000, but the checkpoint is at
        // 48 and at most 50 updates can follow it.
        let (c, r, _) = recover(
            SyncMode::Bsp,
            3,
            bounded.clone(),
            Some(ckpt(48, vec![4.8; 8], vec![])),
            &[
                (0, 1_000_000, 7.0),
                (1, 1_000_000, 7.0),
                (2, 1_000_000, 7.0),
            ],
            0.0,
        );
        let r = r.expect("decided");
        assert_eq!(
            (r.source, r.version, r.rejected),
            (RecoverySource::Checkpoint, 48, 3)
        );
        assert_eq!(c.params(), &[4.8; 8]);
        // Within the bound they are adopted.
        let (_, r, _) = recover(
            SyncMode::Bsp,
            3,
            bounded.clone(),
            Some(ckpt(48, vec![4.8; 8], vec![])),
            &[(0, 98, 9.8), (1, 98, 9.8), (2, 98, 9.8)],
            0.0,
        );
        assert_eq!(
            r.map(|r| (r.source, r.version)),
            Some((RecoverySource::Workers, 98))
        );
        // No checkpoint found though periodic ones are on: the bound counts from 0.
        let (c, r, answers) = recover(
            SyncMode::Bsp,
            3,
            bounded,
            None,
            &[
                (0, 1_000_000, 7.0),
                (1, 1_000_000, 7.0),
                (2, 1_000_000, 7.0),
            ],
            0.0,
        );
        assert!(r.is_none() && !c.is_serving());
        assert!(answers
            .iter()
            .all(|a| code(a) == Some(ErrorCode::NotInitialized)));
    }

    #[test]
    fn one_lost_reply_in_bsp_and_diverging_copies_in_asp() {
        // BSP: the server died after replying to rank 0 only. Rank 1's copy
        // is one version behind: rank 0's copy is taken, nothing is lost.
        let (c, r, _) = recover(
            SyncMode::Bsp,
            2,
            CoreSettings::default(),
            None,
            &[(0, 8, 8.0), (1, 7, 7.0)],
            0.0,
        );
        let r = r.expect("decided");
        assert_eq!(
            (r.source, r.version, r.updates_lost, r.rejected),
            (RecoverySource::Workers, 8, 0, 0)
        );
        assert_eq!(c.params(), &[8.0; 8]);
        // Two versions apart is no lost reply: nothing to check it with.
        let (_, r, _) = recover(
            SyncMode::Bsp,
            2,
            CoreSettings::default(),
            None,
            &[(0, 9, 9.0), (1, 7, 7.0)],
            0.0,
        );
        assert!(r.is_none());
        // ASP: copies legitimately differ; without a majority the shard
        // starts from its checkpoint.
        let (c, r, _) = recover(
            SyncMode::Asp,
            2,
            CoreSettings::default(),
            Some(ckpt(10, vec![1.0; 8], vec![])),
            &[(0, 14, 14.0), (1, 13, 13.0)],
            0.0,
        );
        let r = r.expect("decided");
        assert_eq!(
            (r.source, r.version, r.rejected),
            (RecoverySource::Checkpoint, 10, 2)
        );
        assert_eq!(c.params(), &[1.0; 8]);
        // A fresh run starts from version 0 copies even without a majority.
        let (_, r, _) = recover(
            SyncMode::Asp,
            3,
            CoreSettings::default(),
            None,
            &[(0, 0, 1.0)],
            0.0,
        );
        assert_eq!(r.map(|r| r.source), Some(RecoverySource::Fresh));
    }

    #[test]
    fn gradient_norm_is_bounded() {
        let t0 = Instant::now();
        let mut settings = CoreSettings {
            max_grad_norm: 1.0,
            ..CoreSettings::default()
        };
        let mut c = ShardCore::new(setup(1, 0.0, SyncMode::Bsp), settings.clone(), None);
        c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
        c.handle(offer(0, 0, vec![0.0; 8]), t0);
        c.handle(step(1, 0, 0, sparse(vec![0, 1], vec![3.0, 4.0])), t0);
        assert_eq!(c.stats().clipped, 1);
        assert!((c.params()[0] + 0.6).abs() < 1e-6 && (c.params()[1] + 0.8).abs() < 1e-6);
        settings.norm_policy = GradNormPolicy::Refuse;
        let mut c = joined(1, settings, t0);
        c.handle(offer(0, 0, vec![0.0; 8]), t0);
        let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![1e30])), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::GradientTooLarge));
        assert_eq!(c.params(), &[0.0; 8]);
    }

    /// Rank 0 pushes `honest` to entry 0 and rank 1 pushes `rank1` to entry
    /// 1, for `steps` BSP steps; returns the step's replies.
    fn bsp_step(c: &mut ShardCore, at: u64, honest: f32, rank1: f32, t0: Instant) -> Vec<Response> {
        let mut acts = c.handle(step(2 * at, 0, at, sparse(vec![0], vec![honest])), t0);
        acts.extend(c.handle(step(2 * at + 1, 1, at, sparse(vec![1], vec![rank1])), t0));
        replies(&acts).into_iter().map(|(_, r)| r.clone()).collect()
    }

    #[test]
    fn a_huge_push_from_one_rank_is_neutralised_by_default() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
        for at in 0..5 {
            assert_eq!(bsp_step(&mut c, at, 1.0, 1.0, t0).len(), 2);
        }
        assert_eq!(c.params()[..2], [-2.5, -2.5]);
        // Rank 1 pushes 3e38: scaled down to the median norm (1.0).
        let answers = bsp_step(&mut c, 5, 1.0, 3e38, t0);
        assert!(answers
            .iter()
            .all(|a| matches!(a, Response::Params { version: 6, .. })));
        assert_eq!(c.params()[..2], [-3.0, -3.0]);
        assert!(c.params().iter().all(|p| p.is_finite()));
        let stats = c.stats();
        assert_eq!((stats.anomalies, stats.clipped, stats.refused), (1, 0, 0));
        // Under the refuse policy the push is refused; the honest rank's
        // push waits for rank 1's next one.
        let settings = CoreSettings {
            norm_policy: GradNormPolicy::Refuse,
            ..CoreSettings::default()
        };
        let mut c = joined(2, settings, t0);
        for r in 0..2 {
            c.handle(offer(r, 0, vec![0.0; 8]), t0);
        }
        for at in 0..3 {
            bsp_step(&mut c, at, 1.0, 1.0, t0);
        }
        let answers = bsp_step(&mut c, 3, 1.0, 3e38, t0);
        assert!(
            matches!(
                &answers[..],
                [Response::Error { code: ErrorCode::GradientTooLarge, message }] if message.contains("server.grad_anomaly_factor")
            ),
            "{answers:?}"
        );
        let acts = c.handle(step(100, 1, 3, sparse(vec![1], vec![1.0])), t0);
        assert_eq!(replies(&acts).len(), 2);
        assert_eq!(c.params()[..2], [-2.0, -2.0]);
        // The very first push is held by the ceiling alone.
        let (mut c, t0) = serving(1, 0.0, SyncMode::Bsp);
        c.handle(step(1, 0, 0, sparse(vec![0], vec![3e38])), t0);
        assert!((c.params()[0] + 1.0e6).abs() < 1.0, "{}", c.params()[0]);
        assert_eq!(c.stats().clipped, 1);
    }

    #[test]
    fn push_norms_are_exact_enough_and_do_not_overflow() {
        let small: Vec<f32> = (0..13).map(|i| i as f32).collect();
        let want = (0..13).map(|i| (i * i) as f64).sum::<f64>().sqrt();
        assert!((push_norm(&WireValues::F32(small)) - want).abs() < 1e-9);
        let big = vec![3e38f32; 3 * NORM_CHUNK + 5];
        let norm = push_norm(&WireValues::F32(big.clone()));
        let want = 3e38f64 * ((3 * NORM_CHUNK + 5) as f64).sqrt();
        assert!(
            norm.is_finite() && ((norm - want) / want).abs() < 1e-6,
            "{norm}"
        );
        assert_eq!(
            norm,
            push_norm(&WireValues::F32(big)),
            "same order every time"
        );
    }

    #[test]
    fn ordinary_norm_changes_are_not_anomalies() {
        let (mut c, t0) = serving(1, 0.0, SyncMode::Asp);
        // Norms wander over two orders of magnitude, as in a real run (a
        // fixed sequence, so the test is deterministic).
        let mut x: u32 = 12345;
        for at in 0..500 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let scale = 0.1 + 9.9 * f64::from(x >> 16) as f32 / 65536.0;
            let grad = sparse(vec![0, 3, 5], vec![0.5 * scale, -0.2 * scale, 0.1 * scale]);
            let acts = c.handle(step(at, 0, at, grad), t0);
            assert!(matches!(replies(&acts)[..], [(_, Response::Params { .. })]));
        }
        let stats = c.stats();
        assert_eq!(
            (stats.anomalies, stats.clipped, stats.refused, stats.updates),
            (0, 0, 0, 500)
        );
    }

    #[test]
    fn the_sum_of_one_updates_pushes_stays_finite() {
        // With every bound off, finite pushes whose sum overflows: the push
        // that would overflow is refused, the others are applied.
        let settings = CoreSettings {
            grad_norm_ceiling: 0.0,
            grad_anomaly_factor: 0.0,
            ..CoreSettings::default()
        };
        let t0 = Instant::now();
        let mut c = joined(3, settings, t0);
        for r in 0..3 {
            c.handle(offer(r, 0, vec![0.0; 8]), t0);
        }
        let big = 0.8e37f32;
        for r in 0..2 {
            assert!(
                replies(&c.handle(step(r.into(), r, 0, sparse(vec![0], vec![big])), t0)).is_empty()
            );
        }
        let acts = c.handle(step(2, 2, 0, sparse(vec![0], vec![big])), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::GradientTooLarge));
        let acts = c.handle(step(3, 2, 0, sparse(vec![0], vec![1.0])), t0);
        assert_eq!(replies(&acts).len(), 3);
        assert!(c.params()[0].is_finite() && c.params()[0] < -1e36);
    }

    #[test]
    fn a_failed_update_refuses_its_pushes_and_keeps_the_version() {
        // LARS with tensor segments that do not cover the shard: the fused
        // update cannot run.
        for mode in [SyncMode::Bsp, SyncMode::Asp] {
            let mut s = setup(1, 0.9, mode);
            s.rule.lars_eta = 0.001;
            s.segments = std::iter::once(0..4).collect();
            let t0 = Instant::now();
            let mut c = joined_with(s, CoreSettings::default(), t0);
            c.handle(offer(0, 0, vec![1.0; 8]), t0);
            let dense = WireGrad::Dense(WireValues::F32(vec![1.0; 8]));
            let acts = c.handle(step(1, 0, 0, dense), t0);
            match replies(&acts)[..] {
                [(
                    1,
                    Response::Error {
                        code: ErrorCode::Internal,
                        message,
                    },
                )] => {
                    assert!(
                        message.contains("cannot apply update 1") && message.contains("stays at 0"),
                        "{message}"
                    )
                }
                ref other => panic!("{mode:?}: {other:?}"),
            }
            assert!(!acts.iter().any(|a| matches!(a, Action::Applied { .. })));
            assert_eq!((c.version(), c.params()), (0, &[1.0; 8][..]));
            assert_eq!(c.snapshot().momentum, vec![0.0; 8]);
            assert_eq!((c.stats().failed_updates, c.stats().updates), (1, 0));
            // The step is still open: nothing was counted for it, and the
            // next try meets the same refusal.
            let acts = c.handle(step(2, 0, 0, sparse(vec![0], vec![1.0])), t0);
            assert_eq!(
                code(replies(&acts)[0].1),
                Some(ErrorCode::Internal),
                "{mode:?}"
            );
            assert_eq!((c.version(), c.stats().failed_updates), (0, 2));
        }
    }

    #[test]
    fn ranks_beyond_the_start_count_join_asp_but_not_bsp() {
        for (mode, admitted) in [(SyncMode::Asp, true), (SyncMode::Bsp, false)] {
            let t0 = Instant::now();
            let settings = CoreSettings {
                max_ranks: 3,
                ..CoreSettings::default()
            };
            let mut c = joined_with(setup(2, 0.0, mode), settings, t0);
            for r in 0..2 {
                c.handle(offer(r, 0, vec![0.0; 8]), t0);
            }
            assert!(c.is_serving());
            // Rank 0 trains two steps, then rank 2 joins.
            if mode == SyncMode::Asp {
                for s in 0..2 {
                    c.handle(step(10 + s, 0, s, sparse(vec![0], vec![1.0])), t0);
                }
            }
            c.handle(Event::Joined { rank: 2, conn: 102 }, t0);
            assert_eq!(c.connected_workers(), if admitted { 3 } else { 2 });
            let acts = c.handle(step(20, 2, 0, sparse(vec![3], vec![1.0])), t0);
            let r = replies(&acts);
            if admitted {
                // It starts with the slowest live rank (rank 1, at step 0)
                // and its push is applied at once.
                assert!(
                    matches!(r[..], [(20, Response::Params { next_step: 1, .. })]),
                    "{r:?}"
                );
                assert_eq!(c.stats().updates, 3);
                assert_eq!(c.params()[3], -1.0 / 3.0);
            } else {
                assert_eq!(code(r[0].1), Some(ErrorCode::UnknownWorker), "{r:?}");
                assert_eq!(c.stats().updates, 0);
            }
        }
    }

    #[test]
    fn after_a_resize_asp_ranks_start_at_the_new_split() {
        let t0 = Instant::now();
        let settings = CoreSettings {
            data: DataSplit {
                step: 7,
                samples: 7 * 64,
                world: 2,
                batch: 32,
                seed: 1,
                stable: false,
            },
            ..CoreSettings::default()
        };
        let mut c = joined_with(setup(2, 0.0, SyncMode::Asp), settings, t0);
        for r in 0..2 {
            c.handle(offer(r, 0, vec![0.0; 8]), t0);
        }
        let acts = c.handle(step(1, 0, 7, sparse(vec![0], vec![1.0])), t0);
        assert!(
            matches!(
                replies(&acts)[..],
                [(1, Response::Params { next_step: 8, .. })]
            ),
            "{acts:?}"
        );
        assert_eq!(c.snapshot().data.step, 7);
    }

    #[test]
    fn asp_answers_at_once_and_ssp_bounds_staleness() {
        let (mut c, t0) = serving(2, 0.0, SyncMode::Asp);
        let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![2.0])), t0);
        assert!(matches!(
            replies(&acts)[..],
            [(
                1,
                Response::Params {
                    version: 1,
                    next_step: 1,
                    ..
                }
            )]
        ));
        let (mut c, t0) = serving_with(ssp(2, 1));
        assert_eq!(
            replies(&c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0)).len(),
            1,
            "step 1 is within the bound"
        );
        assert!(
            replies(&c.handle(step(2, 0, 1, sparse(vec![0], vec![1.0])), t0)).is_empty(),
            "step 2 would be 2 ahead"
        );
        let acts = c.handle(step(3, 1, 0, sparse(vec![1], vec![1.0])), t0);
        assert_eq!(
            replies(&acts).len(),
            2,
            "rank 1 catching up releases rank 0"
        );
        // A departed slow worker does not hold the others back.
        let (mut c, t0) = serving_with(ssp(2, 0));
        assert!(replies(&c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0)).is_empty());
        assert_eq!(
            replies(&c.handle(
                Event::Left {
                    rank: 1,
                    conn: Some(101)
                },
                t0
            ))
            .len(),
            1
        );
    }

    #[test]
    fn checkpoints_are_due_every_n_updates_and_on_shutdown() {
        let t0 = Instant::now();
        let settings = CoreSettings {
            checkpoint_every: 2,
            ..CoreSettings::default()
        };
        let mut c = joined(1, settings, t0);
        c.handle(offer(0, 0, vec![0.0; 8]), t0);
        let mut written = vec![];
        for s in 0..5 {
            for a in c.handle(step(s, 0, s, sparse(vec![0], vec![1.0])), t0) {
                if let Action::Checkpoint(ck) = a {
                    written.push(ck.version);
                    c.handle(
                        Event::CheckpointDone {
                            version: ck.version,
                            ok: true,
                        },
                        t0,
                    );
                }
            }
        }
        assert_eq!(written, vec![2, 4]);
        let acts = c.handle(Event::Shutdown, t0);
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Checkpoint(ck) if ck.version == 5)));
        assert!(c.checkpoint_outstanding());
        c.handle(
            Event::CheckpointDone {
                version: 5,
                ok: true,
            },
            t0,
        );
        assert!(!c.checkpoint_outstanding());
    }

    #[test]
    fn the_final_checkpoint_waits_for_the_write_under_way() {
        let t0 = Instant::now();
        let settings = CoreSettings {
            checkpoint_every: 2,
            ..CoreSettings::default()
        };
        let mut c = joined(1, settings, t0);
        c.handle(offer(0, 0, vec![0.0; 8]), t0);
        let checkpoints = |acts: &[Action]| {
            acts.iter()
                .filter_map(|a| match a {
                    Action::Checkpoint(ck) => Some(ck.version),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let mut due = vec![];
        for s in 0..3 {
            due.extend(checkpoints(
                &c.handle(step(s, 0, s, sparse(vec![0], vec![1.0])), t0),
            ));
        }
        // The write of version 2 is under way when the server stops at 3.
        assert_eq!(due, vec![2]);
        assert!(checkpoints(&c.handle(Event::Shutdown, t0)).is_empty());
        assert!(c.checkpoint_outstanding());
        let acts = c.handle(
            Event::CheckpointDone {
                version: 2,
                ok: true,
            },
            t0,
        );
        assert_eq!(checkpoints(&acts), vec![3]);
        assert!(c.checkpoint_outstanding());
        // A failed final write is not retried: the stop goes on without it.
        let acts = c.handle(
            Event::CheckpointDone {
                version: 3,
                ok: false,
            },
            t0,
        );
        assert!(checkpoints(&acts).is_empty());
        assert!(!c.checkpoint_outstanding());
    }
}

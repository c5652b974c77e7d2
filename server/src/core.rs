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
//! rebuilds each shard from the newest version on which the copies agree,
//! checked against the checkpoint when there is one; the checkpoint supplies
//! the optimizer state. A fresh run is the same case with every copy at
//! version 0.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ps_server::core::{Action, CoreSettings, Event, ShardCore, ShardSetup};
//! use ps_shared::config::{OptimizerSection, SyncMode};
//! use ps_shared::protocol::{Response, WireGrad, WireValues};
//!
//! let rule = OptimizerSection { lr: 0.5, momentum: 0.0, nesterov: false, weight_decay: 0.0, lars_eta: 0.0 };
//! let setup = ShardSetup { shard: 0, lo: 0, hi: 4, segments: std::iter::once(0..4).collect(), rule, workers: 1, mode: SyncMode::Bsp, staleness: 0, global_topk: false };
//! let mut core = ShardCore::new(setup, CoreSettings::default(), None);
//! let now = Instant::now();
//! core.handle(Event::Joined { rank: 0, conn: 7 }, now);
//! // The only worker offers its initial copy: the shard starts from it.
//! let acts = core.handle(Event::Offer { reply: 1, conn: 7, rank: 0, version: 0, next_step: 0, values: vec![1.0; 4] }, now);
//! assert!(matches!(acts[..], [.., Action::Reply { to: 1, .. }]));
//! // One push completes the barrier; the reply carries version 1.
//! let grad = WireGrad::Sparse { indices: vec![2], values: WireValues::F32(vec![2.0]) };
//! let acts = core.handle(Event::Step { reply: 2, conn: 7, rank: 0, step: 0, have_version: Some(0), grad }, now);
//! assert!(acts.iter().any(|a| matches!(a, Action::Reply { to: 2, response: Response::Params { version: 1, .. } })));
//! assert_eq!(core.params(), &[1.0, 1.0, 0.0, 1.0]);
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::Hasher;
use std::time::{Duration, Instant};

use ps_shared::config::{GradNormPolicy, OptimizerSection, SyncMode};
use ps_shared::protocol::{ErrorCode, ParamUpdate, Response, WireGrad, WireValues};

use ps_shared::sparse::{topk_exact, SparseGrad};

use crate::checkpoint::{DataSplit, ShardCheckpoint};
use crate::optimizer::fused_update_timed;

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
    /// What to do with a push above `max_grad_norm`: scale it down to the
    /// bound, or refuse it with `GradientTooLarge`.
    pub norm_policy: GradNormPolicy,
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
    Reply {
        to: ReplyId,
        response: Response,
    },
    /// Write this snapshot (at most one write is outstanding).
    Checkpoint(ShardCheckpoint),
    /// An update was applied, touching `entries` parameters (all of them
    /// when the update was dense).
    Applied {
        version: u64,
        entries: usize,
    },
    /// The shard decided where it starts from.
    Recovered(RecoveryReport),
    /// The request's connection closed while its reply was parked: release
    /// the reply slot without answering (nobody is left to read it).
    Forget {
        to: ReplyId,
    },
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
    /// The newest version anyone (a worker or the checkpoint) held.
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
    pub clipped: u64,
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
}

fn refusal(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::error(code, message)
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
        let rule = setup.rule;
        let moves_untouched = rule.moves_untouched();
        Self {
            params: Vec::new(),
            momentum: if rule.uses_momentum() {
                vec![0.0; len]
            } else {
                Vec::new()
            },
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
    /// recovery window since the first offer has passed.
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
        let Some(rec) = self.recovery.take() else {
            return;
        };
        let report = self.decide(rec);
        tracing::info!(shard = self.id(), ?report, "shard starts");
        self.recovered = Some(report.clone());
        out.push(Action::Recovered(report));
        self.release(out);
    }

    /// The newest version on which the offered copies agree wins; the
    /// checkpoint wins when it is newer, and supplies the optimizer state.
    fn decide(&mut self, rec: Recovery) -> RecoveryReport {
        let Recovery {
            mut offers,
            checkpoint,
            ..
        } = rec;
        let offers_n = offers.len();
        // Group copies by (version, checksum), newest first; within a
        // version, the largest group, then the lowest rank.
        let mut groups: BTreeMap<(u64, u64), Vec<u32>> = BTreeMap::new();
        for o in &offers {
            groups
                .entry((o.version, o.checksum))
                .or_default()
                .push(o.rank);
        }
        let mut versions: Vec<u64> = groups.keys().map(|(v, _)| *v).collect();
        versions.dedup();
        versions.sort_unstable_by(|a, b| b.cmp(a));
        let group_at = |v: u64| {
            groups
                .iter()
                .filter(|((gv, _), _)| *gv == v)
                .map(|((_, sum), ranks)| {
                    (*sum, ranks.len(), ranks.iter().min().copied().unwrap_or(0))
                })
                .collect::<Vec<_>>()
        };
        // Newest version whose copies all agree; if none agrees anywhere, the
        // largest group at the newest version.
        let consistent = versions.iter().copied().find(|v| group_at(*v).len() == 1);
        let (chosen_version, chosen_sum) = match consistent {
            Some(v) => (v, group_at(v)[0].0),
            None => {
                let v = versions[0];
                let mut g = group_at(v);
                g.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
                (v, g[0].0)
            }
        };
        let agreeing = offers
            .iter()
            .filter(|o| o.version == chosen_version && o.checksum == chosen_sum)
            .count();
        let conflicting = offers
            .iter()
            .filter(|o| o.version == chosen_version && o.checksum != chosen_sum)
            .count();
        let newest_offer = versions[0];
        let pos = offers
            .iter()
            .position(|o| o.version == chosen_version && o.checksum == chosen_sum)
            .unwrap_or(0);
        let chosen = offers.swap_remove(pos);
        for o in offers.iter().chain(std::iter::once(&chosen)) {
            let c = self.clocks.entry(o.rank).or_insert(0);
            *c = (*c).max(o.next_step);
        }
        let mut report = RecoveryReport {
            shard: self.id(),
            source: RecoverySource::Workers,
            version: chosen_version,
            offers: offers_n,
            agreeing,
            conflicting,
            newest_known: newest_offer,
            updates_lost: 0,
            checkpoint_version: None,
            checkpoint_mismatch: false,
            momentum_updates_lost: 0,
        };
        self.params = chosen.values;
        self.version = chosen_version;
        if let Some(ckpt) = checkpoint {
            report.checkpoint_version = Some(ckpt.version);
            report.newest_known = report.newest_known.max(ckpt.version);
            for (w, c) in &ckpt.clocks {
                let clock = self.clocks.entry(*w).or_insert(0);
                *clock = (*clock).max(*c);
            }
            if ckpt.version > chosen_version {
                report.source = RecoverySource::Checkpoint;
                report.version = ckpt.version;
                self.params = ckpt.params;
                self.version = ckpt.version;
            } else if ckpt.version == chosen_version && checksum(&ckpt.params) != chosen_sum {
                report.checkpoint_mismatch = true;
                tracing::warn!(
                    shard = self.id(),
                    version = chosen_version,
                    "the checkpoint differs from the workers' agreeing copies; keeping the copies"
                );
            }
            if ckpt.momentum.len() == self.momentum.len() {
                self.momentum = ckpt.momentum;
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
                report.momentum_updates_lost = self.version - ckpt.version.min(self.version);
            }
        } else {
            if !self.momentum.is_empty() {
                report.momentum_updates_lost = self.version;
            }
            if self.version == 0 {
                report.source = RecoverySource::Fresh;
            }
        }
        report.updates_lost = report.newest_known - self.version;
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
    fn check_push(&mut self, grad: WireGrad) -> Result<WireGrad, Response> {
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
        let bound = self.settings.max_grad_norm;
        if bound <= 0.0 {
            return Ok(grad);
        }
        let norm = match values {
            WireValues::F32(v) => v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt(),
            WireValues::F16(v) => ps_shared::sparse::values_from_f16(v)
                .iter()
                .map(|x| f64::from(*x).powi(2))
                .sum::<f64>()
                .sqrt(),
        };
        if norm <= f64::from(bound) {
            return Ok(grad);
        }
        match self.settings.norm_policy {
            GradNormPolicy::Refuse => Err(refusal(
                ErrorCode::GradientTooLarge,
                format!("gradient norm {norm:.3e} exceeds server.max_grad_norm = {bound}"),
            )),
            GradNormPolicy::Clip => {
                self.stats.clipped += 1;
                let scale = (f64::from(bound) / norm) as f32;
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
                self.counted.insert(rank, step);
                *self.clocks.entry(rank).or_insert(0) += 1;
                let scale = 1.0 / self.live.len().max(1) as f32;
                self.apply(scale, out);
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
        self.apply(scale, out);
        true
    }

    fn apply(&mut self, scale: f32, out: &mut Vec<Action>) {
        let sparse = !self.all_touched && !self.moves_untouched;
        let entries;
        if sparse {
            // Plain SGD on the pushed entries only: O(k), not O(P).
            let changed = if self.setup.global_topk {
                self.select_global_topk(scale)
            } else {
                let step = self.setup.rule.lr * scale;
                self.touched.sort_unstable();
                for &i in &self.touched {
                    let i = i as usize;
                    self.params[i] -= step * self.agg[i];
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
            match fused_update_timed(
                &mut self.params,
                &self.agg,
                &mut self.momentum,
                &self.setup.segments,
                &self.setup.rule,
                scale,
            ) {
                Ok(cpu) => self.stats.update_pool_cpu += cpu,
                Err(e) => tracing::error!(shard = self.id(), "update failed: {e}"),
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
        self.version += 1;
        self.stats.updates += 1;
        out.push(Action::Applied {
            version: self.version,
            entries,
        });
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
        let lr = self.setup.rule.lr;
        for &i in &chosen {
            let i = i as usize;
            self.params[i] -= lr * self.residual[i];
            self.residual[i] = 0.0;
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
    fn params_reply(&self, rank: u32, have: Option<u64>) -> Response {
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

    fn reply_with(&self, rank: u32, update: ParamUpdate) -> Response {
        Response::Params {
            shard: self.id(),
            version: self.version,
            next_step: self.next_step(rank),
            live_workers: self.connected_workers() as u32,
            update,
        }
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
        // BSP all of them): the delta from each version is built once and
        // copied, so a step costs one union of the changes, not one per
        // worker.
        let mut built: Vec<(Option<u64>, ParamUpdate)> = Vec::new();
        for p in parked {
            if self.ready(&p) {
                let have = match p.wait {
                    // An offer of exactly what the shard starts from needs
                    // nothing back.
                    Wait::Serving => p.offered.filter(|&o| Some(o) == held).map(|(v, _)| v),
                    _ => p.have_version,
                };
                let update = match built.iter().find(|(h, _)| *h == have) {
                    Some((_, u)) => u.clone(),
                    None => {
                        let u = self.param_update(have);
                        built.push((have, u.clone()));
                        u
                    }
                };
                out.push(Action::Reply {
                    to: p.reply,
                    response: self.reply_with(p.rank, update),
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
                Action::Reply { to, response } => Some((*to, response)),
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

    #[test]
    fn recovery_takes_the_newest_consistent_copy_and_checks_the_checkpoint() {
        let t0 = Instant::now();
        let ckpt = |version, params: Vec<f32>, momentum: Vec<f32>| ShardCheckpoint {
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
        };
        let run = |ck: Option<ShardCheckpoint>, offers: Vec<(u32, u64, f32)>, momentum: f32| {
            let mut c = ShardCore::new(
                setup(3, momentum, SyncMode::Bsp),
                CoreSettings::default(),
                ck,
            );
            for (rank, _, _) in &offers {
                c.handle(
                    Event::Joined {
                        rank: *rank,
                        conn: 100 + u64::from(*rank),
                    },
                    t0,
                );
            }
            let mut report = None;
            for (rank, version, value) in offers {
                for a in c.handle(offer(rank, version, vec![value; 8]), t0) {
                    if let Action::Recovered(r) = a {
                        report = Some(r);
                    }
                }
            }
            let report = report.or_else(|| {
                c.handle(Event::Tick, t0 + Duration::from_secs(60))
                    .into_iter()
                    .find_map(|a| match a {
                        Action::Recovered(r) => Some(r),
                        _ => None,
                    })
            });
            (c, report.expect("decided"))
        };
        // The server died after replying to two of three workers: version 8 wins, 0 lost.
        let (c, r) = run(None, vec![(0, 8, 8.0), (1, 8, 8.0), (2, 7, 7.0)], 0.0);
        assert_eq!(
            (r.source, r.version, r.agreeing, r.updates_lost),
            (RecoverySource::Workers, 8, 2, 0)
        );
        assert_eq!(c.params(), &[8.0; 8]);
        assert_eq!(c.version(), 8);
        // Copies at the newest version disagree: the newest consistent one wins.
        let (c, r) = run(None, vec![(0, 9, 1.0), (1, 9, 2.0), (2, 8, 8.0)], 0.0);
        assert_eq!((r.version, r.updates_lost), (8, 1));
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

//! `ShardActor`: the actix actor that drives one [`ShardCore`].
//!
//! The actor holds no policy. It numbers incoming requests, feeds them to the
//! core with the current time, and carries out the core's actions: it sends
//! replies through the requests' one-shot channels, writes checkpoints to the
//! object store, and publishes the shard's version for whoever waits on it.
//! A timer feeds the core `Tick`s so deadlines and the recovery window pass
//! even when no request arrives. Each actor runs on its own arbiter (thread),
//! so shards aggregate and update in parallel.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use object_store::{path::Path as ObjectPath, ObjectStore};
use tokio::sync::{oneshot, watch};

use ps_net::protocol::{encode_response_frame, EncodedFrame, ErrorCode, Response, WireGrad};

use crate::checkpoint::{save, ShardCheckpoint};
use crate::core::{
    Action, ConnId, CoreStats, Event, RecoveryReport, ReplyId, ShardCore, ShardMemory,
};
use crate::observe::ShardSeries;
use crate::optimizer::thread_cpu_time;

/// Where a shard checkpoints.
#[derive(Clone)]
pub struct CheckpointTarget {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: ObjectPath,
}

pub struct ShardActor {
    core: ShardCore,
    replies: HashMap<ReplyId, oneshot::Sender<Reply>>,
    next_reply: ReplyId,
    checkpoints: Option<CheckpointTarget>,
    tick: Duration,
    version: watch::Sender<u64>,
    /// Reply slots in use (requests waiting for their reply).
    waiting: watch::Sender<usize>,
    /// CPU time of this thread in the core (requests, aggregation, replies,
    /// sparse updates; a dense update's pool work is counted by the core).
    cpu: Duration,
    /// Version of the last checkpoint this actor wrote.
    last_written: Option<u64>,
    /// `Shutdown`s waiting for the checkpoint writes to end.
    stop_waiters: Vec<oneshot::Sender<Option<u64>>>,
    /// Checkpoint writes that failed, in all and since the last success.
    checkpoint_failures: u64,
    failures_in_a_row: u32,
    /// Whether a write failed after `Shutdown` (the final checkpoint).
    final_checkpoint_failed: bool,
    /// Failed writes in a row allowed before `give_up` is called.
    max_failures: u32,
    /// Stops the server with the message (see [`Self::with_checkpoint_limit`]).
    give_up: Option<GiveUp>,
    /// The shard's Prometheus series.
    series: ShardSeries,
    /// Bytes of the reply archives this shard encoded.
    encoded: u64,
}

/// What a shard calls when its checkpoints keep failing: stops the server
/// with the message.
pub type GiveUp = Box<dyn Fn(String) + Send>;

impl ShardActor {
    pub fn new(
        core: ShardCore,
        checkpoints: Option<CheckpointTarget>,
        tick: Duration,
        version: watch::Sender<u64>,
        waiting: watch::Sender<usize>,
    ) -> Self {
        Self {
            series: ShardSeries::new(core.id()),
            core,
            replies: HashMap::new(),
            next_reply: 0,
            checkpoints,
            tick,
            version,
            waiting,
            cpu: Duration::ZERO,
            last_written: None,
            stop_waiters: Vec::new(),
            checkpoint_failures: 0,
            failures_in_a_row: 0,
            final_checkpoint_failed: false,
            max_failures: u32::MAX,
            give_up: None,
            encoded: 0,
        }
    }

    /// Once more than `max_failures` checkpoint writes in a row have failed
    /// (`server.checkpoint_max_failures`), call `give_up` with a message
    /// that names the shard, the count and the last error: a checkpoint
    /// location that cannot be written must not let a run end as if it
    /// had been saved.
    pub fn with_checkpoint_limit(mut self, max_failures: u32, give_up: GiveUp) -> Self {
        self.max_failures = max_failures;
        self.give_up = Some(give_up);
        self
    }

    /// A checkpoint write failed: count it, and past the limit give up.
    fn checkpoint_failed(&mut self, shard: u32, version: u64, error: String) {
        self.checkpoint_failures += 1;
        self.failures_in_a_row = self.failures_in_a_row.saturating_add(1);
        // A `Shutdown` waits for this write: it was the final checkpoint
        // (or the write before it, which the final one follows).
        if !self.stop_waiters.is_empty() {
            self.final_checkpoint_failed = true;
        }
        tracing::error!(
            shard,
            version,
            failed = self.checkpoint_failures,
            in_a_row = self.failures_in_a_row,
            limit = self.max_failures,
            "checkpoint failed: {error}"
        );
        if self.failures_in_a_row > self.max_failures {
            if let Some(give_up) = &self.give_up {
                give_up(format!(
                    "shard {shard}: {} checkpoint writes in a row failed, more than server.checkpoint_max_failures = {} (last, version {version}: {error})",
                    self.failures_in_a_row, self.max_failures
                ));
            }
        }
    }

    fn feed(&mut self, event: Event, ctx: &mut Context<Self>) {
        let before = self.core.stats();
        let t0 = thread_cpu_time();
        let actions = self.core.handle(event, Instant::now());
        let replies = self.encode_replies(actions);
        let encoded: u64 = {
            let mut seen: Vec<*const u8> = Vec::new();
            replies
                .iter()
                .filter_map(|(_, r)| r.as_ref())
                .filter(|r| {
                    let at = r.frame.payload().as_ptr();
                    let new = !seen.contains(&at);
                    seen.push(at);
                    new
                })
                .map(|r| r.frame.payload().len() as u64)
                .sum()
        };
        self.encoded += encoded;
        self.series.encoded(encoded);
        self.cpu += thread_cpu_time().saturating_sub(t0);
        self.series.core_moved(&before, &self.core.stats());
        self.carry_out(replies, ctx);
    }

    /// Encode each distinct reply once: the replies of one BSP step share
    /// their response, and so their frame.
    fn encode_replies(&self, actions: Vec<Action>) -> Vec<(Action, Option<Reply>)> {
        let mut frames: Vec<(*const Response, Reply)> = Vec::new();
        actions
            .into_iter()
            .map(|action| {
                let reply = match &action {
                    Action::Reply { response, .. } => {
                        let key = Arc::as_ptr(response);
                        Some(match frames.iter().find(|(k, _)| *k == key) {
                            Some((_, r)) => r.clone(),
                            None => {
                                let r = Reply::shared(response.clone());
                                frames.push((key, r.clone()));
                                r
                            }
                        })
                    }
                    _ => None,
                };
                (action, reply)
            })
            .collect()
    }

    fn carry_out(&mut self, actions: Vec<(Action, Option<Reply>)>, ctx: &mut Context<Self>) {
        for (action, reply) in actions {
            match action {
                Action::Reply { to, .. } => {
                    if let (Some(tx), Some(reply)) = (self.replies.remove(&to), reply) {
                        let _ = tx.send(reply);
                    }
                }
                Action::Applied { version, entries } => {
                    self.series.applied(version, entries);
                    self.version.send_replace(version);
                }
                Action::Recovered(report) => {
                    self.version.send_replace(report.version);
                }
                Action::Checkpoint(snapshot) => self.spawn_checkpoint(snapshot, ctx),
                Action::Forget { to } => {
                    // Dropping the sender ends whoever still waits on it.
                    self.replies.remove(&to);
                }
            }
        }
        // Slots whose receivers are gone (their request task ended) go too.
        self.replies.retain(|_, tx| !tx.is_closed());
        let waiting = self.replies.len();
        self.series.parked(waiting);
        self.waiting
            .send_if_modified(|n| std::mem::replace(n, waiting) != waiting);
    }

    fn spawn_checkpoint(&mut self, snapshot: ShardCheckpoint, ctx: &mut Context<Self>) {
        let version = snapshot.version;
        let Some(target) = self.checkpoints.clone() else {
            self.feed(Event::CheckpointDone { version, ok: true }, ctx);
            return;
        };
        let shard = snapshot.shard;
        let started = Instant::now();
        let write = async move { save(&target.store, &target.prefix, &snapshot).await };
        ctx.spawn(write.into_actor(self).map(move |result, actor, ctx| {
            actor.series.checkpoint(result.is_ok(), started.elapsed());
            let ok = match result {
                Ok(()) => {
                    tracing::info!(shard, version, "checkpoint published");
                    actor.last_written = Some(version);
                    actor.failures_in_a_row = 0;
                    // The write a `Shutdown` waits for succeeded.
                    if !actor.stop_waiters.is_empty() {
                        actor.final_checkpoint_failed = false;
                    }
                    true
                }
                Err(e) => {
                    actor.checkpoint_failed(shard, version, e.to_string());
                    false
                }
            };
            actor.feed(Event::CheckpointDone { version, ok }, ctx);
            actor.answer_stop_waiters();
        }));
    }

    /// Answer the `Shutdown`s once no checkpoint write is outstanding: with
    /// the version of the last checkpoint written when it holds the state
    /// the shard stopped in, else `None`.
    fn answer_stop_waiters(&mut self) {
        if self.stop_waiters.is_empty() || self.core.checkpoint_outstanding() {
            return;
        }
        let saved = self.last_written.filter(|v| *v == self.core.version());
        for tx in self.stop_waiters.drain(..) {
            let _ = tx.send(saved);
        }
    }
}

impl Actor for ShardActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.tick, |actor, ctx| actor.feed(Event::Tick, ctx));
    }
}

/// A request for this shard from an authenticated connection.
#[derive(Debug)]
pub enum ShardRequest {
    Offer {
        version: u64,
        next_step: u64,
        values: Vec<f32>,
    },
    Step {
        step: u64,
        have_version: Option<u64>,
        /// The worker's measured samples per second (0: not measured).
        rate: f32,
        grad: WireGrad,
    },
    NormTotal {
        step: u64,
        have_version: Option<u64>,
        total: Option<f64>,
    },
    /// Backup workers: the rank's stream is done (make-up round).
    MakeUp { skipped: Vec<u64>, trained: u64 },
}

/// A shard's answer to one request: the response and its encoded frame.
/// Requests answered alike share both (one encoding per distinct reply;
/// every connection writes the same archive, by reference).
#[derive(Debug, Clone)]
pub struct Reply {
    pub response: Arc<Response>,
    pub frame: EncodedFrame,
}

impl Reply {
    /// A reply of its own (a refusal made outside a shard, say).
    pub fn new(response: Response) -> Self {
        Self::shared(Arc::new(response))
    }

    /// Encode `response` once for every request it answers.
    pub fn shared(response: Arc<Response>) -> Self {
        let frame = encode_response_frame(&response).unwrap_or_else(|e| {
            // Only a message beyond the format's limits fails to encode:
            // the worker is told so rather than left waiting.
            let refusal = Response::error(ErrorCode::Internal, format!("cannot encode reply: {e}"));
            encode_response_frame(&refusal).expect("a short refusal encodes")
        });
        Self { response, frame }
    }
}

/// Deliver a request; the receiver resolves with the reply (it closes
/// without one when the connection closed first).
#[derive(Message)]
#[rtype(result = "oneshot::Receiver<Reply>")]
pub struct Deliver {
    pub conn: ConnId,
    pub rank: u32,
    pub request: ShardRequest,
}

impl Handler<Deliver> for ShardActor {
    type Result = MessageResult<Deliver>;
    fn handle(&mut self, msg: Deliver, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let reply = self.next_reply;
        self.next_reply += 1;
        self.replies.insert(reply, tx);
        let Deliver {
            conn,
            rank,
            request,
        } = msg;
        let event = match request {
            ShardRequest::Offer {
                version,
                next_step,
                values,
            } => Event::Offer {
                reply,
                conn,
                rank,
                version,
                next_step,
                values,
            },
            ShardRequest::Step {
                step,
                have_version,
                rate,
                grad,
            } => Event::Step {
                reply,
                conn,
                rank,
                step,
                have_version,
                rate,
                grad,
            },
            ShardRequest::NormTotal {
                step,
                have_version,
                total,
            } => Event::NormTotal {
                reply,
                conn,
                rank,
                step,
                have_version,
                total,
            },
            ShardRequest::MakeUp { skipped, trained } => Event::MakeUp {
                reply,
                conn,
                rank,
                skipped,
                trained,
            },
        };
        self.feed(event, ctx);
        MessageResult(rx)
    }
}

/// Membership news for the shard.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub enum MemberNews {
    Joined { rank: u32, conn: ConnId },
    Left { rank: u32, conn: Option<ConnId> },
    ConnClosed { conn: ConnId },
}

impl Handler<MemberNews> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: MemberNews, ctx: &mut Context<Self>) {
        let event = match msg {
            MemberNews::Joined { rank, conn } => Event::Joined { rank, conn },
            MemberNews::Left { rank, conn } => Event::Left { rank, conn },
            MemberNews::ConnClosed { conn } => Event::ConnClosed { conn },
        };
        self.feed(event, ctx);
    }
}

/// Stop serving: answer what waits and write a final checkpoint (when
/// checkpoints are configured). Resolves once no checkpoint write is under
/// way, with the version of the final checkpoint (`None` without
/// checkpoints, or when the write failed).
#[derive(Message)]
#[rtype(result = "Option<u64>")]
pub struct Shutdown;

impl Handler<Shutdown> for ShardActor {
    type Result = ResponseFuture<Option<u64>>;
    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.stop_waiters.push(tx);
        // The replies and the checkpoint go the way of every other event.
        self.feed(Event::Shutdown, ctx);
        self.answer_stop_waiters();
        Box::pin(async move { rx.await.ok().flatten() })
    }
}

/// A snapshot of the shard for status, tests and benchmarks.
#[derive(Debug, Clone)]
pub struct ShardStatus {
    pub shard: u32,
    pub version: u64,
    pub serving: bool,
    pub params: Vec<f32>,
    pub stats: CoreStats,
    /// Replies the core holds back (a barrier, the staleness bound, a
    /// starting shard).
    pub parked: usize,
    /// Requests the actor holds a reply slot for; equal to `parked` between
    /// messages, unless a slot leaked.
    pub waiting_replies: usize,
    /// CPU time the shard used: its own thread in the core (requests,
    /// aggregation, replies, sparse updates, timers) plus the work of its
    /// dense updates on the rayon pool (`stats.update_pool_cpu`).
    pub cpu: Duration,
    pub recovery: Option<RecoveryReport>,
    /// Checkpoint writes that failed over the shard's life.
    pub checkpoint_failures: u64,
}

#[derive(Message)]
#[rtype(result = "ShardStatus")]
pub struct GetStatus;

impl Handler<GetStatus> for ShardActor {
    type Result = MessageResult<GetStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        MessageResult(ShardStatus {
            shard: self.core.id(),
            version: self.core.version(),
            serving: self.core.is_serving(),
            params: self.core.params().to_vec(),
            stats: self.core.stats(),
            parked: self.core.parked(),
            waiting_replies: self.replies.len(),
            cpu: self.cpu + self.core.stats().update_pool_cpu,
            recovery: self.core.recovery_report().cloned(),
            checkpoint_failures: self.checkpoint_failures,
        })
    }
}

/// The shard's counters, CPU time and buffer sizes, without a copy of its
/// parameters (cheap enough to ask for between benchmark steps).
#[derive(Debug, Clone, Copy)]
pub struct ShardCounters {
    pub shard: u32,
    pub version: u64,
    pub stats: CoreStats,
    /// As [`ShardStatus::cpu`].
    pub cpu: Duration,
    pub memory: ShardMemory,
    /// Checkpoint writes that failed over the shard's life.
    pub checkpoint_failures: u64,
    /// Whether the final checkpoint (after `Shutdown`) failed.
    pub final_checkpoint_failed: bool,
    /// Bytes of the reply archives the shard encoded (each distinct reply
    /// once, however many workers it answers).
    pub encoded_bytes: u64,
}

#[derive(Message)]
#[rtype(result = "ShardCounters")]
pub struct GetCounters;

impl Handler<GetCounters> for ShardActor {
    type Result = MessageResult<GetCounters>;
    fn handle(&mut self, _: GetCounters, _: &mut Context<Self>) -> Self::Result {
        MessageResult(ShardCounters {
            shard: self.core.id(),
            version: self.core.version(),
            stats: self.core.stats(),
            cpu: self.cpu + self.core.stats().update_pool_cpu,
            memory: self.core.memory(),
            checkpoint_failures: self.checkpoint_failures,
            final_checkpoint_failed: self.final_checkpoint_failed,
            encoded_bytes: self.encoded,
        })
    }
}

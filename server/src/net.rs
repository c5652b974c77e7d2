//! A ps-server process: a QUIC endpoint in front of this process's shard
//! actors. This module only moves bytes: it accepts connections, reads and
//! decodes frames under size limits and deadlines, feeds the
//! [`Membership`] and [`crate::core::ShardCore`] state machines, and writes
//! what they answer. Every policy lives in those two.
//!
//! Connections, TLS and decoding run on a multi-threaded tokio runtime of
//! `server.io_threads` threads, so shards never queue behind one another's
//! I/O; each shard actor runs on an arbiter of its own.
//!
//! A connection must present a client certificate issued by the cluster CA
//! (the rank is read from it), finish TLS and send a Hello of at most
//! [`MAX_HELLO_BYTES`] within `server.hello_timeout_secs`; after that every
//! stream carries one request and its reply.
//!
//! Admission: a first packet from an address not yet validated is answered
//! with a stateless QUIC Retry, so no handshake state exists for a source
//! that cannot receive at its address. [`Membership`] then admits the
//! connection (evicting the oldest one not yet past Hello when a cap is
//! reached). Until Hello a connection may open one stream with
//! [`transport::PRE_HELLO_RECEIVE_WINDOW`] bytes in flight; after it the
//! windows open ([`transport::open_after_hello`]) and the request frames
//! being read on the connection are held to a [`FrameBudget`] of
//! [`frame_budget_bytes`], each read stalling at most
//! `server.idle_timeout_secs`.
//!
//! ```no_run
//! # async fn demo(tls: ps_server::net::ServerTls) -> anyhow::Result<()> {
//! use ps_shared::config::ClusterConfig;
//! let cfg = ClusterConfig::embedded_default()?;
//! let server = ps_server::net::start(&cfg, 0, "127.0.0.1:0".parse()?, &tls).await?;
//! println!("listening on {}", server.local_addr());
//! server.wait().await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use actix::prelude::*;
use quinn::{Connection, Endpoint, Incoming, RecvStream, SendStream};
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use ps_net::local::{self, KEY_BYTES};
use ps_net::protocol::{
    close, decode_request, encode_response_frame, request_vector_bytes, Copied, ErrorCode,
    LocalPath, Request, Response, ShardRange, MAX_HELLO_BYTES,
};
use ps_net::transport::{
    self, read_frame, read_frame_budgeted, write_encoded, EndpointLimits, FrameBudget,
    TransportError,
};
use ps_shared::bucket::open_bucket;
use ps_shared::config::{Balance, ClusterConfig, SyncMode};
use ps_shared::sampler::Partition;
use ps_shared::shard::ShardMap;

use crate::actor::{
    CheckpointTarget, Deliver, GetCounters, GetStatus, MemberNews, Reply, ShardActor, ShardRequest,
    ShardStatus, Shutdown,
};
use crate::checkpoint::{load_latest, CheckpointError, DataSplit};
use crate::core::{Balancer, ConnId, CoreSettings, ShardCore, ShardSetup};
use crate::membership::{Hello, MemberAction, Membership, MembershipSettings};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("server index {index} is not in cluster.servers (which lists {count})")]
    BadIndex { index: usize, count: usize },
    #[error("cannot split the parameter space: {0}")]
    Shards(String),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("cannot open checkpoint store {url}: {message}")]
    CheckpointStore { url: String, message: String },
    #[error("checkpoint of shard {shard} does not fit: {message}")]
    Restore { shard: usize, message: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the I/O runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot open the same-host socket in {dir} (set TMPDIR, or cluster.local_path = false): {source}")]
    LocalSocket { dir: String, source: std::io::Error },
}

/// TLS material of a server: its certificate and key, and the cluster CA
/// that client certificates must chain to.
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

/// Why a server stopped with an error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ServerExit {
    pub message: String,
    /// A worker stopped the job (`Request::Abort`): the state is sound
    /// (final checkpoints are written), the data is not.
    pub job_stopped: bool,
}

impl ServerExit {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            job_stopped: false,
        }
    }
}

/// State shared by the connection tasks.
struct Ctx {
    index: u32,
    workers: u32,
    /// Where the sample stream stands (sent in every Welcome).
    data: DataSplit,
    max_frame: usize,
    request_timeout: Duration,
    hello_timeout: Duration,
    /// Longest wait for the next byte of a frame being read.
    stall: Duration,
    /// Bytes of request frames one connection may hold at once.
    frame_budget: usize,
    limits: EndpointLimits,
    shards: HashMap<u32, Addr<ShardActor>>,
    welcome: Vec<ShardRange>,
    membership: Mutex<Membership>,
    conns: Mutex<HashMap<ConnId, Connection>>,
    /// Connections not yet past Hello: how to evict each.
    pending: Mutex<HashMap<ConnId, oneshot::Sender<String>>>,
    /// (open connections, those not yet past Hello), after every change.
    counts: watch::Sender<(usize, usize)>,
    next_conn: AtomicU64,
    outcome: watch::Sender<Option<Result<(), ServerExit>>>,
    /// Set once a rank stopped the job (`Request::Abort`): every later step
    /// and offer is refused with it, and the server exits once the last
    /// connection is gone.
    job_stopped: Mutex<Option<String>>,
    /// Set once a rank reached the run's target (`Request::Finish`): every
    /// later step and offer is answered with it, and those ranks stop
    /// cleanly.
    job_done: Mutex<Option<String>>,
    /// Bytes of requests read and decoded (the shards count their replies).
    copied: Mutex<Copied>,
    /// The same-host socket's path, when `cluster.local_path` is on.
    local_path: Option<String>,
    /// The keys handed out in Welcomes, each admitting its connection's
    /// requests through the socket until that connection closes.
    grants: Mutex<HashMap<[u8; KEY_BYTES], Grant>>,
    /// Requests served through the socket.
    local_served: AtomicU64,
}

/// What a same-host key stands for: the connection it was handed out on.
#[derive(Clone)]
struct Grant {
    conn: ConnId,
    rank: u32,
    /// The connection's frame budget, shared by both paths.
    budget: FrameBudget,
}

impl Ctx {
    fn membership(&self) -> MutexGuard<'_, Membership> {
        self.membership.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<ConnId, Connection>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<ConnId, oneshot::Sender<String>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publish the connection counts (after membership changed them).
    fn publish_counts(&self) {
        let (counts, live) = {
            let m = self.membership();
            (m.connections(), m.live().len())
        };
        crate::observe::membership(self.index as usize, counts, live);
        self.counts
            .send_if_modified(|c| std::mem::replace(c, counts) != counts);
    }

    fn broadcast(&self, news: MemberNews) {
        for addr in self.shards.values() {
            addr.do_send(news.clone());
        }
    }

    /// Carry out what membership decided.
    fn apply(&self, actions: Vec<MemberAction>) {
        for action in actions {
            match action {
                MemberAction::Joined { rank, conn } => {
                    tracing::info!(rank, conn, "worker joined");
                    self.broadcast(MemberNews::Joined { rank, conn });
                }
                MemberAction::Left { rank, conn, why } => {
                    if why == "finished" || why == "stopped" {
                        tracing::info!(rank, "worker finished");
                    } else {
                        tracing::warn!(rank, "worker left the barrier: {why}");
                    }
                    self.broadcast(MemberNews::Left { rank, conn });
                }
                MemberAction::Close { conn, why } => {
                    if let Some(c) = self.conns().get(&conn) {
                        c.close(close::EVICTED.into(), why.as_bytes());
                    } else if let Some(evict) = self.pending().remove(&conn) {
                        // Before Hello: its task closes it.
                        let _ = evict.send(why);
                    }
                }
                MemberAction::Exit { ok, message } => {
                    if ok {
                        tracing::info!("{message}; shutting down");
                    } else {
                        tracing::error!("{message}; shutting down");
                    }
                    let outcome = if ok {
                        Ok(())
                    } else {
                        Err(ServerExit::new(message))
                    };
                    self.outcome.send_replace(Some(outcome));
                }
            }
        }
    }

    fn grants(&self) -> MutexGuard<'_, HashMap<[u8; KEY_BYTES], Grant>> {
        self.grants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The same-host path for a connection past Hello, when its peer is on
    /// this host: a fresh key for it, good until the connection closes.
    fn offer_local(&self, conn: &Connection, grant: Grant) -> Option<LocalPath> {
        let path = self.local_path.as_ref()?;
        if !local::same_host(conn.remote_address().ip(), conn.local_ip()) {
            return None;
        }
        let key: [u8; KEY_BYTES] = rand::random();
        self.grants().insert(key, grant);
        Some(LocalPath {
            path: path.clone(),
            key,
        })
    }

    fn closed(&self, conn: ConnId, why: &str) {
        self.pending().remove(&conn);
        self.grants().retain(|_, g| g.conn != conn);
        let none_left = {
            let mut conns = self.conns();
            conns.remove(&conn);
            conns.is_empty()
        };
        let actions = self
            .membership()
            .connection_closed(conn, why, Instant::now());
        self.publish_counts();
        self.broadcast(MemberNews::ConnClosed { conn });
        self.apply(actions);
        if none_left {
            if let Some(message) = self.job_stop() {
                // Every rank has heard: the job ends here.
                fail_once(
                    &self.outcome,
                    ServerExit {
                        message,
                        job_stopped: true,
                    },
                );
            }
        }
    }

    fn job_stop(&self) -> Option<String> {
        lock_note(&self.job_stopped).clone()
    }

    /// Why the job is done, once a rank reached the run's target.
    fn job_done(&self) -> Option<String> {
        lock_note(&self.job_done).clone()
    }

    /// A rank reached the run's target: remember it (the first one wins).
    fn finish_job(&self, rank: u32, reason: &str) {
        lock_note(&self.job_done).get_or_insert_with(|| {
            let message = format!("the job is done: rank {rank} {reason}");
            tracing::info!("{message}");
            message
        });
    }

    /// A rank stopped the job: remember why (the first reason wins).
    fn stop_job(&self, rank: u32, reason: &str) -> String {
        lock_note(&self.job_stopped)
            .get_or_insert_with(|| {
                let message = format!("the job was stopped by rank {rank}: {reason}");
                tracing::error!("{message}");
                message
            })
            .clone()
    }
}

/// The note of why the job stopped or is done, locked (a poisoned lock
/// still holds a sound note: it is only ever set whole).
fn lock_note(slot: &Mutex<Option<String>>) -> MutexGuard<'_, Option<String>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// Decide that the server stops with `exit`, unless a stop was decided
/// already; returns whether this call decided it.
fn fail_once(outcome: &watch::Sender<Option<Result<(), ServerExit>>>, exit: ServerExit) -> bool {
    outcome.send_if_modified(|o| {
        if o.is_some() {
            return false;
        }
        *o = Some(Err(exit.clone()));
        true
    })
}

/// A running server process.
pub struct RunningServer {
    endpoint: Endpoint,
    local_addr: SocketAddr,
    ctx: Arc<Ctx>,
    outcome: watch::Receiver<Option<Result<(), ServerExit>>>,
    versions: Vec<watch::Receiver<u64>>,
    waiting: HashMap<u32, watch::Receiver<usize>>,
    arbiters: Vec<Arbiter>,
    io: Option<tokio::runtime::Runtime>,
    /// The same-host socket's directory, removed with the server.
    _socket_dir: Option<tempfile::TempDir>,
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        for a in &self.arbiters {
            a.stop();
        }
        if let Some(rt) = self.io.take() {
            rt.shutdown_background();
        }
    }
}

impl RunningServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Resolves when the server decides to stop: `Ok` once every worker said
    /// goodbye, an error when no worker joined in time or every worker has
    /// been gone too long. Then closes the endpoint and stops the shards.
    pub async fn wait(mut self) -> Result<(), ServerExit> {
        let mut outcome = match self.outcome.wait_for(|o| o.is_some()).await {
            Ok(o) => o.clone().unwrap_or(Ok(())),
            Err(_) => Err(ServerExit::new("server state dropped")),
        };
        // A stopped job ends in a sound state: keep it, as a completed run
        // does, so a rerun on repaired data resumes from here.
        if outcome.is_ok() || outcome.as_ref().is_err_and(|e| e.job_stopped) {
            let written = self.final_checkpoints().await;
            if outcome.is_ok() {
                outcome = written;
            } else if let Err(e) = written {
                tracing::error!("{e}");
            }
        }
        match &outcome {
            Ok(()) => {
                // Let the last replies leave: workers close after their goodbye.
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), self.endpoint.wait_idle()).await;
                self.endpoint.close(close::BYE.into(), b"done");
            }
            // Stop serving at once (checkpoints that keep failing must not
            // let training go on unsaved): workers still training see the
            // server gone.
            Err(e) => self
                .endpoint
                .close(close::ABORTED.into(), e.message.as_bytes()),
        }
        self.teardown().await;
        outcome
    }

    /// Requests served through the same-host socket so far.
    pub fn local_requests(&self) -> u64 {
        self.ctx.local_served.load(Ordering::Relaxed)
    }

    /// Bytes this server copied: requests read and decoded, and the reply
    /// archives its shards encoded (each distinct reply once).
    pub async fn copied(&self) -> Copied {
        let mut all = *self.ctx.copied.lock().unwrap_or_else(|e| e.into_inner());
        for addr in self.ctx.shards.values() {
            if let Ok(c) = addr.send(GetCounters).await {
                all.encoded += c.encoded_bytes;
            }
        }
        all
    }

    /// The run is complete (every worker said goodbye): every shard writes
    /// a final checkpoint of the state it ends in (when checkpoints are
    /// configured), so that a rerun starts from the end and not from the
    /// last periodic checkpoint. A final write that fails is an error.
    async fn final_checkpoints(&self) -> Result<(), ServerExit> {
        let stops = self.ctx.shards.iter().map(|(shard, addr)| async move {
            let saved = addr.send(Shutdown).await.ok().flatten();
            let failed = match addr.send(GetCounters).await {
                Ok(c) => c.final_checkpoint_failed,
                Err(_) => true,
            };
            (*shard, saved, failed)
        });
        let mut ends = futures::future::join_all(stops).await;
        ends.sort_unstable();
        let failed: Vec<u32> = ends.iter().filter(|e| e.2).map(|e| e.0).collect();
        if !failed.is_empty() {
            return Err(ServerExit::new(format!(
                "the final checkpoint of shard(s) {failed:?} could not be written (see the checkpoint errors above); a rerun would resume from an older one"
            )));
        }
        let saved: Vec<(u32, Option<u64>)> = ends.iter().map(|e| (e.0, e.1)).collect();
        if saved.iter().any(|(_, v)| v.is_some()) {
            tracing::info!(?saved, "run complete: final checkpoints written");
        }
        Ok(())
    }

    /// Stop the I/O threads and release the socket before returning, so the
    /// address can be bound again at once.
    async fn teardown(mut self) {
        let io = self.io.take();
        drop(self);
        if let Some(rt) = io {
            let _ =
                tokio::task::spawn_blocking(move || rt.shutdown_timeout(Duration::from_secs(5)))
                    .await;
        }
    }

    /// Resolves once the server has decided to stop (see [`Self::wait`]).
    pub async fn decided(&self) {
        let mut rx = self.outcome.clone();
        let _ = rx.wait_for(|o| o.is_some()).await;
    }

    /// Stop now, as a crash would: no final checkpoint, connections dropped.
    pub async fn abort(self) {
        self.endpoint
            .close(close::ABORTED.into(), b"server stopped");
        self.teardown().await;
    }

    /// Stop cleanly: answer what waits, write a final checkpoint of every
    /// shard (when checkpoints are configured), then close every connection
    /// with the "shutting down" code so workers wait for a restart. Returns
    /// each shard's final checkpoint version, in shard order.
    pub async fn shutdown(self) -> Vec<(u32, Option<u64>)> {
        // Every shard stops changing at once, then each writes its checkpoint.
        let stops =
            self.ctx.shards.iter().map(|(shard, addr)| async move {
                (*shard, addr.send(Shutdown).await.ok().flatten())
            });
        let mut saved = futures::future::join_all(stops).await;
        saved.sort_unstable();
        self.endpoint
            .close(close::SHUTTING_DOWN.into(), b"server shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        self.teardown().await;
        saved
    }

    /// Current state of every local shard.
    pub async fn status(&self) -> Vec<ShardStatus> {
        let mut out = Vec::new();
        for addr in self.ctx.shards.values() {
            if let Ok(s) = addr.send(GetStatus).await {
                out.push(s);
            }
        }
        out.sort_by_key(|s| s.shard);
        out
    }

    /// Wait until every local shard reached `version` (an event, not a poll).
    pub async fn reached(&self, version: u64) {
        for rx in &self.versions {
            let mut rx = rx.clone();
            let _ = rx.wait_for(|v| *v >= version).await;
        }
    }

    /// Wait until the number of requests waiting for a reply on local shard
    /// `shard` satisfies `pred` (an event: each shard publishes the number
    /// whenever it changes), and return it; `None` when the shard is not
    /// served here or has stopped.
    pub async fn waiting_replies(
        &self,
        shard: u32,
        pred: impl FnMut(&usize) -> bool,
    ) -> Option<usize> {
        let mut rx = self.waiting.get(&shard)?.clone();
        let n = *rx.wait_for(pred).await.ok()?;
        Some(n)
    }

    /// Workers that said goodbye.
    pub fn finished_workers(&self) -> usize {
        self.ctx.membership().finished()
    }

    /// Open connections and those not yet past Hello.
    pub fn connections(&self) -> (usize, usize) {
        self.ctx.membership().connections()
    }

    /// Wait until the connection counts (open, not yet past Hello) satisfy
    /// `pred` (an event: the server publishes them on every change), and
    /// return them.
    pub async fn wait_connections(
        &self,
        pred: impl FnMut(&(usize, usize)) -> bool,
    ) -> (usize, usize) {
        let mut rx = self.ctx.counts.subscribe();
        let counts = match rx.wait_for(pred).await {
            Ok(c) => *c,
            Err(_) => self.connections(),
        };
        counts
    }

    /// QUIC connections the endpoint holds state for, handshakes included.
    pub fn quic_connections(&self) -> usize {
        self.endpoint.open_connections()
    }

    /// Bytes of request frames one connection may hold at once.
    pub fn frame_budget(&self) -> usize {
        self.ctx.frame_budget
    }
}

/// How a shard whose checkpoints keep failing stops the server: the first
/// decision to stop stands.
fn checkpoint_give_up(
    outcome: watch::Sender<Option<Result<(), ServerExit>>>,
) -> crate::actor::GiveUp {
    Box::new(move |message: String| {
        if fail_once(&outcome, ServerExit::new(message.clone())) {
            tracing::error!("{message}; shutting down");
        }
    })
}

/// Local tensor boundaries of `range` given the model's global tensor ranges.
fn segments_within(range: &Range<usize>, tensors: &[Range<usize>]) -> Vec<Range<usize>> {
    tensors
        .iter()
        .filter_map(|t| {
            let lo = t.start.max(range.start);
            let hi = t.end.min(range.end);
            (lo < hi).then(|| lo - range.start..hi - range.start)
        })
        .collect()
}

/// Per segment of [`segments_within`]: whether its tensor is decayed
/// (`optimizer.no_decay`); empty when every tensor is.
fn decay_within(
    range: &Range<usize>,
    tensors: &[Range<usize>],
    names: &[String],
    rule: &ps_shared::config::OptimizerSection,
) -> Vec<bool> {
    if rule.no_decay.is_empty() {
        return Vec::new();
    }
    tensors
        .iter()
        .zip(names)
        .filter(|(t, _)| t.start.max(range.start) < t.end.min(range.end))
        .map(|(_, name)| rule.decays(name))
        .collect()
}

fn secs(v: f64) -> Duration {
    ps_shared::config::secs(v)
}

/// Bytes of request frames one connection may hold at once while they are
/// read and decoded ([`FrameBudget`]): one frame of `server.max_frame_bytes`,
/// or, when more, a dense frame for each of the process's shards (what one
/// step sends at once).
pub fn frame_budget_bytes(cfg: &ClusterConfig) -> usize {
    let dense_frame = 64 + 4 * cfg.model.num_params().div_ceil(cfg.total_shards().max(1));
    cfg.server
        .max_frame_bytes
        .max(cfg.cluster.shards_per_server.saturating_mul(dense_frame))
}

/// The transport limits both ends use.
pub fn endpoint_limits(cfg: &ClusterConfig) -> EndpointLimits {
    EndpointLimits::of_cluster(cfg)
}

/// Start server process `index` of the cluster, listening on `listen`.
/// Each shard starts from the workers' copies (see [`crate::core`]), checked
/// against its latest checkpoint when checkpoints are configured. Must be
/// called inside a running actix `System`.
pub async fn start(
    cfg: &ClusterConfig,
    index: usize,
    listen: SocketAddr,
    tls: &ServerTls,
) -> Result<RunningServer, ServerError> {
    if index >= cfg.cluster.servers.len() {
        return Err(ServerError::BadIndex {
            index,
            count: cfg.cluster.servers.len(),
        });
    }
    let num_params = cfg.model.num_params();
    let map = ShardMap::balanced(num_params, cfg.total_shards())
        .map_err(|e| ServerError::Shards(e.to_string()))?;
    let tensors = cfg.model.tensor_ranges();
    let names: Vec<String> = cfg.model.layout().into_iter().map(|t| t.name).collect();
    let s = &cfg.server;
    let checkpoints = if s.checkpoint_url.trim().is_empty() {
        None
    } else {
        let (store, prefix) =
            open_bucket(&s.checkpoint_url).map_err(|e| ServerError::CheckpointStore {
                url: s.checkpoint_url.clone(),
                message: e.to_string(),
            })?;
        Some(CheckpointTarget { store, prefix })
    };
    let layout_hash = cfg.model.layout_hash();
    let settings = CoreSettings {
        request_timeout: secs(s.request_timeout_secs),
        recovery_window: secs(s.recovery_window_secs),
        max_parked_per_conn: 4,
        max_grad_norm: s.max_grad_norm,
        norm_policy: s.grad_norm_policy,
        grad_norm_ceiling: s.grad_norm_ceiling,
        grad_anomaly_factor: s.grad_anomaly_factor,
        grad_anomaly_warmup: s.grad_anomaly_warmup,
        recovery_max_ahead: s.recovery_max_ahead(),
        checkpoint_every: s.checkpoint_every,
        layout_hash,
        data: DataSplit::default(),
        max_ranks: cfg.cluster.max_ranks() as u32,
    };
    let tick = secs((s.heartbeat_secs / 2.0).min(0.5));
    // Every shard's checkpoint first: the newest one says where the sample
    // stream stands, and the split of this run continues from there.
    let mut found = Vec::new();
    for shard in cfg.shards_of_server(index) {
        let range = map
            .range(shard)
            .ok_or_else(|| ServerError::Shards(format!("shard {shard} is not in the map")))?;
        let mut checkpoint = None;
        if let Some(target) = &checkpoints {
            if let Some(ckpt) = load_latest(&target.store, &target.prefix, shard as u32).await? {
                if ckpt.lo as usize != range.start
                    || ckpt.hi as usize != range.end
                    || ckpt.layout_hash != layout_hash
                {
                    return Err(ServerError::Restore {
                        shard,
                        message: format!(
                            "it covers [{}, {}) of layout {:x}, this shard is [{}, {}) of layout {layout_hash:x}",
                            ckpt.lo, ckpt.hi, ckpt.layout_hash, range.start, range.end
                        ),
                    });
                }
                tracing::info!(shard, version = ckpt.version, "found a checkpoint");
                checkpoint = Some(ckpt);
            }
        }
        found.push((shard, range, checkpoint));
    }
    let now_split = DataSplit::fresh(
        cfg.cluster.workers as u32,
        cfg.data.batch_size as u64,
        cfg.data.seed,
        cfg.data.partition == Partition::Stable,
    );
    let data = match found
        .iter()
        .filter_map(|(shard, _, c)| c.as_ref().map(|c| (*shard, c)))
        .max_by_key(|(_, c)| c.version)
    {
        None => now_split,
        Some((shard, ckpt)) => {
            // BSP resumes at the version; ASP and SSP after the fastest rank.
            let at = match s.mode {
                SyncMode::Bsp => ckpt.version,
                _ => ckpt.clocks.iter().map(|(_, c)| *c).max().unwrap_or(0),
            };
            let split = ckpt
                .data
                .resume(at, &now_split)
                .map_err(|message| ServerError::Restore { shard, message })?;
            if split != ckpt.data {
                tracing::info!(
                    step = split.step,
                    samples = split.samples,
                    from_workers = ckpt.data.world,
                    workers = split.world,
                    "the worker count or batch size changed: the sample stream continues at the same position"
                );
            }
            split
        }
    };
    let settings = CoreSettings { data, ..settings };
    let (outcome_tx, outcome_rx) = watch::channel(None);
    let mut shards = HashMap::new();
    let mut welcome = Vec::new();
    let mut arbiters = Vec::new();
    let mut versions = Vec::new();
    let mut waiting = HashMap::new();
    // With optimizer.moments = "worker" the pushes are Adam directions and
    // the servers add them at the base rate.
    let rule = cfg.optimizer.server_rule();
    for (shard, range, checkpoint) in found {
        let setup = ShardSetup {
            shard: shard as u32,
            lo: range.start,
            hi: range.end,
            decay: decay_within(&range, &tensors, &names, &rule),
            segments: segments_within(&range, &tensors),
            rule: rule.clone(),
            // The barrier's clients: one per node (per worker when
            // cluster.workers_per_node is 1).
            workers: cfg.nodes() as u32,
            mode: s.mode,
            staleness: s.staleness,
            global_topk: cfg.compression.global_topk_for(cfg.nodes() as u32),
            backup: s.backup_workers,
            f16_replies: cfg.compression.f16_replies,
            // One shard sees the whole gradient and clips in one pass;
            // several share their norms through the workers.
            shared_norm: cfg.optimizer.clip_grad_norm > 0.0 && cfg.total_shards() > 1,
        };
        let core = ShardCore::new(setup, settings.clone(), checkpoint);
        // data.balance = "throughput": shard 0 decides the splits of the
        // global batch; a split takes effect balance_every steps after it
        // is decided (the workers' loaders plan no further).
        let core = if shard == 0 && cfg.data.balance == Balance::Throughput {
            let every = cfg.data.balance_every;
            let global = (cfg.cluster.workers * cfg.data.batch_size) as u64;
            core.with_balancer(Balancer::new(cfg.cluster.workers, global, every, every))
        } else {
            core
        };
        let (version_tx, version_rx) = watch::channel(0);
        versions.push(version_rx);
        let (waiting_tx, waiting_rx) = watch::channel(0);
        waiting.insert(shard as u32, waiting_rx);
        let arbiter = Arbiter::new();
        let target = checkpoints.clone();
        let give_up = checkpoint_give_up(outcome_tx.clone());
        let max_failures = s.checkpoint_max_failures;
        let addr = ShardActor::start_in_arbiter(&arbiter.handle(), move |_| {
            ShardActor::new(core, target, tick, version_tx, waiting_tx)
                .with_checkpoint_limit(max_failures, give_up)
        });
        arbiters.push(arbiter);
        shards.insert(shard as u32, addr);
        welcome.push(ShardRange {
            shard: shard as u32,
            lo: range.start as u64,
            hi: range.end as u64,
        });
    }
    let io = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(s.io_threads)
        .thread_name(format!("ps-server-{index}-io"))
        .enable_all()
        .build()
        .map_err(ServerError::Runtime)?;
    let limits = endpoint_limits(cfg);
    let bound = {
        let _guard = io.enter();
        transport::server_endpoint(listen, &tls.cert_pem, &tls.key_pem, &tls.ca_pem, &limits)
            .map_err(|e| match e {
                TransportError::Socket(source) => ServerError::Bind {
                    addr: listen,
                    source,
                },
                other => ServerError::Transport(other),
            })
            .and_then(|endpoint| {
                let addr = endpoint.local_addr().map_err(TransportError::from)?;
                // The same-host socket, when cluster.local_path is on.
                let local = cfg
                    .cluster
                    .local_path
                    .then(|| local_socket(index))
                    .transpose()?;
                Ok((endpoint, addr, local))
            })
    };
    let (endpoint, local_addr, local) = match bound {
        Ok(bound) => bound,
        Err(e) => {
            // A runtime dropped inside this async fn would panic ("Cannot
            // drop a runtime in a context where blocking is not allowed")
            // and hide `e`: let it and the shard arbiters go without
            // blocking.
            io.shutdown_background();
            for arbiter in &arbiters {
                arbiter.stop();
            }
            return Err(e);
        }
    };
    let (socket_dir, local_path, listener) = match local {
        Some((dir, path, listener)) => {
            tracing::info!(path = %path.display(), "same-host socket open");
            let path = path.to_string_lossy().into_owned();
            (Some(dir), Some(path), Some(listener))
        }
        None => (None, None, None),
    };
    let now = Instant::now();
    let membership = Membership::new(
        MembershipSettings {
            workers: cfg.cluster.workers as u32,
            max_workers: cfg.cluster.max_ranks() as u32,
            workers_per_node: cfg.cluster.workers_per_node as u32,
            token: cfg.cluster.token.clone(),
            num_params: num_params as u64,
            layout_hash,
            max_connections: s.max_connections,
            max_unauthenticated: s.max_unauthenticated,
            max_unauthenticated_per_source: s.max_unauthenticated_per_source,
            max_requests_per_sec: s.max_requests_per_sec,
            worker_timeout: secs(s.worker_timeout_secs),
            join_timeout: secs(s.join_timeout_secs),
            all_gone_grace: secs(s.all_gone_grace_secs),
            exit_when_done: s.exit_when_done,
        },
        now,
    );
    let ctx = Arc::new(Ctx {
        index: index as u32,
        workers: cfg.cluster.workers as u32,
        data,
        max_frame: s.max_frame_bytes,
        request_timeout: secs(s.request_timeout_secs),
        hello_timeout: secs(s.hello_timeout_secs),
        stall: secs(s.idle_timeout_secs),
        frame_budget: frame_budget_bytes(cfg),
        limits,
        shards,
        welcome,
        membership: Mutex::new(membership),
        conns: Mutex::new(HashMap::new()),
        pending: Mutex::new(HashMap::new()),
        counts: watch::channel((0, 0)).0,
        next_conn: AtomicU64::new(1),
        outcome: outcome_tx,
        job_stopped: Mutex::new(None),
        job_done: Mutex::new(None),
        copied: Mutex::new(Copied::default()),
        local_path,
        grants: Mutex::new(HashMap::new()),
        local_served: AtomicU64::new(0),
    });
    if let Some(listener) = listener {
        let local_ctx = ctx.clone();
        io.spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        tokio::spawn(serve_local(stream, local_ctx.clone()));
                    }
                    Err(e) => {
                        // Out of descriptors, say: keep serving QUIC, and
                        // try the socket again shortly.
                        tracing::warn!("same-host socket accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }
    let tick_ctx = ctx.clone();
    io.spawn(async move {
        let mut interval = tokio::time::interval(tick);
        loop {
            interval.tick().await;
            let actions = tick_ctx.membership().tick(Instant::now());
            tick_ctx.apply(actions);
        }
    });
    tracing::info!(
        %local_addr,
        server = index,
        shards = ?ctx.welcome.iter().map(|s| (s.shard, s.lo, s.hi)).collect::<Vec<_>>(),
        "ps-server listening (QUIC, TLS 1.3, client certificates)"
    );
    let accept_ep = endpoint.clone();
    let accept_ctx = ctx.clone();
    io.spawn(async move {
        while let Some(incoming) = accept_ep.accept().await {
            if !incoming.remote_address_validated() {
                // A stateless Retry: the client must echo its token from the
                // address it claims before any handshake state is kept.
                if let Err(e) = incoming.retry() {
                    e.into_incoming().ignore();
                }
                continue;
            }
            tokio::spawn(serve_connection(incoming, accept_ctx.clone()));
        }
    });
    Ok(RunningServer {
        endpoint,
        local_addr,
        ctx,
        outcome: outcome_rx,
        versions,
        waiting,
        arbiters,
        io: Some(io),
        _socket_dir: socket_dir,
    })
}

/// A new directory only this user can enter, under the system temporary
/// directory, and the same-host socket listening in it; the directory (and
/// the socket) go when the returned [`tempfile::TempDir`] is dropped.
fn local_socket(
    index: usize,
) -> Result<(tempfile::TempDir, PathBuf, tokio::net::UnixListener), ServerError> {
    let parent = std::env::temp_dir();
    let failed = |source| ServerError::LocalSocket {
        dir: parent.display().to_string(),
        source,
    };
    // A random name, and mode 0700 from the moment it exists.
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix(&format!("stratus-ps-{index}-"))
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(&parent)
        .map_err(failed)?;
    let path = dir.path().join("ps.sock");
    let listener = tokio::net::UnixListener::bind(&path).map_err(failed)?;
    Ok((dir, path, listener))
}

async fn reply(send: &mut SendStream, resp: &Response) {
    match encode_response_frame(resp) {
        Ok(frame) => {
            if let Err(e) = write_encoded(send, &frame).await {
                tracing::debug!("cannot send reply: {e}");
            }
        }
        Err(e) => tracing::error!("cannot encode reply: {e}"),
    }
}

/// How a step of admission ended.
enum Gate<T> {
    Done(T),
    TimedOut,
    Evicted(String),
}

/// Run `step` until the Hello deadline or an eviction, whichever comes first.
async fn gate<F: std::future::Future>(
    deadline: tokio::time::Instant,
    evicted: &mut oneshot::Receiver<String>,
    step: F,
) -> Gate<F::Output> {
    tokio::select! {
        out = tokio::time::timeout_at(deadline, step) => match out {
            Ok(v) => Gate::Done(v),
            Err(_) => Gate::TimedOut,
        },
        why = evicted => match why {
            Ok(why) => Gate::Evicted(why),
            // Not evictable any more: only the step or the deadline decides.
            Err(_) => match tokio::time::timeout_at(deadline, std::future::pending::<()>()).await {
                Ok(()) => unreachable!("pending never resolves"),
                Err(_) => Gate::TimedOut,
            },
        },
    }
}

/// The certificate's rank and the Hello, on a connection that finished TLS.
async fn hello(
    conn: &Connection,
    conn_id: ConnId,
    ctx: &Ctx,
    budget: &FrameBudget,
) -> Result<u32, String> {
    let cert_rank =
        transport::peer_rank(conn).map_err(|e| format!("no usable worker certificate: {e}"))?;
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("no Hello stream: {e}"))?;
    let verdict = match read_frame(&mut recv, MAX_HELLO_BYTES).await {
        Ok(payload) => match decode_request(&payload) {
            Ok(Request::Hello {
                protocol_version,
                token,
                worker_rank,
                workers,
                workers_per_node,
                num_params,
                layout_hash,
            }) => {
                let hello = Hello {
                    protocol_version,
                    token,
                    worker_rank,
                    workers,
                    workers_per_node,
                    num_params,
                    layout_hash,
                };
                ctx.membership()
                    .hello(conn_id, cert_rank, &hello, Instant::now())
                    .map_err(|r| Response::error(r.code, r.message))
            }
            Ok(_) => Err(Response::error(
                ErrorCode::Unauthorized,
                "the first request on a connection must be Hello",
            )),
            Err(e) => Err(Response::error(ErrorCode::BadFrame, e.to_string())),
        },
        Err(e) => Err(Response::error(ErrorCode::BadFrame, e.to_string())),
    };
    match verdict {
        Ok(actions) => {
            // Past Hello: no longer evictable, and the windows open.
            ctx.pending().remove(&conn_id);
            ctx.publish_counts();
            transport::open_after_hello(conn, &ctx.limits);
            // The barrier's client: the rank, or its node when several
            // ranks push through one node aggregator.
            let client = actions
                .iter()
                .find_map(|a| match a {
                    MemberAction::Joined { rank, .. } => Some(*rank),
                    _ => None,
                })
                .unwrap_or(cert_rank);
            ctx.conns().insert(conn_id, conn.clone());
            ctx.apply(actions);
            let grant = Grant {
                conn: conn_id,
                rank: client,
                budget: budget.clone(),
            };
            let local = ctx.offer_local(conn, grant);
            let welcome = Response::Welcome {
                server_index: ctx.index,
                shards: ctx.welcome.clone(),
                workers: ctx.workers,
                data_step: ctx.data.step,
                data_samples: ctx.data.samples,
                data_batch: ctx.data.batch,
                local,
            };
            reply(&mut send, &welcome).await;
            Ok(client)
        }
        Err(resp) => {
            let why = format!("{resp:?}");
            reply(&mut send, &resp).await;
            // Give the refusal a moment to leave before closing.
            let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
            Err(why)
        }
    }
}

/// The source a connection counts against for the per-source cap: its IPv4
/// address (also when mapped into IPv6), or its IPv6 /64 prefix, since one
/// host or site usually holds a whole /64.
fn source_of(peer: SocketAddr) -> std::net::IpAddr {
    use std::net::{IpAddr, Ipv6Addr};
    match peer.ip() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// Admission, TLS and Hello, all within the Hello deadline and each open to
/// eviction until Hello: the connection and its client's rank.
async fn admit(
    incoming: Incoming,
    conn_id: ConnId,
    ctx: &Ctx,
    budget: &FrameBudget,
) -> Result<(Connection, u32), String> {
    let deadline = tokio::time::Instant::now() + ctx.hello_timeout;
    let peer = incoming.remote_address();
    let (evict, mut evicted) = oneshot::channel();
    ctx.pending().insert(conn_id, evict);
    let admitted = ctx
        .membership()
        .connection_from(conn_id, Some(source_of(peer)), Instant::now());
    let actions = match admitted {
        Ok(actions) => actions,
        Err(r) => {
            ctx.pending().remove(&conn_id);
            incoming.refuse();
            return Err(r.message);
        }
    };
    ctx.publish_counts();
    ctx.apply(actions);
    let connecting = incoming
        .accept()
        .map_err(|e| format!("handshake failed: {e}"))?;
    let conn = match gate(deadline, &mut evicted, connecting).await {
        Gate::Done(Ok(conn)) => conn,
        Gate::Done(Err(e)) => return Err(format!("handshake failed: {e}")),
        Gate::TimedOut => return Err(format!("no TLS within {:?}", ctx.hello_timeout)),
        // Dropping the handshake abandons it.
        Gate::Evicted(why) => return Err(why),
    };
    let close = |code: u32, why: String| {
        conn.close(code.into(), why.as_bytes());
        Err(why)
    };
    match gate(deadline, &mut evicted, hello(&conn, conn_id, ctx, budget)).await {
        Gate::Done(Ok(rank)) => Ok((conn.clone(), rank)),
        Gate::Done(Err(why)) => close(close::REFUSED, why),
        Gate::TimedOut => close(
            close::REFUSED,
            format!("no Hello within {:?}", ctx.hello_timeout),
        ),
        Gate::Evicted(why) => close(close::EVICTED, why),
    }
}

async fn serve_connection(incoming: Incoming, ctx: Arc<Ctx>) {
    let conn_id = ctx.next_conn.fetch_add(1, Ordering::Relaxed);
    let peer = incoming.remote_address();
    // Requests on both paths (QUIC streams and the same-host socket) share it.
    let budget = FrameBudget::new(ctx.frame_budget);
    let (conn, rank) = match admit(incoming, conn_id, &ctx, &budget).await {
        Ok(ok) => ok,
        Err(why) => {
            tracing::warn!(%peer, "refused connection: {why}");
            crate::observe::connection(ctx.index as usize, false);
            ctx.closed(conn_id, &why);
            return;
        }
    };
    crate::observe::connection(ctx.index as usize, true);
    tracing::info!(%peer, rank, "worker connected");
    loop {
        match conn.accept_bi().await {
            Ok((send, recv)) => {
                tokio::spawn(serve_stream(
                    send,
                    recv,
                    ctx.clone(),
                    conn_id,
                    rank,
                    budget.clone(),
                ));
            }
            Err(e) => {
                ctx.closed(conn_id, &e.to_string());
                return;
            }
        }
    }
}

async fn serve_stream(
    mut send: SendStream,
    mut recv: RecvStream,
    ctx: Arc<Ctx>,
    conn: ConnId,
    rank: u32,
    budget: FrameBudget,
) {
    let read = tokio::time::timeout(
        ctx.request_timeout,
        read_frame_budgeted(&mut recv, ctx.max_frame, ctx.stall, &budget),
    )
    .await;
    // The unread rest of a refused frame is dropped, not buffered.
    if !matches!(read, Ok(Ok(_))) {
        let _ = recv.stop(0u32.into());
    }
    let resp = answer(&ctx, conn, rank, read).await;
    // The frame was encoded once by the shard for every worker it answers
    // alike.
    if let Err(e) = write_encoded(&mut send, &resp.frame).await {
        tracing::debug!("cannot send reply: {e}");
    }
}

/// Serve one request on the same-host socket: from this server's own user
/// only, with a key handed out in a live connection's Welcome, as that
/// connection's request. A connection without a known key is closed
/// unanswered, so a worker whose QUIC connection ended goes back to it.
async fn serve_local(mut stream: tokio::net::UnixStream, ctx: Arc<Ctx>) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == uid => {}
        Ok(cred) => {
            tracing::warn!(
                peer_uid = cred.uid(),
                "refused a same-host connection from another user"
            );
            return;
        }
        Err(e) => {
            tracing::warn!("refused a same-host connection without credentials: {e}");
            return;
        }
    }
    let key = match local::read_key(&mut stream, ctx.stall).await {
        Ok(key) => key,
        Err(e) => {
            tracing::debug!("same-host connection ended before its key: {e}");
            return;
        }
    };
    let grant = ctx.grants().get(&key).cloned();
    let Some(Grant { conn, rank, budget }) = grant else {
        tracing::debug!("same-host request with a key of no live connection: closed");
        return;
    };
    let read = tokio::time::timeout(
        ctx.request_timeout,
        local::read_frame(&mut stream, ctx.max_frame, ctx.stall, &budget),
    )
    .await;
    ctx.local_served.fetch_add(1, Ordering::Relaxed);
    let resp = answer(&ctx, conn, rank, read).await;
    if let Err(e) = local::write_frame(&mut stream, &resp.frame).await {
        tracing::debug!("cannot send reply: {e}");
    }
}

/// The reply to a request read (or not) from connection `conn` of `rank`,
/// whichever path it came on.
async fn answer(
    ctx: &Ctx,
    conn: ConnId,
    rank: u32,
    read: Result<Result<transport::Frame, TransportError>, tokio::time::error::Elapsed>,
) -> Reply {
    let refuse = |code, message: String| Reply::new(Response::error(code, message));
    let resp = match read {
        Err(_) => refuse(ErrorCode::Timeout, "request not received in time".into()),
        Ok(Err(e)) => refuse(ErrorCode::BadFrame, e.to_string()),
        Ok(Ok(frame)) => match decode_request(&frame.payload) {
            Err(e) => refuse(ErrorCode::BadFrame, e.to_string()),
            Ok(req) => {
                // The payload was read into an aligned buffer (one copy)
                // and validated there; decoding copied its vectors once.
                let read = frame.payload.len() as u64;
                let decoded = request_vector_bytes(&req) as u64;
                {
                    let mut c = ctx.copied.lock().unwrap_or_else(|e| e.into_inner());
                    c.read += read;
                    c.decoded += decoded;
                }
                crate::observe::copied(ctx.index as usize, read, decoded);
                // The request is decoded: the frame's bytes go back to the
                // connection's budget.
                drop(frame);
                let kind = request_kind(&req);
                let span = match &req {
                    Request::Step { shard, step, .. } | Request::NormTotal { shard, step, .. } => {
                        tracing::info_span!("request", kind, rank, conn, shard, step)
                    }
                    Request::Offer { shard, version, .. } => {
                        tracing::info_span!("request", kind, rank, conn, shard, version)
                    }
                    _ => tracing::info_span!("request", kind, rank, conn),
                };
                let started = Instant::now();
                let resp = if ctx.membership().request(conn, Instant::now()) {
                    dispatch(ctx, conn, rank, req)
                        .instrument(span.clone())
                        .await
                } else {
                    refuse(
                        ErrorCode::RateLimited,
                        "over server.max_requests_per_sec".into(),
                    )
                };
                let ok = !matches!(*resp.response, Response::Error { .. });
                crate::observe::request_done(ctx.index as usize, kind, ok, started.elapsed());
                span.in_scope(|| tracing::trace!(ok, "answered"));
                resp
            }
        },
    };
    if let Response::Error { code, message } = &*resp.response {
        tracing::warn!(rank, ?code, "refused request: {message}");
    }
    resp
}

/// The request's kind, as the `kind` label and span field name it.
fn request_kind(req: &Request) -> &'static str {
    match req {
        Request::Hello { .. } => "hello",
        Request::Offer { .. } => "offer",
        Request::Step { .. } => "step",
        Request::NormTotal { .. } => "norm_total",
        Request::MakeUp { .. } => "make_up",
        Request::Bye { .. } => "bye",
        Request::Heartbeat => "heartbeat",
        Request::Abort { .. } => "abort",
        Request::Finish { .. } => "finish",
    }
}

async fn to_shard(ctx: &Ctx, conn: ConnId, rank: u32, shard: u32, request: ShardRequest) -> Reply {
    let Some(addr) = ctx.shards.get(&shard) else {
        return Reply::new(Response::error(
            ErrorCode::UnknownShard,
            format!("shard {shard} is not served by server {}", ctx.index),
        ));
    };
    let rx = match addr
        .send(Deliver {
            conn,
            rank,
            request,
        })
        .await
    {
        Ok(rx) => rx,
        Err(e) => {
            return Reply::new(Response::error(
                ErrorCode::ShuttingDown,
                format!("shard unavailable: {e}"),
            ))
        }
    };
    rx.await.unwrap_or_else(|_| {
        Reply::new(Response::error(
            ErrorCode::ShuttingDown,
            "the shard dropped the request",
        ))
    })
}

async fn dispatch(ctx: &Ctx, conn: ConnId, rank: u32, req: Request) -> Reply {
    if matches!(
        req,
        Request::Offer { .. } | Request::Step { .. } | Request::NormTotal { .. }
    ) {
        if let Some(message) = ctx.job_stop() {
            return Reply::new(Response::error(ErrorCode::JobStopped, message));
        }
        if let Some(message) = ctx.job_done() {
            return Reply::new(Response::error(ErrorCode::JobDone, message));
        }
    }
    let response = match req {
        Request::Hello { .. } => Response::error(ErrorCode::BadFrame, "Hello was already said"),
        Request::Offer {
            shard,
            version,
            next_step,
            values,
        } => {
            let request = ShardRequest::Offer {
                version,
                next_step,
                values,
            };
            return to_shard(ctx, conn, rank, shard, request).await;
        }
        Request::Step {
            shard,
            step,
            have_version,
            rate,
            grad,
        } => {
            let request = ShardRequest::Step {
                step,
                have_version,
                rate,
                grad,
            };
            return to_shard(ctx, conn, rank, shard, request).await;
        }
        Request::NormTotal {
            shard,
            step,
            have_version,
            total_sum_sq,
        } => {
            let request = ShardRequest::NormTotal {
                step,
                have_version,
                total: total_sum_sq,
            };
            return to_shard(ctx, conn, rank, shard, request).await;
        }
        Request::MakeUp {
            shard,
            skipped,
            trained,
        } => {
            let request = ShardRequest::MakeUp { skipped, trained };
            return to_shard(ctx, conn, rank, shard, request).await;
        }
        Request::Heartbeat => Response::HeartbeatAck,
        Request::Abort { reason } => {
            Response::error(ErrorCode::JobStopped, ctx.stop_job(rank, &reason))
        }
        Request::Finish { reason } => {
            ctx.finish_job(rank, &reason);
            Response::ByeAck
        }
        Request::Bye { finished } => {
            let actions = ctx.membership().bye(conn, finished, Instant::now());
            ctx.apply(actions);
            Response::ByeAck
        }
    };
    Reply::new(response)
}

#[cfg(test)]
mod admission_tests {
    use super::source_of;

    #[test]
    fn sources_are_addresses_and_ipv6_prefixes() {
        let src = |a: &str| source_of(a.parse().unwrap()).to_string();
        assert_eq!(src("192.0.2.7:4433"), "192.0.2.7");
        assert_eq!(src("[::ffff:192.0.2.7]:4433"), "192.0.2.7");
        assert_eq!(src("[2001:db8:1:2:aaaa::1]:4433"), "2001:db8:1:2::");
        assert_eq!(
            src("[2001:db8:1:2:ffff::9]:1"),
            src("[2001:db8:1:2::77]:2"),
            "one /64 is one source"
        );
    }
}

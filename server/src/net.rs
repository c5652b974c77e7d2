//! A ps-server process: a QUIC endpoint in front of this process's shard actors.
//!
//! A connection must open with a `Hello` carrying the protocol version, the
//! cluster token and the model layout fingerprint; anything else, or a wrong
//! value, is answered with a typed error and the connection is closed. After
//! that every stream is one request, dispatched to the shard actor it names.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use ps_shared::{config::ClusterConfig, transport::DevCert};
//! let cfg = ClusterConfig::embedded_default()?;
//! let cert = DevCert::generate(&["localhost".into()])?;
//! let server = ps_server::net::start(&cfg, 0, "127.0.0.1:0".parse()?, &cert.cert_pem, &cert.key_pem).await?;
//! println!("listening on {}", server.local_addr());
//! server.wait().await;
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::ops::Range;
use std::rc::Rc;
use std::time::Duration;

use actix::prelude::*;
use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::watch;
use tokio::time::Instant;

use ps_shared::config::{ClusterConfig, SyncMode};
use ps_shared::dataset::open_bucket;
use ps_shared::protocol::{
    decode_request, encode_response, ErrorCode, Request, Response, ShardRange, PROTOCOL_VERSION,
};
use ps_shared::shard::ShardMap;
use ps_shared::transport::{self, read_frame, write_frame, TransportError};

use crate::actor::{
    CheckpointTarget, GetStatus, InitShard, PullParams, PushGrad, ShardActor, ShardStatus,
    WorkerJoined, WorkerLeft,
};
use crate::checkpoint::{load_latest, CheckpointError};
use crate::optimizer::UpdateRule;
use crate::shard::{Mode, ShardSetup, ShardState};

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
    #[error("cannot restore shard {shard}: {message}")]
    Restore { shard: usize, message: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

struct ServerCtx {
    index: u32,
    token: String,
    workers: u32,
    num_params: u64,
    layout_hash: u64,
    max_frame: usize,
    exit_when_done: bool,
    shards: HashMap<u32, Addr<ShardActor>>,
    welcome: Vec<ShardRange>,
    finished: RefCell<BTreeSet<u32>>,
    members: RefCell<Members>,
    worker_timeout: Duration,
    max_rps: u32,
    done: watch::Sender<bool>,
}

/// Liveness of the workers as seen by this server process.
struct Members {
    last_seen: HashMap<u32, Instant>,
    /// Open connections per rank: a restarted worker may connect before its
    /// old connection is seen to be dead.
    connections: HashMap<u32, usize>,
    /// Ranks dropped from the barrier (dead connection or silent too long).
    dropped: BTreeSet<u32>,
}

/// Requests per second allowed on one connection (token bucket, burst 1 s).
struct RequestBudget {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl RequestBudget {
    fn new(rate: u32) -> Self {
        Self {
            rate: f64::from(rate),
            tokens: f64::from(rate),
            last: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        if self.rate == 0.0 {
            return true;
        }
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl ServerCtx {
    /// Note activity from `rank`; a dropped worker that speaks again is readmitted.
    async fn seen(&self, rank: u32) {
        let was_dropped = {
            let mut m = self.members.borrow_mut();
            m.last_seen.insert(rank, Instant::now());
            m.dropped.contains(&rank)
        };
        if was_dropped {
            self.admit(rank).await;
        }
    }

    /// Drop a worker from every local barrier (it may rejoin with a new Hello).
    async fn drop_worker(&self, rank: u32, why: &str) {
        if self.finished.borrow().contains(&rank) || !self.members.borrow_mut().dropped.insert(rank)
        {
            return;
        }
        tracing::warn!(rank, "dropping worker from the barrier: {why}");
        for addr in self.shards.values() {
            let _ = addr.send(WorkerLeft(rank)).await;
        }
    }

    /// Readmit a worker that was dropped.
    async fn admit(&self, rank: u32) {
        let readmitted = {
            let mut m = self.members.borrow_mut();
            m.last_seen.insert(rank, Instant::now());
            m.dropped.remove(&rank)
        };
        if readmitted {
            tracing::info!(rank, "worker rejoined");
            for addr in self.shards.values() {
                let _ = addr.send(WorkerJoined(rank)).await;
            }
        }
    }
}

/// A running server process.
pub struct RunningServer {
    endpoint: Endpoint,
    local_addr: SocketAddr,
    ctx: Rc<ServerCtx>,
    done: watch::Receiver<bool>,
    arbiters: Vec<Arbiter>,
}

impl RunningServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Resolves once every worker has said goodbye (with `exit_when_done`),
    /// then closes the endpoint and stops the shard arbiters.
    pub async fn wait(mut self) {
        while !*self.done.borrow() {
            if self.done.changed().await.is_err() {
                break;
            }
        }
        // Let the last replies leave: workers close their connections after
        // their goodbye is acknowledged.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while self.endpoint.open_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.shutdown().await;
    }

    /// Close the endpoint and stop the shards now.
    pub async fn shutdown(self) {
        self.endpoint.close(0u32.into(), b"server shutting down");
        self.endpoint.wait_idle().await;
        for a in &self.arbiters {
            a.stop();
        }
    }

    /// Current state of every local shard (for tests and status).
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

/// Start server process `index` of the cluster, listening on `listen`,
/// restoring each shard from its latest checkpoint when checkpoints are
/// configured. Must be called inside a running actix `System`.
pub async fn start(
    cfg: &ClusterConfig,
    index: usize,
    listen: SocketAddr,
    cert_pem: &str,
    key_pem: &str,
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
    let o = &cfg.optimizer;
    let rule = UpdateRule {
        lr: o.lr,
        momentum: o.momentum,
        nesterov: o.nesterov,
        weight_decay: o.weight_decay,
        lars: (o.lars_eta > 0.0).then_some(o.lars_eta),
    };
    let mode = match cfg.server.mode {
        SyncMode::Bsp => Mode::Bsp,
        SyncMode::Asp => Mode::Asp,
        SyncMode::Ssp => Mode::Ssp {
            staleness: cfg.server.staleness,
        },
    };
    let checkpoints = if cfg.server.checkpoint_url.trim().is_empty() {
        None
    } else {
        let (store, prefix) =
            open_bucket(&cfg.server.checkpoint_url).map_err(|e| ServerError::CheckpointStore {
                url: cfg.server.checkpoint_url.clone(),
                message: e.to_string(),
            })?;
        Some(CheckpointTarget {
            store,
            prefix,
            every: cfg.server.checkpoint_every,
        })
    };
    let layout_hash = cfg.model.layout_hash();
    let mut shards = HashMap::new();
    let mut welcome = Vec::new();
    let mut arbiters = Vec::new();
    for shard in cfg.shards_of_server(index) {
        let range = map
            .range(shard)
            .ok_or_else(|| ServerError::Shards(format!("shard {shard} is not in the map")))?;
        let setup = ShardSetup {
            shard: shard as u32,
            lo: range.start,
            hi: range.end,
            segments: segments_within(&range, &tensors),
            rule,
            workers: cfg.cluster.workers as u32,
            mode,
        };
        let mut state = ShardState::new(setup);
        if let Some(target) = &checkpoints {
            if let Some(ckpt) = load_latest(&target.store, &target.prefix, shard as u32).await? {
                let version = ckpt.version;
                state
                    .restore(ckpt, layout_hash)
                    .map_err(|message| ServerError::Restore { shard, message })?;
                tracing::info!(shard, version, "restored from checkpoint");
            }
        }
        let arbiter = Arbiter::new();
        let target = checkpoints.clone();
        let addr = ShardActor::start_in_arbiter(&arbiter.handle(), move |_| {
            ShardActor::new(state, target, layout_hash)
        });
        arbiters.push(arbiter);
        shards.insert(shard as u32, addr);
        welcome.push(ShardRange {
            shard: shard as u32,
            lo: range.start as u64,
            hi: range.end as u64,
        });
    }
    let endpoint = transport::server_endpoint(listen, cert_pem, key_pem).map_err(|e| match e {
        TransportError::Socket(source) => ServerError::Bind {
            addr: listen,
            source,
        },
        other => ServerError::Transport(other),
    })?;
    let local_addr = endpoint.local_addr().map_err(TransportError::from)?;
    let (done_tx, done_rx) = watch::channel(false);
    let ctx = Rc::new(ServerCtx {
        index: index as u32,
        token: cfg.cluster.token.clone(),
        workers: cfg.cluster.workers as u32,
        num_params: num_params as u64,
        layout_hash: cfg.model.layout_hash(),
        max_frame: cfg.server.max_frame_bytes,
        exit_when_done: cfg.server.exit_when_done,
        shards,
        welcome,
        finished: RefCell::new(BTreeSet::new()),
        members: RefCell::new(Members {
            last_seen: HashMap::new(),
            connections: HashMap::new(),
            dropped: BTreeSet::new(),
        }),
        worker_timeout: Duration::from_secs_f64(cfg.server.worker_timeout_secs),
        max_rps: cfg.server.max_requests_per_sec,
        done: done_tx,
    });
    // Watchdog: drop workers that went silent (no request and no heartbeat).
    let watch_ctx = ctx.clone();
    let tick = Duration::from_secs_f64(cfg.server.heartbeat_secs / 2.0);
    let started = Instant::now();
    actix::spawn(async move {
        let mut interval = tokio::time::interval(tick);
        loop {
            interval.tick().await;
            if *watch_ctx.done.borrow() {
                return;
            }
            let now = Instant::now();
            let silent: Vec<u32> = (0..watch_ctx.workers)
                .filter(|rank| {
                    let members = watch_ctx.members.borrow();
                    let seen = members.last_seen.get(rank).copied().unwrap_or(started);
                    !members.dropped.contains(rank)
                        && now.duration_since(seen) > watch_ctx.worker_timeout
                })
                .collect();
            for rank in silent {
                watch_ctx
                    .drop_worker(rank, "no heartbeat within server.worker_timeout_secs")
                    .await;
            }
        }
    });
    tracing::info!(
        %local_addr,
        server = index,
        shards = ?ctx.welcome.iter().map(|s| (s.shard, s.lo, s.hi)).collect::<Vec<_>>(),
        "ps-server listening (QUIC, TLS 1.3)"
    );
    let accept_ep = endpoint.clone();
    let accept_ctx = ctx.clone();
    actix::spawn(async move {
        while let Some(incoming) = accept_ep.accept().await {
            let ctx = accept_ctx.clone();
            actix::spawn(async move {
                match incoming.await {
                    Ok(conn) => serve_connection(conn, ctx).await,
                    Err(e) => tracing::warn!("handshake failed: {e}"),
                }
            });
        }
    });
    Ok(RunningServer {
        endpoint,
        local_addr,
        ctx,
        done: done_rx,
        arbiters,
    })
}

fn tokens_equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn reply(send: &mut SendStream, resp: &Response) {
    match encode_response(resp) {
        Ok(frame) => {
            if let Err(e) = write_frame(send, &frame).await {
                tracing::debug!("cannot send reply: {e}");
            }
        }
        Err(e) => tracing::error!("cannot encode reply: {e}"),
    }
}

/// Check a Hello; on success the worker's rank.
fn check_hello(ctx: &ServerCtx, req: Request) -> Result<u32, Response> {
    match req {
        Request::Hello {
            protocol_version,
            token,
            worker_rank,
            num_params,
            layout_hash,
        } => {
            if protocol_version != PROTOCOL_VERSION {
                return Err(Response::error(
                    ErrorCode::VersionMismatch,
                    format!(
                        "client speaks protocol {protocol_version}, server speaks {PROTOCOL_VERSION}"
                    ),
                ));
            }
            if !tokens_equal(&token, &ctx.token) {
                return Err(Response::error(
                    ErrorCode::Unauthorized,
                    "wrong cluster token",
                ));
            }
            if worker_rank >= ctx.workers {
                return Err(Response::error(
                    ErrorCode::UnknownWorker,
                    format!(
                        "rank {worker_rank} but the cluster has {} workers",
                        ctx.workers
                    ),
                ));
            }
            if num_params != ctx.num_params || layout_hash != ctx.layout_hash {
                return Err(Response::error(
                    ErrorCode::LayoutMismatch,
                    format!(
                        "worker model has {num_params} parameters (layout {layout_hash:x}), server has {} ({:x}): use the same [model] config",
                        ctx.num_params, ctx.layout_hash
                    ),
                ));
            }
            Ok(worker_rank)
        }
        _ => Err(Response::error(
            ErrorCode::Unauthorized,
            "the first request on a connection must be Hello",
        )),
    }
}

async fn serve_connection(conn: Connection, ctx: Rc<ServerCtx>) {
    let peer = conn.remote_address();
    let rank = match authenticate(&conn, &ctx).await {
        Some(rank) => rank,
        None => return,
    };
    tracing::info!(%peer, rank, "worker connected");
    *ctx.members
        .borrow_mut()
        .connections
        .entry(rank)
        .or_insert(0) += 1;
    ctx.admit(rank).await;
    let mut budget = RequestBudget::new(ctx.max_rps);
    loop {
        match conn.accept_bi().await {
            Ok((mut send, recv)) => {
                if !budget.take() {
                    let resp = Response::error(
                        ErrorCode::RateLimited,
                        format!("more than {} requests per second", ctx.max_rps),
                    );
                    actix::spawn(async move { reply(&mut send, &resp).await });
                    continue;
                }
                let ctx = ctx.clone();
                actix::spawn(serve_stream(send, recv, ctx, rank));
            }
            Err(e) => {
                // A worker that vanished must not hold the barrier forever,
                // unless it is still (or again) connected on another connection.
                let still_open = {
                    let mut m = ctx.members.borrow_mut();
                    let open = m.connections.entry(rank).or_insert(1);
                    *open = open.saturating_sub(1);
                    *open
                };
                if still_open > 0 {
                    return;
                }
                ctx.drop_worker(
                    rank,
                    &format!("connection from {peer} lost before goodbye ({e})"),
                )
                .await;
                return;
            }
        }
    }
}

async fn authenticate(conn: &Connection, ctx: &ServerCtx) -> Option<u32> {
    let (mut send, mut recv) = conn.accept_bi().await.ok()?;
    let verdict = match read_frame(&mut recv, ctx.max_frame).await {
        Ok(payload) => match decode_request(&payload) {
            Ok(req) => check_hello(ctx, req),
            Err(e) => Err(Response::error(ErrorCode::BadFrame, e.to_string())),
        },
        Err(e) => Err(Response::error(ErrorCode::BadFrame, e.to_string())),
    };
    match verdict {
        Ok(rank) => {
            let welcome = Response::Welcome {
                server_index: ctx.index,
                shards: ctx.welcome.clone(),
                workers: ctx.workers,
            };
            reply(&mut send, &welcome).await;
            Some(rank)
        }
        Err(resp) => {
            tracing::warn!(peer = %conn.remote_address(), "refused connection: {resp:?}");
            reply(&mut send, &resp).await;
            // Give the refusal a moment to leave before closing.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), send.stopped()).await;
            conn.close(1u32.into(), b"refused");
            None
        }
    }
}

async fn serve_stream(mut send: SendStream, mut recv: RecvStream, ctx: Rc<ServerCtx>, rank: u32) {
    let resp = match read_frame(&mut recv, ctx.max_frame).await {
        Ok(payload) => match decode_request(&payload) {
            Ok(req) => {
                ctx.seen(rank).await;
                dispatch(&ctx, rank, req).await
            }
            Err(e) => Response::error(ErrorCode::BadFrame, e.to_string()),
        },
        Err(e) => Response::error(ErrorCode::BadFrame, e.to_string()),
    };
    if let Response::Error { code, message } = &resp {
        tracing::warn!(rank, ?code, "refused request: {message}");
    }
    reply(&mut send, &resp).await;
}

fn shard_addr(ctx: &ServerCtx, shard: u32) -> Result<&Addr<ShardActor>, Response> {
    ctx.shards.get(&shard).ok_or_else(|| {
        Response::error(
            ErrorCode::UnknownShard,
            format!("shard {shard} is not served by server {}", ctx.index),
        )
    })
}

fn mailbox_gone(e: MailboxError) -> Response {
    Response::error(ErrorCode::ShuttingDown, format!("shard unavailable: {e}"))
}

async fn dispatch(ctx: &ServerCtx, rank: u32, req: Request) -> Response {
    match req {
        Request::Hello { .. } => Response::Welcome {
            server_index: ctx.index,
            shards: ctx.welcome.clone(),
            workers: ctx.workers,
        },
        Request::Init { shard, values } => {
            let addr = match shard_addr(ctx, shard) {
                Ok(a) => a,
                Err(r) => return r,
            };
            match addr.send(InitShard(values)).await {
                Ok(Ok(accepted)) => Response::InitAck { shard, accepted },
                Ok(Err(refusal)) => refusal.into_response(),
                Err(e) => mailbox_gone(e),
            }
        }
        Request::Push {
            shard,
            step,
            worker_rank,
            grad,
        } => {
            if worker_rank != rank {
                return Response::error(
                    ErrorCode::Unauthorized,
                    format!("connection of worker {rank} pushed as worker {worker_rank}"),
                );
            }
            let addr = match shard_addr(ctx, shard) {
                Ok(a) => a,
                Err(r) => return r,
            };
            match addr
                .send(PushGrad {
                    worker: rank,
                    step,
                    grad,
                })
                .await
            {
                Ok(Ok(())) => Response::PushAck { shard, step },
                Ok(Err(refusal)) => refusal.into_response(),
                Err(e) => mailbox_gone(e),
            }
        }
        Request::Pull {
            shard,
            have_version,
            min_version,
        } => {
            let addr = match shard_addr(ctx, shard) {
                Ok(a) => a,
                Err(r) => return r,
            };
            match addr
                .send(PullParams {
                    worker: rank,
                    have_version,
                    min_version,
                })
                .await
            {
                Ok(rx) => rx.await.unwrap_or_else(|_| {
                    Response::error(
                        ErrorCode::ShuttingDown,
                        "shard stopped before the step completed",
                    )
                }),
                Err(e) => mailbox_gone(e),
            }
        }
        Request::Heartbeat { .. } => Response::HeartbeatAck,
        Request::Bye { worker_rank } => {
            if worker_rank != rank {
                return Response::error(
                    ErrorCode::Unauthorized,
                    format!("connection of worker {rank} said goodbye as worker {worker_rank}"),
                );
            }
            for addr in ctx.shards.values() {
                let _ = addr.send(WorkerLeft(rank)).await;
            }
            let all_done = {
                let mut finished = ctx.finished.borrow_mut();
                finished.insert(rank);
                finished.len() as u32 >= ctx.workers
            };
            tracing::info!(rank, "worker finished");
            if all_done && ctx.exit_when_done {
                tracing::info!("every worker finished; shutting down");
                let _ = ctx.done.send(true);
            }
            Response::ByeAck
        }
    }
}

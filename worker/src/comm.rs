//! Talking to the parameter servers: `Comm` (plain async) and `CommActor`.
//!
//! A worker holds one QUIC connection per server process, authenticated by
//! its own client certificate. A step is **one round trip per shard**: the
//! `Step` request carries the gradient of step `t` and the version the worker
//! holds, and its reply carries the parameters for step `t + 1` (a sparse
//! delta when that is cheaper). All shards go concurrently. With
//! `optimizer.clip_grad_norm` and several shards a step takes two: the
//! pushes are answered with norm shares, and the total goes back to every
//! shard (`Request::NormTotal`), whose reply is the parameters.
//!
//! `Comm` is a thin driver of the sans-IO [`ClientCore`]: it encodes each
//! shard's request once per step, carries out the core's actions (QUIC
//! calls under the request deadline, redials, timers on tokio's clock) and
//! feeds the outcomes back. Every policy lives in the core: which refusal is
//! retried and after how long, when a link is redialed, what is offered to a
//! restarted server, when a step is complete and when to give up. When a
//! server is lost (its connection dies, or it closes with "shutting down"),
//! the worker redials it for up to `server.connect_timeout_secs`, offers its
//! copy of that server's shards (a restarted server rebuilds them from the
//! workers' copies) and sends the step again unless the shard already
//! applied it; `Step` is idempotent on the server, so a retry never counts a
//! push twice. A server that stays unreachable ends the run with an error
//! naming it. A worker the servers declared dead is fenced: it takes the
//! cluster's parameters and step ([`Traffic::next_step`]) instead of pushing
//! its stale step.

use std::cell::RefCell;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures::channel::oneshot;
use futures::future::{FutureExt, LocalBoxFuture, Shared};
use futures::stream::{FuturesUnordered, StreamExt};
use quinn::Connection;

use ps_net::pki::CertPair;
use ps_net::protocol::{
    close, encode_offer, encode_request_frame, encode_step, response_vector_bytes, Copied,
    EncodedFrame, ErrorCode, GradView, LocalPath, ParamUpdate, Request, Response, ShardRange,
    ValuesView, WireGrad, WireOrphan, PROTOCOL_VERSION,
};
use ps_net::transport::{self, EndpointLimits, TransportError};
use ps_shared::config::ClusterConfig;
use ps_shared::link::{LinkLimiter, LinkSection};
use ps_shared::shard::ShardMap;
use ps_shared::sparse::SparseGrad;

use crate::balance::BalanceLink;
use crate::client::{
    Action, ClientCore, ClientSettings, Delivery, Event, GiveUp, Params, ShardId, Token,
};

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("server refused {what}: {code:?}: {message}")]
    Refused {
        what: &'static str,
        code: ErrorCode,
        message: String,
    },
    #[error("unexpected reply to {what}: {reply}")]
    Unexpected { what: &'static str, reply: String },
    #[error("cluster layout disagrees: {0}")]
    Layout(String),
    /// The servers disagree about where the sample stream stands, or it
    /// does not fit this worker's config.
    #[error("sample order: {0}")]
    DataSplit(String),
    #[error("could not reach server {addr} within {secs} s (server.connect_timeout_secs): {last}")]
    Unreachable {
        addr: String,
        secs: u64,
        last: String,
    },
    #[error(
        "no reply from server {addr} to {what} within {secs:.0} s (server.request_timeout_secs)"
    )]
    Deadline {
        addr: String,
        what: &'static str,
        secs: f64,
    },
    #[error("gave up on step after {attempts} attempts: {last}")]
    GaveUp { attempts: u32, last: String },
    /// Any other reason the client core gave up.
    #[error(transparent)]
    Client(GiveUp),
}

fn refused(what: &'static str, resp: Response) -> CommError {
    match resp {
        Response::Error { code, message } => CommError::Refused {
            what,
            code,
            message,
        },
        other => CommError::Unexpected {
            what,
            reply: format!("{other:?}"),
        },
    }
}

/// A gradient ready to push: sparse (global indices) or dense, or a dense
/// one that the trainer hands over shard by shard while its backward pass
/// still runs ([`GradSink`]).
#[derive(Debug, Clone)]
pub enum Outgoing {
    Sparse(SparseGrad),
    Dense(Vec<f32>),
    Streamed(StreamedGrad),
}

/// One shard's push as the trainer makes it ([`GradSink::offer_with`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ShardPush {
    /// Every entry of the shard, in order.
    Dense(Vec<f32>),
    /// Indices local to the shard, ascending.
    Sparse(SparseGrad),
}

/// One shard's push, as it goes on the wire: dense values, or the shard's
/// own top-k (`compression.scope = "shard"`).
#[derive(Debug)]
enum ShardValues {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Sparse(WireGrad),
}

/// A shard's values still to come from the trainer (or come already).
type PendingShard = Shared<oneshot::Receiver<Arc<ShardValues>>>;

/// The comm's end of a gradient streamed shard by shard: one pending value
/// per shard.
#[derive(Clone)]
pub struct StreamedGrad(Vec<PendingShard>);

impl std::fmt::Debug for StreamedGrad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ready = self.0.iter().filter(|p| settled(p).is_some()).count();
        write!(f, "StreamedGrad({ready} of {} shards ready)", self.0.len())
    }
}

/// The trainer's end of a streamed gradient: each shard leaves as soon as
/// the backward pass has finished its whole range, so that its push goes
/// out while the pass computes the layers before it (in BSP, the exchange
/// overlaps the backward pass).
pub struct GradSink {
    map: ShardMap,
    senders: Vec<Option<oneshot::Sender<Arc<ShardValues>>>>,
    f16: bool,
}

impl GradSink {
    /// A sink for the cluster's shards (the same map and value encoding as
    /// [`Comm::connect`]'s) and the comm's end to hand to the exchange.
    pub fn for_cluster(cfg: &ClusterConfig) -> Result<(GradSink, Outgoing), CommError> {
        let map = ShardMap::balanced(cfg.model.num_params(), cfg.total_shards())
            .map_err(|e| CommError::Layout(e.to_string()))?;
        Ok(Self::new(&map, cfg.compression.f16_values))
    }

    fn new(map: &ShardMap, f16: bool) -> (GradSink, Outgoing) {
        let (senders, pending) = map
            .ranges()
            .iter()
            .map(|_| {
                let (tx, rx) = oneshot::channel();
                (Some(tx), rx.shared())
            })
            .unzip();
        let sink = GradSink {
            map: map.clone(),
            senders,
            f16,
        };
        (sink, Outgoing::Streamed(StreamedGrad(pending)))
    }

    /// The shards of the flat gradient.
    pub fn map(&self) -> &ShardMap {
        &self.map
    }

    /// `grads[from..]` is final: every shard lying wholly inside it that
    /// has not left yet leaves now, scaled by `weight` (the batch's share of
    /// the global batch; 1 leaves the values as they are). Returns how many
    /// left.
    pub fn offer(&mut self, from: usize, grads: &[f32], weight: f32) -> u64 {
        let f16 = self.f16;
        let dense = |_: usize, _: std::ops::Range<usize>, part: &[f32]| {
            Ok::<_, std::convert::Infallible>(match (f16, weight == 1.0) {
                (true, true) => ShardValues::F16(ps_shared::sparse::values_to_f16(part)),
                (true, false) => ShardValues::F16(
                    part.iter()
                        .map(|&v| ps_shared::sparse::f32_to_f16(v * weight))
                        .collect(),
                ),
                (false, true) => ShardValues::F32(part.to_vec()),
                (false, false) => ShardValues::F32(part.iter().map(|&v| v * weight).collect()),
            })
        };
        match self.hand(from, grads, dense) {
            Ok(handed) => handed,
            Err(never) => match never {},
        }
    }

    /// [`Self::offer`] for a push made per shard: each shard that is final
    /// and still here leaves as what `make(shard, its range, its gradient)`
    /// returns (a sparse push has indices local to the shard). The first
    /// error stops the offer and is returned; the shards not handed over
    /// then fail the exchange.
    pub fn offer_with<E>(
        &mut self,
        from: usize,
        grads: &[f32],
        mut make: impl FnMut(usize, std::ops::Range<usize>, &[f32]) -> Result<ShardPush, E>,
    ) -> Result<u64, E> {
        let f16 = self.f16;
        self.hand(from, grads, |shard, range, part| {
            Ok(match make(shard, range, part)? {
                ShardPush::Sparse(g) => ShardValues::Sparse(WireGrad::from_sparse(g, f16)),
                ShardPush::Dense(v) if f16 => {
                    ShardValues::F16(ps_shared::sparse::values_to_f16(&v))
                }
                ShardPush::Dense(v) => ShardValues::F32(v),
            })
        })
    }

    /// Hands every shard that is final and still here over as `make` encodes
    /// it; how many left.
    fn hand<E>(
        &mut self,
        from: usize,
        grads: &[f32],
        mut make: impl FnMut(usize, std::ops::Range<usize>, &[f32]) -> Result<ShardValues, E>,
    ) -> Result<u64, E> {
        let mut handed = 0;
        for (shard, (range, sender)) in self.map.ranges().iter().zip(&mut self.senders).enumerate()
        {
            if range.start < from || sender.is_none() {
                continue;
            }
            let Some(part) = grads.get(range.clone()) else {
                continue;
            };
            let values = make(shard, range.clone(), part)?;
            if let Some(tx) = sender.take() {
                // The exchange may be gone (it failed): nothing waits then.
                let _ = tx.send(Arc::new(values));
                handed += 1;
            }
        }
        Ok(handed)
    }
}

/// New values for one shard, with the shard's first global index.
#[derive(Debug, Clone)]
pub struct ShardUpdate {
    pub offset: usize,
    pub update: ParamUpdate,
}

/// Bytes moved and round trips made by one exchange.
#[derive(Debug, Clone, Copy, Default)]
pub struct Traffic {
    pub pushed: u64,
    pub pulled: u64,
    /// Request/reply round trips to shards (Offer and Step).
    pub round_trips: u64,
    /// Fewest workers connected to any shard's barrier in the replies.
    pub live_workers: u32,
    /// Entries pushed / parameters, when the push was compressed away from
    /// the trainer (by the node aggregator); `None` for a worker's own push.
    pub density: Option<f64>,
    /// The step the cluster expects next from this worker. After a step
    /// `t` it is `t + 1`, unless the worker was declared dead and the
    /// cluster went on without it: then the worker continues from here.
    pub next_step: u64,
    /// Bytes this worker copied encoding its requests and receiving and
    /// decoding the replies (every attempt of the exchange).
    pub copied: Copied,
    /// Shards that refused the push as fenced: it was not applied there.
    pub fenced: usize,
}

/// The make-up round of backup workers, as the servers decided it
/// ([`Comm::make_up`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MakeUpRound {
    /// Every rank's batches never applied, ascending by step then rank.
    pub orphans: Vec<WireOrphan>,
    /// The batches each rank trained (0: not in the round).
    pub trained: Vec<u64>,
    /// The step the cluster expects next (the lowest over the shards).
    pub next_step: u64,
}

/// The worker's current flat parameters (what it offers a restarted server).
pub type ParamSource = Rc<dyn Fn() -> Pin<Box<dyn Future<Output = Vec<f32>>>>>;

/// TLS material of a worker: the cluster CA and the rank's certificate.
#[derive(Clone, Debug)]
pub struct WorkerTls {
    pub ca_pem: String,
    pub identity: CertPair,
}

struct Link {
    server: String,
    conn: Connection,
    /// The server's same-host socket and this connection's key for it,
    /// while that path works (see [`ps_net::local`]).
    local: Option<LocalPath>,
}

/// A server dialed and greeted: what its Welcome said.
struct Dialed {
    conn: Connection,
    shards: Vec<ShardRange>,
    start: DataStart,
    local: Option<LocalPath>,
}

/// What (re)connecting needs.
struct Dialer {
    hello: Request,
    server_name: String,
    tls: WorkerTls,
    limits: EndpointLimits,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_frame: usize,
    /// `cluster.local_path`: take a same-host path a server offers.
    local_path: bool,
}

/// Where the servers say the sample stream stands (from their Welcome):
/// global step `step` starts after `samples` samples of the run's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataStart {
    pub step: u64,
    pub samples: u64,
    /// The `data.batch_size` the servers split the stream with.
    pub batch: u64,
}

/// Connections to every server process and the shard routing.
pub struct Comm {
    rank: u32,
    data: DataStart,
    links: RefCell<Vec<Link>>,
    dialer: Dialer,
    map: ShardMap,
    /// Which link serves each shard.
    route: Vec<usize>,
    /// Every policy: versions, steps, retries, redials, recovery, fencing.
    /// Borrowed only between awaits.
    core: RefCell<ClientCore>,
    heartbeat: Duration,
    /// Heartbeats are off (fault injection: a paused worker).
    silent: std::cell::Cell<bool>,
    f16: bool,
    link: LinkLimiter,
    params: ParamSource,
    /// Bytes copied since the last exchange's figures were taken.
    copied: std::cell::Cell<Copied>,
    /// `data.balance = "throughput"`: the rate sent with each push and the
    /// splits learned from shard 0's replies.
    balance: Option<Arc<BalanceLink>>,
}

/// Bytes an update takes on the wire (values, and delta-encoded indices).
fn update_bytes(u: &ParamUpdate) -> u64 {
    u.wire_bytes() as u64
}

/// The core's clock: tokio's, so a paused test clock drives it too.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

async fn sleep_until(at: std::time::Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
}

/// One shard's encoded push of the step under way, reused by every retry
/// while the step and the version held stay the same.
struct Frame {
    step: u64,
    have_version: Option<u64>,
    bytes: EncodedFrame,
}

/// A step's gradient, held whole and encoded per shard straight from it:
/// the dense gradient is never split into copies, the shards' frames take
/// their slices of it.
enum Pushes {
    /// No gradient (a join).
    None,
    /// The whole dense gradient; shard `i` is `map.ranges()[i]` of it.
    Dense(Vec<f32>),
    /// Each shard's dense values as f16 bits.
    DenseF16(Vec<Vec<u16>>),
    /// Each shard's sparse gradient (local indices).
    Sparse(Vec<WireGrad>),
    /// Each shard's dense values, once the trainer has handed them over.
    Streamed(Vec<PendingShard>),
}

/// A streamed shard's outcome, if the trainer has decided it: its values,
/// or `Err` when the trainer dropped its end without them.
fn settled(pending: &PendingShard) -> Option<&Result<Arc<ShardValues>, oneshot::Canceled>> {
    // A shared future learns its outcome only when polled.
    let _ = pending.clone().now_or_never();
    pending.peek()
}

impl Pushes {
    fn view<'a>(&'a self, map: &ShardMap, shard: usize) -> Option<GradView<'a>> {
        match self {
            Pushes::None => None,
            Pushes::Dense(d) => map
                .split_dense(d)
                .get(shard)
                .map(|v| GradView::Dense(ValuesView::F32(v))),
            Pushes::DenseF16(parts) => parts
                .get(shard)
                .map(|v| GradView::Dense(ValuesView::F16(v))),
            Pushes::Sparse(parts) => parts.get(shard).map(GradView::from),
            Pushes::Streamed(parts) => match settled(parts.get(shard)?)? {
                Ok(values) => Some(match values.as_ref() {
                    ShardValues::F32(v) => GradView::Dense(ValuesView::F32(v)),
                    ShardValues::F16(v) => GradView::Dense(ValuesView::F16(v)),
                    ShardValues::Sparse(g) => GradView::from(g),
                }),
                Err(_) => None,
            },
        }
    }

    /// A shard's values that the trainer has not handed over yet: the
    /// future resolves when it does (`false` when it never will).
    fn pending(&self, shard: usize) -> Option<PendingShard> {
        match self {
            Pushes::Streamed(parts) => parts.get(shard).filter(|p| settled(p).is_none()).cloned(),
            _ => None,
        }
    }
}

impl Comm {
    /// Connect to every server (retrying until `server.connect_timeout_secs`),
    /// authenticate, and check that the servers' shards tile the parameter
    /// space. `params` gives the worker's current parameters for offers.
    pub async fn connect(
        cfg: &ClusterConfig,
        rank: u32,
        tls: WorkerTls,
        params: ParamSource,
    ) -> Result<Self, CommError> {
        Self::connect_over(cfg, rank, tls, params, &LinkSection::default()).await
    }

    /// [`Comm::connect`], every request and reply passing through the
    /// simulated `link` (see [`crate::simulate`]).
    pub async fn connect_over(
        cfg: &ClusterConfig,
        rank: u32,
        tls: WorkerTls,
        params: ParamSource,
        link: &LinkSection,
    ) -> Result<Self, CommError> {
        let num_params = cfg.model.num_params();
        let map = ShardMap::balanced(num_params, cfg.total_shards())
            .map_err(|e| CommError::Layout(e.to_string()))?;
        let mut links = Vec::new();
        let mut route = vec![usize::MAX; map.num_shards()];
        let dialer = Dialer {
            hello: Request::Hello {
                protocol_version: PROTOCOL_VERSION,
                token: cfg.cluster.token.clone(),
                worker_rank: rank,
                workers: cfg.cluster.workers as u32,
                workers_per_node: cfg.cluster.workers_per_node as u32,
                num_params: num_params as u64,
                layout_hash: cfg.model.layout_hash(),
            },
            server_name: cfg.tls.server_name.clone(),
            tls,
            limits: EndpointLimits::of_cluster(cfg),
            connect_timeout: Duration::from_secs(cfg.server.connect_timeout_secs),
            request_timeout: ps_shared::config::secs(cfg.server.request_timeout_secs),
            max_frame: cfg.server.max_frame_bytes,
            local_path: cfg.cluster.local_path,
        };
        let mut data: Option<DataStart> = None;
        for (i, server) in cfg.cluster.servers.iter().enumerate() {
            let Dialed {
                conn,
                shards,
                start,
                local,
            } = dialer.dial(server).await?;
            match data {
                None => data = Some(start),
                Some(d) if d != start => {
                    return Err(CommError::DataSplit(format!(
                        "server {server} says step {} starts at sample {}, server {} says step {} starts at sample {}; start every server from the same checkpoint",
                        start.step, start.samples, cfg.cluster.servers[0], d.step, d.samples
                    )))
                }
                Some(_) => {}
            }
            for s in shards {
                let expected = map.range(s.shard as usize);
                if expected != Some(s.lo as usize..s.hi as usize) {
                    return Err(CommError::Layout(format!(
                        "server {server} serves shard {} as {}..{}, expected {expected:?}",
                        s.shard, s.lo, s.hi
                    )));
                }
                route[s.shard as usize] = i;
            }
            if let Some(l) = &local {
                tracing::info!(
                    server,
                    path = l.path,
                    "server on this host: requests go through its Unix socket"
                );
            }
            links.push(Link {
                server: server.clone(),
                conn,
                local,
            });
        }
        if let Some(missing) = route.iter().position(|&r| r == usize::MAX) {
            return Err(CommError::Layout(format!(
                "no server serves shard {missing}"
            )));
        }
        let data = data.unwrap_or_default();
        if data.batch != cfg.data.batch_size as u64 {
            return Err(CommError::DataSplit(format!(
                "the servers split the samples in batches of {} (their data.batch_size), this worker has data.batch_size = {}",
                data.batch, cfg.data.batch_size
            )));
        }
        let settings = ClientSettings {
            one_step: cfg.server.mode == ps_shared::config::SyncMode::Bsp,
            late_pushes: cfg.server.backup_workers > 0,
            ..ClientSettings::new(
                route.clone(),
                dialer.connect_timeout,
                dialer.request_timeout,
            )
        };
        Ok(Self {
            rank,
            data,
            links: RefCell::new(links),
            dialer,
            core: RefCell::new(ClientCore::new(settings)),
            heartbeat: ps_shared::config::secs(cfg.server.heartbeat_secs),
            silent: std::cell::Cell::new(false),
            map,
            route,
            f16: cfg.compression.f16_values,
            link: LinkLimiter::new(link),
            params,
            copied: std::cell::Cell::new(Copied::default()),
            balance: None,
        })
    }

    /// Throughput balancing: push `link`'s rate with every step and tell it
    /// the splits shard 0 announces.
    pub fn set_balance(&mut self, link: Arc<BalanceLink>) {
        self.balance = Some(link);
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Where the sample stream stands, as the servers said when this
    /// worker connected.
    pub fn data_start(&self) -> DataStart {
        self.data
    }

    /// The step this worker continues from: 0 on a fresh run, the cluster's
    /// step (BSP) or the worker's own clock (ASP/SSP) when it rejoins.
    pub fn start_step(&self) -> u64 {
        self.core.borrow().start_step()
    }

    /// Reconnections to a lost or restarted server so far.
    pub fn recoveries(&self) -> u64 {
        self.core.borrow().recoveries()
    }

    /// The oldest shard version this worker holds.
    pub fn min_version(&self) -> u64 {
        self.core.borrow().min_version()
    }

    /// Round trips to shards so far.
    pub fn round_trips(&self) -> u64 {
        self.core.borrow().round_trips()
    }

    /// The simulated link's accounting (a no-op link counts nothing).
    pub fn link(&self) -> &LinkLimiter {
        &self.link
    }

    fn conn_of(&self, link: usize) -> (String, Connection) {
        let links = self.links.borrow();
        (links[link].server.clone(), links[link].conn.clone())
    }

    /// Send `frame` to the server of `link` and read the reply: through its
    /// same-host socket while that works, else over QUIC. A socket that
    /// fails (the server gone, or its key refused because the connection
    /// it came with closed) is dropped for QUIC until the next Welcome, and
    /// the request goes over QUIC at once; a request a server may see twice
    /// is one it can see twice anyway, as a retry.
    async fn send_frame(
        &self,
        link: usize,
        frame: &EncodedFrame,
    ) -> Result<(Response, usize), TransportError> {
        let (conn, local) = {
            let l = &self.links.borrow()[link];
            (l.conn.clone(), l.local.clone())
        };
        if let Some(local) = local {
            match ps_net::local::call(
                Path::new(&local.path),
                &local.key,
                frame,
                self.dialer.max_frame,
            )
            .await
            {
                Ok(done) => return Ok(done),
                Err(e) => {
                    let mut links = self.links.borrow_mut();
                    let l = &mut links[link];
                    if l.local.as_ref().is_some_and(|now| now.key == local.key) {
                        tracing::info!(
                            server = l.server,
                            path = local.path,
                            "same-host path unusable, staying on QUIC: {e}"
                        );
                        l.local = None;
                    }
                }
            }
        }
        transport::call_frame(&conn, frame, self.dialer.max_frame).await
    }

    /// At `at`, send `frame` to `shard`'s server through the (simulated)
    /// link, under the request deadline; the outcome as the core's event.
    async fn call(
        &self,
        token: Token,
        shard: ShardId,
        frame: EncodedFrame,
        at: std::time::Instant,
        what: &'static str,
    ) -> Event {
        sleep_until(at).await;
        let link = self.route[shard];
        let server = self.links.borrow()[link].server.clone();
        self.link.send(frame.len() as u64).await;
        let call = self.send_frame(link, &frame);
        let resp = match tokio::time::timeout(self.dialer.request_timeout, call).await {
            Ok(Ok((resp, read))) => {
                self.count(Copied {
                    read: read as u64,
                    decoded: response_vector_bytes(&resp) as u64,
                    ..Copied::default()
                });
                resp
            }
            Ok(Err(e)) => {
                return Event::ConnLost {
                    token,
                    shard,
                    error: format!("server {server}: {e}"),
                }
            }
            Err(_) => {
                let e = CommError::Deadline {
                    addr: server,
                    what,
                    secs: self.dialer.request_timeout.as_secs_f64(),
                };
                return Event::ConnLost {
                    token,
                    shard,
                    error: e.to_string(),
                };
            }
        };
        let received = match &resp {
            Response::Params { update, .. } => update_bytes(update) + 32,
            _ => 32,
        };
        self.link.receive(received).await;
        match resp {
            Response::Params {
                shard: 0,
                ref splits,
                ..
            } if !splits.is_empty() && self.balance.is_none() => Event::Refused {
                token,
                shard,
                code: ErrorCode::Internal,
                message: format!(
                    "server {server} balances the global batch across the workers (data.balance = \"throughput\"), this worker has data.balance = \"equal\"; give every process the same [data] section"
                ),
            },
            Response::Params {
                shard: wire_shard,
                version,
                next_step,
                live_workers,
                update,
                splits,
            } => {
                if let (0, Some(b)) = (wire_shard, &self.balance) {
                    b.learn(version, &splits);
                }
                Event::Reply {
                token,
                shard,
                params: Params {
                    version,
                    next_step,
                    live_workers,
                    received: update_bytes(&update),
                    update,
                    sent: frame.len() as u64,
                },
            }
            }
            Response::NormShare {
                step,
                sum_sq,
                total_sum_sq,
                ..
            } => Event::Share {
                token,
                shard,
                step,
                sum_sq,
                total: total_sum_sq,
            },
            Response::Error { code, message } => Event::Refused {
                token,
                shard,
                code,
                message: format!("server {server}: {message}"),
            },
            other => Event::Refused {
                token,
                shard,
                code: ErrorCode::Internal,
                message: format!("server {server}: unexpected reply to {what}: {other:?}"),
            },
        }
    }

    /// At `at`, make `link` usable: keep its connection when it is alive
    /// (unless the server said it is shutting down: then wait up to the
    /// connect timeout for it to close), else dial once and say Hello.
    async fn redial(&self, link: usize, at: std::time::Instant, await_close: bool) -> Event {
        sleep_until(at).await;
        let (server, conn) = self.conn_of(link);
        if conn.close_reason().is_none() {
            if !await_close {
                return Event::Reconnected {
                    link,
                    redialed: false,
                };
            }
            let _ = tokio::time::timeout(self.dialer.connect_timeout, conn.closed()).await;
        }
        match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == close::SHUTTING_DOWN.into() =>
            {
                tracing::warn!(
                    server,
                    "server is shutting down; redialing until it is back"
                );
            }
            reason => tracing::warn!(server, ?reason, "connection lost; reconnecting"),
        }
        match self.dialer.dial_once(&server).await {
            Ok(dialed) => {
                let mut links = self.links.borrow_mut();
                links[link].conn = dialed.conn;
                links[link].local = dialed.local;
                Event::Reconnected {
                    link,
                    redialed: true,
                }
            }
            Err(e) => Event::DialFailed {
                link,
                error: format!("server {server}: {e}"),
            },
        }
    }

    fn count(&self, c: Copied) {
        let mut all = self.copied.get();
        all.add(c);
        self.copied.set(all);
    }

    /// An encoded request, counted.
    fn encoded(&self, frame: EncodedFrame) -> EncodedFrame {
        self.count(Copied {
            encoded: frame.payload().len() as u64,
            ..Copied::default()
        });
        frame
    }

    /// The request frame of an offer of `shard` from `params`.
    fn offer_frame(
        &self,
        shard: usize,
        version: u64,
        next_step: u64,
        params: &[f32],
    ) -> Result<EncodedFrame, CommError> {
        let range = self.map.ranges()[shard].clone();
        let values = params.get(range.clone()).ok_or_else(|| {
            CommError::Layout(format!(
                "the trainer's {} parameters do not cover shard {shard} ({range:?})",
                params.len()
            ))
        })?;
        let frame =
            encode_offer(shard as u32, version, next_step, values).map_err(TransportError::from)?;
        Ok(self.encoded(frame))
    }

    /// The error the core's reason to give up is to the caller.
    fn gave_up(&self, why: GiveUp) -> CommError {
        match why {
            GiveUp::Refused {
                what,
                code,
                message,
                ..
            } => CommError::Refused {
                what,
                code,
                message,
            },
            GiveUp::Exhausted { attempts, last, .. } => CommError::GaveUp { attempts, last },
            GiveUp::Unreachable { link, secs, last } => CommError::Unreachable {
                addr: self.links.borrow()[link].server.clone(),
                secs: secs.round() as u64,
                last,
            },
            other => CommError::Client(other),
        }
    }

    /// Run one exchange (`start`: a join or a step whose per-shard
    /// gradients are `grads`) to its end: carry out the core's actions and
    /// feed their outcomes back.
    async fn drive(&self, start: Event, grads: &Pushes) -> Result<Delivery, CommError> {
        /// What wakes the driver: an event for the core, or a shard's
        /// streamed gradient handed over, whose push was waiting for it.
        enum Wake {
            Core(Event),
            Ready(Action),
        }
        let mut frames: Vec<Option<Frame>> = (0..self.route.len()).map(|_| None).collect();
        let mut params: Option<Rc<Vec<f32>>> = None;
        let mut inflight: FuturesUnordered<LocalBoxFuture<'_, Wake>> = FuturesUnordered::new();
        // The exchange's time budget is enforced even while every request
        // waits for its own deadline.
        let budget = self.core.borrow().settings().budget;
        let started = now();
        let mut actions = self.core.borrow_mut().handle(start, started);
        let deadline = started + budget + Duration::from_millis(1);
        inflight.push(Box::pin(async move {
            sleep_until(deadline).await;
            Wake::Core(Event::Tick)
        }));
        loop {
            for action in actions.drain(..) {
                match action {
                    Action::Send {
                        token,
                        shard,
                        step,
                        have_version,
                        at,
                    } => {
                        let reuse = frames[shard]
                            .as_ref()
                            .filter(|f| f.step == step && f.have_version == have_version)
                            .map(|f| f.bytes.clone());
                        if let (None, Some(pending)) = (&reuse, grads.pending(shard)) {
                            // Backward has not finished this shard yet: the
                            // push leaves once it has.
                            inflight.push(Box::pin(async move {
                                let _ = pending.await;
                                Wake::Ready(Action::Send {
                                    token,
                                    shard,
                                    step,
                                    have_version,
                                    at,
                                })
                            }));
                            continue;
                        }
                        let bytes = match reuse {
                            Some(b) => b,
                            None => {
                                let grad = grads.view(&self.map, shard).ok_or_else(|| {
                                    CommError::Layout(format!(
                                        "no gradient for shard {shard} (the trainer handed none over)"
                                    ))
                                })?;
                                let rate = self.balance.as_ref().map_or(0.0, |b| b.rate());
                                let frame =
                                    encode_step(shard as u32, step, have_version, rate, grad)
                                        .map_err(TransportError::from)?;
                                let bytes = self.encoded(frame);
                                frames[shard] = Some(Frame {
                                    step,
                                    have_version,
                                    bytes: bytes.clone(),
                                });
                                bytes
                            }
                        };
                        inflight.push(Box::pin(
                            self.call(token, shard, bytes, at, "step").map(Wake::Core),
                        ));
                    }
                    Action::Offer {
                        token,
                        shard,
                        version,
                        next_step,
                        at,
                    } => {
                        // The trainer's parameters do not change during an
                        // exchange: read them once.
                        let values = match &params {
                            Some(p) => p.clone(),
                            None => {
                                let p = Rc::new((self.params)().await);
                                params = Some(p.clone());
                                p
                            }
                        };
                        let bytes = self.offer_frame(shard, version, next_step, &values)?;
                        inflight.push(Box::pin(
                            self.call(token, shard, bytes, at, "offer").map(Wake::Core),
                        ));
                    }
                    Action::Total {
                        token,
                        shard,
                        step,
                        have_version,
                        total,
                        at,
                    } => {
                        let request = Request::NormTotal {
                            shard: shard as u32,
                            step,
                            have_version,
                            total_sum_sq: total,
                        };
                        let frame = encode_request_frame(&request).map_err(TransportError::from)?;
                        let bytes = self.encoded(frame);
                        inflight.push(Box::pin(
                            self.call(token, shard, bytes, at, "norm total")
                                .map(Wake::Core),
                        ));
                    }
                    Action::Reconnect {
                        link,
                        at,
                        await_close,
                    } => {
                        inflight.push(Box::pin(self.redial(link, at, await_close).map(Wake::Core)))
                    }
                    Action::Deliver(d) => return Ok(d),
                    Action::GiveUp(why) => {
                        // A run that another rank finished is a clean end,
                        // which the caller reports.
                        if !matches!(
                            why,
                            GiveUp::Refused {
                                code: ErrorCode::JobDone,
                                ..
                            }
                        ) {
                            tracing::warn!(rank = self.rank, "giving up: {why}");
                        }
                        return Err(self.gave_up(why));
                    }
                }
            }
            let event = match inflight.next().await {
                Some(Wake::Core(event)) => event,
                Some(Wake::Ready(send)) => {
                    actions.push(send);
                    continue;
                }
                None => {
                    return Err(CommError::Unexpected {
                        what: "exchange",
                        reply: "the client waits for nothing".into(),
                    })
                }
            };
            match &event {
                Event::Refused {
                    code: ErrorCode::JobDone,
                    ..
                } => {}
                Event::Refused { code, message, .. } => {
                    tracing::warn!(rank = self.rank, ?code, "request refused: {message}");
                }
                _ => {}
            }
            actions = self.core.borrow_mut().handle(event, now());
        }
    }

    /// Turn a delivery into updates for the trainer.
    fn updates(&self, d: Delivery) -> (Vec<ShardUpdate>, Traffic) {
        let traffic = Traffic {
            pushed: d.pushed_bytes,
            pulled: d.pulled_bytes,
            round_trips: d.round_trips,
            live_workers: d.live_workers,
            density: None,
            next_step: d.next_step,
            copied: self.copied.take(),
            fenced: d.fenced,
        };
        let updates = d
            .updates
            .into_iter()
            .map(|(shard, update)| ShardUpdate {
                offset: self.map.ranges()[shard].start,
                update,
            })
            .collect();
        (updates, traffic)
    }

    /// Offer the initial (or current) parameters to every shard and return
    /// the parameters every worker starts from.
    pub async fn join(&self) -> Result<(Vec<ShardUpdate>, Traffic), CommError> {
        self.copied.take();
        let d = self.drive(Event::JoinRequested, &Pushes::None).await?;
        Ok(self.updates(d))
    }

    /// Push this worker's gradient for its next step and return the
    /// parameters after it, one round trip per shard. Recovers from a lost or
    /// restarted server (reconnect, offer, send the step again), and moves
    /// to the cluster's step when fenced ([`Traffic::next_step`]).
    pub async fn step(&self, grad: Outgoing) -> Result<(Vec<ShardUpdate>, Traffic), CommError> {
        let pushes = match grad {
            Outgoing::Sparse(g) => Pushes::Sparse(
                self.map
                    .split(&g)
                    .into_iter()
                    .map(|g| WireGrad::from_sparse(g, self.f16))
                    .collect(),
            ),
            Outgoing::Dense(d) if self.f16 => Pushes::DenseF16(
                self.map
                    .split_dense(&d)
                    .into_iter()
                    .map(ps_shared::sparse::values_to_f16)
                    .collect(),
            ),
            Outgoing::Dense(d) => Pushes::Dense(d),
            Outgoing::Streamed(StreamedGrad(parts)) => {
                if parts.len() != self.map.num_shards() {
                    return Err(CommError::Layout(format!(
                        "a streamed gradient of {} shards for {} shards",
                        parts.len(),
                        self.map.num_shards()
                    )));
                }
                Pushes::Streamed(parts)
            }
        };
        self.copied.take();
        let d = self.drive(Event::StepRequested, &pushes).await?;
        if d.next_step > d.pushed_step + 1 && d.fenced == 0 {
            // Backup workers: this push was late and joined a later update.
            tracing::debug!(
                rank = self.rank,
                pushed = d.pushed_step,
                cluster = d.next_step,
                "late push folded into the cluster's next update; continuing at its step"
            );
        } else if d.next_step > d.pushed_step + 1 {
            tracing::warn!(
                rank = self.rank,
                pushed = d.pushed_step,
                cluster = d.next_step,
                fenced = d.fenced,
                "the cluster went on without this worker; continuing at its step"
            );
        }
        let out = self.updates(d);
        self.commit();
        Ok(out)
    }

    /// The trainer applies what the last call returned: remember it as held.
    pub(crate) fn commit(&self) {
        self.core.borrow_mut().handle(Event::Applied, now());
    }

    /// Backup workers: this worker's sample stream is done. Asks every
    /// shard for the make-up round with the steps of its plan never applied
    /// (`skipped`) and the batches it trained, and waits until every live
    /// rank asked. A wait that outlasts a request deadline (the slowest
    /// rank still trains) asks again, within the exchange's budget twice
    /// over; the shards must agree on the batches to make up.
    pub async fn make_up(&self, skipped: &[u64], trained: u64) -> Result<MakeUpRound, CommError> {
        let budget = self.core.borrow().settings().budget * 2;
        let started = tokio::time::Instant::now();
        let shards = self.route.len();
        let ask = |shard: usize| {
            let request = Request::MakeUp {
                shard: shard as u32,
                skipped: skipped.to_vec(),
                trained,
            };
            async move {
                loop {
                    let (server, conn) = self.conn_of(self.route[shard]);
                    let call = transport::call(&conn, &request, self.dialer.max_frame);
                    let waited = tokio::time::timeout(self.dialer.request_timeout, call).await;
                    match waited {
                        Ok(Ok((
                            Response::MakeUp {
                                next_step,
                                orphans,
                                trained,
                                ..
                            },
                            _,
                        ))) => {
                            return Ok(MakeUpRound {
                                orphans,
                                trained,
                                next_step,
                            })
                        }
                        Ok(Ok((
                            Response::Error {
                                code: ErrorCode::Timeout,
                                ..
                            },
                            _,
                        )))
                        | Err(_) => {}
                        Ok(Ok((other, _))) => return Err(refused("make_up", other)),
                        Ok(Err(e)) => return Err(e.into()),
                    }
                    // Not decided within a request deadline: ask again.
                    if started.elapsed() > budget {
                        return Err(CommError::Deadline {
                            addr: server,
                            what: "make_up",
                            secs: budget.as_secs_f64(),
                        });
                    }
                }
            }
        };
        let rounds = futures::future::join_all((0..shards).map(ask)).await;
        let mut decided: Option<MakeUpRound> = None;
        for (shard, round) in rounds.into_iter().enumerate() {
            let round = round?;
            // An update may have been made after this worker's last reply
            // (a straggler's late push): the make-up steps start there.
            self.core.borrow_mut().follow(shard, round.next_step);
            match &mut decided {
                None => decided = Some(round),
                Some(first) => {
                    if (&first.orphans, &first.trained) != (&round.orphans, &round.trained) {
                        return Err(CommError::Unexpected {
                            what: "make_up",
                            reply: format!(
                                "shard {shard} decided another make-up round than shard 0"
                            ),
                        });
                    }
                    first.next_step = first.next_step.min(round.next_step);
                }
            }
        }
        decided.ok_or_else(|| CommError::Layout("no shard to ask for the make-up round".into()))
    }

    /// Stop (`true`) or resume heartbeats: fault injection, what a paused
    /// process looks like to the servers.
    pub fn silence(&self, on: bool) {
        self.silent.set(on);
    }

    /// Send a heartbeat on every connection (errors are left to the next
    /// exchange); none while silenced.
    pub async fn heartbeat(&self) {
        if self.silent.get() {
            return;
        }
        let conns: Vec<Connection> = self.links.borrow().iter().map(|l| l.conn.clone()).collect();
        for conn in conns {
            let call = transport::call(&conn, &Request::Heartbeat, self.dialer.max_frame);
            let _ = tokio::time::timeout(self.heartbeat, call).await;
        }
    }

    /// Leave the cluster and close the connections: `finished` when this
    /// worker's work is done (it may not rejoin the run), not when it was
    /// told to stop (a replacement may take its rank).
    pub async fn bye(&self, finished: bool) -> Result<(), CommError> {
        let links: Vec<(String, Connection)> = self
            .links
            .borrow()
            .iter()
            .map(|l| (l.server.clone(), l.conn.clone()))
            .collect();
        for (server, conn) in links {
            let bye = Request::Bye { finished };
            let call = transport::call(&conn, &bye, self.dialer.max_frame);
            match tokio::time::timeout(self.dialer.request_timeout, call).await {
                Ok(Ok((Response::ByeAck, _))) => {}
                Ok(Ok((other, _))) => return Err(refused("bye", other)),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => {
                    return Err(CommError::Deadline {
                        addr: server,
                        what: "bye",
                        secs: self.dialer.request_timeout.as_secs_f64(),
                    })
                }
            }
            conn.close(close::BYE.into(), b"bye");
        }
        Ok(())
    }

    /// Stop the whole job (`Request::Abort`): tell every server why, so
    /// they refuse every rank's next step with the reason, then close the
    /// connections. Best effort: a server that does not answer within the
    /// request deadline learns it from the closed connection.
    pub async fn stop_job(&self, reason: &str) {
        let request = Request::Abort {
            reason: reason.to_string(),
        };
        for conn in self.tell_every_server(&request).await {
            conn.close(close::ABORTED.into(), b"job stopped");
        }
    }

    /// Sends `request` to every server at once, each within the request
    /// deadline, and returns the connections it went over.
    async fn tell_every_server(&self, request: &Request) -> Vec<Connection> {
        let conns: Vec<Connection> = self.links.borrow().iter().map(|l| l.conn.clone()).collect();
        let calls = conns.iter().map(|conn| {
            let call = transport::call(conn, request, self.dialer.max_frame);
            tokio::time::timeout(self.dialer.request_timeout, call)
        });
        futures::future::join_all(calls).await;
        conns
    }

    /// This rank reached the run's target (`Request::Finish`): tell every
    /// server, so they answer every other rank's next step with
    /// `JobDone`. The connections stay open for the goodbye. Best effort: a
    /// server that does not answer within the request deadline leaves the
    /// other ranks training until their own end.
    pub async fn finish_job(&self, reason: &str) {
        let request = Request::Finish {
            reason: reason.to_string(),
        };
        self.tell_every_server(&request).await;
    }

    /// Drop every connection without a goodbye (what a crash looks like).
    pub fn abort(&self) {
        for link in self.links.borrow().iter() {
            link.conn.close(close::ABORTED.into(), b"worker stopped");
        }
    }
}

/// Why one dial failed, and whether trying again may help.
enum DialFailure {
    /// Not reachable (yet), or our previous connection is not yet seen dead.
    Retry(String),
    /// Refused for good (a wrong token, layout or protocol).
    Fatal(CommError),
}

impl Dialer {
    /// One attempt to connect and authenticate within the connect timeout.
    async fn attempt(&self, server: &str, left: Duration) -> Result<Dialed, DialFailure> {
        let attempt = async {
            let addr = transport::resolve(server).await?;
            let endpoint = transport::client_endpoint(
                &self.tls.ca_pem,
                &self.tls.identity,
                addr.is_ipv6(),
                &self.limits,
            )?;
            let conn = transport::connect(&endpoint, addr, &self.server_name, left).await?;
            let (resp, _) = transport::call(&conn, &self.hello, self.max_frame).await?;
            Ok::<_, CommError>((conn, resp))
        };
        match tokio::time::timeout(left.max(Duration::from_millis(1)), attempt).await {
            Ok(Ok((
                conn,
                Response::Welcome {
                    shards,
                    data_step,
                    data_samples,
                    data_batch,
                    local,
                    ..
                },
            ))) => {
                let start = DataStart {
                    step: data_step,
                    samples: data_samples,
                    batch: data_batch,
                };
                Ok(Dialed {
                    conn,
                    shards,
                    start,
                    local: local.filter(|_| self.local_path),
                })
            }
            Ok(Ok((
                _,
                Response::Error {
                    code: ErrorCode::RankInUse,
                    message,
                },
            ))) => Err(DialFailure::Retry(message)),
            Ok(Ok((_, other))) => Err(DialFailure::Fatal(refused("hello", other))),
            Ok(Err(e)) => Err(DialFailure::Retry(e.to_string())),
            Err(_) => Err(DialFailure::Retry("timed out".to_string())),
        }
    }

    /// One redial for the client core (which owns the backoff).
    async fn dial_once(&self, server: &str) -> Result<Dialed, String> {
        self.attempt(server, self.connect_timeout)
            .await
            .map_err(|f| match f {
                DialFailure::Retry(m) => m,
                DialFailure::Fatal(e) => e.to_string(),
            })
    }

    /// Connect (with backoff, within the connect timeout) and authenticate;
    /// returns the shards the server owns and where the sample stream stands.
    async fn dial(&self, server: &str) -> Result<Dialed, CommError> {
        let start = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            let left = self.connect_timeout.saturating_sub(start.elapsed());
            let last = match self.attempt(server, left).await {
                Ok(done) => return Ok(done),
                Err(DialFailure::Fatal(e)) => return Err(e),
                Err(DialFailure::Retry(last)) => last,
            };
            if start.elapsed() + backoff > self.connect_timeout {
                return Err(CommError::Unreachable {
                    addr: server.to_string(),
                    secs: self.connect_timeout.as_secs(),
                    last,
                });
            }
            tracing::debug!(server, "connect failed, retrying: {last}");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// The actor face of [`Comm`].
pub struct CommActor {
    comm: Rc<Comm>,
}

impl CommActor {
    pub fn new(comm: Comm) -> Self {
        Self {
            comm: Rc::new(comm),
        }
    }
}

impl Actor for CommActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let every = self.comm.heartbeat;
        ctx.run_interval(every, |act, ctx| {
            let comm = act.comm.clone();
            ctx.spawn(async move { comm.heartbeat().await }.into_actor(act));
        });
    }
}

/// Offer the worker's parameters; returns the parameters to start from, the
/// step to continue from and the traffic.
#[derive(Message)]
#[rtype(result = "Result<(Vec<ShardUpdate>, u64, Traffic), CommError>")]
pub struct Join;

impl Handler<Join> for CommActor {
    type Result = ResponseFuture<Result<(Vec<ShardUpdate>, u64, Traffic), CommError>>;
    fn handle(&mut self, _: Join, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move {
            let (updates, traffic) = comm.join().await?;
            comm.commit();
            Ok((updates, comm.start_step(), traffic))
        })
    }
}

/// Push a step's gradient and receive the new parameters.
#[derive(Message)]
#[rtype(result = "Result<(Vec<ShardUpdate>, Traffic), CommError>")]
pub struct StepExchange {
    pub grad: Outgoing,
}

impl Handler<StepExchange> for CommActor {
    type Result = ResponseFuture<Result<(Vec<ShardUpdate>, Traffic), CommError>>;
    fn handle(&mut self, msg: StepExchange, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move { comm.step(msg.grad).await })
    }
}

/// Backup workers: ask for the make-up round ([`Comm::make_up`]).
#[derive(Message)]
#[rtype(result = "Result<MakeUpRound, CommError>")]
pub struct MakeUp {
    pub skipped: Vec<u64>,
    pub trained: u64,
}

impl Handler<MakeUp> for CommActor {
    type Result = ResponseFuture<Result<MakeUpRound, CommError>>;
    fn handle(&mut self, msg: MakeUp, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move { comm.make_up(&msg.skipped, msg.trained).await })
    }
}

/// Stop or resume heartbeats (fault injection: a paused worker).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Silence(pub bool);

impl Handler<Silence> for CommActor {
    type Result = ();
    fn handle(&mut self, msg: Silence, _: &mut Context<Self>) {
        self.comm.silence(msg.0);
    }
}

/// What a worker's connections did over the run.
#[derive(Debug, Clone, Copy)]
pub struct CommSummary {
    /// Reconnections to a lost or restarted server.
    pub recoveries: u64,
    /// The oldest shard version held at the end.
    pub final_version: u64,
    /// Link time the simulated link (`[link]`) charged, summed over messages.
    pub link_simulated_secs: f64,
    /// Bytes the link carried from the worker (or its node) to the servers.
    pub link_sent_bytes: u64,
    /// Bytes the link carried from the servers to the worker (or its node).
    pub link_received_bytes: u64,
}

impl CommSummary {
    /// What `comm` did so far.
    pub fn of(comm: &Comm) -> Self {
        let link = comm.link().stats();
        Self {
            recoveries: comm.recoveries(),
            final_version: comm.min_version(),
            link_simulated_secs: link.simulated_secs,
            link_sent_bytes: link.sent_bytes,
            link_received_bytes: link.received_bytes,
        }
    }
}

/// Say goodbye to every server, then stop the actor: `finished` when the
/// work is done, not when the worker was told to stop.
#[derive(Message)]
#[rtype(result = "Result<CommSummary, CommError>")]
pub struct Leave {
    pub finished: bool,
}

impl Handler<Leave> for CommActor {
    type Result = ResponseActFuture<Self, Result<CommSummary, CommError>>;
    fn handle(&mut self, msg: Leave, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(
            async move {
                comm.bye(msg.finished).await?;
                Ok(CommSummary::of(&comm))
            }
            .into_actor(self)
            .map(|result, _, ctx| {
                ctx.stop();
                result
            }),
        )
    }
}

/// Stop the whole job, naming the reason to every server, and stop.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopJob(pub String);

impl Handler<StopJob> for CommActor {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, msg: StopJob, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(
            async move { comm.stop_job(&msg.0).await }
                .into_actor(self)
                .map(|(), _, ctx| ctx.stop()),
        )
    }
}

/// This rank reached the run's target: every server hears that the job is
/// done (see [`Comm::finish_job`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct FinishJob(pub String);

impl Handler<FinishJob> for CommActor {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, msg: FinishJob, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move { comm.finish_job(&msg.0).await }.into_actor(self))
    }
}

/// Drop every connection without a goodbye and stop: what a crashed worker
/// looks like to the servers (used by fault-injection tests).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Abort;

impl Handler<Abort> for CommActor {
    type Result = ();
    fn handle(&mut self, _: Abort, ctx: &mut Context<Self>) {
        self.comm.abort();
        ctx.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(pushes: &Pushes, map: &ShardMap) -> Vec<Option<Vec<f32>>> {
        (0..map.num_shards())
            .map(|s| match pushes.view(map, s) {
                Some(GradView::Dense(ValuesView::F32(v))) => Some(v.to_vec()),
                Some(GradView::Dense(ValuesView::F16(v))) => {
                    Some(ps_shared::sparse::values_from_f16(v))
                }
                _ => None,
            })
            .collect()
    }

    /// A sink and the driver's view of what it hands over.
    fn streamed(map: &ShardMap, f16: bool) -> (GradSink, Pushes) {
        let (sink, grad) = GradSink::new(map, f16);
        let Outgoing::Streamed(StreamedGrad(parts)) = grad else {
            panic!("a streamed gradient")
        };
        (sink, Pushes::Streamed(parts))
    }

    #[test]
    fn a_sink_hands_over_each_shard_once_its_whole_range_is_final() {
        let map = ShardMap::balanced(10, 3).unwrap();
        let (mut sink, pushes) = streamed(&map, false);
        let grads: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let last = map.ranges()[2].clone();
        // Final from inside the last shard: nothing leaves yet.
        assert_eq!(sink.offer(last.start + 1, &grads, 2.0), 0);
        assert!(pushes.pending(2).is_some());
        // The last shard's whole range is final: it leaves, scaled.
        assert_eq!(sink.offer(last.start, &grads, 2.0), 1);
        assert!(pushes.pending(2).is_none());
        assert!(pushes.pending(0).is_some() && pushes.pending(1).is_some());
        let got = ready(&pushes, &map);
        let want: Vec<f32> = grads[last].iter().map(|v| v * 2.0).collect();
        assert_eq!(got[2].as_deref(), Some(&want[..]));
        assert_eq!(got[0], None);
        // The rest at the end; nothing leaves twice.
        assert_eq!(sink.offer(0, &grads, 2.0), 2);
        assert_eq!(sink.offer(0, &grads, 2.0), 0);
        let got = ready(&pushes, &map);
        let all: Vec<f32> = got.into_iter().flat_map(Option::unwrap).collect();
        assert_eq!(all, grads.iter().map(|v| v * 2.0).collect::<Vec<_>>());
    }

    #[test]
    fn a_sink_rounds_to_f16_and_a_dropped_sink_leaves_no_gradient() {
        let map = ShardMap::balanced(4, 2).unwrap();
        let (mut sink, pushes) = streamed(&map, true);
        sink.offer(2, &[0.0, 0.0, 1.5, -0.25], 1.0);
        assert!(matches!(
            pushes.view(&map, 1),
            Some(GradView::Dense(ValuesView::F16(_)))
        ));
        assert_eq!(ready(&pushes, &map)[1], Some(vec![1.5, -0.25]));
        // The trainer failed before shard 0 was final: it never comes.
        drop(sink);
        assert!(pushes.pending(0).is_none(), "nothing to wait for");
        assert!(pushes.view(&map, 0).is_none());
    }

    #[test]
    fn a_sink_hands_over_each_final_shards_own_selection_and_stops_at_an_error() {
        let map = ShardMap::balanced(6, 3).unwrap();
        let (mut sink, pushes) = streamed(&map, false);
        let grads = [0.1, -3.0, 0.2, 0.3, 5.0, -0.4];
        // Each shard's largest entry, local index.
        let mut largest = |shard: usize, _: std::ops::Range<usize>, part: &[f32]| {
            let (i, &v) = part
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            if shard == 0 {
                return Err("shard 0 refused");
            }
            Ok(ShardPush::Sparse(SparseGrad {
                indices: vec![i as u32],
                values: vec![v],
            }))
        };
        assert_eq!(sink.offer_with(2, &grads, &mut largest), Ok(2));
        for (shard, (index, value)) in [(1, (1, 0.3)), (2, (0, 5.0))] {
            let Some(GradView::Sparse {
                indices,
                values: ValuesView::F32(values),
            }) = pushes.view(&map, shard)
            else {
                panic!("shard {shard} is sparse, f32")
            };
            assert_eq!(indices, &[index]);
            assert_eq!(values, &[value]);
        }
        // A selection that fails stops the offer: its shard stays pending.
        assert_eq!(
            sink.offer_with(0, &grads, &mut largest),
            Err("shard 0 refused")
        );
        assert!(pushes.pending(0).is_some());
    }
}

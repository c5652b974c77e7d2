//! Talking to the parameter servers: `Comm` (plain async) and `CommActor`.
//!
//! A worker holds one QUIC connection per server process, authenticated by
//! its own client certificate. A step is **one round trip per shard**: the
//! `Step` request carries the gradient of step `t` and the version the worker
//! holds, and its reply carries the parameters for step `t + 1` (a sparse
//! delta when that is cheaper). All shards go concurrently.
//!
//! Every request has a deadline. When a server is lost (its connection dies,
//! or it closes with "shutting down"), the worker redials it for up to
//! `server.connect_timeout_secs`, offers its copy of that server's shards
//! (a restarted server rebuilds them from the workers' copies) and sends the
//! step again; `Step` is idempotent on the server, so a retry never counts a
//! push twice. A server that stays unreachable ends the run with an error
//! naming it.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::future::{join_all, try_join_all};
use quinn::Connection;

use ps_shared::config::ClusterConfig;
use ps_shared::link::{LinkLimiter, LinkSection};
use ps_shared::pki::CertPair;
use ps_shared::protocol::{
    close, encode_request, encoded_indices_len, ErrorCode, ParamUpdate, Request, Response,
    ShardRange, WireGrad, WireValues, PROTOCOL_VERSION,
};
use ps_shared::shard::ShardMap;
use ps_shared::sparse::SparseGrad;
use ps_shared::transport::{self, EndpointLimits, TransportError};

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

impl CommError {
    /// Whether reconnecting and offering again may fix it.
    fn needs_reconnect(&self) -> bool {
        match self {
            CommError::Transport(_) | CommError::Deadline { .. } => true,
            CommError::Refused { code, .. } => matches!(
                code,
                ErrorCode::UnknownWorker | ErrorCode::ShuttingDown | ErrorCode::NotInitialized
            ),
            _ => false,
        }
    }

    /// Whether simply sending the (idempotent) request again may fix it.
    fn retry_as_is(&self) -> bool {
        matches!(
            self,
            CommError::Refused {
                code: ErrorCode::Timeout | ErrorCode::RateLimited,
                ..
            }
        )
    }
}

/// A gradient ready to push: sparse (global indices) or dense.
#[derive(Debug, Clone)]
pub enum Outgoing {
    Sparse(SparseGrad),
    Dense(Vec<f32>),
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
}

/// Attempts of one step before giving up (each may include a reconnect
/// bounded by `server.connect_timeout_secs`).
const MAX_ATTEMPTS: u32 = 8;

/// What one shard's request left behind.
struct ShardReply {
    update: ParamUpdate,
    version: u64,
    next_step: u64,
    live_workers: u32,
    pushed: u64,
    pulled: u64,
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
    /// Serialises reconnects of one link.
    dialing: Vec<futures::lock::Mutex<()>>,
    dialer: Dialer,
    map: ShardMap,
    /// Which link serves each shard.
    route: Vec<usize>,
    /// The version of each shard the worker holds once it applied what the
    /// last call returned.
    versions: RefCell<Vec<Option<u64>>>,
    /// The versions the trainer holds (applied), for offers.
    held: RefCell<Vec<Option<u64>>>,
    /// The step each shard expects from this worker next.
    next_steps: RefCell<Vec<u64>>,
    recoveries: Cell<u64>,
    round_trips: Cell<u64>,
    heartbeat: Duration,
    f16: bool,
    link: LinkLimiter,
    params: ParamSource,
}

/// Bytes an update takes on the wire (values, and delta-encoded indices).
fn update_bytes(u: &ParamUpdate) -> u64 {
    match u {
        ParamUpdate::Dense(v) => 4 * v.len() as u64,
        ParamUpdate::Sparse { indices, values } => {
            (encoded_indices_len(indices) + 4 * values.len()) as u64
        }
    }
}

/// `newer` applied on top of `older` (both for the same shard).
fn merge_updates(older: ParamUpdate, newer: ParamUpdate) -> ParamUpdate {
    match (older, newer) {
        (_, dense @ ParamUpdate::Dense(_)) => dense,
        (ParamUpdate::Dense(mut base), ParamUpdate::Sparse { indices, values }) => {
            for (i, v) in indices.iter().zip(values) {
                if let Some(slot) = base.get_mut(*i as usize) {
                    *slot = v;
                }
            }
            ParamUpdate::Dense(base)
        }
        (
            ParamUpdate::Sparse {
                indices: ia,
                values: va,
            },
            ParamUpdate::Sparse {
                indices: ib,
                values: vb,
            },
        ) => {
            let mut merged: std::collections::BTreeMap<u32, f32> = ia.into_iter().zip(va).collect();
            merged.extend(ib.into_iter().zip(vb));
            let (indices, values) = merged.into_iter().unzip();
            ParamUpdate::Sparse { indices, values }
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
    /// simulated `link` (see [`ps_shared::simulate`]).
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
            limits: EndpointLimits {
                idle_timeout: ps_shared::config::secs(cfg.server.idle_timeout_secs),
                keep_alive: ps_shared::config::secs(cfg.server.heartbeat_secs),
                max_bidi_streams: (4 * cfg.cluster.shards_per_server + 16) as u32,
            },
            connect_timeout: Duration::from_secs(cfg.server.connect_timeout_secs),
            request_timeout: ps_shared::config::secs(cfg.server.request_timeout_secs),
            max_frame: cfg.server.max_frame_bytes,
        };
        let mut data: Option<DataStart> = None;
        for (i, server) in cfg.cluster.servers.iter().enumerate() {
            let (conn, shards, start) = dialer.dial(server).await?;
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
            links.push(Link {
                server: server.clone(),
                conn,
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
        Ok(Self {
            rank,
            data,
            dialing: links
                .iter()
                .map(|_| futures::lock::Mutex::new(()))
                .collect(),
            links: RefCell::new(links),
            dialer,
            next_steps: RefCell::new(vec![0; map.num_shards()]),
            versions: RefCell::new(vec![None; map.num_shards()]),
            held: RefCell::new(vec![None; map.num_shards()]),
            recoveries: Cell::new(0),
            round_trips: Cell::new(0),
            heartbeat: ps_shared::config::secs(cfg.server.heartbeat_secs),
            map,
            route,
            f16: cfg.compression.f16_values,
            link: LinkLimiter::new(link),
            params,
        })
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
        self.next_steps.borrow().iter().copied().min().unwrap_or(0)
    }

    /// Reconnections and re-offers so far.
    pub fn recoveries(&self) -> u64 {
        self.recoveries.get()
    }

    /// The oldest shard version this worker holds.
    pub fn min_version(&self) -> u64 {
        self.versions
            .borrow()
            .iter()
            .map(|v| v.unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// Round trips to shards so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.get()
    }

    /// The simulated link's accounting (a no-op link counts nothing).
    pub fn link(&self) -> &LinkLimiter {
        &self.link
    }

    fn conn_of(&self, link: usize) -> (String, Connection) {
        let links = self.links.borrow();
        (links[link].server.clone(), links[link].conn.clone())
    }

    /// One request to a shard's server through the (simulated) link, under
    /// the request deadline; returns the response and the request's size.
    async fn exchange(
        &self,
        shard: usize,
        req: &Request,
        what: &'static str,
    ) -> Result<(Response, u64), CommError> {
        let (server, conn) = self.conn_of(self.route[shard]);
        let frame = encode_request(req).map_err(TransportError::from)?;
        self.link.send(frame.len() as u64).await;
        self.round_trips.set(self.round_trips.get() + 1);
        let call = transport::call_raw(&conn, &frame, self.dialer.max_frame);
        let resp = match tokio::time::timeout(self.dialer.request_timeout, call).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(CommError::Deadline {
                    addr: server,
                    what,
                    secs: self.dialer.request_timeout.as_secs_f64(),
                })
            }
        };
        let received = match &resp {
            Response::Params { update, .. } => update_bytes(update) + 32,
            _ => 32,
        };
        self.link.receive(received).await;
        Ok((resp, frame.len() as u64))
    }

    fn shard_reply(
        what: &'static str,
        resp: Response,
        pushed: u64,
    ) -> Result<ShardReply, CommError> {
        match resp {
            Response::Params {
                version,
                next_step,
                live_workers,
                update,
                ..
            } => Ok(ShardReply {
                pulled: update_bytes(&update),
                update,
                version,
                next_step,
                live_workers,
                pushed,
            }),
            other => Err(refused(what, other)),
        }
    }

    /// Offer this worker's copy of `shard` (values from `params`) at the
    /// version it holds; the reply is the shard's parameters.
    async fn offer(&self, shard: usize, params: &[f32]) -> Result<ShardReply, CommError> {
        let range = self.map.ranges()[shard].clone();
        let req = Request::Offer {
            shard: shard as u32,
            version: self.versions.borrow()[shard].unwrap_or(0),
            next_step: self.next_steps.borrow()[shard],
            values: params[range].to_vec(),
        };
        let (resp, sent) = self.exchange(shard, &req, "offer").await?;
        Self::shard_reply("offer", resp, sent)
    }

    /// Offer the initial (or current) parameters to every shard and return
    /// the parameters every worker starts from.
    pub async fn join(&self) -> Result<(Vec<ShardUpdate>, Traffic), CommError> {
        let params = (self.params)().await;
        let shards: Vec<usize> = (0..self.map.num_shards()).collect();
        let replies = try_join_all(shards.iter().map(|&s| self.offer(s, &params))).await?;
        let mut traffic = Traffic {
            live_workers: u32::MAX,
            ..Traffic::default()
        };
        let updates = self.absorb(
            shards.into_iter().zip(replies).map(|(s, r)| (s, Some(r))),
            &mut traffic,
        );
        Ok((updates, traffic))
    }

    /// Record replies and turn them into updates for the trainer.
    fn absorb(
        &self,
        replies: impl Iterator<Item = (usize, Option<ShardReply>)>,
        traffic: &mut Traffic,
    ) -> Vec<ShardUpdate> {
        let mut out = Vec::new();
        for (shard, r) in replies {
            let Some(r) = r else { continue };
            self.versions.borrow_mut()[shard] = Some(r.version);
            self.next_steps.borrow_mut()[shard] = r.next_step;
            traffic.pushed += r.pushed;
            traffic.pulled += r.pulled;
            traffic.live_workers = traffic.live_workers.min(r.live_workers);
            out.push(ShardUpdate {
                offset: self.map.ranges()[shard].start,
                update: r.update,
            });
        }
        out
    }

    /// Replace the connection of `link` if it is dead: redial with backoff
    /// (up to `server.connect_timeout_secs`) and say Hello. Returns whether
    /// it reconnected.
    /// `stopping`: the server said it is shutting down; wait (up to the
    /// connect timeout) for it to close the connection, then redial.
    async fn reconnect(&self, link: usize, stopping: bool) -> Result<bool, CommError> {
        let _only_one = self.dialing[link].lock().await;
        let (server, conn) = self.conn_of(link);
        if conn.close_reason().is_none() {
            if !stopping {
                return Ok(false);
            }
            let _ = tokio::time::timeout(self.dialer.connect_timeout, conn.closed()).await;
        }
        match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c))
                if c.error_code == close::SHUTTING_DOWN.into() =>
            {
                tracing::warn!(
                    server,
                    "server is shutting down; waiting up to {:?} for it to come back",
                    self.dialer.connect_timeout
                );
            }
            reason => tracing::warn!(server, ?reason, "connection lost; reconnecting"),
        }
        let (conn, _, _) = self.dialer.dial(&server).await?;
        self.links.borrow_mut()[link].conn = conn;
        self.recoveries.set(self.recoveries.get() + 1);
        Ok(true)
    }

    /// Push this worker's gradient for its next step and return the
    /// parameters after it, one round trip per shard. Recovers from a lost or
    /// restarted server (reconnect, offer, send the step again).
    pub async fn step(&self, grad: Outgoing) -> Result<(Vec<ShardUpdate>, Traffic), CommError> {
        let per_shard: Vec<WireGrad> = match grad {
            Outgoing::Sparse(g) => self
                .map
                .split(&g)
                .into_iter()
                .map(|g| WireGrad::from_sparse(g, self.f16))
                .collect(),
            Outgoing::Dense(d) => self
                .map
                .split_dense(&d)
                .into_iter()
                .map(|part| WireGrad::Dense(WireValues::encode(part.to_vec(), self.f16)))
                .collect(),
        };
        let n = per_shard.len();
        // The step this call pushes to each shard.
        let pushed_steps: Vec<u64> = self.next_steps.borrow().clone();
        let round_trips_before = self.round_trips.get();
        let mut results: Vec<Option<ShardReply>> = (0..n).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..n).collect();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let per_shard = &per_shard;
            let outcomes = join_all(pending.iter().map(|&s| async move {
                let req = Request::Step {
                    shard: s as u32,
                    step: self.next_steps.borrow()[s],
                    have_version: self.versions.borrow()[s],
                    grad: per_shard[s].clone(),
                };
                let r = match self.exchange(s, &req, "step").await {
                    Ok((resp, sent)) => Self::shard_reply("step", resp, sent),
                    Err(e) => Err(e),
                };
                (s, r)
            }))
            .await;
            let mut failed_links = std::collections::BTreeSet::new();
            let mut stopping = std::collections::BTreeSet::new();
            let mut retry = Vec::new();
            let mut last = None;
            for (s, r) in outcomes {
                match r {
                    Ok(reply) => {
                        // Later replies supersede earlier ones of this call.
                        self.versions.borrow_mut()[s] = Some(reply.version);
                        self.next_steps.borrow_mut()[s] = reply.next_step;
                        results[s] = Some(match results[s].take() {
                            None => reply,
                            Some(prev) => ShardReply {
                                update: merge_updates(prev.update, reply.update),
                                pushed: prev.pushed + reply.pushed,
                                pulled: prev.pulled + reply.pulled,
                                ..reply
                            },
                        });
                    }
                    Err(e) if e.needs_reconnect() => {
                        if matches!(
                            e,
                            CommError::Refused {
                                code: ErrorCode::ShuttingDown,
                                ..
                            }
                        ) {
                            stopping.insert(self.route[s]);
                        }
                        failed_links.insert(self.route[s]);
                        last = Some(e.to_string());
                    }
                    Err(e) if e.retry_as_is() => {
                        retry.push(s);
                        last = Some(e.to_string());
                    }
                    Err(e) => return Err(e),
                }
            }
            if failed_links.is_empty() && retry.is_empty() {
                break;
            }
            if attempts >= MAX_ATTEMPTS {
                return Err(CommError::GaveUp {
                    attempts,
                    last: last.unwrap_or_default(),
                });
            }
            tracing::warn!(
                rank = self.rank,
                attempts,
                "step needs a retry: {}",
                last.unwrap_or_default()
            );
            // A lost server: reconnect, offer every shard it serves, then send
            // the step again to each shard that has not applied it yet. A
            // shard whose recovered copy is past this step (the server
            // applied it and died before this worker had the reply) answers
            // the offer with the parameters after it: that is this step's
            // reply, and pushing the gradient again would count it twice.
            let params = if failed_links.is_empty() {
                Vec::new()
            } else {
                (self.params)().await
            };
            pending = retry;
            let mut applied = std::collections::BTreeSet::new();
            for link in failed_links {
                self.reconnect(link, stopping.contains(&link)).await?;
                let shards: Vec<usize> = (0..n).filter(|s| self.route[*s] == link).collect();
                // The offers describe what the trainer holds: the versions
                // before this call's replies.
                for &s in &shards {
                    if results[s].take().is_some() {
                        self.versions.borrow_mut()[s] = self.held_before(s);
                        self.next_steps.borrow_mut()[s] = pushed_steps[s];
                    }
                }
                let offers = try_join_all(shards.iter().map(|&s| self.offer(s, &params))).await?;
                for (&s, reply) in shards.iter().zip(offers) {
                    self.versions.borrow_mut()[s] = Some(reply.version);
                    self.next_steps.borrow_mut()[s] = reply.next_step;
                    if reply.next_step > pushed_steps[s] {
                        applied.insert(s);
                    } else {
                        pending.push(s);
                    }
                    results[s] = Some(reply);
                }
            }
            pending.retain(|s| !applied.contains(s));
            pending.sort_unstable();
            pending.dedup();
        }
        let mut traffic = Traffic {
            live_workers: u32::MAX,
            ..Traffic::default()
        };
        let updates = self.absorb(results.into_iter().enumerate(), &mut traffic);
        self.commit();
        traffic.round_trips = self.round_trips.get() - round_trips_before;
        Ok((updates, traffic))
    }

    /// The version the trainer held for `shard` when the current call began.
    fn held_before(&self, shard: usize) -> Option<u64> {
        self.held.borrow()[shard]
    }

    /// The trainer applies what this call returned: remember it as held.
    pub(crate) fn commit(&self) {
        *self.held.borrow_mut() = self.versions.borrow().clone();
    }

    /// Send a heartbeat on every connection (errors are left to the next exchange).
    pub async fn heartbeat(&self) {
        let conns: Vec<Connection> = self.links.borrow().iter().map(|l| l.conn.clone()).collect();
        for conn in conns {
            let call = transport::call(&conn, &Request::Heartbeat, self.dialer.max_frame);
            let _ = tokio::time::timeout(self.heartbeat, call).await;
        }
    }

    /// Leave the cluster and close the connections.
    pub async fn bye(&self) -> Result<(), CommError> {
        let links: Vec<(String, Connection)> = self
            .links
            .borrow()
            .iter()
            .map(|l| (l.server.clone(), l.conn.clone()))
            .collect();
        for (server, conn) in links {
            let call = transport::call(&conn, &Request::Bye, self.dialer.max_frame);
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

    /// Drop every connection without a goodbye (what a crash looks like).
    pub fn abort(&self) {
        for link in self.links.borrow().iter() {
            link.conn.close(close::ABORTED.into(), b"worker stopped");
        }
    }
}

impl Dialer {
    /// Connect (with backoff, within the connect timeout) and authenticate;
    /// returns the shards the server owns and where the sample stream stands.
    async fn dial(
        &self,
        server: &str,
    ) -> Result<(Connection, Vec<ShardRange>, DataStart), CommError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            let left = self.connect_timeout.saturating_sub(start.elapsed());
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
            let last = match tokio::time::timeout(left.max(Duration::from_millis(1)), attempt).await
            {
                Ok(Ok((
                    conn,
                    Response::Welcome {
                        shards,
                        data_step,
                        data_samples,
                        data_batch,
                        ..
                    },
                ))) => {
                    let start = DataStart {
                        step: data_step,
                        samples: data_samples,
                        batch: data_batch,
                    };
                    return Ok((conn, shards, start));
                }
                // Our previous connection is not yet seen dead: try again.
                Ok(Ok((
                    _,
                    Response::Error {
                        code: ErrorCode::RankInUse,
                        message,
                    },
                ))) => message,
                Ok(Ok((_, other))) => return Err(refused("hello", other)),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "timed out".to_string(),
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

/// Say goodbye to every server, then stop the actor.
#[derive(Message)]
#[rtype(result = "Result<CommSummary, CommError>")]
pub struct Leave;

impl Handler<Leave> for CommActor {
    type Result = ResponseActFuture<Self, Result<CommSummary, CommError>>;
    fn handle(&mut self, _: Leave, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(
            async move {
                comm.bye().await?;
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

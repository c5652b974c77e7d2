//! Talking to the parameter servers: `Comm` (plain async) and `CommActor`.
//!
//! A worker holds one QUIC connection per server process. A step's gradient is
//! split by shard range and every shard gets its push and then its pull on
//! streams of their own, all shards concurrently; the pull names the version
//! the worker already holds so the server can answer with a sparse delta.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::future::try_join_all;
use quinn::Connection;

use ps_shared::config::ClusterConfig;
use ps_shared::link::LinkLimiter;
use ps_shared::protocol::{
    encode_request, ErrorCode, ParamUpdate, Request, Response, ShardRange, WireGrad, WireValues,
    PROTOCOL_VERSION,
};
use ps_shared::shard::ShardMap;
use ps_shared::sparse::SparseGrad;
use ps_shared::transport::{self, TransportError};

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
    #[error("could not reach server {addr} within {secs} s: {last}")]
    Unreachable {
        addr: String,
        secs: u64,
        last: String,
    },
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

/// Bytes moved by one exchange.
#[derive(Debug, Clone, Copy, Default)]
pub struct Traffic {
    pub pushed: u64,
    pub pulled: u64,
}

struct Link {
    server: String,
    conn: Connection,
}

/// What reconnecting needs.
struct Dialer {
    hello: Request,
    server_name: String,
    ca_pem: String,
    timeout: Duration,
}

/// Times a failed exchange is recovered (reconnect and/or resync) before giving up.
const MAX_RECOVERIES: u32 = 5;

/// Connections to every server process and the shard routing.
pub struct Comm {
    rank: u32,
    links: RefCell<Vec<Link>>,
    dialer: Dialer,
    /// The step each shard expects from this worker next.
    next_steps: RefCell<Vec<u64>>,
    recoveries: std::cell::Cell<u64>,
    heartbeat: Duration,
    map: ShardMap,
    /// Which link serves each shard.
    route: Vec<usize>,
    versions: RefCell<Vec<Option<u64>>>,
    max_frame: usize,
    f16: bool,
    /// Simulated link limits (`[link]`); a no-op when unlimited.
    link: LinkLimiter,
}

fn update_bytes(u: &ParamUpdate) -> u64 {
    match u {
        ParamUpdate::Dense(v) => 4 * v.len() as u64,
        ParamUpdate::Sparse { indices, values } => 4 * (indices.len() + values.len()) as u64,
    }
}

impl Comm {
    /// Connect to every server (retrying until `server.connect_timeout_secs`),
    /// authenticate, and check that the servers' shards tile the parameter space.
    pub async fn connect(cfg: &ClusterConfig, rank: u32, ca_pem: &str) -> Result<Self, CommError> {
        let num_params = cfg.model.num_params();
        let map = ShardMap::balanced(num_params, cfg.total_shards())
            .map_err(|e| CommError::Layout(e.to_string()))?;
        let mut links = Vec::new();
        let mut route = vec![usize::MAX; map.num_shards()];
        let hello = Request::Hello {
            protocol_version: PROTOCOL_VERSION,
            token: cfg.cluster.token.clone(),
            worker_rank: rank,
            num_params: num_params as u64,
            layout_hash: cfg.model.layout_hash(),
        };
        let timeout = Duration::from_secs(cfg.server.connect_timeout_secs);
        let dialer = Dialer {
            hello,
            server_name: cfg.tls.server_name.clone(),
            ca_pem: ca_pem.to_string(),
            timeout,
        };
        for (i, server) in cfg.cluster.servers.iter().enumerate() {
            let (conn, shards) = dialer.dial(server, cfg.server.max_frame_bytes).await?;
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
        Ok(Self {
            rank,
            links: RefCell::new(links),
            dialer,
            next_steps: RefCell::new(vec![0; map.num_shards()]),
            recoveries: std::cell::Cell::new(0),
            heartbeat: Duration::from_secs_f64(cfg.server.heartbeat_secs),
            versions: RefCell::new(vec![None; map.num_shards()]),
            map,
            route,
            max_frame: cfg.server.max_frame_bytes,
            f16: cfg.compression.f16_values,
            link: LinkLimiter::new(&cfg.link),
        })
    }

    fn conn(&self, shard: usize) -> Connection {
        self.links.borrow()[self.route[shard]].conn.clone()
    }

    /// The step this worker continues from: 0 on a fresh run, the cluster's
    /// step (BSP) or the worker's own clock (ASP/SSP) when it rejoins.
    pub fn start_step(&self) -> u64 {
        self.next_steps.borrow().iter().copied().min().unwrap_or(0)
    }

    /// Reconnections and resyncs so far.
    pub fn recoveries(&self) -> u64 {
        self.recoveries.get()
    }

    /// Replace the connection serving `shard` if it is dead (a restarted
    /// server): dial again with backoff and say Hello.
    async fn reconnect(&self, shard: usize) -> Result<(), CommError> {
        let link = self.route[shard];
        let (server, current) = {
            let links = self.links.borrow();
            (links[link].server.clone(), links[link].conn.clone())
        };
        if current.close_reason().is_none() {
            return Ok(()); // alive, or already replaced by another shard's recovery
        }
        tracing::warn!(server, "connection lost; reconnecting");
        let (conn, _) = self.dialer.dial(&server, self.max_frame).await?;
        self.links.borrow_mut()[link].conn = conn;
        Ok(())
    }

    /// Forget what this worker holds of `shard` and learn the step it expects,
    /// so the next pull is a full copy.
    async fn resync(&self, shard: usize) -> Result<(), CommError> {
        self.versions.borrow_mut()[shard] = None;
        self.pull_shard(shard, 0).await?;
        self.versions.borrow_mut()[shard] = None;
        Ok(())
    }

    /// Send a heartbeat on every connection (errors are left to the next exchange).
    pub async fn heartbeat(&self) {
        let req = Request::Heartbeat {
            worker_rank: self.rank,
        };
        let conns: Vec<Connection> = self.links.borrow().iter().map(|l| l.conn.clone()).collect();
        for conn in conns {
            let call = transport::call(&conn, &req, self.max_frame);
            let _ = tokio::time::timeout(self.heartbeat, call).await;
        }
    }

    /// One request to a shard's server through the (simulated) link; returns
    /// the response and the request's frame size.
    async fn exchange(&self, shard: usize, req: &Request) -> Result<(Response, usize), CommError> {
        let frame = encode_request(req).map_err(TransportError::from)?;
        self.link.send(frame.len() as u64).await;
        let resp = transport::call_raw(&self.conn(shard), &frame, self.max_frame).await?;
        let received = match &resp {
            Response::Params { update, .. } => update_bytes(update) + 32,
            _ => 32,
        };
        self.link.receive(received).await;
        Ok((resp, frame.len()))
    }

    async fn pull_shard(
        &self,
        shard: usize,
        min_version: u64,
    ) -> Result<(ShardUpdate, u64), CommError> {
        let have = self.versions.borrow()[shard];
        let req = Request::Pull {
            shard: shard as u32,
            have_version: have,
            min_version,
        };
        let (resp, _) = self.exchange(shard, &req).await?;
        match resp {
            Response::Params {
                version,
                next_step,
                update,
                ..
            } => {
                self.versions.borrow_mut()[shard] = Some(version);
                self.next_steps.borrow_mut()[shard] = next_step;
                let bytes = update_bytes(&update);
                let offset = self.map.ranges()[shard].start;
                Ok((ShardUpdate { offset, update }, bytes))
            }
            other => Err(refused("pull", other)),
        }
    }

    /// Offer `initial` as the starting point (the first worker's offer wins) and
    /// pull the parameters every worker starts from.
    pub async fn init_and_pull(&self, initial: &[f32]) -> Result<Vec<ShardUpdate>, CommError> {
        let parts = self.map.split_dense(initial);
        let jobs = parts.iter().enumerate().map(|(shard, part)| async move {
            // Init is idempotent (first offer wins); a restarted or rejoining
            // worker gets the current values and the step to continue from.
            let req = Request::Init {
                shard: shard as u32,
                values: part.to_vec(),
            };
            let (resp, _) = self.exchange(shard, &req).await?;
            match resp {
                Response::InitAck { .. } => {}
                other => return Err(refused("init", other)),
            }
            self.versions.borrow_mut()[shard] = None;
            Ok(self.pull_shard(shard, 0).await?.0)
        });
        try_join_all(jobs).await
    }

    /// Push this worker's gradient for the next step and pull the parameters
    /// after it. Each shard is pushed at the step it expects from this worker
    /// (the steps of different shards differ after a server restart).
    pub async fn push_pull(
        &self,
        grad: Outgoing,
    ) -> Result<(Vec<ShardUpdate>, Traffic), CommError> {
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
        let jobs = per_shard
            .into_iter()
            .enumerate()
            .map(|(shard, grad)| self.push_pull_shard(shard, grad));
        let results = try_join_all(jobs).await?;
        let mut traffic = Traffic::default();
        let mut updates = Vec::with_capacity(results.len());
        for (u, sent, pulled) in results {
            traffic.pushed += sent;
            traffic.pulled += pulled;
            updates.push(u);
        }
        Ok((updates, traffic))
    }

    /// Push to one shard and pull its new values, recovering from a lost
    /// connection (reconnect, resync, push again at the step the shard now
    /// expects) and from a step mismatch (resync).
    async fn push_pull_shard(
        &self,
        shard: usize,
        grad: WireGrad,
    ) -> Result<(ShardUpdate, u64, u64), CommError> {
        let mut recoveries = 0;
        loop {
            let step = self.next_steps.borrow()[shard];
            let req = Request::Push {
                shard: shard as u32,
                step,
                worker_rank: self.rank,
                grad: grad.clone(),
            };
            let attempt = async {
                let (resp, sent) = self.exchange(shard, &req).await?;
                match resp {
                    Response::PushAck { .. } => {}
                    other => return Err(refused("push", other)),
                }
                let (update, pulled) = self.pull_shard(shard, step + 1).await?;
                Ok((update, sent as u64, pulled))
            };
            let err = match attempt.await {
                Ok(done) => return Ok(done),
                Err(e) => e,
            };
            let recoverable = match &err {
                CommError::Transport(_) => true,
                CommError::Refused { code, .. } => matches!(
                    code,
                    ErrorCode::WrongStep | ErrorCode::DuplicatePush | ErrorCode::UnknownWorker
                ),
                _ => false,
            };
            if !recoverable || recoveries >= MAX_RECOVERIES {
                return Err(err);
            }
            recoveries += 1;
            self.recoveries.set(self.recoveries.get() + 1);
            tracing::warn!(shard, "recovering from: {err}");
            if matches!(err, CommError::Transport(_)) {
                self.reconnect(shard).await?;
            }
            self.resync(shard).await?;
        }
    }

    /// Leave the cluster and close the connections.
    pub async fn bye(&self) -> Result<(), CommError> {
        let conns: Vec<Connection> = self.links.borrow().iter().map(|l| l.conn.clone()).collect();
        for conn in conns {
            let req = Request::Bye {
                worker_rank: self.rank,
            };
            match transport::call(&conn, &req, self.max_frame).await? {
                (Response::ByeAck, _) => {}
                (other, _) => return Err(refused("bye", other)),
            }
            conn.close(0u32.into(), b"bye");
        }
        Ok(())
    }
}

impl Dialer {
    /// Connect (with backoff) and authenticate; returns the shards the server owns.
    async fn dial(
        &self,
        server: &str,
        max_frame: usize,
    ) -> Result<(Connection, Vec<ShardRange>), CommError> {
        let conn =
            connect_with_retry(server, &self.server_name, &self.ca_pem, self.timeout).await?;
        let (resp, _) = transport::call(&conn, &self.hello, max_frame).await?;
        match resp {
            Response::Welcome { shards, .. } => Ok((conn, shards)),
            other => Err(refused("hello", other)),
        }
    }
}

async fn connect_with_retry(
    server: &str,
    server_name: &str,
    ca_pem: &str,
    timeout: Duration,
) -> Result<Connection, CommError> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let addr = transport::resolve(server).await?;
            let endpoint = transport::client_endpoint(ca_pem, addr.is_ipv6())?;
            transport::connect(&endpoint, addr, server_name).await
        };
        match attempt.await {
            Ok(conn) => return Ok(conn),
            Err(e) => {
                if start.elapsed() + backoff > timeout {
                    return Err(CommError::Unreachable {
                        addr: server.to_string(),
                        secs: timeout.as_secs(),
                        last: e.to_string(),
                    });
                }
                tracing::debug!(server, "connect failed, retrying: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
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

/// Offer initial parameters; returns the parameters to start from and the
/// step to continue from.
#[derive(Message)]
#[rtype(result = "Result<(Vec<ShardUpdate>, u64), CommError>")]
pub struct InitParams(pub Vec<f32>);

impl Handler<InitParams> for CommActor {
    type Result = ResponseFuture<Result<(Vec<ShardUpdate>, u64), CommError>>;
    fn handle(&mut self, msg: InitParams, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move {
            let updates = comm.init_and_pull(&msg.0).await?;
            Ok((updates, comm.start_step()))
        })
    }
}

/// Push a step's gradient and pull the new parameters.
#[derive(Message)]
#[rtype(result = "Result<(Vec<ShardUpdate>, Traffic), CommError>")]
pub struct PushPull {
    pub grad: Outgoing,
}

impl Handler<PushPull> for CommActor {
    type Result = ResponseFuture<Result<(Vec<ShardUpdate>, Traffic), CommError>>;
    fn handle(&mut self, msg: PushPull, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(async move { comm.push_pull(msg.grad).await })
    }
}

/// Say goodbye to every server, then stop the actor; returns how many times
/// an exchange was recovered during the run.
#[derive(Message)]
#[rtype(result = "Result<u64, CommError>")]
pub struct Leave;

impl Handler<Leave> for CommActor {
    type Result = ResponseActFuture<Self, Result<u64, CommError>>;
    fn handle(&mut self, _: Leave, _: &mut Context<Self>) -> Self::Result {
        let comm = self.comm.clone();
        Box::pin(
            async move {
                comm.bye().await?;
                Ok(comm.recoveries())
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
        for link in self.comm.links.borrow().iter() {
            link.conn.close(1u32.into(), b"worker crashed");
        }
        ctx.stop();
    }
}

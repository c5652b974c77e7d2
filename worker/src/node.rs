//! Node-local aggregation: several worker ranks on one node share one link
//! to the servers.
//!
//! With `cluster.workers_per_node = n > 1`, node `i` runs ranks
//! `i*n .. (i+1)*n` (one per GPU) in one `ps-worker` process. Each rank keeps
//! its own model replica, loader shard and trainer thread, and hands its
//! dense gradient to the node's [`Node`] instead of pushing it. Once every
//! live rank of the node handed in its gradient for the step, the node:
//!
//! 1. sums them densely ([`NodeSum::add`]);
//! 2. divides the sum by the number of ranks that contributed and
//!    compresses that mean with the configured compressor, with one
//!    error-feedback residual per node, not per rank ([`NodeSum::finish`]);
//!    the push is the (compressed) node's mean gradient;
//! 3. pushes it once, as the node's first rank, over the node's one
//!    connection per server ([`Comm`]), and
//! 4. fans the reply (the new parameters or their delta) out to every rank.
//!
//! The servers see the nodes as their clients (client `i` = node `i`, which
//! authenticates with its first rank's certificate): the BSP barrier waits
//! for every live node, ASP/SSP clocks count node steps, and averaging the
//! nodes' mean gradients over the nodes is the average over all workers.
//!
//! **Why in-process channels.** The ranks of a node are tasks of one
//! process: handing a gradient over is a move into shared memory, with no
//! serialisation, no socket and no second TLS identity to manage, and a rank
//! that fails is seen at once (its handle is dropped). A node is the unit
//! that fails together in production anyway (one machine); a loopback or
//! Unix-socket hop would add copies and a protocol without buying isolation.
//!
//! **Failures inside a node.** A rank that stops (error, crash injection, or
//! its task ends) leaves the node's round: the node goes on with the ranks
//! left, and its push is their mean. The node says goodbye to the servers
//! when its last rank left, or drops its connections without a goodbye when
//! its last rank crashed, so the servers handle a dead node exactly as a dead
//! worker. ASP and SSP advance a node when all its live ranks handed in.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};

use futures::channel::oneshot;
use ps_net::protocol::ErrorCode;

use ps_shared::config::ClusterConfig;
use ps_shared::link::{LinkSection, LinkStats};
use ps_shared::sparse::{Compressor, SparseError};

use crate::comm::{
    Comm, CommError, CommSummary, DataStart, Outgoing, ParamSource, ShardUpdate, Traffic, WorkerTls,
};

/// Dense reduction and compression of one node's gradients.
pub struct NodeSum {
    sum: Vec<f32>,
    contributors: usize,
    /// `None`: push the dense mean.
    compressor: Option<Compressor>,
}

impl NodeSum {
    pub fn new(num_params: usize, compressor: Option<Compressor>) -> Self {
        Self {
            sum: vec![0.0; num_params],
            contributors: 0,
            compressor,
        }
    }

    /// The node's sum for `cfg`, with the compressor of its `[compression]`
    /// section (none with `kind = "none"`).
    pub fn for_config(cfg: &ClusterConfig) -> Self {
        let n = cfg.model.num_params();
        Self::new(n, cfg.compression.compressor(n, cfg.total_shards()))
    }

    /// Add one rank's gradient to the node's sum.
    pub fn add(&mut self, grad: &Outgoing) -> Result<(), SparseError> {
        match grad {
            Outgoing::Dense(d) => {
                if d.len() != self.sum.len() {
                    return Err(SparseError::LengthMismatch {
                        expected: self.sum.len(),
                        got: d.len(),
                    });
                }
                for (s, g) in self.sum.iter_mut().zip(d) {
                    *s += g;
                }
            }
            Outgoing::Sparse(g) => {
                g.validate(self.sum.len())?;
                g.add_into(&mut self.sum, 1.0);
            }
            // A node member hands its whole gradient over (the run loop
            // streams only on a rank's own connections): none came.
            Outgoing::Streamed(_) => {
                return Err(SparseError::LengthMismatch {
                    expected: self.sum.len(),
                    got: 0,
                })
            }
        }
        self.contributors += 1;
        Ok(())
    }

    /// Ranks summed since the last [`NodeSum::finish`].
    pub fn contributors(&self) -> usize {
        self.contributors
    }

    /// The node's push for the step: the mean of the contributed gradients,
    /// dense without a compressor, or its top-k with the node's error
    /// feedback. The compressor sees the mean, as a flat worker's sees its
    /// own gradient, so `compression.clip_norm` and the residual are in the
    /// same units as a flat worker's, whatever the number of contributors.
    /// Returns the push and its density, and starts the next sum.
    pub fn finish(&mut self) -> Result<(Outgoing, f64), SparseError> {
        let n = self.sum.len().max(1) as f64;
        let scale = 1.0 / self.contributors.max(1) as f32;
        self.contributors = 0;
        for s in &mut self.sum {
            *s *= scale;
        }
        match &mut self.compressor {
            // The mean is the push; the next sum starts from fresh zeros.
            None => {
                let zeros = vec![0.0; self.sum.len()];
                Ok((
                    Outgoing::Dense(std::mem::replace(&mut self.sum, zeros)),
                    1.0,
                ))
            }
            Some(c) => {
                let sparse = c.compress(&self.sum)?;
                let density = sparse.indices.len() as f64 / n;
                self.sum.fill(0.0);
                Ok((Outgoing::Sparse(sparse), density))
            }
        }
    }

    /// The node's unsent accumulator (empty when dense).
    pub fn residual(&self) -> &[f32] {
        self.compressor.as_ref().map_or(&[], |c| c.residual())
    }
}

/// What a rank's exchange through its node returns.
pub type StepResult = Result<(Vec<ShardUpdate>, Traffic), NodeError>;
/// What a rank's join through its node returns: the parameters, the start
/// step, and where the servers say the sample stream stands.
pub type JoinResult = Result<(Vec<ShardUpdate>, u64, DataStart), NodeError>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum NodeError {
    #[error("node {node}: {message}")]
    Failed { node: u32, message: String },
    #[error("node {node}: rank {rank} is not one of its ranks {first}..{end}")]
    NotMember {
        node: u32,
        rank: u32,
        first: u32,
        end: u32,
    },
    /// A server refused the node's request. The code is kept, so the ranks
    /// react as they would to their own refusal: a run another rank
    /// finished (`JobDone`) ends them cleanly, a stopped job
    /// (`JobStopped`) with the job-stopped exit code.
    #[error("node {node}: server refused {doing}: {code:?}: {message}")]
    Refused {
        node: u32,
        doing: &'static str,
        code: ErrorCode,
        message: String,
    },
}

/// Where a rank stands in its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    Live,
    Left,
    Crashed,
}

/// The node's reply for each of `ranks` ranks: the same updates, and each
/// rank's share of the node's bytes (the first rank takes the remainder), so
/// the ranks' figures add up to what crossed the node's link.
pub fn fan_out(result: StepResult, ranks: usize) -> Vec<StepResult> {
    let shares = ranks.max(1) as u64;
    (0..ranks)
        .map(|i| {
            result.clone().map(|(updates, traffic)| {
                let share = |b: u64| b / shares + u64::from(i == 0) * (b % shares);
                let traffic = Traffic {
                    pushed: share(traffic.pushed),
                    pulled: share(traffic.pulled),
                    ..traffic
                };
                (updates, traffic)
            })
        })
        .collect()
}

/// One node's aggregator, shared by its ranks' tasks (all on one thread).
pub struct Node {
    node: u32,
    first_rank: u32,
    cfg: ClusterConfig,
    tls: WorkerTls,
    members: RefCell<Vec<Member>>,
    /// Each rank's parameter source, for offers to a restarted server.
    sources: RefCell<Vec<Option<ParamSource>>>,
    /// The simulated link of the node's one connection per server.
    link: LinkSection,
    joining: RefCell<Vec<oneshot::Sender<JoinResult>>>,
    joined: Cell<bool>,
    comm: RefCell<Option<Rc<Comm>>>,
    /// A rank of the node left because it was told to stop (not finished).
    stopped: Cell<bool>,
    sum: RefCell<NodeSum>,
    /// Reply channels of the ranks that handed in this round's gradient.
    pending: RefCell<Vec<oneshot::Sender<StepResult>>>,
    /// A round is being pushed (gradients of the next wait for it).
    pushing: Cell<bool>,
    closed: Cell<bool>,
    /// What the node's connections did, once it closed.
    summary: RefCell<Option<CommSummary>>,
}

impl Node {
    /// The aggregator of node `node` of `cfg`; `tls` is its first rank's,
    /// and its connections pass through the simulated `link` (unlimited:
    /// counted only).
    pub fn new(cfg: &ClusterConfig, node: u32, tls: WorkerTls, link: LinkSection) -> Rc<Self> {
        let n = cfg.cluster.workers_per_node.max(1);
        Rc::new(Self {
            node,
            link,
            first_rank: node * n as u32,
            cfg: cfg.clone(),
            tls,
            members: RefCell::new(vec![Member::Live; n]),
            sources: RefCell::new(vec![None; n]),
            joining: RefCell::new(Vec::new()),
            joined: Cell::new(false),
            comm: RefCell::new(None),
            stopped: Cell::new(false),
            sum: RefCell::new(NodeSum::for_config(cfg)),
            pending: RefCell::new(Vec::new()),
            pushing: Cell::new(false),
            closed: Cell::new(false),
            summary: RefCell::new(None),
        })
    }

    /// The handle of `rank`; it leaves the node (as crashed) when dropped
    /// without [`NodeMember::leave`].
    pub fn member(self: &Rc<Self>, rank: u32) -> Result<NodeMember, NodeError> {
        let n = self.members.borrow().len() as u32;
        if rank < self.first_rank || rank >= self.first_rank + n {
            return Err(NodeError::NotMember {
                node: self.node,
                rank,
                first: self.first_rank,
                end: self.first_rank + n,
            });
        }
        Ok(NodeMember {
            node: self.clone(),
            local: (rank - self.first_rank) as usize,
            done: Cell::new(false),
        })
    }

    /// What the node reports when its connections failed `doing` something:
    /// a server's refusal keeps its code.
    fn comm_failed(&self, doing: &'static str, e: CommError) -> NodeError {
        match e {
            CommError::Refused { code, message, .. } => NodeError::Refused {
                node: self.node,
                doing,
                code,
                message,
            },
            e => self.fail(format!("{doing}: {e}")),
        }
    }

    fn fail(&self, message: impl Into<String>) -> NodeError {
        NodeError::Failed {
            node: self.node,
            message: message.into(),
        }
    }

    fn live(&self) -> usize {
        self.members
            .borrow()
            .iter()
            .filter(|m| **m == Member::Live)
            .count()
    }

    /// Stop or resume the node's heartbeats (fault injection: a paused node).
    pub fn silence(&self, on: bool) {
        if let Some(comm) = self.comm.borrow().as_ref() {
            comm.silence(on);
        }
    }

    /// The node's link traffic so far (zero before it joined).
    pub fn link_stats(&self) -> LinkStats {
        self.comm
            .borrow()
            .as_ref()
            .map_or_else(LinkStats::default, |c| c.link().stats())
    }

    /// A parameter source reading the first live rank's replica (every
    /// replica holds the same parameters after each fan-out).
    fn params_source(self: &Rc<Self>) -> ParamSource {
        let weak = Rc::downgrade(self);
        Rc::new(move || {
            let source = weak.upgrade().and_then(|node| {
                let members = node.members.borrow();
                let sources = node.sources.borrow();
                (0..members.len())
                    .find(|&i| members[i] == Member::Live && sources[i].is_some())
                    .and_then(|i| sources[i].clone())
            });
            Box::pin(async move {
                match source {
                    Some(s) => s().await,
                    None => Vec::new(),
                }
            })
        })
    }

    fn join(self: &Rc<Self>, local: usize, params: ParamSource) -> oneshot::Receiver<JoinResult> {
        let (tx, rx) = oneshot::channel();
        self.sources.borrow_mut()[local] = Some(params);
        self.joining.borrow_mut().push(tx);
        self.maybe_connect();
        rx
    }

    /// Once every live rank asked to join: connect, join, fan out.
    fn maybe_connect(self: &Rc<Self>) {
        if self.joined.get() || self.joining.borrow().len() < self.live() || self.live() == 0 {
            return;
        }
        self.joined.set(true);
        let node = self.clone();
        actix::spawn(async move {
            let result = async {
                let comm = Comm::connect_over(
                    &node.cfg,
                    node.first_rank,
                    node.tls.clone(),
                    node.params_source(),
                    &node.link,
                )
                .await?;
                let (updates, _) = comm.join().await?;
                comm.commit();
                Ok::<_, CommError>((Rc::new(comm), updates))
            }
            .await;
            let waiting = std::mem::take(&mut *node.joining.borrow_mut());
            match result {
                Ok((comm, updates)) => {
                    let start = comm.start_step();
                    let data = comm.data_start();
                    *node.comm.borrow_mut() = Some(comm.clone());
                    node.spawn_heartbeats(&comm);
                    for tx in waiting {
                        let _ = tx.send(Ok((updates.clone(), start, data)));
                    }
                }
                Err(e) => {
                    let e = node.comm_failed("joining the cluster", e);
                    for tx in waiting {
                        let _ = tx.send(Err(e.clone()));
                    }
                }
            }
        });
    }

    fn spawn_heartbeats(self: &Rc<Self>, comm: &Rc<Comm>) {
        let weak: Weak<Node> = Rc::downgrade(self);
        let comm = Rc::downgrade(comm);
        let every = ps_shared::config::secs(self.cfg.server.heartbeat_secs);
        actix::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let (Some(node), Some(comm)) = (weak.upgrade(), comm.upgrade()) else {
                    return;
                };
                if node.closed.get() {
                    return;
                }
                comm.heartbeat().await;
            }
        });
    }

    fn submit(self: &Rc<Self>, grad: Outgoing) -> oneshot::Receiver<StepResult> {
        let (tx, rx) = oneshot::channel();
        if let Err(e) = self.sum.borrow_mut().add(&grad) {
            let _ = tx.send(Err(self.fail(format!("gradient of a rank: {e}"))));
            return rx;
        }
        self.pending.borrow_mut().push(tx);
        self.maybe_push();
        rx
    }

    /// Push the round once every live rank handed in.
    fn maybe_push(self: &Rc<Self>) {
        let waiting = self.pending.borrow().len();
        if self.pushing.get() || waiting == 0 || waiting < self.live() {
            return;
        }
        self.pushing.set(true);
        let node = self.clone();
        actix::spawn(async move {
            let pending = std::mem::take(&mut *node.pending.borrow_mut());
            let result = node.push_round().await;
            let replies = fan_out(result, pending.len());
            for (tx, reply) in pending.into_iter().zip(replies) {
                let _ = tx.send(reply);
            }
            node.pushing.set(false);
            // Gradients handed in while this round was on the wire.
            node.maybe_push();
        });
    }

    async fn push_round(&self) -> StepResult {
        let Some(comm) = self.comm.borrow().clone() else {
            return Err(self.fail("a step before the node joined the cluster"));
        };
        let live_here = self.live() as u32;
        let (grad, density) = self
            .sum
            .borrow_mut()
            .finish()
            .map_err(|e| self.fail(format!("compressing the node's mean gradient: {e}")))?;
        let (updates, mut traffic) = comm
            .step(grad)
            .await
            .map_err(|e| self.comm_failed("the node's step", e))?;
        // The servers count nodes: report the ranks of the live nodes.
        let wpn = self.members.borrow().len() as u32;
        traffic.live_workers = traffic
            .live_workers
            .saturating_sub(1)
            .saturating_mul(wpn)
            .saturating_add(live_here);
        traffic.density = Some(density);
        Ok((updates, traffic))
    }

    /// `local` stops taking part. Returns the node's summary when it was the
    /// last live rank (the node closes: goodbye, or abort after a crash).
    fn remove(self: &Rc<Self>, local: usize, how: Member) {
        {
            let mut members = self.members.borrow_mut();
            if members[local] != Member::Live {
                return;
            }
            members[local] = how;
        }
        self.sources.borrow_mut()[local] = None;
        if self.live() > 0 {
            // The join or the round may be complete without it now.
            self.maybe_connect();
            self.maybe_push();
        }
    }

    /// Close the node's connections once no rank is live.
    async fn close(&self, crashed: bool) -> Result<(), NodeError> {
        if self.live() > 0 || self.closed.get() {
            return Ok(());
        }
        let Some(comm) = self.comm.borrow().clone() else {
            self.closed.set(true);
            return Ok(());
        };
        let summary = CommSummary::of(&comm);
        self.closed.set(true);
        *self.summary.borrow_mut() = Some(summary);
        if crashed {
            comm.abort();
            Ok(())
        } else {
            // The node finished only when none of its ranks was stopped.
            comm.bye(!self.stopped.get())
                .await
                .map_err(|e| self.fail(format!("saying goodbye: {e}")))
        }
    }

    /// What the node's connections did so far.
    fn summary(&self) -> CommSummary {
        if let Some(s) = *self.summary.borrow() {
            return s;
        }
        match &*self.comm.borrow() {
            Some(comm) => CommSummary::of(comm),
            None => CommSummary {
                recoveries: 0,
                final_version: 0,
                link_simulated_secs: 0.0,
                link_sent_bytes: 0,
                link_received_bytes: 0,
            },
        }
    }
}

/// One rank's handle on its node.
pub struct NodeMember {
    node: Rc<Node>,
    local: usize,
    done: Cell<bool>,
}

impl NodeMember {
    pub fn node(&self) -> &Rc<Node> {
        &self.node
    }

    /// Join through the node: resolves once every live rank of the node
    /// asked and the node joined the cluster.
    pub fn join(&self, params: ParamSource) -> impl Future<Output = JoinResult> {
        let rx = self.node.join(self.local, params);
        let node = self.node.node;
        async move {
            rx.await.unwrap_or_else(|_| {
                Err(NodeError::Failed {
                    node,
                    message: "the node stopped before joining".into(),
                })
            })
        }
    }

    /// Hand this step's gradient to the node now; the future resolves with
    /// the node's reply once the node's push came back.
    pub fn step(&self, grad: Outgoing) -> Pin<Box<dyn Future<Output = StepResult>>> {
        let rx = self.node.submit(grad);
        let node = self.node.node;
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(NodeError::Failed {
                    node,
                    message: "the node stopped during a step".into(),
                })
            })
        })
    }

    /// This rank is done; the last rank of the node says goodbye to the
    /// servers for the node.
    pub async fn leave(&self, finished: bool) -> Result<CommSummary, NodeError> {
        self.done.set(true);
        if !finished {
            self.node.stopped.set(true);
        }
        self.node.remove(self.local, Member::Left);
        self.node.close(false).await?;
        Ok(self.node.summary())
    }

    /// This rank reached the run's target (`Request::Finish`): every server
    /// hears it and answers every later step with `JobDone`, so the other
    /// ranks, of this node and of the others, stop at their next step.
    pub async fn finish_job(&self, reason: &str) {
        let comm = self.node.comm.borrow().clone();
        if let Some(comm) = comm {
            comm.finish_job(reason).await;
        }
    }

    /// This rank stops the whole job (`Request::Abort`) for the reason
    /// given: every server hears it, and refuses every rank's next step.
    pub async fn stop_job(&self, reason: &str) {
        self.done.set(true);
        self.node.remove(self.local, Member::Crashed);
        let comm = self.node.comm.borrow().clone();
        if let Some(comm) = comm {
            comm.stop_job(reason).await;
        }
    }

    /// This rank stops as if it crashed; the node drops its connections
    /// without a goodbye when no rank is left.
    pub async fn abort(&self) {
        self.done.set(true);
        self.node.remove(self.local, Member::Crashed);
        let _ = self.node.close(true).await;
    }
}

impl Drop for NodeMember {
    fn drop(&mut self) {
        if !self.done.get() {
            self.node.remove(self.local, Member::Crashed);
            if self.node.live() == 0 && !self.node.closed.get() {
                if let Some(comm) = self.node.comm.borrow().clone() {
                    comm.abort();
                }
                self.node.closed.set(true);
            }
        }
    }
}

/// Handles of every rank of node `node`, in rank order.
pub fn node_members(
    cfg: &ClusterConfig,
    node: u32,
    tls: WorkerTls,
    link: LinkSection,
) -> Result<(Rc<Node>, Vec<NodeMember>), NodeError> {
    let n = cfg.cluster.workers_per_node.max(1) as u32;
    if node as usize >= cfg.nodes() {
        return Err(NodeError::Failed {
            node,
            message: format!(
                "the cluster has {} nodes (cluster.workers / cluster.workers_per_node)",
                cfg.nodes()
            ),
        });
    }
    let aggregator = Node::new(cfg, node, tls, link);
    let members = (node * n..(node + 1) * n)
        .map(|rank| aggregator.member(rank))
        .collect::<Result<_, _>>()?;
    Ok((aggregator, members))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::config::CompressionSection;
    use ps_shared::sparse::SparseGrad;

    /// A top-k compressor of 4 parameters, without momentum correction.
    fn topk(density: f64) -> Compressor {
        Compressor::new(
            4,
            CompressionSection {
                density,
                momentum_correction: 0.0,
                ..CompressionSection::default()
            },
        )
    }

    #[test]
    fn dense_sums_push_the_mean_of_the_contributors() {
        let mut s = NodeSum::new(3, None);
        s.add(&Outgoing::Dense(vec![1.0, 2.0, 3.0])).unwrap();
        s.add(&Outgoing::Sparse(SparseGrad {
            indices: vec![2],
            values: vec![5.0],
        }))
        .unwrap();
        assert_eq!(s.contributors(), 2);
        let (out, density) = s.finish().unwrap();
        assert_eq!(density, 1.0);
        let Outgoing::Dense(mean) = out else {
            panic!("a dense node pushes dense")
        };
        assert_eq!(mean, vec![0.5, 1.0, 4.0]);
        // The next round starts from zero.
        s.add(&Outgoing::Dense(vec![2.0, 0.0, 0.0])).unwrap();
        let (Outgoing::Dense(next), _) = s.finish().unwrap() else {
            panic!("dense")
        };
        assert_eq!(next, vec![2.0, 0.0, 0.0]);
    }

    #[test]
    fn error_feedback_keeps_one_residual_on_the_node_mean() {
        // Two ranks whose gradients cancel on entry 0 and add up on entry 1:
        // per-rank top-1 would send entry 0 twice; the node sends entry 1.
        let mut s = NodeSum::new(4, Some(topk(0.25)));
        s.add(&Outgoing::Dense(vec![3.0, 1.0, 0.5, 0.0])).unwrap();
        s.add(&Outgoing::Dense(vec![-3.0, 1.5, 0.5, 0.0])).unwrap();
        let (out, density) = s.finish().unwrap();
        assert_eq!(density, 0.25);
        let Outgoing::Sparse(g) = out else {
            panic!("top-k pushes sparse")
        };
        assert_eq!(g.indices, vec![1]);
        assert_eq!(g.values, vec![1.25], "the sum 2.5 over 2 ranks");
        // The unsent part of the mean stays in the node's residual.
        assert_eq!(s.residual(), &[0.0, 0.0, 0.5, 0.0]);
        // Next round: entry 2's residual plus the new mean wins.
        s.add(&Outgoing::Dense(vec![0.0, 0.1, 0.5, 0.0])).unwrap();
        s.add(&Outgoing::Dense(vec![0.0, 0.1, 0.0, 0.0])).unwrap();
        let (Outgoing::Sparse(g), _) = s.finish().unwrap() else {
            panic!("sparse")
        };
        assert_eq!(g.indices, vec![2]);
        assert_eq!(g.values, vec![0.75], "residual 0.5 + the mean 0.25");
        let r = s.residual();
        assert!((r[1] - 0.1).abs() < 1e-6 && r[2] == 0.0, "{r:?}");
    }

    #[test]
    fn fan_out_gives_every_rank_the_update_and_a_share_of_the_bytes() {
        let updates = vec![ShardUpdate {
            offset: 4,
            update: ps_net::protocol::ParamUpdate::Sparse {
                indices: vec![1],
                values: vec![0.5],
            },
        }];
        let traffic = Traffic {
            pushed: 1001,
            pulled: 10,
            round_trips: 2,
            live_workers: 4,
            density: Some(0.01),
            next_step: 7,
            copied: Default::default(),
            fenced: 0,
        };
        let replies = fan_out(Ok((updates, traffic)), 3);
        assert_eq!(replies.len(), 3);
        let (mut pushed, mut pulled) = (0, 0);
        for r in &replies {
            let (u, t) = r.as_ref().unwrap();
            assert_eq!(u.len(), 1);
            assert_eq!(u[0].offset, 4);
            assert_eq!(
                (t.round_trips, t.live_workers, t.density, t.next_step),
                (2, 4, Some(0.01), 7)
            );
            pushed += t.pushed;
            pulled += t.pulled;
        }
        assert_eq!(
            (pushed, pulled),
            (1001, 10),
            "shares add up to the node's bytes"
        );
        let failed = fan_out(
            Err(NodeError::Failed {
                node: 1,
                message: "x".into(),
            }),
            2,
        );
        assert!(failed.iter().all(|r| r.is_err()));
    }

    #[test]
    fn a_rank_that_stops_does_not_hold_up_its_node() {
        let mut cfg = ClusterConfig::embedded_default().unwrap();
        cfg.cluster.workers = 4;
        cfg.cluster.workers_per_node = 2;
        let pki = ps_net::pki::ClusterCa::generate("node test").unwrap();
        let tls = WorkerTls {
            ca_pem: pki.cert_pem().to_string(),
            identity: pki.issue_worker(2).unwrap(),
        };
        assert!(matches!(
            Node::new(&cfg, 1, tls.clone(), LinkSection::default()).member(0),
            Err(NodeError::NotMember {
                first: 2,
                end: 4,
                ..
            })
        ));
        assert!(
            node_members(&cfg, 2, tls.clone(), LinkSection::default()).is_err(),
            "only 2 nodes"
        );
        let system = actix::System::new();
        system.block_on(async {
            let (node, mut members) = node_members(&cfg, 1, tls, LinkSection::default()).unwrap();
            let n = cfg.model.num_params();
            // Rank 2 hands in its gradient; rank 3 fails before its own.
            let step = members[0].step(Outgoing::Dense(vec![0.0; n]));
            drop(members.pop());
            assert_eq!(node.live(), 1);
            // The round goes ahead without rank 3 and rank 2 gets an answer
            // (an error here: this node never joined a cluster).
            let reply = step.await;
            assert!(
                matches!(&reply, Err(NodeError::Failed { message, .. }) if message.contains("before the node joined")),
                "{reply:?}"
            );
        });
    }

    #[test]
    fn a_gradient_of_the_wrong_length_is_refused() {
        let mut s = NodeSum::new(3, None);
        assert!(s.add(&Outgoing::Dense(vec![1.0])).is_err());
        assert!(s
            .add(&Outgoing::Sparse(SparseGrad {
                indices: vec![9],
                values: vec![1.0],
            }))
            .is_err());
        assert_eq!(s.contributors(), 0);
    }
}

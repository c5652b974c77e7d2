//! `ShardActor`: one actix actor per parameter shard.
//!
//! The actor owns a [`ShardState`] and only moves messages in and out of it.
//! Pulls that ask for a version the shard has not reached yet are parked and
//! answered the moment the barrier completes. Each actor runs on its own
//! arbiter (thread), so shards aggregate and update in parallel, and each
//! update is itself parallel over chunks.

use std::sync::Arc;

use actix::prelude::*;
use object_store::{path::Path as ObjectPath, ObjectStore};
use tokio::sync::oneshot;

use crate::checkpoint::save;
use ps_shared::protocol::{Response, WireGrad};

use crate::shard::{Refusal, ShardState};

pub struct ShardActor {
    state: ShardState,
    parked: Vec<ParkedPull>,
    checkpoints: Option<CheckpointTarget>,
    layout_hash: u64,
    /// A checkpoint write is under way (at most one at a time).
    saving: bool,
    last_saved: u64,
}

/// Where and how often a shard checkpoints.
#[derive(Clone)]
pub struct CheckpointTarget {
    pub store: Arc<dyn ObjectStore>,
    pub prefix: ObjectPath,
    pub every: u64,
}

struct ParkedPull {
    worker: u32,
    have_version: Option<u64>,
    min_version: u64,
    reply: oneshot::Sender<Response>,
}

impl ShardActor {
    pub fn new(state: ShardState, checkpoints: Option<CheckpointTarget>, layout_hash: u64) -> Self {
        let last_saved = state.version();
        Self {
            state,
            parked: Vec::new(),
            checkpoints,
            layout_hash,
            saving: false,
            last_saved,
        }
    }

    /// Start a checkpoint write when one is due and none is under way. The
    /// snapshot is taken now; training goes on while it is written.
    fn maybe_checkpoint(&mut self, ctx: &mut Context<Self>) {
        let Some(target) = &self.checkpoints else {
            return;
        };
        let version = self.state.version();
        if self.saving || target.every == 0 || version < self.last_saved + target.every {
            return;
        }
        self.saving = true;
        let snapshot = self.state.snapshot(self.layout_hash);
        let target = target.clone();
        let shard = self.state.id();
        let write = async move { save(&target.store, &target.prefix, &snapshot).await };
        ctx.spawn(write.into_actor(self).map(move |result, actor, _| {
            actor.saving = false;
            match result {
                Ok(()) => {
                    actor.last_saved = version;
                    tracing::info!(shard, version, "checkpoint published");
                }
                Err(e) => tracing::error!(shard, version, "checkpoint failed: {e}"),
            }
        }));
    }

    fn release_parked(&mut self) {
        let parked = std::mem::take(&mut self.parked);
        for p in parked {
            match self.state.pull(p.worker, p.have_version, p.min_version) {
                Some(resp) => {
                    let _ = p.reply.send(resp);
                }
                None => self.parked.push(p),
            }
        }
    }
}

impl Actor for ShardActor {
    type Context = Context<Self>;
}

/// Offer initial parameter values.
#[derive(Message)]
#[rtype(result = "Result<bool, Refusal>")]
pub struct InitShard(pub Vec<f32>);

impl Handler<InitShard> for ShardActor {
    type Result = Result<bool, Refusal>;
    fn handle(&mut self, msg: InitShard, _: &mut Context<Self>) -> Self::Result {
        let accepted = self.state.init(msg.0)?;
        self.release_parked();
        Ok(accepted)
    }
}

/// A worker's gradient for a step.
#[derive(Message)]
#[rtype(result = "Result<(), Refusal>")]
pub struct PushGrad {
    pub worker: u32,
    pub step: u64,
    pub grad: WireGrad,
}

impl Handler<PushGrad> for ShardActor {
    type Result = Result<(), Refusal>;
    fn handle(&mut self, msg: PushGrad, ctx: &mut Context<Self>) -> Self::Result {
        if self.state.push(msg.worker, msg.step, msg.grad)? {
            self.release_parked();
            self.maybe_checkpoint(ctx);
        }
        Ok(())
    }
}

/// Ask for parameters at `min_version` or later; the receiver resolves when ready.
#[derive(Message)]
#[rtype(result = "oneshot::Receiver<Response>")]
pub struct PullParams {
    pub worker: u32,
    pub have_version: Option<u64>,
    pub min_version: u64,
}

impl Handler<PullParams> for ShardActor {
    type Result = MessageResult<PullParams>;
    fn handle(&mut self, msg: PullParams, _: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        match self
            .state
            .pull(msg.worker, msg.have_version, msg.min_version)
        {
            Some(resp) => {
                let _ = tx.send(resp);
            }
            None => self.parked.push(ParkedPull {
                worker: msg.worker,
                have_version: msg.have_version,
                min_version: msg.min_version,
                reply: tx,
            }),
        }
        MessageResult(rx)
    }
}

/// A worker left the cluster: it no longer holds up the barrier.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WorkerLeft(pub u32);

impl Handler<WorkerLeft> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: WorkerLeft, ctx: &mut Context<Self>) {
        self.state.leave(msg.0);
        // Leaving can complete a step or relax the SSP bound.
        self.release_parked();
        self.maybe_checkpoint(ctx);
    }
}

/// A worker (re)joined the cluster.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WorkerJoined(pub u32);

impl Handler<WorkerJoined> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: WorkerJoined, _: &mut Context<Self>) {
        self.state.join(msg.0);
        self.release_parked();
    }
}

/// A snapshot of the shard for status and tests.
#[derive(Debug, Clone)]
pub struct ShardStatus {
    pub shard: u32,
    pub version: u64,
    pub params: Vec<f32>,
}

#[derive(Message)]
#[rtype(result = "ShardStatus")]
pub struct GetStatus;

impl Handler<GetStatus> for ShardActor {
    type Result = MessageResult<GetStatus>;
    fn handle(&mut self, _: GetStatus, _: &mut Context<Self>) -> Self::Result {
        MessageResult(ShardStatus {
            shard: self.state.id(),
            version: self.state.version(),
            params: self.state.params().to_vec(),
        })
    }
}

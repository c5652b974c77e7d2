//! Tests of the shard core, one file per concern; the helpers shared by
//! them are here.

use ps_net::protocol::{ParamUpdate, WireValues};
use ps_shared::sparse::SparseGrad;

use super::*;

mod backup;
mod balance;
mod checkpoints;
mod f16;
mod guard;
mod membership;
mod norm;
mod recovery;
mod replies;
mod update;

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
        backup: 0,
        f16_replies: false,
        shared_norm: false,
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
        rate: 0.0,
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

//! `LoaderActor`: hands the trainer its batches, fetched ahead of time.
//!
//! The loader knows the whole sample order in advance (a seeded per-epoch
//! permutation split across workers by rank), so it keeps the next
//! `prefetch_batches` batches in flight as concurrent range GETs against the
//! bucket while the trainer computes. A batch is never fetched twice and the
//! queue is bounded, so memory stays bounded.

use std::collections::VecDeque;
use std::sync::Arc;

use actix::prelude::*;
use tokio::task::JoinHandle;

use ps_shared::dataset::{Batch, DatasetError, DatasetReader, Split};
use ps_shared::sampler::EpochSampler;

/// Where a batch sits in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPos {
    pub epoch: u64,
    pub step_in_epoch: usize,
}

/// The plan of batches and the prefetch queue, independent of the actor.
pub struct Prefetcher {
    reader: DatasetReader,
    sampler: EpochSampler,
    batch_size: usize,
    epochs: u64,
    depth: usize,
    next_epoch: u64,
    planned: VecDeque<(BatchPos, Vec<usize>)>,
    in_flight: VecDeque<(BatchPos, JoinHandle<Result<Batch, DatasetError>>)>,
}

impl Prefetcher {
    pub fn new(
        reader: DatasetReader,
        sampler: EpochSampler,
        batch_size: usize,
        epochs: u64,
        depth: usize,
    ) -> Self {
        Self {
            reader,
            sampler,
            batch_size,
            epochs,
            depth: depth.max(1),
            next_epoch: 0,
            planned: VecDeque::new(),
            in_flight: VecDeque::new(),
        }
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.sampler.steps_per_epoch(self.batch_size)
    }

    fn plan_more(&mut self) {
        while self.planned.is_empty() && self.next_epoch < self.epochs {
            let epoch = self.next_epoch;
            self.next_epoch += 1;
            for (i, idx) in self
                .sampler
                .batches(epoch, self.batch_size)
                .into_iter()
                .enumerate()
            {
                self.planned.push_back((
                    BatchPos {
                        epoch,
                        step_in_epoch: i,
                    },
                    idx,
                ));
            }
        }
    }

    /// Start fetches until `depth` batches are in flight. Must run inside a
    /// tokio `LocalSet` (an actix arbiter).
    fn fill(&mut self) {
        while self.in_flight.len() < self.depth {
            self.plan_more();
            let Some((pos, indices)) = self.planned.pop_front() else {
                break;
            };
            let reader = self.reader.clone();
            let handle = tokio::task::spawn_local(async move {
                reader.fetch_batch(Split::Train, &indices).await
            });
            self.in_flight.push_back((pos, handle));
        }
    }

    /// The next batch's fetch (already running), or `None` at the end of the run.
    pub fn next(&mut self) -> Option<(BatchPos, JoinHandle<Result<Batch, DatasetError>>)> {
        self.fill();
        let next = self.in_flight.pop_front();
        self.fill();
        next
    }
}

pub struct LoaderActor {
    prefetcher: Prefetcher,
}

impl LoaderActor {
    pub fn new(prefetcher: Prefetcher) -> Self {
        Self { prefetcher }
    }
}

impl Actor for LoaderActor {
    type Context = Context<Self>;
}

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("fetch task failed: {0}")]
    Task(String),
}

/// Ask for the next batch; `None` once every epoch is done.
#[derive(Message)]
#[rtype(result = "Result<Option<(BatchPos, Arc<Batch>)>, LoaderError>")]
pub struct NextBatch;

impl Handler<NextBatch> for LoaderActor {
    type Result = ResponseFuture<Result<Option<(BatchPos, Arc<Batch>)>, LoaderError>>;
    fn handle(&mut self, _: NextBatch, _: &mut Context<Self>) -> Self::Result {
        let next = self.prefetcher.next();
        Box::pin(async move {
            match next {
                None => Ok(None),
                Some((pos, handle)) => {
                    let batch = handle
                        .await
                        .map_err(|e| LoaderError::Task(e.to_string()))??;
                    Ok(Some((pos, Arc::new(batch))))
                }
            }
        })
    }
}

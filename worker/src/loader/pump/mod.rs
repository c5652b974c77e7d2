//! The pump: the task that plans batches ahead of the trainer, fetches what
//! is missing (soonest needed first, under the retry policy) and hands
//! complete batches over in order.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use ps_dataset::{DatasetReader, RecordRequest, Split};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::cache::{CacheError, TieredCache};
use crate::loader::retry::{OutageLog, RetryFailure, RetryPolicy};
use crate::loader::schedule::{PrefetchWindow, Schedule};
use crate::loader::{BatchPos, Item, LoaderError, LoaderSettings, Shared};

mod decode;
mod peers;
mod tiers;

pub(super) use peers::PeerState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    Disk,
    Peer,
    Bucket,
}

/// A sample some planned batches wait for.
pub(super) struct Waiting {
    /// `(slot seq, index in the batch)`, first need first.
    waiters: Vec<(u64, usize)>,
    /// Stream position of the latest use waiting.
    last_pos: u64,
    /// Absolute position of the first need.
    first_need: u64,
    source: Source,
}

/// A sample in hand that planned batches still refer to.
pub(super) struct Held {
    bytes: Bytes,
    slots: usize,
}

pub(super) struct Slot {
    pos: BatchPos,
    indices: Vec<usize>,
    records: Vec<Option<Bytes>>,
    missing: usize,
}

pub(super) enum Done {
    Bucket {
        request: RecordRequest,
        attempts: u32,
        result: Result<Vec<Bytes>, RetryFailure>,
    },
    Disk {
        sample: usize,
        result: Result<Bytes, CacheError>,
    },
    Peer {
        owner: u32,
        samples: Vec<usize>,
        result: Result<Vec<Option<Bytes>>, crate::peers::PeerError>,
    },
}

pub(super) struct Pump {
    pub(super) reader: DatasetReader,
    pub(super) schedule: Schedule,
    pub(super) window: PrefetchWindow,
    pub(super) settings: LoaderSettings,
    pub(super) cache: TieredCache,
    pub(super) shared: Arc<Shared>,
    pub(super) tx: mpsc::Sender<Item>,
    /// The global step to plan next.
    pub(super) next: Option<u64>,
    /// Epoch whose far-future cache entries were last re-examined.
    pub(super) rekeyed: Option<u64>,
    pub(super) slots: VecDeque<Slot>,
    /// Sequence number of `slots[0]`.
    pub(super) base_seq: u64,
    /// Samples in `slots`.
    pub(super) ahead: usize,
    pub(super) waiting: HashMap<usize, Waiting>,
    pub(super) held: HashMap<usize, Held>,
    /// Samples to fetch from the bucket, not yet turned into requests.
    pub(super) queued: Vec<usize>,
    /// Requests not started yet, soonest need first.
    pub(super) requests: BTreeMap<(u64, u64), RecordRequest>,
    pub(super) request_seq: u64,
    pub(super) inflight: usize,
    pub(super) tasks: JoinSet<Done>,
    /// The peer tier, when the worker has one.
    pub(super) peers: Option<PeerState>,
}

/// One request under the retry policy: transient errors (store failures
/// and short bodies, see [`DatasetError::is_transient`]) are retried within
/// the outage budget; a missing or truncated object, a bad label or a
/// refused request fails at once. The result carries the attempts.
///
/// [`DatasetError::is_transient`]: ps_dataset::DatasetError::is_transient
async fn fetch_with_retry(
    reader: DatasetReader,
    request: RecordRequest,
    retry: RetryPolicy,
    outage: Arc<OutageLog>,
) -> Done {
    let object = request.object.to_string();
    let (result, attempts) = retry
        .run(&object, &outage, || reader.read_request(&request))
        .await;
    Done::Bucket {
        request,
        attempts,
        result,
    }
}

impl Pump {
    pub(super) async fn run(mut self) {
        let outcome = self.drive().await;
        self.tasks.abort_all();
        if outcome.is_ok() && self.peers.is_some() {
            // This rank's stream is done, but other ranks may still need
            // what it owns: the trainer sees the end, and the cache keeps
            // serving until the loader is dropped.
            self.cache.save_index();
            // `finished` first: the trainer reads it once the channel ends.
            self.shared.finished.store(true, Ordering::SeqCst);
            self.shared.rest.send_replace(Some(u64::MAX));
            let (closed, _) = mpsc::channel(1);
            drop(std::mem::replace(&mut self.tx, closed));
            while let Some(call) = peers::next_call(&mut self.peers).await {
                self.serve(call).await;
            }
            return;
        }
        let Pump {
            cache, tx, shared, ..
        } = self;
        // Clean the disk tier up before the trainer can see the end.
        drop(cache);
        shared.rest.send_replace(Some(u64::MAX));
        match outcome {
            Ok(()) => shared.finished.store(true, Ordering::SeqCst),
            Err(e) => {
                shared.set_failure(e.to_string());
                let _ = tx.send(Err(e)).await;
            }
        }
    }

    async fn drive(&mut self) -> Result<(), LoaderError> {
        loop {
            self.plan().await?;
            self.launch()?;
            while self.front_complete() {
                match self.tx.clone().try_reserve_owned() {
                    Ok(permit) => {
                        let item = self.emit().await?;
                        permit.send(Ok(item));
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => break,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Ok(()),
                }
            }
            if self.next.is_none() && self.slots.is_empty() {
                return Ok(());
            }
            if self.can_plan()? {
                // Emitting made room: plan more before waiting.
                continue;
            }
            // Throughput balancing: the next step is past the split
            // schedule's horizon; planning goes on once more is known.
            let horizon = self.next.is_some() && self.schedule.balanced_run();
            let front_complete = self.front_complete();
            // Other ranks are served while the pump waits for something
            // else; with nothing else to wait for, the loader is stuck
            // (below), not serving forever.
            let serving = front_complete || !self.tasks.is_empty();
            let tx = self.tx.clone();
            // The batches taken, as the queue itself counts them: handed
            // over (`base_seq`) less those still queued. Not the trainer's
            // `taken`, which it bumps only after `recv` has already freed a
            // place: read here in between, it would publish a rest one
            // batch behind, and `settled` would wait for it forever.
            let queued = (self.tx.max_capacity() - self.tx.capacity()) as u64;
            let rest = (self.tasks.is_empty() && self.tx.capacity() == 0)
                .then(|| self.base_seq.saturating_sub(queued));
            self.shared
                .rest
                .send_if_modified(|r| std::mem::replace(r, rest) != rest);
            tokio::select! {
                done = self.tasks.join_next(), if !self.tasks.is_empty() => match done {
                    Some(Ok(done)) => self.complete(done).await?,
                    Some(Err(e)) => return Err(LoaderError::Task(e.to_string())),
                    None => {}
                },
                permit = tx.reserve_owned(), if front_complete => match permit {
                    Ok(permit) => {
                        let item = self.emit().await?;
                        permit.send(Ok(item));
                    }
                    Err(_) => return Ok(()),
                },
                call = peers::next_call(&mut self.peers), if serving => match call {
                    Some(call) => self.serve(call).await,
                    None => {
                        // Another loader of this worker serves now.
                        if let Some(p) = &mut self.peers {
                            p.calls = None;
                        }
                    }
                },
                () = self.schedule.changed(), if horizon => {}
                else => {
                    return Err(LoaderError::Task(
                        "the loader has nothing to wait for but batches are incomplete".into(),
                    ))
                }
            }
        }
    }

    fn front_complete(&self) -> bool {
        self.slots.front().is_some_and(|s| s.missing == 0)
    }

    /// Whether the next step may be planned now: the window admits it and
    /// its split is final.
    fn can_plan(&mut self) -> Result<bool, LoaderError> {
        match self.next {
            Some(step) if self.window.admits(self.ahead, self.settings.batch_size) => {
                self.schedule.ready(step)
            }
            _ => Ok(false),
        }
    }

    /// Plans batches while the window admits them.
    async fn plan(&mut self) -> Result<(), LoaderError> {
        while self.can_plan()? {
            let Some(step) = self.next else { break };
            let (first, indices) = self.schedule.batch(step);
            if indices.is_empty() {
                // The split of the run's last step left this rank nothing.
                self.next = None;
                break;
            }
            let last = first + (indices.len() as u64).saturating_sub(1);
            let last_epoch = self.schedule.plan().epoch_of(last);
            if self.rekeyed != Some(last_epoch) {
                self.rekey(last_epoch).await;
            }
            self.plan_batch(step, first, indices).await?;
            self.next = (step + 1 < self.schedule.end_step()).then_some(step + 1);
        }
        Ok(())
    }

    /// Turns queued samples into requests and starts as many as allowed.
    fn launch(&mut self) -> Result<(), LoaderError> {
        self.launch_peers();
        if !self.queued.is_empty() {
            let queued = std::mem::take(&mut self.queued);
            let requests = self.reader.plan_requests(
                Split::Train,
                &queued,
                self.settings.max_request_bytes,
            )?;
            for request in requests {
                let need = request
                    .indices()
                    .filter_map(|s| self.waiting.get(&s).map(|w| w.first_need))
                    .min()
                    .unwrap_or(u64::MAX);
                self.request_seq += 1;
                self.requests.insert((need, self.request_seq), request);
            }
        }
        while self.inflight < self.settings.max_inflight_requests {
            let Some((_, request)) = self.requests.pop_first() else {
                break;
            };
            let reader = self.reader.clone();
            let retry = self.settings.retry;
            let outage = self.shared.outage.clone();
            self.tasks
                .spawn(fetch_with_retry(reader, request, retry, outage));
            self.inflight += 1;
        }
        Ok(())
    }

    async fn complete(&mut self, done: Done) -> Result<(), LoaderError> {
        match done {
            Done::Bucket {
                request,
                attempts,
                result,
            } => {
                self.inflight -= 1;
                let epoch = request
                    .indices()
                    .filter_map(|s| self.waiting.get(&s))
                    .filter_map(|w| w.waiters.first())
                    .filter_map(|&(seq, _)| self.slot(seq).map(|s| s.pos.epoch))
                    .min()
                    .unwrap_or(0);
                let bytes: u64 = match &result {
                    Ok(records) => records.iter().map(|r| r.len() as u64).sum(),
                    Err(_) => 0,
                };
                let ok = u64::from(result.is_ok());
                self.shared.stats.update(epoch, |s| {
                    s.gets += ok;
                    s.get_attempts += u64::from(attempts);
                    s.retries += u64::from(attempts.saturating_sub(1));
                    s.bucket_bytes += bytes;
                });
                match result {
                    Ok(records) => {
                        for (sample, record) in request.indices().zip(records) {
                            self.deliver(sample, record).await;
                        }
                    }
                    Err(failure) => {
                        return Err(LoaderError::from_retry(
                            request.object.to_string(),
                            attempts,
                            failure,
                        ))
                    }
                }
            }
            Done::Peer {
                owner,
                samples,
                result,
            } => self.complete_peer(owner, samples, result).await,
            Done::Disk { sample, result } => match result.and_then(|bytes| {
                // The file's own checksum was right; the bytes must also be
                // the sample the manifest describes.
                self.reader
                    .verify_record(Split::Train, sample, &bytes)
                    .map(|()| bytes)
                    .map_err(|e| CacheError::Damaged {
                        path: self.cache.disk().map_or_else(
                            || PathBuf::from(format!("sample {sample}")),
                            |d| d.file_of(sample as u64),
                        ),
                        message: e.to_string(),
                    })
            }) {
                Ok(bytes) => self.deliver(sample, bytes).await,
                Err(e) => {
                    tracing::warn!("sample {sample}: {e}; fetching it from the bucket");
                    let epoch = self
                        .waiting
                        .get(&sample)
                        .and_then(|w| w.waiters.first())
                        .and_then(|&(seq, _)| self.slot(seq).map(|s| s.pos.epoch))
                        .unwrap_or(0);
                    self.shared.stats.update(epoch, |s| s.disk_errors += 1);
                    self.cache.forget(sample as u64).await;
                    if let Some(w) = self.waiting.get_mut(&sample) {
                        w.source = Source::Bucket;
                    }
                    self.queued.push(sample);
                }
            },
        }
        Ok(())
    }

    fn slot(&self, seq: u64) -> Option<&Slot> {
        let i = usize::try_from(seq.checked_sub(self.base_seq)?).ok()?;
        self.slots.get(i)
    }
}

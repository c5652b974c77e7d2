//! The `Loader`: hands the trainer its batches, fetched ahead of time from a
//! slow bucket through a memory and a disk cache.
//!
//! The sample order is known in advance (this rank's part of every global
//! step of the epochs' seeded global orders, see [`RankPlan`]), so the loader
//! runs a pump task that works ahead of the trainer:
//!
//! * **Plan.** Batches are planned in order while the prefetch window allows:
//!   at most `lookahead_samples` samples and `max_inflight_bytes` of sample
//!   bytes planned but not yet taken by the trainer ([`PrefetchWindow`]; one
//!   batch always proceeds, so small bounds only cost speed). Every sample of
//!   a planned batch is looked up in the window itself, the memory tier and
//!   the disk tier ([`TieredCache`]); the rest is queued for the bucket.
//! * **Fetch.** Queued samples become GETs ([`DatasetReader::plan_requests`]:
//!   one per object in the per-sample layout, adjacent records of a shard
//!   merged into one range GET), started soonest-needed first with at most
//!   `max_inflight_requests` in flight. A transient failure (a store error,
//!   a body cut short) is retried with jittered exponential backoff for up
//!   to the outage budget ([`RetryPolicy`]), with a log line every few
//!   seconds saying so; a permanent one (a missing or truncated object, a bad
//!   label) and an outage longer than the budget give the trainer an error
//!   naming the object.
//! * **Cache.** Each sample, once in hand, is offered to the cache with its
//!   next use (its position in a later epoch), and the [`TierPlan`] keeps the
//!   samples needed soonest.
//! * **Hand over.** Complete batches are decoded in order into a bounded
//!   channel (`ready_batches`); when the trainer is slow, the channel and the
//!   window fill up and planning stops (back-pressure).
//!
//! A run restarted mid-epoch resumes with [`LoaderSettings::resume_from`]
//! (where the stream resumed, possibly with another worker count) and
//! [`LoaderSettings::starting_at`], and gets exactly the batches the
//! uninterrupted run would have had; the disk tier an earlier run left for
//! the same dataset is reused, soonest-needed samples first, so the restarted
//! run fetches only what it lacks. Samples read back from the disk are checked
//! against the manifest's checksums. Per-epoch
//! counters (hits per tier, GETs, bytes from the bucket, retries) are in
//! [`LoaderStats`].
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use object_store::{memory::InMemory, path::Path, ObjectStore};
//! use ps_dataset::{synthetic, write_dataset, DatasetReader, SyntheticSpec};
//! use ps_shared::sampler::EpochSampler;
//! use ps_worker::loader::{Loader, LoaderSettings};
//!
//! let spec = SyntheticSpec { train: 100, test: 0, features: 4, classes: 2, ..SyntheticSpec::default() };
//! let (train, test) = synthetic(&spec);
//! let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
//! write_dataset(store.as_ref(), &Path::default(), "toy", 4, 2, &train, &test, 16).await.unwrap();
//! let reader = DatasetReader::open(store, Path::default()).await.unwrap();
//! let sampler = EpochSampler::new(100, 1, 0, 7).unwrap();
//! let mut settings = LoaderSettings::new(10, 2);
//! settings.memory_cache_bytes = 1000;
//! let mut loader = Loader::start(reader, sampler, settings).unwrap();
//! let mut batches = 0;
//! while let Some((pos, batch)) = loader.next().await.unwrap() {
//!     assert_eq!(batch.len(), 10);
//!     batches += 1;
//!     assert_eq!(pos.step, batches - 1);
//!     assert_eq!(pos.epoch, (batches - 1) / 10);
//! }
//! assert_eq!(batches, 20);
//! assert_eq!(loader.stats().epoch(0).samples, 100);
//! # });
//! ```
//!
//! [`RankPlan`]: ps_shared::sampler::RankPlan

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ps_dataset::{Batch, DatasetError, DatasetReader, Manifest, Split};
use ps_shared::config::ClusterConfig;
use ps_shared::sampler::{EpochSampler, ResumePoint, SamplerError};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::balance::SplitNews;
use crate::cache::{CacheError, DatasetIdentity, TieredCache};

mod pump;
mod retry;
mod schedule;
mod stats;

pub use retry::{Outage, OutageLog, RetryFailure, RetryPolicy};
pub use schedule::{PrefetchWindow, Schedule, FAR_FUTURE};
pub use stats::{EpochDataStats, LoaderStats};

use pump::{PeerState, Pump};

use crate::peers::{Owners, PeerNet};

/// Where a batch sits in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPos {
    /// The epoch of its first sample.
    pub epoch: u64,
    /// The global step it belongs to.
    pub step: u64,
    /// Stream position of its first sample ([`RankPlan`]): sample `i` of
    /// the batch is at `first + i`.
    ///
    /// [`RankPlan`]: ps_shared::sampler::RankPlan
    pub first: u64,
    /// The sample indices planned for the batch, in order (a sample that
    /// cannot be decoded may be missing from the batch itself).
    pub samples: Arc<[usize]>,
}

/// Everything that can stop the loader.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// A GET failed for good (a permanent error: not retried).
    #[error("reading {object} failed after {attempts} attempt(s): {source}")]
    Fetch {
        object: String,
        attempts: u32,
        #[source]
        source: Box<DatasetError>,
    },
    /// A GET kept failing for the whole outage budget.
    #[error(
        "the bucket stayed unreachable for {failing_s:.0} s reading {object} ({attempts} attempts; \
         the outage budget is loader.outage_budget_s): {source}"
    )]
    Outage {
        object: String,
        attempts: u32,
        failing_s: f64,
        #[source]
        source: Box<DatasetError>,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("sample order: {0}")]
    Sampler(#[from] SamplerError),
    #[error("invalid loader settings: {0}")]
    Settings(String),
    #[error("fetch task failed: {0}")]
    Task(String),
    /// The loader already reported an error and stopped.
    #[error("the loader stopped after an earlier error: {0}")]
    Stopped(String),
}

/// How a [`Loader`] runs, apart from the dataset and the sample order.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderSettings {
    pub batch_size: usize,
    /// Epochs of the run: the last batch is from epoch `epochs - 1`.
    pub epochs: u64,
    /// Where the run's sample stream resumed; `None` is the beginning of
    /// the run.
    pub start: Option<ResumePoint>,
    /// The global step to begin at (at or after `start`'s step); `None`:
    /// `start`'s step.
    pub first_step: Option<u64>,
    /// Samples planned ahead of the trainer (at least one batch is).
    pub lookahead_samples: usize,
    /// Concurrent GETs.
    pub max_inflight_requests: usize,
    /// Sample bytes planned but not yet taken by the trainer.
    pub max_inflight_bytes: u64,
    /// Decoded batches queued for the trainer.
    pub ready_batches: usize,
    /// Memory tier capacity in bytes (0: none).
    pub memory_cache_bytes: u64,
    /// Disk tier directory and capacity in bytes.
    pub disk_cache: Option<(PathBuf, u64)>,
    /// Largest merged range GET in the shard layout.
    pub max_request_bytes: u64,
    pub retry: RetryPolicy,
    /// The worker's peer tier ([`crate::peers`]); `None`: every miss reads
    /// the bucket.
    pub peers: Option<PeerLink>,
}

/// A loader's way into the peer tier: the worker's [`PeerNet`], shared by
/// the loaders it starts (equal when it is the same one).
#[derive(Clone, Debug)]
pub struct PeerLink(pub Arc<PeerNet>);

impl PartialEq for PeerLink {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl LoaderSettings {
    /// Prefetching with the `[loader]` defaults and no cache.
    pub fn new(batch_size: usize, epochs: u64) -> Self {
        let d = ps_shared::config::LoaderSection::default();
        Self {
            batch_size,
            epochs,
            start: None,
            first_step: None,
            lookahead_samples: d.lookahead(batch_size),
            max_inflight_requests: d.max_inflight_requests,
            max_inflight_bytes: d.max_inflight_bytes(),
            ready_batches: d.ready_batches,
            memory_cache_bytes: 0,
            disk_cache: None,
            max_request_bytes: d.max_request_kb as u64 * 1024,
            retry: RetryPolicy::default(),
            peers: None,
        }
    }

    /// The settings of `cfg` for worker `rank`, cache fractions resolved
    /// against the training split of `manifest`. The disk tier of rank `r`
    /// lives in `<disk_cache_dir>/rank-<r>`. The lookahead is at least
    /// `data.prefetch_batches` batches.
    pub fn from_config(cfg: &ClusterConfig, manifest: &Manifest, rank: u32) -> Self {
        let l = &cfg.loader;
        let batch = cfg.data.batch_size;
        let dataset_bytes = manifest.total_bytes(Split::Train);
        let disk_bytes = l.disk_cache.resolve(dataset_bytes);
        let dir = l.disk_cache_dir.trim();
        let disk_cache = (!dir.is_empty() && disk_bytes > 0)
            .then(|| (PathBuf::from(dir).join(format!("rank-{rank}")), disk_bytes));
        Self {
            batch_size: batch,
            epochs: cfg.training.epochs,
            start: None,
            first_step: None,
            lookahead_samples: l
                .lookahead(batch)
                .max(cfg.data.prefetch_batches.saturating_mul(batch)),
            max_inflight_requests: l.max_inflight_requests,
            max_inflight_bytes: l.max_inflight_bytes(),
            ready_batches: l.ready_batches,
            memory_cache_bytes: l.memory_cache.resolve(dataset_bytes),
            disk_cache,
            max_request_bytes: (l.max_request_kb as u64).saturating_mul(1024),
            retry: RetryPolicy::from_config(cfg, rank),
            peers: None,
        }
    }

    /// Continue a sample stream that resumed at `point`.
    pub fn resume_from(mut self, point: ResumePoint) -> Self {
        self.start = Some(point);
        self
    }

    /// Serve and ask peers through `net`.
    pub fn with_peers(mut self, net: Arc<PeerNet>) -> Self {
        self.peers = Some(PeerLink(net));
        self
    }

    /// Begin at global step `step` of the stream.
    pub fn starting_at(mut self, step: u64) -> Self {
        self.first_step = Some(step);
        self
    }
}

type Item = Result<(BatchPos, Arc<Batch>), LoaderError>;

struct Shared {
    stats: Arc<LoaderStats>,
    outage: Arc<OutageLog>,
    finished: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Batches the trainer has taken.
    taken: AtomicU64,
    /// `Some(t)`: the pump can do nothing until the trainer takes a batch
    /// (nothing in flight, the queue of ready batches full) and `t` batches
    /// have left the queue; `u64::MAX` once it has ended. `None`: busy.
    rest: watch::Sender<Option<u64>>,
}

impl Shared {
    fn failure(&self) -> Option<String> {
        ps_shared::sync::lock(&self.failure).clone()
    }

    fn set_failure(&self, message: String) {
        *ps_shared::sync::lock(&self.failure) = Some(message);
    }
}

/// A running loader: the pump task and the receiving end of its batches.
/// Dropping it stops the pump.
pub struct Loader {
    rx: mpsc::Receiver<Item>,
    shared: Arc<Shared>,
    end_step: u64,
    task: JoinHandle<()>,
    /// Operations queued on the disk tier and not finished, if there is one.
    disk_ops: Option<watch::Receiver<usize>>,
}

impl Loader {
    /// Starts the pump task (on the current tokio runtime).
    pub fn start(
        reader: DatasetReader,
        sampler: EpochSampler,
        settings: LoaderSettings,
    ) -> Result<Self, LoaderError> {
        Self::start_with(reader, sampler, settings, None)
    }

    /// [`Loader::start`] with throughput balancing: the batches follow the
    /// split schedule `news` tells of, and no step past its horizon is
    /// planned (see [`crate::balance`]).
    pub fn start_balanced(
        reader: DatasetReader,
        sampler: EpochSampler,
        settings: LoaderSettings,
        news: watch::Receiver<SplitNews>,
    ) -> Result<Self, LoaderError> {
        Self::start_with(reader, sampler, settings, Some(news))
    }

    fn start_with(
        reader: DatasetReader,
        sampler: EpochSampler,
        settings: LoaderSettings,
        news: Option<watch::Receiver<SplitNews>>,
    ) -> Result<Self, LoaderError> {
        if settings.batch_size == 0 {
            return Err(LoaderError::Settings("batch_size must be >= 1".into()));
        }
        let origin = settings
            .start
            .unwrap_or_else(|| ResumePoint::start(sampler.seed()));
        let plan = sampler.plan_from(settings.batch_size, settings.epochs, origin)?;
        let first = settings.first_step.unwrap_or(origin.step);
        if first < origin.step {
            return Err(SamplerError::StepBeforeResume {
                step: first,
                origin: origin.step,
            }
            .into());
        }
        let schedule = match news {
            Some(news) => Schedule::balanced(plan, news)?,
            None => Schedule::new(plan)?,
        };
        let end_step = schedule.end_step();
        if settings.max_inflight_requests == 0 || settings.ready_batches == 0 {
            return Err(LoaderError::Settings(
                "max_inflight_requests and ready_batches must be >= 1".into(),
            ));
        }
        let next = (first < end_step).then_some(first);
        let (manifest_crc32, manifest_bytes) = reader.manifest_checksum();
        let dataset = DatasetIdentity {
            location: format!("{} {}", reader.store(), reader.prefix()),
            manifest_crc32,
            manifest_bytes,
        };
        let mut cache = TieredCache::new(
            settings.memory_cache_bytes,
            settings.disk_cache.clone(),
            &dataset,
        )?;
        // Disk files of an earlier run (a restart) serve the samples this
        // run needs soonest; the others go. With peers, the files kept are
        // the samples this rank owns, by the cluster's next use.
        let mut schedule = schedule;
        let num_samples = schedule.plan().sampler().num_samples();
        let owners = settings
            .peers
            .as_ref()
            .map(|_| Owners::of_plan(schedule.plan()));
        let me = sampler.rank() as u32;
        let restored = cache.restore(|key| match (next, usize::try_from(key)) {
            (Some(step), Ok(sample)) if sample < num_samples => match &owners {
                None => schedule.next_use_at(step, sample),
                Some(o) if o.owner(sample) == Some(me) => {
                    let from = schedule.plan().range(step).start;
                    Some(
                        schedule
                            .cluster_next_use(sample, from)
                            .unwrap_or(FAR_FUTURE + sample as u64),
                    )
                }
                Some(_) => None,
            },
            _ => None,
        });
        if restored > 0 {
            tracing::info!("disk cache: reusing {restored} samples kept by an earlier run");
        }
        let disk_ops = cache.disk().map(|d| d.pending_ops());
        let (tx, rx) = mpsc::channel(settings.ready_batches);
        let shared = Arc::new(Shared {
            stats: Arc::new(LoaderStats::default()),
            outage: Arc::new(OutageLog::default()),
            finished: AtomicBool::new(false),
            failure: Mutex::new(None),
            taken: AtomicU64::new(0),
            rest: watch::Sender::new(None),
        });
        let window = PrefetchWindow {
            lookahead_samples: settings.lookahead_samples,
            max_bytes: settings.max_inflight_bytes,
            record_bytes: reader.record_bytes() as u64,
        };
        let peers = match (settings.peers.clone(), owners) {
            (Some(PeerLink(net)), Some(owners)) => {
                tracing::info!(
                    rank = me,
                    owned = owners.count(me),
                    "peer cache tier: serving the samples this rank reads first"
                );
                Some(PeerState::new(net, owners, num_samples))
            }
            _ => None,
        };
        let pump = Pump {
            reader,
            schedule,
            window,
            settings,
            cache,
            shared: shared.clone(),
            tx,
            next,
            rekeyed: None,
            slots: VecDeque::new(),
            base_seq: 0,
            ahead: 0,
            waiting: HashMap::new(),
            held: HashMap::new(),
            queued: Vec::new(),
            requests: BTreeMap::new(),
            request_seq: 0,
            inflight: 0,
            tasks: JoinSet::new(),
            peers,
        };
        let task = tokio::spawn(pump.run());
        Ok(Self {
            rx,
            shared,
            end_step,
            task,
            disk_ops,
        })
    }

    /// Like [`Loader::start`], beginning at global step `step`.
    pub fn start_at(
        reader: DatasetReader,
        sampler: EpochSampler,
        settings: LoaderSettings,
        step: u64,
    ) -> Result<Self, LoaderError> {
        Self::start(reader, sampler, settings.starting_at(step))
    }

    /// The first global step this worker has no batch for.
    pub fn end_step(&self) -> u64 {
        self.end_step
    }

    /// Stops the pump and waits until it has let go of everything: the disk
    /// tier has finished its IO and saved its index, so that a loader started
    /// next on the same directory reuses its files.
    pub async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }

    /// The per-epoch counters.
    pub fn stats(&self) -> Arc<LoaderStats> {
        self.shared.stats.clone()
    }

    /// The loader's record of bucket failures.
    pub fn outage_log(&self) -> Arc<OutageLog> {
        self.shared.outage.clone()
    }

    /// Resolves once the loader is at rest while nobody takes batches: the
    /// pump waits for the trainer with nothing in flight and the ready
    /// queue full (or has ended), and the disk tier has finished every
    /// operation it was given. Until the next batch is taken, the caches do
    /// not change.
    pub async fn settled(&self) {
        let shared = &self.shared;
        let mut rest = shared.rest.subscribe();
        let _ = rest
            .wait_for(|r| {
                r.is_some_and(|t| t == u64::MAX || t == shared.taken.load(Ordering::SeqCst))
            })
            .await;
        if let Some(ops) = &self.disk_ops {
            let mut ops = ops.clone();
            let _ = ops.wait_for(|n| *n == 0).await;
        }
    }

    /// Batches ready in the queue, waiting for the trainer.
    pub fn ready(&self) -> usize {
        self.rx.len()
    }

    /// The next batch in order, `None` after the last one. After an error
    /// every later call fails too.
    pub async fn next(&mut self) -> Result<Option<(BatchPos, Arc<Batch>)>, LoaderError> {
        match self.rx.recv().await {
            Some(Ok(item)) => {
                self.shared.taken.fetch_add(1, Ordering::SeqCst);
                Ok(Some(item))
            }
            Some(Err(e)) => Err(e),
            None if self.shared.finished.load(Ordering::SeqCst) => Ok(None),
            None => {
                Err(LoaderError::Stopped(self.shared.failure().unwrap_or_else(
                    || "the loader task ended unexpectedly".into(),
                )))
            }
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.task.abort();
    }
}

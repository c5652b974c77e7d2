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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use ps_dataset::{Batch, DatasetError, DatasetReader, Manifest, RecordRequest, Split};
use ps_shared::config::{ClusterConfig, CostModel};
use ps_shared::sampler::{EpochSampler, RankPlan, ResumePoint, SamplerError};

use crate::cache::{CacheError, DatasetIdentity, Lookup, TieredCache};

/// Where a batch sits in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPos {
    /// The epoch of its first sample.
    pub epoch: u64,
    /// The global step it belongs to.
    pub step: u64,
    /// Stream position of its first sample ([`RankPlan`]): sample `i` of
    /// the batch is at `first + i`.
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

/// Retries of transient bucket errors: exponential backoff with full
/// jitter (each wait drawn uniformly from zero to a ceiling that doubles
/// per retry up to `max_backoff`), for as long as the request has been
/// failing for less than `outage_budget`. Permanent errors
/// ([`DatasetError::is_transient`] is false) are never retried.
///
/// The jitter is drawn from a generator seeded with `seed` and the object's
/// name, so a run (and a test on tokio's paused clock) is reproducible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Ceiling of the first wait; doubles per retry.
    pub backoff: Duration,
    /// Largest ceiling of a wait.
    pub max_backoff: Duration,
    /// How long one request may keep failing before the loader gives up.
    pub outage_budget: Duration,
    /// How long one attempt may take: a store that hangs instead of
    /// refusing fails the attempt at this deadline, and the outage clock
    /// starts there. During an outage an attempt's deadline is also cut to
    /// the end of the budget, so the budget is honoured exactly.
    pub request_timeout: Duration,
    /// Seed of the jitter.
    pub seed: u64,
}

impl RetryPolicy {
    /// The ceiling of the wait before retry number `retry` (1-based).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32 << retry.saturating_sub(1).min(20);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }

    /// The wait before retry number `retry`: uniform in `[0, ceiling]`.
    pub fn delay(&self, retry: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(retry);
        ceiling.mul_f64(rng.random::<f64>())
    }

    /// The jitter generator of one object.
    pub fn rng_for(&self, object: &str) -> StdRng {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        object.hash(&mut h);
        StdRng::seed_from_u64(self.seed ^ h.finish())
    }

    /// Runs `op` until it succeeds, fails with a permanent error, or has
    /// kept failing for the outage budget. Each attempt has its own deadline
    /// (`request_timeout`, cut to the end of the budget once failing): an
    /// attempt past it is a transient failure at the deadline. Waits on
    /// tokio's clock and tells `outage` about every failure. Returns the
    /// result and the attempts.
    pub async fn run<T, F, Fut>(
        &self,
        object: &str,
        outage: &OutageLog,
        mut op: F,
    ) -> (Result<T, RetryFailure>, u32)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, DatasetError>>,
    {
        let mut rng = self.rng_for(object);
        let mut first_failure: Option<Instant> = None;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let start = Instant::now();
            let mut deadline = start + self.request_timeout;
            if let Some(since) = first_failure {
                deadline = deadline.min(since + self.outage_budget);
            }
            let result = match tokio::time::timeout_at(deadline, op()).await {
                Ok(result) => result,
                Err(_) => Err(DatasetError::Store(object_store::Error::Generic {
                    store: "bucket",
                    source: format!(
                        "no answer within {:.1} s (loader.request_timeout_s)",
                        (deadline - start).as_secs_f64()
                    )
                    .into(),
                })),
            };
            match result {
                Ok(v) => {
                    if first_failure.is_some() {
                        outage.recovered(object);
                    }
                    return (Ok(v), attempts);
                }
                Err(e) if !e.is_transient() => {
                    return (Err(RetryFailure::Permanent(e)), attempts);
                }
                Err(e) => {
                    let now = Instant::now();
                    let since = *first_failure.get_or_insert(now);
                    let failing = now - since;
                    if failing >= self.outage_budget {
                        return (
                            Err(RetryFailure::OutOfBudget { failing, source: e }),
                            attempts,
                        );
                    }
                    let wait = self
                        .delay(attempts, &mut rng)
                        .min(self.outage_budget - failing);
                    outage.failing(object, failing, self.outage_budget, &e);
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

impl RetryPolicy {
    /// The `[loader]` retry settings, jitter seeded by `data.seed` and the rank.
    pub fn from_config(cfg: &ClusterConfig, rank: u32) -> Self {
        let l = &cfg.loader;
        Self {
            backoff: Duration::from_millis(l.retry_backoff_ms),
            max_backoff: Duration::from_millis(l.retry_max_backoff_ms),
            outage_budget: ps_shared::config::secs(l.outage_budget_s),
            request_timeout: ps_shared::config::secs(l.request_timeout_s),
            seed: cfg.data.seed ^ u64::from(rank).rotate_left(32),
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        let d = ps_shared::config::LoaderSection::default();
        Self {
            backoff: Duration::from_millis(d.retry_backoff_ms),
            max_backoff: Duration::from_millis(d.retry_max_backoff_ms),
            outage_budget: ps_shared::config::secs(d.outage_budget_s),
            request_timeout: ps_shared::config::secs(d.request_timeout_s),
            seed: 1,
        }
    }
}

/// Why [`RetryPolicy::run`] gave up.
#[derive(Debug)]
pub enum RetryFailure {
    /// Not worth another try (a missing object, a truncated one, a bad label).
    Permanent(DatasetError),
    /// Transient failures for the whole outage budget.
    OutOfBudget {
        failing: Duration,
        source: DatasetError,
    },
}

/// A bucket outage under way: since when a request has kept failing, and
/// for how long it may (what the progress bar shows while the trainer waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    /// When the failing request first failed (tokio's clock).
    pub since: Instant,
    /// The outage budget (`loader.outage_budget_s`).
    pub budget: Duration,
}

impl Outage {
    /// How long the bucket has been unreachable at `now`.
    pub fn lasted(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }

    /// E.g. "bucket unreachable 12 s (budget 120 s)".
    pub fn message(&self, now: Instant) -> String {
        format!(
            "bucket unreachable {} s (budget {} s)",
            self.lasted(now).as_secs(),
            self.budget.as_secs()
        )
    }
}

/// Says, at most once per `every`, that the bucket is failing and for how
/// long, then that it recovered; a log line rather than silence while the
/// trainer waits. Shared by all requests of a loader (or a run). The outage
/// under way, if any, is also published on a watch channel
/// ([`OutageLog::watch`]) that the progress bar reads.
#[derive(Debug)]
pub struct OutageLog {
    every: Duration,
    /// When the last "unreachable" line was written, and whether a failure
    /// was seen since the last recovery line.
    state: Mutex<(Option<Instant>, bool)>,
    /// Failed attempts seen, for tests and reports.
    failures: AtomicU64,
    /// The outage under way: set by the first failure, cleared when a
    /// request gets through again.
    status: watch::Sender<Option<Outage>>,
}

impl Default for OutageLog {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

impl OutageLog {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, false)),
            failures: AtomicU64::new(0),
            status: watch::Sender::new(None),
        }
    }

    /// Failed attempts reported so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The outage under way, if any.
    pub fn current(&self) -> Option<Outage> {
        *self.status.borrow()
    }

    /// Follows the outage under way: `Some` from a request's first failure
    /// until a request succeeds again.
    pub fn watch(&self) -> watch::Receiver<Option<Outage>> {
        self.status.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<Instant>, bool)> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn failing(&self, object: &str, failing: Duration, budget: Duration, e: &DatasetError) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        self.status.send_if_modified(|status| {
            let starts = status.is_none();
            if starts {
                *status = Some(Outage {
                    since: now.checked_sub(failing).unwrap_or(now),
                    budget,
                });
            }
            starts
        });
        let mut st = self.lock();
        st.1 = true;
        if st.0.is_some_and(|t| now - t < self.every) {
            tracing::debug!(object, "GET failed, retrying: {e}");
            return;
        }
        st.0 = Some(now);
        tracing::warn!(
            "bucket unreachable for {} s, retrying (budget {} s): {object}: {e}",
            failing.as_secs(),
            budget.as_secs()
        );
    }

    fn recovered(&self, object: &str) {
        self.status
            .send_if_modified(|status| status.take().is_some());
        let mut st = self.lock();
        if std::mem::replace(&mut st.1, false) {
            tracing::warn!("bucket reachable again ({object} read)");
        }
    }
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
        }
    }

    /// Continue a sample stream that resumed at `point`.
    pub fn resume_from(mut self, point: ResumePoint) -> Self {
        self.start = Some(point);
        self
    }

    /// Begin at global step `step` of the stream.
    pub fn starting_at(mut self, step: u64) -> Self {
        self.first_step = Some(step);
        self
    }
}

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

/// Data-plane counters of one epoch. GETs and bytes are counted for the
/// epoch of the batch that needed them, even when fetched during the previous
/// epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EpochDataStats {
    /// Samples handed to the trainer.
    pub samples: u64,
    /// Samples served from memory (the memory tier or the prefetch window).
    pub memory_hits: u64,
    /// Samples served from the disk tier.
    pub disk_hits: u64,
    /// Samples fetched from the bucket.
    pub bucket_samples: u64,
    /// Data GETs that succeeded (delivered their records).
    pub gets: u64,
    /// Data GET attempts, failed ones and retries included.
    pub get_attempts: u64,
    /// Bytes received from the bucket.
    pub bucket_bytes: u64,
    /// GETs that were retries.
    pub retries: u64,
    /// Disk-tier reads that failed (the sample was fetched again).
    pub disk_errors: u64,
    /// Images decoded (0 for feature records).
    pub decoded: u64,
    /// Microseconds the decode threads spent, summed over threads.
    pub decode_us: u64,
    /// Samples left out because they could not be decoded
    /// (`data.on_bad_sample = "skip"`).
    pub bad_samples: u64,
}

impl EpochDataStats {
    /// Fraction of samples served from memory.
    pub fn memory_hit_rate(&self) -> f64 {
        ratio(
            self.memory_hits,
            self.memory_hits + self.disk_hits + self.bucket_samples,
        )
    }

    /// Fraction of samples served from the disk tier.
    pub fn disk_hit_rate(&self) -> f64 {
        ratio(
            self.disk_hits,
            self.memory_hits + self.disk_hits + self.bucket_samples,
        )
    }

    /// Estimated request and egress cost in dollars (every attempt is a
    /// request the bucket may bill).
    pub fn cost(&self, prices: &CostModel) -> f64 {
        prices.estimate(self.get_attempts, self.bucket_bytes)
    }

    /// Field-wise sum.
    pub fn add(&mut self, o: &EpochDataStats) {
        self.samples += o.samples;
        self.memory_hits += o.memory_hits;
        self.disk_hits += o.disk_hits;
        self.bucket_samples += o.bucket_samples;
        self.gets += o.gets;
        self.get_attempts += o.get_attempts;
        self.bucket_bytes += o.bucket_bytes;
        self.retries += o.retries;
        self.disk_errors += o.disk_errors;
        self.decoded += o.decoded;
        self.decode_us += o.decode_us;
        self.bad_samples += o.bad_samples;
    }

    /// Images decoded and augmented per second of one decode thread.
    pub fn images_per_core_s(&self) -> f64 {
        if self.decode_us == 0 {
            0.0
        } else {
            self.decoded as f64 / (self.decode_us as f64 / 1e6)
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Per-epoch counters of a loader, shared with its pump task.
#[derive(Debug, Default)]
pub struct LoaderStats {
    per_epoch: Mutex<BTreeMap<u64, EpochDataStats>>,
}

impl LoaderStats {
    /// Counters of `epoch` so far (final once its last batch was handed over).
    pub fn epoch(&self, epoch: u64) -> EpochDataStats {
        self.lock().get(&epoch).copied().unwrap_or_default()
    }

    /// Counters of all epochs together.
    pub fn total(&self) -> EpochDataStats {
        let mut t = EpochDataStats::default();
        for s in self.lock().values() {
            t.add(s);
        }
        t
    }

    fn update(&self, epoch: u64, f: impl FnOnce(&mut EpochDataStats)) {
        f(self.lock().entry(epoch).or_default());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, EpochDataStats>> {
        match self.per_epoch.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

// ---------------------------------------------------------------------------
// Policy: the schedule and the prefetch window
// ---------------------------------------------------------------------------

/// Next-use value of a sample that may be used in a later epoch but not in
/// the next one; plus the key, so such samples still order deterministically.
pub const FAR_FUTURE: u64 = 1 << 62;

const NOT_IN_EPOCH: u64 = u64::MAX;

struct EpochUses {
    /// Stream position of this rank's use of each sample in the epoch, or
    /// [`NOT_IN_EPOCH`].
    position_of: Vec<u64>,
}

/// This worker's part of the sample stream with what the cache needs to
/// know: the stream position of every use (see [`RankPlan`]) and each
/// sample's next use. Holds the uses of at most a few epochs.
pub struct Schedule {
    plan: RankPlan,
    /// Global orders of the epochs batches are being planned from.
    orders: BTreeMap<u64, Vec<usize>>,
    uses: BTreeMap<u64, EpochUses>,
}

impl Schedule {
    pub fn new(plan: RankPlan) -> Result<Self, LoaderError> {
        Ok(Self {
            plan,
            orders: BTreeMap::new(),
            uses: BTreeMap::new(),
        })
    }

    pub fn plan(&self) -> &RankPlan {
        &self.plan
    }

    /// The first global step at which this rank has no batch.
    pub fn end_step(&self) -> u64 {
        self.plan.end_step()
    }

    fn order(&mut self, epoch: u64) -> &[usize] {
        let plan = &self.plan;
        self.orders
            .entry(epoch)
            .or_insert_with(|| plan.sampler().global_order(epoch, plan.batch_size()))
    }

    fn uses(&mut self, epoch: u64) -> &EpochUses {
        if !self.uses.contains_key(&epoch) {
            let n = self.plan.sampler().num_samples();
            let (lo, hi) = (epoch * n as u64, (epoch + 1) * n as u64);
            let mut position_of = vec![NOT_IN_EPOCH; n];
            let steps = self.plan.steps_touching(lo, hi);
            let ranges: Vec<_> = steps.map(|s| self.plan.range(s)).collect();
            let order = self.order(epoch).to_vec();
            for r in ranges {
                for pos in r.start.max(lo)..r.end.min(hi) {
                    if let Some(&sample) = order.get((pos - lo) as usize) {
                        position_of[sample] = pos;
                    }
                }
            }
            self.uses.insert(epoch, EpochUses { position_of });
        }
        &self.uses[&epoch]
    }

    /// The batch of global `step`: its first stream position and samples.
    /// Orders of epochs before the batch's first sample are let go.
    pub fn batch(&mut self, step: u64) -> (u64, Vec<usize>) {
        let range = self.plan.range(step);
        let n = self.plan.sampler().num_samples() as u64;
        let first_epoch = range.start / n;
        self.uses = self.uses.split_off(&first_epoch);
        self.orders = self.orders.split_off(&first_epoch);
        let mut samples = Vec::with_capacity((range.end - range.start) as usize);
        for pos in range.clone() {
            let order = self.order(pos / n);
            samples.push(order[(pos % n) as usize]);
        }
        (range.start, samples)
    }

    /// The first use of `sample` in epoch `epoch` or later: its stream
    /// position in `epoch`, [`FAR_FUTURE`] (plus the sample) when this rank
    /// does not use it in `epoch` but a later epoch of the run exists,
    /// `None` when the run ends before.
    pub fn next_use_from(&mut self, epoch: u64, sample: usize) -> Option<u64> {
        let epochs = self.plan.epochs();
        if epoch >= epochs {
            return None;
        }
        let pos = self
            .uses(epoch)
            .position_of
            .get(sample)
            .copied()
            .unwrap_or(NOT_IN_EPOCH);
        if pos != NOT_IN_EPOCH {
            Some(pos)
        } else if epoch + 1 < epochs {
            Some(FAR_FUTURE + sample as u64)
        } else {
            None
        }
    }

    /// The first use of `sample` at global step `step` or later, for a run
    /// that starts there.
    pub fn next_use_at(&mut self, step: u64, sample: usize) -> Option<u64> {
        let from = self.plan.range(step).start;
        let epoch = self.plan.epoch_of(from);
        match self.next_use_from(epoch, sample) {
            Some(pos) if pos >= from => Some(pos),
            Some(_) => self.next_use_from(epoch.saturating_add(1), sample),
            None => None,
        }
    }

    /// The next use of `sample` after its use at stream position `pos`.
    pub fn next_use_after(&mut self, pos: u64, sample: usize) -> Option<u64> {
        let epoch = self.plan.epoch_of(pos);
        self.next_use_from(epoch.saturating_add(1), sample)
    }
}

/// The prefetch window's bounds: how many samples, and how many bytes of
/// them, may be planned but not yet taken by the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchWindow {
    pub lookahead_samples: usize,
    pub max_bytes: u64,
    pub record_bytes: u64,
}

impl PrefetchWindow {
    /// Whether a batch of `batch` samples may be planned with `ahead`
    /// samples already in the window. An empty window always takes one batch.
    pub fn admits(&self, ahead: usize, batch: usize) -> bool {
        if ahead == 0 {
            return true;
        }
        let samples = ahead.saturating_add(batch);
        samples <= self.lookahead_samples
            && (samples as u64).saturating_mul(self.record_bytes) <= self.max_bytes
    }
}

// ---------------------------------------------------------------------------
// The pump
// ---------------------------------------------------------------------------

type Item = Result<(BatchPos, Arc<Batch>), LoaderError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Disk,
    Bucket,
}

/// A sample some planned batches wait for.
struct Waiting {
    /// `(slot seq, index in the batch)`, first need first.
    waiters: Vec<(u64, usize)>,
    /// Stream position of the latest use waiting.
    last_pos: u64,
    /// Absolute position of the first need.
    first_need: u64,
    source: Source,
}

/// A sample in hand that planned batches still refer to.
struct Held {
    bytes: Bytes,
    slots: usize,
}

struct Slot {
    pos: BatchPos,
    indices: Vec<usize>,
    records: Vec<Option<Bytes>>,
    missing: usize,
}

enum Done {
    Bucket {
        request: RecordRequest,
        attempts: u32,
        result: Result<Vec<Bytes>, RetryFailure>,
    },
    Disk {
        sample: usize,
        result: Result<Bytes, CacheError>,
    },
}

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
        match self.failure.lock() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set_failure(&self, message: String) {
        match self.failure.lock() {
            Ok(mut g) => *g = Some(message),
            Err(poisoned) => *poisoned.into_inner() = Some(message),
        }
    }
}

struct Pump {
    reader: DatasetReader,
    schedule: Schedule,
    window: PrefetchWindow,
    settings: LoaderSettings,
    cache: TieredCache,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Item>,
    /// The global step to plan next.
    next: Option<u64>,
    /// Epoch whose far-future cache entries were last re-examined.
    rekeyed: Option<u64>,
    slots: VecDeque<Slot>,
    /// Sequence number of `slots[0]`.
    base_seq: u64,
    /// Samples in `slots`.
    ahead: usize,
    waiting: HashMap<usize, Waiting>,
    held: HashMap<usize, Held>,
    /// Samples to fetch from the bucket, not yet turned into requests.
    queued: Vec<usize>,
    /// Requests not started yet, soonest need first.
    requests: BTreeMap<(u64, u64), RecordRequest>,
    request_seq: u64,
    inflight: usize,
    tasks: JoinSet<Done>,
}

impl Pump {
    async fn run(mut self) {
        let outcome = self.drive().await;
        self.tasks.abort_all();
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
            if self.next.is_some() && self.window.admits(self.ahead, self.settings.batch_size) {
                // Emitting made room: plan more before waiting.
                continue;
            }
            let front_complete = self.front_complete();
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

    /// Plans batches while the window admits them.
    async fn plan(&mut self) -> Result<(), LoaderError> {
        while let Some(step) = self.next {
            if !self.window.admits(self.ahead, self.settings.batch_size) {
                break;
            }
            let (first, indices) = self.schedule.batch(step);
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

    /// Planning reached `epoch`: cached samples that were "not next epoch"
    /// may now have a known next use, or none left in the run.
    async fn rekey(&mut self, epoch: u64) {
        self.rekeyed = Some(epoch);
        // A restart from here on finds the disk tier as it is now.
        self.cache.save_index();
        for key in self.cache.plan().keys_needed_after(FAR_FUTURE) {
            let next = usize::try_from(key)
                .ok()
                .and_then(|s| self.schedule.next_use_from(epoch + 1, s));
            self.cache.reprioritize(key, next).await;
        }
    }

    async fn plan_batch(
        &mut self,
        step: u64,
        first: u64,
        indices: Vec<usize>,
    ) -> Result<(), LoaderError> {
        let epoch = self.schedule.plan().epoch_of(first);
        let seq = self.base_seq + self.slots.len() as u64;
        let mut slot = Slot {
            pos: BatchPos {
                epoch,
                step,
                first,
                samples: Arc::from(indices.as_slice()),
            },
            records: vec![None; indices.len()],
            missing: indices.len(),
            indices: Vec::new(),
        };
        for (i, &sample) in indices.iter().enumerate() {
            let position = first + i as u64;
            if let Some(w) = self.waiting.get_mut(&sample) {
                w.waiters.push((seq, i));
                w.last_pos = position;
                continue;
            }
            if let Some(h) = self.held.get_mut(&sample) {
                h.slots += 1;
                let bytes = h.bytes.clone();
                slot.records[i] = Some(bytes.clone());
                slot.missing -= 1;
                self.shared.stats.update(epoch, |s| s.memory_hits += 1);
                let next = self.schedule.next_use_after(position, sample);
                self.cache.offer(sample as u64, &bytes, next).await;
                continue;
            }
            let source = match self.cache.lookup(sample as u64).await {
                Lookup::Memory(bytes) => {
                    slot.records[i] = Some(bytes.clone());
                    slot.missing -= 1;
                    self.held.insert(
                        sample,
                        Held {
                            bytes: bytes.clone(),
                            slots: 1,
                        },
                    );
                    self.shared.stats.update(epoch, |s| s.memory_hits += 1);
                    let next = self.schedule.next_use_after(position, sample);
                    self.cache.offer(sample as u64, &bytes, next).await;
                    continue;
                }
                Lookup::Disk(rx) => {
                    self.tasks.spawn(async move {
                        let result = rx.await.unwrap_or(Err(CacheError::Closed));
                        Done::Disk { sample, result }
                    });
                    Source::Disk
                }
                Lookup::Miss => {
                    self.queued.push(sample);
                    Source::Bucket
                }
            };
            self.waiting.insert(
                sample,
                Waiting {
                    waiters: vec![(seq, i)],
                    last_pos: position,
                    first_need: position,
                    source,
                },
            );
        }
        slot.indices = indices;
        self.ahead += slot.indices.len();
        self.slots.push_back(slot);
        Ok(())
    }

    /// Turns queued samples into requests and starts as many as allowed.
    fn launch(&mut self) -> Result<(), LoaderError> {
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

    /// A sample arrived: fill every batch waiting for it, then offer it to
    /// the cache with its next use after the last of them.
    async fn deliver(&mut self, sample: usize, bytes: Bytes) {
        let Some(w) = self.waiting.remove(&sample) else {
            return;
        };
        let mut filled = 0;
        for (k, &(seq, i)) in w.waiters.iter().enumerate() {
            let Some(idx) = seq
                .checked_sub(self.base_seq)
                .and_then(|d| usize::try_from(d).ok())
            else {
                continue;
            };
            let Some(slot) = self.slots.get_mut(idx) else {
                continue;
            };
            if let Some(cell) = slot.records.get_mut(i) {
                if cell.is_none() {
                    *cell = Some(bytes.clone());
                    slot.missing -= 1;
                    filled += 1;
                }
            }
            let source = if k == 0 { Some(w.source) } else { None };
            self.shared.stats.update(slot.pos.epoch, |s| match source {
                Some(Source::Bucket) => s.bucket_samples += 1,
                Some(Source::Disk) => s.disk_hits += 1,
                None => s.memory_hits += 1,
            });
        }
        if filled > 0 {
            self.held.insert(
                sample,
                Held {
                    bytes: bytes.clone(),
                    slots: filled,
                },
            );
        }
        let next = self.schedule.next_use_after(w.last_pos, sample);
        self.cache.offer(sample as u64, &bytes, next).await;
    }

    /// Decodes the complete front batch and lets go of its samples.
    async fn emit(&mut self) -> Result<(BatchPos, Arc<Batch>), LoaderError> {
        let Some(slot) = self.slots.pop_front() else {
            return Err(LoaderError::Task("no batch to hand over".into()));
        };
        self.base_seq += 1;
        self.ahead -= slot.indices.len();
        for sample in &slot.indices {
            if let Some(h) = self.held.get_mut(sample) {
                h.slots = h.slots.saturating_sub(1);
                if h.slots == 0 {
                    self.held.remove(sample);
                }
            }
        }
        let records: Vec<Bytes> = slot.records.into_iter().flatten().collect();
        if records.len() != slot.indices.len() {
            return Err(LoaderError::Task(format!(
                "batch of step {} (epoch {}) is missing samples",
                slot.pos.step, slot.pos.epoch
            )));
        }
        let epoch = slot.pos.epoch;
        let decoded = if self.reader.layout().is_images() {
            // Image decoding is CPU work for the decode pool: keep it off
            // the runtime's threads so fetches keep completing meanwhile.
            let reader = self.reader.clone();
            let indices = slot.indices.clone();
            tokio::task::spawn_blocking(move || {
                reader.decode_batch(Split::Train, epoch, &indices, &records)
            })
            .await
            .map_err(|e| LoaderError::Task(format!("decode task failed: {e}")))??
        } else {
            self.reader
                .decode_batch(Split::Train, epoch, &slot.indices, &records)?
        };
        for why in &decoded.skipped {
            tracing::warn!("skipped a sample that cannot be decoded: {why}");
        }
        self.shared.stats.update(epoch, |s| {
            s.samples += decoded.batch.len() as u64;
            s.decoded += decoded.decoded as u64;
            s.decode_us += (decoded.decode_s * 1e6) as u64;
            s.bad_samples += decoded.skipped.len() as u64;
        });
        if decoded.batch.is_empty() {
            return Err(LoaderError::Task(format!(
                "batch of step {} (epoch {epoch}) has no sample left after skipping undecodable ones",
                slot.pos.step
            )));
        }
        Ok((slot.pos, Arc::new(decoded.batch)))
    }
}

/// One request under the retry policy: transient errors (store failures
/// and short bodies, see [`DatasetError::is_transient`]) are retried within
/// the outage budget; a missing or truncated object, a bad label or a
/// refused request fails at once. The result carries the attempts.
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

impl LoaderError {
    /// The error of a request to `object` that [`RetryPolicy::run`] gave up on.
    pub fn from_retry(object: String, attempts: u32, failure: RetryFailure) -> Self {
        match failure {
            RetryFailure::Permanent(source) => LoaderError::Fetch {
                object,
                attempts,
                source: Box::new(source),
            },
            RetryFailure::OutOfBudget { failing, source } => LoaderError::Outage {
                object,
                attempts,
                failing_s: failing.as_secs_f64(),
                source: Box::new(source),
            },
        }
    }
}

// ---------------------------------------------------------------------------
// The handle and the actor
// ---------------------------------------------------------------------------

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
        let schedule = Schedule::new(plan)?;
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
        // run needs soonest; the others go.
        let mut schedule = schedule;
        let num_samples = schedule.plan().sampler().num_samples();
        let restored = cache.restore(|key| match (next, usize::try_from(key)) {
            (Some(step), Ok(sample)) if sample < num_samples => schedule.next_use_at(step, sample),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_admits_one_batch_then_respects_bounds() {
        let w = PrefetchWindow {
            lookahead_samples: 100,
            max_bytes: 1000,
            record_bytes: 20,
        };
        assert!(w.admits(0, 1000)); // an empty window takes any batch
        assert!(w.admits(10, 40)); // 50 samples, 1000 bytes
        assert!(!w.admits(11, 40)); // 1020 bytes
        let w = PrefetchWindow {
            lookahead_samples: 64,
            max_bytes: u64::MAX,
            record_bytes: 1,
        };
        assert!(w.admits(32, 32));
        assert!(!w.admits(33, 32));
    }

    #[test]
    fn schedule_positions_and_next_uses() {
        // One worker, batches of 3 over 10 samples: step 3 straddles into
        // epoch 1.
        let sampler = EpochSampler::new(10, 1, 0, 3).unwrap();
        let mut s = Schedule::new(sampler.plan(3, 3)).unwrap();
        assert_eq!(s.end_step(), 10);
        let (e0, e1, e2) = (
            sampler.global_order(0, 3),
            sampler.global_order(1, 3),
            sampler.global_order(2, 3),
        );
        assert_eq!(s.batch(3), (9, vec![e0[9], e1[0], e1[1]]));
        // A sample's next use after epoch 0 is its stream position in epoch 1.
        let x = e1[4];
        assert_eq!(s.next_use_after(4, x), Some(10 + 4));
        // After the last epoch nothing is needed again.
        assert_eq!(s.next_use_after(25, x), None);
        assert_eq!(s.next_use_from(2, e2[0]), Some(20));
        // The last step is short, and past the end there is no batch.
        assert_eq!(s.batch(9), (27, e2[7..10].to_vec()));
        assert_eq!(s.batch(10).1, Vec::<usize>::new());

        // Rank 1 of 2 takes stream positions 10, 11, 15, 16 and 17 of epoch 1:
        // the rest of epoch 1 is not its own, so only "later".
        let rank1 = EpochSampler::new(10, 2, 1, 3).unwrap();
        let mut s = Schedule::new(rank1.plan(3, 3)).unwrap();
        assert_eq!(s.next_use_from(1, e1[6]), Some(16));
        assert_eq!(s.next_use_from(1, e1[2]), Some(FAR_FUTURE + e1[2] as u64));
        assert_eq!(s.next_use_from(2, e2[0]), None);
        assert_eq!(s.next_use_from(2, e2[2]), Some(22));
    }

    fn policy(budget_s: u64) -> RetryPolicy {
        RetryPolicy {
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            outage_budget: Duration::from_secs(budget_s),
            request_timeout: Duration::from_secs(10),
            seed: 7,
        }
    }

    #[test]
    fn retry_delays_are_jittered_below_a_doubling_cap() {
        let r = policy(120);
        assert_eq!(r.ceiling(1), Duration::from_millis(100));
        assert_eq!(r.ceiling(3), Duration::from_millis(400));
        assert_eq!(r.ceiling(30), Duration::from_secs(5));
        let draws = |object: &str| {
            let mut rng = r.rng_for(object);
            (1..=40).map(|k| r.delay(k, &mut rng)).collect::<Vec<_>>()
        };
        let a = draws("ds/train/shard-00001.bin");
        // Seeded: the same object gets the same waits.
        assert_eq!(a, draws("ds/train/shard-00001.bin"));
        assert_ne!(a, draws("ds/train/shard-00002.bin"));
        for (k, d) in a.iter().enumerate() {
            assert!(*d <= r.ceiling(k as u32 + 1), "retry {}: {d:?}", k + 1);
        }
        // Full jitter: the capped waits are spread, not all at the cap.
        let capped = &a[10..];
        let lo = capped.iter().min().unwrap();
        let hi = capped.iter().max().unwrap();
        assert!(*hi - *lo > Duration::from_secs(2), "{lo:?}..{hi:?}");
    }

    fn transient(i: u32) -> DatasetError {
        DatasetError::Store(object_store::Error::Generic {
            store: "test",
            source: format!("connection refused ({i})").into(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn retries_ride_out_an_outage_within_the_budget() {
        let r = policy(120);
        let log = OutageLog::default();
        // The store is down for 60 s of tokio's (paused) clock.
        let up_at = Instant::now() + Duration::from_secs(60);
        let mut calls = 0u32;
        let (result, attempts) = r
            .run("ds/x", &log, || {
                calls += 1;
                let i = calls;
                async move {
                    if Instant::now() < up_at {
                        Err(transient(i))
                    } else {
                        Ok(i)
                    }
                }
            })
            .await;
        assert_eq!(result.ok(), Some(attempts));
        assert!(Instant::now() >= up_at);
        assert_eq!(log.failures(), u64::from(attempts - 1));
        // Backoff, not a busy loop: with waits of up to 5 s, a 60 s outage
        // takes more than 12 tries and far fewer than a loop without waits.
        assert!((12..200).contains(&attempts), "{attempts}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_outage_state_follows_failures_and_recovery() {
        let r = policy(120);
        let log = OutageLog::default();
        let mut status = log.watch();
        assert_eq!(*status.borrow_and_update(), None);
        let start = Instant::now();
        let up_at = start + Duration::from_secs(30);
        let mut seen = Vec::new();
        let watcher = async {
            // Set at the first failure, cleared by the success.
            status.changed().await.unwrap();
            seen.push((*status.borrow_and_update(), Instant::now()));
            status.changed().await.unwrap();
            seen.push((*status.borrow_and_update(), Instant::now()));
        };
        let run = r.run("ds/x", &log, || async move {
            if Instant::now() < up_at {
                Err(transient(0))
            } else {
                Ok(())
            }
        });
        let ((result, _), ()) = futures::join!(run, watcher);
        assert!(result.is_ok());
        let [(Some(outage), at), (None, cleared)] = seen[..] else {
            panic!("{seen:?}");
        };
        assert_eq!(outage.since, start);
        assert_eq!(outage.budget, Duration::from_secs(120));
        assert_eq!(at, start, "set at the first failure");
        assert!(cleared >= up_at, "cleared once the bucket answers");
        assert_eq!(log.current(), None);
        assert_eq!(
            outage.message(start + Duration::from_millis(12_400)),
            "bucket unreachable 12 s (budget 120 s)"
        );
        assert_eq!(outage.lasted(start), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_store_is_an_outage_from_the_request_deadline() {
        // The store never answers: each attempt ends at its own deadline.
        let r = policy(120);
        let log = OutageLog::default();
        let mut status = log.watch();
        let start = Instant::now();
        let deadline = start + r.request_timeout;
        let watcher = async {
            status.changed().await.unwrap();
            (*status.borrow_and_update(), Instant::now())
        };
        let run = r.run("ds/x", &log, std::future::pending::<Result<(), _>>);
        let ((result, attempts), (outage, reported_at)) = futures::join!(run, watcher);
        // Reported at the first request's deadline (10 s), not at 30 s
        // (tokio's timer rounds deadlines up to the next millisecond).
        let ms = Duration::from_millis(2);
        let outage = outage.expect("an outage");
        assert!(reported_at >= deadline && reported_at < deadline + ms);
        assert_eq!(outage.since, reported_at);
        // The budget runs from there and ends on time: the attempt under
        // way at its end is cut to it.
        let Err(RetryFailure::OutOfBudget { failing, source }) = result else {
            panic!("expected the budget to run out");
        };
        assert!(
            failing >= r.outage_budget && failing < r.outage_budget + ms,
            "{failing:?}"
        );
        let ended = Instant::now() - start;
        let expected = r.request_timeout + r.outage_budget;
        assert!(ended >= expected && ended < expected + 2 * ms, "{ended:?}");
        assert!(source.is_transient());
        assert!(
            source.to_string().contains("loader.request_timeout_s"),
            "{source}"
        );
        // 120 s of attempts of at most 10 s each, with backoff between.
        assert!((12..100).contains(&attempts), "{attempts}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_past_the_budget_fails_naming_how_long() {
        let r = policy(30);
        let log = OutageLog::default();
        let start = Instant::now();
        let (result, attempts) = r
            .run("ds/x", &log, || async { Err::<(), _>(transient(0)) })
            .await;
        let Err(RetryFailure::OutOfBudget { failing, .. }) = result else {
            panic!("expected the budget to run out");
        };
        assert!(attempts > 2);
        // The last wait is cut to end at the budget (tokio's timer rounds
        // deadlines up to the next millisecond).
        let budget = Duration::from_secs(30);
        assert!(
            failing >= budget && failing < budget + Duration::from_millis(5),
            "{failing:?}"
        );
        assert_eq!(Instant::now() - start, failing);
        let err = LoaderError::from_retry(
            "ds/x".into(),
            attempts,
            RetryFailure::OutOfBudget {
                failing,
                source: transient(0),
            },
        );
        let msg = err.to_string();
        assert!(
            msg.contains("ds/x") && msg.contains("30 s") && msg.contains("outage_budget_s"),
            "{msg}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_are_not_retried() {
        let r = policy(120);
        let log = OutageLog::default();
        let start = Instant::now();
        let (result, attempts) = r
            .run("ds/x", &log, || async {
                Err::<(), _>(DatasetError::Corrupt {
                    object: "ds/x".into(),
                    message: "the object is 7 bytes, the manifest needs 280".into(),
                    permanent: true,
                })
            })
            .await;
        assert!(matches!(result, Err(RetryFailure::Permanent(_))));
        assert_eq!(attempts, 1);
        assert_eq!(Instant::now(), start, "no wait before failing");
        assert_eq!(log.failures(), 0);
    }

    #[test]
    fn stats_rates_and_cost() {
        let s = EpochDataStats {
            samples: 10,
            memory_hits: 5,
            disk_hits: 2,
            bucket_samples: 3,
            gets: 1500,
            get_attempts: 2000,
            bucket_bytes: 2_000_000_000,
            ..EpochDataStats::default()
        };
        assert!((s.memory_hit_rate() - 0.5).abs() < 1e-12);
        assert!((s.disk_hit_rate() - 0.2).abs() < 1e-12);
        let prices = CostModel {
            per_1000_gets: 0.0004,
            per_gb_egress: 0.09,
        };
        assert!((s.cost(&prices) - (0.0008 + 0.18)).abs() < 1e-12);
        assert_eq!(EpochDataStats::default().memory_hit_rate(), 0.0);
    }
}

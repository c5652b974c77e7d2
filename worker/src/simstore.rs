//! A simulated slow bucket: an [`ObjectStore`] wrapper that delays reads the
//! way a remote object store does, counts them, and can inject faults.
//!
//! Every GET (and HEAD) first waits the first-byte latency; the body then
//! streams in pieces no faster than the per-connection rate (each request is
//! its own connection) while all requests together share one aggregate rate
//! ([`TokenBucket`] clones). `get_ranges` issues one simulated GET per range
//! (touching ranges merged, up to 10 in parallel, as `object_store` does for
//! HTTP stores). Writes, lists and deletes pass straight through. Counters
//! give GETs, HEADs and body bytes; [`SimStore::fail_next`] and
//! [`SimStore::truncate_next`] make the next reads of one object fail or come
//! back short, [`SimStore::outage`] fails every read for a while,
//! [`SimStore::hang`] leaves every read issued for a while unanswered, and
//! `transient_error_rate` fails a seeded random fraction.
//! The delays in the stats are the model's computed waits, not measured
//! times; every wait is a `tokio::time` sleep, so the model also runs on
//! tokio's paused clock (as the timed tests and the example below do).
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use object_store::{memory::InMemory, path::Path, ObjectStore, ObjectStoreExt};
//! use ps_worker::simstore::{SimSettings, SimStore};
//!
//! let inner = Arc::new(InMemory::new());
//! inner.put(&Path::from("a"), vec![0u8; 1000].into()).await.unwrap();
//! let sim = SimStore::new(inner, SimSettings::default()); // 50 ms, 50 MB/s, 1 Gbit/s
//! let bytes = sim.get(&Path::from("a")).await.unwrap().bytes().await.unwrap();
//! assert_eq!(bytes.len(), 1000);
//! let stats = sim.stats();
//! assert_eq!((stats.gets, stats.bytes), (1, 1000));
//! // 50 ms to the first byte, then 999 bytes past the 1-byte burst at 50 MB/s.
//! assert!((stats.simulated_delay_s - (0.05 + 999.0 / 50e6)).abs() < 1e-9);
//! # });
//! ```

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{
    Attributes, Extensions, GetOptions, GetResult, GetResultPayload, MultipartUpload, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use serde::Serialize;

use ps_shared::hash::splitmix64;
use ps_shared::link::TokenBucket;

use crate::simulate::SimBucketSection;

/// Body bytes metered per reservation: small enough that concurrent requests
/// interleave on the shared link, large enough to keep timer overhead low.
const PIECE_BYTES: usize = 256 * 1024;

/// Name used in the errors this store makes up.
const STORE_NAME: &str = "SimStore";

/// Delays and fault rates of a [`SimStore`].
#[derive(Debug, Clone, PartialEq)]
pub struct SimSettings {
    /// Wait before the first byte of every request.
    pub first_byte: Duration,
    /// Bytes per second of one request's body; 0 = unlimited.
    pub per_connection_bytes_per_s: f64,
    /// Bytes per second shared by all requests; 0 = unlimited.
    pub aggregate_bytes_per_s: f64,
    /// Fraction of GETs failing with a transient error.
    pub transient_error_rate: f64,
    /// Seed of the random failures.
    pub seed: u64,
}

impl Default for SimSettings {
    /// The DELI setting: 50 ms to first byte, 50 MB/s per connection, 1 Gbit/s in all.
    fn default() -> Self {
        SimSettings::from_section(&SimBucketSection::default())
    }
}

impl SimSettings {
    /// The settings of a simulation file's `[bucket]` section.
    pub fn from_section(s: &SimBucketSection) -> Self {
        Self {
            first_byte: Duration::from_secs_f64(s.first_byte_ms.max(0.0) / 1000.0),
            per_connection_bytes_per_s: s.per_connection_bytes_per_s(),
            aggregate_bytes_per_s: s.aggregate_bytes_per_s(),
            transient_error_rate: s.transient_error_rate,
            seed: s.seed,
        }
    }

    /// No delay at all (counters and fault injection only).
    pub fn instant() -> Self {
        Self {
            first_byte: Duration::ZERO,
            per_connection_bytes_per_s: 0.0,
            aggregate_bytes_per_s: 0.0,
            transient_error_rate: 0.0,
            seed: 1,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    gets: AtomicU64,
    heads: AtomicU64,
    bytes: AtomicU64,
    puts: AtomicU64,
    failures: AtomicU64,
    truncations: AtomicU64,
    delay_ns: AtomicU64,
    longest_wait_ns: AtomicU64,
}

impl Counters {
    fn delayed(&self, wait: Duration) {
        let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.delay_ns.fetch_add(ns, Ordering::Relaxed);
        self.longest_wait_ns.fetch_max(ns, Ordering::Relaxed);
    }
}

/// A snapshot of a [`SimStore`]'s counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SimStats {
    /// GET requests (ranged or not), including failed ones.
    pub gets: u64,
    /// HEAD requests.
    pub heads: u64,
    /// Body bytes delivered.
    pub bytes: u64,
    /// Objects written.
    pub puts: u64,
    /// GETs failed on purpose.
    pub injected_failures: u64,
    /// GETs cut short on purpose.
    pub injected_truncations: u64,
    /// Sum of the delays the model imposed (first byte and bandwidth waits),
    /// as computed, over all requests.
    pub simulated_delay_s: f64,
    /// Longest single delay imposed (a first-byte wait or one piece's wait
    /// for bandwidth, including queueing on the shared link).
    pub longest_wait_s: f64,
}

#[derive(Debug, Default)]
struct Faults {
    fail: HashMap<Path, u32>,
    truncate: HashMap<Path, u32>,
    hang: HashMap<Path, u32>,
    rng: u64,
    /// Every GET fails until then (on tokio's clock).
    down_until: Option<tokio::time::Instant>,
    /// Every GET issued before then never answers (on tokio's clock).
    hung_until: Option<tokio::time::Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Fail,
    Truncate,
    Hang,
}

/// A slow-bucket simulation around another store. See the module docs.
#[derive(Debug)]
pub struct SimStore {
    inner: Arc<dyn ObjectStore>,
    settings: SimSettings,
    aggregate: Option<TokenBucket>,
    counters: Arc<Counters>,
    faults: Mutex<Faults>,
}

impl SimStore {
    pub fn new(inner: Arc<dyn ObjectStore>, settings: SimSettings) -> Self {
        let aggregate = (settings.aggregate_bytes_per_s > 0.0).then(|| {
            let rate = settings.aggregate_bytes_per_s;
            // About a millisecond of traffic may pass at once.
            TokenBucket::new(rate, (rate / 1000.0).max(16.0 * 1024.0))
        });
        let rng = settings.seed;
        Self {
            inner,
            settings,
            aggregate,
            counters: Arc::default(),
            faults: Mutex::new(Faults {
                rng,
                ..Faults::default()
            }),
        }
    }

    /// Wraps `inner` as a simulation file's `[bucket]` section says.
    pub fn from_section(inner: Arc<dyn ObjectStore>, section: &SimBucketSection) -> Self {
        Self::new(inner, SimSettings::from_section(section))
    }

    pub fn settings(&self) -> &SimSettings {
        &self.settings
    }

    /// The store behind the simulation.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// Counters so far.
    pub fn stats(&self) -> SimStats {
        let c = &self.counters;
        SimStats {
            gets: c.gets.load(Ordering::Relaxed),
            heads: c.heads.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            puts: c.puts.load(Ordering::Relaxed),
            injected_failures: c.failures.load(Ordering::Relaxed),
            injected_truncations: c.truncations.load(Ordering::Relaxed),
            simulated_delay_s: c.delay_ns.load(Ordering::Relaxed) as f64 / 1e9,
            longest_wait_s: c.longest_wait_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    /// Sets every counter back to zero.
    pub fn reset_stats(&self) {
        let c = &self.counters;
        for a in [
            &c.gets,
            &c.heads,
            &c.bytes,
            &c.puts,
            &c.failures,
            &c.truncations,
            &c.delay_ns,
            &c.longest_wait_ns,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }

    /// The next `times` GETs of `location` fail with a transient error.
    pub fn fail_next(&self, location: &Path, times: u32) {
        let mut f = self.lock_faults();
        *f.fail.entry(location.clone()).or_default() += times;
    }

    /// The next `times` GETs of `location` deliver only the first half of
    /// their body (a connection cut mid-stream).
    pub fn truncate_next(&self, location: &Path, times: u32) {
        let mut f = self.lock_faults();
        *f.truncate.entry(location.clone()).or_default() += times;
    }

    /// Every GET fails with a transient error for `duration` from now, as
    /// when the bucket is unreachable. Measured on tokio's clock, so a test
    /// on the paused clock runs a long outage in no time.
    pub fn outage(&self, duration: Duration) {
        self.lock_faults().down_until = Some(tokio::time::Instant::now() + duration);
    }

    /// The next `times` GETs of `location` never answer (only the reader's
    /// own deadline, or dropping the request, ends them).
    pub fn hang_next(&self, location: &Path, times: u32) {
        let mut f = self.lock_faults();
        *f.hang.entry(location.clone()).or_default() += times;
    }

    /// Every GET issued during the next `duration` never answers, as when
    /// the bucket's packets are dropped rather than refused: only the
    /// reader's own deadline ends such a request. On tokio's clock.
    pub fn hang(&self, duration: Duration) {
        self.lock_faults().hung_until = Some(tokio::time::Instant::now() + duration);
    }

    fn lock_faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        ps_shared::sync::lock(&self.faults)
    }

    fn take_fault(&self, location: &Path) -> Fault {
        let mut f = self.lock_faults();
        if f.hung_until
            .is_some_and(|t| tokio::time::Instant::now() < t)
        {
            return Fault::Hang;
        }
        if f.down_until
            .is_some_and(|t| tokio::time::Instant::now() < t)
        {
            return Fault::Fail;
        }
        let take = |map: &mut HashMap<Path, u32>| match map.get_mut(location) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        };
        if take(&mut f.hang) {
            return Fault::Hang;
        }
        if take(&mut f.fail) {
            return Fault::Fail;
        }
        if take(&mut f.truncate) {
            return Fault::Truncate;
        }
        let rate = self.settings.transient_error_rate;
        if rate > 0.0 {
            f.rng = splitmix64(f.rng);
            let draw = (f.rng >> 11) as f64 / (1u64 << 53) as f64;
            if draw < rate {
                return Fault::Fail;
            }
        }
        Fault::None
    }

    /// Wraps a body in the bandwidth model (and the truncation, if any).
    fn throttle(
        &self,
        body: BoxStream<'static, Result<Bytes>>,
        cut_at: Option<u64>,
    ) -> BoxStream<'static, Result<Bytes>> {
        let conn = (self.settings.per_connection_bytes_per_s > 0.0)
            .then(|| TokenBucket::new(self.settings.per_connection_bytes_per_s, 1.0));
        let state = BodyState {
            inner: body,
            pending: VecDeque::new(),
            cut_at,
            sent: 0,
            conn,
            aggregate: self.aggregate.clone(),
            counters: self.counters.clone(),
            done: false,
        };
        futures::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(mut piece) = st.pending.pop_front() {
                    if let Some(cut) = st.cut_at {
                        if st.sent >= cut {
                            return None;
                        }
                        let keep = (cut - st.sent).min(piece.len() as u64) as usize;
                        piece.truncate(keep);
                    }
                    let n = piece.len() as u64;
                    let waits = [&st.conn, &st.aggregate]
                        .into_iter()
                        .flatten()
                        .map(|b| b.reserve(n))
                        .max()
                        .unwrap_or(Duration::ZERO);
                    if !waits.is_zero() {
                        st.counters.delayed(waits);
                        tokio::time::sleep(waits).await;
                    }
                    st.sent += n;
                    st.counters.bytes.fetch_add(n, Ordering::Relaxed);
                    return Some((Ok(piece), st));
                }
                if st.done {
                    return None;
                }
                match st.inner.next().await {
                    Some(Ok(chunk)) => {
                        let mut rest = chunk;
                        while rest.len() > PIECE_BYTES {
                            st.pending.push_back(rest.split_to(PIECE_BYTES));
                        }
                        if !rest.is_empty() {
                            st.pending.push_back(rest);
                        }
                    }
                    Some(Err(e)) => {
                        st.done = true;
                        return Some((Err(e), st));
                    }
                    None => st.done = true,
                }
            }
        })
        .boxed()
    }
}

struct BodyState {
    inner: BoxStream<'static, Result<Bytes>>,
    pending: VecDeque<Bytes>,
    cut_at: Option<u64>,
    sent: u64,
    conn: Option<TokenBucket>,
    aggregate: Option<TokenBucket>,
    counters: Arc<Counters>,
    done: bool,
}

impl fmt::Display for SimStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimStore({})", self.inner)
    }
}

crate::wrapstore::wrapping_store!(SimStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let head = options.head;
        let counter = if head {
            &self.counters.heads
        } else {
            &self.counters.gets
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !self.settings.first_byte.is_zero() {
            self.counters.delayed(self.settings.first_byte);
            tokio::time::sleep(self.settings.first_byte).await;
        }
        let fault = if head {
            Fault::None
        } else {
            self.take_fault(location)
        };
        if fault == Fault::Hang {
            std::future::pending::<()>().await;
        }
        if fault == Fault::Fail {
            self.counters.failures.fetch_add(1, Ordering::Relaxed);
            return Err(object_store::Error::Generic {
                store: STORE_NAME,
                source: format!("injected transient failure reading {location}").into(),
            });
        }
        let result = self.inner.get_opts(location, options).await?;
        if head {
            return Ok(result);
        }
        let GetResult {
            payload,
            meta,
            range,
            attributes,
            extensions,
        } = result;
        let body = match payload {
            GetResultPayload::Stream(s) => s,
            GetResultPayload::File(file, path) => {
                // Read the file in one go; the simulation meters the bytes.
                let local = GetResult {
                    payload: GetResultPayload::File(file, path),
                    meta: meta.clone(),
                    range: range.clone(),
                    attributes: Attributes::default(),
                    extensions: Extensions::default(),
                };
                let bytes = local.bytes().await?;
                futures::stream::once(async move { Ok(bytes) }).boxed()
            }
        };
        let cut_at = (fault == Fault::Truncate).then(|| {
            self.counters.truncations.fetch_add(1, Ordering::Relaxed);
            (range.end - range.start) / 2
        });
        Ok(GetResult {
            payload: GetResultPayload::Stream(self.throttle(body, cut_at)),
            meta,
            range,
            attributes,
            extensions,
        })
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        object_store::coalesce_ranges(
            ranges,
            |range| async move {
                self.get_opts(location, GetOptions::new().with_range(Some(range)))
                    .await?
                    .bytes()
                    .await
            },
            0,
        )
        .await
    }
});

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;
    use tokio::time::Instant;

    async fn store_with(objects: &[(&str, usize)], settings: SimSettings) -> SimStore {
        let inner = Arc::new(InMemory::new());
        for (name, len) in objects {
            let data: Vec<u8> = (0..*len).map(|i| (i % 251) as u8).collect();
            inner.put(&Path::from(*name), data.into()).await.unwrap();
        }
        SimStore::new(inner, settings)
    }

    fn settings(first_byte_ms: u64, conn: f64, agg: f64) -> SimSettings {
        SimSettings {
            first_byte: Duration::from_millis(first_byte_ms),
            per_connection_bytes_per_s: conn,
            aggregate_bytes_per_s: agg,
            transient_error_rate: 0.0,
            seed: 1,
        }
    }

    /// Computed delays agree up to the nanosecond rounding of `Duration`.
    fn assert_secs(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-8, "{got} s, want {want} s");
    }

    // The delays below are the model's computed waits, not measured times.
    // Tests with delays run on tokio's paused clock, which moves only when
    // every task waits on a timer: nothing sleeps for real, and what the
    // clock shows afterwards is exactly the time the readers waited. A timer
    // fires on a whole millisecond, so a wait of a fraction of a millisecond
    // moves the clock up to the next one.

    #[tokio::test(start_paused = true)]
    async fn latency_and_per_connection_rate() {
        // 50 ms to first byte, then 1 MB at 10 MB/s: 0.15 s in all. The body
        // goes in 4 pieces (3 x 256 KiB and the rest), each waiting for its
        // bytes beyond the connection's 1-byte burst, which the clock
        // refills while the previous piece waits.
        let sim = store_with(&[("big", 1_000_000)], settings(50, 1e7, 0.0)).await;
        let t = Instant::now();
        let b = sim
            .get(&Path::from("big"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let waited = t.elapsed();
        assert_eq!(b.len(), 1_000_000);
        let s = sim.stats();
        assert_eq!((s.gets, s.bytes), (1, 1_000_000));
        let want = 0.05 + (1_000_000 - 4) as f64 / 1e7;
        assert_secs(s.simulated_delay_s, want);
        // The first byte is the longest single wait.
        assert_secs(s.longest_wait_s, 0.05);
        // The reader waited the charged time, plus under 1 ms per sleep.
        let charged = Duration::from_secs_f64(want);
        assert!(
            waited >= charged && waited < charged + Duration::from_millis(5),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn aggregate_rate_is_shared() {
        let names: Vec<String> = (0..8).map(|i| format!("o{i}")).collect();
        let objs: Vec<(&str, usize)> = names.iter().map(|n| (n.as_str(), 25_000)).collect();
        // 200 KB in all over a shared 1 MB/s link (16 KiB burst), per
        // connection unlimited. All eight bodies reserve at the same instant,
        // so the last piece queues behind the other seven: 200 KB less the
        // burst, 0.183616 s.
        let sim = Arc::new(store_with(&objs, settings(0, 0.0, 1e6)).await);
        let t = Instant::now();
        let reads = names.iter().map(|n| {
            let sim = sim.clone();
            let p = Path::from(n.as_str());
            async move { sim.get(&p).await.unwrap().bytes().await.unwrap().len() }
        });
        let total: usize = futures::future::join_all(reads).await.into_iter().sum();
        let waited = t.elapsed();
        assert_eq!(total, 200_000);
        let s = sim.stats();
        let burst = 16.0 * 1024.0;
        let longest = (200_000.0 - burst) / 1e6;
        assert_secs(s.longest_wait_s, longest);
        // The k-th reservation waits for 25 KB x k less the burst.
        let sum: f64 = (1..=8).map(|k| (25_000.0 * k as f64 - burst) / 1e6).sum();
        assert_secs(s.simulated_delay_s, sum);
        // The reads overlap: together they take as long as the last one.
        let longest = Duration::from_secs_f64(longest);
        assert!(
            waited >= longest && waited < longest + Duration::from_millis(1),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn get_ranges_counts_one_get_per_separate_range() {
        let sim = store_with(&[("s", 1000)], settings(10, 0.0, 0.0)).await;
        let p = Path::from("s");
        let t = Instant::now();
        let got = sim
            .get_ranges(&p, &[0..10, 10..20, 100..110, 500..600])
            .await
            .unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[1][0], 10);
        assert_eq!(got[3].len(), 100);
        // 0..10 and 10..20 touch and merge: three GETs, each charged its
        // 10 ms to first byte, run in parallel.
        assert_eq!(sim.stats().gets, 3);
        assert_secs(sim.stats().simulated_delay_s, 0.03);
        assert_eq!(t.elapsed(), Duration::from_millis(10));
        let r = sim.get_range(&p, 5..9).await.unwrap();
        assert_eq!(&r[..], &[5, 6, 7, 8]);
        sim.head(&p).await.unwrap();
        let s = sim.stats();
        assert_eq!((s.gets, s.heads), (4, 1));
        // HEADs wait for the first byte too.
        assert_secs(s.simulated_delay_s, 0.05);
        assert_secs(s.longest_wait_s, 0.01);
        assert_eq!(t.elapsed(), Duration::from_millis(30));
        sim.reset_stats();
        assert_eq!(sim.stats(), SimStats::default());
    }

    #[tokio::test]
    async fn injected_faults() {
        let sim = store_with(&[("x", 100)], SimSettings::instant()).await;
        let p = Path::from("x");
        sim.fail_next(&p, 2);
        sim.truncate_next(&p, 1);
        for _ in 0..2 {
            let err = sim.get(&p).await.unwrap_err();
            assert!(
                err.to_string()
                    .contains("injected transient failure reading x"),
                "{err}"
            );
        }
        let short = sim.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(short.len(), 50);
        let full = sim.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(full.len(), 100);
        let s = sim.stats();
        assert_eq!(
            (s.gets, s.injected_failures, s.injected_truncations),
            (4, 2, 1)
        );
        // Missing objects stay NotFound.
        let err = sim.get(&Path::from("nope")).await.unwrap_err();
        assert!(matches!(err, object_store::Error::NotFound { .. }), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_object_never_answers_until_its_count_is_spent() {
        let sim = store_with(&[("x", 10), ("y", 10)], SimSettings::instant()).await;
        let x = Path::from("x");
        sim.hang_next(&x, 2);
        for _ in 0..2 {
            let waited = tokio::time::timeout(Duration::from_secs(3600), sim.get(&x)).await;
            assert!(waited.is_err(), "a hung GET answered");
        }
        // Other objects, and the third GET of x, answer at once.
        assert_eq!(
            sim.get(&Path::from("y"))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .len(),
            10
        );
        assert_eq!(sim.get(&x).await.unwrap().bytes().await.unwrap().len(), 10);
        assert_eq!(sim.stats().gets, 4);
    }

    #[tokio::test]
    async fn random_failures_follow_the_rate() {
        let mut s = SimSettings::instant();
        s.transient_error_rate = 0.3;
        let sim = store_with(&[("x", 10)], s).await;
        let p = Path::from("x");
        let mut failed = 0;
        for _ in 0..1000 {
            if sim.get(&p).await.is_err() {
                failed += 1;
            }
        }
        assert!((200..400).contains(&failed), "{failed}");
    }

    #[tokio::test(start_paused = true)]
    async fn wraps_local_files_and_passes_writes_through() {
        let dir = tempfile::tempdir().unwrap();
        let local =
            Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        let sim = SimStore::new(local, settings(1, 1e9, 1e9));
        let p = Path::from("d/f.bin");
        sim.put(&p, vec![7u8; 600_000].into()).await.unwrap();
        assert!(dir.path().join("d/f.bin").exists());
        let b = sim.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(b.len(), 600_000);
        let r = sim.get_range(&p, 10..20).await.unwrap();
        assert_eq!(r.len(), 10);
        // A file's body is metered like a stream: 2 x 1 ms to first byte,
        // then each piece's bytes past the 1-byte burst at 1 GB/s (the
        // shared 1 MB burst never runs dry).
        let s = sim.stats();
        assert_eq!((s.gets, s.bytes), (2, 600_010));
        let pieces = [256 * 1024, 256 * 1024, 600_000 - 512 * 1024, 10];
        let body: f64 = pieces.iter().map(|n| (n - 1) as f64 / 1e9).sum();
        assert_secs(s.simulated_delay_s, 0.002 + body);
        let listed: Vec<_> = sim.list(None).collect().await;
        assert_eq!(listed.len(), 1);
        sim.delete(&p).await.unwrap();
        assert_eq!(sim.stats().puts, 1);
        assert!(sim.to_string().starts_with("SimStore("));
    }
}

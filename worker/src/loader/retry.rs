//! The retry policy of bucket requests (jittered exponential backoff within
//! an outage budget) and the outage clock that reports a bucket failing.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ps_dataset::DatasetError;
use ps_shared::config::ClusterConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::loader::LoaderError;

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
        ps_shared::sync::lock(&self.state)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

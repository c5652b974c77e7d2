//! Simulated bandwidth limits: a shared token bucket and a link model.
//!
//! [`TokenBucket`] meters bytes at a fixed rate with a burst allowance; clones
//! share one bucket, so every user of a clone competes for the same aggregate
//! rate. Reservations are FIFO: a caller takes its bytes immediately (possibly
//! running the bucket into debt) and sleeps until the debt is repaid, which
//! models a link that serialises transfers.
//!
//! [`LinkLimiter`] applies a full-duplex link (one bucket per direction plus a
//! one-way latency) to the worker-server transport in tests and benchmarks.
//! Its clones share the buckets and the accounting: [`LinkLimiter::stats`]
//! gives the bytes and messages carried and the link time the model charged
//! for them (computed from the buckets and the latency, not measured).
//!
//! ```
//! # async fn demo() {
//! use ps_shared::link::TokenBucket;
//! let bucket = TokenBucket::new(1e6, 1e4); // 1 MB/s, 10 KB burst
//! bucket.acquire(5_000).await;            // within the burst: no wait
//! # }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// The arithmetic of a token bucket, with the time passed in: `rate` tokens
/// per second accrue up to `burst`. It does no I/O and reads no clock, so the
/// same code meters simulated links ([`TokenBucket`]) and the server's
/// per-connection request budget (a sans-IO state machine that is handed the
/// time of each event).
#[derive(Debug, Clone)]
pub struct Tokens {
    rate: f64,
    burst: f64,
    level: f64,
    last: StdInstant,
}

impl Tokens {
    /// A full bucket at `now`: `rate` tokens per second (at least 1e-9), at
    /// most `burst` (at least 1) held at once.
    pub fn full(rate: f64, burst: f64, now: StdInstant) -> Self {
        let burst = burst.max(1.0);
        Self {
            rate: rate.max(1e-9),
            burst,
            level: burst,
            last: now,
        }
    }

    /// Tokens per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    fn refill(&mut self, now: StdInstant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.level = (self.level + elapsed * self.rate).min(self.burst);
    }

    /// Takes `n` tokens if that many are there at `now`; otherwise takes none.
    pub fn try_take(&mut self, n: f64, now: StdInstant) -> bool {
        self.refill(now);
        if self.level >= n {
            self.level -= n;
            true
        } else {
            false
        }
    }

    /// Takes `n` tokens at `now`, running into debt if needed, and returns how
    /// long it takes until the debt is repaid (zero when there was no debt).
    /// Callers that wait out that time are served first come, first served.
    pub fn take(&mut self, n: f64, now: StdInstant) -> Duration {
        self.refill(now);
        self.level -= n;
        if self.level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.level / self.rate)
        }
    }
}

/// A byte-rate limiter shared by all its clones.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    state: Arc<Mutex<Tokens>>,
}

impl TokenBucket {
    /// `rate` bytes per second (at least 1), up to `burst` bytes at once.
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            state: Arc::new(Mutex::new(Tokens::full(
                rate.max(1.0),
                burst,
                Instant::now().into_std(),
            ))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tokens> {
        crate::sync::lock(&self.state)
    }

    /// Bytes per second.
    pub fn rate(&self) -> f64 {
        self.lock().rate()
    }

    /// Reserve `bytes` and return how long the caller must wait for them.
    pub fn reserve(&self, bytes: u64) -> Duration {
        self.lock().take(bytes as f64, Instant::now().into_std())
    }

    /// Wait until `bytes` may pass.
    pub async fn acquire(&self, bytes: u64) {
        let wait = self.reserve(bytes);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// A simulated network link between a worker and the servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkSection {
    /// Bandwidth of the worker's link in Mbit/s, each direction; 0 = unlimited.
    pub bandwidth_mbit: f64,
    /// One-way latency added to every message, in milliseconds.
    pub latency_ms: f64,
}

impl Default for LinkSection {
    fn default() -> Self {
        Self {
            bandwidth_mbit: 0.0,
            latency_ms: 0.0,
        }
    }
}

impl LinkSection {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.bandwidth_mbit.is_finite() && self.bandwidth_mbit >= 0.0) {
            return Err("link.bandwidth_mbit must be >= 0 (0 = unlimited)".into());
        }
        if !(self.latency_ms.is_finite() && (0.0..=10_000.0).contains(&self.latency_ms)) {
            return Err("link.latency_ms must be in [0, 10000]".into());
        }
        Ok(())
    }

    pub fn is_unlimited(&self) -> bool {
        self.bandwidth_mbit == 0.0 && self.latency_ms == 0.0
    }
}

/// Traffic through a [`LinkLimiter`] (all its clones together) and the link
/// time the model charged for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LinkStats {
    /// Bytes sent by the worker.
    pub sent_bytes: u64,
    /// Bytes received by the worker.
    pub received_bytes: u64,
    /// Messages in either direction.
    pub messages: u64,
    /// Sum over messages of the wait the direction's bucket imposed plus the
    /// one-way latency, as computed by the model (not measured). Messages in
    /// flight at once each count their own wait, so this can exceed the time
    /// that passed.
    pub simulated_secs: f64,
}

#[derive(Debug, Default)]
struct LinkCounters {
    sent_bytes: AtomicU64,
    received_bytes: AtomicU64,
    messages: AtomicU64,
    charged_ns: AtomicU64,
}

/// Uplink and downlink buckets plus latency, shared by one worker's streams.
#[derive(Debug, Clone)]
pub struct LinkLimiter {
    up: Option<TokenBucket>,
    down: Option<TokenBucket>,
    latency: Duration,
    counters: Arc<LinkCounters>,
}

impl LinkLimiter {
    pub fn new(link: &LinkSection) -> Self {
        let bucket = || {
            (link.bandwidth_mbit > 0.0).then(|| {
                let rate = link.bandwidth_mbit * 1e6 / 8.0;
                // Burst of ~1 ms of traffic: keeps the rate honest at small scales.
                TokenBucket::new(rate, (rate / 1000.0).max(16.0 * 1024.0))
            })
        };
        Self {
            up: bucket(),
            down: bucket(),
            latency: Duration::from_secs_f64(link.latency_ms / 1000.0),
            counters: Arc::default(),
        }
    }

    /// Delay for sending `bytes` from the worker.
    pub async fn send(&self, bytes: u64) {
        self.counters.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.carry(self.up.as_ref(), bytes).await;
    }

    /// Delay for receiving `bytes` at the worker.
    pub async fn receive(&self, bytes: u64) {
        self.counters
            .received_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        self.carry(self.down.as_ref(), bytes).await;
    }

    /// Traffic and charged link time so far, over all clones.
    pub fn stats(&self) -> LinkStats {
        let c = &self.counters;
        LinkStats {
            sent_bytes: c.sent_bytes.load(Ordering::Relaxed),
            received_bytes: c.received_bytes.load(Ordering::Relaxed),
            messages: c.messages.load(Ordering::Relaxed),
            simulated_secs: c.charged_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    /// Charges one message of `bytes` over `bucket` and waits it out: first
    /// the bucket's wait, then the latency.
    async fn carry(&self, bucket: Option<&TokenBucket>, bytes: u64) {
        let wait = bucket.map_or(Duration::ZERO, |b| b.reserve(bytes));
        let charged = wait.saturating_add(self.latency);
        let ns = u64::try_from(charged.as_nanos()).unwrap_or(u64::MAX);
        self.counters.messages.fetch_add(1, Ordering::Relaxed);
        self.counters.charged_ns.fetch_add(ns, Ordering::Relaxed);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Every timed test runs on tokio's paused clock: time moves only when all
    // tasks wait on timers (or the test advances it), so waits are asserted
    // exactly instead of being measured.

    #[test]
    fn tokens_refill_with_the_time_they_are_given() {
        let t0 = StdInstant::now();
        let mut t = Tokens::full(10.0, 10.0, t0);
        assert_eq!((0..30).filter(|_| t.try_take(1.0, t0)).count(), 10);
        assert!(!t.try_take(1.0, t0), "empty until time passes");
        assert!(t.try_take(1.0, t0 + Duration::from_millis(150)));
        // Time never runs backwards: an older instant adds nothing.
        assert!(!t.try_take(1.0, t0));
        // A full second refills no more than the burst.
        let later = t0 + Duration::from_secs(100);
        assert_eq!((0..30).filter(|_| t.try_take(1.0, later)).count(), 10);
        // Taking into debt says how long until it is repaid.
        let mut d = Tokens::full(1000.0, 100.0, t0);
        assert_eq!(d.take(100.0, t0), Duration::ZERO);
        assert_eq!(d.take(500.0, t0), Duration::from_millis(500));
        assert!(!d.try_take(1.0, t0 + Duration::from_millis(400)));
    }

    /// Burst of a [`LinkLimiter`] bucket at up to 131 Mbit/s: 16 KiB.
    const LINK_BURST: f64 = 16.0 * 1024.0;
    /// A message that waits exactly 0.1 s on a full 100 Mbit/s (12.5 MB/s)
    /// bucket: 1.25 MB past the burst.
    const TENTH_AT_100MBIT: u64 = 1_250_000 + 16 * 1024;

    /// Computed times agree up to the nanosecond rounding of `Duration`.
    fn assert_secs(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-8, "{got} s, want {want} s");
    }

    fn link(bandwidth_mbit: f64, latency_ms: f64) -> LinkLimiter {
        LinkLimiter::new(&LinkSection {
            bandwidth_mbit,
            latency_ms,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn reservations_accumulate_debt_at_the_rate() {
        let b = TokenBucket::new(1000.0, 100.0);
        assert_eq!(b.reserve(100), Duration::ZERO);
        // 500 bytes over an empty bucket at 1000 B/s: half a second.
        assert_eq!(b.reserve(500), Duration::from_millis(500));
        // Clones share the debt: 1000 more bytes queue behind those 500.
        assert_eq!(b.clone().reserve(1000), Duration::from_millis(1500));
        // Once the debt is repaid the bucket refills at the rate...
        tokio::time::advance(Duration::from_millis(1550)).await;
        assert_eq!(b.reserve(50), Duration::ZERO);
        assert_eq!(b.reserve(10), Duration::from_millis(10));
        // ...up to the burst and no further.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(b.reserve(100), Duration::ZERO);
        assert_eq!(b.reserve(100), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn acquire_sleeps_for_exactly_the_debt() {
        // 1 MB/s with a 100 KB burst: twice the burst leaves 100 KB of debt,
        // repaid in 0.1 s.
        let b = TokenBucket::new(1e6, 1e5);
        let t = Instant::now();
        b.acquire(200_000).await;
        assert_eq!(t.elapsed(), Duration::from_millis(100));
        // The sleep repaid the debt and no more: the bucket is empty.
        b.acquire(100_000).await;
        assert_eq!(t.elapsed(), Duration::from_millis(200));
        // Reservations are FIFO: a clone's bytes queue behind the first caller's.
        let c = b.clone();
        tokio::join!(b.acquire(100_000), c.acquire(100_000));
        assert_eq!(t.elapsed(), Duration::from_millis(400));

        // With a 1-byte burst, 2 MB more than the burst at 1 MB/s take 2 s.
        let b = TokenBucket::new(1e6, 1.0);
        let t = Instant::now();
        b.acquire(2_000_001).await;
        assert_eq!(t.elapsed(), Duration::from_secs(2));
    }

    #[test]
    fn link_section_validation() {
        assert!(LinkSection::default().validate().is_ok());
        assert!(LinkSection {
            bandwidth_mbit: -1.0,
            latency_ms: 0.0
        }
        .validate()
        .is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn link_charges_the_modelled_time() {
        // 1.25 MB at 100 Mbit/s (12.5 MB/s) is 0.1 s of traffic, less the
        // burst that passes at once.
        let fast = link(100.0, 0.0);
        let t = Instant::now();
        fast.send(1_250_000).await;
        let s = fast.stats();
        assert_eq!(
            (s.sent_bytes, s.received_bytes, s.messages),
            (1_250_000, 0, 1)
        );
        let want = 0.1 - LINK_BURST / 12.5e6;
        assert_secs(s.simulated_secs, want);
        // The sender slept that long, up to the timer's 1 ms granularity.
        let charged = Duration::from_secs_f64(want);
        let slept = t.elapsed();
        assert!(
            slept >= charged && slept < charged + Duration::from_millis(1),
            "{slept:?}"
        );

        // A 10x slower link (same burst) charges 10x the time.
        let slow = link(10.0, 0.0);
        slow.receive(1_250_000).await;
        let s = slow.stats();
        assert_eq!(
            (s.sent_bytes, s.received_bytes, s.messages),
            (0, 1_250_000, 1)
        );
        assert_secs(s.simulated_secs, 1.0 - LINK_BURST / 1.25e6);
        let ratio = s.simulated_secs / fast.stats().simulated_secs;
        assert!((ratio - 10.0).abs() < 1e-6, "{ratio}");
    }

    #[tokio::test(start_paused = true)]
    async fn clones_share_the_buckets_and_the_stats() {
        // 100 Mbit/s and 5 ms one way.
        let a = link(100.0, 5.0);
        let b = a.clone();
        let t = Instant::now();
        // Full duplex: a send and a receive overlap, 0.1 s + 5 ms each.
        tokio::join!(a.send(TENTH_AT_100MBIT), b.receive(TENTH_AT_100MBIT));
        assert_eq!(t.elapsed(), Duration::from_millis(105));
        // One direction is serialised across clones: the second message
        // (1.25 MB, 0.1 s) queues behind the first.
        let t = Instant::now();
        tokio::join!(a.send(TENTH_AT_100MBIT), b.send(1_250_000));
        assert_eq!(t.elapsed(), Duration::from_millis(205));
        let s = b.stats();
        assert_eq!(s, a.stats());
        assert_eq!(
            (s.sent_bytes, s.received_bytes, s.messages),
            (2 * TENTH_AT_100MBIT + 1_250_000, TENTH_AT_100MBIT, 4)
        );
        // Each message is charged its own wait plus the latency:
        // 3 x (0.1 + 0.005) + (0.2 + 0.005).
        assert_secs(s.simulated_secs, 0.52);
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_link_counts_without_waiting() {
        let l = LinkLimiter::new(&LinkSection::default());
        let t = Instant::now();
        l.send(1 << 30).await;
        l.receive(1 << 20).await;
        assert_eq!(t.elapsed(), Duration::ZERO);
        assert_eq!(
            l.stats(),
            LinkStats {
                sent_bytes: 1 << 30,
                received_bytes: 1 << 20,
                messages: 2,
                simulated_secs: 0.0,
            }
        );
        // Latency alone is charged per message.
        let l = link(0.0, 20.0);
        l.send(10).await;
        l.clone().receive(10).await;
        assert_eq!(t.elapsed(), Duration::from_millis(40));
        assert_secs(l.stats().simulated_secs, 0.04);
    }
}

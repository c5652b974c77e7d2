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
//!
//! ```
//! # async fn demo() {
//! use ps_shared::link::TokenBucket;
//! let bucket = TokenBucket::new(1e6, 1e4); // 1 MB/s, 10 KB burst
//! bucket.acquire(5_000).await;            // within the burst: no wait
//! # }
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

#[derive(Debug)]
struct BucketState {
    tokens: f64,
    last: Instant,
}

/// A byte-rate limiter shared by all its clones.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Arc<Mutex<BucketState>>,
}

impl TokenBucket {
    /// `rate` bytes per second (must be > 0), up to `burst` bytes at once.
    pub fn new(rate: f64, burst: f64) -> Self {
        let burst = burst.max(1.0);
        Self {
            rate: rate.max(1.0),
            burst,
            state: Arc::new(Mutex::new(BucketState {
                tokens: burst,
                last: Instant::now(),
            })),
        }
    }

    /// Bytes per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Reserve `bytes` and return how long the caller must wait for them.
    pub fn reserve(&self, bytes: u64) -> Duration {
        let mut s = match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(s.last).as_secs_f64();
        s.last = now;
        s.tokens = (s.tokens + elapsed * self.rate).min(self.burst);
        s.tokens -= bytes as f64;
        if s.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.tokens / self.rate)
        }
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

/// Uplink and downlink buckets plus latency, shared by one worker's streams.
#[derive(Debug, Clone)]
pub struct LinkLimiter {
    up: Option<TokenBucket>,
    down: Option<TokenBucket>,
    latency: Duration,
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
        }
    }

    /// Delay for sending `bytes` from the worker.
    pub async fn send(&self, bytes: u64) {
        if let Some(b) = &self.up {
            b.acquire(bytes).await;
        }
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }

    /// Delay for receiving `bytes` at the worker.
    pub async fn receive(&self, bytes: u64) {
        if let Some(b) = &self.down {
            b.acquire(bytes).await;
        }
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_accumulate_debt_at_the_rate() {
        let b = TokenBucket::new(1000.0, 100.0);
        assert_eq!(b.reserve(100), Duration::ZERO);
        // 500 bytes over an empty bucket at 1000 B/s: about half a second.
        let w = b.reserve(500);
        assert!(
            w > Duration::from_millis(450) && w < Duration::from_millis(550),
            "{w:?}"
        );
        // Clones share the debt.
        let w2 = b.clone().reserve(1000);
        assert!(w2 > Duration::from_millis(1400), "{w2:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn acquire_sleeps_for_the_debt() {
        let b = TokenBucket::new(1e6, 1.0);
        let t = Instant::now();
        b.acquire(2_000_000).await;
        let e = t.elapsed();
        assert!(
            e >= Duration::from_millis(1999) && e < Duration::from_millis(2100),
            "{e:?}"
        );
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
}

//! Throughput balancing on the worker (`data.balance = "throughput"`): the
//! measured throughput it reports with each push, and the split schedule it
//! learns from shard 0's replies.
//!
//! Shard 0 decides a split of the global batch every `data.balance_every`
//! updates (at versions `d = k · every`) and announces it in its replies as
//! effective from step `d + every` (see `ps_server::core::Balancer`). So a
//! worker that holds version `v` knows the split of every step below
//! `(v / every + 1) · every + every`: no decision it has not seen can take
//! effect earlier. That bound is the schedule's **horizon**: the loader plans
//! no batch at or past it ([`SplitNews::known_until`]), so no batch is ever
//! planned with a split that changes afterwards; with the default
//! `balance_every = 20` the horizon is 21 to 40 steps ahead of the trainer,
//! more than the loader's usual lookahead.
//!
//! ```
//! use ps_net::protocol::WireSplit;
//! use ps_worker::balance::BalanceLink;
//!
//! let link = BalanceLink::new(10);
//! assert_eq!(link.news().known_until, 0);
//! link.learn(0, &[]);
//! assert_eq!(link.news().known_until, 20);
//! link.learn(10, &[WireSplit { from: 20, sizes: vec![6, 2] }]);
//! let news = link.news();
//! assert_eq!((news.known_until, news.splits.len()), (30, 1));
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ps_net::protocol::WireSplit;
use ps_shared::sampler::Split;
use tokio::sync::watch;

/// What a worker knows of the split schedule.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SplitNews {
    /// Every split learned, ascending by `from`.
    pub splits: Vec<Split>,
    /// The split of every step below this is known.
    pub known_until: u64,
}

/// Shared by the exchange (which sends the rate and learns the splits) and
/// the training loop and loader (which read them).
#[derive(Debug)]
pub struct BalanceLink {
    every: u64,
    /// The latest measured rate (f32 bits), sent with every push.
    rate: AtomicU32,
    news: watch::Sender<SplitNews>,
}

impl BalanceLink {
    /// A link for splits decided every `every` steps (at least 1), each
    /// effective `every` steps after its decision.
    pub fn new(every: u64) -> Arc<Self> {
        Arc::new(Self {
            every: every.max(1),
            rate: AtomicU32::new(0),
            news: watch::Sender::new(SplitNews::default()),
        })
    }

    /// Shard 0 answered with `version` and the splits it announces.
    pub fn learn(&self, version: u64, splits: &[WireSplit]) {
        let every = self.every;
        let horizon = (version / every + 1)
            .saturating_mul(every)
            .saturating_add(every);
        self.news.send_if_modified(|news| {
            let mut changed = false;
            for s in splits {
                if news.splits.last().is_none_or(|last| last.from < s.from) {
                    news.splits.push(Split {
                        from: s.from,
                        sizes: s.sizes.clone(),
                    });
                    changed = true;
                }
            }
            if horizon > news.known_until {
                news.known_until = horizon;
                changed = true;
            }
            changed
        });
    }

    /// What is known now.
    pub fn news(&self) -> SplitNews {
        self.news.borrow().clone()
    }

    /// Follows what is known.
    pub fn subscribe(&self) -> watch::Receiver<SplitNews> {
        self.news.subscribe()
    }

    /// Sets the rate sent with the next pushes.
    pub fn set_rate(&self, samples_per_s: f32) {
        self.rate.store(samples_per_s.to_bits(), Ordering::Relaxed);
    }

    /// The rate sent with pushes (0: not measured yet).
    pub fn rate(&self) -> f32 {
        f32::from_bits(self.rate.load(Ordering::Relaxed))
    }
}

/// Compute throughput over the last `window` steps: samples over the time
/// spent computing them (forward, backward, compression, and a simulated
/// slowdown), not waiting for data or the exchange.
#[derive(Debug, Clone)]
pub struct RateMeter {
    window: usize,
    steps: VecDeque<(u64, Duration)>,
}

impl RateMeter {
    pub fn new(window: usize) -> Self {
        Self {
            window: window.max(1),
            steps: VecDeque::new(),
        }
    }

    /// One step computed `samples` samples in `took`.
    pub fn record(&mut self, samples: u64, took: Duration) {
        self.steps.push_back((samples, took));
        while self.steps.len() > self.window {
            self.steps.pop_front();
        }
    }

    /// Samples per second over the window (0 before any step).
    pub fn rate(&self) -> f32 {
        let samples: u64 = self.steps.iter().map(|s| s.0).sum();
        let secs: f64 = self.steps.iter().map(|s| s.1.as_secs_f64()).sum();
        if secs > 0.0 {
            (samples as f64 / secs) as f32
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_horizon_follows_the_version_and_splits_arrive_once() {
        let link = BalanceLink::new(20);
        let mut rx = link.subscribe();
        link.learn(0, &[]);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().known_until, 40);
        link.learn(19, &[]);
        assert!(!rx.has_changed().unwrap());
        let split = WireSplit {
            from: 40,
            sizes: vec![3, 1],
        };
        link.learn(20, std::slice::from_ref(&split));
        link.learn(21, std::slice::from_ref(&split));
        let news = link.news();
        assert_eq!(news.known_until, 60);
        assert_eq!(
            news.splits,
            vec![Split {
                from: 40,
                sizes: vec![3, 1]
            }]
        );
        // An older version (another shard's late reply) changes nothing.
        link.learn(3, &[]);
        assert_eq!(link.news().known_until, 60);
    }

    #[test]
    fn the_rate_is_samples_over_compute_time() {
        let mut m = RateMeter::new(2);
        assert_eq!(m.rate(), 0.0);
        m.record(10, Duration::from_millis(100));
        assert!((m.rate() - 100.0).abs() < 1e-3);
        m.record(30, Duration::from_millis(100));
        m.record(30, Duration::from_millis(100));
        assert!((m.rate() - 300.0).abs() < 1e-3);
    }
}

//! Per-epoch data-plane counters of a loader, their rates and their cost.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ps_shared::config::CostModel;
use serde::Serialize;

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
    /// Samples served by their owner in the peer tier.
    pub peer_samples: u64,
    /// Bytes of those samples.
    pub peer_bytes: u64,
    /// Exchanges with peers that returned records.
    pub peer_exchanges: u64,
    /// Samples asked of a peer and read from the bucket instead (not held,
    /// damaged, or the exchange failed).
    pub peer_fallbacks: u64,
    /// Samples a peer sent that failed the manifest's checksum.
    pub peer_damaged: u64,
    /// Exchanges that failed (timeout, unreachable, refused).
    pub peer_errors: u64,
    /// GETs the bucket would have served for the peer samples (counted as
    /// the loader would have requested them: merged ranges in the shard
    /// layout).
    pub peer_gets_saved: u64,
}

impl EpochDataStats {
    fn served(&self) -> u64 {
        self.memory_hits + self.disk_hits + self.peer_samples + self.bucket_samples
    }

    /// Fraction of samples served from memory.
    pub fn memory_hit_rate(&self) -> f64 {
        ratio(self.memory_hits, self.served())
    }

    /// Fraction of samples served from the disk tier.
    pub fn disk_hit_rate(&self) -> f64 {
        ratio(self.disk_hits, self.served())
    }

    /// Fraction of samples served by peers.
    pub fn peer_hit_rate(&self) -> f64 {
        ratio(self.peer_samples, self.served())
    }

    /// What the peer samples would have cost from the bucket: their GETs and
    /// their bytes at the bucket's prices.
    pub fn peer_saved_cost(&self, prices: &CostModel) -> f64 {
        prices.estimate(self.peer_gets_saved, self.peer_bytes)
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
        self.peer_samples += o.peer_samples;
        self.peer_bytes += o.peer_bytes;
        self.peer_exchanges += o.peer_exchanges;
        self.peer_fallbacks += o.peer_fallbacks;
        self.peer_damaged += o.peer_damaged;
        self.peer_errors += o.peer_errors;
        self.peer_gets_saved += o.peer_gets_saved;
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

    pub(super) fn update(&self, epoch: u64, f: impl FnOnce(&mut EpochDataStats)) {
        f(self.lock().entry(epoch).or_default());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, EpochDataStats>> {
        ps_shared::sync::lock(&self.per_epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! The worker's Prometheus series (`stratus_worker_*`, labelled by `rank`)
//! and its per-step JSONL record.
//!
//! [`WorkerSeries`] holds one rank's metric handles, made once; the training
//! loop feeds it each step's figures ([`StepFigures`]) and the loader's
//! counters. With no exporter installed (`--metrics-addr` absent) every
//! handle is a no-op. docs/observability.md lists the names.
//!
//! ```
//! use ps_worker::observe::StepFigures;
//! let step = StepFigures { step: 10, epoch: 1, loss: 0.5, lr: 0.1, ..Default::default() };
//! let line = step.jsonl(3);
//! assert!(line.starts_with("{\"record\":\"step\",\"rank\":3,\"step\":10,"));
//! ```

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};
use serde::Serialize;

use crate::loader::{EpochDataStats, Outage};
use ps_shared::config::CostModel;

/// One training step's figures: the per-step JSONL record and the series
/// [`WorkerSeries::step`] moves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepFigures {
    /// The global step this record closes (the run's step count after it).
    pub step: u64,
    /// The epoch, counted from 1 (as in the per-epoch records).
    pub epoch: u64,
    pub loss: f32,
    /// The scheduled learning rate of the step's update.
    pub lr: f32,
    /// Seconds the trainer waited for the batch.
    pub data_s: f64,
    /// Seconds of forward, backward and applying the reply.
    pub compute_s: f64,
    /// Seconds of gradient compression.
    pub compress_s: f64,
    /// Seconds from the push to the servers' reply.
    pub exchange_s: f64,
    pub samples: u64,
    pub bytes_pushed: u64,
    pub bytes_pulled: u64,
    /// Bytes the step's exchange copied: requests encoded, replies read
    /// from the transport and decoded (see `ps_net::protocol::Copied`).
    pub bytes_copied: u64,
    /// Fraction of the gradient's entries the step's push carried (1 when
    /// dense; with a top-k warm-up, the density in force at this step).
    pub density: f64,
    /// The run's training clock when the step ended: seconds since its
    /// first step, evaluation left out. The difference of two consecutive
    /// records is the later step's wall time.
    pub train_s: f64,
}

impl StepFigures {
    /// The JSONL record: `{"record":"step","rank":R,...}` (per-epoch
    /// records have no `record` field).
    pub fn jsonl(&self, rank: u32) -> String {
        #[derive(Serialize)]
        struct Record<'a> {
            record: &'static str,
            rank: u32,
            #[serde(flatten)]
            figures: &'a StepFigures,
        }
        let record = Record {
            record: "step",
            rank,
            figures: self,
        };
        // Plain numbers only: serialising cannot fail.
        serde_json::to_string(&record).unwrap_or_default()
    }
}

/// Whether step `step` (the count after it) gets a per-step record with
/// `training.step_metrics_every = every`.
pub fn step_record_due(every: u64, step: u64) -> bool {
    every > 0 && step.is_multiple_of(every)
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!("stratus_worker_steps_total", "Training steps this rank completed.");
        describe_counter!("stratus_worker_samples_total", "Samples this rank trained on.");
        describe_histogram!(
            "stratus_worker_step_seconds",
            "Time of one step by phase (phase = data, compute, compress, exchange)."
        );
        describe_gauge!("stratus_worker_loss", "Training loss of the last step.");
        describe_gauge!("stratus_worker_learning_rate", "Learning rate of the last step's update.");
        describe_gauge!("stratus_worker_test_loss", "Loss on the test split at the last evaluation.");
        describe_gauge!(
            "stratus_worker_test_accuracy",
            "Accuracy (0..1) on the test split at the last evaluation."
        );
        describe_gauge!("stratus_worker_step", "The global step this rank is at.");
        describe_counter!(
            "stratus_worker_pushed_bytes_total",
            "Application bytes pushed to the servers."
        );
        describe_counter!(
            "stratus_worker_pulled_bytes_total",
            "Application bytes pulled from the servers."
        );
        describe_counter!(
            "stratus_worker_copied_bytes_total",
            "Bytes the exchanges copied: requests encoded, replies read and decoded."
        );
        describe_counter!(
            "stratus_worker_round_trips_total",
            "Round trips to server shards (Offer and Step requests)."
        );
        describe_gauge!(
            "stratus_worker_live_workers",
            "Workers in the barrier, as the last reply said."
        );
        describe_counter!(
            "stratus_worker_bucket_gets_total",
            "Data GETs from the bucket that succeeded."
        );
        describe_counter!(
            "stratus_worker_bucket_get_attempts_total",
            "Data GET attempts, failed ones and retries included."
        );
        describe_counter!("stratus_worker_bucket_bytes_total", "Bytes read from the bucket.");
        describe_counter!("stratus_worker_bucket_retries_total", "GETs that were retries.");
        describe_counter!(
            "stratus_worker_cache_hits_total",
            "Samples served by a cache tier (tier = memory, disk, peer)."
        );
        describe_counter!(
            "stratus_worker_peer_bytes_total",
            "Bytes of samples served to this worker by their owners (peer tier)."
        );
        describe_counter!(
            "stratus_worker_peer_fallbacks_total",
            "Samples asked of a peer and read from the bucket instead."
        );
        describe_counter!(
            "stratus_worker_peer_damaged_total",
            "Samples a peer sent that failed the manifest's checksum."
        );
        describe_gauge!(
            "stratus_worker_peer_saved_usd",
            "What the samples served by peers would have cost from the bucket ([cost] prices)."
        );
        describe_counter!(
            "stratus_worker_cache_misses_total",
            "Samples fetched from the bucket."
        );
        describe_counter!(
            "stratus_worker_disk_errors_total",
            "Disk-tier reads that failed (the sample was fetched again)."
        );
        describe_counter!(
            "stratus_worker_bad_samples_total",
            "Samples left out because they could not be decoded."
        );
        describe_gauge!(
            "stratus_worker_prefetch_ready_batches",
            "Batches decoded and waiting for the trainer."
        );
        describe_gauge!(
            "stratus_worker_bucket_outage",
            "1 while the bucket is unreachable, else 0."
        );
        describe_gauge!(
            "stratus_worker_bucket_outage_seconds",
            "Seconds the bucket has been unreachable over the run (grows once a second during an outage)."
        );
    });
}

/// One rank's metric handles.
pub struct WorkerSeries {
    steps: Counter,
    samples: Counter,
    phase: [Histogram; 4],
    loss: Gauge,
    lr: Gauge,
    test_loss: Gauge,
    test_accuracy: Gauge,
    step: Gauge,
    pushed: Counter,
    pulled: Counter,
    copied: Counter,
    round_trips: Counter,
    live_workers: Gauge,
    gets: Counter,
    get_attempts: Counter,
    bucket_bytes: Counter,
    retries: Counter,
    memory_hits: Counter,
    disk_hits: Counter,
    peer_hits: Counter,
    peer_bytes: Counter,
    peer_fallbacks: Counter,
    peer_damaged: Counter,
    peer_saved: Gauge,
    misses: Counter,
    disk_errors: Counter,
    bad_samples: Counter,
    ready: Gauge,
}

impl WorkerSeries {
    pub fn new(rank: u32) -> Self {
        use metrics::{counter, gauge, histogram};
        describe();
        let r = rank.to_string();
        let phase = |name: &'static str| histogram!("stratus_worker_step_seconds", "rank" => r.clone(), "phase" => name);
        let hits = |tier: &'static str| counter!("stratus_worker_cache_hits_total", "rank" => r.clone(), "tier" => tier);
        Self {
            steps: counter!("stratus_worker_steps_total", "rank" => r.clone()),
            samples: counter!("stratus_worker_samples_total", "rank" => r.clone()),
            phase: [
                phase("data"),
                phase("compute"),
                phase("compress"),
                phase("exchange"),
            ],
            loss: gauge!("stratus_worker_loss", "rank" => r.clone()),
            lr: gauge!("stratus_worker_learning_rate", "rank" => r.clone()),
            test_loss: gauge!("stratus_worker_test_loss", "rank" => r.clone()),
            test_accuracy: gauge!("stratus_worker_test_accuracy", "rank" => r.clone()),
            step: gauge!("stratus_worker_step", "rank" => r.clone()),
            pushed: counter!("stratus_worker_pushed_bytes_total", "rank" => r.clone()),
            pulled: counter!("stratus_worker_pulled_bytes_total", "rank" => r.clone()),
            copied: counter!("stratus_worker_copied_bytes_total", "rank" => r.clone()),
            round_trips: counter!("stratus_worker_round_trips_total", "rank" => r.clone()),
            live_workers: gauge!("stratus_worker_live_workers", "rank" => r.clone()),
            gets: counter!("stratus_worker_bucket_gets_total", "rank" => r.clone()),
            get_attempts: counter!("stratus_worker_bucket_get_attempts_total", "rank" => r.clone()),
            bucket_bytes: counter!("stratus_worker_bucket_bytes_total", "rank" => r.clone()),
            retries: counter!("stratus_worker_bucket_retries_total", "rank" => r.clone()),
            memory_hits: hits("memory"),
            disk_hits: hits("disk"),
            peer_hits: hits("peer"),
            peer_bytes: counter!("stratus_worker_peer_bytes_total", "rank" => r.clone()),
            peer_fallbacks: counter!("stratus_worker_peer_fallbacks_total", "rank" => r.clone()),
            peer_damaged: counter!("stratus_worker_peer_damaged_total", "rank" => r.clone()),
            peer_saved: gauge!("stratus_worker_peer_saved_usd", "rank" => r.clone()),
            misses: counter!("stratus_worker_cache_misses_total", "rank" => r.clone()),
            disk_errors: counter!("stratus_worker_disk_errors_total", "rank" => r.clone()),
            bad_samples: counter!("stratus_worker_bad_samples_total", "rank" => r.clone()),
            ready: gauge!("stratus_worker_prefetch_ready_batches", "rank" => r),
        }
    }

    /// A finished step.
    pub fn step(&self, f: &StepFigures, round_trips: u64, live_workers: u32) {
        self.steps.increment(1);
        self.samples.increment(f.samples);
        for (h, secs) in self
            .phase
            .iter()
            .zip([f.data_s, f.compute_s, f.compress_s, f.exchange_s])
        {
            h.record(secs);
        }
        self.loss.set(f64::from(f.loss));
        self.lr.set(f64::from(f.lr));
        self.step.set(f.step as f64);
        self.pushed.increment(f.bytes_pushed);
        self.pulled.increment(f.bytes_pulled);
        self.copied.increment(f.bytes_copied);
        self.round_trips.increment(round_trips);
        self.live_workers.set(f64::from(live_workers));
    }

    /// An evaluation on the test split.
    pub fn evaluated(&self, loss: f32, accuracy: f32) {
        self.test_loss.set(f64::from(loss));
        self.test_accuracy.set(f64::from(accuracy));
    }

    /// The loader's counters over every epoch so far, and the batches
    /// waiting in its queue.
    pub fn data_plane(&self, total: &EpochDataStats, ready: usize, prices: &CostModel) {
        self.peer_hits.absolute(total.peer_samples);
        self.peer_bytes.absolute(total.peer_bytes);
        self.peer_fallbacks.absolute(total.peer_fallbacks);
        self.peer_damaged.absolute(total.peer_damaged);
        self.peer_saved.set(total.peer_saved_cost(prices));
        self.gets.absolute(total.gets);
        self.get_attempts.absolute(total.get_attempts);
        self.bucket_bytes.absolute(total.bucket_bytes);
        self.retries.absolute(total.retries);
        self.memory_hits.absolute(total.memory_hits);
        self.disk_hits.absolute(total.disk_hits);
        self.misses.absolute(total.bucket_samples);
        self.disk_errors.absolute(total.disk_errors);
        self.bad_samples.absolute(total.bad_samples);
        self.ready.set(ready as f64);
    }
}

/// Follows the loader's outage status for `rank`: the outage gauge is 1
/// while the bucket is unreachable, and the seconds gauge grows by the
/// outage's length, once a second while it lasts. Ends when the sender is
/// dropped.
pub async fn follow_outages(rank: u32, mut status: tokio::sync::watch::Receiver<Option<Outage>>) {
    describe();
    let r = rank.to_string();
    let active = metrics::gauge!("stratus_worker_bucket_outage", "rank" => r.clone());
    let seconds = metrics::gauge!("stratus_worker_bucket_outage_seconds", "rank" => r);
    active.set(0.0);
    // The part of the current outage already added.
    let mut counted = Duration::ZERO;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let current = *status.borrow_and_update();
        let now = tokio::time::Instant::now();
        match current {
            Some(outage) => {
                active.set(1.0);
                let lasted = outage.lasted(now);
                seconds.increment(lasted.saturating_sub(counted).as_secs_f64());
                counted = lasted;
            }
            None => {
                active.set(0.0);
                counted = Duration::ZERO;
            }
        }
        tokio::select! {
            changed = status.changed() => if changed.is_err() { return },
            _ = tick.tick(), if current.is_some() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_record_is_one_json_object_with_every_figure() {
        let f = StepFigures {
            step: 20,
            epoch: 2,
            loss: 0.75,
            lr: 0.05,
            data_s: 0.001,
            compute_s: 0.02,
            compress_s: 0.003,
            exchange_s: 0.004,
            samples: 32,
            bytes_pushed: 1200,
            bytes_pulled: 3400,
            bytes_copied: 5600,
            density: 0.01,
            train_s: 1.25,
        };
        let line = f.jsonl(7);
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["record"], "step");
        assert_eq!(v["rank"], 7);
        assert_eq!(v["step"], 20);
        assert_eq!(v["epoch"], 2);
        assert_eq!(v["loss"], 0.75);
        assert_eq!(v["exchange_s"], 0.004);
        assert_eq!(v["bytes_pulled"], 3400);
        assert_eq!(v["bytes_copied"], 5600);
        assert_eq!(v["density"], 0.01);
        assert_eq!(v["train_s"], 1.25);
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 16, "{keys:?}");
    }

    #[test]
    fn step_records_come_every_n_steps_and_never_with_zero() {
        let due: Vec<u64> = (1..=25).filter(|s| step_record_due(10, *s)).collect();
        assert_eq!(due, [10, 20]);
        assert!((1..100).all(|s| !step_record_due(0, s)));
        assert!((1..5).all(|s| step_record_due(1, s)));
    }
}

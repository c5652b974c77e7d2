//! The server's Prometheus series (`stratus_server_*`): per shard (label
//! `shard`) from the shard actors, per server process (label `server`) from
//! the network layer. With no exporter installed (`--metrics-addr` absent)
//! every handle is a no-op. docs/observability.md lists the names.
//!
//! ```
//! use ps_server::core::CoreStats;
//! use ps_server::observe::ShardSeries;
//! let series = ShardSeries::new(0);
//! let before = CoreStats::default();
//! let after = CoreStats { pushes: 2, ..before };
//! series.core_moved(&before, &after);
//! ```

use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};

use crate::core::CoreStats;

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "stratus_server_pushes_total",
            "Gradient pushes a shard received."
        );
        describe_counter!(
            "stratus_server_updates_total",
            "Updates a shard applied (its version advanced)."
        );
        describe_counter!(
            "stratus_server_entries_applied_total",
            "Gradient entries the applied updates touched."
        );
        describe_counter!(
            "stratus_server_refused_pushes_total",
            "Pushes a shard refused (bad indices, fenced, over the norm bound, ...)."
        );
        describe_counter!(
            "stratus_server_late_pushes_total",
            "Late pushes (for a step applied without them, server.backup_workers) folded into the next update; also in pushes_total."
        );
        describe_counter!(
            "stratus_server_rounded_updates_total",
            "Updates whose change was rounded to f16 on write (compression.f16_replies)."
        );
        describe_counter!(
            "stratus_server_anomalies_total",
            "Pushes far above the recent median norm (server.grad_anomaly_factor)."
        );
        describe_counter!(
            "stratus_server_clipped_pushes_total",
            "Pushes scaled down to the norm bound."
        );
        describe_counter!(
            "stratus_server_norm_rounds_total",
            "Updates applied with a global norm summed across shards (optimizer.clip_grad_norm with several shards): one per step."
        );
        describe_counter!(
            "stratus_server_norm_clipped_total",
            "Norm rounds whose global norm was above optimizer.clip_grad_norm (the update was scaled down)."
        );
        describe_counter!(
            "stratus_server_barrier_timeouts_total",
            "Barriers that timed out waiting for a worker."
        );
        describe_gauge!(
            "stratus_server_shard_version",
            "The shard's parameter version."
        );
        describe_gauge!(
            "stratus_server_parked_requests",
            "Requests of a shard waiting for their reply (parked at the barrier)."
        );
        describe_counter!(
            "stratus_server_checkpoint_writes_total",
            "Checkpoint writes that succeeded."
        );
        describe_counter!(
            "stratus_server_checkpoint_failures_total",
            "Checkpoint writes that failed."
        );
        describe_gauge!(
            "stratus_server_checkpoint_last_seconds",
            "Duration of the shard's last checkpoint write."
        );
        describe_histogram!(
            "stratus_server_checkpoint_seconds",
            "Durations of checkpoint writes."
        );
        describe_histogram!(
            "stratus_server_request_seconds",
            "Time from a decoded request to its reply (kind = step, offer, heartbeat, ...)."
        );
        describe_counter!(
            "stratus_server_requests_total",
            "Requests answered (kind; outcome = ok or error)."
        );
        describe_counter!(
            "stratus_server_connections_opened_total",
            "Worker connections past admission, TLS and Hello."
        );
        describe_counter!(
            "stratus_server_connections_refused_total",
            "Connections refused at admission, TLS or Hello."
        );
        describe_gauge!(
            "stratus_server_connections_open",
            "Connections open now (state = authenticated, pending)."
        );
        describe_counter!(
            "stratus_server_reply_encoded_bytes_total",
            "Bytes of the reply archives a shard encoded (each distinct reply once)."
        );
        describe_counter!(
            "stratus_server_copied_bytes_total",
            "Request bytes copied (stage = read: from the transport into the aligned buffer; decoded: out of the archive into the request)."
        );
        describe_gauge!(
            "stratus_server_members_live",
            "Worker ranks in the barrier now."
        );
    });
}

/// One shard's handles.
pub struct ShardSeries {
    pushes: Counter,
    updates: Counter,
    entries: Counter,
    refused: Counter,
    late: Counter,
    rounded: Counter,
    anomalies: Counter,
    clipped: Counter,
    norm_rounds: Counter,
    norm_clipped: Counter,
    timeouts: Counter,
    version: Gauge,
    parked: Gauge,
    checkpoint_writes: Counter,
    checkpoint_failures: Counter,
    checkpoint_seconds: Gauge,
    checkpoint_histogram: Histogram,
    encoded: Counter,
}

impl ShardSeries {
    pub fn new(shard: u32) -> Self {
        describe();
        let s = shard.to_string();
        Self {
            pushes: counter!("stratus_server_pushes_total", "shard" => s.clone()),
            updates: counter!("stratus_server_updates_total", "shard" => s.clone()),
            entries: counter!("stratus_server_entries_applied_total", "shard" => s.clone()),
            refused: counter!("stratus_server_refused_pushes_total", "shard" => s.clone()),
            late: counter!("stratus_server_late_pushes_total", "shard" => s.clone()),
            rounded: counter!("stratus_server_rounded_updates_total", "shard" => s.clone()),
            anomalies: counter!("stratus_server_anomalies_total", "shard" => s.clone()),
            clipped: counter!("stratus_server_clipped_pushes_total", "shard" => s.clone()),
            norm_rounds: counter!("stratus_server_norm_rounds_total", "shard" => s.clone()),
            norm_clipped: counter!("stratus_server_norm_clipped_total", "shard" => s.clone()),
            timeouts: counter!("stratus_server_barrier_timeouts_total", "shard" => s.clone()),
            version: gauge!("stratus_server_shard_version", "shard" => s.clone()),
            parked: gauge!("stratus_server_parked_requests", "shard" => s.clone()),
            checkpoint_writes: counter!("stratus_server_checkpoint_writes_total", "shard" => s.clone()),
            checkpoint_failures: counter!("stratus_server_checkpoint_failures_total", "shard" => s.clone()),
            checkpoint_seconds: gauge!("stratus_server_checkpoint_last_seconds", "shard" => s.clone()),
            checkpoint_histogram: histogram!("stratus_server_checkpoint_seconds", "shard" => s.clone()),
            encoded: counter!("stratus_server_reply_encoded_bytes_total", "shard" => s),
        }
    }

    /// What one event changed in the core's counters.
    pub fn core_moved(&self, before: &CoreStats, after: &CoreStats) {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        self.pushes.increment(d(before.pushes, after.pushes));
        self.updates.increment(d(before.updates, after.updates));
        self.refused.increment(d(before.refused, after.refused));
        self.late
            .increment(d(before.late_pushes, after.late_pushes));
        self.rounded
            .increment(d(before.rounded_updates, after.rounded_updates));
        self.anomalies
            .increment(d(before.anomalies, after.anomalies));
        self.clipped.increment(d(before.clipped, after.clipped));
        self.norm_rounds
            .increment(d(before.norm_rounds, after.norm_rounds));
        self.norm_clipped
            .increment(d(before.norm_clipped, after.norm_clipped));
        self.timeouts.increment(d(before.timeouts, after.timeouts));
    }

    /// An update applied: the new version and the entries it touched.
    pub fn applied(&self, version: u64, entries: usize) {
        self.version.set(version as f64);
        self.entries.increment(entries as u64);
    }

    /// Bytes of reply archives encoded.
    pub fn encoded(&self, bytes: u64) {
        self.encoded.increment(bytes);
    }

    pub fn parked(&self, waiting: usize) {
        self.parked.set(waiting as f64);
    }

    /// A checkpoint write ended.
    pub fn checkpoint(&self, ok: bool, took: Duration) {
        if ok {
            self.checkpoint_writes.increment(1);
        } else {
            self.checkpoint_failures.increment(1);
        }
        self.checkpoint_seconds.set(took.as_secs_f64());
        self.checkpoint_histogram.record(took.as_secs_f64());
    }
}

/// A request answered by server `server`.
pub fn request_done(server: usize, kind: &'static str, ok: bool, took: Duration) {
    describe();
    let s = server.to_string();
    histogram!("stratus_server_request_seconds", "server" => s.clone(), "kind" => kind)
        .record(took.as_secs_f64());
    let outcome = if ok { "ok" } else { "error" };
    counter!("stratus_server_requests_total", "server" => s, "kind" => kind, "outcome" => outcome)
        .increment(1);
}

/// Bytes of a request server `server` read and decoded.
pub fn copied(server: usize, read: u64, decoded: u64) {
    describe();
    let s = server.to_string();
    counter!("stratus_server_copied_bytes_total", "server" => s.clone(), "stage" => "read")
        .increment(read);
    counter!("stratus_server_copied_bytes_total", "server" => s, "stage" => "decoded")
        .increment(decoded);
}

/// A connection admitted (`true`) or refused.
pub fn connection(server: usize, admitted: bool) {
    describe();
    let s = server.to_string();
    if admitted {
        counter!("stratus_server_connections_opened_total", "server" => s).increment(1);
    } else {
        counter!("stratus_server_connections_refused_total", "server" => s).increment(1);
    }
}

/// Connections open now (all, and those not yet past Hello) and the live
/// ranks.
pub fn membership(server: usize, (open, pending): (usize, usize), live: usize) {
    describe();
    let s = server.to_string();
    gauge!("stratus_server_connections_open", "server" => s.clone(), "state" => "authenticated")
        .set(open.saturating_sub(pending) as f64);
    gauge!("stratus_server_connections_open", "server" => s.clone(), "state" => "pending")
        .set(pending as f64);
    gauge!("stratus_server_members_live", "server" => s).set(live as f64);
}

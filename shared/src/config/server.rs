//! `[server]`: the parameter-server processes' settings: the sync mode,
//! timeouts, limits on connections and frames, checkpoints, recovery and
//! the guards on pushed gradients.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// Synchronisation modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// Bulk synchronous: every live worker's push for step t before the update.
    Bsp,
    /// Asynchronous: each push is applied on arrival; pulls never wait.
    Asp,
    /// Stale synchronous: applied on arrival, workers at most `server.staleness` steps apart.
    Ssp,
}

/// What the server does with a push whose norm exceeds `server.max_grad_norm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradNormPolicy {
    /// Scale the push down to the bound.
    Clip,
    /// Refuse the push with a typed error.
    Refuse,
}

/// Server-process settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub mode: SyncMode,
    /// SSP bound: how many steps the fastest worker may run ahead of the slowest.
    pub staleness: u64,
    /// BSP only: backup workers. A step is applied once all but this many
    /// live workers pushed it; a push that arrives after its step was
    /// applied is folded into the next update, and the batches of the steps
    /// made without a worker are trained in make-up steps after the last
    /// one (docs/failures.md). 0 = wait for every live worker. Must be
    /// below the barrier's size.
    pub backup_workers: u32,
    /// A worker silent for this long (no request, no heartbeat) is dropped from
    /// the barrier; it may rejoin later.
    pub worker_timeout_secs: f64,
    /// How often workers send a heartbeat.
    pub heartbeat_secs: f64,
    /// Requests per second one connection may make (token bucket, burst = 1 s); 0 = unlimited.
    pub max_requests_per_sec: u32,
    /// Object-store URL for shard checkpoints (`file://dir`, `s3://...`); empty disables.
    pub checkpoint_url: String,
    /// Checkpoint every N updates of a shard (0 disables).
    pub checkpoint_every: u64,
    /// Checkpoint writes of one shard that may fail in a row (each is
    /// logged, counted and retried at the next checkpoint); one more stops
    /// the server with an error. A failed final checkpoint always does.
    pub checkpoint_max_failures: u32,
    /// Stop the server once every worker has said goodbye.
    pub exit_when_done: bool,
    /// Largest frame accepted on the wire, in bytes.
    pub max_frame_bytes: usize,
    /// Seconds a worker keeps trying to reach a server (at start, and after
    /// losing it) before it gives up with an error.
    pub connect_timeout_secs: u64,
    /// Seconds a new connection has to finish TLS and send its Hello.
    pub hello_timeout_secs: f64,
    /// Deadline of every request: a reply that cannot be given within it
    /// (e.g. a barrier waiting for a stuck worker) is answered with Timeout.
    pub request_timeout_secs: f64,
    /// QUIC idle timeout: a peer silent this long (keep-alives included) is
    /// dead. Keep-alives go out every `heartbeat_secs`.
    pub idle_timeout_secs: f64,
    /// Largest UDP payload a QUIC connection of the cluster (workers and
    /// servers, both ends) probes its path up to, by path MTU discovery:
    /// 1452 (the default) suits any Ethernet path; on a network with jumbo
    /// frames (MTU 9000) 8952 sends a sixth of the packets for the same
    /// bytes. Probes a path does not carry are lost and discovery stays
    /// below them, so a value above the path's MTU costs only a few probes.
    pub max_udp_payload: u32,
    /// Connections a server accepts at once, and unauthenticated ones among them.
    pub max_connections: usize,
    pub max_unauthenticated: usize,
    /// Unauthenticated connections from one source address; past it, that
    /// source's oldest one is closed to make room.
    pub max_unauthenticated_per_source: usize,
    /// A server with no worker after this many seconds exits with an error;
    /// a rank that has not joined by then leaves the barrier.
    pub join_timeout_secs: f64,
    /// A server whose workers have all been gone (without finishing) this
    /// long exits with an error.
    pub all_gone_grace_secs: f64,
    /// A starting shard waits this long after the first worker's offer for
    /// the other workers' copies (it decides at once when all have offered).
    pub recovery_window_secs: f64,
    /// Largest L2 norm of one worker's push to one shard (0 = no bound).
    pub max_grad_norm: f32,
    /// `clip` (scale down to the bound) or `refuse`.
    pub grad_norm_policy: GradNormPolicy,
    /// Largest L2 norm of one push to one shard the server ever applies,
    /// whatever `max_grad_norm` says (0 = none). A push above it is scaled
    /// down to it, or refused under `grad_norm_policy = "refuse"`. It also
    /// keeps the sum of one step's pushes finite.
    pub grad_norm_ceiling: f32,
    /// A push whose norm is more than this many times the median norm of
    /// the shard's recent pushes is scaled down to that median, or refused
    /// under `grad_norm_policy = "refuse"` (0 = off).
    pub grad_anomaly_factor: f32,
    /// Pushes a shard takes before the anomaly check starts (only the
    /// ceiling applies to them).
    pub grad_anomaly_warmup: u32,
    /// Recovery: how many periodic checkpoint writes may have failed or
    /// still been under way when a server was lost. A workers' copy more
    /// than `checkpoint_every × (1 + this)` versions past the newest
    /// checkpoint is refused.
    pub recovery_checkpoint_slack: u64,
    /// Threads that run QUIC I/O and decoding.
    pub io_threads: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            mode: SyncMode::Bsp,
            staleness: 2,
            backup_workers: 0,
            worker_timeout_secs: 10.0,
            heartbeat_secs: 1.0,
            max_requests_per_sec: 2000,
            checkpoint_url: String::new(),
            checkpoint_every: 0,
            checkpoint_max_failures: 3,
            exit_when_done: true,
            max_frame_bytes: 256 << 20,
            connect_timeout_secs: 30,
            hello_timeout_secs: 5.0,
            request_timeout_secs: 120.0,
            idle_timeout_secs: 5.0,
            max_udp_payload: 1452,
            max_connections: 256,
            max_unauthenticated: 32,
            max_unauthenticated_per_source: 8,
            join_timeout_secs: 300.0,
            all_gone_grace_secs: 60.0,
            recovery_window_secs: 10.0,
            max_grad_norm: 0.0,
            grad_norm_policy: GradNormPolicy::Clip,
            grad_norm_ceiling: 1.0e6,
            grad_anomaly_factor: 100.0,
            grad_anomaly_warmup: 3,
            recovery_checkpoint_slack: 4,
            io_threads: 2,
        }
    }
}

impl ServerSection {
    /// `max_udp_payload` as the transport takes it (validated to fit).
    pub fn udp_payload(&self) -> u16 {
        u16::try_from(self.max_udp_payload).unwrap_or(u16::MAX)
    }

    /// Time fields in seconds and their ranges: below the low end a timer
    /// spins (a heartbeat of 1e-10 s hangs the run), above the high end a
    /// deadline overflows the clock (a request timeout of 1e19 s panics the
    /// shards).
    const SECONDS: [(&'static str, RangeInclusive<f64>); 8] = [
        ("server.heartbeat_secs", 0.01..=600.0),
        ("server.worker_timeout_secs", 0.02..=86_400.0),
        ("server.idle_timeout_secs", 0.02..=86_400.0),
        ("server.hello_timeout_secs", 0.1..=3_600.0),
        ("server.request_timeout_secs", 0.1..=86_400.0),
        ("server.join_timeout_secs", 0.1..=604_800.0),
        ("server.all_gone_grace_secs", 0.1..=604_800.0),
        ("server.recovery_window_secs", 0.1..=3_600.0),
    ];

    fn seconds(&self) -> [f64; 8] {
        [
            self.heartbeat_secs,
            self.worker_timeout_secs,
            self.idle_timeout_secs,
            self.hello_timeout_secs,
            self.request_timeout_secs,
            self.join_timeout_secs,
            self.all_gone_grace_secs,
            self.recovery_window_secs,
        ]
    }

    /// Every time, size and count field against its range.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        for ((field, range), value) in Self::SECONDS.into_iter().zip(self.seconds()) {
            check_range(field, value, range)?;
        }
        check_range(
            "server.connect_timeout_secs",
            self.connect_timeout_secs,
            1..=86_400,
        )?;
        check_range(
            "server.max_frame_bytes",
            self.max_frame_bytes,
            4096..=1 << 31,
        )?;
        // QUIC's floor (RFC 9000, 14) and the largest UDP payload over IPv4.
        check_range(
            "server.max_udp_payload",
            self.max_udp_payload,
            1200..=65_507,
        )?;
        check_range(
            "server.max_requests_per_sec",
            self.max_requests_per_sec,
            0..=1_000_000,
        )?;
        check_range("server.max_connections", self.max_connections, 1..=65_536)?;
        check_range(
            "server.max_unauthenticated",
            self.max_unauthenticated,
            1..=65_536,
        )?;
        check_range("server.staleness", self.staleness, 0..=1_000_000)?;
        check_range("server.backup_workers", self.backup_workers, 0..=65_535)?;
        check_range(
            "server.checkpoint_every",
            self.checkpoint_every,
            0..=1 << 40,
        )?;
        check_range(
            "server.checkpoint_max_failures",
            self.checkpoint_max_failures,
            0..=1000,
        )?;
        check_range("server.max_grad_norm", self.max_grad_norm, 0.0..=f32::MAX)?;
        check_range("server.io_threads", self.io_threads, 1..=256)
    }

    /// Every field in range and the timeouts consistent with the
    /// heartbeat. The frame size against the model and the connection limit
    /// against the workers are rules across sections
    /// ([`super::ClusterConfig::validate`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        if self.max_frame_bytes < 4096 {
            return Err(invalid("server.max_frame_bytes", "must be >= 4096"));
        }
        if !(self.heartbeat_secs.is_finite() && self.heartbeat_secs > 0.0) {
            return Err(invalid("server.heartbeat_secs", "must be > 0"));
        }
        if !(self.worker_timeout_secs.is_finite()
            && self.worker_timeout_secs >= 2.0 * self.heartbeat_secs)
        {
            return Err(invalid(
                "server.worker_timeout_secs",
                "must be at least twice server.heartbeat_secs",
            ));
        }
        if self.backup_workers > 0 && self.mode != SyncMode::Bsp {
            return Err(invalid(
                "server.backup_workers",
                "applies to server.mode = \"bsp\" only (asp and ssp never wait for a slow worker)",
            ));
        }
        if self.mode == SyncMode::Ssp && self.staleness > 1_000_000 {
            return Err(invalid("server.staleness", "must be <= 1000000"));
        }
        if self.checkpoint_every > 0 && self.checkpoint_url.trim().is_empty() {
            return Err(invalid(
                "server.checkpoint_url",
                "needed when server.checkpoint_every > 0",
            ));
        }
        if self.connect_timeout_secs == 0 {
            return Err(invalid("server.connect_timeout_secs", "must be >= 1"));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        for (field, v) in [
            ("server.hello_timeout_secs", self.hello_timeout_secs),
            ("server.request_timeout_secs", self.request_timeout_secs),
            ("server.join_timeout_secs", self.join_timeout_secs),
            ("server.all_gone_grace_secs", self.all_gone_grace_secs),
            ("server.recovery_window_secs", self.recovery_window_secs),
        ] {
            if !positive(v) {
                return Err(invalid(field, "must be a positive number of seconds"));
            }
        }
        if !(self.idle_timeout_secs.is_finite()
            && self.idle_timeout_secs >= 2.0 * self.heartbeat_secs)
        {
            return Err(invalid(
                "server.idle_timeout_secs",
                "must be at least twice server.heartbeat_secs (keep-alives go out every heartbeat)",
            ));
        }
        if self.max_connections == 0 || self.max_unauthenticated == 0 {
            return Err(invalid(
                "server.max_connections",
                "max_connections and max_unauthenticated must be >= 1",
            ));
        }
        if self.max_unauthenticated_per_source == 0 {
            return Err(invalid(
                "server.max_unauthenticated_per_source",
                "must be >= 1 (above server.max_unauthenticated it changes nothing)",
            ));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(invalid(
                "server.max_grad_norm",
                "must be >= 0 (0 = no bound)",
            ));
        }
        if !(self.grad_norm_ceiling.is_finite() && self.grad_norm_ceiling >= 0.0) {
            return Err(invalid(
                "server.grad_norm_ceiling",
                "must be a finite number >= 0 (0 = no ceiling)",
            ));
        }
        if !(self.grad_anomaly_factor == 0.0
            || (self.grad_anomaly_factor.is_finite() && self.grad_anomaly_factor >= 2.0))
        {
            return Err(invalid(
                "server.grad_anomaly_factor",
                "must be 0 (off) or a finite number >= 2",
            ));
        }
        if self.grad_anomaly_warmup == 0 || self.grad_anomaly_warmup > 1_000_000 {
            return Err(invalid(
                "server.grad_anomaly_warmup",
                "must be in 1..=1000000",
            ));
        }
        if self.recovery_checkpoint_slack > 1_000_000 {
            return Err(invalid(
                "server.recovery_checkpoint_slack",
                "must be <= 1000000",
            ));
        }
        if self.io_threads == 0 || self.io_threads > 256 {
            return Err(invalid("server.io_threads", "must be in 1..=256"));
        }
        Ok(())
    }

    /// Recovery: how many versions past the newest checkpoint (or past 0
    /// without one) the cluster can have reached, when periodic checkpoints
    /// are on: `checkpoint_every × (1 + recovery_checkpoint_slack)`. 0 when
    /// they are off: then nothing bounds a copy's version.
    pub fn recovery_max_ahead(&self) -> u64 {
        if self.checkpoint_every == 0 || self.checkpoint_url.trim().is_empty() {
            return 0;
        }
        self.checkpoint_every
            .saturating_mul(self.recovery_checkpoint_slack.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::refused;
    use crate::config::ClusterConfig;

    #[test]
    fn time_fields_out_of_range_are_refused_by_name() {
        assert_eq!(
            refused("[server]\nrequest_timeout_secs = 1e19\n"),
            "invalid config value server.request_timeout_secs = 1e19 is out of range 0.1..=86400"
        );
        assert_eq!(
            refused("[server]\nheartbeat_secs = 1e-10\n"),
            "invalid config value server.heartbeat_secs = 1e-10 is out of range 0.01..=600"
        );
        // Every seconds field, with values beyond either end, NaN and the
        // infinities.
        for (field, range) in ServerSection::SECONDS {
            let name = field.strip_prefix("server.").expect("a server field");
            for value in [
                "1e19",
                "-1.0",
                "0.0",
                "nan",
                "inf",
                "-inf",
                &format!("{}", range.end() * 2.0),
                &format!("{}", range.start() / 2.0),
            ] {
                let e = refused(&format!("[server]\n{name} = {value}\n"));
                assert!(
                    e.contains(&format!("{field} = ")) && e.contains("is out of range"),
                    "{field} = {value}: {e}"
                );
            }
            // Both ends are allowed (with the heartbeat low enough for the
            // timeouts that must be twice it).
            for value in [range.start(), range.end()] {
                let text = format!("[server]\nheartbeat_secs = 0.01\n{name} = {value:?}\n");
                if let Err(e) = ClusterConfig::from_toml_str(&text) {
                    assert!(!e.to_string().contains("out of range"), "{text}: {e}");
                }
            }
        }
        assert!(refused("[server]\nconnect_timeout_secs = 0\n")
            .contains("server.connect_timeout_secs = 0 is out of range 1..=86400"));
        assert!(refused("[loader]\noutage_budget_s = 1e12\n").contains("loader.outage_budget_s"));
    }

    #[test]
    fn gradient_guards_and_the_recovery_bound_are_checked_by_name() {
        let cfg = ClusterConfig::embedded_default().unwrap();
        assert!(cfg.server.grad_norm_ceiling > 0.0 && cfg.server.grad_anomaly_factor > 0.0);
        for (field, value) in [
            ("grad_norm_ceiling", "-1.0"),
            ("grad_anomaly_factor", "1.5"),
            ("grad_anomaly_factor", "nan"),
            ("grad_anomaly_warmup", "0"),
            ("recovery_checkpoint_slack", "2000000"),
        ] {
            let err = ClusterConfig::from_toml_str(&format!("[server]\n{field} = {value}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("server.{field}")), "{field}: {err}");
        }
        let off = ClusterConfig::from_toml_str("[server]\ngrad_anomaly_factor = 0.0\n").unwrap();
        assert_eq!(off.server.grad_anomaly_factor, 0.0);
        let mut s = ServerSection::default();
        assert_eq!(
            s.recovery_max_ahead(),
            0,
            "no periodic checkpoints: no bound"
        );
        s.checkpoint_every = 100;
        s.checkpoint_url = "file:///tmp/ck".into();
        assert_eq!(s.recovery_max_ahead(), 500);
    }
}

//! `[peers]`: the peer cache tier, where workers serve each other the
//! samples they own before anyone reads the bucket.

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// Samples asked of a peer in one exchange, at most (the owner refuses
/// more).
pub const MAX_PEER_SAMPLES: usize = 4096;

/// The peer cache tier (`[peers]`).
///
/// Every training sample has one owner: the rank that reads it first in the
/// run's sample order. The owner keeps it (memory, then disk) for the rest
/// of the run, by when any rank needs it next, and serves it to the other
/// ranks over the cluster's mutually authenticated QUIC. A rank that misses
/// a sample in its own tiers asks the owner before the bucket, and falls back
/// to the bucket when the owner does not hold it, is slow, gone, refuses, or
/// answers with bytes that fail the manifest's checksum.
///
/// Rank `r` listens on `listen_host`, port `port + r`, and the other ranks
/// reach it at `address` with `{rank}` and `{port}` (`port + r`) replaced:
/// `"127.0.0.1:{port}"` for processes on one host, `"worker-{rank}:{port}"`
/// for containers named by rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeersSection {
    /// Whether workers serve and ask each other for samples.
    pub enabled: bool,
    /// Address the other ranks reach rank `r`'s peer endpoint at, with
    /// `{rank}` and `{port}` placeholders.
    pub address: String,
    /// Host or IP address the peer endpoint binds to.
    pub listen_host: String,
    /// Base port: rank `r` serves on `port + r`.
    pub port: u16,
    /// Exchanges with peers in flight at once (each asks one owner for up to
    /// `max_request_samples` samples).
    pub max_inflight_requests: usize,
    /// Samples asked for in one exchange, at most.
    pub max_request_samples: usize,
    /// Milliseconds a peer may take to answer before the samples are read
    /// from the bucket instead.
    pub timeout_ms: u64,
    /// Seconds a peer that failed (timed out, unreachable, a damaged reply)
    /// is left alone before it is asked again.
    pub retry_after_s: f64,
    /// Exchanges one owner serves at once; more wait their turn.
    pub max_serving: usize,
}

impl Default for PeersSection {
    fn default() -> Self {
        Self {
            enabled: false,
            address: "127.0.0.1:{port}".into(),
            listen_host: "0.0.0.0".into(),
            port: 7700,
            max_inflight_requests: 8,
            max_request_samples: 256,
            timeout_ms: 2000,
            retry_after_s: 10.0,
            max_serving: 16,
        }
    }
}

impl PeersSection {
    /// Where the other ranks reach rank `rank`: `address` with its
    /// placeholders replaced.
    pub fn address_of(&self, rank: u32) -> String {
        self.address
            .replace("{rank}", &rank.to_string())
            .replace("{port}", &self.port_of(rank).to_string())
    }

    /// The port rank `rank` serves on (`port + rank`, saturating).
    pub fn port_of(&self, rank: u32) -> u16 {
        u16::try_from(u32::from(self.port).saturating_add(rank)).unwrap_or(u16::MAX)
    }

    /// Sizes and times in range; an address with a port and a listen host.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_range(
            "peers.max_inflight_requests",
            self.max_inflight_requests,
            1..=4096,
        )?;
        check_range(
            "peers.max_request_samples",
            self.max_request_samples,
            1..=MAX_PEER_SAMPLES,
        )?;
        check_range("peers.timeout_ms", self.timeout_ms, 1..=600_000)?;
        check_range("peers.retry_after_s", self.retry_after_s, 0.0..=86_400.0)?;
        check_range("peers.max_serving", self.max_serving, 1..=4096)?;
        if self.port == 0 {
            return Err(invalid(
                "peers.port",
                "must be a port number >= 1 (rank r serves on port + r)",
            ));
        }
        if self.listen_host.trim().is_empty() {
            return Err(invalid("peers.listen_host", "must name a host or address"));
        }
        let sample = self.address_of(0);
        let port_ok = sample
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(invalid(
                "peers.address",
                format!(
                    "{:?} must be host:port once {{rank}} and {{port}} are replaced (rank 0 gives {sample:?})",
                    self.address
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_validation() {
        let p = PeersSection::default();
        assert_eq!(p.address_of(3), "127.0.0.1:7703");
        p.validate().unwrap();
        let named = PeersSection {
            address: "worker-{rank}:{port}".into(),
            ..PeersSection::default()
        };
        assert_eq!(named.address_of(2), "worker-2:7702");
        let bad = PeersSection {
            address: "worker-{rank}".into(),
            ..PeersSection::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("peers.address"), "{e}");
        let e = PeersSection {
            timeout_ms: 0,
            ..PeersSection::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("peers.timeout_ms"), "{e}");
        let e = PeersSection {
            port: 0,
            ..PeersSection::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("peers.port"), "{e}");
    }
}

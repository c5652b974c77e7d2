//! `[cluster]` and `[tls]`: who is in the cluster, how the parameter space
//! is split among the servers, and the certificates every connection
//! presents.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// Who is in the cluster and how the parameter space is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// One `host:port` per ps-server process, in order; server `i` owns the
    /// `shards_per_server` shards that follow those of servers `0..i`.
    pub servers: Vec<String>,
    /// Parameter shards (one actor each) per server process.
    pub shards_per_server: usize,
    /// Number of workers; ranks are `0..workers`. BSP waits for all of them.
    /// The sample order is split across this many workers; a run resumed
    /// from a checkpoint may use another count (see docs/failures.md,
    /// "Changing the worker count").
    pub workers: usize,
    /// Largest number of workers an `asp` or `ssp` job admits while it runs:
    /// ranks `workers..max_workers` may join beyond the starting count. 0
    /// (the default) means `workers`: nobody joins beyond it. A `bsp`
    /// barrier has a fixed size, so there it must be 0 or `workers`.
    pub max_workers: usize,
    /// Worker ranks per node (one per GPU). Above 1, the ranks of a node
    /// (node `n` holds ranks `n * workers_per_node ..`) hand their
    /// gradients to a node aggregator that sums them, compresses the sum
    /// and pushes once per node; the servers see each node as its first
    /// rank. 1 = every worker pushes on its own. Must divide `workers`.
    pub workers_per_node: usize,
    /// Shared secret workers present when they connect (overridden by `STRATUS_TOKEN`).
    pub token: String,
    /// A worker on a server's own host (loopback, or the server's own
    /// address) sends its requests through the server's Unix socket
    /// instead of QUIC, with a key the server handed it over the
    /// authenticated QUIC connection. The socket lives in a new directory
    /// under the system temporary directory (`TMPDIR`) that only the
    /// server's user can enter; a worker that cannot reach it stays on
    /// QUIC. Both sides must allow it: `false` on a server offers no path,
    /// on a worker takes none.
    pub local_path: bool,
}

impl ClusterSection {
    /// How many ranks may be in the job at once: `max_workers`, or
    /// `workers` when it is 0.
    pub fn max_ranks(&self) -> usize {
        if self.max_workers == 0 {
            self.workers
        } else {
            self.max_workers.max(self.workers)
        }
    }
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            servers: vec!["127.0.0.1:7400".into()],
            shards_per_server: 2,
            workers: 2,
            max_workers: 0,
            workers_per_node: 1,
            token: "stratus-dev-token".into(),
            local_path: true,
        }
    }
}

impl ClusterSection {
    /// Ranges of the counts not checked against other fields.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("cluster.servers (count)", self.servers.len(), 1..=4096)?;
        check_range(
            "cluster.shards_per_server",
            self.shards_per_server,
            1..=1024,
        )?;
        check_range("cluster.workers", self.workers, 1..=4096)?;
        check_range("cluster.workers_per_node", self.workers_per_node, 1..=1024)
    }

    /// The section's own rules: counts in range, every server a
    /// `host:port`, the node size dividing the workers, a token long enough.
    /// Whether workers may join beyond `workers` also depends on
    /// `server.mode` ([`super::ClusterConfig::validate`] checks that).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        if self.servers.is_empty() {
            return Err(invalid(
                "cluster.servers",
                "list at least one server host:port",
            ));
        }
        for s in &self.servers {
            validate_host_port(s)?;
        }
        if self.shards_per_server == 0 || self.shards_per_server > 1024 {
            return Err(invalid("cluster.shards_per_server", "must be in 1..=1024"));
        }
        if self.workers == 0 || self.workers > 4096 {
            return Err(invalid("cluster.workers", "must be in 1..=4096"));
        }
        if self.max_workers != 0 && (self.max_workers < self.workers || self.max_workers > 4096) {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "must be 0 (= cluster.workers) or in cluster.workers..=4096 ({}..=4096)",
                    self.workers
                ),
            ));
        }
        if self.workers_per_node == 0 || !self.workers.is_multiple_of(self.workers_per_node) {
            return Err(invalid(
                "cluster.workers_per_node",
                format!(
                    "must be >= 1 and divide cluster.workers = {} (got {})",
                    self.workers, self.workers_per_node
                ),
            ));
        }
        if self.max_ranks() > self.workers && self.workers_per_node > 1 {
            return Err(invalid(
                "cluster.max_workers",
                format!(
                    "workers join beyond cluster.workers one at a time, so it needs cluster.workers_per_node = 1 (got {})",
                    self.workers_per_node
                ),
            ));
        }
        if self.token.len() < 8 {
            return Err(invalid(
                "cluster.token",
                "must be at least 8 characters (or set STRATUS_TOKEN)",
            ));
        }
        Ok(())
    }
}

/// TLS material. QUIC always runs TLS 1.3 with mutual authentication: the
/// servers and every worker rank hold certificates issued by one cluster CA,
/// and a worker's rank is the one in its certificate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// Server certificate chain (PEM), issued by the cluster CA.
    pub cert: PathBuf,
    /// Server private key (PEM).
    pub key: PathBuf,
    /// The cluster CA certificate (PEM): servers and workers trust only it.
    pub ca: PathBuf,
    /// The cluster CA key (PEM); only `ps-server certs` (or a first start
    /// with `generate_if_missing`) reads it, to issue certificates.
    pub ca_key: PathBuf,
    /// Worker certificate (PEM); `{rank}` is replaced by the worker's rank.
    pub worker_cert: String,
    /// Worker private key (PEM); `{rank}` is replaced by the worker's rank.
    pub worker_key: String,
    /// Name the workers expect in the server certificate.
    pub server_name: String,
    /// Create the CA and any missing server or worker certificate on a
    /// server's start (development clusters). Files already there are kept
    /// as they are; a missing certificate needs `ca_key` when `ca` exists.
    pub generate_if_missing: bool,
}

impl Default for TlsSection {
    fn default() -> Self {
        Self {
            cert: "certs/server.pem".into(),
            key: "certs/server.key".into(),
            ca: "certs/ca.pem".into(),
            ca_key: "certs/ca.key".into(),
            worker_cert: "certs/worker-{rank}.pem".into(),
            worker_key: "certs/worker-{rank}.key".into(),
            server_name: "localhost".into(),
            generate_if_missing: true,
        }
    }
}

impl TlsSection {
    /// A server name to expect, and worker paths with a `{rank}` to fill.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.server_name.is_empty() {
            return Err(invalid("tls.server_name", "must not be empty"));
        }
        if !self.worker_cert.contains("{rank}") || !self.worker_key.contains("{rank}") {
            return Err(invalid(
                "tls.worker_cert",
                "tls.worker_cert and tls.worker_key must contain {rank}",
            ));
        }
        Ok(())
    }

    /// Certificate and key paths of worker `rank`.
    pub fn worker_paths(&self, rank: u32) -> (PathBuf, PathBuf) {
        let fill = |t: &str| PathBuf::from(t.replace("{rank}", &rank.to_string()));
        (fill(&self.worker_cert), fill(&self.worker_key))
    }
}

fn validate_host_port(s: &str) -> Result<(), ConfigError> {
    if s.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(invalid(
            "cluster.servers",
            format!("`{s}` is not host:port (e.g. 10.0.0.5:7400 or ps-0:7400)"),
        )),
    }
}

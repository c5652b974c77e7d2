//! `[loader]` and `[cost]`: the data plane's settings. The loader's
//! prefetch window, cache tiers and retries, and the bucket's prices used
//! for the per-epoch cost estimate.
//!
//! Cache capacities are a [`CacheSize`]: a byte count (`1073741824`,
//! `"512MiB"`, `"2GB"`) or a fraction of the training split (`"25%"`), resolved
//! once the manifest is known.
//!
//! ```
//! use ps_shared::config::{CacheSize, ClusterConfig};
//!
//! let cfg = ClusterConfig::from_toml_str(
//!     "[loader]\nmemory_cache = \"25%\"\ndisk_cache = \"64MiB\"\ndisk_cache_dir = \"/tmp/cache\"\n\
//!      [cost]\nget_cost_per_1000 = 0.0005\n",
//! )
//! .unwrap();
//! assert_eq!(cfg.loader.memory_cache, CacheSize::Fraction(0.25));
//! assert_eq!(cfg.loader.memory_cache.resolve(1000), 250);
//! assert_eq!(cfg.loader.disk_cache.resolve(1000), 64 << 20);
//! let cost = cfg.cost.cost_model().estimate(1000, 1_000_000_000);
//! assert!((cost - (0.0005 + 0.09)).abs() < 1e-12);
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// A cache capacity: bytes, or a fraction of the dataset's training split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheSize {
    /// A fixed number of bytes (0 disables the tier).
    Bytes(u64),
    /// A fraction in `[0, 1]` of the training split's bytes.
    Fraction(f64),
}

impl Default for CacheSize {
    fn default() -> Self {
        CacheSize::Bytes(0)
    }
}

impl CacheSize {
    /// Bytes for a dataset of `dataset_bytes`.
    pub fn resolve(&self, dataset_bytes: u64) -> u64 {
        match *self {
            CacheSize::Bytes(b) => b,
            CacheSize::Fraction(f) => (dataset_bytes as f64 * f.clamp(0.0, 1.0)).floor() as u64,
        }
    }

    /// Parses `"25%"`, `"0.5%"`, `"123"`, `"64KiB"`, `"512MB"`, `"1.5GiB"`, ...
    /// (SI units are powers of 1000, binary units powers of 1024).
    pub fn parse(text: &str) -> Result<CacheSize, String> {
        let t = text.trim();
        if let Some(pct) = t.strip_suffix('%') {
            let v: f64 = pct
                .trim()
                .parse()
                .map_err(|_| format!("`{text}`: expected a percentage such as \"25%\""))?;
            if !(v.is_finite() && (0.0..=100.0).contains(&v)) {
                return Err(format!("`{text}`: a percentage must be in 0..=100"));
            }
            return Ok(CacheSize::Fraction(v / 100.0));
        }
        // parse-size reads SI prefixes (KB, MB, GB, also K, M, G) as powers
        // of 1000 and binary ones (KiB, MiB, GiB) as powers of 1024; the "B"
        // is optional, fractions are rounded to the nearest byte.
        parse_size::parse_size(t)
            .map_err(|e| match e {
                parse_size::Error::PosOverflow => format!("`{text}` is out of range"),
                _ => format!(
                "`{text}`: expected bytes (\"512MiB\", \"2GB\", 1048576) or a percentage (\"25%\")"
            ),
            })
            .map(CacheSize::Bytes)
    }
}

impl fmt::Display for CacheSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CacheSize::Fraction(v) => write!(f, "{}%", v * 100.0),
            CacheSize::Bytes(b) => {
                const UNITS: [(u64, &str); 3] =
                    [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
                for (size, unit) in UNITS {
                    if b >= size && b % size == 0 {
                        return write!(f, "{}{unit}", b / size);
                    }
                }
                write!(f, "{b}")
            }
        }
    }
}

/// How a [`CacheSize`] may be written in TOML: a number of bytes or a string.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum CacheSizeRepr {
    Bytes(u64),
    Text(String),
}

impl TryFrom<CacheSizeRepr> for CacheSize {
    type Error = String;
    fn try_from(r: CacheSizeRepr) -> Result<Self, String> {
        match r {
            CacheSizeRepr::Bytes(b) => Ok(CacheSize::Bytes(b)),
            CacheSizeRepr::Text(t) => CacheSize::parse(&t),
        }
    }
}

impl Serialize for CacheSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for CacheSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let repr = CacheSizeRepr::deserialize(d)?;
        CacheSize::try_from(repr).map_err(serde::de::Error::custom)
    }
}

/// Loader prefetch and cache settings (`[loader]`).
///
/// The loader plans batches ahead of the trainer in the known sample order
/// (the lookahead window), fetches what is not cached with up to
/// `max_inflight_requests` concurrent GETs, and never holds more than
/// `max_inflight_mb` of samples that the trainer has not taken yet (one batch
/// always proceeds, so a tiny bound only costs speed). Samples worth keeping
/// for a later epoch go to the memory tier, then the disk tier; the ones needed
/// soonest stay, the ones needed latest are dropped first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderSection {
    /// Batches planned ahead of the trainer; 0 = use `lookahead_samples`.
    pub lookahead_batches: usize,
    /// Samples planned ahead of the trainer when `lookahead_batches` is 0.
    pub lookahead_samples: usize,
    /// Concurrent GET requests to the bucket.
    pub max_inflight_requests: usize,
    /// Megabytes of samples requested or fetched but not yet taken by the
    /// trainer (the prefetch window's memory bound).
    pub max_inflight_mb: f64,
    /// Assembled batches queued for the trainer, outside the window.
    pub ready_batches: usize,
    /// Memory tier capacity: bytes or a fraction of the training split.
    pub memory_cache: CacheSize,
    /// Disk tier capacity: bytes or a fraction of the training split.
    pub disk_cache: CacheSize,
    /// Directory of the disk tier; empty disables it.
    pub disk_cache_dir: String,
    /// Largest single range GET, in KiB, when adjacent records of a shard are
    /// merged into one request.
    pub max_request_kb: usize,
    /// Ceiling of the wait before the first retry of a failed or short GET,
    /// in milliseconds; doubles per retry. Each wait is drawn at random
    /// below its ceiling (full jitter).
    pub retry_backoff_ms: u64,
    /// Largest ceiling of one wait between retries, in milliseconds.
    pub retry_max_backoff_ms: u64,
    /// Seconds a GET may keep failing with transient errors (the bucket
    /// unreachable, throttling, cut connections) before the run stops; the
    /// trainer waits meanwhile and the log says so. Permanent errors (a
    /// missing or truncated object, a bad label) stop the run at once.
    pub outage_budget_s: f64,
    /// Seconds one GET may take before it counts as failed (a store that
    /// hangs rather than refusing): the outage clock starts at that deadline,
    /// so a hanging bucket is reported after this long and stops the run
    /// `outage_budget_s` later.
    pub request_timeout_s: f64,
}

impl Default for LoaderSection {
    fn default() -> Self {
        Self {
            lookahead_batches: 0,
            lookahead_samples: 4096,
            max_inflight_requests: 256,
            max_inflight_mb: 128.0,
            ready_batches: 2,
            memory_cache: CacheSize::Bytes(1 << 30),
            disk_cache: CacheSize::Bytes(0),
            disk_cache_dir: String::new(),
            max_request_kb: 8192,
            retry_backoff_ms: 50,
            retry_max_backoff_ms: 5000,
            outage_budget_s: 120.0,
            request_timeout_s: 10.0,
        }
    }
}

impl LoaderSection {
    /// The sizes that [`Self::check_rules`] bounds only from below.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range(
            "loader.lookahead_batches",
            self.lookahead_batches,
            0..=1 << 20,
        )?;
        check_range(
            "loader.lookahead_samples",
            self.lookahead_samples,
            0..=1 << 26,
        )?;
        check_range(
            "loader.max_inflight_mb",
            self.max_inflight_mb,
            0.001..=1_048_576.0,
        )?;
        check_range("loader.max_request_kb", self.max_request_kb, 1..=1 << 20)?;
        check_range(
            "loader.outage_budget_s",
            self.outage_budget_s,
            0.0..=86_400.0,
        )
    }

    /// Sizes in range, a disk directory for a disk tier, retry waits that
    /// grow, timeouts a clock can hold.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        self.check_rules().map_err(|m| invalid("loader", m))
    }

    fn check_rules(&self) -> Result<(), String> {
        if self.lookahead_batches == 0 && self.lookahead_samples == 0 {
            return Err(
                "loader.lookahead_samples must be >= 1 when loader.lookahead_batches is 0".into(),
            );
        }
        if self.max_inflight_requests == 0 || self.max_inflight_requests > 65_536 {
            return Err("loader.max_inflight_requests must be in 1..=65536".into());
        }
        if !(self.max_inflight_mb.is_finite() && self.max_inflight_mb > 0.0) {
            return Err("loader.max_inflight_mb must be > 0".into());
        }
        if self.ready_batches == 0 || self.ready_batches > 1024 {
            return Err("loader.ready_batches must be in 1..=1024".into());
        }
        for (name, size) in [
            ("loader.memory_cache", self.memory_cache),
            ("loader.disk_cache", self.disk_cache),
        ] {
            if let CacheSize::Fraction(f) = size {
                if !(f.is_finite() && (0.0..=1.0).contains(&f)) {
                    return Err(format!("{name} must be a fraction in 0%..=100% or bytes"));
                }
            }
        }
        if self.disk_cache_dir.trim().is_empty() && self.disk_cache.resolve(u64::MAX) > 0 {
            return Err("loader.disk_cache needs loader.disk_cache_dir (a local directory)".into());
        }
        if self.max_request_kb == 0 {
            return Err("loader.max_request_kb must be >= 1".into());
        }
        if self.retry_backoff_ms == 0 || self.retry_backoff_ms > 60_000 {
            return Err("loader.retry_backoff_ms must be in 1..=60000".into());
        }
        if self.retry_max_backoff_ms < self.retry_backoff_ms || self.retry_max_backoff_ms > 600_000
        {
            return Err(
                "loader.retry_max_backoff_ms must be in loader.retry_backoff_ms..=600000".into(),
            );
        }
        if !(self.outage_budget_s.is_finite() && (0.0..=86_400.0).contains(&self.outage_budget_s)) {
            return Err(
                "loader.outage_budget_s must be in 0..=86400 seconds (0: no retries)".into(),
            );
        }
        if !(self.request_timeout_s.is_finite()
            && self.request_timeout_s > 0.0
            && self.request_timeout_s <= 600.0)
        {
            return Err(format!(
                "loader.request_timeout_s must be in (0, 600] seconds, got {}",
                self.request_timeout_s
            ));
        }
        Ok(())
    }

    /// Samples planned ahead for batches of `batch_size` (at least one batch).
    pub fn lookahead(&self, batch_size: usize) -> usize {
        let samples = if self.lookahead_batches > 0 {
            self.lookahead_batches.saturating_mul(batch_size)
        } else {
            self.lookahead_samples
        };
        samples.max(batch_size).max(1)
    }

    /// `max_inflight_mb` in bytes.
    pub fn max_inflight_bytes(&self) -> u64 {
        (self.max_inflight_mb * 1e6).round().max(1.0) as u64
    }
}

/// Request and egress prices of a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Dollars per 1000 GET requests.
    pub per_1000_gets: f64,
    /// Dollars per GB (1e9 bytes) read out of the bucket.
    pub per_gb_egress: f64,
}

impl CostModel {
    /// Estimated dollars for `gets` requests that moved `bytes`.
    pub fn estimate(&self, gets: u64, bytes: u64) -> f64 {
        gets as f64 / 1000.0 * self.per_1000_gets + bytes as f64 / 1e9 * self.per_gb_egress
    }
}

/// The prices of the bucket at `data.url` (`[cost]`), for the estimate of
/// what each epoch's GETs and egress cost (`bucket_cost_usd` in the
/// metrics). The defaults are S3 Standard's list prices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostSection {
    /// Dollars per 1000 GET requests.
    pub get_cost_per_1000: f64,
    /// Dollars per GB (1e9 bytes) read out of the bucket.
    pub egress_cost_per_gb: f64,
}

impl Default for CostSection {
    fn default() -> Self {
        Self {
            get_cost_per_1000: 0.0004,
            egress_cost_per_gb: 0.09,
        }
    }
}

impl CostSection {
    /// Prices finite and >= 0.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("cost.get_cost_per_1000", self.get_cost_per_1000),
            ("cost.egress_cost_per_gb", self.egress_cost_per_gb),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid("cost", format!("{name} must be >= 0")));
            }
        }
        Ok(())
    }

    /// The prices as a [`CostModel`].
    pub fn cost_model(&self) -> CostModel {
        CostModel {
            per_1000_gets: self.get_cost_per_1000,
            per_gb_egress: self.egress_cost_per_gb,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClusterConfig;

    #[test]
    fn cache_size_parsing() {
        assert_eq!(CacheSize::parse("25%"), Ok(CacheSize::Fraction(0.25)));
        assert_eq!(CacheSize::parse(" 0.5 % "), Ok(CacheSize::Fraction(0.005)));
        assert_eq!(CacheSize::parse("123"), Ok(CacheSize::Bytes(123)));
        assert_eq!(CacheSize::parse("64KiB"), Ok(CacheSize::Bytes(65536)));
        assert_eq!(
            CacheSize::parse("2 GB"),
            Ok(CacheSize::Bytes(2_000_000_000))
        );
        assert_eq!(CacheSize::parse("1.5MiB"), Ok(CacheSize::Bytes(1_572_864)));
        // SI prefixes are powers of 1000, binary ones powers of 1024; the
        // unit is case-insensitive and the "B" optional.
        for (text, bytes) in [
            ("512MiB", 512 << 20),
            ("1.5GiB", 3 << 29),
            ("2GB", 2_000_000_000),
            ("2g", 2_000_000_000),
            ("64kb", 64_000),
            ("3 TiB", 3 << 40),
            ("1048576", 1 << 20),
            ("10 B", 10),
            (" 7 MB ", 7_000_000),
        ] {
            assert_eq!(
                CacheSize::parse(text),
                Ok(CacheSize::Bytes(bytes)),
                "{text}"
            );
        }
        for bad in ["", "abc", "12XB", "150%", "-1", "nan%", "1.5.2GB", "20EiB"] {
            let e = CacheSize::parse(bad).expect_err(bad);
            assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
        }
        assert!(CacheSize::parse("20EiB")
            .unwrap_err()
            .contains("out of range"));
        assert!(CacheSize::parse("12XB").unwrap_err().contains("\"512MiB\""));
        assert_eq!(CacheSize::Fraction(0.25).resolve(1000), 250);
        assert_eq!(CacheSize::Bytes(7).resolve(1000), 7);
        for s in [
            CacheSize::Bytes(3 << 20),
            CacheSize::Bytes(1000),
            CacheSize::Fraction(0.1),
        ] {
            assert_eq!(CacheSize::parse(&s.to_string()), Ok(s));
        }
    }

    #[test]
    fn sections_parse_and_round_trip() {
        let text = r#"
[loader]
lookahead_batches = 8
max_inflight_requests = 64
memory_cache = 1048576
disk_cache = "10%"
disk_cache_dir = "/tmp/x"

[cost]
egress_cost_per_gb = 0.12
"#;
        let cfg = ClusterConfig::from_toml_str(text).unwrap();
        assert_eq!(cfg.loader.lookahead(32), 256);
        assert_eq!(cfg.loader.memory_cache, CacheSize::Bytes(1 << 20));
        assert_eq!(cfg.loader.disk_cache, CacheSize::Fraction(0.1));
        assert_eq!(cfg.cost.cost_model().per_gb_egress, 0.12);
        assert_eq!(cfg.cost.cost_model().per_1000_gets, 0.0004);
        let again = toml::to_string(&cfg).unwrap();
        assert_eq!(ClusterConfig::from_toml_str(&again).unwrap(), cfg);
    }

    #[test]
    fn bad_values_name_their_field() {
        for (text, field) in [
            (
                "[loader]\nmax_inflight_requests = 0\n",
                "loader.max_inflight_requests",
            ),
            ("[loader]\nmemory_cache = \"200%\"\n", "memory_cache"),
            ("[loader]\ndisk_cache = \"1GiB\"\n", "loader.disk_cache_dir"),
            (
                "[loader]\nmax_inflight_mb = 0.0\n",
                "loader.max_inflight_mb",
            ),
            (
                "[cost]\nget_cost_per_1000 = -1.0\n",
                "cost.get_cost_per_1000",
            ),
            (
                "[cost]\negress_cost_per_gb = inf\n",
                "cost.egress_cost_per_gb",
            ),
            ("[cost]\nwhatever = 1\n", "whatever"),
            (
                "[loader]\noutage_budget_s = -1.0\n",
                "loader.outage_budget_s",
            ),
            (
                "[loader]\nretry_max_backoff_ms = 10\n",
                "loader.retry_max_backoff_ms",
            ),
            (
                "[loader]\nrequest_timeout_s = 0.0\n",
                "loader.request_timeout_s",
            ),
            (
                "[loader]\nrequest_timeout_s = 1e19\n",
                "loader.request_timeout_s",
            ),
            ("[loader]\nmax_retries = 4\n", "max_retries"),
        ] {
            let e = ClusterConfig::from_toml_str(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?} gave {e}");
        }
    }

    #[test]
    fn lookahead_is_at_least_one_batch() {
        let l = LoaderSection {
            lookahead_samples: 10,
            ..LoaderSection::default()
        };
        assert_eq!(l.lookahead(64), 64);
        assert_eq!(l.lookahead(4), 10);
    }
}

//! Test and benchmark simulators, kept out of the cluster config: a
//! simulated network link between a worker and the servers (`[link]`), a
//! simulated slow bucket in front of `data.url` (`[bucket]`) and a
//! simulated slow worker (`[compute]`).
//!
//! A worker gets a [`Simulation`] at run time (`ps-worker train --simulate
//! FILE`, or `WorkerOptions::simulation` in tests and benchmarks); the
//! default simulates nothing. A simulation file is a small TOML file:
//!
//! ```
//! use ps_worker::simulate::Simulation;
//!
//! let sim = Simulation::from_toml_str(
//!     "[link]\nbandwidth_mbit = 100.0\nlatency_ms = 1.0\n\n[bucket]\nfirst_byte_ms = 20.0\n",
//!     "example.toml",
//! )
//! .unwrap();
//! assert_eq!(sim.link.bandwidth_mbit, 100.0);
//! assert_eq!(sim.bucket.as_ref().map(|b| b.first_byte_ms), Some(20.0));
//! // No `[bucket]` section: the bucket is not simulated.
//! assert!(Simulation::from_toml_str("[link]\n", "x.toml").unwrap().bucket.is_none());
//! assert!(Simulation::default().is_none());
//! // A worker 3x slower than the others: each step's compute takes 3x its
//! // measured time (plus `delay_ms`, also multiplied).
//! let slow = Simulation::from_toml_str("[compute]\nslowdown = 3.0\n", "slow.toml").unwrap();
//! let measured = std::time::Duration::from_millis(10);
//! let extra = slow.compute.extra(measured).as_secs_f64();
//! assert!((extra - 0.020).abs() < 1e-9, "{extra}");
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use ps_shared::link::LinkSection;

/// What a worker simulates; nothing by default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Simulation {
    /// The worker's link to the servers (unlimited by default).
    pub link: LinkSection,
    /// A slow bucket in front of `data.url`; `None` (no `[bucket]` section)
    /// reads the bucket as it is.
    pub bucket: Option<SimBucketSection>,
    /// A slow worker: each step's compute is stretched (as it is by default).
    pub compute: SimComputeSection,
    /// A faulty peer cache endpoint (with `peers.enabled`).
    pub peers: SimPeersSection,
}

/// A faulty peer: the `[peers]` section of a simulation file. What this
/// worker's peer endpoint does wrong when other ranks ask it for samples.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimPeersSection {
    /// Wait this long before every answer, in milliseconds.
    pub delay_ms: f64,
    /// Flip a byte of every sample served (the askers' checksum catches it).
    pub corrupt: bool,
}

impl SimPeersSection {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.delay_ms.is_finite() && (0.0..=600_000.0).contains(&self.delay_ms)) {
            return Err("peers.delay_ms must be in [0, 600000]".into());
        }
        Ok(())
    }

    /// The faults as the peer endpoint takes them.
    pub fn faults(&self) -> crate::peers::PeerFaults {
        crate::peers::PeerFaults {
            delay: std::time::Duration::from_secs_f64(self.delay_ms.max(0.0) / 1000.0),
            corrupt: self.corrupt,
        }
    }
}

/// A simulated slow worker: the `[compute]` section of a simulation file.
///
/// A step's compute (gradient and compression) is made to last
/// `(measured + delay_ms) × slowdown`: the worker waits out the difference
/// after computing, and counts it as compute time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimComputeSection {
    /// Factor on each step's compute time, >= 1 (1 = as measured).
    pub slowdown: f64,
    /// Fixed compute time added to every step before the factor, in
    /// milliseconds (0 = none).
    pub delay_ms: f64,
    /// Compute time added per sample of the step's batch before the
    /// factor, in milliseconds (0 = none): a step's compute then grows with
    /// its batch, as a real model's does (`data.balance = "throughput"`
    /// gives a slow worker smaller batches).
    pub sample_ms: f64,
    /// The slowdown lasts until this global step, then the worker computes
    /// at the others' pace again (a straggler that comes back); 0 = the
    /// whole run.
    pub slow_until_step: u64,
}

impl Default for SimComputeSection {
    fn default() -> Self {
        Self {
            slowdown: 1.0,
            delay_ms: 0.0,
            sample_ms: 0.0,
            slow_until_step: 0,
        }
    }
}

impl SimComputeSection {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.slowdown.is_finite() && (1.0..=1000.0).contains(&self.slowdown)) {
            return Err("compute.slowdown must be in [1, 1000]".into());
        }
        if !(self.delay_ms.is_finite() && (0.0..=600_000.0).contains(&self.delay_ms)) {
            return Err("compute.delay_ms must be in [0, 600000]".into());
        }
        if !(self.sample_ms.is_finite() && (0.0..=60_000.0).contains(&self.sample_ms)) {
            return Err("compute.sample_ms must be in [0, 60000]".into());
        }
        Ok(())
    }

    /// Whether compute runs as measured.
    pub fn is_none(&self) -> bool {
        self.slowdown == 1.0 && self.delay_ms == 0.0 && self.sample_ms == 0.0
    }

    /// How long to wait after a step whose compute took `measured`.
    pub fn extra(&self, measured: std::time::Duration) -> std::time::Duration {
        self.extra_for(measured, 0)
    }

    /// How long to wait after a step whose compute of `samples` samples
    /// took `measured`.
    pub fn extra_for(&self, measured: std::time::Duration, samples: usize) -> std::time::Duration {
        self.extra_at(measured, samples, 0)
    }

    /// [`Self::extra_for`] at global step `step` (the slowdown ends at
    /// `slow_until_step`).
    pub fn extra_at(
        &self,
        measured: std::time::Duration,
        samples: usize,
        step: u64,
    ) -> std::time::Duration {
        if self.is_none() {
            return std::time::Duration::ZERO;
        }
        let added = (self.delay_ms + self.sample_ms * samples as f64) / 1000.0;
        let slowdown = if self.slow_until_step > 0 && step >= self.slow_until_step {
            1.0
        } else {
            self.slowdown
        };
        let stretched = (measured.as_secs_f64() + added) * slowdown;
        std::time::Duration::from_secs_f64((stretched - measured.as_secs_f64()).max(0.0))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimulationError {
    #[error("cannot read simulation file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("simulation file {origin} is not valid: {message}")]
    Parse { origin: String, message: String },
    #[error("simulation file {origin}: invalid value {message}")]
    Invalid { origin: String, message: String },
}

impl Simulation {
    /// Reads, parses and checks a simulation file; errors name the file and
    /// the field.
    pub fn load(path: &Path) -> Result<Self, SimulationError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimulationError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and checks simulation TOML; `origin` names it in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, SimulationError> {
        let sim: Simulation = toml::from_str(text).map_err(|e| SimulationError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        sim.validate().map_err(|message| SimulationError::Invalid {
            origin: origin.to_string(),
            message,
        })?;
        Ok(sim)
    }

    /// Checks every value; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.link.validate()?;
        if let Some(b) = &self.bucket {
            b.validate()?;
        }
        self.peers.validate()?;
        self.compute.validate()
    }

    /// Whether this simulates nothing.
    pub fn is_none(&self) -> bool {
        self.link.is_unlimited()
            && self.bucket.is_none()
            && self.compute.is_none()
            && self.peers == SimPeersSection::default()
    }
}

/// A simulated slow bucket in front of the real one: the `[bucket]` section
/// of a simulation file (tests and benchmarks, never the cluster config).
///
/// Every GET waits `first_byte_ms`, then streams its body no faster than
/// `per_connection_mb_per_s` while all GETs together share
/// `aggregate_gbit_per_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimBucketSection {
    /// Latency before the first byte of every request, in milliseconds.
    pub first_byte_ms: f64,
    /// Bandwidth of one request's stream in megabytes (1e6 B) per second; 0 = unlimited.
    pub per_connection_mb_per_s: f64,
    /// Bandwidth shared by all requests in gigabits per second; 0 = unlimited.
    pub aggregate_gbit_per_s: f64,
    /// Fraction of GETs that fail with a transient error (tests retries).
    pub transient_error_rate: f64,
    /// Seed of the injected failures.
    pub seed: u64,
}

impl Default for SimBucketSection {
    fn default() -> Self {
        Self {
            first_byte_ms: 50.0,
            per_connection_mb_per_s: 50.0,
            aggregate_gbit_per_s: 1.0,
            transient_error_rate: 0.0,
            seed: 1,
        }
    }
}

impl SimBucketSection {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.first_byte_ms.is_finite() && (0.0..=60_000.0).contains(&self.first_byte_ms)) {
            return Err("bucket.first_byte_ms must be in [0, 60000]".into());
        }
        if !(self.per_connection_mb_per_s.is_finite() && self.per_connection_mb_per_s >= 0.0) {
            return Err("bucket.per_connection_mb_per_s must be >= 0 (0 = unlimited)".into());
        }
        if !(self.aggregate_gbit_per_s.is_finite() && self.aggregate_gbit_per_s >= 0.0) {
            return Err("bucket.aggregate_gbit_per_s must be >= 0 (0 = unlimited)".into());
        }
        if !(self.transient_error_rate.is_finite()
            && (0.0..1.0).contains(&self.transient_error_rate))
        {
            return Err("bucket.transient_error_rate must be in [0, 1)".into());
        }
        Ok(())
    }

    /// Aggregate bandwidth in bytes per second (0 = unlimited).
    pub fn aggregate_bytes_per_s(&self) -> f64 {
        self.aggregate_gbit_per_s * 1e9 / 8.0
    }

    /// Per-connection bandwidth in bytes per second (0 = unlimited).
    pub fn per_connection_bytes_per_s(&self) -> f64 {
        self.per_connection_mb_per_s * 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_file_loads() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/simulate-slow-bucket.toml");
        let sim = Simulation::load(&path).expect("configs/simulate-slow-bucket.toml");
        assert!(sim.bucket.is_some());
        assert!(!sim.is_none());
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/simulate-slow-worker.toml");
        let slow = Simulation::load(&path).expect("configs/simulate-slow-worker.toml");
        assert_eq!(slow.compute.slowdown, 3.0);
        assert!(slow.bucket.is_none() && slow.link.is_unlimited());
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        for (text, field) in [
            ("[bucket]\nfirst_byte_ms = -1.0\n", "bucket.first_byte_ms"),
            (
                "[bucket]\ntransient_error_rate = 1.0\n",
                "bucket.transient_error_rate",
            ),
            ("[link]\nlatency_ms = 20000.0\n", "link.latency_ms"),
            ("[link]\nbandwidth_mbit = -5.0\n", "link.bandwidth_mbit"),
            ("[bucket]\nenabled = true\n", "enabled"),
            ("[bucket]\nget_cost_per_1000 = 0.1\n", "get_cost_per_1000"),
            ("[bucket_sim]\nfirst_byte_ms = 1.0\n", "bucket_sim"),
            ("[compute]\nslowdown = 0.5\n", "compute.slowdown"),
            ("[compute]\ndelay_ms = -1.0\n", "compute.delay_ms"),
        ] {
            let e = Simulation::from_toml_str(text, "sim/slow.toml")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("sim/slow.toml") && e.contains(field),
                "{text:?} gave {e}"
            );
        }
        let e = Simulation::load(Path::new("/nonexistent/sim.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/sim.toml"), "{e}");
    }

    #[test]
    fn a_slow_worker_stretches_each_steps_compute() {
        use std::time::Duration;
        let sim =
            Simulation::from_toml_str("[compute]\nslowdown = 3.0\ndelay_ms = 5.0\n", "t").unwrap();
        assert!(!sim.is_none());
        // (10 ms + 5 ms) x 3 = 45 ms: 35 ms more than measured.
        let extra = sim.compute.extra(Duration::from_millis(10));
        assert!((extra.as_secs_f64() - 0.035).abs() < 1e-9, "{extra:?}");
        let fixed = Simulation::from_toml_str("[compute]\ndelay_ms = 20.0\n", "t").unwrap();
        let extra = fixed.compute.extra(Duration::from_millis(7));
        assert!((extra.as_secs_f64() - 0.020).abs() < 1e-9, "{extra:?}");
        assert_eq!(
            Simulation::default()
                .compute
                .extra(Duration::from_millis(7)),
            Duration::ZERO
        );
    }

    #[test]
    fn an_empty_bucket_section_simulates_the_default_bucket() {
        let sim = Simulation::from_toml_str("[bucket]\n", "t").unwrap();
        assert_eq!(sim.bucket, Some(SimBucketSection::default()));
        assert!(sim.link.is_unlimited());
        let again = toml::to_string(&sim).unwrap();
        assert_eq!(Simulation::from_toml_str(&again, "t").unwrap(), sim);
    }
}

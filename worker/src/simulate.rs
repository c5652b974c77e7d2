//! Test and benchmark simulators, kept out of the cluster config: a
//! simulated network link between a worker and the servers (`[link]`) and a
//! simulated slow bucket in front of `data.url` (`[bucket]`).
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
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use ps_shared::dataplane::SimBucketSection;
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
        Ok(())
    }

    /// Whether this simulates nothing.
    pub fn is_none(&self) -> bool {
        self.link.is_unlimited() && self.bucket.is_none()
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
    fn an_empty_bucket_section_simulates_the_default_bucket() {
        let sim = Simulation::from_toml_str("[bucket]\n", "t").unwrap();
        assert_eq!(sim.bucket, Some(SimBucketSection::default()));
        assert!(sim.link.is_unlimited());
        let again = toml::to_string(&sim).unwrap();
        assert_eq!(Simulation::from_toml_str(&again, "t").unwrap(), sim);
    }
}

//! Data-plane configuration: the loader's cache and prefetch settings and the
//! simulated bucket used by tests and benchmarks.

use serde::{Deserialize, Serialize};

/// Loader cache and prefetch settings (`[loader]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderSection {}

impl LoaderSection {
    pub fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A simulated slow bucket in front of the real one (`[bucket_sim]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SimBucketSection {}

impl SimBucketSection {
    pub fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

//! `[data]` and `[data.augment]`: where the training data lives, how the
//! loader batches and orders it, and how training images are augmented.

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};
use crate::sampler::Partition;

/// Where the training data lives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Bucket URL of the dataset: `file://dir` (relative to the working directory
    /// or absolute), `memory://`, `s3://`, `gs://` or `az://bucket/prefix` (credentials from the AWS_*, GOOGLE_* or AZURE_* variables).
    pub url: String,
    /// Samples per step on each worker.
    pub batch_size: usize,
    /// Seed of the per-epoch sample order.
    pub seed: u64,
    /// Batches the loader keeps fetched ahead of the trainer.
    pub prefetch_batches: usize,
    /// `reshuffle` (a new random split across ranks every epoch) or `stable`
    /// (each rank keeps its part and shuffles within it: caches stay useful).
    pub partition: Partition,
    /// Image datasets: threads that decode and augment images (per worker).
    pub decode_threads: usize,
    /// Image datasets: `stop` the run at a sample that cannot be decoded, or
    /// `skip` it (the loader counts and logs it).
    pub on_bad_sample: OnBadSample,
    /// Image datasets: augmentation of training images.
    pub augment: AugmentSection,
    /// How the global batch (`cluster.workers × batch_size` samples a step)
    /// is cut across the workers: `equal` (`batch_size` each) or
    /// `throughput` (in proportion to each worker's measured samples per
    /// second, re-split every `balance_every` steps; bsp only).
    pub balance: Balance,
    /// Steps between two re-splits with `balance = "throughput"`; a new
    /// split takes effect `balance_every` steps after it is decided.
    pub balance_every: u64,
}

/// How the global batch of a step is cut across the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Balance {
    /// `data.batch_size` samples each.
    #[default]
    Equal,
    /// In proportion to the workers' measured throughput.
    Throughput,
}

impl DataSection {
    /// Batch and prefetch sizes.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("data.batch_size", self.batch_size, 1..=1 << 20)?;
        check_range("data.prefetch_batches", self.prefetch_batches, 1..=65_536)?;
        check_range("data.decode_threads", self.decode_threads, 1..=256)?;
        check_range("data.balance_every", self.balance_every, 1..=1 << 20)
    }

    /// A bucket URL, sizes in range and the augmentation's statistics.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        if self.url.trim().is_empty() {
            return Err(invalid("data.url", "must name a bucket URL"));
        }
        if self.batch_size == 0 {
            return Err(invalid("data.batch_size", "must be >= 1"));
        }
        if self.prefetch_batches == 0 {
            return Err(invalid("data.prefetch_batches", "must be >= 1"));
        }
        if self.decode_threads == 0 || self.decode_threads > 256 {
            return Err(invalid("data.decode_threads", "must be in 1..=256"));
        }
        self.augment.validate()
    }
}

/// What the loader does with a sample it cannot decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadSample {
    #[default]
    Stop,
    Skip,
}

/// Augmentation of training images; evaluation only normalises. Each
/// sample's crop and flip are drawn from `(data.seed, epoch, sample)`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AugmentSection {
    /// Random crop of the image's size after zero padding of this many pixels.
    pub pad: usize,
    /// Random left-right flip.
    pub hflip: bool,
    /// Per-channel mean to subtract (values in 0..1); empty: none.
    pub mean: Vec<f32>,
    /// Per-channel standard deviation to divide by; empty: none.
    pub std: Vec<f32>,
}

impl AugmentSection {
    /// One standard deviation per mean, all finite, deviations above 0.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.mean.is_empty() && !self.std.is_empty() && self.mean.len() != self.std.len() {
            return Err(invalid(
                "data.augment.std",
                "must have as many values as data.augment.mean (one per channel)",
            ));
        }
        if self.std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(invalid(
                "data.augment.std",
                "values must be finite and above 0",
            ));
        }
        if self.mean.iter().any(|m| !m.is_finite()) {
            return Err(invalid("data.augment.mean", "values must be finite"));
        }
        Ok(())
    }
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            url: "file://data/synthetic".into(),
            batch_size: 64,
            seed: 42,
            prefetch_batches: 4,
            partition: Partition::Reshuffle,
            decode_threads: 2,
            on_bad_sample: OnBadSample::Stop,
            augment: AugmentSection::default(),
            balance: Balance::Equal,
            balance_every: 20,
        }
    }
}

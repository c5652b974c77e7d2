//! Classification datasets stored in object-storage buckets.
//!
//! A dataset lives under a prefix of a bucket as `manifest.json` plus data
//! objects in one of two [`Layout`]s, chosen when the set is written and
//! recorded in the manifest:
//!
//! * `shards` (`format: 1`): shard objects `train/shard-00000.bin`,
//!   `test/shard-00000.bin`, ... Each shard is a run of fixed-size records,
//!   `label: u32 LE` followed by `features: [f32 LE; features]`, so record `i`
//!   of a shard sits at byte `i * record_bytes` and any set of samples can be
//!   read with range GETs (adjacent records merged into one range).
//! * `per_sample` (`format: 2`): one object per sample holding exactly one
//!   record, `train/00000123.bin` (like a folder of images): the small-object
//!   case, one GET per sample.
//!
//! Manifests written before the layout field existed read as `shards`.
//! Writers record a CRC-32 of every record (of every image, for the image
//! layouts) in the manifest, and the reader checks each record it reads
//! against it; manifests written before checksums read unchecked.
//!
//! This crate also builds datasets: a learnable [`synthetic`] task and
//! [`write_dataset`] to put it into a bucket; with the `tools` feature (on by
//! default; the training worker turns it off) also MNIST from CSV or IDX
//! files, the importers of CSV, NumPy, Parquet and text, and the image-set
//! writer and indexer. [`DatasetReader`] reads
//! samples back by global index for training, and [`open_bucket`] turns a
//! bucket URL (`file://`, a plain path, `memory://`, `s3://`) into a store.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use ps_dataset::{open_bucket, synthetic, write_dataset, DatasetReader, Split, SyntheticSpec};
//!
//! let spec = SyntheticSpec { train: 100, test: 20, features: 8, classes: 3, ..SyntheticSpec::default() };
//! let (train, test) = synthetic(&spec);
//! let (store, prefix) = open_bucket("memory://datasets/toy").unwrap();
//! write_dataset(store.as_ref(), &prefix, "toy", 8, 3, &train, &test, 32).await.unwrap();
//!
//! let reader = DatasetReader::open(store, prefix).await.unwrap();
//! let batch = reader.fetch_batch(Split::Train, &[5, 1, 99]).await.unwrap();
//! assert_eq!((batch.len(), batch.dim), (3, 8));
//! assert_eq!(batch.labels[0], train[5].label);
//! assert_eq!(reader.fetch_all(Split::Test).await.unwrap().len(), 20);
//! # });
//! ```

mod format;
pub mod image;
#[cfg(feature = "tools")]
mod imageset;
#[cfg(feature = "tools")]
mod import;
#[cfg(feature = "tools")]
mod index;
#[cfg(feature = "tools")]
mod mnist;
mod plan;
mod read;
mod synthetic;
#[cfg(feature = "tools")]
mod text;
#[cfg(feature = "tools")]
pub mod webdataset;
mod write;

pub use format::*;
#[cfg(feature = "tools")]
pub use imageset::*;
#[cfg(feature = "tools")]
pub use import::*;
#[cfg(feature = "tools")]
pub use index::*;
#[cfg(feature = "tools")]
pub use mnist::*;
pub use plan::*;
pub use ps_shared::bucket::{open_bucket, BucketError};
pub use read::*;
pub use synthetic::*;
#[cfg(feature = "tools")]
pub use text::*;
pub use write::*;

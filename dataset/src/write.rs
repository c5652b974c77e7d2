use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, PutOptions, PutPayload};

use crate::format::*;

// Writing

fn check_samples(
    split: Split,
    samples: &[Sample],
    features: usize,
    classes: usize,
) -> Result<(), DatasetError> {
    for (i, s) in samples.iter().enumerate() {
        if s.features.len() != features {
            return Err(DatasetError::Invalid(format!(
                "{split} sample {i} has {} features, expected {features}",
                s.features.len()
            )));
        }
        if s.label as usize >= classes {
            return Err(DatasetError::Invalid(format!(
                "{split} sample {i} has label {} but there are {classes} classes",
                s.label
            )));
        }
        if let Some(j) = s.features.iter().position(|v| !v.is_finite()) {
            return Err(DatasetError::Invalid(format!(
                "{split} sample {i} feature {j} is not finite"
            )));
        }
    }
    Ok(())
}

fn encode_records(samples: &[Sample], record_bytes: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(samples.len() * record_bytes);
    for s in samples {
        buf.extend_from_slice(&s.label.to_le_bytes());
        for v in &s.features {
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
    buf
}

/// How [`write_dataset_with`] lays a dataset out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    pub layout: Layout,
    /// Records per shard object (shard layout only; must be >= 1).
    pub records_per_shard: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            layout: Layout::Shards,
            records_per_shard: 1024,
        }
    }
}

/// Writes a dataset under `prefix` in the shard layout: the shards of both
/// splits (`records_per_shard` records each, the last one shorter), then the
/// manifest last, so a reader never sees a manifest whose shards are missing.
/// Checks that every sample has `features` finite features and a label below
/// `classes` before writing anything. Returns the manifest written.
#[allow(clippy::too_many_arguments)]
pub async fn write_dataset(
    store: &dyn ObjectStore,
    prefix: &Path,
    name: &str,
    features: usize,
    classes: usize,
    train: &[Sample],
    test: &[Sample],
    records_per_shard: usize,
) -> Result<Manifest, DatasetError> {
    let options = WriteOptions {
        layout: Layout::Shards,
        records_per_shard,
    };
    write_dataset_with(
        store, prefix, name, features, classes, train, test, &options,
    )
    .await
}

/// Like [`write_dataset`], in the layout `options` names: shard objects, or
/// one object per sample (`train/00000123.bin`). The manifest is written last.
#[allow(clippy::too_many_arguments)]
pub async fn write_dataset_with(
    store: &dyn ObjectStore,
    prefix: &Path,
    name: &str,
    features: usize,
    classes: usize,
    train: &[Sample],
    test: &[Sample],
    options: &WriteOptions,
) -> Result<Manifest, DatasetError> {
    let records_per_shard = match options.layout {
        Layout::Shards => options.records_per_shard,
        Layout::PerSample => 1,
        Layout::WebDataset | Layout::ClassFolders => {
            return Err(DatasetError::Invalid(format!(
                "the record writer does not write the {} layout; images are packed with `ps-worker dataset images`",
                options.layout
            )))
        }
    };
    if features == 0 {
        return Err(DatasetError::Invalid("features must be at least 1".into()));
    }
    if classes == 0 || u32::try_from(classes).is_err() {
        return Err(DatasetError::Invalid(format!(
            "classes must be in 1..=u32::MAX, got {classes}"
        )));
    }
    if records_per_shard == 0 {
        return Err(DatasetError::Invalid(
            "records_per_shard must be at least 1".into(),
        ));
    }
    let record_bytes = record_bytes(features)
        .ok_or_else(|| DatasetError::Invalid(format!("{features} features do not fit a record")))?;
    check_samples(Split::Train, train, features, classes)?;
    check_samples(Split::Test, test, features, classes)?;

    let mut infos = Vec::with_capacity(2);
    let mut uploads = Vec::new();
    for (split, samples) in [(Split::Train, train), (Split::Test, test)] {
        let mut shards = Vec::new();
        for (k, chunk) in samples.chunks(records_per_shard).enumerate() {
            if options.layout == Layout::PerSample {
                let rel = sample_object_path(split, k);
                uploads.push((join(prefix, &Path::from(rel.as_str())), chunk));
                continue;
            }
            let rel = format!("{}/shard-{k:05}.bin", split.name());
            let object = join(prefix, &Path::from(rel.as_str()));
            shards.push(ShardInfo {
                path: rel,
                first: k * records_per_shard,
                count: chunk.len(),
            });
            uploads.push((object, chunk));
        }
        infos.push(SplitInfo {
            num_samples: samples.len(),
            shards,
        });
    }

    // Boxed up front (rather than built in a stream closure) so the
    // future of this function is provably `Send`.
    let puts: Vec<BoxFuture<'_, Result<(), object_store::Error>>> = uploads
        .into_iter()
        .map(|(object, chunk)| {
            async move {
                let payload = PutPayload::from(encode_records(chunk, record_bytes));
                store
                    .put_opts(&object, payload, PutOptions::default())
                    .await
                    .map(|_| ())
            }
            .boxed()
        })
        .collect();
    let concurrency = match options.layout {
        Layout::Shards => MAX_CONCURRENT_SHARD_WRITES,
        _ => MAX_CONCURRENT_SAMPLE_WRITES,
    };
    futures::stream::iter(puts)
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;

    let test_info = infos.pop().unwrap_or(SplitInfo {
        num_samples: 0,
        shards: Vec::new(),
    });
    let train_info = infos.pop().unwrap_or(SplitInfo {
        num_samples: 0,
        shards: Vec::new(),
    });
    let manifest = Manifest {
        format: options.layout.format(),
        layout: options.layout,
        name: name.to_string(),
        features,
        classes,
        record_bytes,
        train: train_info,
        test: test_info,
        images: None,
    };
    manifest.validate()?;
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| DatasetError::Manifest(format!("cannot encode: {e}")))?;
    store
        .put_opts(
            &prefix.clone().join(MANIFEST_NAME),
            PutPayload::from(json),
            PutOptions::default(),
        )
        .await?;
    tracing::debug!(
        dataset = name,
        layout = %options.layout,
        %prefix,
        train = train.len(),
        test = test.len(),
        "wrote dataset"
    );
    Ok(manifest)
}

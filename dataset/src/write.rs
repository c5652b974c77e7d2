use std::path::PathBuf;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutOptions, PutPayload};

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

fn encode_record(buf: &mut Vec<u8>, label: u32, features: &[f32], ty: FeatureType) {
    buf.extend_from_slice(&label.to_le_bytes());
    ty.encode(buf, features);
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
/// `classes` before writing anything. Returns the manifest written. On an
/// error every object already written is deleted again.
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
/// A thin wrapper around [`DatasetWriter`] for samples already in memory.
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
    let mut writer = DatasetWriter::create(store, prefix, name, features, classes, options)?;
    check_samples(Split::Train, train, features, classes)?;
    check_samples(Split::Test, test, features, classes)?;
    for (split, samples) in [(Split::Train, train), (Split::Test, test)] {
        for s in samples {
            writer.push(split, s.label, &s.features).await?;
        }
    }
    Ok(writer.finish().await?.manifest)
}

/// What [`DatasetWriter::finish`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteReport {
    /// The manifest, written after every data object.
    pub manifest: Manifest,
    /// Data objects written (shards or per-sample objects), not counting the manifest.
    pub objects: usize,
    /// Bytes of all objects written, the manifest included.
    pub bytes: u64,
}

/// Records of one split not yet in an object, and the shards already cut.
#[derive(Debug, Default)]
struct SplitState {
    buf: Vec<u8>,
    buffered: usize,
    samples: usize,
    shards: Vec<ShardInfo>,
    /// CRC-32 of every record pushed, in order.
    crc32: Vec<u32>,
}

type Upload<'a> = BoxFuture<'a, Result<(), object_store::Error>>;

/// Writes a dataset one sample at a time, for inputs that do not fit in
/// memory. The CRC-32 of every record goes into the manifest (`crc32` of
/// each split), so that readers can check every record they read.
///
/// Memory stays bounded: one shard buffer per split, plus at most 8 shards
/// (or 32 per-sample objects) being uploaded. Shard objects are written as they
/// fill, the manifest strictly last by [`finish`](Self::finish), so a reader
/// never sees a partial dataset. When `push` or `finish` fails, or on
/// [`abort`](Self::abort), every object this writer wrote is deleted again
/// (and, if [`remove_dir_if_empty`](Self::remove_dir_if_empty) named one,
/// the local output directory when nothing else is left in it). A writer
/// dropped without either leaves its data objects, but no manifest.
pub struct DatasetWriter<'a> {
    store: &'a dyn ObjectStore,
    prefix: Path,
    name: String,
    features: usize,
    classes: usize,
    record_bytes: usize,
    feature_type: FeatureType,
    options: WriteOptions,
    normalization: Option<Normalization>,
    text: Option<TextInfo>,
    splits: [SplitState; 2],
    in_flight: FuturesUnordered<Upload<'a>>,
    max_in_flight: usize,
    /// Every object a put was started for, so a failure can delete it.
    written: Vec<Path>,
    bytes: u64,
    local_dir: Option<PathBuf>,
    failed: bool,
}

impl<'a> DatasetWriter<'a> {
    /// A writer for a dataset of `features` features and labels in
    /// `0..classes` under `prefix`. Writes nothing yet.
    pub fn create(
        store: &'a dyn ObjectStore,
        prefix: &Path,
        name: &str,
        features: usize,
        classes: usize,
        options: &WriteOptions,
    ) -> Result<Self, DatasetError> {
        if options.layout.is_images() {
            return Err(DatasetError::Invalid(format!(
                "the record writer does not write the {} layout; images are packed with `ps-data images`",
                options.layout
            )));
        }
        if features == 0 {
            return Err(DatasetError::Invalid("features must be at least 1".into()));
        }
        if classes == 0 || u32::try_from(classes).is_err() {
            return Err(DatasetError::Invalid(format!(
                "classes must be in 1..=u32::MAX, got {classes}"
            )));
        }
        if options.layout == Layout::Shards && options.records_per_shard == 0 {
            return Err(DatasetError::Invalid(
                "records_per_shard must be at least 1".into(),
            ));
        }
        let record_bytes = record_bytes(features, FeatureType::F32).ok_or_else(|| {
            DatasetError::Invalid(format!("{features} features do not fit a record"))
        })?;
        if options.layout == Layout::Shards
            && options
                .records_per_shard
                .checked_mul(record_bytes)
                .is_none()
        {
            return Err(DatasetError::Invalid(format!(
                "{} records of {record_bytes} bytes do not fit a shard",
                options.records_per_shard
            )));
        }
        let max_in_flight = match options.layout {
            Layout::Shards => MAX_CONCURRENT_SHARD_WRITES,
            _ => MAX_CONCURRENT_SAMPLE_WRITES,
        };
        Ok(Self {
            store,
            prefix: prefix.clone(),
            name: name.to_string(),
            features,
            classes,
            record_bytes,
            feature_type: FeatureType::F32,
            options: *options,
            normalization: None,
            text: None,
            splits: Default::default(),
            in_flight: FuturesUnordered::new(),
            max_in_flight,
            written: Vec::new(),
            bytes: 0,
            local_dir: None,
            failed: false,
        })
    }

    /// Records a feature transform in the manifest (the features pushed are
    /// expected to be transformed already).
    pub fn set_normalization(&mut self, normalization: Option<Normalization>) {
        self.normalization = normalization;
    }

    /// Stores each feature as `ty` (f32 unless set): integer types take
    /// whole numbers in their range only, checked on every push. Set it
    /// before the first push.
    pub fn set_feature_type(&mut self, ty: FeatureType) -> Result<(), DatasetError> {
        if self.splits.iter().any(|s| s.samples > 0) {
            return Err(DatasetError::Invalid(
                "the feature type must be set before the first sample".into(),
            ));
        }
        self.record_bytes = record_bytes(self.features, ty).ok_or_else(|| {
            DatasetError::Invalid(format!("{} features do not fit a record", self.features))
        })?;
        self.feature_type = ty;
        Ok(())
    }

    /// Records how a text dataset was tokenized in the manifest.
    pub fn set_text(&mut self, text: Option<TextInfo>) {
        self.text = text;
    }

    /// On failure, also remove the local directory `dir` (the bucket's
    /// root) and its `train`/`test` folders if they are empty once the
    /// objects are deleted. Only empty directories are ever removed.
    pub fn remove_dir_if_empty(&mut self, dir: PathBuf) {
        self.local_dir = Some(dir);
    }

    /// Samples pushed so far to a split.
    pub fn samples(&self, split: Split) -> usize {
        self.splits[split.index()].samples
    }

    /// Appends one sample to a split. Checks its width, its label and that
    /// every feature is finite; on any error (or a failed upload) the objects
    /// written so far are deleted and the writer is unusable.
    pub async fn push(
        &mut self,
        split: Split,
        label: u32,
        features: &[f32],
    ) -> Result<(), DatasetError> {
        if self.failed {
            return Err(DatasetError::Invalid(
                "the dataset writer already failed".into(),
            ));
        }
        let index = self.splits[split.index()].samples;
        let problem = if features.len() != self.features {
            Some(format!(
                "{split} sample {index} has {} features, expected {}",
                features.len(),
                self.features
            ))
        } else if label as usize >= self.classes {
            Some(format!(
                "{split} sample {index} has label {label} but there are {} classes",
                self.classes
            ))
        } else {
            let ty = self.feature_type;
            features.iter().position(|&v| !ty.holds(v)).map(|j| {
                if ty == FeatureType::F32 {
                    format!("{split} sample {index} feature {j} is not finite")
                } else {
                    format!(
                        "{split} sample {index} feature {j} is {}, which {ty} does not hold",
                        features[j]
                    )
                }
            })
        };
        if let Some(message) = problem {
            return Err(self.fail(DatasetError::Invalid(message)).await);
        }
        let state = &mut self.splits[split.index()];
        let start = state.buf.len();
        encode_record(&mut state.buf, label, features, self.feature_type);
        state.crc32.push(crc32(&state.buf[start..]));
        state.buffered += 1;
        state.samples += 1;
        let full = match self.options.layout {
            Layout::Shards => state.buffered >= self.options.records_per_shard,
            _ => true,
        };
        if full {
            if let Err(e) = self.flush(split).await {
                return Err(self.fail(e).await);
            }
        }
        Ok(())
    }

    /// Writes what is left in the buffers, waits for every upload, then
    /// writes the manifest. On an error the objects are deleted again.
    pub async fn finish(mut self) -> Result<WriteReport, DatasetError> {
        if self.failed {
            return Err(DatasetError::Invalid(
                "the dataset writer already failed".into(),
            ));
        }
        match self.finish_inner().await {
            Ok(report) => Ok(report),
            Err(e) => Err(self.fail(e).await),
        }
    }

    /// Stops writing and deletes every object written so far.
    pub async fn abort(mut self) {
        self.cleanup().await;
    }

    async fn finish_inner(&mut self) -> Result<WriteReport, DatasetError> {
        for split in Split::ALL {
            if self.splits[split.index()].buffered > 0 {
                self.flush(split).await?;
            }
        }
        while let Some(result) = self.in_flight.next().await {
            result?;
        }
        let [train, test] = Split::ALL.map(|split| {
            let state = &mut self.splits[split.index()];
            SplitInfo {
                num_samples: state.samples,
                shards: std::mem::take(&mut state.shards),
                crc32: std::mem::take(&mut state.crc32),
            }
        });
        let manifest = Manifest {
            format: self.options.layout.format(),
            layout: self.options.layout,
            name: self.name.clone(),
            features: self.features,
            classes: self.classes,
            record_bytes: self.record_bytes,
            feature_type: self.feature_type,
            train,
            test,
            normalization: self.normalization.clone(),
            images: None,
            text: self.text.clone(),
        };
        manifest.validate()?;
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| DatasetError::Manifest(format!("cannot encode: {e}")))?;
        let object = self.prefix.clone().join(MANIFEST_NAME);
        let len = json.len() as u64;
        self.written.push(object.clone());
        self.store
            .put_opts(&object, PutPayload::from(json), PutOptions::default())
            .await?;
        self.bytes += len;
        let objects = self.written.len() - 1;
        tracing::debug!(
            dataset = %self.name,
            layout = %self.options.layout,
            prefix = %self.prefix,
            train = manifest.train.num_samples,
            test = manifest.test.num_samples,
            "wrote dataset"
        );
        Ok(WriteReport {
            manifest,
            objects,
            bytes: self.bytes,
        })
    }

    /// Starts the upload of the split's buffered records as one object,
    /// first waiting for a slot when too many uploads are running.
    async fn flush(&mut self, split: Split) -> Result<(), DatasetError> {
        while self.in_flight.len() >= self.max_in_flight {
            if let Some(result) = self.in_flight.next().await {
                result?;
            }
        }
        let state = &mut self.splits[split.index()];
        let count = std::mem::take(&mut state.buffered);
        let first = state.samples - count;
        let rel = match self.options.layout {
            Layout::Shards => {
                let rel = format!("{}/shard-{:05}.bin", split.name(), state.shards.len());
                state.shards.push(ShardInfo {
                    path: rel.clone(),
                    first,
                    count,
                });
                rel
            }
            _ => sample_object_path(split, first),
        };
        let capacity = match self.options.layout {
            Layout::Shards => self.options.records_per_shard * self.record_bytes,
            _ => self.record_bytes,
        };
        let bytes = std::mem::replace(&mut state.buf, Vec::with_capacity(capacity));
        self.bytes += bytes.len() as u64;
        let object = join(&self.prefix, &Path::from(rel.as_str()));
        self.written.push(object.clone());
        let store = self.store;
        self.in_flight.push(
            async move {
                store
                    .put_opts(&object, PutPayload::from(bytes), PutOptions::default())
                    .await
                    .map(|_| ())
            }
            .boxed(),
        );
        // Poll once so the new upload starts now, and collect any finished.
        while let Some(Some(result)) = self.in_flight.next().now_or_never() {
            result?;
        }
        Ok(())
    }

    async fn fail(&mut self, error: DatasetError) -> DatasetError {
        self.cleanup().await;
        error
    }

    /// Waits for running uploads, deletes every object written and the
    /// empty local folders.
    async fn cleanup(&mut self) {
        self.failed = true;
        while self.in_flight.next().await.is_some() {}
        let written = std::mem::take(&mut self.written);
        let mut results = self
            .store
            .delete_stream(futures::stream::iter(written.into_iter().map(Ok)).boxed());
        while let Some(result) = results.next().await {
            match result {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => tracing::warn!(error = %e, "could not delete a partly written object"),
            }
        }
        drop(results);
        for split in Split::ALL {
            self.splits[split.index()] = SplitState::default();
        }
        if let Some(dir) = self.local_dir.take() {
            remove_empty_output_dir(&dir, true);
        }
    }
}

/// Makes room for a new dataset at `prefix`: an existing one (its
/// manifest) is refused unless `overwrite`, and then its manifest is
/// deleted before anything new is written.
pub async fn clear_existing(
    store: &dyn ObjectStore,
    prefix: &Path,
    overwrite: bool,
) -> Result<(), DatasetError> {
    let manifest_path = prefix.clone().join(MANIFEST_NAME);
    match store.head(&manifest_path).await {
        Ok(_) if !overwrite => Err(DatasetError::Invalid(format!(
            "the output already holds a dataset (object {manifest_path} exists); write to another place or pass --overwrite"
        ))),
        Ok(_) => Ok(store.delete(&manifest_path).await?),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes the `train` and `test` folders of a local dataset directory if
/// they are empty, then `dir` itself if `remove_root` and it is empty too.
/// Never removes a file or a non-empty directory.
pub fn remove_empty_output_dir(dir: &std::path::Path, remove_root: bool) {
    for split in Split::ALL {
        let _ = std::fs::remove_dir(dir.join(split.name()));
    }
    if remove_root {
        let _ = std::fs::remove_dir(dir);
    }
}

/// The local directory a bucket URL names (`file://...` or a plain path,
/// made absolute against the current directory), or `None` for other
/// stores. Use it to learn whether an output directory exists before
/// [`open_bucket`](crate::open_bucket) creates it.
pub fn local_output_dir(url: &str) -> Option<PathBuf> {
    let url = url.trim();
    let dir = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("file") => {
            let rest = rest.strip_prefix("localhost").unwrap_or(rest);
            PathBuf::from(rest)
        }
        Some(_) => return None,
        None if url.is_empty() => return None,
        None => PathBuf::from(url),
    };
    if dir.is_absolute() {
        Some(dir)
    } else {
        std::env::current_dir().ok().map(|cwd| cwd.join(dir))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::TryStreamExt;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;

    use super::*;

    async fn listed(store: &dyn ObjectStore) -> Vec<String> {
        let list: Vec<_> = store.list(None).try_collect().await.unwrap();
        let mut names: Vec<String> = list.into_iter().map(|m| m.location.to_string()).collect();
        names.sort();
        names
    }

    fn options(layout: Layout, records_per_shard: usize) -> WriteOptions {
        WriteOptions {
            layout,
            records_per_shard,
        }
    }

    #[tokio::test]
    async fn an_existing_dataset_is_named_by_its_manifest_object() {
        for (prefix, object) in [("", "manifest.json"), ("runs/d", "runs/d/manifest.json")] {
            let store = InMemory::new();
            let prefix = Path::from(prefix);
            store
                .put(&prefix.clone().join(MANIFEST_NAME), "{}".into())
                .await
                .unwrap();
            let err = clear_existing(&store, &prefix, false)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("object {object} exists")) && !err.contains("''"),
                "{err}"
            );
            clear_existing(&store, &prefix, true).await.unwrap();
            assert!(listed(&store).await.is_empty());
        }
    }

    #[tokio::test]
    async fn streaming_writer_matches_the_in_memory_writer() {
        let samples: Vec<Sample> = (0..23)
            .map(|i| Sample {
                label: i % 3,
                features: vec![i as f32, -(i as f32)],
            })
            .collect();
        for layout in [Layout::Shards, Layout::PerSample] {
            let a = InMemory::new();
            let b = InMemory::new();
            let prefix = Path::from("d");
            let opts = options(layout, 5);
            let m1 = write_dataset_with(
                &a,
                &prefix,
                "s",
                2,
                3,
                &samples[..17],
                &samples[17..],
                &opts,
            )
            .await
            .unwrap();
            let mut w = DatasetWriter::create(&b, &prefix, "s", 2, 3, &opts).unwrap();
            // Interleaved splits: each keeps its own buffer.
            for (i, s) in samples.iter().enumerate() {
                let split = if i >= 17 { Split::Test } else { Split::Train };
                w.push(split, s.label, &s.features).await.unwrap();
            }
            assert_eq!(w.samples(Split::Train), 17);
            let report = w.finish().await.unwrap();
            assert_eq!(report.manifest, m1);
            let names = listed(&a).await;
            assert_eq!(names, listed(&b).await);
            assert_eq!(report.objects, names.len() - 1);
            for name in names {
                let p = Path::from(name.as_str());
                let x = a.get(&p).await.unwrap().bytes().await.unwrap();
                let y = b.get(&p).await.unwrap().bytes().await.unwrap();
                assert_eq!(x, y, "{name}");
            }
            if layout == Layout::Shards {
                assert_eq!(m1.train.shards.len(), 4);
                assert_eq!(m1.train.shards[3].count, 2);
                assert_eq!(
                    report.bytes,
                    23 * 12
                        + a.head(&prefix.clone().join(MANIFEST_NAME))
                            .await
                            .unwrap()
                            .size
                );
            }
        }
    }

    #[tokio::test]
    async fn a_failed_push_or_an_abort_deletes_everything() {
        for layout in [Layout::Shards, Layout::PerSample] {
            let store = InMemory::new();
            let prefix = Path::from("ds");
            let mut w =
                DatasetWriter::create(&store, &prefix, "x", 1, 2, &options(layout, 2)).unwrap();
            for i in 0..9 {
                w.push(Split::Train, i % 2, &[i as f32]).await.unwrap();
            }
            assert!(!listed(&store).await.is_empty());
            let err = w.push(Split::Test, 0, &[f32::NAN]).await.unwrap_err();
            assert!(err.to_string().contains("not finite"), "{err}");
            assert!(listed(&store).await.is_empty());
            assert!(w.push(Split::Train, 0, &[1.0]).await.is_err());
            assert!(w.finish().await.is_err());

            let mut w =
                DatasetWriter::create(&store, &prefix, "x", 1, 2, &options(layout, 2)).unwrap();
            for i in 0..5 {
                w.push(Split::Test, 1, &[i as f32]).await.unwrap();
            }
            let err = w.push(Split::Train, 2, &[0.0]).await.unwrap_err();
            assert!(err.to_string().contains("label 2"), "{err}");
            assert!(listed(&store).await.is_empty());

            let mut w =
                DatasetWriter::create(&store, &prefix, "x", 1, 2, &options(layout, 2)).unwrap();
            for i in 0..5 {
                w.push(Split::Train, 1, &[i as f32]).await.unwrap();
            }
            w.abort().await;
            assert!(listed(&store).await.is_empty());
        }
    }

    #[tokio::test]
    async fn cleanup_removes_a_local_directory_it_emptied() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let url = dir.to_str().unwrap().to_string();
        assert_eq!(local_output_dir(&url), Some(dir.clone()));
        assert_eq!(
            local_output_dir(&format!("file://{url}")),
            Some(dir.clone())
        );
        assert_eq!(local_output_dir("s3://b/p"), None);
        let (store, prefix) = crate::open_bucket(&url).unwrap();
        let store: Arc<dyn ObjectStore> = store;
        let mut w = DatasetWriter::create(
            store.as_ref(),
            &prefix,
            "x",
            1,
            2,
            &options(Layout::Shards, 1),
        )
        .unwrap();
        w.remove_dir_if_empty(dir.clone());
        // More one-record shards than uploads in flight: some have landed.
        for i in 0..20 {
            w.push(Split::Train, 0, &[i as f32]).await.unwrap();
        }
        w.push(Split::Test, 0, &[1.0]).await.unwrap();
        assert!(std::fs::read_dir(dir.join("train")).unwrap().count() > 0);
        w.abort().await;
        assert!(!dir.exists());

        // A directory holding something else stays, with that file.
        let (store, prefix) = crate::open_bucket(&url).unwrap();
        std::fs::write(dir.join("keep.txt"), "x").unwrap();
        let mut w = DatasetWriter::create(
            store.as_ref(),
            &prefix,
            "x",
            1,
            2,
            &options(Layout::Shards, 1),
        )
        .unwrap();
        w.remove_dir_if_empty(dir.clone());
        w.push(Split::Train, 0, &[1.0]).await.unwrap();
        let _ = w.push(Split::Train, 0, &[f32::INFINITY]).await;
        assert!(dir.join("keep.txt").exists());
        assert!(!dir.join("train").exists());
    }
}

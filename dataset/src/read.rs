use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore};

use crate::format::*;
use crate::image::{augment_in_place, decode_image, sample_rng, Augment, ImagePipeline};
use crate::plan::{ReadPlanner, RecordRequest};

struct ReaderInner {
    store: Arc<dyn ObjectStore>,
    planner: ReadPlanner,
    /// Image layouts: how images are decoded and augmented.
    images: Option<ImagePipeline>,
    /// CRC-32 and length of the manifest's bytes as read.
    manifest_sum: (u32, u64),
}

/// A batch decoded from records, with what decoding cost.
#[derive(Debug, Clone, Default)]
pub struct DecodedBatch {
    pub batch: Batch,
    /// Images decoded (0 for feature records).
    pub decoded: usize,
    /// Seconds the decode threads spent, summed over threads.
    pub decode_s: f64,
    /// Samples left out because they could not be decoded, with the reason.
    pub skipped: Vec<String>,
}

/// Reads records by global index with range GETs. Cheap to clone.
#[derive(Clone)]
pub struct DatasetReader {
    inner: Arc<ReaderInner>,
}

impl fmt::Debug for DatasetReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatasetReader")
            .field("store", &self.inner.store.to_string())
            .field("prefix", &self.inner.planner.prefix)
            .field("name", &self.inner.planner.manifest.name)
            .finish()
    }
}

/// The record runs to read from one shard.
struct ShardPlan {
    shard: usize,
    /// Sorted, disjoint, non-adjacent runs of local record indices.
    runs: Vec<Range<usize>>,
}

/// The records of one shard that were read, as one buffer per run.
struct ShardData {
    runs: Vec<Range<usize>>,
    buffers: Vec<Bytes>,
}

impl DatasetReader {
    /// Reads and validates `manifest.json` under `prefix`.
    pub async fn open(store: Arc<dyn ObjectStore>, prefix: Path) -> Result<Self, DatasetError> {
        let manifest_path = prefix.clone().join(MANIFEST_NAME);
        let bytes = match store.get_opts(&manifest_path, GetOptions::default()).await {
            Ok(result) => result.bytes().await?,
            Err(e) if ps_shared::bucket::is_missing_bucket(&e) => {
                return Err(DatasetError::BucketMissing {
                    store: store.to_string(),
                    object: manifest_path.to_string(),
                    source: e,
                })
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(DatasetError::NotFound {
                    prefix: prefix.to_string(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        let manifest_sum = (crc32(&bytes), bytes.len() as u64);
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| DatasetError::Manifest(format!("{manifest_path}: {e}")))?;
        let planner = ReadPlanner::new(manifest, prefix)?;
        let images = if planner.manifest.layout.is_images() {
            Some(
                ImagePipeline::new(Augment::default(), 0, 1, false)
                    .map_err(DatasetError::Invalid)?,
            )
        } else {
            None
        };
        Ok(Self {
            inner: Arc::new(ReaderInner {
                store,
                planner,
                images,
                manifest_sum,
            }),
        })
    }

    /// Image layouts: decode and augment with `pipeline` (the default
    /// decodes on one thread without augmentation). No effect on feature
    /// records.
    pub fn with_image_pipeline(self, pipeline: ImagePipeline) -> Result<Self, DatasetError> {
        if !self.layout().is_images() {
            return Ok(self);
        }
        let shape = self.image_shape().unwrap_or([1, 1, 1]);
        pipeline
            .augment
            .check(shape[0])
            .map_err(|m| DatasetError::Invalid(format!("image normalisation: {m}")))?;
        Ok(Self {
            inner: Arc::new(ReaderInner {
                store: self.inner.store.clone(),
                planner: self.inner.planner.clone(),
                images: Some(pipeline),
                manifest_sum: self.inner.manifest_sum,
            }),
        })
    }

    /// `[channels, height, width]` of a decoded image, for image layouts.
    pub fn image_shape(&self) -> Option<[usize; 3]> {
        self.inner.planner.manifest.images.as_ref().map(|i| i.shape)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.inner.planner.manifest
    }

    /// The prefix the dataset was opened at.
    pub fn prefix(&self) -> &Path {
        &self.inner.planner.prefix
    }

    /// CRC-32 and length of `manifest.json` as it was read: they change
    /// whenever the dataset is rewritten or re-indexed.
    pub fn manifest_checksum(&self) -> (u32, u64) {
        self.inner.manifest_sum
    }

    /// Checks a record of sample `index` (as [`DatasetReader::read_request`]
    /// returns it, e.g. kept in a cache since) against the manifest's
    /// checksum of that sample, when it has one.
    pub fn verify_record(
        &self,
        split: Split,
        index: usize,
        record: &[u8],
    ) -> Result<(), DatasetError> {
        let m = &self.inner.planner.manifest;
        let (expected, bytes) = match &m.images {
            Some(images) => (
                images.entries(split).get(index).and_then(|e| e.crc32),
                record.get(LABEL_BYTES..).unwrap_or_default(),
            ),
            None => (m.split(split).crc32.get(index).copied(), record),
        };
        match checksum_mismatch(split, index, expected, bytes) {
            None => Ok(()),
            Some(message) => Err(DatasetError::Corrupt {
                object: format!("cached copy of {split} sample {index}"),
                message,
                permanent: true,
            }),
        }
    }

    /// The store the dataset is read from.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Samples in a split.
    pub fn len(&self, split: Split) -> usize {
        self.inner.planner.manifest.split(split).num_samples
    }

    /// Whether a split has no samples.
    pub fn is_empty(&self, split: Split) -> bool {
        self.len(split) == 0
    }

    /// How the dataset is cut into objects.
    pub fn layout(&self) -> Layout {
        self.inner.planner.manifest.layout
    }

    /// Bytes of one record (label and features).
    pub fn record_bytes(&self) -> usize {
        self.inner.planner.manifest.record_bytes
    }

    /// The GETs that read `indices` of a split: see [`ReadPlanner::plan`].
    pub fn plan_requests(
        &self,
        split: Split,
        indices: &[usize],
        max_request_bytes: u64,
    ) -> Result<Vec<RecordRequest>, DatasetError> {
        self.inner.planner.plan(split, indices, max_request_bytes)
    }

    /// Issues one request and returns its records in index order, each checked
    /// for length, checksum (when the manifest has them) and label. A
    /// missing object, a short body, a checksum mismatch or a bad label is
    /// [`DatasetError::Corrupt`] naming the object; a store failure is
    /// [`DatasetError::Store`].
    /// Bytes a whole-object request must find in its object.
    fn whole_object_len(&self, req: &RecordRequest) -> u64 {
        match &self.inner.planner.manifest.images {
            Some(index) => index.entries(req.split).get(req.first).map_or(0, |e| e.len),
            None => {
                req.count
                    .saturating_mul(self.inner.planner.manifest.record_bytes) as u64
            }
        }
    }

    pub async fn read_request(&self, req: &RecordRequest) -> Result<Vec<Bytes>, DatasetError> {
        let m = &self.inner.planner.manifest;
        let rb = m.record_bytes;
        let corrupt = |message: String| DatasetError::Corrupt {
            object: req.object.to_string(),
            message,
            permanent: false,
        };
        let damaged = |message: String| DatasetError::Corrupt {
            object: req.object.to_string(),
            message,
            permanent: true,
        };
        let mut options = GetOptions::new();
        if let Some(range) = &req.range {
            options = options.with_range(Some(range.clone()));
        }
        let body = match self.inner.store.get_opts(&req.object, options).await {
            Ok(result) => {
                // The object's own size tells a truncated object (permanent)
                // from a body cut short on the way (worth another try).
                let size = result.meta.size;
                let needed = match &req.range {
                    Some(r) => r.end,
                    None => self.whole_object_len(req),
                };
                if size < needed {
                    return Err(damaged(format!(
                        "the object is {size} bytes, the manifest needs {needed} (truncated?)"
                    )));
                }
                result.bytes().await?
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(damaged(
                    "the object listed in the manifest is missing".into(),
                ))
            }
            Err(e) if ps_shared::bucket::is_range_not_satisfiable(&e) => {
                return Err(damaged(format!(
                    "the object is shorter than the manifest says (truncated?): {e}"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(index) = &m.images {
            let e = &index.entries(req.split)[req.first];
            if body.len() as u64 != e.len {
                return Err(corrupt(format!(
                    "image `{}` came back as {} bytes, the index says {} (object changed or truncated since it was indexed?)",
                    e.key,
                    body.len(),
                    e.len
                )));
            }
            if let Some(why) = checksum_mismatch(req.split, req.first, e.crc32, &body) {
                return Err(damaged(format!("image `{}`: {why}", e.key)));
            }
            let mut record = Vec::with_capacity(LABEL_BYTES + body.len());
            record.extend_from_slice(&e.label.to_le_bytes());
            record.extend_from_slice(&body);
            return Ok(vec![Bytes::from(record)]);
        }
        let want = req.count.saturating_mul(rb);
        if body.len() != want {
            return Err(corrupt(format!(
                "came back as {} bytes, expected {want} ({} records of {rb} bytes; object truncated?)",
                body.len(),
                req.count
            )));
        }
        let sums = &m.split(req.split).crc32;
        let mut out = Vec::with_capacity(req.count);
        for i in 0..req.count {
            let record = body.slice(i * rb..(i + 1) * rb);
            let index = req.first + i;
            if let Some(why) =
                checksum_mismatch(req.split, index, sums.get(index).copied(), &record)
            {
                return Err(damaged(why));
            }
            check_label(&record, m.classes).map_err(|label| {
                damaged(format!(
                    "record {} has label {label}, not below the manifest's {} classes",
                    req.first + i,
                    m.classes
                ))
            })?;
            out.push(record);
        }
        Ok(out)
    }

    /// Turns the records of `indices` (as [`DatasetReader::read_request`]
    /// returns them) into a batch: feature records are copied, images are
    /// decoded on the pipeline's threads and, for the training split,
    /// augmented with the streams of `(seed, epoch, sample)`. Blocks while
    /// decoding: call it off the async runtime.
    pub fn decode_batch(
        &self,
        split: Split,
        epoch: u64,
        indices: &[usize],
        records: &[Bytes],
    ) -> Result<DecodedBatch, DatasetError> {
        let (Some(pipeline), Some(index)) =
            (&self.inner.images, &self.inner.planner.manifest.images)
        else {
            return Ok(DecodedBatch {
                batch: self.batch_from_records(records)?,
                ..DecodedBatch::default()
            });
        };
        if indices.len() != records.len() {
            return Err(DatasetError::Invalid(format!(
                "{} records for {} samples",
                records.len(),
                indices.len()
            )));
        }
        let shape = index.shape;
        let entries = index.entries(split);
        // Training samples get their random crop and flip; evaluation only
        // the normalisation (no generator).
        let train = split == Split::Train;
        let decode_one = |(&sample, record): (&usize, &Bytes)| {
            let started = std::time::Instant::now();
            let e = entries.get(sample).ok_or(DatasetError::IndexOutOfRange {
                index: sample,
                len: entries.len(),
            })?;
            let body = record.get(LABEL_BYTES..).unwrap_or_default();
            let result = decode_image(body, shape).map(|mut chw| {
                let mut rng = train.then(|| sample_rng(pipeline.seed, epoch, sample));
                augment_in_place(&mut chw, shape, &pipeline.augment, rng.as_mut());
                chw
            });
            let outcome = result.map_err(|why| {
                let object = &index.objects[e.object as usize];
                (
                    object.clone(),
                    format!("{split} sample {sample} (`{}`): {why}", e.key),
                )
            });
            Ok::<_, DatasetError>((e.label, outcome, started.elapsed().as_secs_f64()))
        };
        let decoded: Vec<_> = pipeline.pool.install(|| {
            use rayon::prelude::*;
            indices.par_iter().zip(records).map(decode_one).collect()
        });
        let mut out = DecodedBatch {
            batch: Batch::with_capacity(indices.len(), self.inner.planner.manifest.features),
            ..DecodedBatch::default()
        };
        for item in decoded {
            let (label, outcome, secs) = item?;
            out.decode_s += secs;
            out.decoded += 1;
            match outcome {
                Ok(chw) => {
                    out.batch.labels.push(label);
                    out.batch.features.extend_from_slice(&chw);
                }
                Err((object, message)) if pipeline.skip_bad => {
                    out.skipped.push(format!("{object}: {message}"))
                }
                Err((object, message)) => {
                    return Err(DatasetError::Corrupt {
                        permanent: true,
                        object,
                        message: format!(
                        "{message} (set data.on_bad_sample = \"skip\" to leave such samples out)"
                    ),
                    })
                }
            }
        }
        Ok(out)
    }

    /// Image layouts: reads and decodes samples in the order asked, without
    /// augmentation.
    async fn fetch_images(&self, split: Split, indices: &[usize]) -> Result<Batch, DatasetError> {
        let requests = self.plan_requests(split, indices, u64::MAX)?;
        let records: HashMap<usize, Bytes> = futures::stream::iter(requests)
            .map(|req| async move {
                let mut recs = self.read_request(&req).await?;
                Ok::<_, DatasetError>((req.first, recs.pop().unwrap_or_default()))
            })
            .buffer_unordered(MAX_CONCURRENT_SAMPLE_READS)
            .try_collect()
            .await?;
        let ordered: Vec<Bytes> = indices.iter().map(|i| records[i].clone()).collect();
        let this = self.clone();
        let indices = indices.to_vec();
        // Decoding is CPU work: keep it off the async runtime's threads.
        let decoded =
            tokio::task::spawn_blocking(move || this.decode_batch(split, 0, &indices, &ordered))
                .await
                .map_err(|e| DatasetError::Invalid(format!("decode task failed: {e}")))??;
        Ok(decoded.batch)
    }

    /// Packs records (as [`DatasetReader::read_request`] returns them) into a
    /// batch, checking each one's length and label again.
    pub fn batch_from_records(&self, records: &[Bytes]) -> Result<Batch, DatasetError> {
        let m = &self.inner.planner.manifest;
        let mut batch = Batch::with_capacity(records.len(), m.features);
        for (i, r) in records.iter().enumerate() {
            if r.len() != m.record_bytes {
                return Err(DatasetError::Invalid(format!(
                    "record {i} of the batch has {} bytes, expected {}",
                    r.len(),
                    m.record_bytes
                )));
            }
            let label = check_label(r, m.classes).map_err(|label| {
                DatasetError::Invalid(format!(
                    "record {i} of the batch has label {label}, not below {}",
                    m.classes
                ))
            })?;
            batch.labels.push(label);
            m.feature_type
                .decode_into(&r[LABEL_BYTES..], &mut batch.features);
        }
        Ok(batch)
    }

    /// Fetches the given global indices of a split, in the order asked
    /// (duplicates allowed). Issues one `get_ranges` call per shard touched,
    /// with adjacent records merged into one range. A short or corrupt shard
    /// gives [`DatasetError::Corrupt`] naming the object; an index past the
    /// end gives [`DatasetError::IndexOutOfRange`].
    pub async fn fetch(
        &self,
        split: Split,
        indices: &[usize],
    ) -> Result<Vec<Sample>, DatasetError> {
        if self.layout().is_images() {
            let batch = self.fetch_images(split, indices).await?;
            return Ok((0..batch.len())
                .map(|i| Sample {
                    label: batch.labels[i],
                    features: batch.row(i).unwrap_or_default().to_vec(),
                })
                .collect());
        }
        let mut out = Vec::with_capacity(indices.len());
        let m = &self.inner.planner.manifest;
        let (ty, dim) = (m.feature_type, m.features);
        self.fetch_each(split, indices, |label, bytes| {
            let mut features = Vec::with_capacity(dim);
            ty.decode_into(bytes, &mut features);
            out.push(Sample { label, features })
        })
        .await?;
        Ok(out)
    }

    /// Like [`DatasetReader::fetch`], packed into a [`Batch`].
    pub async fn fetch_batch(
        &self,
        split: Split,
        indices: &[usize],
    ) -> Result<Batch, DatasetError> {
        if self.layout().is_images() {
            return self.fetch_images(split, indices).await;
        }
        let m = &self.inner.planner.manifest;
        let ty = m.feature_type;
        let mut batch = Batch::with_capacity(indices.len(), m.features);
        self.fetch_each(split, indices, |label, bytes| {
            batch.labels.push(label);
            ty.decode_into(bytes, &mut batch.features);
        })
        .await?;
        Ok(batch)
    }

    /// The whole split in index order (meant for the small test set).
    pub async fn fetch_all(&self, split: Split) -> Result<Batch, DatasetError> {
        let info = self.inner.planner.manifest.split(split);
        if self.layout() == Layout::PerSample || self.layout().is_images() {
            let all: Vec<usize> = (0..info.num_samples).collect();
            return self.fetch_batch(split, &all).await;
        }
        let plans = info
            .shards
            .iter()
            .enumerate()
            .map(|(k, s)| ShardPlan {
                shard: k,
                runs: std::iter::once(0..s.count).collect(),
            })
            .collect();
        let data = self.read_plans(split, plans).await?;
        let m = &self.inner.planner.manifest;
        let mut batch = Batch::with_capacity(info.num_samples, m.features);
        for (shard, d) in &data {
            let first = info.shards[*shard].first;
            for (run, buf) in d.runs.iter().zip(&d.buffers) {
                for (i, record) in buf.chunks_exact(m.record_bytes).enumerate() {
                    let index = first + run.start + i;
                    let (label, feats) = self.decode_record(split, *shard, index, record)?;
                    batch.labels.push(label);
                    m.feature_type.decode_into(feats, &mut batch.features);
                }
            }
        }
        Ok(batch)
    }

    /// Reads `indices` and hands each record's label and feature bytes to
    /// `sink` in the order asked.
    async fn fetch_each(
        &self,
        split: Split,
        indices: &[usize],
        mut sink: impl FnMut(u32, &[u8]),
    ) -> Result<(), DatasetError> {
        if self.layout() == Layout::PerSample {
            let requests = self.plan_requests(split, indices, u64::MAX)?;
            let records: HashMap<usize, Bytes> = futures::stream::iter(requests)
                .map(|req| async move {
                    let record = self.read_request(&req).await?.into_iter().next();
                    Ok::<_, DatasetError>((req.first, record.unwrap_or_default()))
                })
                .buffer_unordered(MAX_CONCURRENT_SAMPLE_READS)
                .try_collect()
                .await?;
            for &index in indices {
                let record = records.get(&index).ok_or_else(|| {
                    DatasetError::Invalid(format!("{split} sample {index} was not read"))
                })?;
                let label =
                    check_label(record, self.inner.planner.manifest.classes).map_err(|l| {
                        DatasetError::Invalid(format!("{split} sample {index} has label {l}"))
                    })?;
                sink(label, &record[LABEL_BYTES..]);
            }
            return Ok(());
        }
        let info = self.inner.planner.manifest.split(split);
        let len = info.num_samples;
        // (shard, local record) per requested position.
        let mut locations = Vec::with_capacity(indices.len());
        let mut wanted: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &index in indices {
            if index >= len {
                return Err(DatasetError::IndexOutOfRange { index, len });
            }
            // Validated manifests start at 0, so the partition point is >= 1.
            let shard = info.shards.partition_point(|s| s.first <= index) - 1;
            let local = index - info.shards[shard].first;
            wanted.entry(shard).or_default().push(local);
            locations.push((shard, local));
        }
        let plans = wanted
            .into_iter()
            .map(|(shard, mut locals)| {
                locals.sort_unstable();
                locals.dedup();
                ShardPlan {
                    shard,
                    runs: merge_runs(&locals),
                }
            })
            .collect();
        let data = self.read_plans(split, plans).await?;
        let rb = self.inner.planner.manifest.record_bytes;
        for (shard, local) in locations {
            let corrupt = |message: String| DatasetError::Corrupt {
                object: self.inner.planner.shard_paths[split.index()][shard].to_string(),
                message,
                permanent: false,
            };
            let d = data
                .get(&shard)
                .ok_or_else(|| corrupt("shard was not read".into()))?;
            let run = d.runs.partition_point(|r| r.start <= local).wrapping_sub(1);
            let (range, buf) = d
                .runs
                .get(run)
                .zip(d.buffers.get(run))
                .filter(|(r, _)| r.contains(&local))
                .ok_or_else(|| corrupt(format!("record {local} was not read")))?;
            let at = (local - range.start) * rb;
            let record = buf
                .get(at..at + rb)
                .ok_or_else(|| corrupt(format!("record {local} is cut short")))?;
            let index = info.shards[shard].first + local;
            let (label, feats) = self.decode_record(split, shard, index, record)?;
            sink(label, feats);
        }
        Ok(())
    }

    /// Runs the shard reads, a bounded number at a time.
    async fn read_plans(
        &self,
        split: Split,
        plans: Vec<ShardPlan>,
    ) -> Result<BTreeMap<usize, ShardData>, DatasetError> {
        futures::stream::iter(plans)
            .map(|plan| async move {
                let buffers = self.read_runs(split, plan.shard, &plan.runs).await?;
                Ok::<_, DatasetError>((
                    plan.shard,
                    ShardData {
                        runs: plan.runs,
                        buffers,
                    },
                ))
            })
            .buffer_unordered(MAX_CONCURRENT_SHARD_READS)
            .try_collect()
            .await
    }

    /// One `get_ranges` call for the record runs of one shard, with every
    /// returned length checked.
    async fn read_runs(
        &self,
        split: Split,
        shard: usize,
        runs: &[Range<usize>],
    ) -> Result<Vec<Bytes>, DatasetError> {
        let inner = &self.inner;
        let object = &inner.planner.shard_paths[split.index()][shard];
        let rb = inner.planner.manifest.record_bytes as u64;
        let count = inner.planner.manifest.split(split).shards[shard].count as u64;
        let corrupt = |message: String| DatasetError::Corrupt {
            object: object.to_string(),
            message,
            permanent: false,
        };
        let ranges: Vec<Range<u64>> = runs
            .iter()
            .map(|r| r.start as u64 * rb..r.end as u64 * rb)
            .collect();
        let buffers = match inner.store.get_ranges(object, &ranges).await {
            Ok(buffers) => buffers,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(corrupt(
                    "the shard listed in the manifest is missing".into(),
                ))
            }
            Err(err) => {
                // A range past the end of a truncated object fails in the
                // store; report it as corruption when the size explains it.
                let head = inner
                    .store
                    .get_opts(object, GetOptions::new().with_head(true))
                    .await;
                return match head {
                    Ok(meta) if meta.meta.size != count * rb => Err(corrupt(format!(
                        "object is {} bytes but the manifest expects {} ({count} records of {rb} bytes)",
                        meta.meta.size,
                        count * rb
                    ))),
                    _ => Err(err.into()),
                };
            }
        };
        if buffers.len() != ranges.len() {
            return Err(corrupt(format!(
                "asked for {} ranges, got {}",
                ranges.len(),
                buffers.len()
            )));
        }
        for (range, buf) in ranges.iter().zip(&buffers) {
            let want = range.end - range.start;
            if buf.len() as u64 != want {
                return Err(corrupt(format!(
                    "bytes {}..{} came back as {} bytes (object truncated?); the manifest expects {} bytes",
                    range.start,
                    range.end,
                    buf.len(),
                    count * rb
                )));
            }
        }
        Ok(buffers)
    }

    /// Splits record `index` of a split into its label (checked against
    /// `classes`) and its feature bytes, after checking its checksum.
    fn decode_record<'a>(
        &self,
        split: Split,
        shard: usize,
        index: usize,
        record: &'a [u8],
    ) -> Result<(u32, &'a [u8]), DatasetError> {
        let m = &self.inner.planner.manifest;
        let corrupt = |message: String| DatasetError::Corrupt {
            object: self.inner.planner.shard_paths[split.index()][shard].to_string(),
            message,
            permanent: false,
        };
        if record.len() != m.record_bytes {
            return Err(corrupt(format!(
                "record of {} bytes, expected {}",
                record.len(),
                m.record_bytes
            )));
        }
        let expected = m.split(split).crc32.get(index).copied();
        if let Some(message) = checksum_mismatch(split, index, expected, record) {
            return Err(DatasetError::Corrupt {
                object: self.inner.planner.shard_paths[split.index()][shard].to_string(),
                message,
                permanent: true,
            });
        }
        let (label_bytes, feats) = record.split_at(LABEL_BYTES);
        let label = u32::from_le_bytes([
            label_bytes[0],
            label_bytes[1],
            label_bytes[2],
            label_bytes[3],
        ]);
        if label as usize >= m.classes {
            return Err(corrupt(format!(
                "label {label} is not below the manifest's {} classes",
                m.classes
            )));
        }
        Ok((label, feats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;
    use object_store::local::LocalFileSystem;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;
    use object_store::PutPayload;
    use rand::rngs::StdRng;
    use rand::Rng;
    use rand::SeedableRng;

    fn small_spec() -> SyntheticSpec {
        SyntheticSpec {
            train: 203,
            test: 37,
            features: 5,
            classes: 4,
            seed: 3,
            label_noise: 0.1,
        }
    }

    async fn write_small(store: &dyn ObjectStore, prefix: &Path) -> (Vec<Sample>, Vec<Sample>) {
        let (train, test) = synthetic(&small_spec());
        let m = write_dataset(store, prefix, "small", 5, 4, &train, &test, 16)
            .await
            .unwrap();
        assert_eq!(m.train.shards.len(), 13);
        assert_eq!(m.train.shards[12].count, 203 - 12 * 16);
        assert_eq!(m.test.shards.len(), 3);
        assert_eq!(m.record_bytes, 24);
        assert_eq!(m.total_bytes(Split::Train), 203 * 24);
        (train, test)
    }

    async fn roundtrip(store: Arc<dyn ObjectStore>, prefix: Path) {
        let (train, test) = write_small(store.as_ref(), &prefix).await;
        let reader = DatasetReader::open(store, prefix).await.unwrap();
        assert_eq!(reader.manifest().name, "small");
        assert_eq!(reader.len(Split::Train), 203);

        let mut rng = StdRng::seed_from_u64(1);
        let mut indices: Vec<usize> = (0..150).map(|_| rng.random_range(0..203)).collect();
        // Adjacent runs, duplicates and shard edges.
        indices.extend([15, 16, 17, 17, 0, 202, 201, 200, 31, 32]);
        let got = reader.fetch(Split::Train, &indices).await.unwrap();
        let want: Vec<Sample> = indices.iter().map(|&i| train[i].clone()).collect();
        assert_eq!(got, want);

        let batch = reader.fetch_batch(Split::Train, &indices).await.unwrap();
        assert_eq!(batch, Batch::from_samples(&want, 5));
        assert_eq!(batch.features.len(), batch.len() * 5);

        let all = reader.fetch_all(Split::Test).await.unwrap();
        assert_eq!(all, Batch::from_samples(&test, 5));
        let all_train = reader.fetch_all(Split::Train).await.unwrap();
        assert_eq!(all_train, Batch::from_samples(&train, 5));

        assert!(reader.fetch(Split::Test, &[]).await.unwrap().is_empty());
        assert!(reader
            .fetch_batch(Split::Test, &[])
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test]
    async fn roundtrip_in_memory() {
        roundtrip(Arc::new(InMemory::new()), Path::from("sets/small")).await;
    }

    #[tokio::test]
    async fn roundtrip_local_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        roundtrip(store, Path::from("nested/small")).await;
        assert!(dir.path().join("nested/small/manifest.json").exists());
        assert!(dir
            .path()
            .join("nested/small/train/shard-00000.bin")
            .exists());
        assert!(dir
            .path()
            .join("nested/small/test/shard-00002.bin")
            .exists());
    }

    #[tokio::test]
    async fn roundtrip_at_bucket_root() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().join("fresh").display());
        let (store, prefix) = open_bucket(&url).unwrap();
        assert_eq!(prefix, Path::default());
        roundtrip(store, prefix).await;
        assert!(dir.path().join("fresh/manifest.json").exists());
    }

    #[tokio::test]
    async fn fetch_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let (train, test) = synthetic(&small_spec());
        let root = Path::default();
        let write = write_dataset(store.as_ref(), &root, "s", 5, 4, &train, &test, 64);
        assert_send(&write);
        write.await.unwrap();
        let reader = DatasetReader::open(store, Path::default()).await.unwrap();
        let fut = reader.fetch_batch(Split::Train, &[1, 2]);
        assert_send(&fut);
        let handle = tokio::spawn({
            let reader = reader.clone();
            async move { reader.fetch_all(Split::Test).await }
        });
        assert_eq!(handle.await.unwrap().unwrap().len(), 37);
        assert_eq!(fut.await.unwrap().len(), 2);
    }

    /// A loopback HTTP endpoint that answers every request with a 404 and
    /// the S3 error `code`, as S3 and compatible servers do. Returns its URL.
    async fn s3_answering_404(code: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = format!(
                        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>not here</Message></Error>"
                    );
                    let reply = format!(
                        "HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(reply.as_bytes()).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn missing_bucket_is_reported_as_one() {
        for (code, bucket_missing) in [("NoSuchBucket", true), ("NoSuchKey", false)] {
            let endpoint = s3_answering_404(code).await;
            let opts = [
                ("AWS_ENDPOINT", endpoint.as_str()),
                ("AWS_ALLOW_HTTP", "true"),
                ("AWS_REGION", "us-east-1"),
                ("AWS_ACCESS_KEY_ID", "id"),
                ("AWS_SECRET_ACCESS_KEY", "secret"),
            ];
            let (store, prefix) =
                ps_shared::bucket::open_bucket_with("s3://no-such-bucket/data", opts).unwrap();
            let err = DatasetReader::open(store, prefix).await.unwrap_err();
            let msg = err.to_string();
            if bucket_missing {
                assert!(matches!(err, DatasetError::BucketMissing { .. }), "{msg}");
                assert!(
                    msg.contains("bucket missing") && msg.contains("no-such-bucket"),
                    "{msg}"
                );
                // Not the missing-dataset hint (the store's own text may
                // still quote the object it tried).
                assert!(!msg.contains("write one with"), "{msg}");
            } else {
                assert!(matches!(err, DatasetError::NotFound { .. }), "{msg}");
            }
        }
        // An http:// endpoint without AWS_ALLOW_HTTP: refused by the client
        // itself, every time, so not worth retrying.
        let endpoint = s3_answering_404("NoSuchKey").await;
        let opts = [
            ("AWS_ENDPOINT", endpoint.as_str()),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "id"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
        ];
        let (store, prefix) = ps_shared::bucket::open_bucket_with("s3://b/data", opts).unwrap();
        let err = DatasetReader::open(store, prefix).await.unwrap_err();
        let chain = {
            let mut text = err.to_string();
            let mut source = std::error::Error::source(&err);
            while let Some(e) = source {
                text.push_str(&format!(" / {e}"));
                source = e.source();
            }
            text
        };
        assert!(chain.contains("URL scheme is not allowed"), "{chain}");
        assert!(!err.is_transient(), "{chain}");
    }

    #[tokio::test]
    async fn missing_manifest_is_not_found() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let err = DatasetReader::open(store, Path::from("nothing/here"))
            .await
            .unwrap_err();
        assert!(matches!(&err, DatasetError::NotFound { prefix } if prefix == "nothing/here"));
        let msg = err.to_string();
        assert!(
            msg.contains("nothing/here") && msg.contains("manifest.json not found"),
            "{msg}"
        );
        assert!(msg.contains("ps-data"), "{msg}");
    }

    #[tokio::test]
    async fn bad_manifest_is_rejected() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("d");
        store
            .put(
                &prefix.clone().join(MANIFEST_NAME),
                PutPayload::from_static(b"{not json"),
            )
            .await
            .unwrap();
        let err = DatasetReader::open(store.clone(), prefix.clone())
            .await
            .unwrap_err();
        assert!(matches!(err, DatasetError::Manifest(_)), "{err}");

        let (train, test) = synthetic(&small_spec());
        let mut m = write_dataset(store.as_ref(), &prefix, "s", 5, 4, &train, &test, 50)
            .await
            .unwrap();
        m.format = 2;
        store
            .put(
                &prefix.clone().join(MANIFEST_NAME),
                serde_json::to_vec(&m).unwrap().into(),
            )
            .await
            .unwrap();
        let err = DatasetReader::open(store, prefix).await.unwrap_err();
        assert!(err.to_string().contains("format 2"), "{err}");
    }

    #[tokio::test]
    async fn per_sample_roundtrip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let local: Arc<dyn ObjectStore> =
            Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        let memory: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let options = WriteOptions {
            layout: Layout::PerSample,
            records_per_shard: 16,
        };
        for store in [local, memory] {
            let prefix = Path::from("ps");
            let (train, test) = synthetic(&small_spec());
            let m = write_dataset_with(store.as_ref(), &prefix, "p", 5, 4, &train, &test, &options)
                .await
                .unwrap();
            assert_eq!((m.format, m.layout), (FORMAT_PER_SAMPLE, Layout::PerSample));
            assert!(m.train.shards.is_empty());
            let reader = DatasetReader::open(store.clone(), prefix.clone())
                .await
                .unwrap();
            assert_eq!(reader.layout(), Layout::PerSample);
            let indices = [5usize, 1, 202, 5, 0];
            let got = reader.fetch(Split::Train, &indices).await.unwrap();
            let want: Vec<Sample> = indices.iter().map(|&i| train[i].clone()).collect();
            assert_eq!(got, want);
            assert_eq!(
                reader.fetch_all(Split::Test).await.unwrap(),
                Batch::from_samples(&test, 5)
            );
            let reqs = reader
                .plan_requests(Split::Train, &indices, 1 << 20)
                .unwrap();
            assert_eq!(reqs.len(), 4);
            assert_eq!(reqs[0].object, Path::from("ps/train/00000000.bin"));
            let recs = reader.read_request(&reqs[3]).await.unwrap();
            assert_eq!(
                reader.batch_from_records(&recs).unwrap(),
                Batch::from_samples(&train[202..], 5)
            );
            // A truncated and a missing object are corrupt, named.
            let obj = Path::from("ps/train/00000007.bin");
            store.put(&obj, vec![1u8; 10].into()).await.unwrap();
            let err = reader.fetch(Split::Train, &[7]).await.unwrap_err();
            assert!(
                matches!(&err, DatasetError::Corrupt { object, .. } if object == "ps/train/00000007.bin"),
                "{err}"
            );
            store.delete(&obj).await.unwrap();
            let err = reader.fetch(Split::Train, &[3, 7]).await.unwrap_err();
            assert!(err.to_string().contains("missing"), "{err}");
            assert!(err.to_string().contains("00000007.bin"), "{err}");
        }
    }

    #[tokio::test]
    async fn shard_requests_merge_adjacent_records() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let (train, _) = write_small(store.as_ref(), &Path::default()).await;
        let reader = DatasetReader::open(store, Path::default()).await.unwrap();
        // Shards hold 16 records of 24 bytes.
        let reqs = reader
            .plan_requests(Split::Train, &[3, 4, 5, 15, 16, 17, 40, 3], 1 << 20)
            .unwrap();
        let spans: Vec<(usize, usize, Option<Range<u64>>)> = reqs
            .iter()
            .map(|r| (r.first, r.count, r.range.clone()))
            .collect();
        assert_eq!(
            spans,
            vec![
                (3, 3, Some(72..144)),
                (15, 1, Some(360..384)),
                (16, 2, Some(0..48)),
                (40, 1, Some(192..216)),
            ]
        );
        assert_eq!(reqs[2].object, Path::from("train/shard-00001.bin"));
        // A byte cap splits long runs.
        let capped = reader
            .plan_requests(Split::Train, &[0, 1, 2, 3, 4], 48)
            .unwrap();
        assert_eq!(
            capped.iter().map(|r| r.count).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        for r in &capped {
            let recs = reader.read_request(r).await.unwrap();
            let batch = reader.batch_from_records(&recs).unwrap();
            assert_eq!(batch, Batch::from_samples(&train[r.indices()], 5));
        }
        let err = reader
            .plan_requests(Split::Train, &[203], 1 << 20)
            .unwrap_err();
        assert!(matches!(
            err,
            DatasetError::IndexOutOfRange {
                index: 203,
                len: 203
            }
        ));
        assert!(reader
            .batch_from_records(&[Bytes::from_static(b"abc")])
            .is_err());
    }

    #[tokio::test]
    async fn truncated_shard_is_corrupt() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("t");
        write_small(store.as_ref(), &prefix).await;
        let shard = prefix.clone().join("train").join("shard-00001.bin");
        let full = store.get(&shard).await.unwrap().bytes().await.unwrap();
        // Cut the shard in the middle of record 10 of 16.
        store
            .put(&shard, full.slice(..10 * 24 + 7).into())
            .await
            .unwrap();

        let reader = DatasetReader::open(store.clone(), prefix.clone())
            .await
            .unwrap();
        // Records before the cut still read fine.
        reader.fetch(Split::Train, &[16, 20]).await.unwrap();
        // A record straddling the cut comes back short.
        let err = reader.fetch(Split::Train, &[26]).await.unwrap_err();
        assert!(
            matches!(&err, DatasetError::Corrupt { object, .. } if object == "t/train/shard-00001.bin"),
            "{err}"
        );
        // A record past the end fails in the store; still reported as corrupt.
        let err = reader.fetch(Split::Train, &[30]).await.unwrap_err();
        assert!(
            matches!(&err, DatasetError::Corrupt { object, .. } if object.ends_with("shard-00001.bin")),
            "{err}"
        );
        let err = reader.fetch_all(Split::Train).await.unwrap_err();
        assert!(matches!(err, DatasetError::Corrupt { .. }), "{err}");

        // A missing shard is corrupt too.
        store
            .delete(&prefix.clone().join("test").join("shard-00000.bin"))
            .await
            .unwrap();
        let err = reader.fetch_all(Split::Test).await.unwrap_err();
        assert!(matches!(err, DatasetError::Corrupt { .. }), "{err}");
    }

    #[tokio::test]
    async fn truncated_shard_on_disk_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> =
            Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        write_small(store.as_ref(), &Path::default()).await;
        let file = dir.path().join("train/shard-00000.bin");
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.set_len(5 * 24 + 3).unwrap();
        let reader = DatasetReader::open(store, Path::default()).await.unwrap();
        for idx in [5usize, 9] {
            let err = reader.fetch(Split::Train, &[idx]).await.unwrap_err();
            assert!(
                matches!(&err, DatasetError::Corrupt { object, .. } if object == "train/shard-00000.bin"),
                "{idx}: {err}"
            );
        }
        reader.fetch(Split::Train, &[4, 16]).await.unwrap();
    }

    #[tokio::test]
    async fn bad_label_in_shard_is_corrupt() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let (train, test) = synthetic(&small_spec());
        write_dataset(
            store.as_ref(),
            &Path::default(),
            "s",
            5,
            4,
            &train,
            &test,
            1000,
        )
        .await
        .unwrap();
        let shard = Path::from("test/shard-00000.bin");
        let mut raw = store
            .get(&shard)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        raw[24..28].copy_from_slice(&9u32.to_le_bytes());
        store.put(&shard, raw.into()).await.unwrap();
        let reader = DatasetReader::open(store.clone(), Path::default())
            .await
            .unwrap();
        reader.fetch(Split::Test, &[0, 2]).await.unwrap();
        // The record's checksum catches the change first.
        let err = reader.fetch(Split::Test, &[1]).await.unwrap_err();
        assert!(
            err.to_string().contains("test sample 1 fails its checksum"),
            "{err}"
        );
        // Without checksums (an older manifest) the label check still does.
        strip_checksums(store.as_ref(), &Path::default()).await;
        let reader = DatasetReader::open(store, Path::default()).await.unwrap();
        let err = reader.fetch(Split::Test, &[1]).await.unwrap_err();
        assert!(err.to_string().contains("label 9"), "{err}");
    }

    /// Rewrites the manifest under `prefix` in the form written before
    /// checksums existed: without any `crc32` field.
    async fn strip_checksums(store: &dyn ObjectStore, prefix: &Path) {
        let path = prefix.clone().join(MANIFEST_NAME);
        let raw = store.get(&path).await.unwrap().bytes().await.unwrap();
        let mut json: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        for split in ["train", "test"] {
            json[split].as_object_mut().unwrap().remove("crc32");
        }
        if let Some(images) = json.get_mut("images") {
            for split in ["train", "test"] {
                for e in images[split].as_array_mut().unwrap() {
                    e.as_object_mut().unwrap().remove("crc32");
                }
            }
        }
        let text = serde_json::to_string(&json).unwrap();
        assert!(!text.contains("crc32"), "{text}");
        store.put(&path, text.into_bytes().into()).await.unwrap();
    }

    /// Overwrites `object` with random bytes of the same size.
    async fn scramble(store: &dyn ObjectStore, object: &Path, seed: u64) {
        let size = store.head(object).await.unwrap().size as usize;
        let mut rng = StdRng::seed_from_u64(seed);
        let noise: Vec<u8> = (0..size).map(|_| rng.random()).collect();
        store.put(object, noise.into()).await.unwrap();
    }

    fn assert_damaged(err: &DatasetError, object: &str, sample: &str) {
        assert!(
            matches!(err, DatasetError::Corrupt { object: o, permanent: true, .. } if o == object),
            "{err}"
        );
        assert!(!err.is_transient(), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(object) && msg.contains(sample) && msg.contains("fails its checksum"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn overwritten_objects_are_reported_as_corrupt() {
        // Shards: every way of reading a record checks its checksum.
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("c");
        let (train, _) = write_small(store.as_ref(), &prefix).await;
        let shard = Path::from("c/train/shard-00001.bin");
        scramble(store.as_ref(), &shard, 9).await;
        let reader = DatasetReader::open(store.clone(), prefix.clone())
            .await
            .unwrap();
        // Records of other shards still read.
        assert_eq!(
            reader.fetch(Split::Train, &[3, 40]).await.unwrap(),
            vec![train[3].clone(), train[40].clone()]
        );
        let err = reader.fetch(Split::Train, &[20]).await.unwrap_err();
        assert_damaged(&err, "c/train/shard-00001.bin", "train sample 20");
        let err = reader.fetch_all(Split::Train).await.unwrap_err();
        assert_damaged(&err, "c/train/shard-00001.bin", "train sample 16");
        for req in reader
            .plan_requests(Split::Train, &[17, 18], 1 << 20)
            .unwrap()
        {
            let err = reader.read_request(&req).await.unwrap_err();
            assert_damaged(&err, "c/train/shard-00001.bin", "train sample 17");
        }

        // One object per sample.
        let options = WriteOptions {
            layout: Layout::PerSample,
            records_per_shard: 1,
        };
        let (train, test) = synthetic(&small_spec());
        let prefix = Path::from("p");
        write_dataset_with(store.as_ref(), &prefix, "p", 5, 4, &train, &test, &options)
            .await
            .unwrap();
        scramble(store.as_ref(), &Path::from("p/test/00000007.bin"), 10).await;
        let reader = DatasetReader::open(store.clone(), prefix).await.unwrap();
        reader.fetch(Split::Test, &[6, 8]).await.unwrap();
        let err = reader.fetch_all(Split::Test).await.unwrap_err();
        assert_damaged(&err, "p/test/00000007.bin", "test sample 7");
    }

    #[tokio::test]
    async fn manifest_without_checksums_still_reads() {
        for layout in [Layout::Shards, Layout::PerSample] {
            let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
            let options = WriteOptions {
                layout,
                records_per_shard: 16,
            };
            let (train, test) = synthetic(&small_spec());
            let m = write_dataset_with(
                store.as_ref(),
                &Path::default(),
                "o",
                5,
                4,
                &train,
                &test,
                &options,
            )
            .await
            .unwrap();
            assert_eq!((m.train.crc32.len(), m.test.crc32.len()), (203, 37));
            assert_eq!(m.train.crc32[5], crc32(&store_record(&train[5])));
            strip_checksums(store.as_ref(), &Path::default()).await;
            let reader = DatasetReader::open(store, Path::default()).await.unwrap();
            assert!(reader.manifest().train.crc32.is_empty());
            let got = reader.fetch(Split::Train, &[5, 1, 202]).await.unwrap();
            assert_eq!(
                got,
                vec![train[5].clone(), train[1].clone(), train[202].clone()]
            );
            assert_eq!(
                reader.fetch_all(Split::Test).await.unwrap(),
                Batch::from_samples(&test, 5)
            );
        }
    }

    /// A sample as the writer stores it: label, then features, little-endian.
    fn store_record(s: &Sample) -> Vec<u8> {
        let mut out = s.label.to_le_bytes().to_vec();
        for v in &s.features {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    #[tokio::test]
    async fn out_of_range_index() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        write_small(store.as_ref(), &Path::default()).await;
        let reader = DatasetReader::open(store, Path::default()).await.unwrap();
        let err = reader.fetch(Split::Test, &[0, 37]).await.unwrap_err();
        assert!(
            matches!(err, DatasetError::IndexOutOfRange { index: 37, len: 37 }),
            "{err}"
        );
        let err = reader
            .fetch_batch(Split::Train, &[usize::MAX])
            .await
            .unwrap_err();
        assert!(
            matches!(err, DatasetError::IndexOutOfRange { len: 203, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn write_validates_samples() {
        let store = InMemory::new();
        let p = Path::from("x");
        let good = vec![Sample {
            label: 1,
            features: vec![0.5, 1.0],
        }];
        let short = vec![Sample {
            label: 1,
            features: vec![0.5],
        }];
        let big_label = vec![Sample {
            label: 3,
            features: vec![0.5, 1.0],
        }];
        let nan = vec![Sample {
            label: 0,
            features: vec![f32::NAN, 1.0],
        }];
        for (train, test) in [(&short, &good), (&good, &big_label), (&nan, &good)] {
            let err = write_dataset(&store, &p, "x", 2, 3, train, test, 4)
                .await
                .unwrap_err();
            assert!(matches!(err, DatasetError::Invalid(_)), "{err}");
        }
        let err = write_dataset(&store, &p, "x", 2, 3, &good, &good, 0)
            .await
            .unwrap_err();
        assert!(matches!(err, DatasetError::Invalid(_)));
        // Nothing was written by the failed calls.
        assert!(store.head(&p.clone().join(MANIFEST_NAME)).await.is_err());
        // An empty test split is fine.
        let m = write_dataset(&store, &p, "x", 2, 3, &good, &[], 4)
            .await
            .unwrap();
        assert_eq!(
            m.test,
            SplitInfo {
                num_samples: 0,
                ..SplitInfo::default()
            }
        );
    }
}

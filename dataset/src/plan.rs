//! The read planner: which GETs read a set of samples. Pure: it needs the
//! manifest and the prefix, never the store, so it is tested without one.

use std::ops::Range;

use object_store::path::Path;

use crate::format::*;

/// One GET of records: a whole per-sample object, or a run of adjacent
/// records of one shard read with a range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRequest {
    pub split: Split,
    /// Full object path in the store.
    pub object: Path,
    /// Byte range inside the object; `None` reads the whole object.
    pub range: Option<Range<u64>>,
    /// Global index of the first record; the request covers `first..first + count`.
    pub first: usize,
    /// Records covered.
    pub count: usize,
}

impl RecordRequest {
    /// Global indices of the records it covers.
    pub fn indices(&self) -> Range<usize> {
        self.first..self.first + self.count
    }
}

/// Turns sample indices into GETs for one dataset.
#[derive(Debug, Clone)]
pub struct ReadPlanner {
    pub(crate) prefix: Path,
    pub(crate) manifest: Manifest,
    /// Full object paths of the shards, indexed by `Split::index()`.
    pub(crate) shard_paths: [Vec<Path>; 2],
    /// Image layouts: full paths of the index's objects.
    pub(crate) image_paths: Vec<Path>,
}

impl ReadPlanner {
    /// A planner for a dataset under `prefix`; validates the manifest.
    pub fn new(manifest: Manifest, prefix: Path) -> Result<Self, DatasetError> {
        manifest.validate()?;
        let mut shard_paths: [Vec<Path>; 2] = [Vec::new(), Vec::new()];
        for split in Split::ALL {
            for shard in &manifest.split(split).shards {
                shard_paths[split.index()]
                    .push(object_path(&prefix, &shard.path).map_err(DatasetError::Manifest)?);
            }
        }
        let mut image_paths = Vec::new();
        for (k, rel) in manifest
            .images
            .iter()
            .flat_map(|i| i.objects.iter())
            .enumerate()
        {
            image_paths
                .push(object_path(&prefix, rel).map_err(|msg| {
                    DatasetError::Manifest(format!("images.objects[{k}]: {msg}"))
                })?);
        }
        Ok(Self {
            prefix,
            manifest,
            shard_paths,
            image_paths,
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The GETs that read `indices` of a split (sorted and deduplicated
    /// first): one per sample in the per-sample layout; in the shard layout one
    /// per run of adjacent records of a shard, each at most
    /// `max_request_bytes` long (but at least one record).
    pub fn plan(
        &self,
        split: Split,
        indices: &[usize],
        max_request_bytes: u64,
    ) -> Result<Vec<RecordRequest>, DatasetError> {
        let m = &self.manifest;
        let info = m.split(split);
        let len = info.num_samples;
        let mut sorted = indices.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if let Some(&index) = sorted.last().filter(|&&i| i >= len) {
            return Err(DatasetError::IndexOutOfRange { index, len });
        }
        if let Some(index) = &m.images {
            let entries = index.entries(split);
            return Ok(sorted
                .into_iter()
                .map(|i| {
                    let e = &entries[i];
                    RecordRequest {
                        split,
                        object: self.image_paths[e.object as usize].clone(),
                        range: (m.layout == Layout::WebDataset).then(|| e.offset..e.offset + e.len),
                        first: i,
                        count: 1,
                    }
                })
                .collect());
        }
        if m.layout == Layout::PerSample {
            return Ok(sorted
                .into_iter()
                .map(|i| self.sample_request(split, i))
                .collect());
        }
        let rb = m.record_bytes as u64;
        let max_records = usize::try_from((max_request_bytes / rb).max(1)).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(&first) = sorted.get(start) {
            // Validated manifests start at 0, so the partition point is >= 1.
            let shard = info.shards.partition_point(|s| s.first <= first) - 1;
            let s = &info.shards[shard];
            let shard_end = s.first + s.count;
            let mut end = start + 1;
            while end < sorted.len()
                && sorted[end] == sorted[end - 1] + 1
                && sorted[end] < shard_end
                && end - start < max_records
            {
                end += 1;
            }
            let count = end - start;
            let local = (first - s.first) as u64;
            out.push(RecordRequest {
                split,
                object: self.shard_paths[split.index()][shard].clone(),
                range: Some(local * rb..(local + count as u64) * rb),
                first,
                count,
            });
            start = end;
        }
        Ok(out)
    }

    fn sample_request(&self, split: Split, index: usize) -> RecordRequest {
        let rel = sample_object_path(split, index);
        RecordRequest {
            split,
            object: join(&self.prefix, &Path::from(rel.as_str())),
            range: None,
            first: index,
            count: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(layout: Layout, shard_sizes: &[usize]) -> Manifest {
        let features = 2;
        let mut shards = Vec::new();
        let mut first = 0;
        for (k, &count) in shard_sizes.iter().enumerate() {
            shards.push(ShardInfo {
                path: format!("train/shard-{k:05}.bin"),
                first,
                count,
            });
            first += count;
        }
        let train = SplitInfo {
            num_samples: first,
            shards: if layout == Layout::Shards {
                shards
            } else {
                Vec::new()
            },
            crc32: Vec::new(),
        };
        Manifest {
            format: layout.format(),
            layout,
            name: "plan".into(),
            features,
            classes: 3,
            record_bytes: LABEL_BYTES + 4 * features,
            feature_type: FeatureType::F32,
            train,
            test: SplitInfo {
                num_samples: 0,
                ..SplitInfo::default()
            },
            normalization: None,
            images: None,
            text: None,
        }
    }

    #[test]
    fn shard_runs_merge_within_a_shard_and_respect_the_size_cap() {
        let planner = ReadPlanner::new(manifest(Layout::Shards, &[5, 5]), Path::from("d")).unwrap();
        let rb = 12u64;
        let reqs = planner
            .plan(Split::Train, &[9, 3, 0, 1, 2, 4, 5, 2], 3 * rb)
            .unwrap();
        let got: Vec<(String, Option<Range<u64>>, Range<usize>)> = reqs
            .iter()
            .map(|r| (r.object.to_string(), r.range.clone(), r.indices()))
            .collect();
        let s0 = "d/train/shard-00000.bin".to_string();
        let s1 = "d/train/shard-00001.bin".to_string();
        assert_eq!(
            got,
            vec![
                // 0..3 hits the 3-record cap; 3..5 ends at the shard's end.
                (s0.clone(), Some(0..3 * rb), 0..3),
                (s0, Some(3 * rb..5 * rb), 3..5),
                (s1.clone(), Some(0..rb), 5..6),
                (s1, Some(4 * rb..5 * rb), 9..10),
            ]
        );
        let err = planner.plan(Split::Train, &[10], 1 << 20).unwrap_err();
        assert!(matches!(
            err,
            DatasetError::IndexOutOfRange { index: 10, len: 10 }
        ));
    }

    #[test]
    fn per_sample_layout_reads_whole_objects() {
        let planner = ReadPlanner::new(manifest(Layout::PerSample, &[4]), Path::default()).unwrap();
        let reqs = planner.plan(Split::Train, &[3, 1, 3], 1 << 20).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(
            reqs[0].object.to_string(),
            sample_object_path(Split::Train, 1)
        );
        assert_eq!((reqs[0].range.clone(), reqs[0].indices()), (None, 1..2));
        assert_eq!(reqs[1].indices(), 3..4);
    }
}

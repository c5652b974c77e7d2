//! Indexing images where they lie: WebDataset shards or class folders in a
//! bucket become an [`ImageIndex`] manifest, written next to them, so that
//! the loader reads every image with one range GET and needs no conversion.

use std::collections::{BTreeMap, BTreeSet};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore, PutOptions, PutPayload};

use crate::format::*;
use crate::image::is_image_name;
use crate::webdataset::{expand_braces, is_label_name, parse_label, split_key, TarScanner};

/// Shards indexed at once.
const INDEX_CONCURRENCY: usize = 8;

/// Class-folder images read at once for their checksums.
const CHECKSUM_CONCURRENCY: usize = 32;

/// What to index and how strictly.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexOptions {
    pub name: String,
    /// `[channels, height, width]` of a decoded sample.
    pub shape: [usize; 3],
    /// Leave out (and report) samples without a label, unknown class
    /// folders and other bad entries instead of failing.
    pub skip_bad: bool,
}

/// What indexing found besides the manifest.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IndexReport {
    /// Samples left out, each with the reason (only with `skip_bad`).
    pub skipped: Vec<String>,
    /// Bytes read from the bucket to build the index.
    pub bytes_read: u64,
    /// Objects listed or read.
    pub objects: usize,
}

fn invalid(object: &str, message: String) -> DatasetError {
    DatasetError::Corrupt {
        object: object.to_string(),
        message,
        permanent: true,
    }
}

/// Indexes WebDataset shards: `train` and `test` are shard names relative
/// to `prefix`, brace-expanded (`train-{0000..0009}.tar`). Each shard is
/// read once, as a stream, which also gives every image's checksum.
pub async fn index_webdataset(
    store: &dyn ObjectStore,
    prefix: &Path,
    train: &str,
    test: Option<&str>,
    options: &IndexOptions,
) -> Result<(Manifest, IndexReport), DatasetError> {
    let mut report = IndexReport::default();
    let mut objects = Vec::new();
    let mut splits: Vec<Vec<ImageEntry>> = Vec::new();
    for pattern in [Some(train), test] {
        let Some(pattern) = pattern else {
            splits.push(Vec::new());
            continue;
        };
        if pattern.contains(['*', '?', '[']) {
            return Err(DatasetError::Glob(pattern.to_string()));
        }
        let names = expand_braces(pattern)
            .map_err(|m| DatasetError::Invalid(format!("shard pattern: {m}")))?;
        let first_object = objects.len();
        objects.extend(names.iter().cloned());
        let scans: Vec<_> = futures::stream::iter(names.iter().enumerate())
            .map(|(k, name)| async move {
                let path = object_path(prefix, name).map_err(DatasetError::Invalid)?;
                scan_shard(store, &path, name).await.map(|r| (k, r))
            })
            .buffered(INDEX_CONCURRENCY)
            .try_collect()
            .await?;
        let mut entries = Vec::new();
        for (k, (members, bytes)) in scans {
            report.bytes_read += bytes;
            report.objects += 1;
            group_members(
                &names[k],
                (first_object + k) as u32,
                members,
                options.skip_bad,
                &mut entries,
                &mut report,
            )?;
        }
        splits.push(entries);
    }
    let test_entries = splits.pop().unwrap_or_default();
    let train_entries = splits.pop().unwrap_or_default();
    let classes = train_entries.iter().map(|e| e.label + 1).max().unwrap_or(0) as usize;
    if let Some(e) = test_entries.iter().find(|e| e.label as usize >= classes) {
        return Err(invalid(
            &objects[e.object as usize],
            format!(
                "test sample `{}` has label {} but the training shards only have labels below {classes}",
                e.key, e.label
            ),
        ));
    }
    let class_names = (0..classes).map(|c| c.to_string()).collect();
    let manifest = image_manifest(
        Layout::WebDataset,
        options,
        class_names,
        objects,
        train_entries,
        test_entries,
    )?;
    Ok((manifest, report))
}

/// Reads one shard as a stream and returns its members and its size.
async fn scan_shard(
    store: &dyn ObjectStore,
    path: &Path,
    name: &str,
) -> Result<(Vec<crate::webdataset::TarMember>, u64), DatasetError> {
    let result = match store.get_opts(path, GetOptions::default()).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(DatasetError::MissingObject {
                what: "WebDataset shard",
                object: name.to_string(),
            })
        }
        Err(e) => return Err(e.into()),
    };
    let mut stream = result.into_stream();
    let mut scanner = TarScanner::new(is_label_name);
    let mut bytes = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        scanner.feed(&chunk).map_err(|m| invalid(name, m))?;
    }
    let members = scanner.finish().map_err(|m| invalid(name, m))?;
    Ok((members, bytes))
}

/// Groups one shard's members into samples by key, in archive order.
fn group_members(
    shard: &str,
    object: u32,
    members: Vec<crate::webdataset::TarMember>,
    skip_bad: bool,
    out: &mut Vec<ImageEntry>,
    report: &mut IndexReport,
) -> Result<(), DatasetError> {
    struct Parts {
        image: Option<(u64, u64, u32)>,
        label: Option<Result<u32, String>>,
    }
    let mut order: Vec<String> = Vec::new();
    let mut parts: BTreeMap<String, Parts> = BTreeMap::new();
    for m in members {
        let (key, ext) = split_key(&m.name);
        let key = key.to_string();
        let entry = parts.entry(key.clone()).or_insert_with(|| {
            order.push(key.clone());
            Parts {
                image: None,
                label: None,
            }
        });
        if is_image_name(&m.name) {
            entry.image = Some((m.offset, m.len, m.crc32));
        } else if let Some(data) = &m.data {
            entry.label = Some(parse_label(ext, data));
        }
    }
    for key in order {
        let p = &parts[&key];
        let outcome = match (&p.image, &p.label) {
            (None, _) => Err("has no .jpg, .jpeg or .png member".to_string()),
            (Some(_), None) => Err("has no label (a .cls or .json member)".to_string()),
            (Some(_), Some(Err(e))) => Err(e.clone()),
            (Some((offset, len, crc32)), Some(Ok(label))) if *len > 0 => Ok(ImageEntry {
                object,
                offset: *offset,
                len: *len,
                label: *label,
                key: key.clone(),
                crc32: Some(*crc32),
            }),
            (Some(_), Some(Ok(_))) => Err("has an empty image".to_string()),
        };
        match outcome {
            Ok(e) => out.push(e),
            Err(why) if skip_bad => report.skipped.push(format!("{shard}: sample `{key}` {why}")),
            Err(why) => {
                return Err(invalid(
                    shard,
                    format!("sample `{key}` {why} (set data.on_bad_sample = \"skip\" or pass --skip-bad to leave such samples out)"),
                ))
            }
        }
    }
    Ok(())
}

/// Indexes `train/<class>/<file>` and `test/<class>/<file>` under `prefix`:
/// the classes are the training folders' names in sorted order. Every image
/// is read once, for the checksum the loader checks each read against.
pub async fn index_class_folders(
    store: &dyn ObjectStore,
    prefix: &Path,
    options: &IndexOptions,
) -> Result<(Manifest, IndexReport), DatasetError> {
    let mut report = IndexReport::default();
    let mut listed: [Vec<(String, String, u64)>; 2] = [Vec::new(), Vec::new()];
    for split in Split::ALL {
        let dir = prefix.clone().join(split.name());
        let metas: Vec<_> = store.list(Some(&dir)).try_collect().await?;
        report.objects += metas.len();
        for meta in metas {
            let full = meta.location.to_string();
            let rel = full
                .strip_prefix(&prefix.to_string())
                .unwrap_or(&full)
                .trim_start_matches('/')
                .to_string();
            let parts: Vec<&str> = rel.splitn(3, '/').collect();
            let file = parts.get(2).copied().unwrap_or("");
            if parts.len() < 3 || file.starts_with('.') {
                report
                    .skipped
                    .push(format!("{rel}: not under {}/<class>/", split.name()));
                continue;
            }
            if !is_image_name(file) {
                report
                    .skipped
                    .push(format!("{rel}: not a .jpg, .jpeg or .png file"));
                continue;
            }
            listed[split.index()].push((parts[1].to_string(), rel, meta.size));
        }
        listed[split.index()].sort();
    }
    let class_names: Vec<String> = listed[0]
        .iter()
        .map(|(c, _, _)| c.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if class_names.is_empty() {
        return Err(DatasetError::Invalid(format!(
            "no images under '{}': expected train/<class>/<image>",
            prefix.clone().join("train")
        )));
    }
    let label_of: BTreeMap<&str, u32> = class_names
        .iter()
        .enumerate()
        .map(|(i, c)| (c.as_str(), i as u32))
        .collect();
    let mut objects = Vec::new();
    let mut splits: Vec<Vec<ImageEntry>> = Vec::new();
    for split in Split::ALL {
        let mut entries = Vec::new();
        for (class, rel, size) in &listed[split.index()] {
            let Some(&label) = label_of.get(class.as_str()) else {
                let why = format!(
                    "class folder `{class}` of the {split} split has no training folder (classes: {})",
                    class_names.join(", ")
                );
                if options.skip_bad {
                    report.skipped.push(format!("{rel}: {why}"));
                    continue;
                }
                return Err(invalid(rel, why));
            };
            if *size == 0 {
                if options.skip_bad {
                    report.skipped.push(format!("{rel}: empty file"));
                    continue;
                }
                return Err(invalid(rel, "the image file is empty".into()));
            }
            entries.push(ImageEntry {
                object: objects.len() as u32,
                offset: 0,
                len: *size,
                label,
                key: rel.rsplit('/').next().unwrap_or(rel).to_string(),
                crc32: None,
            });
            objects.push(rel.clone());
        }
        splits.push(entries);
    }
    // Read every image once for its checksum, so that the loader can check
    // each read against it.
    let sums: Vec<(u32, u64)> = futures::stream::iter(objects.iter())
        .map(|rel| async move {
            let path = object_path(prefix, rel).map_err(DatasetError::Invalid)?;
            let body = match store.get_opts(&path, GetOptions::default()).await {
                Ok(r) => r.bytes().await?,
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(invalid(rel, "the image vanished while indexing".into()))
                }
                Err(e) => return Err(e.into()),
            };
            Ok::<_, DatasetError>((crc32(&body), body.len() as u64))
        })
        .buffered(CHECKSUM_CONCURRENCY)
        .try_collect()
        .await?;
    for e in splits.iter_mut().flatten() {
        let (sum, len) = sums[e.object as usize];
        if len != e.len {
            return Err(invalid(
                &objects[e.object as usize],
                format!(
                    "the image was listed as {} bytes but read as {len} (changed while indexing?)",
                    e.len
                ),
            ));
        }
        e.crc32 = Some(sum);
        report.bytes_read += len;
    }
    let test_entries = splits.pop().unwrap_or_default();
    let train_entries = splits.pop().unwrap_or_default();
    let manifest = image_manifest(
        Layout::ClassFolders,
        options,
        class_names,
        objects,
        train_entries,
        test_entries,
    )?;
    Ok((manifest, report))
}

fn image_manifest(
    layout: Layout,
    options: &IndexOptions,
    class_names: Vec<String>,
    objects: Vec<String>,
    train: Vec<ImageEntry>,
    test: Vec<ImageEntry>,
) -> Result<Manifest, DatasetError> {
    if train.is_empty() {
        return Err(DatasetError::Invalid(
            "the training split holds no images".into(),
        ));
    }
    let total: u64 = train.iter().chain(&test).map(|e| e.len).sum();
    let count = (train.len() + test.len()) as u64;
    let mean = usize::try_from(total.div_ceil(count)).unwrap_or(usize::MAX);
    let [c, h, w] = options.shape;
    let manifest = Manifest {
        format: layout.format(),
        layout,
        name: options.name.clone(),
        features: c * h * w,
        classes: class_names.len(),
        record_bytes: mean.saturating_add(LABEL_BYTES),
        feature_type: FeatureType::F32,
        train: SplitInfo {
            num_samples: train.len(),
            ..SplitInfo::default()
        },
        test: SplitInfo {
            num_samples: test.len(),
            ..SplitInfo::default()
        },
        normalization: None,
        images: Some(ImageIndex {
            shape: options.shape,
            class_names,
            objects,
            train,
            test,
        }),
        text: None,
    };
    manifest.validate()?;
    Ok(manifest)
}

/// Writes `manifest.json` under `prefix`.
pub async fn write_manifest(
    store: &dyn ObjectStore,
    prefix: &Path,
    manifest: &Manifest,
) -> Result<(), DatasetError> {
    manifest.validate()?;
    let json = serde_json::to_vec(manifest)
        .map_err(|e| DatasetError::Manifest(format!("cannot encode: {e}")))?;
    store
        .put_opts(
            &prefix.clone().join(MANIFEST_NAME),
            PutPayload::from(json),
            PutOptions::default(),
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use object_store::memory::InMemory;

    use super::*;

    fn options() -> IndexOptions {
        IndexOptions {
            name: "t".into(),
            shape: [1, 2, 2],
            skip_bad: false,
        }
    }

    #[tokio::test]
    async fn a_missing_shard_and_a_glob_have_their_own_messages() {
        let store = InMemory::new();
        let prefix = Path::from("wds");
        let err = index_webdataset(&store, &prefix, "train-{0..1}.tar", None, &options())
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, DatasetError::MissingObject { object, .. } if object.starts_with("train-"))
                && text.contains("WebDataset shard train-")
                && text.contains("does not exist")
                && !text.contains("corrupt"),
            "{text}"
        );
        let err = index_webdataset(&store, &prefix, "train-*.tar", None, &options())
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, DatasetError::Glob(p) if p == "train-*.tar")
                && text.contains("glob patterns")
                && text.contains("{0000..0009}")
                && !text.contains("corrupt"),
            "{text}"
        );
    }
}

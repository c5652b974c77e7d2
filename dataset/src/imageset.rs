//! Image sets for tests and demos, never committed: MNIST written as PNG
//! files, and a learnable synthetic colour set of shapes (JPEG) of any size,
//! written as WebDataset shards or class folders and then indexed.

use object_store::path::Path;
use object_store::{ObjectStore, PutOptions, PutPayload};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::format::*;
use crate::image::{encode_image, EncodeAs};
use crate::index::{index_class_folders, index_webdataset, write_manifest, IndexOptions};
use crate::webdataset::{pack_shard, PackSample};

/// One encoded image and its label.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedImage {
    pub bytes: Vec<u8>,
    /// File extension (`png`, `jpg`).
    pub ext: &'static str,
    pub label: u32,
}

/// Encodes feature rows (values in `[0, 1]`, `shape` each) as images.
pub fn encode_samples(
    samples: &[Sample],
    shape: [usize; 3],
    format: EncodeAs,
) -> Result<Vec<EncodedImage>, DatasetError> {
    samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Ok(EncodedImage {
                bytes: encode_image(&s.features, shape, format)
                    .map_err(|m| DatasetError::Invalid(format!("sample {i}: {m}")))?,
                ext: format.extension(),
                label: s.label,
            })
        })
        .collect()
}

/// Classes of [`synthetic_images`]: five shapes, each warm or cool.
pub const SHAPE_CLASSES: usize = 10;

/// `count` colour images `3 × size × size`, JPEG-encoded: class `c` is
/// shape `c / 2` (disc, square, triangle, ring, cross) in a warm (`c` even)
/// or cool colour, at a random place, size and shade on a noisy background.
pub fn synthetic_images(count: usize, size: usize, seed: u64) -> Vec<EncodedImage> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|i| {
            let label = (i % SHAPE_CLASSES) as u32;
            let chw = shape_image(label, size, &mut rng);
            EncodedImage {
                bytes: encode_image(&chw, [3, size, size], EncodeAs::Jpeg(90))
                    .expect("a generated image has a valid shape"),
                ext: "jpg",
                label,
            }
        })
        .collect()
}

fn shape_image(label: u32, size: usize, rng: &mut StdRng) -> Vec<f32> {
    let s = size as f32;
    let plane = size * size;
    let mut img = vec![0.0f32; 3 * plane];
    let bg: f32 = rng.random_range(0.0..0.35);
    for v in img.iter_mut() {
        *v = (bg + rng.random_range(-0.08..0.08f32)).clamp(0.0, 1.0);
    }
    let warm = label.is_multiple_of(2);
    let shade: f32 = rng.random_range(0.65..1.0);
    let mix: f32 = rng.random_range(0.0..0.45);
    let colour = if warm {
        [shade, mix * shade, 0.1]
    } else {
        [0.1, mix * shade, shade]
    };
    let r = s * rng.random_range(0.22..0.34f32);
    let cx = s / 2.0 + rng.random_range(-0.12..0.12f32) * s;
    let cy = s / 2.0 + rng.random_range(-0.12..0.12f32) * s;
    for y in 0..size {
        for x in 0..size {
            let (dx, dy) = (x as f32 + 0.5 - cx, y as f32 + 0.5 - cy);
            let inside = match label / 2 {
                0 => dx * dx + dy * dy <= r * r,
                1 => dx.abs() <= r * 0.85 && dy.abs() <= r * 0.85,
                2 => dy <= r * 0.8 && dy >= -r && dx.abs() <= (dy + r) * 0.6,
                3 => {
                    let d = (dx * dx + dy * dy).sqrt();
                    d <= r && d >= r * 0.55
                }
                _ => {
                    (dx.abs() <= r * 0.3 && dy.abs() <= r) || (dy.abs() <= r * 0.3 && dx.abs() <= r)
                }
            };
            if inside {
                for (ch, c) in colour.iter().enumerate() {
                    img[ch * plane + y * size + x] = *c;
                }
            }
        }
    }
    img
}

/// How [`write_image_set`] lays the images out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageSetLayout {
    /// `train-0000.tar`, ... with this many samples per shard.
    WebDataset { per_shard: usize },
    /// `train/<class>/<key>.<ext>`.
    ClassFolders,
}

/// Writes train and test images under `prefix`, indexes them and writes
/// the manifest. `class_names` names the folders (class folders only).
pub async fn write_image_set(
    store: &dyn ObjectStore,
    prefix: &Path,
    layout: ImageSetLayout,
    train: &[EncodedImage],
    test: &[EncodedImage],
    class_names: &[String],
    options: &IndexOptions,
) -> Result<Manifest, DatasetError> {
    let put = |rel: String, bytes: Vec<u8>| async move {
        let object = object_path(prefix, &rel).map_err(DatasetError::Invalid)?;
        store
            .put_opts(&object, PutPayload::from(bytes), PutOptions::default())
            .await?;
        Ok::<_, DatasetError>(())
    };
    let mut patterns = Vec::new();
    for (split, images) in [(Split::Train, train), (Split::Test, test)] {
        match layout {
            ImageSetLayout::WebDataset { per_shard } => {
                let chunks: Vec<&[EncodedImage]> = images.chunks(per_shard.max(1)).collect();
                for (k, chunk) in chunks.iter().enumerate() {
                    let keys: Vec<String> = (0..chunk.len())
                        .map(|j| format!("{:08}", k * per_shard.max(1) + j))
                        .collect();
                    let samples: Vec<PackSample<'_>> = chunk
                        .iter()
                        .zip(&keys)
                        .map(|(img, key)| PackSample {
                            key,
                            ext: img.ext,
                            image: &img.bytes,
                            label: img.label,
                        })
                        .collect();
                    let tar = pack_shard(&samples).map_err(DatasetError::Invalid)?;
                    put(format!("{}-{k:04}.tar", split.name()), tar).await?;
                }
                patterns.push((!chunks.is_empty()).then(|| match chunks.len() {
                    1 => format!("{}-0000.tar", split.name()),
                    n => format!("{}-{{0000..{:04}}}.tar", split.name(), n - 1),
                }));
            }
            ImageSetLayout::ClassFolders => {
                for (i, img) in images.iter().enumerate() {
                    let class = class_names.get(img.label as usize).ok_or_else(|| {
                        DatasetError::Invalid(format!("label {} has no class name", img.label))
                    })?;
                    put(
                        format!("{}/{class}/{i:08}.{}", split.name(), img.ext),
                        img.bytes.clone(),
                    )
                    .await?;
                }
            }
        }
    }
    let (manifest, _) = match layout {
        ImageSetLayout::WebDataset { .. } => {
            let train = patterns
                .first()
                .cloned()
                .flatten()
                .ok_or_else(|| DatasetError::Invalid("no training images to write".into()))?;
            let test = patterns.get(1).cloned().flatten();
            index_webdataset(store, prefix, &train, test.as_deref(), options).await?
        }
        ImageSetLayout::ClassFolders => index_class_folders(store, prefix, options).await?,
    };
    write_manifest(store, prefix, &manifest).await?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{index_class_folders, index_webdataset};
    use crate::{DatasetReader, Layout};
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;
    use std::sync::Arc;

    fn options(shape: [usize; 3]) -> IndexOptions {
        IndexOptions {
            name: "t".into(),
            shape,
            skip_bad: false,
        }
    }

    #[tokio::test]
    async fn both_layouts_round_trip_through_the_reader() {
        let train = synthetic_images(25, 12, 1);
        let test = synthetic_images(10, 12, 2);
        let names: Vec<String> = (0..SHAPE_CLASSES).map(|c| format!("c{c}")).collect();
        for layout in [
            ImageSetLayout::WebDataset { per_shard: 10 },
            ImageSetLayout::ClassFolders,
        ] {
            let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
            let prefix = Path::from("imgs");
            let m = write_image_set(
                store.as_ref(),
                &prefix,
                layout,
                &train,
                &test,
                &names,
                &options([3, 12, 12]),
            )
            .await
            .unwrap();
            assert_eq!(
                (m.train.num_samples, m.test.num_samples, m.features),
                (25, 10, 432)
            );
            let reader = DatasetReader::open(store.clone(), prefix.clone())
                .await
                .unwrap();
            assert!(reader.layout().is_images());
            let all = reader.fetch_all(Split::Test).await.unwrap();
            assert_eq!((all.len(), all.dim), (10, 432));
            // Class folders sort by class name, so compare label multisets.
            let mut got = all.labels.clone();
            let mut want: Vec<u32> = test.iter().map(|t| t.label).collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "{layout:?}");
            if let ImageSetLayout::WebDataset { .. } = layout {
                assert_eq!(m.layout, Layout::WebDataset);
                assert_eq!(all.labels, test.iter().map(|t| t.label).collect::<Vec<_>>());
            }

            // Every image has the checksum of its bytes; an image changed
            // since is reported by name, with its object, and not decoded.
            let index = m.images.as_ref().unwrap();
            let e = &index.test[3];
            let object = object_path(&prefix, &index.objects[e.object as usize]).unwrap();
            let body = store.get(&object).await.unwrap().bytes().await.unwrap();
            let (at, len) = (e.offset as usize, e.len as usize);
            assert_eq!(e.crc32, Some(crc32(&body[at..at + len])));
            assert!(index
                .train
                .iter()
                .chain(&index.test)
                .all(|e| e.crc32.is_some()));
            let mut bent = body.to_vec();
            bent[at + len / 2] ^= 0x10;
            store.put(&object, bent.into()).await.unwrap();
            let err = reader.fetch(Split::Test, &[3]).await.unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(&err, DatasetError::Corrupt { object: o, permanent: true, .. } if *o == object.to_string()),
                "{msg}"
            );
            assert!(
                msg.contains(&e.key) && msg.contains("test sample 3 fails its checksum"),
                "{msg}"
            );
        }
    }

    fn put(store: &Arc<dyn ObjectStore>, rel: &str, bytes: Vec<u8>) {
        futures::executor::block_on(store.put_opts(
            &object_path(&Path::from("bad"), rel).unwrap(),
            PutPayload::from(bytes),
            PutOptions::default(),
        ))
        .unwrap();
    }

    #[tokio::test]
    async fn bad_shards_and_folders_are_named_and_leave_nothing_half_done() {
        let img = synthetic_images(3, 8, 3);
        let prefix = Path::from("bad");
        let opts = options([3, 8, 8]);
        let skip = IndexOptions {
            skip_bad: true,
            ..opts.clone()
        };

        // A tar member without a label.
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let mut tar = pack_shard(&[PackSample {
            key: "s0",
            ext: "jpg",
            image: &img[0].bytes,
            label: 1,
        }])
        .unwrap();
        let mut lone = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        h.set_size(img[1].bytes.len() as u64);
        h.set_mode(0o644);
        lone.append_data(&mut h, "s1.jpg", img[1].bytes.as_slice())
            .unwrap();
        let lone = lone.into_inner().unwrap();
        // Splice the labelless member in before the end-of-archive blocks.
        tar.truncate(tar.len() - 1024);
        tar.extend_from_slice(&lone);
        put(&store, "train-0000.tar", tar.clone());
        let err = index_webdataset(store.as_ref(), &prefix, "train-0000.tar", None, &opts)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train-0000.tar") && err.contains("`s1`") && err.contains("no label"),
            "{err}"
        );
        let (m, report) = index_webdataset(store.as_ref(), &prefix, "train-0000.tar", None, &skip)
            .await
            .unwrap();
        assert_eq!((m.train.num_samples, report.skipped.len()), (1, 1));

        // A truncated shard.
        put(&store, "train-0001.tar", tar[..tar.len() / 2].to_vec());
        let err = index_webdataset(
            store.as_ref(),
            &prefix,
            "train-{0000..0001}.tar",
            None,
            &skip,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train-0001.tar") && err.contains("truncated"),
            "{err}"
        );
        // A shard that is not there.
        let err = index_webdataset(store.as_ref(), &prefix, "train-0002.tar", None, &opts)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train-0002.tar") && err.contains("does not exist"),
            "{err}"
        );

        // A test class folder with no training folder.
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        put(&store, "train/cat/a.jpg", img[0].bytes.clone());
        put(&store, "train/dog/b.jpg", img[1].bytes.clone());
        put(&store, "test/cow/c.jpg", img[2].bytes.clone());
        let err = index_class_folders(store.as_ref(), &prefix, &opts)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("test/cow/c.jpg") && err.contains("`cow`"),
            "{err}"
        );
        let (m, report) = index_class_folders(store.as_ref(), &prefix, &skip)
            .await
            .unwrap();
        assert_eq!(
            (m.classes, m.test.num_samples, report.skipped.len()),
            (2, 0, 1)
        );
    }

    #[tokio::test]
    async fn a_corrupt_image_stops_or_is_skipped_as_configured() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let mut img = synthetic_images(4, 8, 5);
        // Same length, garbage bytes: only decoding can tell.
        img[2].bytes = vec![0x42; img[2].bytes.len()];
        let names: Vec<String> = (0..SHAPE_CLASSES).map(|c| c.to_string()).collect();
        let prefix = Path::from("c");
        write_image_set(
            store.as_ref(),
            &prefix,
            ImageSetLayout::WebDataset { per_shard: 4 },
            &img,
            &[],
            &names,
            &options([3, 8, 8]),
        )
        .await
        .unwrap();
        let reader = DatasetReader::open(store, prefix).await.unwrap();
        let indices = [0, 1, 2, 3];
        let reqs = reader
            .plan_requests(Split::Train, &indices, u64::MAX)
            .unwrap();
        let mut records = Vec::new();
        for r in &reqs {
            records.extend(reader.read_request(r).await.unwrap());
        }
        let err = reader
            .decode_batch(Split::Train, 0, &indices, &records)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train-0000.tar")
                && err.contains("sample 2")
                && err.contains("`00000002`"),
            "{err}"
        );
        let skipping = reader
            .with_image_pipeline(
                crate::image::ImagePipeline::new(Default::default(), 1, 2, true).unwrap(),
            )
            .unwrap();
        let out = skipping
            .decode_batch(Split::Train, 0, &indices, &records)
            .unwrap();
        assert_eq!((out.batch.len(), out.decoded, out.skipped.len()), (3, 4, 1));
        assert_eq!(
            out.batch.labels,
            vec![img[0].label, img[1].label, img[3].label]
        );
    }
}

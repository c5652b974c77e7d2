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
        store
            .put_opts(
                &prefix.clone().join_rel(&rel),
                PutPayload::from(bytes),
                PutOptions::default(),
            )
            .await
            .map(|_| ())
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

trait JoinRel {
    fn join_rel(self, rel: &str) -> Path;
}

impl JoinRel for Path {
    fn join_rel(self, rel: &str) -> Path {
        rel.split('/').fold(self, |p, part| p.join(part))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DatasetReader, Layout};
    use object_store::memory::InMemory;
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
            let reader = DatasetReader::open(store, prefix).await.unwrap();
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
        }
    }
}

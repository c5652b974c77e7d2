//! `ps-data images` and `ps-data index`: image sets
//! written as WebDataset shards or class folders, and the index that lets
//! the loader read images where they lie.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use ps_dataset::image::EncodeAs;
use ps_dataset::{
    clear_existing, encode_samples, index_class_folders, index_webdataset, open_bucket,
    read_mnist_csv, synthetic_images, train_test_split, write_image_set, write_manifest,
    EncodedImage, ImageEntry, ImageSetLayout, IndexOptions, SHAPE_CLASSES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ImageLayoutArg {
    /// Tar shards `train-0000.tar`, ... (`<key>.png|jpg` + `<key>.cls`).
    Webdataset,
    /// `train/<class>/<file>` and `test/<class>/<file>`, one object per image.
    ClassFolders,
}

/// Write an image set (your own folder of images packed as they are, MNIST
/// as PNG, or synthetic colour shapes as JPEG) and index it.
#[derive(Args, Debug)]
pub struct ImagesArgs {
    /// Bucket URL to write to.
    #[arg(long)]
    out: String,
    /// Replace a dataset already at --out (its manifest is deleted before
    /// anything new is written); without it an existing dataset is an error.
    #[arg(long)]
    overwrite: bool,
    /// MNIST CSV (e.g. data/mnist_5k.csv.gz): written as 28x28 grey PNGs.
    #[arg(long, conflicts_with = "synthetic")]
    mnist_csv: Option<PathBuf>,
    /// This many synthetic colour images of shapes (10 classes, JPEG).
    #[arg(long, conflicts_with = "from_folder")]
    synthetic: Option<usize>,
    /// A local folder of your own images, `DIR/train/<class>/<image>` and
    /// optionally `DIR/test/<class>/<image>` (.jpg, .jpeg, .png), packed
    /// as they are (no re-encoding); needs --shape.
    #[arg(long, conflicts_with = "mnist_csv")]
    from_folder: Option<PathBuf>,
    /// Decoded sample shape CHANNELS,HEIGHT,WIDTH for --from-folder.
    #[arg(long, value_delimiter = ',')]
    shape: Vec<usize>,
    /// Side of the synthetic images.
    #[arg(long, default_value_t = 32)]
    size: usize,
    /// Images held out for the test split (--mnist-csv, --synthetic).
    #[arg(long, default_value_t = 1000)]
    test: usize,
    #[arg(long, value_enum, default_value = "webdataset")]
    layout: ImageLayoutArg,
    /// Samples per tar shard (webdataset).
    #[arg(long, default_value_t = 1000)]
    per_shard: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// Index WebDataset shards or class folders in a bucket and write its
/// manifest.json there; the images are read in place afterwards.
#[derive(Args, Debug)]
pub struct IndexArgs {
    /// Bucket URL of the image set.
    #[arg(long)]
    url: String,
    #[arg(long, value_enum)]
    layout: ImageLayoutArg,
    /// Training shards relative to the URL, brace-expanded:
    /// `train-{0000..0099}.tar`; required with --layout webdataset (class
    /// folders are found under train/ and test/ without it).
    #[arg(long, required_if_eq("layout", "webdataset"))]
    train: Option<String>,
    /// Test shards (webdataset); none: no test split.
    #[arg(long)]
    test: Option<String>,
    /// Required: the decoded sample shape CHANNELS,HEIGHT,WIDTH (channels 1
    /// or 3), e.g. 3,32,32; images of other sizes are resized to it.
    #[arg(long, value_delimiter = ',', required = true)]
    shape: Vec<usize>,
    /// Leave out samples without a label, unknown test class folders and
    /// other bad entries (and list them) instead of stopping.
    #[arg(long)]
    skip_bad: bool,
    #[arg(long, default_value = "images")]
    name: String,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

pub fn images(a: ImagesArgs) -> anyhow::Result<()> {
    let layout = match a.layout {
        ImageLayoutArg::Webdataset => {
            if a.per_shard == 0 {
                bail!("--per-shard must be >= 1");
            }
            ImageSetLayout::WebDataset {
                per_shard: a.per_shard,
            }
        }
        ImageLayoutArg::ClassFolders => ImageSetLayout::ClassFolders,
    };
    let (train, test, shape, names, name) = match (a.mnist_csv, a.synthetic, a.from_folder) {
        (None, None, Some(dir)) => {
            let shape: [usize; 3] = a.shape.as_slice().try_into().map_err(|_| {
                anyhow::anyhow!("--from-folder needs --shape CHANNELS,HEIGHT,WIDTH")
            })?;
            let (train, test, names) = read_image_folder(&dir, shape)?;
            (train, test, shape, names, "images")
        }
        (Some(csv), None, None) => {
            let samples = read_mnist_csv(&csv)?;
            if a.test >= samples.len() {
                bail!(
                    "--test {} leaves no training images out of {}",
                    a.test,
                    samples.len()
                );
            }
            let (tr, te) = train_test_split(samples, a.test, a.seed);
            let shape = [1, 28, 28];
            (
                encode_samples(&tr, shape, EncodeAs::Png)?,
                encode_samples(&te, shape, EncodeAs::Png)?,
                shape,
                (0..10).map(|c| c.to_string()).collect::<Vec<_>>(),
                "mnist-png",
            )
        }
        (None, Some(n), None) => {
            if a.size < 8 || a.size > 512 {
                bail!("--size must be in 8..=512");
            }
            if a.test >= n {
                bail!("--test {} leaves no training images out of {n}", a.test);
            }
            let shape = [3, a.size, a.size];
            let names = ["disc", "square", "triangle", "ring", "cross"]
                .iter()
                .flat_map(|s| [format!("{s}-warm"), format!("{s}-cool")])
                .collect::<Vec<_>>();
            debug_assert_eq!(names.len(), SHAPE_CLASSES);
            (
                synthetic_images(n - a.test, a.size, a.seed),
                synthetic_images(a.test, a.size, a.seed ^ 0x5eed),
                shape,
                names,
                "shapes",
            )
        }
        _ => bail!("give one of --mnist-csv FILE, --synthetic N or --from-folder DIR"),
    };
    let (store, prefix) = open_bucket(&a.out).with_context(|| format!("opening {}", a.out))?;
    let options = IndexOptions {
        name: name.into(),
        shape,
        skip_bad: false,
    };
    let rt = runtime()?;
    rt.block_on(clear_existing(store.as_ref(), &prefix, a.overwrite))?;
    let manifest = rt.block_on(write_image_set(
        store.as_ref(),
        &prefix,
        layout,
        &train,
        &test,
        &names,
        &options,
    ))?;
    let bytes: u64 = train
        .iter()
        .chain(&test)
        .map(|i| i.bytes.len() as u64)
        .sum();
    ps_net::outln!(
        "wrote {name} to {}: {} train + {} test images ({} MB encoded), shape {:?}, {} classes, layout {}",
        a.out,
        manifest.train.num_samples,
        manifest.test.num_samples,
        bytes as f64 / 1e6,
        shape,
        manifest.classes,
        manifest.layout
    );
    Ok(())
}

/// Reads `dir/train/<class>/<image>` and `dir/test/<class>/<image>` through
/// the class-folder indexer (so the classes, the files taken and the errors
/// are those of `ps-data index --layout class-folders`), then the images.
fn read_image_folder(
    dir: &std::path::Path,
    shape: [usize; 3],
) -> anyhow::Result<(Vec<EncodedImage>, Vec<EncodedImage>, Vec<String>)> {
    if !dir.join("train").is_dir() {
        bail!("{} has no train/ folder", dir.display());
    }
    let url = dir.to_str().context("the folder's path is not UTF-8")?;
    let (store, prefix) = open_bucket(url)?;
    let options = IndexOptions {
        name: "images".into(),
        shape,
        skip_bad: false,
    };
    let rt = runtime()?;
    let (manifest, _) = rt.block_on(index_class_folders(store.as_ref(), &prefix, &options))?;
    let index = manifest
        .images
        .context("the class-folder index lists no images")?;
    let read = |entries: &[ImageEntry]| -> anyhow::Result<Vec<EncodedImage>> {
        entries
            .iter()
            .map(|e| {
                let rel = &index.objects[e.object as usize];
                let ext = if rel.to_ascii_lowercase().ends_with(".png") {
                    "png"
                } else {
                    "jpg"
                };
                let bytes = std::fs::read(dir.join(rel))
                    .with_context(|| format!("reading {}", dir.join(rel).display()))?;
                Ok(EncodedImage {
                    bytes,
                    ext,
                    label: e.label,
                })
            })
            .collect()
    };
    Ok((
        read(&index.train)?,
        read(&index.test)?,
        index.class_names.clone(),
    ))
}

pub fn index(a: IndexArgs) -> anyhow::Result<()> {
    let shape: [usize; 3] = a
        .shape
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("--shape takes CHANNELS,HEIGHT,WIDTH"))?;
    let (store, prefix) = open_bucket(&a.url).with_context(|| format!("opening {}", a.url))?;
    let options = IndexOptions {
        name: a.name,
        shape,
        skip_bad: a.skip_bad,
    };
    let rt = runtime()?;
    let started = std::time::Instant::now();
    let (manifest, report) = rt.block_on(async {
        match a.layout {
            ImageLayoutArg::Webdataset => {
                let Some(train) = a.train.as_deref() else {
                    bail!("--train PATTERN is required for webdataset (e.g. 'train-{{0000..0009}}.tar')");
                };
                Ok(index_webdataset(store.as_ref(), &prefix, train, a.test.as_deref(), &options).await?)
            }
            ImageLayoutArg::ClassFolders => {
                if a.train.is_some() || a.test.is_some() {
                    bail!("class folders are found under train/ and test/: drop --train and --test");
                }
                Ok(index_class_folders(store.as_ref(), &prefix, &options).await?)
            }
        }
    })?;
    rt.block_on(write_manifest(store.as_ref(), &prefix, &manifest))?;
    for why in &report.skipped {
        eprintln!("skipped: {why}");
    }
    ps_net::outln!(
        "indexed {}: {} train + {} test images in {} classes from {} objects ({:.1} MB read, {:.1} s); {} skipped; wrote manifest.json",
        a.url,
        manifest.train.num_samples,
        manifest.test.num_samples,
        manifest.classes,
        report.objects,
        report.bytes_read as f64 / 1e6,
        started.elapsed().as_secs_f64(),
        report.skipped.len()
    );
    Ok(())
}

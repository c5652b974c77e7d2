//! Image data read in place: a narrow ResNet-20 trains on MNIST written as
//! PNG files into WebDataset shards, and on synthetic colour shapes (JPEG)
//! in class folders, through the whole cluster (loader, decode pool,
//! augmentation, batch norm, servers).
//!
//! The MNIST test needs the 5k subset from `scripts/fetch-mnist.sh`; it
//! skips without it unless `STRATUS_REQUIRE_MNIST=1` (set by CI).

use std::sync::Arc;

use object_store::{memory::InMemory, path::Path, ObjectStore};
use ps_dataset::image::EncodeAs;
use ps_dataset::{
    encode_samples, read_mnist_csv, synthetic_images, train_test_split, write_image_set,
    ImageSetLayout, IndexOptions, Layout, SHAPE_CLASSES,
};
use ps_shared::config::{ClusterConfig, CompressionKind, ModelKind};
use ps_tests::{mnist_csv, repo_file, run_cluster};

/// A narrow ResNet-20 (width 0.25) for `shape` images, trained by 2 workers.
fn resnet_config(shape: [usize; 3], epochs: u64) -> ClusterConfig {
    let mut cfg = ClusterConfig::load(&repo_file("configs/resnet20.toml")).expect("resnet20.toml");
    cfg.cluster.servers = vec!["127.0.0.1:0".into()];
    cfg.cluster.workers = 2;
    cfg.model.kind = ModelKind::Resnet20;
    cfg.model.width = 0.25;
    cfg.model.in_channels = shape[0];
    cfg.model.input = shape.iter().product();
    cfg.model.classes = 10;
    cfg.data.batch_size = 32;
    cfg.data.decode_threads = 1;
    cfg.training.epochs = epochs;
    cfg.training.metrics_dir = String::new();
    // A 17k-parameter network: dense pushes (top-k is for large models).
    cfg.compression.kind = CompressionKind::None;
    cfg.optimizer.lr = 0.05;
    cfg.optimizer.weight_decay = 0.0;
    cfg.validate().expect("valid config");
    cfg
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn resnet_learns_mnist_png_from_webdataset_shards() {
    let Some(csv) = mnist_csv() else {
        return;
    };
    let (train, test) = train_test_split(read_mnist_csv(&csv).unwrap(), 1000, 7);
    let shape = [1, 28, 28];
    let train = encode_samples(&train, shape, EncodeAs::Png).unwrap();
    let test = encode_samples(&test, shape, EncodeAs::Png).unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let prefix = Path::from("mnist-wds");
    let options = IndexOptions {
        name: "mnist-png".into(),
        shape,
        skip_bad: false,
    };
    let names: Vec<String> = (0..10).map(|c| c.to_string()).collect();
    let manifest = block_on(write_image_set(
        store.as_ref(),
        &prefix,
        ImageSetLayout::WebDataset { per_shard: 500 },
        &train,
        &test,
        &names,
        &options,
    ))
    .unwrap();
    assert_eq!(manifest.layout, Layout::WebDataset);
    assert_eq!(manifest.images.as_ref().unwrap().objects.len(), 8 + 2);

    let cfg = resnet_config(shape, 2);
    let reports = run_cluster(cfg, store, prefix).expect("cluster run");
    let acc = reports[0].final_accuracy;
    let decoded: u64 = reports[0].epochs.iter().map(|e| e.images_decoded).sum();
    let per_core = reports[0]
        .epochs
        .last()
        .map_or(0.0, |e| e.images_per_core_s);
    let consumed = reports[0]
        .epochs
        .last()
        .map_or(0.0, |e| e.trainer_samples_per_s);
    println!(
        "MNIST as PNG from WebDataset shards, ResNet-20 x0.25: {:.2}% after {} steps; \
         {} images decoded at {:.0} images/s per decode thread; the trainer took {:.0} images/s",
        100.0 * acc,
        reports[0].steps,
        decoded,
        per_core,
        consumed
    );
    assert!(consumed > 0.0 && per_core > 0.0);
    // Each worker decodes its half of every epoch (the last partial batch
    // of each epoch is dropped).
    assert!(decoded >= 2 * (2000 - 32), "decoded {decoded}");
    assert!(acc > 0.85, "ResNet reached only {acc}");
}

#[test]
fn resnet_learns_colour_shapes_from_class_folders() {
    let size = 16;
    let shape = [3, size, size];
    let train = synthetic_images(2400, size, 1);
    let test = synthetic_images(400, size, 2);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let prefix = Path::from("shapes");
    let names: Vec<String> = (0..SHAPE_CLASSES)
        .map(|c| format!("class-{c:02}"))
        .collect();
    let options = IndexOptions {
        name: "shapes".into(),
        shape,
        skip_bad: false,
    };
    let manifest = block_on(write_image_set(
        store.as_ref(),
        &prefix,
        ImageSetLayout::ClassFolders,
        &train,
        &test,
        &names,
        &options,
    ))
    .unwrap();
    assert_eq!(manifest.layout, Layout::ClassFolders);
    assert_eq!(manifest.images.as_ref().unwrap().class_names, names);

    let mut cfg = resnet_config(shape, 4);
    cfg.data.augment.hflip = true;
    cfg.data.augment.pad = 2;
    let reports = run_cluster(cfg, store, prefix).expect("cluster run");
    let acc = reports[0].final_accuracy;
    println!(
        "colour shapes from class folders, ResNet-20 x0.25 with crop and flip: {:.2}% after {} steps \
         ({:.0} images/s per decode thread)",
        100.0 * acc,
        reports[0].steps,
        reports[0].epochs.last().map_or(0.0, |e| e.images_per_core_s)
    );
    // Ten classes: chance is 10%.
    assert!(acc > 0.55, "ResNet reached only {acc}");
}

//! The data plane end to end on small data: the loader over the simulated
//! bucket in both layouts, with tiny and generous caches, resumed mid-epoch,
//! with transient and persistent faults, and inside a whole worker run.
//!
//! Every batch is compared byte for byte with a direct read of the same
//! indices; nothing here looks at wall-clock times.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use ps_dataset::{
    synthetic, write_dataset_with, Batch, DatasetReader, Layout, Split, SyntheticSpec, WriteOptions,
};
use ps_shared::config::{CacheSize, ClusterConfig, CompressionKind};
use ps_shared::sampler::{EpochSampler, Partition, SamplerError};
use ps_worker::loader::{BatchPos, Loader, LoaderError, LoaderSettings, RetryPolicy};
use ps_worker::simstore::{SimSettings, SimStore};
use ps_worker::simulate::{SimBucketSection, Simulation};

const FEATURES: usize = 6;
/// 4-byte label plus the features.
const RECORD: u64 = 4 + 4 * FEATURES as u64;

/// A dataset of `train` samples in the bucket under `ds/`, behind a
/// simulated bucket without delays (counters and faults only).
async fn bucket(layout: Layout, train: usize) -> (Arc<InMemory>, Arc<SimStore>, Path) {
    let spec = SyntheticSpec {
        train,
        test: 8,
        features: FEATURES,
        classes: 3,
        seed: 5,
        label_noise: 0.0,
    };
    let (tr, te) = synthetic(&spec);
    let raw = Arc::new(InMemory::new());
    let prefix = Path::from("ds");
    let options = WriteOptions {
        layout,
        records_per_shard: 10,
    };
    write_dataset_with(raw.as_ref(), &prefix, "dp", FEATURES, 3, &tr, &te, &options)
        .await
        .expect("write dataset");
    let sim = Arc::new(SimStore::new(raw.clone(), SimSettings::instant()));
    (raw, sim, prefix)
}

/// A per-sample synthetic dataset of `train` and `test` samples (64
/// records a shard) named `name`, under the prefix `name` of a memory
/// bucket; written on a runtime of its own, for a test outside any.
fn per_sample_bucket(name: &str, train: usize, test: usize) -> (Arc<InMemory>, Path) {
    let spec = SyntheticSpec {
        train,
        test,
        ..SyntheticSpec::default()
    };
    let prefix = Path::from(name);
    let raw = Arc::new(InMemory::new());
    let (tr, te) = synthetic(&spec);
    let options = WriteOptions {
        layout: Layout::PerSample,
        records_per_shard: 64,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(write_dataset_with(
            raw.as_ref(),
            &prefix,
            name,
            spec.features,
            spec.classes,
            &tr,
            &te,
            &options,
        ))
        .expect("write dataset");
    (raw, prefix)
}

async fn open(store: Arc<dyn ObjectStore>, prefix: &Path) -> DatasetReader {
    DatasetReader::open(store, prefix.clone())
        .await
        .expect("open dataset")
}

/// Settings for tests: fast retries within a 5 s budget, everything else
/// as given.
fn settings(batch: usize, epochs: u64) -> LoaderSettings {
    let mut s = LoaderSettings::new(batch, epochs);
    s.retry = RetryPolicy {
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(20),
        outage_budget: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        seed: 3,
    };
    s
}

/// Takes every batch (bounded by `limit` calls).
async fn drain(
    loader: &mut Loader,
    limit: usize,
) -> Result<Vec<(BatchPos, Arc<Batch>)>, LoaderError> {
    let mut out = Vec::new();
    for _ in 0..limit {
        match loader.next().await? {
            Some(item) => out.push(item),
            None => return Ok(out),
        }
    }
    panic!("the loader gave more than {limit} batches");
}

/// Checks that `got` is exactly the batches of `sampler` from global step
/// `from` to the end of `epochs`, byte for byte against direct reads.
async fn check_batches(
    got: &[(BatchPos, Arc<Batch>)],
    sampler: &EpochSampler,
    batch: usize,
    epochs: u64,
    from: u64,
    direct: &DatasetReader,
) {
    let expected: Vec<(BatchPos, Vec<usize>)> = sampler
        .plan(batch, epochs)
        .batches_from(from)
        .into_iter()
        .map(|b| {
            (
                BatchPos {
                    epoch: b.epoch,
                    step: b.step,
                    first: b.first,
                    samples: Arc::from(b.samples.as_slice()),
                },
                b.samples,
            )
        })
        .collect();
    assert_eq!(got.len(), expected.len(), "number of batches");
    for ((pos, b), (want_pos, idx)) in got.iter().zip(&expected) {
        assert_eq!(pos, want_pos);
        let want = direct
            .fetch_batch(Split::Train, idx)
            .await
            .expect("direct read");
        assert_eq!(b.labels, want.labels, "labels of {pos:?}");
        let same_bits = b
            .features
            .iter()
            .zip(&want.features)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same_bits && b.features.len() == want.features.len(),
            "features of {pos:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_caches_lose_nothing() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (raw, sim, prefix) = bucket(layout, 97).await;
        let direct = open(raw.clone(), &prefix).await;
        let dir = tempfile::tempdir().unwrap();
        // Caches smaller than one batch (1 and 2 records), a window of one
        // batch and one request at a time: only slower, never wrong.
        for (memory, disk, window_bytes, requests) in [
            (RECORD, 2 * RECORD, 1, 1),
            (RECORD / 2, 0, 1, 2),
            (0, 3 * RECORD, 4 * RECORD, 64),
            (5 * RECORD / 2, RECORD, u64::MAX, 256),
        ] {
            let sampler = EpochSampler::new(97, 2, 1, 11).unwrap();
            let mut s = settings(8, 3);
            s.memory_cache_bytes = memory;
            s.disk_cache = (disk > 0).then(|| (dir.path().join("tier"), disk));
            s.max_inflight_bytes = window_bytes;
            s.max_inflight_requests = requests;
            s.lookahead_samples = 8;
            let mut loader =
                Loader::start(open(sim.clone(), &prefix).await, sampler.clone(), s).expect("start");
            let got = drain(&mut loader, 100).await.expect("run");
            check_batches(&got, &sampler, 8, 3, 0, &direct).await;
            // 97 samples, steps of 16 that straddle epoch ends: rank 1
            // takes 48 or 56 samples of batches labelled with each epoch.
            let plan = sampler.plan(8, 3);
            for epoch in 0..3 {
                let want: u64 = plan
                    .batches_from(0)
                    .iter()
                    .filter(|b| b.epoch == epoch)
                    .map(|b| b.samples.len() as u64)
                    .sum();
                assert!(want == 48 || want == 56, "{want}");
                let e = loader.stats().epoch(epoch);
                assert_eq!(e.samples, want, "{layout} epoch {epoch}");
                assert_eq!(e.memory_hits + e.disk_hits + e.bucket_samples, want);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_epochs_come_from_the_cache() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (raw, sim, prefix) = bucket(layout, 96).await;
        let direct = open(raw.clone(), &prefix).await;
        let dataset_bytes = 96 * RECORD;
        let dir = tempfile::tempdir().unwrap();
        // (memory, disk) as fractions of the dataset.
        for (memory, disk) in [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.25, 0.0)] {
            let sampler = EpochSampler::new(96, 1, 0, 4).unwrap();
            let mut s = settings(8, 3);
            // A window of one batch, so repeats are served by the cache tiers
            // and not by the window.
            s.lookahead_samples = 8;
            s.memory_cache_bytes = CacheSize::Fraction(memory).resolve(dataset_bytes);
            let disk_bytes = CacheSize::Fraction(disk).resolve(dataset_bytes);
            s.disk_cache = (disk_bytes > 0).then(|| (dir.path().join("d"), disk_bytes));
            let mut loader =
                Loader::start(open(sim.clone(), &prefix).await, sampler.clone(), s).expect("start");
            let got = drain(&mut loader, 100).await.expect("run");
            check_batches(&got, &sampler, 8, 3, 0, &direct).await;
            let stats = loader.stats();
            assert_eq!(stats.epoch(0).bucket_samples, 96, "cold first epoch");
            for epoch in 1..3 {
                let e = stats.epoch(epoch);
                let label = format!("{layout} memory {memory} disk {disk} epoch {epoch}");
                if memory + disk >= 1.0 {
                    // Everything fits: no GET after the first epoch.
                    assert_eq!((e.bucket_samples, e.gets), (0, 0), "{label}");
                    assert_eq!(e.memory_hits > 0, memory > 0.0, "{label}");
                    assert_eq!(e.disk_hits > 0, disk > 0.0, "{label}");
                } else {
                    // A quarter of the set: the cache keeps the samples needed
                    // soonest, so (at least) a quarter of each epoch is a hit.
                    assert!(e.memory_hits >= 24, "{label}: {e:?}");
                    assert!(e.bucket_samples <= 72, "{label}: {e:?}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_disk_cache_files_are_fetched_again() {
    let (raw, sim, prefix) = bucket(Layout::PerSample, 96).await;
    let direct = open(raw.clone(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    let sampler = EpochSampler::new(96, 1, 0, 6).unwrap();
    let mut s = settings(8, 2);
    s.lookahead_samples = 8;
    s.ready_batches = 1;
    s.disk_cache = Some((tier.clone(), 96 * RECORD));
    let mut loader =
        Loader::start(open(sim.clone(), &prefix).await, sampler.clone(), s).expect("start");
    let mut got = Vec::new();
    for _ in 0..12 {
        got.push(loader.next().await.expect("epoch 1").expect("a batch"));
    }
    // Epoch 1 is over. Once the pump is blocked (window and queue full) and
    // the queued disk writes are done, the tier stops changing; then damage
    // every file in it.
    let rec_files = || {
        std::fs::read_dir(&tier)
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "rec"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    tokio::time::timeout(Duration::from_secs(60), loader.settled())
        .await
        .expect("the loader comes to rest while nobody takes batches");
    let files = rec_files();
    for path in &files {
        std::fs::write(path, b"not a cache file").unwrap();
    }
    // At most the batches planned ahead were read (and dropped) already.
    assert!(files.len() >= 96 - 3 * 8, "{} files", files.len());
    got.extend(drain(&mut loader, 20).await.expect("epoch 2"));
    check_batches(&got, &sampler, 8, 2, 0, &direct).await;
    let e = loader.stats().epoch(1);
    // Every damaged file was read, found out, and its sample fetched again.
    assert_eq!(e.disk_errors, files.len() as u64, "{e:?}");
    assert_eq!(e.disk_hits + e.bucket_samples + e.memory_hits, 96);
}

fn rec_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "rec"))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Loader settings of the restart tests: one batch planned ahead, a disk
/// tier that holds the whole training split, no memory tier.
fn restart_settings(tier: &std::path::Path) -> LoaderSettings {
    let mut s = settings(8, 3);
    s.lookahead_samples = 8;
    s.ready_batches = 1;
    s.disk_cache = Some((tier.to_path_buf(), 96 * RECORD));
    s
}

/// A first run that stops after 6 of the 12 batches of epoch 0, as a worker
/// that is stopped or crashes. Returns the samples it fetched.
async fn interrupted_run(sim: &Arc<SimStore>, prefix: &Path, tier: &std::path::Path) -> u64 {
    let sampler = EpochSampler::new(96, 1, 0, 12).unwrap();
    let mut loader = Loader::start(
        open(sim.clone(), prefix).await,
        sampler,
        restart_settings(tier),
    )
    .expect("start");
    for _ in 0..6 {
        loader.next().await.expect("batch").expect("a batch");
    }
    tokio::time::timeout(Duration::from_secs(60), loader.settled())
        .await
        .expect("the loader comes to rest while nobody takes batches");
    let fetched = loader.stats().total().bucket_samples;
    loader.stop().await;
    fetched
}

/// Resumes the run of [`interrupted_run`] at batch 6 of epoch 0 with the disk
/// tier in `tier`; returns the bucket GETs it made and its counters.
async fn resumed_run(
    sim: &Arc<SimStore>,
    prefix: &Path,
    tier: &std::path::Path,
    direct: &DatasetReader,
) -> (u64, ps_worker::loader::EpochDataStats) {
    let sampler = EpochSampler::new(96, 1, 0, 12).unwrap();
    let reader = open(sim.clone(), prefix).await;
    sim.reset_stats();
    let mut loader =
        Loader::start_at(reader, sampler.clone(), restart_settings(tier), 6).expect("start");
    let got = drain(&mut loader, 100).await.expect("resumed run");
    check_batches(&got, &sampler, 8, 3, 6, direct).await;
    (sim.stats().gets, loader.stats().total())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_fetches_only_what_it_lacks() {
    let (raw, sim, prefix) = bucket(Layout::PerSample, 96).await;
    let direct = open(raw.clone(), &prefix).await;
    let dir = tempfile::tempdir().unwrap();

    // Without a disk tier left by a first run, the rest of the run fetches
    // every sample once (the tier holds them all after that).
    let (cold_gets, cold) = resumed_run(&sim, &prefix, &dir.path().join("cold"), &direct).await;
    assert_eq!((cold_gets, cold.gets, cold.disk_hits > 0), (96, 96, true));

    let tier = dir.path().join("tier");
    let fetched = interrupted_run(&sim, &prefix, &tier).await;
    let kept = rec_files(&tier).len() as u64;
    // Everything the first run fetched went to the disk tier and stayed.
    assert_eq!(kept, fetched);
    assert!((48..96).contains(&kept), "{kept} files");
    let (gets, stats) = resumed_run(&sim, &prefix, &tier, &direct).await;
    // One GET per sample in this layout: only the samples not on disk.
    assert_eq!(gets, 96 - kept, "GETs after the restart");
    assert_eq!(stats.gets, gets);
    assert_eq!(stats.disk_errors, 0);
    println!(
        "restart: {kept} of 96 samples reused from the disk tier; {gets} GETs instead of {cold_gets}"
    );

    // Damaged files are found out on reuse and fetched again: one with a
    // flipped byte, one holding another sample's (well-formed) file.
    let _ = interrupted_run(&sim, &prefix, &tier).await;
    let files = rec_files(&tier);
    let kept = files.len() as u64;
    let mut raw_file = std::fs::read(&files[0]).unwrap();
    let last = raw_file.len() - 1;
    raw_file[last] ^= 0x40;
    std::fs::write(&files[0], raw_file).unwrap();
    std::fs::copy(&files[2], &files[1]).unwrap();
    let (gets, stats) = resumed_run(&sim, &prefix, &tier, &direct).await;
    assert_eq!(stats.disk_errors, 2, "{stats:?}");
    assert_eq!(
        gets,
        96 - kept + 2,
        "the two damaged samples are fetched again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_dataset_does_not_reuse_the_disk_tier() {
    let (_, sim, prefix) = bucket(Layout::Shards, 96).await;
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    let kept = interrupted_run(&sim, &prefix, &tier).await;
    assert_eq!(rec_files(&tier).len() as u64, kept);
    // The same place, rewritten with other samples: another manifest.
    let spec = SyntheticSpec {
        train: 96,
        test: 8,
        features: FEATURES,
        classes: 3,
        seed: 6,
        label_noise: 0.0,
    };
    let (tr, te) = synthetic(&spec);
    let raw = Arc::new(InMemory::new());
    let options = WriteOptions {
        layout: Layout::Shards,
        records_per_shard: 10,
    };
    write_dataset_with(raw.as_ref(), &prefix, "dp", FEATURES, 3, &tr, &te, &options)
        .await
        .expect("write dataset");
    let other = Arc::new(SimStore::new(raw.clone(), SimSettings::instant()));
    let direct = open(raw.clone(), &prefix).await;
    let (_, stats) = resumed_run(&other, &prefix, &tier, &direct).await;
    // Nothing of the first dataset was served (the batches match the new
    // one byte for byte): every sample came from the bucket first.
    assert_eq!(stats.bucket_samples, 96, "{stats:?}");
    assert_eq!(stats.disk_errors, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_mid_epoch_matches_the_uninterrupted_run() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (raw, sim, prefix) = bucket(layout, 90).await;
        let direct = open(raw.clone(), &prefix).await;
        let sampler = EpochSampler::new(90, 2, 0, 21).unwrap();
        let mut full = Loader::start(
            open(sim.clone(), &prefix).await,
            sampler.clone(),
            settings(6, 3),
        )
        .expect("start");
        let full = drain(&mut full, 100).await.expect("full run");
        // 90 samples in global steps of 12: steps straddle epoch ends.
        let end = sampler.plan(6, 3).end_step();
        assert_eq!(end, 23);
        assert_eq!(full.len() as u64, end);
        for step in [4u64, 7, 8, 15, end - 1] {
            // A fresh sampler and loader, as after a restart.
            let again = EpochSampler::new(90, 2, 0, 21).unwrap();
            let mut s = settings(6, 3);
            s.memory_cache_bytes = 10 * RECORD;
            let mut resumed =
                Loader::start_at(open(sim.clone(), &prefix).await, again, s, step).expect("start");
            let resumed = drain(&mut resumed, 100).await.expect("resumed run");
            let skip = step as usize;
            assert_eq!(resumed.len(), full.len() - skip, "step {step}");
            for (a, b) in resumed.iter().zip(&full[skip..]) {
                assert_eq!(a.0, b.0);
                assert_eq!(a.1, b.1);
            }
            check_batches(&resumed, &sampler, 6, 3, step, &direct).await;
        }
        // A resume point from a run with another seed is refused.
        let other = EpochSampler::new(90, 2, 0, 22).unwrap();
        let err = Loader::start(
            open(sim.clone(), &prefix).await,
            other,
            settings(6, 3).resume_from(sampler.plan(6, 3).resume_point(5)),
        )
        .err()
        .expect("seed mismatch");
        assert!(
            matches!(err, LoaderError::Sampler(SamplerError::SeedMismatch { .. })),
            "{err}"
        );
        // Past the last step there is nothing to do.
        let mut done = Loader::start_at(
            open(sim.clone(), &prefix).await,
            sampler.clone(),
            settings(6, 3),
            end,
        )
        .expect("start");
        assert!(done.next().await.expect("end").is_none());
        // Resumed by 3 workers at step 5 of the 2-worker run, rank 2 takes
        // exactly the batches its plan from that point gives.
        let point = sampler.plan(6, 3).resume_point(5);
        let three = EpochSampler::new(90, 3, 2, 21).unwrap();
        let mut loader = Loader::start(
            open(sim.clone(), &prefix).await,
            three.clone(),
            settings(6, 3).resume_from(point),
        )
        .expect("start");
        let got = drain(&mut loader, 100).await.expect("resumed with 3");
        let want = three.plan_from(6, 3, point).unwrap().batches_from(5);
        assert_eq!(got.len(), want.len());
        assert_eq!(got[0].0.first, 60 + 12);
        for ((pos, _), w) in got.iter().zip(&want) {
            assert_eq!((pos.step, pos.first), (w.step, w.first));
            assert_eq!(&pos.samples[..], &w.samples[..]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_faults_are_retried() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (raw, sim, prefix) = bucket(layout, 60).await;
        let direct = open(raw.clone(), &prefix).await;
        let (first, second) = match layout {
            Layout::Shards => ("ds/train/shard-00000.bin", "ds/train/shard-00003.bin"),
            _ => ("ds/train/00000005.bin", "ds/train/00000031.bin"),
        };
        sim.fail_next(&Path::from(first), 2);
        sim.truncate_next(&Path::from(second), 1);
        let sampler = EpochSampler::new(60, 1, 0, 8).unwrap();
        let mut loader = Loader::start(
            open(sim.clone(), &prefix).await,
            sampler.clone(),
            settings(5, 2),
        )
        .expect("start");
        let got = drain(&mut loader, 100).await.expect("retries recover");
        check_batches(&got, &sampler, 5, 2, 0, &direct).await;
        let total = loader.stats().total();
        assert!(total.retries >= 3, "{layout}: {total:?}");
        let s = sim.stats();
        assert_eq!((s.injected_failures, s.injected_truncations), (2, 1));
        // The loader counts every GET it sends, retries included (the only
        // other GET is the manifest), and the ones that delivered.
        assert_eq!(total.get_attempts + 1, s.gets, "{layout}");
        assert_eq!(
            total.get_attempts - total.gets,
            3,
            "{layout}: three failed tries"
        );
        assert_eq!(total.retries, 3, "{layout}");
    }
    // Random failures at a 20% rate with enough retries.
    let (raw, _, prefix) = bucket(Layout::PerSample, 40).await;
    let mut flaky = SimSettings::instant();
    flaky.transient_error_rate = 0.2;
    flaky.seed = 99;
    let sim: Arc<dyn ObjectStore> = Arc::new(SimStore::new(raw.clone(), flaky));
    let s = settings(4, 2);
    let sampler = EpochSampler::new(40, 1, 0, 1).unwrap();
    // The manifest read may fail too; retry opening a few times.
    let mut reader = None;
    for _ in 0..20 {
        if let Ok(r) = DatasetReader::open(sim.clone(), prefix.clone()).await {
            reader = Some(r);
            break;
        }
    }
    let mut loader = Loader::start(reader.expect("manifest"), sampler.clone(), s).expect("start");
    let got = drain(&mut loader, 100).await.expect("flaky bucket");
    check_batches(&got, &sampler, 4, 2, 0, &open(raw, &prefix).await).await;
    assert!(loader.stats().total().retries > 0);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Damage {
    /// Cut to 7 bytes.
    Cut,
    Missing,
    /// Overwritten with random bytes of the same size.
    Scrambled,
}

/// `len` bytes that look random, the same for the same `seed`.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (ps_dataset::crc32(&(i ^ (seed << 32)).to_le_bytes()) >> 11) as u8)
        .collect()
}

/// A 60 s outage of the bucket in the middle of epoch 0 (on tokio's paused
/// clock): the loader keeps retrying within its 120 s budget and the
/// trainer gets exactly the batches of a run without the outage, so the
/// trained model and its accuracy are the same.
#[tokio::test(start_paused = true)]
async fn an_outage_mid_epoch_is_ridden_out() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (raw, sim, prefix) = bucket(layout, 60).await;
        let direct = open(raw.clone(), &prefix).await;
        let sampler = EpochSampler::new(60, 1, 0, 4).unwrap();
        let mut s = settings(5, 2);
        s.retry = RetryPolicy {
            outage_budget: Duration::from_secs(120),
            ..RetryPolicy::default()
        };
        // A short window and no cache: the second half of epoch 0 and all
        // of epoch 1 are fetched after the outage begins.
        s.lookahead_samples = 10;
        let mut loader =
            Loader::start(open(sim.clone(), &prefix).await, sampler.clone(), s).expect("start");
        let mut got = Vec::new();
        for _ in 0..6 {
            got.push(loader.next().await.expect("batch").expect("not the end"));
        }
        let before = sim.stats();
        let start = tokio::time::Instant::now();
        sim.outage(Duration::from_secs(60));
        got.extend(
            drain(&mut loader, 100)
                .await
                .expect("the run rides the outage out"),
        );
        check_batches(&got, &sampler, 5, 2, 0, &direct).await;
        // Trained on, the batches give the model and the accuracy of a run
        // without the outage.
        let mut calm = Loader::start(
            open(raw.clone(), &prefix).await,
            sampler.clone(),
            settings(5, 2),
        )
        .expect("start");
        let calm = drain(&mut calm, 100).await.expect("no outage");
        let test = direct.fetch_all(Split::Test).await.expect("the test split");
        let (with_outage, without) = (train_on(&got, &test), train_on(&calm, &test));
        assert_eq!(with_outage, without, "{layout}: same model, same accuracy");
        println!(
            "{layout}: a 60 s outage mid-epoch: {} batches, test accuracy {:.1}% and loss {:.4}, as without it",
            got.len(),
            100.0 * with_outage.1,
            with_outage.0
        );
        let failed = sim.stats().injected_failures - before.injected_failures;
        assert!(failed > 0, "{layout}: the outage hit requests");
        assert_eq!(loader.outage_log().failures(), failed, "{layout}");
        assert_eq!(loader.stats().total().retries, failed, "{layout}");
        assert!(tokio::time::Instant::now() - start >= Duration::from_secs(60));
    }
}

/// Trains a small MLP with plain SGD on `batches`, in order; returns its
/// (loss, accuracy) on `test`.
fn train_on(batches: &[(BatchPos, Arc<Batch>)], test: &Batch) -> (f32, f32) {
    let spec = ps_shared::config::ModelSection {
        input: FEATURES,
        hidden: vec![16],
        classes: 3,
        ..Default::default()
    };
    let cpu = ps_worker::model::device_from_str("cpu").expect("the cpu device");
    let mut model = ps_worker::model::Model::new(&spec, cpu, 1).expect("model");
    for (_, batch) in batches {
        let (_, grad) = model.gradient(batch).expect("gradient");
        let mut params = model.flat_params().expect("parameters");
        for (p, g) in params.iter_mut().zip(&grad) {
            *p -= 0.2 * g;
        }
        model.set_flat(&params).expect("set parameters");
    }
    model.evaluate(test).expect("evaluate")
}

/// What the progress bar shows during a 60 s outage (tokio's paused clock):
/// the loader's outage state turns on at the first failed GET after the
/// outage began, says how long the bucket has been unreachable against the
/// budget, and turns off once a GET gets through again.
#[tokio::test(start_paused = true)]
async fn the_outage_state_is_set_while_the_bucket_is_down() {
    let (_raw, sim, prefix) = bucket(Layout::PerSample, 60).await;
    let sampler = EpochSampler::new(60, 1, 0, 4).unwrap();
    let mut s = settings(5, 1);
    s.retry = RetryPolicy {
        outage_budget: Duration::from_secs(120),
        ..RetryPolicy::default()
    };
    s.lookahead_samples = 10;
    let mut loader = Loader::start(open(sim.clone(), &prefix).await, sampler, s).expect("start");
    let mut status = loader.outage_log().watch();
    for _ in 0..2 {
        loader.next().await.expect("batch").expect("not the end");
    }
    assert_eq!(*status.borrow_and_update(), None, "no outage yet");
    let start = tokio::time::Instant::now();
    sim.outage(Duration::from_secs(60));
    let mut seen = Vec::new();
    let watch = async {
        status.wait_for(Option::is_some).await.expect("outage seen");
        let outage = status.borrow_and_update().expect("set");
        seen.push((Some(outage), tokio::time::Instant::now()));
        status
            .wait_for(Option::is_none)
            .await
            .expect("recovery seen");
        seen.push((None, tokio::time::Instant::now()));
    };
    let (batches, ()) = futures::join!(drain(&mut loader, 100), watch);
    assert_eq!(batches.expect("the run rides the outage out").len(), 10);
    let [(Some(outage), set_at), (None, cleared_at)] = seen[..] else {
        panic!("{seen:?}");
    };
    assert!(
        outage.since >= start && outage.since <= set_at,
        "{outage:?}"
    );
    assert_eq!(outage.budget, Duration::from_secs(120));
    assert_eq!(
        outage.message(outage.since + Duration::from_secs(12)),
        "bucket unreachable 12 s (budget 120 s)"
    );
    assert!(cleared_at >= start + Duration::from_secs(60));
    assert_eq!(loader.outage_log().current(), None);
}

/// A bucket that hangs (its GETs never answer) instead of refusing: the
/// outage is reported at the first request's own deadline
/// (`request_timeout`), and the run stops when the budget, counted from
/// there, runs out; not 30 s late, and not a budget and a half.
#[tokio::test(start_paused = true)]
async fn a_hanging_bucket_is_reported_at_the_request_deadline() {
    let (_raw, sim, prefix) = bucket(Layout::PerSample, 40).await;
    let sampler = EpochSampler::new(40, 1, 0, 4).unwrap();
    let mut s = settings(5, 1);
    s.retry.request_timeout = Duration::from_secs(4);
    s.retry.outage_budget = Duration::from_secs(20);
    // A short window: most of the epoch is fetched after the hang begins.
    s.lookahead_samples = 10;
    let (timeout, budget) = (s.retry.request_timeout, s.retry.outage_budget);
    let mut loader = Loader::start(open(sim.clone(), &prefix).await, sampler, s).expect("start");
    let mut status = loader.outage_log().watch();
    loader.next().await.expect("batch").expect("not the end");
    let start = tokio::time::Instant::now();
    sim.hang(Duration::from_secs(3600));
    // Bounded on the (paused) clock, so a missing report fails, not hangs.
    let watch = tokio::time::timeout(Duration::from_secs(600), async {
        status.wait_for(Option::is_some).await.expect("outage seen");
        let outage = status.borrow_and_update().expect("set");
        (outage, tokio::time::Instant::now())
    });
    let (result, seen) = futures::join!(drain(&mut loader, 100), watch);
    let (outage, set_at) = seen.expect("the outage was reported");
    let err = result.expect_err("a hanging bucket past the budget");
    let ended = tokio::time::Instant::now();
    // The GETs in flight when the bucket began to hang were issued at
    // `start` or later (the window refills as batches are taken), so the
    // first deadline is at least `timeout` after it and, for a GET issued at
    // once, exactly then.
    assert!(set_at >= start + timeout, "{:?}", set_at - start);
    assert!(
        set_at <= start + timeout + Duration::from_millis(5),
        "{:?}",
        set_at - start
    );
    assert_eq!(outage.since, set_at);
    assert_eq!(outage.budget, budget);
    // The run stops when the budget ends, counted from the deadline.
    let lasted = ended - outage.since;
    assert!(
        lasted >= budget && lasted < budget + Duration::from_millis(50),
        "{lasted:?}"
    );
    let msg = err.to_string();
    assert!(
        matches!(&err, LoaderError::Outage { failing_s, .. } if *failing_s >= 20.0),
        "{msg}"
    );
    assert!(msg.contains("loader.request_timeout_s"), "{msg}");
}

/// An outage longer than the budget stops the run with an error that names
/// the object, how long the bucket was unreachable and the setting.
#[tokio::test(start_paused = true)]
async fn an_outage_past_the_budget_is_reported() {
    let (_raw, sim, prefix) = bucket(Layout::PerSample, 40).await;
    let sampler = EpochSampler::new(40, 1, 0, 4).unwrap();
    let mut loader =
        Loader::start(open(sim.clone(), &prefix).await, sampler, settings(5, 1)).expect("start");
    sim.outage(Duration::from_secs(600));
    let err = drain(&mut loader, 100)
        .await
        .expect_err("outage past the budget");
    let msg = err.to_string();
    assert!(
        matches!(&err, LoaderError::Outage { object, attempts, failing_s, .. }
            if object.starts_with("ds/train/") && *attempts > 1 && *failing_s >= 5.0),
        "{msg}"
    );
    assert!(msg.contains("loader.outage_budget_s"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_damage_is_a_clear_error() {
    for layout in [Layout::Shards, Layout::PerSample] {
        for damage in [Damage::Cut, Damage::Missing, Damage::Scrambled] {
            let (raw, sim, prefix) = bucket(layout, 50).await;
            let object = match layout {
                Layout::Shards => "ds/train/shard-00002.bin",
                _ => "ds/train/00000023.bin",
            };
            let path = Path::from(object);
            match damage {
                Damage::Missing => raw.delete(&path).await.map(drop).unwrap(),
                Damage::Cut => raw.put(&path, vec![1u8; 7].into()).await.map(drop).unwrap(),
                Damage::Scrambled => {
                    // Random bytes of the same size: only the checksums
                    // tell them from the records.
                    let size = raw.head(&path).await.unwrap().size;
                    raw.put(&path, noise(size as usize, 77).into())
                        .await
                        .map(drop)
                        .unwrap()
                }
            }
            let sampler = EpochSampler::new(50, 1, 0, 2).unwrap();
            let s = settings(5, 1);
            let mut loader =
                Loader::start(open(sim.clone(), &prefix).await, sampler, s).expect("start");
            let mut error = None;
            for _ in 0..20 {
                match loader.next().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            let err = error.expect("damaged object must fail the run");
            let msg = err.to_string();
            // A missing object, an object shorter than the manifest says (its
            // size, not just a short body) and a checksum mismatch are
            // permanent: no retry.
            let tries = 1;
            assert!(
                matches!(&err, LoaderError::Fetch { object: o, attempts, .. } if o == object && *attempts == tries),
                "{msg}"
            );
            assert!(
                msg.contains(object) && msg.contains(&format!("{tries} attempt")),
                "{msg}"
            );
            let why = match damage {
                Damage::Missing => "missing",
                Damage::Cut => "truncated",
                Damage::Scrambled => "fails its checksum",
            };
            assert!(msg.contains(why), "{msg}");
            // Later calls keep failing instead of pretending the run ended.
            let again = loader.next().await.expect_err("still failed");
            assert!(matches!(again, LoaderError::Stopped(_)), "{again}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loader_counters_match_the_bucket() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (_, sim, prefix) = bucket(layout, 80).await;
        let sampler = EpochSampler::new(80, 1, 0, 3).unwrap();
        sim.reset_stats();
        let mut s = settings(8, 2);
        s.lookahead_samples = 16;
        let mut loader =
            Loader::start(open(sim.clone(), &prefix).await, sampler, s).expect("start");
        drain(&mut loader, 100).await.expect("run");
        let total = loader.stats().total();
        let s = sim.stats();
        assert_eq!(total.gets + 1, s.gets, "{layout}: manifest + loader GETs");
        assert_eq!(total.gets, total.get_attempts, "{layout}: no failures");
        let manifest_bytes = s.bytes - total.bucket_bytes;
        assert!(manifest_bytes > 0 && manifest_bytes < 4096, "{layout}");
        // No cache: every sample of both epochs came from the bucket, but
        // for the few of epoch 1 that were still in the prefetch window
        // (at most a window's worth, counted as memory hits).
        assert_eq!(total.samples, 160);
        assert_eq!(total.disk_hits, 0);
        assert_eq!(total.bucket_samples + total.memory_hits, 160);
        assert!(total.memory_hits < 16, "{layout}: {total:?}");
        assert_eq!(total.bucket_bytes, total.bucket_samples * RECORD);
        if layout == Layout::PerSample {
            assert_eq!(total.gets, total.bucket_samples);
        } else {
            assert!(total.gets <= total.bucket_samples);
        }
    }
}

#[test]
fn worker_run_reports_data_plane_metrics() {
    let spec = SyntheticSpec {
        train: 512,
        test: 64,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = ps_tests::synthetic_bucket_blocking(&spec);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 3);
    cfg.cluster.workers = 1;
    cfg.training.metrics_dir = dir.path().join("runs").display().to_string();
    // A window of one batch: later epochs are served by the cache tiers.
    cfg.data.prefetch_batches = 1;
    cfg.loader.lookahead_batches = 1;
    cfg.loader.memory_cache = CacheSize::Fraction(0.25);
    cfg.loader.disk_cache = CacheSize::Fraction(0.25);
    cfg.loader.disk_cache_dir = dir.path().join("cache").display().to_string();
    cfg.validate().expect("valid config");
    // A simulated bucket in front of the store, as `--simulate` sets up.
    let sim = Simulation {
        bucket: Some(SimBucketSection {
            first_byte_ms: 1.0,
            per_connection_mb_per_s: 0.0,
            aggregate_gbit_per_s: 0.0,
            ..SimBucketSection::default()
        }),
        ..Simulation::default()
    };
    let reports = ps_tests::run_cluster_simulated(cfg, &sim, store, prefix).expect("cluster run");
    let r = &reports[0];
    assert_eq!(r.epochs.len(), 3);
    let first = &r.epochs[0];
    assert!(first.bucket_gets > 0 && first.bucket_bytes > 0);
    assert_eq!(first.memory_hit_rate + first.disk_hit_rate, 0.0);
    assert!(first.bucket_cost_usd > 0.0);
    for e in &r.epochs[1..] {
        assert!(e.memory_hit_rate > 0.0, "{e:?}");
        assert!(e.disk_hit_rate > 0.0, "{e:?}");
    }
    let jsonl = std::fs::read_to_string(dir.path().join("runs/worker-0.jsonl")).unwrap();
    // One record per epoch, besides the per-step records.
    let epoch_lines = jsonl
        .lines()
        .filter(|l| !l.contains("\"record\":\"step\""))
        .count();
    assert_eq!(epoch_lines, 3);
    assert!(jsonl.contains("\"bucket_gets\""));
    let csv = std::fs::read_to_string(dir.path().join("runs/worker-0.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for col in [
        "epoch",
        "data_wait_s",
        "bucket_gets",
        "bucket_bytes",
        "memory_hit_rate",
        "disk_hit_rate",
        "bucket_cost_usd",
    ] {
        assert!(header.contains(&col), "{col} missing from {header:?}");
    }
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.split(',').count() == header.len()));
    // At the end of the run no sample is needed any more: the disk tier
    // keeps only its (empty) index for the next run.
    let tier = dir.path().join("cache").join("rank-0");
    assert_eq!(rec_files(&tier), Vec::<std::path::PathBuf>::new());
    let left: Vec<_> = std::fs::read_dir(&tier)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("index.json")]);
}

/// `ps-data plot` on a real run's metrics: a two-worker run writes its
/// JSONL, and every chart drawn from it is a PNG of the chart size with a
/// drawing on it (many colours: axes, text, one line per worker and measure).
#[test]
fn plots_are_drawn_from_a_real_runs_metrics() {
    let spec = SyntheticSpec {
        train: 512,
        test: 64,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = ps_tests::synthetic_bucket_blocking(&spec);
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 3);
    cfg.training.metrics_dir = runs.display().to_string();
    cfg.validate().expect("valid config");
    let reports = ps_tests::run_cluster(cfg, store, prefix).expect("cluster run");
    assert_eq!(reports.len(), 2);

    let out = runs.join("plots");
    let written = ps_data::plot::plot_run_dir(&runs, &out).expect("plot");
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // The epoch charts, then the step charts (the run writes per-step
    // records every training.step_metrics_every steps).
    let expected: Vec<&str> = ps_data::plot::chart_files()
        .chain(ps_data::plot::step_chart_files())
        .collect();
    assert_eq!(names, expected);
    assert!(expected.contains(&"loss.png") && expected.contains(&"bucket_cost.png"));
    let (width, height) = ps_data::plot::CHART_SIZE;
    for (path, name) in written.iter().zip(&names) {
        let decoder = png::Decoder::new(std::io::BufReader::new(
            std::fs::File::open(path).expect("chart file"),
        ));
        let mut reader = decoder.read_info().expect("a PNG header");
        let mut pixels = vec![0; reader.output_buffer_size().expect("buffer size")];
        let frame = reader.next_frame(&mut pixels).expect("PNG data");
        assert_eq!((frame.width, frame.height), (width, height), "{path:?}");
        let pixels = &pixels[..frame.buffer_size()];
        let step = frame.color_type.samples();
        let mut colours: Vec<&[u8]> = pixels.chunks(step).collect();
        colours.sort_unstable();
        colours.dedup();
        let ink = pixels
            .chunks(step)
            .filter(|p| p.iter().any(|&c| c < 200))
            .count();
        assert!(colours.len() > 20, "{path:?}: {} colours", colours.len());
        assert!(ink > 2_000, "{path:?}: {ink} dark pixels");
        println!("{name}: {} colours, {ink} dark pixels", colours.len());
    }
    // The JSONL epochs the charts were drawn from count from 1, as the
    // console does.
    let jsonl = std::fs::read_to_string(runs.join("worker-1.jsonl")).unwrap();
    let epochs: Vec<u64> = jsonl
        .lines()
        .filter(|l| !l.contains("\"record\":\"step\""))
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["epoch"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(epochs, [1, 2, 3]);
}

/// A whole worker run over a per-sample dataset: the report's GET counters
/// (data, manifest, test split; attempts and successes) add up exactly to
/// the bucket's own request count, failed requests included.
#[test]
fn worker_counts_every_get_it_sends() {
    let (raw, prefix) = per_sample_bucket("ps", 256, 32);
    let sim = Arc::new(SimStore::new(raw, SimSettings::instant()));
    // Two failed tries of a training sample and one of the manifest.
    sim.fail_next(&Path::from("ps/train/00000007.bin"), 2);
    sim.fail_next(&Path::from("ps/manifest.json"), 1);
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 2);
    cfg.cluster.workers = 1;
    cfg.validate().expect("valid config");
    let reports = ps_tests::run_cluster(cfg, sim.clone(), prefix).expect("cluster run");
    let epochs = &reports[0].epochs;
    assert_eq!(epochs.len(), 2);
    let (first, second) = (&epochs[0], &epochs[1]);
    assert_eq!(first.bucket_manifest_gets, 1);
    assert_eq!(first.bucket_test_gets, 32, "one GET per test sample");
    assert_eq!(
        (second.bucket_manifest_gets, second.bucket_test_gets),
        (0, 0)
    );
    for e in epochs {
        assert_eq!(
            e.bucket_gets,
            e.bucket_data_gets + e.bucket_manifest_gets + e.bucket_test_gets
        );
    }
    let attempts: u64 = epochs.iter().map(|e| e.bucket_get_attempts).sum();
    let gets: u64 = epochs.iter().map(|e| e.bucket_gets).sum();
    let s = sim.stats();
    assert_eq!(s.injected_failures, 3);
    assert_eq!(attempts, s.gets, "every request the bucket saw is counted");
    assert_eq!(gets, s.gets - 3, "the failed ones are not successful GETs");
    // Epoch 0 fetched every training sample once (no cache hit is possible).
    assert_eq!(first.bucket_data_gets, 256);
}

/// With a cache as large as a rank's part, a stable partition serves every
/// later epoch from the cache; reshuffling across ranks cannot (each epoch
/// about half of a rank's samples were another rank's last epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stable_partition_keeps_the_cache_useful() {
    let (_raw, sim, prefix) = bucket(Layout::Shards, 96).await;
    let dataset_bytes = 96 * RECORD;
    let mut later_epoch_gets = Vec::new();
    for partition in [Partition::Reshuffle, Partition::Stable] {
        let mut bucket_samples = 0;
        for rank in 0..2 {
            let sampler = EpochSampler::new(96, 2, rank, 13)
                .unwrap()
                .with_partition(partition);
            let mut s = settings(8, 3);
            s.lookahead_samples = 8;
            s.memory_cache_bytes = CacheSize::Fraction(0.5).resolve(dataset_bytes);
            let mut loader =
                Loader::start(open(sim.clone(), &prefix).await, sampler, s).expect("start");
            let got = drain(&mut loader, 100).await.expect("run");
            assert_eq!(got.len(), 3 * 6);
            let stats = loader.stats();
            bucket_samples += stats.epoch(1).bucket_samples + stats.epoch(2).bucket_samples;
        }
        println!("{partition:?}: {bucket_samples} samples fetched again in epochs 2-3");
        later_epoch_gets.push(bucket_samples);
    }
    assert_eq!(
        later_epoch_gets[1], 0,
        "stable: every later epoch from the cache"
    );
    assert!(
        later_epoch_gets[0] >= 48,
        "reshuffle refetched only {}",
        later_epoch_gets[0]
    );
}

/// A worker resumed from a checkpoint mid-epoch fetches only the samples
/// from the resume step on: the bucket's own count of GETs (per-sample
/// layout, one GET per sample) is the manifest, the test split and exactly
/// the samples after the cut, and the worker's report counts every one.
#[test]
fn a_resumed_worker_fetches_only_from_the_resume_step() {
    const TRAIN: usize = 256;
    const TEST: usize = 32;
    let (raw, prefix) = per_sample_bucket("rs", TRAIN, TEST);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 1);
    cfg.cluster.workers = 1;
    cfg.server.checkpoint_url = format!("file://{}", dir.path().display());
    cfg.server.exit_when_done = false;
    cfg.validate().expect("valid config");
    let batch = cfg.data.batch_size as u64;
    let cut = 3u64;
    assert!(cut * batch < TRAIN as u64, "the cut is mid-epoch");
    let pki = ps_tests::TestPki::new(1);

    // Runs the worker against a fresh server (restored from the checkpoint
    // when there is one), stopped cleanly with a final checkpoint.
    let phase = |cfg: ClusterConfig, store: Arc<dyn ObjectStore>| {
        let pki = &pki;
        let prefix = prefix.clone();
        actix::System::new().block_on(async move {
            let mut cfg = cfg;
            let server = ps_tests::start_loopback_server(&cfg, pki).await;
            cfg.cluster.servers = vec![server.local_addr().to_string()];
            let report = tokio::time::timeout(
                ps_tests::CLUSTER_TIMEOUT,
                ps_worker::run::run_worker(&cfg, pki.options(0), store, prefix),
            )
            .await
            .expect("the worker finishes in time")
            .expect("worker run");
            server.shutdown().await;
            report
        })
    };
    let mut first = cfg.clone();
    first.training.max_steps = cut;
    let before = phase(first, raw.clone());
    assert_eq!(before.steps, cut);

    let sim = Arc::new(SimStore::new(raw, SimSettings::instant()));
    let after = phase(cfg, sim.clone());
    assert_eq!(after.start_step, cut);
    let samples_after = TRAIN as u64 - cut * batch;
    let gets = sim.stats().gets;
    assert_eq!(
        gets,
        1 + TEST as u64 + samples_after,
        "manifest + test split + the samples from the resume step on"
    );
    let counted: u64 = after.epochs.iter().map(|e| e.bucket_get_attempts).sum();
    assert_eq!(counted, gets, "the report counts every GET the bucket saw");
    let data: u64 = after.epochs.iter().map(|e| e.bucket_data_gets).sum();
    assert_eq!(data, samples_after);
}

/// A worker stopped by `max_steps` while its loader still has GETs in
/// flight: its report counts every GET the bucket saw, those the stop cut
/// short included (the epochs' counters only cover batches it reached).
#[test]
fn gets_in_flight_at_a_stop_are_counted() {
    let (raw, prefix) = per_sample_bucket("st", 512, 16);
    let sim = Arc::new(SimStore::new(raw, SimSettings::instant()));
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 2);
    cfg.cluster.workers = 1;
    cfg.training.max_steps = 2;
    cfg.loader.lookahead_batches = 0;
    cfg.loader.lookahead_samples = 512;
    // No request deadline ends a hung GET during the run.
    cfg.loader.request_timeout_s = 600.0;
    cfg.validate().expect("valid config");
    // Every training sample the two steps do not need never answers: the
    // lookahead has asked for those GETs when the run stops, whatever the
    // machine's speed, so they are in flight at the stop.
    let plan = EpochSampler::new(512, 1, 0, cfg.data.seed)
        .expect("sampler")
        .with_partition(cfg.data.partition)
        .plan(cfg.data.batch_size, cfg.training.epochs);
    let needed: HashSet<usize> = plan.batches_from(0)[..2]
        .iter()
        .flat_map(|b| b.samples.iter().copied())
        .collect();
    let hung = (0..512).filter(|i| !needed.contains(i)).count();
    for sample in (0..512).filter(|i| !needed.contains(i)) {
        sim.hang_next(
            &prefix
                .clone()
                .join("train")
                .join(format!("{sample:08}.bin")),
            u32::MAX,
        );
    }
    let reports = ps_tests::run_cluster(cfg, sim.clone(), prefix).expect("cluster run");
    let r = &reports[0];
    assert_eq!(r.steps, 2);
    let gets = sim.stats().gets;
    assert_eq!(r.bucket_gets_sent, gets, "every GET the bucket saw");
    let in_epochs: u64 = r.epochs.iter().map(|e| e.bucket_get_attempts).sum();
    assert!(
        in_epochs < gets,
        "the stop cut GETs short ({in_epochs} in the epochs, {gets} sent, {hung} samples never answer)"
    );
}

/// A dataset without a test split trains and reports "no test split"
/// (NaN, `null` in the JSONL), never an accuracy of 0%; asking for a target
/// accuracy on it is refused at start-up, naming the setting.
#[test]
fn a_dataset_without_a_test_split_reports_none() {
    let spec = SyntheticSpec {
        train: 256,
        test: 0,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = ps_tests::synthetic_bucket_blocking(&spec);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ps_tests::test_config(CompressionKind::None, 1.0, 1);
    cfg.cluster.workers = 1;
    cfg.training.metrics_dir = dir.path().display().to_string();
    cfg.validate().expect("valid config");
    let reports =
        ps_tests::run_cluster(cfg.clone(), store.clone(), prefix.clone()).expect("cluster run");
    let r = &reports[0];
    assert!(r.final_accuracy.is_nan(), "{}", r.final_accuracy);
    assert!(r.epochs.iter().all(|e| e.test_accuracy.is_nan()));
    assert_eq!(
        ps_worker::run::accuracy_text(r.final_accuracy, 2),
        "no test split"
    );
    let jsonl = std::fs::read_to_string(dir.path().join("worker-0.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(jsonl.lines().next().unwrap()).unwrap();
    assert!(line["test_accuracy"].is_null(), "{line}");

    cfg.training.target_accuracy = 0.9;
    cfg.training.metrics_dir = String::new();
    let err = ps_tests::run_cluster(cfg, store, prefix)
        .expect_err("a target accuracy needs a test split")
        .to_string();
    assert!(
        err.contains("training.target_accuracy") && err.contains("has none"),
        "{err}"
    );
}

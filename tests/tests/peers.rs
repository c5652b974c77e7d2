//! The peer cache tier end to end: several ranks' loaders, each with its
//! own QUIC peer endpoint (the cluster's mutual TLS), read one dataset in
//! the default reshuffled order. Every batch is compared byte for byte with
//! a direct read; the counters say where each sample came from.
//!
//! The ranks run at their own pace (no training step couples them); a rank
//! ahead of an owner waits for the owner's first read of a sample within the
//! peer timeout. Faults (a peer that stops, damages bytes, or answers too
//! slowly) must cost bucket reads only, never a wrong or missing batch.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use ps_dataset::{
    synthetic, write_dataset_with, Batch, DatasetReader, Layout, Split, SyntheticSpec, WriteOptions,
};
use ps_net::pki::ClusterCa;
use ps_shared::sampler::EpochSampler;
use ps_worker::comm::WorkerTls;
use ps_worker::countstore::CountingStore;
use ps_worker::loader::{BatchPos, EpochDataStats, Loader, LoaderSettings};
use ps_worker::peers::{PeerError, PeerFaults, PeerNet, PeerSettings};

const TRAIN: usize = 120;
const FEATURES: usize = 6;
const RECORD: u64 = 4 + 4 * FEATURES as u64;
const BATCH: usize = 5;
const EPOCHS: u64 = 3;
const SEED: u64 = 21;

async fn dataset() -> (Arc<InMemory>, Path) {
    let spec = SyntheticSpec {
        train: TRAIN,
        test: 8,
        features: FEATURES,
        classes: 3,
        seed: 4,
        label_noise: 0.0,
    };
    let (tr, te) = synthetic(&spec);
    let raw = Arc::new(InMemory::new());
    let prefix = Path::from("ds");
    let options = WriteOptions {
        layout: Layout::Shards,
        records_per_shard: 10,
    };
    write_dataset_with(
        raw.as_ref(),
        &prefix,
        "peers",
        FEATURES,
        3,
        &tr,
        &te,
        &options,
    )
    .await
    .expect("write dataset");
    (raw, prefix)
}

/// One rank's peer endpoint on loopback, port chosen by the system.
fn peer_net(
    ca: &ClusterCa,
    rank: u32,
    world: u32,
    dataset: (u32, u64),
    timeout: Duration,
    faults: PeerFaults,
) -> Arc<PeerNet> {
    let settings = PeerSettings {
        rank,
        world,
        addresses: Vec::new(),
        listen: "127.0.0.1:0".parse().unwrap(),
        max_inflight_requests: 4,
        max_request_samples: 16,
        timeout,
        retry_after: Duration::from_secs(600),
        max_serving: 8,
        dataset,
    };
    let tls = WorkerTls {
        ca_pem: ca.cert_pem().to_string(),
        identity: ca.issue_worker(rank).expect("worker certificate"),
    };
    PeerNet::start(settings, &tls, faults).expect("peer endpoint")
}

/// The endpoints of `world` ranks of a new cluster, each knowing where the
/// others are.
fn cluster_nets(
    world: u32,
    dataset: (u32, u64),
    timeout: Duration,
    faults: impl Fn(u32) -> PeerFaults,
) -> Vec<Arc<PeerNet>> {
    let ca = ClusterCa::generate("peers test CA").unwrap();
    cluster_nets_of(&ca, world, dataset, timeout, faults)
}

fn cluster_nets_of(
    ca: &ClusterCa,
    world: u32,
    dataset: (u32, u64),
    timeout: Duration,
    faults: impl Fn(u32) -> PeerFaults,
) -> Vec<Arc<PeerNet>> {
    let nets: Vec<_> = (0..world)
        .map(|r| peer_net(ca, r, world, dataset, timeout, faults(r)))
        .collect();
    let addresses: Vec<String> = nets
        .iter()
        .map(|n| n.local_addr().unwrap().to_string())
        .collect();
    for n in &nets {
        n.set_addresses(addresses.clone());
    }
    nets
}

/// Everything a rank's run gives back.
struct RankRun {
    batches: Vec<(BatchPos, Arc<Batch>)>,
    epochs: Vec<EpochDataStats>,
}

/// How one rank runs.
struct RankSpec {
    rank: usize,
    world: usize,
    /// Its memory tier, as a share of the dataset.
    cache_share: f64,
    net: Option<Arc<PeerNet>>,
    /// Stop after this many batches (`None`: the whole run).
    stop_after: Option<usize>,
    /// Wait here before letting the loader go (it serves until then).
    done: Option<Arc<Barrier>>,
    /// Meet the other ranks here after this many batches.
    meet: Option<(usize, Arc<Barrier>)>,
}

/// Runs a rank's loader to the end or until it is told to stop.
async fn run_rank(store: Arc<CountingStore>, prefix: Path, spec: RankSpec) -> RankRun {
    let RankSpec {
        rank,
        world,
        cache_share,
        net,
        stop_after,
        done,
        meet,
    } = spec;
    let reader = DatasetReader::open(store.clone() as Arc<dyn ObjectStore>, prefix)
        .await
        .expect("open");
    let sampler = EpochSampler::new(TRAIN, world, rank, SEED).unwrap();
    let mut s = LoaderSettings::new(BATCH, EPOCHS);
    s.lookahead_samples = 2 * BATCH;
    s.memory_cache_bytes = (cache_share * (TRAIN as u64 * RECORD) as f64) as u64;
    if let Some(net) = net {
        s = s.with_peers(net);
    }
    let mut loader = Loader::start(reader, sampler, s).expect("start");
    let mut batches = Vec::new();
    let limit = stop_after.unwrap_or(usize::MAX);
    for _ in 0..1000 {
        // Ranks can be made to meet after some batches.
        if let Some((after, barrier)) = &meet {
            if batches.len() == *after {
                barrier.wait().await;
            }
        }
        if batches.len() >= limit {
            break;
        }
        match loader.next().await.expect("loader") {
            Some(item) => batches.push(item),
            None => break,
        }
    }
    let stats = loader.stats();
    // A rank that finished keeps serving what it owns until every rank is
    // done (its loader lives until then).
    if let Some(done) = done {
        done.wait().await;
    }
    drop(loader);
    RankRun {
        batches,
        epochs: (0..EPOCHS).map(|e| stats.epoch(e)).collect(),
    }
}

/// Every batch is the sampler's, byte for byte.
async fn check(run: &RankRun, rank: usize, world: usize, direct: &DatasetReader) {
    let plan = EpochSampler::new(TRAIN, world, rank, SEED)
        .unwrap()
        .plan(BATCH, EPOCHS);
    let want = plan.batches_from(0);
    assert_eq!(run.batches.len(), want.len(), "rank {rank}: batches");
    for ((pos, got), w) in run.batches.iter().zip(&want) {
        assert_eq!(
            &pos.samples[..],
            &w.samples[..],
            "rank {rank} step {}",
            pos.step
        );
        let direct = direct
            .fetch_batch(Split::Train, &w.samples)
            .await
            .expect("direct read");
        assert_eq!(got.labels, direct.labels, "rank {rank} step {}", pos.step);
        assert!(
            got.features
                .iter()
                .zip(&direct.features)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "rank {rank} step {}: features",
            pos.step
        );
    }
}

async fn run_cluster(
    world: usize,
    cache_share: f64,
    peers: bool,
    timeout: Duration,
    faults: impl Fn(u32) -> PeerFaults,
    stop_after: impl Fn(usize) -> Option<usize>,
) -> (Vec<RankRun>, Vec<Arc<CountingStore>>, DatasetReader) {
    let (raw, prefix) = dataset().await;
    let direct = DatasetReader::open(raw.clone() as Arc<dyn ObjectStore>, prefix.clone())
        .await
        .unwrap();
    let manifest = direct.manifest_checksum();
    let nets = if peers {
        cluster_nets(world as u32, manifest, timeout, faults)
    } else {
        Vec::new()
    };
    let stores: Vec<_> = (0..world)
        .map(|_| Arc::new(CountingStore::new(raw.clone())))
        .collect();
    let mut tasks = Vec::new();
    let done = Arc::new(Barrier::new(world));
    for (rank, store) in stores.iter().enumerate() {
        let spec = RankSpec {
            rank,
            world,
            cache_share,
            net: nets.get(rank).cloned(),
            stop_after: stop_after(rank),
            done: Some(done.clone()),
            meet: None,
        };
        tasks.push(tokio::spawn(run_rank(store.clone(), prefix.clone(), spec)));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.expect("rank task"));
    }
    drop(nets);
    (runs, stores, direct)
}

fn later_bucket_samples(runs: &[RankRun]) -> u64 {
    runs.iter()
        .flat_map(|r| r.epochs[1..].iter())
        .map(|e| e.bucket_samples)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_serve_every_later_epoch_and_the_bucket_is_read_once() {
    // Each rank's memory holds 40% of the set: 3 ranks together hold it all.
    let timeout = Duration::from_secs(60);
    let (runs, stores, direct) =
        run_cluster(3, 0.4, true, timeout, |_| PeerFaults::default(), |_| None).await;
    for (rank, run) in runs.iter().enumerate() {
        check(run, rank, 3, &direct).await;
    }
    let first: u64 = runs.iter().map(|r| r.epochs[0].bucket_samples).sum();
    assert_eq!(first, TRAIN as u64, "epoch 0 reads every sample once");
    assert_eq!(
        later_bucket_samples(&runs),
        0,
        "no bucket reads after epoch 0: {:?}",
        runs.iter().map(|r| &r.epochs).collect::<Vec<_>>()
    );
    let later_gets: u64 = runs
        .iter()
        .flat_map(|r| r.epochs[1..].iter())
        .map(|e| e.gets)
        .sum();
    assert_eq!(later_gets, 0);
    let peer: u64 = runs
        .iter()
        .flat_map(|r| r.epochs.iter())
        .map(|e| e.peer_samples)
        .sum();
    assert!(peer > 0, "later epochs came from peers");
    for r in &runs {
        for e in &r.epochs {
            assert_eq!(e.peer_fallbacks, 0);
            assert_eq!(e.peer_errors, 0);
            assert_eq!(e.peer_damaged, 0);
        }
        assert!(r.epochs[1].peer_gets_saved > 0);
    }
    // The bucket's own count: only epoch 0's GETs (and the manifest).
    let data_gets: u64 = runs.iter().map(|r| r.epochs[0].gets).sum();
    let total: u64 = stores.iter().map(|s| s.counts().gets).sum();
    assert!(
        total >= data_gets && total <= data_gets + 3,
        "{total} GETs, {data_gets} for data"
    );

    // The same without peers: the reshuffle reads the bucket again.
    let (runs, _, _) =
        run_cluster(3, 0.4, false, timeout, |_| PeerFaults::default(), |_| None).await;
    assert!(
        later_bucket_samples(&runs) >= TRAIN as u64,
        "without peers, later epochs read {} samples again",
        later_bucket_samples(&runs)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_mid_run_costs_bucket_reads_only() {
    // All three ranks meet after the first epoch; then rank 1 stops (its
    // endpoint closes with its loader) and the others read what it owns
    // from the bucket.
    let per_epoch = TRAIN / (3 * BATCH);
    let timeout = Duration::from_secs(3);
    let (raw, prefix) = dataset().await;
    let direct = DatasetReader::open(raw.clone() as Arc<dyn ObjectStore>, prefix.clone())
        .await
        .unwrap();
    let nets = cluster_nets(3, direct.manifest_checksum(), timeout, |_| {
        PeerFaults::default()
    });
    let mut tasks = Vec::new();
    let done = Arc::new(Barrier::new(2));
    let meet = Arc::new(Barrier::new(3));
    for (rank, net) in nets.into_iter().enumerate() {
        let store = Arc::new(CountingStore::new(raw.clone()));
        let prefix = prefix.clone();
        let stop = (rank == 1).then_some(per_epoch);
        let done = (rank != 1).then(|| done.clone());
        let meet = Some((per_epoch, meet.clone()));
        tasks.push(tokio::spawn(async move {
            let spec = RankSpec {
                rank,
                world: 3,
                cache_share: 0.4,
                net: Some(net.clone()),
                stop_after: stop,
                done,
                meet,
            };
            let run = run_rank(store, prefix, spec).await;
            drop(net);
            run
        }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.expect("rank task"));
    }
    for rank in [0, 2] {
        check(&runs[rank], rank, 3, &direct).await;
    }
    assert_eq!(runs[1].batches.len(), per_epoch);
    let sum = |f: fn(&EpochDataStats) -> u64| -> u64 {
        [0, 2]
            .iter()
            .flat_map(|&r| runs[r].epochs[1..].iter())
            .map(f)
            .sum()
    };
    let owned_by_1 = (TRAIN / 3) as u64;
    assert!(
        sum(|e| e.peer_fallbacks) > 0,
        "the stopped peer's samples came from the bucket"
    );
    // In epochs 2 and 3 ranks 0 and 2 need about two thirds of rank 1's
    // samples each time, less what they got before it stopped (their
    // prefetch window): at least half of them in all.
    assert!(
        sum(|e| e.bucket_samples) >= owned_by_1 / 2,
        "{} samples from the bucket",
        sum(|e| e.bucket_samples)
    );
    assert!(
        sum(|e| e.peer_samples) > 0,
        "ranks 0 and 2 still serve each other"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_bytes_from_a_peer_are_caught_and_read_again() {
    let timeout = Duration::from_secs(60);
    let corrupt = |r: u32| PeerFaults {
        corrupt: r == 1,
        ..PeerFaults::default()
    };
    let (runs, _, direct) = run_cluster(3, 0.4, true, timeout, corrupt, |_| None).await;
    for (rank, run) in runs.iter().enumerate() {
        check(run, rank, 3, &direct).await;
    }
    let damaged: u64 = [0, 2]
        .iter()
        .flat_map(|&r| runs[r].epochs.iter())
        .map(|e| e.peer_damaged)
        .sum();
    assert!(damaged > 0, "the damaged records were noticed");
    // The honest owners still served.
    let from_peers: u64 = runs[1].epochs.iter().map(|e| e.peer_samples).sum();
    assert!(from_peers > 0, "rank 1 got samples from ranks 0 and 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_is_passed_over_for_the_bucket() {
    // Rank 2 answers after 30 s; the others give up after 200 ms.
    let slow = |r: u32| PeerFaults {
        delay: if r == 2 {
            Duration::from_secs(30)
        } else {
            Duration::ZERO
        },
        ..PeerFaults::default()
    };
    let (runs, _, direct) =
        run_cluster(3, 0.4, true, Duration::from_millis(200), slow, |_| None).await;
    for (rank, run) in runs.iter().enumerate() {
        check(run, rank, 3, &direct).await;
    }
    let timed_out: u64 = [0, 1]
        .iter()
        .flat_map(|&r| runs[r].epochs.iter())
        .map(|e| e.peer_errors)
        .sum();
    assert!(timed_out > 0, "asking the slow peer timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_clusters_own_ranks_are_served() {
    let (raw, prefix) = dataset().await;
    let direct = DatasetReader::open(raw as Arc<dyn ObjectStore>, prefix)
        .await
        .unwrap();
    let manifest = direct.manifest_checksum();
    let timeout = Duration::from_secs(5);
    let ca = ClusterCa::generate("peers test CA").unwrap();
    let ours = cluster_nets_of(&ca, 2, manifest, timeout, |_| PeerFaults::default());
    let rank0 = ours[0].local_addr().unwrap().to_string();
    // Our own rank gets through; with no loader attached, rank 0 says so.
    let e = ours[1].fetch(0, &[0, 1]).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Refused { message, .. } if message.contains("not serving")),
        "{e}"
    );
    // A worker of another cluster (another CA) is refused at the handshake.
    let other_ca = ClusterCa::generate("another cluster").unwrap();
    let stranger = peer_net(&other_ca, 1, 2, manifest, timeout, PeerFaults::default());
    stranger.set_addresses(vec![rank0.clone()]);
    let e = stranger.fetch(0, &[0, 1]).await.unwrap_err();
    assert!(matches!(e, PeerError::Transport { .. }), "{e}");
    // A certificate of our CA for a rank the cluster does not have.
    let outsider = peer_net(&ca, 7, 8, manifest, timeout, PeerFaults::default());
    outsider.set_addresses(vec![rank0.clone()]);
    let e = outsider.fetch(0, &[0]).await.unwrap_err();
    assert!(matches!(e, PeerError::Transport { .. }), "{e}");
    // One of ours reading another dataset is refused by name.
    let wrong = peer_net(
        &ca,
        1,
        2,
        (manifest.0 ^ 1, manifest.1),
        timeout,
        PeerFaults::default(),
    );
    wrong.set_addresses(vec![rank0]);
    let e = wrong.fetch(0, &[0]).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Refused { message, .. } if message.contains("another dataset")),
        "{e}"
    );
    assert_eq!(
        ours[0]
            .counters()
            .refused
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

/// A whole training cluster (servers, two workers) with `[peers]` on: the
/// workers read the bucket in the first epoch only, and train as well as
/// without the tier.
#[test]
fn a_training_cluster_with_peers_reads_the_bucket_in_the_first_epoch_only() {
    let spec = SyntheticSpec {
        train: 512,
        test: 128,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = ps_tests::synthetic_bucket_blocking(&spec);
    let mut cfg = ps_tests::test_config(ps_shared::config::CompressionKind::None, 1.0, 3);
    cfg.loader.memory_cache = ps_shared::config::CacheSize::Fraction(0.6);
    let plain = ps_tests::run_cluster(cfg.clone(), store.clone(), prefix.clone()).expect("run");
    cfg.peers.enabled = true;
    cfg.peers.listen_host = "127.0.0.1".into();
    cfg.peers.port = ps_tests::free_udp_port().min(u16::MAX - 2);
    cfg.validate().expect("valid config");
    let reports = ps_tests::run_cluster(cfg, store, prefix).expect("run with peers");
    for (r, p) in reports.iter().zip(&plain) {
        assert_eq!(r.epochs.len(), 3);
        assert!(r.epochs[0].bucket_data_gets > 0);
        for e in &r.epochs[1..] {
            assert_eq!(e.bucket_data_gets, 0, "rank {} epoch {}", r.rank, e.epoch);
            assert!(e.peer_hit_rate > 0.0);
            assert!(e.peer_saved_usd > 0.0);
            assert_eq!(e.peer_fallbacks, 0);
        }
        let later: u64 = p.epochs[1..].iter().map(|e| e.bucket_data_gets).sum();
        assert!(
            later > 0,
            "without peers rank {} reads the bucket again",
            p.rank
        );
        // The same samples in the same order: the same training.
        assert_eq!(r.final_accuracy, p.final_accuracy, "rank {}", r.rank);
    }
}

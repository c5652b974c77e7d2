//! `bench-peer-cache`: one cache for the whole cluster, measured in one run.
//!
//! `--workers` ranks read one dataset for `--epochs` epochs in lock step (a
//! barrier after every step, as BSP training does), each "computing" for
//! `--compute-ms` per batch, through a slow bucket: the store at `--url`
//! (an in-memory one by default, or a real S3-compatible server) behind the
//! simulated latency and bandwidth of `--first-byte-ms`,
//! `--per-connection-mb` and `--aggregate-gbit`. Each rank's memory tier
//! holds `--cache-share` of the dataset. Three runs, one after the other on
//! the same objects:
//!
//! * `reshuffle`: the default order, a new permutation every epoch, each
//!   rank caching for itself;
//! * `stable`: `data.partition = "stable"`, each rank re-reading its own part;
//! * `peer tier`: the default order with the peer cache tier (each rank's
//!   QUIC endpoint on loopback, the cluster's mutual TLS).
//!
//! Per run and epoch it prints the bucket GETs and bytes (counted by a store
//! wrapper under each rank, what the bucket bills), their estimated cost at
//! S3 Standard's list prices, the samples peers served and the bill they
//! saved, and the data wait: the time the slowest rank's loop waited for
//! its batches, summed over the epoch's steps. The targets (no bucket GET
//! after the first epoch with the peer tier; its data wait from the second
//! epoch on, as a share of the per-rank caches', no worse than stable's,
//! within one percentage point) are printed as PASS or MISS; nothing fails
//! on a time.
//!
//! ```text
//! cargo run --release -p ps-worker --bin bench-peer-cache
//! scripts/bench-peer-cache.sh          # the same through a local S3 server
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use tokio::sync::Barrier;

use ps_dataset::{
    synthetic, write_dataset_with, DatasetReader, Layout, SyntheticSpec, WriteOptions,
};
use ps_net::pki::ClusterCa;
use ps_shared::config::CostSection;
use ps_shared::sampler::{EpochSampler, Partition};
use ps_worker::comm::WorkerTls;
use ps_worker::countstore::CountingStore;
use ps_worker::loader::{EpochDataStats, Loader, LoaderSettings};
use ps_worker::peers::{PeerFaults, PeerNet, PeerSettings};
use ps_worker::simstore::{SimSettings, SimStore};

/// "No worse than stable": the peer tier's data wait in epochs >= 2, as a
/// share of the per-rank caches' (reshuffle), within this many percentage
/// points of stable partitioning's (timer noise on a shared machine).
const WAIT_TOLERANCE_POINTS: f64 = 1.0;

#[derive(Parser, Debug)]
#[command(
    name = "bench-peer-cache",
    about = "Bucket GETs, cost and data wait: per-rank caches against the peer tier"
)]
struct Args {
    /// Where the dataset is written and read: a bucket URL (s3://bucket/prefix
    /// with AWS_* variables for an S3-compatible server), or "memory".
    #[arg(long, default_value = "memory")]
    url: String,
    /// Ranks reading in lock step.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Training samples.
    #[arg(long, default_value_t = 1536)]
    samples: usize,
    /// Bytes of each sample (rounded to whole f32 features).
    #[arg(long, default_value_t = 16384)]
    sample_bytes: usize,
    /// Records per shard object.
    #[arg(long, default_value_t = 32)]
    records_per_shard: usize,
    #[arg(long, default_value_t = 3)]
    epochs: u64,
    /// Samples per rank and step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Simulated compute per batch, in milliseconds.
    #[arg(long, default_value_t = 20.0)]
    compute_ms: f64,
    /// Each rank's memory tier, as a share of the dataset.
    #[arg(long, default_value_t = 0.5)]
    cache_share: f64,
    /// Simulated time to first byte of every GET, in milliseconds.
    #[arg(long, default_value_t = 30.0)]
    first_byte_ms: f64,
    /// Simulated bandwidth of one GET, MB/s.
    #[arg(long, default_value_t = 20.0)]
    per_connection_mb: f64,
    /// Simulated bandwidth of the bucket for all GETs of a rank, Gbit/s.
    #[arg(long, default_value_t = 0.2)]
    aggregate_gbit: f64,
    /// Concurrent GETs per rank.
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Samples the loader plans ahead, in batches.
    #[arg(long, default_value_t = 4)]
    lookahead_batches: usize,
    /// Write the dataset only if the URL holds none yet (a bucket reused
    /// across invocations).
    #[arg(long)]
    reuse: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Reshuffle,
    Stable,
    Peers,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Reshuffle => "reshuffle",
            Mode::Stable => "stable",
            Mode::Peers => "peer tier",
        }
    }
}

/// One rank's run: per epoch, its loader's counters and its data wait.
struct RankResult {
    epochs: Vec<EpochDataStats>,
    wait_s: Vec<f64>,
    bucket_gets: u64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.workers < 2 {
        bail!("--workers must be >= 2: the peer tier needs peers");
    }
    if args.samples < args.workers * args.batch {
        bail!("--samples must hold at least one step (--workers x --batch)");
    }
    if !(args.cache_share > 0.0 && args.cache_share <= 1.0) {
        bail!("--cache-share must be in (0, 1]");
    }
    let (store, prefix) = open_store(&args.url)?;
    let features = (args.sample_bytes.saturating_sub(4) / 4).max(1);
    let exists = DatasetReader::open(store.clone(), prefix.clone())
        .await
        .is_ok();
    if !(args.reuse && exists) {
        let spec = SyntheticSpec {
            train: args.samples,
            test: 0,
            features,
            classes: 10,
            seed: 1,
            label_noise: 0.0,
        };
        let (train, test) = synthetic(&spec);
        let options = WriteOptions {
            layout: Layout::Shards,
            records_per_shard: args.records_per_shard.max(1),
        };
        let started = Instant::now();
        write_dataset_with(
            store.as_ref(),
            &prefix,
            "peer-cache",
            features,
            10,
            &train,
            &test,
            &options,
        )
        .await
        .context("writing the dataset")?;
        println!(
            "wrote {} samples of {} bytes to {} in {:.1} s",
            args.samples,
            4 + 4 * features,
            args.url,
            started.elapsed().as_secs_f64()
        );
    }
    let reader = DatasetReader::open(store.clone(), prefix.clone()).await?;
    let num_samples = reader.manifest().train.num_samples;
    let dataset_bytes = reader.manifest().total_bytes(ps_dataset::Split::Train);
    let prices = CostSection::default().cost_model();
    println!(
        "{} ranks, {num_samples} samples ({:.1} MB), {} epochs, batch {}, {} ms compute; each rank caches {:.0}% of the set ({:.0}% together); bucket: {} ms to first byte, {} MB/s per GET, {} Gbit/s per rank",
        args.workers,
        dataset_bytes as f64 / 1e6,
        args.epochs,
        args.batch,
        args.compute_ms,
        100.0 * args.cache_share,
        100.0 * args.cache_share * args.workers as f64,
        args.first_byte_ms,
        args.per_connection_mb,
        args.aggregate_gbit
    );
    let mut totals = Vec::new();
    println!();
    println!(
        "| run | epoch | bucket GETs | bucket MB | bucket cost $ | peer samples | saved by peers $ | data wait, slowest rank (s) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for mode in [Mode::Reshuffle, Mode::Stable, Mode::Peers] {
        let ranks = run_mode(&args, mode, store.clone(), &prefix, dataset_bytes).await?;
        let mut later_gets = 0;
        let mut wait_total = 0.0;
        let mut later_wait = 0.0;
        let mut cost_total = 0.0;
        for e in 0..args.epochs as usize {
            let mut sum = EpochDataStats::default();
            for r in &ranks {
                sum.add(&r.epochs[e]);
            }
            let wait = ranks.iter().map(|r| r.wait_s[e]).fold(0.0, f64::max);
            let cost = sum.cost(&prices);
            wait_total += wait;
            cost_total += cost;
            if e > 0 {
                later_gets += sum.gets;
                later_wait += wait;
            }
            println!(
                "| {} | {} | {} | {:.1} | {:.6} | {} | {:.6} | {:.2} |",
                mode.name(),
                e + 1,
                sum.gets,
                sum.bucket_bytes as f64 / 1e6,
                cost,
                sum.peer_samples,
                sum.peer_saved_cost(&prices),
                wait
            );
        }
        let sent: u64 = ranks.iter().map(|r| r.bucket_gets).sum();
        totals.push((mode, later_gets, later_wait, wait_total, cost_total, sent));
    }
    println!();
    println!("| run | GETs in epochs >= 2 | data wait, epochs >= 2 (s) | data wait, whole run (s) | bucket cost $ | GETs the bucket answered (all) |");
    println!("|---|---|---|---|---|---|");
    for (mode, later, lw, w, c, sent) in &totals {
        println!(
            "| {} | {later} | {lw:.2} | {w:.2} | {c:.6} | {sent} |",
            mode.name()
        );
    }
    let get = |m: Mode| totals.iter().find(|t| t.0 == m).copied();
    let (Some(re), Some(st), Some(pe)) =
        (get(Mode::Reshuffle), get(Mode::Stable), get(Mode::Peers))
    else {
        bail!("a run is missing");
    };
    println!();
    let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
    println!(
        "peer tier: {} bucket GETs in epochs >= 2 (reshuffle without it: {}) -> {}",
        pe.1,
        re.1,
        verdict(pe.1 == 0)
    );
    println!(
        "peer tier: bucket bill {:.2}x reshuffle's ({:.6} $ against {:.6} $)",
        ratio(pe.4, re.4),
        pe.4,
        re.4
    );
    // The first epoch reads the whole set from the bucket in every run;
    // the runs differ from the second on. Their data wait there, as a share
    // of what the per-rank caches waited (reshuffle), decides.
    let share = |w: f64| 100.0 * w / re.2.max(1e-9);
    println!(
        "peer tier: data wait in epochs >= 2 is {:.1}% of reshuffle's ({:.2} s of {:.2} s), stable's {:.1}% ({:.2} s) -> {} (within {WAIT_TOLERANCE_POINTS} point of stable's)",
        share(pe.2),
        pe.2,
        re.2,
        share(st.2),
        st.2,
        verdict(share(pe.2) <= share(st.2) + WAIT_TOLERANCE_POINTS)
    );
    println!(
        "whole run: data wait {:.2}x stable's ({:.2} s against {:.2} s; the first epoch's bucket reads dominate both)",
        ratio(pe.3, st.3),
        pe.3,
        st.3
    );
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

fn open_store(url: &str) -> anyhow::Result<(Arc<dyn ObjectStore>, Path)> {
    if url == "memory" {
        return Ok((Arc::new(InMemory::new()), Path::from("peer-cache")));
    }
    ps_shared::bucket::open_data_bucket(url).with_context(|| format!("opening {url}"))
}

async fn run_mode(
    args: &Args,
    mode: Mode,
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    dataset_bytes: u64,
) -> anyhow::Result<Vec<RankResult>> {
    let world = args.workers;
    let manifest = DatasetReader::open(store.clone(), prefix.clone())
        .await?
        .manifest_checksum();
    let nets = if mode == Mode::Peers {
        let ca = ClusterCa::generate("bench-peer-cache CA")?;
        let mut nets = Vec::new();
        for rank in 0..world as u32 {
            let settings = PeerSettings {
                rank,
                world: world as u32,
                addresses: Vec::new(),
                listen: "127.0.0.1:0".parse()?,
                max_inflight_requests: 8,
                max_request_samples: 256,
                timeout: Duration::from_secs(5),
                retry_after: Duration::from_secs(10),
                max_serving: 16,
                dataset: manifest,
            };
            let tls = WorkerTls {
                ca_pem: ca.cert_pem().to_string(),
                identity: ca.issue_worker(rank)?,
            };
            nets.push(PeerNet::start(settings, &tls, PeerFaults::default())?);
        }
        let addresses: Vec<String> = nets
            .iter()
            .map(|n| n.local_addr().map(|a| a.to_string()))
            .collect::<Result<_, _>>()?;
        for n in &nets {
            n.set_addresses(addresses.clone());
        }
        nets
    } else {
        Vec::new()
    };
    let barrier = Arc::new(Barrier::new(world));
    // Rank 0 has a batch at every step of the run.
    let steps = EpochSampler::new(
        DatasetReader::open(store.clone(), prefix.clone())
            .await?
            .manifest()
            .train
            .num_samples,
        world,
        0,
        7,
    )?
    .plan(args.batch, args.epochs)
    .end_step();
    let sim = SimSettings {
        first_byte: Duration::from_secs_f64(args.first_byte_ms / 1000.0),
        per_connection_bytes_per_s: args.per_connection_mb * 1e6,
        aggregate_bytes_per_s: args.aggregate_gbit * 1e9 / 8.0,
        transient_error_rate: 0.0,
        seed: 1,
    };
    let mut tasks = Vec::new();
    for rank in 0..world {
        let counted = Arc::new(CountingStore::new(Arc::new(SimStore::new(
            store.clone(),
            sim.clone(),
        ))));
        let reader =
            DatasetReader::open(counted.clone() as Arc<dyn ObjectStore>, prefix.clone()).await?;
        let partition = if mode == Mode::Stable {
            Partition::Stable
        } else {
            Partition::Reshuffle
        };
        let sampler = EpochSampler::new(reader.manifest().train.num_samples, world, rank, 7)?
            .with_partition(partition);
        let mut settings = LoaderSettings::new(args.batch, args.epochs);
        settings.lookahead_samples = args.lookahead_batches.max(1) * args.batch;
        settings.max_inflight_requests = args.inflight.max(1);
        settings.memory_cache_bytes = (args.cache_share * dataset_bytes as f64) as u64;
        if let Some(net) = nets.get(rank) {
            settings = settings.with_peers(net.clone());
        }
        let barrier = barrier.clone();
        let compute = Duration::from_secs_f64(args.compute_ms / 1000.0);
        let epochs = args.epochs;
        let counted_after = counted.clone();
        tasks.push(tokio::spawn(async move {
            let mut loader = Loader::start(reader, sampler, settings)?;
            let mut wait_s = vec![0.0; epochs as usize];
            // Every rank takes part in every step's barrier, also a rank
            // whose stream ended a step early.
            for _ in 0..steps {
                let t = Instant::now();
                let item = loader.next().await?;
                if let Some((pos, _batch)) = item {
                    if let Some(w) = wait_s.get_mut(pos.epoch as usize) {
                        *w += t.elapsed().as_secs_f64();
                    }
                    tokio::time::sleep(compute).await;
                }
                barrier.wait().await;
            }
            let stats = loader.stats();
            loader.stop().await;
            Ok::<_, anyhow::Error>(RankResult {
                epochs: (0..epochs).map(|e| stats.epoch(e)).collect(),
                wait_s,
                bucket_gets: counted_after.counts().gets,
            })
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.context("rank task")??);
    }
    drop(nets);
    Ok(out)
}

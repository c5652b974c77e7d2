//! `bench-loader`: the DELI comparison of data loaders in one run.
//!
//! On the same dataset and with the same consumer (a training loop that
//! "computes" for a fixed time per batch, here a sleep), it measures:
//!
//! * (a) straight from the simulated bucket: each batch is read when the
//!   consumer asks for it (its GETs concurrent), no cache, no prefetch;
//! * (b) from local disk (`LocalFileSystem`, no simulation), read the same way;
//! * (c) the Stratus loader over the simulated bucket with a cache of 25% of
//!   the dataset (10% memory tier + 15% disk tier) and a prefetch window of
//!   10% of the dataset (so at most 35% of the data is held locally);
//! * (d) the Stratus loader with no cache and a consumer that does not compute
//!   (faster than the link), to measure link utilisation (bytes delivered over
//!   the whole run's time, the first request's latency included); its window is
//!   four bandwidth-delay products of the simulated link, at most a quarter of
//!   the dataset (and at least (c)'s window).
//!
//! for two sample sizes: ~100 KB samples in the shard layout and ~3 KB
//! samples in the one-object-per-sample layout (the small-object hard case).
//! It prints data wait, totals, GETs, bytes, hit rates and the estimated
//! cost of each, then the targets with PASS or MISS. Nothing is asserted.
//!
//! ```text
//! cargo run --release -p ps-worker --bin bench-loader            # or scripts/bench-loader.sh
//! cargo run --release -p ps-worker --bin bench-loader -- --scenario small --epochs 3
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use serde::Serialize;

use ps_dataset::{
    synthetic, write_dataset_with, DatasetReader, Layout, Split, SyntheticSpec, WriteOptions,
};
use ps_shared::config::{CacheSize, CostModel, CostSection};
use ps_shared::sampler::EpochSampler;
use ps_worker::loader::{EpochDataStats, Loader, LoaderSettings};
use ps_worker::simstore::{SimSettings, SimStore};
use ps_worker::simulate::SimBucketSection;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    Large,
    Small,
    Both,
}

/// The DELI data-loader comparison over a simulated slow bucket.
#[derive(Parser, Debug)]
#[command(name = "bench-loader")]
struct Args {
    /// Which sample size to run.
    #[arg(long, value_enum, default_value_t = Which::Both)]
    scenario: Which,
    /// Epochs per run (>= 2 shows the cache at work).
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Consumer "compute" time per batch, in milliseconds.
    #[arg(long, default_value_t = 40.0)]
    compute_ms: f64,
    /// Samples of the ~100 KB set (shard layout).
    #[arg(long, default_value_t = 1536)]
    large_samples: usize,
    /// Samples of the ~3 KB set (per-sample layout).
    #[arg(long, default_value_t = 4096)]
    small_samples: usize,
    /// Cache of run (c) as a fraction of the dataset, split 40/60 between the
    /// memory and the disk tier.
    #[arg(long, default_value_t = 0.25)]
    cache_fraction: f64,
    /// Simulated first-byte latency per request, in milliseconds.
    #[arg(long, default_value_t = 50.0)]
    first_byte_ms: f64,
    /// Simulated bandwidth of one request, MB/s.
    #[arg(long, default_value_t = 50.0)]
    per_connection_mb_per_s: f64,
    /// Simulated bandwidth shared by all requests, Gbit/s.
    #[arg(long, default_value_t = 1.0)]
    aggregate_gbit_per_s: f64,
    /// Concurrent GETs of the Stratus loader.
    #[arg(long, default_value_t = 256)]
    inflight: usize,
    /// Prefetch window of run (c) as a fraction of the dataset (bytes of
    /// samples requested or fetched and not yet consumed).
    #[arg(long, default_value_t = 0.1)]
    window_fraction: f64,
    /// Prefetch window of the link run (d) in bandwidth-delay products of the
    /// simulated link (aggregate rate x first-byte latency), capped at a
    /// quarter of the dataset.
    #[arg(long, default_value_t = 4.0)]
    link_window_bdp: f64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Scenario {
    name: &'static str,
    samples: usize,
    features: usize,
    layout: Layout,
    records_per_shard: usize,
    batch: usize,
}

/// Timing and traffic of one run.
#[derive(Debug, Clone, Default, Serialize)]
struct RunResult {
    name: String,
    /// Per epoch: data wait and total time in seconds.
    epoch_wait_s: Vec<f64>,
    epoch_total_s: Vec<f64>,
    data_wait_s: f64,
    compute_s: f64,
    total_s: f64,
    batches: u64,
    gets: u64,
    bucket_bytes: u64,
    memory_hit_rate: f64,
    disk_hit_rate: f64,
    cost_usd: f64,
    per_epoch: Vec<EpochDataStats>,
}

#[derive(Debug, Clone, Serialize)]
struct ScenarioResult {
    scenario: String,
    record_bytes: usize,
    dataset_bytes: u64,
    runs: Vec<RunResult>,
    wait_reduction: f64,
    total_ratio_c_over_b: f64,
    link_utilisation: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let fraction = |f: f64| (0.0..=1.0).contains(&f);
    if args.epochs == 0 || !fraction(args.cache_fraction) || !fraction(args.window_fraction) {
        bail!("--epochs must be >= 1, --cache-fraction and --window-fraction in [0, 1]");
    }
    if !(args.link_window_bdp.is_finite() && args.link_window_bdp > 0.0) {
        bail!("--link-window-bdp must be > 0");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let sim = SimBucketSection {
        first_byte_ms: args.first_byte_ms,
        per_connection_mb_per_s: args.per_connection_mb_per_s,
        aggregate_gbit_per_s: args.aggregate_gbit_per_s,
        ..SimBucketSection::default()
    };
    sim.validate().map_err(anyhow::Error::msg)?;
    // The default [cost] prices of the cluster config.
    let prices = CostSection::default().cost_model();
    println!(
        "bucket simulation: {} ms to first byte, {} MB/s per connection, {} Gbit/s ({:.1} MB/s) shared; consumer computes {} ms per batch; {} epochs",
        args.first_byte_ms,
        args.per_connection_mb_per_s,
        args.aggregate_gbit_per_s,
        sim.aggregate_bytes_per_s() / 1e6,
        args.compute_ms,
        args.epochs
    );
    println!(
        "prices: ${} per 1000 GETs, ${} per GB egress; no delays are scaled",
        prices.per_1000_gets, prices.per_gb_egress
    );
    let mut scenarios = Vec::new();
    if matches!(args.scenario, Which::Large | Which::Both) {
        scenarios.push(Scenario {
            name: "100 KB samples, shard layout",
            samples: args.large_samples,
            features: 25_000,
            layout: Layout::Shards,
            records_per_shard: 64,
            batch: 32,
        });
    }
    if matches!(args.scenario, Which::Small | Which::Both) {
        scenarios.push(Scenario {
            name: "3 KB samples, one object per sample",
            samples: args.small_samples,
            features: 750,
            layout: Layout::PerSample,
            records_per_shard: 1,
            batch: 64,
        });
    }
    let scratch = std::env::temp_dir().join(format!("stratus-bench-loader-{}", std::process::id()));
    let mut results = Vec::new();
    let mut outcome = Ok(());
    for sc in &scenarios {
        match run_scenario(&args, &sim, &prices, sc, &scratch).await {
            Ok(r) => results.push(r),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    outcome?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}

async fn run_scenario(
    args: &Args,
    sim: &SimBucketSection,
    prices: &CostModel,
    sc: &Scenario,
    scratch: &std::path::Path,
) -> anyhow::Result<ScenarioResult> {
    let record_bytes = 4 + 4 * sc.features;
    let dataset_bytes = (sc.samples * record_bytes) as u64;
    let steps = sc.samples / sc.batch;
    println!();
    println!(
        "== {}: {} samples of {:.1} KB = {:.1} MB, batch {}, {} steps per epoch ==",
        sc.name,
        sc.samples,
        record_bytes as f64 / 1e3,
        dataset_bytes as f64 / 1e6,
        sc.batch,
        steps
    );
    if steps == 0 {
        bail!("fewer samples than one batch");
    }

    // The same dataset in the "bucket" (in memory, behind the simulation)
    // and on local disk.
    let spec = SyntheticSpec {
        train: sc.samples,
        test: 0,
        features: sc.features,
        classes: 10,
        seed: 3,
        label_noise: 0.0,
    };
    let t = Instant::now();
    let (train, test) = synthetic(&spec);
    let options = WriteOptions {
        layout: sc.layout,
        records_per_shard: sc.records_per_shard,
    };
    let bucket: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let prefix = Path::from("bench");
    let local_dir = scratch.join(format!("local-{}", sc.features));
    std::fs::create_dir_all(&local_dir)?;
    let local: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new_with_prefix(&local_dir)?);
    // The same dataset in the (simulated) bucket and on local disk.
    for store in [&bucket, &local] {
        write_dataset_with(
            store.as_ref(),
            &prefix,
            "bench",
            sc.features,
            10,
            &train,
            &test,
            &options,
        )
        .await?;
    }
    drop(train);
    println!(
        "dataset written to memory and {} in {:.1}s",
        local_dir.display(),
        t.elapsed().as_secs_f64()
    );

    let compute = Duration::from_secs_f64(args.compute_ms / 1000.0);
    let sampler = EpochSampler::new(sc.samples, 1, 0, 42)?;
    let settings = SimSettings::from_section(sim);

    // (a) straight from the simulated bucket.
    let sim_a = Arc::new(SimStore::new(bucket.clone(), settings.clone()));
    let reader = DatasetReader::open(sim_a.clone(), prefix.clone()).await?;
    sim_a.reset_stats();
    let mut a = on_demand(
        "(a) bucket, no cache/prefetch",
        &reader,
        &sampler,
        sc.batch,
        args.epochs,
        compute,
    )
    .await?;
    let s = sim_a.stats();
    a.gets = s.gets;
    a.bucket_bytes = s.bytes;
    a.cost_usd = prices.estimate(s.gets, s.bytes);

    // (b) local disk, no simulation.
    let reader = DatasetReader::open(local.clone(), prefix.clone()).await?;
    let b = on_demand(
        "(b) local disk",
        &reader,
        &sampler,
        sc.batch,
        args.epochs,
        compute,
    )
    .await?;

    // (c) the Stratus loader with a 25% cache.
    let sim_c = Arc::new(SimStore::new(bucket.clone(), settings.clone()));
    let reader = DatasetReader::open(sim_c.clone(), prefix.clone()).await?;
    let cache = CacheSize::Fraction(args.cache_fraction).resolve(dataset_bytes);
    let memory = cache * 2 / 5;
    let window = CacheSize::Fraction(args.window_fraction).resolve(dataset_bytes);
    let mut ls = loader_settings(args, sc.batch, args.epochs, window);
    ls.memory_cache_bytes = memory;
    ls.disk_cache = Some((
        scratch.join(format!("disk-cache-{}", sc.features)),
        cache - memory,
    ));
    println!(
        "(c) holds at most: memory tier {:.1} MB + disk tier {:.1} MB + prefetch window {:.1} MB = {:.0}% of the dataset",
        memory as f64 / 1e6,
        (cache - memory) as f64 / 1e6,
        window as f64 / 1e6,
        100.0 * (cache + window) as f64 / dataset_bytes as f64
    );
    let c_name = format!("(c) stratus, cache {:.0}%", 100.0 * args.cache_fraction);
    let c = with_loader(&c_name, reader, &sampler, ls, compute, prices).await?;

    // (d) link utilisation: no cache, a consumer faster than the link.
    let sim_d = Arc::new(SimStore::new(bucket.clone(), settings.clone()));
    let reader = DatasetReader::open(sim_d.clone(), prefix.clone()).await?;
    sim_d.reset_stats();
    let bdp = sim.aggregate_bytes_per_s() * args.first_byte_ms / 1000.0;
    // Enough to keep the link busy, but never a quarter of the data or more,
    // so the window cannot serve a second epoch.
    let link_window = ((args.link_window_bdp * bdp) as u64)
        .min(dataset_bytes / 4)
        .max(window);
    println!(
        "(d) prefetch window {:.1} MB = {:.1} x the link's bandwidth-delay product ({:.2} MB)",
        link_window as f64 / 1e6,
        link_window as f64 / bdp.max(1.0),
        bdp / 1e6
    );
    let ls = loader_settings(args, sc.batch, args.epochs, link_window);
    let d = with_loader(
        "(d) stratus, no cache, no compute",
        reader,
        &sampler,
        ls,
        Duration::ZERO,
        prices,
    )
    .await?;
    let link_rate = sim.aggregate_bytes_per_s();
    let utilisation = if link_rate > 0.0 && d.total_s > 0.0 {
        sim_d.stats().bytes as f64 / d.total_s / link_rate
    } else {
        0.0
    };

    println!(
        "{:<52} {:>9} {:>9} {:>9} {:>8} {:>9} {:>6} {:>6} {:>9}",
        "run", "wait s", "compute s", "total s", "GETs", "bucket MB", "mem%", "disk%", "cost $"
    );
    for r in [&a, &b, &c, &d] {
        println!(
            "{:<52} {:>9.3} {:>9.2} {:>9.2} {:>8} {:>9.1} {:>6.1} {:>6.1} {:>9.5}",
            r.name,
            r.data_wait_s,
            r.compute_s,
            r.total_s,
            r.gets,
            r.bucket_bytes as f64 / 1e6,
            100.0 * r.memory_hit_rate,
            100.0 * r.disk_hit_rate,
            r.cost_usd
        );
    }
    for (e, s) in c.per_epoch.iter().enumerate() {
        println!(
            "  (c) epoch {}: wait {:.3}s, total {:.2}s, {} GETs, {:.1} MB from the bucket, hits memory {:.1}% disk {:.1}%, ${:.5}",
            e + 1,
            c.epoch_wait_s.get(e).copied().unwrap_or(0.0),
            c.epoch_total_s.get(e).copied().unwrap_or(0.0),
            s.gets,
            s.bucket_bytes as f64 / 1e6,
            100.0 * s.memory_hit_rate(),
            100.0 * s.disk_hit_rate(),
            s.cost(prices)
        );
    }

    let reduction = if a.data_wait_s > 0.0 {
        1.0 - c.data_wait_s / a.data_wait_s
    } else {
        0.0
    };
    let ratio = if b.total_s > 0.0 {
        c.total_s / b.total_s
    } else {
        f64::INFINITY
    };
    let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
    println!(
        "data-wait reduction (c) vs (a): {:.1}%  (target >= 95%; DELI reported 85.6-93.5%)  {}",
        100.0 * reduction,
        verdict(reduction >= 0.95)
    );
    println!(
        "(c) / (b) on total time (data wait + compute + loop overhead, all epochs): {:.3}x  (target <= 1.2x)  {}",
        ratio,
        verdict(ratio <= 1.2)
    );
    let bdp_requests = link_rate * (args.first_byte_ms / 1000.0) / record_bytes as f64;
    if sc.layout == Layout::PerSample && bdp_requests > args.inflight as f64 {
        println!(
            "link utilisation (d): {:.1}% of {:.1} MB/s  (info only: {:.1} KB objects are latency-bound; filling the link needs ~{:.0} concurrent GETs, the loader allows {})",
            100.0 * utilisation,
            link_rate / 1e6,
            record_bytes as f64 / 1e3,
            bdp_requests,
            args.inflight
        );
    } else {
        println!(
            "link utilisation (d), consumer faster than the link: {:.1}% of {:.1} MB/s over the whole run, first-byte wait included  (target >= 90%)  {}",
            100.0 * utilisation,
            link_rate / 1e6,
            verdict(utilisation >= 0.9)
        );
    }
    Ok(ScenarioResult {
        scenario: sc.name.to_string(),
        record_bytes,
        dataset_bytes,
        runs: vec![a, b, c, d],
        wait_reduction: reduction,
        total_ratio_c_over_b: ratio,
        link_utilisation: utilisation,
    })
}

fn loader_settings(args: &Args, batch: usize, epochs: u64, window_bytes: u64) -> LoaderSettings {
    let mut s = LoaderSettings::new(batch, epochs);
    s.max_inflight_requests = args.inflight;
    s.max_inflight_bytes = window_bytes;
    s.lookahead_samples = usize::MAX;
    s
}

/// Reads each batch when the consumer asks for it.
async fn on_demand(
    name: &str,
    reader: &DatasetReader,
    sampler: &EpochSampler,
    batch: usize,
    epochs: u64,
    compute: Duration,
) -> anyhow::Result<RunResult> {
    let mut r = RunResult {
        name: name.to_string(),
        ..RunResult::default()
    };
    let start = Instant::now();
    // The run's batches in order; a batch belongs to the epoch of its first
    // sample, and only the run's last batch may be short.
    let batches = sampler.plan(batch, epochs).batches_from(0);
    let last = batches.len().saturating_sub(1);
    let mut epoch = 0u64;
    let mut t_epoch = start;
    let mut wait = Duration::ZERO;
    for (i, planned) in batches.into_iter().enumerate() {
        if planned.epoch != epoch {
            r.epoch_wait_s.push(wait.as_secs_f64());
            r.epoch_total_s.push(t_epoch.elapsed().as_secs_f64());
            (epoch, t_epoch, wait) = (planned.epoch, Instant::now(), Duration::ZERO);
        }
        let t = Instant::now();
        let b = reader.fetch_batch(Split::Train, &planned.samples).await?;
        wait += t.elapsed();
        if b.len() != batch && i != last {
            bail!("{name}: a batch of {} samples", b.len());
        }
        r.batches += 1;
        let t = Instant::now();
        tokio::time::sleep(compute).await;
        r.compute_s += t.elapsed().as_secs_f64();
    }
    r.epoch_wait_s.push(wait.as_secs_f64());
    r.epoch_total_s.push(t_epoch.elapsed().as_secs_f64());
    r.total_s = start.elapsed().as_secs_f64();
    r.data_wait_s = r.epoch_wait_s.iter().sum();
    Ok(r)
}

/// Runs the Stratus loader with the same consumer. The clock starts before
/// the loader does, so its head start is counted.
async fn with_loader(
    name: &str,
    reader: DatasetReader,
    sampler: &EpochSampler,
    settings: LoaderSettings,
    compute: Duration,
    prices: &CostModel,
) -> anyhow::Result<RunResult> {
    let mut r = RunResult {
        name: name.to_string(),
        ..RunResult::default()
    };
    let batch = settings.batch_size;
    let epochs = settings.epochs;
    let start = Instant::now();
    let mut loader = Loader::start(reader, sampler.clone(), settings)?;
    let mut epoch = 0u64;
    let mut t_epoch = start;
    let mut wait = Duration::ZERO;
    loop {
        let t = Instant::now();
        let next = loader.next().await?;
        let waited = t.elapsed();
        let Some((pos, b)) = next else { break };
        if pos.epoch != epoch {
            r.epoch_wait_s.push(wait.as_secs_f64());
            r.epoch_total_s.push(t_epoch.elapsed().as_secs_f64());
            (epoch, t_epoch, wait) = (pos.epoch, Instant::now(), Duration::ZERO);
        }
        wait += waited;
        if b.len() != batch && pos.step + 1 != loader.end_step() {
            bail!("{name}: a batch of {} samples", b.len());
        }
        r.batches += 1;
        if !compute.is_zero() {
            let t = Instant::now();
            tokio::time::sleep(compute).await;
            r.compute_s += t.elapsed().as_secs_f64();
        }
    }
    r.epoch_wait_s.push(wait.as_secs_f64());
    r.epoch_total_s.push(t_epoch.elapsed().as_secs_f64());
    r.total_s = start.elapsed().as_secs_f64();
    r.data_wait_s = r.epoch_wait_s.iter().sum();
    let stats = loader.stats();
    r.per_epoch = (0..epochs).map(|e| stats.epoch(e)).collect();
    let total = stats.total();
    r.gets = total.get_attempts;
    r.bucket_bytes = total.bucket_bytes;
    r.memory_hit_rate = total.memory_hit_rate();
    r.disk_hit_rate = total.disk_hit_rate();
    r.cost_usd = total.cost(prices);
    Ok(r)
}

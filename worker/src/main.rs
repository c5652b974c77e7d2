//! `ps-worker`: one training worker of a Stratus cluster, and the dataset tool.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use ps_dataset::{
    open_bucket, read_mnist_csv, read_mnist_idx, synthetic, train_test_split, write_dataset_with,
    Layout, SyntheticSpec, WriteOptions,
};
use ps_shared::cli::{describe_error, init_logging, stop_signal};
use ps_shared::config::ClusterConfig;
use ps_shared::pki::CertPair;
use ps_shared::transport::read_pem;
use ps_worker::comm::WorkerTls;
use ps_worker::run::{run_worker, WorkerError, WorkerOptions};

/// Stratus worker: trains its share of each step with candle, pushes compressed
/// gradients to the parameter servers over QUIC and pulls the new parameters.
#[derive(Parser, Debug)]
#[command(name = "ps-worker", version, about, long_about = None)]
struct Cli {
    /// Cluster config (TOML); the embedded configs/local.toml when omitted.
    #[arg(long, short, global = true, env = "STRATUS_CONFIG")]
    config: Option<PathBuf>,

    /// Log filter (error, warn, info, debug, or a tracing filter).
    #[arg(long, default_value = "warn", global = true, env = "STRATUS_LOG")]
    log: String,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train as one worker (the default when no subcommand is given: rank 0).
    Train {
        /// This worker's rank in 0..cluster.workers.
        #[arg(long, default_value_t = 0, env = "STRATUS_RANK")]
        rank: u32,
        /// Bucket URL of the dataset (overrides data.url).
        #[arg(long)]
        data: Option<String>,
        /// Print one line per epoch instead of a progress bar.
        #[arg(long)]
        no_progress: bool,
        /// Write the final report as JSON to this file.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Compute device (overrides training.device): cpu, cuda or cuda:N;
        /// cuda needs a build with `--features cuda`.
        #[arg(long, env = "STRATUS_DEVICE")]
        device: Option<String>,
    },
    /// Write a dataset into a bucket.
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// Print the effective configuration (token redacted) and exit.
    ShowConfig,
}

#[derive(Subcommand, Debug)]
enum DatasetCommand {
    /// A learnable synthetic classification set.
    Synthetic {
        /// Bucket URL to write to (file://dir, s3://bucket/prefix, ...).
        #[arg(long)]
        out: String,
        #[arg(long, default_value_t = 8192)]
        train: usize,
        #[arg(long, default_value_t = 2048)]
        test: usize,
        #[arg(long, default_value_t = 64)]
        features: usize,
        #[arg(long, default_value_t = 10)]
        classes: usize,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Fraction of labels flipped at random.
        #[arg(long, default_value_t = 0.02)]
        label_noise: f64,
        /// Records per shard object.
        #[arg(long, default_value_t = 1024)]
        records_per_shard: usize,
        /// Object layout: shards (range GETs) or per-sample (one object per sample).
        #[arg(long, default_value = "shards", value_parser = ["shards", "per-sample"])]
        layout: String,
    },
    /// MNIST from a CSV file (e.g. mnist_5k.csv.gz) or IDX files.
    Mnist {
        #[arg(long)]
        out: String,
        /// CSV file (optionally .gz).
        #[arg(long, conflicts_with_all = ["idx_images", "idx_labels"])]
        csv: Option<PathBuf>,
        /// IDX images file (train-images-idx3-ubyte[.gz]).
        #[arg(long, requires = "idx_labels")]
        idx_images: Option<PathBuf>,
        /// IDX labels file (train-labels-idx1-ubyte[.gz]).
        #[arg(long, requires = "idx_images")]
        idx_labels: Option<PathBuf>,
        /// Samples held out for the test split.
        #[arg(long, default_value_t = 1000)]
        test: usize,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        #[arg(long, default_value_t = 1024)]
        records_per_shard: usize,
        /// Object layout: shards (range GETs) or per-sample (one object per sample).
        #[arg(long, default_value = "shards", value_parser = ["shards", "per-sample"])]
        layout: String,
    },
    /// Write an image set (MNIST as PNG, or synthetic colour shapes as JPEG)
    /// as WebDataset shards or class folders, and index it.
    Images(images_cmd::ImagesArgs),
    /// Index WebDataset shards or class folders where they lie (writes
    /// manifest.json next to them; the images are not converted).
    Index(images_cmd::IndexArgs),
}

mod images_cmd;

fn main() {
    if let Err(e) = run() {
        eprintln!("ps-worker: error: {}", describe_error(e.as_ref()));
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(&cli.log, "warn");
    let command = cli.command.unwrap_or(Command::Train {
        rank: 0,
        data: None,
        no_progress: false,
        report: None,
        device: None,
    });
    match command {
        Command::ShowConfig => {
            let cfg = ClusterConfig::load_or_default(cli.config.as_deref())?;
            println!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Dataset(cmd) => dataset(cmd),
        Command::Train {
            rank,
            data,
            no_progress,
            report,
            device,
        } => {
            let mut cfg = ClusterConfig::load_or_default(cli.config.as_deref())?;
            if let Some(url) = data {
                cfg.data.url = url;
            }
            if let Some(device) = device {
                cfg.training.device = device;
                cfg.validate().context("--device")?;
            }
            if rank as usize >= cfg.cluster.workers {
                bail!(
                    "--rank {rank}: the cluster has {} workers (ranks 0..{})",
                    cfg.cluster.workers,
                    cfg.cluster.workers
                );
            }
            train(cfg, rank, !no_progress, report)
        }
    }
}

fn train(
    cfg: ClusterConfig,
    rank: u32,
    progress: bool,
    report_path: Option<PathBuf>,
) -> anyhow::Result<()> {
    let ca_pem = read_pem(&cfg.tls.ca).with_context(|| {
        "the worker needs the cluster CA certificate (tls.ca); `ps-server certs` writes one"
    })?;
    let (cert, key) = cfg.tls.worker_paths(rank);
    let identity = CertPair::read(&cert, &key).with_context(|| {
        format!(
            "the worker needs its rank-{rank} certificate ({} and {}, from tls.worker_cert / tls.worker_key); `ps-server certs` writes one per rank",
            cert.display(),
            key.display()
        )
    })?;
    let (store, prefix) = open_bucket(&cfg.data.url)
        .with_context(|| format!("opening data.url = {}", cfg.data.url))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let opts = WorkerOptions {
        rank,
        tls: WorkerTls { ca_pem, identity },
        progress,
        epoch_lines: true,
        crash_after_steps: None,
        stop: Some(stop_rx),
        steps_done: None,
    };
    let system = actix::System::new();
    let report = system
        .block_on(async {
            // SIGTERM or Ctrl-C: finish the current step, say goodbye, stop.
            actix::spawn(async move {
                let name = stop_signal().await;
                eprintln!("ps-worker: {name}: finishing the current step and saying goodbye");
                let _ = stop_tx.send(true);
            });
            run_worker(&cfg, opts, store, prefix).await
        })
        .map_err(|e| match e {
            WorkerError::Dataset(_) | WorkerError::Mismatch(_) => {
                anyhow::Error::new(e).context(format!("data.url = {}", cfg.data.url))
            }
            other => other.into(),
        })?;
    if report.steps_short_of_workers > 0 {
        println!(
            "worker {rank}: WARNING: {} of {} steps ran with fewer than {} workers in the barrier (as few as {})",
            report.steps_short_of_workers,
            report.steps - report.start_step,
            cfg.cluster.workers,
            report.min_live_workers
        );
    }
    println!(
        "worker {rank} done: {} steps, test accuracy {:.2}%, pushed {:.1} KB/step, pulled {:.1} KB/step, data wait {:.2}s, compute {:.2}s, comm {:.2}s",
        report.steps,
        100.0 * report.final_accuracy,
        report.bytes_pushed_per_step / 1e3,
        report.bytes_pulled_per_step / 1e3,
        report.data_wait_s,
        report.compute_s,
        report.comm_s
    );
    if let Some(path) = report_path {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing report {}", path.display()))?;
    }
    Ok(())
}

fn dataset(cmd: DatasetCommand) -> anyhow::Result<()> {
    let (out, name, features, classes, train, test, per_shard, layout) = match cmd {
        DatasetCommand::Images(args) => return images_cmd::images(args),
        DatasetCommand::Index(args) => return images_cmd::index(args),
        DatasetCommand::Synthetic {
            out,
            train,
            test,
            features,
            classes,
            seed,
            label_noise,
            records_per_shard,
            layout,
        } => {
            if features == 0 || classes < 2 || train == 0 {
                bail!("need --features >= 1, --classes >= 2 and --train >= 1");
            }
            if !(0.0..1.0).contains(&label_noise) {
                bail!("--label-noise must be in [0, 1)");
            }
            let spec = SyntheticSpec {
                train,
                test,
                features,
                classes,
                seed,
                label_noise,
            };
            let (tr, te) = synthetic(&spec);
            (
                out,
                "synthetic".to_string(),
                features,
                classes,
                tr,
                te,
                records_per_shard,
                layout,
            )
        }
        DatasetCommand::Mnist {
            out,
            csv,
            idx_images,
            idx_labels,
            test,
            seed,
            records_per_shard,
            layout,
        } => {
            let samples = match (csv, idx_images, idx_labels) {
                (Some(csv), _, _) => read_mnist_csv(&csv)?,
                (None, Some(images), Some(labels)) => read_mnist_idx(&images, &labels)?,
                _ => bail!("give --csv FILE or --idx-images FILE --idx-labels FILE"),
            };
            if test >= samples.len() {
                bail!(
                    "--test {test} leaves no training samples out of {}",
                    samples.len()
                );
            }
            let (tr, te) = train_test_split(samples, test, seed);
            (
                out,
                "mnist".to_string(),
                784,
                10,
                tr,
                te,
                records_per_shard,
                layout,
            )
        }
    };
    if per_shard == 0 {
        bail!("--records-per-shard must be >= 1");
    }
    let layout: Layout = layout.parse().map_err(anyhow::Error::msg)?;
    let (store, prefix) = open_bucket(&out).with_context(|| format!("opening {out}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let options = WriteOptions {
        layout,
        records_per_shard: per_shard,
    };
    let manifest = rt.block_on(write_dataset_with(
        store.as_ref(),
        &prefix,
        &name,
        features,
        classes,
        &train,
        &test,
        &options,
    ))?;
    let objects = match layout {
        Layout::Shards => manifest.train.shards.len() + manifest.test.shards.len(),
        Layout::PerSample | Layout::WebDataset | Layout::ClassFolders => {
            manifest.train.num_samples + manifest.test.num_samples
        }
    };
    println!(
        "wrote {name} to {out}: {} train + {} test samples, {} features, {} classes, {objects} {layout} objects",
        manifest.train.num_samples,
        manifest.test.num_samples,
        manifest.features,
        manifest.classes,
    );
    Ok(())
}

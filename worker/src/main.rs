//! `ps-worker`: one training worker of a Stratus cluster, and the dataset tool.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use ps_dataset::{
    import_dataset, local_output_dir, open_bucket, read_mnist_csv, read_mnist_idx,
    remove_empty_output_dir, synthetic, train_test_split, write_dataset_with, write_text_dataset,
    ImportInput, ImportOptions, InputFormat, LabelColumn, Layout, Normalize, SyntheticSpec,
    TestSplit, TextOptions, TextTokenizer, WriteOptions,
};
use ps_shared::cli::{
    describe_error, exit_code, init_logging, stop_signal, ExitCode, UsageError, EXIT_CODES_HELP,
};
use ps_shared::config::ClusterConfig;
use ps_shared::pki::CertPair;
use ps_shared::simulate::Simulation;
use ps_shared::transport::read_pem;
use ps_worker::comm::WorkerTls;
use ps_worker::run::{classify_exit, run_node, run_worker, WorkerError, WorkerOptions};

/// Stratus worker: trains its share of each step with candle, pushes compressed
/// gradients to the parameter servers over QUIC and pulls the new parameters.
#[derive(Parser, Debug)]
#[command(name = "ps-worker", version, about, long_about = None, after_help = EXIT_CODES_HELP)]
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
    /// Train as one worker (the default when no subcommand is given: rank 0),
    /// or as every rank of one node with --node (cluster.workers_per_node > 1).
    Train {
        /// This worker's rank in 0..cluster.workers (cluster.workers_per_node = 1).
        #[arg(long, default_value_t = 0, env = "STRATUS_RANK")]
        rank: u32,
        /// Run node N: its cluster.workers_per_node ranks N*workers_per_node ..
        /// (N+1)*workers_per_node, each with its own model replica and data
        /// shard, pushing once per node through a node aggregator. Needs each
        /// rank's certificate; the first rank's authenticates the node.
        #[arg(long, env = "STRATUS_NODE", conflicts_with = "rank")]
        node: Option<u32>,
        /// Bucket URL of the dataset (overrides data.url).
        #[arg(long)]
        data: Option<String>,
        /// Print one line per epoch instead of a progress bar.
        #[arg(long)]
        no_progress: bool,
        /// Write the final report as JSON to this file (with --node: a list,
        /// one report per rank).
        #[arg(long)]
        report: Option<PathBuf>,
        /// Compute device (overrides training.device): cpu, cuda or cuda:N;
        /// cuda needs a build with `--features cuda`.
        #[arg(long, env = "STRATUS_DEVICE")]
        device: Option<String>,
        /// Simulate a slow link and/or bucket (tests, benchmarks): a TOML file
        /// with a [link] section (bandwidth_mbit, latency_ms) and/or a [bucket]
        /// section (first_byte_ms, per_connection_mb_per_s,
        /// aggregate_gbit_per_s, transient_error_rate, seed); see
        /// configs/simulate-slow-bucket.toml. With --node the link is the
        /// node's one connection per server.
        #[arg(long, value_name = "FILE")]
        simulate: Option<PathBuf>,
    },
    /// Write a dataset into a bucket: synthetic, MNIST, your own tabular data (import) or images (images, index).
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// Print the effective configuration (token redacted) and exit.
    ShowConfig,
    /// Draw PNG charts of a run's per-epoch metrics (the worker-<rank>.jsonl
    /// files in training.metrics_dir): loss, accuracy, data wait, compute and
    /// communication time, bytes per step, cache hit rates, bucket GETs and
    /// cost; one line per worker. Prints the paths written.
    Plot {
        /// The run's metrics directory (training.metrics_dir).
        run_dir: PathBuf,
        /// Where to write the charts (default: RUN_DIR/plots).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum DatasetCommand {
    /// A learnable synthetic classification set.
    Synthetic {
        /// Bucket URL to write to (file://dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, ...).
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
        /// Object layout.
        #[arg(long, value_enum, default_value_t = RecordLayoutArg::Shards)]
        layout: RecordLayoutArg,
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
        /// Object layout.
        #[arg(long, value_enum, default_value_t = RecordLayoutArg::Shards)]
        layout: RecordLayoutArg,
    },
    /// Write an image set (your own folder of images, MNIST as PNG, or synthetic colour shapes as JPEG)
    /// as WebDataset shards or class folders, and index it.
    Images(images_cmd::ImagesArgs),
    /// Index WebDataset shards or class folders where they lie (writes
    /// manifest.json next to them; the images are not converted).
    Index(images_cmd::IndexArgs),
    /// Your own tabular data: CSV (optionally .gz), NumPy .npy/.npz or Parquet.
    ///
    /// Every row of every input is validated (numbers, finite features, the
    /// same width, integer labels in range) before anything is written; on a
    /// failure nothing is left behind. Inputs are streamed, never loaded whole.
    #[command(after_help = "Examples:\n  \
        ps-worker dataset import --train digits.csv --test-fraction 0.2 --out file:///data/digits\n  \
        ps-worker dataset import --train X_train.npy --train-labels y_train.npy \\\n      \
        --test X_test.npy --test-labels y_test.npy --out s3://bucket/digits\n  \
        ps-worker dataset import --train digits.npz --x-key data --y-key target --test-fraction 0.2 --out DIR\n  \
        ps-worker dataset import --train train.parquet --test test.parquet --label-column target --out DIR")]
    Import(Box<ImportArgs>),
    /// Plain text tokenized into windows of seq_len + 1 token ids (for
    /// `model.kind = "gpt"`). Files are streamed line by line.
    #[command(after_help = "Examples:\n  \
        ps-worker dataset text --in corpus.txt --seq-len 64 --out file:///data/text\n  \
        ps-worker dataset text --in a.txt --in b.txt --test held-out.txt --tokenizer tokenizer.json --seq-len 256 --out s3://bucket/text")]
    Text(TextArgs),
}

#[derive(clap::Args, Debug)]
struct TextArgs {
    /// Text files (UTF-8), tokenized in order as one stream.
    #[arg(long = "in", required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// Separate test files (default: the last --test-fraction of the windows).
    #[arg(long, num_args = 1..)]
    test: Vec<PathBuf>,
    /// Share of the windows, from the end, held out as the test split.
    #[arg(long, default_value_t = 0.05)]
    test_fraction: f64,
    /// `bytes` (vocabulary 256) or the path of a tokenizer.json.
    #[arg(long, default_value = "bytes")]
    tokenizer: String,
    /// Tokens of a model input; each record holds seq_len + 1.
    #[arg(long)]
    seq_len: usize,
    /// Bucket URL to write to.
    #[arg(long)]
    out: String,
    #[arg(long, default_value_t = 1024)]
    records_per_shard: usize,
    #[arg(long, default_value = "text")]
    name: String,
    /// Replace a dataset already at --out.
    #[arg(long)]
    overwrite: bool,
}

/// How `dataset make`, `mnist` and `import` cut records into objects.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum RecordLayoutArg {
    /// Shard objects of many records, read with range GETs.
    Shards,
    /// One object per sample, one GET per sample.
    PerSample,
}

impl From<RecordLayoutArg> for Layout {
    fn from(arg: RecordLayoutArg) -> Self {
        match arg {
            RecordLayoutArg::Shards => Layout::Shards,
            RecordLayoutArg::PerSample => Layout::PerSample,
        }
    }
}

#[derive(Args, Debug)]
struct ImportArgs {
    /// Bucket URL to write to (file://dir, a plain path, s3://, gs:// or az://bucket/prefix).
    #[arg(long)]
    out: String,
    /// Training data file; the format comes from its extension (.csv, .tsv,
    /// .txt, each optionally .gz; .npy; .npz; .parquet) or --format.
    #[arg(long)]
    train: PathBuf,
    /// Labels of --train when it is a .npy feature array (a .npy array, one
    /// label per row).
    #[arg(long)]
    train_labels: Option<PathBuf>,
    /// Test data file, kept exactly as given (same format and columns as --train).
    #[arg(long, conflicts_with = "test_fraction")]
    test: Option<PathBuf>,
    /// Labels of --test when it is a .npy feature array.
    #[arg(long, requires = "test")]
    test_labels: Option<PathBuf>,
    /// Hold out this fraction of --train as the test split: a seeded,
    /// stratified random split (round(F * n) rows of each class, picked
    /// with --seed; both splits keep the file order). Without --test or
    /// --test-fraction the test split is empty.
    #[arg(long)]
    test_fraction: Option<f64>,
    /// Seed of the --test-fraction split.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Input format, when the file names do not tell.
    #[arg(long, value_parser = ["csv", "npy", "npz", "parquet"])]
    format: Option<String>,
    /// CSV and Parquet: name of the label column (CSV: in the header row);
    /// every other column is a feature.
    #[arg(long, default_value = "label")]
    label_column: String,
    /// CSV and Parquet: 0-based position of the label column instead of a
    /// name; a CSV file read this way has no header row.
    #[arg(long)]
    label_column_index: Option<usize>,
    /// CSV field separator: one character, or `tab` (default `,`, or a tab
    /// for .tsv files).
    #[arg(long)]
    delimiter: Option<String>,
    /// .npz: name of the feature array.
    #[arg(long, default_value = "x")]
    x_key: String,
    /// .npz: name of the label array.
    #[arg(long, default_value = "y")]
    y_key: String,
    /// Number of classes; by default the largest train label + 1 (every
    /// test label must then be below it). Labels must be non-negative
    /// integers (3.0 is fine, 3.5 is an error).
    #[arg(long)]
    classes: Option<usize>,
    /// Feature normalisation: none (store as read), scale:F (divide every
    /// feature by F, e.g. scale:255), or standard (per-feature mean and
    /// standard deviation of the train split, applied to both splits and
    /// recorded in the manifest).
    #[arg(long, default_value = "none")]
    normalize: String,
    /// Object layout.
    #[arg(long, value_enum, default_value_t = RecordLayoutArg::Shards)]
    layout: RecordLayoutArg,
    /// Records per shard object.
    #[arg(long, default_value_t = 1024)]
    records_per_shard: usize,
    /// Dataset name in the manifest (default: the --train file name up to its first dot).
    #[arg(long)]
    name: Option<String>,
    /// Replace a dataset already at --out (its manifest is deleted before
    /// anything new is written); without it an existing dataset is an error.
    #[arg(long)]
    overwrite: bool,
}

mod images_cmd;

/// How long a worker may take to finish its step and say goodbye after
/// SIGTERM or Ctrl-C before the process exits anyway: inside Kubernetes'
/// default 30 s grace period.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(25);

/// The stop signal received, if any (its name decides the exit code).
static SIGNAL: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn main() {
    if let Err(e) = run() {
        eprintln!("ps-worker: error: {}", describe_error(e.as_ref()));
        // A run that a signal stopped ends with the signal's code, whatever
        // error the stop left behind; a bad config stays a bad config.
        let code = match (exit_code(e.as_ref(), classify_exit), SIGNAL.get()) {
            (ExitCode::Config, _) | (_, None) => exit_code(e.as_ref(), classify_exit),
            (_, Some(name)) => ExitCode::for_signal(name),
        };
        std::process::exit(code.code());
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(&cli.log, "warn");
    let command = cli.command.unwrap_or(Command::Train {
        rank: 0,
        node: None,
        data: None,
        no_progress: false,
        report: None,
        device: None,
        simulate: None,
    });
    match command {
        Command::ShowConfig => {
            let cfg = ClusterConfig::load_or_default(cli.config.as_deref())?;
            println!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Dataset(cmd) => dataset(cmd),
        Command::Plot { run_dir, out } => {
            let out = out.unwrap_or_else(|| run_dir.join("plots"));
            for path in ps_worker::plot::plot_run_dir(&run_dir, &out)? {
                println!("{}", path.display());
            }
            Ok(())
        }
        Command::Train {
            rank,
            node,
            data,
            no_progress,
            report,
            device,
            simulate,
        } => {
            let mut cfg = ClusterConfig::load_or_default(cli.config.as_deref())?;
            let simulation = match &simulate {
                Some(path) => Simulation::load(path)?,
                None => Simulation::default(),
            };
            if let Some(url) = data {
                cfg.data.url = url;
            }
            if let Some(device) = device {
                cfg.training.device = device;
                cfg.validate().context("--device")?;
            }
            let wpn = cfg.cluster.workers_per_node as u32;
            let ranks: Vec<u32> = match node {
                Some(n) if (n as usize) < cfg.nodes() => (n * wpn..(n + 1) * wpn).collect(),
                Some(n) => bail!(UsageError(format!(
                    "--node {n}: the cluster has {} nodes (cluster.workers = {} / cluster.workers_per_node = {wpn})",
                    cfg.nodes(),
                    cfg.cluster.workers
                ))),
                None if wpn > 1 => bail!(UsageError(format!(
                    "cluster.workers_per_node = {wpn}: start each node with --node N (N in 0..{}), which runs its {wpn} ranks together",
                    cfg.nodes()
                ))),
                None if rank as usize >= cfg.cluster.max_ranks() => bail!(UsageError(format!(
                    "--rank {rank}: the cluster admits ranks 0..{} (cluster.workers = {}, cluster.max_workers = {})",
                    cfg.cluster.max_ranks(),
                    cfg.cluster.workers,
                    cfg.cluster.max_workers
                ))),
                None => vec![rank],
            };
            train(cfg, node, ranks, !no_progress, report, simulation)
        }
    }
}

fn train(
    cfg: ClusterConfig,
    node: Option<u32>,
    ranks: Vec<u32>,
    progress: bool,
    report_path: Option<PathBuf>,
    simulation: Simulation,
) -> anyhow::Result<()> {
    let ca_pem = read_pem(&cfg.tls.ca).with_context(|| {
        "the worker needs the cluster CA certificate (tls.ca); `ps-server certs` writes one"
    })?;
    let (store, prefix) = ps_shared::bucket::open_data_bucket(&cfg.data.url)
        .with_context(|| format!("opening data.url = {}", cfg.data.url))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut options = Vec::new();
    for &rank in &ranks {
        let (cert, key) = cfg.tls.worker_paths(rank);
        let identity = CertPair::read(&cert, &key).with_context(|| {
            format!(
                "the worker needs its rank-{rank} certificate ({} and {}, from tls.worker_cert / tls.worker_key); `ps-server certs` writes one per rank",
                cert.display(),
                key.display()
            )
        })?;
        options.push(WorkerOptions {
            rank,
            tls: WorkerTls {
                ca_pem: ca_pem.clone(),
                identity,
            },
            // One progress bar per process: a node prints epoch lines.
            progress: progress && node.is_none(),
            epoch_lines: true,
            crash_after_steps: None,
            pause_after_steps: None,
            stop: Some(stop_rx.clone()),
            steps_done: None,
            trained: None,
            simulation: simulation.clone(),
        });
    }
    let system = actix::System::new();
    // Errors leave the runtime as values: nothing inside it may end the
    // process or drop a runtime.
    let outcomes = system.block_on(async {
        // A CA that is not PEM or a key that does not match its certificate
        // is a config error now, not a server "unreachable" for
        // server.connect_timeout_secs.
        check_tls(&cfg, &options)?;
        let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
        // SIGTERM or Ctrl-C: finish the current step (or cut a wait for the
        // bucket or a server short), say goodbye, stop.
        actix::spawn(async move {
            let name = stop_signal().await;
            let _ = SIGNAL.set(name);
            eprintln!("ps-worker: {name}: finishing the current step and saying goodbye");
            let _ = stop_tx.send(true);
            let _ = stopped_tx.send(name);
        });
        let runs = async {
            match node {
                Some(n) => run_node(&cfg, n, options, store, prefix).await,
                None => {
                    let opts = options.remove(0);
                    vec![run_worker(&cfg, opts, store, prefix).await]
                }
            }
        };
        // The run ends by itself, or within STOP_GRACE of a signal.
        let deadline = async {
            match stopped_rx.await {
                Ok(name) => {
                    tokio::time::sleep(STOP_GRACE).await;
                    name
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            outcomes = runs => anyhow::Ok(outcomes),
            name = deadline => bail!(
                "{name}: the worker did not stop within {} s; exiting without a goodbye",
                STOP_GRACE.as_secs()
            ),
        }
    });
    let outcomes = outcomes?;
    let mut reports = Vec::new();
    for outcome in outcomes {
        reports.push(outcome.map_err(|e| match e {
            WorkerError::Dataset(_) | WorkerError::Mismatch(_) => {
                anyhow::Error::new(e).context(format!("data.url = {}", cfg.data.url))
            }
            other => other.into(),
        })?);
    }
    for report in &reports {
        let rank = report.rank;
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
            "worker {rank} done: {} steps, test accuracy {}, pushed {:.1} KB/step, pulled {:.1} KB/step, data wait {:.2}s, compute {:.2}s, comm {:.2}s",
            report.steps,
            ps_worker::run::accuracy_text(report.final_accuracy, 2),
            report.bytes_pushed_per_step / 1e3,
            report.bytes_pulled_per_step / 1e3,
            report.data_wait_s,
            report.compute_s,
            report.comm_s
        );
    }
    if let (Some(n), Some(first)) = (node, reports.first()) {
        println!(
            "node {n} done: its link carried {:.1} MB up and {:.1} MB down for {} ranks",
            first.link_sent_bytes as f64 / 1e6,
            first.link_received_bytes as f64 / 1e6,
            reports.len()
        );
    }
    if let Some(path) = report_path {
        // One rank: its report; a node: the list of its ranks' reports.
        let json = match (node, reports.as_slice()) {
            (None, [one]) => serde_json::to_string_pretty(one)?,
            _ => serde_json::to_string_pretty(&reports)?,
        };
        std::fs::write(&path, json)
            .with_context(|| format!("writing report {}", path.display()))?;
    }
    Ok(())
}

/// Build each rank's TLS client setup once before connecting: a CA that is
/// not PEM or a key that does not match its certificate is refused here,
/// naming the files.
fn check_tls(cfg: &ClusterConfig, options: &[WorkerOptions]) -> anyhow::Result<()> {
    let limits = ps_shared::transport::EndpointLimits {
        idle_timeout: ps_shared::config::secs(cfg.server.idle_timeout_secs),
        keep_alive: ps_shared::config::secs(cfg.server.heartbeat_secs),
        max_bidi_streams: 16,
    };
    for o in options {
        let (cert, key) = cfg.tls.worker_paths(o.rank);
        ps_shared::transport::client_endpoint(&o.tls.ca_pem, &o.tls.identity, false, &limits)
            .with_context(|| {
                format!(
                    "rank {}: TLS files {} (tls.ca), {} and {} (tls.worker_cert, tls.worker_key)",
                    o.rank,
                    cfg.tls.ca.display(),
                    cert.display(),
                    key.display()
                )
            })?;
    }
    Ok(())
}

fn dataset(cmd: DatasetCommand) -> anyhow::Result<()> {
    // A local output folder this command creates is removed again when the
    // command fails and leaves it empty.
    let out = match &cmd {
        DatasetCommand::Images(_) | DatasetCommand::Index(_) => {
            return match cmd {
                DatasetCommand::Images(args) => images_cmd::images(args),
                DatasetCommand::Index(args) => images_cmd::index(args),
                _ => bail!("not an image command"),
            };
        }
        DatasetCommand::Synthetic { out, .. } | DatasetCommand::Mnist { out, .. } => out.clone(),
        DatasetCommand::Import(args) => args.out.clone(),
        DatasetCommand::Text(args) => args.out.clone(),
    };
    let created = local_output_dir(&out).filter(|d| !d.exists());
    let result = match cmd {
        DatasetCommand::Import(args) => import(*args, created.clone()),
        DatasetCommand::Text(args) => text(args, created.clone()),
        other => write_builtin(other),
    };
    if result.is_err() {
        if let Some(dir) = &created {
            remove_empty_output_dir(dir, true);
        }
    }
    result.with_context(|| format!("dataset not written to {out}"))
}

fn import(args: ImportArgs, created: Option<PathBuf>) -> anyhow::Result<()> {
    let ImportArgs {
        out,
        train,
        train_labels,
        test,
        test_labels,
        test_fraction,
        seed,
        format,
        label_column,
        label_column_index,
        delimiter,
        x_key,
        y_key,
        classes,
        normalize,
        layout,
        records_per_shard,
        name,
        overwrite,
    } = args;
    let layout = Layout::from(layout);
    if records_per_shard == 0 {
        bail!("--records-per-shard must be >= 1");
    }
    let normalize: Normalize = normalize
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--normalize: {e}"))?;
    let delimiter = match delimiter.as_deref() {
        None => None,
        Some("tab") | Some("\\t") | Some("\t") => Some(b'\t'),
        Some(d) if d.len() == 1 => Some(d.as_bytes()[0]),
        Some(d) => bail!("--delimiter must be one ASCII character or `tab`, got `{d}`"),
    };
    let input = |path: PathBuf, labels: Option<PathBuf>| match labels {
        Some(labels) => ImportInput::with_labels(path, labels),
        None => ImportInput::new(path),
    };
    let mut options = ImportOptions::new(input(train, train_labels));
    options.test = match (test, test_fraction) {
        (Some(test), _) => TestSplit::File(input(test, test_labels)),
        (None, Some(fraction)) => TestSplit::Fraction { fraction, seed },
        (None, None) => TestSplit::None,
    };
    options.format = format
        .map(|f| f.parse::<InputFormat>())
        .transpose()
        .map_err(anyhow::Error::msg)?;
    options.label_column = match label_column_index {
        Some(i) => LabelColumn::Index(i),
        None => LabelColumn::Name(label_column),
    };
    options.delimiter = delimiter;
    options.x_key = x_key;
    options.y_key = y_key;
    options.classes = classes;
    options.normalize = normalize;
    if let Some(name) = name {
        options.name = name;
    }
    options.write = WriteOptions {
        layout,
        records_per_shard,
    };
    options.remove_dir_if_empty = created;
    options.overwrite = overwrite;
    let (store, prefix) = open_bucket(&out).with_context(|| format!("opening {out}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let summary = rt.block_on(import_dataset(store.as_ref(), &prefix, &options))?;
    let m = &summary.manifest;
    println!(
        "imported {} to {out}: {} train + {} test samples, {} features, {} classes, {} data objects ({layout} layout) + manifest.json, {} bytes",
        m.name,
        m.train.num_samples,
        m.test.num_samples,
        m.features,
        m.classes,
        summary.objects,
        summary.bytes,
    );
    println!("  class   train    test");
    for (c, [tr, te]) in &summary.class_counts {
        println!("  {c:>5} {tr:>7} {te:>7}");
    }
    let empty = m.classes - summary.class_counts.len();
    if empty > 0 {
        println!("  ({empty} of the {} classes have no samples)", m.classes);
    }
    if m.test.num_samples == 0 {
        println!(
            "  note: the test split is empty; give --test FILE or --test-fraction F to evaluate"
        );
    }
    if let Some(n) = &m.normalization {
        println!(
            "  normalization: {} (recorded in {out}/manifest.json)",
            serde_json::to_string(n)?
        );
    }
    Ok(())
}

fn text(args: TextArgs, created: Option<PathBuf>) -> anyhow::Result<()> {
    if args.records_per_shard == 0 {
        bail!("--records-per-shard must be >= 1");
    }
    let tokenizer = TextTokenizer::open(&args.tokenizer)?;
    let options = TextOptions {
        train: args.inputs,
        test: args.test,
        test_fraction: args.test_fraction,
        seq_len: args.seq_len,
        name: args.name,
        write: WriteOptions {
            layout: Layout::Shards,
            records_per_shard: args.records_per_shard,
        },
        overwrite: args.overwrite,
        remove_dir_if_empty: created,
    };
    let out = &args.out;
    let (store, prefix) = open_bucket(out).with_context(|| format!("opening {out}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let m = rt.block_on(write_text_dataset(
        store.as_ref(),
        &prefix,
        &tokenizer,
        &options,
    ))?;
    let text = m.text.as_ref().map_or(String::new(), |t| {
        format!(
            "tokenizer {} (crc32 {}), vocab {}, seq_len {}",
            t.tokenizer, t.tokenizer_crc32, t.vocab, t.seq_len
        )
    });
    println!(
        "wrote {} to {out}: {} train + {} test windows, {text}",
        m.name, m.train.num_samples, m.test.num_samples
    );
    Ok(())
}

fn write_builtin(cmd: DatasetCommand) -> anyhow::Result<()> {
    let (out, name, features, classes, train, test, per_shard, layout) = match cmd {
        DatasetCommand::Images(_)
        | DatasetCommand::Index(_)
        | DatasetCommand::Import(_)
        | DatasetCommand::Text(_) => {
            bail!("not a built-in dataset")
        }
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
    let layout = Layout::from(layout);
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn train_takes_a_simulation_file() {
        let cli = Cli::try_parse_from(["ps-worker", "train", "--simulate", "slow.toml"]).unwrap();
        let Some(Command::Train { simulate, .. }) = cli.command else {
            panic!("expected train");
        };
        assert_eq!(simulate, Some(PathBuf::from("slow.toml")));
        let mut cmd = Cli::command();
        let train = cmd.find_subcommand_mut("train").expect("train");
        let help = train.render_long_help().to_string();
        assert!(help.contains("--simulate <FILE>"), "{help}");
        // The example the help points to is a valid simulation file.
        assert!(help.contains("configs/simulate-slow-bucket.toml"), "{help}");
        let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/simulate-slow-bucket.toml");
        Simulation::load(&example).expect("the example simulation file");
    }
}

//! `ps-data`: the Stratus data tools. Writes datasets into a bucket
//! (synthetic, MNIST, your own tabular data, text, image sets) and indexes
//! image sets where they lie; draws the charts of a run's metrics.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use ps_dataset::{
    clear_existing, import_dataset, local_output_dir, open_bucket, read_mnist_csv, read_mnist_idx,
    remove_empty_output_dir, synthetic, train_test_split, write_dataset_with, write_text_dataset,
    ImportInput, ImportOptions, InputFormat, LabelColumn, Layout, Normalize, SyntheticSpec,
    TestSplit, TextOptions, TextTokenizer, WriteOptions,
};
use ps_net::cli::{describe_error, LogArgs};

mod images_cmd;

/// Stratus data tools: write a dataset into a bucket (synthetic, MNIST, your
/// own tabular data, text or images), index image shards where they lie, and
/// chart a run's metrics.
#[derive(Parser, Debug)]
#[command(name = "ps-data", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    logging: LogArgs,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// A learnable synthetic classification set.
    Synthetic {
        /// Bucket URL to write to (file://dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, ...).
        #[arg(long)]
        out: String,
        /// Replace a dataset already at --out (its manifest is deleted before
        /// anything new is written); without it an existing dataset is an error.
        #[arg(long)]
        overwrite: bool,
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
        /// Bucket URL to write to.
        #[arg(long)]
        out: String,
        /// Replace a dataset already at --out (its manifest is deleted before
        /// anything new is written); without it an existing dataset is an error.
        #[arg(long)]
        overwrite: bool,
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
        ps-data import --train digits.csv --test-fraction 0.2 --out file:///data/digits\n  \
        ps-data import --train X_train.npy --train-labels y_train.npy \\\n      \
        --test X_test.npy --test-labels y_test.npy --out s3://bucket/digits\n  \
        ps-data import --train digits.npz --x-key data --y-key target --test-fraction 0.2 --out DIR\n  \
        ps-data import --train train.parquet --test test.parquet --label-column target --out DIR")]
    Import(Box<ImportArgs>),
    /// Plain text tokenized into windows of seq_len + 1 token ids (for
    /// `model.kind = "gpt"`). Files are streamed line by line.
    #[command(after_help = "Examples:\n  \
        ps-data text --in corpus.txt --seq-len 64 --out file:///data/text\n  \
        ps-data text --in a.txt --in b.txt --test held-out.txt --tokenizer tokenizer.json --seq-len 256 --out s3://bucket/text")]
    Text(TextArgs),
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

/// How `synthetic`, `mnist` and `import` cut records into objects.
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

fn main() {
    let cli = Cli::parse();
    cli.logging.init("warn");
    if let Err(e) = dataset(cli.command) {
        eprintln!("ps-data: error: {}", describe_error(e.as_ref()));
        std::process::exit(1);
    }
}

fn plot(run_dir: &Path, out: Option<PathBuf>) -> anyhow::Result<()> {
    let out = out.unwrap_or_else(|| run_dir.join("plots"));
    for path in ps_data::plot::plot_run_dir(run_dir, &out)? {
        ps_net::outln!("{}", path.display());
    }
    Ok(())
}

fn dataset(cmd: Command) -> anyhow::Result<()> {
    // A local output folder this command creates is removed again when the
    // command fails and leaves it empty.
    let out = match &cmd {
        Command::Images(_) | Command::Index(_) | Command::Plot { .. } => {
            return match cmd {
                Command::Images(args) => images_cmd::images(args),
                Command::Index(args) => images_cmd::index(args),
                Command::Plot { run_dir, out } => plot(&run_dir, out),
                _ => bail!("not an image command"),
            };
        }
        Command::Synthetic { out, .. } | Command::Mnist { out, .. } => out.clone(),
        Command::Import(args) => args.out.clone(),
        Command::Text(args) => args.out.clone(),
    };
    let created = local_output_dir(&out).filter(|d| !d.exists());
    let result = match cmd {
        Command::Import(args) => import(*args, created.clone()),
        Command::Text(args) => text(args, created.clone()),
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
    ps_net::outln!(
        "imported {} to {out}: {} train + {} test samples, {} features, {} classes, {} data objects ({layout} layout) + manifest.json, {} bytes",
        m.name,
        m.train.num_samples,
        m.test.num_samples,
        m.features,
        m.classes,
        summary.objects,
        summary.bytes,
    );
    ps_net::outln!("  class   train    test");
    for (c, [tr, te]) in &summary.class_counts {
        ps_net::outln!("  {c:>5} {tr:>7} {te:>7}");
    }
    let empty = m.classes - summary.class_counts.len();
    if empty > 0 {
        ps_net::outln!("  ({empty} of the {} classes have no samples)", m.classes);
    }
    if m.test.num_samples == 0 {
        ps_net::outln!(
            "  note: the test split is empty; give --test FILE or --test-fraction F to evaluate"
        );
    }
    if let Some(n) = &m.normalization {
        ps_net::outln!(
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
    ps_net::outln!(
        "wrote {} to {out}: {} train + {} test windows, {text}",
        m.name,
        m.train.num_samples,
        m.test.num_samples
    );
    Ok(())
}

fn write_builtin(cmd: Command) -> anyhow::Result<()> {
    let (out, overwrite, name, features, classes, train, test, per_shard, layout) = match cmd {
        Command::Images(_)
        | Command::Index(_)
        | Command::Import(_)
        | Command::Text(_)
        | Command::Plot { .. } => {
            bail!("not a built-in dataset")
        }
        Command::Synthetic {
            out,
            overwrite,
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
                overwrite,
                "synthetic".to_string(),
                features,
                classes,
                tr,
                te,
                records_per_shard,
                layout,
            )
        }
        Command::Mnist {
            out,
            overwrite,
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
                overwrite,
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
    rt.block_on(clear_existing(store.as_ref(), &prefix, overwrite))?;
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
    ps_net::outln!(
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
    fn every_subcommand_parses_its_help() {
        Cli::command().debug_assert();
        let cmd = Cli::command();
        let names: Vec<_> = cmd.get_subcommands().map(|c| c.get_name()).collect();
        for name in [
            "synthetic",
            "mnist",
            "images",
            "index",
            "import",
            "text",
            "plot",
        ] {
            assert!(names.contains(&name), "{name} missing from {names:?}");
        }
    }

    #[test]
    fn index_help_names_its_required_arguments() {
        let mut cmd = Cli::command();
        let index = cmd.find_subcommand_mut("index").expect("index");
        let help = index.render_long_help().to_string();
        assert!(help.contains("Required"), "{help}");
        assert!(help.contains("--shape <SHAPE>"), "{help}");
        assert!(help.contains("required with --layout webdataset"), "{help}");
        // clap enforces both.
        let no_shape = Cli::try_parse_from([
            "ps-data",
            "index",
            "--url",
            "file:///d",
            "--layout",
            "class-folders",
        ]);
        assert!(no_shape.is_err());
        let no_train = Cli::try_parse_from([
            "ps-data",
            "index",
            "--url",
            "file:///d",
            "--layout",
            "webdataset",
            "--shape",
            "3,8,8",
        ]);
        assert!(no_train.is_err());
        Cli::try_parse_from([
            "ps-data",
            "index",
            "--url",
            "file:///d",
            "--layout",
            "class-folders",
            "--shape",
            "3,8,8",
        ])
        .expect("class folders need no --train");
    }
}

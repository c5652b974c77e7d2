//! Importing tabular data that users already have: CSV (optionally gzipped),
//! NumPy `.npy` pairs and `.npz` archives, and Parquet files.
//!
//! [`import_dataset`] reads its inputs row by row (never a whole file in
//! memory), in passes: the first validates every row of every input and
//! counts the labels, a second one (only for `standard` normalisation with a
//! `--test-fraction` split) computes the per-feature statistics of the train
//! rows, and the last one streams the rows into a [`DatasetWriter`]. Nothing
//! is written before every input has been validated; if the last pass fails
//! anyway (a file changed between passes, the store failed), every object
//! already written is deleted again.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path as FsPath, PathBuf};
use std::str::FromStr;

use object_store::path::Path;
use object_store::ObjectStore;
use ps_shared::rng::{shuffle, StreamRng};

use crate::format::*;
use crate::write::*;

mod csv;
mod numpy;
mod parquet;
#[cfg(test)]
mod testutil;

use self::csv::CsvRows;
#[cfg(test)]
use self::numpy::npy_dict_value;
use self::numpy::{open_npz_member, NpyRows, NpyStream};
use self::parquet::ParquetRows;

/// A file format [`import_dataset`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// Comma (or other) separated text, optionally gzipped.
    Csv,
    /// A NumPy array file; the labels come from a second `.npy` file.
    Npy,
    /// A NumPy zip archive holding the feature and the label arrays.
    Npz,
    /// An Apache Parquet file of flat numeric columns.
    Parquet,
}

impl InputFormat {
    /// The format a file name implies: `.csv`, `.tsv`, `.txt` (each also
    /// with `.gz`), `.npy`, `.npz`, `.parquet` or `.pq`.
    pub fn detect(path: &FsPath) -> Option<InputFormat> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let name = name.strip_suffix(".gz").unwrap_or(&name);
        let ext = name.rsplit_once('.')?.1;
        match ext {
            "csv" | "tsv" | "txt" => Some(InputFormat::Csv),
            "npy" => Some(InputFormat::Npy),
            "npz" => Some(InputFormat::Npz),
            "parquet" | "pq" => Some(InputFormat::Parquet),
            _ => None,
        }
    }
}

impl fmt::Display for InputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            InputFormat::Csv => "csv",
            InputFormat::Npy => "npy",
            InputFormat::Npz => "npz",
            InputFormat::Parquet => "parquet",
        })
    }
}

impl FromStr for InputFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "csv" => Ok(InputFormat::Csv),
            "npy" => Ok(InputFormat::Npy),
            "npz" => Ok(InputFormat::Npz),
            "parquet" => Ok(InputFormat::Parquet),
            other => Err(format!(
                "unknown format `{other}`; use csv, npy, npz or parquet"
            )),
        }
    }
}

/// Which column of a CSV or Parquet file holds the label; every other
/// column is a feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelColumn {
    /// By name: the CSV file has a header row.
    Name(String),
    /// By 0-based position: the CSV file has no header row.
    Index(usize),
}

/// One input: a file, and for `.npy` features the `.npy` file of the labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportInput {
    pub path: PathBuf,
    pub labels: Option<PathBuf>,
}

impl ImportInput {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            labels: None,
        }
    }

    /// Features in `path`, labels in the separate file `labels` (`.npy`).
    pub fn with_labels(path: impl Into<PathBuf>, labels: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            labels: Some(labels.into()),
        }
    }
}

/// Where the test split comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum TestSplit {
    /// No test split (an empty one).
    None,
    /// A separate file, kept exactly as given.
    File(ImportInput),
    /// A seeded, stratified random share of the train input: in each class,
    /// `round(fraction * count)` rows picked at random go to the test split;
    /// both splits keep the file order.
    Fraction { fraction: f64, seed: u64 },
}

/// The feature transform applied while importing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Normalize {
    /// Features stored as read.
    #[default]
    None,
    /// Every feature divided by this number.
    Scale(f32),
    /// `(x - mean) / std` per feature, with the train split's statistics.
    Standard,
}

impl FromStr for Normalize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s.to_ascii_lowercase().as_str() {
            "none" => return Ok(Normalize::None),
            "standard" => return Ok(Normalize::Standard),
            _ => {}
        }
        let bad =
            || format!("unknown normalisation `{s}`; use none, scale:F (divide by F) or standard");
        let divisor = s
            .strip_prefix("scale:")
            .ok_or_else(bad)?
            .trim()
            .parse::<f32>()
            .map_err(|_| bad())?;
        if !divisor.is_finite() || divisor == 0.0 {
            return Err(format!(
                "scale:{divisor}: the divisor must be finite and non-zero"
            ));
        }
        Ok(Normalize::Scale(divisor))
    }
}

/// Everything [`import_dataset`] needs besides the store.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportOptions {
    pub train: ImportInput,
    pub test: TestSplit,
    /// The format of every input; detected from each file name when `None`.
    pub format: Option<InputFormat>,
    /// CSV and Parquet: the label column.
    pub label_column: LabelColumn,
    /// CSV: the field separator; a tab for `.tsv` files and `,` otherwise
    /// when `None`.
    pub delimiter: Option<u8>,
    /// `.npz`: the names of the feature and label arrays.
    pub x_key: String,
    pub y_key: String,
    /// Labels lie in `0..classes`; the largest train label + 1 when `None`.
    pub classes: Option<usize>,
    pub normalize: Normalize,
    /// The dataset name in the manifest.
    pub name: String,
    pub write: WriteOptions,
    /// The local directory the bucket lives in, removed on failure when it
    /// ends up empty (see [`DatasetWriter::remove_dir_if_empty`]).
    pub remove_dir_if_empty: Option<PathBuf>,
    /// Replace a dataset already under the prefix. Its manifest is deleted
    /// before the first new object is written, so a failed import never
    /// leaves an old manifest pointing at replaced shards. Without it, an
    /// existing manifest is an error.
    pub overwrite: bool,
}

impl ImportOptions {
    /// Defaults for everything but the train input: no test split, the
    /// format from the file name, a `label` column, no normalisation.
    pub fn new(train: ImportInput) -> Self {
        let name = train
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .map(|n| n.split('.').next().unwrap_or(n).to_string())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "imported".to_string());
        Self {
            train,
            test: TestSplit::None,
            format: None,
            label_column: LabelColumn::Name("label".into()),
            delimiter: None,
            x_key: "x".into(),
            y_key: "y".into(),
            classes: None,
            normalize: Normalize::None,
            name,
            write: WriteOptions::default(),
            remove_dir_if_empty: None,
            overwrite: false,
        }
    }
}

/// What [`import_dataset`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportSummary {
    pub manifest: Manifest,
    /// Train and test samples of every label that occurs.
    pub class_counts: BTreeMap<u32, [usize; 2]>,
    /// Data objects written (the manifest not counted).
    pub objects: usize,
    /// Bytes written, the manifest included.
    pub bytes: u64,
}

// Locations and errors

/// Where a row sits in its file, for error messages.
#[derive(Debug, Clone, Copy)]
enum Loc {
    /// 1-based line of a text file.
    Line(usize),
    /// 1-based row of a binary file.
    Row(usize),
}

fn err_at(path: &FsPath, loc: Loc, message: impl Into<String>) -> DatasetError {
    match loc {
        Loc::Line(line) => DatasetError::Parse {
            path: path.to_path_buf(),
            line,
            message: message.into(),
        },
        Loc::Row(row) => DatasetError::Format {
            path: path.to_path_buf(),
            message: format!("row {row}: {}", message.into()),
        },
    }
}

fn err_file(path: &FsPath, message: impl Into<String>) -> DatasetError {
    DatasetError::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// `v` as a label: a non-negative integer (`3.0` is fine, `3.5` is not).
fn to_label(v: f64) -> Result<u32, String> {
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f64 {
        Ok(v as u32)
    } else {
        Err(format!("label {v} is not a non-negative integer"))
    }
}

// Row sources

/// A file read one row at a time: the label as read, and the features.
trait RowSource: Send {
    /// Reads the next row; `false` at the end of the file.
    fn next_row(&mut self, label: &mut f64, features: &mut Vec<f32>) -> Result<bool, DatasetError>;
    /// Where the row last read sits.
    fn loc(&self) -> Loc;
    /// How feature `j` is called in error messages.
    fn feature_name(&self, j: usize) -> String;
    /// The features' column names in feature order, for a file with a
    /// header (CSV with a header row, Parquet); `None` otherwise.
    fn feature_names(&self) -> Option<Vec<String>> {
        None
    }
}

/// A source whose rows are checked: the same width throughout, finite
/// features, integer labels.
struct Rows {
    path: PathBuf,
    source: Box<dyn RowSource>,
    label_raw: f64,
    features: Vec<f32>,
    width: Option<usize>,
    count: usize,
    /// Column matching by name: feature `j` of the train file is feature
    /// `order[j]` of this file ([`column_order`]).
    order: Option<Vec<usize>>,
    scratch: Vec<f32>,
}

impl Rows {
    /// Opens `input` with its features in the file's own order.
    fn open(input: &ImportInput, options: &ImportOptions) -> Result<Rows, DatasetError> {
        Self::open_ordered(input, options, None)
    }

    /// Opens `input`, taking its features in the order `order` gives (see
    /// [`column_order`]), or the file's own order when `None`.
    fn open_ordered(
        input: &ImportInput,
        options: &ImportOptions,
        order: Option<&[usize]>,
    ) -> Result<Rows, DatasetError> {
        let path = &input.path;
        let format = match options.format {
            Some(f) => f,
            None => InputFormat::detect(path).ok_or_else(|| {
                err_file(
                    path,
                    "cannot tell the format from the file name; pass --format csv|npy|npz|parquet",
                )
            })?,
        };
        if input.labels.is_some() && format != InputFormat::Npy {
            return Err(err_file(
                path,
                format!("a separate labels file only goes with .npy features, not {format}"),
            ));
        }
        let source: Box<dyn RowSource> = match format {
            InputFormat::Csv => {
                let delimiter = options.delimiter.unwrap_or_else(|| {
                    let tsv = path
                        .to_str()
                        .map(|p| {
                            let p = p.to_ascii_lowercase();
                            p.ends_with(".tsv") || p.ends_with(".tsv.gz")
                        })
                        .unwrap_or(false);
                    if tsv {
                        b'\t'
                    } else {
                        b','
                    }
                });
                Box::new(CsvRows::open(path, delimiter, &options.label_column)?)
            }
            InputFormat::Npy => {
                let labels = input.labels.as_ref().ok_or_else(|| {
                    err_file(path, "a .npy feature file needs a .npy labels file (--train-labels / --test-labels)")
                })?;
                let x = NpyStream::open_file(path)?;
                let y = NpyStream::open_file(labels)?;
                Box::new(NpyRows::new(path, x, labels, y)?)
            }
            InputFormat::Npz => {
                let x = open_npz_member(path, &options.x_key)?;
                let y = open_npz_member(path, &options.y_key)?;
                let x_name = path.join(format!("{}.npy", options.x_key));
                let y_name = path.join(format!("{}.npy", options.y_key));
                Box::new(NpyRows::new(
                    &x_name,
                    NpyStream::open(&x_name, x)?,
                    &y_name,
                    NpyStream::open(&y_name, y)?,
                )?)
            }
            InputFormat::Parquet => Box::new(ParquetRows::open(path, &options.label_column)?),
        };
        Ok(Rows {
            path: path.clone(),
            source,
            label_raw: 0.0,
            features: Vec::new(),
            width: None,
            count: 0,
            order: order.map(<[usize]>::to_vec),
            scratch: Vec::new(),
        })
    }

    /// The next row's label (its features are in `self.features`), checked.
    fn next(&mut self) -> Result<Option<u32>, DatasetError> {
        if !self
            .source
            .next_row(&mut self.label_raw, &mut self.features)?
        {
            if self.count == 0 {
                return Err(err_file(&self.path, "no samples in the file"));
            }
            return Ok(None);
        }
        self.count += 1;
        let loc = self.source.loc();
        match self.width {
            None if self.features.is_empty() => {
                return Err(err_at(&self.path, loc, "no feature columns"));
            }
            None => self.width = Some(self.features.len()),
            Some(w) if w != self.features.len() => {
                return Err(err_at(
                    &self.path,
                    loc,
                    format!(
                        "{} features but the rows before have {w}",
                        self.features.len()
                    ),
                ));
            }
            Some(_) => {}
        }
        if let Some(order) = &self.order {
            self.scratch.clear();
            for &k in order {
                let v = self.features.get(k).copied().ok_or_else(|| {
                    err_at(
                        &self.path,
                        loc,
                        format!("the row has no {}", self.source.feature_name(k)),
                    )
                })?;
                self.scratch.push(v);
            }
            std::mem::swap(&mut self.features, &mut self.scratch);
        }
        if let Some(j) = self.features.iter().position(|v| !v.is_finite()) {
            return Err(err_at(
                &self.path,
                loc,
                format!(
                    "{} is {} (NaN, infinite or too large for f32)",
                    self.source.feature_name(j),
                    self.features[j]
                ),
            ));
        }
        to_label(self.label_raw)
            .map(Some)
            .map_err(|m| err_at(&self.path, loc, m))
    }

    fn loc(&self) -> Loc {
        self.source.loc()
    }
}

/// How the test file's features line up with the train file's when both
/// files have headers: `Some(order)` where feature `j` of the train file is
/// feature `order[j]` of the test file, `None` when the names are the same
/// in the same order (or either file has no header: then columns go by
/// position). A train column the test file lacks, a test column the train
/// file lacks, or a name that is not unique is an error naming the file and
/// the column.
fn column_order(
    train: &ImportInput,
    test: &ImportInput,
    options: &ImportOptions,
) -> Result<Option<Vec<usize>>, DatasetError> {
    let train_names = Rows::open(train, options)?.source.feature_names();
    let test_names = Rows::open(test, options)?.source.feature_names();
    let (Some(train_names), Some(test_names)) = (train_names, test_names) else {
        return Ok(None);
    };
    if train_names == test_names {
        return Ok(None);
    }
    let unique = |names: &[String],
                  path: &FsPath|
     -> Result<BTreeMap<String, usize>, DatasetError> {
        let mut at = BTreeMap::new();
        for (k, name) in names.iter().enumerate() {
            if at.insert(name.clone(), k).is_some() {
                return Err(err_file(
                    path,
                    format!(
                        "column `{name}` appears twice in the header, so the train and test columns (in different orders) cannot be matched by name"
                    ),
                ));
            }
        }
        Ok(at)
    };
    let train_at = unique(&train_names, &train.path)?;
    let test_at = unique(&test_names, &test.path)?;
    if let Some(extra) = test_names.iter().find(|n| !train_at.contains_key(*n)) {
        return Err(err_file(
            &test.path,
            format!(
                "column `{extra}` is not in the train file {} (columns are matched by name when both files have headers)",
                train.path.display()
            ),
        ));
    }
    train_names
        .iter()
        .map(|name| {
            test_at.get(name).copied().ok_or_else(|| {
                err_file(
                    &test.path,
                    format!(
                        "no column `{name}`, which the train file {} has (columns are matched by name when both files have headers)",
                        train.path.display()
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

// Statistics and the split

/// Per-feature running mean and variance (Welford), in f64.
struct FeatureStats {
    n: u64,
    mean: Vec<f64>,
    m2: Vec<f64>,
}

impl FeatureStats {
    fn new(features: usize) -> Self {
        Self {
            n: 0,
            mean: vec![0.0; features],
            m2: vec![0.0; features],
        }
    }

    fn add(&mut self, x: &[f32]) {
        self.n += 1;
        let n = self.n as f64;
        for ((mean, m2), &v) in self.mean.iter_mut().zip(&mut self.m2).zip(x) {
            let v = v as f64;
            let d = v - *mean;
            *mean += d / n;
            *m2 += d * (v - *mean);
        }
    }

    /// The means and population standard deviations (1 for a constant
    /// feature, which then maps to 0).
    fn normalization(&self) -> Normalization {
        let n = self.n.max(1) as f64;
        let std = self
            .m2
            .iter()
            .map(|m2| {
                let s = (m2 / n).sqrt() as f32;
                if s.is_finite() && s > f32::EPSILON {
                    s
                } else {
                    1.0
                }
            })
            .collect();
        Normalization::Standard {
            mean: self.mean.iter().map(|&m| m as f32).collect(),
            std,
        }
    }
}

/// Rows of the train input that go to the test split: per class, a seeded
/// shuffle picks `round(fraction * count)` of them.
fn stratified_test_rows(labels: &[u32], fraction: f64, seed: u64) -> Vec<bool> {
    let mut by_class: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, &l) in labels.iter().enumerate() {
        by_class.entry(l).or_default().push(i);
    }
    let mut rng = StreamRng::seed_from_u64(seed);
    let mut test = vec![false; labels.len()];
    for rows in by_class.values_mut() {
        shuffle(rows, &mut rng);
        let take = (fraction * rows.len() as f64).round() as usize;
        for &i in &rows[..take.min(rows.len())] {
            test[i] = true;
        }
    }
    test
}

/// What the validation pass learns about one input.
struct Scan {
    rows: usize,
    width: usize,
    /// The largest label and the row it first appears in.
    max_label: (u32, Loc),
    /// All labels in file order (kept only when the split needs them).
    labels: Vec<u32>,
    /// Rows per label.
    counts: BTreeMap<u32, usize>,
}

fn scan(
    input: &ImportInput,
    options: &ImportOptions,
    order: Option<&[usize]>,
    keep_labels: bool,
    mut stats: Option<&mut FeatureStats>,
    classes: Option<usize>,
) -> Result<Scan, DatasetError> {
    let mut rows = Rows::open_ordered(input, options, order)?;
    let mut max_label = (0u32, Loc::Row(0));
    let mut labels = Vec::new();
    let mut counts = BTreeMap::new();
    while let Some(label) = rows.next()? {
        *counts.entry(label).or_insert(0) += 1;
        if let Some(classes) = classes {
            if label as usize >= classes {
                return Err(err_at(
                    &input.path,
                    rows.loc(),
                    format!("label {label} is not below --classes {classes}"),
                ));
            }
        }
        if rows.count == 1 || label > max_label.0 {
            max_label = (label, rows.loc());
        }
        if keep_labels {
            labels.push(label);
        }
        if let Some(stats) = stats.as_deref_mut() {
            if stats.mean.len() != rows.features.len() {
                *stats = FeatureStats::new(rows.features.len());
            }
            stats.add(&rows.features);
        }
    }
    Ok(Scan {
        rows: rows.count,
        width: rows.width.unwrap_or(0),
        max_label,
        labels,
        counts,
    })
}

/// Imports `options.train` (and the test input, if any) into a dataset under
/// `prefix`, validating every row of every input before writing anything.
/// On a failure while writing, the objects already written are deleted.
pub async fn import_dataset(
    store: &dyn ObjectStore,
    prefix: &Path,
    options: &ImportOptions,
) -> Result<ImportSummary, DatasetError> {
    if let TestSplit::Fraction { fraction, .. } = options.test {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(DatasetError::Invalid(format!(
                "the test fraction must be between 0 and 1 (exclusive), got {fraction}"
            )));
        }
    }
    if let Some(classes) = options.classes {
        if classes == 0 || u32::try_from(classes).is_err() {
            return Err(DatasetError::Invalid(format!(
                "classes must be in 1..=u32::MAX, got {classes}"
            )));
        }
    }
    let fraction = match options.test {
        TestSplit::Fraction { fraction, seed } => Some((fraction, seed)),
        _ => None,
    };
    let standard = options.normalize == Normalize::Standard;

    // Pass 1: validate every input; the train statistics too when every
    // train row stays in the train split.
    let mut stats = FeatureStats::new(0);
    let train = scan(
        &options.train,
        options,
        None,
        fraction.is_some(),
        (standard && fraction.is_none()).then_some(&mut stats),
        options.classes,
    )?;
    let classes = options.classes.unwrap_or(train.max_label.0 as usize + 1);
    let test_order = match &options.test {
        TestSplit::File(input) => column_order(&options.train, input, options)?,
        _ => None,
    };
    let test_scan = match &options.test {
        TestSplit::File(input) => {
            let test = scan(
                input,
                options,
                test_order.as_deref(),
                false,
                None,
                options.classes,
            )?;
            if test.width != train.width {
                return Err(DatasetError::Invalid(format!(
                    "the train file {} has {} features but the test file {} has {}",
                    options.train.path.display(),
                    train.width,
                    input.path.display(),
                    test.width
                )));
            }
            if test.max_label.0 as usize >= classes {
                let why = match options.classes {
                    Some(c) => format!("--classes {c}"),
                    None => format!(
                        "the {classes} classes the train labels imply (the largest is {}); pass --classes",
                        train.max_label.0
                    ),
                };
                return Err(err_at(
                    &input.path,
                    test.max_label.1,
                    format!("label {} is not below {why}", test.max_label.0),
                ));
            }
            Some(test)
        }
        _ => None,
    };

    // Which train rows go to the test split.
    let test_rows = fraction.map(|(f, seed)| stratified_test_rows(&train.labels, f, seed));
    let mut class_counts: BTreeMap<u32, [usize; 2]> = BTreeMap::new();
    if let Some(mask) = &test_rows {
        for (&l, &t) in train.labels.iter().zip(mask) {
            class_counts.entry(l).or_default()[t as usize] += 1;
        }
    } else {
        for (&l, &n) in &train.counts {
            class_counts.entry(l).or_default()[0] += n;
        }
    }
    if test_rows.is_some() && class_counts.values().all(|c| c[0] == 0) {
        return Err(DatasetError::Invalid(format!(
            "a test fraction of {} leaves no train samples",
            fraction.map_or(0.0, |f| f.0)
        )));
    }
    if let Some(test) = &test_scan {
        for (&l, &n) in &test.counts {
            class_counts.entry(l).or_default()[1] += n;
        }
    }

    // Pass 2 (standard normalisation of a fraction split): train statistics.
    if standard && fraction.is_some() {
        stats = FeatureStats::new(train.width);
        let mask = test_rows.as_deref().unwrap_or(&[]);
        let mut rows = Rows::open(&options.train, options)?;
        let mut i = 0;
        while rows.next()?.is_some() {
            if !mask.get(i).copied().unwrap_or(false) {
                stats.add(&rows.features);
            }
            i += 1;
        }
    }
    let normalization = match options.normalize {
        Normalize::None => None,
        Normalize::Scale(divisor) => Some(Normalization::Scale { divisor }),
        Normalize::Standard => Some(stats.normalization()),
    };

    // An existing dataset: refused, or its manifest removed first.
    clear_existing(store, prefix, options.overwrite).await?;

    // Last pass: write.
    let mut writer = DatasetWriter::create(
        store,
        prefix,
        &options.name,
        train.width,
        classes,
        &options.write,
    )?;
    writer.set_normalization(normalization.clone());
    if let Some(dir) = &options.remove_dir_if_empty {
        writer.remove_dir_if_empty(dir.clone());
    }
    let mut inputs = vec![(&options.train, train.rows, test_rows.as_deref())];
    if let (TestSplit::File(input), Some(test)) = (&options.test, &test_scan) {
        inputs.push((input, test.rows, None));
    }
    let mut transformed = Vec::with_capacity(train.width);
    for (k, (input, expected, mask)) in inputs.into_iter().enumerate() {
        let order = if k == 1 { test_order.as_deref() } else { None };
        let mut rows = match Rows::open_ordered(input, options, order) {
            Ok(rows) => rows,
            Err(e) => {
                writer.abort().await;
                return Err(e);
            }
        };
        let mut i = 0;
        loop {
            let label = match rows.next() {
                Ok(Some(label)) => label,
                Ok(None) => break,
                Err(e) => {
                    writer.abort().await;
                    return Err(e);
                }
            };
            if i >= expected {
                writer.abort().await;
                return Err(err_file(
                    &input.path,
                    "the file changed while it was being imported (more rows than before)",
                ));
            }
            let split = if k == 1 || mask.is_some_and(|m| m[i]) {
                Split::Test
            } else {
                Split::Train
            };
            transformed.clear();
            match &normalization {
                None => transformed.extend_from_slice(&rows.features),
                Some(Normalization::Scale { divisor }) => {
                    transformed.extend(rows.features.iter().map(|v| v / divisor))
                }
                Some(Normalization::Standard { mean, std }) => transformed.extend(
                    rows.features
                        .iter()
                        .zip(mean.iter().zip(std))
                        .map(|(v, (m, s))| (v - m) / s),
                ),
            }
            writer
                .push(split, label, &transformed)
                .await
                .map_err(|e| match e {
                    DatasetError::Invalid(m) => err_at(&input.path, rows.loc(), m),
                    other => other,
                })?;
            i += 1;
        }
        if i != expected {
            writer.abort().await;
            return Err(err_file(
                &input.path,
                "the file changed while it was being imported (fewer rows than before)",
            ));
        }
    }
    let report = writer.finish().await?;
    Ok(ImportSummary {
        manifest: report.manifest,
        class_counts,
        objects: report.objects,
        bytes: report.bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::testutil::*;
    use super::*;

    #[tokio::test]
    async fn test_columns_in_another_order_are_matched_by_name() {
        use ::parquet::basic::Compression;
        let dir = tempfile::tempdir().unwrap();
        let train = table(20, 4, 3);
        let test = table(9, 4, 3);
        // CSV: the test file lists its columns in another order.
        let tr = write(dir.path(), "tr.csv", csv_columns(&train, &[0, 1, 2, 3]));
        let te = write(dir.path(), "te.csv", csv_columns(&test, &[2, 0, 3, 1]));
        let options = with_test_file(ImportInput::new(&tr), ImportInput::new(&te));
        assert_imports(&options, &train, &test).await;

        // Parquet, the same.
        let tr = dir.path().join("tr.parquet");
        let te = dir.path().join("te.parquet");
        write_parquet_columns(&tr, &train, Compression::SNAPPY, &[0, 1, 2, 3]);
        write_parquet_columns(&te, &test, Compression::SNAPPY, &[3, 1, 0, 2]);
        let options = with_test_file(ImportInput::new(&tr), ImportInput::new(&te));
        assert_imports(&options, &train, &test).await;

        // A missing column is named, with the file; so is an extra one.
        let missing = write(dir.path(), "missing.csv", csv_columns(&test, &[2, 0, 3]));
        let mut options_csv = with_test_file(
            ImportInput::new(dir.path().join("tr.csv")),
            ImportInput::new(&missing),
        );
        fails(&options_csv, &["missing.csv", "no column `f1`", "tr.csv"]).await;
        let renamed = write(
            dir.path(),
            "renamed.csv",
            csv_columns(&test, &[2, 0, 3, 1]).replacen("f3", "g3", 1),
        );
        options_csv.test = TestSplit::File(ImportInput::new(&renamed));
        fails(
            &options_csv,
            &["renamed.csv", "column `g3` is not in the train file"],
        )
        .await;
        let twice = write(
            dir.path(),
            "twice.csv",
            csv_columns(&test, &[2, 0, 3, 1]).replacen("f3", "f2", 1),
        );
        options_csv.test = TestSplit::File(ImportInput::new(&twice));
        fails(&options_csv, &["twice.csv", "`f2` appears twice"]).await;
        // Parquet's missing column too.
        let short = dir.path().join("short.parquet");
        write_parquet_columns(&short, &test, Compression::SNAPPY, &[3, 1, 0]);
        let options = with_test_file(ImportInput::new(&tr), ImportInput::new(&short));
        fails(&options, &["short.parquet", "no column `f2`"]).await;

        // Without a header the columns still go by position.
        let tr = write(dir.path(), "tr_plain.csv", csv(&train, 0, None, ','));
        let te = write(dir.path(), "te_plain.csv", csv(&test, 0, None, ','));
        let mut options = with_test_file(ImportInput::new(&tr), ImportInput::new(&te));
        options.label_column = LabelColumn::Index(0);
        assert_imports(&options, &train, &test).await;
    }

    /// Imports and expects an error containing every one of `needles`, with
    /// nothing left in the store.
    async fn fails(options: &ImportOptions, needles: &[&str]) {
        let (store, prefix) = memory();
        let err = import_dataset(store.as_ref(), &prefix, options)
            .await
            .unwrap_err()
            .to_string();
        for needle in needles {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
        assert!(objects(store.as_ref()).await.is_empty(), "{err}");
    }

    #[tokio::test]
    async fn bad_inputs_are_named_and_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let opts = |path: PathBuf| ImportOptions::new(ImportInput::new(path));
        let header = "label,a,b\n";

        let p = write(d, "nan.csv", format!("{header}0,1,2\n1,3,nan\n"));
        fails(&opts(p), &["nan.csv:3:", "column 3 (`b`)", "NaN"]).await;
        let p = write(d, "inf.csv", format!("{header}0,1,2\n1,inf,2\n"));
        fails(&opts(p), &["inf.csv:3:", "column 2 (`a`)"]).await;
        let p = write(d, "word.csv", format!("{header}0,1,x\n"));
        fails(&opts(p), &["word.csv:2:", "`x` is not a number"]).await;
        let p = write(d, "half.csv", format!("{header}0,1,2\n3.5,1,2\n"));
        fails(
            &opts(p),
            &["half.csv:3:", "label 3.5 is not a non-negative integer"],
        )
        .await;
        let p = write(d, "neg.csv", format!("{header}-1,1,2\n"));
        fails(&opts(p), &["neg.csv:2:", "label -1"]).await;
        let p = write(d, "ragged.csv", format!("{header}0,1,2\n\n1,2\n"));
        fails(
            &opts(p),
            &["ragged.csv:4:", "2 columns but the header has 3"],
        )
        .await;
        // Lines are counted as an editor shows them, with CRLF endings and
        // blank lines too.
        let p = write(d, "crlf.csv", "label,a,b\r\n0,1,2\r\n\r\n\n1,2,y\r\n");
        fails(&opts(p), &["crlf.csv:5:", "column 3 (`b`)"]).await;
        let p = write(d, "bom.csv", format!("\u{feff}{header}0,1,2\n1,3,x\n"));
        fails(&opts(p), &["bom.csv:3:", "column 3 (`b`)"]).await;
        let p = write(d, "empty.csv", "");
        fails(&opts(p), &["empty.csv", "empty"]).await;
        let p = write(d, "header_only.csv", header);
        fails(&opts(p), &["header_only.csv", "no samples"]).await;
        let p = write(d, "nolabel.csv", "a,b\n1,2\n");
        fails(
            &opts(p),
            &["no column named `label`", "--label-column-index"],
        )
        .await;

        let p = write(d, "range.csv", format!("{header}0,1,2\n5,1,2\n"));
        let mut o = opts(p.clone());
        o.classes = Some(3);
        fails(&o, &["range.csv:3:", "label 5 is not below --classes 3"]).await;

        // Train implies 2 classes; a test label of 2 is out of range.
        let tr = write(d, "tr.csv", format!("{header}0,1,2\n1,1,2\n"));
        let te = write(d, "te.csv", format!("{header}0,1,2\n2,1,2\n"));
        let mut o = opts(tr.clone());
        o.test = TestSplit::File(ImportInput::new(&te));
        fails(&o, &["te.csv:3:", "label 2 is not below the 2 classes"]).await;
        // Train and test widths differ: with headers, the extra column is
        // named; without, the widths are.
        let te = write(d, "te3.csv", "label,a,b,c\n0,1,2,3\n");
        o.test = TestSplit::File(ImportInput::new(&te));
        fails(
            &o,
            &["te3.csv", "column `c` is not in the train file", "tr.csv"],
        )
        .await;
        let mut plain = opts(write(d, "tr_plain.csv", "0,1,2\n1,1,2\n"));
        plain.label_column = LabelColumn::Index(0);
        plain.test = TestSplit::File(ImportInput::new(write(d, "te3_plain.csv", "0,1,2,3\n")));
        fails(
            &plain,
            &["tr_plain.csv has 2 features", "te3_plain.csv has 3"],
        )
        .await;

        // .npy: label count, truncation, dtype, NaN.
        let rows = table(4, 3, 2);
        let x = write(d, "x.npy", npy("<f4", &[4, 3], &f32_bytes(&rows)));
        let y3 = write(d, "y3.npy", npy("<i4", &[3], &[0u8; 12]));
        fails(
            &ImportOptions::new(ImportInput::with_labels(&x, &y3)),
            &["y3.npy", "3 labels for the 4 rows"],
        )
        .await;
        let short = write(d, "short.npy", npy("<f4", &[4, 3], &f32_bytes(&rows)[..40]));
        let y4 = write(d, "y4.npy", npy("<i4", &[4], &[0u8; 16]));
        fails(
            &ImportOptions::new(ImportInput::with_labels(&short, &y4)),
            &["short.npy", "truncated"],
        )
        .await;
        let big = write(d, "big.npy", npy(">f4", &[4, 3], &f32_bytes(&rows)));
        fails(
            &ImportOptions::new(ImportInput::with_labels(&big, &y4)),
            &["big.npy", "dtype `>f4` is not supported"],
        )
        .await;
        let mut bytes = f32_bytes(&rows);
        bytes[28..32].copy_from_slice(&f32::NAN.to_le_bytes());
        let nan = write(d, "nan.npy", npy("<f4", &[4, 3], &bytes));
        fails(
            &ImportOptions::new(ImportInput::with_labels(&nan, &y4)),
            &["nan.npy", "row 3: feature 2 is NaN"],
        )
        .await;
        let yf = write(
            d,
            "yf.npy",
            npy(
                "<f8",
                &[4],
                &[0.0f64, 1.0, 0.5, 1.0].map(f64::to_le_bytes).concat(),
            ),
        );
        fails(
            &ImportOptions::new(ImportInput::with_labels(&x, &yf)),
            &["x.npy", "row 3", "label 0.5"],
        )
        .await;
        fails(&opts(x.clone()), &["needs a .npy labels file"]).await;
    }

    #[tokio::test]
    async fn fraction_split_is_stratified_and_seeded() {
        let dir = tempfile::tempdir().unwrap();
        let rows = table(200, 4, 4);
        let path = write(dir.path(), "all.csv", csv(&rows, 0, Some("label"), ','));
        let run = |seed: u64| {
            let path = path.clone();
            async move {
                let mut o = ImportOptions::new(ImportInput::new(path));
                o.test = TestSplit::Fraction {
                    fraction: 0.25,
                    seed,
                };
                let (store, prefix) = memory();
                let s = import_dataset(store.as_ref(), &prefix, &o).await.unwrap();
                let (_, train, test) = read_back(store, &prefix).await;
                (s.class_counts, train, test)
            }
        };
        let (counts, train, test) = run(1).await;
        // 50 rows per class; round(0.25 * 50) = 13 of each go to test.
        assert_eq!(counts.into_values().collect::<Vec<_>>(), vec![[37, 13]; 4]);
        assert_eq!((train.len(), test.len()), (148, 52));
        let again = run(1).await;
        assert_eq!((&again.1, &again.2), (&train, &test));
        let other = run(2).await;
        assert_ne!(other.2, test);
        // Every row lands in exactly one split, in file order.
        let mut seen: Vec<f32> = train
            .features
            .chunks(4)
            .chain(test.features.chunks(4))
            .map(|r| r[0])
            .collect();
        seen.sort_by(f32::total_cmp);
        assert_eq!(seen, (0..200).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
        assert!(test.features.chunks(4).map(|r| r[0]).is_sorted());
    }

    #[tokio::test]
    async fn standard_and_scale_normalisation() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = table(90, 3, 3);
        for (i, (_, x)) in rows.iter_mut().enumerate() {
            x[1] = (i as f32 * 1.7).sin() * 40.0 + 100.0;
            x[2] = 5.0; // constant
        }
        let path = write(dir.path(), "n.csv", csv(&rows, 0, Some("label"), ','));
        for fraction in [None, Some(0.2)] {
            let mut o = ImportOptions::new(ImportInput::new(&path));
            o.normalize = Normalize::Standard;
            if let Some(fraction) = fraction {
                o.test = TestSplit::Fraction { fraction, seed: 3 };
            }
            let (store, prefix) = memory();
            import_dataset(store.as_ref(), &prefix, &o).await.unwrap();
            let (manifest, train, test) = read_back(store, &prefix).await;
            let Some(Normalization::Standard { mean, std }) = manifest.normalization else {
                panic!("no statistics in the manifest");
            };
            assert_eq!(std[2], 1.0);
            let n = train.len() as f64;
            for j in 0..3 {
                let col: Vec<f64> = train.features.chunks(3).map(|r| r[j] as f64).collect();
                let m = col.iter().sum::<f64>() / n;
                let var = col.iter().map(|v| (v - m).powi(2)).sum::<f64>() / n;
                assert!(m.abs() < 1e-4, "feature {j} mean {m}");
                let want = if j == 2 { 0.0 } else { 1.0 };
                assert!((var - want).abs() < 1e-3, "feature {j} variance {var}");
            }
            // The test split uses the train statistics.
            for (k, r) in test.features.chunks(3).enumerate() {
                let raw = rows
                    .iter()
                    .find(|(_, x)| ((x[0] - mean[0]) / std[0] - r[0]).abs() < 1e-5);
                assert!(raw.is_some(), "test row {k} is not a transformed input row");
            }
        }
        let mut o = ImportOptions::new(ImportInput::new(&path));
        o.normalize = "scale:16".parse().unwrap();
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &o).await.unwrap();
        let (manifest, train, _) = read_back(store, &prefix).await;
        assert_eq!(
            manifest.normalization,
            Some(Normalization::Scale { divisor: 16.0 })
        );
        assert_eq!(train.row(3).unwrap()[0], rows[3].1[0] / 16.0);
    }

    #[tokio::test]
    async fn an_existing_dataset_needs_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(
            dir.path(),
            "a.csv",
            csv(&table(10, 2, 2), 0, Some("label"), ','),
        );
        let b = write(
            dir.path(),
            "b.csv",
            csv(&table(4, 3, 2), 0, Some("label"), ','),
        );
        let (store, prefix) = memory();
        import_dataset(
            store.as_ref(),
            &prefix,
            &ImportOptions::new(ImportInput::new(&a)),
        )
        .await
        .unwrap();
        let mut o = ImportOptions::new(ImportInput::new(&b));
        let err = import_dataset(store.as_ref(), &prefix, &o)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("--overwrite"), "{err}");
        assert_eq!(read_back(store.clone(), &prefix).await.0.features, 2);
        o.overwrite = true;
        import_dataset(store.as_ref(), &prefix, &o).await.unwrap();
        let (manifest, train, _) = read_back(store, &prefix).await;
        assert_eq!((manifest.features, train.len()), (3, 4));
    }

    #[test]
    fn the_import_future_is_send() {
        fn send<T: Send>(_: &T) {}
        let (store, prefix) = memory();
        let options = ImportOptions::new(ImportInput::new("x.csv"));
        send(&import_dataset(store.as_ref(), &prefix, &options));
    }

    #[test]
    fn option_parsing() {
        assert_eq!("none".parse::<Normalize>(), Ok(Normalize::None));
        assert_eq!("Standard".parse::<Normalize>(), Ok(Normalize::Standard));
        assert_eq!(
            "scale:255".parse::<Normalize>(),
            Ok(Normalize::Scale(255.0))
        );
        assert!("scale:0".parse::<Normalize>().is_err());
        assert!("minmax".parse::<Normalize>().is_err());
        for (name, format) in [
            ("a.csv", Some(InputFormat::Csv)),
            ("a.CSV.gz", Some(InputFormat::Csv)),
            ("a.tsv", Some(InputFormat::Csv)),
            ("x.npy", Some(InputFormat::Npy)),
            ("d.npz", Some(InputFormat::Npz)),
            ("t.parquet", Some(InputFormat::Parquet)),
            ("t.bin", None),
            ("noext", None),
        ] {
            assert_eq!(InputFormat::detect(FsPath::new(name)), format, "{name}");
        }
        assert_eq!(to_label(3.0), Ok(3));
        assert!(to_label(3.5).is_err());
        assert!(to_label(f64::NAN).is_err());
        assert_eq!(
            ImportOptions::new(ImportInput::new("/d/digits.train.csv.gz")).name,
            "digits"
        );
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (1797, 64), }";
        assert_eq!(npy_dict_value(dict, "descr"), Some("'<f8'"));
        assert_eq!(npy_dict_value(dict, "fortran_order"), Some("False"));
        assert_eq!(npy_dict_value(dict, "shape"), Some("(1797, 64)"));
    }
}

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
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path as FsPath, PathBuf};
use std::str::FromStr;

use object_store::path::Path;
use object_store::ObjectStore;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::Field;
use ps_shared::rng::{shuffle, StreamRng};

use crate::format::*;
use crate::mnist::{csv_error, csv_record_line, io_err, open_maybe_gz, skip_bom, LineTracker};
use crate::write::*;

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

/// Trims blanks and one pair of surrounding double quotes the CSV reader
/// left (a quote after leading blanks does not start a quoted field).
fn unquote(field: &str) -> &str {
    let f = field.trim();
    f.strip_prefix('"')
        .and_then(|f| f.strip_suffix('"'))
        .map(str::trim)
        .unwrap_or(f)
}

/// CSV rows, read by the `csv` crate as a stream: every column but the
/// label column is a feature. Fields are numbers, optionally quoted; blank
/// lines are skipped.
struct CsvRows {
    path: PathBuf,
    reader: csv::Reader<LineTracker<Box<dyn BufRead + Send>>>,
    record: csv::StringRecord,
    /// 1-based line where the record last read ends (its only line, for
    /// anything but a quoted field with a line break).
    line: usize,
    /// A first data record already read (files without a header).
    pending: bool,
    columns: usize,
    label: usize,
    header: Option<Vec<String>>,
}

impl CsvRows {
    fn open(path: &FsPath, delimiter: u8, label: &LabelColumn) -> Result<Self, DatasetError> {
        let mut input = open_maybe_gz(path)?;
        skip_bom(path, &mut input)?;
        let reader = csv::ReaderBuilder::new()
            .delimiter(delimiter)
            .has_headers(false)
            // Rows of another width get this importer's own message.
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(LineTracker::new(input));
        let mut rows = CsvRows {
            path: path.to_path_buf(),
            reader,
            record: csv::StringRecord::new(),
            line: 0,
            pending: false,
            columns: 0,
            label: 0,
            header: None,
        };
        if !rows.read_record()? {
            return Err(err_file(path, "the file is empty"));
        }
        let fields: Vec<String> = rows.record.iter().map(|f| unquote(f).to_string()).collect();
        rows.columns = fields.len();
        match label {
            LabelColumn::Name(name) => {
                rows.label = fields.iter().position(|f| f == name).ok_or_else(|| {
                    let shown: Vec<&str> = fields.iter().take(8).map(String::as_str).collect();
                    let more = if fields.len() > 8 {
                        ", ..."
                    } else if fields.len() == 1 {
                        "; only one column: is --delimiter right?"
                    } else {
                        ""
                    };
                    err_at(
                        path,
                        Loc::Line(rows.line),
                        format!(
                            "no column named `{name}` in the header ({}{more}); name the label column with --label-column NAME, or give --label-column-index N for a file without a header",
                            shown.join(", ")
                        ),
                    )
                })?;
                rows.header = Some(fields);
            }
            LabelColumn::Index(i) => {
                if *i >= rows.columns {
                    return Err(err_at(
                        path,
                        Loc::Line(rows.line),
                        format!(
                            "label column index {i} is past the last of the {} columns (indices start at 0)",
                            rows.columns
                        ),
                    ));
                }
                rows.label = *i;
                rows.pending = true;
            }
        }
        Ok(rows)
    }

    /// Reads the next record that is not a blank line into `record`.
    fn read_record(&mut self) -> Result<bool, DatasetError> {
        loop {
            let read = self.reader.read_record(&mut self.record);
            self.line = csv_record_line(&mut self.reader);
            match read {
                Ok(false) => return Ok(false),
                Ok(true) => {}
                Err(e) => return Err(csv_error(&self.path, e, self.line)),
            }
            let blank = self.record.len() == 1 && self.record[0].is_empty();
            if !blank {
                return Ok(true);
            }
        }
    }
}

impl RowSource for CsvRows {
    fn next_row(&mut self, label: &mut f64, features: &mut Vec<f32>) -> Result<bool, DatasetError> {
        if self.pending {
            self.pending = false;
        } else if !self.read_record()? {
            return Ok(false);
        }
        features.clear();
        let n = self.record.len();
        for (c, field) in self.record.iter().take(self.columns).enumerate() {
            let field = unquote(field);
            if c == self.label {
                *label = field.parse::<f64>().map_err(|_| {
                    err_at(
                        &self.path,
                        Loc::Line(self.line),
                        format!("label `{field}` is not a number"),
                    )
                })?;
            } else {
                let v = field.parse::<f32>().map_err(|_| {
                    let j = features.len();
                    err_at(
                        &self.path,
                        Loc::Line(self.line),
                        format!("{}: `{field}` is not a number", self.feature_name(j)),
                    )
                })?;
                features.push(v);
            }
        }
        if n != self.columns {
            let what = if self.header.is_some() {
                "the header has"
            } else {
                "the first row has"
            };
            return Err(err_at(
                &self.path,
                Loc::Line(self.line),
                format!("{n} columns but {what} {}", self.columns),
            ));
        }
        Ok(true)
    }

    fn loc(&self) -> Loc {
        Loc::Line(self.line)
    }

    fn feature_name(&self, j: usize) -> String {
        let c = if j < self.label { j } else { j + 1 };
        match self.header.as_ref().and_then(|h| h.get(c)) {
            Some(name) => format!("column {} (`{name}`)", c + 1),
            None => format!("column {}", c + 1),
        }
    }

    fn feature_names(&self) -> Option<Vec<String>> {
        let header = self.header.as_ref()?;
        Some(
            header
                .iter()
                .enumerate()
                .filter(|&(c, _)| c != self.label)
                .map(|(_, name)| name.clone())
                .collect(),
        )
    }
}

/// The element types of `.npy` arrays this importer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dtype {
    F4,
    F8,
    I1,
    I2,
    I4,
    I8,
    U1,
    U2,
    U4,
    U8,
    B1,
}

impl Dtype {
    fn parse(descr: &str) -> Option<Dtype> {
        let (order, kind) = descr.split_at_checked(1)?;
        if !matches!(order, "<" | "|" | "=") {
            return None;
        }
        Some(match kind {
            "f4" => Dtype::F4,
            "f8" => Dtype::F8,
            "i1" => Dtype::I1,
            "i2" => Dtype::I2,
            "i4" => Dtype::I4,
            "i8" => Dtype::I8,
            "u1" => Dtype::U1,
            "u2" => Dtype::U2,
            "u4" => Dtype::U4,
            "u8" => Dtype::U8,
            "b1" => Dtype::B1,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Dtype::I1 | Dtype::U1 | Dtype::B1 => 1,
            Dtype::I2 | Dtype::U2 => 2,
            Dtype::F4 | Dtype::I4 | Dtype::U4 => 4,
            Dtype::F8 | Dtype::I8 | Dtype::U8 => 8,
        }
    }

    fn decode(self, b: &[u8]) -> f64 {
        let a = |n: usize| -> [u8; 8] {
            let mut out = [0u8; 8];
            out[..n].copy_from_slice(&b[..n]);
            out
        };
        match self {
            Dtype::F4 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            Dtype::F8 => f64::from_le_bytes(a(8)),
            Dtype::I1 => b[0] as i8 as f64,
            Dtype::I2 => i16::from_le_bytes([b[0], b[1]]) as f64,
            Dtype::I4 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            Dtype::I8 => i64::from_le_bytes(a(8)) as f64,
            Dtype::U1 | Dtype::B1 => b[0] as f64,
            Dtype::U2 => u16::from_le_bytes([b[0], b[1]]) as f64,
            Dtype::U4 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
            Dtype::U8 => u64::from_le_bytes(a(8)) as f64,
        }
    }
}

/// The value of `key` in the header dictionary of a `.npy` file, as text.
fn npy_dict_value<'a>(dict: &'a str, key: &str) -> Option<&'a str> {
    let quoted = [format!("'{key}'"), format!("\"{key}\"")];
    let at = quoted
        .iter()
        .find_map(|q| dict.find(q.as_str()).map(|i| i + q.len()))?;
    let rest = dict[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else if let Some(body) = rest.strip_prefix('\'').or_else(|| rest.strip_prefix('"')) {
        body.find(['\'', '"'])? + 2
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}

/// A `.npy` array read front to back.
struct NpyStream {
    reader: Box<dyn Read + Send>,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Bytes before the data.
    header: u64,
    buf: Vec<u8>,
}

impl NpyStream {
    fn open_file(path: &FsPath) -> Result<NpyStream, DatasetError> {
        let file = File::open(path).map_err(io_err(path))?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let stream = NpyStream::open(path, Box::new(BufReader::new(file)))?;
        // A plain file can be checked for its full size up front.
        let data = (stream.len() as u64).saturating_mul(stream.dtype.size() as u64);
        let have = len.saturating_sub(stream.header);
        if have < data {
            return Err(err_file(
                path,
                format!(
                    "the file is truncated: shape {:?} needs {data} data bytes but only {have} follow the header",
                    stream.shape,
                ),
            ));
        }
        Ok(stream)
    }

    /// Reads the header of a `.npy` stream, leaving the reader at the data.
    fn open(path: &FsPath, mut reader: Box<dyn Read + Send>) -> Result<NpyStream, DatasetError> {
        let mut magic = [0u8; 8];
        reader
            .read_exact(&mut magic)
            .map_err(|_| err_file(path, "not a .npy array (too short)"))?;
        if &magic[..6] != b"\x93NUMPY" {
            return Err(err_file(path, "not a .npy array (bad magic)"));
        }
        let (len_bytes, prefix) = match magic[6] {
            1 => (2usize, 10u64),
            2 | 3 => (4, 12),
            v => return Err(err_file(path, format!(".npy version {v} is not supported"))),
        };
        let mut lb = [0u8; 4];
        reader
            .read_exact(&mut lb[..len_bytes])
            .map_err(|_| err_file(path, "the file ends inside its header"))?;
        let dict_len = u32::from_le_bytes(lb) as usize;
        let mut dict = vec![0u8; dict_len];
        reader
            .read_exact(&mut dict)
            .map_err(|_| err_file(path, "the file ends inside its header"))?;
        let dict = String::from_utf8_lossy(&dict).into_owned();
        let bad = |what: &str| err_file(path, format!("bad .npy header ({what}): {}", dict.trim()));
        let descr = npy_dict_value(&dict, "descr").ok_or_else(|| bad("no descr"))?;
        let descr = descr.trim_matches(['\'', '"']);
        let dtype = Dtype::parse(descr).ok_or_else(|| {
            err_file(
                path,
                format!(
                    "dtype `{descr}` is not supported; use little-endian float (f4, f8), int (i1..i8), uint (u1..u8) or bool"
                ),
            )
        })?;
        let fortran =
            npy_dict_value(&dict, "fortran_order").ok_or_else(|| bad("no fortran_order"))?;
        let shape_text = npy_dict_value(&dict, "shape").ok_or_else(|| bad("no shape"))?;
        let shape = shape_text
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad("shape"))?;
        if fortran == "True" && shape.iter().filter(|&&d| d > 1).count() > 1 {
            return Err(err_file(
                path,
                "the array is in Fortran order; save it in C order (numpy.ascontiguousarray)",
            ));
        }
        if shape.is_empty() {
            return Err(err_file(
                path,
                "the array is a scalar, not one row per sample",
            ));
        }
        Ok(NpyStream {
            reader,
            dtype,
            shape,
            header: prefix + dict_len as u64,
            buf: Vec::new(),
        })
    }

    /// Elements in the array.
    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Reads `n` elements into `out` as `f64`s; `false` on a short read.
    fn read(&mut self, n: usize, out: &mut impl FnMut(f64)) -> std::io::Result<bool> {
        let size = self.dtype.size();
        self.buf.resize(n * size, 0);
        match self.reader.read_exact(&mut self.buf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e),
        }
        for chunk in self.buf.chunks_exact(size) {
            out(self.dtype.decode(chunk));
        }
        Ok(true)
    }
}

/// Rows of a feature array (`rows x features...`, flattened in C order)
/// paired with a label array (`rows` or `rows x 1`).
struct NpyRows {
    x_path: PathBuf,
    x: NpyStream,
    y_path: PathBuf,
    y: NpyStream,
    rows: usize,
    width: usize,
    row: usize,
}

impl NpyRows {
    fn new(
        x_path: &FsPath,
        x: NpyStream,
        y_path: &FsPath,
        y: NpyStream,
    ) -> Result<NpyRows, DatasetError> {
        let rows = x.shape[0];
        let width: usize = x.shape[1..].iter().product();
        if y.shape.len() > 2 || (y.shape.len() == 2 && y.shape[1] != 1) {
            return Err(err_file(
                y_path,
                format!(
                    "labels must be one per row, shape (n,) or (n, 1), not {:?}",
                    y.shape
                ),
            ));
        }
        if y.shape[0] != rows {
            return Err(err_file(
                y_path,
                format!(
                    "{} labels for the {rows} rows of {}",
                    y.shape[0],
                    x_path.display()
                ),
            ));
        }
        if rows == 0 {
            return Err(err_file(x_path, "no samples in the array"));
        }
        if width == 0 {
            return Err(err_file(
                x_path,
                format!("shape {:?} has no features", x.shape),
            ));
        }
        Ok(NpyRows {
            x_path: x_path.to_path_buf(),
            x,
            y_path: y_path.to_path_buf(),
            y,
            rows,
            width,
            row: 0,
        })
    }
}

impl RowSource for NpyRows {
    fn next_row(&mut self, label: &mut f64, features: &mut Vec<f32>) -> Result<bool, DatasetError> {
        if self.row == self.rows {
            return Ok(false);
        }
        self.row += 1;
        features.clear();
        let truncated = |path: &FsPath, row: usize, rows: usize| {
            err_file(
                path,
                format!("the data ends at row {row}, before the {rows} rows the header promises"),
            )
        };
        if !self
            .x
            .read(self.width, &mut |v| features.push(v as f32))
            .map_err(io_err(&self.x_path))?
        {
            return Err(truncated(&self.x_path, self.row, self.rows));
        }
        if !self
            .y
            .read(1, &mut |v| *label = v)
            .map_err(io_err(&self.y_path))?
        {
            return Err(truncated(&self.y_path, self.row, self.rows));
        }
        Ok(true)
    }

    fn loc(&self) -> Loc {
        Loc::Row(self.row)
    }

    fn feature_name(&self, j: usize) -> String {
        format!("feature {j}")
    }
}

/// Opens the array `key` (member `key.npy`, or `key`) of a `.npz` archive as
/// a stream of its own: stored or deflated members are read straight from
/// the file, never whole in memory.
fn open_npz_member(path: &FsPath, key: &str) -> Result<Box<dyn Read + Send>, DatasetError> {
    let zip_err =
        |e: zip::result::ZipError| err_file(path, format!("not a readable .npz archive: {e}"));
    let file = File::open(path).map_err(io_err(path))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(file)).map_err(zip_err)?;
    let names: Vec<String> = archive
        .file_names()
        .filter_map(Result::ok)
        .map(|n| n.into_owned())
        .collect();
    let member = [format!("{key}.npy"), key.to_string()]
        .into_iter()
        .find(|n| names.contains(n))
        .ok_or_else(|| {
            let arrays: Vec<&str> = names
                .iter()
                .map(|n| n.strip_suffix(".npy").unwrap_or(n))
                .collect();
            err_file(
                path,
                format!(
                    "no array `{key}` in the archive (it has: {}); pick them with --x-key and --y-key",
                    arrays.join(", ")
                ),
            )
        })?;
    let (start, size, method) = {
        let entry = archive.by_name(&member).map_err(zip_err)?;
        if entry.encrypted() {
            return Err(err_file(path, format!("{member} is encrypted")));
        }
        (
            entry.data_start(),
            entry.compressed_size(),
            entry.compression(),
        )
    };
    let start =
        start.ok_or_else(|| err_file(path, format!("cannot locate the data of {member}")))?;
    let mut file = File::open(path).map_err(io_err(path))?;
    file.seek(SeekFrom::Start(start)).map_err(io_err(path))?;
    let raw = BufReader::new(file).take(size);
    match method {
        zip::CompressionMethod::Stored => Ok(Box::new(raw)),
        zip::CompressionMethod::Deflated => Ok(Box::new(BufReader::new(
            flate2::read::DeflateDecoder::new(raw),
        ))),
        other => Err(err_file(
            path,
            format!("{member} is compressed with {other:?}; only stored and deflate members are supported (numpy.savez / savez_compressed)"),
        )),
    }
}

/// Rows of a Parquet file of flat numeric (or boolean) columns, read row
/// group by row group.
struct ParquetRows {
    path: PathBuf,
    rows: RowIter<'static>,
    names: Vec<String>,
    label: usize,
    /// The columns that are features: all but the label and a pandas index
    /// (`__index_level_0__`, ...).
    feature_columns: Vec<usize>,
    is_feature: Vec<bool>,
    row: usize,
}

/// The Parquet compressions this build reads.
const PARQUET_COMPRESSIONS: &str = "uncompressed, snappy, gzip";

/// Refuse a column compressed with a codec this build does not read (zstd,
/// lz4, brotli, ...), naming the column, its codec and the supported ones,
/// before any row is read.
fn check_parquet_compression(
    path: &FsPath,
    columns: impl IntoIterator<Item = (String, parquet::basic::Compression)>,
) -> Result<(), DatasetError> {
    use parquet::basic::Compression;
    for (column, codec) in columns {
        match codec {
            Compression::UNCOMPRESSED | Compression::SNAPPY | Compression::GZIP(_) => {}
            other => {
                let name = match other {
                    Compression::ZSTD(_) => "zstd".to_string(),
                    Compression::BROTLI(_) => "brotli".to_string(),
                    Compression::LZ4 | Compression::LZ4_RAW => "lz4".to_string(),
                    Compression::LZO => "lzo".to_string(),
                    o => format!("{o:?}").to_lowercase(),
                };
                return Err(err_file(
                    path,
                    format!(
                        "column `{column}` is compressed with {name}, which this build does not read (supported: {PARQUET_COMPRESSIONS}); write the file again with one of those (e.g. pandas `to_parquet(..., compression=\"snappy\")`)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl ParquetRows {
    fn open(path: &FsPath, label: &LabelColumn) -> Result<Self, DatasetError> {
        let file = File::open(path).map_err(io_err(path))?;
        let reader = SerializedFileReader::new(file)
            .map_err(|e| err_file(path, format!("not a readable Parquet file: {e}")))?;
        let columns = reader.metadata().row_groups().iter().flat_map(|g| {
            g.columns()
                .iter()
                .map(|c| (c.column_path().string(), c.compression()))
        });
        check_parquet_compression(path, columns)?;
        let schema = reader.metadata().file_metadata().schema_descr();
        let mut names = Vec::new();
        for field in schema.root_schema().get_fields() {
            if !field.is_primitive() {
                return Err(err_file(
                    path,
                    format!(
                        "column `{}` is nested (a list, map or struct); only flat numeric columns are supported",
                        field.name()
                    ),
                ));
            }
            names.push(field.name().to_string());
        }
        let label = match label {
            LabelColumn::Name(name) => names.iter().position(|n| n == name).ok_or_else(|| {
                err_file(
                    path,
                    format!(
                        "no column named `{name}` (columns: {}); name the label column with --label-column NAME",
                        names.join(", ")
                    ),
                )
            })?,
            LabelColumn::Index(i) if *i < names.len() => *i,
            LabelColumn::Index(i) => {
                return Err(err_file(
                    path,
                    format!(
                        "label column index {i} is past the last of the {} columns",
                        names.len()
                    ),
                ))
            }
        };
        let is_feature: Vec<bool> = names
            .iter()
            .enumerate()
            .map(|(c, n)| c != label && !n.starts_with("__index_level_"))
            .collect();
        let feature_columns = (0..names.len()).filter(|&c| is_feature[c]).collect();
        Ok(ParquetRows {
            path: path.to_path_buf(),
            rows: RowIter::from_file_into(Box::new(reader)),
            names,
            label,
            feature_columns,
            is_feature,
            row: 0,
        })
    }
}

fn field_value(field: &Field) -> Option<f64> {
    Some(match *field {
        Field::Bool(b) => b as u8 as f64,
        Field::Byte(v) => v as f64,
        Field::Short(v) => v as f64,
        Field::Int(v) => v as f64,
        Field::Long(v) => v as f64,
        Field::UByte(v) => v as f64,
        Field::UShort(v) => v as f64,
        Field::UInt(v) => v as f64,
        Field::ULong(v) => v as f64,
        Field::Float16(v) => v.to_f64(),
        Field::Float(v) => v as f64,
        Field::Double(v) => v,
        _ => return None,
    })
}

impl RowSource for ParquetRows {
    fn next_row(&mut self, label: &mut f64, features: &mut Vec<f32>) -> Result<bool, DatasetError> {
        let row = match self.rows.next() {
            None => return Ok(false),
            Some(row) => {
                self.row += 1;
                row.map_err(|e| err_at(&self.path, Loc::Row(self.row), e.to_string()))?
            }
        };
        features.clear();
        for (c, (name, field)) in row.get_column_iter().enumerate() {
            if c != self.label && !self.is_feature.get(c).copied().unwrap_or(false) {
                continue;
            }
            let v = field_value(field).ok_or_else(|| {
                let what = if matches!(field, Field::Null) {
                    "null".to_string()
                } else {
                    format!("not a number ({field})")
                };
                err_at(
                    &self.path,
                    Loc::Row(self.row),
                    format!("column `{name}` is {what}"),
                )
            })?;
            if c == self.label {
                *label = v;
            } else {
                features.push(v as f32);
            }
        }
        Ok(true)
    }

    fn loc(&self) -> Loc {
        Loc::Row(self.row)
    }

    fn feature_name(&self, j: usize) -> String {
        let name = self
            .feature_columns
            .get(j)
            .and_then(|&c| self.names.get(c))
            .map_or("?", String::as_str);
        format!("column `{name}`")
    }

    fn feature_names(&self) -> Option<Vec<String>> {
        Some(
            self.feature_columns
                .iter()
                .filter_map(|&c| self.names.get(c).cloned())
                .collect(),
        )
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
    use std::io::Write;
    use std::sync::Arc;

    use futures::TryStreamExt;

    use super::*;
    use crate::DatasetReader;
    use object_store::ObjectStoreExt;

    fn memory() -> (Arc<dyn ObjectStore>, Path) {
        crate::open_bucket("memory://imported").unwrap()
    }

    async fn objects(store: &dyn ObjectStore) -> Vec<String> {
        let list: Vec<_> = store.list(None).try_collect().await.unwrap();
        list.into_iter().map(|m| m.location.to_string()).collect()
    }

    async fn read_back(store: Arc<dyn ObjectStore>, prefix: &Path) -> (Manifest, Batch, Batch) {
        let reader = DatasetReader::open(store, prefix.clone()).await.unwrap();
        let train = reader.fetch_all(Split::Train).await.unwrap();
        let test = reader.fetch_all(Split::Test).await.unwrap();
        (reader.manifest().clone(), train, test)
    }

    /// `n` rows of `features` values with labels cycling through `classes`;
    /// value `j` of row `i` is `i * 0.5 + j` (exact in f32).
    fn table(n: usize, features: usize, classes: u32) -> Vec<(u32, Vec<f32>)> {
        (0..n)
            .map(|i| {
                let x = (0..features).map(|j| i as f32 * 0.5 + j as f32).collect();
                ((i as u32 * 7 + 3) % classes, x)
            })
            .collect()
    }

    fn assert_batch(batch: &Batch, rows: &[(u32, Vec<f32>)]) {
        assert_eq!(batch.len(), rows.len());
        for (i, (label, x)) in rows.iter().enumerate() {
            assert_eq!(batch.labels[i], *label, "row {i}");
            assert_eq!(batch.row(i).unwrap(), &x[..], "row {i}");
        }
    }

    /// A CSV with the label in column `label_at`, under a header when asked.
    fn csv(rows: &[(u32, Vec<f32>)], label_at: usize, header: Option<&str>, sep: char) -> String {
        let mut out = String::new();
        let width = rows[0].1.len();
        if let Some(name) = header {
            let mut cols: Vec<String> = (0..width).map(|j| format!("f{j}")).collect();
            cols.insert(label_at, name.to_string());
            out += &cols.join(&sep.to_string());
            out += "\n";
        }
        for (label, x) in rows {
            let mut cols: Vec<String> = x.iter().map(|v| v.to_string()).collect();
            cols.insert(label_at, format!("{label}.0"));
            out += &cols.join(&sep.to_string());
            out += "\r\n";
        }
        out
    }

    /// A version 1 `.npy` file.
    fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let shape = if shape.len() == 1 {
            format!("({},)", dims[0])
        } else {
            format!("({})", dims.join(", "))
        };
        let mut dict =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + dict.len() + 1) % 64 != 0 {
            dict.push(' ');
        }
        dict.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
        out.extend_from_slice(dict.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn f64_bytes(rows: &[(u32, Vec<f32>)]) -> Vec<u8> {
        rows.iter()
            .flat_map(|(_, x)| x.iter().flat_map(|&v| (v as f64).to_le_bytes()))
            .collect()
    }

    fn f32_bytes(rows: &[(u32, Vec<f32>)]) -> Vec<u8> {
        rows.iter()
            .flat_map(|(_, x)| x.iter().flat_map(|v| v.to_le_bytes()))
            .collect()
    }

    fn write(dir: &FsPath, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[tokio::test]
    async fn csv_with_header_and_a_test_file_64_features_10_classes() {
        let dir = tempfile::tempdir().unwrap();
        let train = table(120, 64, 10);
        let test = table(30, 64, 10);
        let tr = write(
            dir.path(),
            "digits.csv",
            csv(&train, 3, Some("target"), ','),
        );
        let te = write(
            dir.path(),
            "digits_test.csv",
            csv(&test, 3, Some("target"), ','),
        );
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&te));
        options.label_column = LabelColumn::Name("target".into());
        options.write.records_per_shard = 50;
        let (store, prefix) = memory();
        let summary = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        assert_eq!(summary.manifest.name, "digits");
        assert_eq!(
            (summary.manifest.features, summary.manifest.classes),
            (64, 10)
        );
        assert_eq!(summary.objects, 3 + 1);
        assert_eq!(
            summary.class_counts.values().map(|c| c[0]).sum::<usize>(),
            120
        );
        assert_eq!(summary.class_counts.len(), 10);
        assert!(summary.class_counts.values().all(|c| c[1] == 3));
        assert_eq!(
            summary.bytes,
            150 * 260 + {
                let m = store
                    .get(&prefix.clone().join(MANIFEST_NAME))
                    .await
                    .unwrap();
                m.meta.size
            }
        );
        let (manifest, tr_batch, te_batch) = read_back(store, &prefix).await;
        assert_eq!(manifest.normalization, None);
        assert_batch(&tr_batch, &train);
        assert_batch(&te_batch, &test);
    }

    #[tokio::test]
    async fn headerless_gzipped_tsv_3_classes_per_sample() {
        let dir = tempfile::tempdir().unwrap();
        let rows = table(20, 5, 3);
        let path = dir.path().join("three.tsv.gz");
        let mut gz = flate2::write::GzEncoder::new(
            File::create(&path).unwrap(),
            flate2::Compression::default(),
        );
        gz.write_all(csv(&rows, 5, None, '\t').as_bytes()).unwrap();
        gz.finish().unwrap();
        let mut options = ImportOptions::new(ImportInput::new(&path));
        options.label_column = LabelColumn::Index(5);
        options.write.layout = Layout::PerSample;
        let (store, prefix) = memory();
        let summary = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        assert_eq!(summary.objects, 20);
        let (manifest, train, test) = read_back(store, &prefix).await;
        assert_eq!((manifest.classes, manifest.layout), (3, Layout::PerSample));
        assert_batch(&train, &rows);
        assert!(test.is_empty());
    }

    #[tokio::test]
    async fn npy_pairs_of_several_dtypes() {
        let dir = tempfile::tempdir().unwrap();
        let train = table(40, 64, 10);
        let test = table(10, 64, 10);
        // Train: f64 images of 8x8, int64 labels; test: f32 rows, uint8 labels.
        let x = write(
            dir.path(),
            "x.npy",
            npy("<f8", &[40, 8, 8], &f64_bytes(&train)),
        );
        let labels: Vec<u8> = train
            .iter()
            .flat_map(|(l, _)| (*l as i64).to_le_bytes())
            .collect();
        let y = write(dir.path(), "y.npy", npy("<i8", &[40], &labels));
        let xt = write(
            dir.path(),
            "xt.npy",
            npy("<f4", &[10, 64], &f32_bytes(&test)),
        );
        let labels: Vec<u8> = test.iter().map(|(l, _)| *l as u8).collect();
        let yt = write(dir.path(), "yt.npy", npy("|u1", &[10, 1], &labels));
        let mut options = ImportOptions::new(ImportInput::with_labels(&x, &y));
        options.test = TestSplit::File(ImportInput::with_labels(&xt, &yt));
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (manifest, tr, te) = read_back(store, &prefix).await;
        assert_eq!((manifest.features, manifest.classes), (64, 10));
        assert_batch(&tr, &train);
        assert_batch(&te, &test);
    }

    #[tokio::test]
    async fn npz_with_stored_and_deflated_members() {
        let dir = tempfile::tempdir().unwrap();
        let rows = table(60, 6, 3);
        let path = dir.path().join("data.npz");
        let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
        let stored = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        let deflated = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("data.npy", deflated).unwrap();
        zip.write_all(&npy("<f4", &[60, 6], &f32_bytes(&rows)))
            .unwrap();
        zip.start_file("target.npy", stored).unwrap();
        let labels: Vec<u8> = rows
            .iter()
            .flat_map(|(l, _)| (*l as f32).to_le_bytes())
            .collect();
        zip.write_all(&npy("<f4", &[60], &labels)).unwrap();
        zip.finish().unwrap();

        let mut options = ImportOptions::new(ImportInput::new(&path));
        options.x_key = "data".into();
        options.y_key = "target".into();
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (_, tr, _) = read_back(store.clone(), &prefix).await;
        assert_batch(&tr, &rows);

        // The default keys are not there: the error lists the arrays.
        let (store, prefix) = memory();
        options.x_key = "x".into();
        let err = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("no array `x`"), "{err}");
        assert!(err.to_string().contains("data, target"), "{err}");
    }

    fn write_parquet(
        path: &FsPath,
        rows: &[(u32, Vec<f32>)],
        compression: parquet::basic::Compression,
    ) {
        let width = rows[0].1.len();
        write_parquet_columns(path, rows, compression, &(0..width).collect::<Vec<_>>());
    }

    /// A Parquet file whose feature column `c` is feature `columns[c]` of
    /// `rows`, named `f{columns[c]}`.
    fn write_parquet_columns(
        path: &FsPath,
        rows: &[(u32, Vec<f32>)],
        compression: parquet::basic::Compression,
        columns: &[usize],
    ) {
        use parquet::data_type::{FloatType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let width = columns.len();
        let mut message = String::from("message m { required int64 label; ");
        for j in columns {
            message += &format!("required float f{j}; ");
        }
        // What pandas adds for a non-default index: not a feature.
        message += "required int64 __index_level_0__; }";
        let schema = Arc::new(parquet::schema::parser::parse_message_type(&message).unwrap());
        let props = Arc::new(
            WriterProperties::builder()
                .set_compression(compression)
                .build(),
        );
        let mut writer =
            SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
        // Two row groups, to read across a boundary.
        for part in rows.chunks(rows.len().div_ceil(2)) {
            let mut group = writer.next_row_group().unwrap();
            let mut c = 0;
            while let Some(mut column) = group.next_column().unwrap() {
                if c == width + 1 {
                    let index: Vec<i64> = (0..part.len() as i64).map(|i| 1000 + i).collect();
                    column
                        .typed::<Int64Type>()
                        .write_batch(&index, None, None)
                        .unwrap();
                } else if c == 0 {
                    let labels: Vec<i64> = part.iter().map(|(l, _)| *l as i64).collect();
                    column
                        .typed::<Int64Type>()
                        .write_batch(&labels, None, None)
                        .unwrap();
                } else {
                    let values: Vec<f32> = part.iter().map(|(_, x)| x[columns[c - 1]]).collect();
                    column
                        .typed::<FloatType>()
                        .write_batch(&values, None, None)
                        .unwrap();
                }
                column.close().unwrap();
                c += 1;
            }
            group.close().unwrap();
        }
        writer.close().unwrap();
    }

    #[tokio::test]
    async fn parquet_snappy_and_gzip() {
        use parquet::basic::{Compression, GzipLevel};
        let dir = tempfile::tempdir().unwrap();
        let train = table(50, 64, 10);
        let test = table(12, 64, 10);
        let tr = dir.path().join("train.parquet");
        let te = dir.path().join("test.parquet");
        write_parquet(&tr, &train, Compression::SNAPPY);
        write_parquet(&te, &test, Compression::GZIP(GzipLevel::default()));
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&te));
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (manifest, a, b) = read_back(store, &prefix).await;
        assert_eq!((manifest.features, manifest.classes), (64, 10));
        assert_batch(&a, &train);
        assert_batch(&b, &test);
    }

    /// A CSV with a header whose feature columns come in the order
    /// `columns` (column `c` is feature `columns[c]`, named `f{columns[c]}`),
    /// the label column `label` first.
    fn csv_columns(rows: &[(u32, Vec<f32>)], columns: &[usize]) -> String {
        let mut out = String::from("label");
        for j in columns {
            out += &format!(",f{j}");
        }
        out += "\n";
        for (label, x) in rows {
            out += &label.to_string();
            for &j in columns {
                out += &format!(",{}", x[j]);
            }
            out += "\n";
        }
        out
    }

    #[test]
    fn an_unsupported_parquet_compression_is_named() {
        use parquet::basic::{Compression, GzipLevel, ZstdLevel};
        let path = FsPath::new("x.parquet");
        let ok = [
            ("a".to_string(), Compression::UNCOMPRESSED),
            ("b".to_string(), Compression::SNAPPY),
            ("c".to_string(), Compression::GZIP(GzipLevel::default())),
        ];
        check_parquet_compression(path, ok.clone()).unwrap();
        let mut zstd = ok.to_vec();
        zstd.push(("pixel_3".into(), Compression::ZSTD(ZstdLevel::default())));
        let err = check_parquet_compression(path, zstd)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x.parquet")
                && err.contains("column `pixel_3` is compressed with zstd")
                && err.contains("supported: uncompressed, snappy, gzip")
                && !err.contains("Disabled feature"),
            "{err}"
        );
        let err = check_parquet_compression(path, [("y".into(), Compression::LZ4_RAW)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("compressed with lz4"), "{err}");
    }

    #[tokio::test]
    async fn test_columns_in_another_order_are_matched_by_name() {
        use parquet::basic::Compression;
        let dir = tempfile::tempdir().unwrap();
        let train = table(20, 4, 3);
        let test = table(9, 4, 3);
        // CSV: the test file lists its columns in another order.
        let tr = write(dir.path(), "tr.csv", csv_columns(&train, &[0, 1, 2, 3]));
        let te = write(dir.path(), "te.csv", csv_columns(&test, &[2, 0, 3, 1]));
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&te));
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (_, a, b) = read_back(store, &prefix).await;
        assert_batch(&a, &train);
        assert_batch(&b, &test);

        // Parquet, the same.
        let tr = dir.path().join("tr.parquet");
        let te = dir.path().join("te.parquet");
        write_parquet_columns(&tr, &train, Compression::SNAPPY, &[0, 1, 2, 3]);
        write_parquet_columns(&te, &test, Compression::SNAPPY, &[3, 1, 0, 2]);
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&te));
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (_, a, b) = read_back(store, &prefix).await;
        assert_batch(&a, &train);
        assert_batch(&b, &test);

        // A missing column is named, with the file; so is an extra one.
        let missing = write(dir.path(), "missing.csv", csv_columns(&test, &[2, 0, 3]));
        let mut options_csv = ImportOptions::new(ImportInput::new(dir.path().join("tr.csv")));
        options_csv.test = TestSplit::File(ImportInput::new(&missing));
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
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&short));
        fails(&options, &["short.parquet", "no column `f2`"]).await;

        // Without a header the columns still go by position.
        let tr = write(dir.path(), "tr_plain.csv", csv(&train, 0, None, ','));
        let te = write(dir.path(), "te_plain.csv", csv(&test, 0, None, ','));
        let mut options = ImportOptions::new(ImportInput::new(&tr));
        options.test = TestSplit::File(ImportInput::new(&te));
        options.label_column = LabelColumn::Index(0);
        let (store, prefix) = memory();
        import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap();
        let (_, a, b) = read_back(store, &prefix).await;
        assert_batch(&a, &train);
        assert_batch(&b, &test);
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
            &["nan.npy", "row 3", "feature 1"],
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

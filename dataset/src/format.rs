use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use object_store::path::Path;
use serde::{Deserialize, Serialize};

/// Name of the manifest object under a dataset prefix.
pub const MANIFEST_NAME: &str = "manifest.json";

/// Manifest format of the shard layout (also every manifest without a layout field).
pub const FORMAT_VERSION: u32 = 1;

/// Manifest format of the one-object-per-sample layout.
pub const FORMAT_PER_SAMPLE: u32 = 2;

/// Manifest `format` of encoded images read in place (WebDataset tar shards
/// or class folders), listed by an [`ImageIndex`].
pub const FORMAT_IMAGES: u32 = 3;

/// Per-sample objects fetched at the same time by one [`DatasetReader`] call.
pub(crate) const MAX_CONCURRENT_SAMPLE_READS: usize = 64;

/// Per-sample objects uploaded at the same time by [`write_dataset_with`].
pub(crate) const MAX_CONCURRENT_SAMPLE_WRITES: usize = 32;

/// Shard objects fetched at the same time by one [`DatasetReader`] call.
pub(crate) const MAX_CONCURRENT_SHARD_READS: usize = 16;

/// Shard objects uploaded at the same time by [`write_dataset`].
pub(crate) const MAX_CONCURRENT_SHARD_WRITES: usize = 8;

/// Bytes of the label in front of each record.
pub(crate) const LABEL_BYTES: usize = 4;

/// Everything that can go wrong reading or writing a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The object store failed (network, permissions, ...).
    #[error("object store error: {0}")]
    Store(#[from] object_store::Error),
    /// A local file could not be read or created.
    #[error("cannot access {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A text input (CSV) has a bad line.
    #[error("{}:{line}: {message}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// A binary input (IDX) has a bad header or size.
    #[error("{}: {message}", path.display())]
    Format { path: PathBuf, message: String },
    /// The manifest could not be parsed or is inconsistent.
    #[error("bad dataset manifest: {0}")]
    Manifest(String),
    /// An object does not match what the manifest promises. `permanent`
    /// damage (a missing object, a checksum mismatch, a label out of range,
    /// an image that does not decode) is not retried; a short body may be a
    /// cut connection.
    #[error("corrupt dataset object {object}: {message}")]
    Corrupt {
        object: String,
        message: String,
        permanent: bool,
    },
    /// An object the command was told to read is not in the bucket.
    #[error("{what} {object} does not exist in the bucket")]
    MissingObject { what: &'static str, object: String },
    /// A shard name with glob characters: shards are named with braces.
    #[error("shard name `{0}`: glob patterns (*, ?, [..]) are not supported; list the shards with a brace range, e.g. train-{{0000..0009}}.tar")]
    Glob(String),
    /// A sample index past the end of its split.
    #[error("sample index {index} is out of range for a split of {len} samples")]
    IndexOutOfRange { index: usize, len: usize },
    /// Bad arguments or samples handed to a function of this module.
    #[error("invalid dataset input: {0}")]
    Invalid(String),
    /// No manifest under the prefix.
    #[error("no dataset at '{prefix}': {MANIFEST_NAME} not found; write one with `ps-data ...`")]
    NotFound { prefix: String },
    /// The bucket (or Azure container) itself does not exist.
    #[error("bucket missing: {store} does not exist (reading {object}: {source})")]
    BucketMissing {
        /// The store, as it names itself (`AmazonS3(my-bucket)`, ...).
        store: String,
        object: String,
        #[source]
        source: object_store::Error,
    },
    /// A bucket URL that [`open_bucket`](crate::open_bucket) cannot serve.
    #[error(transparent)]
    Bucket(#[from] ps_shared::bucket::BucketError),
}

impl DatasetError {
    /// Whether trying again may help: store failures other than a missing
    /// object or a refused request, and short or damaged bodies that are not
    /// known to be permanent.
    pub fn is_transient(&self) -> bool {
        use object_store::Error as E;
        match self {
            DatasetError::Store(e) if ps_shared::bucket::is_client_misconfigured(e) => false,
            DatasetError::Store(e) => !matches!(
                e,
                E::NotFound { .. }
                    | E::InvalidPath { .. }
                    | E::NotSupported { .. }
                    | E::NotImplemented { .. }
                    | E::PermissionDenied { .. }
                    | E::Unauthenticated { .. }
                    | E::UnknownConfigurationKey { .. }
            ),
            DatasetError::Corrupt { permanent, .. } => !permanent,
            _ => false,
        }
    }
}

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    /// Both splits, train first.
    pub const ALL: [Split; 2] = [Split::Train, Split::Test];

    /// Lower-case name, also the folder of the split's shards.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Split::Train => 0,
            Split::Test => 1,
        }
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the records of a dataset are cut into objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Shard objects of many fixed-size records, read with range GETs.
    #[default]
    Shards,
    /// One object per sample (`train/00000123.bin`), one GET per sample.
    PerSample,
    /// Encoded images inside WebDataset tar shards, read in place with one
    /// range GET per image; the [`ImageIndex`] holds their offsets.
    #[serde(rename = "webdataset")]
    WebDataset,
    /// One encoded image per object under `train/<class>/` and `test/<class>/`.
    ClassFolders,
}

impl Layout {
    /// The manifest `format` number of this layout.
    pub fn format(self) -> u32 {
        match self {
            Layout::Shards => FORMAT_VERSION,
            Layout::PerSample => FORMAT_PER_SAMPLE,
            Layout::WebDataset | Layout::ClassFolders => FORMAT_IMAGES,
        }
    }

    /// The name used on the command line and in the manifest.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Shards => "shards",
            Layout::PerSample => "per-sample",
            Layout::WebDataset => "webdataset",
            Layout::ClassFolders => "class-folders",
        }
    }

    /// Whether samples are encoded images decoded by the loader.
    pub fn is_images(self) -> bool {
        matches!(self, Layout::WebDataset | Layout::ClassFolders)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "shards" | "shard" => Ok(Layout::Shards),
            "per-sample" => Ok(Layout::PerSample),
            "webdataset" => Ok(Layout::WebDataset),
            "class-folders" => Ok(Layout::ClassFolders),
            other => Err(format!(
                "unknown layout `{other}`; use shards, per-sample, webdataset or class-folders"
            )),
        }
    }
}

/// Object path, relative to the dataset prefix, of sample `index` of a split
/// in the per-sample layout.
pub fn sample_object_path(split: Split, index: usize) -> String {
    format!("{}/{index:08}.bin", split.name())
}

/// The `manifest.json` of a dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] for the shard layout, [`FORMAT_PER_SAMPLE`] for one
    /// object per sample.
    pub format: u32,
    /// How records are cut into objects; `shards` when absent (older manifests).
    #[serde(default)]
    pub layout: Layout,
    pub name: String,
    /// Features per sample.
    pub features: usize,
    /// Labels lie in `0..classes`.
    pub classes: usize,
    /// `4 + features * feature_type.bytes()`; for images, the mean bytes of
    /// one encoded image plus its 4-byte label (what the loader holds per
    /// sample).
    pub record_bytes: usize,
    /// How each feature is stored; `f32` when absent.
    #[serde(default, skip_serializing_if = "FeatureType::is_f32")]
    pub feature_type: FeatureType,
    pub train: SplitInfo,
    pub test: SplitInfo,
    /// How the importer transformed the features, so the same transform can
    /// be applied at inference. Absent when the features were stored as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalization: Option<Normalization>,
    /// Image layouts only: where each encoded image lies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<ImageIndex>,
    /// Text datasets only: each record is a window of `seq_len + 1` token
    /// ids (stored as `feature_type`; the label is the last token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextInfo>,
}

/// How a text dataset was tokenized (`ps-data text`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextInfo {
    /// Token ids lie in `0..vocab` (also the manifest's `classes`).
    pub vocab: usize,
    /// Tokens of a model input; a record holds `seq_len + 1`.
    pub seq_len: usize,
    /// `bytes` or the tokenizer file's name.
    pub tokenizer: String,
    /// CRC-32 of the tokenizer file as 8 hex digits (`bytes`: of the name).
    pub tokenizer_crc32: String,
}

/// How each feature of a record is stored: `f32` (the default, and what
/// manifests without the field mean), or an unsigned integer of one or two
/// bytes for features that are whole numbers in range (a text dataset's
/// token ids: one byte for a vocabulary of at most 256, two for 65,536).
/// Readers always hand out f32 features.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeatureType {
    #[default]
    F32,
    U8,
    U16,
}

impl FeatureType {
    /// Bytes of one stored feature.
    pub fn bytes(self) -> usize {
        match self {
            FeatureType::F32 => 4,
            FeatureType::U8 => 1,
            FeatureType::U16 => 2,
        }
    }

    /// The smallest type that holds every id below `vocab` exactly.
    pub fn for_ids(vocab: usize) -> Self {
        if vocab <= 1 << 8 {
            FeatureType::U8
        } else if vocab <= 1 << 16 {
            FeatureType::U16
        } else {
            FeatureType::F32
        }
    }

    fn is_f32(&self) -> bool {
        *self == FeatureType::F32
    }

    /// Whether `v` is stored exactly.
    pub(crate) fn holds(self, v: f32) -> bool {
        match self {
            FeatureType::F32 => v.is_finite(),
            FeatureType::U8 => v.fract() == 0.0 && (0.0..=255.0).contains(&v),
            FeatureType::U16 => v.fract() == 0.0 && (0.0..=65535.0).contains(&v),
        }
    }

    /// Appends the stored form of `features` (each one [`holds`](Self::holds)).
    pub(crate) fn encode(self, buf: &mut Vec<u8>, features: &[f32]) {
        match self {
            FeatureType::F32 => features
                .iter()
                .for_each(|v| buf.extend_from_slice(&v.to_le_bytes())),
            FeatureType::U8 => buf.extend(features.iter().map(|&v| v as u8)),
            FeatureType::U16 => features
                .iter()
                .for_each(|&v| buf.extend_from_slice(&(v as u16).to_le_bytes())),
        }
    }

    /// Appends the features stored in `bytes` to `out` as f32.
    pub(crate) fn decode_into(self, bytes: &[u8], out: &mut Vec<f32>) {
        match self {
            FeatureType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            FeatureType::U8 => out.extend(bytes.iter().map(|&b| f32::from(b))),
            FeatureType::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| f32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
        }
    }
}

impl std::fmt::Display for FeatureType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FeatureType::F32 => "f32",
            FeatureType::U8 => "u8",
            FeatureType::U16 => "u16",
        })
    }
}

/// A feature transform applied before the records were written, recorded in
/// the manifest (`"normalization": {"kind": "standard", ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Normalization {
    /// Every stored feature is `raw / divisor`.
    Scale { divisor: f32 },
    /// Feature `j` is stored as `(raw - mean[j]) / std[j]`, with the mean and
    /// the population standard deviation of the train split (a constant
    /// feature gets `std` 1).
    Standard { mean: Vec<f32>, std: Vec<f32> },
}

/// Where the encoded images of an image dataset lie, written once by
/// `ps-data index` so that the loader can read any image with one
/// range GET and knows every label without reading the data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageIndex {
    /// `[channels, height, width]` of a decoded sample (1 = grey, 3 = RGB);
    /// images of another size are resized to it. `features` is the product.
    pub shape: [usize; 3],
    /// Class names in label order (folder names, or the label numbers).
    pub class_names: Vec<String>,
    /// Object paths relative to the dataset prefix (tar shards or images).
    pub objects: Vec<String>,
    pub train: Vec<ImageEntry>,
    pub test: Vec<ImageEntry>,
}

/// One encoded image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageEntry {
    /// Index into [`ImageIndex::objects`].
    pub object: u32,
    /// Byte offset of the encoded image in its object (0 for class folders).
    pub offset: u64,
    /// Bytes of the encoded image.
    pub len: u64,
    pub label: u32,
    /// The sample's name in error messages (its WebDataset key or file name).
    pub key: String,
    /// CRC-32 of the encoded image's bytes (the range the loader GETs),
    /// checked on every read; absent in indexes written before checksums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

impl ImageIndex {
    /// The entries of a split.
    pub fn entries(&self, split: Split) -> &[ImageEntry] {
        match split {
            Split::Train => &self.train,
            Split::Test => &self.test,
        }
    }
}

/// Samples and shards of one split.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SplitInfo {
    pub num_samples: usize,
    /// In index order; shard `k` starts where shard `k - 1` ends. Empty in
    /// the per-sample layout.
    #[serde(default)]
    pub shards: Vec<ShardInfo>,
    /// Record layouts: the CRC-32 of every record (label and features), in
    /// sample order; empty in manifests written before checksums (and in
    /// image layouts, whose entries carry their own).
    ///
    /// One checksum per record, not per object, because the loader never
    /// reads a whole shard: it issues range GETs of single records or of
    /// runs of adjacent records, and only a per-record checksum can be
    /// checked on every such read without fetching more than it needs. It
    /// costs 4 bytes per record (8 hex digits in the manifest), 1/50 of an
    /// MNIST record.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "crc_hex")]
    pub crc32: Vec<u32>,
}

/// CRC-32 (IEEE, as zlib and gzip compute it) of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// A list of CRC-32s as one string of 8 lower-case hex digits each: a
/// third of the size of a JSON array of numbers, and one line.
mod crc_hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(sums: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let mut text = String::with_capacity(sums.len() * 8);
        for v in sums {
            text.push_str(&format!("{v:08x}"));
        }
        s.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let text = String::deserialize(d)?;
        if text.len() % 8 != 0 || !text.is_ascii() {
            return Err(serde::de::Error::custom(format!(
                "crc32 must be 8 hex digits per record, got {} characters",
                text.len()
            )));
        }
        (0..text.len() / 8)
            .map(|i| {
                let digits = &text[i * 8..i * 8 + 8];
                u32::from_str_radix(digits, 16).map_err(|_| {
                    serde::de::Error::custom(format!(
                        "crc32 of record {i} is `{digits}`, not 8 hex digits"
                    ))
                })
            })
            .collect()
    }
}

/// Why `bytes`, sample `index` of `split`, are not what was written, if
/// `expected` (the checksums of the split, or none) says so.
pub(crate) fn checksum_mismatch(
    split: Split,
    index: usize,
    expected: Option<u32>,
    bytes: &[u8],
) -> Option<String> {
    let want = expected?;
    let got = crc32(bytes);
    (got != want).then(|| {
        format!(
            "{split} sample {index} fails its checksum (CRC-32 {got:08x}, the manifest says {want:08x}): the object was changed or damaged after the dataset was written"
        )
    })
}

/// One shard object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Object path relative to the dataset prefix.
    pub path: String,
    /// Global index of its first record.
    pub first: usize,
    /// Records in the shard.
    pub count: usize,
}

/// One labelled sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub label: u32,
    pub features: Vec<f32>,
}

/// A batch in row-major form, ready for a tensor: `features.len() == len * dim`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub dim: usize,
}

impl Batch {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Packs samples row by row. Each row gets exactly `dim` values: a sample
    /// with fewer features is padded with zeros and one with more is cut, so
    /// the shape invariant always holds (samples from this module always have
    /// the right length).
    pub fn from_samples(samples: &[Sample], dim: usize) -> Batch {
        let mut batch = Batch::with_capacity(samples.len(), dim);
        for s in samples {
            batch.push(s.label, &s.features);
        }
        batch
    }

    /// Features of row `i`, if there is one.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let start = i.checked_mul(self.dim)?;
        self.features.get(start..start.checked_add(self.dim)?)
    }

    pub(crate) fn with_capacity(rows: usize, dim: usize) -> Batch {
        Batch {
            features: Vec::with_capacity(rows.saturating_mul(dim)),
            labels: Vec::with_capacity(rows),
            dim,
        }
    }

    fn push(&mut self, label: u32, features: &[f32]) {
        let take = features.len().min(self.dim);
        self.features.extend_from_slice(&features[..take]);
        self.features
            .extend(std::iter::repeat_n(0.0, self.dim - take));
        self.labels.push(label);
    }
}

impl Manifest {
    /// Checks the format version against the layout, the record size and,
    /// in the shard layout, that every split's shards tile `0..num_samples` in
    /// order with valid relative paths.
    pub fn validate(&self) -> Result<(), DatasetError> {
        let bad = |msg: String| Err(DatasetError::Manifest(msg));
        if ![FORMAT_VERSION, FORMAT_PER_SAMPLE, FORMAT_IMAGES].contains(&self.format) {
            return bad(format!(
                "format {} is not supported; this build reads formats {FORMAT_VERSION} (shards), {FORMAT_PER_SAMPLE} (per-sample) and {FORMAT_IMAGES} (images)",
                self.format
            ));
        }
        if self.format != self.layout.format() {
            return bad(format!(
                "format {} does not match layout {} (format {})",
                self.format,
                self.layout,
                self.layout.format()
            ));
        }
        if self.features == 0 {
            return bad("features must be at least 1".into());
        }
        if self.classes == 0 || u32::try_from(self.classes).is_err() {
            return bad(format!(
                "classes must be in 1..=u32::MAX, got {}",
                self.classes
            ));
        }
        if self.layout.is_images() {
            return self.validate_images();
        }
        if self.images.is_some() {
            return bad(format!(
                "layout {} does not take an image index",
                self.layout
            ));
        }
        let expected = record_bytes(self.features, self.feature_type).ok_or_else(|| {
            DatasetError::Manifest(format!("{} features do not fit a record", self.features))
        })?;
        if self.record_bytes != expected {
            return bad(format!(
                "record_bytes is {} but {} {} features need {expected}",
                self.record_bytes, self.features, self.feature_type
            ));
        }
        if let Some(text) = &self.text {
            if FeatureType::for_ids(text.vocab).bytes() > self.feature_type.bytes() {
                return bad(format!(
                    "feature_type {} cannot hold the token ids of a vocabulary of {}",
                    self.feature_type, text.vocab
                ));
            }
        }
        match &self.normalization {
            Some(Normalization::Scale { divisor }) if !divisor.is_finite() || *divisor == 0.0 => {
                return bad(format!(
                    "normalization divisor must be finite and non-zero, got {divisor}"
                ));
            }
            Some(Normalization::Standard { mean, std })
                if mean.len() != self.features || std.len() != self.features =>
            {
                return bad(format!(
                    "normalization has {} means and {} standard deviations for {} features",
                    mean.len(),
                    std.len(),
                    self.features
                ));
            }
            _ => {}
        }
        for split in Split::ALL {
            let info = self.split(split);
            if !info.crc32.is_empty() && info.crc32.len() != info.num_samples {
                return bad(format!(
                    "{split} lists {} checksums for {} samples",
                    info.crc32.len(),
                    info.num_samples
                ));
            }
            if self.layout == Layout::PerSample {
                if !info.shards.is_empty() {
                    return bad(format!("{split} lists shards but the layout is per-sample"));
                }
                continue;
            }
            let mut next = 0usize;
            for (k, shard) in info.shards.iter().enumerate() {
                if shard.first != next {
                    return bad(format!(
                        "{split} shard {k} ({}) starts at {} but the previous shards end at {next}",
                        shard.path, shard.first
                    ));
                }
                if shard.count == 0 {
                    return bad(format!("{split} shard {k} ({}) is empty", shard.path));
                }
                if shard
                    .count
                    .checked_mul(self.record_bytes)
                    .and_then(|b| u64::try_from(b).ok())
                    .is_none()
                {
                    return bad(format!("{split} shard {k} ({}) is too large", shard.path));
                }
                relative_object_path(&shard.path)
                    .map_err(|msg| DatasetError::Manifest(format!("{split} shard {k}: {msg}")))?;
                next = match next.checked_add(shard.count) {
                    Some(n) => n,
                    None => return bad(format!("{split} shard counts overflow")),
                };
            }
            if next != info.num_samples {
                return bad(format!(
                    "{split} has num_samples {} but its shards hold {next}",
                    info.num_samples
                ));
            }
        }
        Ok(())
    }

    fn validate_images(&self) -> Result<(), DatasetError> {
        let bad = |msg: String| Err(DatasetError::Manifest(msg));
        let Some(index) = &self.images else {
            return bad(format!("layout {} needs an `images` index", self.layout));
        };
        let [c, h, w] = index.shape;
        if !(c == 1 || c == 3) || h == 0 || w == 0 {
            return bad(format!(
                "images.shape {:?} must be [1 or 3, height >= 1, width >= 1]",
                index.shape
            ));
        }
        if c * h * w != self.features {
            return bad(format!(
                "features is {} but images.shape {:?} holds {}",
                self.features,
                index.shape,
                c * h * w
            ));
        }
        if index.class_names.len() != self.classes {
            return bad(format!(
                "images.class_names has {} names for {} classes",
                index.class_names.len(),
                self.classes
            ));
        }
        for (k, o) in index.objects.iter().enumerate() {
            relative_object_path(o)
                .map_err(|msg| DatasetError::Manifest(format!("images.objects[{k}]: {msg}")))?;
        }
        for split in Split::ALL {
            if !self.split(split).crc32.is_empty() {
                return bad(format!(
                    "{split} lists record checksums, but image entries carry their own"
                ));
            }
            let entries = index.entries(split);
            if entries.len() != self.split(split).num_samples {
                return bad(format!(
                    "{split} has num_samples {} but the image index lists {}",
                    self.split(split).num_samples,
                    entries.len()
                ));
            }
            for (i, e) in entries.iter().enumerate() {
                if e.object as usize >= index.objects.len() {
                    return bad(format!(
                        "{split} image {i} ({}) names object {} of {}",
                        e.key,
                        e.object,
                        index.objects.len()
                    ));
                }
                if e.label as usize >= self.classes {
                    return bad(format!(
                        "{split} image {i} ({}) has label {}, not below {} classes",
                        e.key, e.label, self.classes
                    ));
                }
                if e.len == 0 || e.offset.checked_add(e.len).is_none() {
                    return bad(format!(
                        "{split} image {i} ({}) has an empty or overflowing byte range",
                        e.key
                    ));
                }
            }
        }
        Ok(())
    }

    /// The split's samples and shards.
    pub fn split(&self, s: Split) -> &SplitInfo {
        match s {
            Split::Train => &self.train,
            Split::Test => &self.test,
        }
    }

    /// Bytes of all shards of a split.
    pub fn total_bytes(&self, s: Split) -> u64 {
        (self.split(s).num_samples as u64).saturating_mul(self.record_bytes as u64)
    }
}

pub(crate) fn record_bytes(features: usize, ty: FeatureType) -> Option<usize> {
    features.checked_mul(ty.bytes())?.checked_add(LABEL_BYTES)
}

/// Parses a manifest shard path: relative, no empty or `..` segments.
pub(crate) fn relative_object_path(rel: &str) -> Result<Path, String> {
    if rel.is_empty() || rel.starts_with('/') || rel.ends_with('/') {
        return Err(format!(
            "shard path '{rel}' must be a non-empty relative path"
        ));
    }
    Path::parse(rel).map_err(|e| format!("shard path '{rel}' is invalid: {e}"))
}

pub(crate) fn join(prefix: &Path, rel: &Path) -> Path {
    prefix.parts().chain(rel.parts()).collect()
}

/// The object `rel` (a relative path as manifests hold them) under `prefix`,
/// or why `rel` is not one.
pub(crate) fn object_path(prefix: &Path, rel: &str) -> Result<Path, String> {
    Ok(join(prefix, &relative_object_path(rel)?))
}

/// The label of a record if it is below `classes`, else the bad label.
/// Records are at least [`LABEL_BYTES`] long (checked by the callers).
pub(crate) fn check_label(record: &[u8], classes: usize) -> Result<u32, u32> {
    let label = match record.get(..LABEL_BYTES) {
        Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        None => return Err(u32::MAX),
    };
    if (label as usize) < classes {
        Ok(label)
    } else {
        Err(label)
    }
}

/// Merges sorted, deduplicated record indices into runs of adjacent records.
pub(crate) fn merge_runs(sorted: &[usize]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for &i in sorted {
        match runs.last_mut() {
            Some(last) if last.end == i => last.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_validation() {
        let good = Manifest {
            format: 1,
            layout: Layout::Shards,
            name: "m".into(),
            features: 2,
            classes: 3,
            record_bytes: 12,
            feature_type: FeatureType::F32,
            train: SplitInfo {
                num_samples: 5,
                shards: vec![
                    ShardInfo {
                        path: "train/a".into(),
                        first: 0,
                        count: 3,
                    },
                    ShardInfo {
                        path: "train/b".into(),
                        first: 3,
                        count: 2,
                    },
                ],
                crc32: Vec::new(),
            },
            test: SplitInfo {
                num_samples: 0,
                ..SplitInfo::default()
            },
            normalization: None,
            images: None,
            text: None,
        };
        good.validate().unwrap();
        assert_eq!(good.split(Split::Train).num_samples, 5);
        assert_eq!(good.total_bytes(Split::Train), 60);
        assert_eq!(good.total_bytes(Split::Test), 0);

        let mut m = good.clone();
        m.record_bytes = 11;
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.train.shards[1].first = 4;
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.train.num_samples = 6;
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.train.shards[0].path = "../escape".into();
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.train.shards[0].path = "/abs".into();
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.layout = Layout::PerSample;
        assert!(m
            .validate()
            .unwrap_err()
            .to_string()
            .contains("does not match"));
        m.format = FORMAT_PER_SAMPLE;
        assert!(m
            .validate()
            .unwrap_err()
            .to_string()
            .contains("lists shards"));
        m.train.shards.clear();
        m.validate().unwrap();
        let mut m = good.clone();
        m.normalization = Some(Normalization::Standard {
            mean: vec![0.0],
            std: vec![1.0, 1.0],
        });
        assert!(m.validate().is_err());
        m.normalization = Some(Normalization::Scale { divisor: 0.0 });
        assert!(m.validate().is_err());
        m.normalization = Some(Normalization::Scale { divisor: 255.0 });
        m.validate().unwrap();
        let json = serde_json::to_string(&m).unwrap();
        assert!(
            json.contains(r#""normalization":{"kind":"scale","divisor":255.0}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Manifest>(&json).unwrap(), m);
        let mut m = good.clone();
        m.classes = 0;
        assert!(m.validate().is_err());
        // Checksums: one per sample, written as 8 hex digits each.
        let mut m = good;
        m.train.crc32 = vec![1, 2, 3, 4];
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("4 checksums for 5 samples"), "{err}");
        m.train.crc32.push(0xdead_beef);
        m.validate().unwrap();
        let json = serde_json::to_string(&m).unwrap();
        assert!(
            json.contains(r#""crc32":"00000001000000020000000300000004deadbeef""#),
            "{json}"
        );
        assert_eq!(
            json.matches("crc32").count(),
            1,
            "the empty test split has none"
        );
        assert_eq!(serde_json::from_str::<Manifest>(&json).unwrap(), m);
        for bad in ["0000001", "0000000g", "0000000é"] {
            let text = json.replace("00000001000000020000000300000004deadbeef", bad);
            let err = serde_json::from_str::<Manifest>(&text).unwrap_err();
            assert!(err.to_string().contains("crc32"), "{bad}: {err}");
        }
    }

    #[test]
    fn manifest_without_layout_reads_as_shards() {
        let old = r#"{"format":1,"name":"o","features":1,"classes":2,"record_bytes":8,
            "train":{"num_samples":2,"shards":[{"path":"train/shard-00000.bin","first":0,"count":2}]},
            "test":{"num_samples":0,"shards":[]}}"#;
        let m: Manifest = serde_json::from_str(old).unwrap();
        assert_eq!(m.layout, Layout::Shards);
        assert!(m.train.crc32.is_empty(), "no checksums: nothing to check");
        m.validate().unwrap();
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"layout\":\"shards\""), "{json}");
    }

    #[test]
    fn layout_names() {
        for (text, layout) in [
            ("shards", Layout::Shards),
            ("per-sample", Layout::PerSample),
            ("per_sample", Layout::PerSample),
        ] {
            assert_eq!(text.parse::<Layout>(), Ok(layout));
        }
        assert!("folder".parse::<Layout>().is_err());
        assert_eq!(Layout::PerSample.to_string(), "per-sample");
        assert_eq!(sample_object_path(Split::Train, 123), "train/00000123.bin");
    }

    #[test]
    fn merge_runs_joins_adjacent() {
        assert_eq!(merge_runs(&[]), Vec::<Range<usize>>::new());
        assert_eq!(merge_runs(&[0, 1, 2, 5, 7, 8]), vec![0..3, 5..6, 7..9]);
    }

    #[test]
    fn batch_helpers() {
        let samples = vec![
            Sample {
                label: 2,
                features: vec![1.0, 2.0],
            },
            Sample {
                label: 0,
                features: vec![3.0],
            },
            Sample {
                label: 1,
                features: vec![4.0, 5.0, 6.0],
            },
        ];
        let b = Batch::from_samples(&samples, 2);
        assert_eq!(b.len(), 3);
        assert!(!b.is_empty());
        assert_eq!(b.labels, vec![2, 0, 1]);
        assert_eq!(b.features, vec![1.0, 2.0, 3.0, 0.0, 4.0, 5.0]);
        assert_eq!(b.row(1), Some(&[3.0, 0.0][..]));
        assert_eq!(b.row(3), None);
        assert!(Batch::default().is_empty());
    }
}

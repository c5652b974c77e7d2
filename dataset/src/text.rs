//! Text datasets: plain text tokenized into windows of `seq_len + 1` token
//! ids (`ps-worker dataset text`).
//!
//! The files are read line by line (never whole) and tokenized either byte
//! by byte (vocabulary 256) or by a `tokenizer.json` (the `tokenizers`
//! crate; each line is encoded on its own, its newline included). The
//! token stream of all files in order is cut into non-overlapping windows of
//! `seq_len + 1` tokens (a model's input is the first `seq_len`, its targets
//! the last `seq_len`); a tail shorter than a window is dropped. Each window
//! is one record of the ordinary record format, so the loader's order,
//! caches, resume and checksums apply unchanged: its features are the token
//! ids as f32 (exact below 2^24) and its label is the last token. The
//! manifest's `text` records the vocabulary, `seq_len` and the tokenizer.
//!
//! The test split is either separate files (`test`) or the last
//! `test_fraction` of the windows (the stream is counted in a first pass).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path as FsPath, PathBuf};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::format::*;
use crate::write::{DatasetWriter, WriteOptions};

/// Largest vocabulary whose ids are exact in an f32.
pub const MAX_TEXT_VOCAB: usize = 1 << 24;

/// How text becomes token ids.
pub enum TextTokenizer {
    /// Every byte is a token (vocabulary 256).
    Bytes,
    /// A `tokenizer.json` (its file name and CRC-32 go into the manifest).
    Json {
        name: String,
        crc32: u32,
        tokenizer: Box<tokenizers::Tokenizer>,
    },
}

impl TextTokenizer {
    /// `bytes`, or the path of a `tokenizer.json` (an error names the file).
    pub fn open(spec: &str) -> Result<Self, DatasetError> {
        if spec == "bytes" {
            return Ok(Self::Bytes);
        }
        let path = FsPath::new(spec);
        let bytes = std::fs::read(path)
            .map_err(|e| DatasetError::Invalid(format!("tokenizer file {spec}: {e}")))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            DatasetError::Invalid(format!(
                "tokenizer file {spec} is not a tokenizer.json: {e}"
            ))
        })?;
        let name = path
            .file_name()
            .map_or_else(|| spec.to_string(), |n| n.to_string_lossy().into_owned());
        Ok(Self::Json {
            name,
            crc32: crc32(&bytes),
            tokenizer: Box::new(tokenizer),
        })
    }

    pub fn vocab(&self) -> usize {
        match self {
            Self::Bytes => 256,
            Self::Json { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    fn info(&self, seq_len: usize) -> TextInfo {
        let (tokenizer, crc) = match self {
            Self::Bytes => ("bytes".to_string(), crc32(b"bytes")),
            Self::Json { name, crc32, .. } => (name.clone(), *crc32),
        };
        TextInfo {
            vocab: self.vocab(),
            seq_len,
            tokenizer,
            tokenizer_crc32: format!("{crc:08x}"),
        }
    }

    /// The tokens of one line, appended to `out`.
    fn encode(&self, line: &str, out: &mut Vec<u32>) -> Result<(), String> {
        match self {
            Self::Bytes => out.extend(line.bytes().map(u32::from)),
            Self::Json { tokenizer, .. } => {
                let enc = tokenizer.encode(line, false).map_err(|e| e.to_string())?;
                out.extend_from_slice(enc.get_ids());
            }
        }
        Ok(())
    }
}

/// What `dataset text` writes.
pub struct TextOptions {
    pub train: Vec<PathBuf>,
    /// Separate test files; when empty, the last `test_fraction` of the
    /// training windows are the test split.
    pub test: Vec<PathBuf>,
    pub test_fraction: f64,
    pub seq_len: usize,
    pub name: String,
    pub write: WriteOptions,
    /// Replace a dataset already at the prefix.
    pub overwrite: bool,
    /// A local output folder to remove again if the command fails and leaves it empty.
    pub remove_dir_if_empty: Option<PathBuf>,
}

/// The tokens of `files`, line by line, in order. A file that cannot be
/// read, is not UTF-8 text or holds a NUL byte is an error naming the file
/// and line.
struct Lines<'a> {
    files: &'a [PathBuf],
    tokenizer: &'a TextTokenizer,
    file: usize,
    reader: Option<BufReader<File>>,
    line: usize,
    buf: Vec<u8>,
}

impl<'a> Lines<'a> {
    fn new(files: &'a [PathBuf], tokenizer: &'a TextTokenizer) -> Self {
        Self {
            files,
            tokenizer,
            file: 0,
            reader: None,
            line: 0,
            buf: Vec::new(),
        }
    }

    /// The next line's tokens into `out` (cleared first); false at the end.
    fn next(&mut self, out: &mut Vec<u32>) -> Result<bool, DatasetError> {
        out.clear();
        loop {
            let Some(path) = self.files.get(self.file) else {
                return Ok(false);
            };
            let shown = path.display();
            let reader = match &mut self.reader {
                Some(r) => r,
                None => {
                    let file = File::open(path)
                        .map_err(|e| DatasetError::Invalid(format!("text file {shown}: {e}")))?;
                    self.line = 0;
                    self.reader.insert(BufReader::with_capacity(1 << 16, file))
                }
            };
            self.buf.clear();
            let n = reader
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| DatasetError::Invalid(format!("text file {shown}: {e}")))?;
            if n == 0 {
                self.reader = None;
                self.file += 1;
                continue;
            }
            self.line += 1;
            let line = self.line;
            let text = std::str::from_utf8(&self.buf)
                .ok()
                .filter(|t| !t.contains('\0'));
            let Some(text) = text else {
                return Err(DatasetError::Invalid(format!(
                    "text file {shown} line {line} is not UTF-8 text (a binary file?)"
                )));
            };
            self.tokenizer.encode(text, out).map_err(|e| {
                DatasetError::Invalid(format!("text file {shown} line {line}: {e}"))
            })?;
            return Ok(true);
        }
    }
}

/// Tokens in `files` (a first pass over them).
fn count_tokens(files: &[PathBuf], tokenizer: &TextTokenizer) -> Result<u64, DatasetError> {
    let mut lines = Lines::new(files, tokenizer);
    let mut tokens = Vec::new();
    let mut n = 0u64;
    while lines.next(&mut tokens)? {
        n += tokens.len() as u64;
    }
    Ok(n)
}

/// Writes the windows of `files` into `writer`: the first `train` windows
/// to the train split and the rest to the test split, or all to the test
/// split when `split` is [`Split::Test`].
async fn write_windows(
    files: &[PathBuf],
    tokenizer: &TextTokenizer,
    seq_len: usize,
    writer: &mut DatasetWriter<'_>,
    split: Split,
    train: u64,
) -> Result<(), DatasetError> {
    let window = seq_len + 1;
    let mut lines = Lines::new(files, tokenizer);
    let mut tokens = Vec::new();
    let mut pending: Vec<f32> = Vec::with_capacity(window);
    let mut written = 0u64;
    while lines.next(&mut tokens)? {
        for &t in &tokens {
            pending.push(t as f32);
            if pending.len() < window {
                continue;
            }
            let to = if split == Split::Test || written >= train {
                Split::Test
            } else {
                Split::Train
            };
            writer.push(to, t, &pending).await?;
            pending.clear();
            written += 1;
        }
    }
    Ok(())
}

/// Tokenizes the text files into a dataset under `prefix`.
pub async fn write_text_dataset(
    store: &dyn ObjectStore,
    prefix: &Path,
    tokenizer: &TextTokenizer,
    options: &TextOptions,
) -> Result<Manifest, DatasetError> {
    if options.seq_len == 0 {
        return Err(DatasetError::Invalid("--seq-len must be at least 1".into()));
    }
    if options.train.is_empty() {
        return Err(DatasetError::Invalid("--in names no text file".into()));
    }
    if !(0.0..1.0).contains(&options.test_fraction) {
        return Err(DatasetError::Invalid(format!(
            "--test-fraction must be in [0, 1), got {}",
            options.test_fraction
        )));
    }
    let vocab = tokenizer.vocab();
    if !(2..=MAX_TEXT_VOCAB).contains(&vocab) {
        return Err(DatasetError::Invalid(format!(
            "the tokenizer's vocabulary of {vocab} tokens is outside 2..={MAX_TEXT_VOCAB} (ids must be exact in f32)"
        )));
    }
    let window = options.seq_len as u64 + 1;
    let tokens = count_tokens(&options.train, tokenizer)?;
    let windows = tokens / window;
    if windows == 0 {
        let files: Vec<_> = options
            .train
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        return Err(DatasetError::Invalid(format!(
            "{} hold {tokens} tokens, fewer than one window of seq_len + 1 = {window}",
            files.join(", ")
        )));
    }
    let train_windows = if options.test.is_empty() {
        let test = (windows as f64 * options.test_fraction).round() as u64;
        windows - test.min(windows - 1)
    } else {
        u64::MAX
    };
    let manifest_path = prefix.clone().join(MANIFEST_NAME);
    match store.head(&manifest_path).await {
        Ok(_) if !options.overwrite => {
            return Err(DatasetError::Invalid(format!(
                "a dataset already exists at '{prefix}' ({MANIFEST_NAME}); write to another place or pass --overwrite"
            )));
        }
        Ok(_) => store.delete(&manifest_path).await?,
        Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let mut writer = DatasetWriter::create(
        store,
        prefix,
        &options.name,
        options.seq_len + 1,
        vocab,
        &options.write,
    )?;
    writer.set_text(Some(tokenizer.info(options.seq_len)));
    if let Some(dir) = &options.remove_dir_if_empty {
        writer.remove_dir_if_empty(dir.clone());
    }
    let mut result = write_windows(
        &options.train,
        tokenizer,
        options.seq_len,
        &mut writer,
        Split::Train,
        train_windows,
    )
    .await;
    if result.is_ok() && !options.test.is_empty() {
        result = write_windows(
            &options.test,
            tokenizer,
            options.seq_len,
            &mut writer,
            Split::Test,
            0,
        )
        .await;
    }
    match result {
        Ok(()) => Ok(writer.finish().await?.manifest),
        Err(e) => {
            writer.abort().await;
            Err(e)
        }
    }
}

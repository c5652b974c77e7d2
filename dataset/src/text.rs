//! Text datasets: plain text tokenized into windows of `seq_len + 1` token
//! ids (`ps-data text`).
//!
//! The files are read line by line (never whole) and tokenized either byte
//! by byte (vocabulary 256) or by a `tokenizer.json` (the `tokenizers`
//! crate; each line is encoded on its own, its newline included). The
//! token stream of all files in order is cut into non-overlapping windows of
//! `seq_len + 1` tokens (a model's input is the first `seq_len`, its targets
//! the last `seq_len`); a tail shorter than a window is dropped. Each window
//! is one record of the ordinary record format, so the loader's order,
//! caches, resume and checksums apply unchanged: its features are the token
//! ids, stored in one byte each for a vocabulary of at most 256 and two for
//! at most 65,536 (f32, exact below 2^24, beyond), and its label is the last
//! token. The manifest's `text` records the vocabulary, `seq_len` and the
//! tokenizer, and its `feature_type` the width of a token.
//!
//! The test split is either separate files (`test`) or the last
//! `test_fraction` of the windows (the stream is counted in a first pass).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path as FsPath, PathBuf};

use object_store::path::Path;
use object_store::ObjectStore;

use crate::format::*;
use crate::write::{clear_existing, DatasetWriter, WriteOptions};

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

/// What `ps-data text` writes.
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
    clear_existing(store, prefix, options.overwrite).await?;
    let mut writer = DatasetWriter::create(
        store,
        prefix,
        &options.name,
        options.seq_len + 1,
        vocab,
        &options.write,
    )?;
    writer.set_text(Some(tokenizer.info(options.seq_len)));
    writer.set_feature_type(FeatureType::for_ids(vocab))?;
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

/// `lines` lines of text from a small fixed grammar, drawn from `seed`:
/// learnable (a model's loss falls well below uniform) and available
/// anywhere without downloads. For tests, examples and the shipped config.
pub fn generated_text(lines: usize, seed: u64) -> String {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    const SUBJECTS: [&str; 6] = [
        "the cat",
        "a dog",
        "the old man",
        "my friend",
        "the bird",
        "a child",
    ];
    const VERBS: [&str; 6] = ["sees", "likes", "follows", "finds", "hears", "paints"];
    const OBJECTS: [&str; 6] = [
        "the river",
        "a red ball",
        "the moon",
        "an apple",
        "the garden",
        "a song",
    ];
    const ENDS: [&str; 4] = [".", " today.", " again.", " at night."];
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = String::new();
    for _ in 0..lines {
        let s = rng.random_range(0..SUBJECTS.len());
        // The verb and object depend on the subject: structure to learn.
        let v = (s + rng.random_range(0..2)) % VERBS.len();
        let o = (v + rng.random_range(0..2)) % OBJECTS.len();
        let e = rng.random_range(0..ENDS.len());
        out.push_str(SUBJECTS[s]);
        out.push(' ');
        out.push_str(VERBS[v]);
        out.push(' ');
        out.push_str(OBJECTS[o]);
        out.push_str(ENDS[e]);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::DatasetReader;

    fn options(train: Vec<PathBuf>, seq_len: usize) -> TextOptions {
        TextOptions {
            train,
            test: Vec::new(),
            test_fraction: 0.25,
            seq_len,
            name: "text".into(),
            write: WriteOptions {
                layout: crate::Layout::Shards,
                records_per_shard: 7,
            },
            overwrite: false,
            remove_dir_if_empty: None,
        }
    }

    async fn read_back(store: Arc<dyn ObjectStore>, prefix: &Path) -> (Manifest, Batch, Batch) {
        let reader = DatasetReader::open(store, prefix.clone()).await.unwrap();
        let train = reader.fetch_all(Split::Train).await.unwrap();
        let test = reader.fetch_all(Split::Test).await.unwrap();
        (reader.manifest().clone(), train, test)
    }

    fn file(dir: &FsPath, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[tokio::test]
    async fn windows_in_shards_are_the_tokenizers_output_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let text = generated_text(40, 3);
        let a = file(dir.path(), "a.txt", text.as_bytes());
        let b = file(dir.path(), "b.txt", "héllo\n".as_bytes());
        let (store, prefix) = crate::open_bucket("memory://text").unwrap();
        let seq_len = 9;
        let o = options(vec![a, b], seq_len);
        let m = write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &o)
            .await
            .unwrap();
        let (read, train, test) = read_back(store.clone(), &prefix).await;
        assert_eq!(read, m);
        let info = m.text.as_ref().unwrap();
        assert_eq!(
            (info.vocab, info.seq_len, info.tokenizer.as_str()),
            (256, 9, "bytes")
        );
        assert_eq!((m.features, m.classes), (seq_len + 1, 256));
        let stream: Vec<f32> = text
            .bytes()
            .chain("héllo\n".bytes())
            .map(f32::from)
            .collect();
        let windows = stream.len() / (seq_len + 1);
        let expected_test = (windows as f64 * 0.25).round() as usize;
        assert_eq!(test.len(), expected_test);
        assert_eq!(train.len() + test.len(), windows);
        let mut got = train.features.clone();
        got.extend(&test.features);
        assert_eq!(got, stream[..windows * (seq_len + 1)]);
        // The label is the last token of its window.
        for (i, row) in train.features.chunks(seq_len + 1).enumerate() {
            assert_eq!(train.labels[i] as f32, row[seq_len]);
        }
        // Every record's checksum is in the manifest.
        assert_eq!(m.train.crc32.len(), train.len());
        // Byte tokens take one byte each: a record is the label and the window.
        assert_eq!(m.feature_type, FeatureType::U8);
        assert_eq!(m.record_bytes, 4 + seq_len + 1);
        use object_store::ObjectStoreExt;
        let shard = store
            .get(&crate::format::object_path(&prefix, &m.train.shards[0].path).unwrap())
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(shard.len(), m.train.shards[0].count * m.record_bytes);
        assert_eq!(&shard[4..4 + seq_len + 1], &text.as_bytes()[..seq_len + 1]);
    }

    #[test]
    fn token_widths_follow_the_vocabulary() {
        assert_eq!(FeatureType::for_ids(2), FeatureType::U8);
        assert_eq!(FeatureType::for_ids(256), FeatureType::U8);
        assert_eq!(FeatureType::for_ids(257), FeatureType::U16);
        assert_eq!(FeatureType::for_ids(65_536), FeatureType::U16);
        assert_eq!(FeatureType::for_ids(65_537), FeatureType::F32);
        for ty in [FeatureType::U8, FeatureType::U16, FeatureType::F32] {
            let max = match ty {
                FeatureType::U8 => 255.0,
                FeatureType::U16 => 65_535.0,
                FeatureType::F32 => 16_777_215.0,
            };
            let values = [0.0, 1.0, 200.0, max];
            let mut buf = Vec::new();
            ty.encode(&mut buf, &values);
            assert_eq!(buf.len(), values.len() * ty.bytes(), "{ty}");
            let mut back = Vec::new();
            ty.decode_into(&buf, &mut back);
            assert_eq!(back, values, "{ty}");
        }
        assert!(!FeatureType::U8.holds(256.0));
        assert!(!FeatureType::U8.holds(1.5));
        assert!(!FeatureType::U16.holds(-1.0));
        assert!(!FeatureType::U16.holds(65_536.0));
        assert!(!FeatureType::F32.holds(f32::NAN));
    }

    #[tokio::test]
    async fn a_writer_refuses_a_feature_its_integer_type_cannot_hold() {
        let (store, prefix) = crate::open_bucket("memory://ints").unwrap();
        let options = WriteOptions::default();
        let mut w = DatasetWriter::create(store.as_ref(), &prefix, "ints", 3, 4, &options).unwrap();
        w.set_feature_type(FeatureType::U8).unwrap();
        w.push(Split::Train, 1, &[0.0, 255.0, 7.0]).await.unwrap();
        let err = w
            .push(Split::Train, 1, &[0.0, 256.0, 7.0])
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("train sample 1 feature 1 is 256, which u8 does not hold"),
            "{err}"
        );
        // Too late to change the width once a sample is in.
        let (store, prefix) = crate::open_bucket("memory://ints2").unwrap();
        let mut w = DatasetWriter::create(store.as_ref(), &prefix, "ints", 3, 4, &options).unwrap();
        w.push(Split::Train, 1, &[0.0, 1.0, 2.0]).await.unwrap();
        assert!(w.set_feature_type(FeatureType::U16).is_err());
    }

    #[test]
    fn a_manifest_whose_tokens_do_not_fit_its_feature_type_is_refused() {
        let mut m = Manifest {
            format: FORMAT_VERSION,
            layout: Layout::Shards,
            name: "t".into(),
            features: 5,
            classes: 300,
            record_bytes: 4 + 5,
            feature_type: FeatureType::U8,
            train: SplitInfo::default(),
            test: SplitInfo::default(),
            normalization: None,
            images: None,
            text: Some(TextInfo {
                vocab: 300,
                seq_len: 4,
                tokenizer: "t.json".into(),
                tokenizer_crc32: "00000000".into(),
            }),
        };
        let err = m.validate().unwrap_err().to_string();
        assert!(
            err.contains("feature_type u8 cannot hold the token ids of a vocabulary of 300"),
            "{err}"
        );
        m.feature_type = FeatureType::U16;
        let err = m.validate().unwrap_err().to_string();
        assert!(
            err.contains("record_bytes is 9 but 5 u16 features need 14"),
            "{err}"
        );
        m.record_bytes = 14;
        m.validate().unwrap();
    }

    #[tokio::test]
    async fn separate_test_files_and_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let a = file(dir.path(), "a.txt", generated_text(20, 1).as_bytes());
        let t = file(dir.path(), "t.txt", generated_text(5, 2).as_bytes());
        let (store, prefix) = crate::open_bucket("memory://text").unwrap();
        let mut o = options(vec![a], 4);
        o.test = vec![t.clone()];
        let m = write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &o)
            .await
            .unwrap();
        let test_tokens = std::fs::read(&t).unwrap().len();
        assert_eq!(m.test.num_samples, test_tokens / 5);
        let err = write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &o)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("--overwrite"), "{err}");
        o.overwrite = true;
        o.seq_len = 6;
        write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &o)
            .await
            .unwrap();
        let (m, _, _) = read_back(store, &prefix).await;
        assert_eq!(m.text.unwrap().seq_len, 6);
    }

    #[tokio::test]
    async fn bad_input_is_refused_by_name_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let good = file(dir.path(), "good.txt", generated_text(10, 1).as_bytes());
        let empty = file(dir.path(), "empty.txt", b"");
        let binary = file(dir.path(), "blob.bin", b"abc\n\x00\x01\x02\n");
        let missing = dir.path().join("missing.txt");
        let (store, prefix) = crate::open_bucket("memory://text").unwrap();
        let cases: Vec<(TextOptions, &str)> = vec![
            (options(vec![missing], 4), "missing.txt"),
            (options(vec![empty], 4), "empty.txt"),
            (options(vec![good.clone(), binary], 4), "blob.bin line 2"),
            (options(vec![good.clone()], 0), "--seq-len"),
        ];
        for (o, needle) in cases {
            let err = write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &o)
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "`{err}` should name {needle}");
        }
        use futures::TryStreamExt;
        let left: Vec<_> = store.list(None).try_collect().await.unwrap();
        assert!(left.is_empty(), "{left:?}");
        let bad = file(dir.path(), "tokenizer.json", b"{ not json");
        let err = TextTokenizer::open(bad.to_str().unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        let err = TextTokenizer::open("/nonexistent/tok.json")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/nonexistent/tok.json"), "{err}");
    }

    #[test]
    fn a_tokenizer_json_tokenizes_and_is_fingerprinted() {
        let dir = tempfile::tempdir().unwrap();
        // A word-level tokenizer with a whitespace pre-tokenizer.
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"the":1,"cat":2,"sees":3},"unk_token":"[UNK]"}}"#;
        let p = file(dir.path(), "tokenizer.json", json.as_bytes());
        let t = TextTokenizer::open(p.to_str().unwrap()).unwrap();
        assert_eq!(t.vocab(), 4);
        let mut ids = Vec::new();
        t.encode("the cat sees a dog\n", &mut ids).unwrap();
        assert_eq!(ids, vec![1, 2, 3, 0, 0]);
        let info = t.info(8);
        assert_eq!(info.tokenizer, "tokenizer.json");
        assert_eq!(
            info.tokenizer_crc32,
            format!("{:08x}", crc32(json.as_bytes()))
        );
    }
}

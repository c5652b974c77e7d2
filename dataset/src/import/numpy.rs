//! NumPy inputs: `.npy` feature and label pairs, and `.npz` archives.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path as FsPath, PathBuf};

use super::{err_file, Loc, RowSource};
use crate::format::DatasetError;
use crate::mnist::io_err;

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
pub(super) fn npy_dict_value<'a>(dict: &'a str, key: &str) -> Option<&'a str> {
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
pub(super) struct NpyStream {
    reader: Box<dyn Read + Send>,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Bytes before the data.
    header: u64,
    buf: Vec<u8>,
}

impl NpyStream {
    pub(super) fn open_file(path: &FsPath) -> Result<NpyStream, DatasetError> {
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
    pub(super) fn open(
        path: &FsPath,
        mut reader: Box<dyn Read + Send>,
    ) -> Result<NpyStream, DatasetError> {
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
pub(super) struct NpyRows {
    x_path: PathBuf,
    x: NpyStream,
    y_path: PathBuf,
    y: NpyStream,
    rows: usize,
    width: usize,
    row: usize,
}

impl NpyRows {
    pub(super) fn new(
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
                format!("the data ends in row {row}, before the {rows} rows the header promises"),
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
        format!("feature {}", j + 1)
    }
}

/// Opens the array `key` (member `key.npy`, or `key`) of a `.npz` archive as
/// a stream of its own: stored or deflated members are read straight from
/// the file, never whole in memory.
pub(super) fn open_npz_member(
    path: &FsPath,
    key: &str,
) -> Result<Box<dyn Read + Send>, DatasetError> {
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

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;

    use super::super::testutil::*;
    use super::super::*;

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
        let options = with_test_file(
            ImportInput::with_labels(&x, &y),
            ImportInput::with_labels(&xt, &yt),
        );
        let manifest = assert_imports(&options, &train, &test).await;
        assert_eq!((manifest.features, manifest.classes), (64, 10));
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

    /// Rows and features of an array are numbered from 1 in messages:
    /// `x[1, 2]` is row 2, feature 3.
    #[tokio::test]
    async fn a_bad_value_is_named_by_its_1_based_row_and_feature() {
        let dir = tempfile::tempdir().unwrap();
        let rows = table(3, 4, 2);
        let mut bytes = f32_bytes(&rows);
        let at = (4 + 2) * 4;
        bytes[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        let x = write(dir.path(), "x.npy", npy("<f4", &[3, 4], &bytes));
        let y = write(dir.path(), "y.npy", npy("|u1", &[3], &[0, 1, 0]));
        let (store, prefix) = memory();
        let options = ImportOptions::new(ImportInput::with_labels(&x, &y));
        let err = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("x.npy: row 2: feature 3 is inf"), "{err}");
    }
}

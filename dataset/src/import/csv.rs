//! CSV and TSV inputs, optionally gzipped.

use std::io::BufRead;
use std::path::{Path as FsPath, PathBuf};

use super::{err_at, err_file, LabelColumn, Loc, RowSource};
use crate::format::DatasetError;
use crate::mnist::{csv_error, csv_record_line, open_maybe_gz, skip_bom, LineTracker};

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
pub(super) struct CsvRows {
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
    pub(super) fn open(
        path: &FsPath,
        delimiter: u8,
        label: &LabelColumn,
    ) -> Result<Self, DatasetError> {
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

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;

    use super::super::testutil::*;
    use super::super::*;
    use object_store::ObjectStoreExt;

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
        let mut options = with_test_file(ImportInput::new(&tr), ImportInput::new(&te));
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

    /// Errors name the line as an editor shows it (the header is line 1,
    /// blank lines count) and the column from 1, the label column included.
    #[tokio::test]
    async fn a_bad_field_is_named_by_its_1_based_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "pos.csv", "label,a,b,c\n0,1,2,3\n\n1,4,x,6\n");
        let (store, prefix) = memory();
        let options = ImportOptions::new(ImportInput::new(&path));
        let err = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pos.csv:4: column 3 (`b`): `x` is not a number"),
            "{err}"
        );
    }
}

//! Parquet inputs of flat numeric columns.

use std::fs::File;
use std::path::{Path as FsPath, PathBuf};

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::Field;

use super::{err_at, err_file, LabelColumn, Loc, RowSource};
use crate::format::DatasetError;
use crate::mnist::io_err;

/// Rows of a Parquet file of flat numeric (or boolean) columns, read row
/// group by row group.
pub(super) struct ParquetRows {
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
    pub(super) fn open(path: &FsPath, label: &LabelColumn) -> Result<Self, DatasetError> {
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
                        "label column index {i} is past the last of the {} columns (indices start at 0)",
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

#[cfg(test)]
mod tests {
    use std::path::Path as FsPath;

    use super::super::testutil::*;
    use super::super::*;
    use super::check_parquet_compression;

    #[tokio::test]
    async fn parquet_snappy_and_gzip() {
        use ::parquet::basic::{Compression, GzipLevel};
        let dir = tempfile::tempdir().unwrap();
        let train = table(50, 64, 10);
        let test = table(12, 64, 10);
        let tr = dir.path().join("train.parquet");
        let te = dir.path().join("test.parquet");
        write_parquet(&tr, &train, Compression::SNAPPY);
        write_parquet(&te, &test, Compression::GZIP(GzipLevel::default()));
        let options = with_test_file(ImportInput::new(&tr), ImportInput::new(&te));
        let manifest = assert_imports(&options, &train, &test).await;
        assert_eq!((manifest.features, manifest.classes), (64, 10));
    }

    #[test]
    fn an_unsupported_parquet_compression_is_named() {
        use ::parquet::basic::{Compression, GzipLevel, ZstdLevel};
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

    /// Rows are numbered from 1 across row groups: the sixth row (the
    /// second of the file's second row group) is row 6.
    #[tokio::test]
    async fn a_bad_value_is_named_by_its_1_based_row() {
        use ::parquet::basic::Compression;
        let dir = tempfile::tempdir().unwrap();
        let mut rows = table(8, 3, 2);
        rows[5].1[1] = f32::NAN;
        let path = dir.path().join("pos.parquet");
        write_parquet(&path, &rows, Compression::SNAPPY);
        let (store, prefix) = memory();
        let options = ImportOptions::new(ImportInput::new(&path));
        let err = import_dataset(store.as_ref(), &prefix, &options)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pos.parquet: row 6: column `f1` is NaN"),
            "{err}"
        );
    }
}

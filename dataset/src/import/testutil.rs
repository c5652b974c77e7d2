//! What the importer tests of every format share: a memory bucket, small
//! tables and the files written from them.

use std::fs::File;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;

use super::{import_dataset, ImportInput, ImportOptions, TestSplit};
use crate::format::*;
use crate::DatasetReader;

pub(super) fn memory() -> (Arc<dyn ObjectStore>, Path) {
    crate::open_bucket("memory://imported").unwrap()
}

pub(super) async fn objects(store: &dyn ObjectStore) -> Vec<String> {
    let list: Vec<_> = store.list(None).try_collect().await.unwrap();
    list.into_iter().map(|m| m.location.to_string()).collect()
}

pub(super) async fn read_back(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
) -> (Manifest, Batch, Batch) {
    let reader = DatasetReader::open(store, prefix.clone()).await.unwrap();
    let train = reader.fetch_all(Split::Train).await.unwrap();
    let test = reader.fetch_all(Split::Test).await.unwrap();
    (reader.manifest().clone(), train, test)
}

/// Options importing `train`, with the test split from the file(s) `test`.
pub(super) fn with_test_file(train: ImportInput, test: ImportInput) -> ImportOptions {
    let mut options = ImportOptions::new(train);
    options.test = TestSplit::File(test);
    options
}

/// Import with `options` into a fresh memory bucket and check that the
/// splits read back hold `train` and `test`; returns the manifest.
pub(super) async fn assert_imports(
    options: &ImportOptions,
    train: &[(u32, Vec<f32>)],
    test: &[(u32, Vec<f32>)],
) -> Manifest {
    let (store, prefix) = memory();
    import_dataset(store.as_ref(), &prefix, options)
        .await
        .unwrap();
    let (manifest, a, b) = read_back(store, &prefix).await;
    assert_batch(&a, train);
    assert_batch(&b, test);
    manifest
}

/// `n` rows of `features` values with labels cycling through `classes`;
/// value `j` of row `i` is `i * 0.5 + j` (exact in f32).
pub(super) fn table(n: usize, features: usize, classes: u32) -> Vec<(u32, Vec<f32>)> {
    (0..n)
        .map(|i| {
            let x = (0..features).map(|j| i as f32 * 0.5 + j as f32).collect();
            ((i as u32 * 7 + 3) % classes, x)
        })
        .collect()
}

pub(super) fn assert_batch(batch: &Batch, rows: &[(u32, Vec<f32>)]) {
    assert_eq!(batch.len(), rows.len());
    for (i, (label, x)) in rows.iter().enumerate() {
        assert_eq!(batch.labels[i], *label, "row {i}");
        assert_eq!(batch.row(i).unwrap(), &x[..], "row {i}");
    }
}

/// A CSV with the label in column `label_at`, under a header when asked.
pub(super) fn csv(
    rows: &[(u32, Vec<f32>)],
    label_at: usize,
    header: Option<&str>,
    sep: char,
) -> String {
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
pub(super) fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if shape.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
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

pub(super) fn f64_bytes(rows: &[(u32, Vec<f32>)]) -> Vec<u8> {
    rows.iter()
        .flat_map(|(_, x)| x.iter().flat_map(|&v| (v as f64).to_le_bytes()))
        .collect()
}

pub(super) fn f32_bytes(rows: &[(u32, Vec<f32>)]) -> Vec<u8> {
    rows.iter()
        .flat_map(|(_, x)| x.iter().flat_map(|v| v.to_le_bytes()))
        .collect()
}

pub(super) fn write(dir: &FsPath, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

pub(super) fn write_parquet(
    path: &FsPath,
    rows: &[(u32, Vec<f32>)],
    compression: parquet::basic::Compression,
) {
    let width = rows[0].1.len();
    write_parquet_columns(path, rows, compression, &(0..width).collect::<Vec<_>>());
}

/// A Parquet file whose feature column `c` is feature `columns[c]` of
/// `rows`, named `f{columns[c]}`.
pub(super) fn write_parquet_columns(
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
    let mut writer = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
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

/// A CSV with a header whose feature columns come in the order
/// `columns` (column `c` is feature `columns[c]`, named `f{columns[c]}`),
/// the label column `label` first.
pub(super) fn csv_columns(rows: &[(u32, Vec<f32>)], columns: &[usize]) -> String {
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

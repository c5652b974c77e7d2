//! Bucket URLs: `file://` or a plain path, `memory://`, `s3://`.

use std::path::PathBuf;
use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;

/// A bucket URL that [`open_bucket`] cannot serve.
#[derive(Debug, thiserror::Error)]
#[error("cannot open bucket '{url}': {message}")]
pub struct BucketError {
    pub url: String,
    pub message: String,
}

/// Opens a bucket URL and returns the store plus the prefix inside it.
///
/// * `file:///abs/dir` or a plain path (`./data/x`, `data/x`, `/abs/dir`):
///   a local directory, created if missing; relative paths (also
///   `file://data/x`) resolve against the current directory. The store is
///   rooted at the directory and the prefix is empty.
/// * `memory://` or `memory://some/prefix`: a fresh, empty in-memory store
///   (each call makes a new one).
/// * `s3://bucket/prefix`: Amazon S3 or a compatible service, configured
///   from the `AWS_*` environment variables (`AWS_REGION`,
///   `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT`, ...).
pub fn open_bucket(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), BucketError> {
    let trimmed = url.trim();
    let bucket_err = |message: String| BucketError {
        url: url.to_string(),
        message,
    };
    if trimmed.is_empty() {
        return Err(bucket_err("empty bucket URL".into()));
    }
    if let Some(rest) = strip_scheme(trimmed, "memory") {
        let prefix = Path::parse(rest).map_err(|e| bucket_err(format!("bad prefix: {e}")))?;
        return Ok((Arc::new(InMemory::new()), prefix));
    }
    if let Some(rest) = strip_scheme(trimmed, "file") {
        let dir = if rest.starts_with('/') || rest.starts_with("localhost/") {
            let parsed = url::Url::parse(trimmed).map_err(|e| bucket_err(e.to_string()))?;
            parsed
                .to_file_path()
                .map_err(|()| bucket_err("not a local file path".into()))?
        } else {
            PathBuf::from(rest)
        };
        return open_local(dir, url);
    }
    if let Some((scheme, _)) = trimmed.split_once("://") {
        return match scheme.to_ascii_lowercase().as_str() {
            "s3" | "s3a" => {
                let parsed = url::Url::parse(trimmed).map_err(|e| bucket_err(e.to_string()))?;
                let options = std::env::vars().filter(|(k, _)| k.starts_with("AWS_"));
                let (store, prefix) = object_store::parse_url_opts(&parsed, options)
                    .map_err(|e| bucket_err(e.to_string()))?;
                Ok((Arc::from(store), prefix))
            }
            other => Err(bucket_err(format!(
                "unsupported scheme '{other}://'; use file:///abs/dir, a plain path, memory:// or s3://bucket/prefix"
            ))),
        };
    }
    open_local(PathBuf::from(trimmed), url)
}

/// The rest of `url` after `<scheme>://`, scheme compared case-insensitively.
fn strip_scheme<'a>(url: &'a str, scheme: &str) -> Option<&'a str> {
    let (s, rest) = url.split_once("://")?;
    s.eq_ignore_ascii_case(scheme).then_some(rest)
}

fn open_local(dir: PathBuf, url: &str) -> Result<(Arc<dyn ObjectStore>, Path), BucketError> {
    let dir = if dir.is_absolute() {
        dir
    } else {
        std::env::current_dir()
            .map_err(|e| BucketError {
                url: url.to_string(),
                message: format!("cannot read the current directory: {e}"),
            })?
            .join(dir)
    };
    std::fs::create_dir_all(&dir).map_err(|e| BucketError {
        url: url.to_string(),
        message: format!("cannot create {}: {e}", dir.display()),
    })?;
    let store = LocalFileSystem::new_with_prefix(&dir).map_err(|e| BucketError {
        url: url.to_string(),
        message: e.to_string(),
    })?;
    Ok((Arc::new(store), Path::default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::PutPayload;

    #[tokio::test]
    async fn open_bucket_urls() {
        let (store, prefix) = open_bucket("memory://").unwrap();
        assert_eq!(prefix, Path::default());
        assert!(store.to_string().contains("InMemory"));
        let (_, prefix) = open_bucket("memory:///a/b").unwrap();
        assert_eq!(prefix, Path::from("a/b"));
        let (_, prefix) = open_bucket("memory://a/b/").unwrap();
        assert_eq!(prefix, Path::from("a/b"));

        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("x/y");
        let (store, prefix) = open_bucket(target.to_str().unwrap()).unwrap();
        assert!(target.is_dir());
        store
            .put(&prefix.clone().join("f"), PutPayload::from_static(b"hi"))
            .await
            .unwrap();
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"hi");

        let spaced = dir.path().join("with space");
        let url = format!("file://{}", spaced.display()).replace(' ', "%20");
        open_bucket(&url).unwrap();
        assert!(spaced.is_dir());

        let (_, prefix) = open_bucket("s3://some-bucket/data/mnist").unwrap();
        assert_eq!(prefix, Path::from("data/mnist"));

        for bad in ["gs://b/p", "ftp://host/x", "", "memory://a//b"] {
            let err = open_bucket(bad).err().unwrap();
            assert_eq!(err.url, bad, "{err}");
        }
        let err = open_bucket("gs://b/p").err().unwrap();
        assert!(
            err.to_string().contains("unsupported scheme 'gs://'"),
            "{err}"
        );
    }

    #[test]
    fn open_bucket_relative_paths() {
        // Relative forms resolve against the current directory; check the
        // resolution without changing the process-wide directory.
        let cwd = std::env::current_dir().unwrap();
        let name = format!(".dataset-test-{}", std::process::id());
        let dir = cwd.join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        open_bucket(&format!("file://{name}/a")).unwrap();
        assert!(dir.join("a").is_dir());
        open_bucket(&format!("./{name}/b")).unwrap();
        assert!(dir.join("b").is_dir());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

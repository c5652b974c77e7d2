//! Bucket URLs: `file://` or a plain path, `memory://`, and the clouds:
//! `s3://` (Amazon S3 and compatible services), `gs://` (Google Cloud
//! Storage) and `az://` / `azure://` / `abfs://` (Azure Blob Storage).
//!
//! Cloud URLs are split by `object_store`'s own URL parser
//! ([`ObjectStoreScheme::parse`]) and built by its builders, configured from
//! the environment the way the cloud SDKs read it (`AWS_*`, `GOOGLE_*`,
//! `AZURE_*`). For the training data ([`open_data_bucket`]) `object_store`'s
//! internal retries are turned off: the loader's retry policy owns the outage
//! budget (see `ps_worker::loader::RetryPolicy`), so every try shows in its
//! counters and log instead of stacking unseen. Other uses (writing a
//! dataset, checkpoints) keep `object_store`'s own retries.
//!
//! ```
//! use ps_shared::bucket::open_bucket_with;
//!
//! let opts = [("aws_region", "eu-west-1"), ("aws_access_key_id", "id"), ("aws_secret_access_key", "key")];
//! let (store, prefix) = open_bucket_with("s3://my-bucket/data/mnist", opts).unwrap();
//! assert_eq!(prefix.as_ref(), "data/mnist");
//! assert!(store.to_string().contains("my-bucket"));
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreScheme, RetryConfig};

/// A bucket URL that [`open_bucket`] cannot serve.
#[derive(Debug, thiserror::Error)]
#[error("cannot open bucket '{url}': {message}")]
pub struct BucketError {
    pub url: String,
    pub message: String,
}

/// Prefixes of the environment variables handed to the cloud builders.
const ENV_PREFIXES: [&str; 3] = ["AWS_", "GOOGLE_", "AZURE_"];

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
///   `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT`,
///   `AWS_ALLOW_HTTP`, ...).
/// * `gs://bucket/prefix`: Google Cloud Storage, from `GOOGLE_*`
///   (`GOOGLE_APPLICATION_CREDENTIALS`, `GOOGLE_SERVICE_ACCOUNT`, ...).
/// * `az://container/prefix` (also `azure://`, `abfs://`, `abfss://`,
///   `adl://`): Azure Blob Storage, from `AZURE_*`
///   (`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, ...).
pub fn open_bucket(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), BucketError> {
    open_url(url, cloud_env(), RetryConfig::default())
}

/// [`open_bucket`] for the training data: a cloud store makes each request
/// once and leaves retrying to the caller's policy. `object_store` would
/// otherwise retry a failed request up to 10 times within 3 minutes before
/// the loader sees it, so an outage would be retried twice over and none of
/// those tries would be counted or logged.
pub fn open_data_bucket(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), BucketError> {
    open_url(url, cloud_env(), no_internal_retries())
}

/// The `AWS_*`, `GOOGLE_*` and `AZURE_*` environment variables.
fn cloud_env() -> impl Iterator<Item = (String, String)> {
    std::env::vars().filter(|(k, _)| ENV_PREFIXES.iter().any(|p| k.starts_with(p)))
}

/// [`open_bucket`] with explicit cloud options instead of the environment:
/// `(key, value)` pairs as `object_store`'s builders take them
/// (`aws_region`, `google_service_account`, `azure_storage_account_name`,
/// ...; case-insensitive, keys of other clouds are ignored). Like
/// [`open_data_bucket`], a cloud store makes each request once.
pub fn open_bucket_with<I, K, V>(
    url: &str,
    options: I,
) -> Result<(Arc<dyn ObjectStore>, Path), BucketError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: Into<String>,
{
    open_url(url, options, no_internal_retries())
}

fn open_url<I, K, V>(
    url: &str,
    options: I,
    retry: RetryConfig,
) -> Result<(Arc<dyn ObjectStore>, Path), BucketError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: Into<String>,
{
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
    if !trimmed.contains("://") {
        return open_local(PathBuf::from(trimmed), url);
    }
    let parsed = url::Url::parse(trimmed).map_err(|e| bucket_err(e.to_string()))?;
    let unsupported = || {
        bucket_err(format!(
            "unsupported scheme '{}://'; use file:///abs/dir, a plain path, memory://, \
             s3://bucket/prefix, gs://bucket/prefix or az://container/prefix",
            parsed.scheme()
        ))
    };
    let (scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|_| unsupported())?;
    let prefix = Path::parse(path).map_err(|e| bucket_err(format!("bad prefix: {e}")))?;
    install_crypto_provider();
    let options: Vec<(String, String)> = options
        .into_iter()
        .map(|(k, v)| (k.as_ref().to_ascii_lowercase(), v.into()))
        .collect();
    // The clouds' builders share their shape, not a trait: the options
    // named for that cloud, object_store's retries (off for the data
    // plane), then build.
    macro_rules! cloud {
        ($builder:ty, $prefix:literal) => {{
            let b = configure(
                <$builder>::new().with_url(trimmed),
                &options,
                $prefix,
                |b, k, v| k.parse().map(|k| b.clone().with_config(k, v)).ok(),
            );
            b.with_retry(retry.clone())
                .build()
                .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        }};
    }
    let built = match scheme {
        ObjectStoreScheme::AmazonS3 => cloud!(AmazonS3Builder, "aws_"),
        ObjectStoreScheme::GoogleCloudStorage => cloud!(GoogleCloudStorageBuilder, "google_"),
        ObjectStoreScheme::MicrosoftAzure => cloud!(MicrosoftAzureBuilder, "azure_"),
        _ => return Err(unsupported()),
    };
    let store = built.map_err(|e| bucket_err(e.to_string()))?;
    Ok((store, prefix))
}

/// Applies the options whose key starts with `prefix` (the other clouds'
/// keys are left out; a key the builder does not know is skipped, as
/// `object_store::parse_url_opts` does).
fn configure<B>(
    builder: B,
    options: &[(String, String)],
    prefix: &str,
    apply: impl Fn(&B, &str, &str) -> Option<B>,
) -> B {
    options
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .fold(builder, |b, (k, v)| apply(&b, k, v).unwrap_or(b))
}

/// No retries inside `object_store` (see [`open_data_bucket`]).
fn no_internal_retries() -> RetryConfig {
    RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    }
}

/// The cloud clients run TLS through rustls with the ring provider (as the
/// QUIC transport does), installed process-wide once; aws-lc is not built.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may have installed one meanwhile: either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Whether `err` is the store refusing a range that starts past the end of
/// the object (HTTP 416, or the local stores' range check): the object is
/// shorter than expected, and asking again will not change that.
pub fn is_range_not_satisfiable(err: &object_store::Error) -> bool {
    source_chain_mentions(
        err,
        &[
            "416 Range Not Satisfiable",
            "InvalidRange",
            "Wanted range starting at",
        ],
    )
}

/// Whether `err` comes from the client's own settings rather than from the
/// bucket, so that trying again cannot help: an `http://` endpoint without
/// `AWS_ALLOW_HTTP=true` (or the other clouds' `*_ALLOW_HTTP`) fails every
/// request with `URL scheme is not allowed`.
pub fn is_client_misconfigured(err: &object_store::Error) -> bool {
    source_chain_mentions(err, &["URL scheme is not allowed"])
}

/// Whether the text of `err` or of one of its sources contains one of `needles`.
fn source_chain_mentions(err: &object_store::Error, needles: &[&str]) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        let text = e.to_string();
        if needles.iter().any(|n| text.contains(n)) {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether `err` says that the bucket (or Azure container) itself does not
/// exist, as opposed to one object in it: S3 answers `NoSuchBucket`, Azure
/// `ContainerNotFound`, GCS "The specified bucket does not exist". The
/// store's answer is in the error's source chain.
pub fn is_missing_bucket(err: &object_store::Error) -> bool {
    matches!(err, object_store::Error::NotFound { .. })
        && source_chain_mentions(
            err,
            &["NoSuchBucket", "ContainerNotFound", "bucket does not exist"],
        )
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

        for bad in ["ftp://host/x", "", "memory://a//b", "gs:///no-bucket"] {
            let err = open_bucket(bad).err().unwrap();
            assert_eq!(err.url, bad, "{err}");
        }
        let err = open_bucket("ftp://host/x").err().unwrap();
        assert!(
            err.to_string().contains("unsupported scheme 'ftp://'"),
            "{err}"
        );
    }

    #[test]
    fn cloud_urls_open_with_options() {
        // Fake credentials: building a store does not touch the network.
        let aws = [
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "id"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
            ("AWS_ENDPOINT", "http://127.0.0.1:9"),
            ("AWS_ALLOW_HTTP", "true"),
        ];
        let (store, prefix) = open_bucket_with("s3://some-bucket/data/mnist", aws).unwrap();
        assert_eq!(prefix, Path::from("data/mnist"));
        assert!(store.to_string().contains("some-bucket"), "{store}");

        let gcs = [("GOOGLE_SKIP_SIGNATURE", "true")];
        let (store, prefix) = open_bucket_with("gs://b/p", gcs).unwrap();
        assert_eq!(prefix, Path::from("p"));
        assert_eq!(store.to_string(), "GoogleCloudStorage(b)");

        let azure = [
            ("AZURE_STORAGE_ACCOUNT_NAME", "devaccount"),
            ("AZURE_STORAGE_ACCOUNT_KEY", "c2VjcmV0LWtleQ=="),
        ];
        for url in ["az://images7/a/b", "azure://images7/a/b"] {
            let (store, prefix) = open_bucket_with(url, azure).unwrap();
            assert_eq!(prefix, Path::from("a/b"), "{url}");
            let name = store.to_string();
            assert!(
                name.contains("images7") && name.contains("devaccount"),
                "{url}: {name}"
            );
        }
        let (store, prefix) =
            open_bucket_with("abfs://images8@devaccount.dfs.core.windows.net/a", azure).unwrap();
        assert_eq!(prefix, Path::from("a"));
        assert!(store.to_string().contains("images8"), "{store}");

        // Azure without an account name is refused with the builder's reason.
        let err = open_bucket_with("az://container/a", [("AWS_REGION", "x")])
            .err()
            .unwrap();
        assert!(err.to_string().contains("az://container/a"), "{err}");
    }

    #[test]
    fn missing_bucket_is_told_apart_from_missing_object() {
        use std::error::Error as _;
        #[derive(Debug, thiserror::Error)]
        #[error("Server returned non-2xx status code: 404 Not Found: {0}")]
        struct Answer(&'static str);
        let not_found = |body: &'static str| object_store::Error::NotFound {
            path: "data/manifest.json".into(),
            source: Box::new(Answer(body)),
        };
        let bucket =
            not_found("<Error><Code>NoSuchBucket</Code><BucketName>b</BucketName></Error>");
        assert!(bucket.source().is_some());
        assert!(is_missing_bucket(&bucket));
        assert!(is_missing_bucket(&not_found(
            "<Error><Code>ContainerNotFound</Code></Error>"
        )));
        assert!(!is_missing_bucket(&not_found(
            "<Error><Code>NoSuchKey</Code></Error>"
        )));
        let other = object_store::Error::Generic {
            store: "S3",
            source: "NoSuchBucket".into(),
        };
        assert!(!is_missing_bucket(&other), "only a 404 says so");
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

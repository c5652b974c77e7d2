//! `CountingStore`: an [`ObjectStore`] wrapper that counts the GET requests
//! sent through it and the ones the store refused, and passes everything
//! through unchanged. The worker reads its manifest and test split through
//! one, so the start-up reads show in its bucket counters next to the
//! loader's own.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use object_store::{memory::InMemory, path::Path, ObjectStoreExt};
//! use ps_worker::countstore::CountingStore;
//!
//! let inner = Arc::new(InMemory::new());
//! inner.put(&Path::from("a"), vec![1u8; 10].into()).await.unwrap();
//! let store = CountingStore::new(inner);
//! store.get(&Path::from("a")).await.unwrap();
//! assert!(store.get(&Path::from("missing")).await.is_err());
//! assert_eq!(store.counts().gets, 2);
//! assert_eq!(store.counts().failed, 1);
//! # });
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, MultipartUpload, ObjectStore, PutMultipartOptions, PutOptions,
    PutPayload, PutResult, Result,
};

/// GETs counted by a [`CountingStore`] (HEAD requests are not GETs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GetCounts {
    /// GET requests sent, failed ones included.
    pub gets: u64,
    /// GET requests the store answered with an error.
    pub failed: u64,
}

impl GetCounts {
    /// GETs that the store answered.
    pub fn answered(&self) -> u64 {
        self.gets - self.failed
    }

    /// Counts since `earlier`.
    pub fn since(&self, earlier: GetCounts) -> GetCounts {
        GetCounts {
            gets: self.gets.saturating_sub(earlier.gets),
            failed: self.failed.saturating_sub(earlier.failed),
        }
    }
}

/// Counts GETs; see the module docs.
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn ObjectStore>,
    gets: AtomicU64,
    failed: AtomicU64,
}

impl CountingStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        Self {
            inner,
            gets: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> GetCounts {
        GetCounts {
            gets: self.gets.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Display for CountingStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The inner store's name, so errors name the bucket as it does.
        fmt::Display::fmt(&self.inner, f)
    }
}

crate::wrapstore::wrapping_store!(CountingStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    /// Counted here; `get_ranges` keeps the trait's default, which sends
    /// its (coalesced) ranges through this method.
    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let head = options.head;
        if !head {
            self.gets.fetch_add(1, Ordering::Relaxed);
        }
        let result = self.inner.get_opts(location, options).await;
        if !head && result.is_err() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
});

//! One definition of the pass-through part of an [`object_store::ObjectStore`]
//! wrapper: the crate's wrappers ([`crate::countstore::CountingStore`],
//! [`crate::simstore::SimStore`]) change how objects are written and read,
//! and hand listing, deleting, copying and renaming to their `inner` store
//! unchanged.

/// `impl ObjectStore for $ty` (async-trait) with the given methods (the
/// writes and reads the wrapper changes), and every listing, delete, copy
/// and rename forwarded to `self.inner`.
macro_rules! wrapping_store {
    ($ty:ty { $($method:item)* }) => {
        #[async_trait::async_trait]
        impl object_store::ObjectStore for $ty {
            $($method)*

            fn delete_stream(
                &self,
                locations: futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>,
            ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
                self.inner.delete_stream(locations)
            }

            fn list(
                &self,
                prefix: Option<&object_store::path::Path>,
            ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
                self.inner.list(prefix)
            }

            fn list_with_offset(
                &self,
                prefix: Option<&object_store::path::Path>,
                offset: &object_store::path::Path,
            ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
                self.inner.list_with_offset(prefix, offset)
            }

            async fn list_with_delimiter(
                &self,
                prefix: Option<&object_store::path::Path>,
            ) -> object_store::Result<object_store::ListResult> {
                self.inner.list_with_delimiter(prefix).await
            }

            async fn copy_opts(
                &self,
                from: &object_store::path::Path,
                to: &object_store::path::Path,
                options: object_store::CopyOptions,
            ) -> object_store::Result<()> {
                self.inner.copy_opts(from, to, options).await
            }

            async fn rename_opts(
                &self,
                from: &object_store::path::Path,
                to: &object_store::path::Path,
                options: object_store::RenameOptions,
            ) -> object_store::Result<()> {
                self.inner.rename_opts(from, to, options).await
            }
        }
    };
}

pub(crate) use wrapping_store;

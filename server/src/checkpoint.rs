//! Shard checkpoints in an object store, published atomically.
//!
//! A checkpoint of shard `s` at version `v` is written as one object
//! `shard-s/v<v>.ckpt` (an rkyv archive of [`ShardCheckpoint`]); only after
//! that write succeeds is `shard-s/LATEST.json` overwritten to point at it,
//! with the object's size and checksum. A reader follows `LATEST.json`, so it
//! sees either the previous complete checkpoint or the new complete one, never
//! a partial write. The checkpoint before the newly published one is deleted.

use std::hash::Hasher;
use std::sync::Arc;

use object_store::{path::Path, ObjectStore, ObjectStoreExt, PutPayload};
use rkyv::rancor;
use serde::{Deserialize, Serialize};

/// Everything a shard needs to resume.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, PartialEq)]
pub struct ShardCheckpoint {
    pub shard: u32,
    pub lo: u64,
    pub hi: u64,
    pub layout_hash: u64,
    pub version: u64,
    pub params: Vec<f32>,
    pub momentum: Vec<f32>,
    /// Next step per worker (ASP/SSP).
    pub clocks: Vec<(u32, u64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Latest {
    version: u64,
    object: String,
    bytes: u64,
    checksum: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint store: {0}")]
    Store(#[from] object_store::Error),
    #[error("checkpoint {object} is corrupt: {message}")]
    Corrupt { object: String, message: String },
    #[error("cannot encode checkpoint: {0}")]
    Encode(String),
}

/// FNV-1a 64 of the checkpoint object (the value `LATEST.json` records).
fn checksum(bytes: &[u8]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(bytes);
    h.finish()
}

fn shard_dir(prefix: &Path, shard: u32) -> Path {
    prefix.clone().join(format!("shard-{shard:05}"))
}

/// Write `ckpt` and then publish it as the latest.
pub async fn save(
    store: &Arc<dyn ObjectStore>,
    prefix: &Path,
    ckpt: &ShardCheckpoint,
) -> Result<(), CheckpointError> {
    let dir = shard_dir(prefix, ckpt.shard);
    let bytes = rkyv::to_bytes::<rancor::Error>(ckpt)
        .map_err(|e| CheckpointError::Encode(e.to_string()))?;
    let name = format!("v{:012}.ckpt", ckpt.version);
    let object = dir.clone().join(name.as_str());
    let latest = Latest {
        version: ckpt.version,
        object: name,
        bytes: bytes.len() as u64,
        checksum: checksum(&bytes),
    };
    store
        .put(&object, PutPayload::from(bytes.into_vec()))
        .await?;
    let previous = read_latest(store, &dir).await.ok().flatten();
    let manifest =
        serde_json::to_vec(&latest).map_err(|e| CheckpointError::Encode(e.to_string()))?;
    store
        .put(&dir.clone().join("LATEST.json"), PutPayload::from(manifest))
        .await?;
    if let Some(prev) = previous.filter(|p| p.object != latest.object) {
        let _ = store.delete(&dir.clone().join(prev.object.as_str())).await;
    }
    Ok(())
}

async fn read_latest(
    store: &Arc<dyn ObjectStore>,
    dir: &Path,
) -> Result<Option<Latest>, CheckpointError> {
    let path = dir.clone().join("LATEST.json");
    let bytes = match store.get(&path).await {
        Ok(r) => r.bytes().await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| CheckpointError::Corrupt {
            object: path.to_string(),
            message: e.to_string(),
        })
}

/// The latest published checkpoint of `shard`, verified; `None` if there is none.
pub async fn load_latest(
    store: &Arc<dyn ObjectStore>,
    prefix: &Path,
    shard: u32,
) -> Result<Option<ShardCheckpoint>, CheckpointError> {
    let dir = shard_dir(prefix, shard);
    let Some(latest) = read_latest(store, &dir).await? else {
        return Ok(None);
    };
    let object = dir.clone().join(latest.object.as_str());
    let bytes = store.get(&object).await?.bytes().await?;
    let corrupt = |message: String| CheckpointError::Corrupt {
        object: object.to_string(),
        message,
    };
    if bytes.len() as u64 != latest.bytes || checksum(&bytes) != latest.checksum {
        return Err(corrupt("size or checksum differs from LATEST.json".into()));
    }
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(&bytes);
    let ckpt = rkyv::from_bytes::<ShardCheckpoint, rancor::Error>(&aligned)
        .map_err(|e| corrupt(e.to_string()))?;
    if ckpt.shard != shard || ckpt.version != latest.version {
        return Err(corrupt("shard or version differs from LATEST.json".into()));
    }
    Ok(Some(ckpt))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;

    #[test]
    fn the_checksum_is_fnv1a_64_so_older_checkpoints_still_verify() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(checksum(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(checksum(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(checksum(b"foobar"), 0x8594_4171_f739_67e8);
    }

    fn ckpt(version: u64) -> ShardCheckpoint {
        ShardCheckpoint {
            shard: 3,
            lo: 10,
            hi: 14,
            layout_hash: 7,
            version,
            params: vec![1.0, 2.0, 3.0, version as f32],
            momentum: vec![],
            clocks: vec![(0, version)],
        }
    }

    #[tokio::test]
    async fn save_publish_and_restore() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("ckpt");
        assert!(load_latest(&store, &prefix, 3).await.unwrap().is_none());
        save(&store, &prefix, &ckpt(5)).await.unwrap();
        save(&store, &prefix, &ckpt(10)).await.unwrap();
        assert_eq!(
            load_latest(&store, &prefix, 3).await.unwrap(),
            Some(ckpt(10))
        );
        // The superseded checkpoint is gone, the published one stays.
        let old = shard_dir(&prefix, 3).join("v000000000005.ckpt");
        assert!(store.head(&old).await.is_err());
    }

    #[tokio::test]
    async fn corrupt_checkpoint_is_an_error_not_a_panic() {
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let prefix = Path::from("ckpt");
        save(&store, &prefix, &ckpt(5)).await.unwrap();
        let object = shard_dir(&prefix, 3).join("v000000000005.ckpt");
        store
            .put(&object, PutPayload::from(vec![0u8; 12]))
            .await
            .unwrap();
        let err = load_latest(&store, &prefix, 3).await.unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
    }
}

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

/// Where the job stands in its sample stream (see `ps_shared::sampler`):
/// global step `step` starts after `samples` samples of the stream (the
/// epochs' global orders one after the other), and every step from there on
/// consumes `world × batch` samples. The worker count and batch size may
/// change when a run resumes: [`DataSplit::resume`] starts a new split at
/// the resumed step, at the same stream position.
#[derive(
    rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default,
)]
pub struct DataSplit {
    pub step: u64,
    pub samples: u64,
    /// Workers the steps are split across (`cluster.workers`).
    pub world: u32,
    /// `data.batch_size`.
    pub batch: u64,
    /// `data.seed`.
    pub seed: u64,
    /// `data.partition = "stable"` (whose order depends on the split).
    pub stable: bool,
}

impl DataSplit {
    /// A run that starts from nothing.
    pub fn fresh(world: u32, batch: u64, seed: u64, stable: bool) -> Self {
        Self {
            step: 0,
            samples: 0,
            world,
            batch,
            seed,
            stable,
        }
    }

    /// Stream position of global step `step` (at or after `self.step`).
    pub fn position(&self, step: u64) -> u64 {
        let steps = step.saturating_sub(self.step);
        self.samples.saturating_add(
            steps
                .saturating_mul(u64::from(self.world))
                .saturating_mul(self.batch),
        )
    }

    /// The split of a run resumed at global step `at` with `now`'s worker
    /// count and batch size: unchanged when they are the same, else a new
    /// split from the same stream position. A change of seed or partition,
    /// or of the split of a stable partition, is refused: the sample order
    /// itself would change.
    pub fn resume(&self, at: u64, now: &DataSplit) -> Result<DataSplit, String> {
        if now.seed != self.seed {
            return Err(format!(
                "the checkpoint's sample order was seeded with data.seed = {}, this run has {}; resume with the same seed",
                self.seed, now.seed
            ));
        }
        if now.stable != self.stable {
            return Err(
                "data.partition changed since the checkpoint; resume with the same partition"
                    .into(),
            );
        }
        if now.world == self.world && now.batch == self.batch {
            return Ok(*self);
        }
        if self.stable {
            return Err(format!(
                "data.partition = \"stable\" splits the samples by worker count and batch size: a checkpoint taken with {} workers and batches of {} cannot resume with {} workers and batches of {} (use partition = \"reshuffle\" for elastic runs)",
                self.world, self.batch, now.world, now.batch
            ));
        }
        let at = at.max(self.step);
        Ok(DataSplit {
            step: at,
            samples: self.position(at),
            ..*now
        })
    }
}

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
    /// The global top-k residual's non-zero entries (empty without
    /// `compression.global_topk`).
    pub residual: ps_shared::sparse::SparseGrad,
    /// Next step per worker (ASP/SSP).
    pub clocks: Vec<(u32, u64)>,
    /// Where the sample stream stands.
    pub data: DataSplit,
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
            residual: ps_shared::sparse::SparseGrad {
                indices: vec![1],
                values: vec![0.5],
            },
            clocks: vec![(0, version)],
            data: DataSplit::fresh(2, 8, 1, false),
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

    #[test]
    fn a_split_resumes_at_the_same_stream_position() {
        let four = DataSplit::fresh(4, 8, 1, false);
        assert_eq!(four.position(10), 320);
        // Same count: nothing changes.
        assert_eq!(four.resume(10, &DataSplit::fresh(4, 8, 1, false)), Ok(four));
        // 4 -> 2 workers at step 10: step 10 starts at sample 320, and each
        // step from there takes 16.
        let two = four.resume(10, &DataSplit::fresh(2, 8, 1, false)).unwrap();
        assert_eq!((two.step, two.samples, two.world), (10, 320, 2));
        assert_eq!(two.position(12), 352);
        // And on to 3 workers with batches of 4 at step 12.
        let three = two.resume(12, &DataSplit::fresh(3, 4, 1, false)).unwrap();
        assert_eq!(three.position(13), 352 + 12);
        // Changes that alter the order itself are refused, naming the field.
        let e = four
            .resume(10, &DataSplit::fresh(4, 8, 2, false))
            .unwrap_err();
        assert!(e.contains("data.seed"), "{e}");
        let stable = DataSplit::fresh(4, 8, 1, true);
        let e = stable
            .resume(10, &DataSplit::fresh(2, 8, 1, true))
            .unwrap_err();
        assert!(e.contains("stable") && e.contains("4 workers"), "{e}");
        assert!(stable.resume(10, &DataSplit::fresh(4, 8, 1, true)).is_ok());
        let e = four
            .resume(10, &DataSplit::fresh(4, 8, 1, true))
            .unwrap_err();
        assert!(e.contains("data.partition"), "{e}");
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

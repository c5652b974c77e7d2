//! The loader's sample cache: a memory tier ([moka], weighed in bytes), a
//! local-disk tier (a directory with a byte cap; files are written under a
//! temporary name and renamed into place, and kept with an index across
//! restarts, see [`DiskTier`]) and [`TierPlan`], the policy that decides
//! which samples live where.
//!
//! The loader knows the whole future sample order, so every sample it holds
//! has a known *next use*: an absolute position in this worker's schedule.
//! The plan keeps the samples needed soonest: memory holds the soonest ones,
//! the disk the next ones, and whatever is needed latest is dropped first
//! (Belady's rule). A sample consumed this epoch and not needed until the next
//! one therefore goes before any sample still needed this epoch, and in the
//! last epoch nothing is kept after its use. The tiers are exclusive: a sample
//! is in at most one of them, so their capacities add up.
//!
//! Correctness never depends on the cache: a sample the plan believes cached
//! but that cannot be read back (dropped by moka, a damaged or missing file)
//! is reported as a miss and fetched again; a capacity of zero, or smaller
//! than one sample, only costs speed. Every disk read is checked against the
//! CRC-32 written with the file (and recorded in the index), and the loader
//! checks the bytes against the manifest's checksum of the sample as well.
//!
//! ```
//! use ps_worker::cache::{CacheAction, Tier, TierPlan};
//!
//! // 2 samples of 10 bytes fit in memory, 1 on disk.
//! let mut plan = TierPlan::new(20, 10);
//! assert_eq!(plan.offer(1, 10, Some(100)), vec![CacheAction::PutMemory(1)]);
//! assert_eq!(plan.offer(2, 10, Some(300)), vec![CacheAction::PutMemory(2)]);
//! // Sample 3 is needed before sample 2: 2 moves to disk, 3 takes its place.
//! assert_eq!(
//!     plan.offer(3, 10, Some(200)),
//!     vec![CacheAction::Demote(2), CacheAction::PutMemory(3)]
//! );
//! assert_eq!(plan.tier_of(2), Some(Tier::Disk));
//! // Sample 4 is needed after everything cached: it is not kept.
//! assert!(plan.offer(4, 10, Some(900)).is_empty());
//! // Sample 1 was used and is never needed again: dropped.
//! assert_eq!(plan.offer(1, 10, None), vec![CacheAction::DropMemory(1)]);
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use moka::future::Cache;
use moka::policy::EvictionPolicy;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};

/// Key of a cached sample: its index in the training split.
pub type SampleKey = u64;

/// Everything the cache tiers can report.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A cache file or the cache directory could not be accessed.
    #[error("disk cache: cannot access {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A cache file does not hold what was written to it.
    #[error("disk cache: {} is damaged: {message}", path.display())]
    Damaged { path: PathBuf, message: String },
    /// The disk tier's worker thread is gone.
    #[error("disk cache: the disk worker stopped")]
    Closed,
}

/// A cache tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Memory,
    Disk,
}

impl Tier {
    fn index(self) -> usize {
        match self {
            Tier::Memory => 0,
            Tier::Disk => 1,
        }
    }
}

/// One step of IO that carries out a [`TierPlan`] decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheAction {
    /// Store the sample in hand in memory.
    PutMemory(SampleKey),
    /// Store the sample in hand on disk.
    PutDisk(SampleKey),
    /// Move a sample from memory to disk (its bytes are in the memory tier).
    Demote(SampleKey),
    /// Remove a sample from memory.
    DropMemory(SampleKey),
    /// Remove a sample from disk.
    DropDisk(SampleKey),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    tier: Tier,
    next_use: u64,
    bytes: u64,
}

/// Placement policy of the two tiers by next use (see the module docs).
///
/// Plain data: it decides and returns [`CacheAction`]s; the caller does the
/// IO and reports back with [`TierPlan::forget`] when a tier lost a sample.
#[derive(Debug, Clone)]
pub struct TierPlan {
    caps: [u64; 2],
    used: [u64; 2],
    /// `(next_use, key)` of the samples of each tier, soonest first.
    order: [BTreeSet<(u64, SampleKey)>; 2],
    entries: HashMap<SampleKey, Entry>,
}

impl TierPlan {
    /// Capacities in bytes (0 disables a tier).
    pub fn new(memory_bytes: u64, disk_bytes: u64) -> Self {
        Self {
            caps: [memory_bytes, disk_bytes],
            used: [0, 0],
            order: [BTreeSet::new(), BTreeSet::new()],
            entries: HashMap::new(),
        }
    }

    /// Where the plan keeps `key`.
    pub fn tier_of(&self, key: SampleKey) -> Option<Tier> {
        self.entries.get(&key).map(|e| e.tier)
    }

    /// The next use recorded for `key`.
    pub fn next_use(&self, key: SampleKey) -> Option<u64> {
        self.entries.get(&key).map(|e| e.next_use)
    }

    /// Bytes placed in a tier.
    pub fn used(&self, tier: Tier) -> u64 {
        self.used[tier.index()]
    }

    /// Capacity of a tier.
    pub fn capacity(&self, tier: Tier) -> u64 {
        self.caps[tier.index()]
    }

    /// Samples placed in a tier.
    pub fn count(&self, tier: Tier) -> usize {
        self.order[tier.index()].len()
    }

    /// Keys whose next use is at or after `from`.
    pub fn keys_needed_after(&self, from: u64) -> Vec<SampleKey> {
        self.order
            .iter()
            .flat_map(|set| set.range((from, 0)..).map(|&(_, k)| k))
            .collect()
    }

    /// Keys whose next use is before `to`.
    pub fn keys_needed_before(&self, to: u64) -> Vec<SampleKey> {
        self.order
            .iter()
            .flat_map(|set| set.range(..(to, 0)).map(|&(_, k)| k))
            .collect()
    }

    /// The sample `key` of `bytes` bytes is in hand and next needed at
    /// position `next_use` (`None`: never again). Decides where it lives and
    /// returns the IO to carry that out, in order: first what makes room
    /// (demotions, drops), then the placement of `key` itself. A sample is only
    /// placed by pushing out samples needed later than it.
    pub fn offer(&mut self, key: SampleKey, bytes: u64, next_use: Option<u64>) -> Vec<CacheAction> {
        let mut actions = Vec::new();
        let old = self.remove(key).map(|e| e.tier);
        let target = next_use.and_then(|next| {
            if self.make_room(Tier::Memory, bytes, next, &mut actions) {
                Some(Tier::Memory)
            } else if self.make_room(Tier::Disk, bytes, next, &mut actions) {
                Some(Tier::Disk)
            } else {
                None
            }
        });
        if let (Some(tier), Some(next)) = (target, next_use) {
            self.insert(key, tier, next, bytes);
        }
        match (old, target) {
            (Some(a), Some(b)) if a == b => {}
            (old, target) => {
                if let Some(t) = target {
                    actions.push(match t {
                        Tier::Memory => CacheAction::PutMemory(key),
                        Tier::Disk => CacheAction::PutDisk(key),
                    });
                }
                if let Some(t) = old {
                    actions.push(drop_action(t, key));
                }
            }
        }
        actions
    }

    /// Changes the next use of a cached sample without moving it; `None`
    /// drops it. Returns the IO for a drop.
    pub fn reprioritize(&mut self, key: SampleKey, next_use: Option<u64>) -> Vec<CacheAction> {
        let Some(entry) = self.remove(key) else {
            return Vec::new();
        };
        match next_use {
            Some(next) => {
                self.insert(key, entry.tier, next, entry.bytes);
                Vec::new()
            }
            None => vec![drop_action(entry.tier, key)],
        }
    }

    /// Puts `key` (already in `tier`) into the plan if it fits without
    /// pushing anything out; no IO. For files found in place at start.
    pub fn place(&mut self, key: SampleKey, tier: Tier, bytes: u64, next_use: u64) -> bool {
        let t = tier.index();
        if self.entries.contains_key(&key) || self.used[t].saturating_add(bytes) > self.caps[t] {
            return false;
        }
        self.insert(key, tier, next_use, bytes);
        true
    }

    /// Forgets `key` (a tier lost it); no IO.
    pub fn forget(&mut self, key: SampleKey) -> Option<Tier> {
        self.remove(key).map(|e| e.tier)
    }

    /// Frees `bytes` in `tier` for a sample needed at `next`, evicting only
    /// samples needed later. Evicted memory samples are demoted to disk when
    /// the disk takes them. Changes nothing when it cannot succeed.
    fn make_room(
        &mut self,
        tier: Tier,
        bytes: u64,
        next: u64,
        actions: &mut Vec<CacheAction>,
    ) -> bool {
        let t = tier.index();
        if bytes > self.caps[t] {
            return false;
        }
        let mut free = self.caps[t] - self.used[t];
        let mut victims = Vec::new();
        for &(use_at, k) in self.order[t].iter().rev() {
            if free >= bytes {
                break;
            }
            if use_at <= next {
                return false;
            }
            free += self.entries.get(&k).map_or(0, |e| e.bytes);
            victims.push(k);
        }
        if free < bytes {
            return false;
        }
        for k in victims {
            let Some(v) = self.remove(k) else { continue };
            if tier == Tier::Memory && self.make_room(Tier::Disk, v.bytes, v.next_use, actions) {
                self.insert(k, Tier::Disk, v.next_use, v.bytes);
                actions.push(CacheAction::Demote(k));
            } else {
                actions.push(drop_action(tier, k));
            }
        }
        true
    }

    fn insert(&mut self, key: SampleKey, tier: Tier, next_use: u64, bytes: u64) {
        let t = tier.index();
        self.used[t] += bytes;
        self.order[t].insert((next_use, key));
        self.entries.insert(
            key,
            Entry {
                tier,
                next_use,
                bytes,
            },
        );
    }

    fn remove(&mut self, key: SampleKey) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        let t = e.tier.index();
        self.used[t] -= e.bytes;
        self.order[t].remove(&(e.next_use, key));
        Some(e)
    }
}

fn drop_action(tier: Tier, key: SampleKey) -> CacheAction {
    match tier {
        Tier::Memory => CacheAction::DropMemory(key),
        Tier::Disk => CacheAction::DropDisk(key),
    }
}

// ---------------------------------------------------------------------------
// Memory tier
// ---------------------------------------------------------------------------

/// The memory tier: a moka cache of sample bytes weighed by their length.
///
/// The plan keeps the placed bytes within the capacity and removes samples
/// itself; moka's own bound (the capacity plus an eighth) is a safety net.
#[derive(Clone)]
pub struct MemoryTier {
    cache: Cache<SampleKey, Bytes>,
}

impl MemoryTier {
    pub fn new(capacity_bytes: u64) -> Self {
        let cache = Cache::builder()
            .max_capacity(capacity_bytes.saturating_add(capacity_bytes / 8))
            .weigher(|_: &SampleKey, v: &Bytes| u32::try_from(v.len()).unwrap_or(u32::MAX))
            .eviction_policy(EvictionPolicy::lru())
            .build();
        Self { cache }
    }

    pub async fn get(&self, key: SampleKey) -> Option<Bytes> {
        self.cache.get(&key).await
    }

    pub async fn insert(&self, key: SampleKey, bytes: Bytes) {
        self.cache.insert(key, bytes).await;
    }

    pub async fn remove(&self, key: SampleKey) {
        self.cache.invalidate(&key).await;
    }

    /// Bytes held (after pending maintenance).
    pub async fn weighted_size(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.weighted_size()
    }
}

// ---------------------------------------------------------------------------
// Disk tier
// ---------------------------------------------------------------------------

/// Magic at the start of every cache file (older builds wrote `STRC` files
/// with an FNV-1a sum; they are not read).
const FILE_MAGIC: &[u8; 4] = b"STC2";
/// Magic, payload length (u64 LE), CRC-32 of the payload (u32 LE).
const FILE_HEADER: usize = 4 + 8 + 4;
/// Worker threads of the disk tier; a sample always goes to the same one, so
/// the operations on one file happen in the order they were asked for.
const DISK_LANES: usize = 2;
/// The index of the files in the tier's directory.
pub const INDEX_NAME: &str = "index.json";
/// Version of the [`INDEX_NAME`] format.
const INDEX_VERSION: u32 = 1;
/// Longest time the index on disk lags behind the files: lane 0 saves it
/// this often while files are being written or removed (and at every clean
/// stop). Files a crash leaves unlisted are checked and kept on open anyway
/// (see [`load_index`]), so this only bounds how many files that check reads.
const INDEX_SAVE_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

/// Which dataset the files of a disk tier hold samples of. A tier whose
/// index names another dataset (another place, or a manifest that changed
/// since) is emptied when it opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetIdentity {
    /// Where the dataset is read from: the store and the prefix.
    pub location: String,
    /// CRC-32 of the manifest's bytes, as read from the bucket.
    pub manifest_crc32: u32,
    /// Length of the manifest in bytes.
    pub manifest_bytes: u64,
}

/// What [`INDEX_NAME`] holds.
#[derive(Debug, Serialize, Deserialize)]
struct DiskIndex {
    version: u32,
    dataset: DatasetIdentity,
    /// `(key, payload bytes, CRC-32 of the payload)` of every file.
    files: Vec<(SampleKey, u64, u32)>,
}

/// Length and CRC-32 of a file's payload.
type FileEntries = BTreeMap<SampleKey, (u64, u32)>;

enum DiskOp {
    Write(SampleKey, Bytes),
    Read(SampleKey, oneshot::Sender<Result<Bytes, CacheError>>),
    Delete(SampleKey),
    /// Write the index as the files are now.
    SaveIndex,
}

/// What the lanes share.
struct DiskShared {
    dir: PathBuf,
    dataset: DatasetIdentity,
    /// The files in place, as the lanes wrote and removed them.
    files: Mutex<FileEntries>,
    failed: Mutex<Vec<SampleKey>>,
    /// Operations queued and not finished yet.
    pending: watch::Sender<usize>,
    /// Files were written or removed since the index was last saved.
    dirty: std::sync::atomic::AtomicBool,
    /// How often lane 0 saves a dirty index ([`INDEX_SAVE_PERIOD`]).
    save_period: std::time::Duration,
}

impl DiskShared {
    fn files(&self) -> std::sync::MutexGuard<'_, FileEntries> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the index under a temporary name and renames it into place,
    /// so that a crash leaves the old index or the new one, never half of
    /// one.
    fn save_index(&self) -> Result<(), CacheError> {
        self.dirty.store(false, std::sync::atomic::Ordering::SeqCst);
        let index = DiskIndex {
            version: INDEX_VERSION,
            dataset: self.dataset.clone(),
            files: self
                .files()
                .iter()
                .map(|(&k, &(len, sum))| (k, len, sum))
                .collect(),
        };
        let path = self.dir.join(INDEX_NAME);
        let tmp = self.dir.join(format!("{INDEX_NAME}.tmp"));
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CacheError::Io { path, source }
        };
        let json = serde_json::to_vec(&index).map_err(|e| CacheError::Damaged {
            path: path.clone(),
            message: format!("cannot encode the index: {e}"),
        })?;
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(&json).map_err(io(&tmp))?;
        file.sync_data().map_err(io(&tmp))?;
        drop(file);
        std::fs::rename(&tmp, &path).map_err(io(&path))
    }
}

/// The disk tier: one file per sample in a directory of its own, kept
/// across restarts.
///
/// Writes go to `<key>.<lane>-<n>.tmp` and are renamed to `<key>.rec`, so a
/// reader never sees half a file; every file carries its length and the
/// CRC-32 of its bytes, and a file that fails either, or whose checksum is
/// not the one the index recorded, is reported as damaged (the loader then
/// drops it and fetches the sample again). File IO runs on [`DISK_LANES`]
/// threads.
///
/// [`INDEX_NAME`] lists the files (key, length, checksum) and the dataset
/// they belong to. It is saved atomically (temporary file and rename) every
/// [`INDEX_SAVE_PERIOD`] while files change, when asked to
/// ([`DiskTier::save_index`]) and when the tier is dropped. On open, when it
/// names the same dataset, the files it lists are kept if their size is
/// right, and so are the files written after its last save (a crash) whose
/// header and checksum check out (see [`DiskTier::restored`]); everything
/// else the tier wrote (files of another dataset, damaged files, temporary
/// files) is removed. So a crash loses only the writes under way.
pub struct DiskTier {
    shared: Arc<DiskShared>,
    lanes: Vec<mpsc::Sender<DiskOp>>,
    threads: Vec<JoinHandle<()>>,
    /// Files found in place on open: key and payload length.
    restored: Vec<(SampleKey, u64)>,
}

impl DiskTier {
    /// Opens the tier in `dir` (created if needed) for samples of `dataset`:
    /// keeps the files its index lists for the same dataset, removes the
    /// other cache files, and starts the IO threads.
    pub fn open(dir: &Path, dataset: &DatasetIdentity) -> Result<Self, CacheError> {
        Self::open_saving_every(dir, dataset, INDEX_SAVE_PERIOD)
    }

    /// [`DiskTier::open`] with the index saved every `save_period` while
    /// files change.
    fn open_saving_every(
        dir: &Path,
        dataset: &DatasetIdentity,
        save_period: std::time::Duration,
    ) -> Result<Self, CacheError> {
        let io = |source| CacheError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let files = load_index(dir, dataset);
        remove_cache_files(dir, &files).map_err(io)?;
        let restored = files.iter().map(|(&k, &(len, _))| (k, len)).collect();
        let shared = Arc::new(DiskShared {
            dir: dir.to_path_buf(),
            dataset: dataset.clone(),
            files: Mutex::new(files),
            failed: Mutex::new(Vec::new()),
            pending: watch::Sender::new(0usize),
            dirty: Default::default(),
            save_period,
        });
        // The index on disk now says what is really there.
        shared.save_index()?;
        let mut lanes = Vec::new();
        let mut threads = Vec::new();
        for lane in 0..DISK_LANES {
            let (tx, rx) = mpsc::channel();
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("disk-cache-{lane}"))
                .spawn(move || disk_lane(lane, &shared, &rx))
                .map_err(io)?;
            lanes.push(tx);
            threads.push(handle);
        }
        Ok(Self {
            shared,
            lanes,
            threads,
            restored,
        })
    }

    /// The files kept from an earlier run when the tier opened: key and
    /// payload bytes, in key order. They are in place but in no plan yet.
    pub fn restored(&self) -> &[(SampleKey, u64)] {
        &self.restored
    }

    /// The number of queued operations not finished yet, to wait on (it
    /// changes as they are queued and as they finish).
    pub fn pending_ops(&self) -> watch::Receiver<usize> {
        self.shared.pending.subscribe()
    }

    /// Queue `op` on lane `lane`; the count of pending operations covers it
    /// until the lane is done with it. Gives the operation back when the
    /// lane is gone.
    fn queue_on(&self, lane: usize, op: DiskOp) -> Result<(), DiskOp> {
        let Some(lane) = self.lanes.get(lane) else {
            return Err(op);
        };
        self.shared.pending.send_modify(|n| *n += 1);
        lane.send(op).map_err(|mpsc::SendError(op)| {
            self.shared.pending.send_modify(|n| *n -= 1);
            op
        })
    }

    fn queue(&self, key: SampleKey, op: DiskOp) -> Result<(), DiskOp> {
        self.queue_on((key % self.lanes.len().max(1) as u64) as usize, op)
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Path of the file of `key`.
    pub fn file_of(&self, key: SampleKey) -> PathBuf {
        record_path(&self.shared.dir, key)
    }

    /// Queues a write; a failure shows up in [`DiskTier::take_failed`].
    pub fn write(&self, key: SampleKey, bytes: Bytes) {
        if self.queue(key, DiskOp::Write(key, bytes)).is_err() {
            self.note_failed(key);
        }
    }

    /// Queues a save of the index (after the operations queued before it
    /// on the same lane).
    pub fn save_index(&self) {
        let _ = self.queue_on(0, DiskOp::SaveIndex);
    }

    /// Queues a read; the answer arrives on the returned channel.
    pub fn read(&self, key: SampleKey) -> oneshot::Receiver<Result<Bytes, CacheError>> {
        let (tx, rx) = oneshot::channel();
        if let Err(DiskOp::Read(_, tx)) = self.queue(key, DiskOp::Read(key, tx)) {
            let _ = tx.send(Err(CacheError::Closed));
        }
        rx
    }

    /// Queues a delete (a missing file is fine).
    pub fn delete(&self, key: SampleKey) {
        let _ = self.queue(key, DiskOp::Delete(key));
    }

    /// Keys whose writes failed since the last call.
    pub fn take_failed(&self) -> Vec<SampleKey> {
        let mut g = self.shared.failed.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *g)
    }

    fn note_failed(&self, key: SampleKey) {
        let mut g = self.shared.failed.lock().unwrap_or_else(|p| p.into_inner());
        g.push(key);
    }
}

impl Drop for DiskTier {
    /// Finishes the queued IO and saves the index; the files stay for the
    /// next run.
    fn drop(&mut self) {
        self.lanes.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Err(e) = self.shared.save_index() {
            tracing::warn!("disk cache index not saved (the files will not be reused): {e}");
        }
    }
}

/// The files of `dir`'s index that can be reused for `dataset`: none when
/// there is no index, it does not parse, or it names another dataset;
/// otherwise those whose file is in place with the right size, and the
/// files the index does not list (written after its last save, before a
/// crash) whose header and checksum check out. Every open removes the files
/// it does not keep and saves an index for its dataset, so an unlisted file
/// under an index of the same dataset was written for that dataset.
fn load_index(dir: &Path, dataset: &DatasetIdentity) -> FileEntries {
    let path = dir.join(INDEX_NAME);
    let index: DiskIndex = match std::fs::read(&path) {
        Ok(raw) => match serde_json::from_slice(&raw) {
            Ok(index) => index,
            Err(e) => {
                tracing::warn!(
                    "disk cache: {} is unreadable ({e}); starting empty",
                    path.display()
                );
                return FileEntries::new();
            }
        },
        Err(_) => return FileEntries::new(),
    };
    if index.version != INDEX_VERSION || &index.dataset != dataset {
        tracing::info!(
            dir = %dir.display(),
            "disk cache: the files are of another dataset (or manifest); starting empty"
        );
        return FileEntries::new();
    }
    let listed: BTreeSet<SampleKey> = index.files.iter().map(|&(key, _, _)| key).collect();
    let mut files: FileEntries = index
        .files
        .into_iter()
        .filter(|&(key, len, _)| {
            std::fs::metadata(record_path(dir, key))
                .is_ok_and(|m| m.is_file() && m.len() == FILE_HEADER as u64 + len)
        })
        .map(|(key, len, sum)| (key, (len, sum)))
        .collect();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return files;
    };
    let mut recovered = 0usize;
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(key) = record_key(dir, &path) else {
            continue;
        };
        if listed.contains(&key) {
            continue;
        }
        if let Ok(bytes) = read_file(&path, None) {
            files.insert(key, (bytes.len() as u64, ps_dataset::crc32(&bytes)));
            recovered += 1;
        }
    }
    if recovered > 0 {
        tracing::info!(
            dir = %dir.display(),
            recovered,
            "disk cache: kept the checked files written after the index was last saved"
        );
    }
    files
}

/// The key of a cache file `path` of `dir` (`<key>.rec`), if it is one.
fn record_key(dir: &Path, path: &Path) -> Option<SampleKey> {
    if path.extension().and_then(|e| e.to_str()) != Some("rec") {
        return None;
    }
    let key = path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| SampleKey::from_str_radix(s, 16).ok())?;
    (path == record_path(dir, key)).then_some(key)
}

/// Removes the files this tier writes (`*.rec`, `*.tmp`) from `dir`, except
/// the files of `keep`.
fn remove_cache_files(dir: &Path, keep: &FileEntries) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let kept = record_key(dir, &path).is_some_and(|k| keep.contains_key(&k));
        if (ext == "rec" && !kept) || ext == "tmp" {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

fn record_path(dir: &Path, key: SampleKey) -> PathBuf {
    dir.join(format!("{key:016x}.rec"))
}

/// One IO thread. Lane 0 also saves the index every `save_period` while it
/// is dirty (files written or removed since the last save), so a crash
/// leaves an index at most that far behind.
fn disk_lane(lane: usize, shared: &DiskShared, rx: &mpsc::Receiver<DiskOp>) {
    use std::sync::atomic::Ordering::SeqCst;
    let mut seq = 0u64;
    let mut last_save = std::time::Instant::now();
    loop {
        let op = if lane == 0 {
            match rx.recv_timeout(shared.save_period.max(std::time::Duration::from_millis(1))) {
                Ok(op) => Some(op),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(op) => Some(op),
                Err(_) => break,
            }
        };
        let had_op = op.is_some();
        if let Some(op) = op {
            if matches!(op, DiskOp::SaveIndex) {
                last_save = std::time::Instant::now();
            }
            disk_op(lane, shared, op, &mut seq);
        }
        // A periodic save first, then the operation counts as done: a
        // caller waiting for no pending operations sees the index saved.
        if lane == 0 && shared.dirty.load(SeqCst) && last_save.elapsed() >= shared.save_period {
            last_save = std::time::Instant::now();
            if let Err(e) = shared.save_index() {
                tracing::warn!("{e}");
            }
        }
        if had_op {
            shared.pending.send_modify(|n| *n = n.saturating_sub(1));
        }
    }
}

fn disk_op(lane: usize, shared: &DiskShared, op: DiskOp, seq: &mut u64) {
    let dir = &shared.dir;
    match op {
        DiskOp::Write(key, bytes) => {
            *seq += 1;
            let tmp = dir.join(format!("{key:016x}.{lane}-{seq}.tmp"));
            let sum = ps_dataset::crc32(&bytes);
            match write_file(&tmp, &record_path(dir, key), &bytes, sum) {
                Ok(()) => {
                    shared.files().insert(key, (bytes.len() as u64, sum));
                    shared
                        .dirty
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                }
                Err(e) => {
                    tracing::warn!("disk cache write of sample {key} failed: {e}");
                    let _ = std::fs::remove_file(&tmp);
                    shared.files().remove(&key);
                    let mut g = shared.failed.lock().unwrap_or_else(|p| p.into_inner());
                    g.push(key);
                }
            }
        }
        DiskOp::Read(key, reply) => {
            let expected = shared.files().get(&key).map(|&(_, sum)| sum);
            let _ = reply.send(read_file(&record_path(dir, key), expected));
        }
        DiskOp::Delete(key) => {
            // Out of the index first: an index saved meanwhile may name a
            // file that is gone (skipped on open), never the reverse.
            shared.files().remove(&key);
            shared
                .dirty
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let path = record_path(dir, key);
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("disk cache: cannot remove {}: {e}", path.display());
                }
            }
        }
        DiskOp::SaveIndex => {
            if let Err(e) = shared.save_index() {
                tracing::warn!("{e}");
            }
        }
    }
}

fn write_file(tmp: &Path, dest: &Path, payload: &[u8], sum: u32) -> Result<(), CacheError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CacheError::Io { path, source }
    };
    let mut file = std::fs::File::create(tmp).map_err(io(tmp))?;
    let mut header = [0u8; FILE_HEADER];
    header[..4].copy_from_slice(FILE_MAGIC);
    header[4..12].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    header[12..16].copy_from_slice(&sum.to_le_bytes());
    file.write_all(&header).map_err(io(tmp))?;
    file.write_all(payload).map_err(io(tmp))?;
    drop(file);
    std::fs::rename(tmp, dest).map_err(io(dest))
}

/// Reads a cache file and checks its length and checksum, and that the
/// checksum is `expected` (what the index recorded) when there is one.
fn read_file(path: &Path, expected: Option<u32>) -> Result<Bytes, CacheError> {
    let data = std::fs::read(path).map_err(|source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let damaged = |message: String| CacheError::Damaged {
        path: path.to_path_buf(),
        message,
    };
    if data.len() < FILE_HEADER || &data[..4] != FILE_MAGIC {
        return Err(damaged("no cache header".into()));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&data[4..12]);
    let mut sum = [0u8; 4];
    sum.copy_from_slice(&data[12..16]);
    let (len, sum) = (u64::from_le_bytes(len), u32::from_le_bytes(sum));
    let payload = &data[FILE_HEADER..];
    if payload.len() as u64 != len {
        return Err(damaged("length does not match the header".into()));
    }
    let actual = ps_dataset::crc32(payload);
    if actual != sum {
        return Err(damaged(format!(
            "checksum mismatch (CRC-32 {actual:08x}, the header says {sum:08x})"
        )));
    }
    if let Some(want) = expected.filter(|&w| w != sum) {
        return Err(damaged(format!(
            "checksum {sum:08x} is not the {want:08x} the cache index recorded"
        )));
    }
    let mut data = Bytes::from(data);
    Ok(data.split_off(FILE_HEADER))
}

// ---------------------------------------------------------------------------
// Both tiers together
// ---------------------------------------------------------------------------

/// Where a lookup found a sample.
pub enum Lookup {
    Memory(Bytes),
    /// On disk: the read is under way.
    Disk(oneshot::Receiver<Result<Bytes, CacheError>>),
    Miss,
}

/// What the tiers did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Samples the plan placed in memory but moka no longer had.
    pub memory_lost: u64,
    /// Disk writes queued (placements and demotions).
    pub disk_writes: u64,
    /// Disk writes that failed.
    pub disk_write_failures: u64,
    /// Samples moved from memory to disk.
    pub demotions: u64,
    /// Disk files of an earlier run reused at start.
    pub restored: u64,
}

/// The memory and disk tiers driven by one [`TierPlan`]. Owned by one task.
pub struct TieredCache {
    plan: TierPlan,
    memory: Option<MemoryTier>,
    disk: Option<DiskTier>,
    stats: CacheStats,
}

impl TieredCache {
    /// `memory_bytes` of memory (0: no memory tier) and optionally a disk
    /// tier in a directory with its byte cap, for samples of `dataset`.
    /// Files an earlier run left in the directory are in place but not used
    /// until [`TieredCache::restore`] takes them into the plan.
    pub fn new(
        memory_bytes: u64,
        disk: Option<(PathBuf, u64)>,
        dataset: &DatasetIdentity,
    ) -> Result<Self, CacheError> {
        let memory = (memory_bytes > 0).then(|| MemoryTier::new(memory_bytes));
        let (disk, disk_bytes) = match disk {
            Some((dir, cap)) if cap > 0 => (Some(DiskTier::open(&dir, dataset)?), cap),
            _ => (None, 0),
        };
        Ok(Self {
            plan: TierPlan::new(memory_bytes, disk_bytes),
            memory,
            disk,
            stats: CacheStats::default(),
        })
    }

    /// No tiers at all.
    pub fn disabled() -> Self {
        Self {
            plan: TierPlan::new(0, 0),
            memory: None,
            disk: None,
            stats: CacheStats::default(),
        }
    }

    pub fn plan(&self) -> &TierPlan {
        &self.plan
    }

    /// Takes the disk files kept from an earlier run into the plan, each
    /// with its next use (`None`: not needed by this run), soonest first
    /// while they fit the disk tier's capacity; the others are deleted.
    /// Returns how many were kept. Every kept file is still checked against
    /// its checksum when it is read.
    pub fn restore(&mut self, mut next_use: impl FnMut(SampleKey) -> Option<u64>) -> usize {
        let Some(disk) = &self.disk else { return 0 };
        let mut found: Vec<(Option<u64>, SampleKey, u64)> = disk
            .restored()
            .iter()
            .map(|&(key, bytes)| (next_use(key), key, bytes))
            .collect();
        // Needed soonest first, not needed at all last.
        found.sort_unstable_by_key(|&(next, key, _)| (next.is_none(), next, key));
        let mut kept = 0;
        for (next, key, bytes) in found {
            match next {
                Some(next) if self.plan.place(key, Tier::Disk, bytes, next) => kept += 1,
                _ => disk.delete(key),
            }
        }
        self.stats.restored += kept as u64;
        disk.save_index();
        kept
    }

    /// Saves the disk tier's index now (it is also saved every
    /// [`INDEX_SAVE_PERIOD`] while files change, and when the cache is
    /// dropped).
    pub fn save_index(&self) {
        if let Some(disk) = &self.disk {
            disk.save_index();
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    pub fn memory(&self) -> Option<&MemoryTier> {
        self.memory.as_ref()
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// Looks `key` up: memory bytes, a disk read under way, or a miss.
    pub async fn lookup(&mut self, key: SampleKey) -> Lookup {
        self.reap_failed_writes().await;
        match self.plan.tier_of(key) {
            Some(Tier::Memory) => {
                if let Some(mem) = &self.memory {
                    if let Some(bytes) = mem.get(key).await {
                        return Lookup::Memory(bytes);
                    }
                }
                self.plan.forget(key);
                self.stats.memory_lost += 1;
                Lookup::Miss
            }
            Some(Tier::Disk) => match &self.disk {
                Some(disk) => Lookup::Disk(disk.read(key)),
                None => {
                    self.plan.forget(key);
                    Lookup::Miss
                }
            },
            None => Lookup::Miss,
        }
    }

    /// `key`'s bytes are in hand and next needed at `next_use` (`None`:
    /// never): place, keep, move or drop it as the plan decides.
    pub async fn offer(&mut self, key: SampleKey, bytes: &Bytes, next_use: Option<u64>) {
        let actions = self.plan.offer(key, bytes.len() as u64, next_use);
        self.execute(bytes, actions).await;
    }

    /// Changes the next use of a cached sample (no move); `None` drops it.
    pub async fn reprioritize(&mut self, key: SampleKey, next_use: Option<u64>) {
        let actions = self.plan.reprioritize(key, next_use);
        self.execute(&Bytes::new(), actions).await;
    }

    /// Drops `key` from wherever it is (after a failed read).
    pub async fn forget(&mut self, key: SampleKey) {
        match self.plan.forget(key) {
            Some(Tier::Memory) => {
                if let Some(mem) = &self.memory {
                    mem.remove(key).await;
                }
            }
            Some(Tier::Disk) => {
                if let Some(disk) = &self.disk {
                    disk.delete(key);
                }
            }
            None => {}
        }
    }

    async fn execute(&mut self, in_hand: &Bytes, actions: Vec<CacheAction>) {
        for action in actions {
            match action {
                CacheAction::PutMemory(k) => match &self.memory {
                    Some(mem) => mem.insert(k, in_hand.clone()).await,
                    None => {
                        self.plan.forget(k);
                    }
                },
                CacheAction::PutDisk(k) => match &self.disk {
                    Some(disk) => {
                        disk.write(k, in_hand.clone());
                        self.stats.disk_writes += 1;
                    }
                    None => {
                        self.plan.forget(k);
                    }
                },
                CacheAction::Demote(k) => {
                    let bytes = match &self.memory {
                        Some(mem) => {
                            let b = mem.get(k).await;
                            mem.remove(k).await;
                            b
                        }
                        None => None,
                    };
                    match (bytes, &self.disk) {
                        (Some(b), Some(disk)) => {
                            disk.write(k, b);
                            self.stats.disk_writes += 1;
                            self.stats.demotions += 1;
                        }
                        _ => {
                            self.plan.forget(k);
                            self.stats.memory_lost += 1;
                        }
                    }
                }
                CacheAction::DropMemory(k) => {
                    if let Some(mem) = &self.memory {
                        mem.remove(k).await;
                    }
                }
                CacheAction::DropDisk(k) => {
                    if let Some(disk) = &self.disk {
                        disk.delete(k);
                    }
                }
            }
        }
    }

    /// Forgets samples whose disk writes failed (and removes any leftovers).
    async fn reap_failed_writes(&mut self) {
        let Some(disk) = &self.disk else { return };
        let failed = disk.take_failed();
        for key in failed {
            self.stats.disk_write_failures += 1;
            if self.plan.tier_of(key) == Some(Tier::Disk) {
                self.plan.forget(key);
                if let Some(disk) = &self.disk {
                    disk.delete(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Invariants of a plan: used bytes match the entries and stay within caps.
    fn check(plan: &TierPlan) {
        for tier in [Tier::Memory, Tier::Disk] {
            let t = tier.index();
            let sum: u64 = plan.order[t]
                .iter()
                .map(|(_, k)| plan.entries[k].bytes)
                .sum();
            assert_eq!(sum, plan.used[t]);
            assert!(plan.used[t] <= plan.caps[t]);
        }
        assert_eq!(
            plan.entries.len(),
            plan.order[0].len() + plan.order[1].len()
        );
    }

    #[test]
    fn keeps_the_samples_needed_soonest() {
        let mut plan = TierPlan::new(30, 20);
        for (k, next) in [(1, 50), (2, 10), (3, 40), (4, 20), (5, 30), (6, 60), (7, 5)] {
            plan.offer(k, 10, Some(next));
            check(&plan);
        }
        // Soonest three in memory, next two on disk, the rest dropped.
        let mut mem: Vec<_> = plan.order[0].iter().map(|&(_, k)| k).collect();
        mem.sort_unstable();
        assert_eq!(mem, vec![2, 4, 7]);
        let mut disk: Vec<_> = plan.order[1].iter().map(|&(_, k)| k).collect();
        disk.sort_unstable();
        assert_eq!(disk, vec![3, 5]);
        assert_eq!(plan.tier_of(1), None);
        assert_eq!(plan.tier_of(6), None);
    }

    #[test]
    fn reuse_moves_and_drops() {
        let mut plan = TierPlan::new(10, 10);
        assert_eq!(plan.offer(1, 10, Some(5)), vec![CacheAction::PutMemory(1)]);
        // Used at 5, next needed at 100: it stays in memory (nothing sooner).
        assert!(plan.offer(1, 10, Some(100)).is_empty());
        // A sooner sample pushes it to disk.
        assert_eq!(
            plan.offer(2, 10, Some(20)),
            vec![CacheAction::Demote(1), CacheAction::PutMemory(2)]
        );
        // Read back from disk for use at 100, next at 300: memory is taken
        // by a sooner sample, so it stays on disk without IO.
        assert!(plan.offer(1, 10, Some(300)).is_empty());
        assert_eq!(plan.tier_of(1), Some(Tier::Disk));
        // Sample 2 used, never needed again: dropped; then 1 can go to memory.
        assert_eq!(plan.offer(2, 10, None), vec![CacheAction::DropMemory(2)]);
        assert_eq!(
            plan.offer(1, 10, Some(400)),
            vec![CacheAction::PutMemory(1), CacheAction::DropDisk(1)]
        );
        check(&plan);
        assert_eq!(plan.reprioritize(1, None), vec![CacheAction::DropMemory(1)]);
        assert_eq!(plan.count(Tier::Memory) + plan.count(Tier::Disk), 0);
    }

    #[test]
    fn tiny_and_zero_capacities_never_place() {
        let mut plan = TierPlan::new(5, 0);
        assert!(plan.offer(1, 10, Some(1)).is_empty());
        assert_eq!(plan.tier_of(1), None);
        let mut none = TierPlan::new(0, 0);
        for k in 0..100 {
            assert!(none.offer(k, 1, Some(k)).is_empty());
        }
        check(&none);
    }

    #[test]
    fn mixed_sizes_stay_within_caps() {
        let mut plan = TierPlan::new(1000, 700);
        let mut x: u64 = 17;
        for step in 0..5000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 33) % 200;
            let bytes = 1 + (x >> 20) % 300;
            let next = if x % 7 == 3 {
                None
            } else {
                Some(step + (x >> 40) % 1000)
            };
            plan.offer(key, bytes, next);
            check(&plan);
        }
        let far = plan.keys_needed_after(5500);
        assert!(far
            .iter()
            .all(|k| plan.next_use(*k).is_some_and(|n| n >= 5500)));
    }

    fn dataset(name: &str) -> DatasetIdentity {
        DatasetIdentity {
            location: format!("memory {name}"),
            manifest_crc32: 0x1234_5678,
            manifest_bytes: 321,
        }
    }

    fn files_with(dir: &Path, ext: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .collect();
        out.sort();
        out
    }

    #[tokio::test]
    async fn disk_tier_round_trip_and_damage() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tier");
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join("stale.rec"), b"old").unwrap();
        std::fs::write(sub.join("keep.txt"), b"not ours").unwrap();
        let disk = DiskTier::open(&sub, &dataset("a")).unwrap();
        assert!(!sub.join("stale.rec").exists());
        assert!(sub.join("keep.txt").exists());
        assert!(disk.restored().is_empty());
        disk.write(7, Bytes::from_static(b"hello sample"));
        assert_eq!(&disk.read(7).await.unwrap().unwrap()[..], b"hello sample");
        // Damage the file: the read reports it.
        let path = disk.file_of(7);
        let mut raw = std::fs::read(&path).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 0xff;
        std::fs::write(&path, &raw).unwrap();
        let err = disk.read(7).await.unwrap().unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        std::fs::write(&path, b"xx").unwrap();
        assert!(matches!(
            disk.read(7).await.unwrap(),
            Err(CacheError::Damaged { .. })
        ));
        disk.delete(7);
        assert!(matches!(
            disk.read(7).await.unwrap(),
            Err(CacheError::Io { .. })
        ));
        // No temporary files are left behind.
        assert!(files_with(&sub, "tmp").is_empty());
        assert!(disk.take_failed().is_empty());
        disk.write(8, Bytes::from_static(b"x"));
        drop(disk);
        // The files stay, with their index, for the next run.
        assert!(sub.join("keep.txt").exists());
        assert_eq!(files_with(&sub, "rec"), vec![record_path(&sub, 8)]);
        assert!(sub.join(INDEX_NAME).exists());
    }

    #[tokio::test]
    async fn disk_tier_reuses_verified_files_of_the_same_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tier");
        let disk = DiskTier::open(&sub, &dataset("a")).unwrap();
        for k in 1..=5u64 {
            disk.write(k, Bytes::from(vec![k as u8; 10 + k as usize]));
        }
        drop(disk);
        // A crash leaves files the index does not list, and temporary files.
        std::fs::write(record_path(&sub, 0xaa), b"written after the last save").unwrap();
        std::fs::write(sub.join("00000000000000ab.0-9.tmp"), b"half").unwrap();
        std::fs::write(sub.join(format!("{INDEX_NAME}.tmp")), b"{half an ind").unwrap();
        // File 5 was cut short since.
        std::fs::write(record_path(&sub, 5), b"STC2").unwrap();

        let disk = DiskTier::open(&sub, &dataset("a")).unwrap();
        assert_eq!(disk.restored(), &[(1, 11), (2, 12), (3, 13), (4, 14)]);
        assert!(files_with(&sub, "tmp").is_empty());
        assert_eq!(
            files_with(&sub, "rec").len(),
            4,
            "unlisted and cut files go"
        );
        for k in [1u64, 2] {
            let got = disk.read(k).await.unwrap().unwrap();
            assert_eq!(got, Bytes::from(vec![k as u8; 10 + k as usize]));
        }
        // A damaged file is found out when it is read.
        let path = disk.file_of(3);
        let mut raw = std::fs::read(&path).unwrap();
        raw[FILE_HEADER] ^= 1;
        std::fs::write(&path, &raw).unwrap();
        let err = disk.read(3).await.unwrap().unwrap_err();
        assert!(err.to_string().contains("checksum mismatch"), "{err}");
        // So is a well-formed file of other bytes than the index recorded.
        let other = std::fs::read(disk.file_of(1)).unwrap();
        std::fs::write(disk.file_of(4), {
            let mut f = other.clone();
            f.extend_from_slice(&[1, 1, 1]);
            let payload = f[FILE_HEADER..].to_vec();
            f[4..12].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            f[12..16].copy_from_slice(&ps_dataset::crc32(&payload).to_le_bytes());
            f
        })
        .unwrap();
        let err = disk.read(4).await.unwrap().unwrap_err();
        assert!(
            err.to_string().contains("the cache index recorded"),
            "{err}"
        );
        drop(disk);

        // Another dataset (or a rewritten manifest) reuses nothing.
        let mut changed = dataset("a");
        changed.manifest_crc32 ^= 1;
        let disk = DiskTier::open(&sub, &changed).unwrap();
        assert!(disk.restored().is_empty());
        assert!(files_with(&sub, "rec").is_empty());
        drop(disk);
        // An unreadable index is the same as none.
        std::fs::write(sub.join(INDEX_NAME), b"[not an index").unwrap();
        std::fs::write(record_path(&sub, 1), b"orphan").unwrap();
        let disk = DiskTier::open(&sub, &changed).unwrap();
        assert!(disk.restored().is_empty());
        assert!(files_with(&sub, "rec").is_empty());
    }

    /// Waits until the tier has done every operation queued.
    async fn idle(disk: &DiskTier) {
        let mut ops = disk.pending_ops();
        ops.wait_for(|n| *n == 0).await.unwrap();
    }

    /// Copies the tier's directory as it is now: what a crash (power cut,
    /// SIGKILL) at this instant would leave, without the tier's clean path.
    fn crash_copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }

    #[tokio::test]
    async fn a_crash_loses_no_written_file_and_a_clean_stop_none() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tier");
        let n = 2215u64;
        let payload = |k: u64| Bytes::from(vec![(k % 251) as u8; 8 + (k % 5) as usize]);
        // Saving only at open and at a clean stop (as if the period had not
        // come round yet): everything else rests on the files themselves.
        let disk =
            DiskTier::open_saving_every(&sub, &dataset("a"), Duration::from_secs(3600)).unwrap();
        for k in 0..n {
            disk.write(k, payload(k));
        }
        idle(&disk).await;
        let crashed = dir.path().join("crashed");
        crash_copy(&sub, &crashed);
        // The index on disk lists nothing yet; a file cut short by the crash
        // and a temporary file are there too.
        std::fs::write(record_path(&crashed, n), b"STC2 half").unwrap();
        std::fs::write(crashed.join("0000000000000999.1-7.tmp"), b"half").unwrap();
        let after_crash = DiskTier::open(&crashed, &dataset("a")).unwrap();
        assert_eq!(after_crash.restored().len() as u64, n, "kept after a crash");
        for k in [0, 1, 1000, n - 1] {
            assert_eq!(after_crash.read(k).await.unwrap().unwrap(), payload(k));
        }
        assert_eq!(files_with(&crashed, "rec").len() as u64, n);
        assert!(files_with(&crashed, "tmp").is_empty());
        drop(after_crash);

        // A clean stop: queued writes are finished and the index saved.
        for k in n..n + 1804 {
            disk.write(k, payload(k));
        }
        drop(disk);
        let index: DiskIndex =
            serde_json::from_slice(&std::fs::read(sub.join(INDEX_NAME)).unwrap()).unwrap();
        assert_eq!(
            index.files.len() as u64,
            n + 1804,
            "listed after a clean stop"
        );
        let reopened = DiskTier::open(&sub, &dataset("a")).unwrap();
        assert_eq!(reopened.restored().len() as u64, n + 1804);
    }

    #[tokio::test]
    async fn the_index_is_saved_while_files_change() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tier");
        // A zero period: lane 0 saves after every operation it sees while
        // the index is dirty, before that operation counts as done.
        let disk = DiskTier::open_saving_every(&sub, &dataset("a"), Duration::ZERO).unwrap();
        for k in 0..40u64 {
            disk.write(k, Bytes::from(vec![1u8; 16]));
        }
        disk.delete(3);
        // A last operation on lane 0 after the others are done, so its
        // save sees them all.
        idle(&disk).await;
        disk.read(0).await.unwrap().unwrap();
        idle(&disk).await;
        let index: DiskIndex =
            serde_json::from_slice(&std::fs::read(sub.join(INDEX_NAME)).unwrap()).unwrap();
        assert_eq!(index.files.len(), 39, "the index follows the files");
        assert!(!index.files.iter().any(|f| f.0 == 3));
    }

    #[tokio::test]
    async fn restore_keeps_the_samples_needed_soonest_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("c");
        let disk = DiskTier::open(&sub, &dataset("a")).unwrap();
        for k in 1..=4u64 {
            disk.write(k, Bytes::from(vec![k as u8; 10]));
        }
        drop(disk);
        // Room for two of the four: 3 and 4 are needed soonest, 2 never.
        let mut cache = TieredCache::new(0, Some((sub.clone(), 25)), &dataset("a")).unwrap();
        let kept = cache.restore(|k| match k {
            1 => Some(50),
            3 => Some(10),
            4 => Some(20),
            _ => None,
        });
        assert_eq!(kept, 2);
        assert_eq!(cache.stats().restored, 2);
        assert_eq!(cache.plan().used(Tier::Disk), 20);
        assert_eq!(cache.plan().next_use(3), Some(10));
        let Lookup::Disk(rx) = cache.lookup(3).await else {
            panic!("3 should be on disk")
        };
        assert_eq!(rx.await.unwrap().unwrap(), Bytes::from(vec![3u8; 10]));
        assert!(matches!(cache.lookup(1).await, Lookup::Miss));
        drop(cache);
        assert_eq!(
            files_with(&sub, "rec"),
            vec![record_path(&sub, 3), record_path(&sub, 4)],
            "the files beyond the cap were deleted"
        );
        let disk = DiskTier::open(&sub, &dataset("a")).unwrap();
        assert_eq!(disk.restored(), &[(3, 10), (4, 10)]);
    }

    #[tokio::test]
    async fn tiered_cache_serves_and_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let mut cache =
            TieredCache::new(10, Some((dir.path().join("c"), 10)), &dataset("t")).unwrap();
        let a = Bytes::from_static(b"aaaaaaaaaa");
        let b = Bytes::from_static(b"bbbbbbbbbb");
        cache.offer(1, &a, Some(100)).await;
        cache.offer(2, &b, Some(50)).await;
        // 2 is sooner: memory; 1 demoted to disk.
        assert!(matches!(cache.lookup(2).await, Lookup::Memory(x) if x == b));
        let Lookup::Disk(rx) = cache.lookup(1).await else {
            panic!("1 should be on disk")
        };
        assert_eq!(rx.await.unwrap().unwrap(), a);
        assert_eq!(cache.stats().demotions, 1);
        // A damaged file reads as an error; forgetting it makes it a miss.
        std::fs::write(cache.disk().unwrap().file_of(1), b"junk").unwrap();
        let Lookup::Disk(rx) = cache.lookup(1).await else {
            panic!("1 should still be planned on disk")
        };
        assert!(rx.await.unwrap().is_err());
        cache.forget(1).await;
        assert!(matches!(cache.lookup(1).await, Lookup::Miss));
        // Memory lost behind the plan's back is a miss, not an error.
        cache.memory().unwrap().remove(2).await;
        assert!(matches!(cache.lookup(2).await, Lookup::Miss));
        assert_eq!(cache.stats().memory_lost, 1);
        let mut off = TieredCache::disabled();
        off.offer(3, &a, Some(1)).await;
        assert!(matches!(off.lookup(3).await, Lookup::Miss));
    }

    #[tokio::test]
    async fn memory_tier_weighs_bytes() {
        let mem = MemoryTier::new(1000);
        for k in 0..5 {
            mem.insert(k, Bytes::from(vec![0u8; 100])).await;
        }
        assert_eq!(mem.weighted_size().await, 500);
        mem.remove(0).await;
        assert_eq!(mem.weighted_size().await, 400);
        assert!(mem.get(0).await.is_none());
        assert_eq!(mem.get(1).await.map(|b| b.len()), Some(100));
    }
}

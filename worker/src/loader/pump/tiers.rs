//! The pump and the cache tiers: planned samples are looked up in the window,
//! the memory tier and the disk tier, and each sample in hand is offered to
//! the cache with its next use.

use std::sync::Arc;

use bytes::Bytes;

use crate::cache::{CacheError, Lookup};
use crate::loader::pump::{Done, Held, Pump, Slot, Source, Waiting};
use crate::loader::schedule::FAR_FUTURE;
use crate::loader::{BatchPos, LoaderError};

impl Pump {
    /// Planning reached `epoch`: cached samples that were "not next epoch"
    /// may now have a known next use, or none left in the run.
    pub(super) async fn rekey(&mut self, epoch: u64) {
        self.rekeyed = Some(epoch);
        // A restart from here on finds the disk tier as it is now.
        self.cache.save_index();
        if self.peers.is_some() {
            self.rekey_owned(epoch).await;
            return;
        }
        for key in self.cache.plan().keys_needed_after(FAR_FUTURE) {
            let next = usize::try_from(key)
                .ok()
                .and_then(|s| self.schedule.next_use_from(epoch + 1, s));
            self.cache.reprioritize(key, next).await;
        }
    }

    pub(super) async fn plan_batch(
        &mut self,
        step: u64,
        first: u64,
        indices: Vec<usize>,
    ) -> Result<(), LoaderError> {
        let epoch = self.schedule.plan().epoch_of(first);
        let seq = self.base_seq + self.slots.len() as u64;
        let mut slot = Slot {
            pos: BatchPos {
                epoch,
                step,
                first,
                samples: Arc::from(indices.as_slice()),
            },
            records: vec![None; indices.len()],
            missing: indices.len(),
            indices: Vec::new(),
        };
        for (i, &sample) in indices.iter().enumerate() {
            let position = first + i as u64;
            if let Some(w) = self.waiting.get_mut(&sample) {
                w.waiters.push((seq, i));
                w.last_pos = position;
                continue;
            }
            if let Some(h) = self.held.get_mut(&sample) {
                h.slots += 1;
                let bytes = h.bytes.clone();
                slot.records[i] = Some(bytes.clone());
                slot.missing -= 1;
                self.shared.stats.update(epoch, |s| s.memory_hits += 1);
                let next = self.keep_until(position, sample);
                self.cache.offer(sample as u64, &bytes, next).await;
                continue;
            }
            let source = match self.cache.lookup(sample as u64).await {
                Lookup::Memory(bytes) => {
                    slot.records[i] = Some(bytes.clone());
                    slot.missing -= 1;
                    self.held.insert(
                        sample,
                        Held {
                            bytes: bytes.clone(),
                            slots: 1,
                        },
                    );
                    self.shared.stats.update(epoch, |s| s.memory_hits += 1);
                    let next = self.keep_until(position, sample);
                    self.cache.offer(sample as u64, &bytes, next).await;
                    continue;
                }
                Lookup::Disk(rx) => {
                    self.tasks.spawn(async move {
                        let result = rx.await.unwrap_or(Err(CacheError::Closed));
                        Done::Disk { sample, result }
                    });
                    Source::Disk
                }
                Lookup::Miss if self.ask_peer(sample) => Source::Peer,
                Lookup::Miss => {
                    self.queued.push(sample);
                    Source::Bucket
                }
            };
            self.waiting.insert(
                sample,
                Waiting {
                    waiters: vec![(seq, i)],
                    last_pos: position,
                    first_need: position,
                    source,
                },
            );
        }
        slot.indices = indices;
        self.ahead += slot.indices.len();
        self.slots.push_back(slot);
        Ok(())
    }

    /// A sample arrived: fill every batch waiting for it, then offer it to
    /// the cache with its next use after the last of them.
    pub(super) async fn deliver(&mut self, sample: usize, bytes: Bytes) {
        let Some(w) = self.waiting.remove(&sample) else {
            return;
        };
        let mut filled = 0;
        for (k, &(seq, i)) in w.waiters.iter().enumerate() {
            let Some(idx) = seq
                .checked_sub(self.base_seq)
                .and_then(|d| usize::try_from(d).ok())
            else {
                continue;
            };
            let Some(slot) = self.slots.get_mut(idx) else {
                continue;
            };
            if let Some(cell) = slot.records.get_mut(i) {
                if cell.is_none() {
                    *cell = Some(bytes.clone());
                    slot.missing -= 1;
                    filled += 1;
                }
            }
            let source = if k == 0 { Some(w.source) } else { None };
            self.shared.stats.update(slot.pos.epoch, |s| match source {
                Some(Source::Bucket) => s.bucket_samples += 1,
                Some(Source::Peer) => s.peer_samples += 1,
                Some(Source::Disk) => s.disk_hits += 1,
                None => s.memory_hits += 1,
            });
        }
        if filled > 0 {
            self.held.insert(
                sample,
                Held {
                    bytes: bytes.clone(),
                    slots: filled,
                },
            );
        }
        self.arrived(sample, &bytes);
        let next = self.keep_until(w.last_pos, sample);
        self.cache.offer(sample as u64, &bytes, next).await;
    }
}

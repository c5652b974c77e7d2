//! The decode step: the complete front batch is decoded (images on the
//! blocking pool) and its samples let go.

use std::sync::Arc;

use bytes::Bytes;
use ps_dataset::{Batch, Split};

use crate::loader::pump::Pump;
use crate::loader::{BatchPos, LoaderError};

impl Pump {
    /// Decodes the complete front batch and lets go of its samples.
    pub(super) async fn emit(&mut self) -> Result<(BatchPos, Arc<Batch>), LoaderError> {
        let Some(slot) = self.slots.pop_front() else {
            return Err(LoaderError::Task("no batch to hand over".into()));
        };
        self.base_seq += 1;
        self.ahead -= slot.indices.len();
        for sample in &slot.indices {
            if let Some(h) = self.held.get_mut(sample) {
                h.slots = h.slots.saturating_sub(1);
                if h.slots == 0 {
                    self.held.remove(sample);
                }
            }
        }
        let records: Vec<Bytes> = slot.records.into_iter().flatten().collect();
        if records.len() != slot.indices.len() {
            return Err(LoaderError::Task(format!(
                "batch of step {} (epoch {}) is missing samples",
                slot.pos.step, slot.pos.epoch
            )));
        }
        let epoch = slot.pos.epoch;
        let decoded = if self.reader.layout().is_images() {
            // Image decoding is CPU work for the decode pool: keep it off
            // the runtime's threads so fetches keep completing meanwhile.
            let reader = self.reader.clone();
            let indices = slot.indices.clone();
            tokio::task::spawn_blocking(move || {
                reader.decode_batch(Split::Train, epoch, &indices, &records)
            })
            .await
            .map_err(|e| LoaderError::Task(format!("decode task failed: {e}")))??
        } else {
            self.reader
                .decode_batch(Split::Train, epoch, &slot.indices, &records)?
        };
        for why in &decoded.skipped {
            tracing::warn!("skipped a sample that cannot be decoded: {why}");
        }
        self.shared.stats.update(epoch, |s| {
            s.samples += decoded.batch.len() as u64;
            s.decoded += decoded.decoded as u64;
            s.decode_us += (decoded.decode_s * 1e6) as u64;
            s.bad_samples += decoded.skipped.len() as u64;
        });
        if decoded.batch.is_empty() {
            return Err(LoaderError::Task(format!(
                "batch of step {} (epoch {epoch}) has no sample left after skipping undecodable ones",
                slot.pos.step
            )));
        }
        Ok((slot.pos, Arc::new(decoded.batch)))
    }
}

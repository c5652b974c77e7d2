//! f16 replies (`compression.f16_replies`): each update's change is rounded
//! to f16 on write, so the reply to a worker one version behind is the change
//! in 2 bytes an entry and the worker's sum is bit for bit the shard's copy.
//!
//! After the optimizer wrote an update, every changed entry `i` is set to
//! `held[i] + f16(params[i] + carry[i] - held[i])`, `held` being the copy
//! every up-to-date worker holds (the parameters before the update). What
//! the rounding left out stays in `carry[i]` and joins that entry's next
//! change (error feedback on the server, once for all workers). The
//! optimizer state never sees the rounding. A change too large for f16
//! (above 65504) is written exactly for the whole update, whose reply then
//! carries f32 values.

use ps_net::protocol::ParamUpdate;
use ps_shared::sparse::{f16_to_f32, f32_to_f16};

/// The rounding state of one shard.
#[derive(Debug, Default)]
pub(super) struct Rounding {
    /// The parameters every worker at the shard's version holds.
    held: Vec<f32>,
    /// Per entry: what rounding left out of the entry's changes so far.
    carry: Vec<f32>,
    /// The last update's change as f16 bits, when it was rounded.
    last: Option<LastChange>,
}

#[derive(Debug)]
struct LastChange {
    /// The version the change leads to.
    version: u64,
    /// The entries changed, ascending; `None`: every entry.
    indices: Option<Vec<u32>>,
    bits: Vec<u16>,
}

impl Rounding {
    /// Start from `params` as they are (a shard that starts or recovers):
    /// no carry, no last change. Recovery loses the carry, at most half an
    /// f16 unit of the last change per entry.
    pub(super) fn sync(&mut self, params: &[f32]) {
        self.held.clear();
        self.held.extend_from_slice(params);
        self.carry.clear();
        self.carry.resize(params.len(), 0.0);
        self.last = None;
    }

    /// Bytes held (the copy, the carry and the last change).
    pub(super) fn bytes(&self) -> usize {
        4 * (self.held.capacity() + self.carry.capacity())
            + self.last.as_ref().map_or(0, |l| {
                2 * l.bits.capacity() + 4 * l.indices.as_ref().map_or(0, Vec::capacity)
            })
    }

    /// Rounds the change the update leading to `version` wrote into `params`
    /// at `changed` (`None`: every entry). Returns whether it was rounded.
    pub(super) fn round(
        &mut self,
        params: &mut [f32],
        changed: Option<&[u32]>,
        version: u64,
    ) -> bool {
        self.last = None;
        if self.held.len() != params.len() {
            self.sync(params);
            return false;
        }
        let n = changed.map_or(params.len(), <[u32]>::len);
        let at = |k: usize| changed.map_or(k, |c| c[k] as usize);
        let mut bits = Vec::with_capacity(n);
        for k in 0..n {
            let i = at(k);
            let change = f64::from(params[i]) + f64::from(self.carry[i]) - f64::from(self.held[i]);
            let b = f32_to_f16(change as f32);
            if !f16_to_f32(b).is_finite() {
                // Written exactly: the carry still holds what is missing.
                for k in 0..n {
                    let i = at(k);
                    self.held[i] = params[i];
                }
                return false;
            }
            bits.push(b);
        }
        for (k, &b) in bits.iter().enumerate() {
            let i = at(k);
            let wanted = f64::from(params[i]) + f64::from(self.carry[i]);
            let written = self.held[i] + f16_to_f32(b);
            self.carry[i] = (wanted - f64::from(written)) as f32;
            params[i] = written;
            self.held[i] = written;
        }
        self.last = Some(LastChange {
            version,
            indices: changed.map(<[u32]>::to_vec),
            bits,
        });
        true
    }

    /// The change from `version - 1` to `version`, when that update was
    /// rounded.
    pub(super) fn delta_to(&self, version: u64) -> Option<ParamUpdate> {
        let last = self.last.as_ref().filter(|l| l.version == version)?;
        let base = version - 1;
        Some(match &last.indices {
            None => ParamUpdate::DenseDelta16 {
                base,
                values: last.bits.clone(),
            },
            Some(indices) => ParamUpdate::SparseDelta16 {
                base,
                indices: indices.clone(),
                values: last.bits.clone(),
            },
        })
    }
}

#[cfg(test)]
impl Rounding {
    /// What rounding left out so far, per entry.
    pub(super) fn carry(&self) -> &[f32] {
        &self.carry
    }
}

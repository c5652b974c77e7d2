//! Sparse gradients and the kernels that produce them.
//!
//! Workers do not send whole gradients: a [`Compressor`] keeps an error-feedback
//! residual, selects the largest-magnitude entries of it with a top-k kernel and
//! sends those as a [`SparseGrad`] (parallel arrays of ascending `u32` indices and
//! `f32` values). The unsent remainder stays in the residual and is sent later.
//!
//! Two top-k kernels are provided:
//!
//! * [`topk_exact`] returns exactly `k` entries, the `k` largest magnitudes, with
//!   ties broken towards the lower index.
//! * [`topk_approx`] returns the entries above an estimated magnitude threshold;
//!   its count is within 10% of `k` (2% where magnitudes are distinct), and every
//!   returned magnitude is at least every magnitude left behind.
//!
//! Both avoid full-size temporaries on large inputs: a seeded, stratified random
//! sample gives a conservative magnitude threshold, one parallel pass gathers the few entries
//! above it, and the final choice is made among those candidates only (introselect
//! for the exact kernel, counting rounds for the approximate one). Inputs where the
//! sample cannot give a useful threshold (tiny inputs, large `k`, many ties) fall
//! back to an introselect over the whole array.
//!
//! NaN rule: a NaN has the smallest magnitude of all, below zero. NaNs are
//! therefore only selected when `k` exceeds the number of non-NaN entries.
//!
//! ```
//! use ps_shared::config::CompressionSection;
//! use ps_shared::sparse::{topk_exact, Compressor};
//!
//! let top = topk_exact(&[0.5, -3.0, 0.1, 2.0], 2);
//! assert_eq!(top.indices, vec![1, 3]);
//! assert_eq!(top.values, vec![-3.0, 2.0]);
//!
//! let config = CompressionSection {
//!     density: 0.5,
//!     momentum_correction: 0.0,
//!     ..CompressionSection::default()
//! };
//! let mut compressor = Compressor::new(4, config);
//! let sent = compressor.compress(&[0.5, -3.0, 0.1, 2.0]).unwrap();
//! assert_eq!(sent.indices, vec![1, 3]);
//! assert_eq!(compressor.residual(), &[0.5, 0.0, 0.1, 0.0]);
//! ```

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::config::CompressionSection;

/// Largest number of entries a top-k input may have: indices are `u32`.
/// Entries past this length are ignored by the kernels.
pub const MAX_INDEXABLE_LEN: usize = (u32::MAX as usize).saturating_add(1);

/// Elements per parallel work item in the streaming passes.
const PASS_CHUNK: usize = 1 << 16;
/// Entries per block in the gather pass; a block is only looked at entry by entry
/// when one of its magnitudes may reach the threshold. At most 32 (bit mask).
const GATHER_BLOCK: usize = 32;
const _: () = assert!(GATHER_BLOCK <= 32);
/// Inputs shorter than this always use the whole-array introselect.
const MIN_SAMPLED_LEN: usize = 1 << 16;
/// The sampled path is used only while `k * MAX_SAMPLED_FRACTION_INV <= len`.
const MAX_SAMPLED_FRACTION_INV: usize = 16;
/// Expected number of sampled entries above the true k-th magnitude.
const SAMPLE_HITS: f64 = 64.0;
/// Consecutive entries read per sampled position (two cache lines).
const SAMPLE_RUN: usize = 32;
/// Bounds on the number of sampled entries.
const MIN_SAMPLE: usize = 4096;
const MAX_SAMPLE: usize = 1 << 17;
/// Fixed sample seed of the exact kernel (its result does not depend on it).
const EXACT_SAMPLE_SEED: u64 = 0x5eed_70b1_c0de_0001;
/// Below this k the approximate kernel uses the exact one.
const APPROX_MIN_K: usize = 100;

/// A sparse slice of the flat parameter space: parallel arrays, indices strictly
/// ascending.
#[derive(
    Debug,
    Clone,
    Default,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct SparseGrad {
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
}

impl SparseGrad {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Every entry of `dense`, for the dense baseline. Entries past
    /// [`MAX_INDEXABLE_LEN`] are dropped.
    pub fn from_dense(dense: &[f32]) -> SparseGrad {
        let dense = indexable(dense);
        SparseGrad {
            indices: (0..dense.len()).map(|i| i as u32).collect(),
            values: dense.to_vec(),
        }
    }

    /// `dense[i] += scale * v` for every entry. The caller guarantees that every
    /// index is in range (checked by a debug assertion); out-of-range entries are
    /// skipped in release builds.
    pub fn add_into(&self, dense: &mut [f32], scale: f32) {
        for (&index, &value) in self.indices.iter().zip(&self.values) {
            debug_assert!(
                (index as usize) < dense.len(),
                "index {index} out of range for {} entries",
                dense.len()
            );
            if let Some(slot) = dense.get_mut(index as usize) {
                *slot += scale * value;
            }
        }
    }

    /// Bytes on the wire: 4 per index plus 4 per value.
    pub fn wire_bytes(&self) -> usize {
        4 * self.indices.len() + 4 * self.values.len()
    }

    /// Checks what the type promises, for data received from the network: equal
    /// array lengths, strictly ascending indices, every index below `dim`.
    pub fn validate(&self, dim: usize) -> Result<(), SparseError> {
        if self.indices.len() != self.values.len() {
            return Err(SparseError::ArrayLengths {
                indices: self.indices.len(),
                values: self.values.len(),
            });
        }
        for (position, pair) in self.indices.windows(2).enumerate() {
            if pair[0] >= pair[1] {
                return Err(SparseError::NotAscending {
                    position: position + 1,
                });
            }
        }
        if let Some(&last) = self.indices.last() {
            if last as usize >= dim {
                return Err(SparseError::IndexOutOfRange { index: last, dim });
            }
        }
        Ok(())
    }
}

/// How the top-k entries are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TopKMethod {
    /// Exactly the k largest magnitudes ([`topk_exact`]).
    #[default]
    Exact,
    /// Within 10% of k entries above an estimated threshold ([`topk_approx`]).
    Approx,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SparseError {
    #[error("gradient has {got} entries, expected {expected}")]
    LengthMismatch { expected: usize, got: usize },
    #[error("sparse gradient has {indices} indices but {values} values")]
    ArrayLengths { indices: usize, values: usize },
    #[error("sparse gradient indices are not strictly ascending at position {position}")]
    NotAscending { position: usize },
    #[error("sparse gradient index {index} is out of range for {dim} parameters")]
    IndexOutOfRange { index: u32, dim: usize },
}

/// Sort key of a value's magnitude: NaN is 0, below every number; otherwise the
/// bits of `|v|` plus one, which order like the magnitudes.
#[inline(always)]
fn magnitude_key(value: f32) -> u32 {
    let raw = value.to_bits() & 0x7fff_ffff;
    if raw > 0x7f80_0000 {
        0
    } else {
        raw + 1
    }
}

/// One entry in one integer, ordered by magnitude first and lower index second:
/// bits 63..33 hold the magnitude key (at most 31 bits), bits 32..1 the inverted
/// index, bit 0 the sign. All packed entries of one array are distinct.
#[inline(always)]
fn pack(value: f32, index: u32) -> u64 {
    (u64::from(magnitude_key(value)) << 33)
        | (u64::from(!index) << 1)
        | u64::from(value.to_bits() >> 31)
}

/// Smallest packed entry with a magnitude key of at least `key`.
#[inline(always)]
fn packed_floor(key: u32) -> u64 {
    u64::from(key) << 33
}

#[inline(always)]
fn packed_index(packed: u64) -> u32 {
    !((packed >> 1) as u32)
}

#[inline(always)]
fn packed_key(packed: u64) -> u32 {
    (packed >> 33) as u32
}

/// The value of a packed entry (exact for every non-NaN value).
#[inline(always)]
fn packed_value(packed: u64) -> f32 {
    let sign = (packed as u32 & 1) << 31;
    f32::from_bits(packed_key(packed).wrapping_sub(1) | sign)
}

fn indexable(values: &[f32]) -> &[f32] {
    &values[..values.len().min(MAX_INDEXABLE_LEN)]
}

/// k for a density in (0,1]: `max(1, round(density * len))`, never more than
/// `len`. A density above 1 gives `len`; NaN or a density at or below 0 gives 1.
pub fn k_for_density(len: usize, density: f64) -> usize {
    if len == 0 {
        return 0;
    }
    let wanted = if density.is_nan() || density <= 0.0 {
        1.0
    } else {
        (density.min(1.0) * len as f64).round()
    };
    (wanted as usize).clamp(1, len)
}

/// Top-k by the given method.
pub fn topk(values: &[f32], k: usize, method: TopKMethod, seed: u64) -> SparseGrad {
    match method {
        TopKMethod::Exact => topk_exact(values, k),
        TopKMethod::Approx => topk_approx(values, k, seed),
    }
}

/// Exact top-k by magnitude, indices ascending. `k` is clamped to the length;
/// `k == 0` gives an empty result. Equal magnitudes are broken towards the lower
/// index; NaN counts as the smallest magnitude.
///
/// Large inputs with small `k` are filtered first: a sampled threshold that at
/// least `k` entries reach is applied in one parallel gather pass, and the k-th
/// largest is found by introselect (`select_nth_unstable`) among the gathered
/// candidates. Every entry below that threshold has `k` larger entries, so the
/// result is the same as an introselect over the whole array, which is the path
/// taken otherwise.
pub fn topk_exact(values: &[f32], k: usize) -> SparseGrad {
    let values = indexable(values);
    let k = k.min(values.len());
    if k == 0 {
        return SparseGrad::default();
    }
    if k == values.len() {
        return SparseGrad::from_dense(values);
    }
    match sampled_candidates(values, k, EXACT_SAMPLE_SEED) {
        Some(candidates) => exact_from_candidates(&candidates, k),
        None => exact_whole_array(values, k),
    }
}

/// Approximate top-k in the spirit of MSTopK, indices ascending.
///
/// A random sample (seeded by `seed`) gives a magnitude threshold that somewhat
/// more than `k` entries reach; one parallel pass gathers those candidates; then
/// counting rounds (a binary search over magnitude thresholds, run on the
/// candidates only) pick a threshold whose count is within 2% of `k` where the
/// data allows, and within 10% always. The result is every entry at or above
/// that threshold, so each selected magnitude is at least every unselected one.
/// When no threshold lands in the 10% window (heavy ties), when `k < 100`, or
/// when the input is small, the exact kernel is used. NaN counts as the smallest
/// magnitude.
pub fn topk_approx(values: &[f32], k: usize, seed: u64) -> SparseGrad {
    let values = indexable(values);
    let k = k.min(values.len());
    if k < APPROX_MIN_K || k == values.len() {
        return topk_exact(values, k);
    }
    let Some(candidates) = sampled_candidates(values, k, seed) else {
        return exact_whole_array(values, k);
    };
    // Accept counts within 10% of k; keep searching while farther than 2%.
    let slack = k / 10;
    let aim = k / 50;
    if candidates.len() <= k + aim {
        return sparse_from_packed(&candidates, 0);
    }
    let keys: Vec<u32> = candidates.iter().map(|&p| packed_key(p)).collect();
    let count_at_or_above = |threshold: u32| keys.iter().filter(|&&key| key >= threshold).count();
    // Invariant: count(low) > k + aim, count(high) < k - aim.
    let mut low = keys.iter().copied().min().unwrap_or(0);
    let mut high = keys.iter().copied().max().unwrap_or(0).saturating_add(1);
    let mut best: Option<(usize, u32)> = None;
    while high - low > 1 {
        let middle = low + (high - low) / 2;
        let count = count_at_or_above(middle);
        let distance = count.abs_diff(k);
        if distance <= aim {
            return sparse_from_packed(&candidates, packed_floor(middle));
        }
        if distance <= slack && best.is_none_or(|(closest, _)| distance < closest) {
            best = Some((distance, middle));
        }
        if count > k {
            low = middle;
        } else {
            high = middle;
        }
    }
    match best {
        Some((_, threshold)) => sparse_from_packed(&candidates, packed_floor(threshold)),
        None => exact_from_candidates(&candidates, k),
    }
}

/// Reference top-k by a full sort of every entry (same ordering and tie rule as
/// [`topk_exact`]). Slow; for tests and benchmarks.
pub fn topk_by_full_sort(values: &[f32], k: usize) -> SparseGrad {
    let values = indexable(values);
    let k = k.min(values.len());
    let mut packed: Vec<u64> = values
        .par_iter()
        .enumerate()
        .map(|(i, &v)| pack(v, i as u32))
        .collect();
    packed.par_sort_unstable_by(|a, b| b.cmp(a));
    let mut indices: Vec<u32> = packed[..k].iter().map(|&p| packed_index(p)).collect();
    indices.sort_unstable();
    let values = indices.iter().map(|&i| values[i as usize]).collect();
    SparseGrad { indices, values }
}

/// Candidates (packed, ascending index) of a sampled threshold reached by at least
/// `k` entries, or `None` when the sampled path does not apply or the threshold
/// turns out useless (too few or far too many entries reach it).
fn sampled_candidates(values: &[f32], k: usize, seed: u64) -> Option<Vec<u64>> {
    let len = values.len();
    if len < MIN_SAMPLED_LEN || k.saturating_mul(MAX_SAMPLED_FRACTION_INV) > len {
        return None;
    }
    let density = k as f64 / len as f64;
    let sample_len = ((SAMPLE_HITS / density).ceil() as usize)
        .clamp(MIN_SAMPLE, MAX_SAMPLE)
        .min(len / 8);
    let mut sample = stratified_sample_keys(values, sample_len, seed);
    let sample_len = sample.len();
    // Rank (1-based, largest first) well past the expected number of sampled
    // entries above the k-th magnitude, so that fewer than k entries reaching the
    // threshold needs a deviation of many standard deviations.
    let expected_hits = sample_len as f64 * density;
    let rank = (2.0 * expected_hits + 4.0 * (2.0 * expected_hits).sqrt()).ceil() as usize + 1;
    if rank >= sample_len {
        return None;
    }
    let (_, &mut threshold, _) = sample.select_nth_unstable_by(rank - 1, |a, b| b.cmp(a));
    if threshold == 0 {
        return None;
    }
    let expected_candidates = (rank as f64 / sample_len as f64 * len as f64) as usize;
    let cap = 4 * expected_candidates.max(k) + 4096;
    let candidates = gather_at_or_above(values, threshold, expected_candidates, cap)?;
    (candidates.len() >= k).then_some(candidates)
}

/// About `sample_len` magnitude keys: the array is cut into equal strata and a
/// run of [`SAMPLE_RUN`] consecutive entries at a random (seeded) offset is read
/// from each. Runs keep the number of cache misses low; strata keep the sample
/// spread over the whole array. `sample_len` must be at most `len / 8`.
fn stratified_sample_keys(values: &[f32], sample_len: usize, seed: u64) -> Vec<u32> {
    let runs = sample_len.div_ceil(SAMPLE_RUN).max(1);
    let stratum = values.len() / runs;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sample = Vec::with_capacity(runs * SAMPLE_RUN);
    for run in 0..runs {
        let offset = rng.random_range(0..=stratum.saturating_sub(SAMPLE_RUN));
        let start = run * stratum + offset;
        let entries = values.get(start..start + SAMPLE_RUN).unwrap_or(&[]);
        sample.extend(entries.iter().map(|&v| magnitude_key(v)));
    }
    sample
}

/// Every entry with magnitude key `>= threshold` (which must be at least 1), packed,
/// in ascending index order; `None` once more than `cap` entries were found.
/// `expected` (the estimated total) sizes the per-chunk buffers.
fn gather_at_or_above(
    values: &[f32],
    threshold: u32,
    expected: usize,
    cap: usize,
) -> Option<Vec<u64>> {
    let per_chunk = expected / values.len().div_ceil(PASS_CHUNK).max(1);
    let chunk_capacity = per_chunk + per_chunk / 2 + 16;
    debug_assert!(threshold >= 1);
    let found = AtomicUsize::new(0);
    let overflow = AtomicBool::new(false);
    let parts: Vec<Vec<u64>> = values
        .par_chunks(PASS_CHUNK)
        .enumerate()
        .map(|(chunk_index, chunk)| {
            if overflow.load(Ordering::Relaxed) {
                return Vec::new();
            }
            let part = gather_chunk(chunk, chunk_index * PASS_CHUNK, threshold, chunk_capacity);
            let total = found.fetch_add(part.len(), Ordering::Relaxed) + part.len();
            if total > cap {
                overflow.store(true, Ordering::Relaxed);
            }
            part
        })
        .collect();
    if overflow.load(Ordering::Relaxed) {
        return None;
    }
    let mut candidates = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for part in parts {
        candidates.extend_from_slice(&part);
    }
    Some(candidates)
}

fn gather_chunk(chunk: &[f32], base: usize, threshold: u32, capacity: usize) -> Vec<u64> {
    // key >= threshold  <=>  not NaN and raw >= threshold - 1, where raw are the
    // magnitude bits (below 2^31). With limit = threshold - 2 that is
    // limit - raw < 0 as i32 (no overflow), so a block may hold a hit exactly when
    // the OR of the differences has its sign bit set: an integer reduction that
    // vectorises. NaN bits pass this test and are rejected by the key test. A
    // block that passes is walked through its bit mask of hits.
    let limit = threshold.wrapping_sub(2);
    let difference = |value: f32| limit.wrapping_sub(value.to_bits() & 0x7fff_ffff);
    let mut out = Vec::with_capacity(capacity);
    let blocks = chunk.chunks_exact(GATHER_BLOCK);
    let tail = blocks.remainder();
    for (block_index, block) in blocks.enumerate() {
        let mut any = 0u32;
        for &value in block {
            any |= difference(value);
        }
        if any >> 31 == 0 {
            continue;
        }
        let mut mask = 0u32;
        for (offset, &value) in block.iter().enumerate() {
            mask |= (difference(value) >> 31) << offset;
        }
        let block_base = base + block_index * GATHER_BLOCK;
        while mask != 0 {
            let offset = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if let Some(&value) = block.get(offset) {
                if magnitude_key(value) >= threshold {
                    out.push(pack(value, (block_base + offset) as u32));
                }
            }
        }
    }
    let tail_base = base + chunk.len() - tail.len();
    for (offset, &value) in tail.iter().enumerate() {
        if magnitude_key(value) >= threshold {
            out.push(pack(value, (tail_base + offset) as u32));
        }
    }
    out
}

/// Exactly the `k` largest of `candidates` (packed, ascending index, at least `k`).
fn exact_from_candidates(candidates: &[u64], k: usize) -> SparseGrad {
    let mut scratch = candidates.to_vec();
    let (_, &mut kth, _) = scratch.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    sparse_from_packed(candidates, kth)
}

/// Entries of `candidates` (ascending index) whose packed value is `>= threshold`.
fn sparse_from_packed(candidates: &[u64], threshold: u64) -> SparseGrad {
    let mut out = SparseGrad::default();
    for &packed in candidates.iter().filter(|&&p| p >= threshold) {
        out.indices.push(packed_index(packed));
        out.values.push(packed_value(packed));
    }
    out
}

/// Introselect over every entry, then one ordered pass collecting the winners.
fn exact_whole_array(values: &[f32], k: usize) -> SparseGrad {
    let mut packed: Vec<u64> = values
        .par_iter()
        .enumerate()
        .map(|(i, &v)| pack(v, i as u32))
        .collect();
    let (_, &mut kth, _) = packed.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    drop(packed);
    let parts: Vec<SparseGrad> = values
        .par_chunks(PASS_CHUNK)
        .enumerate()
        .map(|(chunk_index, chunk)| {
            let base = chunk_index * PASS_CHUNK;
            let mut part = SparseGrad::default();
            for (offset, &value) in chunk.iter().enumerate() {
                let index = (base + offset) as u32;
                if pack(value, index) >= kth {
                    part.indices.push(index);
                    part.values.push(value);
                }
            }
            part
        })
        .collect();
    let mut out = SparseGrad {
        indices: Vec::with_capacity(k),
        values: Vec::with_capacity(k),
    };
    for part in parts {
        out.indices.extend_from_slice(&part.indices);
        out.values.extend_from_slice(&part.values);
    }
    out
}

/// Factor that brings `grad`'s L2 norm down to `max_norm` (1 when it is
/// already within it, or when `max_norm` is 0 = off).
pub fn clip_scale(grad: &[f32], max_norm: f32) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let norm = grad
        .par_chunks(PASS_CHUNK)
        .map(|c| c.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>())
        .sum::<f64>()
        .sqrt();
    if norm > f64::from(max_norm) {
        (f64::from(max_norm) / norm) as f32
    } else {
        1.0
    }
}

/// Error-feedback top-k compressor of one worker's flat gradient, with the
/// settings of the config's `[compression]` section.
#[derive(Debug, Clone)]
pub struct Compressor {
    config: CompressionSection,
    /// Accumulated unsent gradient (DGC's `v`).
    residual: Vec<f32>,
    /// Corrected momentum (DGC's `u`); empty while momentum correction is off.
    momentum: Vec<f32>,
    step: u64,
    /// Ranges that each get their own top-k (`compression.scope = "shard"`),
    /// ascending and tiling the gradient; empty: one top-k over all of it.
    blocks: Vec<Range<usize>>,
}

impl Compressor {
    /// A top-k compressor for `num_params` parameters, whatever `config.kind`
    /// says ([`CompressionSection::compressor`] builds none for `none`). The
    /// config should have passed [`CompressionSection::validate`];
    /// out-of-range values are clamped.
    pub fn new(num_params: usize, config: CompressionSection) -> Self {
        let momentum = if config.momentum_correction > 0.0 {
            vec![0.0; num_params]
        } else {
            Vec::new()
        };
        Compressor {
            config,
            residual: vec![0.0; num_params],
            momentum,
            step: 0,
            blocks: Vec::new(),
        }
    }

    /// The same compressor selecting `density` of each of `blocks` on its
    /// own (every block gets its share of the push). Blocks that do not tile
    /// the gradient in ascending order leave it selecting over the whole.
    pub fn per_block(mut self, blocks: Vec<Range<usize>>) -> Self {
        let mut next = 0;
        let tiles = blocks.iter().all(|b| {
            let ok = b.start == next && b.end > b.start;
            next = b.end;
            ok
        }) && next == self.residual.len();
        self.blocks = if tiles { blocks } else { Vec::new() };
        self
    }

    /// The ranges selected on their own (empty: one selection over all).
    pub fn blocks(&self) -> &[Range<usize>] {
        &self.blocks
    }

    /// Accumulates `grad` (with momentum correction when on), selects the top-k of
    /// the accumulator for this step's density (per block when it has blocks),
    /// zeroes the accumulator (and the momentum when masking) at the sent indices
    /// and returns the sent entries. Without error feedback the whole accumulator
    /// is cleared after selection. At density 1 every entry is sent.
    pub fn compress(&mut self, grad: &[f32]) -> Result<SparseGrad, SparseError> {
        if grad.len() != self.residual.len() {
            return Err(SparseError::LengthMismatch {
                expected: self.residual.len(),
                got: grad.len(),
            });
        }
        let scale = clip_scale(grad, self.config.clip_norm);
        let sent = if self.blocks.is_empty() {
            self.compress_range(0..grad.len(), grad, scale, self.step)
        } else {
            let mut sent = SparseGrad::default();
            for block in 0..self.blocks.len() {
                let range = self.blocks[block].clone();
                let seed = self.block_seed(block);
                let part = self.compress_range(range.clone(), &grad[range.clone()], scale, seed);
                sent.indices
                    .extend(part.indices.iter().map(|&i| i + range.start as u32));
                sent.values.extend_from_slice(&part.values);
            }
            sent
        };
        self.step = self.step.saturating_add(1);
        Ok(sent)
    }

    /// Block `block`'s part of this step as the backward pass finishes it:
    /// `part` (the block's gradient) times `scale` is accumulated and the
    /// block's top-k returned, indices local to the block. Each block once
    /// per step, then [`Self::end_step`]; the result is what
    /// [`Self::compress`] sends of the block, bit for bit, when `scale` is
    /// its clipping scale (1 without clipping).
    pub fn compress_block(
        &mut self,
        block: usize,
        part: &[f32],
        scale: f32,
    ) -> Result<SparseGrad, SparseError> {
        let Some(range) = self.blocks.get(block).cloned() else {
            return Err(SparseError::LengthMismatch {
                expected: self.blocks.len(),
                got: block,
            });
        };
        if part.len() != range.len() {
            return Err(SparseError::LengthMismatch {
                expected: range.len(),
                got: part.len(),
            });
        }
        let seed = self.block_seed(block);
        Ok(self.compress_range(range, part, scale, seed))
    }

    /// Closes a step compressed block by block.
    pub fn end_step(&mut self) {
        self.step = self.step.saturating_add(1);
    }

    /// The approximate selection's seed for a block this step.
    fn block_seed(&self, block: usize) -> u64 {
        self.step ^ ((block as u64) << 40)
    }

    /// Accumulates `grad` (the gradient of `range`) and sends the top-k of
    /// the accumulator's `range`, indices local to it.
    fn compress_range(
        &mut self,
        range: Range<usize>,
        grad: &[f32],
        scale: f32,
        seed: u64,
    ) -> SparseGrad {
        let correction = self.config.momentum_correction;
        let correcting = correction > 0.0 && self.momentum.len() == self.residual.len();
        self.accumulate(range.clone(), grad, scale, correcting.then_some(correction));
        let density = self.config.density_at(self.step);
        let masking = correcting && self.config.momentum_masking;
        let residual = &mut self.residual[range.clone()];
        if density >= 1.0 {
            let sent = SparseGrad::from_dense(residual);
            residual.fill(0.0);
            if masking {
                self.momentum[range].fill(0.0);
            }
            return sent;
        }
        let k = k_for_density(residual.len(), density);
        let sent = topk(
            residual,
            k,
            self.config.method,
            crate::hash::splitmix64(seed),
        );
        for &index in &sent.indices {
            if let Some(slot) = residual.get_mut(index as usize) {
                *slot = 0.0;
            }
        }
        if masking {
            let momentum = &mut self.momentum[range];
            for &index in &sent.indices {
                if let Some(slot) = momentum.get_mut(index as usize) {
                    *slot = 0.0;
                }
            }
        }
        if !self.config.error_feedback {
            residual.fill(0.0);
        }
        sent
    }

    /// `v += s*g`, or with correction `u = m*u + s*g; v += u`, over `range`
    /// in parallel chunks (`s` is the clipping scale, 1 without clipping).
    fn accumulate(
        &mut self,
        range: Range<usize>,
        grad: &[f32],
        scale: f32,
        correction: Option<f32>,
    ) {
        let residual = &mut self.residual[range.clone()];
        match correction {
            Some(factor) => residual
                .par_chunks_mut(PASS_CHUNK)
                .zip(self.momentum[range].par_chunks_mut(PASS_CHUNK))
                .zip(grad.par_chunks(PASS_CHUNK))
                .for_each(|((residual, momentum), grad)| {
                    for ((v, u), &g) in residual.iter_mut().zip(momentum.iter_mut()).zip(grad) {
                        *u = factor * *u + scale * g;
                        *v += *u;
                    }
                }),
            None => residual
                .par_chunks_mut(PASS_CHUNK)
                .zip(grad.par_chunks(PASS_CHUNK))
                .for_each(|(residual, grad)| {
                    for (v, &g) in residual.iter_mut().zip(grad) {
                        *v += scale * g;
                    }
                }),
        }
    }

    /// The unsent accumulator.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Number of `compress` calls so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn config(&self) -> &CompressionSection {
        &self.config
    }
}

/// f16 wire encoding of values: round to nearest even; overflow becomes infinity,
/// infinities and NaN stay infinities and NaN.
pub fn values_to_f16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect()
}

/// One value as f16 bits ([`values_to_f16`]'s rounding).
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// One f16 value from its bits.
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Decodes [`values_to_f16`] output.
pub fn values_from_f16(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| half::f16::from_bits(b).to_f32())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::Rng;

    fn topk_config(density: f64) -> CompressionSection {
        CompressionSection::topk_for_tests(density)
    }

    fn gaussian(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..len)
            .map(|_| {
                // Sum of uniforms: close enough to Gaussian for these tests.
                let s: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
                s
            })
            .collect()
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    fn sorted_keys(values: impl Iterator<Item = f32>) -> Vec<u32> {
        let mut keys: Vec<u32> = values.map(magnitude_key).collect();
        keys.sort_unstable();
        keys
    }

    fn assert_same_topk(got: &SparseGrad, want: &SparseGrad) {
        assert_eq!(got.indices, want.indices);
        assert_eq!(bits(&got.values), bits(&want.values));
    }

    /// Selected set is a true top set: every selected magnitude key is at least
    /// every unselected one, indices ascending, values match.
    fn assert_top_set(values: &[f32], selected: &SparseGrad) {
        assert!(selected.indices.windows(2).all(|w| w[0] < w[1]));
        let mut chosen = vec![false; values.len()];
        for (&i, &v) in selected.indices.iter().zip(&selected.values) {
            assert_eq!(values[i as usize].to_bits(), v.to_bits());
            chosen[i as usize] = true;
        }
        let min_selected = selected.values.iter().map(|&v| magnitude_key(v)).min();
        let max_unselected = values
            .iter()
            .zip(&chosen)
            .filter(|(_, &c)| !c)
            .map(|(&v, _)| magnitude_key(v))
            .max();
        if let (Some(lo), Some(hi)) = (min_selected, max_unselected) {
            assert!(lo >= hi, "selected min key {lo} below unselected max {hi}");
        }
    }

    #[test]
    fn packing_round_trips_and_orders() {
        let entries = [
            (1.5f32, 0u32),
            (-1.5, 7),
            (0.0, u32::MAX),
            (-0.0, 3),
            (f32::INFINITY, 1),
            (-f32::MIN_POSITIVE, 2),
            (-f32::MAX, 9),
        ];
        for (value, index) in entries {
            let packed = pack(value, index);
            assert_eq!(packed_index(packed), index);
            assert_eq!(packed_value(packed).to_bits(), value.to_bits());
            assert_eq!(packed_key(packed), magnitude_key(value));
        }
        assert!(pack(-2.0, 5) > pack(1.0, 0));
        assert!(pack(1.0, 0) > pack(-1.0, 1));
        assert!(pack(0.0, 0) > pack(f32::NAN, 0));
        assert!(pack(1.0, 4) >= packed_floor(magnitude_key(1.0)));
        assert!(pack(0.99, 0) < packed_floor(magnitude_key(1.0)));
    }

    #[test]
    fn gather_matches_a_plain_filter() {
        let mut values = gaussian(10_000 + 19, 4);
        values[5] = f32::NAN;
        values[70] = f32::INFINITY;
        values[71] = -f32::INFINITY;
        values[72] = -0.0;
        for threshold in [
            1,
            2,
            magnitude_key(0.5),
            magnitude_key(3.0),
            magnitude_key(f32::INFINITY),
        ] {
            let want: Vec<u64> = values
                .iter()
                .enumerate()
                .filter(|(_, &v)| magnitude_key(v) >= threshold)
                .map(|(i, &v)| pack(v, i as u32 + 100))
                .collect();
            assert_eq!(gather_chunk(&values, 100, threshold, 0), want);
        }
    }

    #[test]
    fn exact_small_examples() {
        let top = topk_exact(&[0.5, -3.0, 0.1, 2.0], 2);
        assert_eq!(top.indices, vec![1, 3]);
        assert_eq!(top.values, vec![-3.0, 2.0]);
        assert!(topk_exact(&[1.0, 2.0], 0).is_empty());
        assert!(topk_exact(&[], 3).is_empty());
        assert_eq!(topk_exact(&[1.0, 2.0], 9).len(), 2);
        // Ties go to the lower index.
        let ties = topk_exact(&[1.0, -1.0, 1.0, 1.0], 2);
        assert_eq!(ties.indices, vec![0, 1]);
    }

    #[test]
    fn nan_is_smallest_and_never_panics() {
        let values = [f32::NAN, 0.0, -2.0, f32::INFINITY, f32::NAN, 1.0];
        let top = topk_exact(&values, 3);
        assert_eq!(top.indices, vec![2, 3, 5]);
        let top = topk_exact(&values, 5);
        assert_eq!(top.indices, vec![0, 1, 2, 3, 5]);
        let mut big = gaussian(1 << 17, 3);
        for i in (0..big.len()).step_by(97) {
            big[i] = f32::NAN;
        }
        let exact = topk_exact(&big, 500);
        assert_same_topk(&exact, &topk_by_full_sort(&big, 500));
        assert!(exact.values.iter().all(|v| !v.is_nan()));
        let approx = topk_approx(&big, 500, 1);
        assert!(approx.values.iter().all(|v| !v.is_nan()));
        assert_top_set(&big, &approx);
    }

    #[test]
    fn exact_matches_sort_on_large_input() {
        let values = gaussian((1 << 20) + 45, 11);
        for k in [1, 50, 1049, 10_000, 70_000, 300_000] {
            assert_same_topk(&topk_exact(&values, k), &topk_by_full_sort(&values, k));
        }
    }

    #[test]
    fn exact_handles_heavy_ties_and_zeros() {
        let mut values = vec![0.0f32; 1 << 17];
        for i in (0..values.len()).step_by(1000) {
            values[i] = 1.0;
        }
        // Fewer non-zeros than k: zeros fill up by lowest index.
        let k = 500;
        assert_same_topk(&topk_exact(&values, k), &topk_by_full_sort(&values, k));
        assert_same_topk(&topk_approx(&values, k, 5), &topk_by_full_sort(&values, k));
        let constant = vec![0.25f32; 1 << 17];
        assert_same_topk(
            &topk_exact(&constant, 1000),
            &topk_by_full_sort(&constant, 1000),
        );
        let approx = topk_approx(&constant, 1000, 2);
        assert!(approx.len().abs_diff(1000) <= 100);
    }

    #[test]
    fn approx_count_is_close_to_k_on_large_inputs() {
        let values = gaussian(1 << 20, 21);
        for (k, seed) in [(100, 1), (1049, 2), (5000, 3), (20_000, 4), (60_000, 5)] {
            let approx = topk_approx(&values, k, seed);
            // Distinct magnitudes: the counting rounds reach the 2% aim.
            assert!(
                approx.len().abs_diff(k) <= k / 50,
                "k {k}: got {}",
                approx.len()
            );
            assert_top_set(&values, &approx);
        }
    }

    #[test]
    fn sampled_path_is_taken_on_gaussian_input() {
        let values = gaussian(1 << 20, 5);
        for (k, seed) in [(100, 1), (1049, 2), (20_000, 3)] {
            let candidates = sampled_candidates(&values, k, seed).expect("sampled path");
            assert!(candidates.len() >= k && candidates.len() <= 8 * k + 4096);
            assert!(candidates
                .windows(2)
                .all(|w| packed_index(w[0]) < packed_index(w[1])));
        }
    }

    #[test]
    fn clustered_large_values_stay_exact() {
        // The largest magnitudes sit in one contiguous run that the sample may
        // over- or under-represent; results must not depend on it.
        let mut values = gaussian(1 << 18, 9);
        for (offset, v) in values[100_000..103_000].iter_mut().enumerate() {
            *v = 50.0 + offset as f32 * 1e-3;
        }
        for k in [500, 2999, 3000, 3001, 5000] {
            assert_same_topk(&topk_exact(&values, k), &topk_by_full_sort(&values, k));
            let approx = topk_approx(&values, k, k as u64);
            assert!(approx.len().abs_diff(k) <= k / 10);
            assert_top_set(&values, &approx);
        }
    }

    #[test]
    fn approx_small_k_is_exact() {
        let values = gaussian(5000, 8);
        assert_same_topk(&topk_approx(&values, 40, 1), &topk_exact(&values, 40));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn exact_equals_sort_reference(
            values in prop::collection::vec(
                prop_oneof![
                    -100.0f32..100.0,
                    Just(0.0f32),
                    Just(-1.5f32),
                    Just(f32::NAN),
                    Just(f32::NEG_INFINITY),
                ],
                0..300,
            ),
            k in 0usize..320,
        ) {
            let got = topk_exact(&values, k);
            let want = topk_by_full_sort(&values, k);
            prop_assert_eq!(
                sorted_keys(got.values.iter().copied()),
                sorted_keys(want.values.iter().copied())
            );
            prop_assert_eq!(&got.indices, &want.indices);
            prop_assert_eq!(got.len(), k.min(values.len()));
        }

        #[test]
        fn approx_is_a_top_set_within_window(seed in any::<u64>(), k in 100usize..4000) {
            let values = gaussian(1 << 16, seed);
            let approx = topk_approx(&values, k, seed);
            prop_assert!(approx.len().abs_diff(k) <= k / 10);
            assert_top_set(&values, &approx);
        }

        #[test]
        fn compressor_conserves_gradient_mass(
            len in 1usize..200,
            steps in 1usize..8,
            density in 0.01f64..1.0,
            approx in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let config = CompressionSection {
                method: if approx { TopKMethod::Approx } else { TopKMethod::Exact },
                ..topk_config(density)
            };
            let mut compressor = Compressor::new(len, config);
            let mut fed = vec![0.0f64; len];
            let mut sent_total = vec![0.0f64; len];
            for step in 0..steps {
                let grad = gaussian(len, seed.wrapping_add(step as u64));
                for (f, &g) in fed.iter_mut().zip(&grad) {
                    *f += f64::from(g);
                }
                let sent = compressor.compress(&grad).unwrap();
                prop_assert!(sent.validate(len).is_ok());
                prop_assert_eq!(sent.len(), k_for_density(len, density));
                for (&i, &v) in sent.indices.iter().zip(&sent.values) {
                    sent_total[i as usize] += f64::from(v);
                }
            }
            for i in 0..len {
                let total = sent_total[i] + f64::from(compressor.residual()[i]);
                prop_assert!((total - fed[i]).abs() <= 1e-4 * (1.0 + fed[i].abs()));
            }
            prop_assert_eq!(compressor.step(), steps as u64);
        }

        #[test]
        fn f16_round_trip_is_within_half_precision(
            values in prop::collection::vec(-6.0e4f32..6.0e4, 0..64),
        ) {
            let back = values_from_f16(&values_to_f16(&values));
            for (&v, &b) in values.iter().zip(&back) {
                prop_assert!((v - b).abs() <= v.abs() * 1e-3 + 1e-7);
            }
        }
    }

    #[test]
    fn f16_special_values() {
        let values = [0.5, -2.0, 1.0e6, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        let back = values_from_f16(&values_to_f16(&values));
        assert_eq!(&back[..2], &[0.5, -2.0]);
        assert_eq!(back[2], f32::INFINITY);
        assert_eq!(back[3], f32::INFINITY);
        assert_eq!(back[4], f32::NEG_INFINITY);
        assert!(back[5].is_nan());
        let exact = [1.0f32, 0.25, -1024.0, 65504.0];
        assert_eq!(values_from_f16(&values_to_f16(&exact)), exact);
    }

    #[test]
    fn dense_density_sends_everything() {
        let config = topk_config(1.0);
        assert!(config.validate().is_ok());
        let mut compressor = Compressor::new(3, config);
        let sent = compressor.compress(&[1.0, 0.0, -2.0]).unwrap();
        assert_eq!(sent, SparseGrad::from_dense(&[1.0, 0.0, -2.0]));
        assert_eq!(compressor.residual(), &[0.0, 0.0, 0.0]);
    }

    /// Per-block selection: each block sends its own `density` share,
    /// and streaming the blocks one by one (`compress_block`, in any
    /// order) sends and keeps exactly what one `compress` call does.
    #[test]
    fn per_block_selection_gives_each_block_its_share_and_streams_bit_for_bit() {
        let blocks = vec![0..300, 300..700, 700..1000];
        for method in [TopKMethod::Exact, TopKMethod::Approx] {
            for correction in [0.0, 0.9] {
                let config = CompressionSection {
                    method,
                    momentum_correction: correction,
                    warmup_steps: 3,
                    warmup_start_density: 1.0,
                    ..topk_config(0.05)
                };
                let mut whole = Compressor::new(1000, config.clone()).per_block(blocks.clone());
                let mut streamed = Compressor::new(1000, config).per_block(blocks.clone());
                assert_eq!(whole.blocks(), &blocks[..]);
                for step in 0..6u64 {
                    // Gradients whose largest entries all lie in the last
                    // block: one selection over the whole would send none
                    // of the first two.
                    let mut grad = gaussian(1000, step);
                    grad[700..].iter_mut().for_each(|g| *g *= 100.0);
                    let sent = whole.compress(&grad).unwrap();
                    let mut parts = Vec::new();
                    // Backward finishes the last layers first.
                    for block in (0..blocks.len()).rev() {
                        let range = blocks[block].clone();
                        let part = streamed.compress_block(block, &grad[range.clone()], 1.0);
                        parts.push((range.start, part.unwrap()));
                    }
                    streamed.end_step();
                    parts.reverse();
                    let mut joined = SparseGrad::default();
                    for (start, part) in parts {
                        let density = whole.config().density_at(step);
                        let k = part.len();
                        let len = whole
                            .blocks()
                            .iter()
                            .find(|b| b.start == start)
                            .unwrap()
                            .len();
                        if method == TopKMethod::Exact {
                            assert_eq!(k, k_for_density(len, density), "step {step}");
                        } else {
                            assert!(k > 0, "every block sends some of its entries");
                        }
                        joined
                            .indices
                            .extend(part.indices.iter().map(|&i| i + start as u32));
                        joined.values.extend(part.values);
                    }
                    assert_same_topk(&joined, &sent);
                    assert_eq!(bits(whole.residual()), bits(streamed.residual()));
                    assert!(sent.indices.iter().any(|&i| i < 300), "step {step}");
                }
                assert_eq!(whole.step(), streamed.step());
            }
        }
        // A block out of range, or a part of the wrong length, is refused.
        let mut c = Compressor::new(10, topk_config(0.5)).per_block(vec![0..5, 5..10]);
        assert!(c.compress_block(2, &[0.0; 5], 1.0).is_err());
        assert!(c.compress_block(0, &[0.0; 4], 1.0).is_err());
        // Blocks that do not tile the gradient: one selection over all.
        let gaps = Compressor::new(10, topk_config(0.5)).per_block(vec![0..4, 5..10]);
        assert!(gaps.blocks().is_empty());
    }

    #[test]
    fn compressor_rejects_wrong_length() {
        let mut compressor = Compressor::new(4, topk_config(0.01));
        assert_eq!(
            compressor.compress(&[1.0; 3]).unwrap_err(),
            SparseError::LengthMismatch {
                expected: 4,
                got: 3
            }
        );
        assert_eq!(compressor.step(), 0);
    }

    #[test]
    fn no_error_feedback_clears_residual() {
        let config = CompressionSection {
            error_feedback: false,
            ..topk_config(0.5)
        };
        let mut compressor = Compressor::new(4, config);
        let sent = compressor.compress(&[4.0, 1.0, -3.0, 0.5]).unwrap();
        assert_eq!(sent.indices, vec![0, 2]);
        assert!(compressor.residual().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn momentum_correction_and_masking() {
        let config = CompressionSection {
            momentum_correction: 0.5,
            momentum_masking: true,
            ..topk_config(0.5)
        };
        let mut compressor = Compressor::new(2, config);
        // u = [1, 0.5]; v = [1, 0.5]; send index 0, zero u[0].
        let sent = compressor.compress(&[1.0, 0.5]).unwrap();
        assert_eq!(sent.indices, vec![0]);
        assert_eq!(compressor.residual(), &[0.0, 0.5]);
        // u = [0 + 0.1, 0.25 + 0.1] = [0.1, 0.35]; v = [0.1, 0.85]; send index 1.
        let sent = compressor.compress(&[0.1, 0.1]).unwrap();
        assert_eq!(sent.indices, vec![1]);
        assert!((sent.values[0] - 0.85).abs() < 1e-6);
        assert!((compressor.residual()[0] - 0.1).abs() < 1e-6);
    }

    #[test]
    fn warmup_schedule_is_monotone_and_ends_at_density() {
        let config = CompressionSection {
            warmup_steps: 40,
            warmup_start_density: 0.25,
            ..topk_config(0.001)
        };
        assert!(config.validate().is_ok());
        assert!((config.density_at(0) - 0.25).abs() < 1e-12);
        let schedule: Vec<f64> = (0..60).map(|s| config.density_at(s)).collect();
        assert!(schedule.windows(2).all(|w| w[1] <= w[0]));
        assert!(schedule.iter().all(|&d| (0.001..=0.25).contains(&d)));
        assert_eq!(config.density_at(40), 0.001);
        assert_eq!(config.density_at(1000), 0.001);
        // Exponential: halfway is the geometric mean.
        assert!((config.density_at(20) - (0.25f64 * 0.001).sqrt()).abs() < 1e-9);
        let off = CompressionSection::default();
        assert_eq!(off.warmup_steps, 0);
        assert_eq!(off.density_at(0), 0.01);
    }

    #[test]
    fn k_for_density_rounds_and_clamps() {
        assert_eq!(k_for_density(1000, 0.01), 10);
        assert_eq!(k_for_density(1000, 0.0001), 1);
        assert_eq!(k_for_density(1000, 1.0), 1000);
        assert_eq!(k_for_density(1000, 2.0), 1000);
        assert_eq!(k_for_density(1000, f64::NAN), 1);
        assert_eq!(k_for_density(0, 0.5), 0);
        assert_eq!(k_for_density(25_000_000, 0.001), 25_000);
    }

    #[test]
    fn sparse_grad_helpers_and_validation() {
        let grad = SparseGrad {
            indices: vec![1, 3],
            values: vec![2.0, -1.0],
        };
        let mut dense = vec![1.0f32; 4];
        grad.add_into(&mut dense, 0.5);
        assert_eq!(dense, vec![1.0, 2.0, 1.0, 0.5]);
        assert_eq!(grad.wire_bytes(), 16);
        assert!(grad.validate(4).is_ok());
        assert_eq!(
            grad.validate(3),
            Err(SparseError::IndexOutOfRange { index: 3, dim: 3 })
        );
        let unordered = SparseGrad {
            indices: vec![3, 3],
            values: vec![1.0, 1.0],
        };
        assert_eq!(
            unordered.validate(4),
            Err(SparseError::NotAscending { position: 1 })
        );
        let ragged = SparseGrad {
            indices: vec![0],
            values: vec![],
        };
        assert!(matches!(
            ragged.validate(4),
            Err(SparseError::ArrayLengths { .. })
        ));
        assert_eq!(SparseGrad::from_dense(&[1.0, 2.0]).indices, vec![0, 1]);
    }

    #[test]
    fn sparse_grad_rkyv_and_serde_round_trip() {
        let grad = SparseGrad {
            indices: vec![0, 7, 9],
            values: vec![1.5, -2.0, 0.25],
        };
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&grad).unwrap();
        let back = rkyv::from_bytes::<SparseGrad, rkyv::rancor::Error>(&bytes).unwrap();
        assert_eq!(back, grad);
        let json = serde_json::to_string(&TopKMethod::Approx).unwrap();
        assert_eq!(json, "\"approx\"");
        let config: CompressionSection = serde_json::from_str(r#"{"density": 0.1}"#).unwrap();
        assert_eq!(config.density, 0.1);
        assert!(config.error_feedback);
    }

    #[test]
    fn local_clipping_scales_only_gradients_above_the_bound() {
        assert_eq!(clip_scale(&[3.0, 4.0], 0.0), 1.0);
        assert_eq!(clip_scale(&[3.0, 4.0], 10.0), 1.0);
        assert!((clip_scale(&[3.0, 4.0], 2.5) - 0.5).abs() < 1e-6);
        let config = CompressionSection {
            clip_norm: 2.5,
            ..topk_config(1.0)
        };
        let mut c = Compressor::new(2, config);
        let sent = c.compress(&[3.0, 4.0]).unwrap();
        assert_eq!(sent.values, vec![1.5, 2.0]);
        let bad = CompressionSection {
            clip_norm: -1.0,
            ..topk_config(0.01)
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("clip_norm"));
    }
}

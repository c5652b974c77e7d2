//! Contiguous, balanced shards of the flat parameter space.
//!
//! The model's parameters are one flat `f32` array of `total` entries. The
//! [`ShardMap`] cuts it into `shards` contiguous ranges whose lengths differ by at
//! most one; each server shard owns one range. Workers split their sparse
//! gradients by shard with [`ShardMap::split`] (indices become local to the shard)
//! and their dense gradients with [`ShardMap::split_dense`].
//!
//! ```
//! use ps_shared::shard::ShardMap;
//! use ps_shared::sparse::SparseGrad;
//!
//! let map = ShardMap::balanced(10, 3).unwrap();
//! assert_eq!(map.ranges(), &[0..4, 4..7, 7..10]);
//! assert_eq!(map.shard_of(5), Some(1));
//!
//! let grad = SparseGrad { indices: vec![1, 5, 9], values: vec![0.1, 0.5, 0.9] };
//! let parts = map.split(&grad);
//! assert_eq!(parts[1].indices, vec![1]); // global 5 is local 1 of shard 1
//! assert_eq!(map.join(&parts).unwrap(), grad);
//! ```

use std::ops::Range;

use crate::sparse::SparseGrad;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("cannot split parameters into zero shards")]
    ZeroShards,
    #[error("cannot split {total} parameters into {shards} non-empty shards")]
    TooManyShards { total: usize, shards: usize },
    #[error("expected one part per shard ({shards}), got {parts}")]
    PartCount { shards: usize, parts: usize },
    #[error("local index {index} is outside shard {shard}, which holds {len} parameters")]
    LocalIndexOutOfRange {
        shard: usize,
        index: u32,
        len: usize,
    },
    #[error("shard {shard} part has {indices} indices but {values} values")]
    PartArrayLengths {
        shard: usize,
        indices: usize,
        values: usize,
    },
}

/// Contiguous ranges covering `[0, total)`; the first `total % shards` ranges are
/// one entry longer than the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    total: usize,
    ranges: Vec<Range<usize>>,
}

impl ShardMap {
    /// Splits `[0, total)` into `shards` contiguous ranges whose lengths differ by at
    /// most one. Fails if `shards == 0` or `shards > total` (no empty shards).
    pub fn balanced(total: usize, shards: usize) -> Result<ShardMap, ShardError> {
        if shards == 0 {
            return Err(ShardError::ZeroShards);
        }
        if shards > total {
            return Err(ShardError::TooManyShards { total, shards });
        }
        let base = total / shards;
        let longer = total % shards;
        let ranges = (0..shards)
            .map(|shard| {
                let start = shard * base + shard.min(longer);
                let len = base + usize::from(shard < longer);
                start..start + len
            })
            .collect();
        Ok(ShardMap { total, ranges })
    }

    /// Number of parameters covered.
    pub fn total(&self) -> usize {
        self.total
    }

    pub fn num_shards(&self) -> usize {
        self.ranges.len()
    }

    /// The global range of `shard`, or `None` if there is no such shard.
    pub fn range(&self, shard: usize) -> Option<Range<usize>> {
        self.ranges.get(shard).cloned()
    }

    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// The shard holding global `index`, by arithmetic; `None` past the end.
    pub fn shard_of(&self, index: usize) -> Option<usize> {
        if index >= self.total {
            return None;
        }
        let shards = self.ranges.len();
        let base = self.total / shards;
        let longer = self.total % shards;
        let long_span = longer * (base + 1);
        Some(if index < long_span {
            index / (base + 1)
        } else {
            longer + (index - long_span) / base
        })
    }

    /// Splits a global sparse gradient into one part per shard, indices rebased to
    /// the shard start. One pass, no sort: each part keeps the input's order, so
    /// ascending input gives ascending parts. Entries at or past `total` are
    /// dropped (validate input with [`SparseGrad::validate`] first).
    pub fn split(&self, grad: &SparseGrad) -> Vec<SparseGrad> {
        let expected = grad.len() / self.ranges.len() + 1;
        let mut parts: Vec<SparseGrad> = self
            .ranges
            .iter()
            .map(|_| SparseGrad {
                indices: Vec::with_capacity(expected),
                values: Vec::with_capacity(expected),
            })
            .collect();
        let mut current = 0usize;
        let mut current_range = self.ranges.first().cloned().unwrap_or(0..0);
        for (&index, &value) in grad.indices.iter().zip(&grad.values) {
            let global = index as usize;
            if !current_range.contains(&global) {
                let Some(shard) = self.shard_of(global) else {
                    continue;
                };
                current = shard;
                current_range = self.ranges[shard].clone();
            }
            let part = &mut parts[current];
            part.indices.push((global - current_range.start) as u32);
            part.values.push(value);
        }
        parts
    }

    /// Inverse of [`ShardMap::split`]: concatenates per-shard parts (local indices)
    /// into one global sparse gradient.
    pub fn join(&self, parts: &[SparseGrad]) -> Result<SparseGrad, ShardError> {
        if parts.len() != self.ranges.len() {
            return Err(ShardError::PartCount {
                shards: self.ranges.len(),
                parts: parts.len(),
            });
        }
        let len = parts.iter().map(SparseGrad::len).sum();
        let mut joined = SparseGrad {
            indices: Vec::with_capacity(len),
            values: Vec::with_capacity(len),
        };
        for (shard, (part, range)) in parts.iter().zip(&self.ranges).enumerate() {
            if part.indices.len() != part.values.len() {
                return Err(ShardError::PartArrayLengths {
                    shard,
                    indices: part.indices.len(),
                    values: part.values.len(),
                });
            }
            for &local in &part.indices {
                if local as usize >= range.len() {
                    return Err(ShardError::LocalIndexOutOfRange {
                        shard,
                        index: local,
                        len: range.len(),
                    });
                }
                joined.indices.push((range.start + local as usize) as u32);
            }
            joined.values.extend_from_slice(&part.values);
        }
        Ok(joined)
    }

    /// Splits a dense slice of length `total` into per-shard borrowed slices. A
    /// shorter slice gives truncated (possibly empty) trailing parts.
    pub fn split_dense<'a>(&self, dense: &'a [f32]) -> Vec<&'a [f32]> {
        self.ranges
            .iter()
            .map(|range| {
                let end = range.end.min(dense.len());
                let start = range.start.min(end);
                &dense[start..end]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn balanced_examples_and_errors() {
        let map = ShardMap::balanced(10, 3).unwrap();
        assert_eq!(map.ranges(), &[0..4, 4..7, 7..10]);
        assert_eq!(map.total(), 10);
        assert_eq!(map.num_shards(), 3);
        assert_eq!(map.range(2), Some(7..10));
        assert_eq!(map.range(3), None);
        assert_eq!(map.shard_of(10), None);
        assert_eq!(ShardMap::balanced(10, 0), Err(ShardError::ZeroShards));
        assert_eq!(
            ShardMap::balanced(2, 3),
            Err(ShardError::TooManyShards {
                total: 2,
                shards: 3
            })
        );
        assert!(ShardMap::balanced(0, 1).is_err());
        assert_eq!(ShardMap::balanced(5, 5).unwrap().ranges()[4], 4..5);
    }

    #[test]
    fn split_dense_borrows_each_range() {
        let map = ShardMap::balanced(5, 2).unwrap();
        let dense = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(
            map.split_dense(&dense),
            vec![&[0.0, 1.0, 2.0][..], &[3.0, 4.0][..]]
        );
        assert_eq!(map.split_dense(&dense[..2]), vec![&[0.0, 1.0][..], &[][..]]);
    }

    #[test]
    fn join_rejects_bad_parts() {
        let map = ShardMap::balanced(4, 2).unwrap();
        assert!(matches!(
            map.join(&[SparseGrad::default()]),
            Err(ShardError::PartCount { .. })
        ));
        let outside = SparseGrad {
            indices: vec![2],
            values: vec![1.0],
        };
        assert!(matches!(
            map.join(&[SparseGrad::default(), outside]),
            Err(ShardError::LocalIndexOutOfRange { shard: 1, .. })
        ));
    }

    #[test]
    fn split_drops_out_of_range_entries() {
        let map = ShardMap::balanced(4, 2).unwrap();
        let grad = SparseGrad {
            indices: vec![1, 9],
            values: vec![1.0, 2.0],
        };
        let parts = map.split(&grad);
        assert_eq!(parts[0].indices, vec![1]);
        assert!(parts[1].is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn ranges_cover_contiguously_and_balanced(total in 1usize..5000, shards in 1usize..64) {
            prop_assume!(shards <= total);
            let map = ShardMap::balanced(total, shards).unwrap();
            prop_assert_eq!(map.num_shards(), shards);
            prop_assert_eq!(map.ranges()[0].start, 0);
            prop_assert_eq!(map.ranges()[shards - 1].end, total);
            for pair in map.ranges().windows(2) {
                prop_assert_eq!(pair[0].end, pair[1].start);
            }
            let lens: Vec<usize> = map.ranges().iter().map(|r| r.len()).collect();
            let (min, max) = (*lens.iter().min().unwrap(), *lens.iter().max().unwrap());
            prop_assert!(min >= 1 && max - min <= 1);
            for (shard, range) in map.ranges().iter().enumerate() {
                prop_assert_eq!(range.len(), total / shards + usize::from(shard < total % shards));
                for index in [range.start, range.end - 1, (range.start + range.end) / 2] {
                    prop_assert_eq!(map.shard_of(index), Some(shard));
                }
            }
            prop_assert_eq!(map.shard_of(total), None);
        }

        #[test]
        fn split_then_join_round_trips(
            total in 1usize..3000,
            shards in 1usize..17,
            picks in prop::collection::btree_set(0usize..3000, 0..200),
        ) {
            prop_assume!(shards <= total);
            let map = ShardMap::balanced(total, shards).unwrap();
            let indices: Vec<u32> =
                picks.into_iter().filter(|&i| i < total).map(|i| i as u32).collect();
            let values: Vec<f32> = indices.iter().map(|&i| i as f32 * 0.5 - 7.0).collect();
            let grad = SparseGrad { indices, values };
            let parts = map.split(&grad);
            prop_assert_eq!(parts.len(), shards);
            for (part, range) in parts.iter().zip(map.ranges()) {
                prop_assert!(part.validate(range.len()).is_ok());
            }
            prop_assert_eq!(map.join(&parts).unwrap(), grad);
        }
    }
}

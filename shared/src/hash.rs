//! Small, stable mixing functions shared by the crates.
//!
//! Values computed here feed sample orders, sampling seeds and simulated
//! faults, so they must never change between builds or versions.

/// SplitMix64 of `x`: adds the golden-ratio increment and applies the
/// generator's output mix. Nearby inputs give unrelated outputs, which makes it
/// a good way to derive independent seeds (per epoch, per step, per object)
/// from one user seed.
///
/// ```
/// use ps_shared::hash::splitmix64;
/// assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
/// assert_ne!(splitmix64(1), splitmix64(2));
/// ```
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One step of the SplitMix64 generator: advances `state` and returns the
/// next output (the same sequence as the reference generator seeded with the
/// initial `state`).
pub fn splitmix64_next(state: &mut u64) -> u64 {
    let out = splitmix64(*state);
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of the reference SplitMix64 generator seeded with 0.
        let mut state = 0u64;
        assert_eq!(splitmix64_next(&mut state), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64_next(&mut state), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(splitmix64_next(&mut state), 0x06c4_5d18_8009_454f);
    }
}

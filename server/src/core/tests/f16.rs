//! `f16_replies`: changes rounded on write, the rounding carried per entry,
//! and f16 changes in the replies to workers one version behind.

use super::*;

fn f16_setup(workers: u32, momentum: f32) -> ShardSetup {
    ShardSetup {
        f16_replies: true,
        ..setup(workers, momentum, SyncMode::Bsp)
    }
}

fn dense(values: Vec<f32>) -> WireGrad {
    WireGrad::Dense(WireValues::F32(values))
}

/// The update in the reply to `to` among `acts`.
fn update_for(acts: &[Action], to: ReplyId) -> ParamUpdate {
    match replies(acts).into_iter().find(|(r, _)| *r == to) {
        Some((_, Response::Params { update, .. })) => update.clone(),
        other => panic!("reply {to}: {other:?}"),
    }
}

/// A gradient whose changes f16 cannot hold exactly.
fn awkward(step: u64) -> Vec<f32> {
    (0..8)
        .map(|i| 1.0e-3 * (1.0 + i as f32 / 3.0) + 1.0e-5 * step as f32)
        .collect()
}

#[test]
fn dense_changes_go_as_f16_and_every_copy_equals_the_shard_bit_for_bit() {
    let (mut c, t0) = serving_with(f16_setup(2, 0.9));
    let mut copies = vec![vec![0.0f32; 8]; 2];
    for s in 0..6u64 {
        let mut acts = c.handle(step(10 * s, 0, s, dense(awkward(s))), t0);
        acts.extend(c.handle(step(10 * s + 1, 1, s, dense(awkward(s + 7))), t0));
        for (r, copy) in copies.iter_mut().enumerate() {
            let u = update_for(&acts, 10 * s + r as u64);
            assert!(
                matches!(u, ParamUpdate::DenseDelta16 { base, ref values } if base == s && values.len() == 8),
                "{u:?}"
            );
            u.apply_to(copy).unwrap();
            let same = copy
                .iter()
                .zip(c.params())
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "step {s}: {copy:?} against {:?}", c.params());
        }
    }
    assert_eq!(c.stats().rounded_updates, 6);
}

#[test]
fn the_carry_keeps_rounding_from_adding_up() {
    // The same 200 sparse steps with and without rounding: rounding moves
    // an entry by at most half an f16 unit of one change, whatever the
    // step count, because the carry joins the next change.
    let mut exact = serving(1, 0.0, SyncMode::Bsp).0;
    let (mut c, t0) = serving_with(f16_setup(1, 0.0));
    let g = awkward(0);
    for s in 0..200u64 {
        exact.handle(step(s, 0, s, sparse(vec![1, 5], vec![g[1], g[5]])), t0);
        let acts = c.handle(step(s, 0, s, sparse(vec![1, 5], vec![g[1], g[5]])), t0);
        let u = update_for(&acts, s);
        assert!(
            matches!(u, ParamUpdate::SparseDelta16 { base, ref indices, .. } if base == s && indices == &[1, 5]),
            "{u:?}"
        );
    }
    let carry = c.rounding.as_ref().unwrap().carry().to_vec();
    for i in [1usize, 5] {
        let off = (c.params()[i] - exact.params()[i]).abs();
        // One change is about 1.3e-3 and 2.3e-3: half an f16 unit of it is
        // below 1e-6; 200 uncorrected roundings would drift far beyond.
        assert!(off < 2.0e-6, "entry {i}: {off}");
        let joined = (c.params()[i] + carry[i] - exact.params()[i]).abs();
        assert!(joined < 1.0e-6, "entry {i}: {joined}");
    }
    assert_eq!(c.params()[0], 0.0);
}

#[test]
fn a_worker_further_behind_gets_f32_values_of_the_rounded_copy() {
    let (mut c, t0) = serving_with(f16_setup(2, 0.0));
    for s in 0..2u64 {
        let mut acts = c.handle(step(10 * s, 0, s, sparse(vec![2], vec![0.1])), t0);
        acts.extend(c.handle(step(10 * s + 1, 1, s, sparse(vec![3], vec![0.2])), t0));
        assert_eq!(replies(&acts).len(), 2);
    }
    // Rank 1 lost its last reply and holds version 0: it gets values.
    let acts = c.handle(
        Event::Step {
            reply: 99,
            conn: 101,
            rank: 1,
            step: 1,
            have_version: Some(0),
            rate: 0.0,
            grad: sparse(vec![3], vec![0.2]),
        },
        t0,
    );
    let u = update_for(&acts, 99);
    assert_eq!(u.base(), None, "{u:?}");
    let mut copy = vec![0.0; 8];
    u.apply_to(&mut copy).unwrap();
    assert_eq!(copy, c.params());
}

#[test]
fn a_change_beyond_f16_is_written_exactly_and_sent_as_f32() {
    let (mut c, t0) = serving_with(f16_setup(1, 0.0));
    let acts = c.handle(step(1, 0, 0, sparse(vec![4], vec![1.0e5])), t0);
    match update_for(&acts, 1) {
        ParamUpdate::Sparse { indices, values } => {
            assert_eq!((indices, values), (vec![4], vec![-1.0e5]));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().rounded_updates, 0);
    // The next, small change goes as f16 again.
    let acts = c.handle(step(2, 0, 1, sparse(vec![4], vec![0.5])), t0);
    let mut copy = c.params().to_vec();
    copy[4] = -1.0e5;
    update_for(&acts, 2).apply_to(&mut copy).unwrap();
    assert_eq!(copy, c.params());
    assert_eq!(c.stats().rounded_updates, 1);
}

#[test]
fn a_recovered_shard_rounds_from_the_adopted_copy() {
    let t0 = Instant::now();
    let mut c = joined_with(f16_setup(1, 0.0), CoreSettings::default(), t0);
    let start: Vec<f32> = (0..8).map(|i| 0.1 * i as f32).collect();
    c.handle(offer(0, 3, start.clone()), t0);
    assert!(c.is_serving());
    let acts = c.handle(step(5, 0, 3, sparse(vec![6], vec![awkward(0)[6]])), t0);
    let mut copy = start;
    update_for(&acts, 5).apply_to(&mut copy).unwrap();
    let same = copy
        .iter()
        .zip(c.params())
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{copy:?} against {:?}", c.params());
}

//! Backup workers (`server.backup_workers`): a BSP step applied after
//! n - b pushes, late pushes folded into the next update.

use super::*;

/// A serving BSP core of `workers` ranks with `backup` backup workers.
fn backed(workers: u32, backup: u32) -> (ShardCore, Instant) {
    serving_with(ShardSetup {
        backup,
        ..setup(workers, 0.0, SyncMode::Bsp)
    })
}

fn params_of(r: &Response) -> (u64, u64) {
    match r {
        Response::Params {
            version, next_step, ..
        } => (*version, *next_step),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_step_proceeds_after_n_minus_b_pushes() {
    let (mut c, t0) = backed(3, 1);
    assert!(replies(&c.handle(step(1, 0, 0, sparse(vec![1], vec![3.0])), t0)).is_empty());
    assert_eq!(c.version(), 0, "one push of three is not enough");
    let acts = c.handle(step(2, 1, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.version(), 1, "two pushes of three apply the step");
    let mut r = replies(&acts);
    r.sort_by_key(|(to, _)| *to);
    assert_eq!(r.len(), 2);
    for (_, resp) in r {
        assert_eq!(params_of(resp), (1, 1));
    }
    // The mean of the two pushes that made it.
    assert_eq!(c.params()[1], -3.0);
    assert_eq!(c.stats().late_pushes, 0);
}

#[test]
fn a_late_push_is_folded_into_the_next_update_and_counted_once() {
    let (mut c, t0) = backed(3, 1);
    c.handle(step(1, 0, 0, sparse(vec![1], vec![3.0])), t0);
    c.handle(step(2, 1, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.version(), 1);
    // Rank 2's push for step 0 arrives after step 0 was applied: it is
    // folded into the update under way (step 1), and its reply waits for it.
    let acts = c.handle(step(3, 2, 0, sparse(vec![1], vec![3.0])), t0);
    assert!(replies(&acts).is_empty(), "{acts:?}");
    assert_eq!(c.stats().late_pushes, 1);
    assert_eq!(c.stats().fenced, 0);
    assert_eq!(c.params()[1], -3.0, "nothing applied yet");
    // A retry of the late push is not counted again.
    let acts = c.handle(step(4, 2, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.stats().duplicate_pushes, 1);
    assert_eq!(params_of(replies(&acts)[0].1).0, 1);
    // Step 1 needs two on-time pushes; the folded one does not count.
    c.handle(step(5, 0, 1, sparse(vec![2], vec![3.0])), t0);
    assert_eq!(c.version(), 1);
    let acts = c.handle(step(6, 1, 1, sparse(vec![2], vec![3.0])), t0);
    assert_eq!(c.version(), 2);
    // The update is the mean over its three pushes: entry 2 got 3 + 3,
    // entry 1 the late 3.
    assert_eq!(c.params()[1], -4.0);
    assert_eq!(c.params()[2], -2.0);
    let r = replies(&acts);
    assert_eq!(r.len(), 3, "ranks 0, 1 and the late rank 2");
    let (_, late) = r.iter().find(|(to, _)| *to == 3).expect("the late reply");
    // The late rank takes the cluster's parameters and step 2: it skipped step 1.
    assert_eq!(params_of(late), (2, 2));
    match late {
        Response::Params {
            update: ParamUpdate::Sparse { indices, values },
            ..
        } => {
            assert_eq!(indices, &vec![1, 2], "the changes since version 0");
            assert_eq!(values, &vec![-4.0, -2.0]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().pushes, 5, "every push counted once");
    // After the update, another copy of the late push is a duplicate.
    let acts = c.handle(step(7, 2, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(params_of(replies(&acts)[0].1), (2, 2));
    assert_eq!(c.params()[1], -4.0);
    assert_eq!((c.stats().pushes, c.stats().late_pushes), (5, 1));
}

#[test]
fn a_straggler_back_to_speed_rejoins_normal_steps() {
    let (mut c, t0) = backed(3, 1);
    c.handle(step(1, 0, 0, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(2, 1, 0, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(3, 2, 0, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(4, 0, 1, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(5, 1, 1, sparse(vec![1], vec![1.0])), t0);
    assert_eq!((c.version(), c.stats().late_pushes), (2, 1));
    // Rank 2, at speed again, pushes step 2 among the first two: an
    // ordinary push, and its reply's next step follows the one it pushed.
    assert!(replies(&c.handle(step(6, 2, 2, sparse(vec![1], vec![1.0])), t0)).is_empty());
    let acts = c.handle(step(7, 0, 2, sparse(vec![1], vec![1.0])), t0);
    let r = replies(&acts);
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|(_, resp)| params_of(resp) == (3, 3)));
    assert_eq!(c.stats().late_pushes, 1, "no new late push");
    // Rank 1 is the slowest of step 2 now: its push is folded in turn.
    c.handle(step(8, 1, 2, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(c.stats().late_pushes, 2);
    for (reply, rank) in [(9, 0), (10, 2)] {
        c.handle(step(reply, rank, 3, sparse(vec![1], vec![1.0])), t0);
    }
    assert_eq!(c.version(), 4);
    assert_eq!(c.stats().fenced, 0);
}

#[test]
fn a_push_older_than_the_fold_window_is_fenced() {
    let (mut c, t0) = backed(2, 1);
    // Rank 0 alone makes every step (2 - 1 = 1 push).
    for s in 0..=MAX_FOLD_LAG {
        c.handle(step(s + 1, 0, s, sparse(vec![1], vec![1.0])), t0);
    }
    assert_eq!(c.version(), MAX_FOLD_LAG + 1);
    let acts = c.handle(step(100, 1, 0, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::Fenced));
    assert_eq!((c.stats().late_pushes, c.stats().fenced), (0, 1));
    // One step newer is within the window: folded.
    let acts = c.handle(step(101, 1, 1, sparse(vec![1], vec![1.0])), t0);
    assert!(replies(&acts).is_empty());
    assert_eq!(c.stats().late_pushes, 1);
}

#[test]
fn without_backups_a_step_waits_for_every_live_rank_and_late_pushes_are_fenced() {
    let (mut c, t0) = backed(3, 0);
    c.handle(step(1, 0, 0, sparse(vec![1], vec![3.0])), t0);
    c.handle(step(2, 1, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.version(), 0, "b = 0 waits for all three");
    c.handle(step(3, 2, 0, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.version(), 1);
    // Rank 2 leaves; ranks 0 and 1 make step 1 without it.
    c.handle(
        Event::Left {
            rank: 2,
            conn: Some(102),
        },
        t0,
    );
    c.handle(step(4, 0, 1, sparse(vec![1], vec![3.0])), t0);
    c.handle(step(5, 1, 1, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(c.version(), 2);
    c.handle(Event::Joined { rank: 2, conn: 102 }, t0);
    let acts = c.handle(step(6, 2, 1, sparse(vec![1], vec![3.0])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::Fenced));
    assert_eq!(c.stats().late_pushes, 0);
}

#[test]
fn with_backups_the_barrier_shrinks_with_the_live_ranks() {
    let (mut c, t0) = backed(3, 1);
    for rank in [1, 2] {
        c.handle(
            Event::Left {
                rank,
                conn: Some(100 + u64::from(rank)),
            },
            t0,
        );
    }
    // One live rank: its push alone makes the step (never fewer than one).
    let acts = c.handle(step(1, 0, 0, sparse(vec![1], vec![2.0])), t0);
    assert_eq!(c.version(), 1);
    assert_eq!(params_of(replies(&acts)[0].1), (1, 1));
    assert_eq!(c.params()[1], -2.0);
}

#[test]
fn a_late_push_after_the_others_left_is_applied_at_once() {
    let (mut c, t0) = backed(3, 1);
    c.handle(step(1, 0, 0, sparse(vec![1], vec![2.0])), t0);
    c.handle(step(2, 1, 0, sparse(vec![1], vec![2.0])), t0);
    // The fast ranks finish and leave; the late push is the only one
    // the next update will ever get.
    for rank in [0, 1] {
        c.handle(
            Event::Left {
                rank,
                conn: Some(100 + u64::from(rank)),
            },
            t0,
        );
    }
    let acts = c.handle(step(3, 2, 0, sparse(vec![1], vec![2.0])), t0);
    assert_eq!(c.version(), 2);
    assert_eq!(params_of(replies(&acts)[0].1), (2, 2));
    assert_eq!(c.params()[1], -4.0);
    assert_eq!(c.stats().late_pushes, 1);
}

fn make_up(reply: ReplyId, rank: u32, skipped: Vec<u64>, trained: u64) -> Event {
    Event::MakeUp {
        reply,
        conn: 100 + u64::from(rank),
        rank,
        skipped,
        trained,
    }
}

fn round_of(r: &Response) -> (u64, Vec<(u64, u32)>, Vec<u64>) {
    match r {
        Response::MakeUp {
            next_step,
            orphans,
            trained,
            ..
        } => (
            *next_step,
            orphans.iter().map(|o| (o.step, o.rank)).collect(),
            trained.clone(),
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_make_up_round_waits_for_every_rank_and_applies_the_last_late_push() {
    let (mut c, t0) = backed(3, 1);
    // Step 0 without rank 2, whose push is late.
    c.handle(step(1, 0, 0, sparse(vec![1], vec![2.0])), t0);
    c.handle(step(2, 1, 0, sparse(vec![1], vec![2.0])), t0);
    assert_eq!(c.version(), 1);
    // The fast ranks' streams are done: they ask for the round (rank 0
    // had missed step 3 of an earlier epoch, say).
    assert!(replies(&c.handle(make_up(3, 0, vec![], 4), t0)).is_empty());
    assert!(replies(&c.handle(make_up(4, 1, vec![], 4), t0)).is_empty());
    // Rank 2's late push of step 0 is folded into an update nobody else
    // will push to: it is applied at once, with rank 2's push alone.
    let acts = c.handle(step(5, 2, 0, sparse(vec![1], vec![2.0])), t0);
    assert_eq!(c.version(), 2);
    assert_eq!(params_of(replies(&acts)[0].1), (2, 2));
    assert_eq!(c.stats().late_pushes, 1);
    // Rank 2 skipped step 1 (the cluster made it without it) and asks:
    // the round is decided and everyone gets the same answer.
    let acts = c.handle(make_up(6, 2, vec![1], 1), t0);
    let mut r = replies(&acts);
    r.sort_by_key(|(to, _)| *to);
    assert_eq!(
        r.iter().map(|(to, _)| *to).collect::<Vec<_>>(),
        vec![3, 4, 6]
    );
    for (_, resp) in &r {
        assert_eq!(round_of(resp), (2, vec![(1, 2)], vec![4, 4, 1]));
    }
    // A retry gets the same round.
    let acts = c.handle(make_up(7, 0, vec![], 4), t0);
    assert_eq!(round_of(replies(&acts)[0].1).1, vec![(1, 2)]);
    // The make-up steps wait for every live rank: no backups any more.
    c.handle(step(8, 0, 2, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(9, 1, 2, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(c.version(), 2, "the slow rank's make-up push is awaited");
    let acts = c.handle(step(10, 2, 2, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(c.version(), 3);
    assert_eq!(replies(&acts).len(), 3);
}

#[test]
fn a_rank_that_leaves_before_the_round_has_its_batches_made_up_by_the_others() {
    let (mut c, t0) = backed(3, 1);
    // Ranks 0 and 1 make five steps without rank 2.
    for s in 0..5u64 {
        c.handle(step(20 + 2 * s, 0, s, sparse(vec![1], vec![1.0])), t0);
        c.handle(step(21 + 2 * s, 1, s, sparse(vec![1], vec![1.0])), t0);
    }
    assert_eq!(c.version(), 5);
    c.handle(make_up(1, 0, vec![4], 9), t0);
    c.handle(make_up(2, 2, vec![0, 2], 3), t0);
    // Rank 2 asked, then left: its skipped steps stay in the round, its
    // weight goes (nobody deals it a batch).
    c.handle(
        Event::Left {
            rank: 2,
            conn: Some(102),
        },
        t0,
    );
    assert_eq!(
        c.parked(),
        1,
        "rank 2's parked ask went with its connection"
    );
    let acts = c.handle(make_up(3, 1, vec![], 10), t0);
    let r = replies(&acts);
    assert_eq!(r.len(), 2);
    for (_, resp) in r {
        assert_eq!(
            round_of(resp),
            (5, vec![(0, 2), (2, 2), (4, 0)], vec![9, 10, 0])
        );
    }
}

#[test]
fn make_up_asks_are_checked() {
    let (mut c, t0) = backed(2, 0);
    let acts = c.handle(make_up(1, 0, vec![], 1), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::WrongStep));
    let (mut c, t0) = backed(2, 1);
    let acts = c.handle(make_up(1, 0, vec![2, 1], 1), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::OutOfRange));
    let acts = c.handle(make_up(2, 0, vec![0], 1), t0);
    assert_eq!(
        code(replies(&acts)[0].1),
        Some(ErrorCode::OutOfRange),
        "step 0 was not made yet"
    );
    assert_eq!(c.parked(), 0);
}

//! Global-norm clipping across shards: shares, totals and the update
//! between them.

use super::*;

const CLIP: f32 = 1.0;

/// A BSP shard of `workers` ranks (SGD, lr 1) that shares its norm.
fn shared(workers: u32) -> (ShardCore, Instant) {
    let mut s = setup(workers, 0.0, SyncMode::Bsp);
    s.rule.clip_grad_norm = CLIP;
    s.shared_norm = true;
    serving_with(s)
}

fn dense(values: Vec<f32>) -> WireGrad {
    WireGrad::Dense(WireValues::F32(values))
}

fn total(reply: ReplyId, rank: u32, step: u64, total: Option<f64>) -> Event {
    Event::NormTotal {
        reply,
        conn: 100 + u64::from(rank),
        rank,
        step,
        have_version: Some(step),
        total,
    }
}

/// The share in a reply, with the total it carries.
fn share_of(r: &Response) -> Option<(u64, f64, Option<f64>)> {
    match r {
        Response::NormShare {
            step,
            sum_sq,
            total_sum_sq,
            ..
        } => Some((*step, *sum_sq, *total_sum_sq)),
        _ => None,
    }
}

fn version_of(r: &Response) -> Option<u64> {
    match r {
        Response::Params { version, .. } => Some(*version),
        _ => None,
    }
}

/// Grad of rank 0 and rank 1; their mean is (2, 1, 0, ..., 0, 4) with a
/// squared norm of 21.
fn grads() -> (Vec<f32>, Vec<f32>) {
    let mut a = vec![0.0; 8];
    let mut b = vec![0.0; 8];
    (a[0], a[1], a[7]) = (1.0, 2.0, 8.0);
    (b[0], b[1], b[7]) = (3.0, 0.0, 0.0);
    (a, b)
}

/// Both ranks pushed step 0: returns the replies to the second push.
fn both_pushed(c: &mut ShardCore, t0: Instant) -> Vec<Action> {
    let (a, b) = grads();
    assert!(replies(&c.handle(step(1, 0, 0, dense(a)), t0)).is_empty());
    c.handle(step(2, 1, 0, dense(b)), t0)
}

#[test]
fn a_complete_barrier_answers_every_push_with_the_shard_share_and_waits_for_a_total() {
    let (mut c, t0) = shared(2);
    let acts = both_pushed(&mut c, t0);
    let r = replies(&acts);
    assert_eq!(r.len(), 2, "{acts:?}");
    for (_, resp) in &r {
        let (step, sum_sq, known) = share_of(resp).expect("a share");
        assert_eq!(step, 0);
        assert!((sum_sq - 21.0).abs() < 1e-9, "{sum_sq}");
        assert_eq!(known, None);
    }
    // No update yet: the shard waits for the total.
    assert_eq!(c.version(), 0);
    assert_eq!(c.params(), &[0.0; 8]);
    assert!(!acts.iter().any(|a| matches!(a, Action::Applied { .. })));
}

#[test]
fn the_first_total_applies_the_update_scaled_by_the_global_norm() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    // The other shards hold the rest of the gradient: the whole norm is 10.
    let acts = c.handle(total(3, 0, 0, Some(100.0)), t0);
    let r = replies(&acts);
    assert_eq!(r.len(), 1, "{acts:?}");
    assert_eq!(version_of(r[0].1), Some(1));
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Applied { version: 1, .. })));
    let factor = f64::from(CLIP) / (10.0 + 1e-6);
    let want = |g: f64| (-(g * factor)) as f32;
    let p = c.params();
    for (i, g) in [(0, 2.0), (1, 1.0), (7, 4.0)] {
        assert!(
            (p[i] - want(g)).abs() < 1e-6,
            "{i}: {} vs {}",
            p[i],
            want(g)
        );
    }
    assert_eq!(&p[2..7], &[0.0; 5]);
    let stats = c.stats();
    assert_eq!((stats.norm_rounds, stats.norm_clipped), (1, 1));
}

#[test]
fn a_total_under_the_bound_applies_the_plain_mean() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    // Norm 0.5 <= 1: no clipping.
    c.handle(total(3, 1, 0, Some(0.25)), t0);
    assert_eq!(c.version(), 1);
    assert_eq!(c.params()[..2], [-2.0, -1.0]);
    assert_eq!(c.params()[7], -4.0);
    assert_eq!((c.stats().norm_rounds, c.stats().norm_clipped), (1, 0));
}

#[test]
fn later_totals_for_an_applied_step_change_nothing() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    c.handle(total(3, 0, 0, Some(100.0)), t0);
    let after = c.params().to_vec();
    // The same total, and a different one: answered with the parameters.
    for (reply, t) in [(4, 100.0), (5, 1.0)] {
        let acts = c.handle(total(reply, 1, 0, Some(t)), t0);
        let r = replies(&acts);
        assert_eq!(r.len(), 1);
        assert_eq!(version_of(r[0].1), Some(1));
        assert!(!acts.iter().any(|a| matches!(a, Action::Applied { .. })));
    }
    assert_eq!(c.params(), &after[..]);
    assert_eq!(c.version(), 1);
    assert_eq!(c.stats().duplicate_totals, 2);
    assert_eq!(c.stats().norm_rounds, 1);
}

#[test]
fn a_worker_that_leaves_between_the_phases_stalls_nothing() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    // Rank 1 dies after the shares went out: rank 0's total suffices.
    c.handle(
        Event::Left {
            rank: 1,
            conn: Some(101),
        },
        t0,
    );
    assert_eq!(c.version(), 0, "leaving applies nothing by itself");
    let acts = c.handle(total(3, 0, 0, Some(100.0)), t0);
    assert_eq!(version_of(replies(&acts)[0].1), Some(1));
    assert_eq!(c.version(), 1);
}

#[test]
fn a_worker_that_leaves_before_pushing_completes_the_barrier_with_the_shares() {
    let (mut c, t0) = shared(2);
    let (a, _) = grads();
    assert!(replies(&c.handle(step(1, 0, 0, dense(a)), t0)).is_empty());
    let acts = c.handle(
        Event::Left {
            rank: 1,
            conn: Some(101),
        },
        t0,
    );
    let r = replies(&acts);
    assert_eq!(r.len(), 1, "{acts:?}");
    // The mean over the one push: (1, 2, 0, ..., 8), squared norm 69.
    let (_, sum_sq, _) = share_of(r[0].1).expect("a share");
    assert!((sum_sq - 69.0).abs() < 1e-9, "{sum_sq}");
    c.handle(total(2, 0, 0, Some(sum_sq)), t0);
    assert_eq!(c.version(), 1);
}

#[test]
fn a_push_after_the_shares_went_out_gets_the_share_and_is_not_counted() {
    let (mut c, t0) = shared(2);
    let (a, b) = grads();
    c.handle(step(1, 0, 0, dense(a)), t0);
    c.handle(
        Event::Left {
            rank: 1,
            conn: Some(101),
        },
        t0,
    );
    // Rank 1 is back on a new connection and pushes the step whose
    // barrier completed without it.
    c.handle(Event::Joined { rank: 1, conn: 201 }, t0);
    let acts = c.handle(
        Event::Step {
            reply: 2,
            conn: 201,
            rank: 1,
            step: 0,
            have_version: Some(0),
            rate: 0.0,
            grad: dense(b),
        },
        t0,
    );
    let (_, sum_sq, _) = share_of(replies(&acts)[0].1).expect("a share");
    assert!(
        (sum_sq - 69.0).abs() < 1e-9,
        "rank 0's push alone: {sum_sq}"
    );
    assert_eq!((c.stats().pushes, c.stats().fenced), (1, 1));
    c.handle(total(3, 0, 0, Some(0.0)), t0);
    // The update is rank 0's push alone.
    assert_eq!(c.params()[..2], [-1.0, -2.0]);
}

#[test]
fn an_empty_total_waits_for_another_workers_total() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    assert!(replies(&c.handle(total(3, 0, 0, None), t0)).is_empty());
    assert_eq!(c.version(), 0);
    let acts = c.handle(total(4, 1, 0, Some(100.0)), t0);
    let mut to: Vec<ReplyId> = replies(&acts).iter().map(|(to, _)| *to).collect();
    to.sort_unstable();
    assert_eq!(to, vec![3, 4]);
    assert!(replies(&acts).iter().all(|(_, r)| version_of(r) == Some(1)));
}

#[test]
fn a_parked_total_times_out_when_no_total_comes() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    c.handle(total(3, 0, 0, None), t0);
    let later = t0 + CoreSettings::default().request_timeout + Duration::from_secs(1);
    let acts = c.handle(Event::Tick, later);
    let r = replies(&acts);
    assert_eq!(r.len(), 1);
    assert_eq!(code(r[0].1), Some(ErrorCode::Timeout));
    // The round is still open: a total applies it.
    c.handle(total(4, 1, 0, Some(21.0)), later);
    assert_eq!(c.version(), 1);
}

#[test]
fn retried_pushes_get_the_same_share_and_after_the_update_the_total_too() {
    let (mut c, t0) = shared(2);
    both_pushed(&mut c, t0);
    let (a, _) = grads();
    let acts = c.handle(step(5, 0, 0, dense(a.clone())), t0);
    let (_, sum_sq, known) = share_of(replies(&acts)[0].1).expect("a share");
    assert!((sum_sq - 21.0).abs() < 1e-9);
    assert_eq!(known, None);
    c.handle(total(6, 1, 0, Some(100.0)), t0);
    let acts = c.handle(step(7, 0, 0, dense(a)), t0);
    let (step0, sum_sq, known) = share_of(replies(&acts)[0].1).expect("a share");
    assert_eq!(step0, 0);
    assert!((sum_sq - 21.0).abs() < 1e-9);
    assert_eq!(known, Some(100.0));
    assert_eq!(c.stats().pushes, 2, "retries are not counted again");
}

#[test]
fn totals_for_a_step_without_shares_are_refused() {
    let (mut c, t0) = shared(2);
    let (a, _) = grads();
    c.handle(step(1, 0, 0, dense(a)), t0);
    // The barrier is open: no share went out.
    let acts = c.handle(total(2, 0, 0, Some(1.0)), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::WrongStep));
    let acts = c.handle(total(3, 0, 4, Some(1.0)), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::WrongStep));
    let acts = c.handle(total(4, 0, 0, Some(f64::NAN)), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::NonFinite));
    // A shard that clips alone takes no totals.
    let (mut alone, t0) = serving(1, 0.0, SyncMode::Bsp);
    let acts = alone.handle(total(5, 0, 0, Some(1.0)), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::BadFrame));
    assert_eq!(c.version(), 0);
}

#[test]
fn with_its_own_share_as_the_total_the_round_equals_one_pass_clipping() {
    // One shard clipping in one pass, and the same shard sharing its norm
    // and getting its own share back: the same parameters, bit for bit.
    let mut one = setup(2, 0.0, SyncMode::Bsp);
    one.rule.clip_grad_norm = CLIP;
    let (mut alone, t0) = serving_with(one);
    let (a, b) = grads();
    alone.handle(step(1, 0, 0, dense(a)), t0);
    alone.handle(step(2, 1, 0, dense(b)), t0);
    let (mut c, t0) = shared(2);
    let acts = both_pushed(&mut c, t0);
    let (_, sum_sq, _) = share_of(replies(&acts)[0].1).unwrap();
    c.handle(total(3, 0, 0, Some(sum_sq)), t0);
    assert_eq!(c.version(), 1);
    assert_eq!(alone.version(), 1);
    assert_eq!(c.params(), alone.params());
    assert_ne!(c.params()[7], -4.0, "the update was clipped");
}

#[test]
fn asp_shards_never_share_norms() {
    let mut s = setup(2, 0.0, SyncMode::Asp);
    s.rule.clip_grad_norm = CLIP;
    s.shared_norm = true;
    let (mut c, t0) = serving_with(s);
    let (a, _) = grads();
    let acts = c.handle(step(1, 0, 0, dense(a)), t0);
    assert_eq!(version_of(replies(&acts)[0].1), Some(1));
}

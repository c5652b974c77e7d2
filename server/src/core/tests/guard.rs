use super::*;
use crate::core::guard::NORM_CHUNK;

#[test]
fn bad_pushes_are_refused_without_side_effects() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
    c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
    let before = (c.params().to_vec(), c.version(), c.parked());
    let cases = [
        (sparse(vec![8], vec![1.0]), ErrorCode::OutOfRange),
        (sparse(vec![3, 3], vec![1.0, 1.0]), ErrorCode::OutOfRange),
        (sparse(vec![1, 2], vec![1.0]), ErrorCode::WrongLength),
        (sparse(vec![1], vec![f32::NAN]), ErrorCode::NonFinite),
        (sparse(vec![1], vec![f32::INFINITY]), ErrorCode::NonFinite),
        (
            WireGrad::Dense(WireValues::F32(vec![0.0; 3])),
            ErrorCode::WrongLength,
        ),
    ];
    for (i, (grad, want)) in cases.into_iter().enumerate() {
        let acts = c.handle(step(10 + i as u64, 1, 0, grad), t0);
        assert_eq!(code(replies(&acts)[0].1), Some(want));
    }
    // A rank on a connection that is not its barrier connection.
    let acts = c.handle(
        Event::Step {
            reply: 20,
            conn: 555,
            rank: 1,
            step: 0,
            have_version: None,
            rate: 0.0,
            grad: sparse(vec![1], vec![1.0]),
        },
        t0,
    );
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::UnknownWorker));
    assert_eq!((c.params().to_vec(), c.version(), c.parked()), before);
    let acts = c.handle(step(30, 1, 0, sparse(vec![2], vec![3.0])), t0);
    assert_eq!(replies(&acts).len(), 2);
    assert_eq!(c.params()[2], -2.0);
}

#[test]
fn gradient_norm_is_bounded() {
    let t0 = Instant::now();
    let mut settings = CoreSettings {
        max_grad_norm: 1.0,
        ..CoreSettings::default()
    };
    let mut c = ShardCore::new(setup(1, 0.0, SyncMode::Bsp), settings.clone(), None);
    c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
    c.handle(offer(0, 0, vec![0.0; 8]), t0);
    c.handle(step(1, 0, 0, sparse(vec![0, 1], vec![3.0, 4.0])), t0);
    assert_eq!(c.stats().clipped, 1);
    assert!((c.params()[0] + 0.6).abs() < 1e-6 && (c.params()[1] + 0.8).abs() < 1e-6);
    settings.norm_policy = GradNormPolicy::Refuse;
    let mut c = joined(1, settings, t0);
    c.handle(offer(0, 0, vec![0.0; 8]), t0);
    let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![1e30])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::GradientTooLarge));
    assert_eq!(c.params(), &[0.0; 8]);
}

/// Rank 0 pushes `honest` to entry 0 and rank 1 pushes `rank1` to entry
/// 1, for `steps` BSP steps; returns the step's replies.
fn bsp_step(c: &mut ShardCore, at: u64, honest: f32, rank1: f32, t0: Instant) -> Vec<Response> {
    let mut acts = c.handle(step(2 * at, 0, at, sparse(vec![0], vec![honest])), t0);
    acts.extend(c.handle(step(2 * at + 1, 1, at, sparse(vec![1], vec![rank1])), t0));
    replies(&acts).into_iter().map(|(_, r)| r.clone()).collect()
}

#[test]
fn a_huge_push_from_one_rank_is_neutralised_by_default() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
    for at in 0..5 {
        assert_eq!(bsp_step(&mut c, at, 1.0, 1.0, t0).len(), 2);
    }
    assert_eq!(c.params()[..2], [-2.5, -2.5]);
    // Rank 1 pushes 3e38: scaled down to the median norm (1.0).
    let answers = bsp_step(&mut c, 5, 1.0, 3e38, t0);
    assert!(answers
        .iter()
        .all(|a| matches!(a, Response::Params { version: 6, .. })));
    assert_eq!(c.params()[..2], [-3.0, -3.0]);
    assert!(c.params().iter().all(|p| p.is_finite()));
    let stats = c.stats();
    assert_eq!((stats.anomalies, stats.clipped, stats.refused), (1, 0, 0));
    // Under the refuse policy the push is refused; the honest rank's
    // push waits for rank 1's next one.
    let settings = CoreSettings {
        norm_policy: GradNormPolicy::Refuse,
        ..CoreSettings::default()
    };
    let mut c = joined(2, settings, t0);
    for r in 0..2 {
        c.handle(offer(r, 0, vec![0.0; 8]), t0);
    }
    for at in 0..3 {
        bsp_step(&mut c, at, 1.0, 1.0, t0);
    }
    let answers = bsp_step(&mut c, 3, 1.0, 3e38, t0);
    assert!(
        matches!(
            &answers[..],
            [Response::Error { code: ErrorCode::GradientTooLarge, message }] if message.contains("server.grad_anomaly_factor")
        ),
        "{answers:?}"
    );
    let acts = c.handle(step(100, 1, 3, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(replies(&acts).len(), 2);
    assert_eq!(c.params()[..2], [-2.0, -2.0]);
    // The very first push is held by the ceiling alone.
    let (mut c, t0) = serving(1, 0.0, SyncMode::Bsp);
    c.handle(step(1, 0, 0, sparse(vec![0], vec![3e38])), t0);
    assert!((c.params()[0] + 1.0e6).abs() < 1.0, "{}", c.params()[0]);
    assert_eq!(c.stats().clipped, 1);
}

#[test]
fn push_norms_are_exact_enough_and_do_not_overflow() {
    let small: Vec<f32> = (0..13).map(|i| i as f32).collect();
    let want = (0..13).map(|i| (i * i) as f64).sum::<f64>().sqrt();
    assert!((push_norm(&WireValues::F32(small)) - want).abs() < 1e-9);
    let big = vec![3e38f32; 3 * NORM_CHUNK + 5];
    let norm = push_norm(&WireValues::F32(big.clone()));
    let want = 3e38f64 * ((3 * NORM_CHUNK + 5) as f64).sqrt();
    assert!(
        norm.is_finite() && ((norm - want) / want).abs() < 1e-6,
        "{norm}"
    );
    assert_eq!(
        norm,
        push_norm(&WireValues::F32(big)),
        "same order every time"
    );
}

#[test]
fn ordinary_norm_changes_are_not_anomalies() {
    let (mut c, t0) = serving(1, 0.0, SyncMode::Asp);
    // Norms wander over two orders of magnitude, as in a real run (a
    // fixed sequence, so the test is deterministic).
    let mut x: u32 = 12345;
    for at in 0..500 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let scale = 0.1 + 9.9 * f64::from(x >> 16) as f32 / 65536.0;
        let grad = sparse(vec![0, 3, 5], vec![0.5 * scale, -0.2 * scale, 0.1 * scale]);
        let acts = c.handle(step(at, 0, at, grad), t0);
        assert!(matches!(replies(&acts)[..], [(_, Response::Params { .. })]));
    }
    let stats = c.stats();
    assert_eq!(
        (stats.anomalies, stats.clipped, stats.refused, stats.updates),
        (0, 0, 0, 500)
    );
}

#[test]
fn the_sum_of_one_updates_pushes_stays_finite() {
    // With every bound off, finite pushes whose sum overflows: the push
    // that would overflow is refused, the others are applied.
    let settings = CoreSettings {
        grad_norm_ceiling: 0.0,
        grad_anomaly_factor: 0.0,
        ..CoreSettings::default()
    };
    let t0 = Instant::now();
    let mut c = joined(3, settings, t0);
    for r in 0..3 {
        c.handle(offer(r, 0, vec![0.0; 8]), t0);
    }
    let big = 0.8e37f32;
    for r in 0..2 {
        assert!(
            replies(&c.handle(step(r.into(), r, 0, sparse(vec![0], vec![big])), t0)).is_empty()
        );
    }
    let acts = c.handle(step(2, 2, 0, sparse(vec![0], vec![big])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::GradientTooLarge));
    let acts = c.handle(step(3, 2, 0, sparse(vec![0], vec![1.0])), t0);
    assert_eq!(replies(&acts).len(), 3);
    assert!(c.params()[0].is_finite() && c.params()[0] < -1e36);
}

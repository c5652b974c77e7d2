use super::*;

#[test]
fn parked_replies_are_bounded_expire_and_die_with_their_connection() {
    let t0 = Instant::now();
    let settings = CoreSettings {
        request_timeout: Duration::from_secs(5),
        max_parked_per_conn: 2,
        ..CoreSettings::default()
    };
    let mut c = ShardCore::new(setup(2, 0.0, SyncMode::Bsp), settings, None);
    c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
    c.handle(Event::Joined { rank: 1, conn: 101 }, t0);
    c.handle(offer(0, 0, vec![0.0; 8]), t0);
    c.handle(offer(1, 0, vec![0.0; 8]), t0);
    c.handle(step(1, 0, 0, sparse(vec![1], vec![1.0])), t0);
    c.handle(step(2, 0, 0, sparse(vec![1], vec![1.0])), t0);
    let acts = c.handle(step(3, 0, 0, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::TooManyPending));
    assert_eq!(c.parked(), 2);
    assert!(replies(&c.handle(Event::Tick, t0 + Duration::from_secs(4))).is_empty());
    let acts = c.handle(Event::Tick, t0 + Duration::from_secs(5));
    let r = replies(&acts);
    assert_eq!(r.len(), 2);
    assert!(r
        .iter()
        .all(|(_, resp)| code(resp) == Some(ErrorCode::Timeout)));
    assert_eq!(c.stats().timeouts, 2);
    // A closed connection takes its parked replies with it, and says
    // which reply slots to release.
    c.handle(step(4, 0, 0, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(c.parked(), 1);
    let acts = c.handle(Event::ConnClosed { conn: 100 }, t0);
    assert_eq!(c.parked(), 0);
    assert!(matches!(acts[..], [Action::Forget { to: 4 }]), "{acts:?}");
    // So does a rank that leaves on its connection.
    c.handle(step(5, 0, 0, sparse(vec![1], vec![1.0])), t0);
    let acts = c.handle(
        Event::Left {
            rank: 0,
            conn: Some(100),
        },
        t0,
    );
    assert!(
        acts.iter().any(|a| matches!(a, Action::Forget { to: 5 })),
        "{acts:?}"
    );
    assert_eq!(c.parked(), 0);
}

#[test]
fn leaving_releases_the_barrier_and_stale_connections_are_ignored() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
    c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
    // Rank 1 reconnected on 201 before its old connection 101 was seen to die.
    c.handle(Event::Joined { rank: 1, conn: 201 }, t0);
    c.handle(
        Event::Left {
            rank: 1,
            conn: Some(101),
        },
        t0,
    );
    assert_eq!(
        c.version(),
        0,
        "the stale connection's departure changes nothing"
    );
    let acts = c.handle(
        Event::Left {
            rank: 1,
            conn: Some(201),
        },
        t0,
    );
    assert_eq!(c.version(), 1);
    assert!(matches!(
        replies(&acts)[..],
        [(
            1,
            Response::Params {
                live_workers: 1,
                ..
            }
        )]
    ));
    assert_eq!(c.params()[0], -1.0);
}

#[test]
fn a_worker_that_crashed_after_pushing_rejoins_with_the_same_step() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
    c.handle(step(1, 1, 0, sparse(vec![0], vec![2.0])), t0);
    // Rank 1 dies after its push; its replacement joins on a new connection.
    c.handle(Event::ConnClosed { conn: 101 }, t0);
    c.handle(
        Event::Left {
            rank: 1,
            conn: Some(101),
        },
        t0,
    );
    // Rank 0 alone completes step 0 (with rank 1's push in it).
    let acts = c.handle(step(2, 0, 0, sparse(vec![0], vec![4.0])), t0);
    assert_eq!(replies(&acts).len(), 1);
    assert_eq!(c.params()[0], -3.0);
    c.handle(Event::Joined { rank: 1, conn: 301 }, t0);
    let acts = c.handle(
        Event::Offer {
            reply: 3,
            conn: 301,
            rank: 1,
            version: 0,
            next_step: 0,
            values: vec![9.0; 8],
        },
        t0,
    );
    match replies(&acts)[..] {
        [(
            3,
            Response::Params {
                version: 1,
                next_step: 1,
                update: ParamUpdate::Dense(v),
                ..
            },
        )] => assert_eq!(v[0], -3.0),
        ref other => panic!("{other:?}"),
    }
    // Its retry of step 0 is answered, not refused; step 1 waits for both.
    let acts = c.handle(
        Event::Step {
            reply: 4,
            conn: 301,
            rank: 1,
            step: 0,
            have_version: Some(1),
            rate: 0.0,
            grad: sparse(vec![0], vec![1.0]),
        },
        t0,
    );
    assert!(matches!(
        replies(&acts)[..],
        [(4, Response::Params { version: 1, .. })]
    ));
    assert!(replies(&c.handle(
        Event::Step {
            reply: 5,
            conn: 301,
            rank: 1,
            step: 1,
            have_version: Some(1),
            rate: 0.0,
            grad: sparse(vec![0], vec![1.0])
        },
        t0
    ))
    .is_empty());
    assert_eq!(
        replies(&c.handle(step(6, 0, 1, sparse(vec![0], vec![1.0])), t0)).len(),
        2
    );
}

#[test]
fn a_rank_declared_dead_is_fenced_and_rejoins_at_the_clusters_step() {
    for mode in [SyncMode::Bsp, SyncMode::Asp] {
        let (mut c, t0) = serving(2, 0.0, mode);
        // Rank 1 falls silent before pushing step 0 and is dropped.
        c.handle(
            Event::Left {
                rank: 1,
                conn: Some(101),
            },
            t0,
        );
        // Rank 0 goes on alone: steps 0 and 1.
        c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
        c.handle(step(2, 0, 1, sparse(vec![0], vec![1.0])), t0);
        assert_eq!(c.version(), 2, "{mode:?}");
        // Rank 1 comes back on a new connection with its stale step 0.
        c.handle(Event::Joined { rank: 1, conn: 201 }, t0);
        let stale = |reply, step| Event::Step {
            reply,
            conn: 201,
            rank: 1,
            step,
            have_version: Some(0),
            rate: 0.0,
            grad: sparse(vec![0], vec![50.0]),
        };
        let acts = c.handle(stale(3, 0), t0);
        assert_eq!(
            code(replies(&acts)[0].1),
            Some(ErrorCode::Fenced),
            "{mode:?}"
        );
        let acts = c.handle(stale(4, 1), t0);
        assert_eq!(
            code(replies(&acts)[0].1),
            Some(ErrorCode::Fenced),
            "{mode:?}"
        );
        assert_eq!(c.stats().fenced, 2);
        assert_eq!(c.version(), 2, "a stale push changes nothing");
        assert_eq!(c.params()[0], -2.0);
        // Its offer gives it the cluster's parameters and step.
        let acts = c.handle(
            Event::Offer {
                reply: 5,
                conn: 201,
                rank: 1,
                version: 0,
                next_step: 0,
                values: vec![0.0; 8],
            },
            t0,
        );
        assert!(
            matches!(
                replies(&acts)[..],
                [(
                    5,
                    Response::Params {
                        version: 2,
                        next_step: 2,
                        ..
                    }
                )]
            ),
            "{mode:?}: {acts:?}"
        );
        if mode == SyncMode::Bsp {
            // Step 2 needs both ranks again.
            let mut pushed = stale(6, 2);
            if let Event::Step { have_version, .. } = &mut pushed {
                *have_version = Some(2);
            }
            assert!(replies(&c.handle(pushed, t0)).is_empty());
            let acts = c.handle(step(7, 0, 2, sparse(vec![0], vec![1.0])), t0);
            assert_eq!(replies(&acts).len(), 2);
            assert_eq!(c.version(), 3);
            // A retry of a push that was counted is still answered.
            let mut retry = stale(8, 2);
            if let Event::Step { have_version, .. } = &mut retry {
                *have_version = Some(2);
            }
            let acts = c.handle(retry, t0);
            assert!(matches!(
                replies(&acts)[..],
                [(8, Response::Params { version: 3, .. })]
            ));
        }
    }
}

#[test]
fn ranks_beyond_the_start_count_join_asp_but_not_bsp() {
    for (mode, admitted) in [(SyncMode::Asp, true), (SyncMode::Bsp, false)] {
        let t0 = Instant::now();
        let settings = CoreSettings {
            max_ranks: 3,
            ..CoreSettings::default()
        };
        let mut c = joined_with(setup(2, 0.0, mode), settings, t0);
        for r in 0..2 {
            c.handle(offer(r, 0, vec![0.0; 8]), t0);
        }
        assert!(c.is_serving());
        // Rank 0 trains two steps, then rank 2 joins.
        if mode == SyncMode::Asp {
            for s in 0..2 {
                c.handle(step(10 + s, 0, s, sparse(vec![0], vec![1.0])), t0);
            }
        }
        c.handle(Event::Joined { rank: 2, conn: 102 }, t0);
        assert_eq!(c.connected_workers(), if admitted { 3 } else { 2 });
        let acts = c.handle(step(20, 2, 0, sparse(vec![3], vec![1.0])), t0);
        let r = replies(&acts);
        if admitted {
            // It starts with the slowest live rank (rank 1, at step 0)
            // and its push is applied at once.
            assert!(
                matches!(r[..], [(20, Response::Params { next_step: 1, .. })]),
                "{r:?}"
            );
            assert_eq!(c.stats().updates, 3);
            assert_eq!(c.params()[3], -1.0 / 3.0);
        } else {
            assert_eq!(code(r[0].1), Some(ErrorCode::UnknownWorker), "{r:?}");
            assert_eq!(c.stats().updates, 0);
        }
    }
}

#[test]
fn after_a_resize_asp_ranks_start_at_the_new_split() {
    let t0 = Instant::now();
    let settings = CoreSettings {
        data: DataSplit {
            step: 7,
            samples: 7 * 64,
            world: 2,
            batch: 32,
            seed: 1,
            stable: false,
        },
        ..CoreSettings::default()
    };
    let mut c = joined_with(setup(2, 0.0, SyncMode::Asp), settings, t0);
    for r in 0..2 {
        c.handle(offer(r, 0, vec![0.0; 8]), t0);
    }
    let acts = c.handle(step(1, 0, 7, sparse(vec![0], vec![1.0])), t0);
    assert!(
        matches!(
            replies(&acts)[..],
            [(1, Response::Params { next_step: 8, .. })]
        ),
        "{acts:?}"
    );
    assert_eq!(c.snapshot().data.step, 7);
}

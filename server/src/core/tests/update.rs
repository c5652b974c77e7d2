use super::*;

#[test]
fn bsp_step_is_one_round_trip_and_idempotent() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Bsp);
    assert!(replies(&c.handle(step(1, 0, 0, sparse(vec![1], vec![2.0])), t0)).is_empty());
    // A retry of the same push (lost reply, reconnect) is not counted twice.
    assert!(replies(&c.handle(step(2, 0, 0, sparse(vec![1], vec![2.0])), t0)).is_empty());
    assert_eq!(c.stats().duplicate_pushes, 1);
    let acts = c.handle(step(3, 1, 0, sparse(vec![1, 3], vec![4.0, 2.0])), t0);
    let r = replies(&acts);
    assert_eq!(
        r.len(),
        3,
        "both parked replies of rank 0 and rank 1's reply"
    );
    assert_eq!(c.version(), 1);
    assert_eq!(c.params()[1], -3.0, "average of 2 and 4");
    assert_eq!(c.params()[3], -1.0);
    // The step's replies are one shared response (built once, and
    // encoded once by the actor), not one copy per worker.
    let shared: Vec<&Arc<Response>> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Reply { response, .. } => Some(response),
            _ => None,
        })
        .collect();
    assert!(shared.iter().all(|r| Arc::ptr_eq(r, shared[0])));
    for (_, resp) in r {
        match resp {
            Response::Params {
                version: 1,
                next_step: 1,
                update: ParamUpdate::Sparse { indices, values },
                live_workers: 2,
                ..
            } => {
                assert_eq!(indices, &vec![1, 3]);
                assert_eq!(values, &vec![-3.0, -1.0]);
            }
            other => panic!("{other:?}"),
        }
    }
    // A push for a step already applied is answered at once, not applied.
    let acts = c.handle(step(4, 0, 0, sparse(vec![1], vec![100.0])), t0);
    assert!(matches!(
        replies(&acts)[..],
        [(4, Response::Params { version: 1, .. })]
    ));
    assert_eq!(c.params()[1], -3.0);
    // A push from the future is refused.
    let acts = c.handle(step(5, 0, 3, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::WrongStep));
}

#[test]
fn sparse_momentum_free_updates_touch_only_pushed_entries() {
    let (mut c, t0) = serving(1, 0.0, SyncMode::Bsp);
    let acts = c.handle(step(1, 0, 0, sparse(vec![2, 5], vec![1.0, 1.0])), t0);
    assert!(acts.iter().any(|a| matches!(
        a,
        Action::Applied {
            version: 1,
            entries: 2
        }
    )));
    assert_eq!(c.stats().sparse_updates, 1);
    let (mut c, t0) = serving(1, 0.9, SyncMode::Bsp);
    let acts = c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
    assert!(
        acts.iter()
            .any(|a| matches!(a, Action::Applied { entries: 8, .. })),
        "momentum moves every entry"
    );
    assert!(matches!(
        replies(&acts)[0].1,
        Response::Params {
            update: ParamUpdate::Dense(_),
            ..
        }
    ));
}

/// Global top-k: two pushes of 2 entries each apply the 2 largest of
/// their mean plus the residual; the rest waits in the residual, is
/// applied when it grows, survives a checkpoint, and joins a dense update.
#[test]
fn global_topk_applies_k_entries_and_keeps_the_rest() {
    let (mut c, t0) = serving_with(ShardSetup {
        global_topk: true,
        ..setup(2, 0.0, SyncMode::Bsp)
    });
    c.handle(step(1, 0, 0, sparse(vec![0, 1], vec![4.0, 2.0])), t0);
    let acts = c.handle(step(2, 1, 0, sparse(vec![1, 3], vec![2.0, -1.0])), t0);
    // Mean: [2, 2, 0, -0.5]; k = 2 applies entries 0 and 1 (lr 1).
    assert!(acts.iter().any(|a| matches!(
        a,
        Action::Applied {
            version: 1,
            entries: 2
        }
    )));
    for (_, r) in replies(&acts) {
        match r {
            Response::Params {
                update: ParamUpdate::Sparse { indices, values },
                ..
            } => {
                assert_eq!(indices, &vec![0, 1]);
                assert_eq!(values, &vec![-2.0, -2.0]);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(c.params(), &[-2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(
        c.snapshot().residual,
        SparseGrad {
            indices: vec![3],
            values: vec![-0.5]
        }
    );
    // Next update: entry 3's residual (-0.5) plus its new mean (-1)
    // beats entry 5's 1.0 with k = 1.
    c.handle(step(3, 0, 1, sparse(vec![3], vec![-2.0])), t0);
    let acts = c.handle(step(4, 1, 1, sparse(vec![5], vec![2.0])), t0);
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Applied { entries: 1, .. })));
    assert_eq!(c.params()[3], 1.5);
    assert_eq!(c.params()[5], 0.0);
    // The residual is restored from a checkpoint at the same version.
    let ckpt = c.snapshot();
    assert_eq!(ckpt.residual.indices, vec![5]);
    let mut again = ShardCore::new(
        ShardSetup {
            global_topk: true,
            ..setup(2, 0.0, SyncMode::Bsp)
        },
        CoreSettings::default(),
        Some(ckpt.clone()),
    );
    for r in 0..2 {
        again.handle(
            Event::Joined {
                rank: r,
                conn: 100 + u64::from(r),
            },
            t0,
        );
        again.handle(offer(r, 2, c.params().to_vec()), t0);
    }
    assert_eq!(again.snapshot().residual, ckpt.residual);
    assert_eq!(again.params(), c.params());
    // A dense update applies what the residual held.
    let dense = |v: f32| WireGrad::Dense(WireValues::F32(vec![v; 8]));
    again.handle(step(5, 0, 2, dense(0.0)), t0);
    again.handle(step(6, 1, 2, dense(0.0)), t0);
    assert_eq!(again.params()[5], -1.0);
    assert!(again.snapshot().residual.is_empty());
}

#[test]
fn adamw_sparse_updates_stay_sparse_and_moments_survive_a_checkpoint() {
    use ps_shared::config::OptimizerKind;
    let adamw = || ShardSetup {
        rule: OptimizerSection {
            lr: 0.1,
            kind: OptimizerKind::Adamw,
            weight_decay: 0.01,
            ..OptimizerSection::default()
        },
        ..setup(1, 0.0, SyncMode::Bsp)
    };
    let (mut c, t0) = serving_with(adamw());
    assert_eq!(c.snapshot().momentum.len(), 16, "two moments per parameter");
    // A sparse push moves only its entry, and the reply is sparse.
    let acts = c.handle(step(1, 0, 0, sparse(vec![2], vec![1.0])), t0);
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Applied { entries: 1, .. })));
    match replies(&acts)[0].1 {
        Response::Params {
            update: ParamUpdate::Sparse { indices, values },
            ..
        } => {
            assert_eq!(indices, &vec![2]);
            // Step 1: lr * sign(g).
            assert!((values[0] + 0.1).abs() < 1e-6, "{values:?}");
        }
        other => panic!("{other:?}"),
    }
    let m = c.snapshot().momentum;
    for i in 0..8 {
        assert_eq!(m[i] != 0.0, i == 2, "first moment {i}: {}", m[i]);
        assert_eq!(m[8 + i] != 0.0, i == 2, "second moment {i}");
    }
    let dense = |v: f32| WireGrad::Dense(WireValues::F32(vec![v; 8]));
    c.handle(step(2, 0, 1, dense(0.5)), t0);
    // Restart from the checkpoint: parameters and moments come back, and
    // the next update is the same bit for bit as on the old core.
    let saved = c.snapshot();
    let mut again = ShardCore::new(adamw(), CoreSettings::default(), Some(saved.clone()));
    again.handle(Event::Joined { rank: 0, conn: 100 }, t0);
    again.handle(offer(0, 2, c.params().to_vec()), t0);
    assert!(again.is_serving());
    assert_eq!(again.snapshot().momentum, saved.momentum);
    assert_eq!(again.recovery_report().unwrap().momentum_updates_lost, 0);
    c.handle(step(3, 0, 2, dense(-0.25)), t0);
    again.handle(step(3, 0, 2, dense(-0.25)), t0);
    assert_eq!(again.params(), c.params());
    assert_eq!(again.snapshot().momentum, c.snapshot().momentum);
    // A checkpoint of another optimizer (SGD momentum: one float per
    // parameter) does not fit: the state starts from zero and the
    // report counts every update's state as lost.
    let sgd = ckpt(2, saved.params.clone(), vec![0.5; 8]);
    let mut other = ShardCore::new(adamw(), CoreSettings::default(), Some(sgd));
    other.handle(Event::Joined { rank: 0, conn: 100 }, t0);
    other.handle(offer(0, 2, saved.params.clone()), t0);
    assert_eq!(other.snapshot().momentum, vec![0.0; 16]);
    assert_eq!(other.recovery_report().unwrap().momentum_updates_lost, 2);
}

#[test]
fn a_failed_update_refuses_its_pushes_and_keeps_the_version() {
    // LARS with tensor segments that do not cover the shard: the fused
    // update cannot run.
    for mode in [SyncMode::Bsp, SyncMode::Asp] {
        let mut s = setup(1, 0.9, mode);
        s.rule.lars_eta = 0.001;
        s.segments = std::iter::once(0..4).collect();
        let t0 = Instant::now();
        let mut c = joined_with(s, CoreSettings::default(), t0);
        c.handle(offer(0, 0, vec![1.0; 8]), t0);
        let dense = WireGrad::Dense(WireValues::F32(vec![1.0; 8]));
        let acts = c.handle(step(1, 0, 0, dense), t0);
        match replies(&acts)[..] {
            [(
                1,
                Response::Error {
                    code: ErrorCode::Internal,
                    message,
                },
            )] => {
                assert!(
                    message.contains("cannot apply update 1") && message.contains("stays at 0"),
                    "{message}"
                )
            }
            ref other => panic!("{mode:?}: {other:?}"),
        }
        assert!(!acts.iter().any(|a| matches!(a, Action::Applied { .. })));
        assert_eq!((c.version(), c.params()), (0, &[1.0; 8][..]));
        assert_eq!(c.snapshot().momentum, vec![0.0; 8]);
        assert_eq!((c.stats().failed_updates, c.stats().updates), (1, 0));
        // The step is still open: nothing was counted for it, and the
        // next try meets the same refusal.
        let acts = c.handle(step(2, 0, 0, sparse(vec![0], vec![1.0])), t0);
        assert_eq!(
            code(replies(&acts)[0].1),
            Some(ErrorCode::Internal),
            "{mode:?}"
        );
        assert_eq!((c.version(), c.stats().failed_updates), (0, 2));
    }
}

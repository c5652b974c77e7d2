use super::*;

#[test]
fn a_fresh_shard_waits_for_every_copy_or_the_window() {
    let t0 = Instant::now();
    let mut c = ShardCore::new(setup(2, 0.0, SyncMode::Bsp), CoreSettings::default(), None);
    c.handle(Event::Joined { rank: 0, conn: 100 }, t0);
    assert!(replies(&c.handle(offer(0, 0, vec![1.0; 8]), t0)).is_empty());
    // A step before the shard serves is refused with a hint.
    let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0);
    assert_eq!(code(replies(&acts)[0].1), Some(ErrorCode::NotInitialized));
    assert!(c
        .handle(Event::Tick, t0 + Duration::from_secs(9))
        .is_empty());
    let acts = c.handle(Event::Tick, t0 + Duration::from_secs(10));
    let report = acts.iter().find_map(|a| match a {
        Action::Recovered(r) => Some(r.clone()),
        _ => None,
    });
    let report = report.expect("decided after the window");
    assert_eq!(
        (report.source, report.version, report.offers),
        (RecoverySource::Fresh, 0, 1)
    );
    assert!(matches!(
        replies(&acts)[..],
        [(9000, Response::Params { version: 0, .. })]
    ));
    assert_eq!(c.params(), &[1.0; 8]);
}

/// A restarted shard of `workers` ranks given `offers` (rank, version,
/// value of every entry); what it decided once every rank offered or the
/// window passed (`None`: it could start from nothing), and the replies
/// its offers got.
fn recover(
    mode: SyncMode,
    workers: u32,
    settings: CoreSettings,
    ck: Option<ShardCheckpoint>,
    offers: &[(u32, u64, f32)],
    momentum: f32,
) -> (ShardCore, Option<RecoveryReport>, Vec<Response>) {
    let t0 = Instant::now();
    let mut c = ShardCore::new(setup(workers, momentum, mode), settings, ck);
    for &(rank, _, _) in offers {
        c.handle(
            Event::Joined {
                rank,
                conn: 100 + u64::from(rank),
            },
            t0,
        );
    }
    let mut acts = Vec::new();
    for &(rank, version, value) in offers {
        acts.extend(c.handle(offer(rank, version, vec![value; 8]), t0));
    }
    acts.extend(c.handle(Event::Tick, t0 + Duration::from_secs(60)));
    let report = acts.iter().find_map(|a| match a {
        Action::Recovered(r) => Some(r.clone()),
        _ => None,
    });
    let answers = replies(&acts).into_iter().map(|(_, r)| r.clone()).collect();
    (c, report, answers)
}

#[test]
fn recovery_takes_the_newest_consistent_copy_and_checks_the_checkpoint() {
    let run = |ck: Option<ShardCheckpoint>, offers: Vec<(u32, u64, f32)>, momentum: f32| {
        let (c, report, _) = recover(
            SyncMode::Bsp,
            3,
            CoreSettings::default(),
            ck,
            &offers,
            momentum,
        );
        (c, report.expect("decided"))
    };
    // The server died after replying to two of three workers: version 8 wins, 0 lost.
    let (c, r) = run(None, vec![(0, 8, 8.0), (1, 8, 8.0), (2, 7, 7.0)], 0.0);
    assert_eq!(
        (
            r.source,
            r.version,
            r.agreeing,
            r.updates_lost,
            r.rejected,
            r.quorum
        ),
        (RecoverySource::Workers, 8, 2, 0, 0, 2)
    );
    assert_eq!(c.params(), &[8.0; 8]);
    assert_eq!(c.version(), 8);
    // Copies at the newest version disagree and no majority agrees
    // anywhere: the checkpoint, the only state the shard can check.
    let (c, r) = run(
        Some(ckpt(8, vec![8.0; 8], vec![])),
        vec![(0, 9, 1.0), (1, 9, 2.0), (2, 8, 8.0)],
        0.0,
    );
    assert_eq!(
        (r.source, r.version, r.rejected),
        (RecoverySource::Checkpoint, 8, 2)
    );
    assert_eq!(c.params(), &[8.0; 8]);
    // A checkpoint newer than every copy wins; momentum comes from it.
    let (c, r) = run(
        Some(ckpt(12, vec![12.0; 8], vec![0.5; 8])),
        vec![(0, 10, 10.0), (1, 10, 10.0), (2, 10, 10.0)],
        0.9,
    );
    assert_eq!(
        (r.source, r.version, r.momentum_updates_lost),
        (RecoverySource::Checkpoint, 12, 0)
    );
    assert_eq!(c.params(), &[12.0; 8]);
    // Copies newer than the checkpoint win; the momentum is that old.
    let (c, r) = run(
        Some(ckpt(10, vec![10.0; 8], vec![0.5; 8])),
        vec![(0, 14, 14.0), (1, 14, 14.0), (2, 14, 14.0)],
        0.9,
    );
    assert_eq!(
        (
            r.source,
            r.version,
            r.checkpoint_version,
            r.momentum_updates_lost,
            r.updates_lost
        ),
        (RecoverySource::Workers, 14, Some(10), 4, 0)
    );
    assert_eq!(c.snapshot().momentum, vec![0.5; 8]);
    // A checkpoint at the chosen version that differs is reported.
    let (_, r) = run(
        Some(ckpt(14, vec![1.0; 8], vec![])),
        vec![(0, 14, 14.0), (1, 14, 14.0), (2, 14, 14.0)],
        0.0,
    );
    assert!(r.checkpoint_mismatch);
}

#[test]
fn a_forged_offer_from_one_rank_is_not_adopted() {
    const FORGED: u64 = 1_000_000;
    // Two honest ranks agree: the majority wins, the forgery is counted.
    let (c, r, _) = recover(
        SyncMode::Bsp,
        3,
        CoreSettings::default(),
        None,
        &[(0, 50, 5.0), (1, 50, 5.0), (2, FORGED, 7.0)],
        0.0,
    );
    let r = r.expect("decided");
    assert_eq!(
        (r.source, r.version, r.agreeing, r.rejected, r.updates_lost),
        (RecoverySource::Workers, 50, 2, 1, 0)
    );
    assert_eq!((c.version(), c.params()), (50, &[5.0; 8][..]));
    // One honest rank against one forger, with a checkpoint: the shard
    // cannot tell them apart and starts from the checkpoint.
    let bounded = CoreSettings {
        recovery_max_ahead: 50,
        ..CoreSettings::default()
    };
    for settings in [CoreSettings::default(), bounded.clone()] {
        let (c, r, _) = recover(
            SyncMode::Bsp,
            2,
            settings,
            Some(ckpt(48, vec![4.8; 8], vec![])),
            &[(0, 50, 5.0), (1, FORGED, 7.0)],
            0.0,
        );
        let r = r.expect("decided");
        assert_eq!(
            (r.source, r.version, r.rejected),
            (RecoverySource::Checkpoint, 48, 2)
        );
        assert_eq!(c.params(), &[4.8; 8]);
    }
    // Without a checkpoint it starts from nothing: the offers are
    // refused with the reason, and the shard keeps waiting.
    let (c, r, answers) = recover(
        SyncMode::Bsp,
        2,
        CoreSettings::default(),
        None,
        &[(0, 50, 5.0), (1, FORGED, 7.0)],
        0.0,
    );
    assert!(r.is_none() && !c.is_serving());
    assert_eq!(answers.len(), 2);
    for a in &answers {
        match a {
            Response::Error {
                code: ErrorCode::NotInitialized,
                message,
            } => assert!(
                message.contains("no strict majority")
                    && message.contains("rank 1 at version 1000000"),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_copy_beyond_what_the_cluster_can_have_reached_is_refused() {
    let bounded = CoreSettings {
        recovery_max_ahead: 50,
        ..CoreSettings::default()
    };
    // Every rank agrees on version 1,000,000, but the checkpoint is at
    // 48 and at most 50 updates can follow it.
    let (c, r, _) = recover(
        SyncMode::Bsp,
        3,
        bounded.clone(),
        Some(ckpt(48, vec![4.8; 8], vec![])),
        &[
            (0, 1_000_000, 7.0),
            (1, 1_000_000, 7.0),
            (2, 1_000_000, 7.0),
        ],
        0.0,
    );
    let r = r.expect("decided");
    assert_eq!(
        (r.source, r.version, r.rejected),
        (RecoverySource::Checkpoint, 48, 3)
    );
    assert_eq!(c.params(), &[4.8; 8]);
    // Within the bound they are adopted.
    let (_, r, _) = recover(
        SyncMode::Bsp,
        3,
        bounded.clone(),
        Some(ckpt(48, vec![4.8; 8], vec![])),
        &[(0, 98, 9.8), (1, 98, 9.8), (2, 98, 9.8)],
        0.0,
    );
    assert_eq!(
        r.map(|r| (r.source, r.version)),
        Some((RecoverySource::Workers, 98))
    );
    // No checkpoint found though periodic ones are on: the bound counts from 0.
    let (c, r, answers) = recover(
        SyncMode::Bsp,
        3,
        bounded,
        None,
        &[
            (0, 1_000_000, 7.0),
            (1, 1_000_000, 7.0),
            (2, 1_000_000, 7.0),
        ],
        0.0,
    );
    assert!(r.is_none() && !c.is_serving());
    assert!(answers
        .iter()
        .all(|a| code(a) == Some(ErrorCode::NotInitialized)));
}

#[test]
fn one_lost_reply_in_bsp_and_diverging_copies_in_asp() {
    // BSP: the server died after replying to rank 0 only. Rank 1's copy
    // is one version behind: rank 0's copy is taken, nothing is lost.
    let (c, r, _) = recover(
        SyncMode::Bsp,
        2,
        CoreSettings::default(),
        None,
        &[(0, 8, 8.0), (1, 7, 7.0)],
        0.0,
    );
    let r = r.expect("decided");
    assert_eq!(
        (r.source, r.version, r.updates_lost, r.rejected),
        (RecoverySource::Workers, 8, 0, 0)
    );
    assert_eq!(c.params(), &[8.0; 8]);
    // Two versions apart is no lost reply: nothing to check it with.
    let (_, r, _) = recover(
        SyncMode::Bsp,
        2,
        CoreSettings::default(),
        None,
        &[(0, 9, 9.0), (1, 7, 7.0)],
        0.0,
    );
    assert!(r.is_none());
    // ASP: copies legitimately differ; without a majority the shard
    // starts from its checkpoint.
    let (c, r, _) = recover(
        SyncMode::Asp,
        2,
        CoreSettings::default(),
        Some(ckpt(10, vec![1.0; 8], vec![])),
        &[(0, 14, 14.0), (1, 13, 13.0)],
        0.0,
    );
    let r = r.expect("decided");
    assert_eq!(
        (r.source, r.version, r.rejected),
        (RecoverySource::Checkpoint, 10, 2)
    );
    assert_eq!(c.params(), &[1.0; 8]);
    // A fresh run starts from version 0 copies even without a majority.
    let (_, r, _) = recover(
        SyncMode::Asp,
        3,
        CoreSettings::default(),
        None,
        &[(0, 0, 1.0)],
        0.0,
    );
    assert_eq!(r.map(|r| r.source), Some(RecoverySource::Fresh));
}

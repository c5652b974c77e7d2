use super::*;

#[test]
fn offers_of_what_the_shard_starts_from_get_no_values_back() {
    let t0 = Instant::now();
    let mut c = joined(3, CoreSettings::default(), t0);
    // Ranks 0 and 1 start from the same initial weights, rank 2 from others.
    let init: Vec<f32> = (0..8).map(|i| i as f32 / 8.0).collect();
    let mut acts = c.handle(offer(0, 0, init.clone()), t0);
    acts.extend(c.handle(offer(1, 0, init.clone()), t0));
    acts.extend(c.handle(offer(2, 0, vec![0.5; 8]), t0));
    assert!(c.is_serving());
    let r = replies(&acts);
    assert_eq!(r.len(), 3);
    let kept = c.params().to_vec();
    for (to, resp) in r {
        let Response::Params { update, .. } = resp else {
            panic!("{resp:?}")
        };
        let offered = if to == 9002 {
            vec![0.5; 8]
        } else {
            init.clone()
        };
        let same = offered == kept;
        match update {
            ParamUpdate::Sparse { indices, .. } if same => assert!(indices.is_empty()),
            ParamUpdate::Dense(values) if !same => assert_eq!(values, &kept),
            other => panic!("reply {to}: {other:?}"),
        }
    }
    // Serving: a rejoining worker holding the current values gets none back.
    let acts = c.handle(offer(1, 0, kept.clone()), t0);
    assert!(matches!(
        replies(&acts)[..],
        [(_, Response::Params { update: ParamUpdate::Sparse { ref indices, .. }, .. })] if indices.is_empty()
    ));
    let acts = c.handle(offer(1, 0, vec![9.0; 8]), t0);
    assert!(matches!(
        replies(&acts)[..],
        [(
            _,
            Response::Params {
                update: ParamUpdate::Dense(_),
                ..
            }
        )]
    ));
}

#[test]
fn asp_answers_at_once_and_ssp_bounds_staleness() {
    let (mut c, t0) = serving(2, 0.0, SyncMode::Asp);
    let acts = c.handle(step(1, 0, 0, sparse(vec![0], vec![2.0])), t0);
    assert!(matches!(
        replies(&acts)[..],
        [(
            1,
            Response::Params {
                version: 1,
                next_step: 1,
                ..
            }
        )]
    ));
    let (mut c, t0) = serving_with(ssp(2, 1));
    assert_eq!(
        replies(&c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0)).len(),
        1,
        "step 1 is within the bound"
    );
    assert!(
        replies(&c.handle(step(2, 0, 1, sparse(vec![0], vec![1.0])), t0)).is_empty(),
        "step 2 would be 2 ahead"
    );
    let acts = c.handle(step(3, 1, 0, sparse(vec![1], vec![1.0])), t0);
    assert_eq!(
        replies(&acts).len(),
        2,
        "rank 1 catching up releases rank 0"
    );
    // A departed slow worker does not hold the others back.
    let (mut c, t0) = serving_with(ssp(2, 0));
    assert!(replies(&c.handle(step(1, 0, 0, sparse(vec![0], vec![1.0])), t0)).is_empty());
    assert_eq!(
        replies(&c.handle(
            Event::Left {
                rank: 1,
                conn: Some(101)
            },
            t0
        ))
        .len(),
        1
    );
}

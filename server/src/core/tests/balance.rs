//! Throughput balancing (`data.balance = "throughput"`): shard 0 decides
//! splits from the rates pushed with the steps and announces them in its
//! replies.

use ps_net::protocol::WireSplit;

use super::*;

fn splits_of(r: &Response) -> Vec<WireSplit> {
    match r {
        Response::Params { splits, .. } => splits.clone(),
        other => panic!("{other:?}"),
    }
}

/// One BSP step of every rank, rank `r` pushing `rates[r]`; the replies.
fn bsp_step(c: &mut ShardCore, t0: Instant, v: u64, rates: &[f32]) -> Vec<Vec<WireSplit>> {
    let mut out = Vec::new();
    for (rank, &rate) in rates.iter().enumerate() {
        let event = Event::Step {
            reply: 100 * v + rank as u64,
            conn: 100 + rank as u64,
            rank: rank as u32,
            step: v,
            have_version: Some(v),
            rate,
            grad: sparse(vec![1], vec![1.0]),
        };
        for (_, r) in replies(&c.handle(event, t0)) {
            out.push(splits_of(r));
        }
    }
    out
}

#[test]
fn the_split_follows_the_reported_rates_and_is_announced_to_every_rank() {
    let (c, t0) = serving_with(setup(3, 0.0, SyncMode::Bsp));
    // Global batch 3 x 32, a decision every 4 updates, effective 4 later.
    let mut c = c.with_balancer(Balancer::new(3, 96, 4, 4));
    for v in 0..3 {
        let replies = bsp_step(&mut c, t0, v, &[300.0, 300.0, 100.0]);
        assert_eq!(replies.len(), 3);
        assert!(
            replies.iter().all(|s| s.is_empty()),
            "no split before update 4"
        );
    }
    // Update 4 decides: every reply of step 3 carries the split from step 8.
    let replies = bsp_step(&mut c, t0, 3, &[300.0, 300.0, 100.0]);
    assert_eq!(c.version(), 4);
    let want = vec![WireSplit {
        from: 8,
        sizes: vec![41, 41, 14],
    }];
    assert_eq!(replies, vec![want.clone(); 3]);
    // Equal speeds from now on: the next decision moves toward equal
    // (smoothed), announced with the split before it.
    for v in 4..8 {
        bsp_step(&mut c, t0, v, &[300.0, 300.0, 300.0]);
    }
    let announced = c.announced_splits().to_vec();
    assert_eq!(announced.len(), 2);
    assert_eq!(announced[0].from, 8);
    assert_eq!(announced[1].from, 12);
    assert!(announced[1].sizes[2] > 14 && announced[1].sizes[2] < 32);
    assert_eq!(announced[1].sizes.iter().sum::<u64>(), 96);
}

#[test]
fn without_a_balancer_replies_carry_no_split() {
    let (mut c, t0) = serving_with(setup(2, 0.0, SyncMode::Bsp));
    for v in 0..5 {
        let replies = bsp_step(&mut c, t0, v, &[10.0, 1.0]);
        assert!(replies.iter().all(|s| s.is_empty()));
    }
}

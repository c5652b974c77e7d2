//! `bench-scale`'s cluster on its smallest configurations: the counters it
//! reports agree with each other and with what the workers sent. No time is
//! asserted.

use ps_net::protocol::{encode_request, Request, WireGrad, WireValues};
use ps_tests::scale::{run_case, CaseResult, ScaleCase};

fn check_consistent(r: &CaseResult) {
    let c = r.case;
    let steps = c.steps;
    assert_eq!(r.servers.len(), c.servers);
    assert_eq!(r.worker_sent.len(), c.workers);
    // Bytes: what the workers sent is what the servers received, and what
    // the servers sent is what the workers received.
    let sent: u64 = r.worker_sent.iter().sum();
    let received: u64 = r.worker_received.iter().sum();
    assert_eq!(sent, r.servers.iter().map(|s| s.bytes_in).sum::<u64>());
    assert_eq!(received, r.servers.iter().map(|s| s.bytes_out).sum::<u64>());
    assert_eq!(
        r.entries_pushed,
        r.servers.iter().map(|s| s.entries_pushed).sum::<u64>()
    );
    let expected_entries: u64 = r
        .servers
        .iter()
        .map(|s| (c.k_for(s.shard_len) * c.workers) as u64 * steps)
        .sum();
    assert_eq!(r.entries_pushed, expected_entries);
    for s in &r.servers {
        // One update per measured step, one push per worker and step, and
        // the warm-up step on top in the version.
        assert_eq!(s.updates, steps, "server {}", s.index);
        assert_eq!(s.pushes, steps * c.workers as u64, "server {}", s.index);
        assert_eq!(s.refused, 0);
        assert_eq!(s.final_version, steps + 1);
        assert_eq!(
            s.sparse_updates,
            if c.density.is_some() { steps } else { 0 }
        );
        // Every push frame carries at least its entries' values.
        assert!(s.bytes_in >= 4 * s.entries_pushed);
        assert!(s.bytes_out > 0);
        assert!(s.cpu_ns > 0, "the shard thread used CPU");
        // Buffers: the parameters and the aggregation buffer hold the shard;
        // momentum only in the dense runs.
        assert_eq!(s.mem_params, 4 * s.shard_len);
        assert!(s.mem_aggregation >= 5 * s.shard_len);
        // The global top-k residual counts as optimizer state.
        if c.density.is_some() && c.global_topk {
            assert!(s.mem_optimizer >= 4 * s.shard_len);
        } else {
            assert_eq!(
                s.mem_optimizer,
                if c.density.is_none() {
                    4 * s.shard_len
                } else {
                    0
                }
            );
        }
    }
    assert!(r.busiest_bytes_per_step() > 0.0);
    assert!(r.cpu_per_update_ms() > 0.0);
    assert!(r.step_ms > 0.0);
}

#[test]
fn dense_smallest_configuration_counts_consistently() {
    let case = ScaleCase {
        params: 10_000,
        density: None,
        servers: 1,
        workers: 2,
        steps: 2,
        global_topk: false,
    };
    let r = run_case(case).expect("the case runs");
    check_consistent(&r);
    // A dense push frame's size is known exactly: encode one like it.
    let frame = encode_request(&Request::Step {
        shard: 0,
        step: 1,
        have_version: Some(1),
        rate: 0.0,
        grad: WireGrad::Dense(WireValues::F32(vec![0.5; 10_000])),
    })
    .expect("encode");
    assert_eq!(r.worker_sent[0], 2 * frame.len() as u64);
    assert_eq!(r.worker_sent[0], r.worker_sent[1]);
    // Dense replies carry the whole shard back to each worker.
    assert!(r.servers[0].bytes_out >= 2 * 2 * 4 * 10_000);
}

#[test]
fn sparse_configuration_over_two_servers_counts_consistently() {
    let case = ScaleCase {
        params: 20_000,
        density: Some(0.01),
        servers: 2,
        workers: 3,
        steps: 2,
        global_topk: false,
    };
    let r = run_case(case).expect("the case runs");
    check_consistent(&r);
    // Each shard of 10 000 gets 100 entries from each worker and step.
    assert_eq!(r.entries_pushed, 2 * 3 * 2 * 100);
    // Replies are sparse deltas: far smaller than the shard.
    for s in &r.servers {
        assert!(s.bytes_out < 3 * 2 * 4 * 10_000 / 4, "{}", s.bytes_out);
    }
}

/// With global top-k each reply carries at most the k entries one worker
/// pushed, not the union of all eight workers' pushes.
#[test]
fn global_topk_bounds_replies_by_k() {
    let case = |global_topk| ScaleCase {
        params: 20_000,
        density: Some(0.01),
        servers: 1,
        workers: 8,
        steps: 2,
        global_topk,
    };
    let union = run_case(case(false)).expect("the case runs");
    let topk = run_case(case(true)).expect("the case runs");
    check_consistent(&union);
    check_consistent(&topk);
    assert_eq!(union.entries_pushed, topk.entries_pushed);
    // 200 entries per push; a union of 8 pushes at different strides holds
    // more than 4 times that, a global top-k reply at most 200.
    let (u, t) = (
        union.reply_bytes_per_worker_step(),
        topk.reply_bytes_per_worker_step(),
    );
    assert_eq!(
        u,
        union.worker_received.iter().sum::<u64>() as f64 / (8.0 * 2.0)
    );
    println!("reply bytes per worker and step: union {u:.0}, global top-k {t:.0}");
    assert!(u > 4.0 * 200.0 * 4.0, "{u}");
    assert!(t < 200.0 * (4.0 + 5.0) + 64.0, "{t}");
}

#[test]
fn a_case_without_workers_is_refused() {
    let case = ScaleCase {
        params: 100,
        density: None,
        servers: 1,
        workers: 0,
        steps: 1,
        global_topk: false,
    };
    let err = run_case(case).expect_err("no workers");
    assert!(err.to_string().contains("at least one worker"), "{err}");
}

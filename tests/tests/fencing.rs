//! Generation fencing: a worker the servers declared dead (silent past
//! `server.worker_timeout_secs`, as a paused process is) must not push its
//! stale steps when it comes back, and must go on at the cluster's step, so
//! that in BSP the final version equals the steps and every worker ends
//! with the same parameters.
//!
//! Two BSP workers are driven step by step through [`Comm`] (the driver of
//! the worker's `ClientCore`). Rank 1 freezes after a few steps: it sends
//! nothing, not even heartbeats. Rank 0's next step waits at the barrier
//! until the server drops rank 1, then goes on alone. A stale push for
//! rank 1's step is refused as `Fenced`; rank 1 then resumes with its stale
//! step, and must come back with the cluster's parameters and step instead
//! of pushing. The test waits on events (replies, steps), never on a sleep;
//! the only timer is rank 0's heartbeat interval, as a live worker's: what
//! the server measures, not a synchronisation.
//!
//! A second test runs two whole workers (`run_worker`) to `training.max_steps`
//! and pauses one of them past the worker timeout: it must come back at the
//! cluster's step, train the cluster's samples from there, and stop with the
//! others at the same step.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use ps_dataset::SyntheticSpec;
use ps_net::protocol::{ErrorCode, ParamUpdate, Request, Response, WireGrad, WireValues};
use ps_net::transport;
use ps_shared::config::CompressionKind;
use ps_tests::{
    start_loopback_server, synthetic_bucket_blocking, test_config, welcomed_connection, TestPki,
};
use ps_worker::comm::{Comm, Outgoing, ParamSource, ShardUpdate, Traffic};
use ps_worker::run::{run_worker, WorkerOptions};

/// Steps both ranks take before rank 1 freezes.
const FREEZE: u64 = 3;
/// The step the cluster is at when rank 1 resumes.
const REJOIN: u64 = 8;
/// The run's steps.
const MAX_STEPS: u64 = 12;
const LIMIT: Duration = Duration::from_secs(120);

type Held = Rc<RefCell<Vec<f32>>>;

fn apply(held: &Held, updates: Vec<ShardUpdate>) {
    let mut p = held.borrow_mut();
    for u in updates {
        let end = match &u.update {
            ParamUpdate::Dense(v) => u.offset + v.len(),
            ParamUpdate::DenseDelta16 { values, .. } => u.offset + values.len(),
            _ => p.len(),
        };
        u.update
            .apply_to(&mut p[u.offset..end])
            .expect("a shard's update fits its range");
    }
}

/// A deterministic gradient of `rank` for `step`.
fn grad(n: usize, rank: u32, step: u64) -> Outgoing {
    let g = 0.001 * f32::from(rank as u8 + 1) * (step as f32 + 1.0);
    Outgoing::Dense((0..n).map(|i| g * ((i % 7) as f32 - 3.0)).collect())
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {LIMIT:?}"))
}

/// The reply of `step` went on to the next step with `live` workers.
fn check(t: &Traffic, step: u64, live: u32) {
    assert_eq!(t.next_step, step + 1, "step {step}");
    assert_eq!(t.live_workers, live, "step {step}");
}

/// A step of both ranks together: each pushes its gradient of `step`, both
/// go on with two live workers, and each applies its reply.
async fn step_both(comms: [&Comm; 2], held: &[Held], n: usize, step: u64) {
    let (a, b) = within(
        "a step of both",
        futures::future::join(
            comms[0].step(grad(n, 0, step)),
            comms[1].step(grad(n, 1, step)),
        ),
    )
    .await;
    let (a, b) = (a.expect("rank 0 steps"), b.expect("rank 1 steps"));
    check(&a.1, step, 2);
    check(&b.1, step, 2);
    apply(&held[0], a.0);
    apply(&held[1], b.0);
}

#[test]
fn a_worker_declared_dead_is_fenced_and_rejoins_at_the_clusters_step() {
    ps_tests::log_from_env();
    let mut cfg = test_config(CompressionKind::None, 1.0, 1);
    cfg.cluster.shards_per_server = 2;
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.idle_timeout_secs = 2.0;
    cfg.server.worker_timeout_secs = 1.0;
    cfg.validate().expect("valid config");
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        cfg.cluster.servers = vec![addr.to_string()];
        let n = cfg.model.num_params();
        let held: Vec<Held> = (0..2)
            .map(|_| Rc::new(RefCell::new(vec![0.05f32; n])))
            .collect();
        let source = |h: &Held| -> ParamSource {
            let h = h.clone();
            Rc::new(move || {
                let v = h.borrow().clone();
                Box::pin(async move { v })
            })
        };
        let (c0, c1) = futures::future::join(
            Comm::connect(&cfg, 0, pki.worker(0), source(&held[0])),
            Comm::connect(&cfg, 1, pki.worker(1), source(&held[1])),
        )
        .await;
        let (c0, c1) = (Rc::new(c0.expect("rank 0 connects")), c1.expect("rank 1 connects"));
        // Rank 0 is alive throughout: it heartbeats as a worker does (the
        // worker's `CommActor` runs the same interval). This timer is not a
        // wait for anything: it is the liveness the server measures, which
        // is what keeps rank 0 in while rank 1 is dropped; no step of the
        // test waits on it.
        let beating = c0.clone();
        let beat = Duration::from_secs_f64(cfg.server.heartbeat_secs);
        let heartbeats = tokio::task::spawn_local(async move {
            let mut every = tokio::time::interval_at(tokio::time::Instant::now() + beat, beat);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                beating.heartbeat().await;
            }
        });
        let (j0, j1) = futures::future::join(c0.join(), c1.join()).await;
        apply(&held[0], j0.expect("rank 0 joins").0);
        apply(&held[1], j1.expect("rank 1 joins").0);

        for step in 0..FREEZE {
            step_both([&*c0, &c1], &held, n, step).await;
        }

        // Rank 1 freezes. Rank 0's next step waits at the barrier until the
        // server declares rank 1 dead, then the cluster goes on without it.
        for step in FREEZE..REJOIN {
            let (u, t) = within("a step of rank 0 alone", c0.step(grad(n, 0, step)))
                .await
                .expect("rank 0 steps alone");
            check(&t, step, 1);
            apply(&held[0], u);
        }

        // A stale push of rank 1 (its step FREEZE, on a connection of its
        // own) is refused as fenced, and changes nothing.
        let before = server.status().await;
        let raw = welcomed_connection(&pki.worker(1), &cfg, addr, 1).await;
        let limit = cfg.server.max_frame_bytes;
        let stale = Request::Step {
            shard: 0,
            step: FREEZE,
            have_version: Some(FREEZE),
            rate: 0.0, grad: WireGrad::Dense(WireValues::F32(vec![1e3; before[0].params.len()])),
        };
        let (resp, _) = transport::call(&raw, &stale, limit)
            .await
            .expect("stale push answered");
        let fenced_message = match resp {
            Response::Error {
                code: ErrorCode::Fenced,
                message,
            } => message,
            other => panic!("a stale push must be fenced, got {other:?}"),
        };
        assert!(
            fenced_message.contains(&format!("expects step {REJOIN}")),
            "{fenced_message}"
        );
        raw.close(0u32.into(), b"done");
        raw.closed().await;
        let after = server.status().await;
        for (b, a) in before.iter().zip(&after) {
            assert_eq!((a.version, &a.params), (b.version, &b.params));
        }

        // Rank 1 resumes with its stale step: it is not pushed; rank 1 takes
        // the cluster's parameters and step.
        let (u, t) = within("rank 1's stale step", c1.step(grad(n, 1, FREEZE)))
            .await
            .expect("rank 1 rejoins");
        apply(&held[1], u);
        assert_eq!(t.next_step, REJOIN, "rank 1 goes on at the cluster's step");
        assert!(c1.recoveries() >= 1, "rank 1 redialed");
        assert!(
            *held[0].borrow() == *held[1].borrow(),
            "rank 1 holds the cluster's parameters"
        );

        // Both go on in step to the end.
        for step in REJOIN..MAX_STEPS {
            step_both([&*c0, &c1], &held, n, step).await;
        }

        let mut status = server.status().await;
        status.sort_by_key(|s| s.shard);
        let versions: Vec<u64> = status.iter().map(|s| s.version).collect();
        assert!(
            versions.iter().all(|v| *v == MAX_STEPS),
            "final versions {versions:?}, steps {MAX_STEPS}"
        );
        let shards = status.len() as u64;
        let pushes: u64 = status.iter().map(|s| s.stats.pushes).sum();
        let expected_pushes = shards * (2 * FREEZE + (REJOIN - FREEZE) + 2 * (MAX_STEPS - REJOIN));
        assert_eq!(pushes, expected_pushes, "no stale push was counted");
        let fenced: u64 = status.iter().map(|s| s.stats.fenced).sum();
        assert_eq!(fenced, 1);
        let server_params: Vec<f32> = status.iter().flat_map(|s| s.params.clone()).collect();
        assert!(*held[0].borrow() == server_params, "rank 0 holds the servers' parameters");
        assert!(*held[1].borrow() == server_params, "rank 1 holds the servers' parameters");

        heartbeats.abort();
        let (b0, b1) = futures::future::join(c0.bye(true), c1.bye(true)).await;
        b0.expect("rank 0 leaves");
        b1.expect("rank 1 leaves");
        within("the server's end", server.wait())
            .await
            .expect("the server ends cleanly once both finished");
        println!(
            "fencing: rank 1 frozen at step {FREEZE}, dropped by the server, stale push refused as fenced, rejoined at step {}; final version {} after {MAX_STEPS} steps; pushes counted {pushes} of {expected_pushes} expected; both ranks hold the servers' {} parameters",
            t.next_step,
            versions[0],
            server_params.len()
        );
    });
}

// The rejoin can find the shards at different steps: a shard that learnt
// of the rank's return after the other rank's push for step S applied S
// alone, another waited for it. The rejoined rank then pushes S to the
// shards that expect S and takes the parameters of the one already past it
// (see `ClientCore`), so both ranks end with the same parameters.
#[test]
fn a_paused_worker_rejoins_the_run_at_the_clusters_step() {
    ps_tests::log_from_env();
    // 4096 samples in batches of 64 over 2 workers: 32 steps an epoch.
    const MAX: u64 = 100;
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 4);
    cfg.training.max_steps = MAX;
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.idle_timeout_secs = 2.0;
    cfg.server.worker_timeout_secs = 1.0;
    cfg.validate().expect("valid config");
    let pki = TestPki::new(2);
    let (store, prefix) = synthetic_bucket_blocking(&SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    });
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        let (steps_tx, mut steps0) = tokio::sync::watch::channel(0);
        let (go, resume) = tokio::sync::watch::channel(false);
        let (trained_tx, mut trained) = tokio::sync::mpsc::unbounded_channel();
        let o0 = WorkerOptions {
            steps_done: Some(steps_tx),
            ..pki.options(0)
        };
        let o1 = WorkerOptions {
            pause_after_steps: Some((FREEZE, resume)),
            trained: Some(trained_tx),
            ..pki.options(1)
        };
        let w0 = run_worker(&cfg, o0, store.clone(), prefix.clone());
        let w1 = run_worker(&cfg, o1, store.clone(), prefix.clone());
        let release = async {
            // Rank 0 gets past step FREEZE only once the server dropped the
            // paused rank 1; then rank 1 wakes up.
            steps0
                .wait_for(|s| *s >= FREEZE + 2)
                .await
                .expect("rank 0 reports its steps");
            go.send_replace(true);
        };
        let (r0, r1, ()) = within("the run", futures::future::join3(w0, w1, release)).await;
        let (r0, r1) = (r0.expect("rank 0 trains"), r1.expect("rank 1 trains"));
        let mut steps = Vec::new();
        while let Ok(b) = trained.try_recv() {
            steps.push(b.step);
        }
        // Rank 1 trained steps 0..=FREEZE (the last one stale, not
        // counted), then the cluster's steps from where it rejoined.
        let stale = FREEZE as usize;
        assert_eq!(&steps[..=stale], &(0..=FREEZE).collect::<Vec<_>>()[..]);
        // (At MAX when rank 0 had finished before rank 1 was back.)
        let rejoined = steps.get(stale + 1).copied().unwrap_or(MAX);
        assert!(rejoined > FREEZE + 1, "rank 1 went on at the cluster's step, not its own: {steps:?}");
        assert_eq!(
            &steps[stale + 1..],
            &(rejoined..MAX).collect::<Vec<_>>()[..],
            "then every step of the cluster to the end, once"
        );
        assert_eq!((r0.steps, r1.steps), (MAX, MAX), "both stop at training.max_steps");
        assert_eq!((r0.final_version, r1.final_version), (MAX, MAX));
        assert!(r0.steps_short_of_workers > 0, "rank 0 trained alone meanwhile");
        assert_eq!(
            r0.final_accuracy, r1.final_accuracy,
            "both hold the same parameters"
        );
        let status = server.status().await;
        let versions: Vec<u64> = status.iter().map(|s| s.version).collect();
        assert!(versions.iter().all(|v| *v == MAX), "versions {versions:?} after {MAX} steps");
        // Per shard: rank 0's MAX pushes, rank 1's FREEZE before the pause
        // (its stale one is not counted) and one per step from the rejoin.
        // A shard that had applied the rejoin step without rank 1 counts
        // one fewer: rank 1 took its parameters instead of pushing there.
        let per_shard = MAX + FREEZE + (MAX - rejoined);
        let counts: Vec<u64> = status.iter().map(|s| s.stats.pushes).collect();
        assert!(
            counts.iter().all(|&c| c == per_shard || c + 1 == per_shard),
            "pushes per shard {counts:?}, expected {per_shard} (or one fewer)"
        );
        let pushes: u64 = counts.iter().sum();
        let expected = status.len() as u64 * per_shard;
        let skipped = expected - pushes;
        within("the server's end", server.wait())
            .await
            .expect("the server ends cleanly once both finished");
        println!(
            "fencing: whole run, rank 1 paused after step {FREEZE} past server.worker_timeout_secs, rejoined at step {rejoined}; both stopped at step {MAX}, final version {} (steps {MAX}), pushes counted {pushes} of {expected} ({skipped} shard(s) had applied the rejoin step without rank 1), final accuracy {:.4} on both",
            versions[0], r0.final_accuracy
        );
    });
}

//! Faults during real training runs, each ending in a summary line whose
//! figures are all computed from what happened:
//!
//! * a worker crashes after pushing and a replacement rejoins;
//! * a server is killed before any checkpoint and restarts empty: it rebuilds
//!   every shard from the workers' copies;
//! * a server is stopped cleanly (SIGTERM path) with checkpoints and momentum:
//!   final checkpoint, workers wait, restart, optimizer state restored;
//! * a server dies after applying a step whose reply one worker never got:
//!   that worker's retry must not count its gradient again;
//! * a worker stopped by a signal says goodbye;
//! * ends that must never be silent: no worker joins, a peer never arrives,
//!   a server stays unreachable;
//! * an attacker sends garbage and tries to impersonate ranks during training;
//! * a certificate holder offers a forged copy to a restarted server;
//! * a certificate holder pushes gradients of 3e38 while another rank trains.
//!
//! A real `ps-server` process killed with SIGKILL is in `tests/process.rs`.
//!
//! "Updates lost" is counted from versions: in BSP every planned step must
//! be applied exactly once, so it is the planned steps minus the shards'
//! final version. Nothing here waits on a sleep: tests wait on events (a
//! worker's step counter, a shard's version, a connection closing).

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use object_store::{path::Path, ObjectStore};
use tokio::sync::watch;

use ps_dataset::SyntheticSpec;
use ps_net::protocol::{ErrorCode, ParamUpdate, Request, Response, WireGrad, WireValues};
use ps_net::transport::{self, EndpointLimits};
use ps_server::core::RecoverySource;
use ps_server::net::RunningServer;
use ps_shared::config::{ClusterConfig, CompressionKind, SyncMode};
use ps_tests::{
    hello, start_loopback_server, synthetic_bucket, synthetic_bucket_blocking, test_config,
    welcomed_connection, TestPki,
};
use ps_worker::comm::{Comm, CommError, Outgoing, ParamSource};
use ps_worker::run::{run_worker, WorkerError, WorkerOptions, WorkerReport};

const ACCURACY_BAR: f32 = 0.90;
const RUN_LIMIT: Duration = Duration::from_secs(300);
const STEPS_PER_EPOCH: u64 = 4096 / 2 / 64;

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

fn config(epochs: u64) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, epochs);
    cfg.server.heartbeat_secs = 0.25;
    cfg.server.idle_timeout_secs = 2.0;
    cfg.server.worker_timeout_secs = 5.0;
    cfg.server.connect_timeout_secs = 30;
    cfg.server.recovery_window_secs = 5.0;
    cfg
}

/// What every fault test starts from.
struct Setup {
    cfg: ClusterConfig,
    pki: TestPki,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    server: Option<RunningServer>,
}

impl Setup {
    fn server(&mut self) -> RunningServer {
        self.server.take().expect("the server was taken once")
    }

    fn opts(&self, rank: u32) -> WorkerOptions {
        self.pki.options(rank)
    }

    /// Options whose step counter the test can wait on.
    fn watched(&self, rank: u32) -> (WorkerOptions, watch::Receiver<u64>) {
        let (tx, rx) = watch::channel(0);
        let opts = WorkerOptions {
            steps_done: Some(tx),
            ..self.opts(rank)
        };
        (opts, rx)
    }
}

/// Build the [`Setup`] for `cfg` and run `body` inside an actix system.
fn with_cluster<F, Fut>(cfg: ClusterConfig, body: F)
where
    F: FnOnce(Setup) -> Fut,
    Fut: Future<Output = ()>,
{
    let pki = TestPki::new(cfg.cluster.workers as u32);
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let mut cfg = cfg;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        body(Setup {
            cfg,
            pki,
            store,
            prefix,
            server: Some(server),
        })
        .await
    });
}

async fn wait_steps(rx: &mut watch::Receiver<u64>, steps: u64) {
    let reached = tokio::time::timeout(RUN_LIMIT, rx.wait_for(|s| *s >= steps)).await;
    assert!(
        matches!(reached, Ok(Ok(_))),
        "a worker never reached step {steps}"
    );
}

#[test]
fn crashed_worker_is_dropped_and_a_replacement_rejoins() {
    with_cluster(config(6), |mut setup| async move {
        let server = setup.server();
        let planned = 6 * STEPS_PER_EPOCH;
        let (survivor_opts, mut survivor_steps) = setup.watched(0);
        let survivor = run_worker(
            &setup.cfg,
            survivor_opts,
            setup.store.clone(),
            setup.prefix.clone(),
        );
        let mut injected = 0;
        let crash_then_rejoin = async {
            let crashed = run_worker(
                &setup.cfg,
                WorkerOptions {
                    crash_after_steps: Some(40),
                    ..setup.opts(1)
                },
                setup.store.clone(),
                setup.prefix.clone(),
            )
            .await;
            injected += 1;
            assert!(
                matches!(crashed, Err(WorkerError::Crashed(40))),
                "{crashed:?}"
            );
            // The survivor goes on alone for a while (an event: its steps).
            wait_steps(&mut survivor_steps, 50).await;
            run_worker(
                &setup.cfg,
                setup.opts(1),
                setup.store.clone(),
                setup.prefix.clone(),
            )
            .await
        };
        let (a, b) = tokio::time::timeout(
            RUN_LIMIT,
            futures::future::join(survivor, crash_then_rejoin),
        )
        .await
        .expect("run finished in time");
        let (a, b) = (a.expect("survivor"), b.expect("replacement"));
        let status = server.status().await;
        server.wait().await.expect("server ends cleanly");
        assert_eq!((a.steps, b.steps), (planned, planned));
        assert!(
            b.start_step >= 50,
            "the replacement continued from step {}",
            b.start_step
        );
        assert!(
            a.steps_short_of_workers > 0,
            "the survivor says it trained short of workers"
        );
        assert_eq!(a.min_live_workers, 1);
        let final_version = status.iter().map(|s| s.version).min().unwrap_or(0);
        let lost = planned - final_version;
        assert_eq!(lost, 0);
        // The default gradient guards never fired on honest training.
        for s in &status {
            assert_eq!(
                (s.stats.anomalies, s.stats.clipped),
                (0, 0),
                "shard {}",
                s.shard
            );
        }
        for r in [&a, &b] {
            assert!(
                r.final_accuracy > ACCURACY_BAR,
                "accuracy {}",
                r.final_accuracy
            );
        }
        let survived = usize::from(a.steps == planned) + usize::from(b.steps == planned);
        println!(
            "faults: worker crash: faults injected {injected}, runs finished {survived} of 2, updates lost {lost} (survivor alone for {} steps, replacement joined at step {}, accuracy {:.2}% / {:.2}%)",
            a.steps_short_of_workers,
            b.start_step,
            100.0 * a.final_accuracy,
            100.0 * b.final_accuracy
        );
    });
}

/// What a run through a server restart left behind.
struct Restarted {
    a: WorkerReport,
    b: WorkerReport,
    /// Per shard: the version the first server held (or checkpointed, when
    /// stopped cleanly).
    held: Vec<u64>,
    /// The second server's shards at the end of the run.
    status: Vec<ps_server::actor::ShardStatus>,
    injected: u32,
}

impl Setup {
    /// Train both workers while the server is killed (or, with `clean`,
    /// stopped) once worker 0 reached step `at` and started again on the
    /// same address; the second server must end cleanly.
    async fn train_through_restart(&mut self, at: u64, clean: bool) -> Restarted {
        let first = self.server();
        let (o0, mut steps) = self.watched(0);
        let workers = futures::future::join(
            run_worker(&self.cfg, o0, self.store.clone(), self.prefix.clone()),
            run_worker(
                &self.cfg,
                self.opts(1),
                self.store.clone(),
                self.prefix.clone(),
            ),
        );
        let chaos = restart_server(&self.cfg, &self.pki, first, &mut steps, at, clean);
        let ((a, b), (held, second, injected)) =
            tokio::time::timeout(RUN_LIMIT, futures::future::join(workers, chaos))
                .await
                .expect("run finished in time");
        let status = second.status().await;
        second.wait().await.expect("server ends cleanly");
        Restarted {
            a: a.expect("worker 0"),
            b: b.expect("worker 1"),
            held,
            status,
            injected,
        }
    }
}

/// Kill (or stop) the server once worker 0 reached `at`, start a new one on
/// the same address, and return it with the version the first one held
/// per shard (for a clean stop: the versions of its final checkpoints).
async fn restart_server(
    setup_cfg: &ClusterConfig,
    pki: &TestPki,
    first: RunningServer,
    steps: &mut watch::Receiver<u64>,
    at: u64,
    clean: bool,
) -> (Vec<u64>, RunningServer, u32) {
    wait_steps(steps, at).await;
    let addr = first.local_addr();
    let mut injected = 0;
    let held = if clean {
        let saved = first.shutdown().await;
        injected += 1;
        saved.iter().map(|(_, v)| v.unwrap_or(0)).collect()
    } else {
        let held = first.status().await.iter().map(|s| s.version).collect();
        first.abort().await;
        injected += 1;
        held
    };
    let second = ps_server::net::start(setup_cfg, 0, addr, &pki.server)
        .await
        .expect("restart on the same address");
    (held, second, injected)
}

#[test]
fn server_killed_before_any_checkpoint_recovers_from_the_workers() {
    with_cluster(config(6), |mut setup| async move {
        let planned = 6 * STEPS_PER_EPOCH;
        let Restarted {
            a,
            b,
            held,
            status,
            injected,
        } = setup.train_through_restart(50, false).await;
        let reports: Vec<_> = status.iter().filter_map(|s| s.recovery.clone()).collect();
        assert_eq!(reports.len(), status.len(), "every shard recovered");
        for (r, held) in reports.iter().zip(&held) {
            assert_eq!(r.source, RecoverySource::Workers);
            assert!(
                r.version + 1 >= *held,
                "recovered at {} of {held}",
                r.version
            );
            assert_eq!(r.updates_lost, 0);
            assert_eq!(r.conflicting, 0);
        }
        let final_version = status.iter().map(|s| s.version).min().unwrap_or(0);
        let lost = planned - final_version;
        assert_eq!(lost, 0, "every planned step was applied once");
        assert_eq!((a.steps, b.steps), (planned, planned));
        assert_eq!((a.final_version, b.final_version), (planned, planned));
        assert!(
            a.recoveries > 0 && b.recoveries > 0,
            "both workers reconnected"
        );
        assert!(a.final_accuracy > ACCURACY_BAR && b.final_accuracy > ACCURACY_BAR);
        println!(
            "faults: server killed without checkpoint: faults injected {injected}, shards recovered {} from {} offers, updates lost {lost} (killed holding versions {held:?}, recovered at {:?}, accuracy {:.2}%, reconnects {}+{})",
            reports.len(),
            reports.iter().map(|r| r.offers).sum::<usize>(),
            reports.iter().map(|r| r.version).collect::<Vec<_>>(),
            100.0 * a.final_accuracy,
            a.recoveries,
            b.recoveries
        );
    });
}

#[test]
fn server_stopped_cleanly_keeps_its_momentum() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(4);
    cfg.compression.kind = CompressionKind::None;
    cfg.optimizer.momentum = 0.9;
    cfg.server.checkpoint_url = format!("file://{}", dir.path().display());
    cfg.server.checkpoint_every = 1000;
    with_cluster(cfg, |mut setup| async move {
        let planned = 4 * STEPS_PER_EPOCH;
        let Restarted {
            a,
            b,
            held,
            status,
            injected,
        } = setup.train_through_restart(30, true).await;
        let reports: Vec<_> = status.iter().filter_map(|s| s.recovery.clone()).collect();
        for (r, held) in reports.iter().zip(&held) {
            assert_eq!(
                r.checkpoint_version,
                Some(*held),
                "the final checkpoint is at the stop"
            );
            assert_eq!(r.momentum_updates_lost, 0);
            assert!(!r.checkpoint_mismatch);
            assert_eq!(r.updates_lost, 0);
        }
        let lost = planned - status.iter().map(|s| s.version).min().unwrap_or(0);
        assert_eq!(lost, 0);
        assert_eq!((a.steps, b.steps), (planned, planned));
        assert!(a.final_accuracy > ACCURACY_BAR);
        println!(
            "faults: clean server stop: faults injected {injected}, final checkpoints at versions {held:?}, momentum updates lost {}, updates lost {lost}, accuracy {:.2}%",
            reports.iter().map(|r| r.momentum_updates_lost).sum::<u64>(),
            100.0 * b.final_accuracy
        );
    });
}

#[test]
fn a_worker_stopped_by_a_signal_says_goodbye() {
    let mut cfg = config(3);
    cfg.cluster.workers = 1;
    with_cluster(cfg, |mut setup| async move {
        let server = setup.server();
        let (stop_tx, stop_rx) = watch::channel(false);
        let (o, mut steps) = setup.watched(0);
        let opts = WorkerOptions {
            stop: Some(stop_rx),
            ..o
        };
        let worker = run_worker(&setup.cfg, opts, setup.store.clone(), setup.prefix.clone());
        let signal = async {
            wait_steps(&mut steps, 10).await;
            stop_tx.send_replace(true);
        };
        let (result, ()) = futures::future::join(worker, signal).await;
        assert!(
            matches!(result, Err(WorkerError::Interrupted(_))),
            "{result:?}"
        );
        // The worker had its goodbye acknowledged before it returned.
        let goodbyes = server.finished_workers();
        assert_eq!(goodbyes, 1);
        // Its goodbye makes the one-worker cluster finish cleanly.
        let outcome = tokio::time::timeout(RUN_LIMIT, server.wait())
            .await
            .expect("server stops");
        assert!(outcome.is_ok(), "{outcome:?}");
        println!(
            "faults: worker signal: goodbyes received {goodbyes}, server exit clean {}",
            outcome.is_ok()
        );
    });
}

#[test]
fn ends_are_never_silent() {
    // No worker joins: the server exits with an error naming the timeout.
    let mut cfg = config(1);
    cfg.server.join_timeout_secs = 1.0;
    with_cluster(cfg, |mut setup| async move {
        let outcome = tokio::time::timeout(RUN_LIMIT, setup.server().wait())
            .await
            .expect("server decides");
        let message = outcome.expect_err("no worker is an error").to_string();
        assert!(message.contains("no worker joined"), "{message}");
        println!("faults: empty cluster: server exit error: {message}");
    });
    // A peer never arrives: the other trains alone and says so; the server
    // then ends with an error because rank 1 never finished.
    let mut cfg = config(2);
    cfg.server.join_timeout_secs = 2.0;
    cfg.server.all_gone_grace_secs = 1.0;
    with_cluster(cfg, |mut setup| async move {
        let server = setup.server();
        let report = run_worker(
            &setup.cfg,
            setup.opts(0),
            setup.store.clone(),
            setup.prefix.clone(),
        )
        .await
        .expect("worker 0 trains alone");
        assert!(report.steps_short_of_workers > 0);
        assert_eq!(report.min_live_workers, 1);
        let outcome = tokio::time::timeout(RUN_LIMIT, server.wait())
            .await
            .expect("server decides");
        let message = outcome
            .expect_err("an unfinished worker is an error")
            .to_string();
        assert!(message.contains("1 of 2 finished"), "{message}");
        println!(
            "faults: missing peer: steps short of workers {} of {}, server exit error: {message}",
            report.steps_short_of_workers, report.steps
        );
    });
    // A server that is not there: the worker gives up naming it.
    let mut cfg = config(1);
    cfg.server.connect_timeout_secs = 2;
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap().to_string();
        drop(socket);
        cfg.cluster.servers = vec![addr.clone()];
        let (store, prefix) = synthetic_bucket(&spec()).await;
        let result = run_worker(&cfg, pki.options(0), store, prefix).await;
        match result {
            Err(WorkerError::Comm(CommError::Unreachable { addr: a, .. })) => assert_eq!(a, addr),
            other => panic!("expected an unreachable server, got {other:?}"),
        }
        println!("faults: unreachable server: worker error names {addr}");
    });
}

#[test]
fn garbage_and_impersonation_during_training_are_refused() {
    with_cluster(config(4), |mut setup| async move {
        let server = setup.server();
        let planned = 4 * STEPS_PER_EPOCH;
        let (o0, mut steps) = setup.watched(0);
        let workers = futures::future::join(
            run_worker(&setup.cfg, o0, setup.store.clone(), setup.prefix.clone()),
            run_worker(
                &setup.cfg,
                setup.opts(1),
                setup.store.clone(),
                setup.prefix.clone(),
            ),
        );
        let addr = server.local_addr();
        let limit = setup.cfg.server.max_frame_bytes;
        let attacker = async {
            wait_steps(&mut steps, 5).await;
            let (mut tried, mut refused) = (0u32, 0u32);
            let mut x: u64 = 0x2545_f491_4f6c_dd1d;
            for _ in 0..20 {
                for (cert_rank, attack) in [(0u32, 0u8), (0, 1), (1, 2)] {
                    let tls = setup.pki.worker(cert_rank);
                    let ep = transport::client_endpoint(
                        &tls.ca_pem,
                        &tls.identity,
                        false,
                        &EndpointLimits::default(),
                    )
                    .unwrap();
                    let Ok(conn) =
                        transport::connect(&ep, addr, "localhost", Duration::from_secs(10)).await
                    else {
                        continue;
                    };
                    tried += 1;
                    let resp = match attack {
                        // Garbage instead of a Hello.
                        0 => {
                            let junk: Vec<u8> = (0..64)
                                .map(|_| {
                                    x ^= x << 13;
                                    x ^= x >> 7;
                                    x ^= x << 17;
                                    x as u8
                                })
                                .collect();
                            let mut frame = (junk.len() as u32).to_le_bytes().to_vec();
                            frame.extend_from_slice(&junk);
                            transport::call_raw(&conn, &frame, limit).await.ok()
                        }
                        // Rank 0's certificate claiming rank 1.
                        1 => transport::call(&conn, &hello(&setup.cfg, 1), limit)
                            .await
                            .ok()
                            .map(|r| r.0),
                        // Rank 1's own certificate while rank 1 is alive.
                        _ => transport::call(&conn, &hello(&setup.cfg, 1), limit)
                            .await
                            .ok()
                            .map(|r| r.0),
                    };
                    let want = [
                        ErrorCode::BadFrame,
                        ErrorCode::Unauthorized,
                        ErrorCode::RankInUse,
                    ][attack as usize];
                    if let Some(Response::Error { code, .. }) = resp {
                        refused += u32::from(
                            code == want || (attack == 0 && code == ErrorCode::Unauthorized),
                        );
                    }
                    conn.close(0u32.into(), b"done");
                }
            }
            (tried, refused)
        };
        let ((a, b), (tried, refused)) =
            tokio::time::timeout(RUN_LIMIT, futures::future::join(workers, attacker))
                .await
                .expect("run finished in time");
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        let status = server.status().await;
        server.wait().await.expect("server ends cleanly");
        let lost = planned - status.iter().map(|s| s.version).min().unwrap_or(0);
        assert_eq!((a.steps, b.steps), (planned, planned));
        assert_eq!(
            tried, refused,
            "every bad input got the expected typed error"
        );
        assert!(tried > 0);
        assert_eq!(lost, 0);
        assert_eq!(
            a.steps_short_of_workers + b.steps_short_of_workers,
            0,
            "no real worker was ejected"
        );
        assert!(
            a.final_accuracy > ACCURACY_BAR,
            "accuracy {}",
            a.final_accuracy
        );
        println!(
            "faults: garbage and impersonation: bad inputs tried {tried}, refused {refused}, real workers ejected {}, updates lost {lost}, accuracy {:.2}%",
            a.steps_short_of_workers + b.steps_short_of_workers,
            100.0 * a.final_accuracy
        );
    });
}

/// A connection of worker `rank` that said Hello, driven by the test.
async fn raw_worker(setup: &Setup, addr: std::net::SocketAddr, rank: u32) -> quinn::Connection {
    welcomed_connection(&setup.pki.worker(rank), &setup.cfg, addr, rank).await
}

#[test]
fn a_step_the_restarted_server_already_applied_is_not_pushed_again() {
    // Rank 1 pushed step 0; the server applied it, replied to rank 0 and
    // died before rank 1 had its reply. The restarted server recovers
    // version 1 from rank 0's copy, so rank 1's retry must take the
    // parameters after step 0 instead of pushing its gradient as step 1.
    let mut cfg = config(1);
    cfg.cluster.shards_per_server = 1;
    // Bounds a push that wrongly waits at the barrier.
    cfg.server.request_timeout_secs = 10.0;
    cfg.validate().expect("valid config");
    with_cluster(cfg, |mut setup| async move {
        let first = setup.server();
        let addr = first.local_addr();
        let n = setup.cfg.model.num_params();
        let limit = setup.cfg.server.max_frame_bytes;
        let start = vec![0.0f32; n];
        let held = start.clone();
        let params: ParamSource = Rc::new(move || {
            let held = held.clone();
            Box::pin(async move { held })
        });
        let comm = Comm::connect(&setup.cfg, 1, setup.pki.worker(1), params)
            .await
            .expect("rank 1 connects");
        let rank0 = raw_worker(&setup, addr, 0).await;
        let offer = |version: u64, values: Vec<f32>| Request::Offer {
            shard: 0,
            version,
            next_step: version,
            values,
        };
        let (joined, offered) = futures::future::join(
            comm.join(),
            transport::call(&rank0, &offer(0, start.clone()), limit),
        )
        .await;
        joined.expect("rank 1 joins");
        let (resp, _) = offered.expect("rank 0 offers");
        assert!(
            matches!(resp, Response::Params { version: 0, .. }),
            "{resp:?}"
        );

        // The server dies; a new one starts on the same address.
        let mut injected = 0u32;
        first.abort().await;
        injected += 1;
        let second = ps_server::net::start(&setup.cfg, 0, addr, &setup.pki.server)
            .await
            .expect("restart on the same address");
        // Rank 0 holds version 1, the parameters after step 0.
        let after_step0 = vec![-0.25f32; n];
        let rank0 = raw_worker(&setup, addr, 0).await;
        let (stepped, offered) = futures::future::join(
            comm.step(Outgoing::Dense(vec![1.0; n])),
            transport::call(&rank0, &offer(1, after_step0.clone()), limit),
        )
        .await;
        let (updates, _) = stepped.expect("rank 1's step ends");
        let (resp, _) = offered.expect("rank 0 offers");
        assert!(
            matches!(resp, Response::Params { version: 1, .. }),
            "{resp:?}"
        );
        let status = second.status().await;
        let pushes_counted = status[0].stats.pushes;
        assert_eq!(
            (status[0].version, pushes_counted, status[0].parked),
            (1, 0, 0),
            "rank 1's gradient of step 0 was counted again"
        );
        assert_eq!(
            (comm.min_version(), comm.start_step(), comm.recoveries()),
            (1, 1, 1)
        );
        // What rank 1 applies is version 1: the copy the server recovered.
        match &updates[..] {
            [u] => match &u.update {
                ParamUpdate::Dense(v) => assert_eq!(v, &after_step0),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }

        // Both go on in step: step 1 needs both pushes and gives version 2.
        let push = Request::Step {
            shard: 0,
            step: 1,
            have_version: Some(1),
            rate: 0.0,
            grad: ps_net::protocol::WireGrad::Dense(ps_net::protocol::WireValues::F32(vec![
                1.0;
                n
            ])),
        };
        let (stepped, pushed) = futures::future::join(
            comm.step(Outgoing::Dense(vec![1.0; n])),
            transport::call(&rank0, &push, limit),
        )
        .await;
        stepped.expect("step 1 of rank 1");
        let (resp, _) = pushed.expect("step 1 of rank 0");
        assert!(
            matches!(resp, Response::Params { version: 2, .. }),
            "{resp:?}"
        );
        assert_eq!(comm.min_version(), 2);
        let status = second.status().await;
        assert_eq!((status[0].version, status[0].stats.pushes), (2, 2));
        println!(
            "faults: step applied before a server crash: faults injected {injected}, rank 1's retry pushed {pushes_counted} gradients to the restarted server (its step 0 was already in version 1), then both ranks reached version {}",
            status[0].version
        );
        second.abort().await;
    });
}

#[test]
fn a_forged_offer_cannot_steer_a_restarted_server() {
    // Three ranks; the server dies and restarts empty. Ranks 0 and 1 hold
    // version 7; whoever holds rank 2's certificate offers a made-up copy
    // at version 1,000,000. The shard resumes from the honest copies and
    // hands them to rank 2.
    const FORGED: u64 = 1_000_000;
    let mut cfg = config(1);
    cfg.cluster.workers = 3;
    cfg.cluster.shards_per_server = 1;
    cfg.validate().expect("valid config");
    with_cluster(cfg, |mut setup| async move {
        let first = setup.server();
        let addr = first.local_addr();
        first.abort().await;
        let second = ps_server::net::start(&setup.cfg, 0, addr, &setup.pki.server)
            .await
            .expect("restart on the same address");
        let n = setup.cfg.model.num_params();
        let limit = setup.cfg.server.max_frame_bytes;
        let honest: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.01).collect();
        let offer = |version: u64, values: Vec<f32>| Request::Offer {
            shard: 0,
            version,
            next_step: version,
            values,
        };
        let (r0, r1, r2) = futures::future::join3(
            raw_worker(&setup, addr, 0),
            raw_worker(&setup, addr, 1),
            raw_worker(&setup, addr, 2),
        )
        .await;
        let (a, b, forged) = futures::future::join3(
            transport::call(&r0, &offer(7, honest.clone()), limit),
            transport::call(&r1, &offer(7, honest.clone()), limit),
            transport::call(&r2, &offer(FORGED, vec![1.0e30; n]), limit),
        )
        .await;
        for reply in [a, b] {
            let (resp, _) = reply.expect("honest offer answered");
            assert!(
                matches!(resp, Response::Params { version: 7, .. }),
                "{resp:?}"
            );
        }
        let (resp, _) = forged.expect("forged offer answered");
        match resp {
            Response::Params {
                version: 7,
                update: ParamUpdate::Dense(values),
                ..
            } => assert!(
                values == honest,
                "rank 2 got other values than the honest copy"
            ),
            other => panic!("{other:?}"),
        }
        let status = second.status().await;
        let report = status[0].recovery.clone().expect("the shard started");
        assert_eq!(
            (
                report.source,
                report.version,
                report.agreeing,
                report.rejected,
                report.quorum
            ),
            (RecoverySource::Workers, 7, 2, 1, 2)
        );
        assert_eq!(status[0].version, 7);
        println!(
            "faults: forged offer: rank 2 offered version {FORGED} against ranks 0 and 1 at version 7; the restarted shard resumed at version {} from {} agreeing copies (quorum {}), {} offer rejected",
            report.version, report.agreeing, report.quorum, report.rejected
        );
        second.abort().await;
    });
}

#[test]
fn huge_pushes_from_one_rank_do_not_poison_the_model() {
    // ASP: rank 0 trains; whoever holds rank 1's certificate joins once rank
    // 0 is under way and pushes 20 dense gradients of 3e38 per entry. The
    // default guards scale each to the median norm of recent pushes.
    const HOSTILE_PUSHES: u64 = 20;
    let mut cfg = config(4);
    cfg.server.mode = SyncMode::Asp;
    cfg.cluster.shards_per_server = 1;
    cfg.validate().expect("valid config");
    with_cluster(cfg, |mut setup| async move {
        let server = setup.server();
        let planned = 4 * STEPS_PER_EPOCH;
        let addr = server.local_addr();
        let limit = setup.cfg.server.max_frame_bytes;
        let n = setup.cfg.model.num_params();
        let (o0, mut steps) = setup.watched(0);
        let honest = run_worker(&setup.cfg, o0, setup.store.clone(), setup.prefix.clone());
        let attacker = async {
            wait_steps(&mut steps, 5).await;
            let conn = raw_worker(&setup, addr, 1).await;
            let join = Request::Offer {
                shard: 0,
                version: 0,
                next_step: 0,
                values: vec![0.0; n],
            };
            let (resp, _) = transport::call(&conn, &join, limit).await.expect("offer");
            let Response::Params { mut next_step, .. } = resp else {
                panic!("{resp:?}")
            };
            for _ in 0..HOSTILE_PUSHES {
                let push = Request::Step {
                    shard: 0,
                    step: next_step,
                    have_version: None,
                    rate: 0.0,
                    grad: WireGrad::Dense(WireValues::F32(vec![3.0e38; n])),
                };
                let (resp, _) = transport::call(&conn, &push, limit).await.expect("push");
                match resp {
                    Response::Params { next_step: s, .. } => next_step = s,
                    other => panic!("{other:?}"),
                }
            }
            let (resp, _) = transport::call(&conn, &Request::Bye { finished: true }, limit)
                .await
                .expect("bye");
            assert!(matches!(resp, Response::ByeAck), "{resp:?}");
        };
        let (a, ()) = tokio::time::timeout(RUN_LIMIT, futures::future::join(honest, attacker))
            .await
            .expect("run finished in time");
        let a = a.expect("the honest worker finishes");
        let status = server.status().await;
        server.wait().await.expect("server ends cleanly");
        assert_eq!(a.steps, planned);
        let stats = status[0].stats;
        assert_eq!(
            (stats.anomalies, stats.clipped, stats.refused),
            (HOSTILE_PUSHES, 0, 0),
            "every hostile push, and only those, was scaled down"
        );
        assert!(status[0].version >= planned + HOSTILE_PUSHES);
        assert!(
            a.final_accuracy > ACCURACY_BAR,
            "accuracy {}",
            a.final_accuracy
        );
        println!(
            "faults: gradient poisoning: rank 1 pushed {HOSTILE_PUSHES} dense gradients of 3e38 per entry; anomalies scaled down {}, honest pushes flagged {}, honest accuracy {:.2}%",
            stats.anomalies,
            stats.anomalies - HOSTILE_PUSHES,
            100.0 * a.final_accuracy
        );
    });
}

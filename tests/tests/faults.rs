//! Faults during real training runs: a worker crashes and a replacement
//! rejoins; a server dies and restarts from its checkpoint; an attacker sends
//! garbage while the cluster trains. Each run must finish its planned steps
//! above the accuracy bar. Each test prints one summary line.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use object_store::{path::Path, ObjectStore};

use ps_server::net::RunningServer;
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_shared::dataset::SyntheticSpec;
use ps_shared::protocol::{Request, Response, WireGrad, WireValues, PROTOCOL_VERSION};
use ps_shared::transport::{self, DevCert};
use ps_tests::{start_loopback_server, synthetic_bucket, test_config};
use ps_worker::run::{run_worker, WorkerError, WorkerOptions};

const ACCURACY_BAR: f32 = 0.90;
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

fn opts(rank: u32, cert: &DevCert, crash_after_steps: Option<u64>) -> WorkerOptions {
    WorkerOptions {
        rank,
        ca_pem: cert.cert_pem.clone(),
        progress: false,
        epoch_lines: false,
        crash_after_steps,
    }
}

fn config(epochs: u64) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, epochs);
    cfg.server.heartbeat_secs = 0.2;
    cfg.server.worker_timeout_secs = 2.0;
    cfg.server.connect_timeout_secs = 20;
    cfg
}

/// What every fault test starts from: a server on loopback, the config
/// pointing at it, the certificate to trust and the synthetic bucket.
struct Setup {
    cfg: ClusterConfig,
    cert: DevCert,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    server: RunningServer,
}

/// Build the [`Setup`] for `cfg` and run `body` inside an actix system.
fn with_cluster<F, Fut>(cfg: ClusterConfig, body: F)
where
    F: FnOnce(Setup) -> Fut,
    Fut: Future<Output = ()>,
{
    let cert = DevCert::generate(&["localhost".into()]).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (store, prefix) = rt.block_on(synthetic_bucket(&spec()));
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &cert).await;
        let mut cfg = cfg;
        cfg.cluster.servers = vec![server.local_addr().to_string()];
        body(Setup {
            cfg,
            cert,
            store,
            prefix,
            server,
        })
        .await
    });
}

#[test]
fn crashed_worker_is_dropped_and_a_replacement_rejoins() {
    let cfg = config(6);
    with_cluster(cfg, |setup| async move {
        let Setup {
            cfg,
            cert,
            store,
            prefix,
            server,
        } = setup;
        let survivor = run_worker(&cfg, opts(0, &cert, None), store.clone(), prefix.clone());
        let crash_then_rejoin = async {
            let crashed = run_worker(
                &cfg,
                opts(1, &cert, Some(40)),
                store.clone(),
                prefix.clone(),
            )
            .await;
            assert!(
                matches!(crashed, Err(WorkerError::Crashed(40))),
                "{crashed:?}"
            );
            // The survivor goes on alone for a while before the replacement starts.
            tokio::time::sleep(Duration::from_millis(100)).await;
            run_worker(&cfg, opts(1, &cert, None), store.clone(), prefix.clone()).await
        };
        let (a, b) = tokio::time::timeout(
            RUN_LIMIT,
            futures::future::join(survivor, crash_then_rejoin),
        )
        .await
        .expect("run finished in time");
        let (a, b) = (a.expect("survivor"), b.expect("replacement"));
        let planned = 6 * (4096 / 2 / 64) as u64;
        assert_eq!(a.steps, planned, "the survivor ran its planned steps");
        assert_eq!(b.steps, planned, "the replacement finished the run");
        assert!(
            b.start_step >= 40,
            "the replacement continued from step {}",
            b.start_step
        );
        assert!(
            a.final_accuracy > ACCURACY_BAR,
            "survivor accuracy {}",
            a.final_accuracy
        );
        assert!(
            b.final_accuracy > ACCURACY_BAR,
            "replacement accuracy {}",
            b.final_accuracy
        );
        let status = server.status().await;
        tokio::time::timeout(Duration::from_secs(30), server.wait())
            .await
            .expect("server stops");
        println!(
            "faults: worker crash: faults injected 1, faults survived 1, bad inputs tried 0, state lost 0 (survivor {:.2}%, replacement joined at step {} and reached {:.2}%, shard versions {:?})",
            100.0 * a.final_accuracy,
            b.start_step,
            100.0 * b.final_accuracy,
            status.iter().map(|s| s.version).collect::<Vec<_>>()
        );
    });
}

#[test]
fn server_restarts_from_its_checkpoint_and_workers_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(6);
    cfg.server.checkpoint_url = format!("file://{}", dir.path().display());
    cfg.server.checkpoint_every = 20;
    // Reconnecting takes a moment on a loaded machine: do not drop for that.
    cfg.server.worker_timeout_secs = 10.0;
    with_cluster(cfg, |setup| async move {
        let Setup {
            cfg,
            cert,
            store,
            prefix,
            server: first,
        } = setup;
        let addr = first.local_addr();
        let workers = futures::future::join(
            run_worker(&cfg, opts(0, &cert, None), store.clone(), prefix.clone()),
            run_worker(&cfg, opts(1, &cert, None), store.clone(), prefix.clone()),
        );
        let chaos = async {
            // Let the cluster pass a few checkpoints, then kill the server.
            let mut killed_at = 0;
            for _ in 0..3000 {
                let v = first
                    .status()
                    .await
                    .iter()
                    .map(|s| s.version)
                    .min()
                    .unwrap_or(0);
                if v >= 50 {
                    killed_at = v;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(killed_at >= 50, "cluster never reached step 50");
            first.shutdown().await;
            // A new process on the same address restores from the checkpoint
            // (in one process the old socket may take a moment to close).
            let mut second = None;
            for _ in 0..200 {
                match ps_server::net::start(&cfg, 0, addr, &cert.cert_pem, &cert.key_pem).await {
                    Ok(s) => {
                        second = Some(s);
                        break;
                    }
                    Err(ps_server::net::ServerError::Bind { .. }) => {
                        tokio::time::sleep(Duration::from_millis(10)).await
                    }
                    Err(e) => panic!("restart failed: {e}"),
                }
            }
            let second = second.expect("the address became free again");
            let restored: Vec<u64> = second.status().await.iter().map(|s| s.version).collect();
            (killed_at, restored, second)
        };
        let ((a, b), (killed_at, restored, second)) =
            tokio::time::timeout(RUN_LIMIT, futures::future::join(workers, chaos))
                .await
                .expect("run finished in time");
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        tokio::time::timeout(Duration::from_secs(30), second.wait())
            .await
            .expect("server stops");
        let planned = 6 * (4096 / 2 / 64) as u64;
        assert_eq!((a.steps, b.steps), (planned, planned));
        for v in &restored {
            assert!(
                *v > 0 && v % 20 == 0,
                "restored version {v} is a published checkpoint"
            );
            assert!(*v <= killed_at);
        }
        assert!(
            a.recoveries > 0 && b.recoveries > 0,
            "both workers reconnected"
        );
        // (Accuracies may differ slightly: a worker that reconnects late can be
        // dropped from the barrier for a few steps and then rejoin.)
        assert!(
            a.final_accuracy > ACCURACY_BAR,
            "accuracy {}",
            a.final_accuracy
        );
        assert!(
            b.final_accuracy > ACCURACY_BAR,
            "accuracy {}",
            b.final_accuracy
        );
        println!(
            "faults: server restart: faults injected 1, faults survived 1, bad inputs tried 0, state lost 0 (killed at step {killed_at}, restored {restored:?}, accuracy {:.2}%, recoveries {}+{})",
            100.0 * a.final_accuracy,
            a.recoveries,
            b.recoveries
        );
    });
}

#[test]
fn garbage_during_training_is_refused_and_the_run_completes() {
    let cfg = config(4);
    with_cluster(cfg, |setup| async move {
        let Setup {
            cfg,
            cert,
            store,
            prefix,
            server,
        } = setup;
        let addr = server.local_addr();
        let workers = futures::future::join(
            run_worker(&cfg, opts(0, &cert, None), store.clone(), prefix.clone()),
            run_worker(&cfg, opts(1, &cert, None), store.clone(), prefix.clone()),
        );
        let attacker = async {
            let limit = cfg.server.max_frame_bytes;
            let client = transport::client_endpoint(&cert.cert_pem, false).unwrap();
            let mut tried = 0u32;
            let mut refused = 0u32;
            let mut x: u64 = 0x2545_f491_4f6c_dd1d;
            for round in 0..40u64 {
                // Unauthenticated garbage.
                let conn = transport::connect(&client, addr, "localhost")
                    .await
                    .unwrap();
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
                tried += 1;
                if matches!(
                    transport::call_raw(&conn, &frame, limit).await,
                    Ok(Response::Error { .. })
                ) {
                    refused += 1;
                }
                // An impostor with the right token pushing hostile gradients as rank 1.
                let conn = transport::connect(&client, addr, "localhost")
                    .await
                    .unwrap();
                let hello = Request::Hello {
                    protocol_version: PROTOCOL_VERSION,
                    token: cfg.cluster.token.clone(),
                    worker_rank: 1,
                    num_params: cfg.model.num_params() as u64,
                    layout_hash: cfg.model.layout_hash(),
                };
                if transport::call(&conn, &hello, limit).await.is_err() {
                    continue;
                }
                let bad = [
                    WireGrad::Sparse {
                        indices: vec![u32::MAX],
                        values: WireValues::F32(vec![1.0]),
                    },
                    WireGrad::Sparse {
                        indices: vec![1],
                        values: WireValues::F32(vec![f32::NAN]),
                    },
                    WireGrad::Dense(WireValues::F32(vec![0.0; 3])),
                ];
                for grad in bad {
                    let req = Request::Push {
                        shard: 0,
                        step: round * 1000 + 999_999,
                        worker_rank: 1,
                        grad,
                    };
                    tried += 1;
                    if matches!(
                        transport::call(&conn, &req, limit).await,
                        Ok((Response::Error { .. }, _))
                    ) {
                        refused += 1;
                    }
                }
                conn.close(0u32.into(), b"done");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (tried, refused)
        };
        let ((a, b), (tried, refused)) =
            tokio::time::timeout(RUN_LIMIT, futures::future::join(workers, attacker))
                .await
                .expect("run finished in time");
        let (a, b) = (a.expect("worker 0"), b.expect("worker 1"));
        tokio::time::timeout(Duration::from_secs(30), server.wait())
            .await
            .expect("server stops");
        let planned = 4 * (4096 / 2 / 64) as u64;
        assert_eq!((a.steps, b.steps), (planned, planned));
        assert_eq!(tried, refused, "every bad input got a typed error");
        assert!(
            a.final_accuracy > ACCURACY_BAR,
            "accuracy {}",
            a.final_accuracy
        );
        println!(
            "faults: garbage: faults injected 0, faults survived 0, bad inputs tried {tried}, state lost 0 (all {refused} refused; accuracy {:.2}%)",
            100.0 * a.final_accuracy
        );
    });
}

//! A sample that cannot be read under `data.on_bad_sample = "stop"` ends
//! the whole job, not just the rank that read it: that rank tells every
//! server why (`Request::Abort`), the servers refuse every later step with
//! `JobStopped` naming the rank and the object, every other rank ends with
//! that message, and the servers exit with the job-stopped code once every
//! rank is gone, after writing their final checkpoints.
//!
//! Nothing here waits on a sleep: the run ends by itself, and the time
//! limits are only safety nets against a hang.

use std::sync::Arc;
use std::time::Duration;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use ps_dataset::{synthetic, write_dataset_with, Layout, SyntheticSpec, WriteOptions};
use ps_net::cli::{exit_code, ExitCode};
use ps_net::protocol::ErrorCode;
use ps_shared::config::{CompressionKind, OnBadSample};
use ps_shared::sampler::EpochSampler;
use ps_tests::{rank_runs, test_config, TestPki};
use ps_worker::comm::CommError;
use ps_worker::run::{classify_exit, WorkerError, WorkerReport};

const RUN_LIMIT: Duration = Duration::from_secs(300);

#[actix::test]
async fn a_bad_sample_stops_every_rank_and_the_servers() {
    let spec = SyntheticSpec {
        train: 4096,
        test: 512,
        ..SyntheticSpec::default()
    };
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 3);
    cfg.data.on_bad_sample = OnBadSample::Stop;
    // One object per sample, so exactly one rank reads the damaged one:
    // the first sample rank 1 trains at step 10 of epoch 0.
    let (train, test) = synthetic(&spec);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let prefix = Path::from("ds");
    let options = WriteOptions {
        layout: Layout::PerSample,
        records_per_shard: 1,
    };
    write_dataset_with(
        store.as_ref(),
        &prefix,
        "per-sample",
        spec.features,
        spec.classes,
        &train,
        &test,
        &options,
    )
    .await
    .expect("write the dataset");
    let world = cfg.cluster.workers;
    let rank1 = EpochSampler::new(spec.train, world, 1, cfg.data.seed)
        .unwrap()
        .with_partition(cfg.data.partition)
        .plan(cfg.data.batch_size, cfg.training.epochs);
    let sample = rank1.batches_from(10)[0].samples[0];
    let missing = format!("ds/train/{sample:08}.bin");
    store
        .delete(&Path::from(missing.as_str()))
        .await
        .expect("delete one sample object");
    for rank in 0..world {
        let plan = EpochSampler::new(spec.train, world, rank, cfg.data.seed)
            .unwrap()
            .with_partition(cfg.data.partition)
            .plan(cfg.data.batch_size, cfg.training.epochs);
        let reads = plan
            .batches_from(0)
            .iter()
            .filter(|b| b.epoch == 0 && b.samples.contains(&sample))
            .count();
        assert_eq!(reads, usize::from(rank == 1), "rank {rank} in epoch 0");
    }

    let pki = TestPki::new(cfg.cluster.workers as u32);
    let server = ps_server::net::start(&cfg, 0, "127.0.0.1:0".parse().unwrap(), &pki.server)
        .await
        .expect("start a server");
    cfg.cluster.servers = vec![server.local_addr().to_string()];

    let runs = rank_runs(&cfg, |rank| pki.options(rank), &store, &prefix);
    let outcomes: Vec<Result<_, WorkerError>> =
        tokio::time::timeout(RUN_LIMIT, futures::future::join_all(runs))
            .await
            .expect("the job ends instead of hanging")
            .into_iter()
            .flatten()
            .collect();
    assert_eq!(outcomes.len(), 2);

    let mut readers = 0;
    let mut told = 0;
    for (rank, outcome) in outcomes.iter().enumerate() {
        let err = match outcome {
            Ok(report) => panic!(
                "rank {rank} finished {} epochs although the job was stopped",
                report.epochs.len()
            ),
            Err(e) => e,
        };
        let message = ps_net::cli::describe_error(err);
        assert_eq!(
            exit_code(err, classify_exit),
            ExitCode::JobStopped,
            "rank {rank}: {message}"
        );
        assert!(message.contains(&missing), "rank {rank}: {message}");
        match err {
            WorkerError::Loader(_) => readers += 1,
            WorkerError::Comm(CommError::Refused {
                code: ErrorCode::JobStopped,
                message,
                ..
            }) => {
                assert!(message.contains("stopped by rank"), "{message}");
                told += 1;
            }
            other => panic!("rank {rank} ended with an unexpected error: {other}"),
        }
        println!("rank {rank} ended: {message}");
    }
    // Rank 1 read the damaged sample; rank 0 heard it from the servers.
    assert_eq!((readers, told), (1, 1));

    let exit = tokio::time::timeout(RUN_LIMIT, server.wait())
        .await
        .expect("the server exits once every rank is gone")
        .expect_err("a stopped job is not a clean end");
    assert!(exit.job_stopped, "{exit}");
    assert!(exit.message.contains(&missing), "{exit}");
    println!(
        "job stopped: {readers} rank(s) read the missing object, {told} told by the servers; server: {exit}"
    );
}

/// A job whose runs end at a target: one loopback server, 20 epochs of
/// dense training evaluated every 4 steps, and no target in `cfg` (the
/// ranks that should reach one get `with_target`, whose target any accuracy
/// meets, so they stop at their first evaluation, step 4).
struct TargetJob {
    cfg: ps_shared::config::ClusterConfig,
    with_target: ps_shared::config::ClusterConfig,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    pki: TestPki,
    server: ps_server::net::RunningServer,
}

async fn target_job(workers: usize, workers_per_node: usize) -> TargetJob {
    let spec = SyntheticSpec {
        train: 4096,
        test: 512,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = ps_tests::synthetic_bucket(&spec).await;
    let mut cfg = test_config(CompressionKind::None, 1.0, 20);
    cfg.cluster.workers = workers;
    cfg.cluster.workers_per_node = workers_per_node;
    cfg.training.eval_every = 4;
    cfg.validate().expect("valid config");
    let pki = TestPki::new(workers as u32);
    let server = ps_tests::start_loopback_server(&cfg, &pki).await;
    cfg.cluster.servers = vec![server.local_addr().to_string()];
    let mut with_target = cfg.clone();
    with_target.training.target_accuracy = 0.01;
    with_target.validate().expect("valid config");
    TargetJob {
        cfg,
        with_target,
        store,
        prefix,
        pki,
        server,
    }
}

impl TargetJob {
    /// Checks that ranks `reached` stopped at their target (step 4) and
    /// every other rank heard it from the servers at its next step (or,
    /// when its push reached the barrier before the news, the step after,
    /// applied alone); then that the server ends cleanly.
    async fn check(self, outcomes: Vec<Result<WorkerReport, WorkerError>>, reached: usize) {
        use ps_worker::run::StopReason;
        assert_eq!(outcomes.len(), self.cfg.cluster.workers);
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let r = outcome.unwrap_or_else(|e| panic!("rank {rank} failed: {e}"));
            println!(
                "rank {rank} stopped at step {} ({:?})",
                r.steps, r.stop_reason
            );
            if rank < reached {
                assert_eq!(r.stop_reason, StopReason::TargetAccuracy, "rank {rank}");
                assert_eq!(r.steps, 4, "rank {rank} stops at its first evaluation");
            } else {
                assert_eq!(r.stop_reason, StopReason::PeerTarget, "rank {rank}");
                assert!((4..=5).contains(&r.steps), "rank {rank}: step {}", r.steps);
            }
        }
        tokio::time::timeout(RUN_LIMIT, self.server.wait())
            .await
            .expect("the server exits once every rank said goodbye")
            .expect("a run that reached its target is a clean end");
    }
}

/// A rank that reaches the run's target ends the run for every rank: it
/// tells the servers (`Request::Finish`), and the other rank, whose own
/// evaluation has not reached it (here it has no target at all, as a rank
/// whose batch norm was calibrated on other batches can measure less),
/// stops at its next step with `JobDone` instead of training on alone
/// (an epoch is 32 steps; alone it would train 20). Both end cleanly, and so
/// does the server.
#[actix::test]
async fn a_rank_that_reaches_the_target_ends_the_run_for_every_rank() {
    let job = target_job(2, 1).await;
    let runs = vec![
        ps_worker::run::run_worker_with(
            &job.with_target,
            job.pki.options(0),
            job.store.clone(),
            job.prefix.clone(),
            None,
        ),
        ps_worker::run::run_worker_with(
            &job.cfg,
            job.pki.options(1),
            job.store.clone(),
            job.prefix.clone(),
            None,
        ),
    ];
    let outcomes = tokio::time::timeout(RUN_LIMIT, futures::future::join_all(runs))
        .await
        .expect("the run ends instead of hanging");
    job.check(outcomes, 1).await;
}

/// The same behind node aggregators (`cluster.workers_per_node = 2`): node
/// 0's ranks reach the target and tell the servers through their node's
/// connections; node 1's ranks, which have no target, hear `JobDone` through
/// their node (which keeps the servers' refusal code) and stop at their next
/// step. Every rank ends cleanly, and so does the server.
#[actix::test]
async fn a_node_that_reaches_the_target_ends_the_run_for_the_other_nodes() {
    let job = target_job(4, 2).await;
    let nodes = vec![
        ps_worker::run::run_node(
            &job.with_target,
            0,
            vec![job.pki.options(0), job.pki.options(1)],
            job.store.clone(),
            job.prefix.clone(),
        ),
        ps_worker::run::run_node(
            &job.cfg,
            1,
            vec![job.pki.options(2), job.pki.options(3)],
            job.store.clone(),
            job.prefix.clone(),
        ),
    ];
    let outcomes = tokio::time::timeout(RUN_LIMIT, futures::future::join_all(nodes))
        .await
        .expect("the run ends instead of hanging");
    job.check(outcomes.into_iter().flatten().collect(), 2).await;
}

/// A refusal that reaches a rank through its node keeps its exit code.
#[test]
fn a_refusal_through_a_node_keeps_its_exit_code() {
    use ps_worker::node::NodeError;
    let refused = |code| {
        WorkerError::Node(NodeError::Refused {
            node: 1,
            doing: "the node's step",
            code,
            message: "rank 0 reached the target".into(),
        })
    };
    let done = refused(ErrorCode::JobDone);
    assert_eq!(done.refusal(), Some(ErrorCode::JobDone));
    assert_eq!(exit_code(&done, classify_exit), ExitCode::Ok);
    let stopped = refused(ErrorCode::JobStopped);
    assert_eq!(exit_code(&stopped, classify_exit), ExitCode::JobStopped);
    let failed = WorkerError::Node(NodeError::Failed {
        node: 1,
        message: "the node stopped during a step".into(),
    });
    assert_eq!(failed.refusal(), None);
    assert_eq!(exit_code(&failed, classify_exit), ExitCode::Failed);
}

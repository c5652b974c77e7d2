//! A sample that cannot be read under `data.on_bad_sample = "stop"` ends
//! the whole job, not just the rank that read it: that rank tells every
//! server why (`Request::Abort`), the servers refuse every later step with
//! `JobStopped` naming the rank and the object, every other rank ends with
//! that message, and the servers exit with the job-stopped code once every
//! rank is gone, after writing their final checkpoints.
//!
//! Nothing here waits on a sleep: the run ends by itself, and the time
//! limits are only safety nets against a hang.

use std::time::Duration;

use object_store::path::Path;

use ps_dataset::SyntheticSpec;
use ps_shared::cli::{exit_code, ExitCode};
use ps_shared::config::{CompressionKind, OnBadSample};
use ps_shared::protocol::ErrorCode;
use ps_tests::{rank_runs, synthetic_bucket, test_config, TestPki};
use ps_worker::comm::CommError;
use ps_worker::run::{classify_exit, WorkerError};

const RUN_LIMIT: Duration = Duration::from_secs(300);

#[actix::test]
async fn a_bad_sample_stops_every_rank_and_the_servers() {
    let spec = SyntheticSpec {
        train: 4096,
        test: 512,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = synthetic_bucket(&spec).await;
    // One of the train split's shard objects is gone: a permanent error,
    // whichever rank reads it first.
    let missing = "synthetic/train/shard-00003.bin";
    store
        .delete(&Path::from(missing))
        .await
        .expect("delete a shard object");

    let mut cfg = test_config(CompressionKind::Topk, 0.01, 3);
    cfg.data.on_bad_sample = OnBadSample::Stop;
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
        let message = ps_shared::cli::describe_error(err);
        assert_eq!(
            exit_code(err, classify_exit),
            ExitCode::JobStopped,
            "rank {rank}: {message}"
        );
        assert!(message.contains(missing), "rank {rank}: {message}");
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
    assert!(readers >= 1, "a rank read the missing object");
    assert_eq!(readers + told, 2);

    let exit = tokio::time::timeout(RUN_LIMIT, server.wait())
        .await
        .expect("the server exits once every rank is gone")
        .expect_err("a stopped job is not a clean end");
    assert!(exit.job_stopped, "{exit}");
    assert!(exit.message.contains(missing), "{exit}");
    println!(
        "job stopped: {readers} rank(s) read the missing object, {told} told by the servers; server: {exit}"
    );
}

//! One worker's training run: wires the loader and the trainer and comm actors
//! together.
//!
//! Per step: take the next (already prefetched) batch from the [`Loader`],
//! have the `TrainerActor` compute and compress the gradient, have the
//! `CommActor` push it and pull the new parameters, and hand those back to the
//! trainer. Time spent waiting for each is measured separately, so the epoch
//! report shows where a step's time went.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};
use object_store::{path::Path as StorePath, ObjectStore};
use serde::Serialize;
use tracing::Instrument;

use crate::countstore::{CountingStore, GetCounts};
use crate::simstore::SimStore;
use crate::simulate::Simulation;
use ps_dataset::image::{Augment, ImagePipeline};
use ps_dataset::{DatasetError, DatasetReader, Split};
use ps_net::cli::ExitCode;
use ps_net::protocol::ErrorCode;
use ps_shared::config::{Balance, ClusterConfig, CostModel, OnBadSample};
use ps_shared::sampler::{EpochSampler, RankPlan, ResumePoint};

use crate::balance::{BalanceLink, RateMeter};
use crate::peers::{PeerNet, PeerSettings};

use crate::comm::{
    Abort, Comm, CommActor, CommError, CommSummary, FinishJob, GradSink, Join, Leave, MakeUp,
    MakeUpRound, Outgoing, ParamSource, ShardUpdate, Silence, StepExchange, StopJob, Traffic,
    WorkerTls,
};
use crate::loader::{
    BatchPos, EpochDataStats, Loader, LoaderError, LoaderSettings, Outage, OutageLog, RetryFailure,
    RetryPolicy,
};
use crate::model::{device_from_str, Model, ModelError};
use crate::moments::WorkerMoments;
use crate::node::{node_members, NodeError, NodeMember};
use crate::observe::{follow_outages, step_record_due, StepFigures, WorkerSeries};
use crate::trainer::{
    ApplyUpdates, CalibrateBn, ComputeStep, Evaluate, GetParams, SetStep, TrainerActor,
    TrainerError,
};
use candle_core::Device;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("dataset: {0}")]
    Dataset(#[from] DatasetError),
    #[error("dataset does not fit the model: {0}")]
    Mismatch(String),
    #[error("loader: {0}")]
    Loader(#[from] LoaderError),
    #[error("model: {0}")]
    Model(#[from] ModelError),
    #[error("trainer: {0}")]
    Trainer(#[from] TrainerError),
    #[error("communication: {0}")]
    Comm(#[from] CommError),
    #[error("node aggregation: {0}")]
    Node(#[from] NodeError),
    #[error("an actor stopped unexpectedly: {0}")]
    Mailbox(#[from] MailboxError),
    #[error("worker stopped by fault injection after {0} steps")]
    Crashed(u64),
    #[error("stopped by a signal at step {0}; said goodbye to the servers")]
    Interrupted(u64),
    /// The stop signal came while the worker waited (for the bucket, a
    /// server, or a reply): the wait was cut short.
    #[error("stopped by a signal at step {step} while waiting for {waiting_for}; {}", if *.goodbye { "said goodbye to the servers" } else { "left without a goodbye (the servers drop it after server.worker_timeout_secs)" })]
    StoppedWaiting {
        step: u64,
        waiting_for: &'static str,
        goodbye: bool,
    },
    #[error("sampler: {0}")]
    Sampler(String),
    /// The peer cache endpoint could not start (`[peers]`).
    #[error("peer cache tier (rank {rank}, [peers]): {message}")]
    Peers { rank: u32, message: String },
    #[error("cannot write metrics to {path}: {source}")]
    Metrics {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl WorkerError {
    /// The code of the servers' refusal this error reports, whether it came
    /// on the rank's own connections or through its node aggregator.
    pub fn refusal(&self) -> Option<ErrorCode> {
        match self {
            WorkerError::Comm(CommError::Refused { code, .. })
            | WorkerError::Node(NodeError::Refused { code, .. }) => Some(*code),
            _ => None,
        }
    }

    /// The exit code this error decides by itself (see
    /// [`ps_net::cli::ExitCode`]); `None` leaves it to its causes.
    pub fn exit_code(&self) -> Option<ExitCode> {
        match self {
            WorkerError::Mismatch(_) | WorkerError::Sampler(_) => Some(ExitCode::Config),
            WorkerError::Model(
                ModelError::Layout(_)
                | ModelError::InitWeights { .. }
                | ModelError::CustomKind
                | ModelError::Config(_)
                | ModelError::Device(_),
            ) => Some(ExitCode::Config),
            WorkerError::Interrupted(_) | WorkerError::StoppedWaiting { .. } => {
                Some(ExitCode::Terminated)
            }
            WorkerError::Trainer(TrainerError::Diverged(_)) => Some(ExitCode::Diverged),
            _ => None,
        }
    }
}

/// The exit code of a servers' refusal that ends a rank.
fn refusal_exit_code(code: ErrorCode) -> Option<ExitCode> {
    match code {
        ErrorCode::JobStopped => Some(ExitCode::JobStopped),
        // Refused because another rank reached the run's target (an offer
        // after the end): the job finished.
        ErrorCode::JobDone => Some(ExitCode::Ok),
        _ => None,
    }
}

/// The worker's part of the one mapping from errors to exit codes: its own
/// error types, for [`ps_net::cli::exit_code`] (which knows the shared
/// ones: config, TLS files, transport).
///
/// ```
/// use ps_net::cli::{exit_code, ExitCode};
/// use ps_worker::run::{classify_exit, WorkerError};
/// let e = WorkerError::Interrupted(7);
/// assert_eq!(exit_code(&e, classify_exit), ExitCode::Terminated);
/// ```
pub fn classify_exit(e: &(dyn std::error::Error + 'static)) -> Option<ExitCode> {
    if let Some(w) = e.downcast_ref::<WorkerError>() {
        return w.exit_code();
    }
    if let Some(t) = e.downcast_ref::<TrainerError>() {
        return matches!(t, TrainerError::Diverged(_)).then_some(ExitCode::Diverged);
    }
    if let Some(c) = e.downcast_ref::<CommError>() {
        return match c {
            CommError::Refused { code, .. } => refusal_exit_code(*code),
            CommError::Unreachable { .. } | CommError::Deadline { .. } => {
                Some(ExitCode::Unreachable)
            }
            _ => None,
        };
    }
    if let Some(NodeError::Refused { code, .. }) = e.downcast_ref::<NodeError>() {
        return refusal_exit_code(*code);
    }
    if let Some(l) = e.downcast_ref::<LoaderError>() {
        return loader_exit_code(l);
    }
    if let Some(d) = e.downcast_ref::<DatasetError>() {
        return bad_sample_code(d);
    }
    None
}

/// The exit code a loader error stands for, if any.
fn loader_exit_code(e: &LoaderError) -> Option<ExitCode> {
    match e {
        LoaderError::Outage { .. } => Some(ExitCode::BucketOutage),
        LoaderError::Fetch { source, .. } => bad_sample_code(source),
        LoaderError::Dataset(d) => bad_sample_code(d),
        _ => None,
    }
}

/// A batch from the loader. A loader error that stops the job is first
/// told to every server, so every rank ends with it, not only this one.
async fn batch_or_stop<T>(
    next: Result<T, LoaderError>,
    exchange: &Exchange,
    rank: u32,
) -> Result<T, WorkerError> {
    match next {
        Ok(batch) => Ok(batch),
        Err(e) => {
            if loader_exit_code(&e) == Some(ExitCode::JobStopped) {
                let reason = ps_net::cli::describe_error(&e);
                tracing::error!(rank, "{reason}; stopping the job");
                exchange.stop_job(&reason).await;
            }
            Err(e.into())
        }
    }
}

/// A sample that cannot be decoded (`data.on_bad_sample = "stop"`) stops
/// the job.
fn bad_sample_code(e: &DatasetError) -> Option<ExitCode> {
    matches!(
        e,
        DatasetError::Corrupt {
            permanent: true,
            ..
        }
    )
    .then_some(ExitCode::JobStopped)
}

/// How long a worker stopped by a signal during a wait tries to say
/// goodbye before it leaves without one.
const GOODBYE_GRACE: Duration = Duration::from_secs(5);

/// Resolves once `stop` turns true; never when there is no stop channel
/// (or its sender is gone).
async fn stop_requested(stop: &Option<tokio::sync::watch::Receiver<bool>>) {
    if let Some(rx) = stop {
        let mut rx = rx.clone();
        if rx.wait_for(|s| *s).await.is_ok() {
            return;
        }
    }
    std::future::pending::<()>().await
}

/// How long a wait may still take once the stop signal came: the current
/// step ends normally when it can.
const WAIT_GRACE: Duration = Duration::from_secs(5);

/// `wait`'s output, or `None` when the stop signal comes first and `wait`
/// does not end within [`WAIT_GRACE`] after it: a bucket outage, a server
/// being redialled or a stuck reply do not hold a stop up.
async fn until_stop<T>(
    stop: &Option<tokio::sync::watch::Receiver<bool>>,
    wait: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::pin!(wait);
    tokio::select! {
        biased;
        out = &mut wait => return Some(out),
        () = stop_requested(stop) => {}
    }
    tokio::time::timeout(WAIT_GRACE, wait).await.ok()
}

/// Stopped by a signal during a wait: say goodbye if the servers answer
/// within [`GOODBYE_GRACE`], then end with [`WorkerError::StoppedWaiting`].
async fn stop_during_wait(
    exchange: Option<&Exchange>,
    rank: u32,
    step: u64,
    waiting_for: &'static str,
) -> WorkerError {
    tracing::warn!(rank, step, "stop signal while waiting for {waiting_for}");
    let goodbye = match exchange {
        Some(x) => matches!(
            tokio::time::timeout(GOODBYE_GRACE, x.leave(false)).await,
            Ok(Ok(_))
        ),
        None => false,
    };
    WorkerError::StoppedWaiting {
        step,
        waiting_for,
        goodbye,
    }
}

/// How to run one worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub rank: u32,
    /// The cluster CA and this rank's client certificate.
    pub tls: WorkerTls,
    /// Show a progress bar (when stderr is a terminal).
    pub progress: bool,
    /// Print one line per epoch to stdout.
    pub epoch_lines: bool,
    /// Fault injection: after this many steps drop every connection without
    /// a goodbye and stop, as a crashed worker would.
    pub crash_after_steps: Option<u64>,
    /// Fault injection: after this many steps fall silent (no steps, no
    /// heartbeats: what a paused process looks like to the servers) until
    /// the receiver turns true, then go on.
    pub pause_after_steps: Option<(u64, tokio::sync::watch::Receiver<bool>)>,
    /// Receives the number of steps done after every step (tests and
    /// tools wait on it instead of polling).
    pub steps_done: Option<tokio::sync::watch::Sender<u64>>,
    /// When this turns true the worker says goodbye after its current step
    /// and stops with [`WorkerError::Interrupted`] (SIGTERM, Ctrl-C).
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// Receives every batch this worker trained, once its step's exchange
    /// returned (tests check which samples a run saw).
    pub trained: Option<tokio::sync::mpsc::UnboundedSender<TrainedBatch>>,
    /// Simulated link and bucket (tests, benchmarks, `ps-worker train
    /// --simulate FILE`); the default simulates nothing.
    pub simulation: Simulation,
}

/// One batch a worker trained (see [`WorkerOptions::trained`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainedBatch {
    pub rank: u32,
    /// The global step.
    pub step: u64,
    /// Stream position of the first sample: sample `i` of `samples` was
    /// position `first + i` of the run's sample stream.
    pub first: u64,
    pub samples: Arc<[usize]>,
}

/// What one epoch did.
///
/// One record per epoch in `worker-<rank>.jsonl` and one row in
/// `worker-<rank>.csv`; the fields are in the CSV's column order: which
/// epoch and worker, time, loss and accuracy, where the time went, bytes to
/// the servers, decoding, the cache tiers, then the bucket.
#[derive(Debug, Clone, Serialize)]
pub struct EpochReport {
    /// The epoch, counted from 1 (the console line, the JSONL and the CSV
    /// all use this number).
    pub epoch: u64,
    pub rank: u32,
    pub steps: u64,
    pub epoch_s: f64,
    /// Mean training loss over the epoch's steps.
    pub train_loss: f32,
    /// Loss on the test split at the epoch's end.
    pub test_loss: f32,
    pub test_accuracy: f32,
    /// `exp(test_loss)`, the perplexity of the mean per-token test loss, for
    /// models trained on a text dataset; `null` (an empty CSV cell) for
    /// other datasets and when there is no test split.
    pub test_perplexity: Option<f32>,
    pub data_wait_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub bytes_pushed: u64,
    pub bytes_pulled: u64,
    pub density: f64,
    /// Round trips to server shards (Offer and Step requests).
    pub round_trips: u64,
    /// Fewest workers in the barrier seen in this epoch's replies.
    pub min_live_workers: u32,
    /// Steps trained while fewer than `cluster.workers` were in the barrier.
    pub steps_short_of_workers: u64,
    /// Images decoded for this epoch's batches (image datasets).
    pub images_decoded: u64,
    /// Seconds the decode threads spent on them, summed over threads.
    pub decode_s: f64,
    /// Images decoded and augmented per second of one decode thread.
    pub images_per_core_s: f64,
    /// Samples the trainer consumed per second of this epoch: compare with
    /// `images_per_core_s × data.decode_threads` to see whether decoding
    /// keeps up.
    pub trainer_samples_per_s: f64,
    /// Samples skipped because they could not be decoded.
    pub bad_samples: u64,
    /// Data plane: samples served from memory (memory tier or prefetch window).
    pub memory_hit_rate: f64,
    /// Data plane: samples served from the disk tier.
    pub disk_hit_rate: f64,
    /// Data plane: successful GETs, `bucket_data_gets +
    /// bucket_manifest_gets + bucket_test_gets`.
    pub bucket_gets: u64,
    /// Data plane: successful GETs for this epoch's batches.
    pub bucket_data_gets: u64,
    /// Data plane: GETs of the manifest at start-up (first epoch only).
    pub bucket_manifest_gets: u64,
    /// Data plane: GETs of the test split at start-up (first epoch only).
    pub bucket_test_gets: u64,
    /// Data plane: GET attempts of all three kinds, failed ones and retries
    /// included (what the bucket may bill).
    pub bucket_get_attempts: u64,
    /// Data plane: bytes read from the bucket for this epoch's batches.
    pub bucket_bytes: u64,
    /// Data plane: estimated request + egress cost of the attempts and
    /// bytes (`[cost]` prices).
    pub bucket_cost_usd: f64,
    /// Data plane: GETs that were retries after a failure.
    pub fetch_retries: u64,
    /// Peer tier: samples served by their owners.
    pub peer_hit_rate: f64,
    /// Peer tier: bytes of those samples.
    pub peer_bytes: u64,
    /// Peer tier: samples asked of a peer and read from the bucket instead.
    pub peer_fallbacks: u64,
    /// Peer tier: what the peer samples would have cost from the bucket
    /// (their GETs and bytes at the `[cost]` prices).
    pub peer_saved_usd: f64,
    /// The learning rate of the epoch's last update, from
    /// `[optimizer.schedule]` at the worker's global step (the servers'
    /// step in BSP; in ASP/SSP each shard counts its own updates).
    pub lr: f32,
}

impl EpochReport {
    /// The loader's counters of the epoch, plus the start-up reads
    /// (manifest, test split) when this is the worker's first epoch.
    fn set_data_plane(
        &mut self,
        d: &EpochDataStats,
        startup: Option<StartupGets>,
        prices: &CostModel,
    ) {
        self.memory_hit_rate = d.memory_hit_rate();
        self.disk_hit_rate = d.disk_hit_rate();
        let s = startup.unwrap_or_default();
        self.bucket_data_gets = d.gets;
        self.bucket_manifest_gets = s.manifest.answered();
        self.bucket_test_gets = s.test.answered();
        self.bucket_gets =
            self.bucket_data_gets + self.bucket_manifest_gets + self.bucket_test_gets;
        self.bucket_get_attempts = d.get_attempts + s.manifest.gets + s.test.gets;
        self.bucket_bytes = d.bucket_bytes;
        self.bucket_cost_usd = prices.estimate(self.bucket_get_attempts, self.bucket_bytes);
        self.fetch_retries = d.retries;
        self.peer_hit_rate = d.peer_hit_rate();
        self.peer_bytes = d.peer_bytes;
        self.peer_fallbacks = d.peer_fallbacks;
        self.peer_saved_usd = d.peer_saved_cost(prices);
        self.images_decoded = d.decoded;
        self.decode_s = d.decode_us as f64 / 1e6;
        self.images_per_core_s = d.images_per_core_s();
        self.trainer_samples_per_s = if self.epoch_s > 0.0 {
            d.samples as f64 / self.epoch_s
        } else {
            0.0
        };
        self.bad_samples = d.bad_samples;
    }
}

/// GETs of the reads before training: the manifest and the test split.
#[derive(Debug, Clone, Copy, Default)]
struct StartupGets {
    manifest: GetCounts,
    test: GetCounts,
}

/// One evaluation on the test split during the run.
#[derive(Debug, Clone, Serialize)]
pub struct EvalPoint {
    /// The run's step count at the evaluation.
    pub step: u64,
    /// Wall seconds since this worker's first step, evaluation time left out.
    pub train_s: f64,
    pub test_accuracy: f32,
    pub test_loss: f32,
    /// `exp(test_loss)` on a text dataset, `null` otherwise.
    pub test_perplexity: Option<f32>,
    /// Application bytes this worker pushed and pulled up to here.
    pub bytes_pushed: u64,
    pub bytes_pulled: u64,
}

/// Why a worker stopped training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Every epoch of `training.epochs` was trained.
    Epochs,
    /// An evaluation reached `training.target_accuracy`.
    TargetAccuracy,
    /// An evaluation's test loss fell to `training.target_loss`.
    TargetLoss,
    /// `training.max_steps` steps were trained.
    MaxSteps,
    /// Another rank reached the run's target (`training.target_accuracy`
    /// or `target_loss`) and the servers said the job is done. Its own
    /// evaluation can differ: batch norm is calibrated on each rank's own
    /// batches.
    PeerTarget,
}

/// What the whole run did.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerReport {
    pub rank: u32,
    /// The run's step count when this worker finished.
    pub steps: u64,
    /// The step this worker started at (above 0 when it rejoined a run).
    pub start_step: u64,
    pub num_params: usize,
    pub epochs: Vec<EpochReport>,
    pub final_accuracy: f32,
    pub bytes_pushed_per_step: f64,
    pub bytes_pulled_per_step: f64,
    /// Bytes the exchanges copied per step, by stage: requests encoded,
    /// replies read from the transport, replies' vectors decoded.
    pub bytes_encoded_per_step: f64,
    pub bytes_read_per_step: f64,
    pub bytes_decoded_per_step: f64,
    pub data_wait_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    /// Reconnections to a lost or restarted server.
    pub recoveries: u64,
    /// The oldest shard version this worker held at the end (in BSP the
    /// number of updates the cluster applied).
    pub final_version: u64,
    /// Link time the simulated link (`[link]`) charged over the run, summed
    /// over messages (computed by the link model, not measured).
    pub link_simulated_s: f64,
    /// Round trips to server shards per training step.
    pub round_trips_per_step: f64,
    /// Shard pushes per step that left while the backward pass still ran
    /// (`training.overlap_backward`; the last shard to finish never does).
    pub early_shards_per_step: f64,
    /// Bytes sent over the link this worker's pushes crossed: its own, or
    /// its node's (with `cluster.workers_per_node` > 1 every rank of a node
    /// reports the node's one link, so count it once per node).
    pub link_sent_bytes: u64,
    /// Bytes received over that link.
    pub link_received_bytes: u64,
    /// Steps trained while fewer than `cluster.workers` were in the barrier
    /// (the others had crashed, left, or never joined).
    pub steps_short_of_workers: u64,
    /// Fewest workers seen in the barrier during the run.
    pub min_live_workers: u32,
    /// Every evaluation: each epoch's end, and every `training.eval_every` steps.
    pub evals: Vec<EvalPoint>,
    pub stop_reason: StopReason,
    /// Wall seconds of training (first step to last), evaluation left out.
    pub train_s: f64,
    /// Every GET request this worker sent to the bucket (start-up reads,
    /// the loader's, failed ones and those still in flight when it stopped),
    /// counted by the store wrapper as each is sent and read once the
    /// loader's tasks are finished; the epochs' counters cover only the
    /// GETs whose batches were reached.
    pub bucket_gets_sent: u64,
    /// Backup workers: the make-up steps after the last regular step (every
    /// rank's batches the cluster applied without), and the samples this
    /// worker trained in them (also counted in the last epoch's figures).
    pub makeup_steps: u64,
    pub makeup_samples: u64,
}

/// Backup workers (`server.backup_workers`): what this rank owes the
/// make-up round (see [`crate::makeup`]).
struct Owing {
    /// The round is still to come: backups on, in BSP, on this rank's own
    /// connections (a node aggregator's ranks have none).
    due: bool,
    /// Steps of its plan whose batch was never applied, ascending.
    skipped: Vec<u64>,
    /// Batches it trained that were applied.
    trained: u64,
    /// What the round made it do.
    steps: u64,
    samples: u64,
}

#[derive(Default)]
struct EpochAcc {
    steps: u64,
    loss_sum: f64,
    wait: Duration,
    compute: Duration,
    comm: Duration,
    pushed: u64,
    pulled: u64,
    density_sum: f64,
    round_trips: u64,
    min_live: Option<u32>,
    short_steps: u64,
    started: Option<Instant>,
    /// The scheduled learning rate of the epoch's last update.
    lr: f32,
}

/// The result of a start-up read under the retry policy: a permanent error
/// as it is (a missing dataset or bucket), an outage as a loader error.
fn startup_read<T>(
    result: Result<T, RetryFailure>,
    object: &str,
    attempts: u32,
) -> Result<T, WorkerError> {
    match result {
        Ok(v) => Ok(v),
        Err(RetryFailure::Permanent(e)) => Err(WorkerError::Dataset(e)),
        Err(failure) => Err(LoaderError::from_retry(object.to_string(), attempts, failure).into()),
    }
}

/// Run one worker to the end of training. Must be called inside an actix
/// `System`. With `cluster.workers_per_node` > 1 a rank cannot run alone:
/// use [`run_node`].
pub async fn run_worker(
    cfg: &ClusterConfig,
    opts: WorkerOptions,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
) -> Result<WorkerReport, WorkerError> {
    run_worker_with(cfg, opts, store, prefix, None).await
}

/// Builds a rank's model on the run's device: what a program that brings
/// its own model hands to [`run_worker_with`] (see [`crate::api`]).
pub type ModelFactory = Arc<dyn Fn(&Device) -> Result<Model, ModelError> + Send + Sync>;

/// [`run_worker`] with the model `model` builds (`None`: from `[model]`).
pub async fn run_worker_with(
    cfg: &ClusterConfig,
    opts: WorkerOptions,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    model: Option<ModelFactory>,
) -> Result<WorkerReport, WorkerError> {
    if cfg.cluster.workers_per_node > 1 {
        return Err(WorkerError::Node(NodeError::Failed {
            node: cfg.node_of(opts.rank),
            message: format!(
                "cluster.workers_per_node = {}: rank {} runs together with the other ranks of its node (ps-worker train --node {})",
                cfg.cluster.workers_per_node,
                opts.rank,
                cfg.node_of(opts.rank)
            ),
        }));
    }
    run_rank(cfg, opts, store, prefix, None, model).await
}

/// Run every rank of node `node` (`cluster.workers_per_node` of them) in
/// this task, sharing one node aggregator (see [`crate::node`]); `opts`
/// holds one entry per rank of the node, in rank order, and the first
/// rank's certificate authenticates the node. Returns each rank's outcome
/// in rank order. Must be called inside an actix `System`.
pub async fn run_node(
    cfg: &ClusterConfig,
    node: u32,
    opts: Vec<WorkerOptions>,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
) -> Vec<Result<WorkerReport, WorkerError>> {
    run_node_with(cfg, node, opts, store, prefix, None).await
}

/// [`run_node`] with each rank's model from `model` (`None`: from `[model]`).
pub async fn run_node_with(
    cfg: &ClusterConfig,
    node: u32,
    opts: Vec<WorkerOptions>,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    model: Option<ModelFactory>,
) -> Vec<Result<WorkerReport, WorkerError>> {
    let wpn = cfg.cluster.workers_per_node.max(1) as u32;
    let expected: Vec<u32> = (node * wpn..(node + 1) * wpn).collect();
    let given: Vec<u32> = opts.iter().map(|o| o.rank).collect();
    if given != expected {
        let e = NodeError::Failed {
            node,
            message: format!(
                "runs ranks {expected:?} (cluster.workers_per_node = {wpn}), given {given:?}"
            ),
        };
        return vec![Err(e.into())];
    }
    // The node's one connection per server is the node's link.
    let link = opts[0].simulation.link.clone();
    let members = match node_members(cfg, node, opts[0].tls.clone(), link) {
        Ok((_, members)) => members,
        Err(e) => return vec![Err(e.into())],
    };
    let runs = opts.into_iter().zip(members).map(|(o, m)| {
        run_rank(
            cfg,
            o,
            store.clone(),
            prefix.clone(),
            Some(m),
            model.clone(),
        )
    });
    futures::future::join_all(runs).await
}

/// How a rank exchanges with the servers: on its own connections, or
/// through its node's aggregator.
enum Exchange {
    Flat(Addr<CommActor>),
    Node(NodeMember),
}

type StepFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(Vec<ShardUpdate>, Traffic), WorkerError>>>,
>;

impl Exchange {
    /// Hand the gradient over now; the future resolves with the reply.
    fn step(&self, grad: Outgoing) -> StepFuture {
        match self {
            Exchange::Flat(comm) => {
                let request = comm.send(StepExchange { grad });
                Box::pin(async move { Ok(request.await??) })
            }
            Exchange::Node(member) => {
                let reply = member.step(grad);
                Box::pin(async move { Ok(reply.await?) })
            }
        }
    }

    /// Say goodbye: `finished` when the work is done, not when the worker
    /// was told to stop (then a replacement may take the rank).
    async fn leave(&self, finished: bool) -> Result<CommSummary, WorkerError> {
        match self {
            Exchange::Flat(comm) => Ok(comm.send(Leave { finished }).await??),
            Exchange::Node(member) => Ok(member.leave(finished).await?),
        }
    }

    /// This rank reached the run's target: tell every server the job is
    /// done, so the other ranks stop at their next step.
    async fn finish_job(&self, reason: &str) {
        match self {
            Exchange::Flat(comm) => {
                let _ = comm.send(FinishJob(reason.to_string())).await;
            }
            Exchange::Node(member) => member.finish_job(reason).await,
        }
    }

    /// Stop the whole job, telling every server why.
    async fn stop_job(&self, reason: &str) {
        match self {
            Exchange::Flat(comm) => {
                let _ = comm.send(StopJob(reason.to_string())).await;
            }
            Exchange::Node(member) => member.stop_job(reason).await,
        }
    }

    /// Backup workers: the make-up round, once every live rank asked
    /// (`None` through a node aggregator, which has no make-up round).
    async fn make_up(
        &self,
        skipped: Vec<u64>,
        trained: u64,
    ) -> Result<Option<MakeUpRound>, WorkerError> {
        match self {
            Exchange::Flat(comm) => Ok(Some(comm.send(MakeUp { skipped, trained }).await??)),
            Exchange::Node(_) => Ok(None),
        }
    }

    /// Stop or resume heartbeats (fault injection).
    async fn silence(&self, on: bool) -> Result<(), WorkerError> {
        match self {
            Exchange::Flat(comm) => Ok(comm.send(Silence(on)).await?),
            Exchange::Node(member) => {
                member.node().silence(on);
                Ok(())
            }
        }
    }

    async fn abort(&self) -> Result<(), WorkerError> {
        match self {
            Exchange::Flat(comm) => Ok(comm.send(Abort).await?),
            Exchange::Node(member) => {
                member.abort().await;
                Ok(())
            }
        }
    }
}

/// One rank's run; `node` is its handle on the node aggregator, if any.
async fn run_rank(
    cfg: &ClusterConfig,
    opts: WorkerOptions,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    node: Option<NodeMember>,
    factory: Option<ModelFactory>,
) -> Result<WorkerReport, WorkerError> {
    let rank = opts.rank;
    let store: Arc<dyn ObjectStore> = match &opts.simulation.bucket {
        Some(slow) => Arc::new(SimStore::from_section(store, slow)),
        None => store,
    };
    // Counts the start-up reads; the loader counts its own.
    let counted = Arc::new(CountingStore::new(store));
    let store: Arc<dyn ObjectStore> = counted.clone();
    // The start-up reads ride out an outage like the loader's.
    let retry = RetryPolicy::from_config(cfg, rank);
    let outage = OutageLog::default();
    let manifest_object = prefix.clone().join(ps_dataset::MANIFEST_NAME).to_string();
    let opening = retry.run(&manifest_object, &outage, || {
        DatasetReader::open(store.clone(), prefix.clone())
    });
    let Some((opened, attempts)) = until_stop(&opts.stop, opening).await else {
        return Err(stop_during_wait(None, rank, 0, "the dataset manifest").await);
    };
    let reader = startup_read(opened, &manifest_object, attempts)?;
    let manifest_gets = counted.counts();
    let reader = if reader.layout().is_images() {
        let a = &cfg.data.augment;
        let pipeline = ImagePipeline::new(
            Augment {
                pad: a.pad,
                hflip: a.hflip,
                mean: a.mean.clone(),
                std: a.std.clone(),
            },
            cfg.data.seed,
            cfg.data.decode_threads,
            cfg.data.on_bad_sample == OnBadSample::Skip,
        )
        .map_err(|m| WorkerError::Mismatch(format!("data.decode_threads: {m}")))?;
        reader.with_image_pipeline(pipeline)?
    } else {
        reader
    };
    let manifest = reader.manifest().clone();
    if cfg.model.kind == ps_shared::config::ModelKind::Gpt {
        let g = &cfg.model.gpt;
        let Some(text) = &manifest.text else {
            return Err(WorkerError::Mismatch(format!(
                "model.kind = \"gpt\" trains on a text dataset (ps-data text); `{}` is not one",
                manifest.name
            )));
        };
        if text.vocab != g.vocab || text.seq_len != g.seq_len {
            return Err(WorkerError::Mismatch(format!(
                "text dataset `{}` has vocab {} and seq_len {} (tokenizer {}), [model.gpt] says vocab = {} and seq_len = {}",
                manifest.name, text.vocab, text.seq_len, text.tokenizer, g.vocab, g.seq_len
            )));
        }
    } else if manifest.features != cfg.model.input || manifest.classes != cfg.model.classes {
        return Err(WorkerError::Mismatch(format!(
            "dataset `{}` has {} features and {} classes, [model] says input = {} and classes = {}",
            manifest.name, manifest.features, manifest.classes, cfg.model.input, cfg.model.classes
        )));
    }
    let reading = retry.run("the test split", &outage, || reader.fetch_all(Split::Test));
    let Some((test, attempts)) = until_stop(&opts.stop, reading).await else {
        return Err(stop_during_wait(None, rank, 0, "the test split").await);
    };
    let test = Arc::new(startup_read(test, "the test split", attempts)?);
    // A dataset without a test split trains, but is never reported as 0%
    // accurate: its evaluations say "no test split" (see `accuracy_text`).
    if test.is_empty() && cfg.training.has_target() {
        let (field, value) = if cfg.training.target_accuracy > 0.0 {
            ("target_accuracy", cfg.training.target_accuracy)
        } else {
            ("target_loss", cfg.training.target_loss)
        };
        return Err(WorkerError::Mismatch(format!(
            "training.{field} = {value} needs a test split, and dataset `{}` has none",
            manifest.name
        )));
    }
    let startup = StartupGets {
        manifest: manifest_gets,
        test: counted.counts().since(manifest_gets),
    };
    let world = cfg.cluster.workers;
    if rank as usize >= cfg.cluster.max_ranks() {
        return Err(WorkerError::Sampler(format!(
            "rank {rank} is beyond cluster.workers = {world} (and cluster.max_workers = {})",
            cfg.cluster.max_workers
        )));
    }
    // Ranks beyond the starting count (asp/ssp with cluster.max_workers)
    // take the part of rank `rank % workers`: see docs/failures.md, "Changing
    // the worker count".
    let sampler = EpochSampler::new(
        manifest.train.num_samples,
        world,
        rank as usize % world,
        cfg.data.seed,
    )
    .map_err(|e| WorkerError::Sampler(e.to_string()))?
    .with_partition(cfg.data.partition);
    if manifest.train.num_samples < world * cfg.data.batch_size {
        return Err(WorkerError::Mismatch(format!(
            "{} training samples over {world} workers is less than one batch of {}",
            manifest.train.num_samples, cfg.data.batch_size
        )));
    }

    // The peer cache tier: this rank serves the samples it reads first, and
    // asks their owners for the others before the bucket.
    let peer_net = if cfg.peers.enabled {
        let peer_err = |message: String| WorkerError::Peers { rank, message };
        let settings =
            PeerSettings::from_config(&cfg.peers, rank, world as u32, reader.manifest_checksum())
                .await
                .map_err(|e| peer_err(e.to_string()))?;
        let listen = settings.listen;
        let net = PeerNet::start(settings, &opts.tls, opts.simulation.peers.faults())
            .map_err(|e| peer_err(format!("cannot serve on {listen}: {e}")))?;
        Some(net)
    } else {
        None
    };

    let device = device_from_str(&cfg.training.device)?;
    let model = match &factory {
        Some(build) => build(&device)?,
        None => Model::new(&cfg.model, device, cfg.training.init_seed)?,
    };
    // The servers lay out the shards from `[model]`: a model brought
    // through the library must have exactly that layout.
    model.check_layout(&cfg.model)?;
    // Every worker loads the same initial weights, so whichever offer the
    // servers take first, the cluster starts from the file.
    let mut model = model;
    let init = &cfg.training.init_weights;
    if !init.is_empty() {
        let reading = read_init_weights(init);
        let Some(bytes) = until_stop(&opts.stop, reading).await else {
            return Err(stop_during_wait(None, rank, 0, "the initial weights").await);
        };
        model.load_safetensors(&bytes?, init)?;
        tracing::info!(rank, file = %init, "initial weights loaded");
    }
    let num_params = model.num_params();
    // Ranks of a node hand their dense gradient to the node, which
    // compresses the node's mean.
    let compressor = if node.is_some() {
        None
    } else {
        cfg.compression.compressor(num_params, cfg.total_shards())
    };
    // With optimizer.moments = "worker" (refused for nodes by the config)
    // each worker keeps Adam's moments and pushes its direction.
    let moments = cfg.optimizer.worker_moments().then(|| {
        let tensors: Vec<_> = model
            .tensors()
            .iter()
            .filter_map(|t| Some((t.name.clone(), model.range_of(&t.name)?)))
            .collect();
        WorkerMoments::new(
            &cfg.optimizer,
            tensors.iter().map(|(n, r)| (n.as_str(), r.clone())),
        )
    });
    let trainer_arbiter = Arbiter::new();
    let trainer = TrainerActor::start_in_arbiter(&trainer_arbiter.handle(), move |_| {
        let trainer = TrainerActor::new(model, compressor);
        match moments {
            Some(m) => trainer.with_moments(m),
            None => trainer,
        }
    });

    // Join the cluster: every worker starts from the parameters the servers
    // hold, and a restarted worker continues from the step the cluster is at,
    // with the loader resuming at the same place in the sample order.
    let result = async {
        let source_trainer = trainer.clone();
        let params: ParamSource = std::rc::Rc::new(move || {
            let t = source_trainer.clone();
            Box::pin(async move { t.send(GetParams).await.unwrap_or_default() })
        });
        // The loader starts once the servers said where the sample stream
        // stands and at which step this worker continues: a worker that
        // rejoins a run under way fetches nothing before that step.
        let settings = LoaderSettings::from_config(cfg, &manifest, rank);
        let settings = match &peer_net {
            Some(net) => settings.with_peers(net.clone()),
            None => settings,
        };
        // data.balance = "throughput": the rate pushed and the splits learned.
        let balance = (cfg.data.balance == Balance::Throughput)
            .then(|| BalanceLink::new(cfg.data.balance_every));
        let joining = async {
            match node {
                None => {
                    let link = &opts.simulation.link;
                    let mut comm =
                        Comm::connect_over(cfg, rank, opts.tls.clone(), params, link).await?;
                    if let Some(b) = &balance {
                        comm.set_balance(b.clone());
                    }
                    let data = comm.data_start();
                    let comm = CommActor::new(comm).start();
                    let (start_params, start_step, _) = comm.send(Join).await??;
                    Ok::<_, WorkerError>((Exchange::Flat(comm), start_params, start_step, data))
                }
                Some(member) => {
                    let (start_params, start_step, data) = member.join(params).await?;
                    Ok((Exchange::Node(member), start_params, start_step, data))
                }
            }
        };
        let Some(joined) = until_stop(&opts.stop, joining).await else {
            return Err(stop_during_wait(None, rank, 0, "the servers (joining)").await);
        };
        let (exchange, start_params, start_step, data) = joined?;
        trainer.send(ApplyUpdates(start_params)).await??;
        trainer.send(SetStep(start_step)).await?;
        // The servers say where the sample stream stands: global step
        // `data.step` starts after `data.samples` samples of the stream.
        let n = manifest.train.num_samples;
        let origin = ResumePoint::at_stream(data.step, data.samples, n, cfg.data.seed);
        let plan = sampler
            .plan_from(cfg.data.batch_size, cfg.training.epochs, origin)
            .map_err(|e| WorkerError::Sampler(e.to_string()))?;
        // A worker declared dead while the cluster went on moves to the
        // cluster's step: a new loader at that place in the sample order.
        let start_loader = {
            let balance = balance.clone();
            move |reader: DatasetReader, sampler: EpochSampler, settings: LoaderSettings| {
                Ok::<_, WorkerError>(match &balance {
                    Some(b) => Loader::start_balanced(reader, sampler, settings, b.subscribe())?,
                    None => Loader::start(reader, sampler, settings)?,
                })
            }
        };
        let restart: LoaderAt = {
            let (reader, sampler, settings) = (reader.clone(), sampler.clone(), settings.clone());
            let start_loader = start_loader.clone();
            Box::new(move |step| {
                let settings = settings.clone().resume_from(origin).starting_at(step);
                start_loader(reader.clone(), sampler.clone(), settings)
            })
        };
        let makeup_reader = reader.clone();
        let loader = if start_step > 0 || data.step > 0 || data.samples > 0 {
            let point = plan.resume_point(start_step.max(data.step));
            tracing::info!(
                rank,
                start_step,
                epoch = point.epoch,
                consumed = point.consumed,
                "rejoining the run"
            );
            let settings = settings.resume_from(origin).starting_at(start_step);
            start_loader(reader, sampler, settings)?
        } else {
            start_loader(reader, sampler, settings)?
        };
        let outage = loader.outage_log();
        let run = Run {
            outage,
            startup,
            exchange,
            loader,
            restart,
            start_step,
            plan,
            balance,
            num_params,
            text: manifest.text.is_some(),
            reader: makeup_reader,
        };
        let mut report = train(cfg, &opts, &trainer, test, run).await?;
        // The loader has stopped (its tasks are finished or aborted): no
        // GET is sent after this.
        report.bucket_gets_sent = counted.counts().gets;
        Ok(report)
    }
    .await;
    trainer_arbiter.stop();
    result
}

/// The bytes of `training.init_weights`: a local path (or `file://` URL),
/// or an object in a bucket (`s3://bucket/dir/init.safetensors`, ...).
async fn read_init_weights(url: &str) -> Result<Vec<u8>, ModelError> {
    let err = |message: String| ModelError::InitWeights {
        source_name: url.to_string(),
        message,
    };
    let local = url
        .strip_prefix("file://")
        .or((!url.contains("://")).then_some(url));
    if let Some(path) = local {
        return std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")));
    }
    let (dir, name) = url
        .rsplit_once('/')
        .filter(|(_, name)| !name.is_empty())
        .ok_or_else(|| err("names no object".into()))?;
    let (store, prefix) = ps_shared::bucket::open_bucket(dir).map_err(|e| err(e.to_string()))?;
    let object = prefix.join(name);
    let got = object_store::ObjectStoreExt::get(store.as_ref(), &object)
        .await
        .map_err(|e| err(format!("cannot read it: {e}")))?;
    let bytes = got
        .bytes()
        .await
        .map_err(|e| err(format!("cannot read it: {e}")))?;
    Ok(bytes.to_vec())
}

/// Builds a loader that begins at the given global step.
type LoaderAt = Box<dyn Fn(u64) -> Result<Loader, WorkerError>>;

/// What the training loop works with.
struct Run {
    /// The loader's record of bucket failures (the progress bar shows an
    /// outage while it lasts).
    outage: Arc<OutageLog>,
    startup: StartupGets,
    exchange: Exchange,
    /// Taken from directly, not through an actor: a message to an actor on
    /// this thread waits its turn behind the runtime's other ready tasks
    /// (QUIC, the loader's own pump), which cost 1-4 ms a step on a busy
    /// node even with the batch long ready; a ready batch is taken here
    /// without yielding.
    loader: Loader,
    /// A loader starting at a given step (to follow the cluster's step).
    restart: LoaderAt,
    start_step: u64,
    plan: RankPlan,
    /// Throughput balancing: the rate pushed and the split schedule.
    balance: Option<Arc<BalanceLink>>,
    num_params: usize,
    /// The dataset is text (evaluations report the perplexity).
    text: bool,
    /// Reads the samples of make-up steps (backup workers).
    reader: DatasetReader,
}

async fn train(
    cfg: &ClusterConfig,
    opts: &WorkerOptions,
    trainer: &Addr<TrainerActor>,
    test: Arc<ps_dataset::Batch>,
    run: Run,
) -> Result<WorkerReport, WorkerError> {
    let rank = opts.rank;
    let Run {
        outage,
        startup,
        exchange,
        loader,
        restart,
        start_step,
        plan,
        balance,
        num_params,
        text,
        reader,
    } = run;
    let mut plan = plan;
    let mut owing = Owing {
        due: cfg.server.backup_workers > 0
            && cfg.server.mode == ps_shared::config::SyncMode::Bsp
            && matches!(exchange, Exchange::Flat(_)),
        skipped: Vec::new(),
        trained: 0,
        steps: 0,
        samples: 0,
    };
    let mut meter = RateMeter::new(cfg.data.balance_every as usize);
    let batch_size = cfg.data.batch_size as f32;
    let mut loader = loader;
    // The start-up reads go into the first epoch this worker reports.
    let mut startup = Some(startup);

    let epochs = cfg.training.epochs;
    let bar = if opts.progress {
        let bar = ProgressBar::new(plan.end_step());
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} steps {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(format!("worker {rank}"));
        bar
    } else {
        ProgressBar::hidden()
    };
    // The last step's figures; a bucket outage replaces them while it lasts.
    let step_text = Rc::new(RefCell::new(String::new()));
    let outage_view = opts
        .progress
        .then(|| actix::spawn(show_outages(bar.clone(), outage.watch(), step_text.clone())));
    let _stop_view = AbortOnDrop(outage_view);
    let mut metrics = open_metrics(cfg, rank)?;
    let series = WorkerSeries::new(rank);
    let _outage_series = AbortOnDrop(Some(actix::spawn(follow_outages(rank, outage.watch()))));
    let step_every = cfg.training.step_metrics_every;
    let mut reports = Vec::new();
    let mut acc = EpochAcc::default();
    let mut epoch = plan.resume_point(start_step).epoch;
    let mut step = start_step;
    bar.set_position(start_step);
    let mut evals = Evals::new(
        cfg.training.eval_every,
        Target {
            accuracy: cfg.training.target_accuracy,
            loss: cfg.training.target_loss,
        },
        if cfg.model.has_batch_norm() {
            cfg.model.bn_calibration_batches
        } else {
            0
        },
        text,
    );
    evals.chunk = eval_chunk(cfg);
    let max_steps = cfg.training.max_steps;
    let mut stopping = max_steps_reached(max_steps, step).then_some(StopReason::MaxSteps);
    // Overlap (asp/ssp with training.overlap): the next batch, taken from
    // the loader and its gradient computed while this step's exchange is in
    // flight.
    let overlap = cfg.overlaps_compute();
    // Streaming (training.overlap_backward): a rank on its own connections
    // pushes each shard (dense, or its own top-k) while backward still runs.
    // A simulated slow worker stretches its compute after the pass, so it
    // pushes whole.
    let unstreamed = match &exchange {
        Exchange::Node(_) => Some("the node aggregator pushes the node's sum"),
        Exchange::Flat(_) if !opts.simulation.compute.is_none() => {
            Some("a simulated slow worker stretches its compute after the pass")
        }
        Exchange::Flat(_) => crate::trainer::why_not_streamed(cfg),
    };
    let stream = unstreamed.is_none();
    if let (true, Some(why)) = (cfg.training.overlap_backward, unstreamed) {
        tracing::warn!(
            rank,
            "training.overlap_backward is on but this rank pushes after the backward pass: {why}"
        );
    }
    let mut lookahead: Option<Option<(BatchPos, Arc<ps_dataset::Batch>)>> = None;
    let mut precomputed: Option<crate::trainer::StepOutput> = None;
    loop {
        let t_wait = Instant::now();
        let next = match (stopping, lookahead.take()) {
            (Some(_), _) => None,
            (None, Some(next)) => next,
            (None, None) => match until_stop(&opts.stop, loader.next()).await {
                Some(next) => batch_or_stop(next, &exchange, rank).await?,
                None => {
                    bar.finish_and_clear();
                    return Err(stop_during_wait(Some(&exchange), rank, step, "data").await);
                }
            },
        };
        let waited = t_wait.elapsed();
        if next.is_none() && stopping.is_none() && owing.due {
            // The stream is done: the batches the cluster applied without
            // some rank are made up now, before the last epoch closes.
            owing.due = false;
            acc.wait += waited;
            let mut ctx = MakeUpCtx {
                cfg,
                opts,
                trainer,
                exchange: &exchange,
                reader: &reader,
                plan: &plan,
                acc: &mut acc,
                evals: &mut evals,
            };
            step = ctx.run(&mut owing, step).await?;
            bar.set_position(step);
        }
        let finished_epoch = match &next {
            Some((pos, _)) => pos.epoch != epoch && acc.steps > 0,
            None => acc.steps > 0,
        };
        if finished_epoch {
            let tested = evals.at(step, trainer, &test).await?;
            series.evaluated(tested.0, tested.1);
            acc.lr = cfg.optimizer.lr_at(step.saturating_sub(1));
            let mut report = close_epoch(
                rank,
                epoch,
                cfg.cluster.workers as u32,
                &mut acc,
                tested,
                evals.text,
            );
            if stopping.is_none() {
                stopping = evals.reached_target();
            }
            let data = loader.stats().epoch(epoch);
            report.set_data_plane(&data, startup.take(), &cfg.cost.cost_model());
            let mut line = epoch_line(&report, epochs);
            if report.steps_short_of_workers > 0 {
                line.push_str(&format!(
                    "\nrank {rank} epoch {}: WARNING: {} steps with only {} of {} workers in the barrier",
                    report.epoch,
                    report.steps_short_of_workers,
                    report.min_live_workers,
                    cfg.cluster.workers
                ));
            }
            if opts.epoch_lines {
                bar.suspend(|| ps_net::progressln!("{line}"));
            }
            write_metrics(&mut metrics, &report)?;
            reports.push(report);
        }
        // A batch fetched before the epoch's evaluation decided to stop is
        // not trained.
        let Some((pos, batch)) = next.filter(|_| stopping.is_none()) else {
            break;
        };
        epoch = pos.epoch;
        evals.remember(&batch);
        acc.started.get_or_insert_with(Instant::now);
        evals.started.get_or_insert_with(Instant::now);
        acc.wait += waited;
        let span = tracing::info_span!(
            "step",
            rank,
            step = step + 1,
            epoch = pos.epoch + 1,
            samples = pos.samples.len()
        );
        let mut data_wait = waited;
        // Throughput balancing: this step's planned batch size (from the
        // splits learned so far, which cover every planned batch) weights
        // the gradient; exactly 1 with equal batches.
        let weight = match &balance {
            Some(b) => {
                learn_splits(&mut plan, b)?;
                plan.own_size(pos.step) as f32 / batch_size
            }
            None => 1.0,
        };
        // With `stream`, the exchange starts before the backward pass and
        // pushes each shard as soon as the pass has finished it.
        let mut early = None;
        let mut out = match precomputed.take() {
            Some(out) => out,
            None => {
                let sink = match stream {
                    true => {
                        let (sink, grad) = GradSink::for_cluster(cfg)?;
                        early = Some(exchange.step(grad));
                        Some(sink)
                    }
                    false => None,
                };
                let mut out = trainer
                    .send(ComputeStep(batch, weight, sink))
                    .instrument(span.clone())
                    .await??;
                slow_compute(&opts.simulation, &mut out, pos.samples.len(), pos.step).await;
                acc.compute += out.compute + out.compress;
                evals.early_shards += out.early_shards;
                out
            }
        };
        if let Some(b) = &balance {
            meter.record(pos.samples.len() as u64, out.compute + out.compress);
            b.set_rate(meter.rate());
        }
        let reply = match early {
            Some(reply) => reply,
            None => exchange.step(push_of(&mut out)?),
        };
        if overlap && !max_steps_reached(max_steps, step + 1) {
            // The exchange is queued: take the next batch and compute its
            // gradient on the parameters held now (one step stale), unless
            // it opens a new epoch, which is evaluated first.
            let t_wait = Instant::now();
            let Some(next) = until_stop(&opts.stop, loader.next()).await else {
                bar.finish_and_clear();
                return Err(stop_during_wait(Some(&exchange), rank, step, "data").await);
            };
            let next = batch_or_stop(next, &exchange, rank).await?;
            acc.wait += t_wait.elapsed();
            data_wait += t_wait.elapsed();
            if let Some((next_pos, next_batch)) = &next {
                if next_pos.epoch == pos.epoch {
                    let mut ahead = trainer
                        .send(ComputeStep(next_batch.clone(), 1.0, None))
                        .await??;
                    slow_compute(
                        &opts.simulation,
                        &mut ahead,
                        next_pos.samples.len(),
                        next_pos.step,
                    )
                    .await;
                    acc.compute += ahead.compute + ahead.compress;
                    precomputed = Some(ahead);
                }
            }
            lookahead = Some(next);
        }
        let t_comm = Instant::now();
        let Some(replied) = until_stop(&opts.stop, reply.instrument(span.clone())).await else {
            bar.finish_and_clear();
            let waiting_for = "the servers' reply to a step";
            return Err(stop_during_wait(Some(&exchange), rank, step, waiting_for).await);
        };
        let (updates, traffic) = match replied {
            Ok(replied) => replied,
            Err(e) if e.refusal() == Some(ErrorCode::JobDone) => {
                // Another rank reached the target: this step is not
                // applied, and the run closes its epoch and says goodbye
                // as at its own target.
                tracing::info!(rank, step, "{e}; stopping");
                stopping = Some(StopReason::PeerTarget);
                continue;
            }
            Err(e) => {
                // The exchange failed for good: drop the connections, so the
                // servers see this rank gone at once (a process that exits
                // drops them too; an in-process run must not leave them
                // open, heartbeats and all).
                bar.finish_and_clear();
                let _ = exchange.abort().await;
                return Err(e);
            }
        };
        let exchange_time = t_comm.elapsed();
        acc.comm += exchange_time;
        // With backups, a push refused as fenced was applied nowhere: its
        // batch is made up after the last step.
        let applied = !(owing.due && traffic.fenced > 0);
        if applied {
            owing.trained += 1;
            if let Some(tx) = &opts.trained {
                let _ = tx.send(TrainedBatch {
                    rank,
                    step: pos.step,
                    first: pos.first,
                    samples: pos.samples.clone(),
                });
            }
        } else {
            owing.skipped.push(pos.step);
        }
        let workers = cfg.cluster.workers as u32;
        if traffic.live_workers < workers {
            if acc.min_live.is_none_or(|m| traffic.live_workers < m) {
                tracing::warn!(
                    rank,
                    step,
                    "training with only {} of {workers} workers in the barrier",
                    traffic.live_workers
                );
            }
            acc.short_steps += 1;
        }
        acc.min_live = Some(
            acc.min_live
                .map_or(traffic.live_workers, |m| m.min(traffic.live_workers)),
        );
        let t_apply = Instant::now();
        trainer
            .send(ApplyUpdates(updates))
            .instrument(span.clone())
            .await??;
        let apply_time = t_apply.elapsed();
        acc.compute += apply_time;
        let density = count_step(&mut acc, &mut evals, out.loss, out.density, &traffic);
        step += 1;
        let figures = StepFigures {
            step,
            epoch: pos.epoch + 1,
            loss: out.loss,
            lr: cfg.optimizer.lr_at(step - 1),
            data_s: data_wait.as_secs_f64(),
            compute_s: (out.compute + apply_time).as_secs_f64(),
            compress_s: out.compress.as_secs_f64(),
            exchange_s: exchange_time.as_secs_f64(),
            samples: pos.samples.len() as u64,
            bytes_pushed: traffic.pushed,
            bytes_pulled: traffic.pulled,
            bytes_copied: traffic.copied.total(),
            density,
            train_s: evals.train_s(),
        };
        series.step(&figures, traffic.round_trips, traffic.live_workers);
        series.data_plane(
            &loader.stats().total(),
            loader.ready(),
            &cfg.cost.cost_model(),
        );
        span.in_scope(|| {
            tracing::debug!(
                loss = figures.loss,
                lr = figures.lr,
                data_s = figures.data_s,
                compute_s = figures.compute_s,
                compress_s = figures.compress_s,
                exchange_s = figures.exchange_s,
                bytes_pushed = figures.bytes_pushed,
                bytes_pulled = figures.bytes_pulled,
                "step done"
            )
        });
        if step_record_due(step_every, step) {
            write_step_metrics(&mut metrics, rank, &figures)?;
        }
        if traffic.next_step > step {
            // The servers declared this worker dead and went on without it
            // (it was paused or cut off past server.worker_timeout_secs):
            // it now holds the cluster's parameters, and trains the
            // cluster's step and samples from here, up to the same end.
            if cfg.server.backup_workers > 0 {
                // A straggler's late push (server.backup_workers): the
                // steps in between were made without it; their batches
                // are made up after the last step.
                if owing.due {
                    let end = plan.end_step();
                    owing
                        .skipped
                        .extend(step.min(end)..traffic.next_step.min(end));
                }
                tracing::debug!(
                    rank,
                    from = step,
                    to = traffic.next_step,
                    "skipped to the cluster's step"
                );
            } else {
                tracing::warn!(
                    rank,
                    from = step,
                    to = traffic.next_step,
                    "rejoined the cluster at its step"
                );
            }
            step = traffic.next_step;
            loader = restart(step)?;
            lookahead = None;
            precomputed = None;
            trainer.send(SetStep(step)).await?;
            bar.set_position(step);
        }
        if let Some((after, resume)) = &opts.pause_after_steps {
            if *after == step {
                exchange.silence(true).await?;
                let mut resume = resume.clone();
                let _ = resume.wait_for(|go| *go).await;
                exchange.silence(false).await?;
            }
        }
        if opts.crash_after_steps == Some(step) {
            exchange.abort().await?;
            bar.finish_and_clear();
            return Err(WorkerError::Crashed(step));
        }
        if opts.stop.as_ref().is_some_and(|s| *s.borrow()) {
            bar.finish_and_clear();
            exchange.leave(false).await?;
            return Err(WorkerError::Interrupted(step));
        }
        if let Some(tx) = &opts.steps_done {
            tx.send_replace(step);
        }
        bar.inc(1);
        let text = format!(
            "epoch {}/{epochs}, last step's train_loss {:.4}, lr {:.3e}",
            pos.epoch + 1,
            out.loss,
            cfg.optimizer.lr_at(step.saturating_sub(1))
        );
        if outage.current().is_none() {
            bar.set_message(text.clone());
        }
        *step_text.borrow_mut() = text;
        if evals.every > 0 && step % evals.every == 0 {
            let (loss, accuracy) = evals.at(step, trainer, &test).await?;
            series.evaluated(loss, accuracy);
            if let Some(reached) = evals.reached_target() {
                stopping = Some(reached);
            }
        }
        if stopping.is_none() && max_steps_reached(max_steps, step) {
            stopping = Some(StopReason::MaxSteps);
        }
    }
    let train_s = evals.train_s();
    bar.finish_and_clear();
    if let Some(reason) = stopping
        .zip(evals.points.last())
        .and_then(|(stop, last)| evals.target.reached_at(stop, last))
    {
        exchange.finish_job(&reason).await;
    }
    // Stop the prefetching: the GETs it has sent are all counted then.
    loader.stop().await;
    let summary = exchange.leave(true).await?;

    // A worker that joined a finished run trained no epoch: evaluate anyway.
    let final_accuracy = match reports.last() {
        Some(r) => r.test_accuracy,
        None => evaluate(trainer, &test, evals.chunk).await?.1,
    };
    let steps = (step - start_step).max(1) as f64;
    let sum = |f: fn(&EpochReport) -> f64| reports.iter().map(f).sum::<f64>();
    Ok(WorkerReport {
        rank,
        steps: step,
        start_step,
        num_params,
        final_accuracy,
        bytes_pushed_per_step: sum(|r| r.bytes_pushed as f64) / steps,
        bytes_pulled_per_step: sum(|r| r.bytes_pulled as f64) / steps,
        bytes_encoded_per_step: evals.copied.encoded as f64 / steps,
        bytes_read_per_step: evals.copied.read as f64 / steps,
        bytes_decoded_per_step: evals.copied.decoded as f64 / steps,
        data_wait_s: sum(|r| r.data_wait_s),
        compute_s: sum(|r| r.compute_s),
        comm_s: sum(|r| r.comm_s),
        recoveries: summary.recoveries,
        final_version: summary.final_version,
        link_simulated_s: summary.link_simulated_secs,
        round_trips_per_step: sum(|r| r.round_trips as f64) / steps,
        early_shards_per_step: evals.early_shards as f64 / steps,
        link_sent_bytes: summary.link_sent_bytes,
        link_received_bytes: summary.link_received_bytes,
        steps_short_of_workers: reports.iter().map(|r| r.steps_short_of_workers).sum(),
        min_live_workers: reports
            .iter()
            .map(|r| r.min_live_workers)
            .min()
            .unwrap_or(cfg.cluster.workers as u32),
        epochs: reports,
        evals: evals.points,
        stop_reason: stopping.unwrap_or(StopReason::Epochs),
        train_s,
        bucket_gets_sent: 0,
        makeup_steps: owing.steps,
        makeup_samples: owing.samples,
    })
}

/// One applied step in the epoch's and the run's totals (steps, loss,
/// bytes, round trips, density); returns the step's push density (the
/// node aggregator's when it compressed, else `computed_density`).
fn count_step(
    acc: &mut EpochAcc,
    evals: &mut Evals,
    loss: f32,
    computed_density: f64,
    traffic: &Traffic,
) -> f64 {
    let density = traffic.density.unwrap_or(computed_density);
    acc.steps += 1;
    acc.loss_sum += f64::from(loss);
    acc.pushed += traffic.pushed;
    acc.pulled += traffic.pulled;
    acc.round_trips += traffic.round_trips;
    acc.density_sum += density;
    evals.pushed += traffic.pushed;
    evals.pulled += traffic.pulled;
    evals.copied.add(traffic.copied);
    density
}

/// What a make-up round needs of the training loop.
struct MakeUpCtx<'a> {
    cfg: &'a ClusterConfig,
    opts: &'a WorkerOptions,
    trainer: &'a Addr<TrainerActor>,
    exchange: &'a Exchange,
    reader: &'a DatasetReader,
    plan: &'a RankPlan,
    acc: &'a mut EpochAcc,
    evals: &'a mut Evals,
}

impl MakeUpCtx<'_> {
    /// Asks for the make-up round and trains this rank's share of its
    /// steps; returns the step counter after them. A round that cannot be
    /// had (a server gone) is reported and skipped: the training is done,
    /// and the batches stay untrained.
    async fn run(&mut self, owing: &mut Owing, step: u64) -> Result<u64, WorkerError> {
        let rank = self.opts.rank;
        let skipped = std::mem::take(&mut owing.skipped);
        let round = match self.exchange.make_up(skipped, owing.trained.max(1)).await {
            Ok(Some(round)) => round,
            Ok(None) => return Ok(step),
            Err(e) => {
                tracing::warn!(
                    rank,
                    "no make-up round ({e}): the batches the cluster applied without some rank stay untrained"
                );
                return Ok(step);
            }
        };
        let batch = self.cfg.data.batch_size;
        let steps = crate::makeup::deal(self.plan, &round.orphans, &round.trained, batch)
            .map_err(|e| WorkerError::Sampler(format!("make-up round: {e}")))?;
        if steps.is_empty() {
            return Ok(step);
        }
        tracing::info!(
            rank,
            batches = round.orphans.len(),
            steps = steps.len(),
            "making up the batches the cluster applied without some rank"
        );
        // Read like the loader: a failed or slow GET is retried within the
        // loader's outage budget (`loader.retry_*`, `loader.outage_budget_s`).
        let reader = self.reader.clone();
        let retry = RetryPolicy::from_config(self.cfg, rank);
        let fetch = move |samples: Vec<usize>| {
            let reader = reader.clone();
            actix::spawn(async move {
                let outage = OutageLog::default();
                let what = format!("{} (make-up samples)", reader.prefix());
                let (read, attempts) = retry
                    .run(&what, &outage, || {
                        reader.fetch_batch(ps_dataset::Split::Train, &samples)
                    })
                    .await;
                startup_read(read, &what, attempts)
            })
        };
        // The samples this rank trains in a make-up step: its piece, or one
        // sample at weight 0 when its piece is empty (it still pushes).
        let of = |s: &crate::makeup::MakeUpStep| -> (Vec<usize>, f32) {
            let piece = s.piece(rank as usize);
            match (piece.is_empty(), s.any()) {
                (true, Some(any)) => (vec![any.sample], 0.0),
                _ => (
                    piece.iter().map(|o| o.sample).collect(),
                    piece.len() as f32 / batch as f32,
                ),
            }
        };
        let mut step = step.max(round.next_step);
        let mut ahead = steps.first().map(|s| fetch(of(s).0));
        for (j, s) in steps.iter().enumerate() {
            if self.opts.stop.as_ref().is_some_and(|s| *s.borrow()) {
                self.exchange.leave(false).await?;
                return Err(WorkerError::Interrupted(step));
            }
            let t_wait = Instant::now();
            let fetched = match ahead.take() {
                Some(task) => task
                    .await
                    .map_err(|e| WorkerError::Mismatch(format!("make-up read stopped: {e}")))??,
                None => break,
            };
            ahead = steps.get(j + 1).map(|next| fetch(of(next).0));
            self.acc.wait += t_wait.elapsed();
            let (samples, weight) = of(s);
            let mut out = self
                .trainer
                .send(ComputeStep(Arc::new(fetched), weight, None))
                .await??;
            slow_compute(&self.opts.simulation, &mut out, samples.len(), step).await;
            self.acc.compute += out.compute + out.compress;
            let t_comm = Instant::now();
            let (updates, traffic) = self.exchange.step(push_of(&mut out)?).await?;
            self.acc.comm += t_comm.elapsed();
            let t_apply = Instant::now();
            self.trainer.send(ApplyUpdates(updates)).await??;
            self.acc.compute += t_apply.elapsed();
            count_step(self.acc, self.evals, out.loss, out.density, &traffic);
            step += 1;
            owing.steps += 1;
            if weight > 0.0 && traffic.fenced == 0 {
                owing.samples += samples.len() as u64;
                if let Some(tx) = &self.opts.trained {
                    for (first, samples) in crate::makeup::runs(s.piece(rank as usize)) {
                        let _ = tx.send(TrainedBatch {
                            rank,
                            step: step - 1,
                            first,
                            samples: samples.into(),
                        });
                    }
                }
            }
            if traffic.next_step > step {
                // Declared dead in a make-up step: the others went on.
                tracing::warn!(
                    rank,
                    from = step,
                    to = traffic.next_step,
                    "the cluster went on without this worker in the make-up steps"
                );
                return Ok(traffic.next_step);
            }
        }
        Ok(step)
    }
}

/// Keeps the progress bar's message on a bucket outage while it lasts
/// ("bucket unreachable 12 s (budget 120 s)", counted up every second), and
/// puts the last step's figures (`step_text`) back once the bucket answers.
async fn show_outages(
    bar: ProgressBar,
    mut status: tokio::sync::watch::Receiver<Option<Outage>>,
    step_text: Rc<RefCell<String>>,
) {
    loop {
        let current = *status.borrow_and_update();
        let changed = match current {
            Some(outage) => {
                bar.set_message(outage.message(tokio::time::Instant::now()));
                tokio::select! {
                    changed = status.changed() => changed,
                    () = tokio::time::sleep(Duration::from_secs(1)) => Ok(()),
                }
            }
            None => {
                bar.set_message(step_text.borrow().clone());
                status.changed().await
            }
        };
        if changed.is_err() {
            return;
        }
    }
}

/// Stops a spawned task when dropped.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// `(test_loss, test_accuracy)` of the model on `test`, evaluated in
/// chunks of `chunk` samples; both NaN for an empty test split (reported
/// as "no test split", never as 0%; NaN is `null` in the JSON).
async fn evaluate(
    trainer: &Addr<TrainerActor>,
    test: &Arc<ps_dataset::Batch>,
    chunk: usize,
) -> Result<(f32, f32), WorkerError> {
    if test.is_empty() {
        return Ok((f32::NAN, f32::NAN));
    }
    let batch = test.clone();
    Ok(trainer.send(Evaluate { batch, chunk }).await??)
}

/// Test samples per evaluation pass: `training.eval_batch_size`, or the
/// training batch size when that is 0.
fn eval_chunk(cfg: &ClusterConfig) -> usize {
    match cfg.training.eval_batch_size {
        0 => cfg.data.batch_size,
        n => n,
    }
}

/// An accuracy for people: `88.40%`, or `no test split` when there was
/// nothing to evaluate on (NaN, see `evaluate`).
pub fn accuracy_text(accuracy: f32, decimals: usize) -> String {
    if accuracy.is_nan() {
        "no test split".to_string()
    } else {
        format!("{:.decimals$}%", 100.0 * accuracy)
    }
}

/// The console line of one epoch; it fits in 100 columns (the JSONL has
/// every field), e.g.
/// `rank 0 epoch 3/10: train_loss 0.412 test_loss 0.398 acc 88.4% wait 1.2s compute 35s comm 4.1s`.
fn epoch_line(r: &EpochReport, epochs: u64) -> String {
    let test = if r.test_accuracy.is_nan() {
        accuracy_text(r.test_accuracy, 1)
    } else if let Some(ppl) = r.test_perplexity {
        // Text models: the perplexity says more than next-token accuracy
        // (which stays in the JSONL and CSV).
        format!(
            "test_loss {} ppl {}",
            short_loss(r.test_loss),
            short_ppl(ppl)
        )
    } else {
        format!(
            "test_loss {} acc {}",
            short_loss(r.test_loss),
            accuracy_text(r.test_accuracy, 1)
        )
    };
    format!(
        "rank {} epoch {}/{epochs}: train_loss {} {test} wait {} compute {} comm {}",
        r.rank,
        r.epoch,
        short_loss(r.train_loss),
        short_secs(r.data_wait_s),
        short_secs(r.compute_s),
        short_secs(r.comm_s),
    )
}

/// A loss in at most 5 characters below 100 000 (`2.303`, `12.35`, `123.5`).
fn short_loss(v: f32) -> String {
    match v.abs() {
        a if a < 10.0 => format!("{v:.3}"),
        a if a < 100.0 => format!("{v:.2}"),
        a if a < 1000.0 => format!("{v:.1}"),
        _ => format!("{v:.0}"),
    }
}

/// The perplexity of a mean per-token loss, `exp(loss)`; `None` when
/// there was no evaluation (a NaN loss).
pub fn perplexity(loss: f32) -> Option<f32> {
    (!loss.is_nan()).then(|| loss.exp())
}

/// A perplexity in at most 6 characters (`3.142`, `12.35`, `4512`, `2.3e9`).
fn short_ppl(v: f32) -> String {
    if v < 100_000.0 {
        short_loss(v)
    } else {
        format!("{v:.1e}")
    }
}

/// Seconds in at most 4 characters below 1000 hours (`0.4s`, `35s`, `20m`, `14h`).
fn short_secs(s: f64) -> String {
    match s {
        s if s < 9.95 => format!("{s:.1}s"),
        s if s < 999.5 => format!("{s:.0}s"),
        s if s < 99.5 * 60.0 => format!("{:.0}m", s / 60.0),
        s => format!("{:.0}h", s / 3600.0),
    }
}

/// Whether a run at `step` has trained `training.max_steps` (0 = no cap).
/// A simulated slow worker (`[compute]` of the simulation): wait out the
/// stretch of this step's compute, counted as compute time.
/// Throughput balancing: adds the splits `link` learned to `plan`.
fn learn_splits(plan: &mut RankPlan, link: &BalanceLink) -> Result<(), WorkerError> {
    for split in link.news().splits {
        if plan.splits().last().is_none_or(|l| l.from < split.from) {
            plan.push_split(split)
                .map_err(|e| WorkerError::Sampler(e.to_string()))?;
        }
    }
    Ok(())
}

/// The push a step computed whole (not streamed to the exchange).
fn push_of(out: &mut crate::trainer::StepOutput) -> Result<Outgoing, WorkerError> {
    out.grad
        .take()
        .ok_or_else(|| WorkerError::Mismatch("a streamed step has no push to hand over".into()))
}

async fn slow_compute(
    sim: &Simulation,
    out: &mut crate::trainer::StepOutput,
    samples: usize,
    step: u64,
) {
    let extra = sim
        .compute
        .extra_at(out.compute + out.compress, samples, step);
    if !extra.is_zero() {
        tokio::time::sleep(extra).await;
        out.compute += extra;
    }
}

fn max_steps_reached(max_steps: u64, step: u64) -> bool {
    max_steps > 0 && step >= max_steps
}

/// Closes the epoch in `acc` (`epoch` counts from 0, as the sampler does;
/// the report counts from 1); `(test_loss, test_accuracy)` come from the
/// evaluation at its last step.
fn close_epoch(
    rank: u32,
    epoch: u64,
    workers: u32,
    acc: &mut EpochAcc,
    (test_loss, test_accuracy): (f32, f32),
    text: bool,
) -> EpochReport {
    let a = std::mem::take(acc);
    let steps = a.steps.max(1);
    EpochReport {
        rank,
        epoch: epoch + 1,
        steps: a.steps,
        train_loss: (a.loss_sum / steps as f64) as f32,
        test_loss,
        test_accuracy,
        test_perplexity: if text { perplexity(test_loss) } else { None },
        data_wait_s: a.wait.as_secs_f64(),
        compute_s: a.compute.as_secs_f64(),
        comm_s: a.comm.as_secs_f64(),
        epoch_s: a.started.map_or(0.0, |s| s.elapsed().as_secs_f64()),
        bytes_pushed: a.pushed,
        bytes_pulled: a.pulled,
        density: a.density_sum / steps as f64,
        memory_hit_rate: 0.0,
        disk_hit_rate: 0.0,
        bucket_gets: 0,
        bucket_data_gets: 0,
        bucket_manifest_gets: 0,
        bucket_test_gets: 0,
        bucket_get_attempts: 0,
        images_decoded: 0,
        decode_s: 0.0,
        images_per_core_s: 0.0,
        trainer_samples_per_s: 0.0,
        bad_samples: 0,
        bucket_bytes: 0,
        bucket_cost_usd: 0.0,
        fetch_retries: 0,
        peer_hit_rate: 0.0,
        peer_bytes: 0,
        peer_fallbacks: 0,
        peer_saved_usd: 0.0,
        round_trips: a.round_trips,
        min_live_workers: a.min_live.unwrap_or(workers),
        steps_short_of_workers: a.short_steps,
        lr: a.lr,
    }
}

/// The evaluation targets of a run: `training.target_accuracy` and
/// `training.target_loss` (0 = none).
#[derive(Debug, Clone, Copy, Default)]
struct Target {
    accuracy: f32,
    loss: f32,
}

impl Target {
    /// Why an evaluation with these results ends the run, if it does.
    fn reached(&self, test_loss: f32, test_accuracy: f32) -> Option<StopReason> {
        if self.accuracy > 0.0 && test_accuracy >= self.accuracy {
            Some(StopReason::TargetAccuracy)
        } else if self.loss > 0.0 && test_loss <= self.loss {
            Some(StopReason::TargetLoss)
        } else {
            None
        }
    }

    /// What the servers are told when the run stopped with `stop` at the
    /// evaluation `at`: which target it reached, and with what (`None`
    /// when the run stopped for another reason).
    fn reached_at(&self, stop: StopReason, at: &EvalPoint) -> Option<String> {
        match stop {
            StopReason::TargetAccuracy => Some(format!(
                "reached training.target_accuracy = {} (test accuracy {:.4}) at step {}",
                self.accuracy, at.test_accuracy, at.step
            )),
            StopReason::TargetLoss => Some(format!(
                "reached training.target_loss = {} (test loss {:.4}) at step {}",
                self.loss, at.test_loss, at.step
            )),
            _ => None,
        }
    }
}

/// Evaluations of one run, and the training clock they are kept off.
struct Evals {
    every: u64,
    target: Target,
    points: Vec<EvalPoint>,
    /// Time of the first step.
    started: Option<Instant>,
    /// Evaluation time so far, left out of `train_s`.
    spent: Duration,
    pushed: u64,
    pulled: u64,
    /// Bytes the exchanges copied (see [`ps_net::protocol::Copied`]).
    copied: ps_net::protocol::Copied,
    /// Shards whose push left while the backward pass still ran
    /// (`training.overlap_backward`).
    early_shards: u64,
    /// The last `keep` training batches (shared, not copied), on which a
    /// model with batch norm recomputes its running statistics before each
    /// evaluation; `keep` is 0 for models without batch norm.
    recent: VecDeque<Arc<ps_dataset::Batch>>,
    keep: usize,
    /// The dataset is text: evaluations report the perplexity too.
    text: bool,
    /// Test samples per evaluation pass (0 = the whole split at once).
    chunk: usize,
}

impl Evals {
    /// Evaluations every `every` steps (0: at epoch ends) towards `target`,
    /// keeping the last `keep` training batches for batch-norm calibration.
    fn new(every: u64, target: Target, keep: usize, text: bool) -> Self {
        Self {
            text,
            every,
            target,
            points: Vec::new(),
            started: None,
            spent: Duration::ZERO,
            pushed: 0,
            pulled: 0,
            copied: Default::default(),
            early_shards: 0,
            recent: VecDeque::new(),
            keep,
            chunk: 0,
        }
    }

    fn remember(&mut self, batch: &Arc<ps_dataset::Batch>) {
        if self.keep == 0 {
            return;
        }
        if self.recent.len() == self.keep {
            self.recent.pop_front();
        }
        self.recent.push_back(batch.clone());
    }

    fn train_s(&self) -> f64 {
        self.started.map_or(0.0, |s| {
            s.elapsed().saturating_sub(self.spent).as_secs_f64()
        })
    }

    /// Evaluates at `step` unless that step was evaluated already; returns
    /// `(test_loss, test_accuracy)`.
    async fn at(
        &mut self,
        step: u64,
        trainer: &Addr<TrainerActor>,
        test: &Arc<ps_dataset::Batch>,
    ) -> Result<(f32, f32), WorkerError> {
        if let Some(p) = self.points.last().filter(|p| p.step == step) {
            return Ok((p.test_loss, p.test_accuracy));
        }
        let train_s = self.train_s();
        let t0 = Instant::now();
        if !self.recent.is_empty() {
            let batches = self.recent.iter().cloned().collect();
            trainer.send(CalibrateBn(batches)).await??;
        }
        let (test_loss, test_accuracy) = evaluate(trainer, test, self.chunk).await?;
        self.spent += t0.elapsed();
        self.points.push(EvalPoint {
            step,
            train_s,
            test_accuracy,
            test_loss,
            test_perplexity: if self.text {
                perplexity(test_loss)
            } else {
                None
            },
            bytes_pushed: self.pushed,
            bytes_pulled: self.pulled,
        });
        Ok((test_loss, test_accuracy))
    }

    /// The last evaluation reached a target: why the run stops.
    fn reached_target(&self) -> Option<StopReason> {
        let last = self.points.last()?;
        self.target.reached(last.test_loss, last.test_accuracy)
    }
}

/// The per-epoch metrics files: `worker-<rank>.jsonl` and `worker-<rank>.csv`.
struct MetricsFiles {
    jsonl: (PathBuf, std::fs::File),
    csv: (PathBuf, csv::Writer<std::fs::File>),
}

fn open_metrics(cfg: &ClusterConfig, rank: u32) -> Result<Option<MetricsFiles>, WorkerError> {
    if cfg.training.metrics_dir.is_empty() {
        return Ok(None);
    }
    let dir = PathBuf::from(&cfg.training.metrics_dir);
    let create = |name: String| {
        let path = dir.join(name);
        let io = |source| WorkerError::Metrics {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let file = std::fs::File::create(&path).map_err(io)?;
        Ok::<_, WorkerError>((path, file))
    };
    let jsonl = create(format!("worker-{rank}.jsonl"))?;
    let (csv_path, csv_file) = create(format!("worker-{rank}.csv"))?;
    Ok(Some(MetricsFiles {
        jsonl,
        csv: (csv_path, csv::Writer::from_writer(csv_file)),
    }))
}

/// Appends `report` to both metrics files: a JSON line, and a CSV row
/// (with the header before the first) whose columns are the fields of
/// [`EpochReport`] in order; f32 fields are written as f32 in both.
fn write_metrics(out: &mut Option<MetricsFiles>, report: &EpochReport) -> Result<(), WorkerError> {
    let Some(files) = out else { return Ok(()) };
    let (path, file) = &mut files.jsonl;
    let io = |path: &PathBuf, source| WorkerError::Metrics {
        path: path.clone(),
        source,
    };
    let line = serde_json::to_string(report).map_err(|e| io(path, e.into()))?;
    writeln!(file, "{line}").map_err(|e| io(path, e))?;
    let (path, writer) = &mut files.csv;
    writer.serialize(report).map_err(|e| io(path, e.into()))?;
    // Flushed per epoch, so the file is complete while the run goes on.
    writer.flush().map_err(|e| io(path, e))
}

/// Appends a per-step record to the JSONL file (flushed at once, so the
/// file is complete while the run goes on).
fn write_step_metrics(
    out: &mut Option<MetricsFiles>,
    rank: u32,
    figures: &StepFigures,
) -> Result<(), WorkerError> {
    let Some(files) = out else { return Ok(()) };
    let (path, file) = &mut files.jsonl;
    writeln!(file, "{}", figures.jsonl(rank)).map_err(|source| WorkerError::Metrics {
        path: path.clone(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_dataset::Batch;

    #[test]
    fn worker_errors_map_to_their_exit_codes() {
        use ps_net::cli::exit_code;
        let code = |e: WorkerError| exit_code(&e, classify_exit);
        let dataset = |permanent| DatasetError::Corrupt {
            object: "train/00001.tar".into(),
            message: "cannot decode".into(),
            permanent,
        };
        assert_eq!(
            code(WorkerError::Mismatch("input".into())),
            ExitCode::Config
        );
        assert_eq!(
            code(WorkerError::Loader(LoaderError::Outage {
                object: "manifest.json".into(),
                attempts: 9,
                failing_s: 120.0,
                source: Box::new(DatasetError::Invalid("refused".into())),
            })),
            ExitCode::BucketOutage
        );
        assert_eq!(
            code(WorkerError::Trainer(TrainerError::Diverged(f32::NAN))),
            ExitCode::Diverged
        );
        assert_eq!(
            code(WorkerError::Loader(LoaderError::Fetch {
                object: "train/00001.tar".into(),
                attempts: 1,
                source: Box::new(dataset(true)),
            })),
            ExitCode::JobStopped
        );
        assert_eq!(
            code(WorkerError::Loader(LoaderError::Dataset(dataset(true)))),
            ExitCode::JobStopped
        );
        // A short body (a cut connection) is not a bad sample.
        assert_eq!(
            code(WorkerError::Loader(LoaderError::Dataset(dataset(false)))),
            ExitCode::Failed
        );
        assert_eq!(
            code(WorkerError::Comm(CommError::Unreachable {
                addr: "127.0.0.1:7400".into(),
                secs: 30,
                last: "refused".into(),
            })),
            ExitCode::Unreachable
        );
        assert_eq!(code(WorkerError::Interrupted(3)), ExitCode::Terminated);
        let waiting = WorkerError::StoppedWaiting {
            step: 3,
            waiting_for: "data",
            goodbye: false,
        };
        assert!(
            waiting.to_string().contains("while waiting for data"),
            "{waiting}"
        );
        assert_eq!(code(waiting), ExitCode::Terminated);
        assert_eq!(code(WorkerError::Crashed(3)), ExitCode::Failed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_cuts_a_wait_short() {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let stop = Some(rx);
        // Nothing to stop on: the wait's own result.
        assert_eq!(until_stop(&None, async { 7 }).await, Some(7));
        let forever = std::future::pending::<u32>();
        let stop_for_forever = stop.clone();
        let waiting = tokio::spawn(async move { until_stop(&stop_for_forever, forever).await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        // A wait that ends within the grace after the stop keeps its result.
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<u32>();
        let finishing = tokio::spawn(async move { until_stop(&stop, done_rx).await });
        tokio::task::yield_now().await;
        let t0 = tokio::time::Instant::now();
        tx.send_replace(true);
        tokio::time::sleep(WAIT_GRACE / 2).await;
        let _ = done_tx.send(5);
        assert_eq!(finishing.await.expect("the finishing task"), Some(Ok(5)));
        // One that does not is cut short at the grace's end.
        assert_eq!(waiting.await.expect("the wait task"), None);
        assert!(t0.elapsed() >= WAIT_GRACE, "{:?}", t0.elapsed());
    }

    /// Lets the other tasks of the `LocalSet` run until `done` holds (a
    /// bounded number of turns; nothing waits on the clock).
    async fn turns_until(done: impl Fn() -> bool) -> bool {
        for _ in 0..100 {
            if done() {
                return true;
            }
            tokio::task::yield_now().await;
        }
        done()
    }

    #[tokio::test(start_paused = true)]
    async fn the_bar_shows_an_outage_while_it_lasts() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let bar = ProgressBar::hidden();
                let (tx, rx) = tokio::sync::watch::channel(None);
                let text = Rc::new(RefCell::new("epoch 1/2".to_string()));
                let view = tokio::task::spawn_local(show_outages(bar.clone(), rx, text.clone()));
                assert!(turns_until(|| bar.message() == "epoch 1/2").await);
                let since = tokio::time::Instant::now();
                tx.send_replace(Some(Outage {
                    since,
                    budget: Duration::from_secs(120),
                }));
                let shows = |s: &str| bar.message() == s;
                assert!(
                    turns_until(|| shows("bucket unreachable 0 s (budget 120 s)")).await,
                    "{}",
                    bar.message()
                );
                // The count goes up while the outage lasts.
                tokio::time::advance(Duration::from_secs(12)).await;
                assert!(
                    turns_until(|| shows("bucket unreachable 12 s (budget 120 s)")).await,
                    "{}",
                    bar.message()
                );
                // Recovery shows the figures of the latest step, also one
                // trained during the outage.
                *text.borrow_mut() = "epoch 2/2".into();
                tx.send_replace(None);
                assert!(
                    turns_until(|| shows("epoch 2/2")).await,
                    "{}",
                    bar.message()
                );
                drop(tx);
                view.await.expect("the view stops with the log");
            })
            .await;
    }

    fn evals(keep: usize) -> Evals {
        Evals::new(0, Target::default(), keep, false)
    }

    #[test]
    fn a_target_is_reached_by_accuracy_or_by_loss() {
        let none = Target::default();
        assert_eq!(none.reached(0.0, 1.0), None, "no target, no stop");
        let acc = Target {
            accuracy: 0.97,
            loss: 0.0,
        };
        assert_eq!(acc.reached(0.1, 0.969), None);
        assert_eq!(acc.reached(9.0, 0.97), Some(StopReason::TargetAccuracy));
        let loss = Target {
            accuracy: 0.0,
            loss: 1.5,
        };
        assert_eq!(
            loss.reached(1.501, 1.0),
            None,
            "accuracy alone is no target"
        );
        assert_eq!(loss.reached(1.5, 0.0), Some(StopReason::TargetLoss));
        assert_eq!(
            loss.reached(f32::NAN, 0.0),
            None,
            "a NaN loss never reaches"
        );
        let both = Target {
            accuracy: 0.9,
            loss: 1.0,
        };
        assert_eq!(both.reached(0.5, 0.1), Some(StopReason::TargetLoss));
        assert_eq!(both.reached(3.0, 0.95), Some(StopReason::TargetAccuracy));
    }

    /// A report with every figure at a large but possible value.
    fn large_report() -> EpochReport {
        let mut acc = EpochAcc {
            steps: 123_456,
            loss_sum: 123_456.0 * 23.456_789,
            wait: Duration::from_secs_f64(9_876.5),
            compute: Duration::from_secs_f64(123_456.7),
            comm: Duration::from_secs_f64(98_765.4),
            pushed: u64::MAX / 4,
            pulled: u64::MAX / 4,
            density_sum: 123_456.0,
            round_trips: u64::MAX,
            ..EpochAcc::default()
        };
        let mut r = close_epoch(999, 999, 1000, &mut acc, (12.345_678, 1.0), false);
        r.bucket_gets = u64::MAX;
        r.bucket_cost_usd = 123_456.789;
        r
    }

    #[test]
    fn the_epoch_line_fits_100_columns_and_labels_both_losses() {
        let r = large_report();
        let line = epoch_line(&r, 1000);
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.len()
        );
        assert!(line.starts_with("rank 999 epoch 1000/1000: "), "{line}");
        assert!(line.contains("train_loss 23.46 "), "{line}");
        assert!(line.contains("test_loss 12.35 "), "{line}");
        assert!(line.contains("acc 100.0% "), "{line}");
        assert!(line.contains("wait 3h compute 34h comm 27h"), "{line}");
        let mut small = r.clone();
        (small.train_loss, small.test_loss, small.test_accuracy) = (0.4123, 0.3981, 0.884);
        (small.data_wait_s, small.compute_s, small.comm_s) = (0.04, 35.2, 4.1);
        assert_eq!(
            epoch_line(&small, 1000),
            "rank 999 epoch 1000/1000: train_loss 0.412 test_loss 0.398 acc 88.4% \
             wait 0.0s compute 35s comm 4.1s"
        );
        // No test split: never "acc 0.0%".
        let mut none = small.clone();
        (none.test_loss, none.test_accuracy) = (f32::NAN, f32::NAN);
        let line = epoch_line(&none, 1000);
        assert!(
            line.contains("train_loss 0.412 no test split wait"),
            "{line}"
        );
        assert!(line.chars().count() <= 100, "{line}");
        assert_eq!(accuracy_text(0.884, 2), "88.40%");
        assert_eq!(accuracy_text(0.0, 1), "0.0%");
        assert_eq!(accuracy_text(f32::NAN, 2), "no test split");
    }

    #[test]
    fn short_figures_keep_their_width() {
        for (s, want) in [
            (9.94, "9.9s"),
            (9.96, "10s"),
            (999.4, "999s"),
            (999.6, "17m"),
            (5969.0, "99m"),
            (5971.0, "2h"),
        ] {
            assert_eq!(short_secs(s), want, "{s}");
        }
        for (v, want) in [
            (2.456_7, "2.457"),
            (99.994, "99.99"),
            (999.94, "999.9"),
            (123_456.0, "123456"),
        ] {
            assert_eq!(short_loss(v), want, "{v}");
        }
    }

    #[test]
    fn text_models_report_the_perplexity_of_the_test_loss() {
        let mut acc = EpochAcc {
            steps: 2,
            loss_sum: 2.0 * 2.5,
            ..EpochAcc::default()
        };
        let r = close_epoch(0, 0, 1, &mut acc, (2.0, 0.25), true);
        let ppl = r.test_perplexity.expect("a text model has a perplexity");
        assert!((ppl - 2.0f32.exp()).abs() < 1e-5, "{ppl}");
        let line = epoch_line(&r, 3);
        assert!(line.contains("test_loss 2.000 ppl 7.389 wait"), "{line}");
        // The largest loss of `large_report` still fits the line.
        let mut big = large_report();
        big.test_perplexity = perplexity(big.test_loss);
        let line = epoch_line(&big, 1000);
        assert!(line.contains("test_loss 12.35 ppl 2.3e5 "), "{line}");
        assert!(line.chars().count() <= 100, "{line}");
        // Other datasets and runs without a test split have none.
        assert_eq!(large_report().test_perplexity, None);
        let mut acc = EpochAcc::default();
        let none = close_epoch(0, 0, 1, &mut acc, (f32::NAN, f32::NAN), true);
        assert_eq!(none.test_perplexity, None);
        // In the metrics: a number for text, null / an empty cell otherwise.
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = ClusterConfig::default();
        cfg.training.metrics_dir = dir.path().join("runs").display().to_string();
        let mut files = open_metrics(&cfg, 0).unwrap();
        write_metrics(&mut files, &r).unwrap();
        write_metrics(&mut files, &large_report()).unwrap();
        drop(files);
        let jsonl = std::fs::read_to_string(dir.path().join("runs/worker-0.jsonl")).unwrap();
        let records: Vec<serde_json::Value> = jsonl
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let text_ppl = records[0]["test_perplexity"].as_f64().unwrap();
        assert!((text_ppl - 2.0f64.exp()).abs() < 1e-4, "{text_ppl}");
        assert!(records[1]["test_perplexity"].is_null(), "{}", records[1]);
        let csv = std::fs::read_to_string(dir.path().join("runs/worker-0.csv")).unwrap();
        let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
        let col = rows[0]
            .iter()
            .position(|h| *h == "test_perplexity")
            .unwrap();
        assert_eq!(rows[0][col - 1], "test_accuracy");
        assert!(rows[1][col].parse::<f32>().is_ok(), "{:?}", rows[1]);
        assert_eq!(rows[2][col], "");
    }

    #[test]
    fn metrics_files_agree_on_epochs_columns_and_f32_digits() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = ClusterConfig::default();
        cfg.training.metrics_dir = dir.path().join("runs").display().to_string();
        let mut files = open_metrics(&cfg, 7).unwrap();
        for epoch in 0..2 {
            let mut acc = EpochAcc {
                steps: 3,
                loss_sum: 3.0 * 0.613_333_34,
                ..EpochAcc::default()
            };
            let r = close_epoch(7, epoch, 2, &mut acc, (0.5, 0.613_333_34), false);
            write_metrics(&mut files, &r).unwrap();
        }
        drop(files);
        let jsonl = std::fs::read_to_string(dir.path().join("runs/worker-7.jsonl")).unwrap();
        let csv = std::fs::read_to_string(dir.path().join("runs/worker-7.csv")).unwrap();
        let lines: Vec<&str> = jsonl.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].starts_with("{\"epoch\":1,\"rank\":7,"),
            "{}",
            lines[0]
        );
        assert!(lines[1].starts_with("{\"epoch\":2,"), "{}", lines[1]);
        assert!(
            lines[0].contains("\"test_accuracy\":0.61333334,"),
            "{}",
            lines[0]
        );
        let rows: Vec<&str> = csv.lines().collect();
        assert_eq!(rows.len(), 3, "{csv}");
        let header: Vec<&str> = rows[0].split(',').collect();
        assert_eq!(
            header[..11],
            [
                "epoch",
                "rank",
                "steps",
                "epoch_s",
                "train_loss",
                "test_loss",
                "test_accuracy",
                "test_perplexity",
                "data_wait_s",
                "compute_s",
                "comm_s"
            ]
        );
        assert_eq!(header.last(), Some(&"lr"));
        let first: Vec<&str> = rows[1].split(',').collect();
        assert_eq!(first.len(), header.len());
        assert_eq!(first[..2], ["1", "7"]);
        assert_eq!(first[6], "0.61333334");
        assert_eq!(rows[2].split(',').next(), Some("2"));
        // Every JSONL field is a CSV column, in the same order.
        let record: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        let mut keys: Vec<String> = record.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        let mut sorted_header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
        sorted_header.sort();
        assert_eq!(keys, sorted_header);
    }

    #[test]
    fn the_calibration_ring_keeps_the_last_batches_without_copying() {
        let batches: Vec<Arc<Batch>> = (0..5)
            .map(|i| {
                Arc::new(Batch {
                    features: vec![i as f32],
                    labels: vec![0],
                    dim: 1,
                })
            })
            .collect();
        let mut e = evals(3);
        for b in &batches {
            e.remember(b);
        }
        assert_eq!(e.recent.len(), 3);
        for (kept, b) in e.recent.iter().zip(&batches[2..]) {
            assert!(Arc::ptr_eq(kept, b));
        }
        // Models without batch norm keep nothing.
        let mut none = evals(0);
        none.remember(&batches[0]);
        assert!(none.recent.is_empty());
    }
}

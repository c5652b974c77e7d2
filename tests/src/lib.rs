//! Helpers for the Stratus integration tests: whole clusters in one process.

pub mod scale;

use std::sync::Arc;

use futures::future::{FutureExt, LocalBoxFuture};
use object_store::{memory::InMemory, path::Path, ObjectStore};
use ps_dataset::{synthetic, write_dataset, SyntheticSpec};
use ps_net::pki::{CertPair, ClusterCa};
use ps_server::net::ServerTls;
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_worker::comm::WorkerTls;
use ps_worker::run::{
    run_node_with, run_worker_with, ModelFactory, WorkerError, WorkerOptions, WorkerReport,
};
use ps_worker::simulate::Simulation;

/// Prints the servers' and workers' tracing output when `RUST_LOG` is set
/// (e.g. `RUST_LOG=ps_server=debug,ps_worker=info`); silent otherwise.
pub fn log_from_env() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    }
}

/// A cluster CA with a loopback server certificate and one client
/// certificate per worker rank, all in memory.
pub struct TestPki {
    pub ca: ClusterCa,
    pub server: ServerTls,
    workers: Vec<CertPair>,
}

impl TestPki {
    pub fn new(workers: u32) -> Self {
        let ca = ClusterCa::generate("stratus test CA").expect("generate a CA");
        let server = ca
            .issue_server(&["localhost".into(), "127.0.0.1".into()])
            .expect("issue a server certificate");
        let workers = (0..workers)
            .map(|r| ca.issue_worker(r).expect("issue a worker certificate"))
            .collect();
        Self {
            server: ServerTls {
                cert_pem: server.cert_pem,
                key_pem: server.key_pem,
                ca_pem: ca.cert_pem().to_string(),
            },
            ca,
            workers,
        }
    }

    /// TLS material of worker `rank`.
    pub fn worker(&self, rank: u32) -> WorkerTls {
        WorkerTls {
            ca_pem: self.server.ca_pem.clone(),
            identity: self.workers[rank as usize].clone(),
        }
    }

    /// Options for worker `rank` (no progress bar, no fault injection).
    pub fn options(&self, rank: u32) -> WorkerOptions {
        worker_options(rank, self.worker(rank))
    }
}

/// Options for worker `rank` with TLS material `tls` (no progress bar, no
/// fault injection).
pub fn worker_options(rank: u32, tls: WorkerTls) -> WorkerOptions {
    WorkerOptions {
        rank,
        tls,
        progress: false,
        epoch_lines: false,
        crash_after_steps: None,
        pause_after_steps: None,
        stop: None,
        steps_done: None,
        trained: None,
        simulation: Simulation::default(),
    }
}

/// A UDP port on loopback that was free a moment ago (the socket that found
/// it is closed again), for a server process the test starts.
pub fn free_udp_port() -> u16 {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a free port");
    socket.local_addr().expect("its address").port()
}

/// Point `cfg.tls` at the files `ps-server certs` writes under `certs` (the
/// CA, the server's pair, one `worker-{rank}` pair per worker), and have no
/// process generate missing ones.
pub fn tls_files_under(cfg: &mut ClusterConfig, certs: &std::path::Path) {
    cfg.tls.ca = certs.join("ca.pem");
    cfg.tls.ca_key = certs.join("ca.key");
    cfg.tls.cert = certs.join("server.pem");
    cfg.tls.key = certs.join("server.key");
    cfg.tls.worker_cert = certs.join("worker-{rank}.pem").display().to_string();
    cfg.tls.worker_key = certs.join("worker-{rank}.key").display().to_string();
    cfg.tls.generate_if_missing = false;
}

/// Write `cfg` to `<dir>/cluster.toml` without its token (a process gets
/// the token through the environment), then have `ps-server certs` write
/// the TLS files `cfg.tls` names; returns the config file's path.
pub fn config_file_with_certs(cfg: &ClusterConfig, dir: &std::path::Path) -> std::path::PathBuf {
    let config = dir.join("cluster.toml");
    std::fs::write(&config, cfg.to_redacted_toml().expect("toml")).expect("write config");
    let certs = std::process::Command::new(server_binary())
        .env_remove("STRATUS_CONFIG")
        .env_remove("STRATUS_METRICS_ADDR")
        .env(ps_shared::config::TOKEN_ENV, &cfg.cluster.token)
        .arg("--config")
        .arg(&config)
        .arg("certs")
        .output()
        .expect("run ps-server certs");
    assert!(
        certs.status.success(),
        "ps-server certs: {}",
        String::from_utf8_lossy(&certs.stderr)
    );
    config
}

/// Worker `rank`'s TLS material, from the files `ps-server certs` wrote
/// where `cfg.tls` names them.
pub fn worker_tls_from_files(cfg: &ClusterConfig, rank: u32) -> WorkerTls {
    let (cert, key) = cfg.tls.worker_paths(rank);
    WorkerTls {
        ca_pem: ps_net::transport::read_pem(&cfg.tls.ca).expect("CA certificate"),
        identity: CertPair::read(&cert, &key).expect("worker certificate"),
    }
}

/// `bin --config <config> run` with `token` in the environment, logging at
/// info without colour to a piped stderr (stdin and stdout closed), for the
/// test to read its log lines.
pub fn server_run_command(
    bin: &std::path::Path,
    config: &std::path::Path,
    token: &str,
) -> std::process::Command {
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("--config")
        .arg(config)
        .arg("run")
        .env(ps_shared::config::TOKEN_ENV, token)
        .env("STRATUS_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// A connection of worker `rank` of `cfg`, with TLS material `tls`, to the
/// server at `addr` that said Hello and was welcomed; the test drives it.
pub async fn welcomed_connection(
    tls: &WorkerTls,
    cfg: &ClusterConfig,
    addr: std::net::SocketAddr,
    rank: u32,
) -> quinn::Connection {
    use ps_net::transport::{self, EndpointLimits};
    let ep = transport::client_endpoint(
        &tls.ca_pem,
        &tls.identity,
        false,
        &EndpointLimits::default(),
    )
    .expect("client endpoint");
    let conn = transport::connect(&ep, addr, "localhost", std::time::Duration::from_secs(10))
        .await
        .expect("connect");
    let (resp, _) = transport::call(&conn, &hello(cfg, rank), cfg.server.max_frame_bytes)
        .await
        .expect("hello");
    assert!(
        matches!(resp, ps_net::protocol::Response::Welcome { .. }),
        "{resp:?}"
    );
    conn
}

/// A synthetic dataset written to an in-memory bucket.
pub async fn synthetic_bucket(spec: &SyntheticSpec) -> (Arc<dyn ObjectStore>, Path) {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let prefix = Path::from("synthetic");
    let (train, test) = synthetic(spec);
    write_dataset(
        store.as_ref(),
        &prefix,
        "synthetic",
        spec.features,
        spec.classes,
        &train,
        &test,
        512,
    )
    .await
    .expect("write synthetic dataset");
    (store, prefix)
}

/// [`synthetic_bucket`] for a test outside any runtime: written on a
/// runtime of its own (the in-memory store outlives it).
pub fn synthetic_bucket_blocking(spec: &SyntheticSpec) -> (Arc<dyn ObjectStore>, Path) {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to write the dataset")
        .block_on(synthetic_bucket(spec))
}

/// The embedded config adjusted for an in-process test cluster.
pub fn test_config(kind: CompressionKind, density: f64, epochs: u64) -> ClusterConfig {
    let mut cfg = ClusterConfig::embedded_default().expect("embedded config");
    cfg.cluster.servers = vec!["127.0.0.1:0".into()];
    cfg.cluster.shards_per_server = 2;
    cfg.cluster.workers = 2;
    cfg.training.epochs = epochs;
    cfg.training.metrics_dir = String::new();
    cfg.compression.kind = kind;
    cfg.compression.density = density;
    if kind == CompressionKind::None {
        cfg.optimizer.momentum = 0.9;
    }
    cfg.validate().expect("valid test config");
    cfg
}

/// The Hello a worker of `cfg` with `rank` sends first.
pub fn hello(cfg: &ClusterConfig, rank: u32) -> ps_net::protocol::Request {
    ps_net::protocol::Request::Hello {
        protocol_version: ps_net::protocol::PROTOCOL_VERSION,
        token: cfg.cluster.token.clone(),
        worker_rank: rank,
        workers: cfg.cluster.workers as u32,
        workers_per_node: cfg.cluster.workers_per_node as u32,
        num_params: cfg.model.num_params() as u64,
        layout_hash: cfg.model.layout_hash(),
    }
}

/// Raise `server.max_frame_bytes` to hold one dense shard of the model with
/// framing, whatever the model size.
pub fn fit_frames_to_model(cfg: &mut ClusterConfig) {
    let dense_shard = 4 * cfg.model.num_params().div_ceil(cfg.total_shards());
    cfg.server.max_frame_bytes = cfg.server.max_frame_bytes.max(2 * dense_shard + 4096);
}

/// Start server process 0 of `cfg` on a free loopback port.
pub async fn start_loopback_server(
    cfg: &ClusterConfig,
    pki: &TestPki,
) -> ps_server::net::RunningServer {
    ps_server::net::start(
        cfg,
        0,
        "127.0.0.1:0".parse().expect("loopback address"),
        &pki.server,
    )
    .await
    .expect("start a server on loopback")
}

/// Upper bound on a whole in-process cluster run.
pub const CLUSTER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Run every server process of `cfg.cluster.servers` and every worker in this process
/// (grouped into nodes when `cluster.workers_per_node` > 1); returns the workers'
/// reports in rank order.
pub fn run_cluster(
    cfg: ClusterConfig,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
) -> anyhow::Result<Vec<WorkerReport>> {
    run_cluster_simulated(cfg, &Simulation::default(), store, prefix)
}

/// One run per worker of `cfg`, or with `cluster.workers_per_node` > 1 one
/// per node with its ranks, to be polled as tasks of one thread; each yields
/// its ranks' outcomes in rank order.
pub fn rank_runs<'a>(
    cfg: &'a ClusterConfig,
    opts: impl Fn(u32) -> WorkerOptions,
    store: &Arc<dyn ObjectStore>,
    prefix: &Path,
) -> Vec<LocalBoxFuture<'a, Vec<Result<WorkerReport, WorkerError>>>> {
    rank_runs_with(cfg, opts, store, prefix, None)
}

/// [`rank_runs`] with each rank's model from `model` (`None`: from `[model]`).
pub fn rank_runs_with<'a>(
    cfg: &'a ClusterConfig,
    opts: impl Fn(u32) -> WorkerOptions,
    store: &Arc<dyn ObjectStore>,
    prefix: &Path,
    model: Option<ModelFactory>,
) -> Vec<LocalBoxFuture<'a, Vec<Result<WorkerReport, WorkerError>>>> {
    let wpn = cfg.cluster.workers_per_node.max(1) as u32;
    if wpn == 1 {
        (0..cfg.cluster.workers as u32)
            .map(|rank| {
                let run = run_worker_with(
                    cfg,
                    opts(rank),
                    store.clone(),
                    prefix.clone(),
                    model.clone(),
                );
                async move { vec![run.await] }.boxed_local()
            })
            .collect()
    } else {
        (0..cfg.nodes() as u32)
            .map(|node| {
                let ranks = (node * wpn..(node + 1) * wpn).map(&opts).collect();
                run_node_with(
                    cfg,
                    node,
                    ranks,
                    store.clone(),
                    prefix.clone(),
                    model.clone(),
                )
                .boxed_local()
            })
            .collect()
    }
}

/// [`run_cluster`] with every worker simulating `sim`'s link and bucket.
pub fn run_cluster_simulated(
    cfg: ClusterConfig,
    sim: &Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
) -> anyhow::Result<Vec<WorkerReport>> {
    Ok(run_cluster_detailed(cfg, sim, store, prefix)?.0)
}

/// [`run_cluster_simulated`], also returning every shard's final status
/// (versions, counters, server CPU time).
pub fn run_cluster_detailed(
    cfg: ClusterConfig,
    sim: &Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
) -> anyhow::Result<(Vec<WorkerReport>, Vec<ps_server::actor::ShardStatus>)> {
    run_cluster_with_model(cfg, sim, store, prefix, None)
}

/// [`run_cluster_detailed`] with every rank's model from `model` (a model a
/// program brings through `ps_worker::api`; `None`: from `[model]`).
pub fn run_cluster_with_model(
    cfg: ClusterConfig,
    sim: &Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    model: Option<ModelFactory>,
) -> anyhow::Result<(Vec<WorkerReport>, Vec<ps_server::actor::ShardStatus>)> {
    run_cluster_per_rank(cfg, &|_| sim.clone(), store, prefix, model)
}

/// [`run_cluster_with_model`] with each rank's own simulation (`sim(rank)`):
/// e.g. one slow worker among fast ones.
pub fn run_cluster_per_rank(
    cfg: ClusterConfig,
    sim: &dyn Fn(u32) -> Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    model: Option<ModelFactory>,
) -> anyhow::Result<(Vec<WorkerReport>, Vec<ps_server::actor::ShardStatus>)> {
    run_cluster_counted(cfg, sim, store, prefix, model).map(|(r, s, _)| (r, s))
}

/// What [`run_cluster_traced`] returns: the reports, the shards' status and
/// every batch the workers trained.
pub type Traced = (
    Vec<WorkerReport>,
    Vec<ps_server::actor::ShardStatus>,
    Vec<ps_worker::run::TrainedBatch>,
);

/// A dense run of `workers` workers on `shards` shards of one server over a
/// synthetic set of `train` samples (1024 test) for `epochs`, with
/// `configure` applied to [`test_config`]'s config before it is validated
/// and each rank under `sim(rank)`; returns the config and what the run
/// traced. Panics when the config is invalid or the run fails.
pub fn train_synthetic_traced(
    train: usize,
    epochs: u64,
    workers: usize,
    shards: usize,
    configure: impl FnOnce(&mut ClusterConfig),
    sim: &dyn Fn(u32) -> Simulation,
) -> (ClusterConfig, Traced) {
    log_from_env();
    let spec = SyntheticSpec {
        train,
        test: 1024,
        ..SyntheticSpec::default()
    };
    let (store, prefix) = synthetic_bucket_blocking(&spec);
    let mut cfg = test_config(CompressionKind::None, 1.0, epochs);
    cfg.cluster.workers = workers;
    cfg.cluster.shards_per_server = shards;
    configure(&mut cfg);
    cfg.validate().expect("valid config");
    let traced = run_cluster_traced(cfg.clone(), sim, store, prefix).expect("cluster run");
    (cfg, traced)
}

/// Checks that `trained` covers every position of the run's sample stream
/// (`epochs` × `samples`) exactly once, each with the sample the epoch's
/// global order puts there (`seed`, `batch`: the run's `data.seed` and
/// `data.batch_size`). Panics naming the first position trained twice, or
/// how many are missing.
pub fn assert_each_position_once(
    trained: &[ps_worker::run::TrainedBatch],
    samples: usize,
    epochs: u64,
    seed: u64,
    batch: usize,
) {
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for b in trained {
        for (i, &sample) in b.samples.iter().enumerate() {
            let pos = b.first + i as u64;
            assert!(
                at.insert(pos, sample).is_none(),
                "stream position {pos} (sample {sample}) trained twice"
            );
        }
    }
    let want = epochs * samples as u64;
    assert_eq!(
        at.len() as u64,
        want,
        "{} of {want} stream positions never trained",
        want.saturating_sub(at.len() as u64)
    );
    let global = ps_shared::sampler::EpochSampler::new(samples, 1, 0, seed).expect("sampler");
    for epoch in 0..epochs {
        let order = global.global_order(epoch, batch);
        let seen: Vec<usize> = (0..samples as u64)
            .map(|i| at[&(epoch * samples as u64 + i)])
            .collect();
        assert_eq!(seen, order, "epoch {epoch} is not its global order");
    }
}

/// [`run_cluster_per_rank`], also returning every batch each worker
/// trained ([`WorkerOptions::trained`]), in no particular order.
pub fn run_cluster_traced(
    cfg: ClusterConfig,
    sim: &dyn Fn(u32) -> Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
) -> anyhow::Result<Traced> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (reports, shards, _) = run_cluster_inner(cfg, sim, store, prefix, None, Some(tx))?;
    let mut trained = Vec::new();
    while let Ok(b) = rx.try_recv() {
        trained.push(b);
    }
    Ok((reports, shards, trained))
}

/// What a server process counted over an in-process run.
#[derive(Debug, Clone, Copy)]
pub struct ServerCounts {
    /// Bytes copied: requests read and decoded, replies encoded.
    pub copied: ps_net::protocol::Copied,
    /// Requests served through the same-host socket (`cluster.local_path`).
    pub local_requests: u64,
}

/// [`run_cluster_per_rank`], also returning what each server process
/// counted.
pub fn run_cluster_counted(
    cfg: ClusterConfig,
    sim: &dyn Fn(u32) -> Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    model: Option<ModelFactory>,
) -> anyhow::Result<(
    Vec<WorkerReport>,
    Vec<ps_server::actor::ShardStatus>,
    Vec<ServerCounts>,
)> {
    run_cluster_inner(cfg, sim, store, prefix, model, None)
}

#[allow(clippy::type_complexity)]
fn run_cluster_inner(
    mut cfg: ClusterConfig,
    sim: &dyn Fn(u32) -> Simulation,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    model: Option<ModelFactory>,
    trained: Option<tokio::sync::mpsc::UnboundedSender<ps_worker::run::TrainedBatch>>,
) -> anyhow::Result<(
    Vec<WorkerReport>,
    Vec<ps_server::actor::ShardStatus>,
    Vec<ServerCounts>,
)> {
    let pki = TestPki::new(cfg.cluster.workers as u32);
    let system = actix::System::new();
    system.block_on(async move {
        // One server process per entry of cluster.servers, each on a free port.
        let mut servers = Vec::new();
        for index in 0..cfg.cluster.servers.len() {
            let server =
                ps_server::net::start(&cfg, index, "127.0.0.1:0".parse()?, &pki.server).await?;
            servers.push(server);
        }
        cfg.cluster.servers = servers.iter().map(|s| s.local_addr().to_string()).collect();
        let runs = rank_runs_with(
            &cfg,
            |rank| WorkerOptions {
                epoch_lines: true,
                simulation: sim(rank),
                trained: trained.clone(),
                ..pki.options(rank)
            },
            &store,
            &prefix,
            model,
        );
        let reports = tokio::time::timeout(CLUSTER_TIMEOUT, futures::future::join_all(runs))
            .await
            .map_err(|_| anyhow::anyhow!("cluster did not finish within {CLUSTER_TIMEOUT:?}"))
            .and_then(|reports| {
                reports
                    .into_iter()
                    .flatten()
                    .map(|r| r.map_err(anyhow::Error::from))
                    .collect::<anyhow::Result<Vec<_>>>()
            });
        let reports = match reports {
            Ok(r) => r,
            Err(e) => {
                for server in servers {
                    server.abort().await;
                }
                return Err(e);
            }
        };
        let mut shards = Vec::new();
        let mut counts = Vec::new();
        for server in &servers {
            shards.extend(server.status().await);
            counts.push(ServerCounts {
                copied: server.copied().await,
                local_requests: server.local_requests(),
            });
        }
        // Every worker said goodbye, so the servers stop by themselves.
        for server in servers {
            tokio::time::timeout(std::time::Duration::from_secs(30), server.wait())
                .await
                .map_err(|_| anyhow::anyhow!("server did not stop after the workers finished"))??;
        }
        Ok((reports, shards, counts))
    })
}

/// A file of the repository, from the tests' crate.
pub fn repo_file(rel: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

/// The MNIST 5k subset that `scripts/fetch-mnist.sh` downloads, or `None`
/// when it is absent (the caller skips, saying so). With
/// `STRATUS_REQUIRE_MNIST=1` (set by CI) its absence fails the test.
pub fn mnist_csv() -> Option<std::path::PathBuf> {
    let csv = repo_file("data/mnist_5k.csv.gz");
    if csv.exists() {
        return Some(csv);
    }
    let required = std::env::var("STRATUS_REQUIRE_MNIST").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{} is missing; run scripts/fetch-mnist.sh",
        csv.display()
    );
    println!(
        "skipped: {} not found (run scripts/fetch-mnist.sh)",
        csv.display()
    );
    None
}

/// The `ps-server` binary of the build the calling test belongs to (for
/// tests that run a real server process); see [`profile_binary`].
pub fn server_binary() -> std::path::PathBuf {
    profile_binary("ps-server")
}

/// The binary `name` (ps-server, ps-worker) of the build the calling test
/// belongs to.
///
/// Cargo builds a package's binaries only for that package's own
/// integration tests (`CARGO_BIN_EXE_<name>`), never for a package that
/// depends on it, and artifact dependencies are not stable. ps-tests
/// depends on the ps-server and ps-worker libraries; their binaries come
/// from those packages' own integration tests (`server/tests/cli.rs`,
/// `worker/tests/exits.rs`), which make `cargo test --workspace` (and
/// `cargo test -p ps-server -p ps-worker`) build them into the target
/// profile directory this test runs from: `<target>/<profile>/deps/<test>-<hash>`
/// next to `<target>/<profile>/<name>`. Running cargo from inside the test
/// instead would rebuild with the test's environment (cargo fingerprints
/// depend on it) and contend with the outer build. So the test takes that
/// binary, and refuses it when it is missing or older than a source file it
/// was built from (its dep-info file `<name>.d` lists them), rather than
/// test stale code.
pub fn profile_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("the test runs from <target>/<profile>/deps");
    let bin = profile_dir.join(name);
    let hint = format!(
        "build it with `cargo build -p {name}` in the same profile \
         (`cargo test --workspace` builds it)"
    );
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}; {hint}", bin.display()));
    let deps = std::fs::read_to_string(profile_dir.join(format!("{name}.d"))).unwrap_or_default();
    let sources = deps.split_once(": ").map(|(_, s)| s).unwrap_or("");
    for source in sources.split_whitespace() {
        let changed = std::fs::metadata(source)
            .and_then(|m| m.modified())
            .unwrap_or(std::time::SystemTime::UNIX_EPOCH);
        assert!(
            changed <= built,
            "{} is older than {source}; {hint}",
            bin.display()
        );
    }
    bin
}

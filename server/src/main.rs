//! `ps-server`: one parameter-server process of a Stratus cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use ps_net::cli::{
    describe_error, exit_code, stop_signal, ExitCode, LogArgs, MetricsArgs, UsageError,
    EXIT_CODES_HELP,
};
use ps_net::pki::{ensure_cluster_pki, Existing, PkiPaths};
use ps_net::transport::read_pem;
use ps_net::transport::TransportError;
use ps_server::net::{ServerError, ServerExit};
use ps_shared::config::ClusterConfig;

/// Stratus parameter server: serves this process's shards of the flat
/// parameter space to the workers over QUIC (TLS 1.3).
#[derive(Parser, Debug)]
#[command(name = "ps-server", version, about, long_about = None, after_help = EXIT_CODES_HELP)]
struct Cli {
    /// Cluster config (TOML). STRATUS__SECTION__FIELD=value variables
    /// override its fields (docs/launch.md).
    #[arg(long, short, global = true, env = "STRATUS_CONFIG")]
    config: Option<PathBuf>,

    /// Use the embedded development config (configs/local.toml: a local
    /// test cluster) instead of --config.
    #[arg(long, global = true)]
    dev: bool,

    /// Which entry of cluster.servers this process is (0-based).
    #[arg(long, default_value_t = 0, env = "STRATUS_SERVER_INDEX")]
    index: usize,

    /// Address to bind; defaults to this server's entry in cluster.servers
    /// (use 0.0.0.0:PORT on a cloud VM).
    #[arg(long)]
    listen: Option<SocketAddr>,

    #[command(flatten)]
    logging: LogArgs,

    #[command(flatten)]
    metrics: MetricsArgs,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve shards (the default when no subcommand is given).
    Run,
    /// Write the cluster CA (tls.ca, tls.ca_key), the server certificate
    /// (tls.cert, tls.key) and one client certificate per worker rank, up
    /// to cluster.max_workers (tls.worker_cert, tls.worker_key); valid files
    /// are kept, and a server certificate issued again keeps the names it had.
    Certs {
        /// Extra DNS names or IP addresses for the server certificate.
        #[arg(long = "name")]
        names: Vec<String>,
        /// Replace existing files (a new CA invalidates every certificate).
        #[arg(long)]
        force: bool,
    },
    /// Print the effective configuration (token redacted) and exit.
    ShowConfig,
}

/// A clean stop on SIGTERM or SIGINT: final checkpoints written, workers
/// told; the process exits with the signal's code.
#[derive(Debug, thiserror::Error)]
#[error("stopped by {0}")]
struct StoppedBy(&'static str);

fn main() {
    match run() {
        Ok(()) => {}
        Err(e) => {
            let code = exit_code(e.as_ref(), classify_exit);
            match e.downcast_ref::<StoppedBy>() {
                Some(stopped) => eprintln!("ps-server: {stopped}"),
                None => eprintln!("ps-server: error: {}", describe_error(e.as_ref())),
            }
            std::process::exit(code.code());
        }
    }
}

/// The server's part of the one mapping from errors to exit codes (see
/// [`ps_net::cli::exit_code`], which knows the shared error types).
fn classify_exit(e: &(dyn std::error::Error + 'static)) -> Option<ExitCode> {
    if let Some(StoppedBy(name)) = e.downcast_ref::<StoppedBy>() {
        return Some(ExitCode::for_signal(name));
    }
    if let Some(exit) = e.downcast_ref::<ServerExit>() {
        return exit.job_stopped.then_some(ExitCode::JobStopped);
    }
    match e.downcast_ref::<ServerError>()? {
        ServerError::BadIndex { .. }
        | ServerError::Shards(_)
        | ServerError::Bind { .. }
        | ServerError::CheckpointStore { .. }
        | ServerError::Transport(
            TransportError::Tls(_) | TransportError::Io { .. } | TransportError::Limits(_),
        ) => Some(ExitCode::Config),
        _ => None,
    }
}
fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.logging.init("info");
    let cfg = ps_shared::overrides::load_cli(cli.config.as_deref(), cli.dev)?;
    match cli.command.unwrap_or(Command::Run) {
        Command::Certs { names, force } => {
            let existing = if force {
                Existing::Replace
            } else {
                Existing::Check
            };
            let report = write_certs(&cfg, &names, existing)?;
            for path in &report.written {
                ps_net::outln!("wrote {}", path.display());
            }
            for path in &report.kept {
                ps_net::outln!("kept {} (use --force to replace it)", path.display());
            }
            Ok(())
        }
        Command::ShowConfig => {
            ps_net::outln!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Run => {
            cli.metrics.start()?;
            serve(&cfg, cli.index, cli.listen)
        }
    }
}

/// The cluster's certificate files, as the config names them.
fn pki_paths(cfg: &ClusterConfig) -> PkiPaths {
    let t = &cfg.tls;
    PkiPaths {
        ca_cert: t.ca.clone(),
        ca_key: t.ca_key.clone(),
        server_cert: t.cert.clone(),
        server_key: t.key.clone(),
        worker_cert: t.worker_cert.clone(),
        worker_key: t.worker_key.clone(),
    }
}

/// Create the CA and whatever certificate is missing; `existing` says what
/// happens to the files already there.
fn write_certs(
    cfg: &ClusterConfig,
    extra: &[String],
    existing: Existing,
) -> anyhow::Result<ps_net::pki::PkiReport> {
    let mut names = vec![
        cfg.tls.server_name.clone(),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    for s in &cfg.cluster.servers {
        if let Some((host, _)) = s.rsplit_once(':') {
            names.push(host.trim_matches(['[', ']']).to_string());
        }
    }
    names.extend(extra.iter().cloned());
    names.sort();
    names.dedup();
    Ok(ensure_cluster_pki(
        &pki_paths(cfg),
        &names,
        cfg.cluster.max_ranks() as u32,
        existing,
    )?)
}

fn exists(p: &Path) -> bool {
    p.try_exists().unwrap_or(false)
}

fn serve(cfg: &ClusterConfig, index: usize, listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let Some(entry) = cfg.cluster.servers.get(index) else {
        bail!(UsageError(format!(
            "--index {index}: cluster.servers lists only {} server(s)",
            cfg.cluster.servers.len()
        )));
    };
    let listen = match listen {
        Some(a) => a,
        None => entry.parse().map_err(|_| {
            UsageError(format!(
                "cluster.servers[{index}] = `{entry}` is not an IP:port; pass --listen"
            ))
        })?,
    };
    if cfg.tls.generate_if_missing {
        // Only what is missing: certificates already there (from `ps-server
        // certs`, perhaps with extra --name entries) stay as they are.
        let report = write_certs(cfg, &[], Existing::Keep)?;
        for path in &report.written {
            tracing::info!(path = %path.display(), "generated");
        }
    } else if [&cfg.tls.cert, &cfg.tls.key, &cfg.tls.ca]
        .into_iter()
        .any(|p| !exists(p))
    {
        bail!(UsageError(format!(
            "TLS certificate {}, key {} or CA {} is missing (run `ps-server certs` or set tls.generate_if_missing)",
            cfg.tls.cert.display(),
            cfg.tls.key.display(),
            cfg.tls.ca.display()
        )));
    }
    let tls = ps_server::net::ServerTls {
        cert_pem: read_pem(&cfg.tls.cert)?,
        key_pem: read_pem(&cfg.tls.key)?,
        ca_pem: read_pem(&cfg.tls.ca)?,
    };
    let system = actix::System::new();
    // Errors leave the runtime as values; the runtime is dropped after.
    let stopped = system.block_on(async move {
        let server = ps_server::net::start(cfg, index, listen, &tls)
            .await
            .with_context(|| {
                format!(
                    "starting server {index} on {listen} (TLS files {}, {}, {})",
                    cfg.tls.cert.display(),
                    cfg.tls.key.display(),
                    cfg.tls.ca.display()
                )
            })?;
        let stop = tokio::select! {
            _ = server.decided() => None,
            name = stop_signal() => Some(name),
        };
        match stop {
            None => {
                server.wait().await?;
                anyhow::Ok(None)
            }
            Some(name) => {
                tracing::info!("{name}: writing final checkpoints and telling the workers");
                let saved = server.shutdown().await;
                tracing::info!(?saved, "stopped; checkpointed versions per shard");
                anyhow::Ok(Some(name))
            }
        }
    })?;
    match stopped {
        Some(name) => Err(StoppedBy(name).into()),
        None => Ok(()),
    }
}

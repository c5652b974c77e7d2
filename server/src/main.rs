//! `ps-server`: one parameter-server process of a Stratus cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};

use ps_shared::cli::{describe_error, init_logging};
use ps_shared::config::ClusterConfig;
use ps_shared::transport::{read_pem, DevCert};

/// Stratus parameter server: serves this process's shards of the flat
/// parameter space to the workers over QUIC (TLS 1.3).
#[derive(Parser, Debug)]
#[command(name = "ps-server", version, about, long_about = None)]
struct Cli {
    /// Cluster config (TOML); the embedded configs/local.toml when omitted.
    #[arg(long, short, global = true, env = "STRATUS_CONFIG")]
    config: Option<PathBuf>,

    /// Which entry of cluster.servers this process is (0-based).
    #[arg(long, default_value_t = 0, env = "STRATUS_SERVER_INDEX")]
    index: usize,

    /// Address to bind; defaults to this server's entry in cluster.servers
    /// (use 0.0.0.0:PORT on a cloud VM).
    #[arg(long)]
    listen: Option<SocketAddr>,

    /// Log filter (error, warn, info, debug, or a tracing filter).
    #[arg(long, default_value = "info", global = true, env = "STRATUS_LOG")]
    log: String,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve shards (the default when no subcommand is given).
    Run,
    /// Write a self-signed development certificate and key (tls.cert / tls.key).
    Certs {
        /// Extra DNS names or IP addresses for the certificate.
        #[arg(long = "name")]
        names: Vec<String>,
        /// Overwrite existing files.
        #[arg(long)]
        force: bool,
    },
    /// Print the effective configuration (token redacted) and exit.
    ShowConfig,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ps-server: error: {}", describe_error(e.as_ref()));
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(&cli.log, "info");
    let cfg = ClusterConfig::load_or_default(cli.config.as_deref())?;
    match cli.command.unwrap_or(Command::Run) {
        Command::Certs { names, force } => {
            let written = write_certs(&cfg, &names, force)?;
            if written {
                println!(
                    "wrote {} and {}",
                    cfg.tls.cert.display(),
                    cfg.tls.key.display()
                );
            } else {
                println!(
                    "{} already exists (use --force to replace it)",
                    cfg.tls.cert.display()
                );
            }
            Ok(())
        }
        Command::ShowConfig => {
            println!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Run => serve(&cfg, cli.index, cli.listen),
    }
}

/// Write the dev certificate when missing (or forced); returns whether it wrote.
fn write_certs(cfg: &ClusterConfig, extra: &[String], force: bool) -> anyhow::Result<bool> {
    if !force && exists(&cfg.tls.cert) && exists(&cfg.tls.key) {
        return Ok(false);
    }
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
    let cert = DevCert::generate(&names)?;
    cert.write(&cfg.tls.cert, &cfg.tls.key)?;
    Ok(true)
}

fn exists(p: &Path) -> bool {
    p.try_exists().unwrap_or(false)
}

fn serve(cfg: &ClusterConfig, index: usize, listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let Some(entry) = cfg.cluster.servers.get(index) else {
        bail!(
            "--index {index}: cluster.servers lists only {} server(s)",
            cfg.cluster.servers.len()
        );
    };
    let listen = match listen {
        Some(a) => a,
        None => entry.parse().with_context(|| {
            format!("cluster.servers[{index}] = `{entry}` is not an IP:port; pass --listen")
        })?,
    };
    if !exists(&cfg.tls.cert) || !exists(&cfg.tls.key) {
        if cfg.tls.generate_if_missing {
            write_certs(cfg, &[], false)?;
            tracing::info!(cert = %cfg.tls.cert.display(), "generated a self-signed dev certificate");
        } else {
            bail!(
                "TLS certificate {} or key {} is missing (run `ps-server certs` or set tls.generate_if_missing)",
                cfg.tls.cert.display(),
                cfg.tls.key.display()
            );
        }
    }
    let cert_pem = read_pem(&cfg.tls.cert)?;
    let key_pem = read_pem(&cfg.tls.key)?;
    let system = actix::System::new();
    system.block_on(async move {
        let server = ps_server::net::start(cfg, index, listen, &cert_pem, &key_pem).await?;
        tokio::select! {
            _ = server_wait(server) => {}
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("interrupted; shutting down");
            }
        }
        anyhow::Ok(())
    })?;
    Ok(())
}

async fn server_wait(server: ps_server::net::RunningServer) {
    server.wait().await;
}

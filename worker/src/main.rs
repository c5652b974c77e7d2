//! `ps-worker`: one training worker of a Stratus cluster (the data tools are
//! in `ps-data`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use ps_net::cli::{init_logging, LogFormat, EXIT_CODES_HELP};
use ps_worker::launch::{train, TrainArgs};

/// Stratus worker: trains its share of each step with candle, pushes compressed
/// gradients to the parameter servers over QUIC and pulls the new parameters.
#[derive(Parser, Debug)]
#[command(name = "ps-worker", version, about, long_about = None, after_help = EXIT_CODES_HELP)]
struct Cli {
    /// Cluster config (TOML). STRATUS__SECTION__FIELD=value variables
    /// override its fields (docs/launch.md).
    #[arg(long, short, global = true, env = "STRATUS_CONFIG")]
    config: Option<PathBuf>,

    /// Use the embedded development config (configs/local.toml: a local
    /// test cluster) instead of --config.
    #[arg(long, global = true)]
    dev: bool,

    /// Log filter (error, warn, info, debug, or a tracing filter); default
    /// warn. When neither this nor STRATUS_LOG is given, RUST_LOG is used.
    #[arg(long, global = true, env = "STRATUS_LOG")]
    log: Option<String>,

    /// Log lines as text (colour only on a terminal) or JSON objects.
    #[arg(
        long,
        global = true,
        default_value = "text",
        env = "STRATUS_LOG_FORMAT"
    )]
    log_format: LogFormat,

    /// Serve Prometheus metrics on http://HOST:PORT/metrics (off when absent).
    #[arg(
        long,
        global = true,
        value_name = "HOST:PORT",
        env = "STRATUS_METRICS_ADDR"
    )]
    metrics_addr: Option<SocketAddr>,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train as one worker (the default when no subcommand is given; the
    /// rank comes from --rank or the launch variables, docs/launch.md),
    /// or as every rank of one node with --node (cluster.workers_per_node > 1).
    Train(TrainArgs),
    /// Print the effective configuration (token redacted) and exit.
    ShowConfig,
}

fn main() {
    ps_worker::launch::exit("ps-worker", run())
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log.as_deref(), "warn", cli.log_format);
    let command = cli
        .command
        .unwrap_or_else(|| Command::Train(TrainArgs::default()));
    match command {
        Command::ShowConfig => {
            let cfg = ps_shared::overrides::load_cli(cli.config.as_deref(), cli.dev)?;
            println!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Train(args) => {
            let cfg = ps_shared::overrides::load_cli(cli.config.as_deref(), cli.dev)?;
            if let Some(addr) = cli.metrics_addr {
                ps_shared::telemetry::start_exporter(addr)?;
            }
            train(cfg, args, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use ps_worker::simulate::Simulation;

    #[test]
    fn train_takes_a_simulation_file() {
        let cli = Cli::try_parse_from(["ps-worker", "train", "--simulate", "slow.toml"]).unwrap();
        let Some(Command::Train(TrainArgs { simulate, .. })) = cli.command else {
            panic!("expected train");
        };
        assert_eq!(simulate, Some(PathBuf::from("slow.toml")));
        let mut cmd = Cli::command();
        let train = cmd.find_subcommand_mut("train").expect("train");
        let help = train.render_long_help().to_string();
        assert!(help.contains("--simulate <FILE>"), "{help}");
        // The example the help points to is a valid simulation file.
        assert!(help.contains("configs/simulate-slow-bucket.toml"), "{help}");
        let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../configs/simulate-slow-bucket.toml");
        Simulation::load(&example).expect("the example simulation file");
    }
}

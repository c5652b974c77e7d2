//! `ps-worker`: one training worker of a Stratus cluster (the data tools are
//! in `ps-data`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use ps_net::cli::{LogArgs, MetricsArgs, EXIT_CODES_HELP};
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

    #[command(flatten)]
    logging: LogArgs,

    #[command(flatten)]
    metrics: MetricsArgs,

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
    cli.logging.init("warn");
    let command = cli
        .command
        .unwrap_or_else(|| Command::Train(TrainArgs::default()));
    match command {
        Command::ShowConfig => {
            let cfg = ps_shared::overrides::load_cli(cli.config.as_deref(), cli.dev)?;
            ps_net::outln!("{}", cfg.to_redacted_toml()?);
            Ok(())
        }
        Command::Train(args) => {
            let cfg = ps_shared::overrides::load_cli(cli.config.as_deref(), cli.dev)?;
            cli.metrics.start()?;
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

//! The binaries' edge: logging setup, one-line error reports, exit codes,
//! stop signals.
//!
//! ```
//! use ps_net::cli::describe_error;
//! let inner = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
//! assert_eq!(describe_error(&inner), "no such file");
//! ```

use std::error::Error;

use crate::pki::PkiError;
use crate::transport::TransportError;
use ps_shared::config::ConfigError;

/// How a `ps-server` or `ps-worker` process ends: one code per kind of end,
/// the same in both binaries (the README's "Exit codes" table and
/// [`EXIT_CODES_HELP`] list them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitCode {
    /// The run finished.
    Ok,
    /// Any other error.
    Failed,
    /// The config, a `STRATUS__` override, a command-line argument, a
    /// launch variable or a TLS file is invalid, or no config was given;
    /// also a port that cannot be bound.
    Config,
    /// A peer could not be reached within its timeout.
    Unreachable,
    /// The data bucket stayed unreachable past `loader.outage_budget_s`.
    BucketOutage,
    /// Training diverged (a non-finite loss).
    Diverged,
    /// The job was stopped by a sample that could not be decoded
    /// (`data.on_bad_sample = "stop"`), on this rank or another.
    JobStopped,
    /// Stopped by SIGINT (Ctrl-C).
    Interrupted,
    /// Stopped by SIGTERM.
    Terminated,
}

impl ExitCode {
    /// The process exit status.
    pub fn code(self) -> i32 {
        match self {
            ExitCode::Ok => 0,
            ExitCode::Failed => 1,
            ExitCode::Config => 2,
            ExitCode::Unreachable => 3,
            ExitCode::BucketOutage => 4,
            ExitCode::Diverged => 5,
            ExitCode::JobStopped => 6,
            ExitCode::Interrupted => 130,
            ExitCode::Terminated => 143,
        }
    }

    /// The code of a stop signal, by the name [`stop_signal`] returns.
    pub fn for_signal(name: &str) -> Self {
        if name == "SIGTERM" {
            ExitCode::Terminated
        } else {
            ExitCode::Interrupted
        }
    }
}

/// The exit codes, for `--help` (`after_help`).
pub const EXIT_CODES_HELP: &str = "Exit codes:
  0    finished
  1    other error
  2    invalid config (or none: --config FILE or --dev), STRATUS__ override,
       argument, launch variable (RANK, WORLD_SIZE, ...) or TLS file, or a
       port that cannot be bound
  3    a server or peer unreachable within its timeout
  4    the data bucket unreachable past loader.outage_budget_s
  5    training diverged
  6    job stopped by a sample that cannot be decoded (data.on_bad_sample = \"stop\")
  130  stopped by SIGINT
  143  stopped by SIGTERM";

/// The exit code of an error: the first error in its chain that
/// `classify` (the binary's own error types) or this crate's types name
/// decides; [`ExitCode::Failed`] when none does.
pub fn exit_code(
    e: &(dyn Error + 'static),
    classify: impl Fn(&(dyn Error + 'static)) -> Option<ExitCode>,
) -> ExitCode {
    let mut cause: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(code) = classify(c).or_else(|| shared_exit_code(c)) {
            return code;
        }
        cause = c.source();
    }
    ExitCode::Failed
}

/// The exit codes of the shared crate's errors.
fn shared_exit_code(e: &(dyn Error + 'static)) -> Option<ExitCode> {
    if e.is::<ConfigError>()
        || e.is::<PkiError>()
        || e.is::<UsageError>()
        || e.is::<ps_shared::telemetry::TelemetryError>()
    {
        return Some(ExitCode::Config);
    }
    match e.downcast_ref::<TransportError>()? {
        TransportError::Tls(_) | TransportError::Io { .. } | TransportError::Limits(_) => {
            Some(ExitCode::Config)
        }
        TransportError::Connect { .. } | TransportError::ConnectTimeout { .. } => {
            Some(ExitCode::Unreachable)
        }
        _ => None,
    }
}

/// A usage error the binaries raise themselves (a flag that does not fit
/// the config): exit code 2, as clap's own.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event; colour only on a terminal.
    #[default]
    Text,
    /// One JSON object per event, with the current span's fields.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("log format `{other}`: expected text or json")),
        }
    }
}

/// The logging flags of every binary, flattened into its command line.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LogArgs {
    /// Log filter (error, warn, info, debug, or a tracing filter); default
    /// info for ps-server, warn for the others. When neither this nor
    /// STRATUS_LOG is given, RUST_LOG is used.
    #[arg(long, global = true, env = "STRATUS_LOG")]
    pub log: Option<String>,
    /// Log lines as text (colour only on a terminal) or JSON objects.
    #[arg(
        long,
        global = true,
        default_value = "text",
        env = "STRATUS_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// Start logging with these flags; `fallback` is the binary's default
    /// filter.
    pub fn init(&self, fallback: &str) {
        init_logging(self.log.as_deref(), fallback, self.log_format);
    }
}

/// `--metrics-addr` of the binaries that serve Prometheus metrics.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics on http://HOST:PORT/metrics (off when absent).
    #[arg(
        long,
        global = true,
        value_name = "HOST:PORT",
        env = "STRATUS_METRICS_ADDR"
    )]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl MetricsArgs {
    /// Serve the metrics when `--metrics-addr` was given.
    pub fn start(&self) -> Result<(), ps_shared::telemetry::TelemetryError> {
        if let Some(addr) = self.metrics_addr {
            ps_shared::telemetry::start_exporter(addr)?;
        }
        Ok(())
    }
}

/// The log filter in force: `--log` (or `STRATUS_LOG`) when given, else
/// `RUST_LOG` when set and not empty, else the binary's default.
pub fn log_filter(flag: Option<&str>, rust_log: Option<&str>, default: &str) -> String {
    flag.or(rust_log.filter(|v| !v.trim().is_empty()))
        .unwrap_or(default)
        .to_string()
}

/// Whether text logs carry ANSI colour: only on a terminal, and not when
/// `NO_COLOR` is set.
pub fn use_colour(format: LogFormat, is_terminal: bool, no_color: bool) -> bool {
    format == LogFormat::Text && is_terminal && !no_color
}

/// Log to stderr with a tracing filter (`info`, `warn`, `ps_server=debug`,
/// ...; see [`log_filter`] for `--log` against `RUST_LOG`); an unparsable
/// filter falls back to `fallback`.
pub fn init_logging(filter: Option<&str>, fallback: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = log_filter(filter, rust_log.as_deref(), fallback);
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    let colour = use_colour(
        format,
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty()),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

/// The error and its causes on one line, skipping causes whose text an
/// earlier message already includes.
pub fn describe_error(e: &(dyn Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// Writes `args` to stdout, for the commands whose output is their result
/// (`show-config`, `ps-data info`, ...). A stdout whose reader has gone
/// away (`ps-worker show-config | head -1`) ends the process quietly with
/// exit code 0, as a pipeline that only wanted the start of the output
/// expects; any other write error is reported on stderr with exit code 1.
/// Use it through [`outln!`](crate::outln), in place of `println!`, which
/// panics on a closed pipe.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        stdout_failed(&e);
    }
}

/// Writes `args` to stdout for a process that goes on after it (a training
/// run's epoch and summary lines): a write that fails, a closed pipe
/// included, drops the text and the run goes on, since its result is the
/// model, the metrics files and the exit code, not these lines. Returns
/// whether the text was written.
pub fn write_stdout_or_drop(args: std::fmt::Arguments<'_>) -> bool {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_fmt(args).and_then(|()| out.flush()).is_ok()
}

/// How a failed write to stdout ends the process (see [`write_stdout`]).
fn stdout_failed(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(ExitCode::Ok.code());
    }
    eprintln!("error: cannot write to stdout: {e}");
    std::process::exit(ExitCode::Failed.code());
}

/// `println!` for a command's output: a closed pipe ends the process
/// quietly with exit code 0 instead of a panic ([`cli::write_stdout`](crate::cli::write_stdout)).
///
/// ```
/// ps_net::outln!("{} shards", 4);
/// ```
#[macro_export]
macro_rules! outln {
    () => {
        $crate::cli::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `println!` for a training run's progress and summary lines: a closed
/// pipe drops the line and the run goes on
/// ([`cli::write_stdout_or_drop`](crate::cli::write_stdout_or_drop)).
#[macro_export]
macro_rules! progressln {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout_or_drop(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Resolves on SIGINT or SIGTERM, whichever comes first; returns its name.
pub async fn stop_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "interrupt"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("loading config: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("starting server")]
    struct Adds(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("loading the config")]
    struct Loading(#[source] ConfigError);

    #[test]
    fn exit_codes_come_from_the_first_known_error_of_the_chain() {
        let config = ConfigError::OutOfRange {
            field: "server.heartbeat_secs".into(),
            value: "0".into(),
            range: "0.01..=600".into(),
        };
        assert_eq!(exit_code(&config, |_| None), ExitCode::Config);
        let wrapped = Loading(config);
        assert_eq!(exit_code(&wrapped, |_| None), ExitCode::Config);
        let tls = TransportError::Tls("no certificate in PEM".into());
        assert_eq!(exit_code(&tls, |_| None), ExitCode::Config);
        let unreachable = TransportError::ConnectTimeout {
            addr: "127.0.0.1:1".into(),
            timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(exit_code(&unreachable, |_| None), ExitCode::Unreachable);
        // The binary's own classification comes first.
        assert_eq!(
            exit_code(&tls, |_| Some(ExitCode::Diverged)),
            ExitCode::Diverged
        );
        let other = std::io::Error::other("disk full");
        assert_eq!(exit_code(&other, |_| None), ExitCode::Failed);
        let usage = UsageError("--node 9".into());
        assert_eq!(exit_code(&usage, |_| None), ExitCode::Config);
    }

    #[test]
    fn exit_codes_are_distinct_and_documented() {
        let all = [
            ExitCode::Ok,
            ExitCode::Failed,
            ExitCode::Config,
            ExitCode::Unreachable,
            ExitCode::BucketOutage,
            ExitCode::Diverged,
            ExitCode::JobStopped,
            ExitCode::Interrupted,
            ExitCode::Terminated,
        ];
        let codes: std::collections::BTreeSet<i32> = all.iter().map(|c| c.code()).collect();
        assert_eq!(codes.len(), all.len());
        for code in codes {
            assert!(
                EXIT_CODES_HELP.contains(&format!("\n  {code} ")),
                "{code} missing from the help"
            );
        }
        assert_eq!(ExitCode::for_signal("SIGTERM").code(), 143);
        assert_eq!(ExitCode::for_signal("SIGINT").code(), 130);
    }

    #[test]
    fn the_log_flag_wins_over_rust_log_which_wins_over_the_default() {
        assert_eq!(log_filter(Some("debug"), Some("trace"), "warn"), "debug");
        assert_eq!(
            log_filter(None, Some("ps_server=trace"), "warn"),
            "ps_server=trace"
        );
        assert_eq!(log_filter(None, Some("  "), "warn"), "warn");
        assert_eq!(log_filter(None, None, "info"), "info");
    }

    #[test]
    fn colour_only_for_text_on_a_terminal_without_no_color() {
        assert!(use_colour(LogFormat::Text, true, false));
        assert!(!use_colour(LogFormat::Text, false, false));
        assert!(!use_colour(LogFormat::Text, true, true));
        assert!(!use_colour(LogFormat::Json, true, false));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        let err = "xml".parse::<LogFormat>().unwrap_err();
        assert!(err.contains("xml") && err.contains("text or json"), "{err}");
    }

    #[test]
    fn causes_are_joined_once() {
        let io = || std::io::Error::other("disk full");
        assert_eq!(describe_error(&Repeats(io())), "loading config: disk full");
        assert_eq!(describe_error(&Adds(io())), "starting server: disk full");
    }
}

//! The binaries' edge: logging setup, one-line error reports, stop signals.
//!
//! ```
//! use ps_shared::cli::describe_error;
//! let inner = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
//! assert_eq!(describe_error(&inner), "no such file");
//! ```

use std::error::Error;

/// Log to stderr with a tracing filter (`info`, `warn`, `ps_server=debug`, ...);
/// an unparsable filter falls back to `fallback`.
pub fn init_logging(filter: &str, fallback: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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

    #[test]
    fn causes_are_joined_once() {
        let io = || std::io::Error::other("disk full");
        assert_eq!(describe_error(&Repeats(io())), "loading config: disk full");
        assert_eq!(describe_error(&Adds(io())), "starting server: disk full");
    }
}

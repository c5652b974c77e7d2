//! Prometheus metrics for both binaries: a [`metrics`] recorder kept in
//! atomics ([`Registry`]), rendered in the Prometheus text format
//! ([`Registry::render`]) and served on `GET /metrics` by a small HTTP/1.1
//! responder ([`start_exporter`], `--metrics-addr`).
//!
//! Code records through the `metrics` facade (`counter!`, `gauge!`,
//! `histogram!`); without an installed registry those calls cost next to
//! nothing and go nowhere. Names start with `stratus_`; docs/observability.md
//! lists them.
//!
//! ```
//! use ps_shared::telemetry::Registry;
//! let registry = Registry::default();
//! metrics::with_local_recorder(&registry, || {
//!     metrics::describe_counter!("stratus_demo_steps_total", "Steps trained.");
//!     metrics::counter!("stratus_demo_steps_total", "rank" => "0").increment(3);
//! });
//! let text = registry.render();
//! assert!(text.contains("# TYPE stratus_demo_steps_total counter"));
//! assert!(text.contains("stratus_demo_steps_total{rank=\"0\"} 3"));
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Upper bounds (seconds) of the histogram buckets: from half a millisecond
/// (a fast step's compress) to a minute (a checkpoint write to a bucket).
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Errors of the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--metrics-addr {addr}: cannot listen: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("--metrics-addr {addr}: cannot start the metrics thread: {source}")]
    Thread {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A histogram with fixed [`SECONDS_BUCKETS`]: a count per bucket, the sum
/// (f64 bits) and the count.
#[derive(Debug, Default)]
pub struct SecondsHistogram {
    buckets: [AtomicU64; SECONDS_BUCKETS.len()],
    sum_bits: AtomicU64,
    count: AtomicU64,
}

impl HistogramFn for SecondsHistogram {
    fn record(&self, value: f64) {
        if !value.is_finite() {
            return;
        }
        if let Some(i) = SECONDS_BUCKETS.iter().position(|b| value <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone)]
enum Series {
    Counter(Arc<AtomicU64>),
    Gauge(Arc<AtomicU64>),
    Histogram(Arc<SecondsHistogram>),
}

impl Series {
    fn kind(&self) -> &'static str {
        match self {
            Series::Counter(_) => "counter",
            Series::Gauge(_) => "gauge",
            Series::Histogram(_) => "histogram",
        }
    }
}

/// Name, then the labels in the order given.
type SeriesKey = (String, Vec<(String, String)>);

#[derive(Debug, Default)]
struct Inner {
    series: BTreeMap<SeriesKey, Series>,
    help: BTreeMap<String, String>,
}

/// The process's metrics: every series registered through the `metrics`
/// facade, kept in atomics until [`Registry::render`] reads them.
#[derive(Debug, Default)]
pub struct Registry {
    inner: Mutex<Inner>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    fn register(&self, key: &Key, make: impl FnOnce() -> Series) -> Series {
        let labels = key
            .labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        let mut inner = self.lock();
        inner
            .series
            .entry((key.name().to_string(), labels))
            .or_insert_with(make)
            .clone()
    }

    fn describe(&self, key: KeyName, description: SharedString) {
        self.lock()
            .help
            .insert(key.as_str().to_string(), description.to_string());
    }

    /// Every series in the Prometheus text exposition format (version
    /// 0.0.4): per name a `# HELP` line (when described), a `# TYPE` line,
    /// then one sample per label set; histograms as cumulative `_bucket`
    /// lines with `le`, `_sum` and `_count`. A name registered with two
    /// kinds keeps the first kind seen and drops the others.
    pub fn render(&self) -> String {
        let inner = self.lock();
        let mut out = String::new();
        let mut current: Option<(&str, &'static str)> = None;
        for ((name, labels), series) in &inner.series {
            match current {
                Some((n, kind)) if n == name => {
                    if kind != series.kind() {
                        continue;
                    }
                }
                _ => {
                    if let Some(help) = inner.help.get(name) {
                        let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
                    }
                    let _ = writeln!(out, "# TYPE {name} {}", series.kind());
                    current = Some((name, series.kind()));
                }
            }
            match series {
                Series::Counter(c) => {
                    let v = c.load(Ordering::Relaxed);
                    let _ = writeln!(out, "{name}{} {v}", label_set(labels, None));
                }
                Series::Gauge(g) => {
                    let v = f64::from_bits(g.load(Ordering::Relaxed));
                    let _ = writeln!(out, "{name}{} {}", label_set(labels, None), number(v));
                }
                Series::Histogram(h) => {
                    let mut cumulative = 0;
                    for (bound, n) in SECONDS_BUCKETS.iter().zip(&h.buckets) {
                        cumulative += n.load(Ordering::Relaxed);
                        let le = number(*bound);
                        let _ = writeln!(
                            out,
                            "{name}_bucket{} {cumulative}",
                            label_set(labels, Some(&le))
                        );
                    }
                    let count = h.count.load(Ordering::Relaxed);
                    let sum = f64::from_bits(h.sum_bits.load(Ordering::Relaxed));
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {count}",
                        label_set(labels, Some("+Inf"))
                    );
                    let _ = writeln!(out, "{name}_sum{} {}", label_set(labels, None), number(sum));
                    let _ = writeln!(out, "{name}_count{} {count}", label_set(labels, None));
                }
            }
        }
        out
    }
}

impl Recorder for Registry {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        match self.register(key, || Series::Counter(Arc::default())) {
            Series::Counter(c) => Counter::from_arc(c),
            _ => Counter::noop(),
        }
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        match self.register(key, || Series::Gauge(Arc::default())) {
            Series::Gauge(g) => Gauge::from_arc(g),
            _ => Gauge::noop(),
        }
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        match self.register(key, || Series::Histogram(Arc::default())) {
            Series::Histogram(h) => Histogram::from_arc(h),
            _ => Histogram::noop(),
        }
    }
}

/// A sample value: integers without a fraction, `NaN`, `+Inf`, `-Inf`
/// spelled as Prometheus reads them.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

/// `{a="x",b="y"}` (with `le` last), or nothing without labels.
fn label_set(labels: &[(String, String)], le: Option<&str>) -> String {
    if labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    format!("{{{}}}", parts.join(","))
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

static GLOBAL: OnceLock<&'static Registry> = OnceLock::new();

/// The process's registry, installed as the global `metrics` recorder on
/// first use (later calls return the same one).
pub fn global() -> &'static Registry {
    GLOBAL.get_or_init(|| {
        let registry: &'static Registry = Box::leak(Box::default());
        // Only fails when another recorder is installed already; then the
        // registry stays empty and /metrics shows no series.
        if metrics::set_global_recorder(registry).is_err() {
            tracing::warn!("another metrics recorder is installed; /metrics will be empty");
        }
        registry
    })
}

/// Serves the global registry on `GET /metrics` at `addr` from a thread of
/// its own (so a busy training runtime never delays a scrape). Returns the
/// bound address (useful with port 0). A port that cannot be bound is an
/// error here, at start.
pub fn start_exporter(addr: SocketAddr) -> Result<SocketAddr, TelemetryError> {
    let registry = global();
    describe_process();
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!("metrics endpoint not started: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, registry).await,
                    Err(e) => tracing::error!("metrics endpoint not started: {e}"),
                }
            });
        })
        .map_err(|source| TelemetryError::Thread { addr, source })?;
    tracing::info!("metrics on http://{bound}/metrics");
    Ok(bound)
}

/// The process-wide series every binary exports.
fn describe_process() {
    metrics::describe_gauge!(
        "stratus_build_info",
        "Always 1; the version label is the binary's version."
    );
    metrics::gauge!("stratus_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// Answers scrapes on `listener` until the process ends: `GET /metrics`
/// (the registry's text), `GET /` (a pointer to it), 404 and 405 otherwise.
pub async fn serve(listener: tokio::net::TcpListener, registry: &'static Registry) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::debug!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            let answered =
                tokio::time::timeout(Duration::from_secs(10), answer(stream, registry)).await;
            if let Ok(Err(e)) = answered {
                tracing::debug!("metrics endpoint: {e}");
            }
        });
    }
}

/// The status line, content type and body for a request head.
fn respond(head: &str, registry: &Registry) -> (&'static str, &'static str, String) {
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    const TEXT: &str = "text/plain; charset=utf-8";
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            registry.render(),
        ),
        ("GET" | "HEAD", "/") => ("200 OK", TEXT, "Stratus metrics: GET /metrics\n".into()),
        ("GET" | "HEAD", _) => ("404 Not Found", TEXT, format!("no page {path}\n")),
        _ => (
            "405 Method Not Allowed",
            TEXT,
            "only GET /metrics is served\n".into(),
        ),
    }
}

async fn answer(
    mut stream: tokio::net::TcpStream,
    registry: &'static Registry,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > 16 * 1024 {
            break;
        }
    }
    let head = String::from_utf8_lossy(&head);
    let (status, content_type, body) = respond(&head, registry);
    let is_head = head.starts_with("HEAD ");
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !is_head {
        reply.push_str(&body);
    }
    stream.write_all(reply.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_gauges_and_histograms_render_as_prometheus_text() {
        let registry = Registry::default();
        metrics::with_local_recorder(&registry, || {
            metrics::describe_counter!("stratus_t_steps_total", "Steps.\nTwo lines.");
            metrics::counter!("stratus_t_steps_total", "rank" => "1").increment(2);
            metrics::counter!("stratus_t_steps_total", "rank" => "0").increment(5);
            metrics::counter!("stratus_t_steps_total", "rank" => "0").increment(1);
            metrics::gauge!("stratus_t_loss", "rank" => "a\"b").set(0.25);
            metrics::gauge!("stratus_t_nan").set(f64::NAN);
            let h = metrics::histogram!("stratus_t_seconds");
            h.record(0.003);
            h.record(0.2);
            h.record(1000.0);
            h.record(f64::NAN);
            // A second kind under a name already used is dropped.
            metrics::gauge!("stratus_t_steps_total", "rank" => "9").set(1.0);
        });
        let text = registry.render();
        let lines: Vec<&str> = text.lines().collect();
        let at = |l: &str| lines.iter().position(|x| *x == l).unwrap_or(usize::MAX);
        assert!(
            at("# HELP stratus_t_steps_total Steps.\\nTwo lines.")
                < at("# TYPE stratus_t_steps_total counter")
        );
        assert!(
            lines.contains(&"stratus_t_steps_total{rank=\"0\"} 6"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_steps_total{rank=\"1\"} 2"),
            "{text}"
        );
        assert!(!text.contains("rank=\"9\""), "{text}");
        assert!(
            lines.contains(&"stratus_t_loss{rank=\"a\\\"b\"} 0.25"),
            "{text}"
        );
        assert!(lines.contains(&"stratus_t_nan NaN"), "{text}");
        assert!(
            lines.contains(&"# TYPE stratus_t_seconds histogram"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_seconds_bucket{le=\"0.001\"} 0"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_seconds_bucket{le=\"0.25\"} 2"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_seconds_bucket{le=\"60\"} 2"),
            "{text}"
        );
        assert!(
            lines.contains(&"stratus_t_seconds_bucket{le=\"+Inf\"} 3"),
            "{text}"
        );
        assert!(lines.contains(&"stratus_t_seconds_count 3"), "{text}");
        let sum = lines
            .iter()
            .find_map(|l| l.strip_prefix("stratus_t_seconds_sum "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        assert!((sum - 1000.203).abs() < 1e-9, "{sum}");
        // One TYPE line per name.
        assert_eq!(text.matches("# TYPE stratus_t_steps_total").count(), 1);
    }

    #[test]
    fn only_get_metrics_is_served() {
        let registry = Registry::default();
        metrics::with_local_recorder(&registry, || {
            metrics::counter!("stratus_t_up_total").increment(1);
        });
        let (status, kind, body) = respond("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &registry);
        assert_eq!(status, "200 OK");
        assert!(kind.starts_with("text/plain; version=0.0.4"));
        assert!(body.contains("stratus_t_up_total 1"), "{body}");
        assert_eq!(
            respond("GET /other HTTP/1.1\r\n\r\n", &registry).0,
            "404 Not Found"
        );
        assert_eq!(
            respond("POST /metrics HTTP/1.1\r\n\r\n", &registry).0,
            "405 Method Not Allowed"
        );
        assert_eq!(respond("", &registry).0, "405 Method Not Allowed");
    }

    #[tokio::test]
    async fn a_scrape_over_tcp_gets_the_text() {
        let registry: &'static Registry = Box::leak(Box::default());
        metrics::with_local_recorder(registry, || {
            metrics::counter!("stratus_t_scraped_total").increment(7);
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, registry));
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        conn.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        assert!(
            reply.contains(
                "\r\n\r\n# TYPE stratus_t_scraped_total counter\nstratus_t_scraped_total 7\n"
            ),
            "{reply}"
        );
    }
}

//! `bench-scale`: how step time, server CPU, traffic and server memory grow
//! with the worker count, the server count and the model size.
//!
//! Every configuration of the grid (workers × servers × parameters ×
//! density) runs an in-process cluster with trivial compute (see
//! `ps_tests::scale`): one warm-up step, then `--steps` measured BSP steps.
//! For each it reports:
//!
//! * `step ms`: mean wall time of a measured step (every worker pushes to
//!   every server and has its replies);
//! * `cpu/upd ms`: CPU time of the server shard threads in the core (from
//!   per-thread CPU clocks, plus the rayon pool time of dense updates), all
//!   servers together, divided by the updates applied (one per step);
//! * `ns/entry`: the same CPU divided by the entries pushed; flat when the
//!   server's cost grows with the entries pushed;
//! * `MB/step`: request plus reply frame bytes per step through the busiest
//!   server, counted by its I/O side from the frames it decoded and encoded;
//! * `MiB/server`: the largest server's parameter, optimizer, aggregation and
//!   history buffers, from the shard's own buffer capacities.
//!
//! Configurations whose estimated memory exceeds `--mem-budget-gib`, or whose
//! estimated entries moved exceed `--max-entries` (the time guard), are
//! printed as skipped with the reason. After the table it checks how the
//! server CPU per update grows with the workers at fixed size for the top-k
//! runs against the growth of the entries pushed, and writes a chart (SVG), a
//! CSV and a JSON file of the results.
//!
//! ```sh
//! cargo run --release -p ps-tests --bin bench-scale -- --help
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Parser;
use serde::Serialize;

use ps_tests::scale::{run_case, CaseResult, ScaleCase};

/// Growth exponent of CPU per update against workers above which a term is
/// flagged: entries pushed grow with exponent 1.
const FLAG_EXPONENT: f64 = 1.25;

/// Scaling of the parameter server with workers, servers and model size.
#[derive(Parser, Debug)]
#[command(name = "bench-scale", long_about = None)]
struct Args {
    /// Worker counts, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4, 8, 16, 32, 64])]
    workers: Vec<usize>,
    /// Server process counts (one shard each), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4])]
    servers: Vec<usize>,
    /// Model sizes, comma separated; K and M suffixes allowed (1M = 1000000).
    #[arg(long, value_delimiter = ',', value_parser = parse_count,
          default_values = ["1M", "10M", "100M"])]
    params: Vec<usize>,
    /// Densities, comma separated: a share in (0, 1) pushed as top-k, or `dense`.
    #[arg(long, value_delimiter = ',', value_parser = parse_density,
          default_values = ["0.001", "dense"])]
    density: Vec<Density>,
    /// Measured steps per configuration (one warm-up step runs first).
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Skip configurations estimated to need more memory than this (GiB).
    #[arg(long, default_value_t = 8.0)]
    mem_budget_gib: f64,
    /// Skip configurations estimated to move more entries than this per run
    /// (pushed plus replied, over every step): the time guard.
    #[arg(long, default_value_t = 1e8)]
    max_entries: f64,
    /// Servers apply a global top-k of each sparse update
    /// (`compression.global_topk`): replies carry at most k entries instead
    /// of the union of every worker's push. `false` measures union replies.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    global_topk: bool,
    /// Folder for the chart, the CSV and the JSON.
    #[arg(long, default_value = "target/bench-scale")]
    out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Density {
    Topk(f64),
    Dense,
}

impl Density {
    fn share(self) -> Option<f64> {
        match self {
            Density::Topk(d) => Some(d),
            Density::Dense => None,
        }
    }
}

fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('M' | 'm') => (&t[..t.len() - 1], 1_000_000.0),
        Some('K' | 'k') => (&t[..t.len() - 1], 1_000.0),
        _ => (t, 1.0),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("--params: `{s}` is not a count such as 1M, 250K or 5000"))?;
    let n = v * mult;
    if !(n >= 1.0 && n <= u32::MAX as f64) {
        return Err(format!(
            "--params: `{s}` must be between 1 and {} parameters",
            u32::MAX
        ));
    }
    Ok(n.round() as usize)
}

fn parse_density(s: &str) -> Result<Density, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("dense") {
        return Ok(Density::Dense);
    }
    match t.parse::<f64>() {
        Ok(d) if d > 0.0 && d < 1.0 => Ok(Density::Topk(d)),
        _ => Err(format!(
            "--density: `{s}` must be a share between 0 and 1 (exclusive) or `dense`"
        )),
    }
}

/// A configuration that was not run, and why.
#[derive(Debug, Clone, Serialize)]
struct Skipped {
    case: ScaleCase,
    reason: String,
}

/// One row of the CSV/JSON.
#[derive(Debug, Clone, Serialize)]
struct Row {
    params: usize,
    density: String,
    servers: usize,
    workers: usize,
    steps: u64,
    step_ms: f64,
    server_cpu_per_update_ms: f64,
    server_cpu_per_entry_ns: f64,
    entries_pushed_per_step: f64,
    busiest_server_bytes_per_step: f64,
    max_server_memory_bytes: usize,
    detail: CaseResult,
}

fn density_label(d: Option<f64>) -> String {
    match d {
        None => "dense".into(),
        Some(d) => format!("{}%", d * 100.0),
    }
}

fn size_label(p: usize) -> String {
    if p >= 1_000_000 && p.is_multiple_of(1_000_000) {
        format!("{}M", p / 1_000_000)
    } else if p >= 1_000 && p.is_multiple_of(1_000) {
        format!("{}K", p / 1_000)
    } else {
        p.to_string()
    }
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => {}
        Err(e) => {
            eprintln!("bench-scale: {e:#}");
            std::process::exit(1);
        }
    }
}

fn validate(args: &Args) -> anyhow::Result<()> {
    if args.workers.is_empty() || args.workers.contains(&0) {
        bail!("--workers: give one or more counts of at least 1");
    }
    if args.servers.is_empty() || args.servers.contains(&0) {
        bail!("--servers: give one or more counts of at least 1");
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if args.mem_budget_gib.is_nan() || args.mem_budget_gib <= 0.0 {
        bail!("--mem-budget-gib must be positive");
    }
    if args.max_entries.is_nan() || args.max_entries <= 0.0 {
        bail!("--max-entries must be positive");
    }
    for &p in &args.params {
        if let Some(&s) = args.servers.iter().find(|&&s| s > p) {
            bail!("--params: {p} parameters cannot be split over {s} servers");
        }
    }
    Ok(())
}

fn run(args: &Args) -> anyhow::Result<()> {
    validate(args)?;
    let budget = args.mem_budget_gib * (1u64 << 30) as f64;
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    println!(
        "sparse replies: {}",
        if args.global_topk {
            "global top-k (at most k entries)"
        } else {
            "union of the pushes"
        }
    );
    println!(
        "{:>6} {:>7} {:>3} {:>4} {:>10} {:>11} {:>9} {:>10} {:>11}",
        "params",
        "density",
        "srv",
        "wkr",
        "step ms",
        "cpu/upd ms",
        "ns/entry",
        "MB/step",
        "MiB/server"
    );
    for &params in &args.params {
        for &density in &args.density {
            for &servers in &args.servers {
                for &workers in &args.workers {
                    let case = ScaleCase {
                        params,
                        density: density.share(),
                        servers,
                        workers,
                        steps: args.steps,
                        global_topk: args.global_topk,
                    };
                    let lead = format!(
                        "{:>6} {:>7} {:>3} {:>4}",
                        size_label(params),
                        density_label(case.density),
                        servers,
                        workers
                    );
                    let need = case.estimated_bytes();
                    let reason = if need > budget {
                        Some(format!(
                            "needs ~{:.1} GiB > --mem-budget-gib {}",
                            need / (1u64 << 30) as f64,
                            args.mem_budget_gib
                        ))
                    } else if case.estimated_entries() > args.max_entries {
                        Some(format!(
                            "moves ~{:.2e} entries > --max-entries {:.2e}",
                            case.estimated_entries(),
                            args.max_entries
                        ))
                    } else {
                        None
                    };
                    if let Some(reason) = reason {
                        println!("{lead}  skipped: {reason}");
                        skipped.push(Skipped { case, reason });
                        continue;
                    }
                    let r = run_case(case).with_context(|| format!("configuration {case:?}"))?;
                    println!(
                        "{lead} {:>10.1} {:>11.2} {:>9.1} {:>10.2} {:>11.1}",
                        r.step_ms,
                        r.cpu_per_update_ms(),
                        r.cpu_per_entry_ns(),
                        r.busiest_bytes_per_step() / 1e6,
                        r.max_server_memory() as f64 / (1u64 << 20) as f64
                    );
                    results.push(r);
                }
            }
        }
    }
    println!();
    print!("{}", analysis(&results));
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating --out folder {}", args.out.display()))?;
    let rows: Vec<Row> = results.iter().map(row).collect();
    let csv = args.out.join("bench-scale.csv");
    std::fs::write(&csv, to_csv(&rows)).with_context(|| format!("writing {}", csv.display()))?;
    let json = args.out.join("bench-scale.json");
    let doc = serde_json::json!({ "results": rows, "skipped": skipped });
    std::fs::write(&json, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let svg = args.out.join("bench-scale.svg");
    chart(&results, &svg).with_context(|| format!("writing {}", svg.display()))?;
    println!("wrote {}", csv.display());
    println!("wrote {}", json.display());
    println!("wrote {}", svg.display());
    Ok(())
}

fn row(r: &CaseResult) -> Row {
    Row {
        params: r.case.params,
        density: density_label(r.case.density),
        servers: r.case.servers,
        workers: r.case.workers,
        steps: r.case.steps,
        step_ms: r.step_ms,
        server_cpu_per_update_ms: r.cpu_per_update_ms(),
        server_cpu_per_entry_ns: r.cpu_per_entry_ns(),
        entries_pushed_per_step: r.entries_pushed as f64 / r.case.steps as f64,
        busiest_server_bytes_per_step: r.busiest_bytes_per_step(),
        max_server_memory_bytes: r.max_server_memory(),
        detail: r.clone(),
    }
}

fn to_csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "params,density,servers,workers,steps,step_ms,server_cpu_per_update_ms,\
         server_cpu_per_entry_ns,entries_pushed_per_step,busiest_server_bytes_per_step,\
         max_server_memory_bytes\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.3},{:.4},{:.3},{:.0},{:.0},{}",
            r.params,
            r.density,
            r.servers,
            r.workers,
            r.steps,
            r.step_ms,
            r.server_cpu_per_update_ms,
            r.server_cpu_per_entry_ns,
            r.entries_pushed_per_step,
            r.busiest_server_bytes_per_step,
            r.max_server_memory_bytes
        );
    }
    out
}

/// For each top-k series (size, density, servers), the growth exponent of the
/// server CPU per update between consecutive worker counts, against the
/// entries pushed (exponent 1). Exponents above [`FLAG_EXPONENT`] are flagged.
fn analysis(results: &[CaseResult]) -> String {
    let mut out = String::from(
        "Growth of server CPU per update with workers (top-k runs; entries pushed grow with exponent 1):\n",
    );
    let mut any = false;
    for (key, series) in series(results) {
        if key.1.is_none() || series.len() < 2 {
            continue;
        }
        any = true;
        let mut parts = Vec::new();
        let mut flagged = Vec::new();
        for pair in series.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let e = (b.cpu_per_update_ms() / a.cpu_per_update_ms()).ln()
                / (b.case.workers as f64 / a.case.workers as f64).ln();
            parts.push(format!("{}->{}: {e:.2}", a.case.workers, b.case.workers));
            if e > FLAG_EXPONENT {
                flagged.push(format!("{}->{}", a.case.workers, b.case.workers));
            }
        }
        let first = series[0];
        let last = series[series.len() - 1];
        let _ = writeln!(
            out,
            "  {} {} {} srv: exponent {}; ns/entry {:.1} -> {:.1}{}",
            size_label(key.0),
            density_label(key.1),
            key.2,
            parts.join(", "),
            first.cpu_per_entry_ns(),
            last.cpu_per_entry_ns(),
            if flagged.is_empty() {
                String::new()
            } else {
                format!(
                    "  FLAG: grows faster than the entries pushed at {}",
                    flagged.join(", ")
                )
            }
        );
    }
    if !any {
        out.push_str("  (no top-k series with two or more worker counts)\n");
    }
    out
}

type SeriesKey = (usize, Option<f64>, usize);

/// Results grouped by (size, density, servers), each sorted by workers.
fn series(results: &[CaseResult]) -> Vec<(SeriesKey, Vec<&CaseResult>)> {
    let mut out: Vec<(SeriesKey, Vec<&CaseResult>)> = Vec::new();
    for r in results {
        let key = (r.case.params, r.case.density, r.case.servers);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(r),
            None => out.push((key, vec![r])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by_key(|r| r.case.workers);
    }
    out
}

/// Two log-log panels against workers: server CPU per update and step time,
/// one line per (size, density, servers).
fn chart(results: &[CaseResult], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    // Text is laid out with the font the worker's charts compile in.
    ps_data::plot::register_font().map_err(anyhow::Error::msg)?;
    let root = SVGBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let groups = series(results);
    let max_w = results
        .iter()
        .map(|r| r.case.workers)
        .max()
        .unwrap_or(2)
        .max(2) as f64;
    let min_w = results
        .iter()
        .map(|r| r.case.workers)
        .min()
        .unwrap_or(1)
        .max(1) as f64;
    type Metric = fn(&CaseResult) -> f64;
    let metrics: [(&str, Metric); 2] = [
        ("server CPU per update (ms)", |r| r.cpu_per_update_ms()),
        ("step time (ms)", |r| r.step_ms),
    ];
    for (panel, (title, metric)) in panels.iter().zip(metrics) {
        let values: Vec<f64> = results.iter().map(metric).filter(|v| *v > 0.0).collect();
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(0.0, f64::max);
        let (lo, hi) = if values.is_empty() {
            (0.01, 1.0)
        } else {
            (lo / 1.5, hi * 1.5)
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((min_w..max_w).log_scale(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("workers")
            .y_desc(title)
            .draw()?;
        for (i, (key, series)) in groups.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> = series
                .iter()
                .map(|r| (r.case.workers as f64, metric(r)))
                .filter(|(_, v)| *v > 0.0)
                .collect();
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(format!(
                    "{} {} {} srv",
                    size_label(key.0),
                    density_label(key.1),
                    key.2
                ))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

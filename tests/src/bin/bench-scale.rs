//! `bench-scale`: how the servers' CPU and traffic grow with the worker
//! count, for both kinds of sparse reply.
//!
//! Every configuration of the grid (parameters × density × servers × reply
//! mode × workers) runs an in-process cluster with trivial compute (see
//! `ps_tests::scale`): one warm-up step, then the measured BSP steps
//! (`--steps`, one count per size). A sparse step's reply is either the
//! union of every worker's push (`union`, up to workers × k entries) or the
//! servers' global top-k of the update (`global`, `compression.global_topk`,
//! at most k entries). For each configuration it prints:
//!
//! * `step ms`: mean wall time of a measured step;
//! * `cpu/upd ms`: CPU time of the server shard threads in the core and in
//!   encoding replies (per-thread CPU clocks, plus the rayon pool time of
//!   dense updates), all servers together, per update (one per step);
//! * `ns/entry`: that CPU per pushed entry;
//! * `x Wmin`: `ns/entry` over the same series' `ns/entry` at its smallest
//!   worker count (W=2 by default);
//! * `reply B/wkr`: reply frame bytes one worker receives per step, from all
//!   servers together (mean over workers);
//! * `link MB/step`: request plus reply frame bytes per step through the
//!   busiest server's link, counted by its I/O side;
//! * `MiB/server`: the largest server's buffers (parameters, optimizer and
//!   residual, aggregation, change history).
//!
//! After the table it prints, per (size, density, servers, mode), the target
//! check "CPU per pushed entry within 1.5x from 2 to 64 workers" as PASS or
//! MISS with the worst ratio; it never fails on it. Configurations whose
//! estimated memory exceeds `--mem-budget-gib`, or whose estimated entries
//! moved exceed `--max-entries` (the time guard), are printed as skipped with
//! the reason. It writes a chart (SVG), a CSV and a JSON file of the results.
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

/// The target: CPU per pushed entry at the largest worker count at most this
/// many times that at the smallest.
const TARGET_RATIO: f64 = 1.5;

/// Scaling of the parameter servers with workers, for union and global top-k
/// replies.
#[derive(Parser, Debug)]
#[command(name = "bench-scale", long_about = None)]
struct Args {
    /// Worker counts, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4, 8, 16, 32, 64])]
    workers: Vec<usize>,
    /// Model sizes, comma separated; K and M suffixes allowed (1M = 1000000).
    #[arg(long, value_delimiter = ',', value_parser = parse_count,
          default_values = ["1M", "10M"])]
    params: Vec<usize>,
    /// Measured steps per configuration, one count per size of `--params`
    /// in order (the last count serves the sizes beyond it); one warm-up
    /// step runs first.
    #[arg(long, value_delimiter = ',', default_values_t = [20u64, 5])]
    steps: Vec<u64>,
    /// Sparse reply modes, comma separated: `union` (the union of the
    /// pushes) and `global` (the servers' global top-k,
    /// `compression.global_topk`). Dense runs ignore it.
    #[arg(long, value_delimiter = ',', value_parser = parse_mode,
          default_values = ["union", "global"])]
    replies: Vec<ReplyMode>,
    /// Densities, comma separated: a share in (0, 1) pushed as top-k, or `dense`.
    #[arg(long, value_delimiter = ',', value_parser = parse_density,
          default_values = ["0.001"])]
    density: Vec<Density>,
    /// Server process counts (one shard each), comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize])]
    servers: Vec<usize>,
    /// Skip configurations estimated to need more memory than this (GiB).
    #[arg(long, default_value_t = 4.0)]
    mem_budget_gib: f64,
    /// Skip configurations estimated to move more entries than this per run
    /// (pushed plus replied, over every step): the time guard.
    #[arg(long, default_value_t = 1e9)]
    max_entries: f64,
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum ReplyMode {
    Union,
    Global,
}

fn parse_mode(s: &str) -> Result<ReplyMode, String> {
    match s.trim() {
        "union" => Ok(ReplyMode::Union),
        "global" => Ok(ReplyMode::Global),
        other => Err(format!(
            "--replies: `{other}` is not a reply mode (union or global)"
        )),
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
    replies: String,
    servers: usize,
    workers: usize,
    steps: u64,
    step_ms: f64,
    server_cpu_per_update_ms: f64,
    server_cpu_per_entry_ns: f64,
    /// `server_cpu_per_entry_ns` over the series' value at its smallest
    /// worker count.
    cpu_per_entry_ratio: f64,
    entries_pushed_per_step: f64,
    reply_bytes_per_worker_step: f64,
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

/// How a case's sparse replies are built; dense cases have one kind only.
fn mode_label(case: &ScaleCase) -> &'static str {
    match (case.density, case.global_topk) {
        (None, _) => "dense",
        (Some(_), true) => "global",
        (Some(_), false) => "union",
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
    if args.steps.is_empty() || args.steps.contains(&0) {
        bail!("--steps: give one or more counts of at least 1");
    }
    if args.replies.is_empty() {
        bail!("--replies: give union, global or both");
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

/// The cases of the grid in the order they run: per size, density, server
/// count and reply mode (dense once), every worker count.
fn grid(args: &Args) -> Vec<ScaleCase> {
    let mut cases = Vec::new();
    for (i, &params) in args.params.iter().enumerate() {
        let steps = args.steps[i.min(args.steps.len() - 1)];
        for &density in &args.density {
            for &servers in &args.servers {
                let modes: Vec<bool> = match density {
                    Density::Dense => vec![false],
                    Density::Topk(_) => {
                        let mut m: Vec<bool> = Vec::new();
                        for r in &args.replies {
                            let global = *r == ReplyMode::Global;
                            if !m.contains(&global) {
                                m.push(global);
                            }
                        }
                        m
                    }
                };
                for global_topk in modes {
                    for &workers in &args.workers {
                        cases.push(ScaleCase {
                            params,
                            density: density.share(),
                            servers,
                            workers,
                            steps,
                            global_topk,
                        });
                    }
                }
            }
        }
    }
    cases
}

fn run(args: &Args) -> anyhow::Result<()> {
    validate(args)?;
    let budget = args.mem_budget_gib * (1u64 << 30) as f64;
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    println!(
        "{:>6} {:>7} {:>6} {:>3} {:>4} {:>5} {:>9} {:>10} {:>9} {:>6} {:>12} {:>12} {:>10}",
        "params",
        "density",
        "reply",
        "srv",
        "wkr",
        "steps",
        "step ms",
        "cpu/upd ms",
        "ns/entry",
        "x Wmin",
        "reply B/wkr",
        "link MB/step",
        "MiB/server"
    );
    for case in grid(args) {
        let lead = format!(
            "{:>6} {:>7} {:>6} {:>3} {:>4} {:>5}",
            size_label(case.params),
            density_label(case.density),
            mode_label(&case),
            case.servers,
            case.workers,
            case.steps
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
        // The series' first row is its smallest worker count (the grid runs
        // them in the order given).
        let ratio = base_of(&results, &r)
            .map(|b| ratio_to(b, &r))
            .unwrap_or(1.0);
        println!(
            "{lead} {:>9.1} {:>10.3} {:>9.1} {:>6.2} {:>12.0} {:>12.3} {:>10.1}",
            r.step_ms,
            r.cpu_per_update_ms(),
            r.cpu_per_entry_ns(),
            ratio,
            r.reply_bytes_per_worker_step(),
            r.busiest_bytes_per_step() / 1e6,
            r.max_server_memory() as f64 / (1u64 << 20) as f64
        );
        results.push(r);
    }
    println!();
    print!("{}", target_check(&results));
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating --out folder {}", args.out.display()))?;
    let rows: Vec<Row> = results.iter().map(|r| row(&results, r)).collect();
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

type SeriesKey = (usize, Option<f64>, usize, bool);

fn key(r: &CaseResult) -> SeriesKey {
    (
        r.case.params,
        r.case.density,
        r.case.servers,
        r.case.global_topk,
    )
}

/// The result of `r`'s series at the smallest worker count measured.
fn base_of<'a>(results: &'a [CaseResult], r: &CaseResult) -> Option<&'a CaseResult> {
    results
        .iter()
        .filter(|b| key(b) == key(r))
        .min_by_key(|b| b.case.workers)
        .filter(|b| b.case.workers <= r.case.workers)
}

fn ratio_to(base: &CaseResult, r: &CaseResult) -> f64 {
    r.cpu_per_entry_ns() / base.cpu_per_entry_ns()
}

fn row(results: &[CaseResult], r: &CaseResult) -> Row {
    Row {
        params: r.case.params,
        density: density_label(r.case.density),
        replies: mode_label(&r.case).into(),
        servers: r.case.servers,
        workers: r.case.workers,
        steps: r.case.steps,
        step_ms: r.step_ms,
        server_cpu_per_update_ms: r.cpu_per_update_ms(),
        server_cpu_per_entry_ns: r.cpu_per_entry_ns(),
        cpu_per_entry_ratio: base_of(results, r).map_or(1.0, |b| ratio_to(b, r)),
        entries_pushed_per_step: r.entries_pushed as f64 / r.case.steps as f64,
        reply_bytes_per_worker_step: r.reply_bytes_per_worker_step(),
        busiest_server_bytes_per_step: r.busiest_bytes_per_step(),
        max_server_memory_bytes: r.max_server_memory(),
        detail: r.clone(),
    }
}

fn to_csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "params,density,replies,servers,workers,steps,step_ms,server_cpu_per_update_ms,\
         server_cpu_per_entry_ns,cpu_per_entry_ratio,entries_pushed_per_step,\
         reply_bytes_per_worker_step,busiest_server_bytes_per_step,max_server_memory_bytes\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{:.3},{:.4},{:.3},{:.3},{:.0},{:.0},{:.0},{}",
            r.params,
            r.density,
            r.replies,
            r.servers,
            r.workers,
            r.steps,
            r.step_ms,
            r.server_cpu_per_update_ms,
            r.server_cpu_per_entry_ns,
            r.cpu_per_entry_ratio,
            r.entries_pushed_per_step,
            r.reply_bytes_per_worker_step,
            r.busiest_server_bytes_per_step,
            r.max_server_memory_bytes
        );
    }
    out
}

/// Per series: is the CPU per pushed entry at every worker count within
/// [`TARGET_RATIO`] of that at the smallest? PASS or MISS, with the worst
/// ratio; a series with one worker count cannot be checked.
fn target_check(results: &[CaseResult]) -> String {
    let mut out = String::new();
    for (key, series) in series(results) {
        let first = series[0];
        let last = series[series.len() - 1];
        let _ = write!(
            out,
            "CPU per pushed entry within {TARGET_RATIO}x from {} to {} workers, {} {} {} srv {}: ",
            first.case.workers,
            last.case.workers,
            size_label(key.0),
            density_label(key.1),
            key.2,
            mode_label(&first.case),
        );
        if series.len() < 2 {
            out.push_str("not checked (one worker count)\n");
            continue;
        }
        let (worst, at) = series
            .iter()
            .map(|r| (ratio_to(first, r), r.case.workers))
            .fold((f64::NEG_INFINITY, 0), |a, b| if b.0 > a.0 { b } else { a });
        let _ = writeln!(
            out,
            "{} ({:.1} ns at {} workers, {:.1} ns at {}; worst {worst:.2}x at {at})",
            if worst <= TARGET_RATIO {
                "PASS"
            } else {
                "MISS"
            },
            first.cpu_per_entry_ns(),
            first.case.workers,
            last.cpu_per_entry_ns(),
            last.case.workers,
        );
    }
    out
}

/// Results grouped by (size, density, servers, mode), each sorted by workers.
fn series(results: &[CaseResult]) -> Vec<(SeriesKey, Vec<&CaseResult>)> {
    let mut out: Vec<(SeriesKey, Vec<&CaseResult>)> = Vec::new();
    for r in results {
        match out.iter_mut().find(|(k, _)| *k == key(r)) {
            Some((_, v)) => v.push(r),
            None => out.push((key(r), vec![r])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by_key(|r| r.case.workers);
    }
    out
}

/// Two log-log panels against workers: server CPU per pushed entry and reply
/// bytes per worker and step, one line per (size, density, servers, mode).
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
        ("server CPU per pushed entry (ns)", |r| r.cpu_per_entry_ns()),
        ("reply bytes per worker and step", |r| {
            r.reply_bytes_per_worker_step()
        }),
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
                    "{} {} {} srv {}",
                    size_label(key.0),
                    density_label(key.1),
                    key.2,
                    mode_label(&series[0].case)
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

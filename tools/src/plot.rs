//! Charts of a run's per-epoch and per-step metrics, drawn as PNG files.
//!
//! [`plot_run_dir`] reads the `worker-<rank>.jsonl` files a run writes to
//! `training.metrics_dir` and draws one chart per measure (loss, accuracy,
//! data wait, compute and communication time, bytes per step, cache hit rate
//! per tier, bucket GETs and cost), with epochs along the x axis and one line
//! per worker; when the files hold per-step records (`"record":"step"`,
//! every `training.step_metrics_every` steps) it also draws loss, learning
//! rate, step time by phase and bytes with steps along the x axis. [`write_line_chart`] is the line chart underneath, usable on
//! its own:
//!
//! ```no_run
//! use ps_data::plot::{write_line_chart, LineChart, Series, CHART_SIZE};
//! let series = [Series::new("worker 0", vec![(1.0, 2.3), (2.0, 1.1)])];
//! let chart = LineChart { title: "Loss", x_label: "epoch", y_label: "loss", series: &series };
//! write_line_chart(std::path::Path::new("loss.png"), &chart, CHART_SIZE).unwrap();
//! ```
//!
//! Everything is pure Rust: plotters draws into an RGB buffer, text is set
//! with DejaVu Sans compiled into the binary (no system fonts, so it works in
//! the `scratch` image), and `png` encodes the buffer.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use serde_json::{Map, Value};

/// Width and height in pixels of the charts [`plot_run_dir`] writes.
pub const CHART_SIZE: (u32, u32) = (960, 540);

/// The family name the compiled-in font is registered under.
const FONT: &str = "sans-serif";

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no metrics in {dir}: expected worker-<rank>.jsonl files with at least one epoch \
         or step record (a run writes them when training.metrics_dir is set)"
    )]
    NoMetrics { dir: PathBuf },
    #[error("{path}, line {line}: {reason}")]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("chart {chart:?}: {reason}")]
    Draw { chart: String, reason: String },
    #[error("cannot write {path}: {reason}")]
    Write { path: PathBuf, reason: String },
}

/// One named line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// A line chart: a title, axis labels and its named series.
#[derive(Debug, Clone, Copy)]
pub struct LineChart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: &'a [Series],
}

/// Registers the compiled-in DejaVu Sans as the `sans-serif` family for
/// every plotters backend (no system fonts are needed, nor read). Safe to
/// call more than once.
pub fn register_font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
                .map_err(|_| "the compiled-in DejaVu Sans font does not parse".to_string())
        })
        .clone()
}

/// The axis range covering `values`, padded so that a single value or a
/// flat line still gets a visible range; `from_zero` starts it at 0 when
/// every value is positive.
fn axis_range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo > hi {
        return (0.0, 1.0);
    }
    if from_zero && lo > 0.0 {
        lo = 0.0;
    }
    if hi - lo < 1e-12 {
        let pad = if hi.abs() > 0.0 { hi.abs() * 0.1 } else { 0.5 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    if !(from_zero && lo == 0.0) {
        lo -= pad;
    }
    hi += pad;
    (lo, hi)
}

/// Tick labels for an axis spanning `span`: enough decimals to tell ticks
/// about a tenth of the span apart, trailing zeros dropped (`0.5`, `2`,
/// `0.0001`).
fn tick_label(v: f64, span: f64) -> String {
    if v.fract() == 0.0 {
        return format!("{v:.0}");
    }
    let decimals = if span > 0.0 {
        (-(span / 10.0).log10().floor()).clamp(0.0, 12.0) as usize
    } else {
        3
    };
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        let text = text.trim_end_matches('0').trim_end_matches('.');
        if text == "-0" {
            "0".to_string()
        } else {
            text.to_string()
        }
    } else {
        text
    }
}

/// Line colours, told apart easily on white.
const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draws `chart` into an RGB buffer of `width × height` pixels (3 bytes
/// per pixel, rows top to bottom). Points that are not finite are left out.
pub fn render_line_chart(
    chart: &LineChart,
    (width, height): (u32, u32),
) -> Result<Vec<u8>, PlotError> {
    let fail = |e: &dyn std::fmt::Display| PlotError::Draw {
        chart: chart.title.to_string(),
        reason: e.to_string(),
    };
    if width < 200 || height < 150 {
        return Err(fail(&format!(
            "{width}x{height} pixels is too small (at least 200x150)"
        )));
    }
    register_font().map_err(|e| fail(&e))?;
    let finite = |s: &Series| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let lines: Vec<(&str, Vec<(f64, f64)>)> = chart
        .series
        .iter()
        .map(|s| (s.name.as_str(), finite(s)))
        .collect();
    let xs = || lines.iter().flat_map(|(_, p)| p.iter().map(|p| p.0));
    let (x0, x1) = axis_range(xs(), false);
    let (y0, y1) = axis_range(lines.iter().flat_map(|(_, p)| p.iter().map(|p| p.1)), true);
    let mut distinct_x: Vec<f64> = xs().collect();
    distinct_x.sort_by(f64::total_cmp);
    distinct_x.dedup();

    let mut buf = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut ctx = ChartBuilder::on(&root)
            .caption(chart.title, (FONT, 26))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(96)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| fail(&e))?;
        ctx.configure_mesh()
            .x_desc(chart.x_label)
            .y_desc(chart.y_label)
            .x_labels(distinct_x.len().clamp(2, 12))
            .y_labels(8)
            .x_label_formatter(&|v| tick_label(*v, x1 - x0))
            .y_label_formatter(&|v| tick_label(*v, y1 - y0))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .light_line_style(RGBColor(236, 236, 236))
            .draw()
            .map_err(|e| fail(&e))?;
        for (i, (name, points)) in lines.iter().enumerate() {
            let color = COLOURS[i % COLOURS.len()];
            ctx.draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| fail(&e))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
            ctx.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| fail(&e))?;
        }
        if lines.iter().any(|(name, _)| !name.is_empty()) {
            ctx.configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font((FONT, 15))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .draw()
                .map_err(|e| fail(&e))?;
        }
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(buf)
}

/// Writes an RGB buffer as an 8-bit PNG.
pub fn write_png(path: &Path, rgb: &[u8], (width, height): (u32, u32)) -> Result<(), PlotError> {
    let fail = |reason: String| PlotError::Write {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::create(path).map_err(|e| fail(e.to_string()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| fail(e.to_string()))?;
    writer
        .write_image_data(rgb)
        .map_err(|e| fail(e.to_string()))?;
    writer.finish().map_err(|e| fail(e.to_string()))
}

/// Draws `chart` and writes it to `path` as a PNG of `size` pixels.
pub fn write_line_chart(path: &Path, chart: &LineChart, size: (u32, u32)) -> Result<(), PlotError> {
    let rgb = render_line_chart(chart, size)?;
    write_png(path, &rgb, size)
}

/// One worker's epochs as read from its `worker-<rank>.jsonl`.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    pub rank: u64,
    pub path: PathBuf,
    /// One JSON object per epoch, in file order.
    pub epochs: Vec<Map<String, Value>>,
    /// The per-step records (`"record":"step"`), in file order.
    pub steps: Vec<Map<String, Value>>,
}

/// Reads every `worker-<rank>.jsonl` in `dir`, in rank order. A line that is
/// not a JSON object with integer `rank` and `epoch` fields (`rank` and
/// `step` for a `"record":"step"` line) is an error naming the file and
/// line; a directory without any record is [`PlotError::NoMetrics`].
pub fn read_run_dir(dir: &Path) -> Result<Vec<WorkerMetrics>, PlotError> {
    let read_err = |path: &Path, source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    };
    let entries = std::fs::read_dir(dir).map_err(|e| read_err(dir, e))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| read_err(dir, e))?.path();
        let rank = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("worker-"))
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|r| r.parse::<u64>().ok());
        if let Some(rank) = rank {
            files.push((rank, path));
        }
    }
    files.sort();
    let mut workers = Vec::new();
    for (rank, path) in files {
        let text = std::fs::read_to_string(&path).map_err(|e| read_err(&path, e))?;
        let mut epochs = Vec::new();
        let mut steps = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let malformed = |reason: String| PlotError::Malformed {
                path: path.clone(),
                line: i + 1,
                reason,
            };
            let record: Map<String, Value> = serde_json::from_str(line)
                .map_err(|e| malformed(format!("not a JSON object: {e}")))?;
            let is_step = match record.get("record") {
                None => false,
                Some(Value::String(kind)) if kind == "step" => true,
                Some(other) => {
                    return Err(malformed(format!(
                        "`record` is {other}; the known kind is \"step\""
                    )))
                }
            };
            let keys = if is_step {
                ["rank", "step"]
            } else {
                ["rank", "epoch"]
            };
            for key in keys {
                if !record.get(key).is_some_and(Value::is_u64) {
                    return Err(malformed(format!(
                        "no `{key}` field holding a non-negative integer"
                    )));
                }
            }
            if record.get("rank").and_then(Value::as_u64) != Some(rank) {
                return Err(malformed(format!(
                    "`rank` is {}, but the file is worker {rank}'s",
                    record["rank"]
                )));
            }
            if is_step {
                steps.push(record);
            } else {
                epochs.push(record);
            }
        }
        if !epochs.is_empty() || !steps.is_empty() {
            workers.push(WorkerMetrics {
                rank,
                path,
                epochs,
                steps,
            });
        }
    }
    if workers.is_empty() {
        return Err(PlotError::NoMetrics {
            dir: dir.to_path_buf(),
        });
    }
    Ok(workers)
}

/// How a chart line is computed from one epoch's record.
#[derive(Debug, Clone, Copy)]
enum Measure {
    /// A numeric field as it is.
    Field(&'static str),
    /// A fraction field, in percent.
    Percent(&'static str),
    /// A byte count over the epoch's steps, in kilobytes.
    KbPerStep(&'static str),
    /// A byte count, in kilobytes.
    Kb(&'static str),
    /// Seconds, in milliseconds.
    Ms(&'static str),
}

impl Measure {
    fn of(self, record: &Map<String, Value>) -> Option<f64> {
        let num = |key: &str| record.get(key).and_then(Value::as_f64);
        match self {
            Measure::Field(key) => num(key),
            Measure::Percent(key) => num(key).map(|v| 100.0 * v),
            Measure::KbPerStep(key) => {
                let steps = num("steps").filter(|s| *s > 0.0)?;
                num(key).map(|v| v / steps / 1e3)
            }
            Measure::Kb(key) => num(key).map(|v| v / 1e3),
            Measure::Ms(key) => num(key).map(|v| v * 1e3),
        }
    }
}

/// One of the charts `ps-data plot` writes.
struct ChartSpec {
    file: &'static str,
    title: &'static str,
    y_label: &'static str,
    /// (line name, measure); each worker gets one line per entry.
    lines: &'static [(&'static str, Measure)],
}

const CHARTS: &[ChartSpec] = &[
    ChartSpec {
        file: "loss.png",
        title: "Loss (train: mean over the epoch's steps; test: at its end)",
        y_label: "cross-entropy loss",
        lines: &[
            ("train loss", Measure::Field("train_loss")),
            ("test loss", Measure::Field("test_loss")),
        ],
    },
    ChartSpec {
        file: "accuracy.png",
        title: "Test accuracy",
        y_label: "% correct",
        lines: &[("test accuracy", Measure::Percent("test_accuracy"))],
    },
    ChartSpec {
        file: "data_wait.png",
        title: "Time the trainer waited for data",
        y_label: "seconds per epoch",
        lines: &[("data wait", Measure::Field("data_wait_s"))],
    },
    ChartSpec {
        file: "compute_comm.png",
        title: "Compute and communication time",
        y_label: "seconds per epoch",
        lines: &[
            ("compute", Measure::Field("compute_s")),
            ("comm", Measure::Field("comm_s")),
        ],
    },
    ChartSpec {
        file: "bytes_per_step.png",
        title: "Bytes sent to and received from the servers per step",
        y_label: "KB per step",
        lines: &[
            ("pushed", Measure::KbPerStep("bytes_pushed")),
            ("pulled", Measure::KbPerStep("bytes_pulled")),
        ],
    },
    ChartSpec {
        file: "cache_hits.png",
        title: "Samples served by each cache tier",
        y_label: "% of the epoch's samples",
        lines: &[
            ("memory", Measure::Percent("memory_hit_rate")),
            ("disk", Measure::Percent("disk_hit_rate")),
            ("peer", Measure::Percent("peer_hit_rate")),
        ],
    },
    ChartSpec {
        file: "bucket_gets.png",
        title: "Bucket GET requests",
        y_label: "GETs per epoch",
        lines: &[("GETs", Measure::Field("bucket_gets"))],
    },
    ChartSpec {
        file: "bucket_cost.png",
        title: "Estimated bucket cost (requests and egress)",
        y_label: "USD per epoch",
        lines: &[
            ("cost", Measure::Field("bucket_cost_usd")),
            ("saved by peers", Measure::Field("peer_saved_usd")),
        ],
    },
];

/// The charts by step, drawn from the per-step records.
const STEP_CHARTS: &[ChartSpec] = &[
    ChartSpec {
        file: "step_loss.png",
        title: "Training loss by step",
        y_label: "cross-entropy loss",
        lines: &[("loss", Measure::Field("loss"))],
    },
    ChartSpec {
        file: "step_lr.png",
        title: "Learning rate by step",
        y_label: "learning rate",
        lines: &[("lr", Measure::Field("lr"))],
    },
    ChartSpec {
        file: "step_time.png",
        title: "Step time by phase",
        y_label: "milliseconds",
        lines: &[
            ("data", Measure::Ms("data_s")),
            ("compute", Measure::Ms("compute_s")),
            ("compress", Measure::Ms("compress_s")),
            ("exchange", Measure::Ms("exchange_s")),
        ],
    },
    ChartSpec {
        file: "step_bytes.png",
        title: "Bytes sent to and received from the servers by step",
        y_label: "KB",
        lines: &[
            ("pushed", Measure::Kb("bytes_pushed")),
            ("pulled", Measure::Kb("bytes_pulled")),
        ],
    },
];

/// The file names [`plot_run_dir`] writes for the per-epoch records, in
/// order.
pub fn chart_files() -> impl Iterator<Item = &'static str> {
    CHARTS.iter().map(|c| c.file)
}

/// The file names [`plot_run_dir`] writes after [`chart_files`] when the
/// run has per-step records, in order.
pub fn step_chart_files() -> impl Iterator<Item = &'static str> {
    STEP_CHARTS.iter().map(|c| c.file)
}

/// Which records a chart draws, and the field along x.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Axis {
    Epoch,
    Step,
}

/// The series of one chart: per worker, one line per measure, with the
/// record's `epoch` (or `step`) along x. Records lacking the measure's
/// field are skipped.
fn chart_series(spec: &ChartSpec, workers: &[WorkerMetrics], axis: Axis) -> Vec<Series> {
    let mut series = Vec::new();
    for w in workers {
        let (records, x_key) = match axis {
            Axis::Epoch => (&w.epochs, "epoch"),
            Axis::Step => (&w.steps, "step"),
        };
        for &(name, measure) in spec.lines {
            let points = records
                .iter()
                .filter_map(|r| {
                    let x = r.get(x_key).and_then(Value::as_f64)?;
                    Some((x, measure.of(r)?))
                })
                .collect();
            let name = if spec.lines.len() == 1 {
                format!("worker {}", w.rank)
            } else {
                format!("worker {} {name}", w.rank)
            };
            series.push(Series::new(name, points));
        }
    }
    series
}

/// Reads the metrics in `run_dir` and writes every chart (the step charts
/// only when there are per-step records) into `out_dir`
/// (created if missing) as a [`CHART_SIZE`] PNG; returns the paths written.
pub fn plot_run_dir(run_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let workers = read_run_dir(run_dir)?;
    std::fs::create_dir_all(out_dir).map_err(|e| PlotError::Write {
        path: out_dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut written = Vec::new();
    let with_steps = workers.iter().any(|w| !w.steps.is_empty());
    let step_charts = if with_steps { STEP_CHARTS } else { &[] };
    let charts = CHARTS
        .iter()
        .map(|c| (c, Axis::Epoch))
        .chain(step_charts.iter().map(|c| (c, Axis::Step)));
    for (spec, axis) in charts {
        let series = chart_series(spec, &workers, axis);
        let chart = LineChart {
            title: spec.title,
            x_label: match axis {
                Axis::Epoch => "epoch",
                Axis::Step => "step",
            },
            y_label: spec.y_label,
            series: &series,
        };
        let path = out_dir.join(spec.file);
        write_line_chart(&path, &chart, CHART_SIZE)?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn a_malformed_line_names_its_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "worker-0.jsonl",
            "{\"rank\":0,\"epoch\":1,\"train_loss\":2.0}\n{\"rank\":0,\"epoch\":2,\n",
        );
        let err = read_run_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("worker-0.jsonl, line 2"), "{err}");
        write(
            dir.path(),
            "worker-0.jsonl",
            "{\"rank\":0,\"train_loss\":2.0}\n",
        );
        let err = read_run_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("`epoch`"), "{err}");
        write(dir.path(), "worker-0.jsonl", "{\"rank\":3,\"epoch\":1}\n");
        let err = read_run_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("`rank` is 3"), "{err}");
    }

    #[test]
    fn a_directory_without_epochs_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "notes.txt", "hello");
        let err = read_run_dir(dir.path()).unwrap_err();
        assert!(matches!(err, PlotError::NoMetrics { .. }), "{err}");
        // A metrics file with no epoch yet is no better.
        write(dir.path(), "worker-0.jsonl", "");
        let err = read_run_dir(dir.path()).unwrap_err();
        assert!(matches!(err, PlotError::NoMetrics { .. }), "{err}");
        let missing = dir.path().join("nope");
        let err = read_run_dir(&missing).unwrap_err().to_string();
        assert!(err.contains("nope"), "{err}");
    }

    #[test]
    fn series_are_per_worker_and_per_measure() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "worker-1.jsonl",
            "{\"rank\":1,\"epoch\":1,\"steps\":4,\"bytes_pushed\":8000,\"train_loss\":2.5,\"test_loss\":2.0}\n\
             {\"rank\":1,\"epoch\":2,\"steps\":4,\"bytes_pushed\":4000,\"train_loss\":1.5,\"test_loss\":null}\n",
        );
        write(
            dir.path(),
            "worker-0.jsonl",
            "{\"rank\":0,\"epoch\":1,\"steps\":2,\"bytes_pushed\":1000,\"train_loss\":2.4,\"test_loss\":2.1}\n",
        );
        let workers = read_run_dir(dir.path()).unwrap();
        assert_eq!(workers.iter().map(|w| w.rank).collect::<Vec<_>>(), [0, 1]);
        let loss = chart_series(&CHARTS[0], &workers, Axis::Epoch);
        let names: Vec<&str> = loss.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "worker 0 train loss",
                "worker 0 test loss",
                "worker 1 train loss",
                "worker 1 test loss"
            ]
        );
        assert_eq!(loss[2].points, [(1.0, 2.5), (2.0, 1.5)]);
        // A null (a NaN in the run) is left out, not drawn as 0.
        assert_eq!(loss[3].points, [(1.0, 2.0)]);
        let bytes = CHARTS
            .iter()
            .find(|c| c.file == "bytes_per_step.png")
            .unwrap();
        let kb = chart_series(bytes, &workers, Axis::Epoch);
        assert_eq!(kb[2].points, [(1.0, 2.0), (2.0, 1.0)]);
    }

    #[test]
    fn step_records_give_charts_by_step_next_to_the_epochs() {
        let dir = tempfile::tempdir().unwrap();
        // An old file (epochs only) next to a new one (steps and epochs).
        write(
            dir.path(),
            "worker-0.jsonl",
            "{\"rank\":0,\"epoch\":1,\"steps\":2,\"train_loss\":2.4}\n",
        );
        write(
            dir.path(),
            "worker-1.jsonl",
            "{\"record\":\"step\",\"rank\":1,\"step\":10,\"epoch\":1,\"loss\":2.5,\"lr\":0.1,\
             \"data_s\":0.002,\"compute_s\":0.01,\"compress_s\":0.001,\"exchange_s\":0.004,\
             \"bytes_pushed\":3000,\"bytes_pulled\":5000}\n\
             {\"record\":\"step\",\"rank\":1,\"step\":20,\"epoch\":1,\"loss\":1.5,\"lr\":0.05,\
             \"data_s\":0.001,\"compute_s\":0.02,\"compress_s\":0.001,\"exchange_s\":0.003,\
             \"bytes_pushed\":2000,\"bytes_pulled\":4000}\n\
             {\"rank\":1,\"epoch\":1,\"steps\":20,\"train_loss\":2.0}\n",
        );
        let workers = read_run_dir(dir.path()).unwrap();
        assert_eq!(workers[0].steps.len(), 0);
        assert_eq!((workers[1].steps.len(), workers[1].epochs.len()), (2, 1));
        // The epoch chart is unchanged by the step records.
        let loss = chart_series(&CHARTS[0], &workers, Axis::Epoch);
        assert_eq!(loss[2].points, [(1.0, 2.0)]);
        let by_step = chart_series(&STEP_CHARTS[0], &workers, Axis::Step);
        assert_eq!(by_step[0].points, []);
        assert_eq!(by_step[1].name, "worker 1");
        assert_eq!(by_step[1].points, [(10.0, 2.5), (20.0, 1.5)]);
        let time = STEP_CHARTS
            .iter()
            .find(|c| c.file == "step_time.png")
            .unwrap();
        let phases = chart_series(time, &workers, Axis::Step);
        let exchange = phases
            .iter()
            .find(|s| s.name == "worker 1 exchange")
            .unwrap();
        assert_eq!(exchange.points.len(), 2);
        assert!(
            (exchange.points[0].1 - 4.0).abs() < 1e-9,
            "{:?}",
            exchange.points
        );
        let bytes = STEP_CHARTS
            .iter()
            .find(|c| c.file == "step_bytes.png")
            .unwrap();
        let kb = chart_series(bytes, &workers, Axis::Step);
        assert_eq!(kb[3].points, [(10.0, 5.0), (20.0, 4.0)]);
        // The files: epoch charts, then step charts.
        let out = dir.path().join("plots");
        let written = plot_run_dir(dir.path(), &out).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let expected: Vec<&str> = chart_files().chain(step_chart_files()).collect();
        assert_eq!(names, expected);
        // A step record without `step`, or an unknown kind, names its line.
        write(
            dir.path(),
            "worker-1.jsonl",
            "{\"rank\":1,\"epoch\":1}\n{\"record\":\"step\",\"rank\":1,\"epoch\":1}\n",
        );
        let err = read_run_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("`step`"), "{err}");
        write(
            dir.path(),
            "worker-1.jsonl",
            "{\"record\":\"batch\",\"rank\":1}\n",
        );
        let err = read_run_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("\"batch\""), "{err}");
    }

    #[test]
    fn tick_labels_have_the_decimals_the_span_needs() {
        assert_eq!(tick_label(2.0, 2.4), "2");
        assert_eq!(tick_label(1.5, 2.4), "1.5");
        assert_eq!(tick_label(0.0001, 0.00012), "0.0001");
        assert_eq!(tick_label(0.000125, 0.00012), "0.00013");
        assert_eq!(tick_label(350.0, 420.0), "350");
        assert_eq!(tick_label(87.5, 60.0), "88");
    }

    #[test]
    fn axis_ranges_stay_visible() {
        assert_eq!(axis_range([].into_iter(), true), (0.0, 1.0));
        let (lo, hi) = axis_range([3.0].into_iter(), false);
        assert!(lo < 3.0 && hi > 3.0);
        let (lo, hi) = axis_range([0.0, 0.0].into_iter(), true);
        assert!(lo < 0.0 && hi > 0.0);
        let (lo, hi) = axis_range([2.0, 4.0].into_iter(), true);
        assert_eq!(lo, 0.0);
        assert!(hi > 4.0);
    }

    #[test]
    fn a_rendered_chart_has_ink_of_several_colours() {
        let series = [
            Series::new("a", vec![(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]),
            Series::new("b", vec![(1.0, 0.5), (2.0, f64::NAN), (3.0, 1.5)]),
        ];
        let chart = LineChart {
            title: "t",
            x_label: "epoch",
            y_label: "y",
            series: &series,
        };
        let rgb = render_line_chart(&chart, (400, 300)).unwrap();
        assert_eq!(rgb.len(), 400 * 300 * 3);
        let mut colours: Vec<&[u8]> = rgb.chunks(3).collect();
        colours.sort();
        colours.dedup();
        assert!(colours.len() > 10, "{} colours", colours.len());
        let err = render_line_chart(&chart, (10, 10)).unwrap_err().to_string();
        assert!(err.contains("too small"), "{err}");
    }
}

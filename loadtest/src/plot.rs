//! Plots of a load test, each as PNG and SVG: throughput and latency
//! percentiles against load (one line per target), a per-request
//! timeline of one run with the load sampled from /metrics beneath it,
//! and panels of series over time ([`write_series`]: an autoscaler's
//! replicas and the signals behind them).
//!
//! Text in the PNGs needs a font: DejaVu Sans ships inside the tool
//! (`assets/`, its licence beside it), so no system fonts are needed.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::client::{Outcome, Record};
use crate::report::Point;
use crate::sampler::Sample;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the built-in font did not load".to_string())
    })
    .clone()
}

/// One target's curve: per load level, the mean over its runs.
#[derive(Clone, Debug)]
pub struct Curve {
    pub label: String,
    /// (level, output tok/s, TTFT p50 ms, TTFT p99 ms, inter-token p99 ms)
    pub points: Vec<(f64, f64, f64, f64, f64)>,
}

impl Curve {
    pub fn from_points(label: &str, ps: &[Point]) -> Curve {
        let mut levels: Vec<usize> = ps.iter().map(|p| p.concurrency).collect();
        levels.sort();
        levels.dedup();
        let points = levels
            .into_iter()
            .map(|l| {
                let at: Vec<&Point> = ps.iter().filter(|p| p.concurrency == l).collect();
                let mean = |f: &dyn Fn(&Point) -> Option<f64>| {
                    let v: Vec<f64> = at.iter().filter_map(|p| f(p)).collect();
                    if v.is_empty() {
                        f64::NAN
                    } else {
                        v.iter().sum::<f64>() / v.len() as f64
                    }
                };
                (
                    l as f64,
                    mean(&|p| Some(p.output_tokens_per_s)),
                    mean(&|p| p.ttft_s.as_ref().map(|t| t.p50 * 1e3)),
                    mean(&|p| p.ttft_s.as_ref().map(|t| t.p99 * 1e3)),
                    mean(&|p| p.inter_token_s.as_ref().map(|t| t.p99 * 1e3)),
                )
            })
            .collect();
        Curve { label: label.to_string(), points }
    }
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("plot: {e:?}")
}

fn level_range(curves: &[Curve]) -> std::ops::Range<f64> {
    let hi = curves.iter().flat_map(|c| c.points.iter().map(|p| p.0)).fold(1.0, f64::max);
    0.8..hi * 1.25
}

fn max_of(curves: &[Curve], f: fn(&(f64, f64, f64, f64, f64)) -> f64) -> f64 {
    curves.iter().flat_map(|c| c.points.iter().map(f)).filter(|v| v.is_finite()).fold(0.0, f64::max)
}

fn draw_throughput<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    curves: &[Curve],
    xdesc: &str,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let ymax = max_of(curves, |p| p.1).max(1.0) * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption("Output throughput", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(level_range(curves).log_scale(), 0.0..ymax)
        .map_err(err)?;
    chart.configure_mesh().x_desc(xdesc).y_desc("output tokens/s").max_light_lines(1).draw().map_err(err)?;
    for (i, c) in curves.iter().enumerate() {
        let col = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = c.points.iter().map(|p| (p.0, p.1)).filter(|p| p.1.is_finite()).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
            .map_err(err)?
            .label(c.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, col.filled()))).map_err(err)?;
    }
    legend_and_present(&mut chart, root, SeriesLabelPosition::UpperLeft)
}

fn draw_latency<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    curves: &[Curve],
    xdesc: &str,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let ymax = max_of(curves, |p| p.3.max(p.4)).max(1.0) * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption("Latency percentiles", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(level_range(curves).log_scale(), 0.0..ymax)
        .map_err(err)?;
    chart.configure_mesh().x_desc(xdesc).y_desc("milliseconds").max_light_lines(1).draw().map_err(err)?;
    type Pick = fn(&(f64, f64, f64, f64, f64)) -> f64;
    let series: [(&str, Pick, bool); 3] =
        [("TTFT p50", |p| p.2, false), ("TTFT p99", |p| p.3, false), ("inter-token p99", |p| p.4, true)];
    for (i, c) in curves.iter().enumerate() {
        let col = COLORS[i % COLORS.len()];
        for (name, pick, dashed) in series {
            let pts: Vec<(f64, f64)> = c.points.iter().map(|p| (p.0, pick(p))).filter(|p| p.1.is_finite()).collect();
            let width = if name == "TTFT p50" { 1 } else { 2 };
            let style = col.stroke_width(width);
            let label = format!("{} {name}", c.label);
            if dashed {
                chart
                    .draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))
                    .map_err(err)?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], style));
            } else {
                chart
                    .draw_series(LineSeries::new(pts.clone(), style))
                    .map_err(err)?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            }
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, col.filled()))).map_err(err)?;
        }
    }
    legend_and_present(&mut chart, root, SeriesLabelPosition::UpperLeft)
}

/// Gauges worth drawing on the timeline, if sampled: (metric, label).
const GAUGES: &[(&str, &str)] = &[
    ("pdmesh_decode_running", "decode running"),
    ("pdmesh_decode_queued", "decode waiting for a slot"),
    ("pdmesh_decode_awaiting_kv", "decode awaiting KV"),
    ("pdmesh_prefill_queued", "prefill queued"),
    ("pdmesh_prefill_running", "prefill running"),
];

fn draw_timeline<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    records: &[Record],
    samples: &[Sample],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically((root.dim_in_pixel().1 as f64 * 0.62) as u32);
    let t_end =
        records.iter().map(|r| r.start_s + r.e2e_s).chain(samples.iter().map(|s| s.t_s)).fold(1.0, f64::max) * 1.02;
    let n = records.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_end, 0.0..n + 1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .y_desc("request")
        .x_desc("seconds since the run started")
        .disable_y_mesh()
        .max_light_lines(1)
        .draw()
        .map_err(err)?;
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    for (i, r) in sorted.iter().enumerate() {
        let y = i as f64 + 1.0;
        let end = r.start_s + r.e2e_s;
        let first = r.ttft_s.map_or(end, |t| r.start_s + t);
        let done = match r.outcome {
            Outcome::Ok => COLORS[0],
            Outcome::Stalled => COLORS[4],
            _ => COLORS[1],
        };
        // Waiting for the first token (grey), then streaming (coloured).
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(r.start_s, y), (first, y)],
                RGBColor(170, 170, 170).stroke_width(2),
            )))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(PathElement::new(vec![(first, y), (end, y)], done.stroke_width(2))))
            .map_err(err)?;
    }
    let mut series: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
    for (metric, label) in GAUGES {
        // Summed over instances at each sampling time.
        let mut pts: Vec<(f64, f64)> = Vec::new();
        for s in samples {
            if let Some(v) = s.values.get(*metric) {
                match pts.iter_mut().find(|(t, _)| (t - s.t_s).abs() < 0.2) {
                    Some(p) => p.1 += v,
                    None => pts.push((s.t_s, *v)),
                }
            }
        }
        if !pts.is_empty() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            series.push((label, pts));
        }
    }
    let ymax = series.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).fold(1.0, f64::max) * 1.15;
    let mut load = ChartBuilder::on(&bottom)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_end, 0.0..ymax)
        .map_err(err)?;
    load.configure_mesh().y_desc("sequences (sampled)").max_light_lines(1).draw().map_err(err)?;
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let col = COLORS[(i + 2) % COLORS.len()];
        load.draw_series(LineSeries::new(pts, col.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
    }
    legend_and_present(&mut load, root, SeriesLabelPosition::UpperRight)
}

/// Draw the series legend at `at`, then write the figure out.
fn legend_and_present<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    root: &DrawingArea<DB, Shift>,
    at: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Draws one figure as PNG and as SVG.
type DrawPng<'a> = dyn Fn(&DrawingArea<BitMapBackend, Shift>) -> Result<(), String> + 'a;
type DrawSvg<'a> = dyn Fn(&DrawingArea<SVGBackend, Shift>) -> Result<(), String> + 'a;

/// Draw with `f` into `<prefix>-<name>.png` and with `g` into `.svg`;
/// returns the files.
fn both(prefix: &Path, name: &str, size: (u32, u32), f: &DrawPng<'_>, g: &DrawSvg<'_>) -> Result<Vec<PathBuf>, String> {
    let stem = prefix.file_name().and_then(|s| s.to_str()).unwrap_or("loadtest");
    let png = prefix.with_file_name(format!("{stem}-{name}.png"));
    let svg = prefix.with_file_name(format!("{stem}-{name}.svg"));
    f(&BitMapBackend::new(&png, size).into_drawing_area())?;
    g(&SVGBackend::new(&svg, size).into_drawing_area())?;
    Ok(vec![png, svg])
}

/// Named series over time, sharing one y axis.
pub struct Panel {
    pub y_desc: String,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

fn draw_panels<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, panels: &[Panel]) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let t_end = panels.iter().flat_map(|p| p.series.iter().flat_map(|s| s.1.iter().map(|x| x.0))).fold(1.0, f64::max);
    let (head, body) = root.split_vertically(30);
    head.titled(title, ("sans-serif", 20)).map_err(err)?;
    let areas = body.split_evenly((panels.len().max(1), 1));
    let mut c = 0;
    for (area, panel) in areas.iter().zip(panels) {
        let ymax = panel.series.iter().flat_map(|s| s.1.iter().map(|x| x.1)).fold(0.0, f64::max).max(1e-3) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..t_end, 0.0..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .y_desc(panel.y_desc.as_str())
            .x_desc("seconds")
            .max_light_lines(1)
            .draw()
            .map_err(err)?;
        for (label, pts) in &panel.series {
            let col = COLORS[c % COLORS.len()];
            c += 1;
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), col.stroke_width(2)))
                .map_err(err)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)
}

/// Panels of series over time, stacked, as `<prefix>-series.png` and `.svg`.
pub fn write_series(prefix: &Path, title: &str, panels: &[Panel]) -> Result<Vec<PathBuf>, String> {
    register_font()?;
    let h = 200 + 220 * panels.len() as u32;
    both(prefix, "series", (1000, h), &|r| draw_panels(r, title, panels), &|r| draw_panels(r, title, panels))
}

/// Every plot of a run, written beside `prefix` (e.g. `docs/benchmarks/run`
/// gives `run-throughput.png`, `run-latency.svg`, ...). `timeline` is one
/// run's requests and metrics samples, with its title.
pub fn write_all(
    prefix: &Path,
    curves: &[Curve],
    xdesc: &str,
    timeline: Option<(&str, &[Record], &[Sample])>,
) -> Result<Vec<PathBuf>, String> {
    register_font()?;
    let mut files = Vec::new();
    if curves.iter().any(|c| !c.points.is_empty()) {
        files.extend(both(prefix, "throughput", (900, 560), &|r| draw_throughput(r, curves, xdesc), &|r| {
            draw_throughput(r, curves, xdesc)
        })?);
        files.extend(both(prefix, "latency", (900, 560), &|r| draw_latency(r, curves, xdesc), &|r| {
            draw_latency(r, curves, xdesc)
        })?);
    }
    if let Some((title, records, samples)) = timeline {
        if !records.is_empty() {
            files.extend(both(
                prefix,
                "timeline",
                (1000, 700),
                &|r| draw_timeline(r, title, records, samples),
                &|r| draw_timeline(r, title, records, samples),
            )?);
        }
    }
    Ok(files)
}

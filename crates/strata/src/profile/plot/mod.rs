//! Pictures of profiles and of training metrics, drawn with `plotters` as PNG or SVG:
//! memory over time per rank with the forward, backward and update stretches as bands; the
//! map of where each unit's parameters are over time; per-unit time and memory bars; and
//! ([`metrics`]) loss, learning rate, tokens/s and memory over steps for several runs.
//!
//! Owns: the drawing of the series [`super::series`] takes from read profiles. Must not read or validate
//! files: it takes what [`super::read_dir`] and [`metrics::read`] return.
//!
//! Labels need a TrueType font: [`use_font`] takes one, else the first of the usual system
//! places ([`FONT_PLACES`]) is loaded once per process.
pub mod metrics;

use super::series::{host_homed, memory_series, residency, unit_costs, Residency};
use super::{Profile, SpanKind};
use crate::engine::Placement;
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where a font for labels is looked for when none is given (Debian and Ubuntu, Fedora,
/// Arch, macOS).
pub const FONT_PLACES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// The font registered for labels, if any (a process registers one and keeps it).
static FONT: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Draws labels with the TrueType font at `path` from now on.
pub fn use_font(path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    // plotters keeps fonts for the life of the process; one font per process is leaked.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| Error::Plot(format!("{}: not a TrueType or OpenType font", path.display())))?;
    *FONT.lock().unwrap_or_else(|e| e.into_inner()) = Some(path.to_path_buf());
    Ok(())
}

fn ensure_font() -> Result<()> {
    if FONT.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        return Ok(());
    }
    let found = FONT_PLACES.iter().map(Path::new).find(|p| p.is_file()).ok_or_else(|| {
        Error::Plot(
            "no font for the labels in the usual places: give one (--font FILE.ttf, e.g. DejaVuSans.ttf)".into(),
        )
    })?;
    use_font(found)
}

/// PNG or SVG, by the file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageFormat {
    /// A PNG bitmap (`.png`).
    Png,
    /// An SVG drawing (`.svg`).
    Svg,
}

impl ImageFormat {
    /// The format `path`'s extension names, in either case; any other extension is an error.
    pub fn of(path: &Path) -> Result<ImageFormat> {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("png") => Ok(ImageFormat::Png),
            Some("svg") => Ok(ImageFormat::Svg),
            _ => Err(Error::Plot(format!("{}: pictures are .png or .svg", path.display()))),
        }
    }

    /// The file extension of the format, without the dot.
    pub fn extension(self) -> &'static str {
        match self {
            ImageFormat::Png => "png",
            ImageFormat::Svg => "svg",
        }
    }
}

/// Something drawn on a drawing area of any backend.
pub trait Picture {
    /// Width and height in pixels.
    fn size(&self) -> (u32, u32);
    /// Draws the whole picture onto `root`, filling its background first.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult;
}

/// A drawing's outcome; plotters' errors carry the backend's type, so they become text.
pub type DrawResult = std::result::Result<(), String>;

fn drawing<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Draws `picture` into `path` (format by extension), replacing it whole or not at all.
pub fn render(picture: &impl Picture, path: &Path) -> Result<()> {
    let format = ImageFormat::of(path)?;
    ensure_font()?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("picture");
    // The bitmap backend picks its encoder by extension, so the partial file keeps it.
    let partial = path.with_file_name(format!(".{name}.partial.{}", format.extension()));
    let drawn = match format {
        ImageFormat::Png => {
            let root = BitMapBackend::new(&partial, picture.size()).into_drawing_area();
            picture.draw(&root).and_then(|()| root.present().map_err(drawing))
        }
        ImageFormat::Svg => {
            let root = SVGBackend::new(&partial, picture.size()).into_drawing_area();
            picture.draw(&root).and_then(|()| root.present().map_err(drawing))
        }
    };
    if let Err(e) = drawn {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::Plot(format!("{}: {e}", path.display())));
    }
    std::fs::rename(&partial, path).map_err(|e| Error::io(path, e))
}

use crate::profile::MIB as MB;

/// Colours of the stretches of a step, drawn as bands behind the memory curves.
fn band_colour(kind: SpanKind) -> RGBAColor {
    match kind {
        SpanKind::Forward(_) => RGBColor(120, 170, 230).mix(0.22),
        SpanKind::Backward(_) => RGBColor(240, 160, 90).mix(0.22),
        SpanKind::Recompute(_) => RGBColor(170, 120, 200).mix(0.30),
        SpanKind::Update => RGBColor(110, 190, 110).mix(0.30),
    }
}

/// Device and host memory over time, one panel per rank: what the ledger counts per
/// placement, the device's model states (the chunk-managed part) and the allocator's
/// bytes, over bands marking each unit's forward and backward and the update.
pub struct MemoryOverTime<'a>(pub &'a [Profile]);

/// The map of units over time, one panel per rank: a row per unit, its home shaded (grey on
/// the device, light brown on the host), its stretches gathered or copied to the device
/// drawn over it, and its forward and backward marked.
pub struct UnitMap<'a>(pub &'a [Profile]);

/// Per-unit bars: forward and backward time above, parameter and kept-activation bytes
/// below (averaged over the ranks that ran each unit).
pub struct UnitBars<'a>(pub &'a [Profile]);

/// The time axis of `p`'s panels (never empty).
fn span_of(p: &Profile) -> (f64, f64) {
    let (start, end) = p.time_range();
    (start, if end > start { end } else { start + 1.0 })
}

/// A chart of seconds, steps or positions against values.
type Chart<'a, DB> =
    ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>>;

/// Legend entries drawn as filled boxes (for bands, boxes and bars).
fn legend_boxes<DB: DrawingBackend>(chart: &mut Chart<'_, DB>, entries: &[(ShapeStyle, &str)]) -> DrawResult {
    for &(style, label) in entries {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(drawing)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], style));
    }
    Ok(())
}

/// The legend of every labelled series, in the upper right corner.
fn draw_legend<'a, DB: DrawingBackend + 'a>(chart: &mut Chart<'a, DB>) -> DrawResult {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(drawing)
}

/// A line series with its legend entry.
fn legend_line<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    points: Vec<(f64, f64)>,
    colour: RGBColor,
    label: &str,
) -> DrawResult {
    chart
        .draw_series(LineSeries::new(points, colour.stroke_width(2)))
        .map_err(drawing)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
    Ok(())
}

/// The name for an axis position: the unit whose row or bar is centred there (rows counted
/// from the top when `reversed`), nothing between them.
fn row_label(names: &[String], at: f64, reversed: bool) -> String {
    let index = at.round();
    if (at - index).abs() > 1e-6 || index < 0.0 {
        return String::new();
    }
    let index = index as usize;
    let index = if reversed { names.len().checked_sub(index + 1) } else { Some(index) };
    index.and_then(|i| names.get(i)).cloned().unwrap_or_default()
}

impl Picture for MemoryOverTime<'_> {
    fn size(&self) -> (u32, u32) {
        (1280, 380 * self.0.len().max(1) as u32)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(drawing)?;
        for (area, p) in root.split_evenly((self.0.len(), 1)).iter().zip(self.0) {
            let series = memory_series(p);
            let top = series
                .iter()
                .flat_map(|m| m.by_placement.values().copied().chain(m.allocated))
                .max()
                .unwrap_or(1)
                .max(1) as f64
                / MB
                * 1.45;
            let (start, end) = span_of(p);
            let mut chart = ChartBuilder::on(area)
                .caption(format!("rank {}: memory over time ({})", p.header.rank, p.header.device), ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(70)
                .build_cartesian_2d(start..end, 0.0..top)
                .map_err(drawing)?;
            chart.configure_mesh().x_desc("seconds").y_desc("MiB").draw().map_err(drawing)?;
            let bands = p
                .spans()
                .into_iter()
                .map(|s| Rectangle::new([(s.start, 0.0), (s.end, top)], band_colour(s.kind).filled()));
            chart.draw_series(bands).map_err(drawing)?;
            let colours = [RGBColor(31, 90, 170), RGBColor(150, 90, 40)];
            for (i, placement) in [Placement::Device, Placement::Host].into_iter().enumerate() {
                let points: Vec<(f64, f64)> = series
                    .iter()
                    .filter_map(|m| m.by_placement.get(&placement).map(|&b| (m.t, b as f64 / MB)))
                    .collect();
                if points.iter().any(|&(_, y)| y > 0.0) {
                    let label = format!("ledger, {}", placement.name());
                    legend_line(&mut chart, points, colours[i], &label)?;
                }
            }
            let states: Vec<(f64, f64)> = series.iter().map(|m| (m.t, m.device_model_states as f64 / MB)).collect();
            legend_line(&mut chart, states, RGBColor(40, 150, 70), "model states on the device")?;
            let allocated: Vec<(f64, f64)> =
                series.iter().filter_map(|m| m.allocated.map(|a| (m.t, a as f64 / MB))).collect();
            if !allocated.is_empty() {
                legend_line(&mut chart, allocated, RGBColor(200, 40, 40), "allocator (whole process)")?;
            }
            legend_boxes(
                &mut chart,
                &[
                    (band_colour(SpanKind::Forward(0)).filled(), "forward"),
                    (band_colour(SpanKind::Backward(0)).filled(), "backward"),
                    (band_colour(SpanKind::Recompute(0)).filled(), "recompute (in backward)"),
                    (band_colour(SpanKind::Update).filled(), "update"),
                ],
            )?;
            draw_legend(&mut chart)?;
        }
        Ok(())
    }
}

impl Picture for UnitMap<'_> {
    fn size(&self) -> (u32, u32) {
        let units = self.0.first().map_or(1, |p| p.header.units.len()) as u32;
        (1280, (110 + 16 * units) * self.0.len().max(1) as u32)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(drawing)?;
        let home_device = RGBColor(215, 215, 215).filled();
        let home_host = RGBColor(235, 215, 180).filled();
        let gathered = RGBColor(70, 120, 200).filled();
        let on_device = RGBColor(60, 160, 90).filled();
        let computing = RGBColor(30, 30, 30).filled();
        let recomputing = RGBColor(150, 60, 190).filled();
        for (area, p) in root.split_evenly((self.0.len(), 1)).iter().zip(self.0) {
            let units = p.header.units.len();
            let (start, end) = span_of(p);
            // Room on the right for the legend, clear of the rows.
            let room = end + (end - start) * 0.22;
            let names = p.header.units.clone();
            let mut chart = ChartBuilder::on(area)
                .caption(format!("rank {}: where each unit's parameters are", p.header.rank), ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(150)
                .build_cartesian_2d(start..room, -0.5..units as f64 - 0.5)
                .map_err(drawing)?;
            chart
                .configure_mesh()
                .x_desc("seconds")
                .y_labels(units + 1)
                .y_label_formatter(&|&y| row_label(&names, y, true))
                .disable_y_mesh()
                .draw()
                .map_err(drawing)?;
            // Row `u` is centred on `units - 1 - u`: unit 0 uppermost, as the schedule runs them.
            let row = |u: usize, inset: f64| (units - 1 - u) as f64 - 0.5 + inset;
            let homes = (0..units).map(|u| {
                let style = if host_homed(p, u) { home_host } else { home_device };
                Rectangle::new([(start, row(u, 0.1)), (end, row(u, 0.9))], style)
            });
            chart.draw_series(homes).map_err(drawing)?;
            let away = residency(p).into_iter().map(|s| {
                let style = if s.residency == Residency::Gathered { gathered } else { on_device };
                Rectangle::new([(s.start, row(s.unit, 0.1)), (s.end, row(s.unit, 0.9))], style)
            });
            chart.draw_series(away).map_err(drawing)?;
            // Recomputed forwards go last, over their backward's mark, in their own colour.
            let mut spans = p.spans();
            spans.sort_by_key(|s| matches!(s.kind, SpanKind::Recompute(_)));
            let compute = spans.into_iter().filter_map(|s| match s.kind {
                SpanKind::Forward(u) | SpanKind::Backward(u) => {
                    Some(Rectangle::new([(s.start, row(u, 0.4)), (s.end, row(u, 0.6))], computing))
                }
                SpanKind::Recompute(u) => {
                    Some(Rectangle::new([(s.start, row(u, 0.4)), (s.end, row(u, 0.6))], recomputing))
                }
                SpanKind::Update => None,
            });
            chart.draw_series(compute).map_err(drawing)?;
            legend_boxes(
                &mut chart,
                &[
                    (home_device, "home on the device"),
                    (home_host, "home on the host"),
                    (gathered, "gathered whole"),
                    (on_device, "copied to the device"),
                    (computing, "forward / backward"),
                    (recomputing, "forward recomputed"),
                ],
            )?;
            draw_legend(&mut chart)?;
        }
        Ok(())
    }
}

/// One panel of [`UnitBars`]: two values per unit, stacked.
struct StackedBars {
    title: &'static str,
    unit: &'static str,
    layers: [(RGBColor, &'static str); 2],
    values: Vec<(f64, f64)>,
}

impl Picture for UnitBars<'_> {
    fn size(&self) -> (u32, u32) {
        (1280, 760)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(drawing)?;
        let costs = unit_costs(self.0);
        let names: Vec<String> = costs.iter().map(|c| c.name.clone()).collect();
        let panels = root.split_evenly((2, 1));
        let pairs = [
            StackedBars {
                title: "time per unit (whole profile, mean over the ranks running it)",
                unit: "ms",
                layers: [(RGBColor(70, 120, 200), "forward"), (RGBColor(230, 140, 60), "backward")],
                values: costs.iter().map(|c| (c.forward_s * 1e3, c.backward_s * 1e3)).collect(),
            },
            StackedBars {
                title: "memory per unit",
                unit: "MiB",
                layers: [
                    (RGBColor(60, 160, 90), "parameters"),
                    (RGBColor(160, 80, 160), "activations kept for backward"),
                ],
                values: costs.iter().map(|c| (c.param_bytes as f64 / MB, c.activation_bytes as f64 / MB)).collect(),
            },
        ];
        for (area, StackedBars { title, unit, layers: colours, values }) in panels.iter().zip(pairs) {
            let top = values.iter().map(|(a, b)| a + b).fold(0.0, f64::max).max(1e-9) * 1.15;
            let n = values.len().max(1);
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(70)
                .y_label_area_size(70)
                .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top)
                .map_err(drawing)?;
            // Few units: names across; many: names down, so they do not collide.
            let style = if n <= 12 {
                ("sans-serif", 12).into_font()
            } else {
                ("sans-serif", 11).into_font().transform(FontTransform::Rotate90)
            };
            chart
                .configure_mesh()
                .y_desc(unit)
                .x_labels(n + 1)
                .x_label_formatter(&|&x| row_label(&names, x, false))
                .x_label_style(style)
                .disable_x_mesh()
                .draw()
                .map_err(drawing)?;
            // Stacked: the first value at the bottom, the second on top of it.
            for (layer, (colour, label)) in colours.into_iter().enumerate() {
                let bars = values.iter().enumerate().map(|(i, &(a, b))| {
                    let (low, high) = if layer == 0 { (0.0, a) } else { (a, a + b) };
                    Rectangle::new([(i as f64 - 0.35, low), (i as f64 + 0.35, high)], colour.filled())
                });
                chart
                    .draw_series(bars)
                    .map_err(drawing)?
                    .label(label)
                    .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], colour.filled()));
            }
            draw_legend(&mut chart)?;
        }
        Ok(())
    }
}

/// A pipeline's schedule as it ran: a row per rank on one clock, each forward and backward
/// a box of its kind's colour with its micro-batch, sends and receives thin below, and the
/// time a rank computed nothing shaded red: the bubble.
pub struct PipelineTimeline<'a>(pub &'a [Profile]);

fn op_colour(op: &str) -> RGBColor {
    match op {
        "forward" => RGBColor(70, 120, 200),
        "backward" => RGBColor(230, 140, 60),
        "backward_input" => RGBColor(200, 100, 40),
        "backward_weight" => RGBColor(60, 160, 90),
        _ => RGBColor(120, 120, 120),
    }
}

impl Picture for PipelineTimeline<'_> {
    fn size(&self) -> (u32, u32) {
        (1400, 140 + 70 * self.0.len().max(1) as u32)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(drawing)?;
        let ranks = self.0.len();
        let offsets = super::clock_offsets(self.0);
        let ops: Vec<Vec<super::Operation>> = self.0.iter().map(Profile::operations).collect();
        let start = ops
            .iter()
            .zip(&offsets)
            .flat_map(|(o, off)| o.iter().map(move |x| x.start + off))
            .fold(f64::INFINITY, f64::min);
        let end = ops
            .iter()
            .zip(&offsets)
            .flat_map(|(o, off)| o.iter().map(move |x| x.end + off))
            .fold(f64::NEG_INFINITY, f64::max);
        let (start, end) = if start < end { (start, end) } else { (0.0, 1.0) };
        // Room on the right for the legend, clear of the rows.
        let room = end + (end - start) * 0.2;
        let bubbles: Vec<String> =
            self.0.iter().map(|p| p.bubble().map_or("-".into(), |b| format!("{:.0}%", b * 100.0))).collect();
        let mut chart = ChartBuilder::on(root)
            .caption(format!("pipeline schedule per rank (bubble: {})", bubbles.join(", ")), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(start..room, -0.5..ranks as f64 - 0.5)
            .map_err(drawing)?;
        let names: Vec<String> = self.0.iter().map(|p| format!("rank {}", p.header.rank)).collect();
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_labels(ranks + 1)
            .y_label_formatter(&|&y| row_label(&names, y, true))
            .disable_y_mesh()
            .draw()
            .map_err(drawing)?;
        let row = |rank: usize, inset: f64| (ranks - 1 - rank) as f64 - 0.5 + inset;
        let bubble = RGBColor(235, 90, 90).mix(0.30).filled();
        for (rank, (p, off)) in self.0.iter().zip(&offsets).enumerate() {
            // Each step's stretch shaded, the operations drawn over it: what stays red is
            // the bubble (the update between steps is not part of it).
            let stretches = p.operation_steps().into_iter().filter_map(|ops| {
                let (first, last) = super::Operation::extent(&ops)?;
                Some(Rectangle::new([(first + off, row(rank, 0.1)), (last + off, row(rank, 0.9))], bubble))
            });
            chart.draw_series(stretches).map_err(drawing)?;
            let rank_ops = &ops[rank];
            let boxes = rank_ops.iter().map(|o| {
                let (low, high) = if o.computes() { (0.1, 0.9) } else { (0.1, 0.22) };
                let colour = op_colour(&o.op).filled();
                Rectangle::new([(o.start + off, row(rank, low)), (o.end + off, row(rank, high))], colour)
            });
            chart.draw_series(boxes).map_err(drawing)?;
            // The micro-batch of each box wide enough to hold its number.
            let wide = (end - start) / 60.0;
            let labels = rank_ops.iter().filter(|o| o.computes() && o.end - o.start > wide).map(|o| {
                Text::new(
                    o.micro.to_string(),
                    ((o.start + o.end) / 2.0 + off, row(rank, 0.62)),
                    ("sans-serif", 13).into_font().color(&WHITE),
                )
            });
            chart.draw_series(labels).map_err(drawing)?;
        }
        legend_boxes(
            &mut chart,
            &[
                (op_colour("forward").filled(), "forward"),
                (op_colour("backward").filled(), "backward"),
                (op_colour("backward_input").filled(), "input gradient"),
                (op_colour("backward_weight").filled(), "weight gradient"),
                (op_colour("send").filled(), "send / receive"),
                (bubble, "bubble (computing nothing)"),
            ],
        )?;
        draw_legend(&mut chart)?;
        Ok(())
    }
}

/// Draws a profile's pictures into `dir` as `memory`, `units`, `unit_bars` and, where a
/// pipeline ran, `pipeline`, with the given format's extension; returns their paths.
pub fn profile_pictures(profiles: &[Profile], dir: &Path, format: ImageFormat) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = |name: &str| dir.join(format!("{name}.{}", format.extension()));
    let mut paths = vec![path("memory"), path("units"), path("unit_bars")];
    render(&MemoryOverTime(profiles), &paths[0])?;
    render(&UnitMap(profiles), &paths[1])?;
    render(&UnitBars(profiles), &paths[2])?;
    if profiles.iter().any(|p| p.bubble().is_some()) {
        paths.push(path("pipeline"));
        render(&PipelineTimeline(profiles), &paths[3])?;
    }
    Ok(paths)
}

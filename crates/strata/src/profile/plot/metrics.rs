//! Training metrics over steps (the JSON lines `strata train --metrics` writes), several
//! runs overlaid: loss (validation loss as points), learning rate, tokens/s and memory.
//!
//! Owns reading such files back, validated, and their pictures. Must not write metrics or
//! decide their fields: `strata train` writes them, and fields not drawn here are ignored.
use super::{draw_legend, drawing, legend_line, DrawResult, Picture, MB};
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Deserialize;
use std::path::Path;

/// The figures of one step drawn here; a metrics line carries more, which is ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct StepPoint {
    /// The step's number, counted from 1.
    pub step: u64,
    /// Loss per supervised token of the step's global batch.
    pub loss: f64,
    /// The learning rate of the step.
    pub lr: f64,
    /// Tokens per second over all data ranks.
    pub tokens_per_s: f64,
    /// The ledger's peak over all placements.
    pub peak_bytes: u64,
    /// Peak bytes libtorch's allocator held during the step, where tracked.
    #[serde(default)]
    pub allocator_peak_bytes: Option<u64>,
    /// Validation loss, after steps where a validation ran.
    #[serde(default)]
    pub val_loss: Option<f64>,
}

/// Reads a metrics file, refusing in one line (file and line) an empty file, a line that is
/// not a step's metrics, or steps that do not increase.
pub fn read(path: &Path) -> Result<Vec<StepPoint>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut points: Vec<StepPoint> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let point: StepPoint = serde_json::from_str(line)
            .map_err(|e| Error::Data(format!("{}:{}: not a step's metrics: {e}", path.display(), i + 1)))?;
        if points.last().is_some_and(|last| point.step <= last.step) {
            return Err(Error::Data(format!(
                "{}:{}: step {} after step {}",
                path.display(),
                i + 1,
                point.step,
                points[points.len() - 1].step
            )));
        }
        points.push(point);
    }
    if points.is_empty() {
        return Err(Error::Data(format!("{}: no steps recorded", path.display())));
    }
    Ok(points)
}

/// Runs (a name and its steps) drawn together.
pub struct MetricsPlot<'a>(pub &'a [(String, Vec<StepPoint>)]);

const RUN_COLOURS: [RGBColor; 6] = [
    RGBColor(31, 90, 170),
    RGBColor(220, 90, 30),
    RGBColor(40, 150, 70),
    RGBColor(170, 40, 150),
    RGBColor(120, 120, 120),
    RGBColor(190, 160, 20),
];

type Panel = (&'static str, &'static str, fn(&StepPoint) -> Option<f64>);

const PANELS: [Panel; 4] = [
    ("loss", "loss", |p| Some(p.loss)),
    ("learning rate", "lr", |p| Some(p.lr)),
    ("tokens per second", "tokens/s", |p| Some(p.tokens_per_s)),
    ("peak memory (ledger; allocator dashed)", "MiB", |p| Some(p.peak_bytes as f64 / MB)),
];

impl Picture for MetricsPlot<'_> {
    fn size(&self) -> (u32, u32) {
        (1280, 860)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult {
        root.fill(&WHITE).map_err(drawing)?;
        let last_step = self.0.iter().flat_map(|(_, s)| s.last()).map(|p| p.step).max().unwrap_or(1);
        let first_step = self.0.iter().flat_map(|(_, s)| s.first()).map(|p| p.step).min().unwrap_or(0);
        let x_range = first_step as f64..(last_step.max(first_step + 1)) as f64;
        for (area, (title, unit, value)) in root.split_evenly((2, 2)).iter().zip(PANELS) {
            let allocator = |p: &StepPoint| p.allocator_peak_bytes.map(|b| b as f64 / MB);
            let memory = unit == "MiB";
            let values = self.0.iter().flat_map(|(_, steps)| steps.iter()).flat_map(|p| {
                let extra = if memory { allocator(p) } else { None };
                value(p).into_iter().chain(p.val_loss.filter(|_| unit == "loss")).chain(extra)
            });
            let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
            let (low, high) = if low.is_finite() { (low, high) } else { (0.0, 1.0) };
            let pad = ((high - low) * 0.08).max(high.abs() * 1e-3).max(1e-12);
            let low = if unit == "loss" { low - pad } else { (low - pad).max(0.0).min(low) };
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(80)
                .build_cartesian_2d(x_range.clone(), low..high + pad)
                .map_err(drawing)?;
            chart
                .configure_mesh()
                .x_desc("step")
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_desc(unit)
                .draw()
                .map_err(drawing)?;
            for (i, (name, steps)) in self.0.iter().enumerate() {
                let colour = RUN_COLOURS[i % RUN_COLOURS.len()];
                let points = steps.iter().filter_map(|p| value(p).map(|v| (p.step as f64, v))).collect();
                legend_line(&mut chart, points, colour, name)?;
                if unit == "loss" {
                    let val = steps.iter().filter_map(|p| p.val_loss.map(|v| (p.step as f64, v)));
                    chart.draw_series(val.map(|xy| Circle::new(xy, 4, colour.filled()))).map_err(drawing)?;
                }
                if memory {
                    let points: Vec<(f64, f64)> =
                        steps.iter().filter_map(|p| allocator(p).map(|v| (p.step as f64, v))).collect();
                    chart.draw_series(DashedLineSeries::new(points, 6, 4, colour.stroke_width(2))).map_err(drawing)?;
                }
            }
            draw_legend(&mut chart)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_files_are_read_and_refused_in_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let line = |step: u64| {
            format!(
                "{{\"step\":{step},\"loss\":2.5,\"lr\":0.001,\"tokens_per_s\":900.0,\"peak_bytes\":1000,\"skipped\":false}}\n"
            )
        };
        std::fs::write(&path, line(1) + &line(2)).unwrap();
        let points = read(&path).unwrap();
        assert_eq!(points.iter().map(|p| p.step).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(points[0].val_loss, None);
        std::fs::write(&path, line(2) + &line(2)).unwrap();
        assert!(read(&path).unwrap_err().to_string().contains(":2: step 2 after step 2"));
        std::fs::write(&path, line(1) + "{\"step\":2,\"lo").unwrap();
        assert!(read(&path).unwrap_err().to_string().contains(":2: not a step's metrics"));
        std::fs::write(&path, "").unwrap();
        assert!(read(&path).unwrap_err().to_string().contains("no steps"));
    }
}

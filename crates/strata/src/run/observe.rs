//! What rank 0 reports of each step: the metrics file (a JSON line per step), TensorBoard
//! scalars of the same fields, the progress bar and the log's progress lines.
use super::tensorboard::EventWriter;
use super::RunConfig;
use crate::profile::human_bytes;
use crate::train::StepReport;
use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufWriter, Write};
use std::path::Path;

/// The metrics file, one JSON line per step, opened for the steps after `start`: a new
/// run starts it afresh; a resumed one keeps the lines of the steps up to its checkpoint
/// (rewritten atomically, without the lines of steps that run again) and appends after them.
fn open_metrics(path: &Path, start: u64) -> Result<BufWriter<std::fs::File>> {
    if start > 0 && path.exists() {
        let old = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let done = |line: &&str| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= start)
        };
        let kept: String = old.lines().filter(done).flat_map(|l| [l, "\n"]).collect();
        crate::io::write_atomic(path, kept.as_bytes())?;
    }
    let mut options = std::fs::OpenOptions::new();
    match start {
        0 => options.write(true).create(true).truncate(true),
        _ => options.append(true).create(true),
    };
    Ok(BufWriter::new(options.open(path).map_err(|e| Error::io(path, e))?))
}

/// A report's scalar fields under their metrics-file names: TensorBoard's series are the
/// metrics file's.
fn scalars(report: &serde_json::Value) -> Vec<(String, f64)> {
    let Some(fields) = report.as_object() else { return vec![] };
    fields
        .iter()
        .filter(|(name, _)| *name != "step")
        .filter_map(|(name, v)| Some((name.clone(), v.as_f64()?)))
        .collect()
}

pub(super) struct Observers {
    /// Only rank 0 writes and draws.
    leader: bool,
    log_every: u64,
    metrics: Option<(std::path::PathBuf, BufWriter<std::fs::File>)>,
    tensorboard: Option<EventWriter>,
    bar: ProgressBar,
    last_step: u64,
}

impl Observers {
    /// Opens the outputs of a run whose next step is `start + 1`.
    pub fn open(config: &RunConfig, leader: bool, start: u64) -> Result<Observers> {
        let metrics = match config.outputs.metrics.as_ref().filter(|_| leader) {
            Some(path) => Some((path.clone(), open_metrics(path, start)?)),
            None => None,
        };
        let tensorboard = match config.outputs.tensorboard.as_ref().filter(|_| leader) {
            Some(dir) => Some(EventWriter::create(dir, start + 1)?),
            None => None,
        };
        let bar = match leader && config.progress {
            true => ProgressBar::new(config.steps),
            false => ProgressBar::hidden(),
        };
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(start);
        Ok(Observers { leader, log_every: config.log_every.max(1), metrics, tensorboard, bar, last_step: start })
    }

    pub fn step(&mut self, report: &StepReport) -> Result<()> {
        self.last_step = report.step;
        if !self.leader {
            return Ok(());
        }
        let value = serde_json::to_value(report).map_err(|e| Error::Engine(format!("a step report: {e}")))?;
        if let Some((path, m)) = self.metrics.as_mut() {
            // A line per step reaches the file even if the run dies later.
            let line = format!("{value}\n");
            m.write_all(line.as_bytes()).and_then(|()| m.flush()).map_err(|e| Error::io(path.as_path(), e))?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.scalars(report.step, &scalars(&value))?;
        }
        self.bar.set_message(format!(
            "loss {:.4}{} | {:.0} tok/s | {}",
            report.loss,
            report.val_loss.map_or(String::new(), |v| format!(" val {v:.4}")),
            report.tokens_per_s,
            human_bytes(report.peak_bytes)
        ));
        self.bar.inc(1);
        if report.step.is_multiple_of(self.log_every) {
            self.bar.suspend(|| {
                tracing::info!(
                    step = report.step,
                    loss = report.loss,
                    val_loss = report.val_loss,
                    lr = report.lr,
                    tokens_per_s = report.tokens_per_s as u64,
                    "progress"
                )
            });
        }
        Ok(())
    }

    /// Runs `f` with the bar out of the way of what it logs.
    pub fn suspend<T>(&self, f: impl FnOnce() -> T) -> T {
        self.bar.suspend(f)
    }

    pub fn finish(&mut self) -> Result<()> {
        self.bar.finish_and_clear();
        if let Some((path, m)) = self.metrics.as_mut() {
            m.flush().map_err(|e| Error::io(path.as_path(), e))?;
        }
        Ok(())
    }

    /// Draws the profile recorded in `dir` (every rank's file) and attaches the pictures to
    /// the TensorBoard log as images of the last step. Without a font for the labels the
    /// pictures are left out with a warning: they are not worth failing a finished run.
    pub fn attach_profile(&mut self, dir: &Path) -> Result<()> {
        let Some(tb) = self.tensorboard.as_mut() else { return Ok(()) };
        let profiles = crate::profile::read_dir(dir)?;
        let pictures =
            match crate::profile::plot::profile_pictures(&profiles, dir, crate::profile::plot::ImageFormat::Png) {
                Ok(paths) => paths,
                Err(e) => {
                    tracing::warn!(error = %e, "the profile's pictures are not in the TensorBoard log");
                    return Ok(());
                }
            };
        for path in pictures {
            let png = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("picture");
            tb.png(self.last_step, &format!("profile/{name}"), png)?;
        }
        Ok(())
    }
}
